"""Optimizer offload ([Note: optimizer offload] in ``runtime/optimizer.py``,
[C-offload] in ``solve/objective.py``): a stage's AdamW moments and float32
masters in host memory, the step on the CPU. Equal to single-process training
(losses, step-1 gradients, parameters after several steps) on Gloo with
NCCL's semantics, replicated and ZeRO-1 with unequal shards and sample
shares, a tied embedding, fp32 and bf16-mixed with 16-bit working weights;
checkpoints move between offloaded and on-device layouts. On this CPU host
and device memory are one, so what these runs show is the arithmetic and
the bookkeeping (host copies, write-back, checkpoint keys), not the
transfers' speed; ``make gpu-check`` runs on a GPU.

The planner side: the cluster file's host fields, the stage DP's third pass
(only where nothing fits without offload), the objective against the
simulator, the host-memory check and its message.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import gpt3x64, make_devices, train_and_compare, with_low_precision, with_memory_policy
from zorse_fx.cluster import Cluster
from zorse_fx.errors import ClusterConfigError, InfeasiblePlanError, PlanFileError
from zorse_fx.ir.costs import BlockCosts
from zorse_fx.ir.memory import StageMemory
from zorse_fx.options import PlanOptions
from zorse_fx.plan import Plan
from zorse_fx.sim import simulate
from zorse_fx.solve.objective import evaluate
from zorse_fx.solve.stage_dp import solve_stage_dp
from test_zero2 import LR, WEIGHT_DECAY, _two_stage_plan


GiB = 2**30


def with_offload(plan, stages):
    """``plan`` with ``StagePlan.offload_optimizer`` on ``stages`` (indices)."""
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, offload_optimizer=s.index in stages)
                                                  for s in plan.stages))


def test_fp32_offload_replicated_and_zero1(lee_bytes, tmp_path):
    """fp32, both stages offloaded (stage 0 replicated on one GPU, stage 1
    ZeRO-1 with 3:1 shards), clipping at 0.5: every stepped tensor is a host
    copy (4 B per element, stage 0 all of its parameters, stage 1 each
    rank's range), and training equals single-process AdamW."""
    captured = gpt3x64()
    plan = with_offload(_two_stage_plan(captured), {0, 1})
    summaries, _ = train_and_compare(plan, captured, lee_bytes, tmp_path, steps=3, lr=LR, weight_decay=WEIGHT_DECAY,
                                     extra=("--clip-grad-norm", "0.5"), ref_kwargs={"clip": 0.5})
    assert all(summaries[r]["offload"] for r in range(plan.world_size))
    stage0 = summaries[0]
    assert stage0["host_copy_bytes"] == 4 * stage0["stage_elements"]
    for r in (1, 2):
        assert summaries[r]["host_copy_bytes"] == 4 * summaries[r]["owned_elements"] > 0
    assert summaries[1]["owned_elements"] > 2 * summaries[2]["owned_elements"]


def test_bf16_offload_with_sixteen_bit_working_weights(lee_bytes, tmp_path):
    """bf16-mixed, stage 1 offloaded with 16-bit working weights: their
    float32 masters are allocated in host memory (no host copy for them),
    the rest of the range gets host copies; equal to single-process training
    under the same autocast within the bf16 tolerances."""
    captured = gpt3x64()
    plan = with_offload(with_low_precision(_two_stage_plan(captured), captured), {1})
    assert plan.stages[1].low_precision_params
    summaries, _ = train_and_compare(plan, captured, lee_bytes, tmp_path, steps=3, lr=LR, weight_decay=WEIGHT_DECAY,
                                     precision="bf16-mixed")
    assert not summaries[0]["offload"] and summaries[0]["host_copy_bytes"] == 0
    for r in (1, 2):
        bf16 = next(b for b in summaries[r]["buffers"] if b["dtype"] == "bfloat16")
        fp32 = next(b for b in summaries[r]["buffers"] if b["dtype"] == "float32")
        assert bf16["master_bytes"] == 4 * bf16["owned_elements"] > 0
        assert summaries[r]["host_copy_bytes"] == 4 * fp32["owned_elements"]


def test_zero3_with_offload_equals_single_process(lee_bytes, tmp_path):
    """bf16-mixed, stage 1 ZeRO-3 (3:1 shards, 16-bit working weights) with
    its optimizer offloaded: the float32 gradient shards go to the host, the
    CPU steps the masters, the rounding goes back into the GPU's owned range
    of the weights, which the next forward gathers; equal to single-process
    training."""
    from conftest import with_param_sharding

    captured = gpt3x64()
    plan = with_offload(with_param_sharding(with_low_precision(_two_stage_plan(captured), captured)), {1})
    assert plan.stages[1].param_sharded and plan.stages[1].offload_optimizer
    summaries, _ = train_and_compare(plan, captured, lee_bytes, tmp_path, steps=2, lr=LR, weight_decay=WEIGHT_DECAY,
                                     precision="bf16-mixed")
    for r in (1, 2):
        assert summaries[r]["offload"] and summaries[r]["zero3"]["gathers"] > 0


def test_checkpoints_move_between_offloaded_and_on_device(lee_bytes, tmp_path):
    """fp32: steps 1-2 offloaded, step 3 resumed on the GPU, step 4 offloaded
    again: losses and parameters equal 4 uninterrupted on-device steps (the
    host copies are refreshed from the loaded weights)."""
    from conftest import assert_resume_across_layouts
    from test_training_loop import _plan_a4

    captured = gpt3x64()
    dev = with_memory_policy(_plan_a4(captured), sharded={0, 1}, shard_bytes={0: (2**20, 2**20),
                                                                              1: (3 * 2**20, 2**20)})
    assert_resume_across_layouts(captured, lee_bytes, tmp_path, dev, with_offload(dev, {0, 1}))

def test_plan_file_offload_field():
    """``offload_activations`` on a recomputing stage is refused naming the
    field and the fix; a version-10 file reads with it off; the table says
    where the optimizer lives and how much host memory it takes."""
    captured = gpt3x64()
    plan = with_offload(_two_stage_plan(captured), {1})
    d = plan.to_dict()
    assert d["stages"][1]["offload_optimizer"] is True
    assert Plan.from_dict(d).stages[1].offload_optimizer
    bad = plan.to_dict()
    bad["stages"][1].update(offload_activations=True, recompute=True)
    with pytest.raises(PlanFileError, match=r"stages\[1\]\.offload_activations is true on a stage that "
                                            r"recomputes; activation offload goes without recomputation"):
        Plan.from_dict(bad)
    bad = plan.to_dict()
    bad["stages"][1]["offload_optimizer"] = "yes"
    with pytest.raises(PlanFileError, match=r"stages\[1\]\.offload_optimizer"):
        Plan.from_dict(bad)
    d["version"] = 10
    for s in d["stages"]:
        del s["offload_optimizer"]
        for g in s["gpus"]:
            g.pop("predicted_host_memory_bytes", None)
    assert not any(s.offload_optimizer for s in Plan.from_dict(d).stages)
    table = plan.table()
    assert "offloaded" in table and "GiB host" in table and "Optimizer offloaded on stage 1" in table


# -- planner ---------------------------------------------------------------

def _big_model(params_per_block=250_000_000, blocks=4):
    """1e9 float32 parameters (16 GB of state): more than a 12 GiB GPU holds."""
    return BlockCosts(fwd_bwd_s_per_sample={"V100-16GB": (0.01,) * blocks}, param_count=(params_per_block,) * blocks,
                      act_bytes_per_sample=(50_000_000,) * blocks, cut_bytes_per_sample=(0, *(1e6,) * (blocks - 1), 0))


def _one_gpu(host_gib, *, link=15.75e9, host_bw=100e9):
    dev = make_devices(["V100-16GB"], ["n0"], [12 * GiB], [900e9])
    return dataclasses.replace(dev, host_memory_bytes=(host_gib * GiB,), host_mem_bw_bytes_per_s=(host_bw,),
                               host_link_bytes_per_s=(link,))


def test_stage_dp_offloads_only_where_nothing_fits():
    """One 12 GiB GPU cannot hold 16 GB of state: without host memory there
    is no plan (the error says so), with 64 GiB of it the stage DP offloads
    (device: weights and gradients, 8 GB; host: 12 GB), and the objective's
    step equals the simulator's (the CPU step after the backward, priced
    alike). The offload time is the host link round trip plus the CPU step:
    1e9 x (8 B / 15.75 GB/s + 32 B / 100 GB/s) = 0.828 s."""
    costs, opts = _big_model(), PlanOptions(global_batch_size=4, planner="stage_dp")
    with pytest.raises(InfeasiblePlanError, match="fits memory"):
        solve_stage_dp(costs, _one_gpu(0), opts)
    dev = _one_gpu(64)
    res = solve_stage_dp(costs, dev, opts)
    d = res.decision
    assert d.memory == (StageMemory(optimizer="host"),)
    ev = evaluate(costs, dev, opts, d)
    assert ev.feasible and ev.memory_bytes[0][0] < 12 * GiB
    assert ev.optim_s[0] == pytest.approx(1e9 * (8 / 15.75e9 + 32 / 100e9), rel=1e-3)
    assert simulate(costs, dev, opts, d).step_time_s == pytest.approx(ev.step_time_s, rel=1e-4)
    with pytest.raises(InfeasiblePlanError):
        solve_stage_dp(costs, dev, dataclasses.replace(opts, offload="never"))


def test_stage_dp_does_not_offload_what_fits():
    """A model that fits on the GPU plans the same with and without host memory."""
    costs, opts = _big_model(params_per_block=100_000_000), PlanOptions(global_batch_size=4, planner="stage_dp")
    with_host, without = solve_stage_dp(costs, _one_gpu(64), opts), solve_stage_dp(costs, _one_gpu(0), opts)
    assert not any(m.optimizer == "host" for m in with_host.decision.memory)
    assert with_host.decision == without.decision


def test_host_memory_check_names_the_node_and_the_fix():
    """An offloaded decision on a node with too little host memory is
    infeasible; the violation names the GPU, the bytes and the node; with no
    host memory at all it says to add ``host_memory_GiB``."""
    costs, opts = _big_model(), PlanOptions(global_batch_size=4)
    d = solve_stage_dp(costs, _one_gpu(64), dataclasses.replace(opts, planner="stage_dp")).decision
    small = evaluate(costs, _one_gpu(8), opts, d)
    assert not small.feasible
    assert any("offloads 11.2 GiB to host memory > 7.2 GiB usable" in v and "node n0" in v for v in small.violations)
    none = evaluate(costs, _one_gpu(0), opts, d)
    assert any("add host_memory_GiB to the node" in v for v in none.violations)


def test_cluster_file_host_fields(tmp_path):
    """``host_memory_GiB``, ``host_memory_bandwidth_GBps`` and ``host_link``
    per node: split over the node's GPUs, the host link defaulting by GPU
    class (V100: PCIe Gen3 x16, 15.75 GB/s; A100: Gen4, 31.5 GB/s), written
    back by ``to_dict``; a bad value names the field and the fix."""
    d = {"nodes": [{"name": "n0", "gpus": [{"type": "V100-16GB", "count": 2}], "host_memory_GiB": 488,
                    "host_link": {"bandwidth_GBps": 12}},
                   {"name": "n1", "gpus": [{"type": "A100-40GB", "count": 1}], "host_memory_GiB": 100,
                    "host_memory_bandwidth_GBps": 300}],
         "links": {"intra_node": {"bandwidth_GBps": 16, "latency_us": 10},
                   "inter_node": {"bandwidth_GBps": 3, "latency_us": 20}}}
    c = Cluster.from_dict(d)
    g = c.device_graph()
    assert g.host_memory_bytes == (244 * GiB, 244 * GiB, 100 * GiB)
    assert g.host_link_bytes_per_s == pytest.approx((12e9, 12e9, 31.5e9), rel=1e-3)
    assert g.host_mem_bw_bytes_per_s == pytest.approx((102.4e9, 102.4e9, 300e9))
    assert Cluster.from_dict(c.to_dict()) == c
    bad = {**d, "nodes": [{**d["nodes"][0], "host_memory_GiB": -1}, d["nodes"][1]]}
    with pytest.raises(ClusterConfigError, match=r"nodes\[0\]\.host_memory_GiB: must be a positive number "
                                                 r"\(got -1\); the node's RAM training may use"):
        Cluster.from_dict(bad)
    bad = {**d, "nodes": [{**d["nodes"][0], "host_link": {"bandwidth_GBps": 12, "latency_us": 1}}, d["nodes"][1]]}
    with pytest.raises(ClusterConfigError, match=r"nodes\[0\]\.host_link\.latency_us"):
        Cluster.from_dict(bad)
    plain = Cluster.from_dict({**d, "nodes": [{k: v for k, v in n.items() if not k.startswith("host")}
                                              for n in d["nodes"]]})
    assert plain.device_graph().host_memory_bytes == (0, 0, 0)


# -- activation offload -------------------------------------------------------

def with_act_offload(plan, stages):
    """``plan`` with ``StagePlan.offload_activations`` on ``stages`` (indices)."""
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, offload_activations=s.index in stages)
                                                  for s in plan.stages))


@pytest.mark.parametrize("precision", [None, "bf16-mixed"])
def test_activation_offload_equals_single_process(precision, lee_bytes, tmp_path):
    """Both stages offload their activations (stage 1 with its optimizer too,
    ZeRO-1 with 3:1 shards; bf16 with 16-bit working weights): equal to
    single-process training. Every stage moved saved tensors to host memory
    and kept its weights (parameters and autocast's casts of them) in place."""
    captured = gpt3x64()
    plan = _two_stage_plan(captured)
    if precision:
        plan = with_low_precision(plan, captured)
    plan = with_act_offload(with_offload(plan, {1}), {0, 1})
    summaries, _ = train_and_compare(plan, captured, lee_bytes, tmp_path, steps=2, lr=LR, weight_decay=WEIGHT_DECAY,
                                     precision=precision)
    for r in range(plan.world_size):
        moved = summaries[r]["activation_offload"]
        assert moved["offloaded_bytes"] > 0 and moved["kept_weights"] > 0, (r, moved)


def test_activation_offload_in_the_planner():
    """GPipe with 4 micro-batches of 4 GB of saved activations each on a 12
    GiB GPU: nothing fits without activation offload; with it the GPU holds
    one micro-batch's (3.7 GiB) and the host all four, each micro-batch pays
    2 x 4 GB over the 15.75 GB/s link (0.508 s) in its compute, and the
    objective's step equals the simulator's (the transfer half in the
    forward, half in the backward in both)."""
    costs = BlockCosts(fwd_bwd_s_per_sample={"V100-16GB": (0.01,) * 4}, param_count=(25_000_000,) * 4,
                       act_bytes_per_sample=(1_000_000_000,) * 4, cut_bytes_per_sample=(0, *(1e6,) * 3, 0))
    opts = PlanOptions(global_batch_size=4, planner="stage_dp", recompute="never", num_microbatches=(4,),
                       schedule="gpipe")
    dev = _one_gpu(64)
    with pytest.raises(InfeasiblePlanError):
        solve_stage_dp(costs, dev, dataclasses.replace(opts, activation_offload="never"))
    d = solve_stage_dp(costs, dev, opts).decision
    assert d.memory == (StageMemory(activations="host"),)
    ev = evaluate(costs, dev, opts, d)
    assert ev.feasible
    # (the tables round each block's activations up to a KiB and the per-MiB time to a ns: ~4e-6)
    assert ev.compute_s[0] == pytest.approx(4 * 0.01 + 2 * 4e9 / 15.75e9, rel=2e-5)
    assert ev.host_memory_bytes[0][0] == pytest.approx(4 * 4e9, rel=1e-3)
    assert ev.memory_bytes[0][0] < 5.3 * GiB
    sim = simulate(costs, dev, opts, d)
    assert sim.step_time_s == pytest.approx(ev.step_time_s, rel=1e-5)
    assert sim.peak_memory_bytes[0] == ev.memory_bytes[0][0]
    small = evaluate(costs, _one_gpu(8), opts, d)
    assert any("to host memory" in v for v in small.violations)


def test_stage_dp_offloads_a_zero3_stage_where_only_that_fits():
    """1e9 float32 parameters on two 6 GiB GPUs: ZeRO-3 alone needs 8 B per
    parameter per GPU (7.5 GiB), optimizer offload without it keeps 8 B of
    weights and gradients on each; ZeRO-3 with its optimizer offloaded keeps
    the weight and gradient shards (4 B per parameter over 2 GPUs) and
    puts 12 B per owned parameter in host memory: the only layout that fits,
    and the stage DP finds it; the objective equals the simulator in time
    and memory. With 10 GiB GPUs ZeRO-3 fits alone and nothing is offloaded."""
    nb, p = 16, 1_000_000_000
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (0.01,) * nb}, param_count=(p // nb,) * nb,
                       act_bytes_per_sample=(4 << 20,) * nb, cut_bytes_per_sample=(0, *(1 << 20,) * (nb - 1), 0))
    opts = PlanOptions(global_batch_size=4, max_stages=1, num_microbatches=(2,), allow_idle_gpus=False,
                       planner="stage_dp")

    def devices(gib):
        dev = make_devices(["A", "A"], ["n0", "n0"], [gib * GiB] * 2, [1e12, 1e12])
        return dataclasses.replace(dev, host_memory_bytes=(64 * GiB,) * 2, host_mem_bw_bytes_per_s=(1e11,) * 2,
                                   host_link_bytes_per_s=(16e9,) * 2)

    with pytest.raises(InfeasiblePlanError):
        solve_stage_dp(costs, devices(6), dataclasses.replace(opts, offload="never"))
    d = solve_stage_dp(costs, devices(6), opts).decision
    assert d.memory == (StageMemory(zero=3, optimizer="host"),)
    ev = evaluate(costs, devices(6), opts, d)
    assert ev.feasible and max(ev.memory_bytes[0]) < 0.8 * 6 * GiB
    assert sum(ev.host_memory_bytes[0]) == pytest.approx(12 * p, rel=1e-3)
    sim = simulate(costs, devices(6), opts, d)
    # (1e-3: the ZeRO-3 gathers' latencies, per block in the simulator and per pass in the objective)
    assert sim.step_time_s == pytest.approx(ev.step_time_s, rel=1e-3)
    assert sim.peak_memory_bytes[:2] == ev.memory_bytes[0]
    roomy = solve_stage_dp(costs, devices(10), opts).decision
    assert roomy.memory == (StageMemory(zero=3),)


def test_interleaved_three_microbatches_with_offload(lee_bytes, tmp_path):
    """Interleaved, P = 2 groups, v = 2, M = 3 (not a multiple of P): group 0
    (2 GPUs, 2:1 samples, ZeRO-1 shards 1:2 and 3:1) offloads the optimizer
    of both its stages, group 1 (one GPU) its activations; bf16-mixed with
    16-bit working weights. Equal to single-process training. (The planner
    does not interleave offloaded plans; the runtime trains them.)"""
    from conftest import fixed_plan, gpt4x64

    captured = gpt4x64()
    plan = fixed_plan(captured, ((0, 1), (2,), (0, 1), (2,)), ((2, 1), (3,), (2, 1), (3,)), num_microbatches=3,
                      global_batch_size=9, interleave=2)
    plan = with_memory_policy(plan, sharded={0, 2}, shard_bytes={0: (2**20, 2 * 2**20), 2: (3 * 2**20, 2**20)})
    plan = with_act_offload(with_offload(with_low_precision(plan, captured), {0, 2}), {1, 3})
    summaries, _ = train_and_compare(plan, captured, lee_bytes, tmp_path, steps=2, lr=LR, weight_decay=WEIGHT_DECAY,
                                     precision="bf16-mixed")
    assert all(summaries[r]["offload"] for r in (0, 1))
    assert summaries[2]["activation_offload"]["offloaded_bytes"] > 0
