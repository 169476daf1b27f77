"""Interleaving: re-cut a finished plan's GPU groups into P x v stages.

[Note: interleave search]
The CP-SAT models, the stage DP and the baselines choose one stage per GPU
group. Interleaved 1F1B (``ir.schedule.interleaved_1f1b``) runs v model
chunks on every group, stage s on group s mod P, and shrinks the pipeline
bubble from (P - 1) stage times to (P - 1) / v of them ([Note: interleaved
stages] in objective.py) at the price of v times more boundary messages and
more activations in flight. Where that pays depends on the bubble (few
micro-batches per group), the links and the memory left, so the planner asks
the objective: given the best plan's groups (their GPUs, their sample
shares, their memory policy), for every interleave degree v = 2 ..
``max_interleave`` and every micro-batch count M that the groups can split
(any M: ``ir.schedule.interleaved_1f1b`` runs rounds of >= P micro-batches
when M is not a multiple of P; every GPU keeping >= 1 sample; shares rescaled to the
new micro-batch size by largest remainder):

1. cuts: the P v stages' block ranges minimising the largest stage time
   (compute of the group's slowest GPU + boundary to the next stage), by
   binary search on that time and a greedy pass that gives each stage as many
   blocks as fit (with fewer blocks than the remaining stages need, it stops);
2. local search on the objective itself: each cut moves by one block while
   that lowers (memory breach in KiB, step time), lexicographically; the
   tries run in order of their step at the cuts of 1., and one whose start is
   more than ``LOCAL_SEARCH_SLACK`` times the best step found (or the step the
   result must beat), fitting memory or not, is recorded at its start, not
   searched (a deterministic skip: the order and the scores depend on the
   inputs alone);
3. memory policy: the group's flags as in the plan, with recomputation
   on every group when ``options.recompute`` allows it (interleaving keeps
   more micro-batch chunks in flight than 1F1B), and with host-stashed
   recomputation on every group ([C-stash]: the chunks' block inputs wait in
   host memory, so a chunk in flight costs the GPU only its boundary
   tensors) where ``options.stash`` allows it and the GPUs have host memory.

[Note: per-chunk policies]
Where the base's own policy breaches memory at a (v, M)'s cuts, the search also
tries a policy per chunk (stage) instead of one per group: each group has a
ladder (``_ladders``: its base policy, ZeRO-1, whole-stage recomputation,
host-stashed recomputation, as the options allow), and while a group breaches,
its chunk of the most activation bytes climbs one rung (``_fit_chunks``; one
scoring per round, at most v x rungs rounds: trying every chunk's next rung
each round cost the search 2x on Zorse B). So a group may recompute only the
chunks whose activations do not fit, or stash only where whole-stage
recomputation is not enough, instead of recomputing all of them. The local search then moves that try's cuts as any
other's (its policies kept).

The best interleaved decision replaces the plan when the objective scores it
faster and it fits; its bound is the smaller of the plan's bound and the
throughput bound (``bounds.throughput_lower_bound``, valid for interleaved
decisions too: a group's load T_p is at least the compute of each of its
GPUs), since a CP-SAT bound only covers one stage per group. This is a local
search around the solver's answer, not part of the proven model.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial

from ..ir.costs import BlockCosts
from ..ir.decision import Decision
from ..ir.devices import DeviceGraph
from ..ir.memory import StageMemory
from ..ir.result import Candidate, SolverResult, with_safety_stop
from ..options import PlanOptions
from .isolated import map_isolated, work_jobs
from .objective import (
    UNIT_S,
    MemoryPolicy,
    StageUnits,
    build_tables,
    evaluate,
    evaluate_units,
    fill_policy,
    microbatch_candidates,
)

__all__ = ["interleave_search", "with_interleaving", "rescale_shares"]

#: Local-search passes over the cuts (each pass tries every cut +-1 block).
MAX_PASSES = 8

#: The interleave search skips the local search of a (M, v, policy) whose
#: min-max cuts score more than this times the best step found so far: the
#: local search gained at most 15% over its start on the demo's 42 tries
#: (1.189 -> 1.035 of the best), so 1.25 leaves a margin (issue 32, bench/LOG.md).
LOCAL_SEARCH_SLACK = 1.25

#: The local searches run in waves of this many (M, v, policy) tries against the bar of
#: the wave's start, side by side in forked children (``solve/isolated.map_isolated``);
#: fixed, not ``jobs``, so that the tries searched are the same for every ``jobs``.
WAVE = 4


def rescale_shares(shares: tuple[int, ...], size: int) -> tuple[int, ...] | None:
    """Integer shares summing to ``size``, proportional to ``shares``, each >= 1
    (largest remainder, ties to the earlier GPU); None if ``size`` < GPUs."""
    k, total = len(shares), sum(shares)
    if size < k or total <= 0:
        return None
    base = [max(1, size * n // total) for n in shares]
    while sum(base) > size:  # the max(1, .) floors can overshoot
        j = max(range(k), key=lambda q: (base[q], -q))
        base[j] -= 1
    rem = sorted(range(k), key=lambda q: (-(size * shares[q] % total), q))
    for q in rem[: size - sum(base)]:
        base[q] += 1
    while sum(base) < size:
        base[rem[0]] += 1
    return tuple(base)


class _Cutter:
    """Stage times t_s(i, j) of the stages of one (groups, shares, M, v)."""

    def __init__(self, tab, groups, shares, v, recompute):
        self.tab, self.groups, self.v = tab, groups, v
        p_count, nb = len(groups), tab.num_blocks
        self.n_s = p_count * v
        # Per group: distinct (type, samples) pairs; their work is what max() needs.
        self.kinds = [sorted({(tab.gpu_types[g], n) for g, n in zip(gs, ns)}) for gs, ns in zip(groups, shares)]
        self.recompute = recompute
        # Per group p: the boundary towards group p+1 (mod P) at cut j, 2 (xfer + lat).
        self.bnd = []
        for p in range(p_count):
            q = (p + 1) % p_count
            classes = {tab.pair_bw_class[g][h] for g in groups[p] for h in groups[q]}
            lat = max(tab.pair_lat[g][h] for g in groups[p] for h in groups[q])
            self.bnd.append([2 * (max(tab.xfer[c][j] for c in classes) + lat) for j in range(nb + 1)])

    def time(self, s: int, i: int, j: int) -> int:
        tab, p = self.tab, s % len(self.groups)
        rc = self.recompute[p]
        comp = 0
        for t, n in self.kinds[p]:
            w = n * (tab.work_prefix[t][j] - tab.work_prefix[t][i]) + tab.fixed_prefix[t][j] - tab.fixed_prefix[t][i]
            if rc:
                w += n * (tab.rc_work_prefix[t][j] - tab.rc_work_prefix[t][i]) \
                    + tab.rc_fixed_prefix[t][j] - tab.rc_fixed_prefix[t][i]
            comp = max(comp, w)
        return comp + (self.bnd[p][j] if s < self.n_s - 1 else 0)

    def greedy(self, limit: int) -> list[int] | None:
        """Cuts with every stage time <= limit, each stage taking as many blocks as fit."""
        nb, cuts, i = self.tab.num_blocks, [0], 0
        for s in range(self.n_s - 1):
            best = None
            for j in range(i + 1, nb - (self.n_s - s - 1) + 1):
                if self.time(s, i, j) <= limit:
                    best = j
            if best is None:
                return None
            cuts.append(best)
            i = best
        if self.time(self.n_s - 1, i, nb) > limit:
            return None
        return cuts + [nb]

    def min_max(self) -> list[int] | None:
        nb = self.tab.num_blocks
        if self.n_s > nb:
            return None
        lo, hi = 0, max(self.time(s, 0, nb) for s in range(len(self.groups)))
        best = self.greedy(hi)
        if best is None:
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            cuts = self.greedy(mid)
            if cuts is None:
                lo = mid + 1
            else:
                hi, best = mid, cuts
        return best


def _score(tab, cuts, stage_gpus, samples, memory, v,
           pair_cache: dict | None = None) -> tuple[tuple[int, int], StageUnits, MemoryPolicy]:
    blocks = tuple(zip(cuts[:-1], cuts[1:]))
    pol = fill_policy(tab, blocks, stage_gpus, samples, memory=memory)
    u = evaluate_units(tab, blocks, stage_gpus, samples, pol, v, pair_cache=pair_cache)
    breach = sum(u.uncovered) + sum(max(0, need - tab.cap_bytes[g])
                                    for gs, needs in zip(stage_gpus[: len(stage_gpus) // v], u.memory)
                                    for g, need in zip(gs, needs))
    return (breach, u.step), u, pol


def _local_search(tab, cuts, stage_gpus, samples, memory, v):
    seen: dict[tuple[int, ...], tuple[int, int]] = {}  # cuts -> key: a move undone in the next pass is not re-scored
    pairs: dict = {}  # the boundaries' GPU-pair terms: only the cuts move (objective.evaluate_units)

    def score(c):
        k = tuple(c)
        if k not in seen:
            seen[k] = _score(tab, c, stage_gpus, samples, memory, v, pairs)[0]
        return seen[k]

    key = score(cuts)
    for _ in range(MAX_PASSES):
        improved = False
        for k in range(1, len(cuts) - 1):
            for d in (-1, 1):
                c = cuts[k] + d
                if not cuts[k - 1] < c < cuts[k + 1]:
                    continue
                trial = cuts[:k] + [c] + cuts[k + 1:]
                tkey = score(trial)
                if tkey < key:
                    key, cuts, improved = tkey, trial, True
        if not improved:
            break
    return key, cuts


def interleave_search(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions,
                      base: SolverResult, target_s: float | None = None
                      ) -> tuple[SolverResult | None, tuple[Candidate, ...]]:
    """The fastest feasible interleaved version of ``base``'s GPU groups (see
    [Note: interleave search]) and a ``Candidate`` per (v, M, policy) tried. The
    result is None when nothing was tried or nothing fits; it is returned even
    when slower than ``base`` (``with_interleaving`` compares). ``target_s``: the step
    the result must beat (s; ``with_interleaving``'s), the local-search bar until a
    try beats it. The local searches run in waves of ``WAVE``, side by side in up to
    ``options.jobs`` forked children, each wave against the bar of its start, so
    the result is the same for every ``jobs``."""
    d = base.decision
    p_count = d.num_stages
    if options.max_interleave < 2 or options.schedule != "1f1b" or d.interleave != 1 or p_count < 2:
        return None, ()
    if any(mem.optimizer == "host" or mem.activations == "host" for mem in d.memory):
        return None, ()  # an offloaded plan is a last resort for memory; interleaving only adds to it
    gbs = options.global_batch_size
    groups = d.stage_gpus
    policies = _policies(devices, options, d)
    ladders = _ladders(devices, options, d)
    # Every (M, v, policy) is scored at its min-max cuts first; the local search then runs
    # in order of that score and skips a try whose score is LOCAL_SEARCH_SLACK x the best
    # step found ([Note: interleave search]).
    def starts_of(m: int, shares):  # the M's tables and its (key, v, policy, cuts, args) tries
        tab = build_tables(costs, devices, options, m)
        out = []
        for v in range(2, options.max_interleave + 1):
            if p_count * v > costs.num_blocks:
                break
            stage_gpus, samples = groups * v, shares * v
            for memory in policies:
                rc = tuple(mem.recompute for mem in memory)
                cuts = _Cutter(tab, groups, shares, v, rc).min_max()
                if cuts is None:
                    continue
                args = (stage_gpus, samples, memory * v, v)
                key, *_ = _score(tab, cuts, *args)
                out.append((key, v, rc, cuts, args))
                if key[0] and memory == policies[0]:  # the base's policy breaches: per chunk, as it needs
                    chunked = _fit_chunks(tab, cuts, stage_gpus, samples, memory * v, v, ladders)
                    if chunked is not None:
                        key, chunk_memory = chunked
                        out.append((key, v, tuple(m.recompute for m in chunk_memory), cuts,
                                    (stage_gpus, samples, chunk_memory, v)))
        return tab, out

    jobs = work_jobs(options, devices.num_gpus)
    per_m = []
    for m in microbatch_candidates(options):
        shares = tuple(rescale_shares(tuple(ns), gbs // m) for ns in d.samples_per_microbatch)
        if not any(s is None for s in shares):
            per_m.append((m, shares))
    starts = []  # the M's side by side (forked children), in M order
    for (m, _), (ok, answer) in zip(per_m, map_isolated([partial(starts_of, m, sh) for m, sh in per_m], jobs)):
        if not ok:
            raise answer
        tab, tries = answer
        starts += [(key, len(starts) + k, m, v, rc, tab, cuts, args)
                   for k, (key, v, rc, cuts, args) in enumerate(tries)]
    best, tried = None, []
    order = sorted(starts, key=lambda x: x[:2])
    target = round(target_s / UNIT_S) if target_s is not None else None
    for w in range(0, len(order), WAVE):
        wave = order[w:w + WAVE]
        # The bar of the wave's start: the best try so far, or the step the result must beat.
        bar = min([x for x in (best[0] if best is not None else None, target) if x is not None], default=None)
        # A try whose start is over the slack behind is not searched, whether or not it fits: moving
        # cuts to fit memory does not make it faster.
        search = [bar is None or key0[1] <= LOCAL_SEARCH_SLACK * bar for key0, *_ in wave]
        found = iter(map_isolated([partial(_local_search, tab, cuts, *args)
                                   for (_, _, _, _, _, tab, cuts, args), go in zip(wave, search) if go], jobs))
        for (key0, _, m, v, rc, tab, cuts, args), go in zip(wave, search):
            if go:
                ok, answer = next(found)
                if not ok:
                    raise answer
                key, cuts = answer
            else:
                key = key0  # too far behind to catch up: not searched
            tried.append(Candidate(kind="interleave", interleave=v, num_microbatches=m, recompute_all=all(rc),
                                   step_time_s=key[1] * UNIT_S, feasible=key[0] == 0))
            if key[0] == 0 and (best is None or key[1] < best[0]):
                best = (key[1], m, v, cuts, *args[:3])
    if best is None:
        return None, tuple(tried)
    _, m, v, cuts, stage_gpus, samples, memory = best
    blocks = tuple(zip(cuts[:-1], cuts[1:]))
    ev = evaluate(costs, devices, options, Decision(
        stage_blocks=blocks, stage_gpus=stage_gpus, samples_per_microbatch=samples, num_microbatches=m,
        memory=memory, interleave=v, precision=d.precision))
    if not ev.feasible:  # cannot happen: the search scored the same model
        raise AssertionError(f"interleave search returned an infeasible plan: {ev.violations}")
    res = SolverResult.from_evaluation(ev, options=options, status=with_safety_stop(
                                           f"{with_safety_stop(base.status, 0)}+INTERLEAVED", base.wall_clock_stops),
                                       best_bound=base.best_bound)
    return res, tuple(tried)


def _policies(devices: DeviceGraph, options: PlanOptions, d: Decision) -> list[tuple[StageMemory, ...]]:
    """The per-group memory policies the search tries (step 3 of [Note: interleave search]), each group's
    on all of its stages: the base's own; recomputation on every group (the base's ZeRO levels) where
    ``options.recompute`` allows it and the base does not already; and host-stashed recomputation on every
    group ([C-stash]: ZeRO-2/3 groups as ZeRO-1) where ``options.stash`` allows it and every GPU of the
    groups has host memory. Each honours the flags' "always" ([Note: memory flags])."""
    base = tuple(d.memory)
    policies = [base]
    if options.recompute != "never" and not all(mem.recompute for mem in base):
        policies.append(tuple(StageMemory(zero=mem.zero, recompute=True) for mem in base))
    host = devices.host_memory_bytes or ()
    if options.stash != "never" and options.recompute != "never" and not all(mem.stash == "host" for mem in base) \
            and host and all(host[g] > 0 for gs in d.stage_gpus for g in gs):
        policies.append(tuple(StageMemory(zero=min(mem.zero, 1), recompute=True, stash="host") for mem in base))
    return [p for p in policies
            if (options.recompute != "always" or all(m.recompute for m in p))
            and (options.stash != "always" or all(m.stash == "host" for m in p))]


def _ladders(devices: DeviceGraph, options: PlanOptions, d: Decision) -> tuple[tuple[StageMemory, ...], ...]:
    """Per GPU group, the policies one of its chunks may take, in the order the per-chunk fit climbs them
    ([Note: per-chunk policies]): the base's, ZeRO-1 (a group of >= 2 GPUs, where ``options.sharding``
    allows it), whole-stage recomputation, host-stashed recomputation (where ``options.stash`` allows it and
    the group's GPUs have host memory); each allowed by the flags' "never" and "always"."""
    host = devices.host_memory_bytes or ()
    out = []
    for gpus, base in zip(d.stage_gpus, d.memory):
        zero = max(base.zero, 1) if len(gpus) >= 2 and options.sharding != "never" else base.zero
        steps = [base, dataclasses.replace(base, zero=zero)]
        if options.recompute != "never":
            steps.append(StageMemory(zero=zero, recompute=True))
            if options.stash != "never" and host and all(host[g] > 0 for g in gpus):
                steps.append(StageMemory(zero=min(zero, 1), recompute=True, stash="host"))
        out.append(tuple(m for m in dict.fromkeys(steps)
                         if (options.recompute != "always" or m.recompute)
                         and (options.stash != "always" or m.stash == "host")
                         and (options.sharding != "always" or m.zero or len(gpus) < 2)))
    return tuple(out)


def _fit_chunks(tab, cuts, stage_gpus, samples, memory, v, ladders):
    """[Note: per-chunk policies]: ``memory`` (one policy per chunk) with, while some GPU group breaches
    memory, one chunk of each breaching group moved one rung up its group's ladder: the chunk of the most
    activation bytes per sample among those with a rung left (the lowest index on ties); one scoring per
    round. (key, policies) of the first that fits, None if a breaching group runs out of rungs first."""
    n_s = len(stage_gpus)
    p_count = n_s // v
    memory = list(memory)
    acts = [tab.act_prefix[j] - tab.act_prefix[i] for i, j in zip(cuts[:-1], cuts[1:])]
    for _ in range(v * max(map(len, ladders), default=1)):
        key, u, _ = _score(tab, cuts, stage_gpus, samples, tuple(memory), v)
        if not key[0]:
            return key, tuple(memory)
        moved = False
        for p in range(p_count):
            if not (u.uncovered[p] or any(need > tab.cap_bytes[g] for g, need in zip(stage_gpus[p], u.memory[p]))):
                continue
            ladder = ladders[p]
            left = [s for s in range(p, n_s, p_count)
                    if memory[s] in ladder and ladder.index(memory[s]) + 1 < len(ladder)]
            if not left:
                return None
            s = max(left, key=lambda c: (acts[c], -c))
            memory[s] = ladder[ladder.index(memory[s]) + 1]
            moved = True
        if not moved:
            return None
    return None


def base_makespan_s(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions, base: SolverResult) -> float:
    """``base`` (one stage per group) scored like an interleaved decision (s):
    the runtime's point-to-point program replayed with fixed times
    (``pipeline_terms.program_ends``), each stage's sync from its own last
    backward's end ([Note: interleaved stages] with v = 1), so both sides of
    the comparison use the same measure. It is at most the closed form of the
    module note without its own-backward overlap (every sync offset by D_s
    alone; tests/test_interleave.py checks it on every plan it searches). The
    replay starts a stage's sync at its last backward's end, so
    [C-objective]'s overlap of the sync with that task can put the closed form
    below it."""
    from .objective import prepare

    d = base.decision
    tab, pol = prepare(costs, devices, options, d)
    u = evaluate_units(tab, d.stage_blocks, d.stage_gpus, d.samples_per_microbatch, pol, task_graph=True)
    return u.step * UNIT_S


def with_interleaving(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions,
                      base: SolverResult) -> SolverResult:
    """``base``, or its interleaved version when the objective scores that faster
    than both ``base``'s step and ``base_makespan_s`` (the same measure).

    The interleaved result's status is ``<base status>+INTERLEAVED`` and its
    bound the smaller of ``base``'s and the throughput bound (see the note);
    every try is appended to ``candidates`` (a ``Candidate`` of kind "interleave").
    When nothing could be tried (``max_interleave`` 1, "gpipe", one stage)
    ``base`` itself is returned."""
    from .bounds import throughput_bound_s

    t0 = time.perf_counter()
    d = base.decision
    if options.max_interleave < 2 or options.schedule != "1f1b" or d.interleave != 1 or d.num_stages < 2:
        return base  # nothing to try (interleave_search's own test, before pricing the target)
    target = min(base.predicted_step_time_s, base_makespan_s(costs, devices, options, base))
    res, tried = interleave_search(costs, devices, options, base, target_s=target)
    if not tried:  # interleaving off, or nothing it could try: ``base`` itself
        return base
    records = tuple(tried)
    if res is None or res.predicted_step_time_s >= target:
        return dataclasses.replace(base, candidates=tuple(base.candidates) + records,
                                   wall_s=base.wall_s + time.perf_counter() - t0)
    bound = min(base.best_bound, throughput_bound_s(costs, devices, options))
    step = res.predicted_step_time_s
    return dataclasses.replace(res, best_bound=bound, optimality_gap=(step - bound) / step if step > 0 else 0.0,
                               candidates=tuple(base.candidates) + records, wall_clock_stops=base.wall_clock_stops,
                               wall_s=base.wall_s + time.perf_counter() - t0)
