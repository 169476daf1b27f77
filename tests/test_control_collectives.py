"""The step's world control collectives ([C-control] in solve/objective.py): the
gradient norm's all-reduce and the per-step table's all-gather ([Note: one world
collective after the step] in zorse_fx/train.py), priced as r passes of the used
GPUs' ring (``solve.tables.control_pass``: (W - 1) x the slowest link in one
datacenter; across datacenters the slowest link once per datacenter crossed, the
slowest link inside a datacenter for the other steps) in the objective, the CP-SAT
model (equal to ``evaluate`` to the ns, idle GPUs or not) and the simulator (a
barrier before every optimizer, the all-gather at the end)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from conftest import assert_cpsat_equals_brute_force, assert_grouped_within_cpsat_gap, random_instance, solver_options

from zorse_fx.cluster import Cluster
from zorse_fx.precision import PRECISIONS, PrecisionPolicy
from zorse_fx.sim import simulate
from zorse_fx.solve import BlockCosts, Decision, evaluate, solve_brute_force, solve_cpsat
from zorse_fx.solve.objective import UNITS_PER_S
from zorse_fx.solve.tables import control_pass


def _two_regions(wan_latency_ms: float) -> Cluster:
    """Two one-T4 nodes in region us, two in eu: 4 GB/s and 10 us inside a region, 1 GB/s and
    ``wan_latency_ms`` across."""
    return Cluster.from_dict({
        "datacenters": [{"name": "us"}, {"name": "eu"}],
        "nodes": [{"name": n, "datacenter": dc, "gpus": [{"type": "T4", "count": 1}]}
                  for dc, names in (("us", ["u0", "u1"]), ("eu", ["e0", "e1"])) for n in names],
        "links": {"inter_node": {"bandwidth_GBps": 4, "latency_us": 10},
                  "cross_datacenter": {"bandwidth_GBps": 1, "latency_ms": wan_latency_ms}}})


def _costs(t: float, rounds: int, params: int = 0) -> BlockCosts:
    """Two blocks of ``t`` s per sample each on a T4, ``params`` parameters each, nothing crossing the cut."""
    return BlockCosts(fwd_bwd_s_per_sample={"T4": (t, t)}, param_count=(params, params), act_bytes_per_sample=(0, 0),
                      cut_bytes_per_sample=(0, 0, 0), step_control_rounds=rounds)


def test_precisions_count_their_control_rounds():
    """3 ring latencies per (W - 1): the norm's all-reduce (2) and the table's all-gather (1); fp16-mixed's
    loss scaler agrees on inf/NaN in one more all-reduce (5)."""
    rounds = {name: PrecisionPolicy(name=name).step_control_rounds for name in PRECISIONS}
    assert rounds == {name: 5 if name == "fp16-mixed" else 3 for name in PRECISIONS}


def test_objective_prices_one_pass_of_the_used_gpus_ring():
    """One stage over W GPUs: the control term is r passes of their ring: (W - 1) x 10 us inside a region;
    across the 1 ms WAN, x = min(D, W - 1) steps at 1 ms and the rest at 10 us; nothing on one GPU."""
    devices = _two_regions(1.0).device_graph()
    options = solver_options(global_batch_size=4, num_microbatches=(1,), allow_idle_gpus=True)
    for gpus, one_pass in (((0, 1, 2, 3), 10e-6 + 2e-3), ((0, 1), 10e-6), ((2, 3), 10e-6), ((0, 2), 1e-3),
                           ((0, 1, 2), 2e-3), ((1,), 0.0)):
        d = Decision(stage_blocks=((0, 2),), stage_gpus=(gpus,),
                     samples_per_microbatch=((4 // len(gpus),) * len(gpus),) if 4 % len(gpus) == 0
                     else ((2, 1, 1),), num_microbatches=1)
        with_ = evaluate(_costs(1e-3, 3), devices, options, d)
        without = evaluate(_costs(1e-3, 0), devices, options, d)
        assert with_.control_s == pytest.approx(3 * one_pass, abs=1e-9)
        assert with_.objective_units - without.objective_units == round(with_.control_s * UNITS_PER_S)
        assert without.control_s == 0.0


def test_control_pass_in_one_datacenter_is_the_lockstep_ring():
    """Random latency tables, every GPU in one datacenter: a pass is (W - 1) x the largest latency among the
    used GPUs, as before datacenters were counted; across datacenters never more than that."""
    rng = np.random.default_rng(5)
    for _ in range(200):
        g = int(rng.integers(2, 9))
        lat = rng.integers(1, 1000, size=(g, g))
        lat = np.minimum(lat, lat.T)
        used = sorted(set(rng.integers(0, g, size=int(rng.integers(1, g + 1))).tolist()))
        sub = lat[np.ix_(used, used)][~np.eye(len(used), dtype=bool)]
        lockstep = (len(used) - 1) * int(sub.max()) if len(used) > 1 else 0
        assert control_pass(lat, np.zeros(g, dtype=np.int64), used) == lockstep
        dcs = rng.integers(0, 3, size=g)
        assert 0 <= control_pass(lat, dcs, used) <= lockstep


def test_control_pass_of_zorse_c_crosses_the_wan_twice():
    """Zorse C (128 GPUs, two regions 50 ms apart): a pass over every GPU is 2 WAN latencies + 125 x the
    largest latency inside a region (25 GbE, 20 us); region 1 alone 63 x that; was 127 x 50 ms."""
    from pathlib import Path

    cluster = Cluster.from_yaml(Path(__file__).resolve().parents[1] / "examples/clusters/zorse_c_two_regions.yaml")
    devices = cluster.device_graph()
    lat, dcs = np.asarray(devices.link_latency_s), np.asarray(devices.datacenter_index)
    inside = max(devices.link_latency_s[0][h] for h in range(64))
    assert control_pass(lat, dcs, range(128)) == pytest.approx(2 * 50e-3 + 125 * inside, rel=1e-12)
    assert control_pass(lat, dcs, range(64)) == pytest.approx(63 * inside, rel=1e-12)
    assert 2 * 50e-3 + 125 * inside < 0.11


def test_a_plan_stays_on_one_side_of_a_slow_wan():
    """4 samples of 100 ms: four GPUs take 100 ms of compute, two 200 ms. Across a 10 ms WAN the
    gradient ring (one bucket, no parameters) costs 2 x 3 x 10 ms = 60 ms, less than the 100 ms saved, so
    without the control term CP-SAT uses all four GPUs across the WAN; the control collectives add
    3 passes of (2 x 10 ms + 10 us) = 60 ms there, so with them (idle GPUs allowed) CP-SAT and brute force
    keep the plan in one region: 200 ms + its ring (2 x 10 us) + its control (3 x 10 us)."""
    devices = _two_regions(10.0).device_graph()
    options = solver_options(global_batch_size=4, max_stages=1, num_microbatches=(1,), allow_idle_gpus=True)
    priced = solve_cpsat(_costs(50e-3, 3), devices, options)
    blind = solve_cpsat(_costs(50e-3, 0), devices, options)
    assert {g // 2 for g in priced.decision.stage_gpus[0]} in ({0}, {1})
    assert len(priced.decision.stage_gpus[0]) == 2
    assert sorted(blind.decision.stage_gpus[0]) == [0, 1, 2, 3]
    ref = solve_brute_force(_costs(50e-3, 3), devices, options)
    assert round(priced.objective * UNITS_PER_S) == round(ref.objective * UNITS_PER_S)
    assert priced.objective == pytest.approx(0.200 + 2 * 10e-6 + 3 * 10e-6, abs=1e-9)


@pytest.mark.parametrize("seed", range(12))
def test_cpsat_equals_evaluate_and_brute_force_with_control(seed):
    """Random instances (idle GPUs allowed on most seeds, single-pair links of other latencies):
    CP-SAT's optimum, [C-control] included, is brute force's, and its objective equals ``evaluate``
    of its decision to the ns (``_search`` checks every answer as well)."""
    costs, devices, options = random_instance(seed)
    costs = dataclasses.replace(costs, step_control_rounds=random.Random(seed).choice([3, 5]))
    got = assert_cpsat_equals_brute_force(costs, devices, options)
    if got is None:
        return
    _, res, ev = got
    used = {g for gs in res.decision.stage_gpus for g in gs}
    assert (ev.control_s > 0) == (len(used) > 1)


def test_simulator_runs_the_norm_before_every_optimizer_and_the_gather_last():
    """One stage on all four GPUs (1000 parameters per block: one gradient bucket): every GPU's optimizer
    starts after the norm's all-reduce, 2 passes (2 WAN latencies + 10 us each) after the gradient ring,
    and the step ends one pass after the optimizers: the objective's 3 passes, and the same step."""
    one_pass = 2 * 1e-3 + 10e-6
    devices = _two_regions(1.0).device_graph()
    options = solver_options(global_batch_size=4, num_microbatches=(1,))
    d = Decision(stage_blocks=((0, 2),), stage_gpus=((0, 1, 2, 3),), samples_per_microbatch=((1, 1, 1, 1),),
                 num_microbatches=1)
    costs = _costs(1e-3, 3, params=1000)
    sim = simulate(costs, devices, options, d)
    backward_end = max(e.end_s for e in sim.events if e.kind == "allreduce")
    control = sorted((e for e in sim.events if e.kind == "control"), key=lambda e: (e.start_s, e.gpu))
    assert len(control) == 8
    assert all(e.end_s == pytest.approx(backward_end + 2 * one_pass, rel=1e-12) for e in control[:4])
    optim = [e for e in sim.events if e.kind == "optim"]
    assert all(e.start_s == pytest.approx(control[0].end_s, rel=1e-12) for e in optim)
    assert sim.step_time_s == pytest.approx(max(e.end_s for e in optim) + one_pass, rel=1e-12)
    # Both models add the same 3 passes to this step.
    blind = simulate(dataclasses.replace(costs, step_control_rounds=0), devices, options, d)
    assert not [e for e in blind.events if e.kind == "control"]
    assert sim.step_time_s - blind.step_time_s == pytest.approx(3 * one_pass, rel=1e-9)
    assert evaluate(costs, devices, options, d).control_s == pytest.approx(3 * one_pass, rel=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_class_level_model_prices_control_like_evaluate(seed):
    """solve_grouped (classes of 4 and of 2 GPUs on two nodes: multi-unit groups) with idle GPUs allowed:
    its answer's objective, [C-control] included, equals ``evaluate`` (``_search`` raises otherwise) and is
    never better than the per-GPU optimum."""
    from conftest import make_devices, random_costs

    rng = random.Random(700 + seed)
    types = ["A"] * 4 + ["A", "A", "B", "B"]
    devices = make_devices(types, ["n0"] * 4 + ["n1"] * 4, [16 * 2**30] * 8,
                           [1e12 if t == "A" else 3e11 for t in types],
                           inter=(10e9, rng.choice([2e-5, 5e-3])))
    costs = dataclasses.replace(random_costs(rng, rng.randint(2, 4), "AB"), step_control_rounds=3)
    options = solver_options(global_batch_size=rng.choice([4, 8]), max_stages=2, num_microbatches=(1, 2),
                            allow_idle_gpus=True, seed=seed)
    assert_grouped_within_cpsat_gap(costs, devices, options)


def _in_two_datacenters(devices, seed: int):
    """``devices`` with each node in datacenter "a" or "b" (both used where there are two nodes) and the pairs
    across the two 2-20 ms apart."""
    rng = random.Random(900 + seed)
    nodes = sorted(set(devices.node_names))
    dc = {n: ("a", "b")[i % 2] if len(nodes) > 1 else "a" for i, n in enumerate(nodes)}
    names = tuple(dc[n] for n in devices.node_names)
    wan = rng.uniform(2e-3, 20e-3)
    lat = tuple(tuple(0.0 if g == h else (wan if names[g] != names[h] else x) for h, x in enumerate(row))
                for g, row in enumerate(devices.link_latency_s))
    return dataclasses.replace(devices, datacenter_names=names, link_latency_s=lat)


@pytest.mark.parametrize("seed", range(10))
def test_cpsat_equals_evaluate_and_brute_force_across_datacenters(seed):
    """Random instances with their nodes in two datacenters (idle GPUs allowed on most seeds): CP-SAT's
    optimum, [C-control]'s two-level pass included, is brute force's, its objective ``evaluate``'s to the ns."""
    costs, devices, options = random_instance(seed)
    devices = _in_two_datacenters(devices, seed)
    costs = dataclasses.replace(costs, step_control_rounds=random.Random(seed).choice([3, 5]))
    assert_cpsat_equals_brute_force(costs, devices, options)


@pytest.mark.parametrize("seed", range(3))
def test_class_level_model_prices_control_across_datacenters(seed):
    """solve_grouped on two 4-GPU nodes in two datacenters (multi-GPU classes, idle GPUs allowed): its
    objective equals ``evaluate`` (``_search`` raises otherwise), never better than the per-GPU optimum."""
    from conftest import make_devices, random_costs

    rng = random.Random(800 + seed)
    types = ["A"] * 4 + ["A", "A", "B", "B"]
    devices = make_devices(types, ["n0"] * 4 + ["n1"] * 4, [16 * 2**30] * 8,
                           [1e12 if t == "A" else 3e11 for t in types], inter=(10e9, 2e-5))
    devices = _in_two_datacenters(devices, seed)
    costs = dataclasses.replace(random_costs(rng, rng.randint(2, 4), "AB"), step_control_rounds=3)
    options = solver_options(global_batch_size=rng.choice([4, 8]), max_stages=2, num_microbatches=(1, 2),
                             allow_idle_gpus=True, seed=seed)
    assert_grouped_within_cpsat_gap(costs, devices, options)
