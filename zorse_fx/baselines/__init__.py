"""Baseline planners from the literature, judged by zorse_fx's own cost model.

Each baseline has the planner interface
``fn(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions) -> SolverResult``
and returns ONE decision (stages, GPUs per stage, samples per GPU, micro-batch
count) scored by ``zorse_fx.solve.evaluate``, the same step-time and memory
model the CP-SAT planner minimises; ``status`` is "BASELINE", or
"BASELINE_INFEASIBLE" when even the method's best candidate breaks memory (its
``Candidate`` with ``chosen`` set lists the violations). See
``solve/heuristics.py`` [Note: how a baseline picks among its candidates]. Each gets the
memory techniques ``PlanOptions.sharding`` / ``recompute`` allow (ZeRO-1
optimizer-state sharding, stage recomputation), uniformly over its stages;
the SolverResult's ``decision`` carries the policy (``sharded``,
``shard_mib``, ``recompute``); see [Note: memory techniques of the baselines].

==================  =========================================================
``homogeneous_all``   Megatron-LM / torchtitan uniform PP x DP on all GPUs
``homogeneous_best``  the same on only the GPUs of the fastest type
``cephalo``           Cephalo (ICS'25): pure heterogeneous DP, min-max shares
``zorse_paper``       Zorse (arXiv 2507.10392): min-k-cut groups as stages
``metis``             Metis (ATC'24): type-placement enumeration + layer DP
``flashflex``         FlashFlex/HexiScale (arXiv 2409.01143): spectral stages,
                      memory-proportional layers
==================  =========================================================
"""

from __future__ import annotations

from typing import Callable

from ..ir.costs import BlockCosts
from ..ir.devices import DeviceGraph
from ..ir.result import SolverResult
from ..options import PlanOptions
from .cephalo import cephalo
from .flashflex import flashflex
from .homogeneous import homogeneous_all, homogeneous_best
from .metis import metis
from .zorse_paper import zorse_paper

__all__ = ["BASELINES", "Baseline", "homogeneous_all", "homogeneous_best", "cephalo", "zorse_paper",
           "metis", "flashflex"]

#: A baseline planner: same inputs and output record as ``solve_cpsat``.
Baseline = Callable[[BlockCosts, DeviceGraph, PlanOptions], SolverResult]

#: Name -> planner, in the order a benchmark table lists them.
BASELINES: dict[str, Baseline] = {
    "homogeneous_all": homogeneous_all,
    "homogeneous_best": homogeneous_best,
    "cephalo": cephalo,
    "zorse_paper": zorse_paper,
    "metis": metis,
    "flashflex": flashflex,
}
