"""A planner's answer before it becomes a ``Plan``: the decision, its
predictions and how the planner got it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .decision import Decision

if TYPE_CHECKING:
    from ..options import PlanOptions

__all__ = ["SolverResult", "SAFETY_STOP", "with_safety_stop"]

#: Appended to a result's status when the wall-clock safety stop cut a CP-SAT
#: solve short ([Note: reproducible plans] in ``solve/_search.py``).
SAFETY_STOP = " (wall-clock safety stop)"


def with_safety_stop(status: str, wall_clock_stops: int) -> str:
    """``status`` without ``SAFETY_STOP``, then with it again at the end when
    ``wall_clock_stops`` > 0 (so "+INTERLEAVED" and the portfolio's names go before it)."""
    base = status.replace(SAFETY_STOP, "")
    return base + SAFETY_STOP if wall_clock_stops else base


@dataclass(frozen=True, slots=True, kw_only=True)
class SolverResult:
    """A planner's answer, before it is turned into a ``Plan``: the decision,
    its predictions and how the planner got it."""

    #: The decision (stages, GPUs, samples, micro-batches, interleaving,
    #: memory policy), each sharded stage's shards chosen (``shard_mib`` set).
    decision: Decision
    #: "1f1b" or "gpipe" (``PlanOptions.schedule``).
    schedule: str
    #: Predicted step time by the planner's objective, seconds.
    predicted_step_time_s: float
    #: Breakdown (seconds): per stage compute, comm, all-reduce, optimizer.
    predicted_stage_time_s: tuple[float, ...] = ()
    predicted_allreduce_s: tuple[float, ...] = ()
    #: Per stage, per GPU (aligned with ``decision.stage_gpus``): predicted peak memory bytes.
    predicted_memory_bytes: tuple[tuple[int, ...], ...] = ()
    #: "OPTIMAL", "FEASIBLE", "BRUTE_FORCE", ... and the gap (0 = proven optimal);
    #: ends in ``SAFETY_STOP`` when ``wall_clock_stops`` > 0.
    status: str = "UNKNOWN"
    objective: float = 0.0
    best_bound: float = 0.0
    optimality_gap: float = 0.0
    wall_s: float = 0.0
    #: CP-SAT solves the wall-clock safety stop (``PlanOptions.time_limit_s``)
    #: cut short before their deterministic budget: when > 0 the decision may
    #: differ on another run or machine, and ``status`` ends in
    #: " (wall-clock safety stop)".
    wall_clock_stops: int = 0
    #: Every (num_stages, num_microbatches) candidate tried and its result.
    candidates: tuple[dict, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not isinstance(self.decision, Decision) or self.decision.shard_mib is None:
            raise ValueError(f"SolverResult.decision must be a Decision with its shards chosen (shard_mib set), "
                             f"got {self.decision!r}: build the result with SolverResult.from_evaluation")

    @classmethod
    def from_evaluation(cls, ev, *, options: "PlanOptions", status: str, best_bound: float, wall_s: float = 0.0,
                        candidates: tuple[dict, ...] = ()) -> "SolverResult":
        """The record of a decision scored by ``objective.evaluate`` (``ev``, an
        ``Evaluation``): the decision as scored (``ev.decision``, shards
        included), predictions from ``ev``, objective = its step time (s),
        gap = (objective - best_bound) / objective (0 when the objective is 0).
        Used by every planner, so the fields stay in step."""
        obj = ev.step_time_s
        return cls(
            decision=ev.decision, schedule=options.schedule,
            predicted_step_time_s=ev.step_time_s, predicted_stage_time_s=ev.stage_time_s,
            predicted_allreduce_s=ev.allreduce_s, predicted_memory_bytes=ev.memory_bytes,
            status=status, objective=obj, best_bound=best_bound,
            optimality_gap=(obj - best_bound) / obj if obj > 0 else 0.0, wall_s=wall_s, candidates=candidates)

    @property
    def num_stages(self) -> int:
        return self.decision.num_stages
