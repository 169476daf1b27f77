"""Does a fixed reference probe track this machine's speed drift? ([Note: drift-compensated pacing])

    .venv/bin/python bench/drift_probe.py [--seconds 240] [--window 20] [--out bench/results/drift_probe.json]

One thread, alternately: the reference probe (``zorse_fx.pacing.probe_parts_s``: float32 matmuls, then a
memory-bound pass) and one forward + backward of the registry's GPT (micro-batch 8, sequence 64: box case
(a)'s model), each on the thread's CPU clock, a probe before and after each step, for ``--seconds``. Per
``--window`` of wall time: the medians of the step's CPU time, of the probe's, and of step / probe (the
step in probe units, what drift-compensated pacing stretches); over the windows, each one's range (max /
min of the medians). The same for the probe's matmuls alone (``*_matmul``: the probe up to 2026-12-07), so
that the two probes are compared on the same drift.

Proves: how much a thread's CPU time for fixed work moves on this machine within minutes, and how much of
that each probe takes out (the step / probe range against the step's). Cannot: another machine's drift,
or drift that slows a GPU (a real GPU does not run on a shared core); drift that slows the model's
kernels and the probe's unequally is left in.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=240.0)
    ap.add_argument("--window", type=float, default=20.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "drift_probe.json"))
    args = ap.parse_args(argv)
    import torch

    from zorse_fx.models import registry
    from zorse_fx.pacing import probe_parts_s

    torch.set_num_threads(1)
    model, _ = registry.load_model("gpt")
    x = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))

    def step() -> float:
        t = time.thread_time()
        loss = model(x, x)
        (loss[1] if isinstance(loss, tuple) else loss).backward()
        return time.thread_time() - t

    def probes() -> tuple[float, float]:
        """(the whole probe, its matmuls alone): medians of 3 samples, as ``reference_probe_s``."""
        parts = probe_parts_s()
        return (statistics.median(mm + mem for mm, mem in parts), statistics.median(mm for mm, _ in parts))

    step()
    rows = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < args.seconds:
        before = probes()
        cpu = step()
        after = probes()
        rows.append((time.perf_counter() - t0, (before[0] + after[0]) / 2, cpu, (before[1] + after[1]) / 2))
    windows = {}
    for t, probe, cpu, matmul in rows:
        windows.setdefault(int(t // args.window), []).append((probe, cpu, matmul))
    out_rows = [{"start_s": k * args.window, "steps": len(v),
                 "probe_ms": statistics.median(p for p, _, _ in v) * 1e3,
                 "probe_matmul_ms": statistics.median(m for _, _, m in v) * 1e3,
                 "step_cpu_ms": statistics.median(c for _, c, _ in v) * 1e3,
                 "step_over_probe": statistics.median(c / p for p, c, _ in v),
                 "step_over_probe_matmul": statistics.median(c / m for _, c, m in v)}
                for k, v in sorted(windows.items()) if len(v) >= 5]

    def spread(key):
        vals = [r[key] for r in out_rows]
        return max(vals) / min(vals)

    def cv(vals):
        return statistics.pstdev(vals) / statistics.mean(vals)

    doc = {"command": "bench/drift_probe.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "seconds": args.seconds, "window_s": args.window, "steps": len(rows), "windows": out_rows,
           "range_step_cpu": spread("step_cpu_ms"), "range_probe": spread("probe_ms"),
           "range_step_over_probe": spread("step_over_probe"),
           "range_step_over_probe_matmul": spread("step_over_probe_matmul"),
           "cv_step_cpu": cv([c for _, _, c, _ in rows]), "cv_step_over_probe": cv([c / p for _, p, c, _ in rows]),
           "cv_step_over_probe_matmul": cv([c / m for _, _, c, m in rows])}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{len(rows)} steps; window medians' range (max/min): step CPU {doc['range_step_cpu']:.3f}, probe "
          f"{doc['range_probe']:.3f}, step/probe {doc['range_step_over_probe']:.3f} (matmuls alone "
          f"{doc['range_step_over_probe_matmul']:.3f}); per step CV {doc['cv_step_cpu']:.3f} -> "
          f"{doc['cv_step_over_probe']:.3f} ({doc['cv_step_over_probe_matmul']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
