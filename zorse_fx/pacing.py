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

[Note: drift-compensated pacing]
A thread's CPU time is not a fixed amount of work: on this project's shared 2-core VM the same forward +
backward took 44-57 ms of thread CPU time (medians of 20 s windows, 40-129 ms single steps) within four
minutes, and two profiles of one emulated type an hour apart priced the same plan 16% apart (bench/LOG.md,
2026-12-07). A GPU does not drift so, and a plan priced from a profile measured minutes before its run met
a slower (or faster) machine. ``ZORSE_PACE_REFERENCE=R`` (set by the box with ``ZORSE_PACE``) fixes the
unit: a small fixed workload (``reference_probe_s``, thread CPU time) took ``R`` seconds on the box's
nominal host, and each paced region takes ``F x cpu x R / probe``, where ``probe`` is the workload's CPU
time now (measured right after a region, at most every ``PROBE_EVERY_S`` of wall time). Over the same four
minutes the model's step divided by a probe of float32 matmuls varied 75.7-81.0 (window medians) where the
step alone varied 44.3-57.3 ms (bench/drift_probe.py). Matmuls are compute-bound and L2-resident; a model's
step is not all of that, and the drift a neighbour's load brings (a shared L3 and memory bus) slows its
memory-bound kernels more: so the probe is the matmuls plus one pass over 16 MB and an exp over 4 MB into
preallocated buffers (``probe_parts_s``; about 0.5 + 0.8 ms; its first call, untimed, touches them).
Measured side by side on one thread beside another process's load (2026-12-07, bench/LOG.md "The one-GPU
plan's forward on the box", "The drift the pacing takes out"; bench/drift_probe.py measures both): the GPT
forward in units of the matmuls alone ranged 6.1% over 10 s windows, in units of both parts 2.8%. The probe
runs inside the time the
region sleeps anyway where that time is longer than the last probe took (else a later region runs it: a
probe that outlasts a short region's sleep would stretch that region beyond its pace; one older than
``PROBE_OVERDUE_S`` runs whatever it costs); the box makes ``R`` its measured probe times
``PACE_HEADROOM`` so that even its fastest type (``F`` near 1) is paced when the host runs up to that much
slower than when the box came up. What it cannot remove: drift that slows the model's kernels and the
probe unequally.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator

from .errors import BoxConfigError

__all__ = ["ENV_PACE", "ENV_PACE_REFERENCE", "MAX_PACE", "PACE_HEADROOM", "PROBE_EVERY_S", "PROBE_OVERDUE_S",
           "Pacer", "nominal_reference_s", "pace_factor", "pace_reference_s", "probe_parts_s", "reference_probe_s"]

#: The environment variable holding a process's pace factor (absent or ``1``: not paced).
ENV_PACE = "ZORSE_PACE"
#: The environment variable holding the reference probe's CPU seconds on the nominal host ([Note:
#: drift-compensated pacing]); absent: regions are paced on raw CPU time.
ENV_PACE_REFERENCE = "ZORSE_PACE_REFERENCE"
#: The largest factor accepted (a GPU 1000x slower than one CPU thread is no GPU).
MAX_PACE = 1000.0
#: The box's nominal host is this much slower than its probe measured when the box came up, so that a rank
#: of pace ~1 is still paced when the host slows by up to that (drift of 20-35% measured, bench/LOG.md).
PACE_HEADROOM = 1.4
#: A paced region re-measures the reference probe when the last probe is older than this (seconds, wall), where
#: it has the time left to sleep for it; whatever time it has left once the last probe is older than
#: ``PROBE_OVERDUE_S`` (a rank of only short regions still follows the host's drift).
PROBE_EVERY_S = 0.25
PROBE_OVERDUE_S = 1.0
#: The reference probe's compute-bound part: ``_PROBE_CALLS`` matmuls of two ``_PROBE_N`` x ``_PROBE_N`` float32
#: matrices per sample (L2-resident).
_PROBE_N = 192
_PROBE_CALLS = 4
#: Its memory-bound part ([Note: drift-compensated pacing]): one multiply of ``_PROBE_STREAM`` float32 elements
#: into another buffer (16 MB read and written, beyond a core's L2) and one exp of ``_PROBE_EXP`` elements into
#: another (outputs preallocated: no page is faulted in a timed sample).
_PROBE_STREAM = 2_000_000
_PROBE_EXP = (256, 4096)
_PROBE_SAMPLES = 3
#: Bounds of a reference (seconds): a probe outside them is no CPU's.
_REFERENCE_RANGE = (1e-6, 10.0)
_probe_inputs: list = []


def probe_parts_s(samples: int = _PROBE_SAMPLES) -> list[tuple[float, float]]:
    """Per sample, the CPU seconds (``time.thread_time``) of the reference probe's two parts on this thread now:
    ``(matmuls, memory pass)`` (about 0.5 and 0.8 ms on the project's AMD EPYC thread). One thread: torch's
    intra-op pool is not used for tensors this small (the box's ranks run with one)."""
    import torch

    if not _probe_inputs:
        g = torch.Generator().manual_seed(0)
        made = [torch.randn(_PROBE_N, _PROBE_N, generator=g) for _ in range(3)]
        made += [torch.randn(_PROBE_STREAM, generator=g), torch.empty(_PROBE_STREAM),
                 torch.randn(*_PROBE_EXP, generator=g), torch.empty(*_PROBE_EXP)]
        a, b, out, stream, stream_out, logits, logits_out = made
        torch.mm(a, b, out=out)  # one untimed pass: the outputs' first touch, the kernels' set-up
        torch.mul(stream, 1.0001, out=stream_out)
        torch.exp(logits, out=logits_out)
        _probe_inputs.extend(made)
    a, b, out, stream, stream_out, logits, logits_out = _probe_inputs
    parts = []
    for _ in range(samples):
        t = time.thread_time()
        for _ in range(_PROBE_CALLS):
            torch.mm(a, b, out=out)
        t_mm = time.thread_time()
        torch.mul(stream, 1.0001, out=stream_out)
        torch.exp(logits, out=logits_out)
        parts.append((t_mm - t, time.thread_time() - t_mm))
    return parts


def reference_probe_s(samples: int = _PROBE_SAMPLES) -> float:
    """The reference workload's CPU seconds on this thread now: the median over ``samples`` of both parts of
    ``probe_parts_s`` together (about 1.3 ms on the project's AMD EPYC thread)."""
    times = sorted(mm + mem for mm, mem in probe_parts_s(samples))
    return max(times[len(times) // 2], 1e-7)


def nominal_reference_s(duration_s: float = 0.5, headroom: float = PACE_HEADROOM) -> float:
    """The box's ``ZORSE_PACE_REFERENCE``: the median probe over ``duration_s`` of wall time, times
    ``headroom`` ([Note: drift-compensated pacing])."""
    probes = [reference_probe_s()]
    end = time.perf_counter() + duration_s
    while time.perf_counter() < end:
        probes.append(reference_probe_s())
    probes.sort()
    return headroom * probes[len(probes) // 2]


def pace_reference_s(environ: dict[str, str] | os._Environ | None = None) -> float | None:
    """This process's ``ZORSE_PACE_REFERENCE`` in seconds, or None where it is unset.

    Raises:
        BoxConfigError: a value that is not a number of seconds in ``_REFERENCE_RANGE``.
    """
    text = (os.environ if environ is None else environ).get(ENV_PACE_REFERENCE, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    lo, hi = _REFERENCE_RANGE
    if not (lo <= value <= hi):
        raise BoxConfigError(f"{ENV_PACE_REFERENCE}={text!r}: give the reference probe's CPU seconds on the "
                             f"nominal host, from {lo:g} to {hi:g} (set by the box with {ENV_PACE}; unset it to "
                             f"pace on raw CPU time)")
    return value


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
    """Stretches timed regions to ``factor`` x the CPU time this thread spent in them ([Note: paced compute]),
    in units of the reference probe where ``reference_s`` is given ([Note: drift-compensated pacing]):
    ``factor x cpu x reference_s / probe``.

    ``factor``: 1 (nothing is slept without a reference) to ``MAX_PACE``; ``reference_s``: the probe's CPU
    seconds on the nominal host, or None. The clocks, ``sleep`` and ``probe`` are arguments so that a test can
    drive them; defaults ``time.thread_time``, ``time.perf_counter``, ``time.sleep``, ``reference_probe_s``
    (seconds).
    """

    def __init__(self, factor: float = 1.0, *, reference_s: float | None = None,
                 cpu_clock: Callable[[], float] | None = None, wall_clock: Callable[[], float] | None = None,
                 sleep: Callable[[float], None] | None = None, probe: Callable[[], float] | None = None) -> None:
        if not (1.0 <= factor <= MAX_PACE):
            raise BoxConfigError(f"pace factor {factor!r}: give a number from 1 to {MAX_PACE:g}")
        if reference_s is not None and not (_REFERENCE_RANGE[0] <= reference_s <= _REFERENCE_RANGE[1]):
            raise BoxConfigError(f"pace reference {reference_s!r} s: give the probe's CPU seconds, from "
                                 f"{_REFERENCE_RANGE[0]:g} to {_REFERENCE_RANGE[1]:g}")
        self.factor = float(factor)
        self.reference_s = reference_s
        self._cpu = cpu_clock or (lambda: time.thread_time())
        self._wall = wall_clock or (lambda: time.perf_counter())
        self._sleep = sleep or (lambda s: time.sleep(s))
        self._probe = probe or reference_probe_s
        self._probe_at: float | None = None
        #: The last probe's CPU seconds (None: none yet).
        self.last_probe_s: float | None = None
        #: Seconds slept so far (what the pacing added).
        self.slept_s = 0.0
        #: Wall seconds the last probe took (a region with less time left to sleep defers a due probe).
        self._probe_wall_s = 0.0

    @classmethod
    def from_environment(cls, environ: dict[str, str] | os._Environ | None = None) -> Pacer:
        """The pacer ``ZORSE_PACE`` and ``ZORSE_PACE_REFERENCE`` ask for (``BoxConfigError`` naming a bad one)."""
        return cls(pace_factor(environ), reference_s=pace_reference_s(environ))

    @property
    def active(self) -> bool:
        """Whether anything is stretched (factor above 1, or a reference to pace to)."""
        return self.factor > 1.0 or self.reference_s is not None

    def scale(self) -> float:
        """``reference_s / probe`` (1 without a reference): this host's speed now against the nominal host's,
        the probe re-measured where the last is older than ``PROBE_EVERY_S``."""
        if self.reference_s is None:
            return 1.0
        if self._probe_due():
            self._measure_probe()
        return self.reference_s / self.last_probe_s

    def _probe_due(self) -> bool:
        return self._probe_at is None or self._wall() - self._probe_at >= PROBE_EVERY_S

    def _measure_probe(self) -> None:
        t = self._wall()
        first = self.last_probe_s is None
        self.last_probe_s = self._probe()
        self._probe_at = self._wall()
        if not first:  # (the first also makes the probe's inputs: not what a probe takes)
            self._probe_wall_s = self._probe_at - t

    def start(self) -> tuple[float, float]:
        """``(cpu, wall)`` now, for ``finish`` or ``emulated_s``."""
        return self._cpu(), self._wall()

    def emulated_s(self, start: tuple[float, float]) -> float:
        """Seconds the region begun at ``start`` takes on the emulated GPU: ``max(wall, factor x cpu x scale)``
        (the probe, where one is due, runs after the region's clocks are read)."""
        cpu, wall = self._cpu() - start[0], self._wall() - start[1]
        return max(wall, self.factor * cpu * self.scale())

    def finish(self, start: tuple[float, float]) -> None:
        """Sleep until the region begun at ``start`` has taken ``factor x cpu x scale`` (nothing when inactive);
        a probe that is due runs first, inside that time, where the region has time left for it (the last
        probe's wall time; else it waits for a later region, [Note: drift-compensated pacing]: a probe that
        outlasts the time a short region sleeps would stretch that region beyond its pace)."""
        if not self.active:
            return
        cpu = self._cpu() - start[0]
        if self.reference_s is not None and self._probe_due():
            left = (self.factor * cpu * self.reference_s / self.last_probe_s - (self._wall() - start[1])
                    if self.last_probe_s is not None else math.inf)
            if left >= self._probe_wall_s or self._wall() - self._probe_at >= PROBE_OVERDUE_S:
                self._measure_probe()
        target = self.factor * cpu * (self.reference_s / self.last_probe_s if self.reference_s is not None else 1.0)
        extra = target - (self._wall() - start[1])
        if extra > 0:
            self._sleep(extra)
            self.slept_s += extra

    @contextlib.contextmanager
    def paced(self) -> Iterator[None]:
        """The block takes ``factor x cpu x scale`` (``start`` ... ``finish``)."""
        if not self.active:
            yield
            return
        start = self.start()
        yield
        self.finish(start)
