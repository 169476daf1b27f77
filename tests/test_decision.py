"""``Decision``, the one record of a planner answer, and ``PlanOptions``, the one options record (issue 13).

Every validation error of ``Decision`` names the field or stage and the value;
a Plan read back with ``Plan.decision`` scores to the plan's own prediction.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CLUSTERS, make_devices, random_costs, random_instance, small_gpt

import zorse_fx
import zorse_fx.ir.result as records
from zorse_fx import PlanOptions, PlanOptionsError
from zorse_fx.solve import Decision, SolverResult, StageMemory, evaluate, solve_brute_force, solve_cpsat
from zorse_fx.solve.objective import evaluate_result

ROOT = Path(__file__).resolve().parents[1]
TWO = dict(stage_blocks=((0, 2), (2, 4)), stage_gpus=((0, 1), (2,)), samples_per_microbatch=((3, 1), (4,)),
           num_microbatches=2)
PLAIN, ZERO1, RECOMPUTE = StageMemory(), StageMemory(zero=1), StageMemory(recompute=True)


@pytest.mark.parametrize("change, message", [
    (dict(stage_gpus=((0, 1),)), r"stage_blocks has 2 stages, stage_gpus 1, samples_per_microbatch 2"),
    (dict(stage_blocks=(), stage_gpus=(), samples_per_microbatch=()), r"stage_blocks is empty"),
    (dict(num_microbatches=0), r"Decision.num_microbatches=0: use an int >= 1"),
    (dict(num_microbatches=2.0), r"Decision.num_microbatches=2.0"),
    (dict(interleave=0), r"interleave=0 must be an int >= 1"),
    (dict(interleave=2), r"interleave=2 needs a stage count that is a multiple of 2 with at least 2 GPU groups, "
                         r"got 2 stages"),
    (dict(stage_blocks=((1, 2), (2, 4))), r"stage 0 blocks \(1, 2\): expected a non-empty range starting at block 0"),
    (dict(stage_blocks=((0, 2), (3, 4))), r"stage 1 blocks \(3, 4\): expected a non-empty range starting at block 2"),
    (dict(stage_blocks=((0, 2), (2, 2))), r"stage 1 blocks \(2, 2\)"),
    (dict(stage_gpus=((0, 1), ()), samples_per_microbatch=((3, 1), ())), r"stage 1 has no GPU"),
    (dict(samples_per_microbatch=((4,), (4,))), r"stage 0: 2 GPUs but 1 sample counts"),
    (dict(stage_gpus=((0, 1), (1,))), r"GPU 1 is in stage 0 and stage 1: each GPU serves at most one stage"),
    (dict(stage_gpus=((0, 0), (2,))), r"GPU 0 is twice in stage 0"),
    (dict(stage_gpus=((0, -1), (2,))), r"stage 0: GPU index -1 must be an int >= 0"),
    (dict(samples_per_microbatch=((4, 0), (4,))), r"stage 0 GPU 1: samples per micro-batch must be an int >= 1, got 0"),
    (dict(samples_per_microbatch=((3, 1), (3,))), r"stage 1: samples \(3,\) sum to 3, stage 0's \(3, 1\) to 4"),
    (dict(memory=(ZERO1,)), r"Decision.memory has 1 entries, the decision has 2 stages"),
    (dict(memory=(RECOMPUTE,) * 3), r"Decision.memory has 3 entries, the decision has 2 stages"),
    (dict(memory=(PLAIN, True)), r"Decision.memory\[1\] is a bool: use a zorse_fx.ir.StageMemory"),
    (dict(memory=(PLAIN, ZERO1)),
     r"stage 1 is sharded \(ZeRO-1\) but has 1 GPU: ZeRO needs >= 2 GPUs.*Decision.memory\[1\].zero"),
    (dict(memory=(ZERO1, PLAIN), shard_mib=((1, 1),)), r"Decision.shard_mib has 1 rows, the decision has 2 stages"),
    (dict(memory=(ZERO1, PLAIN), shard_mib=((1, 1), (3,))),
     r"stage 1 is not sharded but Decision.shard_mib gives it shards \(3,\)"),
    (dict(memory=(ZERO1, PLAIN), shard_mib=((5,), ())),
     r"stage 0: Decision.shard_mib \(5,\) must give one int >= 0 per GPU \(2 GPUs\)"),
    (dict(memory=(ZERO1, PLAIN), shard_mib=((5, -1), ())), r"stage 0: Decision.shard_mib \(5, -1\)"),
    (dict(precision="bf16"), r"Decision.precision='bf16': use '' \(as priced\) or one of 'fp32'"),
])
def test_each_malformed_decision_is_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        Decision(**{**TWO, **change})


@pytest.mark.parametrize("fields, message", [
    (dict(zero=4), r"StageMemory.zero=4: use an int in 0..3"),
    (dict(zero=True), r"StageMemory.zero=True: use an int in 0..3"),
    (dict(zero=1.0), r"StageMemory.zero=1.0: use an int in 0..3"),
    (dict(recompute="yes"), r"StageMemory.recompute='yes': use True or False"),
    (dict(optimizer="cpu"), r"StageMemory.optimizer='cpu': use 'device' or 'host'"),
    (dict(activations=True), r"StageMemory.activations=True: use 'device' or 'host'"),
    (dict(activations="host", recompute=True), r"StageMemory\(activations='host', recompute=True\): activation "
                                               r"offload goes without recomputation and ZeRO-2/3"),
    (dict(activations="host", zero=2), r"StageMemory\(activations='host', zero=2\)"),
])
def test_each_malformed_stage_memory_is_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        StageMemory(**fields)


def test_stage_memory_round_trips_through_the_plan_fields():
    """Every valid policy -> ``StagePlan.memory_fields`` -> ``plan.stage_memory`` is itself;
    an object without the fields (a plan from before them) reads as plain."""
    from types import SimpleNamespace as NS

    from zorse_fx.plan import StagePlan, stage_memory

    every = [StageMemory(zero=z, recompute=rc, optimizer=o, activations=a) for z in range(4) for rc in (False, True)
             for o in ("device", "host") for a in ("device", "host") if a == "device" or not (rc or z >= 2)]
    assert len(every) == 20 and len(set(every)) == 20  # 16 with activations on the GPU, 4 on the host
    for mem in every:
        assert stage_memory(NS(**StagePlan.memory_fields(mem))) == mem
    assert stage_memory(NS()) == StageMemory()
    assert StageMemory(zero=2, recompute=1).recompute is True


def test_interleaving_rules():
    four = dict(stage_blocks=((0, 1), (1, 2), (2, 3), (3, 4)), stage_gpus=((0, 1), (2,), (0, 1), (2,)),
                samples_per_microbatch=((3, 1), (4,), (3, 1), (4,)), num_microbatches=2, interleave=2)
    d = Decision(**four)
    assert (d.num_stages, d.num_groups, d.microbatch_size, d.gpus_used) == (4, 2, 4, (0, 1, 2))
    with pytest.raises(ValueError, match=r"interleave=2: stage 2 must have the GPUs and samples of stage 0 "
                                         r"\(\(0, 1\), \(3, 1\)\), got \(\(0, 1\), \(2, 2\)\)"):
        Decision(**{**four, "samples_per_microbatch": ((3, 1), (4,), (2, 2), (4,))})
    # Any micro-batch count interleaves (issue 31 item 5): 3 on 2 groups is one round of 3.
    assert Decision(**{**four, "num_microbatches": 3}).num_microbatches == 3
    with pytest.raises(ValueError, match=r"interleave=2 needs schedule '1f1b', got 'gpipe'"):
        d.check(num_blocks=4, num_gpus=3, global_batch_size=8, schedule="gpipe")


def test_checks_against_the_instance():
    d = Decision(**TWO)
    assert d.check(num_blocks=4, num_gpus=3, global_batch_size=8) == 4
    with pytest.raises(ValueError, match=r"last stage ends at block 4, the model has 5 blocks"):
        d.check(num_blocks=5, num_gpus=3, global_batch_size=8)
    with pytest.raises(ValueError, match=r"stage 1: GPU index 2 outside 0..1"):
        d.check(num_blocks=4, num_gpus=2, global_batch_size=8)
    with pytest.raises(ValueError, match=r"num_microbatches=2 must be a positive divisor of global_batch_size=7"):
        d.check(num_blocks=4, num_gpus=3, global_batch_size=7)
    with pytest.raises(ValueError, match=r"stage 0: samples \(3, 1\) sum to 4, the micro-batch has 6 samples "
                                         r"\(12 / 2 micro-batches\)"):
        d.check(num_blocks=4, num_gpus=3, global_batch_size=12)


def test_frozen_normalised_and_defaults():
    d = Decision(stage_blocks=[[0, 2], [2, 4]], stage_gpus=[[0, 1], [2]], samples_per_microbatch=[[3, 1], [4]],
                 num_microbatches=2)
    assert d == Decision(**TWO) and hash(d) == hash(Decision(**TWO))
    assert d.stage_blocks == ((0, 2), (2, 4)) and isinstance(d.stage_gpus[0], tuple)
    assert (d.interleave, d.memory, d.shard_mib, d.precision) == (1, (PLAIN, PLAIN), ((), ()), "")
    assert d.shard_bytes() == ((0, 0), (0,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.num_microbatches = 4
    # A sharded stage without shards: the evaluator balances them.
    open_shards = Decision(**TWO, memory=(ZERO1, PLAIN))
    assert open_shards.shard_mib is None
    with pytest.raises(ValueError, match="evaluate the decision first"):
        open_shards.shard_bytes()
    assert open_shards.with_shards(((2, 1), ())).shard_bytes() == ((2 << 20, 1 << 20), (0,))


def test_evaluate_fills_the_shards_and_a_result_keeps_them():
    costs = random_costs(__import__("random").Random(0), 4, ["A", "B"])
    devices = make_devices(["A", "A", "B"], ["n0", "n0", "n1"], [16 << 30] * 3, [1e12, 1e12, 5e11])
    options = PlanOptions(global_batch_size=8)
    ev = evaluate(costs, devices, options, Decision(**TWO, memory=(ZERO1, PLAIN)))
    assert ev.decision.shard_mib is not None and len(ev.decision.shard_mib[0]) == 2
    res = SolverResult.from_evaluation(ev, options=options, status="TEST", best_bound=0.0)
    assert res.decision == ev.decision and evaluate_result(costs, devices, options, res) == ev
    with pytest.raises(ValueError, match="with its shards chosen"):
        dataclasses.replace(res, decision=Decision(**TWO, memory=(ZERO1, PLAIN)))
    with pytest.raises(TypeError, match="expected a zorse_fx.solve.Decision, got dict"):
        evaluate(costs, devices, options, dict(TWO))


def test_plans_round_trip_through_their_decision():
    """plan -> Plan.decision -> evaluate gives the plan's own predicted step:
    a solved plan (interleaved here) and a hand-made one with a ZeRO-1 stage
    (shards in whole MiB) and a recomputing one; the precision comes along."""
    from zorse_fx.capture import analyse
    from zorse_fx.cluster import Cluster
    from zorse_fx.planner import plan_captured, plan_fixed
    from zorse_fx.pricing import price

    captured = small_gpt()
    cluster = Cluster.from_yaml(CLUSTERS / "small_hetero.yaml")
    options = PlanOptions(global_batch_size=8, max_stages=2, num_microbatches=(2,), solver_budget=0.5)
    solved, _ = plan_captured(captured, cluster, options, model_name="gpt", label_mode="shifted")
    nb = analyse(captured).num_blocks
    fixed, _ = plan_fixed(captured, cluster, options, Decision(
        stage_blocks=((0, 2), (2, nb)), stage_gpus=((0, 1), (2,)), samples_per_microbatch=((3, 1), (4,)),
        num_microbatches=2, memory=(ZERO1, RECOMPUTE)))
    priced = price(captured, cluster, options)
    costs, policy, devices = priced.costs, priced.precision, priced.devices
    for plan, relaxed in ((solved, options), (fixed, dataclasses.replace(options, num_microbatches=None))):
        dec = plan.decision(costs)
        assert dec.precision == plan.precision == policy.name
        assert dec.interleave == plan.interleave and dec.num_microbatches == plan.num_microbatches
        ev = evaluate(costs, devices, relaxed, dec)
        assert ev.feasible, ev.violations
        assert ev.step_time_s == pytest.approx(plan.predicted_step_time_s, rel=1e-12)
        assert [g.predicted_memory_bytes for st in plan.stages for g in st.gpus] == [
            m for row in ev.memory_bytes for m in row]
    assert solved.interleave > 1
    dec = fixed.decision(costs)
    assert dec.memory == (ZERO1, RECOMPUTE) and sum(dec.shard_mib[0]) >= 1
    assert dec.shard_bytes()[0] == tuple(g.state_shard_bytes for g in fixed.stages[0].gpus)
    with pytest.raises(ValueError, match=r"Decision.precision='fp32' but the options price 'fp16-mixed' on cluster "
                                         r"'small_hetero': pass PlanOptions\(precision='fp32'\)"):
        plan_fixed(captured, cluster, options, dataclasses.replace(dec, precision="fp32"))


def test_plan_options_is_the_one_options_record():
    assert not [n for n in vars(records) if n.endswith("Options")]  # no second options record
    from zorse_fx import planner, solve

    assert zorse_fx.PlanOptions is planner.PlanOptions is solve.PlanOptions is PlanOptions
    # The solvers take PlanOptions as they are (sharding / recompute "auto" by default).
    costs, devices, options = random_instance(3)
    assert type(options) is PlanOptions
    opts = PlanOptions(global_batch_size=options.global_batch_size, max_stages=2, num_microbatches=(1, 2),
                       solver_budget=0.5, seed=0)
    assert (opts.sharding, opts.recompute, opts.num_workers, opts.seed) == ("auto", "auto", 1, 0)
    small = dataclasses.replace(costs, fwd_bwd_s_per_sample={t: v[:3] for t, v in costs.fwd_bwd_s_per_sample.items()},
                                fwd_bwd_s_fixed={t: v[:3] for t, v in costs.fwd_bwd_s_fixed.items()},
                                param_count=costs.param_count[:3], act_bytes_per_sample=costs.act_bytes_per_sample[:3],
                                cut_bytes_per_sample=costs.cut_bytes_per_sample[:3] + (0,))
    few = dataclasses.replace(devices, **{f: getattr(devices, f)[:3] for f in
                                          ("gpu_types", "memory_bytes", "mem_bw_bytes_per_s", "node_names")},
                              link_bw_bytes_per_s=tuple(r[:3] for r in devices.link_bw_bytes_per_s[:3]),
                              link_latency_s=tuple(r[:3] for r in devices.link_latency_s[:3]))
    exact = solve_brute_force(small, few, dataclasses.replace(opts, global_batch_size=4))
    cpsat = solve_cpsat(small, few, dataclasses.replace(opts, global_batch_size=4, max_interleave=1))
    assert isinstance(exact.decision, Decision) and cpsat.objective == pytest.approx(exact.objective, abs=1e-9)
    with pytest.raises(PlanOptionsError, match=r"PlanOptions.sharding='sometimes': use one of"):
        PlanOptions(global_batch_size=4, sharding="sometimes")
    with pytest.raises(PlanOptionsError, match=r"PlanOptions.max_interleave=0"):
        PlanOptions(global_batch_size=4, max_interleave=0)
    with pytest.raises(PlanOptionsError, match=r"PlanOptions.planner='cp-sat': use one of 'auto', 'cpsat'"):
        PlanOptions(global_batch_size=4, planner="cp-sat")
    with pytest.raises(PlanOptionsError, match=r"PlanOptions.schedule='1F1B': use one of '1f1b', 'gpipe'"):
        PlanOptions(global_batch_size=4, schedule="1F1B")
    # The command line is PlanOptions itself (tyro): its defaults, not a copy of them.
    from zorse_fx.cli import build_parser

    args = build_parser().parse_args(["plan", "--model", "gpt", "--cluster", "c.yaml", "--global-batch-size", "8",
                                      "-o", "out"])
    assert args.parsed.planner == PlanOptions(global_batch_size=8)
    args = build_parser().parse_args(["plan", "--model", "gpt", "--cluster", "c.yaml", "--global-batch-size", "8",
                                      "--param-sharding", "never", "--recompute", "always", "-o", "out"])
    assert (args.parsed.planner.param_sharding, args.parsed.planner.recompute) == ("never", "always")
    # Light: importing the options loads neither OR-Tools nor the planner.
    out = subprocess.run([sys.executable, "-c", "import sys, zorse_fx.options; "
                          "print('ortools' in sys.modules, 'zorse_fx.planner' in sys.modules)"],
                         capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT)}, check=True)
    assert out.stdout.split() == ["False", "False"]
