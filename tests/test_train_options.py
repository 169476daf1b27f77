"""The training options (zorse_fx/train_options.py): one frozen tree, its
defaults written once, flat flags parsed by tyro, every check's message
(exit status 2, as argparse), the options file `zorse train` writes and the
ranks read, and the torchrun command that hands the ranks that file."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest

from zorse_fx.train import PROG, parse_args
from zorse_fx.train_options import (FORMAT, OPTIONS_FILE, VERSION, CheckpointOptions, DataOptions, JobOptions,
                                    LoopOptions, OptimizerOptions, TestingOptions, TrainingOptions,
                                    TrainOptionsFileError, read_options_file, write_options_file)

ROOT = Path(__file__).resolve().parents[1]


def _leaves(cls=TrainingOptions, prefix=""):
    """(dotted field path, flag) of every leaf field of the tree."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _leaves(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, "--" + f.name.replace("_", "-")


def _get(tree, dotted):
    for part in dotted.split("."):
        tree = getattr(tree, part)
    return tree


# -- defaults ---------------------------------------------------------------------------------

def test_the_defaults_are_the_records_defaults():
    """A minimal command line gives the records' own defaults: the parser adds none of its own."""
    got = parse_args(["plan", "--data", "d.bin"])
    assert got == TrainingOptions(data=DataOptions(plan="plan", data="d.bin"))
    assert (got.optimizer, got.loop, got.checkpoint, got.job, got.testing) == (
        OptimizerOptions(), LoopOptions(), CheckpointOptions(), JobOptions(), TestingOptions())
    assert (got.loop.steps, got.job.out, got.optimizer.lr) == (10, "runs/train", 1e-4)


def test_zorse_train_has_the_same_defaults():
    from zorse_fx.cli import LaunchOptions, TrainCommand, build_parser

    cmd = build_parser().parse_args(["train", "plan"]).train
    assert cmd == TrainCommand(data=DataOptions(plan="plan"))
    assert cmd.launch == LaunchOptions()
    assert cmd.training_options("d.bin") == parse_args(["plan", "--data", "d.bin"])


def test_the_runtime_takes_its_defaults_from_the_options():
    """AdamW's and the schedule's defaults are written once, in OptimizerOptions."""
    from zorse_fx.runtime.lr_schedule import LRSchedule
    from zorse_fx.runtime.optimizer import OptimizerConfig

    o = OptimizerOptions()
    assert OptimizerConfig() == OptimizerConfig.from_options(o)
    assert OptimizerConfig().betas == (o.adam_beta1, o.adam_beta2)
    assert LRSchedule() == LRSchedule.from_options(o, total_steps=1)


# -- flags --------------------------------------------------------------------------------------

# (argv beyond "plan", dotted field, value); a flag that acts only with another flag of its record comes with it
FLAGS = [
    (["--data", "d.bin"], "data.data", "d.bin"),
    (["--tokens", "t.pt"], "data.tokens", "t.pt"),
    (["--weights", "w.pt"], "data.weights", "w.pt"),
    (["--allow-repeat"], "data.allow_repeat", True),
    (["--val-fraction", "0.1"], "data.val_fraction", 0.1),
    (["--lr", "3e-4"], "optimizer.lr", 3e-4),
    (["--lr-schedule", "cosine"], "optimizer.lr_schedule", "cosine"),
    (["--warmup-steps", "5"], "optimizer.warmup_steps", 5),
    (["--lr-schedule", "linear", "--min-lr", "1e-5"], "optimizer.min_lr", 1e-5),
    (["--weight-decay", "0.1"], "optimizer.weight_decay", 0.1),
    (["--adam-beta1", "0.8"], "optimizer.adam_beta1", 0.8),
    (["--adam-beta2", "0.99"], "optimizer.adam_beta2", 0.99),
    (["--adam-eps", "1e-6"], "optimizer.adam_eps", 1e-6),
    (["--clip-grad-norm", "1"], "optimizer.clip_grad_norm", 1.0),
    (["--seed", "7"], "optimizer.seed", 7),
    (["--steps", "3"], "loop.steps", 3),
    (["--val-every", "2"], "loop.val_every", 2),
    (["--val-every", "3", "--val-batches", "4"], "loop.val_batches", 4),
    (["--tensorboard"], "loop.tensorboard", True),
    (["--no-timings"], "loop.no_timings", True),
    (["--checkpoint-every", "5"], "checkpoint.checkpoint_every", 5),
    (["--checkpoint-every", "1", "--keep-checkpoints", "2"], "checkpoint.keep_checkpoints", 2),
    (["--resume"], "checkpoint.resume", True),
    (["--final-checkpoint", "model-only"], "checkpoint.final_checkpoint", "model-only"),
    (["--overwrite"], "checkpoint.overwrite", True),
    (["--out", "runs/y"], "job.out", "runs/y"),
    (["--backend", "gloo"], "job.backend", "gloo"),
    (["--precision", "bf16-mixed"], "job.precision", "bf16-mixed"),
    (["--precision", "bf16-mixed", "--grad-reduce-dtype", "bfloat16"], "job.grad_reduce_dtype", "bfloat16"),
    (["--pg-timeout-min", "2.5"], "job.pg_timeout_min", 2.5),
    (["--heartbeat-s", "0"], "job.heartbeat_s", 0.0),
    (["--skip-device-check"], "job.skip_device_check", True),
    (["--kill-at-step", "1:3"], "testing.kill_at_step", (1, 3)),
    (["--fail-rank", "2:3"], "testing.fail_rank", (2, 3)),
    (["--inject-inf", "0:2"], "testing.inject_inf", (0, 2)),
    (["--slow-gpu", "1:2.5"], "testing.slow_gpu", (1, 2.5)),
    (["--raise-at-step", "1:2"], "testing.raise_at_step", (1, 2)),
    (["--dump-grads", "2"], "testing.dump_grads", 2),
    (["--dump-params"], "testing.dump_params", True),
]


@pytest.mark.parametrize("argv, field, value", FLAGS, ids=[f for _, f, _ in FLAGS])
def test_a_flat_flag_sets_its_field(argv, field, value):
    source = [] if {"--data", "--tokens"} & set(argv) else ["--data", "d.bin"]
    got = parse_args(["plan", *source, *argv])
    assert _get(got, field) == value
    others = dataclasses.replace(got, **{field.split(".")[0]: _get(TrainingOptions(data=got.data), field.split(".")[0])})
    assert others == TrainingOptions(data=got.data)  # nothing else changed


def test_every_field_has_a_flat_flag_in_both_commands(capsys):
    from zorse_fx.cli import build_parser

    leaves = dict(_leaves())
    assert set(leaves) - {"data.plan"} == {f for _, f, _ in FLAGS}
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    assert e.value.code == 0
    ranks = capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["train", "--help"])
    assert e.value.code == 0
    launcher = capsys.readouterr().out
    def lists(text, flag):  # a line of the help that starts with the flag (after the box drawing)
        return re.search(rf"^\W*{flag}\b", text, re.M) is not None

    for field, flag in leaves.items():
        if field != "data.plan":
            assert lists(ranks, flag) and lists(launcher, flag), flag
            assert f".{flag[2:]}" not in ranks, flag  # flat: no --optimizer.lr
    for flag in ("--max-restarts", "--stall-timeout", "--term-grace-s", "--corpus", "--tokenizer", "--nproc"):
        assert lists(launcher, flag) and not lists(ranks, flag), flag
    assert "--no-resume" not in ranks and "peak learning rate" in ranks and "PLAN" in ranks


# -- checks -------------------------------------------------------------------------------------

ERRORS = [  # (argv, message): after "plan --tokens t.pt" unless the argv starts with "!"
    (["!plan"], "one of the arguments --data --tokens is required"),
    (["!plan", "--data", "a.bin", "--tokens", "t.pt"], "argument --tokens: not allowed with argument --data"),
    (["!--tokens", "t.pt"], "the following arguments are required: PLAN"),
    (["--val-fraction", "1.5"], "--val-fraction must be in [0, 1), got 1.5"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--val-batches", "0"], "--val-batches must be >= 1, got 0"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints must be >= 1, got 0"),
    (["--val-every", "-1"], "--val-every must be >= 0 (0: never), got -1"),
    (["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0 (0: never), got -1"),
    (["--dump-grads", "-1"], "--dump-grads must be >= 0 (0: never), got -1"),
    (["--clip-grad-norm", "0"], "--clip-grad-norm must be > 0, got 0.0"),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0, got -0.1"),
    (["--adam-beta1", "1"], "--adam-beta1 must be in [0, 1), got 1.0"),
    (["--adam-beta2", "1.5"], "--adam-beta2 must be in [0, 1), got 1.5"),
    (["--adam-eps", "0"], "--adam-eps must be > 0, got 0.0"),
    (["--lr", "-1"], "--lr -1.0: the learning rate must be a finite number >= 0"),
    (["--min-lr", "1"], "--min-lr 1.0: must be between 0 and --lr 0.0001"),
    (["--warmup-steps", "-1"], "--warmup-steps -1: must be >= 0"),
    (["--lr-schedule", "cos"], "argument --lr-schedule: invalid choice: 'cos' (choose from 'constant', 'cosine', "
                               "'linear')"),
    (["--grad-reduce-dtype", "bfloat16"], "--grad-reduce-dtype needs --precision (without it the plan's own "
                                          "reduction dtype is used)"),
    (["--precision", "fp16-mixed", "--grad-reduce-dtype", "bfloat16"],
     "precision 'fp16-mixed' reduces gradients in float32, not 'bfloat16'"),
    (["--precision", "bf17"], "argument --precision: invalid choice: 'bf17' (choose from 'fp32', 'bf16-mixed', "
                              "'fp16-mixed')"),
    (["--backend", "mpi"], "argument --backend: invalid choice: 'mpi' (choose from 'auto', 'gloo', 'nccl')"),
    (["--pg-timeout-min", "0"], "--pg-timeout-min must be > 0 and --heartbeat-s >= 0, got 0.0, 1.0"),
    (["--heartbeat-s", "-1"], "--pg-timeout-min must be > 0 and --heartbeat-s >= 0, got 10.0, -1.0"),
    (["--bucket-mib", "0.05"], "--bucket-mib is not a training option: the gradient bucket size is priced by the "
                               "planner and recorded in the plan (grad_bucket_bytes), which the ranks train with; "
                               "re-plan with `zorse plan --bucket-mib MIB` (or PlanOptions(bucket_mib=...))"),
    (["--kill-at-step", "x"], "--kill-at-step expects RANK:STEP with two integers >= 0, got 'x'"),
    (["--inject-inf", "1-2"], "--inject-inf expects RANK:STEP with two integers >= 0, got '1-2'"),
    (["--slow-gpu", "1:0.5"], "--slow-gpu expects GPU:FACTOR, a GPU index of the cluster file (>= 0) and a factor "
                              "from 1 to 1000 (3: three times slower), got '1:0.5'"),
    (["--slow-gpu", "x:3"], "--slow-gpu expects GPU:FACTOR, a GPU index of the cluster file (>= 0) and a factor "
                            "from 1 to 1000 (3: three times slower), got 'x:3'"),
    (["--inject-inf", "1:-2"], "--inject-inf expects RANK:STEP with two integers >= 0, got '1:-2'"),
    (["--lr", "x"], "argument --lr: could not convert string to float: 'x'"),
    (["--steps", "1.5"], "argument --steps: invalid literal for int() with base 10: '1.5'"),
    (["--steps"], "argument --steps: expected one argument"),
    (["--nope", "1"], "unrecognized arguments: --nope 1"),
    (["--resume", "True"], "unrecognized arguments: True"),
    (["!--options-file", "o.json", "--lr", "1"], "--options-file holds every option; got other arguments too: --lr 1"),
]


@pytest.mark.parametrize("argv, message", ERRORS, ids=[m[:50] for _, m in ERRORS])
def test_a_refused_option_exits_2_naming_the_flag(argv, message, capsys):
    argv = [argv[0][1:], *argv[1:]] if argv[0].startswith("!") else ["plan", "--tokens", "t.pt", *argv]
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"{PROG}: error: {message}"


@pytest.mark.parametrize("argv, message", [
    (["--max-restarts", "-1"], "--max-restarts must be >= 0, got -1"),
    (["--nproc", "-1"], "--nproc must be >= 0, got -1"),
    (["--term-grace-s", "-1"], "--term-grace-s must be >= 0, got -1.0"),
    (["--stall-timeout", "soon"], "argument --stall-timeout: could not convert string to float: 'soon'"),
    (["--pg-timeout-min", "0"], "--pg-timeout-min must be > 0 and --heartbeat-s >= 0, got 0.0, 1.0"),
    (["--data", "a.bin", "--tokens", "t.pt"], "argument --tokens: not allowed with argument --data"),
    (["--nope", "1"], "unrecognized arguments: --nope 1"),
])
def test_zorse_train_refuses_the_same_way(argv, message, capsys):
    from zorse_fx.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "plan", *argv])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"zorse train: error: {message}"


def test_the_module_exits_2_and_shows_its_help():
    run = [sys.executable, "-m", "zorse_fx.train"]
    bad = subprocess.run([*run, "plan", "--data", "d.bin", "--steps", "0"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.splitlines()[-1] == f"{PROG}: error: --steps must be >= 1, got 0"
    help_ = subprocess.run([*run, "--help"], capture_output=True, text=True, cwd=ROOT)
    assert help_.returncode == 0 and "--checkpoint-every" in help_.stdout and "--options-file" in help_.stdout


# -- options that cannot take effect ([Note: options that cannot take effect]) -------------------------------------

VOID = [  # (argv after "plan --tokens t.pt", message)
    (["--warmup-steps", "100", "--steps", "4"], "--warmup-steps 100 is longer than the run (--steps 4): the rate would "
     "never reach --lr 0.0001; pass --warmup-steps 4 or fewer, or --steps 100 or more"),
    (["--warmup-steps", "5", "--steps", "4", "--lr-schedule", "cosine"], "--warmup-steps 5 is longer than the run "
     "(--steps 4): the rate would never reach --lr 0.0001 and the cosine decay never start; pass --warmup-steps 4 or "
     "fewer, or --steps 5 or more"),
    (["--fail-rank", "1:5", "--steps", "4"], "--fail-rank 1:5: step 5 is not one of the run's steps 1..4 (--steps 4), "
     "so it would never act; pass a STEP from 1 to 4"),
    (["--kill-at-step", "0:9", "--steps", "4"], "--kill-at-step 0:9: step 9 is not one of the run's steps 1..4 "
     "(--steps 4), so it would never act; pass a STEP from 1 to 4"),
    (["--raise-at-step", "1:0"], "--raise-at-step 1:0: step 0 is not one of the run's steps 1..10 (--steps 10), so it "
     "would never act; pass a STEP from 1 to 10"),
    (["--inject-inf", "0:11"], "--inject-inf 0:11: step 11 is not one of the run's steps 1..10 (--steps 10), so it "
     "would never act; pass a STEP from 1 to 10"),
    (["--dump-grads", "5", "--steps", "4"], "--dump-grads 5: the run ends at step 4 (--steps 4), so no gradients "
     "would be saved; pass a step from 1 to 4 (0: never)"),
    (["--min-lr", "1e-05"], "--min-lr 1e-05 is the rate --lr-schedule cosine or linear decays to; the constant "
     "schedule never uses it: pass --lr-schedule cosine (or linear), or drop --min-lr"),
    (["--val-batches", "3"], "--val-batches 3 (global batches per validation) acts only with --val-every, which is "
     "off, so it would not take effect: add --val-every N, or drop --val-batches"),
    (["--keep-checkpoints", "1", "--resume"], "--keep-checkpoints 1 (checkpoints kept) acts only with "
     "--checkpoint-every, which is off, so it would not take effect: add --checkpoint-every N, or drop "
     "--keep-checkpoints"),
]


@pytest.mark.parametrize("argv, message", VOID, ids=[" ".join(a) for a, _ in VOID])
def test_option_that_cannot_take_effect_refused(argv, message, capsys):
    """`--warmup-steps 100 --steps 4`, a testing hook or --dump-grads past the
    last step (or at step 0), and a flag whose own flag is off: refused
    naming both, exit 2, in python -m zorse_fx.train and in zorse train."""
    from zorse_fx.cli import main

    for run, prog in ((parse_args, PROG), (lambda a: main(["train", *a]), "zorse train")):
        with pytest.raises(SystemExit) as e:
            run(["plan", "--tokens", "t.pt", *argv])
        assert e.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == f"{prog}: error: {message}"


def test_warmup_steps_100_with_steps_4_refused_and_intervals_past_the_run_accepted():
    """The case of the issue, and the rule's other side: a warm-up as long as
    the run reaches --lr at the last step; --checkpoint-every and --val-every
    longer than the run act at the last step (a checkpoint, a validation)."""
    from zorse_fx.train_options import OptionValueError

    with pytest.raises(OptionValueError, match=r"^--warmup-steps 100 is longer than the run \(--steps 4\)") as e:
        TrainingOptions(data=DataOptions(plan="p", data="d"), optimizer=OptimizerOptions(warmup_steps=100),
                        loop=LoopOptions(steps=4))
    assert e.value.field == "optimizer.warmup_steps"
    ok = parse_args(["plan", "--data", "d", "--steps", "4", "--warmup-steps", "4", "--checkpoint-every", "100",
                     "--val-every", "100", "--fail-rank", "1:4", "--dump-grads", "4"])
    assert (ok.optimizer.warmup_steps, ok.checkpoint.checkpoint_every, ok.loop.val_every) == (4, 100, 100)


def test_corpus_with_data_refused(capsys):
    """zorse train --corpus / --tokenizer prepare a token file only without
    --data / --tokens: with either they would be ignored."""
    from zorse_fx.cli import main

    for argv, message in [
            (["--data", "d.bin", "--corpus", "news.txt"], "--corpus news.txt applies only where zorse train prepares "
             "the token file itself; --data names one, so it would not take effect: drop --corpus, or drop --data"),
            (["--tokens", "t.pt", "--tokenizer", "smollm2-135m"], "--tokenizer smollm2-135m applies only where zorse "
             "train prepares the token file itself; --tokens names one, so it would not take effect: drop "
             "--tokenizer, or drop --tokens")]:
        with pytest.raises(SystemExit) as e:
            main(["train", "plan", *argv])
        assert e.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == f"zorse train: error: {message}"


def test_stall_timeout_without_heartbeats_refused(capsys):
    """zorse train's --stall-timeout watches the ranks' heartbeats: with
    --heartbeat-s 0 (none written) it would never see a stall, and with beats
    as far apart as the timeout every healthy rank would look stalled; both
    refused naming the two flags. --stall-timeout 0 with --heartbeat-s 0, and
    a timeout many beats long, are fine."""
    from zorse_fx.cli import main

    for argv, message in [
            (["--heartbeat-s", "0"], "--heartbeat-s 0 turns the ranks' heartbeats off, which --stall-timeout 300 "
             "watches, so it would not take effect: pass --stall-timeout 0 too, or a --heartbeat-s above 0"),
            (["--heartbeat-s", "30", "--stall-timeout", "20"], "--stall-timeout 20 is not above --heartbeat-s 30: a "
             "healthy rank would look stalled between two beats; give a --stall-timeout several heartbeats long")]:
        with pytest.raises(SystemExit) as e:
            main(["train", "plan", "--tokens", "t.pt", *argv])
        assert e.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == f"zorse train: error: {message}"
    from zorse_fx.cli import TrainCommand
    from zorse_fx.train_options import parse_flags

    for argv in (["--heartbeat-s", "0", "--stall-timeout", "0"], ["--heartbeat-s", "2", "--stall-timeout", "60"]):
        cmd = parse_flags(TrainCommand, ["plan", "--tokens", "t.pt", *argv], prog="zorse train")
        assert (cmd.job.heartbeat_s, cmd.launch.stall_timeout) == tuple(float(a) for a in argv[1::2])


@pytest.fixture(scope="module")
def two_rank_plan(tmp_path_factory):
    """A 2-stage GPT plan on 2 ranks exported with its weights, and the Lee corpus as byte tokens."""
    import torch

    from conftest import fixed_plan, gpt3x64
    from zorse_fx.data import read_corpus, tokenize

    d = tmp_path_factory.mktemp("two_ranks")
    captured = gpt3x64()
    plan = fixed_plan(captured, ((0,), (1,)), ((2,), (2,)), num_microbatches=2, global_batch_size=4)
    plan.export(d / "plan")
    torch.save(captured.state(), d / "plan" / "weights.pt")
    torch.save(tokenize(read_corpus("lee"))[:20000], d / "tokens.pt")
    return d


@pytest.mark.parametrize("hook", ["fail_rank", "kill_at_step", "raise_at_step", "inject_inf"])
def test_fail_rank_beyond_world_refused(two_rank_plan, tmp_path, capsys, monkeypatch, hook):
    """`--fail-rank 9:3` (and every other RANK:STEP hook) on a plan of 2
    ranks: zorse train refuses it before torchrun starts, one line naming the
    flag, the rank and the job's ranks, exit 1."""
    import zorse_fx.runtime.launch as launch_mod
    from zorse_fx.cli import main

    monkeypatch.setattr(launch_mod, "launch", lambda *a, **kw: pytest.fail("torchrun was started"))
    flag = "--" + hook.replace("_", "-")
    d = two_rank_plan
    assert main(["train", str(d / "plan"), "--tokens", str(d / "tokens.pt"), "--steps", "4", flag, "9:3",
                 "--out", str(tmp_path / "run")]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"zorse: {flag} 9:3: rank 9 is not in the job (its 2 ranks are 0..1), so it would never act; pass a RANK "
        f"from 0 to 1"]
    assert not (tmp_path / "run" / OPTIONS_FILE).exists()


def test_fail_rank_beyond_world_refused_by_the_ranks(two_rank_plan, tmp_path):
    """Ranks started without zorse train (torchrun by hand): each refuses
    `--fail-rank 9:3` in one line as soon as it knows the world size."""
    from conftest import spawn_ranks

    d = two_rank_plan
    with pytest.raises(AssertionError) as got:
        spawn_ranks(d / "plan", 2, ["--tokens", str(d / "tokens.pt"), "--steps", "4", "--fail-rank", "9:3",
                                    "--out", str(tmp_path / "run")])
    report = str(got.value)
    for r in (0, 1):
        assert f"--- rank {r} (exit code 1) ---" in report
        assert re.search(rf"^zorse: rank {r}\b.*: --fail-rank 9:3: rank 9 is not in the job \(its 2 ranks are 0..1\), "
                         rf"so it would never act; pass a RANK from 0 to 1", report, re.M), report
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# -- the options file -----------------------------------------------------------------------------

FULL = TrainingOptions(
    data=DataOptions(plan="runs/x/plan", weights="w.pt", data="d.bin", allow_repeat=True, val_fraction=0.1),
    optimizer=OptimizerOptions(lr=3e-4, lr_schedule="cosine", warmup_steps=2, min_lr=1e-5, weight_decay=0.1,
                               adam_beta1=0.8, adam_beta2=0.99, adam_eps=1e-6, clip_grad_norm=1.0, seed=3),
    loop=LoopOptions(steps=7, val_every=2, val_batches=2, tensorboard=True, no_timings=True),
    checkpoint=CheckpointOptions(checkpoint_every=3, keep_checkpoints=1, resume=True, final_checkpoint="model-only"),
    job=JobOptions(out="runs/x", backend="gloo", precision="bf16-mixed", grad_reduce_dtype="bfloat16",
                   pg_timeout_min=2.5, heartbeat_s=0.5, skip_device_check=True),
    testing=TestingOptions(kill_at_step=(1, 3), fail_rank=(2, 4), raise_at_step=(1, 2), inject_inf=(0, 2),
                           slow_gpu=(1, 2.5), dump_grads=2, dump_params=True))


def test_options_file_round_trip(tmp_path):
    assert all(_get(FULL, f) != _get(TrainingOptions(data=DataOptions(plan="p", data="d")), f)
               for f, _ in _leaves() if f not in ("data.tokens", "checkpoint.overwrite"))  # every field away
    # from its default (--overwrite is not allowed with --resume: its own round trip below)
    path = write_options_file(FULL, tmp_path / OPTIONS_FILE)
    doc = json.loads(path.read_text())
    assert (doc["format"], doc["version"]) == (FORMAT, VERSION)
    assert doc["optimizer"]["lr"] == 3e-4 and doc["testing"]["kill_at_step"] == [1, 3]
    assert read_options_file(path) == FULL
    assert parse_args(["--options-file", str(path)]) == FULL
    assert parse_args([f"--options-file={path}"]) == FULL
    fresh = dataclasses.replace(FULL, checkpoint=CheckpointOptions(overwrite=True))
    assert read_options_file(write_options_file(fresh, tmp_path / "fresh.json")) == fresh


def _edited(tmp_path, edit) -> Path:
    doc = json.loads(write_options_file(FULL, tmp_path / "o.json").read_text())
    edit(doc)
    (tmp_path / "o.json").write_text(json.dumps(doc))
    return tmp_path / "o.json"


AGAIN = "write it again with `zorse train` (or `write_options_file`)"


@pytest.mark.parametrize("edit, field, value, message", [
    (lambda d: d["optimizer"].update(lr_max=0.1), "optimizer.lr_max", 0.1,
     f"unknown field optimizer.lr_max (value 0.1); remove it or {AGAIN}"),
    (lambda d: d.update(schedule={}), "'schedule'", {}, f"unknown field 'schedule' (value {{}}); remove it or {AGAIN}"),
    (lambda d: d["loop"].update(steps="3"), "loop.steps", "3",
     f"field loop.steps is '3': expected `int`, got `str`; correct it or {AGAIN}"),
    (lambda d: d["optimizer"].update(adam_beta1=1.0), "optimizer.adam_beta1", 1.0,
     f"field optimizer.adam_beta1 is 1.0: --adam-beta1 must be in [0, 1), got 1.0; correct it or {AGAIN}"),
    (lambda d: d["job"].update(precision="bf17"), "job.precision", "bf17",
     "field job.precision is 'bf17'; allowed: 'fp32', 'bf16-mixed', 'fp16-mixed'"),
    (lambda d: d["testing"].update(kill_at_step=[1, -3]), "testing.kill_at_step", [1, -3],
     f"field testing.kill_at_step is [1, -3]: --kill-at-step expects RANK:STEP with two integers >= 0, got (1, -3); "
     f"correct it or {AGAIN}"),
    (lambda d: d["data"].update(data=None), "data.data", None,
     f"field data.data is None: one of the arguments --data --tokens is required; correct it or {AGAIN}"),
    (lambda d: d["data"].pop("plan"), "data.plan", None, f"missing field data.plan; {AGAIN}"),
    (lambda d: d["optimizer"].pop("lr"), "optimizer.lr", None, f"missing field optimizer.lr; {AGAIN}"),
    (lambda d: d["loop"].update(steps=1), "optimizer.warmup_steps", 2,
     f"field optimizer.warmup_steps is 2: --warmup-steps 2 is longer than the run (--steps 1): the rate would never "
     f"reach --lr 0.0003 and the cosine decay never start; pass --warmup-steps 1 or fewer, or --steps 2 or more; "
     f"correct it or {AGAIN}"),
    (lambda d: d["testing"].update(fail_rank=[9, 30]), "testing.fail_rank", [9, 30],
     f"field testing.fail_rank is [9, 30]: --fail-rank 9:30: step 30 is not one of the run's steps 1..7 (--steps 7), "
     f"so it would never act; pass a STEP from 1 to 7; correct it or {AGAIN}"),
    (lambda d: d.update(format="zorse_fx.plan"), "'format'", "zorse_fx.plan",
     "not a zorse_fx training options (field 'format' is 'zorse_fx.plan', expected 'zorse_fx.train_options')"),
    (lambda d: d.update(version=2), "'version'", 2,
     f"training options format version 2 is not supported by this zorse_fx (reads version 1); {AGAIN}"),
])
def test_a_bad_options_file_names_file_field_and_value(tmp_path, edit, field, value, message, capsys):
    path = _edited(tmp_path, edit)
    with pytest.raises(TrainOptionsFileError) as e:
        read_options_file(path)
    assert str(e.value) == f"{path}: {message}"
    assert (e.value.path, e.value.field, e.value.value) == (str(path), field, value)
    assert isinstance(e.value, ValueError)
    with pytest.raises(SystemExit) as exit_:  # a rank: exit 2, the message on stderr
        parse_args(["--options-file", str(path)])
    assert exit_.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == f"{PROG}: error: {path}: {message}"


@pytest.mark.parametrize("section", ["data", "optimizer", "loop", "checkpoint", "job", "testing"])
def test_options_file_with_section_deleted_refused(tmp_path, section):
    """A train_options.json that lost a record (FULL trains 7 steps, the
    defaults 10): refused naming the file and the record, not read as its
    defaults."""
    path = _edited(tmp_path, lambda d: d.pop(section))
    with pytest.raises(TrainOptionsFileError) as e:
        read_options_file(path)
    assert str(e.value) == f"{path}: missing field {section!r}; {AGAIN}"
    assert (e.value.path, e.value.field) == (str(path), repr(section))


def test_an_options_file_that_is_not_there_or_not_json(tmp_path):
    with pytest.raises(TrainOptionsFileError, match=r"nope.json: no such training options file; `zorse train` writes "
                                                    r"<out>/train_options.json"):
        read_options_file(tmp_path / "nope.json")
    (tmp_path / "o.json").write_text("{")
    with pytest.raises(TrainOptionsFileError, match=r"o.json: invalid JSON at line 1: "):
        read_options_file(tmp_path / "o.json")


# -- zorse train hands the ranks the file ---------------------------------------------------------

@pytest.fixture
def launched(monkeypatch):
    """`zorse train` with the pre-flight checks passed, prepare_data and launch recorded instead of run."""
    import zorse_fx.runtime.launch as launch_mod
    import zorse_fx.runtime.preflight as preflight
    import zorse_fx.token_data as token_data
    from zorse_fx.plan import Plan

    calls = SimpleNamespace(launch=[], prepared=[])
    monkeypatch.setattr(Plan, "load", classmethod(lambda cls, path: SimpleNamespace(world_size=2, model_name="gpt")))
    monkeypatch.setattr(preflight, "check_job", lambda path, **kw: (Plan.load(path), {}))
    monkeypatch.setattr(preflight, "check_data", lambda plan, weights, data, **kw: None)
    monkeypatch.setattr(token_data, "prepare_data", lambda source, out, tokenizer: calls.prepared.append(
        (source, Path(out), tokenizer)))
    monkeypatch.setattr(launch_mod, "launch", lambda nproc, argv, **kw: calls.launch.append((nproc, argv, kw)))
    return calls


def test_zorse_train_launches_the_ranks_with_the_options_file(launched, tmp_path, capsys):
    from zorse_fx.cli import main

    out = tmp_path / "run"
    assert main(["train", "runs/x/plan", "--data", "d.bin", "--lr", "3e-4", "--resume", "--out", str(out),
                 "--max-restarts", "1", "--term-grace-s", "9", "--stall-timeout", "5"]) == 0
    (nproc, argv, kw), = launched.launch
    path = out / OPTIONS_FILE
    assert (nproc, argv) == (2, ["--options-file", str(path)])
    assert kw == dict(heartbeat_dir=out / ".heartbeat", stall_timeout_s=5.0, term_grace_s=9.0, max_restarts=1,
                      out=out)
    assert read_options_file(path) == parse_args(["runs/x/plan", "--data", "d.bin", "--lr", "3e-4", "--resume",
                                                  "--out", str(out)])
    printed = capsys.readouterr().out.splitlines()[-1].split()
    assert printed[printed.index("--max-restarts=1"):][-4:] == ["-m", "zorse_fx.train", "--options-file", str(path)]
    assert printed.index("--max-restarts=1") < printed.index("zorse_fx.train") and not launched.prepared


def test_zorse_train_prepares_the_corpus_and_names_it_in_the_file(launched, tmp_path):
    from zorse_fx.cli import main

    out = tmp_path / "run"
    assert main(["train", "runs/x/plan", "--corpus", "news.txt", "--tokenizer", "bytes", "--out", str(out)]) == 0
    assert launched.prepared == [("news.txt", out / "data" / "tokens", "bytes")]
    options = read_options_file(out / OPTIONS_FILE)
    assert (options.data.data, options.data.tokens) == (str(out / "data" / "tokens.bin"), None)
