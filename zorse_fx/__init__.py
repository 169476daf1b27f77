"""zorse_fx: compile PyTorch transformer training onto heterogeneous GPU clusters.

Public surface: :func:`compile`, :class:`Cluster`, :class:`Plan`, and the
errors in :mod:`zorse_fx.errors`.
"""

from .api import CompiledModel, compile
from .cluster import Cluster
from .errors import (
    ClusterConfigError,
    InfeasiblePlanError,
    ModelCaptureError,
    PlanFileError,
    RuntimeExecutionError,
    ZorseError,
)
from .plan import Plan

__version__ = "0.1.0"

__all__ = [
    "compile",
    "CompiledModel",
    "Cluster",
    "Plan",
    "ZorseError",
    "ClusterConfigError",
    "PlanFileError",
    "ModelCaptureError",
    "InfeasiblePlanError",
    "RuntimeExecutionError",
]
