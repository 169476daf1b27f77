"""The runtime's measurement of a rank's memory ([Note: measured rank memory] in
zorse_fx/runtime/memory_meter.py) on this CPU: what a rank allocates after the meter is made is counted,
what it held before is not, and the number is a peak."""

from __future__ import annotations

import sys

import pytest
import torch

from zorse_fx.runtime.memory_meter import MemoryMeter

MIB = 2**20


@pytest.mark.skipif(sys.platform != "linux", reason="the peak reset (/proc/self/clear_refs) is Linux's")
def test_cpu_meter_counts_what_is_allocated_after_it_not_before():
    # 128 MiB touched and freed before the meter: the process's lifetime peak, not the rank's.
    before = torch.ones(32 * MIB)  # 32 Mi float32 = 128 MiB
    del before
    meter = MemoryMeter(torch.device("cpu"))
    assert meter.peak_bytes() < 16 * MIB
    x = torch.ones(16 * MIB)  # 64 MiB, touched (anonymous memory, one mmap of its own)
    peak = meter.peak_bytes()
    # The tensor, give or take what else the process touched or released meanwhile (measured 63.9 MiB:
    # a few pages the interpreter gave back); not the 128 MiB before, which would read >= 128 MiB.
    assert 60 * MIB <= peak <= 96 * MIB, peak / MIB
    del x
    assert meter.peak_bytes() == peak  # a peak: freeing does not lower it
    y = torch.ones(8 * MIB)  # 32 MiB, under the peak
    assert meter.peak_bytes() == peak
    del y
