"""The CP-SAT encoding of [C-boundary]'s rows per link and of the link loads
(network_terms.py [Note: boundary rows]) over the groups of the one model
builder (model.py [Note: one model builder]): ``evaluate``'s ``boundary_rows``
and ``link_load`` as equalities, so the model's objective stays ``evaluate``'s
to the ns.

Per boundary s and present group pair (c in s, d in s+1), its link's rows:
b across a shared link of several nodes a side, max(S_c, S'_d) across shared links of one
node a side (a NIC, a node's cap), min(n[c][s], n[d][s+1]) on one node, and across
nodes min(S_c, S'_d), or (both groups on one node each) max(min(S_c, S'_d),
min(S_d, S'_c)), of the node sample sums (``node_sums``; full-duplex links);
per bandwidth class one product (max rows) x (one sample's transfer at the
cut) (``_encoding.rows_max``); the link loads of network_terms.link_load
(``LinkTerms.loads``: the sum of both overlaps, one direction per micro-batch)
and the pipeline period over them (``LinkTerms.period``, network_terms.py
[Note: pipeline period]).
"""

from __future__ import annotations

from ortools.sat.python import cp_model

from ._encoding import any_of, both, rows_max
from ._encoding import gated as _gated
from .network_terms import ROWS_ALL, ROWS_NODE_SUMS, ROWS_NODE_TOTAL, ROWS_SAME_NODE
from .objective import IntTables

__all__ = ["LinkTerms", "node_sums"]


class LinkTerms:
    """[C-boundary] per stage (``boundary``) and the link loads (``loads``) of one
    candidate model: ``groups`` (model._Group), ``cuts`` (StageCuts), ``p`` / ``n``
    ([group][stage] presence / samples per GPU), ``kn`` ((group, stage) -> k n of
    a multi-unit group)."""

    def __init__(self, m: cp_model.CpModel, tab: IntTables, groups, *, cuts, p, n, kn, num_stages: int):
        self.m, self.tab, self.groups, self.cuts, self.p, self.n = m, tab, groups, cuts, p, n
        self.num_stages, self.b = num_stages, tab.microbatch_size
        #: node_sum[c][s]: the samples of stage s on the node of a unit of c.
        self.node_sum = node_sums(tab, groups, n, kn, num_stages)
        self.one_node = [len({tab.gpu_node[g] for g in q.members}) == 1 for q in groups]
        self.ys: dict[tuple[int, int, int], object] = {}  # (c, d, s) -> c in s and d in s + 1
        self._xcut: dict[tuple[int, int], object] = {}

    def xcut(self, q: int, s: int):
        """IntVar: one sample's transfer units of bandwidth class q at the cut after stage s."""
        if (q, s) not in self._xcut:
            x = self._xcut[q, s] = self.m.new_int_var(0, max(self.tab.xfer1[q]), f"xcut_{q}_{s}")
            self.m.add(x == self.cuts.at_cut(self.tab.xfer1[q], s + 1))
        return self._xcut[q, s]

    def boundary(self, s: int):
        """(max over present pairs of rows x transfer, max latency) of the boundary after stage s;
        (c, c) across stages (count > 1) has the link between two units."""
        m, tab, groups, p, n, b = self.m, self.tab, self.groups, self.p, self.n, self.b
        node_sum, one_node = self.node_sum, self.one_node
        pairs = []
        for c, qc in enumerate(groups):
            for d, qd in enumerate(groups):
                if c == d and qc.count == 1:
                    continue
                link = (qc.members[0], qd.members[0]) if c != d else qc.link_out
                y = self.ys[c, d, s] = both(m, p[c][s], p[d][s + 1], f"y_{c}_{d}_{s}")
                code = tab.pair_rows[link[0]][link[1]]
                if code == ROWS_ALL:
                    rows = b * y
                elif code == ROWS_SAME_NODE:
                    rows = m.new_int_var(0, b, f"mn_{c}_{d}_{s}")
                    m.add_min_equality(rows, [n[c][s], n[d][s + 1]])
                elif code == ROWS_NODE_TOTAL:  # each node's own shared link: all of its rows
                    mx = m.new_int_var(0, b, f"mt_{c}_{d}_{s}")
                    m.add_max_equality(mx, [node_sum[c][s], node_sum[d][s + 1]])
                    rows = _gated(m, y, mx, b, f"rows_{c}_{d}_{s}")
                else:  # each direction of the node pair's link; back only between one-node groups
                    mn = m.new_int_var(0, b, f"mn_{c}_{d}_{s}")
                    m.add_min_equality(mn, [node_sum[c][s], node_sum[d][s + 1]])
                    if one_node[c] and one_node[d] and c != d:
                        back = m.new_int_var(0, b, f"mb_{c}_{d}_{s}")
                        m.add_min_equality(back, [node_sum[d][s], node_sum[c][s + 1]])
                        both_ = m.new_int_var(0, b, f"mx_{c}_{d}_{s}")
                        m.add_max_equality(both_, [mn, back])
                        mn = both_
                    rows = _gated(m, y, mn, b, f"rows_{c}_{d}_{s}")
                pairs.append((link, y, rows))
        return rows_max(m, tab, pairs, lambda q: self.xcut(q, s), lambda q: max(tab.xfer1[q]), b, f"bd{s}")

    def loads(self) -> list:
        """network_terms.link_load's node pair links that can carry two boundaries (call
        after every ``boundary``), as expressions (ns units, one direction): those between
        a node with >= 2 GPUs of one-node groups ("a-node") and another a-node, or a unit
        (node) of a multi-node group in stage s' (the boundaries s'-1 and s'). Every other
        link carries one boundary, and its load (both overlaps) <= 2 x the larger overlap's
        transfer <= that boundary's term, so it never sets the period."""
        m, tab, groups, n, b, xcut = self.m, self.tab, self.groups, self.n, self.b, self.xcut
        one_node, node_sum, ys, num_stages = self.one_node, self.node_sum, self.ys, self.num_stages
        if num_stages < 3 or not tab.xfer1:
            return []  # one boundary (or one GPU): no link carries two
        node = tab.gpu_node
        on: dict[int, list[int]] = {}
        for c, q in enumerate(groups):
            if one_node[c]:
                on.setdefault(node[q.members[0]], []).append(c)
        big = sorted(x for x, cs in on.items() if sum(len(groups[c].members) for c in cs) >= 2)
        rep = [q.members[0] for q in groups]
        nsum = {x: node_sum[cs[0]] for x, cs in on.items()}
        hi = b * max(max(r) for r in tab.xfer1)

        def transfer(pairs, s, name):
            """max over present (c, d) pairs coded ROWS_NODE_SUMS of xcut(class, s) (None if none)."""
            by_q: dict[int, list] = {}
            for c, d in pairs:
                if tab.pair_rows[rep[c]][rep[d]] == ROWS_NODE_SUMS:
                    by_q.setdefault(tab.pair_bw_class[rep[c]][rep[d]], []).append(ys[c, d, s])
            if not by_q:
                return None
            flags = {q: any_of(m, yl, f"{name}_p{q}") for q, yl in by_q.items()}
            terms = [_gated(m, flags[q], xcut(q, s), max(tab.xfer1[q]), f"{name}_g{q}") for q in by_q]
            x = m.new_int_var(0, max(max(tab.xfer1[q]) for q in by_q), f"{name}_x")
            m.add_max_equality(x, terms)
            return x

        def product(rows, x, name):
            z = m.new_int_var(0, hi, name)
            m.add_multiplication_equality(z, [rows, x])
            return z

        def least(a_, b_, name):
            v = m.new_int_var(0, b, name)
            m.add_min_equality(v, [a_, b_])
            return v

        loads = []
        for x1 in big:
            for x2 in [y for y in on if y != x1 and (y not in big or y > x1)]:
                terms = []
                pairs = [(c, d) for c in on[x1] for d in on[x2]] + [(d, c) for c in on[x1] for d in on[x2]]
                for s in range(num_stages - 1):
                    x = transfer(pairs, s, f"ll_{x1}_{x2}_{s}")
                    if x is not None:
                        rows = least(nsum[x1][s], nsum[x2][s + 1], f"lr_{x1}_{x2}_{s}") + \
                            least(nsum[x2][s], nsum[x1][s + 1], f"lb_{x1}_{x2}_{s}")
                        terms.append(product(rows, x, f"lz_{x1}_{x2}_{s}"))
                if len(terms) >= 2:
                    loads.append(sum(terms))
            for c, q in enumerate(groups):
                if one_node[c]:
                    continue
                for s in range(num_stages):  # a unit of c in stage s: boundaries s - 1 (in) and s (out)
                    terms = []
                    if s >= 1:
                        x = transfer([(d, c) for d in on[x1]], s - 1, f"la_{x1}_{c}_{s}")
                        if x is not None:
                            terms.append(product(least(nsum[x1][s - 1], q.unit * n[c][s], f"lin_{x1}_{c}_{s}"), x,
                                                 f"lza_{x1}_{c}_{s}"))
                    if s + 1 < num_stages:
                        x = transfer([(c, d) for d in on[x1]], s, f"lo_{x1}_{c}_{s}")
                        if x is not None:
                            terms.append(product(least(q.unit * n[c][s], nsum[x1][s + 1], f"lout_{x1}_{c}_{s}"), x,
                                                 f"lzo_{x1}_{c}_{s}"))
                    if len(terms) == 2:
                        loads.append(sum(terms))
        return loads

    def period(self, comps, halves, split, gpu_comps, thr: int, t_hi: int):
        """IntVar: network_terms.pipeline_period's T (ns units) under the tables' schedule,
        over the stages' slowest compute ``comps``, their boundaries' one-way halves
        ``halves`` (S - 1) and, for GPipe, ``split`` = (fwd3, bwd3): per stage the lists
        of its classes' 3 x forward and 3 x backward (None for 1F1B); this model's link
        loads (``loads``, called here); redundant bounds: every GPU's compute
        (``gpu_comps``) and the throughput bound ``thr``; ``t_hi``: the upper bound of a
        stage time."""
        m, tab, n_s = self.m, self.tab, len(comps)
        loads = self.loads()
        hi = max(2 * t_hi, 2 * n_s * self.b * max((max(r) for r in tab.xfer1), default=0))
        period = m.new_int_var(0, hi, "period")

        def h(s):  # one direction of boundary s (0 outside the pipeline)
            return halves[s] if 0 <= s < n_s - 1 else 0

        if tab.schedule == "1f1b":
            loops = []
            for s in range(n_s):
                v = m.new_int_var(0, t_hi, f"loop_{s}")
                m.add(v == comps[s] + h(s - 1) + h(s))
                loops.append(v)
            m.add_max_equality(period, loops + loads)
        else:
            fwd3, bwd3 = split

            def phase(parts, first, name):
                """3 x max(one end's compute, its exchange, every other stage's compute + its larger exchange)."""
                terms = []
                for s in range(n_s):
                    c3 = m.new_int_var(0, 3 * t_hi, f"{name}c_{s}")
                    m.add_max_equality(c3, parts[s])
                    if s == first:  # no receive in this phase: its sends queue on its stream
                        terms += [c3, 3 * h(s if s == 0 else s - 1)]
                        continue
                    big = m.new_int_var(0, t_hi, f"{name}h_{s}")
                    m.add_max_equality(big, [h(s - 1), h(s)])
                    terms.append(c3 + 3 * big)
                out = m.new_int_var(0, 3 * hi, f"{name}3")
                m.add_max_equality(out, terms)
                return out

            t3 = phase(fwd3, 0, "gf") + phase(bwd3, n_s - 1, "gb")
            tg = m.new_int_var(0, hi, "period_gpipe")
            m.add_division_equality(tg, t3 + 2, 3)  # ceil
            m.add_max_equality(period, [tg] + loads)
        for cv in gpu_comps:  # redundant: the period is >= every GPU's compute, so >= the throughput bound
            m.add(period >= cv)
        m.add(period >= thr)
        return period


def node_sums(tab: IntTables, groups, n, kn, num_stages: int):
    """[Note: boundary rows] per (group c, stage s): an expression of the samples the GPUs of
    stage s on the node of one unit of c take, for the two layouts the planners build:
      * every member of c on one node N (a GPU, a class of one node): the sum over
        the groups on N (each with every member on N) of their k n;
      * each unit of c a node of its own, no other group on it (merged identical
        nodes; GPUs without node names, each its own node): unit * n[c][s].
    Raises ValueError for any other layout (no planner makes one)."""
    node = tab.gpu_node
    nodes_of = [{node[g] for g in q.members} for q in groups]
    holders: dict[int, list[int]] = {}
    for c, ns_ in enumerate(nodes_of):
        for x in ns_:
            holders.setdefault(x, []).append(c)
    out = []
    for c, q in enumerate(groups):
        if len(nodes_of[c]) == 1:
            (x,) = nodes_of[c]
            if any(len(nodes_of[d]) != 1 for d in holders[x]):
                raise ValueError(f"group {c} shares node {x} with a group that spans nodes")
            out.append([sum(q_.unit * (n[d][s] if q_.count == 1 else kn[d, s])
                            for d in holders[x] for q_ in (groups[d],)) for s in range(num_stages)])
            continue
        units = [q.members[u * q.unit:(u + 1) * q.unit] for u in range(q.count)]
        if any(len({node[g] for g in us}) != 1 for us in units) or len(nodes_of[c]) != q.count \
                or any(holders[x] != [c] for x in nodes_of[c]):
            raise ValueError(f"group {c}: its units are not one node each, alone on it")
        out.append([q.unit * n[c][s] for s in range(num_stages)])
    return out
