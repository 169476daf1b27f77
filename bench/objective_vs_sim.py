"""Objective vs simulator on the plans the planners return (issue 13 item 6).

    .venv/bin/python bench/objective_vs_sim.py [--only amp,metis] [--solver-budget 1] [--seeds 40]
        [--scaling 8x16,64x40,256x40]

For every plan -- zorse_fx's portfolio and every baseline on the scenarios of
``bench/scenarios.py`` (``--only``), and ``solve_cpsat``'s optimum on the
random instances of the solver tests (``tests/conftest.random_instance``,
seeds 0..``--seeds``-1) and the planner on ``bench/planner_scaling.py``'s
instances (``--scaling``) -- the plan is scored by the objective
(``solve.evaluate``) and replayed by the simulator (``zorse_fx.sim``), and the
ratio simulated / objective step time is reported: min / median / max per
family, and the plans furthest from 1. Each plan is simulated twice: with
the runtime's point-to-point program under NCCL's rules (``ratio_nccl``, the
simulator's default, [Note: point-to-point models] in
``zorse_fx/sim/engine.py``) and with buffered sends (``ratio``, Gloo's
semantics, ``simulate(p2p="buffered")``); ``--p2p`` picks which one the
table reports (default nccl: the runtime on GPUs). Writes
``<out>/objective_vs_sim.json`` (one row per plan) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))


def _row(family, name, costs, devices, opts, res):
    from zorse_fx.sim import simulate
    from zorse_fx.solve.objective import evaluate_result

    ev = evaluate_result(costs, devices, opts, res)
    dec = res.decision
    sim = simulate(costs, devices, opts, dec, p2p="buffered").step_time_s
    nccl = simulate(costs, devices, opts, dec, p2p="nccl").step_time_s
    return {"family": family, "plan": name, "objective_s": ev.step_time_s, "simulated_s": sim,
            "ratio": sim / ev.step_time_s, "simulated_nccl_s": nccl, "ratio_nccl": nccl / ev.step_time_s,
            "num_stages": dec.num_stages, "num_microbatches": dec.num_microbatches,
            "interleave": dec.interleave, "gpus": len(dec.gpus_used)}


def scenario_rows(names: str, budget: float) -> list[dict]:
    from functools import partial

    from scenarios import CLUSTERS, price, selected

    from zorse_fx.baselines import BASELINES
    from zorse_fx.cluster import Cluster
    from zorse_fx.errors import InfeasiblePlanError
    from zorse_fx.options import PlanOptions
    from zorse_fx.portfolio import auto_planner, solve_portfolio
    from zorse_fx.solve import solve_cpsat, solve_grouped

    rows = []
    for sc in selected(names):
        cluster = Cluster.from_yaml(CLUSTERS / sc.cluster)
        costs, _ = price(sc, cluster)
        devices = cluster.device_graph()
        opts = PlanOptions(global_batch_size=sc.global_batch_size, max_stages=sc.max_stages, time_limit_s=100.0,
                           solver_budget=budget, max_microbatches=64, sharding="auto", recompute="auto",
                           max_interleave=4)
        cpsat = solve_cpsat if auto_planner(len(cluster)) == "cpsat" else solve_grouped
        for name, fn in {"zorse_fx": partial(solve_portfolio, solver=cpsat), **BASELINES}.items():
            t0 = time.perf_counter()
            try:
                res = fn(costs, devices, opts)
            except (InfeasiblePlanError, ValueError) as exc:
                print(f"[{sc.name}] {name}: no plan ({type(exc).__name__})", flush=True)
                continue
            rows.append(_row(sc.name, name, costs, devices, opts, res))
            print(f"[{sc.name}] {name}: sim / objective {rows[-1]['ratio_nccl']:.3f} NCCL, {rows[-1]['ratio']:.3f} "
                  f"buffered ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    return rows


def scaling_rows(sizes: str) -> list[dict]:
    """``bench/planner_scaling.py``'s instances (its settings) of the given GPU counts ("8x16,64x40": GPUs x layers)."""
    from planner_scaling import instance

    from zorse_fx.options import PlanOptions
    from zorse_fx.portfolio import auto_planner, solve_portfolio
    from zorse_fx.solve import solve_cpsat, solve_grouped

    rows = []
    for item in filter(None, sizes.split(",")):
        num_gpus, layers = map(int, item.split("x"))
        costs, devices = instance(num_gpus, min(2 * layers, 64))
        options = PlanOptions(global_batch_size=max(64, num_gpus), max_stages=4, num_microbatches=(8,),
                              solver_budget=2.0, seed=0, sharding="never", recompute="never")
        res = solve_portfolio(costs, devices, options, (solve_cpsat if auto_planner(num_gpus) == "cpsat" else solve_grouped))
        rows.append(_row("scaling (planner_scaling.py)", f"{num_gpus} GPUs x {layers} layers", costs, devices,
                         options, res))
        print(f"[scaling] {item}: sim / objective {rows[-1]['ratio_nccl']:.3f} NCCL, {rows[-1]['ratio']:.3f} "
              "buffered", flush=True)
    return rows


def random_rows(seeds: int) -> list[dict]:
    from conftest import random_instance

    from zorse_fx.errors import InfeasiblePlanError
    from zorse_fx.solve import solve_cpsat

    rows = []
    for seed in range(seeds):
        costs, devices, opts = random_instance(seed)
        try:
            res = solve_cpsat(costs, devices, opts)
        except InfeasiblePlanError:
            continue
        rows.append(_row("tests (random_instance)", f"seed {seed}", costs, devices, opts, res))
    return rows


def table(rows: list[dict], key: str = "ratio") -> str:
    out = ["| plans | n | min | median | max | within 5% |", "|---|---|---|---|---|---|"]
    fams = list(dict.fromkeys(r["family"] for r in rows))
    for fam in fams + ["all"]:
        xs = sorted(r[key] for r in rows if fam in ("all", r["family"]))
        within = sum(abs(x - 1) <= 0.05 for x in xs)
        out.append(f"| {fam} | {len(xs)} | {xs[0]:.3f} | {statistics.median(xs):.3f} | {xs[-1]:.3f} | "
                   f"{within}/{len(xs)} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="amp,metis", help="comma-separated scenario names ('' = none)")
    ap.add_argument("--solver-budget", type=float, default=1.0)
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--scaling", default="", help="planner_scaling instances, e.g. 8x16,64x40,256x40")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--p2p", choices=("nccl", "buffered"), default="nccl",
                    help="which simulated step the table reports (both are written)")
    args = ap.parse_args()
    key = "ratio" if args.p2p == "buffered" else "ratio_nccl"
    rows = random_rows(args.seeds) + scaling_rows(args.scaling)
    if args.only:
        rows += scenario_rows(args.only, args.solver_budget)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "objective_vs_sim.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows, key))
    for r in sorted(rows, key=lambda r: abs(r[key] - 1))[-5:]:
        print(f"  {r['family']} {r['plan']}: sim / objective {r[key]:.3f} (S={r['num_stages']}, "
              f"M={r['num_microbatches']}, v={r['interleave']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
