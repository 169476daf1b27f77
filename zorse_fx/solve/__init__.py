"""Planners: the step-time model (objective.py), CP-SAT (cpsat.py) and an
exhaustive oracle for tiny instances (brute_force.py)."""

from .brute_force import solve_brute_force
from .cpsat import solve_cpsat
from .objective import Evaluation, evaluate
from .records import BlockCosts, DeviceGraph, SolverOptions, SolverResult

__all__ = [
    "BlockCosts", "DeviceGraph", "SolverOptions", "SolverResult",
    "Evaluation", "evaluate", "solve_brute_force", "solve_cpsat",
]
