"""A rank's error as one line; its traceback in the run directory's logs.

[Note: one line per error]
Every rank of a job that fails used to print its traceback, and torchrun its
own (``ChildFailedError`` with a box of details): 45-150 lines for one wrong
file. Now

- a rank (``zorse_fx/train.py``'s ``main``) that raises writes the traceback
  to ``<out>/logs/rank<k>.log`` and a record of the error (rank, stages,
  message, time) to ``<out>/logs/rank<k>.error.json`` (``record_rank_error``),
  and prints ``zorse: rank <k> (stage <s>): <cause>`` on its stderr -- unless
  the launcher collects the records (``COLLECT_ENV``, set by ``zorse train``);
- ``zorse train``'s launcher (``runtime/launch.py``) keeps torchrun's own
  chatter (its log lines and its ``ChildFailedError`` traceback) in
  ``<out>/logs/torchrun.log`` and, when the job fails, reads the records and
  raises one line (``summarize``): the first rank that failed and its cause,
  the log holding its traceback, and the ranks that stopped after it (a peer
  whose collective broke because that rank left).

[Note: the rank that died first]
A rank killed by a signal (SIGKILL from the OOM killer, a lost GPU, a
segfault in native code) or one that exits without a Python traceback
writes no record; its peers then fail in their next collective ("Connection
closed by peer", "Connection reset by peer", an NCCL error) and do write
records, so the records alone blame a peer. torchrun's failure report
(``ChildFailedError``'s box, in ``<out>/logs/torchrun.log``) lists every
failed worker with its rank, exit code and pid (``failed_ranks``), and
torchrun logs each worker it stops itself ("Sending process <pid> closing
signal SIGTERM": ``stopped_pids``). Its "root cause" is the failure with the
earliest time stamp, in whole seconds: a peer that recorded its broken
connection in the same second ties with the dead rank and may be named
instead. ``first_failure`` therefore takes, among the workers torchrun did
not stop, the first that died by a signal, else the first that exited with
an error status and no record (no Python traceback), else torchrun's root
cause. ``summarize`` names a rank that died so, how, and the ranks whose
records came after it; where every failed rank has a record (Python errors
only), the oldest record is the cause (its time is the rank's own clock,
finer than torchrun's seconds). ``zorse train --elastic`` drops the first
failure's GPU (``elastic.lost_rank``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from ..errors import ZorseError

__all__ = ["LOGS", "COLLECT_ENV", "MAX_CAUSE_CHARS", "logs_dir", "rank_log", "cause_of", "record_rank_error",
           "read_rank_errors", "clear_rank_errors", "summarize", "RankFailure", "failed_ranks", "stopped_pids",
           "first_failure", "STOP_SIGNALS", "EXIT_NONFINITE", "VERDICTS"]

#: The run directory's log folder.
LOGS = "logs"
#: Set (to "1") in the ranks' environment by a launcher that reports their errors itself.
COLLECT_ENV = "ZORSE_COLLECT_RANK_ERRORS"
#: The exit status of every rank after a step whose loss or gradients were not finite
#: (``train.py``; ``zorse train`` exits with it too).
EXIT_NONFINITE = 3
#: Exit statuses a rank ends with on purpose, having said why: a refused option (2, as
#: argparse), a non-finite step, the job stopped by SIGTERM or SIGINT (128 + signal,
#: after a checkpoint). No rank died: ``first_failure`` does not take them for a death.
VERDICTS = frozenset({2, EXIT_NONFINITE, 128 + signal.SIGTERM, 128 + signal.SIGINT})
#: Longest cause shown on the one line (characters); the rest is in the rank's log.
MAX_CAUSE_CHARS = 1500
_SUFFIX = ".error.json"


def logs_dir(out: str | Path) -> Path:
    """``<out>/logs``."""
    return Path(out) / LOGS


def rank_log(out: str | Path, rank: int) -> Path:
    """``<out>/logs/rank<k>.log``: rank ``k``'s tracebacks."""
    return logs_dir(out) / f"rank{rank}.log"


def cause_of(exc: BaseException) -> str:
    """``exc`` in one line: a ``ZorseError``'s message (it names the file, the
    value and the fix), else the exception's type and message (a bug, or an
    error of torch or the OS); cut to ``MAX_CAUSE_CHARS``."""
    msg = " ".join(str(exc).split()) or type(exc).__name__
    if not isinstance(exc, ZorseError):
        msg = f"{type(exc).__name__}: {msg}"
    if len(msg) > MAX_CAUSE_CHARS:
        msg = f"{msg[:MAX_CAUSE_CHARS]}... ({len(msg) - MAX_CAUSE_CHARS} characters more in the log)"
    return msg


def _where(rank: int, stages: tuple[int, ...]) -> str:
    if not stages:
        return f"rank {rank}"
    return f"rank {rank} ({'stage' if len(stages) == 1 else 'stages'} {', '.join(map(str, stages))})"


def record_rank_error(exc: BaseException, *, out: str | Path, rank: int, stages: tuple[int, ...] = ()) -> str:
    """Rank ``rank`` failed with ``exc``: append its traceback to
    ``<out>/logs/rank<k>.log``, write ``<out>/logs/rank<k>.error.json``, and
    print the one line (unless ``COLLECT_ENV`` is set). Returns the line. A
    log that cannot be written (a read-only ``out``) is said on the line."""
    # A DeviceMismatchError is about a rank its message names (every rank raises it): no prefix.
    text = cause_of(exc) if hasattr(exc, "rank") else f"{_where(rank, stages)}: {cause_of(exc)}"
    line = f"zorse: {text}"
    log = rank_log(out, rank)
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} rank {rank} (pid {os.getpid()}) ---\n")
            traceback.print_exception(exc, file=f)
        record = {"rank": rank, "stages": list(stages), "text": text, "cause": cause_of(exc), "type": type(exc).__name__,
                  "time": time.time(), "log": str(log)}
        tmp = log.with_name(f"rank{rank}{_SUFFIX}.tmp")
        tmp.write_text(json.dumps(record) + "\n")
        tmp.replace(log.with_name(f"rank{rank}{_SUFFIX}"))
        line += f" (traceback: {log})"
    except OSError as err:
        line += f" (its traceback could not be written to {log}: {err})"
    if os.environ.get(COLLECT_ENV) != "1":
        print(line, file=sys.stderr, flush=True)
    return line


def read_rank_errors(out: str | Path, *, since: float = 0.0) -> list[dict]:
    """The error records of ``<out>/logs`` written at ``since`` (seconds since the epoch) or later, oldest first."""
    found = []
    for p in logs_dir(out).glob(f"rank*{_SUFFIX}"):
        try:
            rec = json.loads(p.read_text())
        except (OSError, ValueError, RecursionError):  # not a record of ours
            continue
        if isinstance(rec, dict) and rec.get("time", 0) >= since:
            found.append(rec)
    return sorted(found, key=lambda r: (r.get("time", 0), r.get("rank", 0)))


def clear_rank_errors(out: str | Path, *, ranks: tuple[int, ...] | None = None) -> None:
    """Remove the error records of an earlier job (the logs stay); ``ranks``:
    only theirs (one node of a multi-node job, whose ``out`` the others share)."""
    if ranks is not None:
        for r in ranks:
            (logs_dir(out) / f"rank{r}{_SUFFIX}").unlink(missing_ok=True)
        return
    for p in logs_dir(out).glob(f"rank*{_SUFFIX}"):
        p.unlink(missing_ok=True)


#: What a signal that ended a rank most likely means, said after its name.
_SIGNAL_HINTS = {signal.SIGKILL: "out of memory? see dmesg", signal.SIGSEGV: "a crash in native code",
                 signal.SIGBUS: "a lost device or a truncated memory-mapped file?",
                 signal.SIGABRT: "aborted by native code: a CUDA or C++ error?"}
#: Signals torchrun (and ``zorse train``) stop the workers with: a worker ended by one was stopped, not lost.
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


@dataclass(frozen=True, slots=True, kw_only=True)
class RankFailure:
    """One failed worker as torchrun's failure report names it ([Note: the rank that died first])."""

    rank: int
    #: The worker's exit status; negative: killed by signal ``-exitcode``.
    exitcode: int = 0
    #: Its process id (0: not reported).
    pid: int = 0
    #: No exit: the rank stopped making progress (no heartbeat for ``--stall-timeout``) and the job was stopped.
    stalled: bool = False

    @property
    def signal(self) -> signal.Signals | None:
        """The signal that ended the worker, or None (it exited, or the number is no signal here)."""
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode)
        except ValueError:
            return None

    def describe(self, *, hint: bool = False) -> str:
        """``"killed by SIGKILL"``, ``"exit status 1"``; ``hint``: with what the signal most likely
        means (``"killed by SIGKILL (out of memory? see dmesg)"``)."""
        if self.stalled:
            return "no progress for --stall-timeout"
        if self.exitcode >= 0:
            return f"exit status {self.exitcode}"
        sig = self.signal
        text = f"killed by {sig.name}" if sig is not None else f"killed by signal {-self.exitcode}"
        return f"{text} ({_SIGNAL_HINTS[sig]})" if hint and sig in _SIGNAL_HINTS else text


_ENTRY = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)"
                    r"(?:\s*\(pid:\s*(\d+)\))?", re.MULTILINE)
_ROOT = "Root Cause (first observed failure):"
_CLOSING = re.compile(r"Sending process (\d+) closing signal")


def failed_ranks(torchrun_output: str) -> list[RankFailure]:
    """The workers torchrun's last failure report names, its root cause first,
    then the others in the report's order (empty where the text has no
    report: torchrun itself failed, or the job was stopped)."""
    end = torchrun_output.rfind(_ROOT)
    if end < 0:
        return []
    start = torchrun_output.rfind("Failures:", 0, end)
    others = torchrun_output[start:end] if start >= 0 else ""
    root = torchrun_output[end:]
    return [RankFailure(rank=int(r), exitcode=int(c), pid=int(p or 0))
            for text in (root, others) for r, c, p in _ENTRY.findall(text)]


def stopped_pids(torchrun_output: str) -> frozenset[int]:
    """The pids of the workers torchrun stopped itself ("Sending process <pid> closing signal ...")."""
    return frozenset(int(p) for p in _CLOSING.findall(torchrun_output))


def first_failure(failures: list[RankFailure], *, stopped: frozenset[int] = frozenset(),
                  traced: frozenset[int] = frozenset(),
                  verdicts: frozenset[int] = frozenset()) -> RankFailure | None:
    """The rank that failed first ([Note: the rank that died first]) among
    ``failures`` (``failed_ranks``: the root cause first): leaving out the
    workers torchrun stopped (their pid in ``stopped``, or ended by SIGTERM or
    SIGINT), the first one killed by a signal, else the first with an exit
    status other than 0 and ``verdicts`` and no error record (its rank not in
    ``traced``), else the first left (torchrun's root cause where it is one of
    them). None where torchrun stopped every one."""
    own = [f for f in failures if not (f.pid and f.pid in stopped) and f.signal not in STOP_SIGNALS]
    killed = [f for f in own if f.exitcode < 0]
    silent = [f for f in own if f.exitcode > 0 and f.rank not in traced and f.exitcode not in verdicts]
    return (killed or silent or own or [None])[0]


def summarize(records: list[dict], *, torchrun_log: str | Path | None = None, died: RankFailure | None = None,
              stages: tuple[int, ...] = (), restarts: int = 0) -> str | None:
    """One line for a failed job from its ranks' error records (oldest first):
    the first one's rank, stage and cause, where its traceback is, and which
    ranks failed after it (with the same cause, or another: stopped by it).
    ``died``: a rank that died without a record ([Note: the rank that died
    first]; on ``stages``), named first, how it died, and every recorded rank
    as stopped after it; ``restarts``: torchrun's restarts it failed in, each
    (``--max-restarts``). None without records or ``died``."""
    log_note = [f"torchrun's output in {torchrun_log}"] if torchrun_log else []
    if died is not None:
        how = f"was {died.describe(hint=True)}" if died.exitcode < 0 else f"exited with status {died.exitcode}"
        parts = [f"{_where(died.rank, stages)} {how}, without a Python traceback"
                 + (f", in the last of {restarts + 1} attempts (--max-restarts {restarts})" if restarts else "")]
        after = [r for r in records if r["rank"] != died.rank]
        if after:
            ranks = sorted({r["rank"] for r in after})
            logs = sorted({r["log"] for r in after if r.get("log")})
            parts.append(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} stopped after it"
                         + (f" ({'their errors' if len(ranks) > 1 else 'its error'} in {', '.join(logs)})"
                            if logs else ""))
        if torchrun_log:
            parts.append(f"torchrun's report is in {torchrun_log}")
        return "; ".join(parts)
    if not records:
        return None
    first = records[0]
    same = sorted({r["rank"] for r in records[1:] if r.get("cause") == first.get("cause")})
    after = sorted({r["rank"] for r in records[1:]} - set(same) - {first["rank"]})
    notes = [f"traceback in {first['log']}"]
    if same:
        notes.append(f"rank{'s' if len(same) > 1 else ''} {', '.join(map(str, same))} the same")
    if after:
        notes.append(f"rank{'s' if len(after) > 1 else ''} {', '.join(map(str, after))} stopped after it")
    if torchrun_log:
        notes.append(f"torchrun's output in {torchrun_log}")
    return f"{first['text']} ({'; '.join(notes)})"
