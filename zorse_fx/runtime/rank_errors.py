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
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

from ..errors import ZorseError

__all__ = ["LOGS", "COLLECT_ENV", "MAX_CAUSE_CHARS", "logs_dir", "rank_log", "cause_of", "record_rank_error",
           "read_rank_errors", "clear_rank_errors", "summarize"]

#: The run directory's log folder.
LOGS = "logs"
#: Set (to "1") in the ranks' environment by a launcher that reports their errors itself.
COLLECT_ENV = "ZORSE_COLLECT_RANK_ERRORS"
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
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and rec.get("time", 0) >= since:
            found.append(rec)
    return sorted(found, key=lambda r: (r.get("time", 0), r.get("rank", 0)))


def clear_rank_errors(out: str | Path) -> None:
    """Remove the error records of an earlier job (the logs stay)."""
    for p in logs_dir(out).glob(f"rank*{_SUFFIX}"):
        p.unlink(missing_ok=True)


def summarize(records: list[dict], *, torchrun_log: str | Path | None = None) -> str | None:
    """One line for a failed job from its ranks' error records (oldest first):
    the first one's rank, stage and cause, where its traceback is, and which
    ranks failed after it (with the same cause, or another: stopped by it). None
    without records."""
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
