"""Mechanism shared by the baseline planners (policy lives in one module per
method, ``zorse_fx/baselines``) and the stage DP (``stage_dp.py``).

Every baseline proposes concrete decisions (stage blocks, stage GPUs, samples
per GPU, micro-batch count) and lets :class:`Selector` score them with the
planners' own step-time model (``zorse_fx.solve.objective``), so a baseline and
the CP-SAT planner are compared on exactly the same numbers.

[Note: how a baseline picks among its candidates]
A method that enumerates choices (pipeline degree, micro-batch count, GPU
grouping) keeps the candidate with the smallest predicted step time among
those ``evaluate`` accepts (memory fits, no idle GPU when idling is not
allowed, at most ``max_stages`` stages); ties: fewer stages, then fewer
micro-batches (as the solver). If no candidate is accepted, the fastest
candidate is returned anyway with status "BASELINE_INFEASIBLE" and its
violations in the ``candidates`` entry with ``chosen`` set, so a
benchmark can report the method as infeasible instead of dropping it.

[Note: memory techniques of the baselines]
The published systems train with memory techniques the shared model knows:
Megatron-LM's distributed optimizer is ZeRO-1 and it recomputes activations
("full" recomputation); Cephalo, Zorse and FlashFlex shard training state
across a data-parallel group (FSDP / ZeRO); Metis' and FlashFlex's planners
check memory. So every baseline gets what ``PlanOptions.sharding`` /
``recompute`` allow ([C-shard], [C-recompute] in ``objective``): for each
decision ``Selector.add`` tries the uniform variants the options allow --
plain, every multi-GPU stage sharded, every stage recomputing, both
(``memory_variants``), each with the ZeRO-2/3 and offload layouts an "always"
of their flags asks (``memory_policy.uniform_memory``; [Note: memory flags] in
``zorse_fx/options.py``) -- and keeps the best by (infeasible?, step). Per-stage
mixes are the CP-SAT planner's search, not a baseline's. A sharded stage's
shards are ``objective.balance_shards``' split unless the method passes its
own ``MemoryPolicy`` (Cephalo: shards by free memory). With both options
"never" (the default) every baseline is scored exactly as before the
techniques existed. Methods whose own heuristics read memory (Cephalo's batch
caps, Metis' layer balancer, FlashFlex's memory-proportional layers) use
``stage_fits`` / the replicated part of the state under the variant at hand.

Legend: ``B`` blocks, ``G`` GPUs, ``S`` stages, ``M`` micro-batches, ``b`` =
samples per micro-batch. Times in seconds unless a name says ``units`` (1 ns).
"""

from __future__ import annotations

import functools
import time
from collections import Counter

import numpy as np

from ..errors import InfeasiblePlanError
from ..ir.costs import BlockCosts
from ..ir.devices import DeviceGraph
from ..ir.memory import StageMemory
from ..ir.result import Candidate, SolverResult
from ..options import PlanOptions
from ..solve.memory_policy import stash_device_kib, uniform_memory
from ..solve.objective import (
    MIB_UNITS,
    UNIT_S,
    MemoryPolicy,
    build_tables,
    evaluate,
    evaluate_units,
    fill_policy,
    inflight,
    mode_violations,
    policy_decision,
)
from ..solve.state_terms import (extra_copies_matrix, gathered_weight_matrix, grad_shard_kib,
                                 grad_transient_matrix, stage_state_kib, transient_kib)

__all__ = ["Selector", "gpu_speeds", "largest_remainder", "proportional_cuts", "reference_block_work",
           "bandwidth", "min_max_partition", "min_max_partition_arrays", "memory_variants", "stage_act_kib",
           "memory_groups", "stage_fits", "StageMatrices"]

_MODE_FLAGS = {"never": (False,), "auto": (False, True), "always": (True,)}


def memory_variants(options: PlanOptions) -> tuple[StageMemory, ...]:
    """The uniform per-stage policies ``options`` allow before their "always" flags, as ``StageMemory``
    records: ZeRO-1 (``zero`` 1) or not, recomputation or not, in the order plain, sharded, recompute, both
    (see [Note: memory techniques of the baselines]); sharding applies to the stages with >= 2 GPUs only
    (``uniform_memory`` adds what an "always" asks)."""
    sh, rc = _MODE_FLAGS[options.sharding], _MODE_FLAGS[options.recompute]
    return tuple(StageMemory(zero=int(a), recompute=b) for b in rc for a in sh)


def stage_act_kib(tab, s: int, n_s: int, i: int, j: int, n: int, *, recompute: bool) -> int:
    """Activation KiB of a GPU with ``n`` samples on stage ``s`` of ``n_s``
    (blocks [i, j)), as [C-memory]: in-flight micro-batches x n x A_s, or with
    recomputation n x (in-flight x X_s + A_s) (X_0 = 0)."""
    fl = inflight(tab.schedule, n_s, s, tab.num_microbatches)
    a = tab.act_prefix[j] - tab.act_prefix[i]
    return n * (fl * (tab.cut_kib[i] if s > 0 else 0) + a) if recompute else fl * n * a


def memory_groups(tab, gpus, samples) -> tuple[tuple[tuple[int, int], int], ...]:
    """A stage's GPUs as distinct ((samples, usable KiB), count) pairs, the
    input of ``stage_fits`` (GPUs alike in both behave alike in memory)."""
    return tuple(sorted(Counter((n, tab.cap_bytes[g]) for g, n in zip(gpus, samples)).items()))


def stage_fits(tab, s: int, n_s: int, i: int, j: int, groups, *, memory: StageMemory) -> bool:
    """Whether stage ``s`` of ``n_s`` (blocks [i, j), GPUs as ``memory_groups``)
    fits memory under the policy ``memory`` (its ZeRO level and recomputation;
    no offload). Unsharded (or one GPU), every GPU holds the whole state plus
    its activations; sharded, every GPU holds the replicated part plus its
    activations and the memory left over, in whole MiB, holds the shardable
    part -- exactly when ``objective.fill_policy`` finds shards satisfying
    [C-memory] and [C-shard] (ZeRO-2/3: with their replicated and shardable
    parts, [C-grad-shard], [C-param-shard])."""
    from .objective import sharded_state_kib

    state, shard = stage_state_kib(tab, i, j)  # [C-tied]: a tied parameter once per stage
    a = tab.act_prefix[j] - tab.act_prefix[i]

    def act(n):  # with [Note: gradient transients] (state_terms.py)
        if memory.stash == "host":  # [C-stash]: its device part (host memory is the offload checks')
            return stash_device_kib(tab, s, n_s, i, j, n)
        return stage_act_kib(tab, s, n_s, i, j, n, recompute=memory.recompute) + transient_kib(tab, i, j, n, a)

    if not memory.zero or sum(c for _, c in groups) < 2:
        return all(state + act(n) <= cap for (n, cap), _ in groups)
    rep, shard = sharded_state_kib(tab, i, j, memory.zero)
    free = [(cap - rep - act(n), c) for (n, cap), c in groups]
    return min(f for f, _ in free) >= 0 and MIB_UNITS * sum(c * (f // MIB_UNITS) for f, c in free) >= shard


def gpu_speeds(costs: BlockCosts, devices: DeviceGraph) -> tuple[float, ...]:
    """``(G,)`` samples/s of each GPU on the whole model: 1 / sum of its type's
    per-sample block times (fixed per-micro-batch costs ignored)."""
    total = {t: sum(costs.fwd_bwd_s_per_sample[t]) for t in set(devices.gpu_types)}
    return tuple(1.0 / total[t] if total[t] > 0 else float("inf") for t in devices.gpu_types)


def bandwidth(devices: DeviceGraph, g: int, h: int) -> float:
    """Link bandwidth between GPUs g and h in bytes/s (slower direction, as the model)."""
    return min(devices.link_bw_bytes_per_s[g][h], devices.link_bw_bytes_per_s[h][g])


def largest_remainder(total: int, weights, minimum: int = 1) -> tuple[int, ...]:
    """Integers >= ``minimum`` summing to ``total``, proportional to ``weights``
    (Hamilton / largest-remainder method; ties go to the lower index). Entries
    that round below ``minimum`` are raised to it, taking one at a time from
    the entry most above its quota. Raises ValueError if ``total`` is too small."""
    w = [float(x) for x in weights]
    n = len(w)
    if n == 0 or total < minimum * n:
        raise ValueError(f"cannot give {n} parts >= {minimum} each out of {total}")
    wsum = sum(w)
    quota = [total * x / wsum for x in w] if wsum > 0 else [total / n] * n
    out = [int(q) for q in quota]
    for i in sorted(range(n), key=lambda i: (-(quota[i] - out[i]), i))[: total - sum(out)]:
        out[i] += 1
    for i in range(n):
        while out[i] < minimum:
            j = max((j for j in range(n) if out[j] > minimum), key=lambda j: (out[j] - quota[j], -j))
            out[j] -= 1
            out[i] += 1
    return tuple(out)


def reference_block_work(costs: BlockCosts, devices: DeviceGraph) -> tuple[float, ...]:
    """``(B,)`` each block's share of the model's per-sample work, averaged over
    the GPU types present (so a proportional split does not favour one type)."""
    types = sorted(set(devices.gpu_types))
    nb = costs.num_blocks
    out = [0.0] * nb
    for t in types:
        w = costs.fwd_bwd_s_per_sample[t]
        tot = sum(w) or 1.0
        for k in range(nb):
            out[k] += w[k] / tot / len(types)
    return tuple(out)


def proportional_cuts(block_weights, shares) -> tuple[tuple[int, int], ...]:
    """Split blocks into ``len(shares)`` contiguous non-empty ranges whose
    weight fractions follow ``shares``: cut ``s`` goes to the block boundary
    whose cumulative weight fraction is nearest to the cumulative share
    (clamped so every range keeps >= 1 block)."""
    nb, n_s = len(block_weights), len(shares)
    if not 1 <= n_s <= nb:
        raise ValueError(f"cannot split {nb} blocks into {n_s} non-empty stages")
    tot_w = sum(block_weights)
    pre = [0.0]
    for x in block_weights:
        pre.append(pre[-1] + (x / tot_w if tot_w > 0 else 1.0 / nb))
    tot_s = sum(shares)
    cuts, acc = [0], 0.0
    for s in range(n_s - 1):
        acc += shares[s] / tot_s
        lo, hi = cuts[-1] + 1, nb - (n_s - 1 - s)
        cuts.append(min(range(lo, hi + 1), key=lambda c: (abs(pre[c] - acc), c)))
    cuts.append(nb)
    return tuple((cuts[s], cuts[s + 1]) for s in range(n_s))


def min_max_partition(nb: int, n_s: int, cost, fits=lambda s, i, j: True):
    """Contiguous split of ``nb`` blocks into ``n_s`` non-empty ranges minimising
    ``max_s cost(s, i, j)`` (callables; ``min_max_partition_arrays`` with the
    costs as matrices). Ranges with ``fits(s, i, j)`` False are excluded;
    returns None if no split fits."""
    inf = float("inf")
    mats = np.full((n_s, nb + 1, nb + 1), inf)
    for s in range(n_s):
        for i in range(nb):
            for j in range(i + 1, nb + 1):
                if fits(s, i, j):
                    mats[s, i, j] = cost(s, i, j)
    return min_max_partition_arrays(mats)


def min_max_partition_arrays(cost) -> tuple[tuple[int, int], ...] | None:
    """Contiguous split of B blocks into S non-empty ranges minimising the largest
    ``cost[s, i, j]`` (an (S, B+1, B+1) float array; inf where stage s may not
    hold blocks [i, j), and wherever i >= j), by dynamic program over the
    stages, one vectorised step each (O(S B^2)). Ties: the smallest start of
    each stage's range, from the last stage back. Returns the ranges as
    ((start, end), ...), or None if no split fits. Exact for integer costs
    below 2**53."""
    n_s, nb = cost.shape[0], cost.shape[1] - 1
    best = np.full(nb + 1, np.inf)
    best[0] = 0.0
    args = []
    cols = np.arange(nb + 1)
    for s in range(n_s):
        v = np.maximum(best[:, None], cost[s])  # [i, j]: the split's max if stage s takes [i, j)
        arg = np.argmin(v, axis=0)  # the first (smallest) i on ties
        best = v[arg, cols]
        args.append(arg)
    if not np.isfinite(best[nb]):
        return None
    parts, j = [], nb
    for s in range(n_s - 1, -1, -1):
        i = int(args[s][j])
        parts.append((i, j))
        j = i
    return tuple(parts[::-1])


class StageMatrices:
    """The integer terms of a stage over blocks [i, j) of ``tab`` (an
    ``objective.IntTables``) for every (i, j) at once: (B+1, B+1) int64
    matrices indexed [i, j] (meaningful where ``valid``: i < j), each tied
    parameter counted once per stage ([C-tied]). KiB for memory, units (ns)
    for time, as ``objective.py``. Shared by the stage DP and the Metis
    baseline, whose memory checks (``fits``) equal ``stage_fits`` entry by entry
    (tests/test_stage_dp.py)."""

    def __init__(self, tab):
        self.tab = tab
        self.nb = nb = tab.num_blocks
        ii, jj = np.meshgrid(np.arange(nb + 1), np.arange(nb + 1), indexing="ij")
        self.ii, self.jj = ii, jj
        self.valid = ii < jj
        pre = self.pre
        # [C-tied]: a stage over [i, j) holds each tied parameter once (state_terms.py).
        self.extra = extra = extra_copies_matrix(tab.tied_blocks, nb)
        self.state = pre(tab.state_prefix) - sum((e * tab.tied_state[t] for t, e in extra), np.int64(0))
        self.shard = pre(tab.shard_prefix) - sum((e * tab.tied_shard[t] for t, e in extra), np.int64(0))
        self.act = pre(tab.act_prefix)
        self.gtr = grad_transient_matrix(tab)  # [Note: gradient transients]
        self.cut_in = np.asarray(tab.cut_kib, dtype=np.int64)[:, None]  # X of a stage starting at i
        self.work = {t: pre(p) for t, p in tab.work_prefix.items()}
        self.fixed = {t: pre(p) for t, p in tab.fixed_prefix.items()}
        self.rc_work = {t: pre(p) for t, p in tab.rc_work_prefix.items()}
        self.rc_fixed = {t: pre(p) for t, p in tab.rc_fixed_prefix.items()}

    @staticmethod
    def pre(p) -> np.ndarray:
        """[i, j] = p[j] - p[i] of a prefix sum ``p``."""
        a = np.asarray(p, dtype=np.int64)
        return a[None, :] - a[:, None]

    @functools.cached_property
    def stash(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """[C-stash]'s (kept, peak, inputs) KiB per sample of a stage over [i, j), as
        ``memory_policy.stash_units``: cut_i + cut_j; max_k A_k + 2 max_k cut_k; sum_k cut_k (k in [i, j))."""
        tab, nb = self.tab, self.nb
        cut = np.asarray(tab.cut_kib, dtype=np.int64)
        act = np.diff(np.asarray(tab.act_prefix, dtype=np.int64))
        peak = np.zeros((nb + 1, nb + 1), dtype=np.int64)
        for i in range(nb):
            peak[i, i + 1:] = np.maximum.accumulate(act[i:]) + 2 * np.maximum.accumulate(cut[i:nb])
        return cut[:, None] + cut[None, :], peak, self.pre(np.concatenate([[0], np.cumsum(cut[:nb])]))

    def stash_kib(self, n: int, fl: int) -> np.ndarray:
        """[C-stash]: device KiB of a GPU with ``n`` samples, ``fl`` micro-batches in flight, with the
        transients beyond it (as ``objective``'s), for every (i, j)."""
        kept, peak, _ = self.stash
        dev = n * (fl * kept + peak)
        return dev + np.maximum(0, self.gtr - dev)

    def act_kib(self, n: int, fl: int, not_first: bool, recompute: bool) -> np.ndarray:
        """Activation KiB of a GPU with ``n`` samples (``stage_act_kib``), ``fl``
        micro-batches in flight, for every (i, j)."""
        if recompute:
            return n * (fl * (self.cut_in if not_first else 0) + self.act)
        return fl * n * self.act

    def transient(self, n: int) -> np.ndarray:
        """``state_terms.transient_kib`` of a GPU with ``n`` samples, for every (i, j)."""
        return np.maximum(0, self.gtr - n * self.act)

    @functools.cached_property
    def zero23(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(ZeRO-2 replicated, ZeRO-2 shardable, ZeRO-3 replicated, ZeRO-3 shardable)
        KiB matrices of a sharded stage over [i, j) (``objective.sharded_state_kib``:
        [C-grad-shard], [C-param-shard]); computed on first use (O(B^2) Python)."""
        tab, nb, pre, extra = self.tab, self.nb, self.pre, self.extra
        up, down, tr = (np.zeros_like(self.state) for _ in range(3))
        for i in range(nb):
            for j in range(i + 1, nb + 1):
                up[i, j], down[i, j], tr[i, j] = grad_shard_kib(tab, i, j)
        rep = self.state - self.shard
        # [C-param-shard]: the weights move into the shards; GATHERED_UNITS consecutive blocks' and the
        # tied weights stay gathered.
        grads = pre(tab.grad_kib_prefix) - sum((e * tab.tied_grad_kib[t] for t, e in extra), np.int64(0))
        return (rep - np.minimum(down, rep) + tr, self.shard + up,
                tr + gathered_weight_matrix(tab) + np.maximum(0, grads - up), self.state - grads + up)

    def layout(self, zero: int):
        """(replicated, shardable) KiB matrices of a sharded stage under its ZeRO
        level ``zero`` (``objective.sharded_state_kib``: ZeRO-1, [C-grad-shard],
        [C-param-shard])."""
        if zero == 3:
            return self.zero23[2:]
        if zero == 2:
            return self.zero23[:2]
        return self.state - self.shard, self.shard

    def fits(self, mem, fl: int, not_first: bool, policy: StageMemory) -> np.ndarray:
        """[C-memory] / [C-shard] for every (i, j) at once (``stage_fits``), the
        stage's GPUs as ``memory_groups``, under ``policy``'s ZeRO level,
        recomputation and activation placement ("host": one micro-batch's
        activations on the GPU, [C-act-offload]); its optimizer placement is
        not read (``stage_dp``'s offload check)."""
        def act(n):  # with [Note: gradient transients]
            if policy.stash == "host":  # [C-stash]
                return self.stash_kib(n, fl)
            return (n * self.act if policy.activations == "host"
                    else self.act_kib(n, fl, not_first, policy.recompute)) + self.transient(n)

        ok = np.ones_like(self.valid)
        if not policy.zero:  # (stage_fits also treats a one-GPU stage as unsharded; callers pass zero=0)
            for (n, cap), _ in mem:
                ok &= self.state + act(n) <= cap
            return ok
        rep, need = self.layout(policy.zero)
        held = np.zeros_like(self.state)
        for (n, cap), c in mem:
            free = cap - rep - act(n)
            ok &= free >= 0
            held += c * (np.maximum(free, 0) // MIB_UNITS)
        return ok & (MIB_UNITS * held >= need)


class Selector:
    """Scores candidate decisions with the shared model; keeps the best per
    (S, M) and overall (see [Note: how a baseline picks among its candidates])."""

    def __init__(self, name: str, costs: BlockCosts, devices: DeviceGraph, options: PlanOptions):
        self.name, self.costs, self.devices, self.options = name, costs, devices, options
        self.t0 = time.perf_counter()
        self._tables: dict[int, object] = {}
        #: {(S, M): (rank key, decision, MemoryPolicy)}; rank key = (infeasible?, step units).
        self._best: dict[tuple[int, int], tuple[tuple[int, int], tuple, MemoryPolicy]] = {}
        #: The same over the policies without sharded gradients (ZeRO-2): the CP-SAT model's warm
        #: starts, as it has no ZeRO-2 ([Note: ZeRO-2 outside CP-SAT] in ``zorse_fx/portfolio.py``).
        self._best_plain: dict[tuple[int, int], tuple[tuple[int, int], tuple, MemoryPolicy]] = {}

    def tables(self, m: int):
        """Integer tables of the model for M micro-batches (cached)."""
        if m not in self._tables:
            self._tables[m] = build_tables(self.costs, self.devices, self.options, m)
        return self._tables[m]

    def add(self, stage_blocks, stage_gpus, samples, m: int, policy: MemoryPolicy | None = None) -> int:
        """Score one decision; returns its step time in units (1 ns).

        ``policy`` None: every variant of ``memory_variants(options)`` is
        scored (shards by ``balance_shards``) and the best by (infeasible?,
        step) is kept, plain first on ties; else the method's own policy."""
        tab = self.tables(m)
        dec = (tuple(map(tuple, stage_blocks)), tuple(map(tuple, stage_gpus)), tuple(map(tuple, samples)), m)
        blocks, gpus, ns = dec[:3]
        if policy is None:
            per_stage = dict.fromkeys(tuple(StageMemory(zero=v.zero if len(gs) >= 2 else 0, recompute=v.recompute)
                                            for gs in gpus) for v in memory_variants(self.options))
            # each with what the options' "always" asks ([Note: memory flags] in zorse_fx/options.py)
            policies = [fill_policy(tab, blocks, gpus, ns, memory=uniform_memory(self.options, gpus, variant))
                        for variant in per_stage]
        else:
            policies = [policy]
        ok_shape = len(blocks) <= self.options.max_stages
        ok_shape &= self.options.allow_idle_gpus or sum(map(len, gpus)) == self.devices.num_gpus
        best = plain = None
        pairs: dict = {}  # the boundaries' pair terms, shared by the policies (objective.evaluate_units)
        for pol in policies:
            u = evaluate_units(tab, blocks, gpus, ns, pol, pair_cache=pairs)
            ok = ok_shape and u.fits(tab, gpus) and not mode_violations(self.options, gpus, pol)
            key = (0 if ok else 1, u.step)
            if best is None or key < best[0]:
                best = (key, pol)
            if (all(m.zero < 2 and m.optimizer == m.activations == m.stash == "device" for m in pol.memory)
                    and (plain is None or key < plain[0])):
                plain = (key, pol)
        s_m = (len(blocks), m)
        for kept, found in ((self._best, best), (self._best_plain, plain)):
            if found is not None and (s_m not in kept or found[0] < kept[s_m][0]):
                kept[s_m] = (found[0], dec, found[1])
        return best[0][1]

    def best_step_s(self) -> float | None:
        """The fastest feasible decision's step time so far (s), None if none fits."""
        steps = [step for (bad, step), _, _ in self._best.values() if not bad]
        return min(steps) * UNIT_S if steps else None

    def result(self, why_none: str = "") -> SolverResult:
        """The chosen decision as a SolverResult (status BASELINE / BASELINE_INFEASIBLE).
        Raises InfeasiblePlanError if no candidate was formed."""
        if not self._best:
            raise InfeasiblePlanError(f"{self.name}: no candidate plan can be formed: {why_none}")
        # Feasible first, then step time, then fewer stages, then fewer micro-batches.
        s_m = min(self._best, key=lambda k: (self._best[k][0], k))
        cands = []
        for k in sorted(self._best):
            (bad, step), (blocks, gpus, samples, m), pol = self._best[k]
            ev = evaluate(self.costs, self.devices, self.options, policy_decision(blocks, gpus, samples, m, pol))
            assert ev.objective_units == step and ev.feasible == (not bad), (ev, step, bad)
            cands.append(Candidate(kind="heuristic", num_stages=k[0], num_microbatches=k[1], method=self.name,
                                   status="BASELINE" if ev.feasible else "BASELINE_INFEASIBLE",
                                   step_time_s=step * UNIT_S, feasible=ev.feasible,
                                   violations=tuple(ev.violations), chosen=k == s_m,
                                   stage_memory=ev.decision.memory,
                                   state_shard_bytes=tuple(tuple(row) for row in ev.decision.shard_bytes())))
            if k == s_m:
                chosen = ev
        return self._record(chosen, tuple(cands))

    def feasible_per_candidate(self, *, plain: bool = False) -> tuple[SolverResult, ...]:
        """The best feasible decision of every (S, M) scored, fastest first
        (status BASELINE; ``candidates`` empty): warm starts for CP-SAT
        (``plain``: the best without sharded gradients, which CP-SAT's
        model can express)."""
        out = []
        kept = self._best_plain if plain else self._best
        for k in sorted(kept, key=lambda k: (kept[k][0], k)):
            (bad, _), (blocks, gpus, samples, m), pol = kept[k]
            if bad:
                continue
            ev = evaluate(self.costs, self.devices, self.options, policy_decision(blocks, gpus, samples, m, pol))
            out.append(self._record(ev, ()))
        return tuple(out)

    def _record(self, ev, cands) -> SolverResult:
        # No lower bound is known: bound 0, gap (obj - 0) / obj = 1.
        return SolverResult.from_evaluation(
            ev, options=self.options, status="BASELINE" if ev.feasible else "BASELINE_INFEASIBLE", best_bound=0.0,
            wall_s=time.perf_counter() - self.t0, candidates=cands)
