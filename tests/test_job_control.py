"""`zorse train` stops its whole job: SIGTERM / SIGINT to the CLI end torchrun
and every rank; a stopped (SIGSTOP) rank ends the job with that rank named
(heartbeats, runtime/watchdog.py). Each test runs the real CLI, torchrun and 2
Gloo ranks in subprocesses, records every descendant while training runs, and
checks that none is left; the finally blocks kill whatever a failure left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from zorse_fx.cli import main as zorse_main
from zorse_fx.runtime.launch import running
from zorse_fx.runtime.watchdog import heartbeat_dir, read_heartbeats, stalled_rank, start_heartbeat

ROOT = Path(__file__).resolve().parents[1]

# Under pytest-xdist (`make test`: --dist loadgroup) the tests that start a
# torchrun job (marked JOB) run one after another on one worker: never two
# torchrun jobs of this file, each 3 processes with signals and second-scale
# waits, competing for the CPUs at once. The others (no torchrun job: unit
# checks and one light fake job of two sleeping processes) go to any worker,
# as every other test of the suite does beside these jobs.
JOB = pytest.mark.xdist_group("job_control")
#: How long a job, a signal's effect or a rank's exit may take before a test calls it hung: a bound
#: for a failure, never a speed the test expects (a loaded 2-core machine starts a 2-rank job in
#: tens of seconds); passing tests never wait for it.
END_S = 300.0


@pytest.fixture(scope="module")
def plan2(tmp_path_factory):
    """A 2-GPU plan of a tiny GPT (2 ranks on this CPU) and a small text corpus."""
    d = tmp_path_factory.mktemp("jobctl")
    cluster = d / "two.yaml"
    cluster.write_text("name: two\nnodes:\n  - name: n0\n    gpus: [{type: T4, count: 2}]\n"
                       "links:\n  intra_node: {bandwidth_GBps: 16, latency_us: 10}\n")
    assert zorse_main(["plan", "--model", "gpt", "--cluster", str(cluster), "--global-batch-size", "4",
                       "--seq-len", "32", "--planner", "stage_dp", "--precision", "fp32", "-o", str(d / "plan")]) == 0
    corpus = d / "corpus.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    return d / "plan", corpus


class Job:
    """`zorse train` in its own session; stdout/stderr collected by threads."""

    def __init__(self, plan: Path, corpus: Path, out: Path, *extra: str):
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        self.out = out
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "zorse_fx.cli", "train", str(plan), "--corpus", str(corpus), "--tokenizer",
             "bytes", "--steps", "100000", "--out", str(out), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True)
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.seen: dict[int, psutil.Process] = {}
        for stream, sink in ((self.proc.stdout, self.stdout), (self.proc.stderr, self.stderr)):
            threading.Thread(target=lambda s=stream, k=sink: k.extend(iter(s.readline, "")), daemon=True).start()

    def record(self) -> None:
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(p.pid, p)
        except psutil.Error:
            pass

    def wait_for_steps(self, n: int = 3, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.record()
            if sum("[zorse] step " in line for line in self.stdout) >= n and len(self.ranks()) == 2:
                self.record()
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.3)
        raise AssertionError(f"no {n} training steps (exit {self.proc.poll()}):\n"
                             + "".join(self.stdout[-20:] + self.stderr[-30:]))

    def ranks(self) -> dict[int, int]:
        return {b.rank: b.pid for b in read_heartbeats(heartbeat_dir(self.out))}

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError("zorse train did not end:\n" + "".join(self.stdout[-10:] + self.stderr[-30:]))

    def left(self) -> list[psutil.Process]:
        return running(self.seen.values())

    def cleanup(self) -> None:
        for p in self.left():
            try:
                p.resume()
                p.kill()
            except psutil.Error:
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def _gone_within(job: Job, seconds: float) -> list[psutil.Process]:
    deadline = time.monotonic() + seconds
    while job.left() and time.monotonic() < deadline:
        time.sleep(0.1)
    return job.left()


@JOB
@pytest.mark.parametrize("sig,status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_stops_torchrun_and_every_rank(plan2, tmp_path, sig, status):
    plan, corpus = plan2
    job = Job(plan, corpus, tmp_path / "run", "--term-grace-s", "15")
    try:
        job.wait_for_steps()
        ranks = job.ranks()
        assert set(ranks.values()) <= set(job.seen), (ranks, list(job.seen))  # the ranks are torchrun's descendants
        assert len(job.seen) >= 3  # torchrun + 2 ranks
        os.kill(job.proc.pid, sig)
        assert job.wait(END_S) == status
        err = [ln for ln in job.stderr if ln.strip()]
        assert err[-1].startswith(f"zorse: stopped by {signal.Signals(sig).name}"), err[-5:]
        assert _gone_within(job, END_S) == []
    finally:
        job.cleanup()


@JOB
def test_stopped_rank_is_named_and_ends_the_job(plan2, tmp_path):
    plan, corpus = plan2
    job = Job(plan, corpus, tmp_path / "run", "--stall-timeout", "8")
    stopped = None
    try:
        job.wait_for_steps()
        stopped = psutil.Process(job.ranks()[1])
        stopped.suspend()  # SIGSTOP: rank 1 stops beating; rank 0 waits in a collective and keeps beating
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and job.proc.poll() is None:
            ages = {b.rank: b.age_s for b in read_heartbeats(heartbeat_dir(job.out))}
            if ages.get(1, 0) > 5:
                # the beat thread runs while rank 0's main thread is blocked: rank 0 beat after rank 1
                # stopped (a comparison, not a time limit: holds on a loaded machine)
                assert ages[0] < ages[1], ages
                break
            time.sleep(0.2)
        assert job.wait(END_S) == 1
        err = [ln for ln in job.stderr if ln.strip()]
        assert err[-1].startswith(f"zorse: rank 1 (pid {stopped.pid}) made no progress for "), err[-5:]
        assert "(stalled or stopped); stopped the job (--stall-timeout is 8 s" in err[-1]
        assert _gone_within(job, END_S) == []
    finally:
        if stopped is not None:
            try:
                stopped.resume()
            except psutil.Error:
                pass
        job.cleanup()


@JOB
def test_max_restarts_restarts_every_rank(plan2, tmp_path):
    """--max-restarts 1: a SIGKILLed rank makes torchrun restart both ranks, which
    meet again (runtime/launch.py init_process_group: the restarted attempt's
    store prefix) and train again (from step 1: no checkpoint here)."""
    plan, corpus = plan2
    job = Job(plan, corpus, tmp_path / "run", "--max-restarts", "1")
    try:
        job.wait_for_steps()
        first = job.ranks()[1]
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 240
        while job.proc.poll() is None and time.monotonic() < deadline:
            job.record()
            if sum("[zorse] step   1/" in line for line in job.stdout) >= 2 and job.ranks().get(1) != first:
                break
            time.sleep(0.3)
        assert sum("[zorse] step   1/" in line for line in job.stdout) >= 2, "".join(job.stderr[-40:])
        assert job.ranks()[1] != first
        os.kill(job.proc.pid, signal.SIGTERM)
        assert job.wait(END_S) == 143
        assert _gone_within(job, END_S) == []
    finally:
        job.cleanup()


def test_heartbeat_files_and_stall_check(tmp_path):
    """The rank side writes rank<r> with its pid at once and keeps beating; the
    monitor reports only a live rank older than the timeout. (Beats compared
    with clock readings taken before them, not with a time limit: the same
    on a loaded machine.)"""
    before = time.time()
    start_heartbeat(tmp_path, 3, interval_s=0.2)
    (b,) = read_heartbeats(tmp_path, now=before)
    assert (b.rank, b.pid) == (3, os.getpid()) and b.age_s <= 0  # written at once, after `before`
    later = time.time()
    deadline = time.monotonic() + END_S  # (a bound for a thread that never beats again, not a speed)
    while read_heartbeats(tmp_path, now=later)[0].age_s > 0:  # rewritten by the thread
        assert time.monotonic() < deadline, "the heartbeat thread stopped beating"
        time.sleep(0.05)
    assert stalled_rank(tmp_path, 5.0) is None
    late = stalled_rank(tmp_path, 5.0, now=time.time() + 60)
    assert late is not None and late.rank == 3
    (tmp_path / "rank9").write_text('{"rank": 9, "pid": 999999999, "time": 0}')  # a dead rank: torchrun's business
    assert stalled_rank(tmp_path, 5.0, now=time.time() + 60).rank == 3
    with pytest.raises(ValueError, match="interval must be > 0"):
        start_heartbeat(tmp_path, 0, interval_s=0)


def test_train_options_reach_torchrun_and_the_ranks():
    from zorse_fx.cli import build_parser
    from zorse_fx.runtime.launch import torchrun_command
    from zorse_fx.train import parse_args

    a = build_parser().parse_args(["train", "p", "--max-restarts", "2", "--term-grace-s", "90",
                                   "--stall-timeout", "0", "--pg-timeout-min", "2.5"]).train
    launch = a.launch
    assert (launch.max_restarts, launch.term_grace_s, launch.stall_timeout, a.job.pg_timeout_min) == (2, 90.0, 0.0, 2.5)
    cmd = torchrun_command(2, ["--options-file", "o.json"], max_restarts=2, shutdown_timeout_s=90)
    assert "--max-restarts=2" in cmd and "--shutdown-timeout=90" in cmd
    assert cmd.index("--max-restarts=2") < cmd.index("zorse_fx.train")
    assert cmd[cmd.index("zorse_fx.train"):] == ["zorse_fx.train", "--options-file", "o.json"]
    t = parse_args(["p", "--tokens", "t.pt", "--pg-timeout-min", "2.5", "--heartbeat-s", "0"])
    assert (t.job.pg_timeout_min, t.job.heartbeat_s) == (2.5, 0.0)
    for bad in (["--max-restarts", "-1"], ["--stall-timeout", "soon"], ["--pg-timeout-min", "0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["train", "p", *bad])


FAKE_TORCHRUN = """
import signal, subprocess, sys, time
# A 'rank' in its own session (as torchrun starts them) that ignores SIGTERM and SIGINT.
rank = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                         "signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)"], start_new_session=True)
open(sys.argv[1], "w").write(f"{rank.pid}\\n")
signal.signal(signal.SIGTERM, lambda *a: sys.exit(1))  # the 'launcher' exits at once, orphaning its rank
time.sleep(600)
"""

SUPERVISE = """
import sys
from zorse_fx.runtime.launch import JobInterrupted, supervise
try:
    supervise([sys.executable, "-c", sys.argv[1], sys.argv[2]], term_grace_s=2)
except JobInterrupted as e:
    print(e, flush=True)
    sys.exit(128 + e.signum)
"""


def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    """The rank outlives the launcher that started it in its own session; supervise
    recorded it and SIGKILLs it after --term-grace-s (here 2 s)."""
    pidfile = tmp_path / "rank.pid"
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISE, FAKE_TORCHRUN, str(pidfile)], cwd=ROOT,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, text=True,
                           start_new_session=True)
    rank = None
    try:
        deadline = time.monotonic() + 60
        while not pidfile.exists() or not pidfile.read_text().endswith("\n"):
            assert time.monotonic() < deadline and sup.poll() is None, "the fake job did not start"
            time.sleep(0.1)
        rank = psutil.Process(int(pidfile.read_text()))
        # No wait for supervise to see the rank: it collects the job's processes again after
        # a signal arrives and before it forwards it, and the rank exists before we send it.
        os.kill(sup.pid, signal.SIGTERM)
        out, _ = sup.communicate(timeout=END_S)
        assert sup.returncode == 143
        assert out.strip() == "stopped by SIGTERM; killed the 1 process of the job still running after --term-grace-s"
        deadline = time.monotonic() + 30
        while rank.is_running() and rank.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not rank.is_running() or rank.status() == psutil.STATUS_ZOMBIE
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)
            sup.wait(timeout=30)
        if rank is not None:
            try:
                rank.kill()
            except psutil.Error:
                pass


@JOB
def test_sigterm_writes_a_checkpoint_then_resume_continues(plan2, tmp_path):
    """Spot preemption: with --checkpoint-every set (here too large to fire on
    its own), SIGTERM to `zorse train` makes every rank finish its step,
    agree on stopping, write checkpoints/step_<k> and exit; `--resume` then
    continues at step k + 1 and metrics.jsonl holds steps 1..k+2 once each."""
    from zorse_fx.runtime.checkpoint import latest_checkpoint, read_manifest

    plan, corpus = plan2
    run = tmp_path / "run"
    job = Job(plan, corpus, run, "--checkpoint-every", "100000", "--term-grace-s", str(int(END_S)))
    try:
        job.wait_for_steps()
        os.kill(job.proc.pid, signal.SIGTERM)
        assert job.wait(END_S) == 143
        assert _gone_within(job, END_S) == []
    finally:
        job.cleanup()
    ckpt = latest_checkpoint(run / "checkpoints")
    assert ckpt is not None, "".join(job.stdout[-10:] + job.stderr[-20:])
    k = read_manifest(ckpt)["step"]
    assert any(f"SIGTERM received: stopping after step {k} (checkpoint step_{k})" in ln for ln in job.stdout)
    assert zorse_main(["train", str(plan), "--corpus", str(corpus), "--steps", str(k + 2), "--out", str(run),
                       "--resume"]) == 0
    import json

    steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, k + 3))
