"""Planner wall time and optimality gap vs cluster size and model depth.

    .venv/bin/python bench/planner_scaling.py [--sizes 512x40,1024x40] [--solver-budget 5] [--out DIR]

Synthetic clusters of 8-GPU nodes with four GPU types round-robin (H100-, A100-,
V100-, T4-like speeds and memories, 300 GB/s inside a node, 25 GB/s between),
``B`` blocks (= 2 per transformer layer); zorse_fx's ``planner="auto"`` choice:
per-GPU CP-SAT up to 16 GPUs, class-level CP-SAT (``solve_grouped``) beyond,
then the portfolio check against the baselines (``zorse_fx/portfolio.py``), and
the simulator's check of the answer (``sim/check.py``, timed separately).
Writes ``bench/results/scaling.json`` (num_gpus, num_layers, planner_wall_s,
optimality_gap, ...) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _timing import cpu_s  # noqa: E402  (bench/, the directory of this script)

GIB = 1 << 30
SPEC = {"H100": (80, 3.35e12, 1.0), "A100": (40, 1.6e12, 1.6), "V100": (32, 9e11, 2.8), "T4": (16, 3e11, 6.0)}


def instance(num_gpus: int, num_blocks: int, seed: int = 0):
    from zorse_fx.ir.costs import BlockCosts
    from zorse_fx.ir.devices import DeviceGraph

    rng = random.Random(seed)
    per_node = min(8, num_gpus)
    names = list(SPEC)
    types, nodes = [], []
    for i in range(num_gpus // per_node):
        types += [names[i % 4]] * per_node
        nodes += [f"node{i}"] * per_node
    base = [rng.uniform(0.5e-3, 2e-3) for _ in range(num_blocks)]
    costs = BlockCosts(
        fwd_bwd_s_per_sample={t: tuple(x * SPEC[t][2] for x in base) for t in names},
        param_count=tuple(rng.randint(50, 150) * 1_000_000 for _ in range(num_blocks)),
        act_bytes_per_sample=tuple(rng.randint(20, 100) * 1_000_000 for _ in range(num_blocks)),
        cut_bytes_per_sample=(0, *(rng.randint(5, 20) * 1_000_000 for _ in range(num_blocks - 1)), 0),
    )
    g = len(types)
    bw = tuple(tuple(1e15 if a == b else (300e9 if nodes[a] == nodes[b] else 25e9) for b in range(g)) for a in range(g))
    lat = tuple(tuple(0.0 if a == b else (3e-6 if nodes[a] == nodes[b] else 1e-5) for b in range(g)) for a in range(g))
    devices = DeviceGraph(gpu_types=tuple(types), memory_bytes=tuple(SPEC[t][0] * GIB for t in types),
                          mem_bw_bytes_per_s=tuple(SPEC[t][1] for t in types), link_bw_bytes_per_s=bw,
                          link_latency_s=lat, node_names=tuple(nodes))
    return costs, devices


def _default_budget() -> float:
    import dataclasses

    from zorse_fx.options import PlanOptions

    return next(f.default for f in dataclasses.fields(PlanOptions) if f.name == "solver_budget")


SIZES = ((8, 16), (16, 16), (32, 32), (64, 40), (64, 80), (128, 40), (256, 40), (512, 40), (1024, 40), (1024, 80))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(f"{g}x{l}" for g, l in SIZES),
                    help="comma-separated GPUSxLAYERS instances (default: all ten)")
    ap.add_argument("--solver-budget", type=float, default=_default_budget(),
                    help="CP-SAT deterministic seconds for the whole (stages, micro-batches) search (default: "
                         "PlanOptions.solver_budget, what zorse_fx.compile uses)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="directory for scaling.json")
    args = ap.parse_args()
    sizes = [tuple(int(x) for x in item.split("x")) for item in args.sizes.split(",") if item]
    from zorse_fx.options import PlanOptions
    from zorse_fx.portfolio import auto_planner, solve_portfolio
    from zorse_fx.sim.check import check_result
    from zorse_fx.solve import solve_cpsat, solve_grouped

    rows = []
    for num_gpus, layers in sizes:
        costs, devices = instance(num_gpus, min(2 * layers, 64))
        options = PlanOptions(global_batch_size=max(64, num_gpus), max_stages=4, num_microbatches=(8,),
                              solver_budget=args.solver_budget, seed=0, sharding="never",
                              recompute="never")
        solve = solve_cpsat if auto_planner(num_gpus) == "cpsat" else solve_grouped
        t0, c0 = time.perf_counter(), cpu_s()
        res = solve_portfolio(costs, devices, options, solve)
        wall, cpu = time.perf_counter() - t0, cpu_s() - c0
        check = check_result(costs, devices, options, res)  # what plan_captured runs next
        rows.append({"num_gpus": num_gpus, "num_layers": layers, "num_blocks": costs.num_blocks,
                     "planner": solve.__name__, "planner_wall_s": wall, "planner_cpu_s": cpu,
                     "optimality_gap": res.optimality_gap,
                     "status": res.status, "step_time_s": res.predicted_step_time_s,
                     "num_stages": res.num_stages, "gpus_used": len(res.decision.gpus_used),
                     "interleave": res.decision.interleave, "simulated_step_time_s": check.simulated_step_time_s,
                     "sim_check_s": check.wall_s})
        print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out) / "scaling.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print("| GPUs | layers | blocks | planner | wall s | gap | status | step s | simulated s | sim check s "
          "| stages | GPUs used |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['num_gpus']} | {r['num_layers']} | {r['num_blocks']} | {r['planner']} | {r['planner_wall_s']:.1f} | "
              f"{r['optimality_gap']:.0%} | {r['status']} | {r['step_time_s']:.3f} | {r['simulated_step_time_s']:.3f} | "
              f"{r['sim_check_s']:.1f} | {r['num_stages']} | {r['gpus_used']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
