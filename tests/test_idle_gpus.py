"""Idle GPUs said aloud (``Plan.idle_gpus``, ``zorse_fx/idle.py``): the plan names the GPUs it leaves idle,
the predicted step of the best plan scored that uses them and why that one is slower; plan.json round trip;
a bad value named; ``--use-all-gpus`` (``allow_idle_gpus=False``) says nothing."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from zorse_fx.capture import capture
from zorse_fx.cluster import Cluster
from zorse_fx.errors import PlanFileError
from zorse_fx.idle import FALLBACK_BASELINES, idle_gpus
from zorse_fx.models.gpt import GPT, GPTConfig
from zorse_fx.options import PlanOptions
from zorse_fx.plan import Plan
from zorse_fx.planner import plan_captured, solve_plan
from zorse_fx.pricing import price

#: Two A100s on NVLink and one T4 behind a 1 Gb/s link: the best plan leaves the T4 idle.
SLOW_T4 = {
    "name": "one_slow_t4",
    "nodes": [{"name": "a100-node", "gpus": [{"type": "A100-40GB", "count": 2}],
               "intra_node": {"bandwidth_GBps": 300, "latency_us": 5}},
              {"name": "t4-node", "gpus": [{"type": "T4", "count": 1}]}],
    "links": {"intra_node": {"bandwidth_GBps": 16, "latency_us": 10},
              "inter_node": {"bandwidth_GBps": 0.125, "latency_us": 50}},
}


@pytest.fixture(scope="module")
def captured():
    """A GPT of 4 layers, 128 wide, 32 tokens (seed 0): enough work for both A100s, not for the T4."""
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 32))
    return capture(GPT(GPTConfig(n_layer=4, n_embd=128, block_size=32)), (ids, ids))


def _plan(captured, **options) -> Plan:
    cluster = Cluster.from_dict(SLOW_T4)
    plan, _ = plan_captured(captured, cluster, PlanOptions(global_batch_size=64, **options), model_name="gpt",
                            label_mode="shifted")
    return plan


@pytest.fixture(scope="module")
def plan(captured) -> Plan:
    return _plan(captured)


def test_the_idle_t4_is_named_with_the_slower_plan_that_uses_it(plan):
    used = {g.gpu for s in plan.stages for g in s.gpus}
    assert used == {0, 1}  # both A100s; the T4 idle
    idle = plan.idle_gpus
    assert [(g.gpu, g.node, g.gpu_type) for g in idle.gpus] == [(2, "t4-node", "T4")]
    assert idle.all_gpus_step_time_s >= plan.predicted_step_time_s
    assert idle.all_gpus_source  # the planner part that made it ("BASELINE:<name>", "STAGE_DP", ...)
    # The reason names the T4's link (its stage's sync, or the boundary to it) or the T4 itself.
    assert "a100-node <-> t4-node" in idle.reason or "T4 @ t4-node" in idle.reason, idle.reason
    line = next(row for row in plan.table().splitlines() if row.startswith("idle: "))
    assert line.startswith("idle: 1 x T4 (node t4-node) -- the best plan scored that uses them: ")
    assert f"({idle.all_gpus_step_time_s / plan.predicted_step_time_s - 1:+.0%}, {idle.all_gpus_source})" in line


def test_idle_gpus_round_trip_and_a_bad_value_is_named(plan, tmp_path):
    path = plan.export(tmp_path / "p")
    loaded = Plan.load(path)
    assert loaded == plan and loaded.idle_gpus == plan.idle_gpus
    good = path.read_text()
    d = json.loads(good)
    assert d["idle_gpus"]["gpus"] == [{"gpu": 2, "node": "t4-node", "gpu_type": "T4"}]
    for field, value, words in (
            ("all_gpus_step_time_s", -1.0, "field idle_gpus.all_gpus_step_time_s is -1.0"),
            ("gpus", [], "field idle_gpus.gpus is []"),
            ("gpus", [{"gpu": 0, "node": "a100-node", "gpu_type": "A100-40GB"}],
             "field idle_gpus.gpus[0].gpu is 0, but stage 0 runs on GPU 0")):
        bad = json.loads(good)
        bad["idle_gpus"][field] = value
        path.write_text(json.dumps(bad))
        with pytest.raises(PlanFileError) as err:
            Plan.load(path)
        assert str(path) in str(err.value) and words in str(err.value), str(err.value)
    # A file of version 15 (before the field) loads without it.
    old = json.loads(good)
    old.pop("idle_gpus")
    old["version"] = 15
    path.write_text(json.dumps(old))
    assert Plan.load(path).idle_gpus is None


def test_use_all_gpus_plans_say_nothing(captured):
    every = _plan(captured, allow_idle_gpus=False)
    assert {g.gpu for s in every.stages for g in s.gpus} == {0, 1, 2}
    assert every.idle_gpus is None and "idle: " not in every.table()
    assert json.loads(json.dumps(every.to_dict()))["idle_gpus"] is None


def test_without_a_scored_all_gpu_plan_one_is_planned_or_why_none_fits_is_said(captured):
    cluster = Cluster.from_dict(SLOW_T4)
    options = PlanOptions(global_batch_size=64, planner="stage_dp")  # no portfolio: no plan in hand
    priced = price(captured, cluster, options)
    result = solve_plan(priced.costs, priced.devices, options)
    assert result.all_gpus is None and len({g for gs in result.decision.stage_gpus for g in gs}) == 2
    report = idle_gpus(priced.costs, priced.devices, options, result, cluster)
    # The linear-cost baselines with every GPU in use: one of them fits.
    assert report.all_gpus_source in {f"BASELINE:{name}" for name in FALLBACK_BASELINES}
    assert report.all_gpus_step_time_s >= result.predicted_step_time_s
    # Two samples cannot give three GPUs of one stage work: no baseline fits, the stage DP says why none can.
    one = dataclasses.replace(options, global_batch_size=2, max_stages=1)
    result = solve_plan(priced.costs, priced.devices, one)
    report = idle_gpus(priced.costs, priced.devices, one, result, cluster)
    assert report.all_gpus_step_time_s is None and report.all_gpus_source == ""
    assert report.reason == ("no plan using every GPU fits: allow_idle_gpus=False: each of the 3 GPUs must take >= 1 "
                             "sample of every micro-batch, but at most 1 stage x 2 samples = 2 GPUs can be busy")
