"""The records passed between zorse_fx's phases, and nothing else.

Capture produces ``TensorSpec`` (``tensor``); the cost model ``BlockCosts``
and ``TiedParam`` (``costs``); the cluster a ``DeviceGraph`` with its
``SharedLink`` (``devices``); the planners a ``Decision`` (``decision``),
each stage's memory policy a ``StageMemory`` (``memory``), inside a
``SolverResult`` (``result``). The schedule IR (``schedule``: one
``Action`` list per GPU group), the point-to-point program derived from it
(``p2p``) and the gradient bucket layout (``buckets``) are read alike by the
objective, the simulator and the runtime, which executes them.

Everything here is plain Python: no torch, no OR-Tools, no module of a later
phase (the layers contract in ``pyproject.toml``, ``[tool.importlinter]``,
checked by ``make test``). Each record checks its own shape in
``__post_init__`` and raises ``ValueError`` naming the field and value.
"""

from .buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES, bucket_caps
from .costs import BlockCosts, TiedParam
from .decision import Decision
from .devices import DeviceGraph, SharedLink
from .memory import StageMemory
from .p2p import Message, ProgramError, RankProgram, Route, programs_from, route_messages, routes, simulate_nccl
from .result import SAFETY_STOP, SolverResult, with_safety_stop
from .schedule import SCHEDULES, Action, make_schedule
from .tensor import TensorSpec

__all__ = [
    "BUCKET_BYTES", "FIRST_BUCKET_BYTES", "bucket_caps", "BlockCosts", "TiedParam", "Decision", "StageMemory",
    "DeviceGraph", "SharedLink", "Message", "ProgramError", "RankProgram", "Route", "programs_from",
    "route_messages", "routes", "simulate_nccl", "SAFETY_STOP", "SolverResult", "with_safety_stop", "SCHEDULES",
    "Action", "make_schedule", "TensorSpec",
]
