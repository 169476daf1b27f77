"""Homogeneous PP x DP baselines: Megatron-LM / torchtitan style.

Source: Megatron-LM (Shoeybi et al. 2019; Narayanan et al., SC'21, "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM") and
torchtitan (Liang et al., ICLR'25). Both assume identical GPUs: a uniform
pipeline degree ``p`` (dividing the GPU count), data-parallel degree
``d = G / p``, the same number of layers on every stage and the same number of
samples on every data-parallel rank.

What is implemented (``homogeneous_all``):
  * every ``p`` dividing ``G`` with ``p <= min(max_stages, B)``, and every
    micro-batch count ``M`` from ``microbatch_candidates(options)``;
  * blocks split uniformly: every stage ``floor(B / p)`` contiguous blocks, the
    first ``B mod p`` stages one more (Megatron's uniform layer split; blocks
    are our layers);
  * GPUs in index order, stage ``s`` = GPUs ``[s d, (s + 1) d)`` (Megatron's
    rank order puts pipeline outermost, so a DP group is consecutive ranks);
  * every GPU of a stage ``b / d`` samples; a (p, M) with ``d`` not dividing
    ``b`` is skipped (Megatron requires the micro-batch to split evenly).
``homogeneous_best`` is the same method on only the GPUs of the single
fastest type (smallest total per-sample block time), the others idle: what a
user does who keeps only their best GPUs.

Memory: Megatron's distributed optimizer is ZeRO-1 and its activation
recomputation ("full", per layer) is stage-wide here; so, as the options
allow, every decision is also scored with every multi-GPU stage sharded
and/or every stage recomputing, the best kept (``solve/heuristics.py`` [Note: memory
techniques of the baselines]).

Simplifications: no tensor parallelism, no interleaved virtual stages; the
schedule (1F1B / GPipe) and memory model are the shared ones of
``zorse_fx.solve.objective`` (with sharding "never", the default, the state
is replicated in a DP group).
"""

from __future__ import annotations

from ..ir.costs import BlockCosts
from ..ir.devices import DeviceGraph
from ..ir.result import SolverResult
from ..options import PlanOptions
from ..solve.heuristics import Selector
from ..solve.objective import max_stage_count, microbatch_candidates

__all__ = ["homogeneous_all", "homogeneous_best", "fastest_type", "uniform_blocks"]


def uniform_blocks(nb: int, p: int) -> tuple[tuple[int, int], ...]:
    """``p`` contiguous ranges of ``nb`` blocks, sizes ``nb // p`` (+1 for the first ``nb % p``)."""
    sizes = [nb // p + (1 if s < nb % p else 0) for s in range(p)]
    edges = [0]
    for n in sizes:
        edges.append(edges[-1] + n)
    return tuple((edges[s], edges[s + 1]) for s in range(p))


def _plan(name: str, gpus: tuple[int, ...], costs: BlockCosts, devices: DeviceGraph,
          options: PlanOptions) -> SolverResult:
    sel = Selector(name, costs, devices, options)
    n_g, nb = len(gpus), costs.num_blocks
    k_max = min(max_stage_count(costs, devices, options), n_g)
    for p in (p for p in range(1, k_max + 1) if n_g % p == 0):
        d = n_g // p
        blocks = uniform_blocks(nb, p)
        stage_gpus = tuple(gpus[s * d:(s + 1) * d] for s in range(p))
        for m in microbatch_candidates(options):
            b = options.global_batch_size // m
            if b % d:
                continue
            sel.add(blocks, stage_gpus, tuple((b // d,) * d for _ in range(p)), m)
    return sel.result(
        f"{n_g} GPUs: no pipeline degree p <= {k_max} dividing {n_g} leaves a DP degree d = {n_g}/p "
        f"dividing a micro-batch size of global_batch_size={options.global_batch_size} / M, "
        f"M in {microbatch_candidates(options)}")


def homogeneous_all(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions) -> SolverResult:
    """Megatron/torchtitan uniform PP x DP on all G GPUs (see module note)."""
    return _plan("homogeneous_all", tuple(range(devices.num_gpus)), costs, devices, options)


def fastest_type(costs: BlockCosts, devices: DeviceGraph) -> str:
    """The GPU type with the smallest total per-sample block time (ties: more GPUs, then name)."""
    types = set(devices.gpu_types)
    return min(types, key=lambda t: (sum(costs.fwd_bwd_s_per_sample[t]), -devices.gpu_types.count(t), t))


def homogeneous_best(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions) -> SolverResult:
    """Uniform PP x DP on only the GPUs of the fastest type, the rest idle (see module note)."""
    t = fastest_type(costs, devices)
    gpus = tuple(g for g in range(devices.num_gpus) if devices.gpu_types[g] == t)
    return _plan("homogeneous_best", gpus, costs, devices, options)
