"""Exhaustive oracle for tiny instances (tests compare CP-SAT against it).

Enumerates every S, M, assignment of GPUs to stages / idle, cut composition,
sample split and per-stage memory policy (ZeRO-1/2/3, recomputation, optimizer
and activation offload, as the options allow; a sharded stage's shards are
``balance_shards``' split, the least optimizer time that fits), the full
product with no pruning, checks memory and scores each decision with
objective.py's integer model (``evaluate_units``).
"""

from __future__ import annotations

import itertools
import time

from ..errors import InfeasiblePlanError
from ..ir.costs import BlockCosts
from ..ir.devices import DeviceGraph
from ..ir.memory import StageMemory
from ..ir.result import Candidate, SolverResult
from ..options import PlanOptions
from .bounds import explain_infeasible
from .objective import (
    UNIT_S,
    build_tables,
    evaluate,
    evaluate_units,
    fill_policy,
    max_stage_count,
    microbatch_candidates,
    mode_violations,
    policy_decision,
)

__all__ = ["solve_brute_force", "MAX_GPUS", "MAX_BLOCKS", "MAX_MICROBATCH_SIZE"]

MAX_GPUS = 4
MAX_BLOCKS = 6
MAX_MICROBATCH_SIZE = 6
#: A placement flag (offloaded?) as ``StageMemory.optimizer`` / ``activations``.
_PLACE = {False: "device", True: "host"}


def _compositions(total: int, parts: int):
    """Every tuple of ``parts`` positive ints summing to ``total``."""
    for bars in itertools.combinations(range(1, total), parts - 1):
        edges = (0, *bars, total)
        yield tuple(edges[i + 1] - edges[i] for i in range(parts))


def solve_brute_force(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions) -> SolverResult:
    """Exact optimum of the model by enumeration (G <= 4, B <= 6, b <= 6).

    Same decision and tie-break as ``solve_cpsat`` (fewer stages, then fewer
    micro-batches); status "BRUTE_FORCE", gap 0, times in seconds. Raises
    ValueError for larger instances and InfeasiblePlanError when nothing fits.
    """
    t0 = time.perf_counter()
    ms = microbatch_candidates(options)
    n_g, nb = devices.num_gpus, costs.num_blocks
    big_b = options.global_batch_size // ms[0]
    if n_g > MAX_GPUS or nb > MAX_BLOCKS or big_b > MAX_MICROBATCH_SIZE:
        raise ValueError(
            f"brute force is limited to G <= {MAX_GPUS} GPUs, B <= {MAX_BLOCKS} blocks and micro-batch "
            f"size b <= {MAX_MICROBATCH_SIZE}; got G={n_g}, B={nb}, b up to {big_b}")
    k_max = max_stage_count(costs, devices, options)
    # Every per-stage policy the options allow ([Note: memory flags] in zorse_fx/options.py):
    # the ZeRO level of a stage of >= 2 GPUs (a one-GPU stage: the first, nothing sharded),
    # recomputation, and the offloads where some GPU has host memory.
    modes = {"never": (False,), "auto": (False, True), "always": (True,)}
    layouts = (0,)
    if options.sharding != "never":
        layouts += tuple(3 if ps else 2 if gs else 1 for gs in modes[options.grad_sharding]
                         for ps in (modes[options.param_sharding] if gs else (False,)))
    host = any(devices.host_memory_bytes)
    rcs = modes[options.recompute]
    ofs = modes[options.offload] if host or options.offload == "always" else (False,)
    aos = modes[options.activation_offload] if host or options.activation_offload == "always" else (False,)
    sts = modes[options.stash] if host or options.stash == "always" else (False,)
    # each allowed (ZeRO level, recompute, optimizer offload, (activation offload, [C-stash])) as its record,
    # made once: the combinations StageMemory accepts (ir/memory.py)
    places = [(ao, st) for ao in aos for st in sts]
    records = {}
    for key in itertools.product(layouts, rcs, ofs, places):
        z, rc, of, (ao, st) = key
        try:
            records[key] = StageMemory(zero=z, recompute=rc, optimizer=_PLACE[of], activations=_PLACE[ao],
                                       stash=_PLACE[st])
        except ValueError:
            pass
    best, cands = None, []
    for n_s in range(1, k_max + 1):
        for m in ms:
            t1 = time.perf_counter()
            tab = build_tables(costs, devices, options, m)
            b = tab.microbatch_size

            cand_best = None
            choices = range(-1 if options.allow_idle_gpus else 0, n_s)  # -1 = idle
            for assign in itertools.product(choices, repeat=n_g):
                stage_gpus = tuple(tuple(g for g in range(n_g) if assign[g] == s) for s in range(n_s))
                if any(not 1 <= len(gs) <= b for gs in stage_gpus):
                    continue
                for inner in itertools.combinations(range(1, nb), n_s - 1):
                    edges = (0, *inner, nb)
                    blocks = tuple((edges[s], edges[s + 1]) for s in range(n_s))
                    splits = [list(_compositions(b, len(gs))) for gs in stage_gpus]
                    flags = [layouts if len(gs) >= 2 else layouts[:1] for gs in stage_gpus]
                    for samples in itertools.product(*splits):
                        for zeros in itertools.product(*flags):
                            for recompute, offload, acts in itertools.product(
                                    itertools.product(rcs, repeat=n_s), itertools.product(ofs, repeat=n_s),
                                    itertools.product(places, repeat=n_s)):
                                keys = tuple(zip(zeros, recompute, offload, acts))
                                if any(k not in records for k in keys):
                                    continue  # a combination StageMemory refuses
                                memory = tuple(map(records.__getitem__, keys))
                                pol = fill_policy(tab, blocks, stage_gpus, samples, memory=memory)
                                if mode_violations(options, stage_gpus, pol):
                                    continue
                                u = evaluate_units(tab, blocks, stage_gpus, samples, pol)
                                if not u.fits(tab, stage_gpus):
                                    continue
                                if cand_best is None or u.step < cand_best[0]:
                                    cand_best = (u.step, blocks, stage_gpus, samples, pol)
            cands.append(Candidate(kind="brute_force", num_stages=n_s, num_microbatches=m,
                                   status="INFEASIBLE" if cand_best is None else "BRUTE_FORCE",
                                   step_time_s=None if cand_best is None else cand_best[0] * UNIT_S,
                                   wall_s=time.perf_counter() - t1))
            if cand_best is not None and (best is None or cand_best[0] < best[0][0]):
                best = (cand_best, m)
    if best is None:
        raise InfeasiblePlanError(explain_infeasible(costs, devices, options, cands))
    (step, blocks, gpus, samples, pol), m = best
    ev = evaluate(costs, devices, options, policy_decision(blocks, gpus, samples, m, pol))
    if ev.objective_units != step or not ev.feasible:
        raise AssertionError(f"brute force step {step} != evaluate() {ev.objective_units} ({ev.violations})")
    return SolverResult.from_evaluation(
        ev, options=options, status="BRUTE_FORCE", best_bound=ev.step_time_s, wall_s=time.perf_counter() - t0,
        candidates=tuple(cands))
