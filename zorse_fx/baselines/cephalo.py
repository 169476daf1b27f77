"""Cephalo baseline: heterogeneous pure data parallelism.

Source: Guo et al., "Cephalo: Harnessing Heterogeneous GPU Clusters for
Training Transformer Models", ICS'25, arXiv 2411.01075. Cephalo trains with
sharded data parallelism only (no pipeline) on every GPU, and picks each GPU's
batch size and the micro-batch count with a dynamic program that minimises
the slowest GPU's compute time subject to memory; training state is sharded
unevenly by free memory, and layer-major gradient accumulation with host
offload keeps activation memory from growing with micro-batches.

What is implemented:
  * one stage, all blocks, all G GPUs;
  * for every micro-batch count ``M`` (``microbatch_candidates``) with
    ``b = global_batch_size / M >= G``: per-GPU samples ``n_g >= 1``,
    ``sum n_g = b``, minimising ``max_g n_g W_g + F_g`` (``W_g`` per-sample,
    ``F_g`` fixed per-micro-batch time of g's type, integer ns units). Greedy:
    start at one sample each and give each further sample to the GPU that
    would finish it earliest (lowest index on ties); this is optimal for
    min-max with increasing per-GPU costs and stands in for the paper's DP.
    A GPU whose memory cannot take another sample is skipped (the paper's
    memory constraint); if the GPUs together cannot hold ``b`` samples, the
    split ignores memory and the candidate is reported infeasible;
  * the micro-batch count with the best shared-objective step time wins.

Simplification that matters: the shared memory model of
``zorse_fx.solve.objective`` REPLICATES the training state (16 B/param) on
every GPU of a data-parallel group, whereas Cephalo shards it by memory
capacity and offloads activations. This baseline is judged by the shared
replicated-state model, so for models whose state exceeds one GPU it is
reported BASELINE_INFEASIBLE: an honest outcome of the comparison (the
decision Cephalo makes is kept; only its memory cost is modelled without
sharding). Its communication is likewise the shared model's ring all-reduce,
not FSDP's all-gather + reduce-scatter per layer.
"""

from __future__ import annotations

from ..solve.objective import inflight, microbatch_candidates
from ..solve.records import BlockCosts, DeviceGraph, SolverOptions, SolverResult
from ._common import Selector

__all__ = ["cephalo", "min_max_samples"]


def min_max_samples(b: int, per_sample, fixed, cap=None) -> tuple[int, ...] | None:
    """Integer samples ``n_g in [1, cap_g]`` summing to ``b`` that minimise
    ``max_g n_g per_sample[g] + fixed[g]``; None if the caps cannot hold ``b``.
    ``cap=None`` means unlimited."""
    n_g = len(per_sample)
    cap = cap if cap is not None else [b] * n_g
    if b < n_g or any(c < 1 for c in cap) or sum(min(c, b) for c in cap) < b:
        return None
    n = [1] * n_g
    for _ in range(b - n_g):
        g = min((g for g in range(n_g) if n[g] < cap[g]),
                key=lambda g: ((n[g] + 1) * per_sample[g] + fixed[g], g))
        n[g] += 1
    return tuple(n)


def cephalo(costs: BlockCosts, devices: DeviceGraph, options: SolverOptions) -> SolverResult:
    """Cephalo-style heterogeneous DP on all GPUs, one stage (see module note)."""
    sel = Selector("cephalo", costs, devices, options)
    n_g, nb = devices.num_gpus, costs.num_blocks
    gpus = tuple(range(n_g))
    for m in microbatch_candidates(options):
        b = options.global_batch_size // m
        if b < n_g:
            continue
        tab = sel.tables(m)
        per = [tab.work_prefix[t][nb] for t in devices.gpu_types]
        fixed = [tab.fixed_prefix[t][nb] for t in devices.gpu_types]
        state, act = tab.state_prefix[nb], tab.act_prefix[nb] * inflight(options.schedule, 1, 0, m)
        cap = [(c - state) // act if act > 0 else (b if c >= state else 0) for c in tab.cap_bytes]
        n = min_max_samples(b, per, fixed, cap) or min_max_samples(b, per, fixed)
        sel.add(((0, nb),), (gpus,), (n,), m)
    return sel.result(f"every micro-batch size global_batch_size / M "
                      f"(M in {microbatch_candidates(options)}) is below the {n_g} GPUs, "
                      f"and pure DP gives every GPU >= 1 sample")
