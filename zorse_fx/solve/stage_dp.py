"""Memory-first stage dynamic program: a fast feasible plan for the portfolio.

[Note: stage DP]
CP-SAT can stop at its time limit without any incumbent when memory is tight
(Zorse B: Llama-2 13B on 64 GPUs, half of them 16 GB; bench/LOG.md, "Scenario
benchmark, third results"),
and the baselines' fixed recipes (one stage; layers by speed) overflow the
small GPUs. This module searches the space of Alpa's and Metis' stage DPs --
contiguous stages over an *ordered* list of GPU units -- with heterogeneous,
memory-checked stages, and returns the best plan it finds in well under a
second per (order, M) on 64 GPUs:

  units    u_0 ... u_{U-1}: the GPUs of one type on one node (cut into runs
           of at most b GPUs, the most a stage can hold: 8 A100s of one
           node at b = 4 are two units of 4), in one of
           ``ORDERS`` (cluster-file order keeps regions and racks together;
           memory-richest first puts the big GPUs on the early stages, which
           hold the most in-flight micro-batches under 1F1B; fastest first;
           fastest last: the last stage holds one micro-batch in flight, so
           fast GPUs there take many blocks without recomputation -- Zorse A's
           H100s: 87% of the bound last vs 79% first, the same section of
           bench/LOG.md).
           Above ``MAX_UNITS`` units, neighbouring units of one type and
           memory merge pairwise (up to b GPUs).
  stage    units [u0, u1) x blocks [i, j). Its b = global batch / M samples
           per micro-batch are split over its GPUs by whole-model speed
           (largest remainder, >= 1 each, so a stage has at most b GPUs).
  variant  a memory policy of the ones ``options`` allow (plain, ZeRO-1
           sharded, recomputing, both: ``heuristics.memory_variants``),
           kept iff [C-memory] / [C-shard] hold (``stage_fits``, exact).
  cost     c = (M + S - 1) * (compute + boundary) + allreduce + optim of the
           cheapest fitting variant, with the boundary on the link to the next
           unit: a per-stage proxy of [C-objective] (step <= sum_s t_s +
           (M - 1) max_s t_s + max_s sync_s <= max_s c_s + (S - 1) max_s t_s
           with sync_s = allreduce_s + optim_s; the proxy leaves out the
           drain and own-backward offsets, and the objective's sync term
           max(allreduce_s - ..., L_s - D_s) is <= allreduce_s up to the
           last bucket's rounding, so the proxy is an approximate upper
           bound, used only to rank splits, never to prune or bound).
  DP       best[s][u][j] = min over (u0, i) of max(best[s-1][u0][i], c(s; u0..u; i..j)),
           one DP per total S (in-flight micro-batches of stage s are
           min(S - s, M)), vectorised over the block indices with numpy.
           With ``allow_idle_gpus`` the stages may cover a prefix of the
           order (the units after it idle: the slowest ones in "speed"
           order), e.g. when S stages of <= b GPUs cannot hold every GPU.

Every (order, S, M) answer is then scored exactly by the shared objective
(``objective.evaluate``, via the baselines' ``Selector``, with the DP's
per-stage policy and with each uniform policy) and the best feasible one is
returned with status "STAGE_DP". The portfolio (``zorse_fx/portfolio.py``) hands it to
CP-SAT as a hint like the baselines' plans, and returns it when CP-SAT finds
nothing better.

[Note: ZeRO-2 in the stage DP]
Sharded gradients ([C-grad-shard] in ``objective.py``) win only through the
memory they free (their sync is never cheaper than ZeRO-1's), i.e. where a
split recomputes or does not fit. The DP over every variant at once picks
other splits (its proxy is not the objective: a Zorse A split 1.7% slower),
and running it for every (M, order, S) doubled the DP's time on Zorse C for
no gain. So the search runs in two passes: pass 1 the variants without
ZeRO-2 for every (M, order, S), each split scored by the objective; pass 2
the DP with ZeRO-2 too (the plain splits tie-win) for the (M, order, S)
whose pass-1 split recomputes and is within ``recompute_gain`` (4/3 with the
backward at twice the forward: the most that dropping recomputation can
save) of pass 1's best, plus, for each
of those (M, order), the stage count just below the fewest that fit without
ZeRO-2 (fewer stages, less bubble, that ZeRO-2 may make fit). Where no split
fits at all in pass 1, pass 2 runs for every key (Zorse B before ZeRO-2 had
no plan). Both passes' splits are scored and the best kept. Measured in
bench/LOG.md ("ZeRO-2 through the stage DP", "pass 2 pruned").

[Note: offload in the stage DP]
Optimizer offload ([C-offload], with any layout, ZeRO-3 included) frees the
optimizer's state from the GPU at the price of a host-link round trip and a
CPU step every step; activation offload ([C-act-offload]) frees the in-flight
activations at 2 x their bytes over the host link per micro-batch. Neither is
priced as overlapped, so neither beats a plan that fits without it unless
memory forbids that plan. So pass 3, the DP with the offload variants too
(every variant of the earlier passes with an offload), runs only when passes
1 and 2 found no split at all (or an offload is "always"), for every
(M, order, S) key, and only on tables with host memory. A cluster that fits
without offload plans exactly as before, in the same time.

[Note: a tied model's ends on one node]
A parameter tied across blocks (GPT-2's and SmolLM2's embedding, read by the first block and the LM
head) makes the first and last stages sum its gradients every step ([C-tied] in ``state_terms.py``),
over the link between their GPUs; contiguous stages over an order put those two stages on the order's
first and last units, usually two nodes apart. On AMP's cluster (12 V100s on 3 nodes + 4 T4s, 3.1 GB/s
between nodes) GPT-2 medium's 51M-element embedding is ~206 MB of float32 gradient per step across
that link, and cb7ceac's CP-SAT plan, which put stages 0 and 2 on one node's GPUs (0, 1) and (2, 3),
was 13% faster than the stage DP's best; the DP could not express it. So for the orders in
``ENDS_ORDERS``, where the model ties a parameter across blocks, the DP also runs over the order with
its first unit cut in two halves, one first and one after the next k units (``_ends_orders``: k = the
following units of the first unit's GPU type, so a plan on that type alone, and k = all of them): the
first and last stages then share a node, and the sum runs over its intra-node link. AMP's plan
(bench/LOG.md, "A tied model's ends on one node"): 0.3638 -> 0.2810 s per step, four stages with the
first on v100-0's GPUs (0, 1) and the last on (2, 3). The cost: each of the two ends orders adds one or
two orders (one where the two k coincide), each a whole DP per M: up to four more orders on a tied model.

Legend: ``U`` units, ``B`` blocks, ``S`` stages, ``M`` micro-batches, ``b``
samples per micro-batch; times in integer units (1 ns), memory in KiB units.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from functools import partial

import numpy as np

from ..errors import InfeasiblePlanError
from ..ir.costs import BlockCosts
from ..ir.devices import DeviceGraph
from ..ir.memory import StageMemory
from ..ir.result import SolverResult
from ..options import PlanOptions
from .isolated import map_isolated, work_jobs
from .objective import MIB_UNITS, fill_policy, inflight, max_stage_count, microbatch_candidates
from .heuristics import StageMatrices

__all__ = ["solve_stage_dp", "stage_dp_search", "ORDERS", "ENDS_ORDERS", "MAX_UNITS"]

#: Unit orders tried (see the module note).
ORDERS = ("file", "memory", "speed", "speed_last")
#: Above this many units neighbouring alike units merge (the DP is O(S^2 U^2) numpy steps).
MAX_UNITS = 32
_INF = np.iinfo(np.int64).max // 4


def grad_variants(options: PlanOptions) -> tuple[StageMemory, ...]:
    """The per-stage memory policies the stage DP tries: ``heuristics.memory_variants``
    (ZeRO-1 or not, recomputation or not), each sharded one with ZeRO-2 off and / or on
    as ``options.grad_sharding`` allows ([C-grad-shard]), each ZeRO-2 one with ZeRO-3
    off and / or on as ``options.param_sharding`` allows ([C-param-shard]), each with
    optimizer offload off and / or on as ``options.offload`` allows ([C-offload]), and
    each without recomputation or ZeRO-2 with activation offload off and / or on as
    ``options.activation_offload`` allows ([C-act-offload]). A stage of one GPU takes
    a variant's ZeRO level as 0."""
    from .heuristics import memory_variants

    modes = {"never": (False,), "auto": (False, True), "always": (True,)}
    place = {False: "device", True: "host"}
    return tuple(StageMemory(zero=3 if ps else 2 if gs else v.zero, recompute=v.recompute, optimizer=place[of],
                             activations=place[ao], stash=place[st])
                 for v in memory_variants(options)
                 for gs in (modes[options.grad_sharding] if v.zero else (False,))
                 for ps in (modes[options.param_sharding] if gs else (False,))
                 for of in modes[options.offload]
                 for ao in ((False,) if gs or v.recompute else modes[options.activation_offload])
                 for st in (modes[options.stash] if v.recompute and not gs else (False,)))


def _level(variant: StageMemory) -> int:
    """The stage DP pass a variant joins: 0 (neither ZeRO-2 nor offload), 1 (ZeRO-2, or host-stashed
    recomputation: a way to recompute that holds less, [C-stash]), 2 (an offload)."""
    if variant.optimizer == "host" or variant.activations == "host":
        return 2  # (ZeRO-2 with offload: 2)
    return 1 if variant.zero >= 2 or variant.stash == "host" else 0


def _units(devices: DeviceGraph, tab, speeds, order: str) -> list[tuple[int, ...]]:
    """GPU units (one type on one node) in ``order``; alike neighbours merged above MAX_UNITS."""
    nodes = devices.node_names or tuple(str(g) for g in range(devices.num_gpus))
    by_key: dict[tuple[str, str], list[int]] = {}
    for g in range(devices.num_gpus):
        by_key.setdefault((nodes[g], devices.gpu_types[g]), []).append(g)
    # File order of first appearance; a unit of more GPUs than a stage may hold (b: each GPU takes
    # >= 1 sample of every micro-batch) is cut into runs of b, else no stage could take it at all.
    b = tab.microbatch_size
    units = [tuple(v[k:k + b]) for v in by_key.values() for k in range(0, len(v), b)]
    if order == "memory":
        units.sort(key=lambda u: (-tab.cap_bytes[u[0]], -speeds[u[0]], u[0]))
    elif order == "speed":
        units.sort(key=lambda u: (-speeds[u[0]], -tab.cap_bytes[u[0]], u[0]))
    elif order == "speed_last":
        units.sort(key=lambda u: (speeds[u[0]], tab.cap_bytes[u[0]], u[0]))
    while len(units) > MAX_UNITS:
        merged, k = [], 0
        while k < len(units):
            a = units[k]
            if k + 1 < len(units) and _alike(devices, tab, a[0], units[k + 1][0]) \
                    and len(a) + len(units[k + 1]) <= b:
                merged.append(a + units[k + 1])
                k += 2
            else:
                merged.append(a)
                k += 1
        if len(merged) == len(units):
            break  # nothing alike to merge: keep the units
        units = merged
    return units


#: The orders whose first unit is also split across the ends ([Note: a tied model's ends on one node]).
ENDS_ORDERS = ("file", "speed")


def _ends_orders(costs: BlockCosts, gpu_types, units: list[tuple[int, ...]]) -> list[list[tuple[int, ...]]]:
    """``units`` with its first unit cut in two halves, the first half first and the second after the next
    k units, for k = the units of the first one's GPU type that follow it (the rest after the second half)
    and k = every other unit; none where the model ties no parameter across blocks or the first unit is
    one GPU ([Note: a tied model's ends on one node])."""
    if not any(len(set(tp.blocks)) > 1 for tp in costs.tied_params) or not units or len(units[0]) < 2:
        return []
    first, rest = units[0], units[1:]
    head, tail = first[:len(first) // 2], first[len(first) // 2:]
    same = next((k for k, u in enumerate(rest) if gpu_types[u[0]] != gpu_types[first[0]]), len(rest))
    return [[head, *rest[:k], tail, *rest[k:]] for k in sorted({same, len(rest)}) if k >= 1]


#: The last few (G, G) pair tables as arrays (``_pair_array``), each entry holding its table
#: (the tuple ``build_tables`` shares across micro-batch counts: ``tables._pair_tables``).
_ARRAYS: list[tuple[tuple, int, np.ndarray]] = []


def _pair_array(rows, *, fill: int) -> np.ndarray:
    """A (G, G) table of GPU-pair terms as an int64 array, ``fill`` on the diagonal;
    converted once per table (4,096 GPUs: 16.8 million entries, ~0.5 s)."""
    for known, f, a in _ARRAYS:
        if known is rows and f == fill:
            return a
    a = np.array(rows, dtype=np.int64)
    np.fill_diagonal(a, fill)
    _ARRAYS.insert(0, (rows, fill, a))
    del _ARRAYS[4:]
    return a


def _unit_reduce(pair: np.ndarray, units, reduce) -> np.ndarray:
    """(U, U) ``reduce`` (np.minimum / np.maximum) of a (G, G) pair array over each
    block (GPUs of unit a) x (GPUs of unit b): a group of units [u0, u1) then takes
    its pairs' min / max from the (u1 - u0)^2 unit blocks instead of its k^2 pairs."""
    order = np.asarray([g for u in units for g in u])
    starts = np.cumsum([0] + [len(u) for u in units[:-1]])
    sub = pair[np.ix_(order, order)]
    return reduce.reduceat(reduce.reduceat(sub, starts, axis=0), starts, axis=1)


def _alike(devices: DeviceGraph, tab, g: int, h: int) -> bool:
    return devices.gpu_types[g] == devices.gpu_types[h] and tab.cap_bytes[g] == tab.cap_bytes[h]


class _Stages(StageMatrices):
    """Per-(u0, u1) stage terms of one unit order and one M, as (B+1, B+1) matrices over (i, j)
    (the per-(i, j) terms: ``heuristics.StageMatrices``; here also ZeRO-2/3 layouts, all-reduce, offload)."""

    def __init__(self, tab, units, speeds, variants, num_microbatches: int):
        super().__init__(tab)
        self.units, self.variants, self.m = units, variants, num_microbatches
        nb, b, pre = self.nb, tab.microbatch_size, self.pre
        ii, jj, extra = self.ii, self.jj, self.extra
        self.ar = [pre(p) for p in tab.ar_prefix]
        self.arsh = [pre(p) for p in tab.arsh_prefix]
        self.opt = [pre(p) - sum((e * tab.tied_opt[t][q] for t, e in extra), np.int64(0))
                    for q, p in enumerate(tab.opt_prefix)]
        # [C-grad-shard] / [C-param-shard] variants: their layouts are ``StageMatrices.zero23``.
        self.zero23_used = any(v.zero >= 2 for v in variants)
        self.stash_used = any(v.stash == "host" for v in variants)
        self.nblocks = np.maximum(jj - ii, 1)
        # [C-allreduce]'s bucket count nb of blocks [i, j) (objective.bucket_count, vectorised;
        # tied exclusions are not known per stage here, as for the all-reduce term above).
        first_cap, cap = tab.bucket_caps
        self.nbuckets = 1 + np.maximum(0, -((first_cap - pre(tab.grad_kib_prefix)) // cap))
        # [C-offload]: the host state H of blocks [i, j) (state_terms.stage_host_kib).
        self.host = (pre(tab.host_prefix) - sum((e * tab.tied_host[t] for t, e in extra), np.int64(0))
                     if any(tab.host_cap) else None)
        # [C-offload]: what a replicated offloaded stage keeps on the GPU (state_terms.offload_replicated_kib).
        self.off_rep = (pre(tab.off_rep_prefix) - sum((e * tab.tied_off_rep[t] for t, e in extra), np.int64(0))
                        if any(tab.host_cap) else None)
        self.terms: dict[tuple[int, int], dict | None] = {}
        self.b, self.speeds = b, speeds
        # GPU-pair link classes and latencies as (G, G) arrays (the diagonal, no pair, never
        # chosen), reduced to (U, U) over the units' blocks: a group's slowest class and
        # largest latency over its pairs, and over its pairs with the next unit.
        pair_bw = _pair_array(tab.pair_bw_class, fill=np.iinfo(np.int64).max)
        pair_lat = _pair_array(tab.pair_lat, fill=np.iinfo(np.int64).min)
        self.unit_bw = _unit_reduce(pair_bw, units, np.minimum)
        self.unit_lat = _unit_reduce(pair_lat, units, np.maximum)

    def group(self, u0: int, u1: int):
        """GPUs, samples and the time / memory terms of units [u0, u1); None if > b GPUs."""
        key = (u0, u1)
        if key in self.terms:
            return self.terms[key]
        from .heuristics import largest_remainder, memory_groups

        tab = self.tab
        gpus = tuple(g for u in self.units[u0:u1] for g in u)
        if len(gpus) > self.b:
            self.terms[key] = None
            return None
        ns = largest_remainder(self.b, [self.speeds[g] for g in gpus])
        kinds = Counter((tab.gpu_types[g], n) for g, n in zip(gpus, ns))
        comp = np.max([n * self.work[t] + self.fixed[t] for t, n in kinds], axis=0)
        comp_rc = np.max([n * (self.work[t] + self.rc_work[t]) + self.fixed[t] + self.rc_fixed[t]
                          for t, n in kinds], axis=0)
        k = len(gpus)
        if k > 1:
            kin, lat = int(self.unit_bw[u0:u1, u0:u1].min()), int(self.unit_lat[u0:u1, u0:u1].max())
            # ring: objective.ring_units; nb buckets of 2 (k - 1) latencies (+ 1 all-gather when sharded)
            ar = -((-self.ar[kin] * (k - 1)) // k) + 2 * self.nbuckets * (k - 1) * lat
            arsh = -((-self.arsh[kin] * (k - 1)) // k) + (2 * self.nbuckets + 1) * (k - 1) * lat
            # [C-grad-shard]: M reduce-scatters (half an all-reduce ring each) and the all-gather
            m = self.m
            zr = (-((-(-(-m * self.ar[kin] // 2) + self.arsh[kin] - self.ar[kin]) * (k - 1)) // k)
                  + (m * self.nbuckets + 1) * (k - 1) * lat)
            # [C-param-shard]: the sync without the all-gather; one gather pass of the weights
            zr3 = -((-(-(-m * self.ar[kin] // 2)) * (k - 1)) // k) + m * self.nbuckets * (k - 1) * lat
            gpass = -((-(self.arsh[kin] - self.ar[kin]) * (k - 1)) // k) + self.nblocks * (k - 1) * lat \
                if self.zero23_used else None
        else:
            ar = arsh = zr = zr3 = np.zeros_like(self.state)
            gpass = None
        mbw = sorted({tab.gpu_mbw_class[g] for g in gpus})
        opt = np.max([self.opt[q] for q in mbw], axis=0)
        per_gpu_mib = -(-self.shard // (MIB_UNITS * k))
        opt_sh = max(tab.opt_per_mib[q] for q in mbw) * per_gpu_mib
        opt_gs = (max(tab.opt_per_mib[q] for q in mbw) * -(-self.zero23[1] // (MIB_UNITS * k))
                  if self.zero23_used else None)
        opt_ps = (max(tab.opt_per_mib[q] for q in mbw) * -(-self.zero23[3] // (MIB_UNITS * k))
                  if self.zero23_used else None)
        # Boundary to the next unit (the first GPU group of the next stage): cut at j.
        bnd = np.zeros(self.nb + 1, dtype=np.int64)
        if u1 < len(self.units):
            kq, lq = int(self.unit_bw[u0:u1, u1].min()), int(self.unit_lat[u0:u1, u1].max())
            bnd = 2 * (np.asarray(tab.xfer[kq], dtype=np.int64) + lq)
        mem = memory_groups(tab, gpus, ns)
        # [C-offload]: each GPU's host capacity and the step's time over its host state (per GPU, as
        # the objective: a replicated stage's whole H, a sharded one's ~H / k).
        hcap = tuple(tab.host_cap[g] for g in gpus) if tab.host_cap else ()
        opt_of = ao_x = st_x = None
        if self.host is not None and hcap and min(hcap) > 0:
            off = max(tab.off_per_mib[g] for g in gpus)
            opt_of = (-(-off * self.host // MIB_UNITS), -(-off * -(-self.host // k) // MIB_UNITS))
            # [C-act-offload]: the slowest GPU's activations down and back per micro-batch
            ao_x = np.max([-(-n * self.act * tab.act_per_mib[g] // MIB_UNITS) for g, n in zip(gpus, ns)], axis=0)
            if self.stash_used:  # [C-stash]: the re-run compute and the blocks' inputs down and back, exposed
                # where they outlast the F / B task's compute (objective._compute_terms)
                inputs, rows = self.stash[2], []
                for t, n, per in sorted({(tab.gpu_types[g], n, tab.act_per_mib[g]) for g, n in zip(gpus, ns)}):
                    x = -(-n * inputs * per // MIB_UNITS)
                    f = n * self.rc_work[t] + self.rc_fixed[t]
                    w = n * (self.work[t] + self.rc_work[t]) + self.fixed[t] + self.rc_fixed[t]
                    rows.append(w + np.maximum(0, x // 2 - f) + np.maximum(0, x - x // 2 - (w - f)))
                st_x = np.max(rows, axis=0)
        out = {"gpus": gpus, "samples": ns, "comp": comp, "comp_rc": comp_rc, "ar": ar, "arsh": arsh, "zr": zr,
               "zr3": zr3, "gpass": gpass, "opt": opt, "opt_sh": opt_sh, "opt_gs": opt_gs, "opt_ps": opt_ps,
               "bnd": bnd[None, :], "mem": mem, "k": k, "cost": {}, "hcap": hcap, "opt_of": opt_of, "ao_x": ao_x,
               "st_x": st_x,
               "fits": {}}
        self.terms[key] = out
        return out

    def cost(self, u0: int, u1: int, s: int, n_s: int, level: int = 1):
        """(cost matrix with _INF where nothing fits, variant index matrix) of stage s of n_s,
        over the variants of ``_level`` <= ``level`` (0: neither ZeRO-2 nor offload; 1: and
        ZeRO-2; 2: and offload)."""
        g = self.group(u0, u1)
        if g is None:
            return None
        fl = inflight(self.tab.schedule, n_s, s, self.m)
        ck = (fl, s > 0, n_s)
        if (ck, level) in g["cost"]:
            return g["cost"][ck, level]
        mult = self.m + n_s - 1
        if level == 0:
            best = np.full_like(self.state, _INF)
            arg = np.full(self.state.shape, -1, dtype=np.int64)
        else:  # this level's variants on top of the lower ones' (ties: the lower one)
            best, arg = self.cost(u0, u1, s, n_s, level - 1)
        for v, variant in enumerate(self.variants):
            of, ao, st = variant.optimizer == "host", variant.activations == "host", variant.stash == "host"
            if _level(variant) != level or ((of or ao or st) and g["opt_of"] is None):
                continue
            fk = (fl, s > 0, v)  # what fits does not depend on the stage count: shared over n_s
            terms = g["fits"].get(fk)
            if terms is None:
                if g["k"] < 2 and variant.zero:  # a one-GPU stage: nothing sharded
                    variant = dataclasses.replace(variant, zero=0)
                sh, rc, gs, ps = variant.zero >= 1, variant.recompute, variant.zero >= 2, variant.zero == 3
                fits = (self._fits_offload(g, fl, s > 0, variant) if of or ao or st
                        else self.fits(g["mem"], fl, s > 0, variant)) & self.valid
                # (st_x: [C-stash]'s compute with its re-run and exposed transfers)
                t = (g["st_x"] if st else g["comp_rc"] if rc else g["comp"]) + g["bnd"] + (g["ao_x"] if ao else 0)
                if ps:  # [C-param-shard]: the gathers' exposed time per micro-batch (objective.evaluate_units)
                    passes = 3 if rc else 2
                    comp = g["comp_rc"] if rc else g["comp"]
                    t = t + np.maximum(0, passes * g["gpass"] - comp) + passes * -(-g["gpass"] // self.nblocks)
                sync = g["zr3"] if ps else g["zr"] if gs else g["arsh"] if sh else g["ar"]
                fixed = sync + (g["opt_of"][sh] if of else g["opt_ps"] if ps else g["opt_gs"] if gs
                                else g["opt_sh"] if sh else g["opt"])
                # cost = mult t + fixed where the variant fits, _INF elsewhere (t 0 there)
                terms = g["fits"][fk] = (np.where(fits, t, 0), np.where(fits, fixed, _INF))
            t, fixed = terms
            c = mult * t + fixed
            better = c < best
            best = np.where(better, c, best)
            arg = np.where(better, v, arg)
        g["cost"][ck, level] = (best, arg)
        return best, arg

    def _fits_offload(self, g, fl: int, not_first: bool, variant: StageMemory):
        """[C-memory], [C-shard] and [C-host-memory] of a variant with an offload ([C-offload],
        [C-act-offload]), all (i, j) (as ``objective.fill_policy`` and ``evaluate_units``)."""
        host_acts, recompute, stash = variant.activations == "host", variant.recompute, variant.stash == "host"
        # Host memory per GPU: the in-flight activations (or stashed block inputs), then the offloaded optimizer state.
        hfree = [hc - (fl * n * self.act if host_acts else fl * n * self.stash[2] if stash else 0)
                 for n, hc in zip(g["samples"], g["hcap"])]
        ok = np.ones_like(self.valid)
        for f in hfree:
            ok &= f >= 0
        if variant.optimizer != "host":  # activations only: the state on the GPU as without offload
            return ok & self.fits(g["mem"], fl, not_first, variant)

        def act(n):  # on the GPU, with [Note: gradient transients]
            if stash:
                return self.stash_kib(n, fl)
            return (n * self.act if host_acts else self.act_kib(n, fl, not_first, recompute)) + self.transient(n)

        rep, need = self.layout(variant.zero) if variant.zero else (self.off_rep, None)
        for (n, cap), _ in g["mem"]:  # the optimizer's state in host memory (a shard's gradients / weights: below)
            ok &= rep + act(n) <= cap
        if not variant.zero:
            for f in hfree:
                ok &= self.host <= f
            return ok
        host = np.maximum(self.host, 1)
        need1 = np.maximum(need, 1)
        per_gpu = [np.maximum(f, 0) * need1 // host for f in hfree]  # KiB of shard each host share holds
        if variant.zero >= 2:  # and each GPU holds the shard's gradients / weights
            rest = np.maximum(need - self.shard, 1)
            dev_free = [np.maximum(self.tab.cap_bytes[x] - rep - act(n), 0) for x, n in zip(g["gpus"], g["samples"])]
            per_gpu = [np.where(need > self.shard, np.minimum(p, d * need1 // rest), p)
                       for p, d in zip(per_gpu, dev_free)]
        held = sum(p // MIB_UNITS for p in per_gpu)
        return ok & (MIB_UNITS * held >= need)

def _dp(st: _Stages, n_s: int, idle: bool = False, level: int = 1):
    """Best split into n_s stages over all blocks and all units (``idle``: over a
    prefix of the units, the rest idle): list of (u0, u1, i, j, variant) or None."""
    n_u, nb = len(st.units), st.nb
    best = np.full((n_u + 1, nb + 1), _INF, dtype=np.int64)
    best[0, 0] = 0
    back = []
    for s in range(n_s):
        nxt = np.full_like(best, _INF)
        arg = {}
        for u0 in range(n_u):
            row = best[u0]
            if (row >= _INF).all():
                continue
            for u1 in range(u0 + 1, n_u + 1):
                if not idle and (s == n_s - 1) != (u1 == n_u):
                    continue  # the last stage takes the remaining units, earlier ones leave some
                cv = st.cost(u0, u1, s, n_s, level)
                if cv is None:
                    break  # more units only add GPUs: > b
                c, var = cv
                cand = np.maximum(row[:, None], c)
                i_best = cand.argmin(axis=0)
                v = cand[i_best, np.arange(nb + 1)]
                upd = v < nxt[u1]
                if upd.any():
                    nxt[u1] = np.where(upd, v, nxt[u1])
                    for j in np.nonzero(upd)[0]:
                        arg[(u1, int(j))] = (u0, int(i_best[j]), int(var[i_best[j], j]))
        back.append(arg)
        best = nxt
    u_end = int(best[:, nb].argmin()) if idle else n_u  # ties: the fewest units
    if best[u_end, nb] >= _INF:
        return None
    out, u, j = [], u_end, nb
    for s in range(n_s - 1, -1, -1):
        u0, i, v = back[s][(u, j)]
        out.append((u0, u, i, j, v))
        u, j = u0, i
    return out[::-1]


def _add_split(sel, st: _Stages, tab, split, variants, m: int) -> int:
    """Score one DP split with the objective (``Selector``): with the DP's per-stage
    variants and with each uniform policy. Returns the better step time (units)."""
    blocks, gpus, samples, memory = [], [], [], []
    for u0, u1, i, j, v in split:
        g = st.group(u0, u1)
        order_g = sorted(range(len(g["gpus"])), key=lambda a: g["gpus"][a])
        blocks.append((i, j))
        gpus.append(tuple(g["gpus"][a] for a in order_g))
        samples.append(tuple(g["samples"][a] for a in order_g))
        one_gpu = len(g["gpus"]) < 2 and variants[v].zero  # a one-GPU stage: nothing sharded
        memory.append(dataclasses.replace(variants[v], zero=0) if one_gpu else variants[v])
    pol = fill_policy(tab, blocks, gpus, samples, memory=memory)
    own = sel.add(blocks, gpus, samples, m, pol)
    return min(own, sel.add(blocks, gpus, samples, m))  # and each uniform policy


#: The most a split can speed up by dropping its recomputation: a recomputing stage runs each
#: micro-batch's forward twice, F + B -> 2F + B, which with the backward at twice the forward
#: (``ir.costs.FORWARD_SHARE``) is 4/3; ``recompute_gain`` gives it for the costs' own split.
#: Pass 2 of the stage DP re-runs only the (M, order, S) keys whose recomputing pass-1 split is
#: within this factor of pass 1's best.
RECOMPUTE_GAIN = 4 / 3


def recompute_gain(costs) -> float:
    """1 + the largest forward share of a block (``BlockCosts.forward_share_max``):
    (2F + B) / (F + B) at its largest, at least ``RECOMPUTE_GAIN``."""
    return max(RECOMPUTE_GAIN, 1.0 + costs.forward_share_max())


def _zero2_pass(found: dict, gain: float = RECOMPUTE_GAIN) -> dict[tuple[int, tuple], list[int]]:
    """The (M, units) -> stage counts the stage DP re-runs with ZeRO-2 ([Note: ZeRO-2 in the stage DP])."""
    scores = [score for per_s in found.values() for score, _ in per_s.values() if score is not None]
    if not scores:
        picks = [(m, units, n_s) for (m, units), per_s in found.items() for n_s in per_s]
    else:
        bar = min(scores) * gain
        picks = sorted((m, units, n_s) for (m, units), per_s in found.items()
                       for n_s, (score, rc) in per_s.items() if score is not None and rc and score <= bar)
        for m, units, _ in list(picks):  # and the stage count just below the fewest that fit without ZeRO-2
            fit = min(n for n, (score, _) in found[m, units].items() if score is not None)
            if fit > 1:
                picks.append((m, units, fit - 1))
    out: dict[tuple[int, tuple], list[int]] = {}
    for m, units, n_s in picks:
        if n_s not in out.setdefault((m, units), []):
            out[m, units].append(n_s)
    return out


def _why_none(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions, s_max: int) -> str:
    """Why no split fits, with the numbers: the stage and GPU counts the DP had, the
    samples per micro-batch b (a stage holds at most b GPUs) and the binding
    constraint (``bounds.explain_infeasible``: memory, idle GPUs or the caps)."""
    from .bounds import explain_infeasible

    ms = microbatch_candidates(options)
    bs = ", ".join(str(options.global_batch_size // m) for m in ms)
    every = "" if options.allow_idle_gpus else "gives every GPU work and "
    return (f"no split of the {devices.num_gpus} GPUs into <= {s_max} stages {every}fits memory with at most b GPUs "
            f"per stage (b = {bs} samples per micro-batch at M = {', '.join(map(str, ms))} micro-batches); allow ZeRO-1 "
            f"sharding / recomputation (now {options.sharding!r} / {options.recompute!r}), more stages (max_stages) "
            f"or more micro-batches (max_microbatches). Binding: {explain_infeasible(costs, devices, options)}")


def solve_stage_dp(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions, progress=None) -> SolverResult:
    """The best plan of the memory-first stage DP (see [Note: stage DP]); the
    first half of ``stage_dp_search``.

    Same interface as the planners (``solve_cpsat``, ``baselines``): the
    decision is scored by ``objective.evaluate``; status "STAGE_DP". The DP's
    memory check is exact, so every split it returns fits; its proxy cost
    (max stage cost) can still pick a split whose uniform-policy variant is
    faster, which ``Selector`` also scores. No lower bound is known:
    ``best_bound`` 0.

    ``progress``: called with a line before the DPs and after each pass.

    Raises:
        InfeasiblePlanError: no split fits memory with <= b GPUs per stage
            for any (S, M); the message names the options that would help.
    """
    return stage_dp_search(costs, devices, options, progress)[0]


def stage_dp_search(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions,
                    progress=None) -> tuple[SolverResult, tuple[SolverResult, ...]]:
    """(the best plan as ``solve_stage_dp``, the best feasible plan without
    sharded gradients of every (S, M) the DP reached, fastest first): the second are CP-SAT warm starts
    for every candidate (``zorse_fx/portfolio.py``). Raises as ``solve_stage_dp``."""
    import time

    from .heuristics import Selector, gpu_speeds

    t0 = time.perf_counter()

    def say(what: str) -> None:
        if progress is not None:
            best = sel.best_step_s()
            progress(f"stage DP {what}; best plan {f'{best:.4g} s' if best is not None else 'none yet'}, "
                     f"{time.perf_counter() - t0:.1f} s")

    sel = Selector("stage_dp", costs, devices, options)
    speeds = gpu_speeds(costs, devices)
    variants = grad_variants(options)
    zero2 = any(v.zero >= 2 or v.stash == "host" for v in variants)  # (pass 2: ZeRO-2/3 and [C-stash])
    offload = any(_level(v) == 2 for v in variants)
    s_max = max_stage_count(costs, devices, options)
    # Pass 1: the DP over the variants without ZeRO-2, every (M, order, S). Kept per (M, order):
    # its units and, per S, the score of its split (None: no split) and whether it recomputes.
    # The DPs of the (M, order)s are independent: up to ``jobs`` run side by side in forked
    # children (solve/isolated.map_isolated); their splits are scored here in the fixed order.
    found: dict[tuple[int, tuple], dict[int, tuple[int | None, bool]]] = {}
    tasks = []
    for m in microbatch_candidates(options):
        tab = sel.tables(m)
        for order in ORDERS:
            units = _units(devices, tab, speeds, order)
            more = _ends_orders(costs, devices.gpu_types, units) if order in ENDS_ORDERS else []
            for u in (units, *more):
                if (m, tuple(u)) not in tasks:
                    tasks.append((m, tuple(u)))

    say(f"pass 1: {len(tasks)} (micro-batches, unit order) DPs over {devices.num_gpus} GPUs in up to "
        f"{max(len(u) for _, u in tasks)} units, up to {s_max} stages")

    def splits(m: int, units: tuple) -> list:
        st = _Stages(sel.tables(m), list(units), speeds, variants, m)
        return [_dp(st, n_s, options.allow_idle_gpus, level=0) for n_s in range(1, min(s_max, len(units)) + 1)]

    jobs = work_jobs(options, devices.num_gpus)
    for (m, units), (ok, answer) in zip(tasks, map_isolated([partial(splits, m, u) for m, u in tasks], jobs)):
        if not ok:
            raise answer
        tab = sel.tables(m)
        per_s = found[m, units] = {}
        st = _Stages(tab, list(units), speeds, variants, m)
        for n_s, split in enumerate(answer, start=1):
            if split is None:
                per_s[n_s] = (None, False)
            else:
                per_s[n_s] = (_add_split(sel, st, tab, split, variants, m),
                              any(variants[v].recompute for *_, v in split))
    # Pass 2: the DP with ZeRO-2 too, only where it can win ([Note: ZeRO-2 in the stage DP]).
    fitted = any(score is not None for per_s in found.values() for score, _ in per_s.values())
    if zero2:
        again = _zero2_pass(found, recompute_gain(costs))
        say(f"pass 1 done; pass 2 (ZeRO-2/3) on {sum(map(len, again.values()))} (micro-batches, order, stages)")
        for (m, units), stage_counts in again.items():
            tab = sel.tables(m)
            st = _Stages(tab, list(units), speeds, variants, m)
            for n_s in stage_counts:
                split = _dp(st, n_s, options.allow_idle_gpus)
                if split is not None:
                    fitted = True
                    _add_split(sel, st, tab, split, variants, m)
    # Pass 3: offload, only where nothing fits without it ([Note: offload in the stage DP]).
    if offload and (not fitted or "always" in (options.offload, options.activation_offload)):
        say("pass 3 (offload) next")
        for (m, units), per_s in found.items():
            tab = sel.tables(m)
            if not tab.host_cap or not any(tab.host_cap):
                continue
            st = _Stages(tab, list(units), speeds, variants, m)
            for n_s in per_s:
                split = _dp(st, n_s, options.allow_idle_gpus, level=2)
                if split is not None:
                    _add_split(sel, st, tab, split, variants, m)
    try:
        res = sel.result()
    except InfeasiblePlanError:
        raise InfeasiblePlanError(f"stage_dp: no candidate plan can be formed: "
                                  f"{_why_none(costs, devices, options, s_max)}") from None
    ok = res.status == "BASELINE"
    cands = tuple(dataclasses.replace(c, status="STAGE_DP" if c.feasible else "STAGE_DP_INFEASIBLE")
                  for c in res.candidates)
    hints = tuple(dataclasses.replace(h, status="STAGE_DP") for h in sel.feasible_per_candidate(plain=True))
    return dataclasses.replace(res, status="STAGE_DP" if ok else "STAGE_DP_INFEASIBLE", candidates=cands), hints
