"""CPU seconds of this process and its waited-for children (the planner's forked CP-SAT solves,
``solve/_search.run_isolated``), for the benchmarks' planner-time columns (issue 32 item 6):
``os.times()``' user + system time of the process and of its children that have been waited for."""

from __future__ import annotations

import os


def cpu_s() -> float:
    """User + system CPU seconds so far of this process and its waited-for children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system
