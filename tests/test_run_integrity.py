"""Runs that cannot mix or rot unseen, and steps that are not finite.

One run directory per run ([Note: one run per directory] in
``runtime/run_dir.py``): a fresh run into another run's directory is refused
(``--overwrite`` replaces it), every metrics record and checkpoint manifest
carries the run's id, ``--resume`` of a finished run says so and exits 0.
Checkpoints are verified before a resume ([Note: checkpoint integrity] in
``runtime/checkpoint.py``): a truncated, missing or bit-flipped file (DCP's
``.metadata`` too, under either manifest version) is named in one line and
the newest intact checkpoint is used. A checkpoint of another run is never
resumed ([Note: checkpoints bound to their run] in ``runtime/run_dir.py``). A step whose loss or
gradients are not finite stops every rank ([Note: non-finite steps] in
``runtime/worker.py``) with a non-zero exit and no checkpoint of it.

Five rank launches (2 Gloo ranks each, under a second apiece after the
first): the module's run (4 steps, an inf gradient at step 4), a resume of it
that finds nothing to train, one past a bit-flipped checkpoint, a run from
NaN weights, and one `zorse train --resume` (torchrun) past a missing
``.metadata``. Everything else works on copies of the first run's
directory, in this process (rank 0's start decision is a plain function).
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from conftest import fixed_plan, gpt3x64, spawn_ranks
from test_training_loop import _export
from zorse_fx.cli import main as zorse_main
from zorse_fx.errors import CheckpointDamagedError, RunDirectoryError
from zorse_fx.plan import Plan
from zorse_fx.runtime.checkpoint import MANIFEST, list_checkpoints, read_manifest, verify_checkpoint
from zorse_fx.runtime.run_dir import check_fresh_start, plan_hash
from zorse_fx.train import EXIT_NONFINITE, _decide_start, _metrics_file
from zorse_fx.train_options import CheckpointOptions, OptionValueError

pytestmark = pytest.mark.xdist_group("run_integrity")  # one worker computes the module's run once


def _plan():
    """2 stages on 2 GPUs (cut in the middle), global batch 4 in 2 micro-batches."""
    return fixed_plan(gpt3x64(), ((0,), (1,)), ((2,), (2,)), num_microbatches=2, global_batch_size=4)


def _failed_ranks(exc: AssertionError) -> dict[int, tuple[int, str]]:
    """spawn_ranks's failure report -> {rank: (exit code, output tail)}."""
    parts = re.split(r"^--- rank (\d+) \(exit code (-?\d+)\) ---$", str(exc), flags=re.M)
    return {int(parts[i]): (int(parts[i + 1]), parts[i + 2]) for i in range(1, len(parts), 3)}


@pytest.fixture(scope="module")
def stopped_run(lee_bytes, tmp_path_factory):
    """4 steps with a checkpoint after each; rank 1 writes an inf into a
    gradient at step 4 (fp32: no loss scaler to skip it). Returns (the
    export directory, the common train arguments, the run directory, the
    ranks' {rank: (exit code, output)})."""
    d = tmp_path_factory.mktemp("integrity")
    common = _export(_plan(), gpt3x64(), lee_bytes, d)
    run = d / "run"
    with pytest.raises(AssertionError) as got:
        spawn_ranks(d / "plan", 2, [*common[1:], "--steps", "4", "--out", str(run), "--checkpoint-every", "1",
                                    "--inject-inf", "1:4"])
    return d, common, run, _failed_ranks(got.value)


def _copy(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def _biggest_shard(ckpt):
    return max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)


# -- non-finite steps ---------------------------------------------------------------

def test_inf_gradient_stops_run_keeping_last_checkpoint(stopped_run):
    """Every rank exits with EXIT_NONFINITE after step 4; rank 0 names the
    step, the rank and the stage in one line; step_3 (the last good one) is
    the newest checkpoint, no step_4 was written; metrics.jsonl has step 4."""
    d, _, run, ranks = stopped_run
    assert {r: code for r, (code, _) in ranks.items()} == {0: EXIT_NONFINITE, 1: EXIT_NONFINITE}
    root = run / "checkpoints"
    want = (f"zorse: step 4 is not finite: non-finite gradients on rank 1 (stage 1); stopped without an optimizer "
            f"step or a checkpoint of it (the last checkpoint is {root / 'step_3'})")
    assert want in ranks[0][1].splitlines()
    assert "Traceback" not in ranks[0][1] + ranks[1][1]
    assert [s for s, _ in list_checkpoints(root)] == [1, 2, 3]
    assert not list(root.glob("step_4*"))
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[3]["grad_norm"] == float("inf")


def test_nan_weights_stop_run_nonzero_exit(stopped_run, lee_bytes, tmp_path):
    """A NaN in a weight of stage 0 (rank 0): step 1's loss is NaN; every
    rank stops after it with EXIT_NONFINITE, the line naming the loss, the
    gradients and the weights with their ranks and stages."""
    d, common, _, _ = stopped_run
    weights = {k: v.clone() for k, v in torch.load(d / "plan" / "weights.pt").items()}
    weights["h.0.mlp.c_fc.weight"][3, 5] = float("nan")
    torch.save(weights, tmp_path / "nan.pt")
    run = tmp_path / "nan"
    with pytest.raises(AssertionError) as got:
        spawn_ranks(d / "plan", 2, [*common[1:], "--weights", str(tmp_path / "nan.pt"), "--steps", "3",
                                    "--out", str(run), "--checkpoint-every", "1"])
    ranks = _failed_ranks(got.value)
    assert {r: code for r, (code, _) in ranks.items()} == {0: EXIT_NONFINITE, 1: EXIT_NONFINITE}
    want = ("zorse: step 1 is not finite: loss nan on rank 1 (stage 1); non-finite gradients on rank 0 (stage 0), "
            "rank 1 (stage 1); non-finite weights on rank 0 (stage 0); stopped without an optimizer step or a "
            "checkpoint of it (no checkpoint was written)")
    assert want in ranks[0][1].splitlines()
    assert list_checkpoints(run / "checkpoints") == []
    assert [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()] == [1]


# -- the run's identity ----------------------------------------------------------------

def test_metrics_records_carry_run_id(stopped_run):
    """Every metrics record and every manifest carries the same run id (16
    hex digits) and the plan's hash."""
    d, _, run, _ = stopped_run
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    ids = {r["run_id"] for r in rows} | {read_manifest(c)["run_id"] for _, c in list_checkpoints(run / "checkpoints")}
    assert len(ids) == 1 and re.fullmatch(r"[0-9a-f]{16}", ids.pop())
    want = plan_hash(Plan.load(d / "plan"))
    assert {r["plan_hash"] for r in rows} == {want}
    assert {read_manifest(c)["plan_hash"] for _, c in list_checkpoints(run / "checkpoints")} == {want}


def test_manifest_records_size_and_sha256_of_every_file(stopped_run):
    import hashlib

    _, _, run, _ = stopped_run
    for _, ckpt in list_checkpoints(run / "checkpoints"):
        files = read_manifest(ckpt)["files"]
        assert set(files) == {p.name for p in ckpt.iterdir() if p.name != MANIFEST}
        assert ".metadata" in files and any(n.endswith(".distcp") for n in files)
        for name, rec in files.items():
            data = (ckpt / name).read_bytes()
            assert rec == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        assert verify_checkpoint(ckpt)["step"] == int(ckpt.name.removeprefix("step_"))


def test_resumed_metrics_keep_only_this_runs_earlier_steps(tmp_path):
    """A resume at step 2 of run "a" keeps a's steps 1-2 (and lines of no run
    id, from before run ids), drops a's later steps, another run's lines
    and a line cut short."""
    lines = [{"step": 1, "run_id": "a"}, {"step": 1, "run_id": "b"}, {"step": 2}, {"step": 2, "run_id": "a"},
             {"step": 3, "run_id": "a"}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 4, "ru')
    _metrics_file(tmp_path, 2, "a").close()
    kept = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == [{"step": 1, "run_id": "a"}, {"step": 2}, {"step": 2, "run_id": "a"}]


# -- one run per directory ----------------------------------------------------------------

def test_fresh_run_into_other_runs_dir_refuses(stopped_run, tmp_path, capsys):
    """`zorse train` without --resume into the run's directory: one `zorse:`
    line naming the directory and what it holds, --overwrite and --resume;
    nothing is started or changed. The ranks refuse alike."""
    d, common, run, _ = stopped_run
    out = _copy(run, tmp_path)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    run_id = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["run_id"]
    want = (f"zorse: {out} holds another run's checkpoints step_1, step_2, step_3 and metrics.jsonl (4 records, run "
            f"{run_id}); pass --overwrite to replace that run or --resume to continue it (or choose another --out)")
    assert zorse_main(["train", *common, "--steps", "2", "--out", str(out)]) == 1
    assert capsys.readouterr().err.splitlines() == [want]
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    start = _decide_start(out, CheckpointOptions(), 2, 0)
    assert (start.kind, start.lines) == ("refused", (want,))
    with pytest.raises(RunDirectoryError):
        check_fresh_start(out, overwrite=False)
    assert check_fresh_start(tmp_path / "empty", overwrite=False) is None


def test_overwrite_replaces_old_run(stopped_run, tmp_path):
    """--overwrite: the old run's checkpoints and metrics.jsonl are removed
    (other files kept), the new run gets a new id; --overwrite with --resume
    is refused."""
    _, _, run, _ = stopped_run
    out = _copy(run, tmp_path)
    old_id = read_manifest(out / "checkpoints" / "step_3")["run_id"]
    (out / "train_options.json").write_text("{}")
    start = _decide_start(out, CheckpointOptions(overwrite=True), 2, 0)
    assert start.kind == "fresh" and re.fullmatch(r"[0-9a-f]{16}", start.run_id) and start.run_id != old_id
    assert len(start.lines) == 1 and start.lines[0].startswith(
        "[zorse] --overwrite: removed the earlier run's checkpoints step_1, step_2, step_3 and metrics.jsonl")
    assert list((out / "checkpoints").iterdir()) == [] and not (out / "metrics.jsonl").exists()
    assert (out / "train_options.json").exists()
    with pytest.raises(OptionValueError, match="--overwrite: not allowed with argument --resume"):
        CheckpointOptions(resume=True, overwrite=True)


def test_resume_without_checkpoint_of_other_runs_metrics_refuses(stopped_run, tmp_path):
    """--resume where only another run's metrics.jsonl is left (no
    checkpoint): refused, not started at step 1 beside those metrics; a
    torchrun restart before the first checkpoint starts anew."""
    _, _, run, _ = stopped_run
    out = _copy(run, tmp_path)
    shutil.rmtree(out / "checkpoints")
    start = _decide_start(out, CheckpointOptions(resume=True), 5, 0)
    run_id = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["run_id"]
    assert start.lines == (f"zorse: {out} holds a run's metrics.jsonl (4 records, run {run_id}) but no checkpoint to "
                           f"resume it from (that run stopped before writing one); pass --overwrite instead of --resume "
                           f"to start it anew",)
    assert start.kind == "refused"
    assert _decide_start(out, CheckpointOptions(), 5, 1).kind == "fresh"


def test_resume_finished_run_exits_0(stopped_run, tmp_path, capsys):
    """--resume with --steps 3 of a run whose newest checkpoint is step_3:
    one line, every rank exits 0 (no UnboundLocalError), nothing written."""
    d, common, run, _ = stopped_run
    out = _copy(run, tmp_path)
    metrics = (out / "metrics.jsonl").read_text()
    spawn_ranks(d / "plan", 2, [*common[1:], "--steps", "3", "--out", str(out), "--resume"])
    want = (f"[zorse] nothing to train: the newest checkpoint {out / 'checkpoints' / 'step_3'} is at step 3, the "
            f"final step (--steps 3); pass a larger --steps to train on")
    assert want in capsys.readouterr().out.splitlines()
    assert (out / "metrics.jsonl").read_text() == metrics
    assert _decide_start(out, CheckpointOptions(resume=True), 2, 0).lines[-1].endswith(
        "is at step 3, past the final step (--steps 2); pass a larger --steps to train on")


# -- damaged checkpoints ------------------------------------------------------------------

def test_bitflipped_shard_falls_back_to_previous_checkpoint(stopped_run, tmp_path):
    """One bit of step_3's largest shard flipped: --resume names the file and
    the problem in one line, sets step_3 aside (step_3.damaged) and resumes
    from step_2 with the run's id."""
    _, _, run, _ = stopped_run
    out = _copy(run, tmp_path)
    root = out / "checkpoints"
    shard = _biggest_shard(root / "step_3")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    start = _decide_start(out, CheckpointOptions(resume=True), 6, 0)
    assert (start.kind, start.step, start.run_id) == ("resume", 2, read_manifest(root / "step_2")["run_id"])
    (line,) = start.lines
    assert re.fullmatch(rf"\[zorse\] checkpoint {re.escape(str(root / 'step_3'))} is damaged: file {shard.name} has "
                        rf"sha256 [0-9a-f]{{12}}\.\.\., the manifest records [0-9a-f]{{12}}\.\.\. \(its bytes changed "
                        rf"since it was written\); set aside as step_3\.damaged", line), line
    assert [s for s, _ in list_checkpoints(root)] == [1, 2] and (root / "step_3.damaged").is_dir()


def test_resume_past_a_bitflipped_checkpoint_continues_the_run(stopped_run, tmp_path, capsys):
    """The ranks resume from step_2 when step_3 is flipped: the line names the
    damaged file, the resume line says it is the newest intact checkpoint;
    step 3 is trained again with the same loss, the same run id, and the new
    checkpoints are kept (step_3.damaged left aside)."""
    d, common, run, _ = stopped_run
    out = _copy(run, tmp_path)
    root = out / "checkpoints"
    shard = _biggest_shard(root / "step_3")
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01
    shard.write_bytes(bytes(data))
    before = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    spawn_ranks(d / "plan", 2, [*common[1:], "--steps", "4", "--out", str(out), "--resume", "--checkpoint-every", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert any(ln.startswith(f"[zorse] checkpoint {root / 'step_3'} is damaged: file {shard.name} has sha256 ")
               and ln.endswith("; set aside as step_3.damaged") for ln in lines)
    assert f"[zorse] resumed from {root / 'step_2'} (step 2, written on 2 ranks), the newest intact checkpoint" in lines
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert {r["run_id"] for r in rows} == {before[0]["run_id"]}
    assert rows[2]["loss"] == before[2]["loss"]
    assert [s for s, _ in list_checkpoints(root)] == [2, 3, 4] and (root / "step_3.damaged").is_dir()


def test_truncated_shard_named_in_one_line(stopped_run, tmp_path):
    _, _, run, _ = stopped_run
    ckpt = _copy(run, tmp_path) / "checkpoints" / "step_3"
    shard = _biggest_shard(ckpt)
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 3)
    with pytest.raises(CheckpointDamagedError) as got:
        verify_checkpoint(ckpt)
    assert str(got.value) == (f"checkpoint {ckpt} is damaged: file {shard.name} has {size // 3} bytes, the manifest "
                              f"records {size} (truncated)")
    assert (got.value.path, got.value.file) == (str(ckpt), shard.name)


def test_missing_shard_and_unreadable_manifest_named(stopped_run, tmp_path):
    _, _, run, _ = stopped_run
    root = _copy(run, tmp_path) / "checkpoints"
    shard = _biggest_shard(root / "step_3")
    shard.unlink()
    with pytest.raises(CheckpointDamagedError, match=rf"^checkpoint {re.escape(str(root / 'step_3'))} is damaged: "
                                                     rf"file {shard.name} is missing$"):
        verify_checkpoint(root / "step_3")
    (root / "step_2" / MANIFEST).write_text('{"format": "zorse_fx.checkpoint", "version": 2, "step": ')
    with pytest.raises(CheckpointDamagedError) as got:
        verify_checkpoint(root / "step_2")
    assert str(got.value).startswith(f"checkpoint {root / 'step_2'} is damaged: its manifest does not read (")
    assert "\n" not in str(got.value) and got.value.file == MANIFEST


def test_all_checkpoints_damaged_refuses_resume(stopped_run, tmp_path):
    """No intact checkpoint: each damaged one is named, then one line says
    there is nothing to resume; nothing is set aside."""
    _, _, run, _ = stopped_run
    out = _copy(run, tmp_path)
    root = out / "checkpoints"
    for _, ckpt in list_checkpoints(root):
        _biggest_shard(ckpt).unlink()
    start = _decide_start(out, CheckpointOptions(resume=True), 6, 0)
    assert start.kind == "refused" and len(start.lines) == 4
    assert [ln.split(" is damaged")[0] for ln in start.lines[:3]] == [
        f"zorse: checkpoint {root / f'step_{k}'}" for k in (3, 2, 1)]
    assert start.lines[3] == (f"zorse: no intact checkpoint in {root} to resume; pass --overwrite instead of "
                              f"--resume to start the run anew")
    assert [s for s, _ in list_checkpoints(root)] == [1, 2, 3]


# -- checkpoints bound to their run ([Note: checkpoints bound to their run] in runtime/run_dir.py) -----------------

def _foreign_checkpoint(root, step, run_id="b" * 16, source="step_3"):
    """A copy of ``source`` as ``step_<step>`` whose manifest says another run wrote it (its files still intact)."""
    new = root / f"step_{step}"
    shutil.copytree(root / source, new)
    doc = json.loads((new / MANIFEST).read_text())
    doc.update(step=step, run_id=run_id)
    (new / MANIFEST).write_text(json.dumps(doc))
    return new


def test_other_runs_checkpoint_refused_not_resumed(stopped_run, tmp_path, capsys):
    """Another run's step_5 placed in this run's checkpoints: --resume (the
    ranks' start decision, and zorse train before any rank starts) refuses
    it in one line naming it, its run id, this run's id and the fix; nothing
    is resumed, set aside or deleted (metrics.jsonl untouched). Moved out,
    the run resumes from its own newest checkpoint with its own id."""
    d, common, run, _ = stopped_run
    out = _copy(run, tmp_path)
    root = out / "checkpoints"
    this = read_manifest(root / "step_3")["run_id"]
    foreign = _foreign_checkpoint(root, 5)
    metrics = (out / "metrics.jsonl").read_text()
    want = (f"zorse: checkpoint {foreign} was written by run {'b' * 16}, but {out} holds run {this} (its "
            f"metrics.jsonl); resuming it would continue the other run and drop this run's metrics: move step_5 out "
            f"of {root} to resume run {this} from its own newest checkpoint, or pass --overwrite instead of --resume "
            f"to start anew")
    start = _decide_start(out, CheckpointOptions(resume=True), 8, 0)
    assert (start.kind, start.lines) == ("refused", (want,))
    assert _decide_start(out, CheckpointOptions(), 8, 1).kind == "refused"  # a torchrun restart alike
    assert zorse_main(["train", *common, "--steps", "8", "--out", str(out), "--resume"]) == 1
    assert capsys.readouterr().err.splitlines() == [want]
    assert (out / "metrics.jsonl").read_text() == metrics
    assert [s for s, _ in list_checkpoints(root)] == [1, 2, 3, 5]
    shutil.move(foreign, tmp_path / "step_5")
    start = _decide_start(out, CheckpointOptions(resume=True), 8, 0)
    assert (start.kind, start.step, start.run_id, start.lines) == ("resume", 3, this, ())
    _metrics_file(out, start.step, start.run_id).close()  # steps 1-3 of this run kept (step 4 is trained again)
    assert (out / "metrics.jsonl").read_text().splitlines() == metrics.splitlines()[:3]


def test_other_runs_checkpoint_without_metrics_refused(stopped_run, tmp_path):
    """No metrics.jsonl names the run and the checkpoints disagree (step_5 of
    run b, steps 1-3 of this run): refused, naming both runs' checkpoints.
    Checkpoints of one run alone (or of no run id, version 1) are resumed."""
    _, _, run, _ = stopped_run
    out = _copy(run, tmp_path)
    root = out / "checkpoints"
    this = read_manifest(root / "step_3")["run_id"]
    (out / "metrics.jsonl").unlink()
    _foreign_checkpoint(root, 5)
    start = _decide_start(out, CheckpointOptions(resume=True), 8, 0)
    assert start.kind == "refused" and start.lines == ((
        f"zorse: checkpoint {root / 'step_5'} was written by run {'b' * 16}, but {root} also holds another run's "
        f"(run {this}: step_1, step_2, step_3) and no metrics.jsonl says which run {out} holds; move the other run's "
        f"checkpoints out of {root} to resume run {'b' * 16}, or pass --overwrite instead of --resume to start "
        f"anew"),)
    shutil.rmtree(root / "step_5")
    start = _decide_start(out, CheckpointOptions(resume=True), 8, 0)
    assert (start.kind, start.step, start.run_id) == ("resume", 3, this)


def _as_version_1(ckpt):
    """Rewrite ``ckpt``'s manifest as version 1: no run id, plan hash or file records."""
    doc = json.loads((ckpt / MANIFEST).read_text())
    for key in ("run_id", "plan_hash", "files"):
        doc.pop(key)
    (ckpt / MANIFEST).write_text(json.dumps({**doc, "version": 1}))


def test_version_1_checkpoint_keeps_this_runs_id_and_metrics(stopped_run, tmp_path):
    """A version-1 checkpoint (no run id) resumed where metrics.jsonl names
    the run: the run keeps its id, so continuing metrics.jsonl deletes none
    of its records (a new id would have dropped them all)."""
    _, _, run, _ = stopped_run
    out = _copy(run, tmp_path)
    _as_version_1(out / "checkpoints" / "step_3")
    this = read_manifest(out / "checkpoints" / "step_2")["run_id"]
    start = _decide_start(out, CheckpointOptions(resume=True), 8, 0)
    assert (start.kind, start.step, start.run_id) == ("resume", 3, this)
    rows = (out / "metrics.jsonl").read_text().splitlines()
    _metrics_file(out, start.step, start.run_id).close()
    assert (out / "metrics.jsonl").read_text().splitlines() == rows[:3]


def test_checkpoint_of_another_plan_named_on_resume(stopped_run, tmp_path):
    """A checkpoint of this run written under another plan (a re-plan) is
    resumed, its plan hash and this plan's named in one line."""
    _, _, run, _ = stopped_run
    out = _copy(run, tmp_path)
    ckpt = out / "checkpoints" / "step_3"
    written = read_manifest(ckpt)["plan_hash"]
    start = _decide_start(out, CheckpointOptions(resume=True), 8, 0, this_plan="0" * 16)
    assert (start.kind, start.step, start.fell_back) == ("resume", 3, False)
    assert start.lines == (f"[zorse] {ckpt} was written under another plan (plan hash {written}, this plan "
                           f"{'0' * 16}): resuming under this one (the model, global batch and sequence length are "
                           f"checked)",)
    assert _decide_start(out, CheckpointOptions(resume=True), 8, 0, this_plan=written).lines == ()


# -- a missing file of a checkpoint ------------------------------------------------------------------

@pytest.mark.parametrize("version", [2, 1])
def test_missing_metadata_falls_back_to_previous_checkpoint(stopped_run, tmp_path, version):
    """step_3's DCP .metadata deleted (under a version-2 manifest, which
    records it, and a version-1 one, which records no files): named in one
    line with the checkpoint, set aside, step_2 resumed."""
    _, _, run, _ = stopped_run
    out = _copy(run, tmp_path)
    root = out / "checkpoints"
    if version == 1:
        _as_version_1(root / "step_3")
    (root / "step_3" / ".metadata").unlink()
    what = "file .metadata is missing" if version == 2 else "file .metadata (DCP's index of every tensor) is missing"
    with pytest.raises(CheckpointDamagedError) as got:
        verify_checkpoint(root / "step_3")
    assert str(got.value) == f"checkpoint {root / 'step_3'} is damaged: {what}" and got.value.file == ".metadata"
    start = _decide_start(out, CheckpointOptions(resume=True), 6, 0)
    assert (start.kind, start.step, start.fell_back) == ("resume", 2, True)
    assert start.lines == (f"[zorse] checkpoint {root / 'step_3'} is damaged: {what}; set aside as step_3.damaged",)


def test_missing_shard_of_version_1_checkpoint_named(stopped_run, tmp_path):
    """A version-1 checkpoint records no files: DCP's .metadata names the
    shards, so a missing or truncated one is named all the same."""
    _, _, run, _ = stopped_run
    ckpt = _copy(run, tmp_path) / "checkpoints" / "step_3"
    _as_version_1(ckpt)
    shard = _biggest_shard(ckpt)
    data = shard.read_bytes()
    shard.write_bytes(data[:100])
    with pytest.raises(CheckpointDamagedError, match=rf"^checkpoint {re.escape(str(ckpt))} is damaged: file "
                                                     rf"{shard.name} has 100 bytes, \.metadata points up to byte "
                                                     rf"\d+ \(truncated\)$"):
        verify_checkpoint(ckpt)
    shard.unlink()
    with pytest.raises(CheckpointDamagedError, match=rf"^checkpoint {re.escape(str(ckpt))} is damaged: file "
                                                     rf"{shard.name}, which \.metadata points into, is missing$"):
        verify_checkpoint(ckpt)


def test_missing_metadata_of_every_checkpoint_refused_before_ranks_start(stopped_run, tmp_path, capsys):
    """zorse train --resume where no checkpoint has its .metadata: one line
    naming each, exit 1, before torchrun starts."""
    _, common, run, _ = stopped_run
    out = _copy(run, tmp_path)
    root = out / "checkpoints"
    for k in (1, 2, 3):
        (root / f"step_{k}" / ".metadata").unlink()
    assert zorse_main(["train", *common, "--steps", "6", "--out", str(out), "--resume"]) == 1
    damaged = "; ".join(f"checkpoint {root / f'step_{k}'} is damaged: file .metadata is missing" for k in (3, 2, 1))
    assert capsys.readouterr().err.splitlines() == [
        f"zorse: no intact checkpoint in {root} to resume ({damaged}); pass --overwrite instead of --resume to start "
        f"the run anew"]
    assert [s for s, _ in list_checkpoints(root)] == [1, 2, 3]


def test_zorse_train_resume_with_missing_metadata_falls_back(stopped_run, tmp_path, capfd):
    """`zorse train --resume` (torchrun, 2 ranks) with step_3's .metadata
    gone: not refused before the ranks start (was: `.metadata is missing`,
    no fallback); rank 0 names it, sets it aside and resumes from step_2;
    steps 3-4 trained again, the run's id kept."""
    _, common, run, _ = stopped_run
    out = _copy(run, tmp_path)
    root = out / "checkpoints"
    (root / "step_3" / ".metadata").unlink()
    this = read_manifest(root / "step_2")["run_id"]
    assert zorse_main(["train", *common, "--steps", "4", "--out", str(out), "--resume", "--checkpoint-every", "1",
                       "--backend", "gloo"]) == 0
    printed = capfd.readouterr().out  # (the ranks' output: torchrun's processes)
    assert (f"[zorse] checkpoint {root / 'step_3'} is damaged: file .metadata is missing; set aside as step_3.damaged"
            in printed)
    assert (f"[zorse] resumed from {root / 'step_2'} (step 2, written on 2 ranks), the newest intact checkpoint"
            in printed)
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and {r["run_id"] for r in rows} == {this}
    assert [s for s, _ in list_checkpoints(root)] == [2, 3, 4] and (root / "step_3.damaged").is_dir()


def test_final_checkpoint_model_only_holds_the_parameters_and_a_resume_falls_back(stopped_run, tmp_path):
    """--final-checkpoint model-only (issue 48 item 1): the last step's checkpoint holds the model's
    parameters and the step alone (manifest ``contents`` "model"; DCP's own converter reads no optimizer key
    from it) and is smaller; the checkpoints before it are full. A --resume with the same --steps has
    nothing to train; with more steps it continues from the newest full checkpoint, said in one line; with
    none before it, refused naming the fix. A version-2 manifest reads as "full"."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    d, common, _, _ = stopped_run
    run = tmp_path / "model_only"
    spawn_ranks(d / "plan", 2, [*common[1:], "--steps", "2", "--out", str(run), "--checkpoint-every", "1",
                                "--final-checkpoint", "model-only"])
    root = run / "checkpoints"
    assert [(s, read_manifest(p)["contents"]) for s, p in list_checkpoints(root)] == [(1, "full"), (2, "model")]
    verify_checkpoint(root / "step_2")
    for step in (1, 2):
        dcp_to_torch_save(root / f"step_{step}", tmp_path / f"step_{step}.pt")
    full, model = (torch.load(tmp_path / f"step_{k}.pt") for k in (1, 2))
    assert {k for k in full if k.startswith("model/")} == set(model) - {"train/step"}
    assert any(k.startswith("optim/") for k in full) and int(model["train/step"]) == 2
    size = {k: sum(f.stat().st_size for f in (root / f"step_{k}").iterdir()) for k in (1, 2)}
    assert size[2] < size[1] / 2

    assert _decide_start(run, CheckpointOptions(resume=True), 2, 0).kind == "finished"
    start = _decide_start(run, CheckpointOptions(resume=True), 3, 0)
    assert (start.kind, start.step) == ("resume", 1)
    assert start.lines == (f"[zorse] {root / 'step_2'} holds the parameters only (--final-checkpoint model-only), "
                           f"not the optimizer state training continues from: resuming from {root / 'step_1'} "
                           f"(step 1), the newest with it",)
    shutil.rmtree(root / "step_1")
    start = _decide_start(run, CheckpointOptions(resume=True), 3, 0)
    assert start.kind == "refused"
    assert start.lines == (f"zorse: {root / 'step_2'} holds the parameters only (--final-checkpoint model-only), "
                           f"not the optimizer state training continues from, and no checkpoint before it does; "
                           f"pass --overwrite instead of --resume to start anew",)
    manifest = json.loads((root / "step_2" / MANIFEST).read_text())
    old = {k: v for k, v in manifest.items() if k != "contents"} | {"version": 2}
    (root / "step_2" / MANIFEST).write_text(json.dumps(old))
    assert read_manifest(root / "step_2")["contents"] == "full"
