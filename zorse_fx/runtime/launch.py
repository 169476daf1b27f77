"""Start the ranks of a plan with torchrun on this machine (``zorse train``), and stop them.

[Note: stopping a job]
torchrun (torch.distributed.elastic) starts every worker with
``start_new_session=True`` (``elastic/multiprocessing/subprocess_handler``):
each rank is in its own session and process group, so neither a terminal's
Ctrl-C nor a signal to the launcher's process group reaches it. torchrun
itself forwards SIGINT/SIGTERM/SIGHUP/SIGQUIT to its workers' groups and
SIGKILLs them after ``--shutdown-timeout`` seconds; but a signal to the
``zorse train`` process alone used to end only that process, leaving torchrun
and every rank training, orphaned. ``supervise`` therefore

- starts torchrun in its own session (the terminal's Ctrl-C reaches only the
  launcher, which decides what happens) and records torchrun's descendants
  (psutil) every poll, so it can still find ranks that torchrun's death
  orphaned;
- on SIGINT or SIGTERM forwards the signal to torchrun (which forwards it to
  the ranks: on SIGTERM a rank may write a checkpoint before it exits), waits
  a grace period (SIGINT ``int_grace_s``, a few seconds; SIGTERM
  ``term_grace_s``, ``zorse train --term-grace-s``; a second signal cuts it
  short), then SIGSTOPs torchrun (no restarts while it is being killed),
  collects its descendants once more and SIGKILLs them all;
- with a heartbeat directory (``runtime/watchdog.py``) stops the job the same
  way when a live rank has not beaten for ``stall_timeout_s`` seconds, and
  names it.

Whatever ends the job (success included), every process it recorded is gone
when ``supervise`` returns or raises.

[Note: one zorse train per node]
On one host (``--nnodes 1``) torchrun runs ``--standalone`` and starts every
rank. On N nodes ``zorse train --nnodes N --node-rank k --master-addr HOST``
runs on each node and starts torchrun with its static rendezvous
(``--nnodes N --node-rank k --master-addr --master-port``, not
``--standalone``): node 0's agent serves the rendezvous store at HOST:PORT,
the others connect to it, and each node starts the plan's ranks of its node
(``node_launch``: ``Plan.node_ranks()[k]``, whose process count differs per
node where the plan leaves GPUs idle), torchrun numbering them from the sum
of the lower nodes' counts ([Note: ranks node by node] in ``plan.py``). The
node is named by ``--node-rank``, its place among the plan's nodes in the
cluster file's order; the ranks' device check compares every rank's host name
with its planned node and names the ``--node-rank`` each node needs
(``runtime/device_check.py``). Each node's launcher supervises its own ranks
only: its stall monitor reads their heartbeats (a shared ``--out`` holds every
node's, whose pids mean nothing here) and torchrun's log is
``logs/torchrun.node<k>.log``. ``--elastic`` across nodes: the nodes agree
through the shared run directory on what was lost and restart under one
re-plan ([Note: losing a node] in ``elastic_nodes.py``). Not across nodes:
torchrun restarts (``--max-restarts``; a static rendezvous restarts one
node's workers without the others') and ``--corpus`` (every node would
tokenize into the same file): refused where the options are parsed
(``cli.LaunchOptions``).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from ..errors import RuntimeExecutionError

__all__ = ["Rendezvous", "node_launch", "check_master_addr", "torchrun_command", "launch", "supervise", "rank_device", "init_process_group",
           "running", "JobInterrupted", "JobFailedError", "JobStalledError"]

#: Seconds a SIGINT (Ctrl-C) gives the ranks to exit before they are killed.
INT_GRACE_S = 5.0
#: Seconds a stalled job's other ranks get after SIGTERM before they are killed.
STALL_GRACE_S = 3.0
#: torchrun's own output (its log lines, its ``ChildFailedError`` report) under ``<out>/logs``.
TORCHRUN_LOG = "torchrun.log"
#: A line of torch's own logging: Python's ("E1202 03:20:00.123000 4242 torch/distributed/...] ...") or c10d's
#: ("[W1206 07:10:41.468072081 socket.cpp:207] [c10d] ...": a rendezvous across nodes warns of reverse lookups).
_TORCH_LOG_LINE = re.compile(r"^(?:[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+\] |\[[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ \S+\] )")


class _TorchrunFilter:
    """Copies torchrun's stderr (the ranks' too: they inherit it) to the
    terminal and every line to a log file, except torchrun's own lines on the
    terminal: torch's log lines, and Python tracebacks but their last line,
    the exception (torchrun's ``ChildFailedError`` and its report box not at
    all; a rank's own error is one ``zorse:`` line, [Note: one line per
    error] in ``runtime/rank_errors.py``)."""

    def __init__(self, source, log: Path, sink=None):
        self.source, self.sink = source, sink or sys.stderr
        self.reported = 0  # the ranks' `zorse:` lines shown
        self.log = open(log, "a")
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        hiding = False  # inside a traceback
        rest = False  # after torchrun's ChildFailedError: its report box
        for line in iter(self.source.readline, ""):
            self.log.write(line)
            self.log.flush()
            if rest or _TORCH_LOG_LINE.match(line):
                continue
            if line.startswith("Traceback (most recent call last):"):
                hiding = True
                continue
            if hiding:
                if line[:1] in (" ", "\t", "\n", "") or line.startswith("During handling of the above exception"):
                    continue
                hiding = False
                rest = "ChildFailedError" in line
                if rest:
                    continue  # (another traceback's last line, the exception, is shown)
            self.reported += line.startswith("zorse: ")
            self.sink.write(line)
            self.sink.flush()

    def close(self) -> None:
        self.thread.join(timeout=10)
        self.log.close()


def rank_device(backend: str) -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` (selected) for NCCL, else the CPU."""
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def init_process_group(backend: str, *, timeout: timedelta, device_id: torch.device | None = None) -> None:
    """``dist.init_process_group`` from torchrun's environment, safe across torchrun restarts.

    A worker that torchrun restarted (``--max-restarts``; ``TORCHELASTIC_RESTART_COUNT`` > 0)
    meets its peers in the same rendezvous store as the failed attempt, where
    that attempt's process-group keys are still set: Gloo's ``connectFullMesh``
    then dials the dead ranks' addresses ("Connection refused") and the restart
    fails (torch 2.13, ``--standalone``). Restarted attempts therefore use the
    store under the prefix ``/attempt_<n>``; the first attempt is
    ``dist.init_process_group`` unchanged."""
    import torch.distributed as dist

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt == 0:
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        return
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    dist.init_process_group(backend, store=dist.PrefixStore(f"/attempt_{attempt}", store), rank=rank,
                            world_size=world, timeout=timeout, device_id=device_id)


class JobInterrupted(KeyboardInterrupt):
    """The job was stopped because the launcher received ``signum`` (SIGINT or SIGTERM).

    A ``KeyboardInterrupt``: ``except Exception`` does not swallow it, and a
    caller that handles Ctrl-C handles this too."""

    def __init__(self, signum: int, detail: str = ""):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}{detail}")


class JobFailedError(RuntimeExecutionError):
    """torchrun ended with a non-zero status (a rank failed; its error is in the output).
    ``reported``: a rank printed the cause as a ``zorse:`` line already (a
    non-finite step, a refused run directory): ``zorse train`` adds none.
    ``exit_status``: what ``zorse train`` exits with (``returncode`` is torchrun's)."""

    def __init__(self, message: str, returncode: int, stdout: str | None = None, stderr: str | None = None, *,
                 reported: bool = False, exit_status: int = 1):
        super().__init__(message)
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr
        self.reported = reported
        #: The status ``zorse train`` exits with: 1, or 3 where the ranks stopped at a non-finite step.
        self.exit_status = exit_status


class JobStalledError(RuntimeExecutionError):
    """A rank stopped beating (``--stall-timeout``); the job was stopped. ``rank``: that rank."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


@functools.cache
def _torchrun_has_option(option: str) -> bool:
    """Whether this torch's torchrun knows ``option`` (``--shutdown-timeout`` is recent: torch 2.13 has it)."""
    from torch.distributed.run import get_args_parser

    _, unknown = get_args_parser().parse_known_args([f"{option}=1", "script.py"])
    return not unknown


@dataclass(frozen=True, slots=True, kw_only=True)
class Rendezvous:
    """Where the nodes of a multi-node job meet: torchrun's static rendezvous
    ([Note: one zorse train per node]); ``zorse train --nnodes --node-rank
    --master-addr --master-port``."""

    #: Nodes of the job (the plan's nodes, ``len(Plan.node_ranks())``), >= 2.
    nnodes: int
    #: This node's place among them, 0..nnodes-1 (``NodeRanks.node_rank``).
    node_rank: int
    #: Host name or address of node 0, where its torchrun agent serves the rendezvous store.
    master_addr: str
    #: TCP port of that store.
    master_port: int

    def __post_init__(self) -> None:
        assert self.nnodes >= 2 and 0 <= self.node_rank < self.nnodes and 0 < self.master_port < 65536, self


def node_launch(plan, rendezvous: Rendezvous, nproc: int = 0, *, plan_path: str | Path = "the plan"):
    """The ranks this node starts (``plan.NodeRanks``): node
    ``rendezvous.node_rank`` of ``plan.node_ranks()`` ([Note: ranks node by
    node] in ``plan.py``); ``nproc`` (0: the node's count) must be its count.

    Raises:
        LaunchError: the plan's nodes are not ``rendezvous.nnodes``; a node's
            ranks are not contiguous (a plan of format 14 or older, numbered
            stage by stage: re-plan); ``nproc`` is not the node's count."""
    from .preflight import LaunchError

    nodes = plan.node_ranks()
    split = [n for n in nodes if not n.contiguous]
    if split:
        n = split[0]
        raise LaunchError(
            f"{plan_path} numbers its ranks stage by stage (rank_order {plan.rank_order!r}, a plan of format 14 or "
            f"older): node {n.node!r} has {n.describe_ranks()}, but torchrun numbers the ranks of a node "
            f"consecutively, so it cannot run on {rendezvous.nnodes} nodes; re-plan with `zorse plan` (ranks "
            f"numbered node by node), or run it on one host without --nnodes")
    if len(nodes) != rendezvous.nnodes:
        listed = ", ".join(f"{n.node!r}" for n in nodes)
        raise LaunchError(
            f"--nnodes {rendezvous.nnodes} does not match {plan_path}: its ranks run on {len(nodes)} "
            f"node{'s' if len(nodes) != 1 else ''} ({listed}; a node the plan leaves idle takes no part); pass "
            f"--nnodes {len(nodes)} on each of them" + (" or leave --nnodes out" if len(nodes) == 1 else ""))
    node = nodes[rendezvous.node_rank]
    if nproc and nproc != len(node.ranks):
        raise LaunchError(
            f"--nproc {nproc} does not match {plan_path}: node {node.node!r} (--node-rank {node.node_rank}) runs "
            f"{len(node.ranks)} of the plan's ranks ({node.describe_ranks()}); leave --nproc out (or pass --nproc "
            f"{len(node.ranks)})")
    return node


def check_master_addr(rendezvous: Rendezvous) -> str | None:
    """What this host can tell about ``--master-addr`` before torchrun waits
    for the other nodes (up to its rendezvous timeout, 10 minutes): it must
    resolve here (else ``LaunchError``); on node 0, whose agent serves the
    rendezvous, returns a warning where it names none of this host's
    addresses (the nodes then meet only if that address forwards here, a
    service address; else every node waits); None where nothing is amiss."""
    import socket

    from .preflight import LaunchError

    r = rendezvous
    try:
        addrs = {a[4][0] for a in socket.getaddrinfo(r.master_addr, r.master_port, type=socket.SOCK_STREAM)}
    except OSError as exc:
        raise LaunchError(f"--master-addr {r.master_addr} does not resolve on this host ({exc}); give the host "
                          f"name or address of node 0 (--node-rank 0) as this node reaches it") from None
    if r.node_rank != 0:
        return None
    for a in addrs:
        try:
            with socket.socket(socket.AF_INET6 if ":" in a else socket.AF_INET) as sock:
                sock.bind((a, 0))
            return None  # an address of this host: node 0 serves the rendezvous there
        except OSError:
            continue
    return (f"--master-addr {r.master_addr} ({', '.join(sorted(addrs))}) is not an address of this host "
            f"({socket.gethostname()}), where --node-rank 0 serves the rendezvous: the nodes meet only if it forwards "
            f"here; else start --node-rank 0 on {r.master_addr}, or pass this host as --master-addr on every node")


def torchrun_command(nprocs: int, train_argv: list[str], *, max_restarts: int = 0,
                     shutdown_timeout_s: float | None = None, rendezvous: Rendezvous | None = None) -> list[str]:
    """The torchrun command line that runs ``python -m zorse_fx.train`` with
    ``train_argv`` on ``nprocs`` local processes: ``zorse train`` passes
    ``["--options-file", <out>/train_options.json]``; flags work too
    (``[plan_dir, "--data", ...]``). torchrun's own options come before
    ``-m zorse_fx.train``.

    ``rendezvous``: None starts a single-host job (``--standalone``); else
    this node of a multi-node job, under torchrun's static rendezvous
    (``--nnodes --node-rank --master-addr --master-port``; [Note: one zorse
    train per node]). ``max_restarts``: torchrun restarts every worker (up to
    this many times) when one fails; with checkpoints the restarted ranks
    resume. ``shutdown_timeout_s``: how long torchrun lets its workers exit
    after forwarding a signal before it SIGKILLs them (torchrun's default is
    30 s; left out where this torch's torchrun has no ``--shutdown-timeout``)."""
    if rendezvous is None:
        where = ["--standalone"]
    else:
        r = rendezvous
        where = [f"--nnodes={r.nnodes}", f"--node-rank={r.node_rank}", f"--master-addr={r.master_addr}",
                 f"--master-port={r.master_port}"]
    opts = [f"--max-restarts={max_restarts}"] if max_restarts else []
    if shutdown_timeout_s is not None and _torchrun_has_option("--shutdown-timeout"):
        opts.append(f"--shutdown-timeout={max(1, int(round(shutdown_timeout_s)))}")
    # On a node of a box (zorse_fx/box: ZORSE_BOX set by the box in every command it runs), each worker first
    # enters its local rank's cgroup (runtime does not import box: the variable's name is the interface).
    enter = ["-m", "zorse_fx.box.rank_enter"] if os.environ.get("ZORSE_BOX") else []
    return [
        sys.executable, "-m", "torch.distributed.run", *where, f"--nproc-per-node={nprocs}", *opts,
        *enter, "-m", "zorse_fx.train", *train_argv,
    ]


def job_env() -> dict[str, str]:
    """The environment torchrun and the ranks run in: one thread per rank, unbuffered output."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # each rank uses one thread
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.pop("TORCHELASTIC_RUN_ID", None)
    # =1 makes torchrun number node k's ranks k x (its own --nproc-per-node), wrong where the nodes' counts differ
    # (a plan that leaves GPUs idle): the cumulative count is the plan's numbering ([Note: ranks node by node]).
    env.pop("TORCH_ELASTIC_WORKER_IDENTICAL", None)
    return env


def launch(nprocs: int, train_argv: list[str], *, timeout_s: float | None = None,
           capture: bool = False, heartbeat_dir: str | Path | None = None, stall_timeout_s: float = 0,
           term_grace_s: float = 60.0, max_restarts: int = 0,
           stderr_tail_chars: int = 0, out: str | Path | None = None, rendezvous: Rendezvous | None = None,
           ranks: tuple[int, ...] | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m zorse_fx.train`` with ``train_argv`` (see
    ``torchrun_command``) on ``nprocs`` local processes under torchrun and ``supervise`` it.

    ``rendezvous``: this node of a multi-node job ([Note: one zorse train per
    node]), whose ranks are ``ranks`` (the stall monitor watches those
    only; torchrun's log is ``logs/torchrun.node<k>.log``).

    ``heartbeat_dir``/``stall_timeout_s``: stop the job when a rank has not
    beaten for that long (0: never). ``term_grace_s``: on SIGTERM, how long the
    ranks get to exit (write a checkpoint) before they are killed.
    ``max_restarts``: passed to torchrun, which restarts every worker when one
    dies (up to that many times). ``stderr_tail_chars``: see ``supervise``.
    ``out``: the run directory: the ranks'
    errors reach the user as one line ([Note: one line per error] in
    ``runtime/rank_errors.py``), torchrun's own output is kept in
    ``<out>/logs/torchrun.log``.

    Raises:
        JobFailedError: torchrun exited with a non-zero status; with ``out``,
            the message is one line naming the rank that failed first, and
            how ([Note: the rank that died first] in ``runtime/rank_errors.py``).
        JobStalledError: a rank stopped beating.
        JobInterrupted: SIGINT or SIGTERM; the job was stopped.
    """
    cmd = torchrun_command(nprocs, train_argv, max_restarts=max_restarts, shutdown_timeout_s=term_grace_s,
                           rendezvous=rendezvous)
    env = job_env()
    log = None
    if out is not None:
        from .rank_errors import COLLECT_ENV, clear_rank_errors, logs_dir

        name = TORCHRUN_LOG if rendezvous is None else TORCHRUN_LOG.replace(".log", f".node{rendezvous.node_rank}.log")
        log = logs_dir(out) / name
        log.parent.mkdir(parents=True, exist_ok=True)
        clear_rank_errors(out, ranks=ranks)
        env[COLLECT_ENV] = "1"
    started = time.time()
    try:
        return supervise(cmd, env, timeout_s=timeout_s, capture=capture, heartbeat_dir=heartbeat_dir,
                         stall_timeout_s=stall_timeout_s, term_grace_s=term_grace_s, torchrun_log=log,
                         stderr_tail_chars=stderr_tail_chars, ranks=ranks)
    except JobFailedError as exc:
        if out is None or exc.returncode < 0:
            raise
        raise _failed_job(exc, out, log, since=started - 1.0, max_restarts=max_restarts) from None


#: Bytes of the end of ``<out>/logs/torchrun.log`` read for torchrun's failure report and its stop lines.
_REPORT_TAIL_BYTES = 1 << 20


def _failed_job(exc: JobFailedError, out: str | Path, log: Path, *, since: float,
                max_restarts: int) -> JobFailedError:
    """``exc`` (torchrun failed) as the error ``zorse train`` shows: one line
    naming the rank that failed first ([Note: the rank that died first] in
    ``runtime/rank_errors.py``), from torchrun's report in ``log`` and the
    ranks' error records in ``out``; ``exit_status`` 3 where the ranks stopped
    at a non-finite step (``train.EXIT_NONFINITE``)."""
    from .rank_errors import (EXIT_NONFINITE, VERDICTS, failed_ranks, first_failure, read_rank_errors, stopped_pids,
                              summarize)

    text = exc.stderr or ""  # (capture: torchrun's stderr is the error's; else it went to the log)
    if log.exists():
        with open(log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _REPORT_TAIL_BYTES))
            text = f.read().decode("utf-8", errors="replace")
    records = read_rank_errors(out, since=since)
    traced = frozenset(r["rank"] for r in records)
    first = first_failure(failed_ranks(text), stopped=stopped_pids(text), traced=traced, verdicts=VERDICTS)
    status = EXIT_NONFINITE if first is not None and first.exitcode == EXIT_NONFINITE else 1
    # A rank with a record failed with a Python error: the oldest record (in its rank's own clock, finer
    # than torchrun's whole seconds) is the cause, as without a report.
    died = first if first is not None and first.rank not in traced and first.exitcode not in VERDICTS else None
    line = summarize(records, torchrun_log=log if log.exists() else None, died=died,
                     stages=_planned_stages(out, died.rank) if died is not None else (),
                     restarts=max_restarts)
    if line is None:
        return JobFailedError(str(exc), exc.returncode, exc.stdout, exc.stderr, reported=exc.reported,
                              exit_status=status)
    return JobFailedError(line, exc.returncode, exc.stdout, exc.stderr, exit_status=status)


def _planned_stages(out: str | Path, rank: int) -> tuple[int, ...]:
    """The stages the plan of ``<out>/train_options.json`` gives ``rank`` (() where that cannot be read)."""
    from ..errors import ZorseError
    from ..plan import Plan
    from ..train_options import OPTIONS_FILE, read_options_file

    try:
        plan = Plan.load(read_options_file(Path(out) / OPTIONS_FILE).data.plan)
        return plan.stages_of(rank) if 0 <= rank < plan.world_size else ()
    except (OSError, ZorseError):
        return ()


def running(processes) -> list:
    """The ``psutil.Process`` objects of ``processes`` still running (a zombie,
    exited but not reaped, counts as gone)."""
    import psutil

    out = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


class _JobTree:
    """torchrun and every descendant seen so far (psutil handles, which survive pid reuse)."""

    def __init__(self, root: subprocess.Popen):
        import psutil

        self.root = root
        self.procs: dict[int, psutil.Process] = {}
        self.refresh()

    def refresh(self) -> None:
        import psutil

        try:
            kids = psutil.Process(self.root.pid).children(recursive=True)
        except psutil.Error:  # torchrun is gone: its orphans are still in self.procs
            return
        for k in kids:
            self.procs.setdefault(k.pid, k)

    def alive(self) -> list:
        return running(self.procs.values())

    def kill_all(self, wait_s: float = 10.0) -> None:
        """SIGSTOP torchrun (no restarts), collect its descendants again, SIGKILL all and wait for them."""
        import psutil

        if self.root.poll() is None:
            try:
                os.kill(self.root.pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
            self.refresh()
            self.root.kill()
        victims = self.alive()
        for p in victims:
            try:
                p.kill()
            except psutil.Error:
                pass
        try:
            self.root.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + wait_s
        while self.alive() and time.monotonic() < deadline:  # orphans are reaped by init, not us
            time.sleep(0.05)


class _StderrTail:
    """Copies the job's stderr to this process's on a thread as it comes (a
    progress bar's carriage returns too), keeping its last ``chars`` characters."""

    def __init__(self, chars: int):
        self.chars, self._parts, self._size, self._thread = chars, [], 0, None

    def start(self, stream) -> None:
        self._thread = threading.Thread(target=self._copy, args=(stream,), daemon=True)
        self._thread.start()

    def _copy(self, stream) -> None:
        import codecs

        decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        fd = stream.fileno()
        while True:
            chunk = os.read(fd, 65536)
            text = decode(chunk, final=not chunk)
            if text:
                sys.stderr.write(text)
                sys.stderr.flush()
                self._parts.append(text)
                self._size += len(text)
                while self._size > self.chars and len(self._parts) > 1:
                    self._size -= len(self._parts.pop(0))
            if not chunk:
                break
        stream.close()

    def join(self, timeout_s: float = 5.0) -> None:
        """Wait for the copy to reach the end of the stream (every writer gone), at most ``timeout_s``."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def text(self) -> str:
        return "".join(self._parts)[-self.chars:]


def supervise(cmd: list[str], env: dict[str, str] | None = None, *, timeout_s: float | None = None,
              capture: bool = False, heartbeat_dir: str | Path | None = None, stall_timeout_s: float = 0,
              term_grace_s: float = 60.0, int_grace_s: float = INT_GRACE_S,
              poll_s: float = 0.5, torchrun_log: str | Path | None = None,
              stderr_tail_chars: int = 0, ranks: tuple[int, ...] | None = None) -> subprocess.CompletedProcess:
    """Run torchrun's ``cmd`` in its own session until it ends; see [Note: stopping a job].

    ``capture``: the output is returned (``stdout``/``stderr``, text) instead of
    going to the terminal. ``torchrun_log`` (without ``capture``): stderr goes
    to the terminal without torchrun's own log lines and tracebacks, and all
    of it to this file (``_TorchrunFilter``). ``stderr_tail_chars`` (without
    ``capture``): the last this many characters of the job's stderr (from
    ``torchrun_log`` where given, else copied to the terminal line by line as
    it comes) are kept as the ``stderr`` of a ``JobFailedError`` (where
    torchrun names the rank that failed first: ``zorse train --elastic``). Signal handlers (SIGINT, SIGTERM) are installed only
    when called from the main thread, and restored on return. ``ranks``: the
    ranks this torchrun starts, whose heartbeats alone are cleared and watched
    (one node of a multi-node job; None: every rank's)."""
    hb = Path(heartbeat_dir) if heartbeat_dir else None
    if hb is not None:  # an old run's beats must not look stalled (another node's are that node's business)
        if ranks is None:
            shutil.rmtree(hb, ignore_errors=True)
        else:
            for r in ranks:
                (hb / f"rank{r}").unlink(missing_ok=True)
    received: list[int] = []
    old_handlers = {}
    out_f = tempfile.TemporaryFile("w+") if capture else None
    err_f = tempfile.TemporaryFile("w+") if capture else None
    tree = pump = None
    tee = (_StderrTail(stderr_tail_chars) if stderr_tail_chars and not capture and torchrun_log is None
           else None)

    def read(f):
        if f is None:
            return tee.text() if tee is not None else None
        f.seek(0)
        return f.read()

    try:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                old_handlers[s] = signal.signal(s, lambda signum, frame: received.append(signum))
        filtered = torchrun_log is not None and not capture
        proc = subprocess.Popen(cmd, env=env, stdout=out_f, stderr=subprocess.PIPE if filtered or tee else err_f,
                                text=True, start_new_session=True)
        if filtered:
            pump = _TorchrunFilter(proc.stderr, Path(torchrun_log))
        elif tee is not None:
            tee.start(proc.stderr)
        tree = _JobTree(proc)
        start = time.monotonic()
        while True:
            try:
                proc.wait(timeout=poll_s)
                break
            except subprocess.TimeoutExpired:
                pass
            tree.refresh()
            if received:
                sig = received[0]
                try:
                    proc.send_signal(sig)  # torchrun forwards it to every rank's process group
                except ProcessLookupError:
                    pass
                deadline = time.monotonic() + (term_grace_s if sig == signal.SIGTERM else int_grace_s)
                while proc.poll() is None and time.monotonic() < deadline and len(received) == 1:
                    tree.refresh()
                    time.sleep(0.1)
                n = len(tree.alive()) + (proc.poll() is None)
                detail = (f"; killed the {n} process{'es' if n != 1 else ''} of the job still running after "
                          f"{'--term-grace-s' if sig == signal.SIGTERM else 'the grace period'}" if n else
                          "; torchrun and every rank exited")
                raise JobInterrupted(sig, detail)
            if hb is not None and stall_timeout_s > 0:
                from .watchdog import stalled_rank

                beat = stalled_rank(hb, stall_timeout_s, ranks=ranks)
                if beat is not None:
                    try:
                        proc.send_signal(signal.SIGTERM)
                    except ProcessLookupError:
                        pass
                    deadline = time.monotonic() + min(STALL_GRACE_S, term_grace_s)
                    while proc.poll() is None and time.monotonic() < deadline:
                        time.sleep(0.1)
                    raise JobStalledError(
                        f"rank {beat.rank} (pid {beat.pid}) made no progress for {beat.age_s:.0f} s (stalled or "
                        f"stopped); stopped the job (--stall-timeout is {stall_timeout_s:g} s: raise it if one "
                        f"step can take longer)", beat.rank)
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                raise JobFailedError(f"the job ran longer than {timeout_s:g} s and was stopped: {' '.join(cmd)}",
                                     -1, read(out_f), read(err_f))
        stdout, stderr = read(out_f), read(err_f)
    finally:
        if tree is not None:
            tree.kill_all()
        if pump is not None:
            pump.close()
        for s, h in old_handlers.items():
            signal.signal(s, h)
        if tee is not None:
            tee.join()
        for f in (out_f, err_f):
            if f is not None:
                f.close()
    if tee is not None:
        stderr = tee.text()  # complete now (joined)
    elif pump is not None and stderr_tail_chars:  # all of stderr went to the log (the pump is closed)
        with open(torchrun_log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4 * stderr_tail_chars))
            stderr = f.read().decode("utf-8", errors="replace")[-stderr_tail_chars:]
    if proc.returncode != 0:
        where = ("the output is in this error's stdout/stderr" if capture else
                 f"see the ranks' errors above; torchrun's output is in {torchrun_log}" if torchrun_log else
                 "see the ranks' errors above")
        raise JobFailedError(f"torchrun exited with status {proc.returncode} ({where}): {' '.join(cmd)}",
                             proc.returncode, stdout, stderr, reported=pump is not None and pump.reported > 0)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
