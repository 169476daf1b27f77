"""The class-level CP-SAT planner: model.py's one model builder over GPU classes.

GPU *classes* are sets of GPUs that are interchangeable with each other and
uniform towards every other class: same type, node, usable memory, memory
bandwidth; every pair inside a class has the same link (rounded bandwidth
class, latency) and every pair (g in c, h in d) of two classes c != d has the
same link. ``gpu_classes`` finds the coarsest such partition that refines
(type, node, memory, memory bandwidth) -- in practice "same type on the same
node".

The model is ``model.CandidateModel`` ([Note: one model builder]) with one
group per class: k[c][s] GPUs of class c in stage s, all taking the same share
of the micro-batch -- a restriction of the per-GPU decision space
(``solve_cpsat``: the same builder with one group per GPU), equal to it when
every class has one GPU. The objective of any solution equals ``evaluate()``
of its expansion to GPUs (the first k[c][0] GPUs of class c, in index order,
go to stage 0, the next k[c][1] to stage 1, ...); ``solve_grouped`` asserts
this on every answer.

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
variables (C = number of groups; a group with one unit has O(B)), independent
of the GPU count.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from ..ir.costs import BlockCosts
from ..ir.devices import DeviceGraph
from ..ir.result import SolverResult
from ..options import PlanOptions
from ._search import CandidateSearch, ordered_candidates
from .model import CandidateModel, _Group, _link_code
from .objective import IntTables

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


def _groups(devices: DeviceGraph, tab: IntTables, aggregate: bool) -> list[_Group]:
    """Plain classes, or (``aggregate``) classes of identical nodes merged.

    Two classes merge when they have the same type, usable memory, memory
    bandwidth, size, inside link and datacenter, the same link to each other
    and the same links to every other class (class-level refinement, ``_refine``)."""
    classes = gpu_classes(devices, tab)
    if not aggregate:
        return [_Group(tuple(c), 1, len(c), None, (c[0], c[1]) if len(c) > 1 else None) for c in classes]
    code = _link_code(tab)
    reps = [c[0] for c in classes]
    cc = code[np.ix_(reps, reps)]
    keys: dict[tuple, list[int]] = defaultdict(list)
    per_node: dict[int, int] = defaultdict(int)
    for c in classes:
        for x in {tab.gpu_node[g] for g in c}:
            per_node[x] += 1
    for i, c in enumerate(classes):
        g = c[0]
        # A class sharing its node with another stays a plain class: a merged group's node
        # holds its GPUs only ([Note: boundary rows]: _boundary_encoding.node_sums).
        alone = len({tab.gpu_node[h] for h in c}) == 1 and per_node[tab.gpu_node[g]] == 1
        # Nodes of one datacenter only: [C-control] counts the datacenters a group's GPUs are in.
        keys[(devices.gpu_types[g], tab.cap_bytes[g], tab.gpu_mbw_class[g], len(c),
              int(code[c[0], c[1]]) if len(c) > 1 else -1, True if alone else i,
              tab.gpu_dc[g] if tab.gpu_dc else 0)].append(i)
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


#: With ``aggregate_nodes=None``, identical nodes are merged when there are more classes than this.
AGGREGATE_ABOVE = 16


def solve_grouped(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions, *,
                  aggregate_nodes: bool | None = None, hints=(), incumbent: SolverResult | None = None,
                  progress=None) -> SolverResult:
    """Plan with the grouped CP-SAT model: minimise the predicted step time over (S, M).

    Same contract as ``solve_cpsat`` (``objective`` / ``best_bound`` in seconds,
    "OPTIMAL" only when every candidate was solved to optimality or proven
    infeasible) except that optimality is over the grouped decision space,
    a restriction of the per-GPU one; with one GPU per class the model is
    ``solve_cpsat``'s itself ([Note: one model builder] in model.py).
    ``aggregate_nodes``: merge classes of identical nodes into one group whose
    stages take whole nodes (a further restriction; None = only when there are
    more than AGGREGATE_ABOVE classes). Each candidate gets
    ``options.solver_budget`` deterministic seconds (``options.time_limit_s``:
    the wall-clock safety stop). ``hints``: decisions to warm-start the candidate
    with the same S and M, ``incumbent`` a plan to beat, ``progress`` a line per
    candidate (``solve_cpsat``). Raises
    InfeasiblePlanError if nothing fits."""
    cands = ordered_candidates(costs, devices, options, hints)
    search = CandidateSearch(costs, devices, options, label="grouped", incumbent=incumbent, progress=progress,
                             total=len(cands))
    groups = None

    def model(n_s, tab):
        nonlocal groups
        if groups is None:
            groups = _groups(devices, tab, False)
            if aggregate_nodes or (aggregate_nodes is None and len(groups) > AGGREGATE_ABOVE):
                groups = _groups(devices, tab, True)
        return CandidateModel(tab, devices, options, groups, n_s)

    search.run(cands, model, hints=hints, num_groups=lambda: len(groups))
    return search.result()
