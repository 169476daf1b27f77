"""Paced compute: a CPU thread standing in for a slower GPU ([Note: paced compute]).

``ZORSE_PACE=F`` (set by the box for each rank and for the benchmarks it runs on a rank's behalf,
``zorse_fx/box``) makes every compute of the training runtime (each forward and backward, the optimizer
step) and every sample of the kernel profiler take ``F`` times the CPU time the thread spent on it,
measured on the thread's own CPU clock (``time.thread_time``), as a GPU ``F`` times slower than this
CPU's thread would: ``Pacer.paced`` sleeps the difference, ``Pacer.emulated_s`` says what a timed
region took on the emulated GPU without sleeping.

[Note: paced compute]
The box first gave each rank its GPU type's speed as a CFS CPU quota (``cpu.max``). Measured on it
(bench/cfs_burst.py, bench/LOG.md, 2026-12-06) a quota is not a slower processor: a compute burst
shorter than the quota's share of a period, after the rank idled, runs at the host's full speed (under
0.273 cores of a 10 ms period, 0.5-3 ms bursts took 1.1-1.6x their unthrottled time, not 3.7x), so a
pipeline's short micro-batches ran up to 2.7x faster than profiled; and the quota throttles everything
in the rank's cgroup, the threads that carry its communication too (a Gloo all-reduce waits for the next
period once the backward has spent the quota: box case (a)'s 2-rank plan measured 10-15 ms per step of
collectives priced at under 1 ms). A GPU does neither: its kernels take their time however long it
idled, and its NIC and copy engines run whatever its SMs do. Pacing is both: a compute of CPU time
``c`` takes ``max(wall, F x c)``, whatever ran before it; communication (other threads: Gloo's) and
the host's own Python run at the host's speed, as a real host's do. The CPU clock is the thread's, so a
loaded machine (other ranks, CI) stretches a paced compute only where it leaves the thread less than
``1/F`` of a core. What it cannot emulate: a GPU's different balance of arithmetic to memory
bandwidth (every type is this CPU, slowed), and compute running beside its own host code (the
runtime's Python between two computes is not overlapped with the next compute as a CUDA stream's
queue would be).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator

from .errors import BoxConfigError

__all__ = ["ENV_PACE", "MAX_PACE", "Pacer", "pace_factor"]

#: The environment variable holding a process's pace factor (absent or ``1``: not paced).
ENV_PACE = "ZORSE_PACE"
#: The largest factor accepted (a GPU 1000x slower than one CPU thread is no GPU).
MAX_PACE = 1000.0


def pace_factor(environ: dict[str, str] | os._Environ | None = None) -> float:
    """This process's pace factor from ``ZORSE_PACE`` (default ``1.0``: not paced).

    Raises:
        BoxConfigError: a value that is not a number from 1 to ``MAX_PACE``, naming the variable and value.
    """
    text = (os.environ if environ is None else environ).get(ENV_PACE, "").strip()
    if not text:
        return 1.0
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (1.0 <= value <= MAX_PACE):
        raise BoxConfigError(f"{ENV_PACE}={text!r}: give the compute slowdown as a number from 1 to {MAX_PACE:g} "
                             f"(set by the box for its ranks; unset it to run at this CPU's speed)")
    return value


class Pacer:
    """Stretches timed regions to ``factor`` x the CPU time this thread spent in them ([Note: paced compute]).

    ``factor``: 1 (nothing is slept) to ``MAX_PACE``. The clocks and ``sleep`` are arguments so that a test
    can drive them; defaults ``time.thread_time``, ``time.perf_counter``, ``time.sleep`` (seconds).
    """

    def __init__(self, factor: float = 1.0, *, cpu_clock: Callable[[], float] | None = None,
                 wall_clock: Callable[[], float] | None = None, sleep: Callable[[float], None] | None = None) -> None:
        if not (1.0 <= factor <= MAX_PACE):
            raise BoxConfigError(f"pace factor {factor!r}: give a number from 1 to {MAX_PACE:g}")
        self.factor = float(factor)
        self._cpu = cpu_clock or (lambda: time.thread_time())
        self._wall = wall_clock or (lambda: time.perf_counter())
        self._sleep = sleep or (lambda s: time.sleep(s))
        #: Seconds slept so far (what the pacing added).
        self.slept_s = 0.0

    @property
    def active(self) -> bool:
        """Whether anything is stretched (factor above 1)."""
        return self.factor > 1.0

    def start(self) -> tuple[float, float]:
        """``(cpu, wall)`` now, for ``finish`` or ``emulated_s``."""
        return self._cpu(), self._wall()

    def emulated_s(self, start: tuple[float, float]) -> float:
        """Seconds the region begun at ``start`` takes on the emulated GPU: ``max(wall, factor x cpu)``."""
        cpu, wall = self._cpu() - start[0], self._wall() - start[1]
        return max(wall, self.factor * cpu)

    def finish(self, start: tuple[float, float]) -> None:
        """Sleep until the region begun at ``start`` has taken ``factor`` x its CPU time (nothing at factor 1)."""
        if self.factor <= 1.0:
            return
        cpu, wall = self._cpu() - start[0], self._wall() - start[1]
        extra = self.factor * cpu - wall
        if extra > 0:
            self._sleep(extra)
            self.slept_s += extra

    @contextlib.contextmanager
    def paced(self) -> Iterator[None]:
        """The block takes ``factor`` x its CPU time (``start`` ... ``finish``)."""
        if self.factor <= 1.0:
            yield
            return
        start = self.start()
        yield
        self.finish(start)
