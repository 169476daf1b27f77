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
  * memory, as the options allow (``solve/heuristics.py`` [Note: memory techniques of
    the baselines]). Cephalo is sharded DP only, so with ``sharding`` "auto"
    or "always" (and >= 2 GPUs) the stage is always ZeRO-1 sharded, with an
    explicit policy instead of ``balance_shards``: a GPU's sample cap counts
    only the replicated part of the state, and the shardable part is split
    in whole MiB in proportion to each GPU's memory left after its
    replicated state and activations (largest remainder; so the shards are
    ordered like the free memory and never exceed it when the state fits).
    Each recomputation setting the options allow is tried (the GPU's
    per-sample time then includes the recomputed forward), the faster kept;
  * the micro-batch count with the best shared-objective step time wins.

Simplifications that matter: Cephalo shards ALL training state with FSDP
(ZeRO-3: weights, gradients and optimizer state) and offloads activations
with layer-major gradient accumulation; the shared model has ZeRO-1 only
([C-shard] in ``zorse_fx.solve.objective``), so here the weights and
gradients stay replicated on every GPU and only the optimizer state is
sharded. With ``sharding="never"`` (the default) even that is replicated
(all of ``state_bytes_per_param``, e.g. 18 B/param in mixed precision, on
every GPU). Models whose replicated part exceeds one GPU are
therefore reported BASELINE_INFEASIBLE: an honest outcome of the comparison
(the decision Cephalo makes is kept; only its memory cost is modelled with
less sharding than FSDP). Its communication is likewise the shared model's
ring all-reduce (+ the weight all-gather when sharded), not FSDP's
all-gather + reduce-scatter per layer.
"""

from __future__ import annotations

from ..ir.costs import BlockCosts
from ..ir.devices import DeviceGraph
from ..ir.memory import StageMemory
from ..ir.result import SolverResult
from ..options import PlanOptions
from ..solve.heuristics import Selector, largest_remainder, memory_variants, stage_act_kib
from ..solve.objective import MIB_UNITS, MemoryPolicy, microbatch_candidates
from ..solve.state_terms import grad_transient_kib, stage_state_kib

__all__ = ["cephalo", "min_max_samples", "free_memory_shards"]


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


def free_memory_shards(need_kib: int, free_kib) -> tuple[int, ...]:
    """Whole-MiB shards summing to ``ceil(need_kib / MiB)``, proportional to
    each GPU's free memory in whole MiB (largest remainder, even split if none
    is free): Cephalo assigns training state by free memory. A shard never
    exceeds its GPU's free MiB when the free MiB together cover the need."""
    need = -(-need_kib // MIB_UNITS)
    return largest_remainder(need, [max(f, 0) // MIB_UNITS for f in free_kib], minimum=0)


def cephalo(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions) -> SolverResult:
    """Cephalo-style heterogeneous DP on all GPUs, one stage (see module note)."""
    sel = Selector("cephalo", costs, devices, options)
    n_g, nb = devices.num_gpus, costs.num_blocks
    gpus = tuple(range(n_g))
    shard = options.sharding != "never" and n_g >= 2
    for m in microbatch_candidates(options):
        b = options.global_batch_size // m
        if b < n_g:
            continue
        tab = sel.tables(m)
        state, q = stage_state_kib(tab, 0, nb)  # [C-tied]: a tied parameter once
        # the state every GPU holds in full, and the gradient transient at most ([Note: gradient transients])
        held = (state - q if shard else state) + grad_transient_kib(tab, 0, nb)
        for rc in dict.fromkeys(v.recompute for v in memory_variants(options)):
            per = [tab.work_prefix[t][nb] + (tab.rc_work_prefix[t][nb] if rc else 0) for t in devices.gpu_types]
            fixed = [tab.fixed_prefix[t][nb] + (tab.rc_fixed_prefix[t][nb] if rc else 0)
                     for t in devices.gpu_types]
            act = stage_act_kib(tab, 0, 1, 0, nb, 1, recompute=rc)  # per sample
            cap = [(c - held) // act if act > 0 else (b if c >= held else 0) for c in tab.cap_bytes]
            n = min_max_samples(b, per, fixed, cap) or min_max_samples(b, per, fixed)
            if shard:
                free = [c - held - stage_act_kib(tab, 0, 1, 0, nb, k, recompute=rc) for c, k in zip(tab.cap_bytes, n)]
                pol = MemoryPolicy((StageMemory(zero=1, recompute=rc),), (free_memory_shards(q, free),))
            else:
                pol = MemoryPolicy((StageMemory(recompute=rc),), ((),))
            sel.add(((0, nb),), (gpus,), (n,), m, policy=pol)
    return sel.result(f"every micro-batch size global_batch_size / M "
                      f"(M in {microbatch_candidates(options)}) is below the {n_g} GPUs, "
                      f"and pure DP gives every GPU >= 1 sample")
