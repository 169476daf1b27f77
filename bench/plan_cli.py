"""Where `zorse plan`'s time goes: the README's command, CPU seconds per phase, cold and warm (issue 48 item 7).

    .venv/bin/python bench/plan_cli.py [--runs 2] [--out bench/results/plan_cli.json]

Runs ``zorse plan --model smollm2-135m --cluster examples/clusters/demo.yaml --global-batch-size 24
--seq-len 64`` in a fresh Python process per run (``--runs``: the first with an empty capture cache
directory, ``ZORSE_CACHE_DIR``; the others with the one it filled: [Note: the capture cache]), timing
each phase by wrapping the function that does it: imports (``zorse_fx.cli`` and what it loads), the
model (``models.registry.load_model``: weights from disk), capture (``api.capture``: torch.export, or the
cache; ``trace.capture_recorded`` where the plan is made without the model, [Note: a warm plan without the
model] in zorse_fx/api.py: then no model phase; writing that record is ``api.record_model``), pricing
(``planner.price``), the search (``planner.solve_plan``), the simulator's check (``sim.check.check_result``),
codegen (``planner.build_plan``), writing (``Plan.export``, ``save_weights``). CPU seconds: this process's
(``time.process_time``) plus its waited-for children's (``RUSAGE_CHILDREN``: forked CP-SAT solves); wall
seconds beside them.

Proves: where the CPU time of one interactive `zorse plan` goes on this machine, and what the capture
cache saves. Cannot: another machine's absolute seconds (a ratio between phases carries over better).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ["plan", "--model", "smollm2-135m", "--cluster", str(ROOT / "examples" / "clusters" / "demo.yaml"),
           "--global-batch-size", "24", "--seq-len", "64"]

_CHILD = r'''
import json, resource, sys, time

def cpu():
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + c.ru_utime + c.ru_stime

phases, t0, w0 = [], cpu(), time.perf_counter()
import zorse_fx.cli as cli
phases.append(["imports", cpu() - t0, time.perf_counter() - w0])

def wrap(owner, name, label):
    fn = getattr(owner, name)
    def timed(*a, **k):
        c, w = cpu(), time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            phases.append([label, cpu() - c, time.perf_counter() - w])
    setattr(owner, name, timed)

import zorse_fx.api as api, zorse_fx.models.registry as reg, zorse_fx.planner as planner
import zorse_fx.sim.check as check, zorse_fx.plan as plan_mod, zorse_fx.capture.trace as trace
wrap(reg, "load_model", "model (weights)")
wrap(api, "capture", "capture")
wrap(trace, "capture_recorded", "capture")
wrap(api, "record_model", "model record")
wrap(planner, "price", "pricing")
wrap(planner, "solve_plan", "search (CP-SAT)")
wrap(check, "check_result", "simulator check")
wrap(planner, "build_plan", "codegen")
wrap(plan_mod.Plan, "export", "writing plan")
wrap(api.CompiledModel, "save_weights", "writing weights")
c, w = cpu(), time.perf_counter()
rc = cli.main(json.loads(sys.argv[1]))
phases.append(["zorse plan (all)", cpu() - c, time.perf_counter() - w])
print("PHASES " + json.dumps({"rc": rc, "phases": phases, "total_cpu_s": cpu() - t0,
                              "total_wall_s": time.perf_counter() - w0}))
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "plan_cli.json"))
    args = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="zorse-plan-cli-") as tmp:
        cache = Path(tmp) / "cache"
        for k in range(args.runs):
            out = Path(tmp) / f"plan{k}"
            env = {**os.environ, "ZORSE_CACHE_DIR": str(cache), "OMP_NUM_THREADS": os.environ.get(
                "OMP_NUM_THREADS", "")}
            env = {k2: v for k2, v in env.items() if v != ""}
            p = subprocess.run([sys.executable, "-c", _CHILD, json.dumps([*COMMAND, "-o", str(out)])], env=env,
                               cwd=ROOT, capture_output=True, text=True, timeout=1800)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("PHASES ")), None)
            if p.returncode != 0 or line is None:
                print(p.stdout[-3000:], p.stderr[-3000:], file=sys.stderr)
                return 1
            res = json.loads(line[len("PHASES "):])
            res["cache"] = "empty" if k == 0 else "warm"
            runs.append(res)
            print(f"run {k} ({res['cache']} cache): {res['total_cpu_s']:.1f} CPU s, {res['total_wall_s']:.1f} s wall")
            for name, c, w in res["phases"]:
                print(f"  {name:<20} {c:7.2f} CPU s {w:7.2f} s")
    doc = {"command": "bench/plan_cli.py " + " ".join(sys.argv[1:]), "zorse_command": "zorse " + " ".join(
        c if not c.startswith(str(ROOT)) else os.path.relpath(c, ROOT) for c in COMMAND),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version()}, "runs": runs}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
