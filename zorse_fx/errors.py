"""The exception policy of zorse_fx.

- ``ValueError`` subclasses: something the *user* got wrong (a cluster file, a
  plan file, a model zorse_fx cannot capture). Messages name the file, the
  field, the value and what would fix it.
- ``RuntimeError`` subclasses: the planner or the runtime could not do its job
  with valid input (no feasible plan, a rank failed). Messages name the binding
  constraint with numbers.
- ``assert`` is used only for internal invariants.
"""

from __future__ import annotations

__all__ = [
    "ZorseError",
    "ClusterConfigError",
    "PlanFileError",
    "PlanOptionsError",
    "ModelCaptureError",
    "InfeasiblePlanError",
    "RuntimeExecutionError",
    "DataError",
]


class ZorseError(Exception):
    """Base class of every error zorse_fx raises on purpose."""


class ClusterConfigError(ZorseError, ValueError):
    """A cluster description (YAML file or dict) is invalid."""


class PlanFileError(ZorseError, ValueError):
    """A plan file (plan.json) is malformed or of an unsupported version."""


class PlanOptionsError(ZorseError, ValueError):
    """A planner option (``PlanOptions``, a ``zorse.compile`` keyword, a
    ``zorse plan`` flag) is invalid or does not fit the cluster (bf16-mixed
    asked for on a GPU without bfloat16)."""


class ModelCaptureError(ZorseError, ValueError):
    """The model cannot be captured or cut into pipeline stages."""


class InfeasiblePlanError(ZorseError, RuntimeError):
    """No plan satisfies the constraints (memory, batch divisibility, ...).

    The message names the binding constraint with numbers, e.g.
    ``stage 0 needs 21.3 GiB on T4 (16.0 GiB)``.
    """


class RuntimeExecutionError(ZorseError, RuntimeError):
    """A rank could not execute its part of a plan."""


class DataError(ZorseError, ValueError):
    """A token file, its header, a corpus or a tokenizer is unusable (wrong
    dtype or shape, ids outside the vocabulary, a header that does not match
    its file, a corpus smaller than one global batch). The message names the
    file, the field, the value and the fix."""
