"""The training loop of ``zorse_fx.train``: learning-rate schedules, global
gradient-norm clipping, weight decay on matrices only, validation loss, and
checkpoints (save, exact resume, resume under another plan, restart after a
rank is killed), each against single-process training.

Tolerances are ``conftest.FP32`` (see test_distributed.py for where they come
from); a resumed run on the same plan must equal the uninterrupted one
exactly (same operations in the same order on the same CPU).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import (FP32, ROOT, assert_params_match, fixed_plan, gpt3x64, reference_adamw, spawn_ranks,
                      train_and_compare, with_low_precision, with_memory_policy)
from zorse_fx.capture import analyse, capture
from zorse_fx.data import global_batch
from zorse_fx.errors import CheckpointError
from zorse_fx.models.gpt import GPT, GPTConfig
from zorse_fx.runtime.checkpoint import MANIFEST, latest_checkpoint, list_checkpoints, read_manifest
from zorse_fx.runtime.lr_schedule import LRSchedule
from zorse_fx.runtime.timings import read_timings

LR, WD = 1e-3, 0.1
SEQ = 32  # gpt3x64's tokens


def _gpt():
    return gpt3x64()  # the 3-layer GPT of the distributed tests (captured once per session)


def _plan_a(captured):
    """2 stages cut in the middle, global batch 6 in 2 micro-batches: stage 0 on
    GPU 0; stage 1 on GPUs 2, 3 (1:2 samples), ZeRO-1 3:1, tied embedding."""
    plan = fixed_plan(captured, ((0,), (2, 3)), ((3,), (1, 2)), num_microbatches=2, global_batch_size=6,
                      cuts=(analyse(captured).num_blocks // 2,))
    return with_memory_policy(plan, sharded={1}, shard_bytes={1: (3 * 2**20, 2**20)})


def _plan_a4(captured):
    """4 ranks, cut in the middle, global batch 6 in 2 micro-batches: stage 0 on
    GPUs 0, 1 (2:1 samples), stage 1 on GPUs 2, 3 (1:2), ZeRO-1 3:1."""
    plan = fixed_plan(captured, ((0, 1), (2, 3)), ((2, 1), (1, 2)), num_microbatches=2, global_batch_size=6,
                      cuts=(analyse(captured).num_blocks // 2,))
    return with_memory_policy(plan, sharded={1}, shard_bytes={1: (3 * 2**20, 2**20)})


def _plan_b(captured):
    """Another plan of the same model: another cut (block 2), stage 0 on 2 GPUs
    (2:1, ZeRO-1 1:1), stage 1 on one GPU with recomputation; 3 ranks."""
    plan = fixed_plan(captured, ((0, 1), (3,)), ((2, 1), (3,)), num_microbatches=2, global_batch_size=6, cuts=(2,))
    return with_memory_policy(plan, sharded={0}, recompute={1})


# -- learning-rate schedules -----------------------------------------------------

def test_lr_schedules_warm_up_then_decay_to_min_lr():
    cos = LRSchedule(name="cosine", lr=1.0, min_lr=0.1, warmup_steps=2, total_steps=10)
    assert [cos(1), cos(2)] == [0.5, 1.0]
    assert cos(6) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cos(10) == pytest.approx(0.1)
    lin = LRSchedule(name="linear", lr=1.0, min_lr=0.0, warmup_steps=0, total_steps=4)
    assert [lin(k) for k in range(1, 5)] == pytest.approx([0.75, 0.5, 0.25, 0.0])
    const = LRSchedule(name="constant", lr=0.3, warmup_steps=3, total_steps=5)
    assert [const(k) for k in range(1, 6)] == pytest.approx([0.1, 0.2, 0.3, 0.3, 0.3])


@pytest.mark.parametrize("kw, message", [
    (dict(name="step"), "--lr-schedule 'step': choose one of constant, cosine, linear"),
    (dict(lr=1e-3, min_lr=1e-2), "--min-lr 0.01: must be between 0 and --lr 0.001"),
    (dict(warmup_steps=-1), "--warmup-steps -1: must be >= 0"),
])
def test_lr_schedule_errors_name_the_option(kw, message):
    with pytest.raises(ValueError) as got:
        LRSchedule(**kw)
    assert str(got.value) == message


def test_bad_training_options_are_named_by_argparse(capsys):
    from zorse_fx.train import parse_args

    for argv, message in ((["--clip-grad-norm", "0"], "--clip-grad-norm must be > 0, got 0.0"),
                          (["--adam-beta2", "1.5"], "--adam-beta2 must be in [0, 1), got 1.5"),
                          (["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0 (0: never), got -1")):
        with pytest.raises(SystemExit):
            parse_args(["plan", "--tokens", "t.pt", *argv])
        assert message in capsys.readouterr().err


# -- the loop against single-process training ------------------------------------

def test_cosine_schedule_clipping_and_matrix_only_decay_equal_single_process(lee_bytes, tmp_path):
    """ZeRO-1 plan with a tied embedding across stages and a 2-GPU data-parallel
    stage: the global gradient norm counts each parameter once (equal to
    ``clip_grad_norm_`` on the whole model every step), clipping at 0.5 is
    active, the rates follow the cosine schedule, and 3 steps equal
    single-process AdamW with decay on matrices only."""
    captured = _gpt()
    plan = _plan_a(captured)
    sched = LRSchedule(name="cosine", lr=LR, min_lr=1e-4, warmup_steps=1, total_steps=3)
    norms: list[float] = []
    _, rows = train_and_compare(
        plan, captured, lee_bytes, tmp_path, steps=3, lr=LR, weight_decay=WD,
        extra=("--lr-schedule", "cosine", "--warmup-steps", "1", "--min-lr", "1e-4", "--clip-grad-norm", "0.5"),
        ref_kwargs=dict(lr_at=sched, clip=0.5, norms=norms))
    assert [r["lr"] for r in rows] == pytest.approx([sched(k) for k in (1, 2, 3)])
    assert [r["grad_norm"] for r in rows] == pytest.approx(norms, rel=1e-4)
    assert min(norms) > 0.5, "clipping must be active for the test to mean something"


def test_validation_loss_equals_single_process_eval_on_held_out_batches(lee_bytes, tmp_path):
    """--val-every 2 over 2 steps: the held-out split is the corpus' last
    global batch; the reported loss equals the single-process model's after
    the same 2 AdamW steps, and training never saw those tokens."""
    captured = _gpt()
    plan = _plan_a(captured)
    tokens = lee_bytes[:20 * 6 * (SEQ + 1)]
    held = 6 * (SEQ + 1)
    _, rows = train_and_compare(plan, captured, tokens[:-held], tmp_path, steps=2, lr=LR, weight_decay=WD,
                                extra=("--val-every", "2", "--val-batches", "1"))
    # train_and_compare saved tokens[:-held]; run again on the full corpus with validation.
    torch.save(tokens, tmp_path / "tokens.pt")
    spawn_ranks(tmp_path / "plan", plan.world_size,
                ["--tokens", str(tmp_path / "tokens.pt"), "--steps", "2", "--out", str(tmp_path / "val"),
                 "--lr", str(LR), "--weight-decay", str(WD), "--val-every", "2", "--tensorboard"])
    val_rows = [json.loads(l) for l in (tmp_path / "val" / "metrics.jsonl").read_text().splitlines()]
    # --tensorboard: the same numbers as metrics.jsonl, readable by TensorBoard itself
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "val" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([r["loss"] for r in val_rows])
    assert [(e.step, e.value) for e in events.Scalars("val/loss")] == [(2, pytest.approx(val_rows[1]["val_loss"]))]
    assert [r["loss"] for r in val_rows] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert "val_loss" not in val_rows[0]
    # the reference model after 2 steps (reference_adamw trained captured's module in place)
    ref = _gpt()
    reference_adamw(ref, tokens[:-held], plan, 2, lr=LR, weight_decay=WD)
    batch = global_batch(tokens[-held:], 0, global_batch_size=6, seq_len=SEQ, input_names=plan.input_names,
                         label_mode=plan.label_mode)
    with torch.no_grad():
        want = float(ref.graph_module(*[batch[n] for n in ref.input_names]))
    assert val_rows[1]["val_loss"] == pytest.approx(want, rel=FP32.loss_rel)


# -- checkpoints -------------------------------------------------------------------

def _rows(run):
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]


def _params(run, world):
    return {r: torch.load(run / "params" / f"rank{r}.pt") for r in range(world)}


def _export(plan, captured, tokens, d):
    d.mkdir(parents=True, exist_ok=True)
    plan.export(d / "plan")
    torch.save(captured.state(), d / "plan" / "weights.pt")
    torch.save(tokens, d / "tokens.pt")
    # A run stopped early here is started with --steps 2: a constant rate after the warm-up, so the
    # rates of steps 3-4 do not depend on where the first part thought the run ended.
    return [str(d / "plan"), "--tokens", str(d / "tokens.pt"), "--lr", str(LR), "--weight-decay", str(WD),
            "--warmup-steps", "2"]


@pytest.fixture(scope="module")
def uninterrupted(lee_bytes, tmp_path_factory):
    """Plan A exported to a directory ``d``, trained 4 steps in one go into
    ``d/full``; returns (d, the common train arguments, world size). The
    exact-resume and killed-rank tests compare against this same run."""
    d = tmp_path_factory.mktemp("uninterrupted")
    plan = _plan_a(_gpt())
    common = _export(plan, _gpt(), lee_bytes, d)
    spawn_ranks(d / "plan", plan.world_size,
                [*common[1:], "--steps", "4", "--out", str(d / "full"), "--dump-params"])
    return d, common, plan.world_size


def _assert_same_params(run_a, run_b, world):
    """Every rank's final parameters of the two runs are bitwise equal."""
    for r, (a, b) in enumerate(zip(_params(run_a, world).values(), _params(run_b, world).values())):
        for name in a:
            assert torch.equal(a[name], b[name]), f"rank {r} {name} differs between {run_a.name} and {run_b.name}"


@pytest.mark.xdist_group("uninterrupted")  # one worker computes the module fixture once
def test_a_run_without_checkpoint_every_keeps_its_trained_weights(uninterrupted, tmp_path):
    """The uninterrupted run had no --checkpoint-every: its last step still
    wrote checkpoints/step_4 (issue 48 item 1), intact, of this run, holding
    the trained weights (read back with DCP's own converter, equal to the
    parameters the ranks dumped at the end) and the optimizer state; a
    --resume of the run has nothing to train."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from zorse_fx.runtime.checkpoint import verify_checkpoint
    from zorse_fx.train import _decide_start
    from zorse_fx.train_options import CheckpointOptions

    d, _, w = uninterrupted
    root = d / "full" / "checkpoints"
    assert [s for s, _ in list_checkpoints(root)] == [4]
    verify_checkpoint(root / "step_4")
    manifest = read_manifest(root / "step_4")
    assert manifest["run_id"] == _rows(d / "full")[0]["run_id"] and manifest["optimizer_steps"] == 4
    dcp_to_torch_save(root / "step_4", tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt")
    trained = {name: t for r in range(w) for name, t in _params(d / "full", w)[r].items()}
    model = {k.removeprefix("model/"): v for k, v in state.items() if k.startswith("model/")}
    assert model.keys() == trained.keys()
    for name, t in trained.items():
        assert torch.equal(model[name], t), name
    assert any(k.startswith("optim/exp_avg/") for k in state)
    start = _decide_start(d / "full", CheckpointOptions(resume=True), 4, 0)
    assert start.kind == "finished" and start.step == 4


@pytest.mark.xdist_group("uninterrupted")  # one worker computes the module fixture once
def test_resumed_run_equals_the_uninterrupted_run_exactly(uninterrupted, tmp_path):
    """4 steps in one go vs 2 steps, stop, --resume to 4 (same plan, ZeRO-1
    shards and tied embedding): identical losses and parameters; the
    checkpoint directory is complete (manifest) and the last K are kept;
    metrics.jsonl is continued, not overwritten."""
    d, common, w = uninterrupted
    run = tmp_path / "resumed"
    spawn_ranks(d / "plan", w, [*common[1:], "--steps", "2", "--out", str(run), "--checkpoint-every", "1",
                                "--keep-checkpoints", "1"])
    assert [s for s, _ in list_checkpoints(run / "checkpoints")] == [2]
    assert not list((run / "checkpoints").glob("*.tmp"))
    manifest = read_manifest(latest_checkpoint(run / "checkpoints"))
    assert (manifest["step"], manifest["world_size"], manifest["optimizer_steps"]) == (2, w, 2)
    spawn_ranks(d / "plan", w, [*common[1:], "--steps", "4", "--out", str(run), "--resume", "--dump-params"])
    full, resumed = _rows(d / "full"), _rows(run)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [t.step for t in read_timings(run / "timings.jsonl")] == [1, 2, 3, 4]  # continued as metrics.jsonl
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]
    assert [r["lr"] for r in resumed] == [r["lr"] for r in full]
    _assert_same_params(d / "full", run, w)


def test_resume_under_another_plan_equals_single_process_training(lee_bytes, tmp_path):
    """2 steps under plan A (4 GPUs, cut in the middle, stage 1 ZeRO-1 3:1),
    then 2 more under plan B for the cluster without GPU 2 (3 GPUs, another
    cut, stage 0 ZeRO-1 over other GPUs, stage 1 recomputing): parameters
    and AdamW moments are re-cut to B's stages and shards, and the 4 steps
    equal single-process training."""
    captured = _gpt()
    a, b = _plan_a4(captured), _plan_b(captured)
    assert (a.world_size, b.world_size) == (4, 3)
    assert 2 not in {g.gpu for s in b.stages for g in s.gpus}
    run = tmp_path / "run"
    common_a = _export(a, captured, lee_bytes, tmp_path / "a")
    spawn_ranks(tmp_path / "a" / "plan", a.world_size, [*common_a[1:], "--steps", "2", "--out", str(run),
                                                       "--checkpoint-every", "2"])
    common_b = _export(b, captured, lee_bytes, tmp_path / "b")
    spawn_ranks(tmp_path / "b" / "plan", b.world_size, [*common_b[1:], "--steps", "4", "--out", str(run), "--resume",
                                                       "--dump-params"])
    sched = LRSchedule(name="constant", lr=LR, warmup_steps=2, total_steps=4)
    initial = {k: v.clone() for k, v in captured.state().items()}
    ref_losses, ref_grads, ref_params = reference_adamw(captured, lee_bytes, a, 4, lr=LR, weight_decay=WD, lr_at=sched)
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=FP32.loss_rel)
    assert_params_match(_params(run, b.world_size), ref_params, initial, 4, LR, FP32)


def test_checkpoints_move_between_float32_and_16_bit_working_weights_exactly(lee_bytes, tmp_path):
    """bf16-mixed, plan A on 4 ranks with both stages ZeRO-1 (2:1 and 3:1
    shards), once with float32 weights and once with 16-bit working weights
    (the same values: [Note: 16-bit working weights]). Steps 1-2 under the
    16-bit layout, step 3 resumed under float32 weights, step 4 resumed under
    16-bit weights again equal 4 uninterrupted steps under float32 weights bit
    for bit: a checkpoint saves the float32 masters (by shard range under the
    16-bit layout) and the AdamW moments, and each layout loads the other's."""
    captured = _gpt()
    a32 = with_memory_policy(_plan_a4(captured), sharded={0, 1}, shard_bytes={0: (2**20, 2**20),
                                                                               1: (3 * 2**20, 2**20)})
    a16 = with_low_precision(a32, captured)
    assert all(s.low_precision_params for s in a16.stages)
    bf16 = ("--precision", "bf16-mixed")
    c32, c16 = (_export(p, captured, lee_bytes, tmp_path / name) for p, name in ((a32, "a32"), (a16, "a16")))
    full, run, w = tmp_path / "full", tmp_path / "run", a32.world_size
    spawn_ranks(tmp_path / "a32" / "plan", w, [*c32[1:], *bf16, "--steps", "4", "--out", str(full), "--dump-params"])
    for common, plan_dir, steps, more in ((c16, "a16", 2, ("--checkpoint-every", "2")),
                                          (c32, "a32", 3, ("--resume", "--checkpoint-every", "3")),
                                          (c16, "a16", 4, ("--resume", "--dump-params"))):
        spawn_ranks(tmp_path / plan_dir / "plan", w, [*common[1:], *bf16, "--steps", str(steps), "--out", str(run),
                                                      *more])
    assert [r["step"] for r in _rows(run)] == [1, 2, 3, 4]
    assert [r["loss"] for r in _rows(run)] == [r["loss"] for r in _rows(full)]
    want, got = _params(full, w), _params(run, w)
    for r in range(w):
        masters = torch.load(run / "params" / f"rank{r}_masters.pt")
        assert masters, f"rank {r} holds no float32 master"
        stage = a16.stages[a16.role(r).stage]
        low = {stage.params[f] for f in stage.low_precision_params}
        for name, value in got[r].items():  # a 16-bit working weight is its master's rounding
            assert (value.dtype == torch.bfloat16) == (name in low), (r, name, value.dtype)
            assert torch.equal(value, want[r][name].to(value.dtype)), (r, name)
        for name, pieces in masters.items():
            for a, b, t in pieces:
                assert torch.equal(t, want[r][name].reshape(-1)[a:b]), (r, name, a, b)


def test_checkpoint_of_another_model_is_refused_naming_the_parameter(lee_bytes, tmp_path):
    """A checkpoint loads only into a plan of its model: another width is
    refused with the parameter and both shapes named."""
    captured = _gpt()
    plan = _plan_a(captured)
    common = _export(plan, captured, lee_bytes, tmp_path / "a")
    run = tmp_path / "run"
    spawn_ranks(tmp_path / "a" / "plan", plan.world_size, [*common[1:], "--steps", "2", "--out", str(run),
                                                          "--checkpoint-every", "2"])
    torch.manual_seed(0)
    other = capture(GPT(GPTConfig(n_layer=3, n_embd=32, n_head=4, block_size=SEQ)),
                    (torch.randint(0, 256, (4, SEQ)),) * 2)
    plan2 = _plan_a(other)
    common2 = _export(plan2, other, lee_bytes, tmp_path / "b")
    with pytest.raises(AssertionError) as got:
        spawn_ranks(tmp_path / "b" / "plan", plan2.world_size,
                    [*common2[1:], "--steps", "3", "--out", str(run), "--resume"])
    # each rank's one line ([Note: one line per error] in runtime/rank_errors.py); the traceback in <out>/logs
    assert re.search(r"^zorse: rank 0 \(stage 0\): \S+: parameter '[^']+' has shape \(256, 64\) in the checkpoint",
                     str(got.value), re.M), str(got.value)
    assert "CheckpointError" in (run / "logs" / "rank0.log").read_text()


def test_manifest_errors_name_file_and_field(tmp_path):
    from zorse_fx.errors import FileFormatError

    d = tmp_path / "step_3"
    d.mkdir()
    with pytest.raises(CheckpointError, match="no zorse_checkpoint.json"):
        read_manifest(d)
    (d / MANIFEST).write_text(json.dumps({"format": "zorse_fx.checkpoint", "version": 1, "step": "3"}))
    with pytest.raises(CheckpointError) as got:
        read_manifest(d)
    assert str(got.value) == (f"{d / MANIFEST}: field 'step' is '3': expected `int`, got `str` (training steps taken "
                              f"when it was written); correct it or resume from another step_<k> directory of "
                              f"<out>/checkpoints")
    assert latest_checkpoint(tmp_path) is None or latest_checkpoint(tmp_path) == d
    v1 = {"format": "zorse_fx.checkpoint", "version": 1, "step": 3, "optimizer_steps": 3, "world_size": 2,
          "num_stages": 2, "model_name": "gpt", "cluster_name": "c", "global_batch_size": 8, "seq_len": 16,
          "precision": "fp32", "samples_seen": 24}
    (d / MANIFEST).write_text(json.dumps(v1))  # version 1: no run identity, no file records
    good = {**v1, "version": 3, "run_id": "", "plan_hash": "", "files": None, "contents": "full"}
    assert read_manifest(d) == good
    good = {**good, "run_id": "0123456789abcdef", "files": {"__0_0.distcp": {"bytes": 5, "sha256": "0" * 64}}}
    (d / MANIFEST).write_text(json.dumps(good))
    assert read_manifest(d) == good
    for field, value, bad in [("'world_size'", "2", {"world_size": "2"}),  # wrong type
                              ("'seq_len'", 0, {"seq_len": 0}),  # out of range
                              ("'precision'", "fp8", {"precision": "fp8"}),  # not an allowed value
                              ("'samples'", 24, {"samples": 24})]:  # unknown field
        (d / MANIFEST).write_text(json.dumps({**good, **bad}))
        with pytest.raises(FileFormatError) as got:
            read_manifest(d)
        assert isinstance(got.value, CheckpointError)
        assert (got.value.path, got.value.field, got.value.value) == (str(d / MANIFEST), field, value)
        assert str(got.value).startswith(f"{d / MANIFEST}: ") and f"{field}" in str(got.value)
        # the fix (an enum's error lists the allowed values instead)
        assert str(got.value).endswith("resume from another step_<k> directory of <out>/checkpoints") \
            or str(got.value).endswith("allowed: 'fp32', 'bf16-mixed', 'fp16-mixed'")


@pytest.mark.xdist_group("uninterrupted")  # one worker computes the module fixture once
def test_a_killed_rank_restarts_the_job_from_the_last_checkpoint(uninterrupted, tmp_path):
    """torchrun --max-restarts 1: rank 1 SIGKILLs itself after step 3 (before
    step 3's checkpoint); torchrun restarts every rank, they resume from
    step_2 and finish; the final parameters equal an uninterrupted run's."""
    d, common, w = uninterrupted
    run = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("TORCHELASTIC_RUN_ID", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={w}",
           "--max-restarts=1", "--monitor-interval=0.5", "-m", "zorse_fx.train", *common, "--steps", "4",
           "--out", str(run), "--checkpoint-every", "1", "--kill-at-step", "1:3", "--dump-params"]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "resumed from" in done.stdout and "after torchrun restart 1" in done.stdout
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["loss"] for r in rows] == [r["loss"] for r in _rows(d / "full")]
    assert [t.step for t in read_timings(run / "timings.jsonl")] == [1, 2, 3, 4]  # step 3's once
    _assert_same_params(d / "full", run, w)


def test_checkpoint_metadata_that_would_run_code_is_refused(tmp_path):
    """DCP's .metadata is a pickle: one that names a callable outside DCP's
    metadata classes (here os.system) is refused before anything runs."""
    import pickle

    from zorse_fx.runtime.checkpoint import _SafeReader

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match=r"refers to (posix|os)\.system"):
        _SafeReader(tmp_path).read_metadata()
    assert not (tmp_path / "ran").exists()
