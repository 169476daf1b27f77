"""The grouped CP-SAT planner: the per-GPU model of cpsat.py restricted by symmetry.

GPU *classes* are sets of GPUs that are interchangeable with each other and
uniform towards every other class: same type, node, usable memory, memory
bandwidth; every pair inside a class has the same link (rounded bandwidth
class, latency) and every pair (g in c, h in d) of two classes c != d has the
same link. ``gpu_classes`` finds the coarsest such partition that refines
(type, node, memory, memory bandwidth) -- in practice "same type on the same
node".

Decision space (a restriction of the per-GPU one: all GPUs of a class in one
stage take the same share of the micro-batch):

  k[c][s] in [0, min(|c|, b)]: GPUs of class c in stage s;
      sum_s k[c][s] <= |c| (== |c| without idle GPUs)              [C-assign]
  n[c][s] in [1, b] iff k[c][s] >= 1 (else 0): samples per GPU;
      sum_c k[c][s] * n[c][s] = b  (AddMultiplicationEquality)      [C-samples]
  cuts / block membership exactly as cpsat.py (ge, in_s)           [C-cuts]

and the terms of objective.py's note over classes instead of GPUs:

  compute_cs  = sum_q w[type(c)][q] z[c][s][q] + sum_q f[type(c)][q] u[c][s][q]
                (z[c][s][q] = n[c][s] if block q is in stage s, else 0;
                u = z >= 1)                                        [C-compute]
  boundary_s  = 2 * (max over present class pairs (c in s, d in s+1) of the
                pair's rounded transfer time + max latency); the pair (c, c)
                is present iff k[c][s] >= 1 and k[c][s+1] >= 1      [C-boundary]
  t_s         = max_c compute_cs + boundary_s                       [C-stage]
  allreduce_s = max over present pairs inside s (c < d: both present; (c, c):
                k[c][s] >= 2) + 2 * (sum_c k[c][s] - 1) * max latency [C-allreduce]
  optim_s     = max over memory-bandwidth classes present           [C-optim]
  memory_c    = as objective.py's [C-memory] with n = n[c][s] and the
                shard zc[c][s] (MiB per GPU of c in a sharded stage s);
                coverage: sum_c unit * k[c][s] * zc[c][s] MiB >= Q_s    [C-shard]
  (recomputation adds the recomputed forward to compute_cs)         [C-recompute]
  step        = sum_s t_s + (M - 1) max_s t_s + max_s (allreduce_s + optim_s)
                                                                    [C-objective]

Units: time in integer ns (objective.UNITS_PER_S), memory in KiB
(objective.MEMORY_UNIT_BYTES), exactly the tables of ``build_tables``.
Every derived quantity is defined by equalities, so the objective of any
solution equals ``evaluate()`` of its expansion to GPUs (the first k[c][0]
GPUs of class c, in index order, go to stage 0, the next k[c][1] to stage 1,
...); ``solve_grouped`` asserts this on every answer.

Node aggregation (``aggregate_nodes``; automatic above AGGREGATE_ABOVE
classes): classes of identical nodes (same type, memory, memory bandwidth,
size, inside link, the same link between any two of them and to every other
class) merge into one *group* of ``count`` nodes of ``unit`` GPUs, and stages
take whole nodes: k[c][s] counts nodes, a stage holds unit * k[c][s] GPUs, the
pair (c, c) inside a stage has the intra-node link iff c is present and the
inter-node link iff k[c][s] >= 2, and (c, c) across two stages is always
inter-node. A further restriction, exact w.r.t. ``evaluate`` like the rest.
Plain classes are groups with unit = 1.

Model size: O(C^2 S) pair booleans and O(C S B) sample-through-block
variables (C = number of groups), independent of the GPU count.
Redundant constraints: tmax >= every class compute and a throughput bound
(see the model); [C-symmetry]: interchangeable groups are ordered.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from ..options import PlanOptions
from .cpsat import _memory_limit, _policy_vars, _stage_input_kib, matching_hint
from .objective import (MIB_UNITS, IntTables, build_tables, inflight, max_stage_count,
                        microbatch_candidates)
from ._encoding import StageCuts
from ._encoding import any_of as _any_of
from ._encoding import blocks_of as _blocks
from ._encoding import both as _both
from ._encoding import gated as _gated
from ._encoding import pair_max
from ._search import CandidateSearch
from .decision import Decision
from .records import BlockCosts, DeviceGraph, SolverResult

__all__ = ["gpu_classes", "solve_grouped"]


def gpu_classes(devices: DeviceGraph, tab: IntTables) -> list[list[int]]:
    """Partition the GPUs into classes (sorted member lists, ordered by first member).

    Start from (type, node, usable memory, memory-bandwidth class) and refine
    until every class-pair block of the link matrix (rounded bandwidth class,
    latency) is constant, off the diagonal inside a class too. A non-uniform
    cross block (c, d) splits c by its rows over d; a non-uniform block inside
    a class splits it into singletons (never seen on real clusters)."""
    n_g = tab.num_gpus
    nodes = devices.node_names or ("",) * n_g
    keys: dict[tuple, list[int]] = defaultdict(list)
    for g in range(n_g):
        keys[(devices.gpu_types[g], nodes[g], tab.cap_bytes[g], tab.gpu_mbw_class[g])].append(g)
    return _refine(_link_code(tab), list(keys.values()))


def _link_code(tab: IntTables) -> np.ndarray:
    """(G, G) integer code of each link: (rounded bandwidth class, latency)."""
    lat = np.asarray(tab.pair_lat, dtype=np.int64)
    return np.asarray(tab.pair_bw_class, dtype=np.int64) * (int(lat.max()) + 1) + lat


def _refine(code: np.ndarray, start: list[list[int]]) -> list[list[int]]:
    """Coarsest refinement of ``start`` whose blocks of ``code`` are constant
    (off the diagonal inside a part). Parts sorted, ordered by first member."""
    classes = [np.asarray(v) for v in start]
    changed = True
    while changed:
        changed = False
        for ci in range(len(classes)):
            c = classes[ci]
            if len(c) > 1:
                sub = code[np.ix_(c, c)]
                off = sub[~np.eye(len(c), dtype=bool)]
                if (off != off[0]).any():
                    classes[ci:ci + 1] = [np.asarray([g]) for g in c]
                    changed = True
                    break
            for d in classes:
                if d is c:
                    continue
                sub = code[np.ix_(c, d)]
                if (sub != sub.flat[0]).any():
                    groups: dict[bytes, list[int]] = defaultdict(list)
                    for row, g in zip(sub, c):
                        groups[row.tobytes()].append(int(g))
                    if len(groups) == 1:
                        continue  # rows equal, columns differ: d gets split when it is c
                    classes[ci:ci + 1] = [np.asarray(v) for v in groups.values()]
                    changed = True
                    break
            if changed:
                break
    out = sorted((sorted(int(g) for g in c) for c in classes), key=lambda c: c[0])
    return out


@dataclass(frozen=True)
class _Group:
    """A unit of decision: ``count`` interchangeable units of ``unit`` GPUs each.

    A plain class (unit = 1) or, with node aggregation, ``count`` identical
    nodes of one class each (unit = GPUs per node; stages take whole nodes).
    ``members`` lists the GPUs unit by unit (node by node). ``link_in``: a GPU
    pair inside one unit (None if unit = 1); ``link_out``: a pair in two
    different units (None if count = 1)."""

    members: tuple[int, ...]
    unit: int
    count: int
    link_in: tuple[int, int] | None
    link_out: tuple[int, int] | None


def _groups(devices: DeviceGraph, tab: IntTables, aggregate: bool) -> list[_Group]:
    """Plain classes, or (``aggregate``) classes of identical nodes merged.

    Two classes merge when they have the same type, usable memory, memory
    bandwidth, size and inside link, the same link to each other and the
    same links to every other class (class-level refinement, ``_refine``)."""
    classes = gpu_classes(devices, tab)
    if not aggregate:
        return [_Group(tuple(c), 1, len(c), None, (c[0], c[1]) if len(c) > 1 else None) for c in classes]
    code = _link_code(tab)
    reps = [c[0] for c in classes]
    cc = code[np.ix_(reps, reps)]
    keys: dict[tuple, list[int]] = defaultdict(list)
    for i, c in enumerate(classes):
        g = c[0]
        keys[(devices.gpu_types[g], tab.cap_bytes[g], tab.gpu_mbw_class[g], len(c),
              int(code[c[0], c[1]]) if len(c) > 1 else -1)].append(i)
    out = []
    for part in _refine(cc, list(keys.values())):
        cs = [classes[i] for i in part]
        if len(cs) == 1:
            c = cs[0]
            out.append(_Group(tuple(c), 1, len(c), None, (c[0], c[1]) if len(c) > 1 else None))
        else:
            unit = len(cs[0])
            out.append(_Group(tuple(g for c in cs for g in c), unit, len(cs),
                              (cs[0][0], cs[0][1]) if unit > 1 else None, (cs[0][0], cs[1][0])))
    return sorted(out, key=lambda q: q.members[0])


class _GroupedModel:
    """CP-SAT model of one (S, M) candidate over GPU classes (see the module note)."""

    def __init__(self, tab: IntTables, devices: DeviceGraph, options: PlanOptions,
                 groups: list[_Group], num_stages: int):
        self.tab, self.S, self.groups = tab, num_stages, groups
        self.m = m = cp_model.CpModel()
        n_s, nb, b = num_stages, tab.num_blocks, tab.microbatch_size
        n_c = len(groups)
        cls, stages, blocks = range(n_c), range(n_s), range(nb)
        wsum = cp_model.LinearExpr.WeightedSum
        rep = [q.members[0] for q in groups]
        unit = [q.unit for q in groups]
        count = [q.count for q in groups]
        ctype = [tab.gpu_types[r] for r in rep]

        # [C-assign] k[c][s] units (GPUs, or whole nodes when aggregated) of group c in stage s;
        # every GPU takes >= 1 of the b samples, so unit * k <= b.
        self.k = k = [[m.NewIntVar(0, min(count[c], b // unit[c]), f"k_{c}_{s}") for s in stages] for c in cls]
        self.p = p = [[m.NewBoolVar(f"p_{c}_{s}") for s in stages] for c in cls]
        for c in cls:
            if options.allow_idle_gpus:
                m.Add(sum(k[c]) <= count[c])
            else:
                m.Add(sum(k[c]) == count[c])
            for s in stages:
                m.Add(k[c][s] >= 1).OnlyEnforceIf(p[c][s])
                m.Add(k[c][s] == 0).OnlyEnforceIf(p[c][s].Not())
        size = [sum(unit[c] * k[c][s] for c in cls) for s in stages]
        for s in stages:
            m.AddBoolOr([p[c][s] for c in cls])
            m.Add(size[s] <= b)

        # [C-cuts] as in cpsat.py (encoding in _encoding.py).
        cuts = StageCuts(m, nb, n_s)
        self.cut, in_s = cuts.cut, cuts.in_s
        stage_sum, at_cut = cuts.stage_sum, cuts.at_cut

        def gated(flag, value, hi, name):
            return _gated(m, flag, value, hi, name)

        # [C-shard] / [C-recompute] per-stage policy (as cpsat.py).
        self.sh, self.rc = sh, rc = _policy_vars(m, tab, size, n_s)

        def any_of(lits, name):
            return _any_of(m, lits, name)

        def both(a, c, name):
            return _both(m, a, c, name)

        # [C-samples] n[c][s] in [1, b] iff present; sum_c unit * k * n = b.
        self.n = n = [[m.NewIntVar(0, b, f"n_{c}_{s}") for s in stages] for c in cls]
        # z[c][s][q] = n[c][s] if block q is in stage s, else 0 (a class may serve
        # several stages, so per (class, stage)); u = z >= 1 (pays the fixed cost).
        z = [[[m.NewIntVar(0, b, f"z_{c}_{s}_{q}") for q in blocks] for s in stages] for c in cls]
        u = [[[m.NewBoolVar(f"u_{c}_{s}_{q}") for q in blocks] for s in stages] for c in cls]
        for s in stages:
            tots = []
            for c in cls:
                m.Add(n[c][s] >= 1).OnlyEnforceIf(p[c][s])
                m.Add(n[c][s] == 0).OnlyEnforceIf(p[c][s].Not())
                if count[c] == 1:
                    tots.append(unit[c] * n[c][s])  # k = p: k * n = n
                else:
                    tot = m.NewIntVar(0, b, f"kn_{c}_{s}")
                    m.AddMultiplicationEquality(tot, [k[c][s], n[c][s]])
                    tots.append(unit[c] * tot)
                for q in blocks:
                    m.Add(z[c][s][q] == n[c][s]).OnlyEnforceIf(in_s[s][q])
                    m.Add(z[c][s][q] == 0).OnlyEnforceIf(in_s[s][q].Not())
                    m.Add(z[c][s][q] >= 1).OnlyEnforceIf(u[c][s][q])
                    m.Add(z[c][s][q] == 0).OnlyEnforceIf(u[c][s][q].Not())
            m.Add(sum(tots) == b)

        # [C-compute]
        lat_hi = max(max(r) for r in tab.pair_lat) if tab.num_gpus > 1 else 0
        work_hi = b * max(p_[-1] for p_ in tab.work_prefix.values()) + \
            max(p_[-1] for p_ in tab.fixed_prefix.values())
        t_hi = work_hi + 2 * (max((max(r) for r in tab.xfer), default=0) + lat_hi)
        gpu_hi = min(tab.num_gpus, b * n_s)
        if rc:
            work_hi += b * max(p_[-1] for p_ in tab.rc_work_prefix.values()) + \
                max(p_[-1] for p_ in tab.rc_fixed_prefix.values())
            t_hi = work_hi + 2 * (max((max(r) for r in tab.xfer), default=0) + lat_hi)
        tmax = m.NewIntVar(0, t_hi, "tmax")
        # compute[c][s] = n W + F of a GPU of c in stage s (0 when c is absent from s).
        comp = [[None] * n_s for _ in cls]
        for c in cls:
            for s in stages:
                cc = m.NewIntVar(0, work_hi, f"comp_{c}_{s}")
                extra = 0
                if rc:  # [C-compute] the recomputed forward
                    extra = gated(rc[s], wsum(z[c][s], _blocks(tab.rc_work_prefix[ctype[c]]))
                                  + wsum(u[c][s], _blocks(tab.rc_fixed_prefix[ctype[c]])), work_hi, f"rcw_{c}_{s}")
                m.Add(cc == wsum(z[c][s], _blocks(tab.work_prefix[ctype[c]]))
                      + wsum(u[c][s], _blocks(tab.fixed_prefix[ctype[c]])) + extra)
                m.Add(tmax >= cc)  # redundant
                comp[c][s] = cc
        # Redundant throughput bound (valid for every decision): with w_ref[q] the
        # fastest type's time of block q and r_g = max_q w_ref[q] / w_type(g)[q] <= 1,
        # sum_g r_g compute_g >= b * sum_q w_ref[q] and compute_g <= tmax.
        wt = {t_: _blocks(tab.work_prefix[t_]) for t_ in set(ctype)}
        w_ref = [min(wt[t_][q] for t_ in wt) for q in blocks]
        r_sum = 0.0
        for c in cls:
            r_g = max((w_ref[q] / wt[ctype[c]][q] for q in blocks if wt[ctype[c]][q] > 0), default=1.0)
            r_sum += r_g * len(groups[c].members)
        if r_sum > 0:
            m.Add(tmax >= int(b * sum(w_ref) / r_sum * (1 - 1e-9)))
        t = []
        for s in stages:
            cs = m.NewIntVar(0, work_hi, f"comp_s{s}")
            m.AddMaxEquality(cs, [comp[c][s] for c in cls])
            # [C-boundary]
            if s < n_s - 1:
                # (c, c): GPUs of two different units of c (whole nodes / distinct GPUs).
                pairs = [((rep[c], rep[d]) if c != d else groups[c].link_out,
                          both(p[c][s], p[d][s + 1], f"y_{c}_{d}_{s}"))
                         for c in cls for d in cls if c != d or count[c] > 1]
                xm, lm = pair_max(m, tab, pairs, lambda q, s=s: at_cut(tab.xfer[q], s + 1),
                                  lambda q: max(tab.xfer[q]), f"bd{s}")
                bnd = 2 * xm + 2 * lm
            else:
                bnd = 0
            ts = m.NewIntVar(0, t_hi, f"t_{s}")
            m.Add(ts == cs + bnd)  # [C-stage]
            t.append(ts)

        # [C-shard] zc[c][s]: MiB per GPU of c in sharded stage s (0 otherwise).
        self.zc = zc = None
        if sh:
            zc = [[m.NewIntVar(0, tab.cap_bytes[rep[c]] // MIB_UNITS, f"zc_{c}_{s}") for s in stages] for c in cls]
            for s in stages:
                held = []
                for c in cls:
                    m.Add(zc[c][s] == 0).OnlyEnforceIf(both(p[c][s], sh[s], f"psh_{c}_{s}").Not())
                    if count[c] == 1:
                        held.append(unit[c] * zc[c][s])
                    else:
                        kz = m.NewIntVar(0, count[c] * (tab.cap_bytes[rep[c]] // MIB_UNITS), f"kz_{c}_{s}")
                        m.AddMultiplicationEquality(kz, [k[c][s], zc[c][s]])
                        held.append(unit[c] * kz)
                m.Add(MIB_UNITS * sum(held) >= stage_sum(tab.shard_prefix, s)).OnlyEnforceIf(sh[s])
            self.zc = zc
        opt_hi = max(max(p_[-1] for p_ in tab.opt_prefix),
                     max((tab.cap_bytes[r] // MIB_UNITS * tab.opt_per_mib[tab.gpu_mbw_class[r]] for r in rep),
                         default=0) if sh else 0)
        ar_hi = max((p_[-1] for p_ in (tab.arsh_prefix if sh else tab.ar_prefix)), default=0)
        sync_hi = ar_hi + 3 * max(gpu_hi - 1, 0) * lat_hi + opt_hi

        # [C-allreduce] / [C-optim]
        sync = []
        for s in stages:
            pairs = []
            for c in cls:
                if unit[c] > 1:  # a used node has >= 2 GPUs: its inside link is present
                    pairs.append((groups[c].link_in, p[c][s]))
                if count[c] > 1:  # >= 2 units used: the link between units is present
                    two = m.NewBoolVar(f"two_{c}_{s}")
                    m.Add(k[c][s] >= 2).OnlyEnforceIf(two)
                    m.Add(k[c][s] <= 1).OnlyEnforceIf(two.Not())
                    pairs.append((groups[c].link_out, two))
                for d in range(c + 1, n_c):
                    pairs.append(((rep[c], rep[d]), both(p[c][s], p[d][s], f"w_{c}_{d}_{s}")))
            if pairs and gpu_hi > 1:
                arb, lw = pair_max(m, tab, pairs, lambda q, s=s: stage_sum(tab.ar_prefix[q], s),
                                   lambda q: tab.ar_prefix[q][-1], f"ar{s}")
                sz1 = m.NewIntVar(0, gpu_hi, f"size1_{s}")
                m.Add(sz1 == size[s] - 1)
                lat_term = m.NewIntVar(0, gpu_hi * lat_hi, f"arlat_{s}")
                m.AddMultiplicationEquality(lat_term, [sz1, lw])
                if sh:  # a sharded stage also all-gathers its weights
                    arb_sh, _ = pair_max(m, tab, pairs, lambda q, s=s: stage_sum(tab.arsh_prefix[q], s),
                                         lambda q: tab.arsh_prefix[q][-1], f"as{s}")
                    hi = max(p_[-1] for p_ in tab.arsh_prefix)
                    ar = (gated(sh[s].Not(), arb, hi, f"arp_{s}") + gated(sh[s], arb_sh, hi, f"ars_{s}")
                          + 2 * lat_term + gated(sh[s], lat_term, gpu_hi * lat_hi, f"arl_{s}"))
                else:
                    ar = arb + 2 * lat_term
            else:
                ar = 0
            opt_terms = []
            for q in sorted(set(tab.gpu_mbw_class)):
                members = [p[c][s] for c in cls if tab.gpu_mbw_class[rep[c]] == q]
                if members:
                    flag = any_of(members, f"o_{q}_{s}")
                    if sh:
                        flag = both(flag, sh[s].Not(), f"on_{q}_{s}")
                    opt_terms.append(gated(flag, stage_sum(tab.opt_prefix[q], s),
                                           tab.opt_prefix[q][-1], f"oz_{q}_{s}"))
            if sh:
                opt_terms += [tab.opt_per_mib[tab.gpu_mbw_class[rep[c]]] * zc[c][s] for c in cls]
            opt = m.NewIntVar(0, opt_hi, f"opt_{s}")
            m.AddMaxEquality(opt, opt_terms)
            sync.append(ar + opt)

        # [C-memory] (KiB), per policy combination
        for s in stages:
            state = stage_sum(tab.state_prefix, s)
            fl = inflight(tab.schedule, n_s, s, tab.num_microbatches)
            xin = _stage_input_kib(m, tab, cuts, s) if rc else None
            shard = stage_sum(tab.shard_prefix, s) if sh else 0
            for c in cls:
                act = wsum(z[c][s], _blocks(tab.act_prefix))
                _memory_limit(m, tab, p[c][s], cap=tab.cap_bytes[rep[c]], state=state, shard=shard,
                              z_mib=zc[c][s] if sh else 0, act=act, fl=fl, n=n[c][s], xin=xin,
                              sh=sh[s] if sh else None, rc=rc[s] if rc else None, name=f"{c}_{s}")

        # [C-symmetry] interchangeable groups c < d (same type, memory, memory
        # bandwidth, shape, inside links; same links to each other group): the
        # vector (k[c][0], ..., k[c][S-1]) is lexicographically >= that of d.
        code = _link_code(tab)

        def lk(pair):
            return -1 if pair is None else int(code[pair])

        def sig(c):
            g = rep[c]
            return (ctype[c], tab.cap_bytes[g], tab.gpu_mbw_class[g], unit[c], count[c],
                    lk(groups[c].link_in), lk(groups[c].link_out))

        for c in cls:
            for d in range(c + 1, n_c):
                if sig(c) == sig(d) and all(code[rep[c], rep[e]] == code[rep[d], rep[e]]
                                            for e in cls if e not in (c, d)):
                    base = count[c] + 1
                    m.Add(sum(base ** (n_s - 1 - s) * (k[c][s] - k[d][s]) for s in stages) >= 0)
                    break

        # [C-objective]
        m.AddMaxEquality(tmax, t)
        smax = m.NewIntVar(0, sync_hi, "syncmax")
        m.AddMaxEquality(smax, sync)
        self.objective = sum(t) + (tab.num_microbatches - 1) * tmax + smax
        m.Minimize(self.objective)

    def hint(self, decision: Decision) -> None:
        """Warm start from a per-GPU decision (same S and M): cuts, policy, and per
        group the units in each stage and the samples / shard of its first GPU
        there (a hint, so a decision the classes cannot express exactly is
        repaired by CP-SAT)."""
        m = self.m
        for s, (i, _) in enumerate(decision.stage_blocks):
            m.AddHint(self.cut[s], i)
        shards = decision.shard_mib or ((),) * decision.num_stages
        where = {}
        for s, (gs, ns) in enumerate(zip(decision.stage_gpus, decision.samples_per_microbatch)):
            sharded = decision.sharded[s] and bool(shards[s])
            for pos, (g, n) in enumerate(zip(gs, ns)):
                where[g] = (s, n, shards[s][pos] if sharded else 0)
        for c, grp in enumerate(self.groups):
            for s in range(self.S):
                mine = [where[g] for g in grp.members if where.get(g, (None,))[0] == s]
                m.AddHint(self.k[c][s], len(mine) // grp.unit)
                m.AddHint(self.p[c][s], bool(mine))
                m.AddHint(self.n[c][s], mine[0][1] if mine else 0)
                if self.zc is not None:
                    m.AddHint(self.zc[c][s], max((z for _, _, z in mine), default=0))
        for s in range(self.S):
            if self.sh:
                m.AddHint(self.sh[s], decision.sharded[s])
            if self.rc:
                m.AddHint(self.rc[s], decision.recompute[s])

    def decision(self, solver: cp_model.CpSolver):
        """Expand the class decision to GPUs: the ``Decision`` of the solver's current solution."""
        cuts = [solver.Value(c) for c in self.cut]
        blocks = tuple((cuts[s], cuts[s + 1]) for s in range(self.S))
        sharded = tuple(bool(self.sh and solver.BooleanValue(self.sh[s])) for s in range(self.S))
        recompute = tuple(bool(self.rc and solver.BooleanValue(self.rc[s])) for s in range(self.S))
        per_stage = [[] for _ in range(self.S)]
        for c, grp in enumerate(self.groups):
            members, pos = grp.members, 0
            for s in range(self.S):
                kk, nn = grp.unit * solver.Value(self.k[c][s]), solver.Value(self.n[c][s])
                zz = solver.Value(self.zc[c][s]) if sharded[s] else 0
                per_stage[s].extend((g, nn, zz) for g in members[pos:pos + kk])
                pos += kk
        gpus, samples, shards = [], [], []
        for s, row in enumerate(per_stage):
            row.sort()
            gpus.append(tuple(g for g, _, _ in row))
            samples.append(tuple(nn for _, nn, _ in row))
            shards.append(tuple(zz for _, _, zz in row) if sharded[s] else ())
        return Decision(stage_blocks=blocks, stage_gpus=tuple(gpus), samples_per_microbatch=tuple(samples),
                        num_microbatches=self.tab.num_microbatches, sharded=sharded, shard_mib=tuple(shards),
                        recompute=recompute)


#: With ``aggregate_nodes=None``, identical nodes are merged when there are more classes than this.
AGGREGATE_ABOVE = 16


def solve_grouped(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions, *,
                  aggregate_nodes: bool | None = None, hints=()) -> SolverResult:
    """Plan with the grouped CP-SAT model: minimise the predicted step time over (S, M).

    Same contract as ``solve_cpsat`` (``objective`` / ``best_bound`` in seconds,
    "OPTIMAL" only when every candidate was solved to optimality or proven
    infeasible) except that optimality is over the grouped decision space,
    a restriction of the per-GPU one; equal to it when every class has one GPU.
    ``aggregate_nodes``: merge classes of identical nodes into one group whose
    stages take whole nodes (a further restriction; None = only when there are
    more than AGGREGATE_ABOVE classes). Each candidate gets
    ``options.time_limit_s``. ``hints``: decisions to warm-start the candidate
    with the same S and M (``solve_cpsat``). Raises InfeasiblePlanError if nothing fits."""
    search = CandidateSearch(costs, devices, options, label="grouped")
    groups, tabs = None, {}
    for n_s in range(1, max_stage_count(costs, devices, options) + 1):
        for m in microbatch_candidates(options):
            if m not in tabs:
                tabs[m] = build_tables(costs, devices, options, m)
            tab = tabs[m]
            if groups is None:
                groups = _groups(devices, tab, False)
                if aggregate_nodes or (aggregate_nodes is None and len(groups) > AGGREGATE_ABOVE):
                    groups = _groups(devices, tab, True)
            model = _GroupedModel(tab, devices, options, groups, n_s)
            h = matching_hint(hints, n_s, m)
            if h is not None:
                model.hint(h.decision)
            search.solve(model, n_s, m, num_groups=len(groups), **({"hint": h.status} if h is not None else {}))
    return search.result()
