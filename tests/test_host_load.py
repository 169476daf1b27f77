"""bench/_host_load.py: the count of runnable processes outside any box, read from the real /proc (what
bench/box.py records per repetition to flag a run measured beside other work)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "_host_load", Path(__file__).resolve().parents[1] / "bench" / "_host_load.py")
_host_load = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_host_load)
OthersRunnable, runnable_outside_boxes = _host_load.OthersRunnable, _host_load.runnable_outside_boxes


def test_a_busy_process_outside_any_box_is_counted_and_skipped_when_asked():
    """A process spinning on a core is in state R nearly all the time: sampled 20 times over 1 s it is counted
    in some sample, and the sampler's mean is above 0."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)  # (its interpreter's start-up)
        seen = 0
        for _ in range(20):
            seen += runnable_outside_boxes() >= 1
            time.sleep(0.05)
        assert seen >= 1
        with OthersRunnable(interval_s=0.05) as others:
            deadline = time.monotonic() + 60  # (a loaded machine samples more slowly: wait for 3, not for a time)
            while len(others.samples) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
        assert len(others.samples) >= 3 and others.mean > 0
    finally:
        busy.kill()
        busy.wait()


def test_a_reading_of_proc_counts_only_state_r_outside_boxes(tmp_path):
    """The parsing, on files written as /proc writes them: a running process, a sleeping one, a running one in a
    box's cgroup, a name with a parenthesis and a space (``stat``'s state follows the last ')'), a non-pid entry."""
    rows = {"11": ("(python3) R 1", "4:cpu:/user.slice"), "12": ("(bash) S 1", "4:cpu:/"),
            "13": ("(python) R 1", "4:cpu:/zbox-bench_b/r2-v100/rank0/gpu"), "14": ("(a) b) R 1", "4:cpu:/")}
    for pid, (stat, cgroup) in rows.items():
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "stat").write_text(f"{pid} {stat} 0 0\n")
        (tmp_path / pid / "cgroup").write_text(cgroup + "\n")
    (tmp_path / "self").mkdir()
    assert runnable_outside_boxes(tmp_path) == 2
    assert runnable_outside_boxes(tmp_path, skip=frozenset({11})) == 1
