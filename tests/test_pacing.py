"""Paced compute ([Note: paced compute] in zorse_fx/pacing.py): a CPU thread standing in for a GPU F times
slower, as the box runs its ranks and their kernel benchmarks. Clocks are driven by the tests (no test
reads a real clock's value)."""

from __future__ import annotations

import time

import pytest
import torch

from zorse_fx.cost import replay
from zorse_fx.errors import BoxConfigError
from zorse_fx.pacing import ENV_PACE, Pacer, pace_factor


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
