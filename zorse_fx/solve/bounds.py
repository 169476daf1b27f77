"""What can be said about a planning instance without solving it: a lower
bound on the step time of every decision (``throughput_lower_bound``, used as
each CP-SAT candidate's bound when the solver's own is weaker) and, when no
candidate fits, the message that names the binding constraint
(``explain_infeasible``). Both read the model of ``objective.py``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..ir.costs import BlockCosts, extra_copies, unique_params
from ..ir.devices import DeviceGraph
from ..options import PlanOptions
from .objective import IntTables, fmt_bytes, max_stage_count, microbatch_candidates
from .tables import _prefix

__all__ = ["throughput_lower_bound", "throughput_bound_s", "explain_infeasible", "stage_count_lower_bound",
           "microbatch_chain_bound", "structure_lower_bound", "STRUCTURE_MAX_GPUS"]


def _min_max_split(needs: list[int], k_max: int, less=None) -> tuple[int, list[tuple[int, int]]]:
    """Split ``needs`` into <= k_max contiguous parts minimising the largest part
    sum, less ``less(i, j)`` for a part [i, j) (default 0). Returns (largest part, the parts as (start, end))."""
    nb = len(needs)
    pre = _prefix(needs)
    less = less or (lambda i, j: 0)
    inf = float("inf")
    # best[k][j]: min over splits of blocks [0, j) into k parts of the largest part.
    best = [[inf] * (nb + 1) for _ in range(k_max + 1)]
    arg = [[0] * (nb + 1) for _ in range(k_max + 1)]
    best[0][0] = 0
    for k in range(1, k_max + 1):
        for j in range(1, nb + 1):
            for i in range(k - 1, j):
                v = max(best[k - 1][i], pre[j] - pre[i] - less(i, j))
                if v < best[k][j]:
                    best[k][j], arg[k][j] = v, i
    k = min(range(1, k_max + 1), key=lambda q: (best[q][nb], q))
    parts, j = [], nb
    for q in range(k, 0, -1):
        parts.append((arg[q][j], j))
        j = arg[q][j]
    return int(best[k][nb]), parts[::-1]


def throughput_lower_bound(tab: IntTables) -> int:
    """A lower bound (units) on the step time of EVERY decision with
    ``tab.num_microbatches`` micro-batches: M * ceil(b * W / R).

    W = sum over blocks q of w_ref[q], the fastest type's per-sample time of q;
    R = sum over GPUs g of r_g = max_q w_ref[q] / w_type(g)[q] (<= 1, the GPU's
    speed relative to the reference, taken at its best block). Proof: a GPU g
    of stage s with n_g samples has compute_g >= n_g W_ref(s) / r_g and
    compute_g <= tmax, so b W_ref(s) = sum_{g in s} n_g W_ref(s) <= tmax R_s;
    summed over the stages, b W <= tmax R (each GPU in one stage, idle ones
    add nothing); and [C-objective] step >= sum_s t_s + (M - 1) tmax >= M tmax.
    It is the scenario benchmark's "upper bound" throughput turned into time
    (no communication, no bubble, perfect balance) and the same redundant
    constraint the class-level CP-SAT model carries, so it holds for the
    per-GPU, class-level and brute-force searches alike. Exact rational
    arithmetic; 0 when no block has work."""
    from fractions import Fraction

    types = sorted(set(tab.gpu_types))
    work = {t: [tab.work_prefix[t][q + 1] - tab.work_prefix[t][q] for q in range(tab.num_blocks)] for t in types}
    w_ref = [min(work[t][q] for t in types) for q in range(tab.num_blocks)]
    total = sum(w_ref)
    if total <= 0:
        return 0
    r = {t: max((Fraction(w_ref[q], work[t][q]) for q in range(tab.num_blocks) if work[t][q] > 0),
                default=Fraction(1)) for t in types}
    speed = sum(r[t] for t in tab.gpu_types)
    per_mb = Fraction(tab.microbatch_size * total) / speed
    return tab.num_microbatches * -(-per_mb.numerator // per_mb.denominator)


def stage_count_lower_bound(tab: IntTables, num_stages: int) -> int:
    """A lower bound (units) on the step time of every decision with S =
    ``num_stages`` stages, one per GPU group (the CP-SAT candidates'), and
    ``tab.num_microbatches`` = M: max(F, P) + (M - 1) max(ceil(F / S), P).

    F = sum over blocks q of the smallest per-micro-batch fixed time over the
    GPU types (``fixed_prefix``: kernel launches, paid once per micro-batch by
    every GPU of the block's stage), P = ``throughput_lower_bound`` / M.
    Proof: compute_g >= n_g W + F over its stage's blocks (recomputation,
    ZeRO-3's exposed gathers and activation offload only add), so cmax_s >=
    F_s, sum_s F_s >= F and max_s cmax_s >= ceil(F / S) (integers); and
    max_s cmax_s >= P (``throughput_lower_bound``'s lemma). [C-objective]:
    step >= sum_s t_s + (M - 1) T with t_s >= cmax_s and the period T >=
    max_s cmax_s (1F1B: each stage's cycle; GPipe: T_F + T_B >= max_s F_s +
    max_s B_s >= max_s cmax_s), the sync term >= 0. With small micro-batches
    the fixed part dominates and the bound grows as S shrinks, which lets the
    candidate search skip (S, M) pairs that cannot beat a plan in hand
    (``_search.CandidateSearch.pruned``; issue 32 item 1)."""
    m = tab.num_microbatches
    types = sorted(set(tab.gpu_types))
    fixed = sum(min(tab.fixed_prefix[t][q + 1] - tab.fixed_prefix[t][q] for t in types)
                for q in range(tab.num_blocks))
    per = throughput_lower_bound(tab) // m
    return max(fixed, per) + (m - 1) * max(-(-fixed // max(num_stages, 1)), per)


def microbatch_chain_bound(tab: IntTables) -> int:
    """A lower bound (units) on the step time of EVERY decision: sum over blocks q
    of min over GPU types t of (F_q,t + W_q,t), one sample's forward and backward
    through every block with the block's per-micro-batch fixed time (kernel
    launches). Proof: [C-objective] step >= sum_s t_s >= sum_s cmax_s, and a GPU
    g of stage s has compute_g = n_g W_s + F_s (+ recomputation, ZeRO-3's
    gathers, activation offload) with n_g >= 1; under interleaving every
    micro-batch still runs its forward, then its backward, through every chunk
    in order (the replay of [Note: interleaved stages]). Where the fixed times
    dominate (small models, small micro-batches) it is far above
    ``throughput_lower_bound``, which has no fixed term."""
    types = sorted(set(tab.gpu_types))
    return sum(min(tab.fixed_prefix[t][q + 1] - tab.fixed_prefix[t][q] + tab.work_prefix[t][q + 1]
                   - tab.work_prefix[t][q] for t in types) for q in range(tab.num_blocks))


def throughput_bound_s(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions) -> float:
    """A lower bound (s) on every decision's step time when CP-SAT returned none:
    the smallest ``throughput_lower_bound`` over the micro-batch counts, or
    ``microbatch_chain_bound`` where that is larger."""
    from .objective import UNIT_S, build_tables

    tabs = [build_tables(costs, devices, options, m) for m in microbatch_candidates(options)]
    return max(min(throughput_lower_bound(tab) for tab in tabs), microbatch_chain_bound(tabs[0])) * UNIT_S


def explain_infeasible(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions,
                       candidates=()) -> str:
    """Why no (S, M) admits a plan, naming the binding constraint with numbers;
    when the planner's own caps are why (``max_stages``, ``max_microbatches``:
    the stage DP finds a plan with them widened), it says so and which values
    to set (``wider_caps_note``)."""
    why = _explain(costs, devices, options, candidates)
    return why + wider_caps_note(costs, devices, options) if "a block cannot be split" not in why else why


def wider_caps_note(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions) -> str:
    """``"; with max_stages=S and max_microbatches=M a plan exists ..."`` when
    the stage DP (``stage_dp.solve_stage_dp``: memory-first, seconds even on
    64 GPUs) finds a feasible plan with the caps widened to at most
    ``min(GPUs, blocks)`` stages and ``global_batch_size`` micro-batches,
    else ``""``. The caps named are the smallest that hold that plan, so the
    search they allow contains it. Deterministic: the stage DP has no budget.
    A probe, not a proof: the stage DP keeps a node's GPUs of one type in one
    stage, so a plan that splits a node may exist where it finds none."""
    from ..errors import InfeasiblePlanError
    from .stage_dp import solve_stage_dp

    stages = min(devices.num_gpus, costs.num_blocks)
    gbs = options.global_batch_size
    fixed_m = options.num_microbatches is not None  # an explicit list is the user's, not a cap
    if stages <= options.max_stages and (fixed_m or options.max_microbatches >= gbs):
        return ""
    wide = dataclasses.replace(options, max_stages=max(options.max_stages, stages),
                               max_microbatches=options.max_microbatches if fixed_m else
                               max(options.max_microbatches, gbs))
    try:
        res = solve_stage_dp(costs, devices, wide)
    except (InfeasiblePlanError, ValueError):
        return ""
    s, m = res.num_stages, res.decision.num_microbatches
    need = [f"max_stages={s}" if s > options.max_stages else "",
            f"max_microbatches={m}" if m > options.max_microbatches else ""]
    need = [x for x in need if x]
    if not need:
        return ""
    flags = " ".join(f"--{x.replace('_', '-').replace('=', ' ')}" for x in need)
    return (f"; the planner's own cap{'s are' if len(need) > 1 else ' is'} why: with {' and '.join(need)} a plan "
            f"exists (the stage DP finds {s} stages x {m} micro-batches of {gbs // m} samples, predicted "
            f"{res.predicted_step_time_s:.3g} s per step): set {' and '.join(need)} (zorse plan {flags})")


def _explain(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions, candidates=()) -> str:
    gbs, n_g = options.global_batch_size, devices.num_gpus
    ms = microbatch_candidates(options)  # raises for an indivisible batch
    k_max = max_stage_count(costs, devices, options)
    k_txt = f"{k_max} stage{'s' if k_max > 1 else ''}"
    if k_max < options.max_stages:
        k_txt += f" (max_stages={options.max_stages}, {n_g} GPUs, {costs.num_blocks} blocks)"
    unknown = sorted((c.num_stages, c.num_microbatches) for c in candidates if c.status == "UNKNOWN")
    note = (f"; (S, M) = {unknown} found no solution within solver_budget="
            f"{options.solver_budget:g} (CP-SAT deterministic seconds; zorse plan --solver-budget) or the "
            f"wall-clock safety stop time_limit_s={options.time_limit_s:g} s: raise the budget" if unknown else "")
    crashed = sorted((c.num_stages, c.num_microbatches) for c in candidates if c.status == "CRASHED")
    if crashed:
        note += (f"; (S, M) = {crashed}: OR-Tools crashed on every try (google/or-tools#5288; "
                 f"solve_stage_dp or another ortools version may plan them)")
    if not options.allow_idle_gpus and n_g > k_max * (gbs // ms[0]):
        return (f"allow_idle_gpus=False: each of the {n_g} GPUs must take >= 1 sample of every "
                f"micro-batch, but at most {k_txt} x {gbs // ms[0]} samples = "
                f"{k_max * (gbs // ms[0])} GPUs can be busy; allow idle GPUs (without zorse plan --use-all-gpus) or raise "
                f"global_batch_size / max_stages{note}")
    caps = [int(options.memory_fraction * mb) for mb in devices.memory_bytes]
    big = max(range(n_g), key=lambda g: caps[g])
    big_txt = (f"the largest GPU ({devices.gpu_types[big]}) has {fmt_bytes(caps[big])} usable "
               f"({options.memory_fraction:g} × {fmt_bytes(devices.memory_bytes[big])})")
    st = costs.state_bytes_per_param
    n_par = unique_params(costs)  # a tied parameter once ([C-tied])
    head = (f"the model's training state needs {fmt_bytes(st * n_par)} "
            f"({st} B/param × {n_par:.3g} params)")
    state = [st * p for p in costs.param_count]
    rep = st  # per tied (float32) parameter
    if options.sharding != "never" and costs.shardable_bytes_per_param:
        rep = st - costs.shardable_bytes_per_param
        # Lower bound: the shardable part can be spread over other GPUs of the stage.
        state = [x - costs.shardable_bytes(b) for b, x in enumerate(state)]
        head += (f", {fmt_bytes(sum(state) - _tied_replicated(costs))} of it replicated per stage under "
                 f"ZeRO-1 sharding")
    needs = [x + a for x, a in zip(state, costs.act_bytes_per_sample)]
    fix = "add GPUs with more memory, raise max_stages, or lower global_batch_size / use more micro-batches"
    more = [f"{name}='auto'" for name, v in (("sharding", options.sharding), ("recompute", options.recompute))
            if v == "never"]
    if more:
        fix += f", or allow {' and '.join(more)} (ZeRO-1 optimizer-state sharding / stage recomputation)"
    blk = max(range(len(needs)), key=lambda i: needs[i])
    if needs[blk] > caps[big]:
        return (f"{head}; block {blk} alone needs {fmt_bytes(needs[blk])} "
                f"({fmt_bytes(state[blk])} state of {costs.param_count[blk]:.3g} params "
                f"+ {fmt_bytes(costs.act_bytes_per_sample[blk])} activations of one sample) but {big_txt}; "
                f"a block cannot be split across stages: add GPUs with more memory{note}")
    tied = [tp.blocks for tp in costs.tied_params]

    def tied_less(i, j):  # a stage holds a tied parameter once ([C-tied])
        return sum(c * rep * costs.tied_params[t].numel for t, c in extra_copies(tied, i, j))

    worst, parts = _min_max_split(needs, k_max, tied_less)
    s = max(range(len(parts)), key=lambda q: sum(needs[parts[q][0]:parts[q][1]]) - tied_less(*parts[q]))
    i, j = parts[s]
    detail = (f"{fmt_bytes(worst)} on stage {s} (blocks {i}-{j - 1}: "
              f"{fmt_bytes(sum(state[i:j]) - tied_less(i, j))} state + "
              f"{fmt_bytes(sum(costs.act_bytes_per_sample[i:j]))} activations of one sample)")
    if worst > caps[big]:
        return f"{head}; with at most {k_txt} the best split still needs {detail} but {big_txt}; {fix}{note}"
    tried = sorted((c.num_stages, c.num_microbatches) for c in candidates)
    # [Note: gradient transients] in state_terms.py: the most any stage can hold of it
    g = max([4 * q for q in costs.max_param_numel] + [3 * 4 * tp.numel for tp in costs.tied_params], default=0)
    if g:
        detail += (f", and a weight's gradient while autograd adds it: up to {fmt_bytes(g)} (the largest "
                   f"parameter's float32 gradient, or three of a tied one's on a stage holding both its uses)")
    return (f"{head}; no (stages, micro-batches) candidate {tried} fits in memory: the best split into "
            f"at most {k_txt} needs {detail} and {big_txt}, but every stage needs its own GPUs "
            f"and holds activations of b = {gbs // ms[-1]}..{gbs // ms[0]} samples x up to "
            f"{ms[-1] if options.schedule == 'gpipe' else min(k_max, ms[-1])} micro-batches in flight; "
            f"usable per GPU: {', '.join(fmt_bytes(c) for c in caps)}; {fix}{note}")


def _tied_replicated(costs: BlockCosts) -> int:
    """Replicated state bytes of the extra copies of tied parameters that the
    per-block sums count (one copy per extra block reading it)."""
    per = costs.state_bytes_per_param - costs.shardable_bytes_per_param  # a tied parameter is float32
    return sum(per * tp.numel * (len(tp.blocks) - 1) for tp in costs.tied_params)


#: ``structure_lower_bound`` enumerates every GPU-group sequence, so only up to this many GPUs (a
#: 4-GPU cluster has at most 50 sequences of 2 groups, 60 of 3, 24 of 4).
STRUCTURE_MAX_GPUS = 4


def _group_sequences(num_gpus: int, num_stages: int):
    """Every sequence of ``num_stages`` disjoint non-empty GPU groups (tuples of GPU indices; GPUs in no
    group are idle)."""
    import itertools

    for assign in itertools.product(range(-1, num_stages), repeat=num_gpus):
        groups = tuple(tuple(g for g in range(num_gpus) if assign[g] == s) for s in range(num_stages))
        if all(groups):
            yield groups


def _compute_floor(tab: IntTables, gpus) -> np.ndarray:
    """(B + 1, B + 1) int64 array: at [i, j] (i < j) a lower bound (units) of cmax_s, the slowest GPU's
    [C-compute], of a stage of blocks [i, j) on ``gpus`` with b = ``tab.microbatch_size`` samples per
    micro-batch: the larger of max_g (W_g + F_g) (every GPU takes >= 1 sample) and F_min + b / sum_g (1 /
    W_g) (a GPU with n_g samples takes n_g W_g + F_g <= cmax_s, so b = sum_g n_g <= (cmax_s - F_min) sum_g
    1 / W_g); exact for one GPU. Recomputation and ZeRO-3's gathers only add to compute_g."""
    pre = {t: (np.asarray(tab.work_prefix[t], dtype=np.int64), np.asarray(tab.fixed_prefix[t], dtype=np.int64))
           for t in {tab.gpu_types[g] for g in gpus}}
    ws = [pre[tab.gpu_types[g]][0][None, :] - pre[tab.gpu_types[g]][0][:, None] for g in gpus]
    fs = [pre[tab.gpu_types[g]][1][None, :] - pre[tab.gpu_types[g]][1][:, None] for g in gpus]
    b = tab.microbatch_size
    one = np.max([w + f for w, f in zip(ws, fs)], axis=0)
    if len(gpus) == 1:
        return np.maximum(one, b * ws[0] + fs[0])
    f_min = np.min(fs, axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        speed = np.sum([np.where(w > 0, 1.0 / np.maximum(w, 1), np.inf) for w in ws], axis=0)
        share = np.where(np.isfinite(speed), np.floor(b / speed) - 1, 0)  # floats: 1 unit of slack
    return np.maximum(one, f_min + np.maximum(share, 0).astype(np.int64))


def structure_lower_bound(tab: IntTables, num_stages: int) -> int:
    """A lower bound (units) on the step time of every decision of the CP-SAT candidate models with S =
    ``num_stages`` stages, one per GPU group, and M = ``tab.num_microbatches`` (any recomputation and
    ZeRO-1; none of ZeRO-2/3, offload or interleaving): the least over every GPU-group sequence and every
    cut of sum_s c_s + (M - 1) max_s c_s + max(0, max_s tied_s) + control, c_s = ``_compute_floor``,
    tied_s and control the [C-tied] and [C-control] terms of that sequence and cut
    (``network_terms.tied_terms``, ``tables.control_units``: they depend on nothing else). 0 above
    ``STRUCTURE_MAX_GPUS`` GPUs.

    [Note: bounds of small clusters]
    Proof ([C-objective], ``objective._pipeline_step``): step = sum_s t_s + (M - 1) T + max_s (max(sync_s,
    tied_s + ag_s) + optim_s) + control, with t_s = cmax_s + boundary_s >= cmax_s >= c_s, the period T >=
    max_s cmax_s (``stage_count_lower_bound``'s proof), ag_s, optim_s >= 0 and stage 0's term >= 0 (its
    drain offsets are 0, so sync_0 >= L_0 >= 0); memory, the boundaries and the stages' own all-reduces
    are left out (each only adds or restricts). Why: ``stage_count_lower_bound`` spreads the work over
    every GPU of the cluster at once, with no communication, which on a small cluster of mixed GPUs is far
    below any plan. The README's demo (4 GPUs, 17 blocks, the heuristics' plan 68.4 ms on the V100
    alone): its bounds were 24-59 ms for the 22 candidates CP-SAT then proved NO_BETTER, 0.1-0.4 CPU s
    each (presolve and search; 0.01-0.09 deterministic s); this one is 74-228 ms on 26 of its 28
    candidates, 5-24% below the candidate's optimum where CP-SAT found one (the tied embedding's
    ring between the first and the last stage is 7.1 ms inside a node, 121 ms across its 10 GbE), so
    the search skips them. Enumerated: at most 60 sequences x C(B - 1, S - 1) cuts, numpy over the cuts
    (0.3 CPU s for the demo's 28 candidates, computed once each); tests/test_bounds_small.py compares it
    with the brute-force optimum of random small instances."""
    from itertools import combinations

    from .network_terms import tied_terms
    from .tables import control_units

    n_g, nb, m = tab.num_gpus, tab.num_blocks, tab.num_microbatches
    if n_g > STRUCTURE_MAX_GPUS or num_stages > min(n_g, nb):
        return 0
    cuts = np.array([(0, *c, nb) for c in combinations(range(1, nb), num_stages - 1)], dtype=np.int64)
    floors: dict[tuple[int, ...], np.ndarray] = {}
    best = None
    for groups in _group_sequences(n_g, num_stages):
        if any(len(g) > tab.microbatch_size for g in groups):
            continue  # [C-samples]: every GPU of a stage takes >= 1 sample
        for g in groups:
            if g not in floors:
                floors[g] = _compute_floor(tab, g)
        c = np.stack([floors[g][cuts[:, s], cuts[:, s + 1]] for s, g in enumerate(groups)], axis=1)
        step = c.sum(axis=1) + (m - 1) * c.max(axis=1)
        control = control_units(tab, [x for g in groups for x in g])
        tied = _tied_per_cut(tab, cuts, groups, tied_terms)
        low = int((step + tied).min()) + control
        best = low if best is None else min(best, low)
    return best if best is not None else 0


def _tied_per_cut(tab: IntTables, cuts: np.ndarray, groups, tied_terms) -> np.ndarray:
    """Per cut (a row of ``cuts``: stage edges), max(0, max_s tied_s) of [C-tied] for the GPU groups
    ``groups``, from ``network_terms.tied_terms`` once per distinct placement of the tied blocks."""
    if not tab.tied_blocks:
        return np.zeros(len(cuts), dtype=np.int64)
    blocks = sorted({b for bs in tab.tied_blocks for b in bs})
    # the stage holding block q: the number of inner edges <= q
    where = np.stack([(cuts[:, 1:-1] <= q).sum(axis=1) for q in blocks], axis=1)
    out = np.zeros(len(cuts), dtype=np.int64)
    memo: dict[tuple[int, ...], int] = {}
    for r, key in enumerate(map(tuple, where.tolist())):
        if key not in memo:
            edges = cuts[r].tolist()
            _, tied = tied_terms(tab, [(edges[s], edges[s + 1]) for s in range(len(groups))], groups)
            memo[key] = max([0] + [x for x in tied if x is not None])
        out[r] = memo[key]
    return out
