"""CP-SAT building blocks of the candidate model (model.py, the one model
builder of the per-GPU and class-level planners).

[C-cuts] c_0 = 0 < c_1 < ... < c_S = B; stage s runs blocks [c_s, c_{s+1}).
Block membership is linear: ge[s][k] <=> c_s <= k (monotone in k), so "block
k is in stage s" is in_s[s][k] = ge[s][k] - ge[s+1][k], and any per-stage sum
of a per-block table is a weighted sum of in_s.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from ortools.sat.python import cp_model

if TYPE_CHECKING:
    from .objective import IntTables

__all__ = ["StageCuts", "blocks_of", "gated", "any_of", "both", "pair_max", "pair_max_many", "rows_max"]


def blocks_of(prefix) -> list[int]:
    """Per-block values of a prefix-summed table."""
    return [prefix[i + 1] - prefix[i] for i in range(len(prefix) - 1)]


class StageCuts:
    """Cut variables ``cut``, booleans ``ge`` and ``in_s`` of S stages over B blocks."""

    def __init__(self, m: cp_model.CpModel, num_blocks: int, num_stages: int):
        nb, n_s = num_blocks, num_stages
        self.nb = nb
        self.cut = cut = [m.new_int_var(min(s, nb), max(nb - n_s + s, 0), f"c_{s}") for s in range(n_s + 1)]
        m.add(cut[0] == 0)
        m.add(cut[n_s] == nb)
        self.ge = ge = [[m.new_bool_var(f"ge_{s}_{k}") for k in range(nb)] for s in range(n_s + 1)]
        for s in range(n_s + 1):
            for k in range(nb):
                m.add(cut[s] <= k).OnlyEnforceIf(ge[s][k])
                m.add(cut[s] >= k + 1).OnlyEnforceIf(ge[s][k].Not())
                if k + 1 < nb:
                    m.add_implication(ge[s][k], ge[s][k + 1])
            m.add(cut[s] == nb - sum(ge[s]))
        for s in range(n_s):
            m.add(cut[s + 1] >= cut[s] + 1)
        self.in_s = in_s = [[m.new_bool_var(f"in_{s}_{k}") for k in range(nb)] for s in range(n_s)]
        for s in range(n_s):
            for k in range(nb):
                m.add(in_s[s][k] == ge[s][k] - ge[s + 1][k])
        for k in range(nb):
            m.add_exactly_one(in_s[s][k] for s in range(n_s))

    def stage_sum(self, prefix, s):
        """Linear expression: sum of a prefix-summed table over the blocks of stage s."""
        return cp_model.LinearExpr.WeightedSum(self.in_s[s], blocks_of(prefix))

    def at_cut(self, table, s):
        """Linear expression: table[c_s] for an interior cut 1 <= s < S."""
        ge = self.ge
        return sum(table[c] * (ge[s][c] - ge[s][c - 1]) for c in range(1, self.nb))


def gated(m: cp_model.CpModel, flag, value, hi: int, name: str):
    """An IntVar equal to flag ? value : 0."""
    z = m.new_int_var(0, hi, name)
    m.add(z == value).OnlyEnforceIf(flag)
    m.add(z == 0).OnlyEnforceIf(flag.Not())
    return z


def any_of(m: cp_model.CpModel, lits, name: str):
    """A boolean equal to OR(lits)."""
    p = m.new_bool_var(name)
    m.add_max_equality(p, lits)
    return p


def both(m: cp_model.CpModel, a, c, name: str):
    """A boolean equal to a AND c."""
    y = m.new_bool_var(name)
    m.add_implication(y, a)
    m.add_implication(y, c)
    m.add_bool_or([a.Not(), c.Not(), y])
    return y


def pair_max(m: cp_model.CpModel, tab: IntTables, pairs, value_of_class, hi_of_class, name: str):
    """(max over present pairs of value_of_class(bw class), max latency over present pairs).

    ``pairs``: iterable of ((g, h) a GPU pair with the link, presence literal),
    iterated once; the link of (g, h) is read from ``tab.pair_bw_class`` /
    ``tab.pair_lat``. Pairs are grouped by bandwidth class / latency (one OR
    literal per group); ``hi_of_class(k)`` bounds ``value_of_class(k)``."""
    xs, lm = pair_max_many(m, tab, pairs, [(value_of_class, hi_of_class)], name)
    return xs[0], lm


def pair_max_many(m: cp_model.CpModel, tab: IntTables, pairs, values, name: str):
    """``pair_max`` of several (value_of_class, hi_of_class) in ``values`` over the
    same pairs, sharing their presence literals: ([max of each], max latency)."""
    by_bw, by_lat = defaultdict(list), defaultdict(list)
    for (g, h), y in pairs:
        by_bw[tab.pair_bw_class[g][h]].append(y)
        by_lat[tab.pair_lat[g][h]].append(y)
    present, xs = {}, []
    for v, (value_of_class, hi_of_class) in enumerate(values):
        sfx, terms = "" if v == 0 else f"_{v}", []
        for k, ys in by_bw.items():
            if k not in present:
                present[k] = any_of(m, ys, f"{name}_p{k}")
            terms.append(gated(m, present[k], value_of_class(k), hi_of_class(k), f"{name}_z{k}{sfx}"))
        xm = m.new_int_var(0, max(hi_of_class(k) for k in by_bw), f"{name}_x{sfx}")
        m.add_max_equality(xm, terms)
        xs.append(xm)
    lm = m.new_int_var(0, max(by_lat), f"{name}_l")
    m.add_max_equality(lm, [lat * any_of(m, ys, f"{name}_q{lat}") for lat, ys in by_lat.items()])
    return xs, lm


def rows_max(m: cp_model.CpModel, tab: IntTables, pairs, xfer_of_class, hi_of_class, b: int, name: str):
    """[C-boundary]: (max over pairs of rows x xfer_of_class(bw class), max latency over present pairs).

    ``pairs``: iterable of ((g, h) a GPU pair with the link, presence literal,
    rows: the samples its link carries, an IntVar or linear expression in
    [0, b] that is 0 when the pair is absent); ``xfer_of_class(k)``: one
    sample's transfer units at the stage's cut, in [0, ``hi_of_class(k)``].
    Per bandwidth class one product (max rows of the class) x (its transfer):
    the max over pairs of rows x transfer, as the transfer is one per class."""
    by_bw, by_lat = defaultdict(list), defaultdict(list)
    for (g, h), y, rows in pairs:
        by_bw[tab.pair_bw_class[g][h]].append(rows)
        by_lat[tab.pair_lat[g][h]].append(y)
    terms = []
    for k, rs in by_bw.items():
        r = m.new_int_var(0, b, f"{name}_r{k}")
        m.add_max_equality(r, rs)
        x = m.new_int_var(0, hi_of_class(k), f"{name}_c{k}")
        m.add(x == xfer_of_class(k))
        hi = hi_of_class(k)
        z = m.new_int_var(0, b * hi, f"{name}_z{k}")
        m.add_multiplication_equality(z, [r, x])
        # Redundant (McCormick, r in [0, b], x in [0, hi]): linear cuts of the product that
        # keep the LP bound of an all-rows boundary (r = b gives z >= b x).
        m.add(z >= b * x + hi * r - b * hi)
        m.add(z <= b * x)
        m.add(z <= hi * r)
        terms.append(z)
    xm = m.new_int_var(0, b * max(hi_of_class(k) for k in by_bw), f"{name}_x")
    m.add_max_equality(xm, terms)
    lm = m.new_int_var(0, max(by_lat), f"{name}_l")
    m.add_max_equality(lm, [lat * any_of(m, ys, f"{name}_q{lat}") for lat, ys in by_lat.items()])
    return xm, lm
