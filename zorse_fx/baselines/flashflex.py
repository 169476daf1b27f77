"""FlashFlex / HexiScale baseline: graph-partitioned stages, memory-proportional layers.

Source: Yan et al., "FlashFlex: Accommodating Large Language Model Training
over Heterogeneous Environment" (published as HexiScale), arXiv 2409.01143.
FlashFlex partitions the device graph (GPUs, links weighted by bandwidth)
into pipeline stages / data-parallel groups with a graph-partitioning pass
that balances compute while cutting as little bandwidth as possible, assigns
layers to stages in proportion to their memory, and splits work inside a
group by speed.

What is implemented:
  * stages: recursive spectral bisection of the bandwidth graph into
    ``k = 1 .. min(max_stages, B, G)`` parts. A part to be cut into ``k``
    pieces is ordered by its Fiedler vector (second eigenvector of the
    bandwidth-weighted Laplacian, ``numpy.linalg.eigh``; sign fixed so the
    lowest-index GPU is on the negative side; index order when the second
    eigenvalue is degenerate, e.g. one node with uniform links) and cut into
    ``floor(k/2)`` and ``k - floor(k/2)`` pieces at the position whose left
    compute (sum of GPU speeds, 1 / total per-sample time) is within
    ``BALANCE_TOLERANCE`` = 10 % of the total of the proportional target and
    whose cut bandwidth is smallest (no such position: the best-balanced);
    stages follow the spectral order (left part first);
  * layers: contiguous block ranges proportional to each stage's MEMORY. A
    block weighs its training state plus one sample's activations (bytes);
    a stage's capacity is its smallest GPU's usable memory when the stage
    replicates its state on each of its GPUs; when the options allow ZeRO-1
    sharding, also the split for sharded capacities (the replicated part of
    the state and the activations on every GPU, the shardable part spread
    over the group's memory: ``stage_capacities``). The Selector scores
    each split under every memory variant the options allow (plain, sharded,
    recompute, both; ``solve/heuristics.py`` [Note: memory techniques of the baselines]);
  * samples per GPU in a stage: proportional to speed, integers >= 1 by the
    largest-remainder method; a micro-batch smaller than a stage is skipped;
  * the best (k, M) by the shared objective among memory-feasible ones.

Simplifications: no tensor parallelism (FlashFlex also forms TP groups,
whose capacity would be the sum of their memory); no swap-based refinement
of the partition with the paper's cost model; its ILP/cost model is replaced
by the shared ``zorse_fx.solve.objective`` model.
"""

from __future__ import annotations

import numpy as np

from ..ir.costs import BlockCosts
from ..ir.devices import DeviceGraph
from ..ir.result import SolverResult
from ..options import PlanOptions
from ..solve.heuristics import Selector, bandwidth, gpu_speeds, largest_remainder, memory_variants, proportional_cuts
from ..solve.objective import max_stage_count, microbatch_candidates

__all__ = ["flashflex", "spectral_stages", "stage_capacities", "BALANCE_TOLERANCE"]

#: Allowed deviation of a bisection's compute from its target, as a fraction of the part's total.
BALANCE_TOLERANCE = 0.1


def _fiedler_order(devices: DeviceGraph, gpus: list[int]) -> list[int]:
    """GPUs ordered by the Fiedler vector of their bandwidth graph (see module note)."""
    n = len(gpus)
    if n <= 2:
        return sorted(gpus)
    w = np.array([[bandwidth(devices, g, h) if g != h else 0.0 for h in gpus] for g in gpus])
    w /= w.max()
    vals, vecs = np.linalg.eigh(np.diag(w.sum(axis=1)) - w)
    if vals[2] - vals[1] <= 1e-9 * max(vals[-1], 1.0):
        return sorted(gpus)
    v = vecs[:, 1]
    lead = int(np.argmin(gpus))
    if v[lead] > 0:
        v = -v
    return [gpus[i] for i in sorted(range(n), key=lambda i: (round(float(v[i]), 9), gpus[i]))]


def spectral_stages(devices: DeviceGraph, speed, k: int, gpus=None) -> list[tuple[int, ...]]:
    """Recursive compute-balanced spectral bisection into ``k`` GPU groups, in stage order."""
    gpus = list(range(devices.num_gpus)) if gpus is None else list(gpus)
    if not 1 <= k <= len(gpus):
        raise ValueError(f"cannot cut {len(gpus)} GPUs into k={k} stages")
    if k == 1:
        return [tuple(sorted(gpus))]
    order = _fiedler_order(devices, gpus)
    k1 = k // 2
    total = sum(speed[g] for g in order)
    target = total * k1 / k
    cum = [0.0]
    for g in order:
        cum.append(cum[-1] + speed[g])
    pos = range(k1, len(order) - (k - k1) + 1)

    def cut_bw(i):
        return sum(bandwidth(devices, g, h) for g in order[:i] for h in order[i:])

    near = [i for i in pos if abs(cum[i] - target) <= BALANCE_TOLERANCE * total]
    i = (min(near, key=lambda i: (cut_bw(i), abs(cum[i] - target), i)) if near
         else min(pos, key=lambda i: (abs(cum[i] - target), i)))
    return spectral_stages(devices, speed, k1, order[:i]) + spectral_stages(devices, speed, k - k1, order[i:])


def stage_capacities(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions, stages,
                     sharded: bool) -> list[float]:
    """Per stage, the bytes of model memory (``block_mem``: training state
    plus one sample's activations) it can hold. Unsharded, every GPU holds its
    blocks' whole state: the smallest GPU's usable memory ``c_min``. Sharded
    (ZeRO-1, a stage of k >= 2 GPUs), only the replicated part R of the state
    and the activations A sit on every GPU while the shardable part Q spreads
    over the group (model totals R, Q, A): min(c_min (R + Q + A) / (R + A),
    sum_g c_g (R + Q + A) / (k (R + A) + Q))."""
    cap = [int(options.memory_fraction * mb) for mb in devices.memory_bytes]
    n_par = sum(costs.param_count)
    q = sum(costs.shardable_bytes(b) for b in range(costs.num_blocks))
    ra = (costs.state_bytes_per_param * n_par - q) + sum(costs.act_bytes_per_sample)
    out = []
    for gs in stages:
        c_min = min(cap[g] for g in gs)
        if sharded and len(gs) >= 2 and ra > 0:
            out.append(min(c_min * (ra + q) / ra, sum(cap[g] for g in gs) * (ra + q) / (len(gs) * ra + q)))
        else:
            out.append(c_min)
    return out


def flashflex(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions) -> SolverResult:
    """FlashFlex/HexiScale-style plan on the shared cost model (see module note)."""
    sel = Selector("flashflex", costs, devices, options)
    speed = gpu_speeds(costs, devices)
    block_mem = [costs.state_bytes_per_param * p + a
                 for p, a in zip(costs.param_count, costs.act_bytes_per_sample)]
    shard_modes = sorted({v.zero >= 1 for v in memory_variants(options)})
    for k in range(1, max_stage_count(costs, devices, options) + 1):
        stages = spectral_stages(devices, speed, k)
        splits = dict.fromkeys(proportional_cuts(block_mem, stage_capacities(costs, devices, options, stages, sh))
                               for sh in shard_modes)
        for m in microbatch_candidates(options):
            b = options.global_batch_size // m
            if b < max(map(len, stages)):
                continue
            samples = [largest_remainder(b, [speed[g] for g in gs]) for gs in stages]
            for blocks in splits:
                sel.add(blocks, stages, samples, m)
    return sel.result(f"the micro-batch (global_batch_size={options.global_batch_size} / M, "
                      f"M in {microbatch_candidates(options)}) is smaller than every stage grouping "
                      f"needs ({devices.num_gpus} GPUs)")
