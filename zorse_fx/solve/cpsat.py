"""The per-GPU OR-Tools CP-SAT planner.

One CP-SAT model per (S stages, M micro-batches); the best feasible plan over
all pairs wins (ties: fewer stages, then fewer micro-batches). The model is
model.py's ``CandidateModel`` (the one model builder, [Note: one model
builder]) with one group per GPU (``singleton_groups``), which restricts
nothing: every GPU takes its own stage and share of the micro-batch. The
builder gives a single-GPU group the small per-GPU encoding (samples per GPU
and block, the redundant per-block sample sum, a symmetry rule that orders
interchangeable GPUs by stage and samples). Its objective, in objective.py's
integer units (1 ns, KiB), equals ``evaluate()`` of the decision for *any*
solution CP-SAT returns, optimal or not; ``solve_cpsat`` checks that on every
answer (``_search.CandidateSearch``). Warm starts: [Note: warm start] in
model.py.
"""

from __future__ import annotations

from ..ir.costs import BlockCosts
from ..ir.devices import DeviceGraph
from ..ir.result import SolverResult
from ..options import PlanOptions
from ._search import CandidateSearch
from .model import CandidateModel, matching_hint, singleton_groups
from .objective import build_tables, max_stage_count, microbatch_candidates

__all__ = ["solve_cpsat"]


def solve_cpsat(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions, *, hints=()) -> SolverResult:
    """Plan with CP-SAT: minimise the predicted step time (seconds) over (S, M).

    ``objective`` / ``best_bound`` are in seconds. ``status`` is "OPTIMAL" only
    when every candidate was solved to optimality (or proven infeasible) and
    ``best_bound`` is the smallest bound over all candidates, so the gap
    covers the whole (S, M) search. ``hints``: decisions (SolverResults, e.g.
    the baselines') to warm-start the candidate with the same S and M.
    Raises InfeasiblePlanError if nothing fits.
    """
    search = CandidateSearch(costs, devices, options, label="CP-SAT")
    groups = singleton_groups(devices.num_gpus)
    for n_s in range(1, max_stage_count(costs, devices, options) + 1):
        for m in microbatch_candidates(options):
            tab = build_tables(costs, devices, options, m)
            if search.pruned(tab, n_s):  # its lower bound is above a plan in hand
                continue
            model = CandidateModel(tab, devices, options, groups, n_s)
            h = matching_hint(hints, n_s, m)
            if h is not None:
                model.hint(h.decision)
            search.solve(model, n_s, m, **({"hint": h.status} if h is not None else {}))
    return search.result()
