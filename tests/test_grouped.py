"""Tests of the grouped (GPU-class) CP-SAT planner against the per-GPU one."""

from __future__ import annotations

import random
import time

import pytest

from zorse_fx.errors import InfeasiblePlanError
from zorse_fx.solve import BlockCosts, Decision, evaluate, solve_cpsat
from zorse_fx.solve.grouped import gpu_classes, solve_grouped
from zorse_fx.solve.objective import UNITS_PER_S, build_tables

from conftest import (assert_candidates_agree, candidate_dicts, make_devices, random_costs, random_instance, reference_or_same_error,
                      solver_options)

GIB = 1 << 30


def _eval(costs, devices, options, res):
    return evaluate(costs, devices, options, res.decision.without_policy())


def _check_candidates(res):
    for c in candidate_dicts(res):
        assert c["status"] in ("OPTIMAL", "INFEASIBLE", "NO_BETTER", "PRUNED"), c


@pytest.mark.parametrize("seed", range(12))
def test_singleton_classes_match_cpsat(seed):
    costs, devices, options = random_instance(seed, singleton_classes=True)
    tab = build_tables(costs, devices, options, 1)
    assert all(len(c) == 1 for c in gpu_classes(devices, tab))
    ref = reference_or_same_error(solve_cpsat, solve_grouped, costs, devices, options)
    if ref is None:
        return
    res = solve_grouped(costs, devices, options)
    assert ref.status == "OPTIMAL" and res.status == "OPTIMAL"
    ev = _eval(costs, devices, options, res)
    assert ev.feasible
    assert ev.objective_units == round(res.objective * UNITS_PER_S) == round(ref.objective * UNITS_PER_S)
    assert_candidates_agree(res, ref)


def test_classes_two_nodes_of_four():
    """2 nodes x 4 identical GPUs -> 2 classes; a node with 2 x A + 2 x B -> split by type."""
    devices = make_devices(["A"] * 4 + ["A", "A", "B", "B"], ["n0"] * 4 + ["n1"] * 4, [16 * GIB] * 8,
                            [1e12] * 6 + [3e11] * 2)
    costs = random_costs(random.Random(0), 3, "AB")
    tab = build_tables(costs, devices, solver_options(global_batch_size=8), 1)
    assert gpu_classes(devices, tab) == [[0, 1, 2, 3], [4, 5], [6, 7]]
    # one odd link inside node 0 splits that node.
    odd = make_devices(["A"] * 4, ["n0"] * 4, [16 * GIB] * 4, [1e12] * 4, odd_links={(0, 1): (5e9, 1e-5)})
    tab = build_tables(costs, odd, solver_options(global_batch_size=8), 1)
    classes = gpu_classes(odd, tab)
    assert sorted(g for c in classes for g in c) == [0, 1, 2, 3]
    for c in classes:  # uniform links inside every class
        vals = {(tab.pair_bw_class[g][h], tab.pair_lat[g][h]) for g in c for h in c if g != h}
        assert len(vals) <= 1


@pytest.mark.parametrize("seed", range(4))
def test_grouped_is_restriction(seed):
    """Classes of size > 1: grouped optimum >= per-GPU optimum, and evaluate() agrees."""
    rng = random.Random(100 + seed)
    nb = rng.randint(2, 5)
    types = ["A"] * 4 + [rng.choice("AB")] * 4 if seed % 2 else ["A", "A", "B", "B", "A", "A", "B", "B"]
    nodes = ["n0"] * 4 + ["n1"] * 4
    devices = make_devices(types, nodes, [rng.choice([8, 16]) * GIB if t == "B" else 16 * GIB for t in types],
                            [1e12 if t == "A" else 3e11 for t in types])
    costs = random_costs(rng, nb, "AB", fixed=seed % 2 == 0)
    options = solver_options(global_batch_size=rng.choice([4, 6, 8]), max_stages=2, num_microbatches=(1, 2),
                            seed=seed)
    ref = solve_cpsat(costs, devices, options)
    res = solve_grouped(costs, devices, options)
    assert res.status == "OPTIMAL"
    ev = _eval(costs, devices, options, res)
    assert ev.feasible and ev.objective_units == round(res.objective * UNITS_PER_S)
    assert round(res.objective * UNITS_PER_S) >= round(ref.objective * UNITS_PER_S) or ref.status != "OPTIMAL"
    if ref.status == "OPTIMAL":
        assert res.objective >= ref.objective - 1e-12


def _big_instance(n_nodes, per_node, nb, seed=0):
    """n_nodes nodes of per_node GPUs of one type each, 4 types round-robin."""
    rng = random.Random(seed)
    spec = {"H100": (80, 3.35e12, 1.0), "A100": (40, 1.6e12, 1.6), "V100": (32, 9e11, 2.8), "T4": (16, 3e11, 6.0)}
    names = list(spec)
    types, nodes = [], []
    for i in range(n_nodes):
        t = names[i % len(names)]
        types += [t] * per_node
        nodes += [f"node{i}"] * per_node
    base = [rng.uniform(0.5e-3, 2e-3) for _ in range(nb)]
    costs = BlockCosts(
        fwd_bwd_s_per_sample={t: tuple(x * spec[t][2] for x in base) for t in names},
        param_count=tuple(rng.randint(50, 150) * 1_000_000 for _ in range(nb)),
        act_bytes_per_sample=tuple(rng.randint(20, 100) * 1_000_000 for _ in range(nb)),
        cut_bytes_per_sample=(0, *(rng.randint(5, 20) * 1_000_000 for _ in range(nb - 1)), 0),
    )
    devices = make_devices(types, nodes, [spec[t][0] * GIB for t in types], [spec[t][1] for t in types],
                            intra=(300e9, 3e-6), inter=(25e9, 1e-5))
    return costs, devices


def test_sixty_four_gpus_four_types():
    costs, devices = _big_instance(8, 8, 40)
    # M = 8 only: the search over M in (4, 8) answers with M = 8 (a 2-stage plan), so the
    # same plan is checked from half the candidates.
    options = solver_options(global_batch_size=256, max_stages=4, num_microbatches=(8,),
                            solver_budget=1.0, seed=0)
    t0 = time.perf_counter()
    res = solve_grouped(costs, devices, options)
    wall = time.perf_counter() - t0
    ev = _eval(costs, devices, options, res)
    print(f"64 GPUs: wall {wall:.2f} s, status {res.status}, step {res.objective:.4f} s, "
          f"gap {res.optimality_gap:.3%}, S={res.num_stages}, M={res.decision.num_microbatches}, "
          f"GPUs used {sum(map(len, res.decision.stage_gpus))}")
    assert ev.feasible and ev.objective_units == round(res.objective * UNITS_PER_S)
    # Planner wall time is measured in bench/planner_scaling.py, not asserted here.


@pytest.mark.parametrize("seed", range(3))
def test_node_aggregation_is_restriction(seed):
    """3 identical nodes x 2 GPUs + 1 other node: aggregated (whole nodes) >= classes >= per-GPU
    optimum; solve_grouped asserts evaluate() == objective on every answer."""
    rng = random.Random(200 + seed)
    types = ["A"] * 6 + ["B"] * 2
    nodes = ["n0", "n0", "n1", "n1", "n2", "n2", "n3", "n3"]
    devices = make_devices(types, nodes, [16 * GIB] * 6 + [8 * GIB] * 2, [1e12] * 6 + [3e11] * 2)
    costs = random_costs(rng, rng.randint(2, 5), "AB", fixed=seed % 2 == 0)
    options = solver_options(global_batch_size=rng.choice([4, 8, 12]), max_stages=3, num_microbatches=(1, 2),
                            seed=seed)
    agg = solve_grouped(costs, devices, options, aggregate_nodes=True)
    assert {c["num_groups"] for c in candidate_dicts(agg)} == {2}
    cls = solve_grouped(costs, devices, options, aggregate_nodes=False)
    assert {c["num_groups"] for c in candidate_dicts(cls)} == {4}
    assert agg.status == cls.status == "OPTIMAL"
    for res in (agg, cls):
        ev = _eval(costs, devices, options, res)
        assert ev.feasible and ev.objective_units == round(res.objective * UNITS_PER_S)
    assert round(agg.objective * UNITS_PER_S) >= round(cls.objective * UNITS_PER_S)
    # stages take whole nodes when aggregated.
    for gs in agg.decision.stage_gpus:
        a_nodes = {nodes[g] for g in gs}
        assert sum(1 for g in range(8) if nodes[g] in a_nodes) == len(gs)


def test_identical_nodes_are_aggregated_at_scale():
    """32 nodes x 8 GPUs (4 types): identical nodes become 4 groups; the answer is exact.
    (1024 GPUs and the wall times: bench/planner_scaling.py.)"""
    costs, devices = _big_instance(32, 8, 24)
    options = solver_options(global_batch_size=256, max_stages=3, num_microbatches=(8,),
                            solver_budget=1.0, seed=0)
    res = solve_grouped(costs, devices, options)
    assert {c["num_groups"] for c in candidate_dicts(res)} == {4}
    ev = _eval(costs, devices, options, res)
    assert ev.feasible and ev.objective_units == round(res.objective * UNITS_PER_S)


@pytest.mark.parametrize("seed", range(8))
def test_singleton_classes_match_cpsat_with_memory_policy(seed):
    """Per-stage ZeRO-1 sharding and recomputation: the grouped model equals the
    per-GPU one when every class has one GPU, and evaluate() agrees with both."""
    import dataclasses

    from zorse_fx.solve.objective import evaluate_result

    costs, devices, options = random_instance(seed, singleton_classes=True)
    options = dataclasses.replace(options, sharding=("auto", "always")[seed % 2],
                                  recompute=("auto", "always", "never", "auto")[seed % 4])
    ref = reference_or_same_error(solve_cpsat, solve_grouped, costs, devices, options)
    if ref is None:
        return
    res = solve_grouped(costs, devices, options)
    assert ref.status == "OPTIMAL" and res.status == "OPTIMAL"
    ev = evaluate_result(costs, devices, options, res)
    assert ev.feasible, ev.violations
    assert ev.objective_units == round(res.objective * UNITS_PER_S) == round(ref.objective * UNITS_PER_S)


def test_grouped_shards_across_a_class():
    """Two nodes of 4 identical 16 GiB GPUs: the state of 3e9 params (44.7 GiB) only fits
    sharded; the class-level shard zc is per GPU and the shards cover the state."""
    import dataclasses

    from zorse_fx.solve.objective import evaluate_result

    devices = make_devices(["A"] * 8, ["n0"] * 4 + ["n1"] * 4, [16 * GIB] * 8, [1e12] * 8)
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (0.01,) * 4}, param_count=(750_000_000,) * 4,
                       act_bytes_per_sample=(32 << 20,) * 4, cut_bytes_per_sample=(0, 4 << 20, 4 << 20, 4 << 20, 0))
    opts = solver_options(global_batch_size=8, max_stages=2, num_microbatches=(1, 2))
    with pytest.raises(InfeasiblePlanError, match="sharding='auto'"):
        solve_grouped(costs, devices, opts)
    res = solve_grouped(costs, devices, dataclasses.replace(opts, sharding="auto"))
    assert all(m.zero == 1 for m in res.decision.memory)
    for s, ((i, j), row) in enumerate(zip(res.decision.stage_blocks, res.decision.shard_bytes())):
        assert sum(row) >= 8 * sum(costs.param_count[i:j])
    assert evaluate_result(costs, devices, dataclasses.replace(opts, sharding="auto"), res).feasible


@pytest.mark.parametrize("grouped", [False, True])
def test_hint_encodes_the_hinted_decision(grouped):
    """[Note: warm start]: with CP-SAT told to fix every hinted variable, the model's
    answer is the hinted plan itself (sharded, with its shards), scored as evaluate() does."""
    from ortools.sat.python import cp_model

    from zorse_fx.baselines import BASELINES
    from zorse_fx.solve.grouped import _groups
    from zorse_fx.solve.model import CandidateModel, singleton_groups
    from zorse_fx.solve.objective import evaluate_result

    devices = make_devices(["A"] * 4 + ["B"] * 4, ["n0"] * 4 + ["n1"] * 4, [16 * GIB] * 8, [1e12] * 4 + [3e11] * 4)
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (0.01,) * 4, "B": (0.03,) * 4}, param_count=(400_000_000,) * 4,
                       act_bytes_per_sample=(32 << 20,) * 4, cut_bytes_per_sample=(0, 4 << 20, 4 << 20, 4 << 20, 0))
    opts = solver_options(global_batch_size=16, max_stages=2, num_microbatches=(2,), sharding="always",
                         recompute="auto")
    base = BASELINES["homogeneous_all"](costs, devices, opts)
    ev = evaluate_result(costs, devices, opts, base)
    assert ev.feasible and any(m.zero for m in base.decision.memory)
    tab = build_tables(costs, devices, opts, base.decision.num_microbatches)
    groups = _groups(devices, tab, False) if grouped else singleton_groups(devices.num_gpus)
    model = CandidateModel(tab, devices, opts, groups, base.num_stages)
    model.hint(base.decision)
    solver = cp_model.CpSolver()
    solver.parameters.fix_variables_to_their_hinted_value = True
    solver.parameters.num_workers = 1
    assert solver.solve(model.m) in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    dec = model.decision(solver)
    assert (dec.stage_blocks, dec.stage_gpus, dec.samples_per_microbatch) == (
        base.decision.stage_blocks, base.decision.stage_gpus, base.decision.samples_per_microbatch)
    assert dec.memory == base.decision.memory
    assert solver.value(model.objective) == ev.objective_units


@pytest.mark.parametrize("seed", range(4))
def test_one_model_builder(seed):
    """[Note: one model builder]: with one GPU per class, the class-level model
    (solve_grouped) is the per-GPU model (solve_cpsat) itself -- the same groups
    give the same CP-SAT model, constraint for constraint -- and a group with one
    unit has one samples-through-block variable per block (the per-GPU encoding,
    not one per stage and block)."""
    import dataclasses

    from zorse_fx.solve.grouped import _groups
    from zorse_fx.solve.model import CandidateModel, singleton_groups

    costs, devices, options = random_instance(seed, singleton_classes=True)
    options = dataclasses.replace(options, sharding=("never", "auto")[seed % 2], recompute=("never", "auto")[seed // 2])
    tab = build_tables(costs, devices, options, 1)
    assert _groups(devices, tab, False) == singleton_groups(devices.num_gpus)
    for n_s in (1, 2, 3):
        per_gpu = str(CandidateModel(tab, devices, options, singleton_groups(devices.num_gpus), n_s).m.proto)
        grouped = str(CandidateModel(tab, devices, options, _groups(devices, tab, False), n_s).m.proto)
        assert per_gpu == grouped
        proto = CandidateModel(tab, devices, options, singleton_groups(devices.num_gpus), n_s).m.proto
        z = [v for v in proto.variables if v.name.startswith("z_")]
        assert len(z) == devices.num_gpus * costs.num_blocks


def test_multi_unit_groups_get_the_per_stage_encoding():
    """A class of 4 GPUs may span stages: its samples-through-block variables are per
    (stage, block); the model's objective at the hinted homogeneous plan is evaluate()'s."""
    from zorse_fx.solve.grouped import _groups
    from zorse_fx.solve.model import CandidateModel

    devices = make_devices(["A"] * 4 + ["B"] * 4, ["n0"] * 4 + ["n1"] * 4, [16 * GIB] * 8, [1e12] * 4 + [3e11] * 4)
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (0.01,) * 3, "B": (0.03,) * 3}, param_count=(1000,) * 3,
                       act_bytes_per_sample=(1 << 20,) * 3, cut_bytes_per_sample=(0, 1 << 20, 1 << 20, 0))
    opts = solver_options(global_batch_size=8, max_stages=2, num_microbatches=(1,))
    tab = build_tables(costs, devices, opts, 1)
    groups = _groups(devices, tab, False)
    assert [g.count for g in groups] == [4, 4]
    proto = CandidateModel(tab, devices, opts, groups, 2).m.proto
    assert sum(v.name.startswith("z_") for v in proto.variables) == 2 * 2 * 3  # groups x stages x blocks
    assert not any(v.name.startswith("through_") for v in proto.variables)  # no per-block sum: the old class model


def test_mixed_groups():
    """Three interchangeable A GPUs and one B: the A class (count 3) gets the per-(stage,
    block) encoding, the B GPU the per-block one, and the per-block sample sum counts
    the class through y; solve_grouped's answer is exact (evaluate() agrees) and no
    better than the per-GPU optimum."""
    from zorse_fx.solve.grouped import _groups
    from zorse_fx.solve.model import CandidateModel

    devices = make_devices(["A", "A", "A", "B"], ["n0"] * 4, [16 * GIB] * 4, [1e12] * 3 + [3e11])
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (0.01, 0.02, 0.01), "B": (0.02, 0.05, 0.02)},
                       param_count=(1000,) * 3, act_bytes_per_sample=(1 << 20,) * 3,
                       cut_bytes_per_sample=(0, 1 << 20, 1 << 20, 0))
    opts = solver_options(global_batch_size=8, max_stages=2, num_microbatches=(1, 2))
    tab = build_tables(costs, devices, opts, 1)
    groups = _groups(devices, tab, False)
    assert [(g.unit, g.count) for g in groups] == [(1, 3), (1, 1)]
    names = [v.name for v in CandidateModel(tab, devices, opts, groups, 2).m.proto.variables]
    assert sum(x.startswith("z_") for x in names) == 2 * 3 + 3 and sum(x.startswith("through_") for x in names) == 3
    res, ref = solve_grouped(costs, devices, opts), solve_cpsat(costs, devices, opts)
    assert res.status == ref.status == "OPTIMAL"
    ev = _eval(costs, devices, opts, res)
    assert ev.feasible and ev.objective_units == round(res.objective * UNITS_PER_S)
    assert res.objective >= ref.objective - 1e-12
