"""``zorse_fx.pricing``: a model priced once (``price``) and an exported plan
simulated on it (``simulate_plan``), the public path the CLI, the demo and the
benchmarks take."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conftest import small_gpt
from zorse_fx.cluster import Cluster
from zorse_fx.ir import Decision, StageMemory
from zorse_fx.options import PlanOptions
from zorse_fx.plan import Plan
from zorse_fx.planner import plan_fixed
from zorse_fx.pricing import CLASS_MODEL, options_for_plan, price, simulate_plan
from zorse_fx.sim import simulate

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpt():
    return small_gpt()


def test_price_without_profiles_says_where_costs_come_from(gpt):
    cluster = Cluster.from_yaml(ROOT / "examples" / "clusters" / "small_hetero.yaml")
    lines = []
    priced = price(gpt, cluster, PlanOptions(global_batch_size=8, profiles=()), progress=lines.append)
    assert priced.precision.name == "fp16-mixed" and priced.precision_reason == "auto: T4 has no bf16"
    assert priced.cost_sources == {"A100-40GB": {CLASS_MODEL: 1.0}, "T4": {CLASS_MODEL: 1.0}}
    assert priced.profile_batches is None
    assert priced.costs.num_blocks == priced.blocks.num_blocks
    assert set(priced.costs.fwd_bwd_s_per_sample) == {"A100-40GB", "T4"}
    assert priced.devices.gpu_types == ("A100-40GB", "A100-40GB", "T4", "T4")
    assert lines[0].startswith("precision fp16-mixed") and lines[-1].startswith("cost model: roofline on")
    with pytest.raises(dataclasses.FrozenInstanceError):
        priced.costs = None  # type: ignore[misc]


def test_price_with_a_measured_profile(gpt, tmp_path):
    (tmp_path / "h100.yaml").write_text(
        "name: one_h100\nnodes:\n  - name: n0\n    gpus: [{type: H100-80GB, count: 2}]\n"
        "    intra_node: {bandwidth_GBps: 450, latency_us: 5}\n")
    cluster = Cluster.from_yaml(tmp_path / "h100.yaml")
    priced = price(gpt, cluster, PlanOptions(global_batch_size=8))  # the shipped profiles
    sources = priced.cost_sources["H100-80GB"]
    assert CLASS_MODEL not in sources and sum(sources.values()) == pytest.approx(1.0)
    assert priced.profile_batches is not None and priced.profile_batches[0] < priced.profile_batches[1]
    plain = price(gpt, cluster, PlanOptions(global_batch_size=8, profiles=()))
    assert priced.costs.fwd_bwd_s_per_sample != plain.costs.fwd_bwd_s_per_sample


def test_simulate_plan_is_the_plans_decision_simulated(gpt, tmp_path):
    cluster = Cluster.from_yaml(ROOT / "examples" / "clusters" / "small_hetero.yaml")
    options = PlanOptions(global_batch_size=8, profiles=())
    nb = price(gpt, cluster, options).blocks.num_blocks
    plan, _ = plan_fixed(gpt, cluster, options, Decision(
        stage_blocks=((0, 2), (2, nb)), stage_gpus=((0, 1), (2,)), samples_per_microbatch=((3, 1), (4,)),
        num_microbatches=2, memory=(StageMemory(zero=1), StageMemory(recompute=True))))
    plan = Plan.load(plan.export(tmp_path / "plan"))
    priced = price(gpt, cluster, options_for_plan(plan, profiles=()))
    got = simulate_plan(plan, priced)
    by_hand = simulate(priced.costs, priced.devices, options_for_plan(plan, profiles=()),
                       plan.decision(priced.costs))
    assert got.step_time_s == by_hand.step_time_s and got.peak_memory_bytes == by_hand.peak_memory_bytes
    assert [g.predicted_memory_bytes for st in plan.stages for g in st.gpus] == [
        got.peak_memory_bytes[g.gpu] for st in plan.stages for g in st.gpus]
    fp32 = price(gpt, cluster, options_for_plan(plan, profiles=(), precision="fp32"))
    with pytest.raises(ValueError, match=r"priced under fp32 .* but the plan trains in fp16-mixed .*: price it "
                                         r"with options_for_plan\(plan\)"):
        simulate_plan(plan, fp32)
