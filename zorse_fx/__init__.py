"""zorse_fx: compile PyTorch transformer training onto heterogeneous GPU clusters.

Public surface: :func:`compile`, :class:`Cluster`, :class:`Plan`,
:class:`PlanOptions` (the planner's options, ``compile``'s keywords), and the
errors in :mod:`zorse_fx.errors`.
"""

from .cluster import Cluster
from .errors import (
    ClusterConfigError,
    InfeasiblePlanError,
    ModelCaptureError,
    PlanFileError,
    PlanOptionsError,
    RuntimeExecutionError,
    ZorseError,
)
from .options import PlanOptions
from .plan import Plan

__version__ = "0.1.0"


def __getattr__(name: str):
    # The planner (OR-Tools) loads on first use of ``compile``: ranks started
    # by ``python -m zorse_fx.train`` import this package but never OR-Tools.
    if name in ("compile", "CompiledModel"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'zorse_fx' has no attribute {name!r}")

__all__ = [
    "compile",
    "CompiledModel",
    "Cluster",
    "Plan",
    "PlanOptions",
    "ZorseError",
    "ClusterConfigError",
    "PlanFileError",
    "PlanOptionsError",
    "ModelCaptureError",
    "InfeasiblePlanError",
    "RuntimeExecutionError",
]
