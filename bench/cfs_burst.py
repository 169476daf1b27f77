"""How long a compute burst of W ms (at full speed) takes under a CFS quota, after idling (issue 47: the box).

    sudo .venv/bin/python bench/cfs_burst.py /sys/fs/cgroup/cpu/<a cgroup with cpu.cfs_quota_us set>

The box emulates a GPU's speed by a CPU quota per rank (zorse_fx/box/cgroups.py). This process calibrates
how many 128 x 128 matmuls (one thread) make a millisecond at full speed, joins the cgroup given, then for
bursts of W ms of that work, each after 50 ms idle, prints the median over 15 of (elapsed / W): the
slowdown the quota gives a burst of that length. Proves: whether short bursts escape the quota (CFS
budgets quota per period; an idle rank starts each burst with a full budget). Cannot: the box's
training itself (bench/box.py and `zorse timings` on its runs show the effect there).
"""
import json
import os
import statistics
import sys
import time

import torch

torch.set_num_threads(1)
a = torch.randn(128, 128)


def unit():  # one small matmul
    return a @ a



# calibrate: units per ms at full speed (no quota yet)
n = 2000
t0 = time.perf_counter()
for _ in range(n):
    unit()
per_ms = n / ((time.perf_counter() - t0) * 1e3)
cg = sys.argv[1]  # a cgroup v1 cpu directory (tasks file) or v2 directory (cgroup.procs)
procs = f"{cg}/tasks" if os.path.exists(f"{cg}/tasks") else f"{cg}/cgroup.procs"
with open(procs, "w") as f:
    f.write(str(os.getpid()))
res = {}
for w in (0.5, 1, 2, 3, 5, 10, 20, 50, 200):
    k, xs = max(1, int(w * per_ms)), []
    for _ in range(15):
        time.sleep(0.05)
        t0 = time.perf_counter()
        for _ in range(k):
            unit()
        xs.append((time.perf_counter() - t0) * 1e3 / w)
    res[w] = round(statistics.median(xs), 2)
print(json.dumps(res))
