"""A planner's answer before it becomes a ``Plan``: the decision, its
predictions and how the planner got it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .decision import Decision
from .memory import StageMemory

if TYPE_CHECKING:
    from ..options import PlanOptions

__all__ = ["SolverResult", "Candidate", "SAFETY_STOP", "with_safety_stop"]

#: Appended to a result's status when the wall-clock safety stop cut a CP-SAT
#: solve short ([Note: reproducible plans] in ``solve/_search.py``).
SAFETY_STOP = " (wall-clock safety stop)"


def with_safety_stop(status: str, wall_clock_stops: int) -> str:
    """``status`` without ``SAFETY_STOP``, then with it again at the end when
    ``wall_clock_stops`` > 0 (so "+INTERLEAVED" and the portfolio's names go before it)."""
    base = status.replace(SAFETY_STOP, "")
    return base + SAFETY_STOP if wall_clock_stops else base


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """One thing a planner tried and how it came out; plan.json's
    ``solver.candidates`` lists them (``to_dict``).

    ``kind``:

    * ``"solve"``: one (S stages, M micro-batches) CP-SAT model (per GPU, or
      over ``num_groups`` GPU classes), with its ``status`` (OPTIMAL,
      FEASIBLE, INFEASIBLE, UNKNOWN, CRASHED; PRUNED: not solved, its lower
      bound ``bounds.stage_count_lower_bound`` above a plan already found),
      step time and lower bound (seconds; None where it found none), the
      heuristic ``hint`` that warm-started it and what the solve cost;
    * ``"brute_force"``: one (S, M) of the exhaustive oracle;
    * ``"heuristic"``: a baseline's (``method``) or the stage DP's best plan
      for one (S, M), ``feasible`` or with its ``violations``, ``chosen`` on
      the one the method returned, and its memory policy per stage;
    * ``"interleave"``: one (interleave degree, M, recompute everywhere?) the
      interleave pass scored;
    * ``"portfolio"``: one heuristic (``source``) the portfolio ran before
      CP-SAT, its step time and feasibility;
    * ``"rerank"``: one plan the simulator re-ranked (``source``: its status,
      its stages, micro-batches and interleave degree), its objective and
      simulated step time, ``chosen`` on the one returned
      ([Note: simulator re-rank] in portfolio.py);
    * ``"polish"``: the final local search ([Note: the final polish] in
      solve/polish.py): ``source`` the status of the plan it started from,
      ``best_bound_s`` that plan's step, ``step_time_s`` the better plan it
      found (None: none), ``evaluations`` the objective evaluations spent.
    """

    kind: str
    num_stages: int | None = None
    num_microbatches: int | None = None
    status: str | None = None
    #: Seconds; None: no plan for this candidate.
    step_time_s: float | None = None
    best_bound_s: float | None = None
    wall_s: float = 0.0
    #: "solve": GPU classes of a class-level model (None: one per GPU).
    num_groups: int | None = None
    #: "solve": the status of the heuristic plan that warm-started it, and
    #: whether CP-SAT completed that hint to a solution.
    hint: str | None = None
    hint_completed: bool | None = None
    presolve_retry: bool = False
    #: "solve": re-solved in the search's second round with the budget left over
    #: ([Note: candidate waves] in solve/_search.py); budget and wall time are both rounds'.
    second_round: bool = False
    crashes: int = 0
    #: "solve": CP-SAT deterministic seconds used.
    solver_budget_used: float | None = None
    wall_clock_stop: bool = False
    #: "heuristic"
    method: str | None = None
    feasible: bool | None = None
    violations: tuple[str, ...] = ()
    chosen: bool = False
    #: "heuristic": each stage's memory policy (``ir/memory.py``); plan.json writes its ZeRO-1-or-more and
    #: recomputation as ``stage_sharded`` / ``stage_recompute``.
    stage_memory: tuple[StageMemory, ...] = ()
    state_shard_bytes: tuple[tuple[int, ...], ...] = ()
    #: "interleave"
    interleave: int | None = None
    recompute_all: bool | None = None
    #: "portfolio", "rerank"
    source: str | None = None
    #: "rerank": seconds (inf: the simulator refused the plan).
    simulated_step_time_s: float | None = None
    #: "polish": objective evaluations spent.
    evaluations: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in CANDIDATE_KINDS:
            raise ValueError(f"Candidate.kind={self.kind!r}: use one of {', '.join(map(repr, CANDIDATE_KINDS))}")

    def to_dict(self) -> dict:
        """The JSON record plan.json writes for this candidate (its kind's keys)."""
        if self.kind == "interleave":
            return {"interleave_search": {"interleave": self.interleave, "num_microbatches": self.num_microbatches,
                                          "recompute_all": self.recompute_all, "step_time_s": self.step_time_s,
                                          "feasible": self.feasible}}
        if self.kind == "rerank":
            return {"rerank": {"source": self.source, "num_stages": self.num_stages,
                               "num_microbatches": self.num_microbatches, "interleave": self.interleave,
                               "step_time_s": self.step_time_s, "simulated_step_time_s": self.simulated_step_time_s,
                               "chosen": self.chosen}}
        if self.kind == "polish":
            return {"polish": {"source": self.source, "from_step_time_s": self.best_bound_s,
                               "step_time_s": self.step_time_s, "evaluations": self.evaluations}}
        if self.kind == "portfolio":
            return {"portfolio": {"source": self.source, "step_time_s": self.step_time_s, "feasible": self.feasible}}
        out = {"num_stages": self.num_stages, "num_microbatches": self.num_microbatches}
        if self.kind == "heuristic":
            return {**out, "method": self.method, "status": self.status, "step_time_s": self.step_time_s,
                    "feasible": self.feasible, "violations": list(self.violations), "chosen": self.chosen,
                    "stage_sharded": [m.zero >= 1 for m in self.stage_memory],
                    "state_shard_bytes": [list(row) for row in self.state_shard_bytes],
                    "stage_recompute": [m.recompute for m in self.stage_memory]}
        if self.kind == "brute_force":
            return {**out, "status": self.status, "step_time_s": self.step_time_s, "wall_s": self.wall_s}
        out.update(status=self.status, step_time_s=self.step_time_s, best_bound_s=self.best_bound_s,
                   wall_s=self.wall_s)
        if self.num_groups is not None:
            out["num_groups"] = self.num_groups
        if self.hint is not None:
            out["hint"] = self.hint
            out["hint_completed"] = self.hint_completed
        if self.presolve_retry:
            out["presolve_retry"] = True
        if self.second_round:
            out["second_round"] = True
        if self.crashes:
            out["crashes"] = self.crashes
        if self.solver_budget_used is not None:
            out["solver_budget_used"] = self.solver_budget_used
        if self.wall_clock_stop:
            out["wall_clock_stop"] = True
        return out


#: ``Candidate.kind`` values.
CANDIDATE_KINDS = ("solve", "brute_force", "heuristic", "interleave", "portfolio", "rerank", "polish")


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
    #: Per stage, per GPU: predicted host memory of its offloads, bytes ([C-offload], [C-act-offload];
    #: interleaved: of the GPU's group, as ``predicted_memory_bytes``); () = none recorded.
    predicted_host_memory_bytes: tuple[tuple[int, ...], ...] = ()
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
    #: Everything the planner tried and its result, in the order it was tried.
    candidates: tuple[Candidate, ...] = field(default_factory=tuple)
    #: Where ``decision`` leaves GPUs idle: the fastest plan (by ``predicted_step_time_s``) among the feasible
    #: ones the planner scored that gives every GPU work; None: ``decision`` uses every GPU, or the planner
    #: scored no such plan (the portfolio sets it: [Note: idle GPUs said aloud] in ``zorse_fx/idle.py``).
    all_gpus: "SolverResult | None" = None

    def __post_init__(self) -> None:
        if not isinstance(self.decision, Decision) or self.decision.shard_mib is None:
            raise ValueError(f"SolverResult.decision must be a Decision with its shards chosen (shard_mib set), "
                             f"got {self.decision!r}: build the result with SolverResult.from_evaluation")

    @classmethod
    def from_evaluation(cls, ev, *, options: "PlanOptions", status: str, best_bound: float, wall_s: float = 0.0,
                        candidates: tuple[Candidate, ...] = ()) -> "SolverResult":
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
            predicted_host_memory_bytes=ev.host_memory_bytes, status=status, objective=obj, best_bound=best_bound,
            optimality_gap=(obj - best_bound) / obj if obj > 0 else 0.0, wall_s=wall_s, candidates=candidates)

    @property
    def num_stages(self) -> int:
        return self.decision.num_stages
