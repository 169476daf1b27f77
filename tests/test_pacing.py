"""Paced compute ([Note: paced compute] in zorse_fx/pacing.py): a CPU thread standing in for a GPU F times
slower, as the box runs its ranks and their kernel benchmarks. Clocks are driven by the tests (no test
reads a real clock's value)."""

from __future__ import annotations

import time

import pytest
import torch

from zorse_fx.cost import replay
from zorse_fx.errors import BoxConfigError
from zorse_fx.pacing import (ENV_PACE, ENV_PACE_REFERENCE, PROBE_EVERY_S, PROBE_OVERDUE_S, Pacer, nominal_reference_s,
                              pace_factor, pace_reference_s, probe_parts_s, reference_probe_s)


class Clocks:
    """A thread CPU clock and a wall clock the test advances; ``sleep`` advances the wall clock."""

    def __init__(self) -> None:
        self.cpu = self.wall = 0.0
        self.slept: list[float] = []

    def work(self, cpu_s: float, wall_s: float | None = None) -> None:
        self.cpu += cpu_s
        self.wall += cpu_s if wall_s is None else wall_s

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.wall += s


def pacer(factor: float, c: Clocks) -> Pacer:
    return Pacer(factor, cpu_clock=lambda: c.cpu, wall_clock=lambda: c.wall, sleep=c.sleep)


def test_a_paced_region_takes_factor_times_its_cpu_time():
    c = Clocks()
    p = pacer(4.0, c)
    with p.paced():
        c.work(0.010)  # 10 ms of CPU on a free core
    assert c.slept == [pytest.approx(0.030)] and c.wall == pytest.approx(0.040) and p.slept_s == pytest.approx(0.03)


def test_a_region_slowed_by_the_machine_sleeps_only_the_rest():
    """A loaded machine stretched the 10 ms of CPU to 25 ms of wall: 15 ms more make the 40; at 50 ms of wall
    nothing is slept (the emulated GPU is never made faster than the machine runs it)."""
    c = Clocks()
    p = pacer(4.0, c)
    with p.paced():
        c.work(0.010, wall_s=0.025)
    assert c.slept == [pytest.approx(0.015)]
    with p.paced():
        c.work(0.010, wall_s=0.050)
    assert len(c.slept) == 1


def test_emulated_seconds_without_sleeping():
    c = Clocks()
    p = pacer(2.5, c)
    start = p.start()
    c.work(0.004, wall_s=0.006)
    assert p.emulated_s(start) == pytest.approx(0.010) and c.slept == []
    start = p.start()
    c.work(0.004, wall_s=0.020)
    assert p.emulated_s(start) == pytest.approx(0.020)


def test_factor_one_never_sleeps():
    c = Clocks()
    p = pacer(1.0, c)
    assert not p.active
    with p.paced():
        c.work(0.010)
    p.finish(p.start())
    assert c.slept == []


@pytest.mark.parametrize("value", ["abc", "0.5", "nan", "inf", "1e9", "-2"])
def test_bad_pace_named_with_its_variable_and_fix(value):
    with pytest.raises(BoxConfigError, match=rf"{ENV_PACE}={value!r}: give the compute slowdown as a number from 1 "
                                             r"to 1000 \(set by the box for its ranks; unset it"):
        pace_factor({ENV_PACE: value})
    with pytest.raises(BoxConfigError, match="pace factor"):
        Pacer(0.5)


def test_pace_factor_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(ENV_PACE, raising=False)
    assert pace_factor() == 1.0
    monkeypatch.setenv(ENV_PACE, " 3.25 ")
    assert pace_factor() == 3.25


def test_kernel_profiler_samples_are_the_paced_time(monkeypatch):
    """cost.replay's samples (what `zorse bench kernels` writes) under ZORSE_PACE=4: each call of 5 ms of
    thread CPU time (a driven clock) is timed as 20 ms; without ZORSE_PACE as its wall time."""
    c = Clocks()
    monkeypatch.setattr(time, "thread_time", lambda: c.cpu)
    monkeypatch.setattr(time, "perf_counter", lambda: c.wall)

    def call():
        c.work(0.005)

    monkeypatch.setenv(ENV_PACE, "4")
    assert replay._timeit(call, torch.device("cpu"), repeats=3) == pytest.approx(20.0)
    with replay.timing_window(50.0):  # a window of calls: the mean of the paced calls in it
        assert replay._timeit(call, torch.device("cpu"), repeats=3) == pytest.approx(20.0)
    monkeypatch.delenv(ENV_PACE)
    assert replay._timeit(call, torch.device("cpu"), repeats=3) == pytest.approx(5.0)


class Probe:
    """The reference probe's CPU seconds, set by the test (the host's speed now)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.calls = seconds, 0

    def __call__(self) -> float:
        self.calls += 1
        return self.seconds


def test_a_slower_host_is_paced_in_units_of_the_reference():
    """[Note: drift-compensated pacing]: reference 1 ms on the nominal host. The host now runs the probe in
    2 ms (twice slower), so the region's 20 ms of CPU are 10 ms of nominal work: x3 = 30 ms, 10 more to sleep.
    The host then runs at the nominal speed: 10 ms of CPU x3 = 30 ms."""
    c, probe = Clocks(), Probe(0.002)
    p = Pacer(3.0, reference_s=0.001, cpu_clock=lambda: c.cpu, wall_clock=lambda: c.wall, sleep=c.sleep, probe=probe)
    with p.paced():
        c.work(0.020)
    assert c.slept == [pytest.approx(0.010)] and p.last_probe_s == 0.002
    c.wall += PROBE_EVERY_S  # the probe is due again
    probe.seconds = 0.001
    with p.paced():
        c.work(0.010)
    assert c.slept[1:] == [pytest.approx(0.020)] and probe.calls == 2


def test_the_probe_is_re_measured_at_most_every_probe_every_s():
    c, probe = Clocks(), Probe(0.001)
    p = Pacer(2.0, reference_s=0.001, cpu_clock=lambda: c.cpu, wall_clock=lambda: c.wall, sleep=c.sleep, probe=probe)
    for _ in range(5):  # 5 regions of 2 ms + 2 slept: 20 ms, well inside PROBE_EVERY_S
        with p.paced():
            c.work(0.001)
    assert probe.calls == 1
    start = p.start()
    c.work(0.001, wall_s=PROBE_EVERY_S)
    assert p.emulated_s(start) == pytest.approx(PROBE_EVERY_S) and probe.calls == 2


def test_a_reference_paces_even_at_factor_one():
    """The box's fastest type (factor 1) on a host faster than the nominal one (probe 0.5 ms for a 0.7 ms
    reference): 10 ms of CPU are 14 ms on the nominal host."""
    c = Clocks()
    p = Pacer(1.0, reference_s=0.0007, cpu_clock=lambda: c.cpu, wall_clock=lambda: c.wall, sleep=c.sleep,
              probe=Probe(0.0005))
    assert p.active
    with p.paced():
        c.work(0.010)
    assert c.slept == [pytest.approx(0.004)]


@pytest.mark.parametrize("value", ["abc", "0", "nan", "11", "-1e-3"])
def test_bad_pace_reference_named_with_its_variable_and_fix(value):
    with pytest.raises(BoxConfigError, match=rf"{ENV_PACE_REFERENCE}={value!r}: give the reference probe's CPU "
                                             r"seconds on the nominal host, from 1e-06 to 10 \(set by the box"):
        pace_reference_s({ENV_PACE_REFERENCE: value})
    assert pace_reference_s({}) is None
    with pytest.raises(BoxConfigError, match="pace reference"):
        Pacer(2.0, reference_s=20.0)


def test_pacer_from_the_environment():
    p = Pacer.from_environment({ENV_PACE: "2", ENV_PACE_REFERENCE: "0.0012"})
    assert (p.factor, p.reference_s, p.active) == (2.0, 0.0012, True)
    assert not Pacer.from_environment({}).active


def test_the_reference_probe_runs_real_matmuls_and_a_memory_pass():
    """The probe is thread CPU time of real float32 matmuls and a memory-bound pass (each part positive, one
    row per sample); the whole probe is their sum (positive, bounded); the nominal reference is the median
    probe times the headroom asked."""
    parts = probe_parts_s(samples=2)
    assert len(parts) == 2 and all(mm > 0 and mem > 0 for mm, mem in parts)
    assert 0 < reference_probe_s(samples=1) < 10
    assert 0 < nominal_reference_s(duration_s=0.0, headroom=1.0) < 10


class SlowProbe(Probe):
    """A probe that takes ``wall_s`` of the driven wall clock (and as much CPU) to run."""

    def __init__(self, seconds: float, clocks: Clocks, wall_s: float) -> None:
        super().__init__(seconds)
        self.clocks, self.wall_s = clocks, wall_s

    def __call__(self) -> float:
        self.clocks.work(self.wall_s)
        return super().__call__()


def test_a_due_probe_waits_for_a_region_with_time_left_for_it():
    """[Note: drift-compensated pacing]: a probe of 4 ms is due; a region of 1 ms CPU at x2 has 1 ms to sleep,
    so the probe waits (the region takes its 2 ms, not 5); the next region (10 ms CPU, 10 ms to sleep) runs it
    inside its sleep and still takes its 20 ms. Once the last probe is PROBE_OVERDUE_S old, a short region runs
    it whatever that costs it."""
    c = Clocks()
    probe = SlowProbe(0.001, c, 0.004)
    p = Pacer(2.0, reference_s=0.001, cpu_clock=lambda: c.cpu, wall_clock=lambda: c.wall, sleep=c.sleep, probe=probe)
    for calls in (1, 2):  # the first probe runs wherever it falls (no scale without it; its time, which makes
        with p.paced():  # the probe's inputs, is not the probe's); the second, inside a long region, is timed
            c.work(0.010)
        assert probe.calls == calls
        c.wall += PROBE_EVERY_S
    t0 = c.wall
    with p.paced():
        c.work(0.001)
    assert probe.calls == 2 and c.wall - t0 == pytest.approx(0.002)
    t0 = c.wall
    with p.paced():
        c.work(0.010)
    assert probe.calls == 3 and c.wall - t0 == pytest.approx(0.020)
    c.wall += PROBE_OVERDUE_S
    with p.paced():
        c.work(0.001)
    assert probe.calls == 4
