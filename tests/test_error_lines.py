"""One line for every error of `zorse train`, wherever it is found.

What the files show is refused before any rank starts ([Note: pre-flight
checks] in ``runtime/preflight.py``): each test here runs ``zorse train`` in
this process and finds one ``zorse:`` line naming the file or flag, the value
and the fix, and no rank started. What only a rank finds reaches the user as
one line naming the rank and the cause, its traceback kept in
``<out>/logs`` ([Note: one line per error] in ``runtime/rank_errors.py``):
one real torchrun job (2 Gloo ranks). Each rank checks its GPU and node
against the plan ([Note: checking the devices against the plan] in
``runtime/device_check.py``): a pure function, tested with GPU-like values.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import fixed_plan, gpt3x64, run_distributed
from test_training_loop import _export
from zorse_fx.cli import main as zorse_main
from zorse_fx.plan import Plan
from zorse_fx.runtime.checkpoint import MANIFEST
from zorse_fx.runtime.device_check import DeviceMismatchError, DeviceObservation, check_devices
from zorse_fx.runtime.launch import _TorchrunFilter
from zorse_fx.runtime.rank_errors import read_rank_errors, record_rank_error, summarize

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30


def _plan2():
    """2 stages on GPUs 0 and 1 of small_hetero.yaml (both A100-40GB on node a100-node), global batch 4."""
    return fixed_plan(gpt3x64(), ((0,), (1,)), ((2,), (2,)), num_microbatches=2, global_batch_size=4)


@pytest.fixture(scope="module")
def exported(lee_bytes, tmp_path_factory):
    """The exported plan, its weights and tokens; returns (directory, the common `zorse train` arguments)."""
    d = tmp_path_factory.mktemp("errlines")
    return d, _export(_plan2(), gpt3x64(), lee_bytes, d)


def _one_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("zorse: ") and "Traceback" not in captured.out + captured.err, lines
    return lines[0]


def _train(common, tmp_path, *extra) -> int:
    return zorse_main(["train", *common, "--steps", "2", "--out", str(tmp_path / "run"), *extra])  # (>= --warmup-steps)


# -- refused before any rank starts ---------------------------------------------------------------

def test_wrong_weights_file_one_line(exported, tmp_path, capsys):
    d, common = exported
    weights = torch.load(d / "plan" / "weights.pt")
    name = next(k for k, v in weights.items() if v.dim() == 2)
    weights[name] = torch.zeros(3, 3)
    torch.save(weights, tmp_path / "other.pt")
    assert _train(common, tmp_path, "--weights", str(tmp_path / "other.pt")) == 1
    line = _one_line(capsys)
    assert line.startswith(f"zorse: {tmp_path / 'other.pt'}: tensor {name!r} has shape (3, 3)"), line
    assert "these are not the weights of the model the plan was made for" in line
    assert not (tmp_path / "run" / "logs").exists()  # no rank started
    assert _train(common, tmp_path, "--weights", str(tmp_path / "none.pt")) == 1
    assert _one_line(capsys) == (f"zorse: weights file {tmp_path / 'none.pt'} not found; pass --weights or export "
                                 f"the plan with `zorse plan` (it writes weights.pt beside plan.json)")


def test_token_ids_beyond_vocab_one_line(exported, tmp_path, capsys):
    d, common = exported
    tokens = torch.load(d / "tokens.pt").clone()
    tokens[7] = 300
    torch.save(tokens, tmp_path / "big.pt")
    args = [a if a != str(d / "tokens.pt") else str(tmp_path / "big.pt") for a in common]
    assert _train(args, tmp_path) == 1
    line = _one_line(capsys)
    assert line.startswith(f"zorse: token file {tmp_path / 'big.pt'} has token id 300, but the model's vocabulary "
                           f"is 256"), line


def test_nproc_mismatch_one_line(exported, tmp_path, capsys):
    _, common = exported
    assert _train(common, tmp_path, "--nproc", "3") == 1
    assert _one_line(capsys) == ("zorse: --nproc 3 does not match the plan: it needs 2 processes, one per GPU it "
                                 "uses; leave --nproc out (or pass --nproc 2), or re-plan for 3 GPUs with "
                                 "`zorse plan`")


def test_val_fraction_out_of_range_one_line(exported, tmp_path, capsys):
    """Out of [0, 1): the flag's check (usage error, exit 2, one error line);
    in range but leaving no training batch: refused before the ranks start."""
    _, common = exported
    with pytest.raises(SystemExit) as exc:
        _train(common, tmp_path, "--val-fraction", "1.5")
    assert exc.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "zorse train: error: --val-fraction must be in [0, 1), got 1.5", err
    assert _train(common, tmp_path, "--val-fraction", "0.9999") == 1
    line = _one_line(capsys)
    assert line.startswith(f"zorse: token file {common[2]}: its train split has 1 sequences of seq_len + 1 = 33 "
                           f"tokens (the other "), line
    assert "held out for validation: --val-fraction 0.9999), fewer than one global batch of 4" in line


def test_missing_data_one_line(exported, tmp_path, capsys):
    _, common = exported
    args = [common[0], "--data", str(tmp_path / "nope.bin")]
    assert _train(args, tmp_path) == 1
    line = _one_line(capsys)
    assert line.startswith(f"zorse: token file {tmp_path / 'nope'}") and "not found" in line, line


def test_old_plan_version_one_line(exported, tmp_path, capsys):
    """A plan.json of format version 4 (no stage-source hashes) loads (`zorse show`) but is not run."""
    d, common = exported
    old = tmp_path / "plan"
    old.mkdir()
    for f in (d / "plan").iterdir():
        (old / f.name).write_bytes(f.read_bytes())
    doc = json.loads((old / "plan.json").read_text())
    doc["version"] = 4
    for s in doc["stages"]:
        s.pop("source_sha256", None)
    (old / "plan.json").write_text(json.dumps(doc))
    assert not Plan.load(old).sources_verified
    assert _train([str(old), *common[1:]], tmp_path) == 1
    line = _one_line(capsys)
    assert line.startswith(f"zorse: {old}: plan.json records no sha256 of its stage sources (a file of format "
                           f"version < 5), so zorse_fx will not run them")
    assert "re-export the plan" in line


def _fake_checkpoint(out: Path, params: dict[str, torch.Tensor], **manifest) -> Path:
    """A checkpoint directory as `--resume` finds it: DCP's files of ``params``
    (``model/<name>``) and a manifest (fields overridden by ``manifest``)."""
    ckpt = out / "checkpoints" / "step_2"
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process, as meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({f"model/{k}": v for k, v in params.items()}, checkpoint_id=str(ckpt), no_dist=True)
    doc = {"format": "zorse_fx.checkpoint", "version": 2, "step": 2, "optimizer_steps": 2, "world_size": 2,
           "num_stages": 2, "model_name": "gpt", "cluster_name": "small_hetero", "global_batch_size": 4,
           "seq_len": 32, "precision": "fp32", "samples_seen": 8, "run_id": "0" * 16, "plan_hash": "", "files": {},
           **manifest}
    (ckpt / MANIFEST).write_text(json.dumps(doc))
    return ckpt


@pytest.mark.parametrize("case", ["model", "global_batch_size", "seq_len"])
def test_checkpoint_of_another_model_one_line(exported, tmp_path, capsys, case):
    """`--resume` from a checkpoint of another model, global batch or sequence length: refused before the ranks."""
    d, common = exported
    plan = Plan.load(d / "plan")
    weights = torch.load(d / "plan" / "weights.pt")
    params = {c: weights[c] for s in plan.stages for c in s.params.values()}
    out = tmp_path / "run"
    if case == "model":
        name = next(c for c, t in params.items() if t.dim() == 2)
        params[name] = torch.zeros(5, 7)
        ckpt = _fake_checkpoint(out, params)
        want = (f"zorse: {ckpt}: parameter {name!r} has shape (5, 7) in the checkpoint but this plan's is "
                f"{tuple(weights[name].shape)}; the checkpoint is of another model")
    else:
        ckpt = _fake_checkpoint(out, params, **{case: 8})
        want = (f"zorse: {ckpt}: written with {case} 8, but this plan has "
                f"{plan.global_batch_size if case == 'global_batch_size' else plan.seq_len}")
    assert _train(common, tmp_path, "--resume", "--steps", "3") == 1
    line = _one_line(capsys)
    assert line.startswith(want), line
    assert not (out / "logs").exists()


# -- found by a rank -------------------------------------------------------------------------------

def test_rank_error_reaches_user_as_one_line_with_log_kept(exported, tmp_path):
    """Rank 1 raises in step 2 (--raise-at-step): the terminal shows one
    `zorse:` line naming rank 1, its stage and the cause, and where the
    tracebacks are; no traceback on the terminal;
    the ranks' tracebacks and torchrun's own output kept in <out>/logs.
    (One torchrun job of 2 Gloo ranks, ~15 s.)"""
    _, common = exported
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "zorse_fx.cli", "train", *common, "--steps", "3", "--out", str(out),
                           "--raise-at-step", "1:2", "--term-grace-s", "5"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)
    assert proc.returncode == 1, proc.stderr
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr
    zorse = [ln for ln in err if ln.startswith("zorse:")]
    assert len(zorse) == 1 and zorse == err[-1:], proc.stderr
    log1 = out / "logs" / "rank1.log"
    assert zorse[0].startswith(f"zorse: rank 1 (stage 1): testing: --raise-at-step 1:2 (traceback in {log1}"), zorse
    # (rank 0, whose receive from rank 1 broke, is named "stopped after it" where it wrote its record before
    # torchrun's SIGTERM ended it)
    assert zorse[0].endswith(f"torchrun's output in {out / 'logs' / 'torchrun.log'})"), zorse
    assert "Traceback (most recent call last)" in log1.read_text()
    assert "raise RuntimeExecutionError" in log1.read_text()
    assert "ChildFailedError" in (out / "logs" / "torchrun.log").read_text()
    assert "[zorse] step   1/3" in proc.stdout
    # each rank checked its device and node: on this CPU the GPU part and the nodes are skipped, said once
    assert ("[zorse] device check skipped for GPU name and memory: ranks 0, 1 run on the CPU (no GPU to compare "
            "with the plan's); nodes: every rank runs on the CPU of host ") in proc.stdout


def test_rank_error_lines_and_torchrun_filter(tmp_path, monkeypatch, capsys):
    """Unit level: a rank's record and line (printed where no launcher collects
    them), the launcher's summary of several ranks, and the stderr filter that
    keeps torchrun's log lines and tracebacks off the terminal."""
    monkeypatch.delenv("ZORSE_COLLECT_RANK_ERRORS", raising=False)
    try:
        raise ValueError("boom\nsecond line")
    except ValueError as exc:
        line = record_rank_error(exc, out=tmp_path, rank=2, stages=(1, 3))
    assert line == f"zorse: rank 2 (stages 1, 3): ValueError: boom second line (traceback: {tmp_path}/logs/rank2.log)"
    assert capsys.readouterr().err == line + "\n"
    (rec,) = read_rank_errors(tmp_path)
    later = dict(rec, rank=0, stages=[0], text="rank 0 (stage 0): RuntimeError: Connection closed by peer",
                 cause="RuntimeError: Connection closed by peer", time=rec["time"] + 1)
    same = dict(rec, rank=3, time=rec["time"] + 2)
    assert summarize([rec, later, same], torchrun_log="t.log") == (
        f"rank 2 (stages 1, 3): ValueError: boom second line (traceback in {tmp_path}/logs/rank2.log; rank 3 the "
        f"same; rank 0 stopped after it; torchrun's output in t.log)")
    assert summarize([]) is None
    torchrun = io.StringIO(
        "[zorse] a rank's line\n"
        "W1202 03:20:00.123000 4242 torch/distributed/run.py:766] Setting OMP_NUM_THREADS\n"
        "zorse: rank 1 (stage 1): boom\n"
        "Traceback (most recent call last):\n  File \"y.py\", line 1, in <module>\n    import nothing\n"
        "ModuleNotFoundError: No module named 'nothing'\n"
        "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "============================================================\nzorse_fx.train FAILED\n")
    sink = io.StringIO()
    f = _TorchrunFilter(torchrun, tmp_path / "torchrun.log", sink)
    f.close()
    assert sink.getvalue() == ("[zorse] a rank's line\nzorse: rank 1 (stage 1): boom\n"
                               "ModuleNotFoundError: No module named 'nothing'\n")
    assert (tmp_path / "torchrun.log").read_text() == torchrun.getvalue()
    assert f.reported == 1  # a rank's `zorse:` line reached the terminal


def test_failed_job_whose_rank_printed_its_line_adds_none(exported, tmp_path, monkeypatch, capsys):
    """A job that failed after a rank printed its `zorse:` line (a non-finite
    step, a refused run directory) and left no error record: `zorse train`
    adds no line of its own, it exits 1."""
    import zorse_fx.runtime.launch as launch_mod
    from zorse_fx.runtime.launch import JobFailedError

    def failed(nproc, argv, **kw):
        print("zorse: step 2 is not finite: ...", file=sys.stderr)
        raise JobFailedError("torchrun exited with status 1", 1, reported=True)

    _, common = exported
    monkeypatch.setattr(launch_mod, "launch", failed)
    assert _train(common, tmp_path) == 1
    assert capsys.readouterr().err == "zorse: step 2 is not finite: ...\n"


def _zorse_train(common, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """`zorse train` in a subprocess (torchrun and its 2 Gloo ranks under it), 3 steps."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "zorse_fx.cli", "train", *common, "--steps", "3", "--out", str(out),
                           "--term-grace-s", "5", *extra], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=240)


def test_sigkilled_rank_named_not_its_peer(exported, tmp_path):
    """Issue 46 case: rank 1 SIGKILLed (the OOM killer, a lost GPU; here
    --kill-at-step 1:2) leaves no traceback, and rank 0 fails next in its
    receive with Gloo's "Connection closed/reset by peer", which it records.
    The one line names rank 1, how it died and rank 0 as stopped after it,
    not rank 0's broken connection ([Note: the rank that died first] in
    runtime/rank_errors.py). (One torchrun job of 2 Gloo ranks.)"""
    _, common = exported
    out = tmp_path / "run"
    proc = _zorse_train(common, out, "--kill-at-step", "1:2")
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    zorse = [ln for ln in err if ln.startswith("zorse:")]
    assert len(zorse) == 1 and zorse == err[-1:], proc.stderr
    line = zorse[0]
    assert line.startswith("zorse: rank 1 (stage 1) was killed by SIGKILL (out of memory? see dmesg), without a "
                           "Python traceback; "), line
    assert line.endswith(f"; torchrun's report is in {out / 'logs' / 'torchrun.log'}"), line
    # rank 0 is named only as stopped after it (where it recorded its error before torchrun's SIGTERM)
    assert "Connection" not in line and "rank 0 (stage 0)" not in line, line
    if (out / "logs" / "rank0.error.json").exists():
        assert f"; rank 0 stopped after it (its error in {out / 'logs' / 'rank0.log'}); " in line, line
    assert not (out / "logs" / "rank1.log").exists()  # no traceback of the dead rank: nothing blamed on a log


def test_nonfinite_step_exits_3(exported, tmp_path):
    """A non-finite step (--inject-inf: an inf in rank 1's gradients, fp32:
    no loss scaler skips it) stops every rank with status 3, and `zorse train`
    exits 3 too (README, "Exit statuses"), after rank 0's one line. (One
    torchrun job of 2 Gloo ranks.)"""
    _, common = exported
    proc = _zorse_train(common, tmp_path / "run", "--inject-inf", "1:2")
    assert proc.returncode == 3, proc.stderr
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert [ln for ln in err if ln.startswith("zorse:")] == err[-1:], proc.stderr
    assert err[-1].startswith("zorse: step ") and " is not finite: " in err[-1], err


def test_docs_list_every_exit_status():
    """The docs' one list of `zorse train`'s exit statuses (docs/guide/troubleshooting.md) holds each status it
    returns: 0, 1, 2 (a refused option: test_val_fraction_out_of_range_one_line),
    3 (test_nonfinite_step_exits_3), 128 + SIGINT and SIGTERM
    (test_job_control.py's test_signal_stops_torchrun_and_every_rank)."""
    import re
    import signal

    from zorse_fx.runtime.rank_errors import EXIT_NONFINITE

    text = (ROOT / "docs" / "guide" / "troubleshooting.md").read_text()
    start = text.index("Exit statuses of `zorse train`")
    block = text[start:text.index("\n\n", text.index("\n- ", start))]
    listed = {int(n) for item in re.findall(r"^- (.+)$", block, re.M) for n in re.findall(r"\*\*(\d+)\*\*", item)}
    assert listed == {0, 1, 2, EXIT_NONFINITE, 128 + signal.SIGINT, 128 + signal.SIGTERM}, block


#: torchrun's own lines and failure report (torch 2.13's format) for a job whose rank 1 was
#: SIGKILLed: rank 0 recorded its broken connection and exited 1 in the same second, so
#: torchrun's root cause (the earliest time stamp, ties in rank order) is rank 0; rank 2
#: ignored the SIGTERM torchrun stopped it with and was SIGKILLed at --shutdown-timeout.
_TIED_REPORT = """\
W1206 04:57:09.597000 13590 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 13598 closing \
signal SIGTERM
E1206 04:57:09.712000 13590 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) \
local_rank: 0 (pid: 13596) of binary: /usr/bin/python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
zorse_fx.train FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-06_04:57:09
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 13597)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 13597
[2]:
  time      : 2026-12-06_04:57:40
  host      : localhost
  rank      : 2 (local_rank: 2)
  exitcode  : -9 (pid: 13598)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 13598
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-06_04:57:09
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 13596)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
=======================================================
"""


def test_rank_that_died_first_named_from_torchruns_report(tmp_path, monkeypatch):
    """Unit level, the class of [Note: the rank that died first]: a rank
    killed by a signal is named though torchrun's root cause is the peer
    that recorded its broken connection in the same second, and though
    another rank torchrun stopped itself (its pid in a "closing signal"
    line) ended by SIGKILL too; a rank that exited with an error status and
    no traceback is named where no rank was killed; a recorded error is the
    cause where neither is; and after --max-restarts the line says so."""
    from zorse_fx.runtime.rank_errors import VERDICTS, RankFailure, failed_ranks, first_failure, stopped_pids

    failures = failed_ranks(_TIED_REPORT)
    assert failures == [RankFailure(rank=0, exitcode=1, pid=13596), RankFailure(rank=1, exitcode=-9, pid=13597),
                        RankFailure(rank=2, exitcode=-9, pid=13598)]
    assert stopped_pids(_TIED_REPORT) == {13598}
    monkeypatch.setenv("ZORSE_COLLECT_RANK_ERRORS", "1")
    try:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    except RuntimeError as exc:
        record_rank_error(exc, out=tmp_path, rank=0, stages=(0,))
    records = read_rank_errors(tmp_path)
    died = first_failure(failures, stopped=stopped_pids(_TIED_REPORT), traced={0}, verdicts=VERDICTS)
    assert died == RankFailure(rank=1, exitcode=-9, pid=13597)
    log0 = tmp_path / "logs" / "rank0.log"
    assert summarize(records, torchrun_log="t.log", died=died, stages=(1,)) == (
        f"rank 1 (stage 1) was killed by SIGKILL (out of memory? see dmesg), without a Python traceback; rank 0 "
        f"stopped after it (its error in {log0}); torchrun's report is in t.log")
    assert summarize(records, died=died, stages=(1,), restarts=2).startswith(
        "rank 1 (stage 1) was killed by SIGKILL (out of memory? see dmesg), without a Python traceback, in the last "
        "of 3 attempts (--max-restarts 2); rank 0 stopped after it")
    # no rank killed: one that exited with an error and no traceback (os._exit, a native exit) ...
    silent = [RankFailure(rank=0, exitcode=1, pid=1), RankFailure(rank=3, exitcode=7, pid=4),
              RankFailure(rank=1, exitcode=-15, pid=2)]
    died = first_failure(silent, traced={0}, verdicts=VERDICTS)
    assert died == RankFailure(rank=3, exitcode=7, pid=4)
    assert summarize([], died=died, stages=(2,)) == "rank 3 (stage 2) exited with status 7, without a Python traceback"
    # ... else the recorded error (torchrun's root cause first); a verdict (3: a non-finite step) is no death
    assert first_failure(silent[:1] + silent[2:], traced={0}, verdicts=VERDICTS) == silent[0]
    assert first_failure([RankFailure(rank=1, exitcode=3), RankFailure(rank=0, exitcode=3)], verdicts=VERDICTS) \
        == RankFailure(rank=1, exitcode=3)
    assert first_failure([RankFailure(rank=0, exitcode=-15)]) is None  # torchrun stopped every one
    assert RankFailure(rank=0, exitcode=-11).describe(hint=True) == "killed by SIGSEGV (a crash in native code)"


# -- each rank on its planned GPU and node ---------------------------------------------------------------

def _plan3():
    """Rank 0 (stage 0) on GPU 0, an A100-40GB of node a100-node; ranks 1, 2 (stage 1) on GPUs 2, 3, T4s of t4-node."""
    return fixed_plan(gpt3x64(), ((0,), (2, 3)), ((2,), (1, 1)), num_microbatches=2, global_batch_size=4)


def _gpu(rank, host, name, gib):
    return DeviceObservation(rank=rank, host=host, device_type="cuda", gpu_name=name, memory_bytes=int(gib * GiB))


def test_device_check_refuses_wrong_gpu():
    plan = _plan3()
    a100, t4 = ("NVIDIA A100-SXM4-40GB", 39.4), ("Tesla T4", 14.7)
    good = [_gpu(0, "h0", *a100), _gpu(1, "h1", *t4), _gpu(2, "h1", *t4)]
    assert check_devices(plan, good).skipped == ()
    with pytest.raises(DeviceMismatchError) as exc:  # ranks 0 and 1 on each other's GPUs
        check_devices(plan, [_gpu(0, "h0", *t4), _gpu(1, "h1", *a100), _gpu(2, "h1", *t4)])
    assert exc.value.rank == 0
    assert str(exc.value) == (
        "rank 0 (stage 0) runs on a Tesla T4 (14.7 GiB) on host 'h0', but the plan assigned it GPU 0 of the cluster "
        "file, a A100-40GB on node 'a100-node'; start each node with its --node-rank and CUDA_VISIBLE_DEVICES listing "
        "the node's planned GPUs in the cluster file's order: 0 on 'a100-node' (1 process: rank 0), 1 on 't4-node' "
        "(2 processes: ranks 1-2), the plan's nodes in the cluster file's order (`zorse train --nnodes 2 --node-rank K "
        "--master-addr HOST` on node K starts its processes; torchrun: --nproc-per-node), or plan for these GPUs "
        "(`zorse plan --cluster ...`); --skip-device-check runs anyway")
    with pytest.raises(DeviceMismatchError, match=r"rank 2 \(stage 1\) runs on a NVIDIA H200 \(139\.8 GiB\)"):
        check_devices(plan, [*good[:2], _gpu(2, "h1", "NVIDIA H200", 139.8)])
    # the same name with less memory than the plan assumed (a cluster file's type for a smaller card)
    with pytest.raises(DeviceMismatchError, match=r"rank 1 \(stage 1\) runs on a Tesla T4 \(8\.0 GiB\).* with 16\.0 GiB"):
        check_devices(plan, [good[0], _gpu(1, "h1", "Tesla T4", 8.0), good[2]])
    # a type the cluster file declares (not in the built-in table): its memory is checked, not its name
    custom = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, gpus=tuple(
        dataclasses.replace(g, gpu_type="LabCard") for g in s.gpus)) for s in plan.stages))
    assert check_devices(custom, [_gpu(0, "h0", *a100), _gpu(1, "h1", "Tesla T4", 14.7),
                                  _gpu(2, "h1", "NVIDIA GeForce RTX 3080", 40.0)]).skipped == ()
    with pytest.raises(DeviceMismatchError, match=r"rank 1 \(stage 1\) runs on a Tesla T4 \(8\.0 GiB\)"):
        check_devices(custom, [good[0], _gpu(1, "h1", "Tesla T4", 8.0), good[2]])
    # a CPU run: the GPU part skipped, with the reason; one host's CPU stands in for both nodes
    cpu = [DeviceObservation(rank=r, host="box", device_type="cpu") for r in range(3)]
    assert check_devices(plan, cpu).skipped == (
        "GPU name and memory: ranks 0, 1, 2 run on the CPU (no GPU to compare with the plan's)",
        "nodes: every rank runs on the CPU of host 'box', standing in for the plan's 2 nodes")


def test_device_check_refuses_wrong_node_order():
    plan = _plan3()
    a100, t4 = ("NVIDIA A100-SXM4-40GB", 39.4), ("Tesla T4", 14.7)
    # node names are host names: the t4 node started first (--node-rank 0) holds rank 0
    swapped = [_gpu(0, "t4-node", *t4), _gpu(1, "a100-node", *a100), _gpu(2, "a100-node", *a100)]
    with pytest.raises(DeviceMismatchError) as exc:
        check_devices(plan, swapped)
    assert exc.value.rank == 0  # the GPU part names it first
    hosts_only = [DeviceObservation(rank=0, host="t4-node.cluster", device_type="cpu"),
                  DeviceObservation(rank=1, host="a100-node", device_type="cpu"),
                  DeviceObservation(rank=2, host="a100-node", device_type="cpu")]
    with pytest.raises(DeviceMismatchError) as exc:
        check_devices(plan, hosts_only)
    assert str(exc.value) == (
        "rank 0 (stage 0) runs on host 't4-node.cluster', but the plan assigned it GPU 0 (A100-40GB) on node "
        "'a100-node'; start each node with its --node-rank: 0 on 'a100-node' (1 process: rank 0), 1 on 't4-node' "
        "(2 processes: ranks 1-2), the plan's nodes in the cluster file's order (`zorse train --nnodes 2 --node-rank K "
        "--master-addr HOST` on node K starts its processes; torchrun: --nproc-per-node); --skip-device-check runs "
        "anyway")
    ok = [_gpu(0, "a100-node.cluster", *a100), _gpu(1, "t4-node", *t4), _gpu(2, "t4-node", *t4)]
    assert check_devices(plan, ok).skipped == ()
    # node names are labels: ranks of one planned node on two hosts, or of two planned nodes on one host
    with pytest.raises(DeviceMismatchError, match=r"^rank 2 \(stage 1\) runs on host 'h2', but the plan puts it on "
                                                  r"node 't4-node' with rank 1, which runs on host 'h1'"):
        check_devices(plan, [_gpu(0, "h0", *a100), _gpu(1, "h1", *t4), _gpu(2, "h2", *t4)])
    with pytest.raises(DeviceMismatchError, match=r"^rank 1 \(stage 1\) runs on host 'h0' beside rank 0, but the "
                                                  r"plan puts it on node 't4-node' and rank 0 on node 'a100-node'"):
        check_devices(plan, [_gpu(0, "h0", *a100), _gpu(1, "h0", *t4), _gpu(2, "h0", *t4)])


def test_inject_inf_on_a_rank_counting_no_gradient_refused(lee_bytes, tmp_path):
    """--inject-inf on a rank whose gradients the global norm does not count
    (rank 1 of a data-parallel stage: each parameter's gradient is counted
    once, on rank 0) would write its inf into rank 1's replica only, unseen by
    the non-finite check, and only show a step later as "non-finite weights":
    rank 1 refuses it in one line naming the ranks that count. (2 ranks from
    the suite's fork server, stopped before the first step.)"""
    plan = fixed_plan(gpt3x64(), ((0, 1),), ((1, 1),), num_microbatches=2, global_batch_size=4)
    with pytest.raises(AssertionError) as e:
        run_distributed(plan, gpt3x64().state(), lee_bytes[:4096], tmp_path, steps=2, extra=("--inject-inf", "1:2"))
    lines = [ln for ln in str(e.value).splitlines() if ln.startswith("zorse: rank 1")]
    assert len(lines) == 1 and lines[0].startswith(
        "zorse: rank 1 (stage 0): --inject-inf 1:2: rank 1 adds no gradient to the global norm (each parameter's "
        "gradient is counted once, on the lowest rank holding it), so an inf written there would reach its own "
        "optimizer only; use one of ranks 0"), str(e.value)
