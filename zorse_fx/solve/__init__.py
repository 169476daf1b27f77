"""Planners: the step-time model (objective.py), CP-SAT (one model builder,
model.py: per-GPU in cpsat.py, over GPU classes / whole nodes in grouped.py for
large clusters), the memory-first stage DP
(stage_dp.py; its scoring shared with the baselines in heuristics.py), lower
bounds and infeasibility explanations (bounds.py) and an exhaustive oracle for
tiny instances (brute_force.py); ``zorse_fx/portfolio.py`` runs the heuristics
first and warm-starts CP-SAT with them. They all take ``PlanOptions``
(``zorse_fx/options.py``) and answer with a ``SolverResult`` whose
``decision`` is a ``Decision`` (both in ``zorse_fx/ir``), the record
``evaluate``, ``sim.simulate`` and the plan builder take.

``solve_cpsat`` / ``solve_grouped`` (class-level CP-SAT for large clusters) /
``solve_brute_force`` load on first use, so code that only
needs the records (the cluster, the runtime) never imports OR-Tools.
"""

from ..ir.costs import BlockCosts, TiedParam
from ..ir.decision import Decision
from ..ir.devices import DeviceGraph, SharedLink
from ..ir.memory import StageMemory
from ..ir.result import SolverResult
from ..options import PlanOptions
from .objective import Evaluation, evaluate

__all__ = [
    "BlockCosts", "DeviceGraph", "Decision", "PlanOptions", "SharedLink", "SolverResult", "StageMemory", "TiedParam",
    "Evaluation", "evaluate", "solve_brute_force", "solve_cpsat", "solve_grouped",
]


def __getattr__(name: str):
    if name == "solve_cpsat":
        from .cpsat import solve_cpsat

        return solve_cpsat
    if name == "solve_grouped":
        from .grouped import solve_grouped

        return solve_grouped
    if name == "solve_brute_force":
        from .brute_force import solve_brute_force

        return solve_brute_force
    raise AttributeError(f"module 'zorse_fx.solve' has no attribute {name!r}")
