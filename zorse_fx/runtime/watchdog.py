"""Rank heartbeats and the launcher's stall monitor (``zorse train --stall-timeout``).

Rank side: ``start_heartbeat(dir, rank)`` starts a daemon thread that rewrites
``<dir>/rank<r>`` (JSON: rank, pid, time) every ``interval_s`` seconds. The
thread keeps beating while the rank's main thread waits in a collective
(Gloo and NCCL release the GIL while they wait), so a rank that only waits for
a slow or stuck peer still beats; a rank that is stopped (SIGSTOP, a debugger,
a frozen host) or wedged in code that holds the GIL stops beating.

Launcher side: ``stalled_rank(dir, timeout_s)`` returns the rank whose file is
oldest and older than ``timeout_s``, if its process is still alive (a dead
rank is torchrun's business: it fails or restarts the job). The launcher
(``runtime/launch.py``) then stops the whole job and names that rank, instead of
every other rank waiting for the process-group timeout.

``<out>/.heartbeat`` is the directory both sides use (``heartbeat_dir``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HEARTBEAT_DIRNAME", "Beat", "heartbeat_dir", "start_beat", "start_heartbeat", "read_heartbeats", "stalled_rank"]

HEARTBEAT_DIRNAME = ".heartbeat"


def heartbeat_dir(out: str | Path) -> Path:
    """The heartbeat directory of the run directory ``out``."""
    return Path(out) / HEARTBEAT_DIRNAME


def _write_beat(path: Path, doc: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**doc, "time": time.time()}))
    os.replace(tmp, path)  # atomic: the monitor never reads half a file


def start_beat(path: str | Path, doc: dict, interval_s: float = 1.0, *,
               stop: threading.Event | None = None) -> threading.Thread:
    """Write ``doc`` with the time (JSON, ``"time"``: ``time.time()`` seconds) to ``path`` now and every
    ``interval_s`` seconds from a daemon thread, until ``stop`` is set or the process ends; returns the
    (started) thread. A rank's heartbeat (``start_heartbeat``) and a node launcher's beat
    (``elastic_nodes``, [Note: losing a node]) are two uses.

    Raises:
        ValueError: ``interval_s`` <= 0."""
    if interval_s <= 0:
        raise ValueError(f"heartbeat interval must be > 0 seconds, got {interval_s}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_beat(path, doc)  # the file exists as soon as this returns

    def beat() -> None:
        while True:
            time.sleep(interval_s)  # (a sleep, not Event.wait: the ranks' heartbeat thread as it always was)
            if stop is not None and stop.is_set():
                return
            try:
                _write_beat(path, doc)
            except OSError:  # a full or vanished disk must not kill the process; the monitor will notice
                pass

    t = threading.Thread(target=beat, name=f"zorse-beat-{path.name}", daemon=True)
    t.start()
    return t


def start_heartbeat(directory: str | Path, rank: int, interval_s: float = 1.0) -> threading.Thread:
    """Write ``<directory>/rank<rank>`` now and every ``interval_s`` seconds from a daemon thread.

    Returns the (started) thread; it ends with the process."""
    return start_beat(Path(directory) / f"rank{rank}", {"rank": rank, "pid": os.getpid()}, interval_s)


@dataclass(frozen=True)
class Beat:
    """One rank's last heartbeat: its rank, pid and seconds since it beat."""

    rank: int
    pid: int
    age_s: float


def read_heartbeats(directory: str | Path, now: float | None = None) -> list[Beat]:
    """Every rank's last beat in ``directory`` (none if it does not exist yet), by rank."""
    now = time.time() if now is None else now
    beats = []
    d = Path(directory)
    if not d.is_dir():
        return beats
    for f in d.glob("rank*"):
        try:
            rec = json.loads(f.read_text())
            beats.append(Beat(rank=int(rec["rank"]), pid=int(rec["pid"]), age_s=now - float(rec["time"])))
        except (OSError, ValueError, KeyError, TypeError, RecursionError):  # replaced while reading, or not ours
            continue
    return sorted(beats, key=lambda b: b.rank)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stalled_rank(directory: str | Path, timeout_s: float, now: float | None = None, *,
                 ranks: tuple[int, ...] | None = None) -> Beat | None:
    """The live rank that has not beaten for the longest time, if longer than ``timeout_s``; else None.
    ``ranks``: of these only (a node's own: another node's pids mean nothing on this host)."""
    late = [b for b in read_heartbeats(directory, now) if b.age_s > timeout_s and (ranks is None or b.rank in ranks)
            and _alive(b.pid)]
    return max(late, key=lambda b: b.age_s) if late else None
