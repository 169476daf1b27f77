"""Sharded parameters (ZeRO-3) in the planner: [C-param-shard] of the
objective (``solve/objective.py``), the stage DP, the portfolio's try on its
winner, the simulator and the plan file. Not in the CP-SAT model nor the
brute-force oracle ([Note: ZeRO-2 outside CP-SAT] in ``zorse_fx/portfolio.py``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conftest import make_devices, small_gpt, solver_options
from zorse_fx.errors import InfeasiblePlanError
from zorse_fx.options import PlanOptions
from zorse_fx.solve import BlockCosts, Decision, StageMemory
from zorse_fx.solve.objective import MEMORY_UNIT_BYTES, build_tables, evaluate, evaluate_result
from zorse_fx.solve.stage_dp import solve_stage_dp
from zorse_fx.solve.state_terms import GATHERED_UNITS, block_weight_kib, grad_shard_kib

GIB = 1 << 30
CLUSTERS = Path(__file__).parents[1] / "examples" / "clusters"
P = 800_000_000  # parameters over 16 blocks: 16 B each (fp32) is 11.9 GiB
NB = 16


def _one_stage_two_gpus(memory_gib=8, **fields):
    """One 16-block fp32 model (16 B/param: weight 4 + gradient 4 replicated,
    moments 8 shardable) of 0.8e9 parameters on two GPUs. ZeRO-2: 4 + 12/2 =
    10 B/param = 7.5 GiB per GPU; ZeRO-3: 16/2 = 8 B/param = 6.0 GiB and 3
    blocks' weights (3 x 0.19 GiB)."""
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (0.01,) * NB}, param_count=(P // NB,) * NB,
                       act_bytes_per_sample=(4 << 20,) * NB, cut_bytes_per_sample=(0, *(1 << 20,) * (NB - 1), 0))
    devices = make_devices(["A", "A"], ["n0", "n0"], [memory_gib * GIB] * 2, [1e12, 1e12])
    options = solver_options(global_batch_size=4, max_stages=1, num_microbatches=(2,), allow_idle_gpus=False,
                             sharding="auto", grad_sharding="auto", **fields)
    return costs, devices, options


ONE = dict(stage_blocks=((0, NB),), stage_gpus=((0, 1),), samples_per_microbatch=((1, 1),), num_microbatches=2)
ZERO2, ZERO3 = StageMemory(zero=2), StageMemory(zero=3)


def test_zero3_memory_and_time_terms():
    """[C-param-shard] by hand: the replicated state is the reduction buffers
    and GATHERED_UNITS blocks' weights, the shards cover everything else; each
    micro-batch gathers the weights twice, prefetched; no all-gather after the
    step; the simulator's peak memory is the objective's and its step within
    the two models' different overlap accounting."""
    from zorse_fx.sim import simulate

    costs, devices, options = _one_stage_two_gpus(param_sharding="auto")
    z2 = evaluate(costs, devices, options, Decision(**ONE, memory=(ZERO2,)))
    z3 = evaluate(costs, devices, options, Decision(**ONE, memory=(ZERO3,)))
    assert not z2.feasible and z3.feasible, (z2.violations, z3.violations)
    tab = build_tables(costs, devices, options, 2)
    kib = MEMORY_UNIT_BYTES
    block = block_weight_kib(tab, 0)
    assert block * kib >= 4 * (P // NB) > (block - 2) * kib  # the float32 weights of one block, rounded up
    _, _, transient = grad_shard_kib(tab, 0, NB)
    shard_mib = z3.decision.shard_mib[0]
    assert sum(shard_mib) * 2**20 >= 16 * P - NB * kib  # weights + gradients + moments (less the rounding)
    for g, z in enumerate(shard_mib):
        act = NB * (4 << 20)
        assert z3.memory_bytes[0][g] == pytest.approx((transient + GATHERED_UNITS * block) * kib + (z << 20) + act,
                                                      abs=8 * kib)
    # Time: the gathers lengthen the stage's compute; the sync loses the all-gather.
    assert z3.compute_s[0] > z2.compute_s[0]
    assert z3.allreduce_s[0] < z2.allreduce_s[0]
    sim = simulate(costs, devices, options, z3.decision)
    assert sim.peak_memory_bytes[:2] == tuple(z3.memory_bytes[0])
    assert sim.step_time_s == pytest.approx(z3.step_time_s, rel=0.25)


def test_stage_dp_and_portfolio_choose_zero3_where_nothing_else_fits():
    """ZeRO-2 cannot hold the model on two 8 GiB GPUs: with param_sharding
    "never" no plan, with "auto" the stage DP answers with ZeRO-3 and the
    portfolio's try turns a ZeRO-2 plan into it."""
    from zorse_fx.ir.result import SolverResult
    from zorse_fx.portfolio import _try_grad_sharding

    costs, devices, never = _one_stage_two_gpus(param_sharding="never")
    with pytest.raises(InfeasiblePlanError):
        solve_stage_dp(costs, devices, never)
    options = dataclasses.replace(never, param_sharding="auto")
    dp = solve_stage_dp(costs, devices, options)
    assert dp.decision.memory[0].zero == 3
    ev = evaluate_result(costs, devices, options, dp)
    assert ev.feasible
    z2 = evaluate(costs, devices, options, Decision(**ONE, memory=(ZERO2,)))
    base = SolverResult.from_evaluation(z2, options=options, status="FEASIBLE", best_bound=0.5 * z2.step_time_s)
    out = _try_grad_sharding(costs, devices, options, base)
    assert out.decision.memory[0].zero == 3 and out.status == "FEASIBLE+ZERO3"
    assert evaluate_result(costs, devices, options, out).feasible
    assert _try_grad_sharding(costs, devices, never, base).decision.memory[0].zero == 2


def test_zero3_not_chosen_where_memory_does_not_bind():
    """On two 40 GiB GPUs everything fits: ZeRO-3's gathers only cost time,
    so the stage DP does not choose it."""
    costs, devices, options = _one_stage_two_gpus(memory_gib=40, param_sharding="auto")
    dp = solve_stage_dp(costs, devices, options)
    assert not any(m.zero == 3 for m in dp.decision.memory)


#: Per layout: the decision's memory-policy fields, what the table says, the plan field that records it.
LAYOUTS = {
    "zero2": (dict(memory=(ZERO2, StageMemory())), "ZeRO-2", "grad_sharded"),
    "zero3": (dict(memory=(ZERO3, StageMemory())), "ZeRO-3", "param_sharded"),
    "offload": (dict(memory=(StageMemory(zero=1, optimizer="host"), StageMemory())), "offloaded", "offload_optimizer"),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_plan_file_table_and_round_trip(layout, tmp_path):
    """A plan of a real model with stage 0 (2 GPUs) under ``layout``: the
    stage records it, the table says so, the memory breakdown adds up (ZeRO-2:
    the GPU's gradient shard among the gradients; ZeRO-3: the weight shard
    among the weights; offload: no optimizer bytes on the GPU, 12 B per owned
    parameter in host memory), and plan -> Plan.decision -> evaluate gives
    the plan's own step and memory."""
    from zorse_fx.capture import analyse
    from zorse_fx.cluster import Cluster
    from zorse_fx.plan import Plan
    from zorse_fx.planner import plan_fixed
    from zorse_fx.pricing import price

    fields, label, flag = LAYOUTS[layout]
    captured = small_gpt()
    cluster = Cluster.from_yaml(CLUSTERS / "small_hetero.yaml")
    if layout == "offload":  # host memory on every node
        d = cluster.to_dict()
        cluster = Cluster.from_dict({**d, "nodes": [{**n, "host_memory_GiB": 64} for n in d["nodes"]]})
    options = PlanOptions(global_batch_size=8, max_stages=2, num_microbatches=(2,), solver_budget=0.5)
    nb = analyse(captured).num_blocks
    plan, _ = plan_fixed(captured, cluster, options, Decision(
        stage_blocks=((0, 2), (2, nb)), stage_gpus=((0, 1), (2,)), samples_per_microbatch=((3, 1), (4,)),
        num_microbatches=2, **fields))
    assert getattr(plan.stages[0], flag) and not getattr(plan.stages[1], flag)
    assert label in plan.table()
    plan.export(tmp_path / "p")
    loaded = Plan.load(tmp_path / "p")
    assert getattr(loaded.stages[0], flag)
    priced = price(captured, cluster, options)
    dec = loaded.decision(priced.costs)
    for name, value in fields.items():
        assert getattr(dec, name) == value
    ev = evaluate(priced.costs, priced.devices, dataclasses.replace(options, num_microbatches=None), dec)
    assert ev.feasible and ev.step_time_s == pytest.approx(plan.predicted_step_time_s, rel=1e-12)
    for g, mem in zip(plan.stages[0].gpus, ev.memory_bytes[0]):
        b = g.predicted_memory
        assert g.predicted_memory_bytes == mem == (b.weights_bytes + b.gradients_bytes + b.optimizer_bytes
                                                   + b.activations_bytes + b.communication_bytes)
        if layout == "zero2":  # the GPU keeps gradients of its shard only
            assert b.gradients_bytes <= 4 * plan.stages[0].num_parameters
        if layout == "zero3":
            assert b.weights_bytes > 0
        if layout == "offload":
            assert b.optimizer_bytes == 0
    if layout == "offload":
        n = plan.stages[0].num_parameters
        # (12 B per parameter; the planner rounds each block's up to whole KiB)
        assert 12 * n <= sum(g.predicted_host_memory_bytes for g in plan.stages[0].gpus) <= 12 * n + 2048 * nb
        assert all(g.predicted_host_memory_bytes == 0 for g in plan.stages[1].gpus)
    if layout == "zero2":
        assert sum(g.predicted_memory.gradients_bytes for g in plan.stages[0].gpus) > 0


@pytest.mark.parametrize("zero3", [False, True])
def test_interleave_search_keeps_the_state_layout(zero3):
    """The interleave search keeps each group's ZeRO-2 / ZeRO-3 on all of its
    stages: two groups of two 5 GiB GPUs hold the model under ZeRO-2 or
    ZeRO-3 only, and their interleaved (v = 2) version fits with it."""
    from zorse_fx.ir.result import SolverResult
    from zorse_fx.solve.interleave import interleave_search

    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (0.01,) * NB}, param_count=(P // NB,) * NB,
                       act_bytes_per_sample=(4 << 20,) * NB, cut_bytes_per_sample=(0, *(1 << 20,) * (NB - 1), 0))
    devices = make_devices(["A"] * 4, ["n0"] * 4, [5 * GIB] * 4, [1e12] * 4)
    options = solver_options(global_batch_size=8, max_stages=2, num_microbatches=(4,), allow_idle_gpus=False,
                             sharding="auto", grad_sharding="auto", param_sharding="auto", max_interleave=2)
    two = dict(stage_blocks=((0, NB // 2), (NB // 2, NB)), stage_gpus=((0, 1), (2, 3)),
               samples_per_microbatch=((1, 1), (1, 1)), num_microbatches=4)
    assert not evaluate(costs, devices, options, Decision(**two, memory=(StageMemory(zero=1),) * 2)).feasible
    layout = StageMemory(zero=3 if zero3 else 2)
    ev = evaluate(costs, devices, options, Decision(**two, memory=(layout, layout)))
    assert ev.feasible, ev.violations
    base = SolverResult.from_evaluation(ev, options=options, status="FEASIBLE", best_bound=0.1)
    res, tried = interleave_search(costs, devices, options, base)
    assert res is not None and res.decision.interleave == 2, tried
    assert res.decision.memory == (layout,) * 4
    assert evaluate_result(costs, devices, options, res).feasible
