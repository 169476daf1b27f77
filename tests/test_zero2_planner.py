"""Sharded gradients (ZeRO-2) in the planner: [C-grad-shard] of the objective
(``solve/objective.py``), the stage DP, the brute-force oracle, the
portfolio's try on its winner, the simulator and the plan file ([Note: ZeRO-2
outside CP-SAT] in ``zorse_fx/portfolio.py``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conftest import make_devices, small_gpt, solver_options
from zorse_fx.errors import InfeasiblePlanError
from zorse_fx.ir.buckets import MAX_SHARD_BUCKETS_IN_FLIGHT
from zorse_fx.options import PlanOptions
from zorse_fx.solve import BlockCosts, Decision, StageMemory
from zorse_fx.solve.brute_force import solve_brute_force
from zorse_fx.solve.objective import MEMORY_UNIT_BYTES, build_tables, evaluate, evaluate_result
from zorse_fx.solve.stage_dp import solve_stage_dp
from zorse_fx.solve.state_terms import grad_shard_kib

GIB = 1 << 30
CLUSTERS = Path(__file__).parents[1] / "examples" / "clusters"
P = 850_000_000  # parameters: 16 B each is 12.7 GiB


def _one_stage_two_gpus(**fields):
    """One 4-block fp32 model (16 B/param: weight 4 + gradient 4 replicated,
    moments 8 shardable) of 0.85e9 parameters on two 10 GiB GPUs (9 GiB
    usable). ZeRO-1: 8 + 8/2 = 12 B/param = 9.5 GiB per GPU, too much;
    ZeRO-2: 4 + 12/2 = 10 B/param = 7.9 GiB and its reduction buffers."""
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (0.01,) * 4}, param_count=(P // 4,) * 4,
                       act_bytes_per_sample=(16 << 20,) * 4, cut_bytes_per_sample=(0, 1 << 20, 1 << 20, 1 << 20, 0))
    devices = make_devices(["A", "A"], ["n0", "n0"], [10 * GIB, 10 * GIB], [1e12, 1e12])
    options = solver_options(global_batch_size=4, max_stages=1, num_microbatches=(2,), allow_idle_gpus=False,
                             sharding="auto", **fields)
    return costs, devices, options


def test_zero2_memory_and_time_terms():
    """[C-grad-shard] by hand: the replicated state drops by the gradients less
    the rounding, the shards cover moments and gradients, the reduction
    buffers are 3 buckets; the sync is M reduce-scatters (each half an
    all-reduce ring) and the all-gather; the simulator's peak memory is the
    objective's."""
    from zorse_fx.sim import simulate

    costs, devices, options = _one_stage_two_gpus(grad_sharding="auto")
    one = dict(stage_blocks=((0, 4),), stage_gpus=((0, 1),), samples_per_microbatch=((1, 1),), num_microbatches=2)
    z1 = evaluate(costs, devices, options, Decision(**one, memory=(StageMemory(zero=1),)))
    z2 = evaluate(costs, devices, options, Decision(**one, memory=(StageMemory(zero=2),)))
    assert not z1.feasible and any("needs" in v for v in z1.violations)
    assert z2.feasible, z2.violations
    tab = build_tables(costs, devices, options, 2)
    up, down, transient = grad_shard_kib(tab, 0, 4)
    kib = MEMORY_UNIT_BYTES
    assert up == 4 * -(-4 * (P // 4) // kib)  # per block rounded up
    assert down == up - 4 <= 4 * P // kib  # less one KiB per block: never above the exact bytes
    assert transient == (2 * MAX_SHARD_BUCKETS_IN_FLIGHT + 2) * 25 * 1024  # in flight, their outputs, filling
    shard_mib = z2.decision.shard_mib[0]
    assert sum(shard_mib) * 2**20 >= (8 + 4) * P  # moments + gradients
    replicated = (16 - 8 - 4) * P + transient * kib
    for g, z in enumerate(shard_mib):
        act = 4 * (16 << 20)  # one micro-batch in flight on the last stage (1F1B) x 4 blocks, one sample
        assert z2.memory_bytes[0][g] == pytest.approx(replicated + (z << 20) + act, abs=8 * kib)
    # Sync: 2 reduce-scatters of 4 B/param + the 4 B/param all-gather > one all-reduce (8) + all-gather (4)?
    # Equal bytes for M = 2; both rings on the same link: ZeRO-2's is not cheaper.
    assert z2.allreduce_s[0] >= z1.allreduce_s[0] * 0.999
    sim = simulate(costs, devices, options, z2.decision)
    assert sim.peak_memory_bytes[:2] == tuple(z2.memory_bytes[0])


def test_zero2_makes_the_plan_feasible_and_the_oracle_agrees():
    """ZeRO-1 cannot hold the model; the stage DP, the brute-force oracle and
    the planner's portfolio all answer with ZeRO-2, the same step time."""
    costs, devices, never = _one_stage_two_gpus()
    with pytest.raises(InfeasiblePlanError):
        solve_brute_force(costs, devices, never)
    options = dataclasses.replace(never, grad_sharding="auto")
    oracle = solve_brute_force(costs, devices, options)
    dp = solve_stage_dp(costs, devices, options)
    assert oracle.decision.memory[0].zero == dp.decision.memory[0].zero == 2
    assert dp.predicted_step_time_s == pytest.approx(oracle.predicted_step_time_s, rel=1e-12)
    assert evaluate_result(costs, devices, options, dp).feasible


def test_portfolio_turns_recomputation_into_zero2_where_it_is_faster():
    """GPipe, 2 micro-batches in flight: a 0.6e9-parameter model fits two 10 GiB
    GPUs under ZeRO-1 only with recomputation (+1/3 compute); ZeRO-2 frees
    4 (k-1)/k B/param, enough for both micro-batches' activations.
    ``_try_grad_sharding`` turns the first plan into the second (faster: the
    recomputed forward costs more than ZeRO-2's larger optimizer shard), keeps
    it feasible, marks the status and keeps the bound below the step; with
    ``grad_sharding="never"`` it changes nothing."""
    from zorse_fx.ir.result import SolverResult
    from zorse_fx.portfolio import _try_grad_sharding

    n = 600_000_000
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (0.01,) * 4}, param_count=(n // 4,) * 4,
                       act_bytes_per_sample=(358 << 20,) * 4, cut_bytes_per_sample=(0, 1 << 20, 1 << 20, 1 << 20, 0))
    devices = make_devices(["A", "A"], ["n0", "n0"], [10 * GIB, 10 * GIB], [1e12, 1e12])
    options = solver_options(global_batch_size=4, max_stages=1, num_microbatches=(2,), allow_idle_gpus=False,
                             sharding="auto", recompute="auto", grad_sharding="auto", schedule="gpipe")
    one = dict(stage_blocks=((0, 4),), stage_gpus=((0, 1),), samples_per_microbatch=((1, 1),), num_microbatches=2)
    zero1 = Decision(**one, memory=(StageMemory(zero=1),))
    assert not evaluate(costs, devices, options, zero1).feasible  # ZeRO-1 without recomputation
    rc = evaluate(costs, devices, options, Decision(**one, memory=(StageMemory(zero=1, recompute=True),)))
    assert rc.feasible, rc.violations
    base = SolverResult.from_evaluation(rc, options=options, status="OPTIMAL", best_bound=0.9 * rc.step_time_s)
    out = _try_grad_sharding(costs, devices, options, base)
    assert out.decision.memory == (StageMemory(zero=2),)
    assert out.status == "OPTIMAL+ZERO2"
    ev = evaluate_result(costs, devices, options, out)
    assert ev.feasible and ev.step_time_s == out.predicted_step_time_s < rc.step_time_s
    assert 0 < out.best_bound <= out.predicted_step_time_s
    assert _try_grad_sharding(costs, devices, dataclasses.replace(options, grad_sharding="never"), base) is base
    # The stage DP finds the ZeRO-2 plan by itself.
    assert solve_stage_dp(costs, devices, options).predicted_step_time_s == out.predicted_step_time_s


def test_stage_dp_second_pass_runs_only_where_zero2_can_win():
    """[Note: ZeRO-2 in the stage DP]: pass 2 re-runs the (M, order, S) keys whose
    pass-1 split recomputes within RECOMPUTE_GAIN of the best pass-1 score, plus the
    stage count below the fewest that fit for those (M, order); every key when
    nothing fit in pass 1."""
    from zorse_fx.solve.stage_dp import RECOMPUTE_GAIN, _zero2_pass

    a, b = ("u0", "u1"), ("u1", "u0")
    best = 1000
    found = {
        (8, a): {1: (None, False), 2: (None, False), 3: (best, False), 4: (int(best * RECOMPUTE_GAIN), True)},
        (8, b): {1: (None, False), 2: (1200, True), 3: (int(best * RECOMPUTE_GAIN) + 1, True)},
        (16, a): {1: (None, False), 2: (900 * 10, True)},
    }
    picks = _zero2_pass(found)
    # (8, a) S=4 is at the bar; its fewest fitting S is 3, so S=2 too. (8, b) S=2 is under the bar,
    # S=3 over it; its fewest fitting S is 2, so S=1. (16, a) is far over the bar, and S=3 of (8, a)
    # does not recompute: ZeRO-2 cannot win there.
    assert picks == {(8, a): [4, 2], (8, b): [2, 1]}
    nothing = {(8, a): {1: (None, False), 2: (None, False)}, (16, b): {1: (None, False)}}
    assert _zero2_pass(nothing) == {(8, a): [1, 2], (16, b): [1]}
