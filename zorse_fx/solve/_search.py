"""The (stages, micro-batches) candidate loop shared by the CP-SAT planners.

Each candidate is one CP-SAT model (any object with ``.m``, ``.objective`` and
``.decision(solver)``). Every answer is re-checked with ``evaluate``: the
model's objective at the returned solution must equal the evaluator's integer
objective (ns). ``status`` is "OPTIMAL" only when every candidate was solved to
optimality or proven infeasible; ``best_bound`` is the smallest bound over all
candidates, so the reported gap covers the whole search. A candidate's bound
is the larger of CP-SAT's and ``bounds.throughput_lower_bound`` (valid for
every decision with its M; before it, a time-limited UNKNOWN candidate
reported 0 and pinned every gap at 100%).

[Note: presolve bug]
OR-Tools 9.15.6755 (the newest release on PyPI) has a presolve bug that
declares some feasible models INFEASIBLE (google/or-tools#5274: "INFEASIBLE
with presolve enabled but OPTIMAL with presolve disabled", fixed after the
release). It hit us on Zorse B: the class-level model of (7 stages, 64
micro-batches) was "INFEASIBLE" in 0.2 s although the stage DP's plan for it
satisfies every constraint (checked by solving with that plan fixed through
assumptions). Turning off presolve's inclusion step
(``presolve_inclusion_work_limit = 0``) gives the right answer there, but the
same setting crashes OR-Tools 9.15 now and then (``std::out_of_range:
absl::btree_map::at``, an abort of the whole process: once within the first
~75 ``solve_cpsat`` runs on the tests' random instances, where the default
setting ran 510 clean; seen twice in ~12 full test runs), so it is not used. Instead: a candidate whose warm start
(``hint``, a feasible plan) is declared infeasible cannot be infeasible, and
is solved again with presolve off (recorded as ``"presolve_retry": True`` in
its entry); ``complete_hint`` does the same for its copy. A candidate without
a hint that presolve wrongly declares infeasible is still lost (and may let
the search report OPTIMAL): the portfolio hints every (stages, micro-batches)
the stage DP reaches, which narrows this to the candidates no heuristic fits.
Also open upstream: OR-Tools 9.15 can abort the process (uncaught
``std::out_of_range: absl::btree_map::at`` in SolutionCrush, presolve with a
complete hint, google/or-tools#5288, fixed on main). Seen once in a scenario
benchmark run (FlashFlex, 2026-11-22); a planner that must not die would run
each solve in a forked child and retry without the hint.
"""

from __future__ import annotations

import math
import time

from ortools.sat.python import cp_model

from ..errors import InfeasiblePlanError
from .bounds import explain_infeasible, throughput_lower_bound
from .objective import UNIT_S, evaluate
from .records import BlockCosts, DeviceGraph, SolverOptions, SolverResult

__all__ = ["CandidateSearch"]


def complete_hint(m: cp_model.CpModel, solver: cp_model.CpSolver) -> bool:
    """Extend ``m``'s partial solution hint to every variable, in place.

    The models hint only the decisions (cuts, GPUs per stage, samples, shards,
    policy); every other variable follows from them by equalities. CP-SAT
    treats an incomplete hint as a search preference and can spend the whole
    time limit without reaching it (Zorse B, 7 stages: UNKNOWN after 3 s
    with the stage DP's plan hinted). So the hinted variables are fixed on a
    copy, the copy is solved for a feasible point (propagation does nearly
    all of it), and its values become a complete hint, which CP-SAT checks
    and keeps as its first incumbent. Returns False (hint left as it was)
    when the copy finds nothing, e.g. a hint the model cannot express."""
    proto = m.Proto()
    hinted = list(zip(proto.solution_hint.vars, proto.solution_hint.values))
    if not hinted:
        return False
    fixed = m.Clone()
    fixed.ClearHints()
    fixed.ClearObjective()
    for v, val in hinted:
        fixed.Add(fixed.GetIntVarFromProtoIndex(v) == val)
    solver.parameters.max_time_in_seconds = min(solver.parameters.max_time_in_seconds, HINT_COMPLETION_S)
    code = solver.Solve(fixed)
    if code == cp_model.INFEASIBLE:  # [Note: presolve bug]
        solver.parameters.cp_model_presolve = False
        code = solver.Solve(fixed)
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return False
    m.ClearHints()
    for v in range(len(proto.variables)):
        var = m.GetIntVarFromProtoIndex(v)
        m.AddHint(var, solver.Value(fixed.GetIntVarFromProtoIndex(v)))
    return True


#: Seconds at most to complete a hint (``complete_hint``).
HINT_COMPLETION_S = 2.0


class CandidateSearch:
    """Solve candidates one by one; ``result()`` returns the best as a SolverResult."""

    def __init__(self, costs: BlockCosts, devices: DeviceGraph, options: SolverOptions, *, label: str):
        self.costs, self.devices, self.options, self.label = costs, devices, options, label
        self.t0 = time.perf_counter()
        self.cands: list[dict] = []
        self.bounds: list[int] = []
        self.best = None  # (objective units, microbatches, decision, Evaluation)
        self.all_optimal = True
        self._tlb: dict[int, int] = {}

    def _throughput_bound(self, model, m: int) -> int:
        """``bounds.throughput_lower_bound`` of the candidate's tables (valid for
        every decision with M micro-batches): the bound a candidate reports when
        CP-SAT's own is weaker, e.g. 0 after a time-limited UNKNOWN."""
        if m not in self._tlb:
            self._tlb[m] = throughput_lower_bound(model.tab)
        return self._tlb[m]

    def _solver(self) -> cp_model.CpSolver:
        opts = self.options
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = opts.time_limit_s
        solver.parameters.num_workers = opts.num_workers
        solver.parameters.random_seed = opts.seed
        return solver

    def solve(self, model, num_stages: int, num_microbatches: int, **record) -> None:
        """Solve one candidate model and record it (``record``: extra fields for its entry)."""
        t1 = time.perf_counter()
        opts, m = self.options, num_microbatches
        if record.get("hint"):
            record["hint_completed"] = complete_hint(model.m, self._solver())
        solver = self._solver()
        code = solver.Solve(model.m)
        retried = False
        if code == cp_model.INFEASIBLE and record.get("hint"):  # [Note: presolve bug]
            solver = self._solver()
            solver.parameters.cp_model_presolve = False
            code, retried = solver.Solve(model.m), True
        rec = {"num_stages": num_stages, "num_microbatches": m, "status": solver.StatusName(code),
               "step_time_s": None, "best_bound_s": None, "wall_s": 0.0, **record}
        if retried:
            rec["presolve_retry"] = True
        if code in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            # The objective at the returned solution (OR-Tools 9.15's ObjectiveValue() can
            # differ from it by a few ms on time-limited FEASIBLE answers).
            obj = int(solver.Value(model.objective))
            tlb = self._throughput_bound(model, m)
            if tlb > obj:
                raise AssertionError(f"{self.label}: throughput lower bound {tlb} > objective {obj} "
                                     f"for S={num_stages}, M={m}")
            bound = min(obj, max(int(round(solver.BestObjectiveBound())), tlb))
            dec = model.decision(solver)
            pol = dec[3]
            ev = evaluate(self.costs, self.devices, opts, stage_blocks=dec[0], stage_gpus=dec[1],
                          samples_per_microbatch=dec[2], num_microbatches=m, stage_sharded=pol.sharded,
                          state_shard_mib=pol.shard_mib, stage_recompute=pol.recompute)
            if ev.objective_units != obj or not ev.feasible:
                raise AssertionError(f"{self.label} objective {obj} != evaluate() {ev.objective_units} "
                                     f"(violations {ev.violations}) for S={num_stages}, M={m}: {dec}")
            rec.update(step_time_s=obj * UNIT_S, best_bound_s=bound * UNIT_S)
            self.bounds.append(bound)
            self.all_optimal &= code == cp_model.OPTIMAL
            if self.best is None or obj < self.best[0]:
                self.best = (obj, m, dec, ev)
        elif code == cp_model.MODEL_INVALID:
            raise AssertionError(f"invalid CP-SAT model for S={num_stages}, M={m}: {model.m.Validate()}")
        elif code != cp_model.INFEASIBLE:  # UNKNOWN: time limit without a solution
            self.all_optimal = False
            lb = solver.BestObjectiveBound()
            self.bounds.append(max(int(lb) if math.isfinite(lb) else 0, self._throughput_bound(model, m)))
            rec["best_bound_s"] = self.bounds[-1] * UNIT_S
        rec["wall_s"] = time.perf_counter() - t1
        self.cands.append(rec)

    def result(self) -> SolverResult:
        """The best candidate; raises InfeasiblePlanError naming the binding constraint."""
        if self.best is None:
            raise InfeasiblePlanError(explain_infeasible(self.costs, self.devices, self.options, self.cands))
        obj, m, (blocks, gpus, samples, _), ev = self.best
        assert ev.objective_units == obj
        return SolverResult.from_evaluation(
            ev, stage_blocks=blocks, stage_gpus=gpus, samples_per_microbatch=samples, num_microbatches=m,
            options=self.options, status="OPTIMAL" if self.all_optimal else "FEASIBLE",
            best_bound=min(self.bounds) * UNIT_S, wall_s=time.perf_counter() - self.t0, candidates=tuple(self.cands))
