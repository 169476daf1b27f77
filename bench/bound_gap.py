"""Where the gap to the upper bound goes: zorse_fx re-planned on idealised clusters.

    .venv/bin/python bench/bound_gap.py [--only metis,amp] [--solver-budget 5]

The scenario benchmark (``bench/scenarios.py``) compares each plan with the
scenario's upper bound: the sum of each GPU's standalone throughput (whole
model, no communication, unlimited memory). Issue 4's target, >= 85% of that
bound "where the cluster is not communication-bound", needs a test of what
bounds a cluster. This benchmark answers it by re-planning with zorse_fx's
planner (the same portfolio, time limits and cost model) on three idealised
copies of each scenario's cluster:

* ``ideal_links``: every link at 1 EB/s with zero latency (communication
  costs ~0 ns; boundaries, all-reduces and all-gathers all vanish);
* ``ideal_memory``: every GPU with 1 TiB of memory (any split fits without
  sharding or recomputation);
* ``ideal_both``: both.

Each variant's plan is scored under its own idealised cluster. If a variant
reaches the 85% that the real cluster misses, that resource is what binds:
``ideal_links`` >= 85% means the scenario is communication-bound,
``ideal_memory`` >= 85% memory-bound. If even ``ideal_both`` stays below,
the rest of the gap is the pipeline's own losses (fill/drain bubble, integer
samples per GPU, whole-layer stages, GPUs whose standalone speed the plan
cannot use) or the planner's search, which the notes in bench/LOG.md read
from the plan.

The ``real`` row is the plan on the unchanged cluster (re-planned here, so
that all four rows come from one run). Writes ``bench/results/bound_gap.json``
(list of {scenario, variant, tokens_per_s, upper_bound_tokens_per_s,
fraction_of_upper_bound, num_stages, num_microbatches, interleave, gpus_used,
sharded_stages, recompute_stages, planner_wall_s, status, optimality_gap, stage_gpu_types,
stage_blocks}) and ``bound_gap.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from report import verdict  # noqa: E402 (what binds a scenario: one rule for the run and the report)
from scenarios import CLUSTERS, price, selected, upper_bound_tokens_per_s, write_results  # noqa: E402

#: Link bandwidth of the idealised links, bytes/s: 1 EB/s makes every transfer
#: of these models round to 0 ns in the planner's integer tables.
IDEAL_LINK_BW = 1e18
#: Memory of every GPU in the idealised-memory variants, bytes (1 TiB: more than
#: Llama-2 13B's whole training state, 18 B/param mixed precision = 234 GB, plus activations).
IDEAL_MEMORY = 1 << 40
VARIANTS = ("real", "ideal_links", "ideal_memory", "ideal_both")


def idealise(devices, variant: str):
    """A copy of ``devices`` (DeviceGraph) with its links and/or memory idealised."""
    if variant in ("ideal_links", "ideal_both"):
        n = devices.num_gpus
        devices = replace(devices, link_bw_bytes_per_s=tuple((IDEAL_LINK_BW,) * n for _ in range(n)),
                          link_latency_s=tuple((0.0,) * n for _ in range(n)))
    if variant in ("ideal_memory", "ideal_both"):
        devices = replace(devices, memory_bytes=(IDEAL_MEMORY,) * devices.num_gpus)
    return devices


def run(sc, args) -> list[dict]:
    from functools import partial

    from zorse_fx.cluster import Cluster
    from zorse_fx.errors import InfeasiblePlanError
    from zorse_fx.options import PlanOptions
    from zorse_fx.portfolio import auto_planner, solve_portfolio
    from zorse_fx.solve import solve_cpsat, solve_grouped
    from zorse_fx.solve.objective import evaluate_result

    cluster = Cluster.from_yaml(CLUSTERS / sc.cluster)
    costs, _ = price(sc, cluster)
    ub = upper_bound_tokens_per_s(costs, cluster, sc.seq_len)
    opts = PlanOptions(global_batch_size=sc.global_batch_size, max_stages=args.max_stages or sc.max_stages,
                       time_limit_s=args.time_limit, solver_budget=args.solver_budget,
                       max_microbatches=args.max_microbatches,
                       sharding="auto", recompute="auto", max_interleave=args.max_interleave)
    plan = partial(solve_portfolio, solver=(solve_cpsat if auto_planner(len(cluster)) == "cpsat" else solve_grouped))
    rows = []
    for variant in args.variants:
        devices = idealise(cluster.device_graph(), variant)
        t0 = time.perf_counter()
        row = {"scenario": sc.name, "variant": variant, "upper_bound_tokens_per_s": ub}
        try:
            res = plan(costs, devices, opts)
        except (InfeasiblePlanError, ValueError) as exc:
            row.update(feasible=False, tokens_per_s=0.0, fraction_of_upper_bound=0.0,
                       planner_wall_s=time.perf_counter() - t0, error=str(exc).splitlines()[0][:300])
            rows.append(row)
            print(f"[{sc.name}] {variant}: no plan", flush=True)
            continue
        wall = time.perf_counter() - t0
        ev = evaluate_result(costs, devices, opts, res)
        tokens = sc.global_batch_size * sc.seq_len / ev.step_time_s
        row.update(feasible=ev.feasible, tokens_per_s=tokens, fraction_of_upper_bound=tokens / ub,
                   step_time_s=ev.step_time_s, num_stages=res.num_stages,
                   num_microbatches=res.decision.num_microbatches,
                   interleave=res.decision.interleave, gpus_used=len(res.decision.gpus_used),
                   gpus=len(cluster), sharded_stages=sum(m.zero >= 1 for m in ev.decision.memory),
                   recompute_stages=sum(m.recompute for m in ev.decision.memory), planner_wall_s=wall,
                   status=res.status,
                   optimality_gap=res.optimality_gap,
                   stage_gpu_types=[sorted({devices.gpu_types[g] for g in gs}) for gs in res.decision.stage_gpus],
                   stage_blocks=[list(b) for b in res.decision.stage_blocks])
        rows.append(row)
        print(f"[{sc.name}] {variant}: {tokens:,.0f} tokens/s ({tokens / ub:.0%} of bound), {res.num_stages} stages "
              f"x {res.decision.num_microbatches} micro-batches on {row['gpus_used']}/{len(cluster)} GPUs, "
              f"{wall:.0f} s",
              flush=True)
    return rows




def table(rows: list[dict]) -> str:
    lines = ["| scenario | real | ideal links | ideal memory | ideal both | verdict |", "|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["scenario"] for r in rows):
        mine = [r for r in rows if r["scenario"] == name]
        cells = []
        for v in VARIANTS:
            r = next((r for r in mine if r["variant"] == v), None)
            if r is None:
                cells.append("-")
            elif not r.get("feasible"):
                cells.append("no plan")
            else:
                cells.append(f"{r['fraction_of_upper_bound']:.0%} ({r['num_stages']} st x {r['num_microbatches']} mb, "
                             f"{r['gpus_used']} GPUs)")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {verdict(mine)} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    ap.add_argument("--solver-budget", type=float, default=5.0,
                    help="CP-SAT deterministic seconds (work units) for the whole (stages, micro-batches) search")
    ap.add_argument("--time-limit", type=float, default=100.0,
                    help="wall-clock safety stop per CP-SAT solve, seconds (a status ending in "
                         "'(wall-clock safety stop)' says it fired)")
    ap.add_argument("--max-stages", type=int, default=0)
    ap.add_argument("--max-microbatches", type=int, default=64)
    ap.add_argument("--max-interleave", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    args.variants = [v for v in args.variants.split(",") if v]
    bad = sorted(set(args.variants) - set(VARIANTS))
    if bad:
        ap.error(f"--variants: unknown {bad}; choose from {VARIANTS}")
    rows = [row for sc in selected(args.only) for row in run(sc, args)]
    write_results(args.out, "bound_gap", rows, table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
