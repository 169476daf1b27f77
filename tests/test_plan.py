"""Plan IR: JSON round trip, export/load, readable table, bad plan files; schedules."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from fractions import Fraction

import pytest
import torch
from conftest import fixed_plan, small_gpt, with_memory_policy

from zorse_fx.errors import PlanFileError, PlanOptionsError
from zorse_fx.ir.memory import StageMemory
from zorse_fx.ir.schedule import Action, format_grid, inflight, interleave_rounds, make_schedule, validate
from zorse_fx.models.gpt import GPT, GPTConfig
from zorse_fx.plan import PLAN_FORMAT_VERSION, Plan
from zorse_fx.planner import PlanOptions


def _gpt_plan(n_layer: int, cuts, stage_gpus, samples, *, interleave: int = 1, bucket_mib: float = 25.0):
    """A ``fixed_plan`` of ``small_gpt(n_layer)`` on small_hetero.yaml, global
    batch 8 in 2 micro-batches; ``cuts``: the blocks where stages 1.. begin."""
    return fixed_plan(small_gpt(n_layer), stage_gpus, samples, num_microbatches=2, global_batch_size=8, cuts=cuts,
                      interleave=interleave, bucket_mib=bucket_mib)


@pytest.fixture(scope="module")
def plan():
    return _gpt_plan(2, (3,), ((0, 1), (2,)), ((3, 1), (4,)))


def test_json_round_trip(plan, tmp_path):
    path = plan.export(tmp_path / "p")
    loaded = Plan.load(path)
    assert loaded == plan
    assert loaded.sources == plan.sources
    d = json.loads(path.read_text())
    assert d["version"] == PLAN_FORMAT_VERSION == 17
    assert loaded.sources_verified
    assert [s["source_sha256"] for s in d["stages"]] == [hashlib.sha256(src.encode()).hexdigest()
                                                         for src in plan.sources]
    # small_hetero.yaml has T4s (no bfloat16): precision "auto" is fp16-mixed.
    assert (d["precision"], d["grad_reduce_dtype"], d["compute_dtype"]) == ("fp16-mixed", "float32", "float16")
    assert [[g["samples_per_microbatch"] for g in s["gpus"]] for s in d["stages"]] == [[3, 1], [4]]
    assert (tmp_path / "p" / "stage_0.py").read_text().startswith('"""Stage 0 of 2')


def test_memory_breakdown_adds_up_and_is_checked(plan, tmp_path):
    """Each GPU's predicted peak split by what holds it (format 7): fp16-mixed
    keeps 6 B of weights (float32 master + float16 copy), 4 B of gradients and
    8 B of AdamW moments per unique parameter of the stage (the tied embedding
    once); the rest is activations, more on the GPU taking 3 samples than on
    the one taking 1. A version 6 file has none (all 0); parts that do not add
    up are refused, naming the field."""
    for s in plan.stages:
        for g in s.gpus:
            m = g.predicted_memory
            n = s.num_parameters
            assert (m.weights_bytes, m.gradients_bytes, m.optimizer_bytes, m.communication_bytes) == \
                (6 * n, 4 * n, 8 * n, 0)
            assert m.total_bytes == g.predicted_memory_bytes and m.activations_bytes > 0
    a, b = plan.stages[0].gpus
    assert a.predicted_memory.activations_bytes > b.predicted_memory.activations_bytes
    assert "predicted peak memory per rank" in plan.table()
    path = plan.export(tmp_path / "p")
    d = json.loads(path.read_text())
    assert d["stages"][0]["gpus"][0]["predicted_memory"]["weights_bytes"] == 6 * plan.stages[0].num_parameters
    for s in d["stages"]:
        for g in s["gpus"]:
            del g["predicted_memory"]
    path.write_text(json.dumps({**d, "version": 6}))
    old = Plan.load(path)
    assert all(g.predicted_memory.total_bytes == 0 for s in old.stages for g in s.gpus)
    assert "predicted peak memory per rank" not in old.table()
    d["stages"][1]["gpus"][0]["predicted_memory"] = {"weights_bytes": 1, "gradients_bytes": 2, "optimizer_bytes": 0,
                                                     "activations_bytes": 0, "communication_bytes": 0}
    path.write_text(json.dumps(d))
    with pytest.raises(PlanFileError, match=r"field stages\[1\].gpus\[0\].predicted_memory sums to 3 bytes, but "
                                            r"predicted_memory_bytes is \d+; the parts must add up"):
        Plan.load(path)


def test_the_bucket_size_is_priced_and_recorded(plan, tmp_path):
    """``PlanOptions.bucket_mib`` reaches the plan (the runtime's buckets) and the
    planner's price: 2 KiB buckets split the data-parallel stage's 19 KiB of
    float32 gradients (4,800 parameters; the tied embedding is reduced apart)
    into 10 all-reduces, each paying the ring's latencies."""
    small = _gpt_plan(2, (3,), ((0, 1), (2,)), ((3, 1), (4,)), bucket_mib=0.002)
    assert (plan.grad_bucket_bytes, small.grad_bucket_bytes) == (25 * 2**20, 2 * 1024)  # whole KiB
    assert small.stages[0].predicted_allreduce_s > plan.stages[0].predicted_allreduce_s
    assert small.predicted_step_time_s > plan.predicted_step_time_s
    assert Plan.load(small.export(tmp_path / "p")).grad_bucket_bytes == 2 * 1024
    with pytest.raises(PlanOptionsError, match=r"PlanOptions.bucket_mib=0.0: use a number of MiB from 1/1024 \(1 "
                                               r"KiB\) to 2\*\*20 \(the gradient bucket size, e.g. 25; zorse plan "
                                               r"--bucket-mib\)"):
        PlanOptions(global_batch_size=8, bucket_mib=0.0)


def test_memory_options_round_trip(plan, tmp_path):
    """sharded / recompute / state_shard_bytes survive export + load and show in the table."""
    assert [(s.sharded, s.recompute) for s in plan.stages] == [(False, False)] * 2  # defaults
    p2 = with_memory_policy(plan, sharded={0}, recompute={1}, shard_bytes={0: (3 * 2**30, 2**30)})
    loaded = Plan.load(p2.export(tmp_path / "p"))
    assert loaded == p2 != plan
    assert [(s.sharded, s.recompute) for s in loaded.stages] == [(True, False), (False, True)]
    assert [g.state_shard_bytes for g in loaded.stages[0].gpus] == [3 * 2**30, 2**30]
    d = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert d["stages"][1]["recompute"] is True and d["stages"][0]["gpus"][1]["state_shard_bytes"] == 2**30
    text = p2.table()
    for needle in ("optimizer state", "sharded 3.00 GiB (75%)", "sharded 1.00 GiB (25%)", "replicated",
                   "1 (recompute)"):
        assert needle in text, needle
    assert max(len(line) for line in text.splitlines()) <= 150


def test_version_1_plan_reads_with_defaults(plan, tmp_path):
    path = plan.export(tmp_path / "p")
    d = json.loads(path.read_text())
    d["version"] = 1
    for s in d["stages"]:
        del s["sharded"], s["recompute"]
        for g in s["gpus"]:
            del g["state_shard_bytes"]
    path.write_text(json.dumps(d))
    loaded = Plan.load(path)
    # New fields at their defaults (a version-1 plan trained in fp32); read into the current version.
    assert loaded == dataclasses.replace(plan, precision="fp32", grad_reduce_dtype="float32")
    assert loaded.version == PLAN_FORMAT_VERSION
    assert all(not s.sharded and not s.recompute and all(g.state_shard_bytes == 0 for g in s.gpus)
               for s in loaded.stages)


def test_invalid_memory_options_are_named(plan, tmp_path):
    path = with_memory_policy(plan, sharded={0}).export(tmp_path / "p")
    d = json.loads(path.read_text())
    d["stages"][0]["gpus"][1]["state_shard_bytes"] = -5
    path.write_text(json.dumps(d))
    with pytest.raises(PlanFileError, match=r"plan.json: field stages\[0\]\.gpus\[1\]\.state_shard_bytes is -5: "
                                            r"expected `int` >= 0") as e:
        Plan.load(path)
    assert "0 on every GPU of the stage splits it equally" in str(e.value)
    d["stages"][0]["gpus"][1]["state_shard_bytes"] = 0
    d["stages"][1]["recompute"] = "yes"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanFileError, match=r"field stages\[1\]\.recompute is 'yes': expected `bool`, got `str` "
                                            r"\(true or false\)"):
        Plan.load(path)


def _largest_remainder(n, weights):
    """Reference: quotas as exact fractions, floors, then +1 by largest remainder (ties: lower index)."""
    if sum(weights) == 0:
        weights = [1] * len(weights)
    quotas = [Fraction(n * w, sum(weights)) for w in weights]
    sizes = [int(q) for q in quotas]
    for j in sorted(range(len(weights)), key=lambda j: (-(quotas[j] - sizes[j]), j))[: n - sum(sizes)]:
        sizes[j] += 1
    return sizes


@pytest.mark.parametrize(("n", "weights", "expected"), [
    (10, (3, 1), ((0, 8), (8, 10))),            # 7.5 / 2.5: the tie goes to the first GPU
    (10, (1, 1, 1), ((0, 4), (4, 7), (7, 10))),  # equal weights
    (7, (0, 2, 1), ((0, 0), (0, 5), (5, 7))),    # 0 / 4.67 / 2.33: a zero share gets nothing
    (5, (0, 0), ((0, 3), (3, 5))),               # all zero: equal split
    (0, (3, 1), ((0, 0), (0, 0))),
    (9, (4,), ((0, 9),)),
])
def test_shard_ranges_examples(plan, n, weights, expected):
    stage = dataclasses.replace(plan.stages[0], gpus=tuple(
        dataclasses.replace(plan.stages[0].gpus[0], rank=j, state_shard_bytes=w) for j, w in enumerate(weights)))
    assert stage.shard_ranges(n) == expected


def test_shard_ranges_largest_remainder_rule(plan):
    import random

    rng = random.Random(0)
    g0 = plan.stages[0].gpus[0]
    for _ in range(300):
        k = rng.randint(1, 6)
        weights = [rng.choice((0, 0, 1, 3, 7, rng.randint(1, 10**10))) for _ in range(k)]
        n = rng.randint(0, 10**6)
        stage = dataclasses.replace(plan.stages[0], gpus=tuple(
            dataclasses.replace(g0, rank=j, state_shard_bytes=w) for j, w in enumerate(weights)))
        ranges = stage.shard_ranges(n)
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a <= b for a, b in ranges) and all(ranges[j][1] == ranges[j + 1][0] for j in range(k - 1))
        assert [b - a for a, b in ranges] == _largest_remainder(n, weights), (n, weights)
        if any(weights):
            assert all(b == a for (a, b), w in zip(ranges, weights) if w == 0)


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


# --- interleaved 1F1B (Megatron-LM virtual stages) ---

def test_interleaved_schedule_matches_megatron_order():
    """P=2 groups, v=2 chunks, M=4: forwards in rounds of P micro-batches per chunk,
    backwards with the chunks reversed, 2 (P - p - 1) + (v - 1) P warm-up forwards."""
    sched = make_schedule("1f1b", 4, 4, interleave=2)
    assert len(sched) == 2
    assert [str(a) for a in sched[0]] == ["F0", "F1", "F0.1", "F1.1", "F2", "B0.1", "F3", "B1.1",
                                          "F2.1", "B0", "F3.1", "B1", "B2.1", "B3.1", "B2", "B3"]
    assert [str(a) for a in sched[1][:4]] == ["F0", "F1", "F0.1", "B0.1"]  # warm-up 2 = (v - 1) P
    validate(sched, interleave=2)
    with pytest.raises(ValueError, match=r"schedule deadlocks: group 0 step 2 \(F0.1\) waits forever"):
        validate((sched[0], tuple(reversed(sched[1]))), interleave=2)


@pytest.mark.parametrize("groups", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 5])
def test_interleaved_schedules_run_every_stage_once_without_deadlock(groups, chunks):
    """Every micro-batch count M = 1 .. 5 P + 2, multiples of P or not (issue 31 item 5)."""
    for m in range(1, 5 * groups + 3):
        sched = make_schedule("1f1b", groups * chunks, m, interleave=chunks)
        validate(sched, interleave=chunks)
        for acts in sched:
            assert sorted((a.kind, a.chunk, a.microbatch) for a in acts) == sorted(
                (k, c, i) for k in "FB" for c in range(chunks) for i in range(m))
        # In flight at most the warm-up + 1, as in Megatron-LM (all of them when M <= P); the
        # rounds are P micro-batches each when P divides M, the first round's size R0 >= P else.
        r0 = interleave_rounds(groups, m)[0]
        assert r0 == (groups if m % groups == 0 else r0) and (r0 >= groups or m < groups)
        for p, acts in enumerate(sched):
            warm = m * chunks if m <= groups else min(2 * (groups - p - 1) + (chunks - 1) * r0, m * chunks)
            assert inflight(acts) == (min(warm + 1, m * chunks) if chunks > 1 else min(groups - p, m))


def test_interleave_rounds():
    assert [interleave_rounds(4, m) for m in (1, 3, 4, 5, 8, 10, 11, 12)] == [
        (1,), (3,), (4,), (5,), (4, 4), (5, 5), (6, 5), (4, 4, 4)]
    with pytest.raises(ValueError, match=">= 1 micro-batch, got 2 and 0"):
        interleave_rounds(2, 0)


def test_interleaved_schedule_errors_name_the_fix():
    with pytest.raises(ValueError, match="needs schedule '1f1b'"):
        make_schedule("gpipe", 4, 4, interleave=2)
    with pytest.raises(ValueError, match="divide the stage count 5"):
        make_schedule("1f1b", 5, 4, interleave=2)


def test_live_profile_peaks_equal_a_step_by_step_count():
    """The moments ``live_profile`` lists contain the true peak of any chunk weighting."""
    import random

    from zorse_fx.ir.schedule import live_profile

    rng = random.Random(0)
    for groups, chunks, m in ((2, 2, 4), (3, 2, 6), (2, 3, 8), (4, 2, 8)):
        for p in range(groups):
            w = [rng.randint(1, 9) for _ in range(chunks)]
            rerun = [rng.randint(0, 9) for _ in range(chunks)]
            live, peak = [0] * chunks, 0
            for a in make_schedule("1f1b", groups * chunks, m, chunks)[p]:
                if a.kind == "F":
                    live[a.chunk] += 1
                    peak = max(peak, sum(x * y for x, y in zip(live, w)))
                else:
                    peak = max(peak, sum(x * y for x, y in zip(live, w)) + rerun[a.chunk])
                    live[a.chunk] -= 1
            prof = live_profile("1f1b", groups * chunks, m, chunks, p)
            assert peak == max(sum(x * y for x, y in zip(lv, w)) + (rerun[c] if c >= 0 else 0) for lv, c in prof)


@pytest.fixture(scope="module")
def interleaved_plan():
    return _gpt_plan(4, (3, 5, 7), ((0, 1), (2,), (0, 1), (2,)), ((3, 1), (4,), (3, 1), (4,)), interleave=2)


def test_interleaved_plan_round_trip_roles_and_table(interleaved_plan, tmp_path):
    p = interleaved_plan
    assert (p.interleave, p.num_groups, p.num_stages, p.world_size) == (2, 2, 4, 3)
    assert [p.stages_of(r) for r in range(3)] == [(0, 2), (0, 2), (1, 3)]
    assert p.role(1).stages == (0, 2) and (p.role(1).row_start, p.role(1).row_end) == (3, 4)
    assert [g.rank for g in p.stages[2].gpus] == [0, 1]
    assert Plan.load(p.export(tmp_path / "p")) == p
    assert json.loads((tmp_path / "p" / "plan.json").read_text())["interleave"] == 2
    text = p.table()
    assert "interleaved x2 (2 GPU groups" in text and "2 g0" in text and "3 g1" in text
    # A GPU's memory row is its total over its stages: the same in both of its stages.
    assert p.stages[0].gpus[0].predicted_memory_bytes == p.stages[2].gpus[0].predicted_memory_bytes > 0


def test_interleaved_plan_file_errors_are_named(interleaved_plan, tmp_path):
    path = interleaved_plan.export(tmp_path / "p")
    d = json.loads(path.read_text())
    d["stages"][2]["gpus"][0]["samples_per_microbatch"], d["stages"][2]["gpus"][1]["samples_per_microbatch"] = 2, 2
    path.write_text(json.dumps(d))
    with pytest.raises(PlanFileError, match=r"stage 2 must run on the GPUs of stage 0 \(GPU group 0\)"):
        Plan.load(path)
    d = json.loads(path.read_text())
    d["stages"][2]["gpus"][0]["samples_per_microbatch"], d["stages"][2]["gpus"][1]["samples_per_microbatch"] = 3, 1
    d["interleave"] = 3
    path.write_text(json.dumps(d))
    with pytest.raises(PlanFileError, match="interleave 3 must be an integer >= 1 dividing the stage count 4"):
        Plan.load(path)
    d["interleave"], d["schedule"] = 2, "gpipe"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanFileError, match="interleave 2 needs schedule '1f1b'"):
        Plan.load(path)
    d["schedule"], d["num_microbatches"], d["microbatch_size"] = "1f1b", 1, 8
    for s in d["stages"]:
        for g in s["gpus"]:
            g["samples_per_microbatch"] *= 2
    path.write_text(json.dumps(d))
    # One micro-batch on 2 groups: interleaving runs any micro-batch count (issue 31 item 5).
    assert Plan.load(path).num_microbatches == 1


# -- a plan directory runs no code its author did not export -------------------

def _stage_runtime(loaded, plan_dir):
    from zorse_fx.precision import precision_policy
    from zorse_fx.runtime.stage import StageRuntime

    weights = torch.load(plan_dir / "weights.pt", weights_only=True)
    return StageRuntime(loaded, 0, plan_dir, weights, rank=0, device=torch.device("cpu"),
                        precision=precision_policy("fp32"))


@pytest.fixture()
def exported(plan, tmp_path):
    """``plan`` exported with the weights of its model (seed 0, as ``_gpt_plan`` builds it)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, block_size=16))
    plan.export(tmp_path / "p")
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, tmp_path / "p" / "weights.pt")
    return tmp_path / "p"


def test_an_edited_stage_file_is_refused(exported):
    assert _stage_runtime(Plan.load(exported), exported).module is not None  # the exported files run
    stage = exported / "stage_0.py"
    stage.write_text(stage.read_text() + "\nimport os  # an edit after export\n")
    with pytest.raises(PlanFileError, match=r"plan.json: stage 0 source 'stage_0.py' has sha256 [0-9a-f]{16}\.\.\. "
                                            r"but plan.json records [0-9a-f]{16}\.\.\.: the file was changed after "
                                            r"export.*Re-export the plan"):
        Plan.load(exported)


@pytest.mark.parametrize("name", ["/tmp/evil.py", "../stage_0.py", "sub/stage_0.py", ".hidden.py", "stage_0.txt", 7])
def test_a_source_file_outside_the_plan_directory_is_refused(exported, name):
    d = json.loads((exported / "plan.json").read_text())
    d["stages"][0]["source_file"] = name
    (exported / "plan.json").write_text(json.dumps(d))
    with pytest.raises(PlanFileError, match=r"field stages\[0\]\.source_file is .*it must be the plain name of a "
                                            r"Python file beside plan.json"):
        Plan.load(exported)


@pytest.mark.parametrize("value", [None, "abc", "A" * 64])
def test_a_missing_or_malformed_hash_is_refused(exported, value):
    d = json.loads((exported / "plan.json").read_text())
    d["stages"][1]["source_sha256"] = value
    (exported / "plan.json").write_text(json.dumps(d))
    with pytest.raises(PlanFileError, match=r"field stages\[1\]\.source_sha256 is .*not a sha256"):
        Plan.load(exported)


def test_a_plan_file_that_is_not_an_object_is_refused(tmp_path):
    (tmp_path / "plan.json").write_text("[1, 2]")
    with pytest.raises(PlanFileError, match=r"plan.json: a plan file holds a JSON object, not a list"):
        Plan.load(tmp_path)


def test_an_old_plan_without_hashes_loads_but_does_not_run(exported):
    """A version-4 file records no hashes: ``zorse show`` reads it, the
    runtime refuses its stage files until the plan is re-exported."""
    from zorse_fx.errors import RuntimeExecutionError

    d = json.loads((exported / "plan.json").read_text())
    d["version"] = 4
    for s in d["stages"]:
        del s["source_sha256"]
    (exported / "plan.json").write_text(json.dumps(d))
    old = Plan.load(exported)
    assert not old.sources_verified and "zorse_fx plan: model on small_hetero" in old.table()
    with pytest.raises(RuntimeExecutionError, match=r"records no sha256 of its stage sources.*re-export the plan"):
        _stage_runtime(old, exported)
    old.export(exported)  # re-exported after checking: now it runs
    assert _stage_runtime(Plan.load(exported), exported).module is not None


def test_sixteen_bit_working_weights_are_planned_priced_and_checked(tmp_path):
    """A mixed plan whose stage 1 is sharded over 2 GPUs keeps that stage's
    matmul weights in 16 bits (format 8, ``low_precision_params``): not the
    tied embedding, not the norms, nothing on the unsharded stage 0. The
    cost model prices them (12 B/param sharded: float32 master + AdamW
    moments; 2 B all-gathered) and the breakdown gives them 2 B of weights.
    A version 7 file has none; a name the stage does not have, or 16-bit
    weights on an fp32 plan or an unsharded stage, are refused naming the field."""
    from conftest import CLUSTERS, fixed_decision

    from zorse_fx.capture import analyse, low_precision_params
    from zorse_fx.cluster import Cluster
    from zorse_fx.planner import plan_fixed
    from zorse_fx.pricing import price

    captured = small_gpt(2)
    cluster = Cluster.from_yaml(CLUSTERS / "small_hetero.yaml")
    options = PlanOptions(global_batch_size=8)  # T4s: fp16-mixed
    bg = analyse(captured)
    decision = dataclasses.replace(fixed_decision(captured, ((0,), (2, 3)), ((4,), (1, 3)), num_microbatches=2,
                                                  cuts=(3,)), memory=(StageMemory(), StageMemory(zero=1)),
                                   shard_mib=None)
    plan, _ = plan_fixed(captured, cluster, options, decision)
    assert plan.precision == "fp16-mixed"
    s0, s1 = plan.stages
    eligible = low_precision_params(bg)
    assert s0.low_precision_params == ()
    assert s1.low_precision_params == tuple(f for f, c in s1.params.items() if c in eligible) != ()
    assert all(".ln_" not in c and c != "wte.weight" for c in eligible)
    state = captured.state()
    n, n16 = s1.num_parameters, sum(state[s1.params[f]].numel() for f in s1.low_precision_params)
    for g in s1.gpus:
        m = g.predicted_memory
        assert (m.weights_bytes, m.gradients_bytes, m.optimizer_bytes) == (
            6 * (n - n16) + 2 * n16, 4 * n, g.state_shard_bytes)
    costs = price(captured, cluster, options).costs
    assert sum(costs.param16_count) == sum(state[c].numel() for c in eligible)
    b = next(b for b in range(costs.num_blocks) if costs.param16(b))
    p, q = costs.param_count[b], costs.param16(b)
    assert costs.shardable_bytes(b) == 8 * (p - q) + 12 * q and costs.gather_bytes(b) == 4 * (p - q) + 2 * q
    assert Plan.load(plan.export(tmp_path / "p")) == plan
    table = plan.table()
    assert table.count("16-bit") == 3 and "16-bit working weights on stage 1 (12 matmul weights in float16" in table

    # Simulated as each plan keeps its weights: a sharded stage without the list (format 7, or edited) holds
    # float32 weights, 4 B more per 16-bit weight than the 2 B the 16-bit layout replicates.
    from zorse_fx.pricing import options_for_plan, simulate_plan

    fp32_weights = dataclasses.replace(plan, stages=(s0, dataclasses.replace(s1, low_precision_params=())))
    priced = price(captured, cluster, options_for_plan(plan))
    sim16, sim32 = simulate_plan(plan, priced), simulate_plan(fp32_weights, priced)
    for g in s1.gpus:  # (the shards are the plan's whole MiB in both; state rounded up to KiB per block)
        diff = sim32.peak_memory_bytes[g.gpu] - sim16.peak_memory_bytes[g.gpu]
        assert abs(diff - 4 * n16) <= 1024 * (s1.blocks[1] - s1.blocks[0]), (diff, 4 * n16)
    path = tmp_path / "p" / "plan.json"
    d = json.loads(path.read_text())
    old = json.loads(json.dumps(d))
    for st in old["stages"]:
        del st["low_precision_params"]
    path.write_text(json.dumps({**old, "version": 7}))
    assert all(st.low_precision_params == () for st in Plan.load(path).stages)
    for edit, message in (
            (lambda d: d["stages"][1]["low_precision_params"].append("nope"),
             r"field stages\[1\].low_precision_params names \['nope'\], which is not among the stage's parameters"),
            (lambda d: d["stages"][1].update(sharded=False),
             r"field stages\[1\].low_precision_params lists \d+ parameter\(s\), but 16-bit working weights need a "
             r"mixed precision and a sharded stage of two or more GPUs \(precision 'fp16-mixed', sharded False, "
             r"2 GPU\(s\)\); set it to \[\]"),
            (lambda d: d.update(precision="fp32", grad_reduce_dtype="float32", compute_dtype="float32"),
             r"precision 'fp32', sharded True")):
        bad = json.loads(json.dumps(d))
        edit(bad)
        path.write_text(json.dumps(bad))
        with pytest.raises(PlanFileError, match=message):
            Plan.load(path)


def test_solver_verdict_says_what_is_proven():
    """Issue 32 item 3: "proven optimal" only for a CP-SAT optimum returned as
    it is (and over CP-SAT's model); an interleaved or heuristic plan is "the
    best plan found"; every plan gets its distance to the throughput bound,
    named as a bound no plan beats."""
    from zorse_fx.plan import SolverReport

    def report(status, bound=2.0):
        return SolverReport(planner="cpsat", status=status, objective_s=3.0, best_bound_s=3.0, optimality_gap=0.0,
                            wall_s=1.0, throughput_bound_s=bound)

    assert report("OPTIMAL").verdict(3.0).startswith("proven optimal among the plans of CP-SAT's model")
    assert "50% slower than the throughput bound 2.000 s" in report("OPTIMAL").verdict(3.0)
    inter = report("OPTIMAL+INTERLEAVED").verdict(2.5)
    assert inter.startswith("the best plan found (OPTIMAL+INTERLEAVED)") and "proven" not in inter
    assert "25% slower than the throughput bound" in inter and "no plan of these options is faster" in inter
    assert report("STAGE_DP", bound=0.0).verdict(3.0) == "the best plan found (STAGE_DP)"


def test_export_into_existing_plan_dir_removes_stale_stage_files(plan, tmp_path):
    """Plan.export over a plan of more stages: the old stage_<i>.py it does not
    write are removed (they would sit beside a plan.json that does not name
    them), the weights kept (a re-export in place of a loaded plan keeps
    them); a directory holding other files is refused in one line."""
    from zorse_fx.errors import PlanDirectoryError

    d = tmp_path / "p"
    plan.export(d)
    (d / "weights.pt").write_bytes(b"weights")
    one = _gpt_plan(2, (), ((0, 1),), ((3, 1),))
    assert one.num_stages == 1
    assert one.export(d) == d / "plan.json"
    assert sorted(p.name for p in d.iterdir()) == ["plan.json", "stage_0.py", "weights.pt"]
    assert Plan.load(d) == one and (d / "weights.pt").read_bytes() == b"weights"
    Plan.load(d).export(d)  # in place
    assert sorted(p.name for p in d.iterdir()) == ["plan.json", "stage_0.py", "weights.pt"]
    (d / "notes.txt").write_text("mine")
    with pytest.raises(PlanDirectoryError, match=re.escape(
            f"{d} is not a plan directory: it holds notes.txt (a plan directory holds only plan.json, stage_<i>.py, "
            f"weights.pt, hf_config.json, plan_request.json, cluster.yaml and simulate/), which writing a plan there "
            f"would replace; give a new or empty directory for the plan")):
        plan.export(d)
    assert Plan.load(d) == one and not (d / "stage_1.py").exists()
