"""Metis baseline: enumerate pipeline degree and GPU-type placement, balance layers.

Source: Um et al., "Metis: Fast Automatic Distributed Training on
Heterogeneous GPUs", USENIX ATC'24. Metis groups identical GPUs on a node
into device groups, enumerates the pipeline degree and how device groups of
each GPU type are assigned to stages (heterogeneous data parallelism inside a
stage, with per-GPU batch shares proportional to speed), balances layers
across stages by their compute (a load balancer that also respects memory),
and ranks the candidates with its cost model.

What is implemented:
  * GPU orders: for each permutation of the GPU types (all of them for <= 4
    types, else fastest-first and slowest-first), the GPUs listed type-major
    (type by type, node by node inside a type) and node-major (node by node,
    type by type inside a node); either way identical GPUs on one node (a
    device group) are adjacent. Type-major is Metis' own order (it assumes
    one GPU type per node); node-major keeps a stage inside a node when
    nodes mix types;
  * stages: every split of such an order into ``S = 1 .. min(max_stages, B,
    G)`` contiguous non-empty runs. Splits may fall anywhere if that yields
    at most ``MAX_CANDIDATES`` = 200 distinct stage groupings in all; else
    only at device-group boundaries and device-group halves (Metis' power of
    two sub-groups); else only at device-group boundaries; if still more,
    each (order, S) keeps its first combinations in lexicographic order so
    the total stays <= 200 (the bound on enumeration the paper needs too);
  * samples inside a stage: proportional to speed (1 / total per-sample
    time), integers >= 1 by the largest-remainder method; a micro-batch
    smaller than a stage's GPU count skips that candidate;
  * layers: a dynamic program over contiguous block ranges minimising the
    largest stage compute time ``max_g n_g W_{s,type(g)} + F`` (ns units),
    restricted to ranges that fit every GPU's memory under the schedule's
    in-flight micro-batches; if no split fits, the unrestricted one (reported
    infeasible). With ZeRO-1 sharding and/or recomputation allowed by the
    options, the DP runs once per memory variant (plain, sharded, recompute,
    both; see ``solve/heuristics.py`` [Note: memory techniques of the baselines]) with
    that variant's memory check (sharded: the replicated part of the state
    plus activations on every GPU, the shardable part spread over the
    stage's leftover memory) and, when recomputing, its extra forward time;
    each distinct split is scored under every variant;
  * every micro-batch count ``M``; the best candidate by the shared objective
    among memory-feasible ones.

Simplifications: no tensor parallelism (Metis also searches TP degree inside
a device group); Metis' own cost model is replaced by the shared one; the
layer balancer ignores boundary communication (as Metis' does).
"""

from __future__ import annotations

import itertools
from math import comb

import numpy as np

from ..ir.costs import BlockCosts
from ..ir.devices import DeviceGraph
from ..ir.memory import StageMemory
from ..ir.result import SolverResult
from ..options import PlanOptions
from ..solve.heuristics import (
    Selector,
    StageMatrices,
    gpu_speeds,
    largest_remainder,
    memory_groups,
    memory_variants,
    min_max_partition_arrays,
)
from ..solve.objective import inflight, max_stage_count, microbatch_candidates

__all__ = ["metis", "stage_groupings", "MAX_CANDIDATES"]

#: Upper bound on the distinct stage groupings Metis enumerates.
MAX_CANDIDATES = 200


def _orders(costs: BlockCosts, devices: DeviceGraph):
    """GPU orders (type by type, node-major) and, per order, its device-group runs."""
    total = {t: sum(costs.fwd_bwd_s_per_sample[t]) for t in set(devices.gpu_types)}
    types = sorted(total, key=lambda t: (total[t], t))
    perms = list(itertools.permutations(types)) if len(types) <= 4 else [tuple(types), tuple(types[::-1])]
    nodes = devices.node_names or ("",) * devices.num_gpus
    seen = set()
    for perm in perms:
        rank = {t: i for i, t in enumerate(perm)}
        for key in (lambda g: (rank[devices.gpu_types[g]], nodes[g], g),   # type-major
                    lambda g: (nodes[g], rank[devices.gpu_types[g]], g)):  # node-major
            order = tuple(sorted(range(devices.num_gpus), key=key))
            if order not in seen:
                seen.add(order)
                yield list(order), [(devices.gpu_types[g], nodes[g]) for g in order]


def _positions(units, level: int) -> list[int]:
    """Allowed cut positions 1..G-1 in an order: all (0), group boundaries and
    halves (1), group boundaries (2)."""
    n = len(units)
    if level == 0:
        return list(range(1, n))
    out, start = [], 0
    for i in range(1, n + 1):
        if i == n or units[i] != units[start]:
            size = i - start
            if level == 1 and size % 2 == 0 and size >= 2:
                out.append(start + size // 2)
            if i < n:
                out.append(i)
            start = i
    return sorted(set(out))


def stage_groupings(costs: BlockCosts, devices: DeviceGraph, k_max: int):
    """Distinct stage groupings (tuples of GPU tuples, in stage order), at most
    MAX_CANDIDATES of them (see module note)."""
    orders = list(_orders(costs, devices))
    for level in (0, 1, 2):
        per = [(order, _positions(units, level)) for order, units in orders]
        count = sum(comb(len(p), s - 1) for _, p in per for s in range(1, k_max + 1))
        if count <= MAX_CANDIDATES:
            break
    quota = max(1, MAX_CANDIDATES // (len(per) * k_max)) if count > MAX_CANDIDATES else None
    seen = []
    for n_s in range(1, k_max + 1):
        for order, pos in per:
            for cuts in itertools.islice(itertools.combinations(pos, n_s - 1), quota):
                edges = (0, *cuts, len(order))
                cand = tuple(tuple(sorted(order[edges[s]:edges[s + 1]])) for s in range(n_s))
                if cand not in seen:
                    seen.append(cand)
    return seen[:MAX_CANDIDATES]


def _layers(mats: StageMatrices, stages, samples, sharded: bool, recompute: bool):
    """Block ranges minimising the slowest stage's compute (recomputation
    included when the variant recomputes), memory-feasible under the memory
    variant if possible (``mats``: the tables' ``StageMatrices``)."""
    tab, n_s = mats.tab, len(stages)
    cost = np.empty((n_s, mats.nb + 1, mats.nb + 1))
    fits = np.empty(cost.shape, dtype=bool)
    for s, (gs, ns) in enumerate(zip(stages, samples)):
        # {type: largest samples of a GPU of that type}: the stage's slowest GPU per type.
        worst = {}
        for g, n in zip(gs, ns):
            worst[tab.gpu_types[g]] = max(worst.get(tab.gpu_types[g], 0), n)
        busy = [n * mats.work[t] + mats.fixed[t] + (n * mats.rc_work[t] + mats.rc_fixed[t] if recompute else 0)
                for t, n in worst.items()]
        cost[s] = np.where(mats.valid, np.max(busy, axis=0), np.inf)
        fits[s] = mats.fits(memory_groups(tab, gs, ns), inflight(tab.schedule, n_s, s, tab.num_microbatches), s > 0,
                            StageMemory(zero=int(sharded and len(gs) >= 2), recompute=recompute))
    return min_max_partition_arrays(np.where(fits, cost, np.inf)) or min_max_partition_arrays(cost)


def metis(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions) -> SolverResult:
    """Metis-style enumeration with speed-proportional DP and balanced layers (see module note)."""
    sel = Selector("metis", costs, devices, options)
    speed = gpu_speeds(costs, devices)
    groupings = stage_groupings(costs, devices, max_stage_count(costs, devices, options))
    for m in microbatch_candidates(options):
        b = options.global_batch_size // m
        tab = sel.tables(m)
        mats = StageMatrices(tab)
        for stages in groupings:
            if b < max(map(len, stages)):
                continue
            samples = [largest_remainder(b, [speed[g] for g in gs]) for gs in stages]
            # One layer split per memory variant the options allow (sharding only
            # matters with a multi-GPU stage); the Selector scores each split
            # under every variant.
            variants = {(v.zero >= 1 and max(map(len, stages)) >= 2, v.recompute) for v in memory_variants(options)}
            splits = dict.fromkeys(_layers(mats, stages, samples, sh, rc)
                                   for sh, rc in sorted(variants))
            for blocks in splits:
                sel.add(blocks, stages, samples, m)
    return sel.result(f"every micro-batch size global_batch_size / M (M in {microbatch_candidates(options)}) "
                      f"is smaller than the GPU count of every stage grouping")
