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
from ._search import CandidateSearch, ordered_candidates
from .model import CandidateModel, singleton_groups

__all__ = ["solve_cpsat"]


def solve_cpsat(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions, *, hints=(),
                incumbent: SolverResult | None = None, progress=None) -> SolverResult:
    """Plan with CP-SAT: minimise the predicted step time (seconds) over (S, M).

    ``objective`` / ``best_bound`` are in seconds. ``status`` is "OPTIMAL" only
    when every candidate was solved to optimality (or proven infeasible) and
    ``best_bound`` is the smallest bound over all candidates, so the gap
    covers the whole (S, M) search. ``hints``: decisions (SolverResults, e.g.
    the baselines') to warm-start the candidate with the same S and M;
    ``incumbent``: a feasible plan every candidate must beat, returned when none
    does ([Note: incumbent cutoff] in _search.py); ``progress``: called with a line
    per candidate. Candidates are tried in order of their lower bound. Raises InfeasiblePlanError if nothing fits.
    """
    cands = ordered_candidates(costs, devices, options, hints)
    search = CandidateSearch(costs, devices, options, label="CP-SAT", incumbent=incumbent, progress=progress,
                             total=len(cands))
    groups = singleton_groups(devices.num_gpus)
    search.run(cands, lambda n_s, tab: CandidateModel(tab, devices, options, groups, n_s), hints=hints)
    return search.result()
