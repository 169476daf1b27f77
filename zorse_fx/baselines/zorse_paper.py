"""Zorse (paper) baseline: min-k-cut GPU groups as asymmetric pipeline stages.

Source: "Zorse: Optimizing LLM Training Efficiency on Heterogeneous GPU
Clusters", arXiv 2507.10392 (MLSys 2026). Zorse groups GPUs by an approximate
minimum k-cut of the bandwidth graph, so that slow links separate groups and
fast links stay inside them; each group is a heterogeneous ZeRO/FSDP data
parallel group running pipeline stage(s); layers are split across groups in
proportion to their compute, and GPUs inside a group get integer shares of
the work in proportion to their speed. Its planner enumerates micro-batch
size and interleave degree with an analytical model.

What is implemented:
  * groups: greedy splitting (Saran & Vazirani's 2-approximation of min
    k-cut): start with all GPUs in one group and, k - 1 times, split the group
    whose Stoer-Wagner minimum cut (``networkx.stoer_wagner``, edge weight =
    link bandwidth in bytes/s) is smallest (lowest group index on ties);
    ``k = 1 .. min(max_stages, B, G)``;
  * stage order: a bandwidth chain. The group with the largest aggregate speed
    goes first (under 1F1B the first stage holds the most activations in
    flight), then repeatedly the remaining group with the fastest bottleneck
    link to the last placed group (ties: faster group, then lower index);
  * layers: contiguous block ranges whose share of the model's per-sample work
    (``reference_block_work``: average over the GPU types present) is
    proportional to the group's aggregate speed (sum over its GPUs of
    1 / total per-sample time), cut at the nearest block boundary;
  * samples per GPU inside a group: proportional to speed, integers >= 1 by
    the largest-remainder method; a (k, M) whose micro-batch is smaller than
    a group is skipped;
  * the best (k, M) by the shared objective among memory-feasible ones.

  * memory: as the options allow, each decision is also scored with every
    multi-GPU group ZeRO-1 sharded and/or every stage recomputing, the best
    kept (``solve/heuristics.py`` [Note: memory techniques of the baselines]);
    and with Zorse's own activation policy, every layer recomputed from its
    input kept in host memory: host-stashed recomputation on every stage
    ([C-stash] in ``solve/objective.py``), multi-GPU groups ZeRO-1, where
    ``PlanOptions.stash`` allows it and every GPU's node gives host memory.

Simplifications: one stage per group (no interleaved / round-robin stages);
the baseline shards only the optimizer state (ZeRO-1, where Zorse uses
ZeRO/FSDP), so memory may bind earlier than in the paper; the split is per
sample of each micro-batch rather than whole micro-batches per GPU.
"""

from __future__ import annotations

import networkx as nx

from ..ir.costs import BlockCosts
from ..ir.devices import DeviceGraph
from ..ir.result import SolverResult
from ..options import PlanOptions
from ..solve.heuristics import (
    Selector,
    bandwidth,
    gpu_speeds,
    largest_remainder,
    proportional_cuts,
    reference_block_work,
)
from ..ir.memory import StageMemory
from ..solve.memory_policy import fill_policy
from ..solve.objective import max_stage_count, microbatch_candidates

__all__ = ["zorse_paper", "min_k_cut_groups", "min_k_cut_sequence", "bandwidth_graph"]


def bandwidth_graph(devices: DeviceGraph) -> nx.Graph:
    """Complete graph on the GPUs, edge ``weight`` = link bandwidth (bytes/s, integer)."""
    graph = nx.Graph()
    graph.add_nodes_from(range(devices.num_gpus))
    for g in range(devices.num_gpus):
        for h in range(g + 1, devices.num_gpus):
            graph.add_edge(g, h, weight=int(round(bandwidth(devices, g, h))))
    return graph


def min_k_cut_groups(devices: DeviceGraph, k: int) -> tuple[tuple[int, ...], ...]:
    """Approximate min k-cut of the bandwidth graph by greedy Stoer-Wagner
    splitting; groups as sorted GPU tuples, the two halves of a split replacing
    their parent in place (lower-index half first). Stage order: ``_chain``.

    Raises:
        ValueError: ``k`` is not in 1..num_gpus."""
    return min_k_cut_sequence(devices, k)[k - 1]


def min_k_cut_sequence(devices: DeviceGraph, k_max: int) -> list[tuple[tuple[int, ...], ...]]:
    """``min_k_cut_groups(devices, k)`` for k = 1..``k_max`` (index k - 1) in one
    pass: the greedy splitting of k groups is that of k - 1 plus one split, so
    each group's Stoer-Wagner cut is computed once (the same cuts, in the same
    order, as ``k_max`` separate calls).

    Raises:
        ValueError: ``k_max`` is not in 1..num_gpus."""
    if not 1 <= k_max <= devices.num_gpus:
        raise ValueError(f"cannot cut {devices.num_gpus} GPUs into k={k_max} groups")
    graph = bandwidth_graph(devices)
    cut: dict[tuple[int, ...], tuple] = {}  # group -> (cut value, lower half, upper half)
    groups = [tuple(range(devices.num_gpus))]
    out = [tuple(groups)]
    while len(groups) < k_max:
        best = None
        for i, grp in enumerate(groups):
            if len(grp) < 2:
                continue
            if grp not in cut:
                value, (a, b) = nx.stoer_wagner(graph.subgraph(grp), weight="weight")
                cut[grp] = (value, tuple(sorted(a)), tuple(sorted(b)))
            value, a, b = cut[grp]
            if best is None or value < best[0]:
                best = (value, i, a, b)
        _, i, a, b = best
        groups[i:i + 1] = sorted((a, b))
        out.append(tuple(groups))
    return out


def _chain(groups, speed, devices: DeviceGraph):
    """Order groups: fastest first, then the best-connected remaining group."""
    agg = [sum(speed[g] for g in grp) for grp in groups]
    left = list(range(len(groups)))
    first = min(left, key=lambda i: (-agg[i], i))
    order = [first]
    left.remove(first)
    while left:
        last = groups[order[-1]]
        nxt = min(left, key=lambda i: (-min(bandwidth(devices, g, h) for g in last for h in groups[i]),
                                       -agg[i], i))
        order.append(nxt)
        left.remove(nxt)
    return [groups[i] for i in order]


def zorse_paper(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions) -> SolverResult:
    """Zorse paper's planner on the shared cost model (see module note)."""
    sel = Selector("zorse_paper", costs, devices, options)
    speed = gpu_speeds(costs, devices)
    work = reference_block_work(costs, devices)
    k_max = max_stage_count(costs, devices, options)
    host = devices.host_memory_bytes or ()
    stash = options.stash != "never" and options.recompute != "never" and any(host)
    for k, cut in enumerate(min_k_cut_sequence(devices, k_max), start=1):
        groups = _chain(cut, speed, devices)
        blocks = proportional_cuts(work, [sum(speed[g] for g in grp) for grp in groups])
        for m in microbatch_candidates(options):
            b = options.global_batch_size // m
            if b < max(map(len, groups)):
                continue
            samples = [largest_remainder(b, [speed[g] for g in grp]) for grp in groups]
            sel.add(blocks, groups, samples, m)
            if stash and all(host[g] > 0 for grp in groups for g in grp):  # Zorse's recomputation
                memory = tuple(StageMemory(zero=int(len(grp) >= 2 and options.sharding != "never"), recompute=True,
                                           stash="host") for grp in groups)
                sel.add(blocks, groups, samples, m, policy=fill_policy(sel.tables(m), blocks, groups, samples,
                                                                       memory=memory))
    return sel.result(f"the micro-batch (global_batch_size={options.global_batch_size} / M, "
                      f"M in {microbatch_candidates(options)}) is smaller than every GPU grouping "
                      f"needs ({devices.num_gpus} GPUs, <= {max_stage_count(costs, devices, options)} groups)")
