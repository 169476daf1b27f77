"""Plan IR: JSON round trip, export/load, readable table, bad plan files; schedules."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import CLUSTERS
from zorse_fx.capture import analyse, capture
from zorse_fx.cluster import Cluster
from zorse_fx.errors import PlanFileError
from zorse_fx.models.gpt import GPT, GPTConfig
from zorse_fx.plan import Plan
from zorse_fx.planner import PlanOptions, plan_fixed
from zorse_fx.runtime.schedule import Action, format_grid, inflight, make_schedule, validate


@pytest.fixture(scope="module")
def plan():
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 16))
    captured = capture(GPT(GPTConfig(n_layer=2, n_embd=32, block_size=16)), (ids, ids))
    nb = analyse(captured).num_blocks
    p, _ = plan_fixed(captured, Cluster.from_yaml(CLUSTERS / "small_hetero.yaml"), PlanOptions(global_batch_size=8),
                      stage_blocks=((0, 3), (3, nb)), stage_gpus=((0, 1), (2,)),
                      samples_per_microbatch=((3, 1), (4,)), num_microbatches=2)
    return p


def test_json_round_trip(plan, tmp_path):
    path = plan.export(tmp_path / "p")
    loaded = Plan.load(path)
    assert loaded == plan
    assert loaded.sources == plan.sources
    d = json.loads(path.read_text())
    assert d["version"] == 1
    assert [[g["samples_per_microbatch"] for g in s["gpus"]] for s in d["stages"]] == [[3, 1], [4]]
    assert (tmp_path / "p" / "stage_0.py").read_text().startswith('"""Stage 0 of 2')


def test_roles_and_ranges(plan):
    assert plan.world_size == 3
    assert plan.role(1).row_start == 3 and plan.role(1).row_end == 4
    assert plan.role(2).stage == 1
    assert plan.shared_params() == {"wte.weight": (0, 1)}


def test_table_is_readable(plan):
    text = plan.table()
    for needle in ("stage", "A100-40GB", "T4", "3/4", "1/4", "predicted step time", "micro-batches"):
        assert needle in text


def test_bad_plan_files(plan, tmp_path):
    path = plan.export(tmp_path / "p")
    d = json.loads(path.read_text())
    d["version"] = 99
    path.write_text(json.dumps(d))
    with pytest.raises(PlanFileError, match="plan format version 99 is not supported"):
        Plan.load(path)
    path.write_text("{ not json")
    with pytest.raises(PlanFileError, match="invalid JSON at line 1"):
        Plan.load(path)
    with pytest.raises(PlanFileError, match="no such plan file"):
        Plan.load(tmp_path / "missing")
    d["version"] = 1
    d["stages"][0]["gpus"][0]["samples_per_microbatch"] = 2
    plan.export(tmp_path / "q")
    (tmp_path / "q" / "plan.json").write_text(json.dumps(d))
    with pytest.raises(PlanFileError, match=r"stage 0 GPUs take \[2, 1\] samples \(sum 3\) but microbatch_size is 4"):
        Plan.load(tmp_path / "q")


def test_1f1b_schedule_shape():
    sched = make_schedule("1f1b", 3, 4)
    assert [str(a) for a in sched[0]] == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    assert [str(a) for a in sched[2]] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert [inflight(s) for s in sched] == [3, 2, 1]
    assert [inflight(s) for s in make_schedule("gpipe", 3, 4)] == [4, 4, 4]
    validate(sched)


def test_deadlocking_schedule_is_marked():
    bad = (
        (Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)),
        (Action("F", 1), Action("B", 1), Action("F", 0), Action("B", 0)),
    )
    with pytest.raises(ValueError, match="stage 0 step 1 \\(B0\\) waits forever") as e:
        validate(bad)
    assert ">B0<" in str(e.value)
    assert "stage |" in format_grid(bad)


def test_rank_entry_point_does_not_import_ortools():
    """A rank reads plan.json and stage sources only; OR-Tools stays on the planning side."""
    import subprocess
    import sys

    code = "import sys, zorse_fx.train; assert 'ortools' not in sys.modules, 'ortools imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
