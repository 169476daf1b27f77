"""Tests of the baseline planners (zorse_fx.baselines): well-formed decisions
scored by the shared model, hand-checked plans, and CP-SAT never worse."""

from __future__ import annotations

import random

import pytest

from zorse_fx.baselines import BASELINES, cephalo, flashflex, homogeneous_all, homogeneous_best, metis, zorse_paper
from zorse_fx.baselines._common import gpu_speeds, largest_remainder, min_max_partition, proportional_cuts
from zorse_fx.baselines.flashflex import spectral_stages
from zorse_fx.baselines.homogeneous import uniform_blocks
from zorse_fx.baselines.metis import MAX_CANDIDATES, stage_groupings
from zorse_fx.baselines.zorse_paper import min_k_cut_groups
from zorse_fx.errors import InfeasiblePlanError
from zorse_fx.solve import BlockCosts, DeviceGraph, SolverOptions, evaluate, solve_cpsat
from zorse_fx.solve.objective import UNITS_PER_S

GIB = 1 << 30
INTRA, INTER = (100e9, 5e-6), (10e9, 2e-5)  # (bytes/s, s): NVLink-like in a node, slower across


def _devices(types, nodes, memory, mem_bw):
    g = len(types)
    link = [[INTRA if nodes[a] == nodes[b] else INTER for b in range(g)] for a in range(g)]
    return DeviceGraph(
        gpu_types=tuple(types), memory_bytes=tuple(memory), mem_bw_bytes_per_s=tuple(mem_bw),
        link_bw_bytes_per_s=tuple(tuple(0.0 if a == b else link[a][b][0] for b in range(g)) for a in range(g)),
        link_latency_s=tuple(tuple(0.0 if a == b else link[a][b][1] for b in range(g)) for a in range(g)),
        node_names=tuple(nodes))


def _hand():
    """4 GPUs: A, A on n0 and B, B on n1; 8 equal blocks, A 1 ms/sample/block, B 3x slower."""
    nb = 8
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (1e-3,) * nb, "B": (3e-3,) * nb},
                       param_count=(1_000_000,) * nb, act_bytes_per_sample=(1_000_000,) * nb,
                       cut_bytes_per_sample=(0, *(1_000_000,) * (nb - 1), 0))
    devices = _devices("AABB", ["n0", "n0", "n1", "n1"], [16 * GIB] * 4, [1e12, 1e12, 5e11, 5e11])
    return costs, devices


def _eight(seed=0):
    """8 GPUs in 2 nodes (4 fast A with 40 GiB, 4 slow B with 16 GiB), 16 uneven blocks."""
    rng = random.Random(seed)
    nb = 16
    base = [rng.uniform(1e-3, 4e-3) for _ in range(nb)]
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": tuple(base), "B": tuple(2.5 * t for t in base)},
                       param_count=tuple(rng.randint(10, 80) * 1_000_000 for _ in range(nb)),
                       act_bytes_per_sample=tuple(rng.randint(10, 100) * 1_000_000 for _ in range(nb)),
                       cut_bytes_per_sample=(0, *(8_000_000,) * (nb - 1), 0))
    types = "AAAABBBB" if seed % 2 == 0 else "ABABABAB"
    devices = _devices(types, ["n0"] * 4 + ["n1"] * 4, [40 * GIB if t == "A" else 16 * GIB for t in types],
                       [1.5e12 if t == "A" else 3e11 for t in types])
    return costs, devices


def _eval(costs, devices, options, res):
    return evaluate(costs, devices, options, stage_blocks=res.stage_blocks, stage_gpus=res.stage_gpus,
                    samples_per_microbatch=res.samples_per_microbatch, num_microbatches=res.num_microbatches)


def _units(seconds):
    return round(seconds * UNITS_PER_S)


INSTANCES = [
    (_hand, SolverOptions(global_batch_size=8, max_stages=2)),
    (lambda: _eight(0), SolverOptions(global_batch_size=16, max_stages=4, schedule="gpipe")),
    (lambda: _eight(1), SolverOptions(global_batch_size=32, max_stages=3, num_microbatches=(2, 4, 8))),
]


@pytest.mark.parametrize("name", list(BASELINES))
@pytest.mark.parametrize("case", range(len(INSTANCES)))
def test_well_formed(name, case):
    make, options = INSTANCES[case]
    costs, devices = make()
    res = BASELINES[name](costs, devices, options)
    ev = _eval(costs, devices, options, res)  # raises ValueError if malformed
    edges = [i for i, _ in res.stage_blocks] + [res.stage_blocks[-1][1]]
    assert edges[0] == 0 and edges[-1] == costs.num_blocks and edges == sorted(set(edges))
    assert all(sum(ns) == res.microbatch_size for ns in res.samples_per_microbatch)
    assert res.microbatch_size * res.num_microbatches == options.global_batch_size
    assert res.status == ("BASELINE" if ev.feasible else "BASELINE_INFEASIBLE")
    assert _units(res.objective) == ev.objective_units and res.predicted_step_time_s == ev.step_time_s
    assert res.predicted_memory_bytes == ev.memory_bytes and res.predicted_allreduce_s == ev.allreduce_s
    assert res.optimality_gap == 1.0 and res.best_bound == 0.0  # a baseline proves no bound
    chosen = [c for c in res.candidates if c["chosen"]]
    assert len(chosen) == 1 and chosen[0]["violations"] == list(ev.violations)
    assert (chosen[0]["num_stages"], chosen[0]["num_microbatches"]) == (res.num_stages, res.num_microbatches)
    # the chosen candidate is the best feasible one (or the fastest if none is feasible).
    pool = [c for c in res.candidates if c["feasible"]] or list(res.candidates)
    assert _units(res.objective) == min(_units(c["step_time_s"]) for c in pool)


def test_homogeneous_all_by_hand():
    costs, devices = _hand()
    options = SolverOptions(global_batch_size=8, max_stages=2, num_microbatches=(2,))  # b = 4
    res = homogeneous_all(costs, devices, options)
    steps = {c["num_stages"]: _units(c["step_time_s"]) for c in res.candidates}
    # p = 2, d = 2: stages ((0, 4), (4, 8)) on GPUs (0, 1) | (2, 3), 2 samples each.
    t0 = 2 * 4e-3 + 2 * (4 * 1e6 / 10e9 + 2e-5)  # A: 2 x 4 ms + boundary across nodes (4 MB, b = 4)
    t1 = 2 * 4 * 3e-3
    sync = max(2 * 4 * 4e6 / 100e9 + 2 * 5e-6 + 2 * 16 * 4e6 / 1e12,
               2 * 4 * 4e6 / 100e9 + 2 * 5e-6 + 2 * 16 * 4e6 / 5e11)
    assert steps[2] == _units(t0 + t1 + 1 * max(t0, t1) + sync) == 57_426_000
    # p = 1, d = 4: one stage of all 8 blocks, 1 sample per GPU; all-reduce over the 10 GB/s link.
    one = 24e-3 + 24e-3 + (2 * 4 * 8e6 / 10e9 + 2 * 3 * 2e-5) + 2 * 16 * 8e6 / 5e11
    assert steps[1] == _units(one) == 55_032_000
    assert res.stage_blocks == ((0, 8),) and res.stage_gpus == ((0, 1, 2, 3),)
    assert res.samples_per_microbatch == ((1, 1, 1, 1),) and res.status == "BASELINE"
    (two,) = [c for c in res.candidates if c["num_stages"] == 2]
    assert two["feasible"] and not two["chosen"]
    # the uniform split: the first B mod p stages get one block more.
    assert uniform_blocks(8, 3) == ((0, 3), (3, 6), (6, 8)) and uniform_blocks(8, 2) == ((0, 4), (4, 8))


def test_homogeneous_equal_shares_and_skip_indivisible():
    costs, devices = _eight(0)
    options = SolverOptions(global_batch_size=24, max_stages=4, num_microbatches=(1, 2, 3, 4))
    res = homogeneous_all(costs, devices, options)
    d = 8 // res.num_stages
    assert all(len(gs) == d and len(set(ns)) == 1 for gs, ns in zip(res.stage_gpus, res.samples_per_microbatch))
    assert len({j - i for i, j in res.stage_blocks}) == 1  # 16 blocks split evenly
    assert res.stage_gpus == tuple(tuple(range(s * d, (s + 1) * d)) for s in range(res.num_stages))
    # M = 3 gives b = 8 (p = 1, 2, 4 all fit); b = 24 / 4 = 6 is not divisible by d = 4 or 8.
    tried = {(c["num_stages"], c["num_microbatches"]) for c in res.candidates}
    assert (1, 4) not in tried and (2, 4) not in tried and (4, 4) in tried and (1, 3) in tried
    with pytest.raises(InfeasiblePlanError, match="homogeneous_all: no candidate"):
        homogeneous_all(costs, devices, SolverOptions(global_batch_size=1, max_stages=4))


def test_homogeneous_best_by_hand():
    costs, devices = _hand()
    options = SolverOptions(global_batch_size=8, max_stages=2, num_microbatches=(2,))
    res = homogeneous_best(costs, devices, options)
    assert {devices.gpu_types[g] for gs in res.stage_gpus for g in gs} == {"A"}
    # p = 1 on GPUs (0, 1), 2 samples each: 16 ms x (1 + 1) + ring all-reduce in n0 + A's optimizer.
    assert res.stage_gpus == ((0, 1),) and res.samples_per_microbatch == ((2, 2),)
    expected = 2 * 16e-3 + (2 * 4 * 8e6 / 100e9 + 2 * 5e-6) + 2 * 16 * 8e6 / 1e12
    assert _units(res.objective) == _units(expected) == 32_906_000
    # with idling forbidden the decision is kept but reported infeasible.
    strict = homogeneous_best(costs, devices, SolverOptions(global_batch_size=8, max_stages=2,
                                                            num_microbatches=(2,), allow_idle_gpus=False))
    assert strict.status == "BASELINE_INFEASIBLE"
    assert any("idle" in v for c in strict.candidates if c["chosen"] for v in c["violations"])


def test_cephalo_by_hand():
    costs, devices = _hand()
    res = cephalo(costs, devices, SolverOptions(global_batch_size=8, num_microbatches=(1,)))
    # b = 8: A takes 8 ms per sample, B 24 ms; min-max shares (3, 3, 1, 1) -> 24 ms on every GPU.
    assert res.num_stages == 1 and res.stage_gpus == ((0, 1, 2, 3),)
    assert res.samples_per_microbatch == ((3, 3, 1, 1),)
    expected = 24e-3 + (2 * 4 * 8e6 / 10e9 + 2 * 3 * 2e-5) + 2 * 16 * 8e6 / 5e11
    assert _units(res.objective) == _units(expected) == 31_032_000
    # larger instance: one stage, faster GPUs never get fewer samples than slower ones.
    costs, devices = _eight(1)
    res = cephalo(costs, devices, SolverOptions(global_batch_size=32, num_microbatches=(1, 2)))
    (gs,), (ns,) = res.stage_gpus, res.samples_per_microbatch
    fast = [n for g, n in zip(gs, ns) if devices.gpu_types[g] == "A"]
    slow = [n for g, n in zip(gs, ns) if devices.gpu_types[g] == "B"]
    assert res.num_stages == 1 and len(gs) == 8 and min(fast) > max(slow)
    with pytest.raises(InfeasiblePlanError, match="below the 8 GPUs"):
        cephalo(costs, devices, SolverOptions(global_batch_size=4))


def test_cephalo_reports_replicated_state_infeasible():
    costs, devices = _hand()
    big = BlockCosts(fwd_bwd_s_per_sample=costs.fwd_bwd_s_per_sample, param_count=(200_000_000,) * 8,
                     act_bytes_per_sample=costs.act_bytes_per_sample,
                     cut_bytes_per_sample=costs.cut_bytes_per_sample)  # 25.6 GB of state > 14.4 GiB
    res = cephalo(big, devices, SolverOptions(global_batch_size=8))
    assert res.status == "BASELINE_INFEASIBLE" and not _eval(big, devices, SolverOptions(global_batch_size=8),
                                                             res).feasible
    (chosen,) = [c for c in res.candidates if c["chosen"]]
    assert not chosen["feasible"] and len(chosen["violations"]) == 4  # every GPU over its memory


def test_zorse_paper_groups_follow_min_cut():
    costs, devices = _eight(0)
    assert min_k_cut_groups(devices, 1) == (tuple(range(8)),)
    assert min_k_cut_groups(devices, 2) == ((0, 1, 2, 3), (4, 5, 6, 7))
    nodes = devices.node_names
    for k in range(2, 9):
        groups = min_k_cut_groups(devices, k)
        assert sorted(g for gs in groups for g in gs) == list(range(8))
        assert all(len({nodes[g] for g in gs}) == 1 for gs in groups)  # no group spans the slow link
    # interleaved node membership: the cut still follows the nodes, not the indices.
    inter = _devices("ABAB", ["n0", "n1", "n0", "n1"], [16 * GIB] * 4, [1e12] * 4)
    assert min_k_cut_groups(inter, 2) == ((0, 2), (1, 3))
    # hand instance, k = 2: fast node first, blocks 6 : 2 (aggregate speeds 2/8 ms : 2/24 ms per
    # sample), 2 samples per GPU; beats k = 1 (55.032 ms, the all-reduce crosses the slow link).
    costs, devices = _hand()
    res = zorse_paper(costs, devices, SolverOptions(global_batch_size=8, max_stages=2, num_microbatches=(2,)))
    assert res.stage_gpus == ((0, 1), (2, 3)) and res.stage_blocks == ((0, 6), (6, 8))
    assert res.samples_per_microbatch == ((2, 2), (2, 2))
    t0 = 2 * 6e-3 + 2 * (4 * 1e6 / 10e9 + 2e-5)
    t1 = 2 * 2 * 3e-3
    sync = max(2 * 4 * 6e6 / 100e9 + 2 * 5e-6 + 2 * 16 * 6e6 / 1e12, 2 * 4 * 2e6 / 100e9 + 2 * 5e-6
               + 2 * 16 * 2e6 / 5e11)
    assert _units(res.objective) == _units(t0 + t1 + max(t0, t1) + sync) == 38_362_000


def test_metis_enumeration_is_bounded_and_shares_follow_speed():
    costs, devices = _eight(1)
    groupings = stage_groupings(costs, devices, 4)
    assert 0 < len(groupings) <= MAX_CANDIDATES and len(set(groupings)) == len(groupings)
    assert ((0, 2, 4, 6), (1, 3, 5, 7)) in groupings and ((0, 1, 2, 3), (4, 5, 6, 7)) in groupings
    res = metis(costs, devices, SolverOptions(global_batch_size=32, max_stages=3, num_microbatches=(2, 4)))
    for gs, ns in zip(res.stage_gpus, res.samples_per_microbatch):
        fast = [n for g, n in zip(gs, ns) if devices.gpu_types[g] == "A"]
        slow = [n for g, n in zip(gs, ns) if devices.gpu_types[g] == "B"]
        assert not fast or not slow or min(fast) >= max(slow)
    # 16 GPUs in 4 nodes: the level fallback keeps the enumeration <= 200.
    big = _devices("AAAABBBBAAAABBBB", [f"n{g // 4}" for g in range(16)], [40 * GIB] * 16, [1e12] * 16)
    assert len(stage_groupings(costs, big, 4)) <= MAX_CANDIDATES


def test_flashflex_stages_and_memory_proportional_layers():
    costs, devices = _eight(0)
    speed = gpu_speeds(costs, devices)
    stages = spectral_stages(devices, speed, 2)
    assert sorted(g for gs in stages for g in gs) == list(range(8))
    res = flashflex(costs, devices, SolverOptions(global_batch_size=16, max_stages=4))
    assert len({g for gs in res.stage_gpus for g in gs}) == 8
    # two equal-memory stages split the blocks at half the memory: equal blocks -> 4 + 4.
    assert proportional_cuts([5] * 8, [16, 16]) == ((0, 4), (4, 8))
    assert proportional_cuts([5] * 8, [40, 16, 16, 8]) == ((0, 4), (4, 6), (6, 7), (7, 8))


def test_helpers():
    assert largest_remainder(4, [3, 1]) == (3, 1)
    assert largest_remainder(8, [1, 1, 1 / 3, 1 / 3]) == (3, 3, 1, 1)
    assert largest_remainder(4, [100, 1, 1]) == (2, 1, 1)  # minimum 1 each
    assert largest_remainder(5, [1, 1]) == (3, 2)  # tie: lower index
    with pytest.raises(ValueError):
        largest_remainder(1, [1, 1])
    parts = min_max_partition(6, 3, lambda s, i, j: j - i)
    assert parts == ((0, 2), (2, 4), (4, 6))
    assert min_max_partition(4, 2, lambda s, i, j: j - i, fits=lambda s, i, j: j - i <= 1) is None


SEEDS = 12


def _random(seed):
    rng = random.Random(1000 + seed)
    nb = 8
    slow = rng.choice([1.5, 2.0, 3.0])
    base = [rng.uniform(2e-3, 10e-3) for _ in range(nb)]
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": tuple(base), "B": tuple(t * slow for t in base)},
                       param_count=tuple(rng.randint(20, 200) * 1_000_000 for _ in range(nb)),
                       act_bytes_per_sample=tuple(rng.randint(20, 400) * 1_000_000 for _ in range(nb)),
                       cut_bytes_per_sample=(0, *(rng.randint(1, 100) * 1_000_000 for _ in range(nb - 1)), 0),
                       # a third of the seeds pay a fixed time per micro-batch (kernel launches)
                       fwd_bwd_s_fixed=({"A": tuple(rng.uniform(0, 2e-3) for _ in range(nb)),
                                         "B": tuple(rng.uniform(0, 3e-3) for _ in range(nb))}
                                        if seed % 3 == 2 else {}))
    types = "AABB" if seed % 2 else "ABAB"
    memory = [rng.choice([16, 24, 40]) * GIB if t == "A" else rng.choice([8, 12, 16]) * GIB for t in types]
    devices = _devices(types, ["n0", "n0", "n1", "n1"], memory, [1.5e12 if t == "A" else 3e11 for t in types])
    options = SolverOptions(global_batch_size=8, max_stages=rng.choice([2, 3]), num_microbatches=(1, 2, 4),
                            schedule=rng.choice(["1f1b", "gpipe"]), time_limit_s=5.0, num_workers=2, seed=seed)
    return costs, devices, options


@pytest.mark.parametrize("seed", range(SEEDS))
def test_cpsat_never_worse_than_baselines(seed):
    """CP-SAT optimises the same objective over a superset of the baselines'
    decisions, so when it proves optimality no feasible baseline may beat it.
    Baselines reported infeasible (memory, idle GPUs with allow_idle_gpus=False)
    lie outside the solver's space and are not compared."""
    costs, devices, options = _random(seed)
    best = solve_cpsat(costs, devices, options)
    assert best.status == "OPTIMAL", best.candidates
    compared = 0
    for name, fn in BASELINES.items():
        res = fn(costs, devices, options)
        if res.status != "BASELINE":
            continue
        assert res.num_stages <= options.max_stages
        assert _units(best.objective) <= _units(res.objective), (name, res)
        compared += 1
    assert compared >= 3


def test_portfolio_never_worse_than_a_baseline_and_keeps_proven_optima():
    """A CP-SAT run stopped early at a poor incumbent is replaced by a better feasible
    baseline; a proven CP-SAT optimum is returned as is."""
    import dataclasses

    from zorse_fx.solve.portfolio import solve_portfolio

    costs, devices = _eight(seed=3)
    options = SolverOptions(global_batch_size=8, max_stages=3, time_limit_s=10.0)

    def stopped_early(c, d, o):  # a feasible but poor incumbent, not proven optimal
        worst = max((fn(c, d, o) for fn in BASELINES.values()),
                    key=lambda r: (_eval(c, d, o, r).feasible, r.predicted_step_time_s))
        return dataclasses.replace(worst, status="FEASIBLE", best_bound=0.0)

    res = solve_portfolio(costs, devices, options, stopped_early)
    feasible = [r for r in (fn(costs, devices, options) for fn in BASELINES.values())
                if _eval(costs, devices, options, r).feasible]
    assert feasible and res.predicted_step_time_s == min(r.predicted_step_time_s for r in feasible)
    assert res.status.startswith("BASELINE:")
    # A proven optimum of the same objective is returned as is (no baseline can beat it).
    proven = dataclasses.replace(res, status="OPTIMAL")
    assert solve_portfolio(costs, devices, options, lambda c, d, o: proven) is proven
