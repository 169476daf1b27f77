"""The CP-SAT model of one (S stages, M micro-batches) candidate: the one model
builder of both CP-SAT planners.

[Note: one model builder]
The model is written over *groups* (``_Group``): ``count`` interchangeable
units of ``unit`` GPUs each, all units of a group in one stage taking the same
share of the micro-batch. The per-GPU planner (``solve_cpsat``, cpsat.py) is
this model with one group per GPU (``singleton_groups``: unit = count = 1,
which restricts nothing); the class-level planner (``solve_grouped``,
grouped.py) is this model with GPU classes or merged identical nodes
(``grouped._groups``). Both go through ``CandidateModel``; nothing else builds
a model.

Decision variables (the terms are objective.py's "step-time model" note, over
groups instead of GPUs; constraints carry its tags):

  k[c][s] in [0, min(count, b // unit)]: units of group c in stage s;
      sum_s k[c][s] <= count (== count without idle GPUs)          [C-assign]
  p[c][s] = k[c][s] >= 1;  every stage has a group; unit * sum k <= b
  n[c][s] in [1, b] iff p[c][s] (else 0): samples per GPU;
      sum_c unit * k[c][s] * n[c][s] = b                            [C-samples]
  cuts / block membership (ge, in_s; _encoding.StageCuts)           [C-cuts]
  sh[s], rc[s]: per-stage ZeRO-1 sharding / recomputation   [C-shard] [C-recompute]
  zc[c][s]: MiB of stage s's shardable state per GPU of c; coverage
      sum_c unit * k[c][s] * zc[c][s] MiB >= Q_s if sh[s]          [C-shard]

Per-group encoding, the smaller one that fits the group:

  * count == 1 (every group of the per-GPU model): the group is in at most one
    stage, so k[c][s] = p[c][s] (a boolean, ExactlyOne / AtMostOne over s),
    k * n is n, and z[c][q] (samples a GPU of c pushes through block q: n of
    c's stage if q is in it, else 0) is one variable per (group, block); its
    compute is one variable, gated onto its stage. Redundant: every block
    sees the b samples (sum_c unit * z[c][q] = b, a multi-unit group
    entering with y[c][q] = k n of the stage holding q; only in models with
    a single group). [C-symmetry]: interchangeable groups c < d ordered by
    (stage, -samples), idle last.
  * count > 1 (a class spanning stages): z[c][s][q] and compute[c][s] per
    (group, stage, block), k * n and k * zc by AddMultiplicationEquality.
    [C-symmetry]: the vector k[c][.] of interchangeable groups c < d is
    lexicographically >= that of d.

With u = z >= 1 (the block's fixed cost is paid):

  compute     = sum_q w[type][q] z[q] + f[type][q] u[q] (+ the recomputed forward) [C-compute]
  boundary_s  = 2 * (max over present group pairs (c in s, d in s+1) of
                rows x one sample's rounded transfer time + max latency);
                rows = min(n[c][s], n[d][s+1]) on one node, the node sample
                sums' larger overlap across nodes (``_boundary_encoding.node_sums``), b across a
                shared link (network_terms.py [Note: boundary rows]); per
                bandwidth class one product (max rows) x (transfer at the
                cut), with McCormick cuts; (c, c) across stages (count > 1)
                has the link between two units                          [C-boundary]
  load        = the node pair links that can carry two boundaries (``_boundary_encoding``):
                network_terms.link_load; the period is network_terms.pipeline_period's
  t_s         = max_c compute of c in s + boundary_s                    [C-stage]
  sync6_s     = 6 x stage s's gradient synchronisation term: its own ring
                all-reduce with buckets less E_s + B6_s (below), L_s (the
                last bucket's ring) less E_s, the tied parameters' cross-stage
                all-reduce and the optimizer; encoded in _sync_encoding.py,
                which documents it              [C-allreduce] [C-tied] [C-optim]
  dup_s       = the tied copies stage s holds once (_sync_encoding.
                tied_copies), left out of its state and shard coverage  [C-tied]
  memory      = objective.py's [C-memory] per group and stage           [C-memory]
  step        = sum_s t_s + (M - 1) T + Y (T: the period), Y = ceil(W / 6) by
                AddDivisionEquality, W = max_s sync6_s, E_s = sum_{j<s} (k_E
                cmax_j + 3 boundary_j), B6_s = k_B cmax-_s, k_Brc cmax-_s when rc_s
                (``IntTables.drain_coefs``; a gated
                product on rc_s; cmax-_s = max_c of c's compute over zh / uh,
                its samples z / u on every block but the last of its stage:
                end[q] = sum_s (ge[s][q+1] - ge[s][q]) a cut at q + 1, zh[q]
                = end[q] ? 0 : z[q], uh[q] = u[q] and not end[q]):
                objective.py's floors in integers (_sync_encoding.py); + control   [C-objective]
  control     = r (W - 1) lat_max over the used GPUs: a constant when every GPU is
                used, else the used groups' pairs as [C-tied]'s union
                (_sync_encoding.control_term)                            [C-control]

Units: time in integer ns (objective.UNITS_PER_S), memory in KiB, exactly the
tables of ``build_tables``. Every derived quantity is defined by an equality
(linear sums, max, flag ? value : 0, small products), never by a one-sided
bound, so the objective of *any* solution CP-SAT returns equals ``evaluate()``
of its expansion to GPUs (``decision``: the first unit * k[c][0] members of c
go to stage 0, the next to stage 1, ...); ``_search.CandidateSearch`` checks
that on every answer. Redundant constraints: the period T (network_terms
[Note: pipeline period]) and tmax (the largest t_s; in no term of the
objective, only these bounds use it) are >= every compute and a throughput
bound (see the model). A class-level model mixing single and multi-unit
groups needs the per-block sample sum (with y) for its strength: 16 GPUs
(two classes of 7, two single GPUs), 2 stages, 0.5 deterministic s: OPTIMAL
with it, FEASIBLE and 14% slower without it.

[Note: warm start]
``hints`` (SolverResults, in practice the baselines' and the stage DP's
feasible plans, best first; ``zorse_fx/portfolio.py``) seed the candidate with the
same (S, M): ``CandidateModel.hint`` gives CP-SAT the cuts, the units and
samples per group and stage, shards and memory policy via ``AddHint``. A hint
only guides the search (CP-SAT repairs a hint the model cannot express), so it
cannot change the optimum, only how soon a good incumbent appears.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from ..ir.decision import Decision
from ..ir.devices import DeviceGraph
from ..ir.memory import StageMemory
from ..options import PlanOptions
from ._boundary_encoding import LinkTerms
from ._encoding import StageCuts
from ._encoding import blocks_of as _blocks
from ._encoding import both as _both
from ._encoding import gated as _gated
from ._sync_encoding import control_term, sync_terms, tied_copies
from .objective import MIB_UNITS, IntTables, inflight

__all__ = ["CandidateModel", "matching_hint", "singleton_groups"]


@dataclass(frozen=True)
class _Group:
    """A unit of decision: ``count`` interchangeable units of ``unit`` GPUs each.

    One GPU (the per-GPU model: unit = count = 1), a plain class (unit = 1)
    or, with node aggregation, ``count`` identical nodes of one class each
    (unit = GPUs per node; stages take whole nodes). ``members`` lists the
    GPUs unit by unit (node by node). ``link_in``: a GPU pair inside one unit
    (None if unit = 1); ``link_out``: a pair in two different units (None if
    count = 1)."""

    members: tuple[int, ...]
    unit: int
    count: int
    link_in: tuple[int, int] | None
    link_out: tuple[int, int] | None


def singleton_groups(num_gpus: int) -> list[_Group]:
    """The per-GPU model's groups: GPU g is group g (unit = count = 1)."""
    return [_Group((g,), 1, 1, None, None) for g in range(num_gpus)]


def _link_code(tab: IntTables) -> np.ndarray:
    """(G, G) integer code of each link: (rounded bandwidth class, latency, [Note: boundary rows] code)."""
    lat = np.asarray(tab.pair_lat, dtype=np.int64)
    code = np.asarray(tab.pair_bw_class, dtype=np.int64) * (int(lat.max()) + 1) + lat
    return code * 5 + np.asarray(tab.pair_rows, dtype=np.int64) + 1  # (rows codes -1..3)


class CandidateModel:
    """CP-SAT model of one (S, M) candidate over ``groups`` (see [Note: one model builder]).

    Times in ns units, memory in KiB. Attributes: ``m`` (the CpModel),
    ``objective`` (its linear objective), ``cut``, ``k`` / ``p`` / ``n``
    ([group][stage]), ``sh`` / ``rc`` / ``zc`` (None when the mode is "never").
    ``devices`` is not read (the tables hold every GPU fact); kept for the
    callers' uniform signature."""

    def __init__(self, tab: IntTables, devices: DeviceGraph, options: PlanOptions,
                 groups: list[_Group], num_stages: int):
        self.tab, self.S, self.groups = tab, num_stages, groups
        self.m = cp_model.CpModel()
        self.b, self.nb = tab.microbatch_size, tab.num_blocks
        self.rep = [q.members[0] for q in groups]
        self.unit = [q.unit for q in groups]
        self.count = [q.count for q in groups]
        self.single = [q.count == 1 for q in groups]
        self.ctype = [tab.gpu_types[r] for r in self.rep]
        # The constraint families of [Note: one model builder], in this order (the
        # order fixes the variables' and constraints' indices in the model).
        self._assign(options.allow_idle_gpus)  # [C-assign]
        self.cuts = StageCuts(self.m, self.nb, num_stages)  # [C-cuts] (_encoding.py)
        self.cut, self.in_s = self.cuts.cut, self.cuts.in_s
        self.tied = tied_copies(self.m, tab, self.cuts, num_stages)  # [C-tied] same_s / dup_s (_sync_encoding.py)
        self.sh, self.rc = _policy_vars(self.m, tab, self.size, num_stages)  # [C-shard] / [C-recompute]
        self._samples()  # [C-samples]
        self.links = LinkTerms(self.m, tab, groups, cuts=self.cuts, p=self.p, n=self.n, kn=self.kn,  # [C-boundary]
                               num_stages=num_stages)
        self._compute()  # [C-compute]
        self._compute_heads()  # [C-objective]'s cmax-
        self._throughput_bound()  # redundant
        self._stage_times()  # [C-stage]
        self._shards()  # [C-shard]
        # [C-allreduce] [C-tied] [C-optim] 6 x each stage's sync term (_sync_encoding.py).
        sync, sync_hi = sync_terms(self.m, tab, groups, p=self.p, k=self.k, size=self.size, cuts=self.cuts,
                                   tied=self.tied, sh=self.sh, zc=self.zc, drain6=self.drain6, bwd6=self.bwd6,
                                   gpu_hi=self.gpu_hi, lat_hi=self.lat_hi, drain_hi=self.drain_hi)
        self._memory()  # [C-memory]
        self._symmetry()  # [C-symmetry]
        self.control = control_term(self.m, tab, groups, self.p, self.k, options.allow_idle_gpus)  # [C-control]
        self._objective(sync, sync_hi)  # [C-objective]

    # -- the constraint families -------------------------------------------------------

    def _gated(self, flag, value, hi, name):
        return _gated(self.m, flag, value, hi, name)

    def _both(self, a, c, name):
        return _both(self.m, a, c, name)

    def _shard_kib(self, s: int):
        """Q_s in KiB, a tied parameter once ([C-tied])."""
        dup = self.tied.dup
        return self.cuts.stage_sum(self.tab.shard_prefix, s) - sum(
            self.tab.tied_shard[t_] * dup[t_][s] for t_ in range(len(dup)))

    def _assign(self, allow_idle_gpus: bool) -> None:
        """[C-assign] k[c][s] units (GPUs, or whole nodes when aggregated) of group c in stage s,
        p[c][s] = k >= 1; every GPU takes >= 1 of the b samples, so unit * k <= b."""
        m, b, cls, stages = self.m, self.b, range(len(self.groups)), range(self.S)
        single, count, unit = self.single, self.count, self.unit
        k = [None if single[c] else [m.new_int_var(0, min(count[c], b // unit[c]), f"k_{c}_{s}") for s in stages]
             for c in cls]
        self.p = p = [[m.new_bool_var(f"p_{c}_{s}") for s in stages] for c in cls]
        self.k = k = [p[c] if single[c] else k[c] for c in cls]  # one unit: k = p
        for c in cls:
            if single[c]:
                (m.add_at_most_one if allow_idle_gpus else m.add_exactly_one)(p[c])
                continue
            if allow_idle_gpus:
                m.add(sum(k[c]) <= count[c])
            else:
                m.add(sum(k[c]) == count[c])
            for s in stages:
                m.add(k[c][s] >= 1).OnlyEnforceIf(p[c][s])
                m.add(k[c][s] == 0).OnlyEnforceIf(p[c][s].Not())
        self.size = [sum(unit[c] * k[c][s] for c in cls) for s in stages]
        for s in stages:
            m.add_bool_or([p[c][s] for c in cls])
            m.add(self.size[s] <= b)

    def _samples(self) -> None:
        """[C-samples] n[c][s] in [1, b] iff present; sum_c unit * k * n = b. z: samples a GPU
        of c pushes through each block (0 off its stage); u = z >= 1; kn: k * n of a
        multi-unit group; with a single group, the redundant per-block sample sum."""
        m, b, in_s, p, k = self.m, self.b, self.in_s, self.p, self.k
        cls, stages, blocks = range(len(self.groups)), range(self.S), range(self.nb)
        single, unit = self.single, self.unit
        self.n = n = [[m.new_int_var(0, b, f"n_{c}_{s}") for s in stages] for c in cls]
        self.z = z = [[m.new_int_var(0, b, f"z_{c}_{q}") for q in blocks] if single[c] else
                      [[m.new_int_var(0, b, f"z_{c}_{s}_{q}") for q in blocks] for s in stages] for c in cls]
        self.u = u = [[m.new_bool_var(f"u_{c}_{q}") for q in blocks] if single[c] else
                      [[m.new_bool_var(f"u_{c}_{s}_{q}") for q in blocks] for s in stages] for c in cls]
        self.kn = kn = {}  # (group, stage) -> IntVar k * n of a multi-unit group
        for s in stages:
            tots = []
            for c in cls:
                m.add(n[c][s] >= 1).OnlyEnforceIf(p[c][s])
                m.add(n[c][s] == 0).OnlyEnforceIf(p[c][s].Not())
                if single[c]:
                    tots.append(unit[c] * n[c][s])  # k = p: k * n = n
                    continue
                tot = m.new_int_var(0, b, f"kn_{c}_{s}")
                m.add_multiplication_equality(tot, [k[c][s], n[c][s]])
                kn[c, s] = tot
                tots.append(unit[c] * tot)
                for q in blocks:  # z[c][s][q] = n[c][s] if block q is in stage s, else 0
                    m.add(z[c][s][q] == n[c][s]).OnlyEnforceIf(in_s[s][q])
                    m.add(z[c][s][q] == 0).OnlyEnforceIf(in_s[s][q].Not())
                    m.add(z[c][s][q] >= 1).OnlyEnforceIf(u[c][s][q])
                    m.add(z[c][s][q] == 0).OnlyEnforceIf(u[c][s][q].Not())
            m.add(sum(tots) == b)
        for c in cls:
            if single[c]:  # in one stage at most: z[c][q] = n[c][s] for the stage s holding q
                for s in stages:
                    for q in blocks:
                        m.add(z[c][q] == n[c][s]).OnlyEnforceIf(in_s[s][q])
                for q in blocks:
                    m.add(z[c][q] >= 1).OnlyEnforceIf(u[c][q])
                    m.add(z[c][q] == 0).OnlyEnforceIf(u[c][q].Not())
        if any(single):
            # Redundant: every block sees the b samples. A multi-unit group's samples
            # through block q: y[c][q] = k n of the stage holding q.
            through = []
            for c in cls:
                if single[c]:
                    through.append([unit[c] * z[c][q] for q in blocks])
                    continue
                y = [m.new_int_var(0, b, f"through_{c}_{q}") for q in blocks]
                for s in stages:
                    for q in blocks:
                        m.add(y[q] == kn[c, s]).OnlyEnforceIf(in_s[s][q])
                through.append([unit[c] * y[q] for q in blocks])
            for q in blocks:
                m.add(sum(row[q] for row in through) == b)

    def _compute(self) -> None:
        """[C-compute] compute = n W + F (+ the recomputed forward) of a GPU of c: stage_comp[c][s]
        (0 when c is absent from s) and, under GPipe, stage_fwd[c][s], its forward task (the
        forward tables, 0 when c is absent from s), for GPipe's forward / backward split; the
        bounds every time term uses."""
        m, tab, b, n_s, rc = self.m, self.tab, self.b, self.S, self.rc
        cls, stages = range(len(self.groups)), range(n_s)
        self.lat_hi = max(max(r) for r in tab.pair_lat) if tab.num_gpus > 1 else 0
        xfer_hi = max((max(r) for r in tab.xfer), default=0)
        work_hi = b * max(p_[-1] for p_ in tab.work_prefix.values()) + \
            max(p_[-1] for p_ in tab.fixed_prefix.values())
        if rc:
            work_hi += b * max(p_[-1] for p_ in tab.rc_work_prefix.values()) + \
                max(p_[-1] for p_ in tab.rc_fixed_prefix.values())
        self.work_hi = work_hi
        self.t_hi = work_hi + 2 * (xfer_hi + self.lat_hi)
        self.gpu_hi = min(tab.num_gpus, b * n_s)
        self.tmax = m.new_int_var(0, self.t_hi, "tmax")
        self.drain_hi = 6 * self.t_hi  # bounds k_E cmax_s + 3 boundary_s of [C-objective] (k_E <= 4)
        self.gpu_comps = []  # every compute IntVar: redundant lower bounds of the period
        self.stage_comp = [[None] * n_s for _ in cls]
        self.stage_fwd = [[0] * n_s for _ in cls]
        gpipe = tab.schedule == "gpipe"
        self.rcg = [None] * len(self.groups)  # per single group: its stage recomputes
        p, z, u = self.p, self.z, self.u
        for c in cls:
            if self.single[c]:
                on = None
                if rc:  # the recomputed forward, when c's stage recomputes
                    on = m.new_bool_var(f"rcg_{c}")
                    m.add(on == sum(self._both(p[c][s], rc[s], f"prc_{c}_{s}") for s in stages))
                self.rcg[c] = on
                cv, fwd = self._gpu_compute(c, z[c], u[c], on, f"{c}")
                for s in stages:
                    self.stage_comp[c][s] = self._gated(p[c][s], cv, work_hi, f"cgs_{c}_{s}")
                    if gpipe:
                        self.stage_fwd[c][s] = self._gated(p[c][s], fwd, work_hi, f"fws_{c}_{s}")
            else:
                for s in stages:
                    self.stage_comp[c][s], self.stage_fwd[c][s] = self._gpu_compute(
                        c, z[c][s], u[c][s], rc[s] if rc else None, f"{c}_{s}")

    def _gpu_compute(self, c, zz, uu, on, name):
        """(IntVar: compute of a GPU of c with samples zz per block, its forward task: a
        linear expression of the forward tables, which a recomputing stage runs twice);
        ``on``: recomputes."""
        m, tab, ty, work_hi = self.m, self.tab, self.ctype[c], self.work_hi
        wsum = cp_model.LinearExpr.WeightedSum
        cv = m.new_int_var(0, work_hi, f"comp_{name}")
        extra = 0
        fwd = wsum(zz, _blocks(tab.rc_work_prefix[ty])) + wsum(uu, _blocks(tab.rc_fixed_prefix[ty]))
        if self.rc:
            extra = self._gated(on, fwd, work_hi, f"rcw_{name}")
        m.add(cv == wsum(zz, _blocks(tab.work_prefix[ty])) + wsum(uu, _blocks(tab.fixed_prefix[ty])) + extra)
        m.add(self.tmax >= cv)  # redundant
        self.gpu_comps.append(cv)
        return cv, fwd

    def _compute_heads(self) -> None:
        """[C-objective] cmax-_s: compute over the stage's blocks but its last (the backward the
        stage's buckets can overlap). end[q]: block q is the last of its stage (a cut at q + 1;
        True for the last block, False for the others with one stage); zh / uh = z / u off them."""
        m, nb, n_s, ge = self.m, self.nb, self.S, self.cuts.ge
        cls, stages = range(len(self.groups)), range(n_s)
        self.end = end = [True if q == nb - 1 else False if n_s == 1 else m.new_bool_var(f"end_{q}") for q in range(nb)]
        for q in range(nb - 1):
            if n_s > 1:
                m.add(end[q] == sum(ge[s][q + 1] - ge[s][q] for s in range(1, n_s)))
        self.stage_head = [[None] * n_s for _ in cls]
        p, z, u, rc = self.p, self.z, self.u, self.rc
        for c in cls:
            if self.single[c]:
                hv = self._head(c, z[c], u[c], self.rcg[c], f"{c}")
                for s in stages:
                    self.stage_head[c][s] = self._gated(p[c][s], hv, self.work_hi, f"chs_{c}_{s}")
            else:
                for s in stages:
                    self.stage_head[c][s] = self._head(c, z[c][s], u[c][s], rc[s] if rc else None, f"{c}_{s}")

    def _head(self, c, zz, uu, on, name):
        """IntVar: compute of a GPU of c over its stage's blocks but the last ([C-compute] of
        zz / uu with the last block's samples and fixed cost left out)."""
        m, tab, end, blocks = self.m, self.tab, self.end, range(self.nb)
        ty, zh, uh = self.ctype[c], [], []
        for q in blocks:
            if end[q] is True:
                zh.append(0), uh.append(0)
            elif end[q] is False:
                zh.append(zz[q]), uh.append(uu[q])
            else:
                v = m.new_int_var(0, self.b, f"zh_{name}_{q}")
                m.add(v == zz[q]).OnlyEnforceIf(end[q].Not())
                m.add(v == 0).OnlyEnforceIf(end[q])
                zh.append(v), uh.append(self._both(uu[q], end[q].Not(), f"uh_{name}_{q}"))

        def tsum(prefix):
            w_, f_ = _blocks(prefix[0][ty]), _blocks(prefix[1][ty])
            return sum(w_[q] * zh[q] + f_[q] * uh[q] for q in blocks)

        hv = m.new_int_var(0, self.work_hi, f"comph_{name}")
        extra = self._gated(on, tsum((tab.rc_work_prefix, tab.rc_fixed_prefix)), self.work_hi,
                            f"rch_{name}") if self.rc else 0
        m.add(hv == tsum((tab.work_prefix, tab.fixed_prefix)) + extra)
        return hv

    def _throughput_bound(self) -> None:
        """Redundant throughput bound (valid for every decision): with w_ref[q] the fastest
        type's time of block q and r_g = max_q w_ref[q] / w_type(g)[q] <= 1,
        sum_g r_g compute_g >= b * sum_q w_ref[q] and compute_g <= tmax."""
        tab, blocks, ctype = self.tab, range(self.nb), self.ctype
        wt = {t_: _blocks(tab.work_prefix[t_]) for t_ in set(ctype)}
        w_ref = [min(wt[t_][q] for t_ in wt) for q in blocks]
        r_sum = 0.0
        for c in range(len(self.groups)):
            r_g = max((w_ref[q] / wt[ctype[c]][q] for q in blocks if wt[ctype[c]][q] > 0), default=1.0)
            r_sum += r_g * len(self.groups[c].members)
        self.thr = int(self.b * sum(w_ref) / r_sum * (1 - 1e-9)) if r_sum > 0 else 0
        if r_sum > 0:
            self.m.add(self.tmax >= self.thr)

    def _stage_times(self) -> None:
        """[C-stage] t_s = cmax_s + boundary_s; per stage its compute (comps), one direction of
        its boundary (halves: an exchange of [Note: pipeline period]) and [C-objective]'s
        drain6_s = k_E cmax_s + 3 boundary_s = E_{s+1} - E_s and B6_s = k_B cmax-_s (k_Brc cmax-_s
        when the stage recomputes; ``IntTables.drain_coefs``)."""
        m, n_s, rc, work_hi = self.m, self.S, self.rc, self.work_hi
        cls = range(len(self.groups))
        self.t, self.drain6, self.bwd6, self.comps, self.halves = [], [], [], [], []
        for s in range(n_s):
            cs = m.new_int_var(0, work_hi, f"comp_s{s}")
            m.add_max_equality(cs, [self.stage_comp[c][s] for c in cls])
            # [C-boundary] rows per link (network_terms.py [Note: boundary rows]; _boundary_encoding.py).
            if s < n_s - 1:
                xm, lm = self.links.boundary(s)
                bnd = 2 * xm + 2 * lm
            else:
                bnd = 0
            ts = m.new_int_var(0, self.t_hi, f"t_{s}")
            m.add(ts == cs + bnd)  # [C-stage]
            self.t.append(ts)
            self.comps.append(cs)
            if s < n_s - 1:
                self.halves.append(xm + lm)
            k_e, k_b, k_brc = self.tab.drain_coefs
            self.drain6.append(k_e * cs + 3 * bnd)
            ch = m.new_int_var(0, work_hi, f"comph_s{s}")
            m.add_max_equality(ch, [self.stage_head[c][s] for c in cls])
            self.bwd6.append(k_b * ch - (k_b - k_brc) * self._gated(rc[s], ch, work_hi, f"bwdrc_{s}") if rc
                             else k_b * ch)

    def _shards(self) -> None:
        """[C-shard] zc[c][s]: MiB per GPU of c in sharded stage s (0 otherwise), covering the
        stage's shardable state Q_s when it is sharded; None when sharding is "never"."""
        self.zc = None
        if not self.sh:
            return
        m, tab, sh, p, k = self.m, self.tab, self.sh, self.p, self.k
        cls, stages, rep = range(len(self.groups)), range(self.S), self.rep
        zc = [[m.new_int_var(0, tab.cap_bytes[rep[c]] // MIB_UNITS, f"zc_{c}_{s}") for s in stages] for c in cls]
        for s in stages:
            held = []
            for c in cls:
                m.add(zc[c][s] == 0).OnlyEnforceIf(self._both(p[c][s], sh[s], f"psh_{c}_{s}").Not())
                if self.single[c]:
                    held.append(self.unit[c] * zc[c][s])
                else:
                    kz = m.new_int_var(0, self.count[c] * (tab.cap_bytes[rep[c]] // MIB_UNITS), f"kz_{c}_{s}")
                    m.add_multiplication_equality(kz, [k[c][s], zc[c][s]])
                    held.append(self.unit[c] * kz)
            m.add(MIB_UNITS * sum(held) >= self._shard_kib(s)).OnlyEnforceIf(sh[s])
        self.zc = zc

    def _memory(self) -> None:
        """[C-memory] state + activations <= usable KiB of a GPU of c in s, per policy combination."""
        m, tab, n_s, sh, rc, zc, dup = self.m, self.tab, self.S, self.sh, self.rc, self.zc, self.tied.dup
        wsum = cp_model.LinearExpr.WeightedSum
        cls = range(len(self.groups))
        act_single = {c: wsum(self.z[c], _blocks(tab.act_prefix)) for c in cls if self.single[c]}
        g1s = [(k_, v) for k_, v in enumerate(tab.gt_kib) if v]
        g3s = [(t_, v) for t_, v in enumerate(tab.tied_gt3_kib) if v]
        g_hi = max([v for _, v in g1s] + [v for _, v in g3s], default=0)
        for s in range(n_s):
            state = self.cuts.stage_sum(tab.state_prefix, s) - sum(
                tab.tied_state[t_] * dup[t_][s] for t_ in range(len(dup)))  # [C-tied]
            # [Note: gradient transients] (state_terms.py): G_s >= the largest gradient of a block in s and
            # three of a tied parameter whose first and last blocks s holds (same); the row with it below
            # holds for max(0, G_s - n A_s), as the evaluator's transient_kib.
            g = None
            if g_hi:
                g = m.new_int_var(0, g_hi, f"gtr_{s}")
                for k_, v in g1s:
                    m.add(g >= v * self.cuts.in_s[s][k_])
                for t_, v in g3s:
                    m.add(g >= v * self.tied.same[t_][s])
            fl = inflight(tab.schedule, n_s, s, tab.num_microbatches)
            xin = _stage_input_kib(m, tab, self.cuts, s) if rc else None
            shard = self._shard_kib(s) if sh else 0
            for c in cls:
                act = act_single[c] if self.single[c] else wsum(self.z[c][s], _blocks(tab.act_prefix))
                _memory_limit(m, tab, self.p[c][s], cap=tab.cap_bytes[self.rep[c]], state=state, shard=shard,
                              z_mib=zc[c][s] if sh else 0, act=act, fl=fl, n=self.n[c][s], xin=xin,
                              sh=sh[s] if sh else None, rc=rc[s] if rc else None, name=f"{c}_{s}",
                              transient=g)

    def _symmetry(self) -> None:
        """[C-symmetry] interchangeable groups c < d (same type, memory, memory bandwidth,
        shape, inside links; the same links to every other group): swapping them changes
        nothing, so order them. Single groups: (stage, -samples) of c <= that of d (idle
        counts as stage S); otherwise k[c][.] lexicographically >= k[d][.]."""
        m, tab, b, n_s, p, n, k = self.m, self.tab, self.b, self.S, self.p, self.n, self.k
        rep, n_c, stages = self.rep, len(self.groups), range(self.S)
        code = _link_code(tab)

        def lk(pair):
            return -1 if pair is None else int(code[pair])

        def sig(c):
            g = rep[c]
            return (self.ctype[c], tab.cap_bytes[g], tab.gpu_mbw_class[g], self.unit[c], self.count[c],
                    lk(self.groups[c].link_in), lk(self.groups[c].link_out))

        def key(c):
            return sum((b + 1) * s * p[c][s] - n[c][s] for s in stages) + (b + 1) * n_s * (1 - sum(p[c]))

        for c in range(n_c):
            for d in range(c + 1, n_c):
                if sig(c) == sig(d) and all(code[rep[c], rep[e]] == code[rep[d], rep[e]]
                                            for e in range(n_c) if e not in (c, d)):
                    if self.single[c]:
                        m.add(key(c) <= key(d))
                    else:
                        base = self.count[c] + 1
                        m.add(sum(base ** (n_s - 1 - s) * (k[c][s] - k[d][s]) for s in stages) >= 0)
                    break

    def _objective(self, sync, sync_hi: int) -> None:
        """[C-objective] step = sum t_s + (M-1) T + ceil(max_s sync6_s / 6) (stage 0's term >= 0),
        the period T of network_terms.pipeline_period: 1F1B max(cmax_s + h_{s-1} + h_s, load),
        GPipe max(T_F + T_B, load) (ceil of the thirds); load: network_terms.link_load, over the
        links that can carry two boundaries."""
        m, tab, cls, stages = self.m, self.tab, range(len(self.groups)), range(self.S)
        m.add_max_equality(self.tmax, self.t)
        period = 0
        if tab.num_microbatches > 1:  # (M - 1) T: no period term with one micro-batch
            split = None
            if tab.schedule == "gpipe":  # per stage, its classes' 3 x forward and 3 x backward (the rest)
                split = ([[3 * self.stage_fwd[c][s] for c in cls] for s in stages],
                         [[3 * (self.stage_comp[c][s] - self.stage_fwd[c][s]) for c in cls] for s in stages])
            period = self.links.period(self.comps, self.halves, split, self.gpu_comps, self.thr, self.t_hi)
        smax6 = m.new_int_var(0, 6 * sync_hi, "syncmax6")
        m.add_max_equality(smax6, sync)
        num6 = m.new_int_var(5, 6 * sync_hi + 5, "syncnum6")
        m.add(num6 == smax6 + 5)
        smax = m.new_int_var(0, sync_hi, "syncmax")
        m.add_division_equality(smax, num6, 6)
        self.objective = sum(self.t) + (tab.num_microbatches - 1) * period + smax + self.control
        m.minimize(self.objective)

    def hint(self, decision: Decision) -> None:
        """Warm start from a per-GPU decision (same S and M; [Note: warm start]): cuts,
        policy, and per group the units in each stage and the samples / shard of its
        first GPU there (a hint, so a decision the groups cannot express exactly is
        repaired by CP-SAT; with one group per GPU it is the decision itself)."""
        m = self.m
        for s, (i, _) in enumerate(decision.stage_blocks):
            m.add_hint(self.cut[s], i)
        shards = decision.shard_mib or ((),) * decision.num_stages
        where = {}
        for s, (gs, ns) in enumerate(zip(decision.stage_gpus, decision.samples_per_microbatch)):
            sharded = decision.memory[s].zero >= 1 and bool(shards[s])
            for pos, (g, n) in enumerate(zip(gs, ns)):
                where[g] = (s, n, shards[s][pos] if sharded else 0)
        for c, grp in enumerate(self.groups):
            for s in range(self.S):
                mine = [where[g] for g in grp.members if where.get(g, (None,))[0] == s]
                if self.k[c] is not self.p[c]:
                    m.add_hint(self.k[c][s], len(mine) // grp.unit)
                m.add_hint(self.p[c][s], bool(mine))
                m.add_hint(self.n[c][s], mine[0][1] if mine else 0)
                if self.zc is not None:
                    m.add_hint(self.zc[c][s], max((z for _, _, z in mine), default=0))
        for s in range(self.S):
            if self.sh:
                m.add_hint(self.sh[s], decision.memory[s].zero >= 1)
            if self.rc:
                m.add_hint(self.rc[s], decision.memory[s].recompute)

    def decision(self, solver: cp_model.CpSolver):
        """Expand the group decision to GPUs: the ``Decision`` of the solver's current solution."""
        cuts = [solver.value(c) for c in self.cut]
        blocks = tuple((cuts[s], cuts[s + 1]) for s in range(self.S))
        sharded = tuple(bool(self.sh and solver.boolean_value(self.sh[s])) for s in range(self.S))
        recompute = tuple(bool(self.rc and solver.boolean_value(self.rc[s])) for s in range(self.S))
        per_stage = [[] for _ in range(self.S)]
        for c, grp in enumerate(self.groups):
            members, pos = grp.members, 0
            for s in range(self.S):
                kk, nn = grp.unit * solver.value(self.k[c][s]), solver.value(self.n[c][s])
                zz = solver.value(self.zc[c][s]) if sharded[s] else 0
                per_stage[s].extend((g, nn, zz) for g in members[pos:pos + kk])
                pos += kk
        gpus, samples, shards = [], [], []
        for s, row in enumerate(per_stage):
            row.sort()
            gpus.append(tuple(g for g, _, _ in row))
            samples.append(tuple(nn for _, nn, _ in row))
            shards.append(tuple(zz for _, _, zz in row) if sharded[s] else ())
        return Decision(stage_blocks=blocks, stage_gpus=tuple(gpus), samples_per_microbatch=tuple(samples),
                        num_microbatches=self.tab.num_microbatches, shard_mib=tuple(shards),
                        memory=tuple(StageMemory(zero=int(sh), recompute=rc) for sh, rc in zip(sharded, recompute)))


def _policy_vars(m: cp_model.CpModel, tab: IntTables, size, n_s: int):
    """Per-stage booleans sh[s] ([C-shard]: only with >= 2 GPUs) and rc[s]
    ([C-recompute]); None for a mode "never", fixed for "always"."""
    sh = rc = None
    if tab.sharding != "never":
        sh = [m.new_bool_var(f"sh_{s}") for s in range(n_s)]
        for s in range(n_s):
            m.add(size[s] >= 2).OnlyEnforceIf(sh[s])
            if tab.sharding == "always":
                m.add(size[s] <= 1).OnlyEnforceIf(sh[s].Not())
    if tab.recompute != "never":
        rc = [m.new_bool_var(f"rc_{s}") for s in range(n_s)]
        if tab.recompute == "always":
            for v in rc:
                m.add(v == 1)
    return sh, rc


def _memory_limit(m: cp_model.CpModel, tab: IntTables, present, *, cap, state, shard, z_mib, act, fl, n, xin,
                  sh, rc, name: str, transient=None) -> None:
    """[C-memory] of one GPU (or group member) on one stage, for each memory-policy
    combination: (sh ? state - shard + z MiB : state) + (rc ? fl * n * X_s + act :
    fl * act) <= cap (KiB), enforced when ``present``. ``sh`` / ``rc``: the
    stage's policy literals, None when the mode is "never"; ``xin``: X_s (None
    for stage 0); ``act`` = n * A_s."""
    states = [(state, [])] if sh is None else \
        [(state, [sh.Not()]), (state - shard + MIB_UNITS * z_mib, [sh])]
    acts = [(fl * act, [])]
    if rc is not None:
        cin = 0
        if xin is not None:
            cin = m.new_int_var(0, tab.microbatch_size * tab.cut_kib_max, f"cin_{name}")
            m.add_multiplication_equality(cin, [n, xin])
        acts = [(fl * act, [rc.Not()]), (fl * cin + act, [rc])]
    for st_expr, l1 in states:
        for act_expr, l2 in acts:
            m.add(st_expr + act_expr <= cap).OnlyEnforceIf([present, *l1, *l2])
            if transient is not None:  # [Note: gradient transients]: + max(0, G - n A_s)
                m.add(st_expr + act_expr - act + transient <= cap).OnlyEnforceIf([present, *l1, *l2])


def _stage_input_kib(m: cp_model.CpModel, tab: IntTables, cuts: StageCuts, s: int):
    """IntVar = X_s, the cut KiB per sample entering stage s (None for s = 0: nothing)."""
    if s == 0:
        return None
    v = m.new_int_var(0, tab.cut_kib_max, f"xin_{s}")
    m.add(v == cuts.at_cut(tab.cut_kib, s))
    return v


def matching_hint(hints, num_stages: int, num_microbatches: int):
    """The first of ``hints`` (SolverResults) whose decision has this S and M, or None."""
    return next((h for h in hints if h.decision.num_stages == num_stages
                 and h.decision.num_microbatches == num_microbatches), None)
