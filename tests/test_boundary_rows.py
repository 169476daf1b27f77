"""Tests of [C-boundary]'s rows per link (solve/network_terms.py [Note: boundary
rows]): the samples of a micro-batch the objective charges on a GPU pair's link
bound the bytes the runtime's routes put on that link; the objective, CP-SAT,
brute force and the simulator agree where they price the same transfer; the
class-level model's node aggregation keeps a node's sample sum expressible."""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict

import pytest
from conftest import make_devices, random_costs, solver_options

from zorse_fx.ir.devices import SharedLink
from zorse_fx.ir.p2p import routes
from zorse_fx.sim import simulate
from zorse_fx.sim.network import link_resource
from zorse_fx.solve import BlockCosts, Decision, evaluate, solve_brute_force, solve_cpsat
from zorse_fx.solve.grouped import _groups, solve_grouped
from zorse_fx.solve.network_terms import ROWS_ALL, boundary_rows, pipeline_period
from zorse_fx.solve.objective import UNITS_PER_S, build_tables, to_units

GIB = 1 << 30


def _ranges(ns):
    out, start = [], 0
    for n in ns:
        out.append((start, start + n))
        start += n
    return tuple(out)


@pytest.mark.parametrize("seed", range(200))
def test_rows_bound_the_bytes_the_runtimes_routes_put_on_each_link(seed):
    """Random stage pairs on random nodes: for every link the routes use (a node pair's,
    or a GPU pair's inside a node: ``sim/network.link_resource``), and for every shared link
    and direction, the samples routed over it are at most the rows [C-boundary] charges on each
    GPU pair using it; a pair crossing a shared link of several nodes a side (a region's path)
    is charged the whole micro-batch, one crossing only shared links of one node a side (a NIC,
    a node's cap) its two nodes' larger sample count."""
    rng = random.Random(seed)
    n_g = rng.randint(2, 10)
    nodes = [f"n{rng.randint(0, 3)}" for _ in range(n_g)]
    devices = make_devices(["A"] * n_g, nodes, [16 * GIB] * n_g, [1e12] * n_g)
    if seed % 3 == 0:  # a shared link between node n0 and the rest (a NIC, or n0's cap to the rest)
        side = tuple(g for g in range(n_g) if nodes[g] == "n0")
        rest = tuple(g for g in range(n_g) if nodes[g] != "n0")
        if side and rest:
            devices = dataclasses.replace(devices, shared_links=(
                SharedLink(name="nic0", gpus_a=side, gpus_b=rest, bandwidth_bytes_per_s=5e9),))
    elif seed % 3 == 1:  # a path between two regions of two nodes each (n0, n1 | n2, n3)
        side = tuple(g for g in range(n_g) if nodes[g] in ("n0", "n1"))
        rest = tuple(g for g in range(n_g) if nodes[g] in ("n2", "n3"))
        if side and rest:
            devices = dataclasses.replace(devices, shared_links=(
                SharedLink(name="wan", gpus_a=side, gpus_b=rest, bandwidth_bytes_per_s=5e9),))
    gpus = list(range(n_g))
    rng.shuffle(gpus)
    cut = rng.randint(1, n_g - 1)
    src, dst = tuple(gpus[:cut]), tuple(gpus[cut:])
    b = rng.randint(max(len(src), len(dst)), 16)

    def split(k):
        edges = sorted(rng.sample(range(1, b), k - 1))
        return tuple(e - s for s, e in zip([0] + edges, edges + [b]))

    src_n, dst_n = split(len(src)), split(len(dst))
    tab = build_tables(BlockCosts(fwd_bwd_s_per_sample={"A": (1e-3, 1e-3)}, param_count=(1, 1),
                                  act_bytes_per_sample=(1, 1), cut_bytes_per_sample=(0, 1, 0)),
                       devices, solver_options(global_batch_size=b), 1)
    rows = dict(boundary_rows(tab, src, src_n, dst, dst_n))
    assert set(rows) == {(g, h) for g in src for h in dst}
    on_link, pairs_of = defaultdict(int), defaultdict(set)
    for r in routes(_ranges(src_n), _ranges(dst_n)):
        g, h = src[r.src_pos], dst[r.dst_pos]
        on_link[link_resource(devices, g, h)] += r.rows
        pairs_of[link_resource(devices, g, h)].add((g, h))
    for link, routed in on_link.items():
        for g, h in pairs_of[link]:
            assert routed <= rows[g, h], (link, g, h, routed, rows[g, h])
    for sl in devices.shared_links:
        for direction in (0, 1):
            crossing = [r for r in routes(_ranges(src_n), _ranges(dst_n))
                        if sl.direction(src[r.src_pos], dst[r.dst_pos]) == direction]
            routed = sum(r.rows for r in crossing)
            for r in crossing:
                g, h = src[r.src_pos], dst[r.dst_pos]
                assert routed <= rows[g, h], (sl.name, direction, g, h, routed, rows[g, h])
    for (g, h), r in rows.items():
        if tab.pair_rows[g][h] == ROWS_ALL:
            assert r == b
        assert 0 <= r <= b


def test_a_one_gpu_stage_feeding_two_nodes():
    """GPU 0 (node a) holds the micro-batch of 4 samples and feeds stage 1 on GPUs 1, 2
    (node b, one sample each) and 3 (node c, two): each node pair's link carries 2
    samples, so the boundary is 2 (2 x cut / bw + latency), half of what all 4 samples on
    the slowest pair cost. One micro-batch and no parameters (stage 1's ring latencies
    hide behind stage 0's drain offset): the simulator's step is the objective's, to the ns."""
    cut, bw, lat = 50_000_000, 10e9, 2e-5
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (3e-3, 1e-3)}, param_count=(0, 0),
                       act_bytes_per_sample=(0, 0), cut_bytes_per_sample=(0, cut, 0))
    nodes = ["a", "b", "b", "c"]
    devices = make_devices(["A"] * 4, nodes, [16 * GIB] * 4, [1e12] * 4, inter=(bw, lat))
    options = solver_options(global_batch_size=4, num_microbatches=(1,), max_stages=2)
    dec = Decision(stage_blocks=((0, 1), (1, 2)), stage_gpus=((0,), (1, 2, 3)),
                   samples_per_microbatch=((4,), (1, 1, 2)), num_microbatches=1)
    ev = evaluate(costs, devices, options, dec)
    assert round(ev.boundary_s[0] * UNITS_PER_S) == 2 * (2 * to_units(cut / bw) + to_units(lat))
    sim = simulate(costs, devices, options, dec)
    assert round(ev.step_time_s * UNITS_PER_S) == to_units(12e-3 + 2e-3) + round(ev.boundary_s[0] * UNITS_PER_S)
    assert sim.step_time_s == pytest.approx(ev.step_time_s, abs=2e-9)
    # The planners price the same term: CP-SAT's optimum equals brute force's (and, checked
    # on every answer by the search, evaluate of its decision).
    res, ref = solve_cpsat(costs, devices, options), solve_brute_force(costs, devices, options)
    assert res.status == "OPTIMAL"
    assert round(res.objective * UNITS_PER_S) == round(ref.objective * UNITS_PER_S)


@pytest.mark.parametrize("seed", range(3))
def test_nodes_holding_two_classes_are_not_merged(seed):
    """Three identical nodes of 2 A + 2 B GPUs: node aggregation leaves their classes plain
    (a merged group's node must hold its GPUs only, for its node's sample sum), and the
    grouped planner's answer equals evaluate (asserted on every answer) and is no better
    than the per-GPU optimum over the same GPUs."""
    rng = random.Random(300 + seed)
    types = ["A", "A", "B", "B"] * 3
    nodes = [f"n{i // 4}" for i in range(12)]
    devices = make_devices(types, nodes, [16 * GIB] * 12, [1e12 if t == "A" else 3e11 for t in types])
    costs = random_costs(rng, rng.randint(2, 4), "AB")
    options = solver_options(global_batch_size=12, max_stages=2, num_microbatches=(1, 2), seed=seed,
                            solver_budget=0.5)
    tab = build_tables(costs, devices, options, 1)
    assert all(q.unit == 1 for q in _groups(devices, tab, True))
    res = solve_grouped(costs, devices, options, aggregate_nodes=True)
    ev = evaluate(costs, devices, options, res.decision)
    assert ev.feasible and ev.objective_units == round(res.objective * UNITS_PER_S)
    # Identical nodes of one class each still merge.
    one = make_devices(["A"] * 8, [f"n{i // 2}" for i in range(8)], [16 * GIB] * 8, [1e12] * 8)
    assert any(q.unit == 2 for q in _groups(one, build_tables(costs, one, options, 1), True))


def _shared_link_instance(schedule="1f1b", num_microbatches=4):
    """Stage 0 on GPU 0 (node a), stage 1 on GPU 2 (node b), stage 2 on GPU 1 (node a): the
    a-b link carries both boundaries. Block 1's state fits only GPU 2, blocks 0 and 2 one per
    16 GiB GPU, so every feasible plan has this shape (or GPUs 0 and 1 swapped)."""
    cut, bw, m = 20_000_000, 10e9, num_microbatches
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (3e-3, 3e-3, 3e-3)},
                       param_count=(500_000_000, 2_000_000_000, 500_000_000),
                       act_bytes_per_sample=(0, 0, 0), cut_bytes_per_sample=(0, cut, cut, 0))
    devices = make_devices(["A"] * 3, ["a", "a", "b"], [16 * GIB, 16 * GIB, 40 * GIB], [1e12] * 3,
                           inter=(bw, 2e-5))
    options = solver_options(global_batch_size=2 * m, num_microbatches=(m,), max_stages=3, schedule=schedule)
    dec = Decision(stage_blocks=((0, 1), (1, 2), (2, 3)), stage_gpus=((0,), (2,), (1,)),
                   samples_per_microbatch=((2,), (2,), (2,)), num_microbatches=m)
    return costs, devices, options, dec, 2 * to_units(cut / bw)


@pytest.mark.parametrize("num_microbatches", [4, 16])
def test_a_node_pair_link_carrying_two_boundaries(num_microbatches):
    """Both boundaries cross the a-b link (x = 4 ms one way per micro-batch, 20 us latency,
    3 ms + 3 ms compute per stage). Under 1F1B the runtime's fused exchanges keep the
    stages in lock step, so the two boundaries' exchanges take turns on the link: the
    period is the loop form ([Note: pipeline period]), the middle stage's
    cmax + h_0 + h_1 = 6 ms + 2 (4 ms + 20 us) = max t_s, and the simulator (the runtime's
    NCCL program) is within 3% (M = 4: 0.970, M = 16: 0.987); charging every exchange
    both directions, as if the two boundaries met on the link, would be 18-30%
    pessimistic. GPipe's phases give the same T (T_F + T_B = (2 + 4.02) + (4 + 4.02) ms),
    which the simulator meets to 1e-6. CP-SAT prices it as ``evaluate`` (checked on every
    answer) and as brute force does."""
    costs, devices, options, dec, x = _shared_link_instance(num_microbatches=num_microbatches)
    ev = evaluate(costs, devices, options, dec)
    stage = [round(v * UNITS_PER_S) for v in ev.stage_time_s]
    comp = [round(v * UNITS_PER_S) for v in ev.compute_s]
    bnd = [round(v * UNITS_PER_S) for v in ev.boundary_s]
    assert max(stage) == to_units(6e-3) + 2 * (x + to_units(2e-5))
    m = num_microbatches
    period = pipeline_period(comp, bnd, 0)
    assert period == comp[1] + bnd[0] // 2 + bnd[1] // 2 == max(stage)
    sync = ev.objective_units - sum(stage) - (m - 1) * period
    assert sync >= 0
    sim = simulate(costs, devices, options, dec).step_time_s
    assert 0.95 < sim / ev.step_time_s < 1.03
    both_ways = max(c + (bnd[s - 1] if s else 0) + bnd[s] for s, c in enumerate(comp))
    assert sim / ((sum(stage) + (m - 1) * both_ways + sync) / UNITS_PER_S) < 0.85
    gp_costs, gp_devices, gp_options, gp_dec, _ = _shared_link_instance("gpipe", num_microbatches)
    gp = evaluate(gp_costs, gp_devices, gp_options, gp_dec)
    assert pipeline_period(comp, bnd, 0, "gpipe", ([c for c in comp], [2 * c for c in comp])) == max(stage)
    assert simulate(gp_costs, gp_devices, gp_options, gp_dec).step_time_s == pytest.approx(gp.step_time_s, rel=1e-6)
    res, ref = solve_cpsat(costs, devices, options), solve_brute_force(costs, devices, options)
    assert res.decision.stage_gpus in (((0,), (2,), (1,)), ((1,), (2,), (0,)))
    assert round(res.objective * UNITS_PER_S) == round(ref.objective * UNITS_PER_S) == ev.objective_units
