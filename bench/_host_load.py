"""How much other work ran beside a box run: the mean count of runnable processes outside any box.

A box rank's compute is paced on its thread's CPU time ([Note: paced compute] in zorse_fx/pacing.py); while
it sleeps between computes, another process on that core leaves its caches cold, and the next compute takes
more CPU time than the profile measured on a quiet machine (box b_wan_pairs, 2026-12-07: the one-GPU plan
0.104 s a step beside a helper's tests, 0.089 s alone, simulated 0.089; bench/LOG.md). ``OthersRunnable``
samples ``/proc`` on a thread every ``interval_s`` and counts the processes in state R (running or runnable)
whose ``cpu`` cgroup is not a box's (``zbox-``) and that are not this process: their mean is how many cores'
worth of other work ran. A run beside more than ``BUSY_CORES`` of it is flagged.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

__all__ = ["BUSY_CORES", "OthersRunnable", "runnable_outside_boxes"]

#: A repetition whose other processes averaged more runnable than this is flagged as measured beside load.
BUSY_CORES = 0.25


def runnable_outside_boxes(proc: Path = Path("/proc"), skip: frozenset[int] = frozenset()) -> int:
    """The processes in state R under ``proc`` whose cgroups name no ``zbox-`` directory, but ``skip``'s."""
    n = 0
    for d in proc.iterdir():
        if not d.name.isdigit() or int(d.name) in skip:
            continue
        try:
            stat = (d / "stat").read_text()
            state = stat[stat.rindex(")") + 2]
            if state == "R" and "zbox-" not in (d / "cgroup").read_text():
                n += 1
        except (OSError, ValueError, IndexError):  # (a process that ended between the listing and the read)
            continue
    return n


class OthersRunnable:
    """A context manager: samples ``runnable_outside_boxes`` every ``interval_s`` while open; ``mean`` is the
    samples' mean (processes, i.e. cores' worth of other work), 0.0 without a sample."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s, self.samples = interval_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="others-runnable")

    def _run(self) -> None:
        me = frozenset({os.getpid()})
        while not self._stop.wait(self.interval_s):
            self.samples.append(runnable_outside_boxes(skip=me))

    def __enter__(self) -> OthersRunnable:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def mean(self) -> float:
        return sum(self.samples) / len(self.samples) if self.samples else 0.0
