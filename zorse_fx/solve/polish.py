"""The final polish: a deterministic local search around the planner's answer (issue 50 item 6).

[Note: the final polish]
The planners stop on a budget (CP-SAT's deterministic seconds, the stage DP's
grid, the baselines' rules), and the answer they return is often one step
from a better plan in the objective: a cut one block over, one sample moved
from a group's slowest GPU to its fastest, the micro-batch count one divisor
up or down, one stage's memory policy changed. ``polish`` walks those
neighbours in a fixed order and takes the first that the objective prices
faster (feasible, at the objective's 1 ns units), then starts again from it,
until a whole round finds none or ``POLISH_EVALUATIONS`` evaluations are
spent: a count, not a clock, so the same inputs give the same plan on any
machine. The neighbours, per round:

1. cuts: each stage boundary one block earlier, then one later (both stages
   keep a block);
2. samples: per GPU group of >= 2 GPUs, one sample from the GPU whose share
   takes longest (its type's per-sample time x its samples) to the one that
   would take least with one more; every stage of the group alike (an
   interleaved group's stages share their split);
3. memory: per stage, each ZeRO level (0-3, the options' modes allowing;
   >= 1 needs two GPUs) and recomputation on or off, as ``StageMemory``
   (optimizer and activation placement kept);
4. micro-batches: the next micro-batch count below and above M that the
   options allow (``microbatch_candidates``), every stage's split rescaled to the new
   micro-batch size (largest remainders, each GPU >= 1 sample).

A changed decision's shards are re-balanced (``shard_mib`` None: the
evaluator's ``balance_shards``). The portfolio polishes its answer and the
next best distinct plans in hand (``portfolio.POLISH_STARTS`` in all: on
FlashFlex the stage DP's plan, priced 0.7% slower than CP-SAT's answer,
polished to 5% faster than it, where CP-SAT's had no faster neighbour), and
the fastest polished plan goes to the simulator's re-rank beside the
unpolished ones ([Note: simulator re-rank] in portfolio.py), so it is kept
only where the simulator agrees it is faster.
Measured: bench/LOG.md "Control collectives across datacenters, the final polish, every
scenario re-run".
"""

from __future__ import annotations

import dataclasses

from ..ir.costs import BlockCosts
from ..ir.decision import Decision
from ..ir.devices import DeviceGraph
from ..options import PlanOptions

__all__ = ["POLISH_EVALUATIONS", "polish", "neighbours"]

#: The polish's budget per start: evaluations of the objective (deterministic; Zorse C's 128 GPUs: ~9 ms each,
#: 138 in 1.3 CPU s, bench/LOG.md "Control collectives across datacenters, the final polish, ...").
POLISH_EVALUATIONS = 300

_RECOMPUTE = {"never": (False,), "auto": (False, True), "always": (True,)}


def _zero_levels(options: PlanOptions) -> tuple[int, ...]:
    """The ZeRO levels the options' modes do not forbid (an "always" they break is the evaluator's violation)."""
    flags = (options.sharding, options.grad_sharding, options.param_sharding)
    return (0, *(z for z, mode in zip((1, 2, 3), flags) if all(f != "never" for f in flags[:z]) and mode != "never"))


def _rescaled(samples: tuple[int, ...], b: int) -> tuple[int, ...] | None:
    """``samples`` (one stage's split) scaled to sum to ``b``: largest remainders, ties to the earlier GPU;
    None when a GPU would get no sample."""
    total = sum(samples)
    exact = [n * b / total for n in samples]
    out = [int(x) for x in exact]
    order = sorted(range(len(samples)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in order[:b - sum(out)]:
        out[i] += 1
    return tuple(out) if min(out) >= 1 else None


def _per_sample_s(costs: BlockCosts, gpu_type: str, i: int, j: int) -> float:
    return sum(costs.fwd_bwd_s_per_sample[gpu_type][i:j])


def _groups(d: Decision) -> int:
    return len(d.stage_blocks) // d.interleave


def _with_split(d: Decision, p: int, split: tuple[int, ...]) -> Decision:
    """``d`` with GPU group ``p``'s split (every stage of the group) set to ``split``."""
    n_p = _groups(d)
    samples = tuple(split if s % n_p == p else ns for s, ns in enumerate(d.samples_per_microbatch))
    return dataclasses.replace(d, samples_per_microbatch=samples, shard_mib=None)


def neighbours(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions, d: Decision):
    """The decisions one step from ``d``, in the fixed order of [Note: the final polish]."""
    n_s = len(d.stage_blocks)
    for s in range(n_s - 1):  # 1. cuts
        (i, j), (_, k) = d.stage_blocks[s], d.stage_blocks[s + 1]
        for cut in (j - 1, j + 1):
            if i < cut < k:
                blocks = d.stage_blocks[:s] + ((i, cut), (cut, k)) + d.stage_blocks[s + 2:]
                yield dataclasses.replace(d, stage_blocks=blocks, shard_mib=None)
    n_p = _groups(d)
    for p in range(n_p):  # 2. samples
        gpus, ns = d.stage_gpus[p], d.samples_per_microbatch[p]
        if len(gpus) < 2:
            continue
        per = [sum(_per_sample_s(costs, devices.gpu_types[g], *d.stage_blocks[s]) for s in range(p, n_s, n_p))
               for g in gpus]
        src = max(range(len(gpus)), key=lambda a: (per[a] * ns[a], -a))
        dst = min((a for a in range(len(gpus)) if a != src), key=lambda a: (per[a] * (ns[a] + 1), a))
        if ns[src] > 1:
            split = tuple(n - (a == src) + (a == dst) for a, n in enumerate(ns))
            yield _with_split(d, p, split)
    zeros, recomputes = _zero_levels(options), _RECOMPUTE[options.recompute]
    host = devices.host_memory_bytes or ()
    for s in range(n_s):  # 3. memory
        mem = d.memory[s]
        # [C-stash] where the options allow it and every GPU of the stage has host memory
        stashes = ("device",) + (("host",) if options.stash != "never" and host
                                 and all(host[g] > 0 for g in d.stage_gpus[s]) else ())
        for zero in zeros:
            if zero and len(d.stage_gpus[s]) < 2:
                continue
            for rc in recomputes:
                for st in stashes:
                    if (zero, rc, st) == (mem.zero, mem.recompute, mem.stash):
                        continue
                    try:
                        policy = dataclasses.replace(mem, zero=zero, recompute=rc, stash=st)
                    except ValueError:  # a policy StageMemory refuses (ir/memory.py): no neighbour
                        continue
                    yield dataclasses.replace(d, memory=d.memory[:s] + (policy,) + d.memory[s + 1:], shard_mib=None)
    gbs, m = options.global_batch_size, d.num_microbatches  # 4. micro-batches
    from .objective import microbatch_candidates

    ms = microbatch_candidates(options)
    for q in [q for q in ms if q < m][-1:] + [q for q in ms if q > m][:1]:
        splits = [_rescaled(d.samples_per_microbatch[p], gbs // q) for p in range(n_p)]
        if all(splits):
            samples = tuple(splits[s % n_p] for s in range(n_s))
            yield dataclasses.replace(d, num_microbatches=q, samples_per_microbatch=samples, shard_mib=None)


def polish(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions, decision: Decision,
           budget: int = POLISH_EVALUATIONS):
    """First-improvement local search from ``decision`` ([Note: the final polish]).

    Returns:
        ``(evaluation, evaluations spent)``: the ``Evaluation`` of the best decision found, None where no
        neighbour the objective prices faster (and feasible) was found within ``budget`` evaluations.
    """
    from .objective import evaluate

    current = evaluate(costs, devices, options, decision)
    found, spent = None, 1
    improved = current.feasible
    while improved and spent < budget:
        improved = False
        for nb in neighbours(costs, devices, options, current.decision):
            if spent >= budget:
                break
            try:
                ev = evaluate(costs, devices, options, nb)
            except ValueError:  # a neighbour the options refuse (e.g. a policy outside them)
                spent += 1
                continue
            spent += 1
            if ev.feasible and ev.objective_units < current.objective_units:
                current = found = ev
                improved = True
                break
    return found, spent
