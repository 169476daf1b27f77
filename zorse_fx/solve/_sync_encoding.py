"""Gradient synchronisation terms of the candidate model (model.py, the one
model builder of the per-GPU and class-level planners): the stage's own ring
all-reduce with its buckets, the cross-stage all-reduce of tied parameters and
the optimizer step, as 6 x the per-stage sync term of [C-objective].

The terms are objective.py's "step-time model" note over groups (model.py's
``_Group``: ``count`` units of ``unit`` GPUs each; k[c][s] units of group c in
stage s, p[c][s] = k[c][s] >= 1) and carry its tags. Units: time in integer ns
(objective.UNITS_PER_S), gradient sizes in KiB, as in ``build_tables``.

  allreduce_s = ring(max over present pairs inside s (c < d both present; the
                link inside a unit if unit > 1; between units if k >= 2) of
                the stage's sum less its excluded tied copies, GPUs of s)
                + (2 nb_s + sh_s) * (GPUs of s - 1) * max latency; ring(x, k) =
                ceil(x (k-1) / k) by one literal per k = GPUs of s and,
                under it, k d >= (k-1) x > k d - k (linear); nb_s = 1 + e_s,
                e_s = max(0, ceil((G_s - first_cap) / cap)) = (G_s - first_cap
                + cap - 1) // cap (AddDivisionEquality; G_s the stage's
                gradient KiB less its excluded tied copies, linear; first_cap
                < cap keeps the numerator >= 0), its latency product by
                AddMultiplicationEquality; a sharded stage (sh_s) also
                all-gathers its weights                                 [C-allreduce]
  tied        per tied parameter t with blocks q_1 < ... < q_r: same_s =
                in_s[q_1] and in_s[q_r] (all in s); excluded copies of stage
                s = sum_i in_s[q_i] - same_s; holders hold_s = OR_i in_s[q_i];
                when no same_s: the ring over the union of the holders' groups
                (units summed over holding stages) -- pairs and size as for a
                stage --, gated onto every holding stage; state, shard
                coverage and optim_s of stage s less dup_s = sum_i
                in_s[q_i] - hold_s copies of t (same_s with r = 2)     [C-tied]
  optim_s     = max over memory-bandwidth classes present (a sharded stage:
                each GPU's shard)                                       [C-optim]
  L_s         = the last bucket's ring: last_kib_s = G_s - cap e_s + (cap -
                first_cap) [e_s >= 1] (a literal on e_s >= 1; G_s with one
                bucket), LK_s = max(last_kib_s, untied KiB of the stage's
                first block: StageCuts.at_cut, linear); per bandwidth class
                q of the stage's pairs d_q = ring(lastb_coef[q] LK_s, k)
                with scale lastb_scale[q]
                (k scale d >= (k-1) x > k scale d - k scale, sharing the
                all-reduce ring's literals); the max of d_q over present
                pairs; when sh_s + ring(max over present pairs of own arsh
                - own ar, k), the all-gather; + (2 + sh_s) (k - 1) max
                latency (ag_s: the all-gather's ring and its (k - 1) max
                latency, 0 unsharded)                                   [C-objective]
  sync6_s     = max(6 allreduce_s - E_s - B6_s, 6 L_s - E_s, 6 (tied of s + ag_s))
                + 6 optim_s: 6 x the stage's sync term of objective.py's
                step, E_s = sum_{j<s} (k_E cmax_j + 3 boundary_j) (model.py's
                drain terms), B6_s = k_B or k_Brc x cmax-_s (model.py's bwd6;
                cmax-_s over the stage's blocks but its last) and
                the floors in integers (ceil((6 a - E - B) / 6) = a -
                floor((E + B) / 6)); a tied term is -6 s t_hi (<= -E_s <=
                6 L_s - E_s) on a stage not holding it                  [C-objective]

``tied_copies`` builds same_s and dup_s (model.py reads dup_s for the state
and shard terms too); ``sync_terms`` builds the rest and returns sync6_s per
stage; ``pair_max_many`` shares one presence literal per bandwidth class
between a stage's all-reduce and last-bucket maxima. Every quantity is
defined by an equality, as in the rest of the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ortools.sat.python import cp_model

from .objective import MIB_UNITS, bucket_count
from .network_terms import untied_block_kib
from ._encoding import StageCuts, any_of, both, gated, pair_max, pair_max_many

if TYPE_CHECKING:
    from .objective import IntTables

__all__ = ["TiedCopies", "tied_copies", "ring", "ring_literals", "sync_terms", "control_term"]


@dataclass(frozen=True)
class TiedCopies:
    """Per tied parameter t and stage s ([C-tied]): ``same[t][s]`` BoolVar, every
    block of t in s; ``dup[t][s]`` linear expression, the copies of t stage s
    holds once instead of once per block (its blocks in s less one if it holds
    any), left out of its state, shard and optimizer terms."""

    same: list
    dup: list


def tied_copies(m: cp_model.CpModel, tab: IntTables, cuts: StageCuts, num_stages: int) -> TiedCopies:
    """[C-tied] same_s and dup_s of every tied parameter (``tab.tied_blocks``) over
    the stages of ``cuts``."""
    in_s, stages = cuts.in_s, range(num_stages)
    # [C-tied] per tied parameter t: same_s = every block of t in stage s; dup[t][s] = the
    # copies stage s holds once instead of once per block (its blocks in s less one if it
    # holds any; with two blocks: same_s), less in its state, shard and optimizer terms.
    tsame, dup = [], []
    for t_, tb in enumerate(tab.tied_blocks):
        same_s = [both(m, in_s[s][tb[0]], in_s[s][tb[-1]], f"tsame_{t_}_{s}") for s in stages]
        tsame.append(same_s)
        if len(tb) == 2:
            dup.append(same_s)
        else:
            held = [any_of(m, [in_s[s][q] for q in tb], f"tdup_{t_}_{s}") for s in stages]
            dup.append([sum(in_s[s][q] for q in tb) - held[s] for s in stages])
    return TiedCopies(tsame, dup)


def ring_literals(m: cp_model.CpModel, kv, khi: int, name: str):
    """One literal per k = 1..khi, exactly one true: k = kv (``ring``'s); None when ``khi`` < 2."""
    if khi < 2:
        return None
    e = [m.new_bool_var(f"{name}_is{kk}") for kk in range(1, khi + 1)]
    m.add_exactly_one(e)
    m.add(sum(kk * lit for kk, lit in zip(range(1, khi + 1), e)) == kv)
    return e


def ring(m: cp_model.CpModel, units, kv, hi: int, khi: int, name: str, *, scale: int = 1, lits=None):
    """IntVar d = ceil(units * (k - 1) / (k * scale)) of a ring over kv = k >= 1
    GPUs ([C-allreduce], objective.ring_units), or 0 when ``khi`` < 2; ``hi``
    bounds d, ``khi`` bounds k; ``lits``: ``ring_literals(m, kv, khi, ...)`` to
    share (default: new ones). One literal per k (k = kv), under which two
    linear inequalities k scale d >= (k - 1) units > k scale d - k scale pin
    d. (A product units * (k - 1) of two variables then a division left
    CP-SAT's LP relaxation too weak -- seed 7 of
    test_cpsat_matches_brute_force_with_memory_policy did not reach OPTIMAL in
    its budget --, and division constraints by each constant k made CP-SAT
    exhaust memory (> 8 GB) on bench/planner_scaling.py's 256-GPU instance
    when warm-started.)"""
    if khi < 2:
        return 0
    e = ring_literals(m, kv, khi, name) if lits is None else lits
    d = m.new_int_var(0, hi, f"{name}_ring")
    m.add(d == 0).OnlyEnforceIf(e[0])
    for kk, lit in zip(range(2, khi + 1), e[1:]):
        m.add(kk * scale * d >= (kk - 1) * units).OnlyEnforceIf(lit)
        m.add(kk * scale * d <= (kk - 1) * units + kk * scale - 1).OnlyEnforceIf(lit)
    return d


def sync_terms(m: cp_model.CpModel, tab: IntTables, groups, *, p, k, size, cuts: StageCuts, tied: TiedCopies,
               sh, zc, drain6, bwd6, gpu_hi: int, lat_hi: int, drain_hi: int):
    """(sync6, sync_hi): per stage s, the linear expression sync6_s (6 x the
    stage's sync term less E_s, module note; ns units), and sync_hi >= every
    sync term before the factor 6.

    ``groups``: model.py's ``_Group`` list; ``p`` / ``k``: [group][stage]
    presence literals / unit counts; ``size[s]``: GPUs of stage s (linear);
    ``sh`` / ``zc``: per-stage sharding literals and [group][stage] shard MiB
    (None when sharding is "never"); ``drain6[j]`` = k_E cmax_j + 3 boundary_j
    (E_s = sum_{j<s}); ``bwd6[s]`` = B6_s = k_B (k_Brc: recomputing) cmax-_s; ``gpu_hi`` bounds
    the GPUs of a stage, ``lat_hi`` a link's latency, ``drain_hi`` one drain6
    and one bwd6 term."""
    n_s = len(size)
    rep = [q.members[0] for q in groups]
    b = tab.microbatch_size
    opt_hi = max(max(p_[-1] for p_ in tab.opt_prefix),
                 max((tab.cap_bytes[r] // MIB_UNITS * tab.opt_per_mib[tab.gpu_mbw_class[r]] for r in rep),
                     default=0) if sh else 0)
    ar_hi = max((p_[-1] for p_ in (tab.arsh_prefix if sh else tab.ar_prefix)), default=0)
    k_hi = max(1, min(tab.num_gpus, b))  # GPUs of one stage

    ex, tied_of, tied_hi = _tied_allreduce(m, tab, groups, p, k, cuts, tied, n_s, lat_hi=lat_hi, drain_hi=drain_hi)

    def own_ar(prefix, q, s):
        """The stage's sum of a per-block all-reduce table less its excluded tied copies."""
        return cuts.stage_sum(prefix[q], s) - sum(tab.tied_ar[t_][q] * ex[t_][s] for t_ in range(len(ex)))

    fk = untied_block_kib(tab)

    def first_kib(s):
        """The untied gradient KiB of stage s's first block (linear: at its cut)."""
        return cuts.at_cut(fk, s) if s > 0 else fk[0]

    def own_grad(s):
        """The stage's float32 gradient KiB G_s less its excluded tied copies ([C-allreduce]'s buckets)."""
        return cuts.stage_sum(tab.grad_kib_prefix, s) - sum(
            tab.tied_grad_kib[t_] * ex[t_][s] for t_ in range(len(ex)))

    extra_hi = bucket_count(tab.grad_kib_prefix[-1], tab.bucket_caps) - 1  # buckets after the first, at most
    arlat_hi = (2 * extra_hi + 3) * max(gpu_hi - 1, 0) * lat_hi
    # [C-objective] the last bucket's ring (LK_s KiB) and a sharded stage's all-gather.
    lk_hi = max(tab.bucket_caps[1], max(fk))  # LK_s <= the larger of a bucket and a block
    # a sharded stage's all-gather: its ring (the whole model's, at most) and its latency
    gather_ring_hi = max((a[-1] - b[-1] for a, b in zip(tab.arsh_prefix, tab.ar_prefix)), default=0) if sh else 0
    ag_hi = gather_ring_hi + max(gpu_hi - 1, 0) * lat_hi if sh else 0
    lring_hi = max((-(-c * lk_hi // sc) for c, sc in zip(tab.lastb_coef, tab.lastb_scale)), default=0) \
        + gather_ring_hi + 3 * max(gpu_hi - 1, 0) * lat_hi
    sync_hi = max(ar_hi + arlat_hi, lring_hi, tied_hi + ag_hi) + opt_hi

    # [C-allreduce] ring over the stage's pairs; [C-optim] slowest memory bandwidth of the stage.
    sync = []
    for s in range(n_s):
        terms = _stage_allreduce(m, tab, groups, p, k, size[s], s, sh, own_ar, own_grad, first_kib, gpu_hi=gpu_hi,
                                 lat_hi=lat_hi, ar_hi=ar_hi, k_hi=k_hi, extra_hi=extra_hi, lk_hi=lk_hi)
        # [C-objective] 6 x the stage's sync term: its own all-reduce overlaps its last backward
        # (B6_s) and the drain (E_s); its last bucket's ring only the drain.
        e_s = sum(drain6[:s])
        own = []
        if terms is None:  # no pair can be present: allreduce = last = 0, the term is -E_s
            ar = -e_s
        else:
            ar6 = m.new_int_var(-drain_hi * (s + 1), 6 * (ar_hi + arlat_hi), f"arown_{s}")
            m.add(ar6 == 6 * terms[0] - e_s - bwd6[s])
            last6 = m.new_int_var(-drain_hi * s, 6 * lring_hi, f"arlast_{s}")
            m.add(last6 == 6 * terms[1] - e_s)
            own = [ar6, last6]
        if own or tied_of[s]:  # [C-tied] the optimizer waits for the stage's own and its tied reductions
            if not own:
                own = [m.new_int_var(-drain_hi * s, 0, f"arown_{s}")]
                m.add(own[0] == ar)
            # a sharded holder's all-gather follows its optimizer step, so the tied ring too: tied_s + ag_s
            # (on a stage not holding t, its floor + 6 ag_s <= 6 L_s - E_s, still below an own term)
            ag6 = 6 * terms[2] if terms is not None else 0
            ar = m.new_int_var(-drain_hi * s, 6 * sync_hi, f"arw_{s}")
            m.add_max_equality(ar, [*own, *(tg + ag6 for tg in tied_of[s])])
        opt = _stage_optim(m, tab, groups, p, cuts, tied, s, sh, zc, opt_hi)
        sync.append(ar + 6 * opt)
    return sync, sync_hi


def _tied_allreduce(m: cp_model.CpModel, tab: IntTables, groups, p, k, cuts: StageCuts, tied: TiedCopies,
                    n_s: int, *, lat_hi: int, drain_hi: int):
    """[C-tied] (ex, tied_of, tied_hi): ex[t][s] the copies of tied parameter t
    stage s's own all-reduce leaves out; tied_of[s] the 6 x tied ring terms of
    stage s (one per tied parameter, a floor below any own term where s does
    not hold it; empty with one GPU or one stage); tied_hi bounds a tied ring."""
    in_s, stages, n_c = cuts.in_s, range(n_s), len(groups)
    unit = [q.unit for q in groups]
    count = [q.count for q in groups]
    single = [q.count == 1 for q in groups]
    # [C-tied] per tied parameter t: ex[t][s] = copies stage s's own all-reduce leaves out
    # (its blocks in s, less one if every block is in s), and per stage the all-reduce over
    # the union of the holders when they are in different stages (0 otherwise).
    ex = []
    tied_of = [[] for _ in stages]
    tied_hi = 0
    for t_, tb in enumerate(tab.tied_blocks):
        same_s = tied.same[t_]
        ex.append([sum(in_s[s][q] for q in tb) - same_s[s] for s in stages])
        if tab.num_gpus < 2 or n_s < 2:
            continue
        diff = m.new_bool_var(f"tdiff_{t_}")
        m.add(sum(same_s) == 0).OnlyEnforceIf(diff)
        m.add(sum(same_s) == 1).OnlyEnforceIf(diff.Not())
        hold = [any_of(m, [in_s[s][q] for q in tb], f"thold_{t_}_{s}") for s in stages]
        ksum, pu, ku = [], [], []
        for c in range(n_c):
            if single[c]:
                pc = any_of(m, [both(m, p[c][s], hold[s], f"tpu_{t_}_{c}_{s}") for s in stages], f"tpc_{t_}_{c}")
                ksum.append(unit[c] * pc)
                ku.append(None)
            else:
                kt = m.new_int_var(0, count[c], f"tkt_{t_}_{c}")
                m.add(kt == sum(gated(m, hold[s], k[c][s], count[c], f"tkh_{t_}_{c}_{s}") for s in stages))
                ksum.append(unit[c] * kt)
                pc = m.new_bool_var(f"tpc_{t_}_{c}")
                m.add(kt >= 1).OnlyEnforceIf(pc)
                m.add(kt == 0).OnlyEnforceIf(pc.Not())
                ku.append(kt)
            pu.append(pc)
        upairs = _present_pairs(m, groups, pu, ku, f"t{t_}")
        hi = max(tab.tied_ar[t_])
        xm, lm = pair_max(m, tab, upairs, lambda q, t_=t_: tab.tied_ar[t_][q], lambda q, t_=t_: tab.tied_ar[t_][q],
                          f"tied{t_}")
        kmax = tab.num_gpus
        ku = m.new_int_var(1, kmax, f"tk_{t_}")
        m.add(ku == sum(ksum))
        ku1 = m.new_int_var(0, kmax - 1, f"tk1_{t_}")
        m.add(ku1 == ku - 1)
        lat_t = m.new_int_var(0, kmax * lat_hi, f"tlat_{t_}")
        m.add(lat_t == _steps_times_lat_max(m, tab, upairs, ku1, kmax - 1, f"tl{t_}"))  # (k - 1) x lm, linear
        t_hi = hi + 2 * kmax * lat_hi
        tt = m.new_int_var(0, t_hi, f"tied_{t_}")
        m.add(tt == ring(m, xm, ku, hi, kmax, f"tr{t_}") + 2 * lat_t)
        tied_hi = max(tied_hi, t_hi)
        for s in stages:  # 6 x the ring on a holder ([C-objective]), else a floor below any own term
            held, tg = both(m, hold[s], diff, f"thd_{t_}_{s}"), m.new_int_var(-drain_hi * s, 6 * t_hi, f"tg_{t_}_{s}")
            m.add(tg == 6 * tt).OnlyEnforceIf(held)
            m.add(tg == -drain_hi * s).OnlyEnforceIf(held.Not())
            tied_of[s].append(tg)
    return ex, tied_of, tied_hi


def control_term(m: cp_model.CpModel, tab: IntTables, groups, p, k, allow_idle_gpus: bool):
    """[C-control] r x one pass of the used GPUs' ring (objective.py; ``tables.control_units``;
    ``solve.tables.control_pass``): an int when every GPU is used (``tab.world_pass``), else IntVars over
    the used groups' pairs (``_present_pairs``, as [C-tied]'s union): W - 1 steps at the largest latency,
    in one datacenter; spanning D >= 2 datacenters, x = min(D, W - 1) of them at the largest latency and
    the rest at the largest latency inside one datacenter. A group's GPUs share one datacenter (a GPU
    class shares a node; ``grouped._groups`` merges nodes of one datacenter only)."""
    r, n_g = tab.control_rounds, tab.num_gpus
    if not r or n_g < 2:
        return tab.step_overhead
    if not allow_idle_gpus:
        return r * tab.world_pass + tab.step_overhead
    used, units, size = [], [], []
    for c, q in enumerate(groups):
        if q.count == 1:  # in one stage at most: used = sum_s p
            u = m.new_bool_var(f"wu_{c}")
            m.add(u == sum(p[c]))
            units.append(None)
            size.append(q.unit * u)
        else:
            kt = m.new_int_var(0, q.count, f"wk_{c}")
            m.add(kt == sum(k[c]))
            u = m.new_bool_var(f"wu_{c}")
            m.add(kt >= 1).OnlyEnforceIf(u)
            m.add(kt == 0).OnlyEnforceIf(u.Not())
            units.append(kt)
            size.append(q.unit * kt)
        used.append(u)
    pairs = _present_pairs(m, groups, used, units, "w")
    if not pairs:
        return tab.step_overhead
    w1 = m.new_int_var(0, n_g - 1, "world_w1")
    m.add(w1 == sum(size) - 1)
    dc_of = [tab.gpu_dc[q.members[0]] if tab.gpu_dc else 0 for q in groups]
    if len(set(dc_of)) < 2:  # one datacenter: (W - 1) lat_max
        return r * _steps_times_lat_max(m, tab, pairs, w1, n_g - 1, "world") + tab.step_overhead
    return r * _two_level_pass(m, tab, pairs, used, dc_of, w1) + tab.step_overhead


def _steps_times_lat_max(m: cp_model.CpModel, tab: IntTables, pairs, w1, w1_hi: int, name: str):
    """w1 x (the largest latency of a present pair) as a linear sum: with the pairs' distinct latencies
    L_1 < ... < L_n (L_0 = 0), sum_k (L_k - L_{k-1}) y_k, y_k = w1 where a pair of latency >= L_k is
    present, else 0 (enforced equalities). A product constraint (``add_multiplication_equality``) was
    exact too but slowed CP-SAT's search: on amp the same budget returned 0.3319 s with it, 0.3155 s
    with this (bench/LOG.md "Control collectives across datacenters ...")."""
    by_lat: dict[int, list] = {}
    for (g, h), y in pairs:
        by_lat.setdefault(tab.pair_lat[g][h], []).append(y)
    levels = sorted(by_lat)
    terms, above = [], []
    for k in range(len(levels) - 1, -1, -1):  # from the largest latency down: b_k = some pair at >= L_k
        lat = levels[k]
        above = above + by_lat[lat]
        b = any_of(m, above, f"{name}_ge{lat}")
        y = m.new_int_var(0, w1_hi, f"{name}_y{lat}")
        m.add(y == w1).OnlyEnforceIf(b)
        m.add(y == 0).OnlyEnforceIf(b.Not())
        terms.append((lat - (levels[k - 1] if k else 0)) * y)
    return sum(terms)


def _two_level_pass(m: cp_model.CpModel, tab: IntTables, pairs, used, dc_of, w1):
    """[C-control]'s pass over groups in several datacenters: (W - 1 - x) lat_dc + x lat_max, x = min(D,
    W - 1) where the used groups span D >= 2 datacenters, else 0 (``solve.tables.control_pass``); both
    products linear (``_steps_times_lat_max``)."""
    n_g, dcs = tab.num_gpus, sorted(set(dc_of))
    same = [(pair, y) for pair, y in pairs if tab.gpu_dc[pair[0]] == tab.gpu_dc[pair[1]]]
    in_dc = []
    for d in dcs:
        y = m.new_bool_var(f"wdc_{d}")
        m.add_max_equality(y, [u for u, e in zip(used, dc_of) if e == d])
        in_dc.append(y)
    n_dc = m.new_int_var(0, len(dcs), "world_dcs")
    m.add(n_dc == sum(in_dc))
    spans = m.new_bool_var("world_spans")
    m.add(n_dc >= 2).OnlyEnforceIf(spans)
    m.add(n_dc <= 1).OnlyEnforceIf(spans.Not())
    xm = m.new_int_var(0, len(dcs), "world_xm")
    m.add_min_equality(xm, [n_dc, w1])
    x = m.new_int_var(0, len(dcs), "world_x")
    m.add(x == xm).OnlyEnforceIf(spans)
    m.add(x == 0).OnlyEnforceIf(spans.Not())
    rest = m.new_int_var(0, n_g - 1, "world_rest")
    m.add(rest == w1 - x)
    # (no two used GPUs in one datacenter: nothing at lat_dc)
    local = _steps_times_lat_max(m, tab, same, rest, n_g - 1, "world_dc") if same else 0
    return local + _steps_times_lat_max(m, tab, pairs, x, len(dcs), "world_x")


def _present_pairs(m: cp_model.CpModel, groups, present, units, name: str):
    """The links a ring over the used units of ``groups`` crosses, each with its
    presence literal, for ``pair_max`` ([C-allreduce], [C-tied]): ``present[c]``
    group c is used, ``units[c]`` its used units (None for a one-unit group).
    The link inside a unit (unit > 1: a used unit has >= 2 GPUs), the link
    between two units of a group (>= 2 used), the link between two used groups."""
    rep = [q.members[0] for q in groups]
    pairs = []
    for c, q in enumerate(groups):
        if q.unit > 1:
            pairs.append((q.link_in, present[c]))
        if units[c] is not None:
            two = m.new_bool_var(f"{name}_two_{c}")
            m.add(units[c] >= 2).OnlyEnforceIf(two)
            m.add(units[c] <= 1).OnlyEnforceIf(two.Not())
            pairs.append((q.link_out, two))
    for c in range(len(groups)):
        for d in range(c + 1, len(groups)):
            pairs.append(((rep[c], rep[d]), both(m, present[c], present[d], f"{name}_w_{c}_{d}")))
    return pairs


def _stage_allreduce(m: cp_model.CpModel, tab: IntTables, groups, p, k, size_s, s: int, sh, own_ar, own_grad,
                     first_kib, *, gpu_hi: int, lat_hi: int, ar_hi: int, k_hi: int, extra_hi: int, lk_hi: int):
    """([C-allreduce] allreduce_s, [C-objective] L_s, [C-tied] ag_s: a sharded
    stage's all-gather, 0 unsharded) of stage s as expressions, or None when no
    pair can be present. ``own_ar(prefix, q, s)`` / ``own_grad(s)``:
    the stage's all-reduce table of bandwidth class q / gradient KiB less its
    excluded tied copies; ``first_kib(s)`` its first block's untied KiB, <=
    ``lk_hi``."""
    pairs = _present_pairs(m, groups, [p[c][s] for c in range(len(groups))],
                           [k[c][s] if q.count > 1 else None for c, q in enumerate(groups)], f"s{s}")
    if not (pairs and gpu_hi > 1):
        return None
    first_cap, cap = tab.bucket_caps
    ksz = m.new_int_var(1, k_hi, f"size_{s}")
    m.add(ksz == size_s)
    lits = ring_literals(m, ksz, k_hi, f"arr{s}")
    # [C-objective] the last bucket's KiB G_s - cap e_s + (cap - first_cap) [e_s >= 1] (set
    # below) and its ring on each bandwidth class of the stage's pairs (class units).
    # LK_s = max(last_kib, the stage's first block's untied KiB: at its cut, linear).
    last_kib = m.new_int_var(0, cap, f"lastk_{s}")
    lk = m.new_int_var(0, lk_hi, f"lastkf_{s}")
    m.add_max_equality(lk, [last_kib, first_kib(s)])
    lring, lring_hi = {}, {}
    for q in sorted({tab.pair_bw_class[g][h] for (g, h), _ in pairs}):
        coef, sc = tab.lastb_coef[q], tab.lastb_scale[q]
        lring_hi[q] = -(-coef * lk_hi // sc)
        lring[q] = ring(m, coef * lk, ksz, lring_hi[q], k_hi, f"lr{s}_{q}", scale=sc, lits=lits)
    values = [(lambda q: own_ar(tab.ar_prefix, q, s), lambda q: tab.ar_prefix[q][-1]),
              (lambda q: lring[q], lambda q: lring_hi[q])]
    if sh:  # the all-reduce's (2 grad + param) bytes; the all-gather's param bytes
        values += [(lambda q: own_ar(tab.arsh_prefix, q, s), lambda q: tab.arsh_prefix[q][-1]),
                   (lambda q: own_ar(tab.arsh_prefix, q, s) - own_ar(tab.ar_prefix, q, s),
                    lambda q: tab.arsh_prefix[q][-1] - tab.ar_prefix[q][-1])]
    xs, lw = pair_max_many(m, tab, pairs, values, f"ar{s}")
    arb, last_ring = xs[0], xs[1]
    sz1 = m.new_int_var(0, gpu_hi, f"size1_{s}")
    m.add(sz1 == size_s - 1)
    lat_term = m.new_int_var(0, gpu_hi * lat_hi, f"arlat_{s}")
    m.add(lat_term == _steps_times_lat_max(m, tab, pairs, sz1, gpu_hi, f"arl{s}"))  # (k - 1) x lw, linear
    grad_lat = 2 * lat_term  # the first bucket's ring
    if extra_hi > 0:  # e_s more buckets, each a ring of 2 (k - 1) latencies
        # e_s = (G_s - first_cap + cap - 1) // cap, the numerator >= cap - 1 - first_cap
        # >= 0 (division by a constant: with the two linear inequalities it pins
        # instead, CP-SAT stalled -- test_stage_dp seed 0, S=2, M=4: 0.9 deterministic
        # s without proving optimality, 0.03 s with the division).
        num = m.new_int_var(cap - 1 - first_cap, tab.grad_kib_prefix[-1] + cap - 1 - first_cap, f"nbn_{s}")
        m.add(num == own_grad(s) - first_cap + cap - 1)
        e_s = m.new_int_var(0, extra_hi, f"nbx_{s}")
        m.add_division_equality(e_s, num, cap)
        e_lat = m.new_int_var(0, extra_hi * gpu_hi * lat_hi, f"nblat_{s}")
        m.add_multiplication_equality(e_lat, [e_s, lat_term])
        grad_lat += 2 * e_lat
        more = m.new_bool_var(f"nbm_{s}")  # e_s >= 1
        m.add(e_s >= 1).OnlyEnforceIf(more)
        m.add(e_s == 0).OnlyEnforceIf(more.Not())
        m.add(last_kib == own_grad(s) - cap * e_s + (cap - first_cap) * more)
    else:  # one bucket holds every stage's gradients
        m.add(last_kib == own_grad(s))
    if not sh:
        return (ring(m, arb, ksz, ar_hi, k_hi, f"arr{s}", lits=lits) + grad_lat, last_ring + 2 * lat_term, 0)
    # A sharded stage also all-gathers its weights, after the last bucket.
    hi = max(p_[-1] for p_ in tab.arsh_prefix)
    sel = m.new_int_var(0, hi, f"arsel_{s}")
    m.add(sel == arb).OnlyEnforceIf(sh[s].Not())
    m.add(sel == xs[2]).OnlyEnforceIf(sh[s])
    ghi = max(a[-1] - b[-1] for a, b in zip(tab.arsh_prefix, tab.ar_prefix))
    gather = ring(m, gated(m, sh[s], xs[3], ghi, f"ag_{s}"), ksz, ghi, k_hi, f"agr{s}", lits=lits)
    gather_lat = gated(m, sh[s], lat_term, gpu_hi * lat_hi, f"arl_{s}")
    return (ring(m, sel, ksz, hi, k_hi, f"arr{s}", lits=lits) + grad_lat + gather_lat,
            last_ring + gather + 2 * lat_term + gather_lat, gather + gather_lat)


def _stage_optim(m: cp_model.CpModel, tab: IntTables, groups, p, cuts: StageCuts, tied: TiedCopies, s: int,
                 sh, zc, opt_hi: int):
    """[C-optim] IntVar optim_s: the largest optimizer time over the memory-bandwidth
    classes present in stage s (unsharded: the stage's optimizer table less its
    dup_s tied copies; sharded: each GPU's shard of zc MiB)."""
    n_c, dup = len(groups), tied.dup
    rep = [q.members[0] for q in groups]
    opt_terms = []
    for q in sorted(set(tab.gpu_mbw_class)):
        members = [p[c][s] for c in range(n_c) if tab.gpu_mbw_class[rep[c]] == q]
        if members:
            flag = any_of(m, members, f"o_{q}_{s}")
            if sh:
                flag = both(m, flag, sh[s].Not(), f"on_{q}_{s}")
            opt_terms.append(gated(m, flag, cuts.stage_sum(tab.opt_prefix[q], s) - sum(
                tab.tied_opt[t_][q] * dup[t_][s] for t_ in range(len(dup))),
                tab.opt_prefix[q][-1], f"oz_{q}_{s}"))
    if sh:
        opt_terms += [tab.opt_per_mib[tab.gpu_mbw_class[rep[c]]] * zc[c][s] for c in range(n_c)]
    opt = m.new_int_var(0, opt_hi, f"opt_{s}")
    m.add_max_equality(opt, opt_terms)
    return opt
