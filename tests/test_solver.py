"""Tests of the planners: CP-SAT vs brute force, hand-checked plans, infeasibility."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from zorse_fx.errors import InfeasiblePlanError
from zorse_fx.solve import BlockCosts, Decision, DeviceGraph, StageMemory, evaluate, solve_brute_force, solve_cpsat
from zorse_fx.solve.objective import UNITS_PER_S, evaluate_result

from conftest import assert_candidates_agree, assert_cpsat_equals_brute_force, candidate_dicts, make_devices, random_instance, reference_or_same_error, solver_options

GIB = 1 << 30


def _eval(costs, devices, options, res):
    return evaluate(costs, devices, options, res.decision.without_policy())


SEEDS = range(40)


@pytest.mark.parametrize("seed", SEEDS)
def test_cpsat_matches_brute_force(seed):
    costs, devices, options = random_instance(seed)
    ref = reference_or_same_error(solve_brute_force, solve_cpsat, costs, devices, options)
    if ref is None:
        return
    res = solve_cpsat(costs, devices, options)
    assert res.status == "OPTIMAL"
    ev_ref, ev = _eval(costs, devices, options, ref), _eval(costs, devices, options, res)
    assert ev.feasible and ev_ref.feasible
    assert ev.objective_units == ev_ref.objective_units
    assert round(res.objective * UNITS_PER_S) == ev.objective_units
    assert (res.num_stages, res.decision.num_microbatches) == (ref.num_stages, ref.decision.num_microbatches)
    assert_candidates_agree(res, ref)


def test_random_family_is_diverse():
    """The random family exercises what it should: memory binds (the optimum
    with unlimited memory is faster, or only it is feasible), pipelines,
    heterogeneous data-parallel groups with unequal shares, idle GPUs."""
    def best(costs, devices, options):
        try:
            return solve_brute_force(costs, devices, options)
        except InfeasiblePlanError:
            return None

    binding = pipelines = dp = unequal = 0
    for seed in SEEDS:
        costs, devices, options = random_instance(seed)
        res = best(costs, devices, options)
        roomy = best(costs, dataclasses.replace(devices, memory_bytes=(1 << 45,) * devices.num_gpus), options)
        binding += res is None or res.objective != roomy.objective
        if res is not None:
            pipelines += res.num_stages > 1
            dp += any(len(gs) > 1 for gs in res.decision.stage_gpus)
            unequal += any(len(set(ns)) > 1 for ns in res.decision.samples_per_microbatch)
    assert binding >= 8 and pipelines >= 8 and dp >= 5 and unequal >= 1


def _fast_slow():
    """GPU 0 is 3x faster than GPU 1 (same node); one block of 1e6 parameters."""
    costs = BlockCosts(fwd_bwd_s_per_sample={"fast": (1e-3,), "slow": (3e-3,)}, param_count=(1_000_000,),
                       act_bytes_per_sample=(1_000_000,), cut_bytes_per_sample=(0, 0))
    devices = DeviceGraph(gpu_types=("fast", "slow"), memory_bytes=(16 * GIB, 16 * GIB),
                          mem_bw_bytes_per_s=(1e12, 5e11), link_bw_bytes_per_s=((0, 1e10), (1e10, 0)),
                          link_latency_s=((0, 1e-5), (1e-5, 0)), node_names=("n0", "n0"))
    return costs, devices


def test_hand_checked_unequal_shares():
    costs, devices = _fast_slow()
    options = solver_options(global_batch_size=4, max_stages=2)
    compute = 3 * 1e-3  # fast: 3 samples x 1 ms = slow: 1 sample x 3 ms
    # ring: 2 (k-1)/k x grad bytes / bw + 2 (k-1) latency per gradient bucket; 4 MB of float32
    # gradients = a 1 MiB bucket + the rest (< 25 MiB): nb = 2 ([C-allreduce])
    nb = 2
    allreduce = 2 * (1 / 2) * 4 * 1e6 / 1e10 + nb * 2 * (2 - 1) * 1e-5
    optim = 2 * 16 * 1e6 / 5e11  # the slower memory bandwidth of the two GPUs
    # [C-objective] one block: its gradients are all ready only when the backward ends, so no
    # bucket overlaps it (B6 = 0) and the whole ring follows the compute.
    expected = compute + allreduce + optim  # M = 1, one stage: no pipeline terms
    assert expected < 4 * 1e-3 + 2 * 16 * 1e6 / 1e12  # beats the fast GPU alone (4 ms + its optimizer)
    for solve in (solve_cpsat, solve_brute_force):
        res = solve(costs, devices, options)
        assert res.decision.stage_gpus == ((0, 1),) and res.decision.samples_per_microbatch == ((3, 1),)
        assert res.decision.num_microbatches == 1 and res.decision.stage_blocks == ((0, 1),)
        assert res.predicted_step_time_s == pytest.approx(expected, abs=1e-9)
        assert res.predicted_allreduce_s == pytest.approx((allreduce,), abs=1e-9)
    ev = evaluate(costs, devices, options, Decision(stage_blocks=((0, 1),), stage_gpus=((0, 1),),
                                                    samples_per_microbatch=((3, 1),), num_microbatches=1))
    # 3e6 ns compute + (400_000 + 2 x 20_000) ns all-reduce + 64_000 ns optimizer
    assert ev.objective_units == 3_504_000 and ev.compute_s == pytest.approx((3e-3,))
    assert ev.optim_s == pytest.approx((optim,)) and ev.boundary_s == (0.0,)


def test_two_stages_with_heterogeneous_dp_group():
    """The model does not fit one GPU: the optimum pipelines two stages, and the
    first stage is a data-parallel pair of a fast and a slow GPU (split 3:1)."""
    p = 600_000_000  # 9.6e9 B of state per block: one block per 16 GiB GPU (14.4 GiB usable)
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (4e-3, 2e-3), "B": (12e-3, 6e-3)}, param_count=(p, p),
                       act_bytes_per_sample=(10_000_000, 10_000_000), cut_bytes_per_sample=(0, 1_000_000, 0))
    devices = make_devices(["A", "B", "A"], ["n0"] * 3, [16 * GIB] * 3, [1e12] * 3, intra=(1e12, 1e-6))
    options = solver_options(global_batch_size=16, num_microbatches=(4,), max_stages=3)
    res = solve_cpsat(costs, devices, options)
    ref = solve_brute_force(costs, devices, options)
    assert res.num_stages == 2 and res.decision.stage_blocks == ((0, 1), (1, 2))
    assert res.decision.stage_gpus == ((0, 1), (2,)) and res.decision.samples_per_microbatch == ((3, 1), (4,))
    # by hand, b = 4 samples: stage 0 = max(3 x 4 ms, 1 x 12 ms) + 2 x (3 MB / 1 TB/s + 1 us): one
    # node, so each GPU pair has its own link, and GPU 0 -> GPU 2 carries min(3, 4) = 3 samples,
    # the most of any pair ([Note: boundary rows]; all 4 before)
    t0 = 12e-3 + 2 * (3e6 / 1e12 + 1e-6)
    t1 = 4 * 2e-3
    # The two-GPU stage's ring all-reduce, (k-1)/k = 1/2, 2 (k-1) latencies per gradient bucket:
    # 4 p = 2.4e9 B of float32 gradients = 1 MiB + 91.5 x 25 MiB, nb = 1 + 92 = 93 buckets.
    nb = 1 + math.ceil((4 * p - (1 << 20)) / (25 << 20))
    assert nb == 93
    ar0 = 2 * (1 / 2) * 4 * p / 1e12 + nb * 2 * 1e-6
    opt = 2 * 16 * p / 1e12  # same for both stages
    # [C-objective] stage 0 holds one block, ready only when its backward ends: its ring
    # overlaps none of it (stage 1, one GPU, has no ring and D_1 > its optimizer).
    # [Note: pipeline period]: the steady state's period is stage 0's cycle, its compute and one
    # direction of its boundary (the fused exchange with stage 1), 12 ms + 3 MB / 1 TB/s + 1 us.
    period = 12e-3 + (3e6 / 1e12 + 1e-6)
    assert period > t1 + (3e6 / 1e12 + 1e-6)
    expected = t0 + t1 + 3 * period + ar0 + opt
    assert res.predicted_step_time_s == pytest.approx(expected, abs=1e-8)
    assert round(ref.objective * UNITS_PER_S) == round(res.objective * UNITS_PER_S)


def test_infeasible_memory_best_split():
    p = 600_000_000  # 8.9 GiB of state per block, 4 blocks = 35.8 GiB
    costs = BlockCosts(fwd_bwd_s_per_sample={"T4": (1e-3,) * 4}, param_count=(p,) * 4,
                       act_bytes_per_sample=(0,) * 4, cut_bytes_per_sample=(0,) * 5)
    devices = make_devices(["T4", "T4"], ["n0", "n0"], [16 * GIB] * 2, [3e11] * 2)
    options = solver_options(global_batch_size=4, max_stages=4)
    for solve in (solve_cpsat, solve_brute_force):
        pattern = r"training state needs 35\.8 GiB \(16 B/param × 2\.4e\+09"
        with pytest.raises(InfeasiblePlanError, match=pattern) as e:
            solve(costs, devices, options)
        msg = str(e.value)
        assert ("with at most 2 stages (max_stages=4, 2 GPUs, 4 blocks) the best split still needs "
                "17.9 GiB on stage 0") in msg
        assert "largest GPU (T4) has 14.4 GiB usable (0.9 × 16.0 GiB)" in msg
        assert "raise max_stages" in msg


def test_infeasible_because_of_the_planners_caps_says_which_to_raise():
    """Issue 31: the planner's own caps must not hide a plan silently. Four
    blocks of 8.9 GiB of state on four T4s (14.4 GiB usable; one per node,
    the stage DP's unit) need 4 stages:
    with max_stages=2 the error says max_stages=4 holds a plan (the stage DP
    finds it with the caps widened). One block whose sample keeps 5 GiB of
    activations needs micro-batches of at most 2 samples: with
    max_microbatches=2 at global batch 8 the error names max_microbatches=4."""
    p = 600_000_000
    costs = BlockCosts(fwd_bwd_s_per_sample={"T4": (1e-3,) * 4}, param_count=(p,) * 4,
                       act_bytes_per_sample=(0,) * 4, cut_bytes_per_sample=(0,) * 5)
    devices = make_devices(["T4"] * 4, ["n0", "n1", "n2", "n3"], [16 * GIB] * 4, [3e11] * 4)
    with pytest.raises(InfeasiblePlanError) as e:
        solve_cpsat(costs, devices, solver_options(global_batch_size=4, max_stages=2))
    assert ("; the planner's own cap is why: with max_stages=4 a plan exists (the stage DP finds 4 stages x "
            in str(e.value))
    assert str(e.value).endswith("set max_stages=4 (zorse plan --max-stages 4)")
    one = BlockCosts(fwd_bwd_s_per_sample={"T4": (1e-3,)}, param_count=(1000,), act_bytes_per_sample=(5 * GIB,),
                     cut_bytes_per_sample=(0, 0))
    t4 = make_devices(["T4"], ["n0"], [16 * GIB], [3e11])
    with pytest.raises(InfeasiblePlanError) as e:
        solve_cpsat(one, t4, solver_options(global_batch_size=8, max_microbatches=2))
    assert "with max_microbatches=4 a plan exists (the stage DP finds 1 stages x 4 micro-batches of 2 samples" \
        in str(e.value)
    # An explicit micro-batch list is the user's choice, not a cap.
    with pytest.raises(InfeasiblePlanError) as e:
        solve_cpsat(one, t4, solver_options(global_batch_size=8, num_microbatches=(2,)))
    assert "cap" not in str(e.value)


def test_infeasible_single_block():
    costs = BlockCosts(fwd_bwd_s_per_sample={"T4": (1e-3, 1e-3)}, param_count=(1_000_000_000, 10),
                       act_bytes_per_sample=(0, 0), cut_bytes_per_sample=(0, 0, 0))
    devices = make_devices(["T4"] * 3, ["n0"] * 3, [16 * GIB] * 3, [3e11] * 3)
    with pytest.raises(InfeasiblePlanError, match=r"block 0 alone needs 14\.9 GiB .* 14\.4 GiB usable"):
        solve_cpsat(costs, devices, solver_options(global_batch_size=2))


def test_indivisible_batch():
    costs, devices = _fast_slow()
    options = solver_options(global_batch_size=7, num_microbatches=(2, 4))
    for solve in (solve_cpsat, solve_brute_force):
        with pytest.raises(InfeasiblePlanError, match=r"global_batch_size=7 cannot be divided.*\(2, 4\)"):
            solve(costs, devices, options)


def test_evaluate_memory_violation_and_shape_errors():
    costs, devices = _fast_slow()
    devices = dataclasses.replace(devices, memory_bytes=(16 * GIB, 1 * GIB))
    costs = BlockCosts(fwd_bwd_s_per_sample=costs.fwd_bwd_s_per_sample, param_count=(100_000_000,),
                       act_bytes_per_sample=(1 << 28,), cut_bytes_per_sample=(0, 0))
    options = solver_options(global_batch_size=4)
    ev = evaluate(costs, devices, options, Decision(stage_blocks=((0, 1),), stage_gpus=((0, 1),),
                                                    samples_per_microbatch=((3, 1),), num_microbatches=1))
    # GPU 1: 1.6e9 B state + 0.25 GiB activations = 1.7 GiB > 0.9 GiB usable
    assert not ev.feasible
    assert ev.violations == ("stage 0 GPU 1 (slow) needs 1.7 GiB > 921.6 MiB usable (0.9 × 1.0 GiB)",)
    assert ev.memory_bytes == ((1_600_000_000 + 3 * (1 << 28), 1_600_000_000 + (1 << 28)),)
    kw = dict(stage_gpus=((0, 1),), num_microbatches=1)
    with pytest.raises(ValueError, match=r"sum to 3"):
        evaluate(costs, devices, options, Decision(stage_blocks=((0, 1),), samples_per_microbatch=((2, 1),), **kw))
    with pytest.raises(ValueError, match=r"stage 0 blocks \(0, 0\)"):
        evaluate(costs, devices, options, Decision(stage_blocks=((0, 0),), samples_per_microbatch=((3, 1),), **kw))
    with pytest.raises(ValueError, match=r"GPU 1 is twice in stage 0"):
        evaluate(costs, devices, options, Decision(stage_blocks=((0, 1),), stage_gpus=((1, 1),),
                                                   samples_per_microbatch=((2, 2),), num_microbatches=1))


def test_brute_force_refuses_large_instances():
    costs, devices = _fast_slow()
    with pytest.raises(ValueError, match=r"b <= 6"):
        solve_brute_force(costs, devices, solver_options(global_batch_size=64, num_microbatches=(4,)))


def test_sixteen_gpus_forty_blocks():
    rng = random.Random(7)
    speed = {"A100": 1.0, "V100": 2.2, "T4": 5.0, "L4": 3.0}
    mem = {"A100": 80, "V100": 32, "T4": 16, "L4": 24}
    mbw = {"A100": 2.0e12, "V100": 0.9e12, "T4": 0.32e12, "L4": 0.3e12}
    types = [t for t in speed for _ in range(4)]
    nodes = [f"node{g // 4}" for g in range(16)]
    nb = 40
    base = [rng.uniform(2e-4, 6e-4) for _ in range(nb)]
    costs = BlockCosts(
        fwd_bwd_s_per_sample={t: tuple(x * s for x in base) for t, s in speed.items()},
        param_count=tuple(rng.randint(20, 60) * 1_000_000 for _ in range(nb)),
        act_bytes_per_sample=tuple(rng.randint(20, 60) * 1_000_000 for _ in range(nb)),
        cut_bytes_per_sample=(0, *([8_000_000] * (nb - 1)), 0))
    devices = make_devices(types, nodes, [mem[t] * GIB for t in types], [mbw[t] for t in types])
    options = solver_options(global_batch_size=64, num_microbatches=(8,), max_stages=4, solver_budget=1.0)
    res = solve_cpsat(costs, devices, options)  # wall time: bench/planner_scaling.py
    assert res.status in ("OPTIMAL", "FEASIBLE")
    ev = _eval(costs, devices, options, res)
    assert ev.feasible and res.predicted_step_time_s == ev.step_time_s
    assert all(sum(ns) == 8 for ns in res.decision.samples_per_microbatch)
    assert len(candidate_dicts(res)) == 4


def test_large_memory_coefficients_do_not_break_presolve():
    """Regression: GPT-3 1.5B-class block costs (Metis scenario, traced on meta, fp16)
    on 4 x A100 + 4 x T4. With memory in bytes (coefficients ~4e10) OR-Tools' presolve
    called the 2-stage model INFEASIBLE although the homogeneous A100-only plan fits;
    memory is now counted in KiB. CP-SAT must find a plan at least as fast."""
    import json
    from pathlib import Path

    from zorse_fx.baselines import BASELINES
    from zorse_fx.cluster import Cluster

    raw = json.loads((Path(__file__).parent / "data" / "metis_gpt3_1.5b_costs.json").read_text())
    costs = BlockCosts(**{k: ({t: tuple(v) for t, v in val.items()} if isinstance(val, dict) else
                              tuple(val) if isinstance(val, list) else val) for k, val in raw.items()})
    devices = Cluster.from_yaml(Path(__file__).parents[1] / "examples" / "clusters" / "metis.yaml").device_graph()
    options = solver_options(global_batch_size=128, max_stages=2, num_microbatches=(16,))
    base = BASELINES["homogeneous_best"](costs, devices, options)
    res = solve_cpsat(costs, devices, options)
    assert res.status == "OPTIMAL"
    assert res.predicted_step_time_s <= base.predicted_step_time_s + 1e-9


# -- memory policy: ZeRO-1 sharding and stage recomputation ------------------

MODES = ("never", "auto", "always")


@pytest.mark.parametrize("seed", range(16))
def test_cpsat_matches_brute_force_with_memory_policy(seed):
    """With sharding / recompute decided per stage, CP-SAT's optimum equals the
    oracle's (without ZeRO-2, which the CP-SAT model does not have: [Note:
    ZeRO-2 outside CP-SAT] in zorse_fx/portfolio.py)."""
    costs, devices, options = random_instance(seed)
    options = dataclasses.replace(options, sharding=("auto", "always")[seed % 2],
                                  recompute=("auto", "always", "auto", "never")[seed % 4], grad_sharding="never")
    got = assert_cpsat_equals_brute_force(costs, devices, options)
    if got is None:
        return
    ref, _, ev = got
    assert evaluate_result(costs, devices, options, ref).objective_units == ev.objective_units


def test_throughput_bound_of_a_small_model_is_not_printed_as_zero():
    """Issue 46: "2580% slower than the throughput bound 0.000 s" -- a model whose
    per-micro-batch fixed times (kernel launches) dominate had a bound of 28 us
    against a 0.75 ms plan (per-sample work only), printed with three decimals. The
    bound now also holds one sample's pass through every block with its fixed
    times (``microbatch_chain_bound``), stays below every plan brute force finds,
    and prints with its digits."""
    from zorse_fx.plan import SolverReport, fmt_seconds
    from zorse_fx.solve.bounds import microbatch_chain_bound, throughput_bound_s, throughput_lower_bound
    from zorse_fx.solve.objective import build_tables, microbatch_candidates

    chain_binds = checked = 0
    for seed in range(1, 24, 2):  # odd seeds: a fixed per-micro-batch cost (random_instance)
        costs, devices, options = random_instance(seed)
        options = dataclasses.replace(options, sharding="auto", recompute="auto")
        try:
            opt = solve_brute_force(costs, devices, options)
        except InfeasiblePlanError:
            continue
        bound = throughput_bound_s(costs, devices, options)
        tabs = [build_tables(costs, devices, options, m) for m in microbatch_candidates(options)]
        chain = microbatch_chain_bound(tabs[0])
        assert round(bound * UNITS_PER_S) == max(chain, min(map(throughput_lower_bound, tabs)))
        assert round(bound * UNITS_PER_S) <= round(opt.objective * UNITS_PER_S), (seed, bound, opt.objective)
        chain_binds += chain > min(map(throughput_lower_bound, tabs))
        checked += 1
    assert checked >= 8 and chain_binds >= 1
    assert [fmt_seconds(t) for t in (2.0, 0.0788, 2.79e-5, 0.0)] == ["2.000 s", "78.8 ms", "27.9 µs", "0 s"]
    report = SolverReport(planner="cpsat", status="OPTIMAL", objective_s=7.5e-4, best_bound_s=7.5e-4,
                          optimality_gap=0.0, wall_s=1.0, throughput_bound_s=2.79e-5)
    assert "2588% slower than the throughput bound 27.9 µs (" in report.verdict(7.5e-4)


def _two_gpu_state_bound():
    """One 4-block model on two GPUs (24 and 10 GiB): 16 B/param of 1.0e9 params =
    14.9 GiB of state does not fit the 10 GiB GPU replicated."""
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (0.01,) * 4}, param_count=(250_000_000,) * 4,
                       act_bytes_per_sample=(64 << 20,) * 4, cut_bytes_per_sample=(0, 8 << 20, 8 << 20, 8 << 20, 0))
    devices = make_devices(["A", "A"], ["n0", "n0"], [24 * GIB, 10 * GIB], [1e12, 1e12])
    return costs, devices


def test_sharding_makes_a_plan_feasible_with_unequal_shards():
    costs, devices = _two_gpu_state_bound()
    base = solver_options(global_batch_size=4, max_stages=1, num_microbatches=(1,), allow_idle_gpus=False)
    with pytest.raises(InfeasiblePlanError, match="sharding"):
        solve_cpsat(costs, devices, base)
    res = solve_cpsat(costs, devices, dataclasses.replace(base, sharding="auto"))
    assert res.decision.memory == (StageMemory(zero=1),)
    big, small = res.decision.shard_bytes()[0]
    # 8 B/param of moments = 7.45 GiB sharded; the 10 GiB GPU (9 GiB usable) keeps 7.45 GiB
    # of weights + grads replicated and 0.5 GiB of activations, so it can hold < 1.1 GiB of
    # moments: the split is unequal (equal memory bandwidth would otherwise balance it 1:1).
    assert big + small >= 8 * sum(costs.param_count)
    assert 0 < small < 1.1 * GIB and big > 5 * small
    ev = evaluate_result(costs, devices, dataclasses.replace(base, sharding="auto"), res)
    assert ev.feasible
    # [C-memory] by hand for the big GPU: replicated 8 B/param + its shard + activations of 4 samples.
    kib = 1024
    repl = sum(-(-16 * p // kib) - (-(-8 * p // kib)) for p in costs.param_count) * kib
    act = sum(-(-a // kib) for a in costs.act_bytes_per_sample) * kib
    assert ev.memory_bytes[0][0] == repl + big + res.decision.samples_per_microbatch[0][0] * act
    # [C-allreduce]: a sharded stage moves (2 * 4 + 4) B/param over its link, of which a
    # ring of k = 2 sends (k-1)/k = 1/2 per hop, plus 2 (k-1) latencies per gradient bucket
    # (4e9 B of float32 gradients = 1 MiB + 152.5 x 25 MiB: 154 buckets) and 1 for the all-gather.
    p_tot = sum(costs.param_count)
    nb = 1 + math.ceil((4 * p_tot - (1 << 20)) / (25 << 20))
    assert nb == 154
    assert ev.allreduce_s[0] == pytest.approx(12 * p_tot / 100e9 / 2 + (2 * nb + 1) * 5e-6, rel=1e-6)
    # sharding "never" reports the memory breach instead.
    bad = evaluate(costs, devices, base, Decision(stage_blocks=((0, 4),), stage_gpus=((0, 1),),
                                                  samples_per_microbatch=((2, 2),), num_microbatches=1))
    assert not bad.feasible and any("GPU 1" in v for v in bad.violations)


def test_evaluate_rejects_malformed_memory_policy():
    costs, devices = _two_gpu_state_bound()
    opts = solver_options(global_batch_size=4, sharding="auto")
    dec = dict(stage_blocks=((0, 2), (2, 4)), stage_gpus=((0,), (1,)), samples_per_microbatch=((4,), (4,)),
               num_microbatches=1)
    with pytest.raises(ValueError, match=r"stage 0 is sharded \(ZeRO-1\) but has 1 GPU"):
        evaluate(costs, devices, opts, Decision(**dec, memory=(StageMemory(zero=1), StageMemory())))
    with pytest.raises(ValueError, match="memory has 1 entries"):
        evaluate(costs, devices, opts, Decision(**dec, memory=(StageMemory(recompute=True),)))
    one = dict(stage_blocks=((0, 4),), stage_gpus=((0, 1),), samples_per_microbatch=((2, 2),), num_microbatches=1)
    with pytest.raises(ValueError, match="one int >= 0 per GPU"):
        evaluate(costs, devices, opts, Decision(**one, memory=(StageMemory(zero=1),), shard_mib=((5,),)))
    ev = evaluate(costs, devices, opts, Decision(**one, memory=(StageMemory(zero=1),), shard_mib=((1, 1),)))
    assert not ev.feasible and any("optimizer state" in v for v in ev.violations)
    never = evaluate(costs, devices, solver_options(global_batch_size=4), Decision(**one, memory=(StageMemory(zero=1),)))
    assert any("sharding='never'" in v for v in never.violations)
    with pytest.raises(ValueError, match="PlanOptions.recompute='sometimes'"):
        solver_options(global_batch_size=4, recompute="sometimes")


def test_recompute_adds_a_third_and_keeps_only_stage_inputs():
    """[C-compute] / [C-memory] of a recomputing stage, checked by hand."""
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (0.03, 0.06)}, param_count=(1000, 1000),
                       act_bytes_per_sample=(400 << 20, 400 << 20), cut_bytes_per_sample=(0, 10 << 20, 0))
    devices = make_devices(["A", "A"], ["n0", "n1"], [80 * GIB] * 2, [1e12] * 2)
    opts = solver_options(global_batch_size=8, recompute="auto", max_stages=2)
    dec = dict(stage_blocks=((0, 1), (1, 2)), stage_gpus=((0,), (1,)), samples_per_microbatch=((2,), (2,)),
               num_microbatches=4)
    plain = evaluate(costs, devices, opts, Decision(**dec))
    rc = evaluate(costs, devices, opts, Decision(**dec, memory=(StageMemory(), StageMemory(recompute=True))))
    assert rc.compute_s[0] == plain.compute_s[0]
    assert rc.compute_s[1] == pytest.approx(plain.compute_s[1] * 4 / 3, rel=1e-6)
    # stage 1 of 2 under 1F1B holds 1 micro-batch in flight: inputs of 1 + activations of 1.
    state = -(-16 * 1000 // 1024) * 1024
    assert rc.memory_bytes[1][0] == state + 2 * ((10 << 20) + (400 << 20))
    assert plain.memory_bytes[0][0] - state == 2 * 2 * (400 << 20)  # 2 in flight on stage 0


def test_balance_shards_minimises_the_slowest_optimizer():
    from zorse_fx.solve.objective import balance_shards

    # 10 MiB over GPUs with rates 1 and 3 (ns/MiB) and room 100 / 100: 7.5 : 2.5 -> (8, 2)? max(8, 6) = 8
    assert balance_shards(10 * 1024, [100, 100], [1, 3]) == (8, 2)
    assert balance_shards(10 * 1024, [3, 100], [1, 3]) == (3, 7)  # memory binds on GPU 0
    assert balance_shards(10 * 1024, [3, 3], [1, 1]) is None
    assert balance_shards(0, [3, 3], [1, 1]) == (0, 0)
    assert balance_shards(1, [3, 3], [1, 1]) in ((1, 0), (0, 1))


def test_throughput_lower_bound_holds_for_every_decision():
    """``throughput_lower_bound`` (the bound a candidate reports when CP-SAT's is
    weaker) is positive and below the brute-force optimum of its M (brute force
    restricted to that M, so below every decision with that M), over 12 seeds."""
    from zorse_fx.solve.bounds import throughput_lower_bound
    from zorse_fx.solve.objective import build_tables, microbatch_candidates

    checked = 0
    for seed in range(12):
        costs, devices, options = random_instance(seed)
        options = dataclasses.replace(options, sharding="auto", recompute="auto")
        for m in microbatch_candidates(options):
            only_m = dataclasses.replace(options, num_microbatches=(m,))
            try:
                opt = solve_brute_force(costs, devices, only_m)
            except InfeasiblePlanError:
                continue
            bound = throughput_lower_bound(build_tables(costs, devices, only_m, m))
            assert 0 < bound <= round(opt.objective * UNITS_PER_S), (seed, m, bound, opt.objective)
            checked += 1
    assert checked >= 15
