"""Tests of the network terms of the objective (solve/objective.py, issue 13
item 6): shared links through the pair bandwidth ([Note: shared links in the
objective]), the ring's (k-1)/k in [C-allreduce], and the all-reduce of tied
parameters over the union of their holders ([C-tied]); the CP-SAT model agrees
with ``evaluate`` to the ns on each, and the simulator with the objective where
both price the same thing."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest

from zorse_fx.cluster import Cluster
from zorse_fx.sim import simulate
from zorse_fx.solve import BlockCosts, SolverOptions, evaluate, solve_brute_force, solve_cpsat
from zorse_fx.solve.objective import UNITS_PER_S, effective_pair_bandwidth, to_units
from zorse_fx.solve.records import TiedParam

from conftest import random_instance, reference_or_same_error

GIB = 1 << 30


def _two_regions(wan_gbps: float | None) -> dict:
    """Two one-T4 nodes in region us, two in eu; 4 GB/s inside a region, 1 GB/s
    (1 ms) across; with ``wan_gbps`` one WAN path of that capacity between the regions."""
    data = {"datacenters": [{"name": "us"}, {"name": "eu"}],
            "nodes": [{"name": n, "datacenter": dc, "gpus": [{"type": "T4", "count": 1}]}
                      for dc, names in (("us", ["u0", "u1"]), ("eu", ["e0", "e1"])) for n in names],
            "links": {"inter_node": {"bandwidth_GBps": 4, "latency_us": 10},
                      "cross_datacenter": {"bandwidth_GBps": 1, "latency_ms": 1}}}
    if wan_gbps is not None:
        data["shared_links"] = [{"name": "wan", "between": [{"datacenter": "us"}, {"datacenter": "eu"}],
                                 "bandwidth_Gbps": wan_gbps}]
    return copy.deepcopy(data)


def _two_block_costs(t: float, cut: int, params: int = 0) -> BlockCosts:
    return BlockCosts(fwd_bwd_s_per_sample={"T4": (t, t)}, param_count=(params, params),
                      act_bytes_per_sample=(0, 0), cut_bytes_per_sample=(0, cut, 0))


def test_boundary_across_a_wan_is_priced_at_the_wan_capacity():
    """Stage 0 on the us GPUs, stage 1 on the eu GPUs; each route crosses the
    regions' WAN path of 2 Gb/s = 0.25 GB/s (the pairs' own links: 1 GB/s). The
    objective's boundary is 2 (all cut bytes / 0.25 GB/s + 1 ms), and the
    simulator, where the two routes share the WAN, agrees: its boundary moves the
    same bytes at the same 0.25 GB/s in all."""
    t, cut, wan = 2e-3, 10_000_000, 0.25e9
    costs = _two_block_costs(t, cut)
    options = SolverOptions(global_batch_size=2, num_microbatches=(1,))
    kw = dict(stage_blocks=((0, 1), (1, 2)), stage_gpus=((0, 1), (2, 3)), samples_per_microbatch=((1, 1),) * 2,
              num_microbatches=1)
    free = Cluster.from_dict(_two_regions(None)).device_graph()
    shared = Cluster.from_dict(_two_regions(2)).device_graph()
    bw = effective_pair_bandwidth(shared)
    assert bw[0][2] == bw[3][1] == wan and bw[0][1] == bw[2][3] == 4e9  # inside a region: not crossed
    assert effective_pair_bandwidth(free)[0][2] == 1e9
    ev = evaluate(costs, shared, options, **kw)
    assert ev.boundary_s[0] * UNITS_PER_S == 2 * (to_units(2 * cut / wan) + to_units(1e-3))
    ev_free = evaluate(costs, free, options, **kw)
    assert ev_free.boundary_s[0] * UNITS_PER_S == 2 * (to_units(2 * cut / 1e9) + to_units(1e-3))
    # The simulator: stage 1 can start after its route's message (0.25 GB/s shared by 2 routes
    # = cut / 0.125 GB/s each) -- the objective's all bytes at 0.25 GB/s, to the ns. No
    # parameters: the simulator has no bucket to reduce, the objective 2 (k-1) latencies.
    sim = simulate(costs, shared, options, **kw)
    assert max(ev.allreduce_s) == pytest.approx(2 * 10e-6)
    assert sim.step_time_s == pytest.approx(ev.step_time_s - max(ev.allreduce_s), abs=2e-9)


def test_cpsat_equals_evaluate_with_a_wan_and_prefers_one_region():
    """Four GPUs in two regions, a WAN path slower than the pairs' links: CP-SAT's
    optimum equals ``evaluate`` of its decision (``_search`` checks it on every
    answer) and brute force's; a 2-stage plan keeps a data-parallel group in one region."""
    costs = _two_block_costs(20e-3, 40_000_000, params=50_000_000)
    options = SolverOptions(global_batch_size=4, max_stages=2)
    devices = Cluster.from_dict(_two_regions(0.8)).device_graph()
    res = solve_cpsat(costs, devices, options)
    ref = solve_brute_force(costs, devices, options)
    assert res.status == "OPTIMAL"
    assert round(res.objective * UNITS_PER_S) == round(ref.objective * UNITS_PER_S)
    ev = evaluate(costs, devices, options, **res.decision_kwargs())
    assert round(res.objective * UNITS_PER_S) == ev.objective_units
    for gpus in res.stage_gpus:
        regions = {g // 2 for g in gpus}
        assert len(regions) == 1 or len(res.stage_gpus) == 1
