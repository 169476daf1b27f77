"""The public scenario benchmark: zorse_fx vs published ways of using a heterogeneous cluster.

    .venv/bin/python bench/scenarios.py [--only metis,amp] [--solver-budget 5]

Each scenario (``../shared/DESIGN.md``) is a model traced on the meta device in
float32 (no weights allocated), a cluster file in ``examples/clusters/``, a global
batch and a sequence length. The model is priced under the precision
zorse_fx's planner picks for the cluster by default (``precision="auto"``:
bf16-mixed where every GPU supports bfloat16, else fp16-mixed), i.e. what the
runtime keeps ([Note: mixed precision] in ``zorse_fx/precision.py``): float32
master weights, gradients and AdamW moments plus the step's 16-bit weight
copies (18 B/param, of which ZeRO-1 shards the 8 B of moments), activations as
autograd saves them under autocast, float32 gradient all-reduce. Every planner
(zorse_fx's CP-SAT and each
baseline in ``zorse_fx/baselines``) is scored by the same cost model (the measured
kernel profile of a GPU type where one is shipped, H100-80GB and H200, else the
per-class GPU model) and, where available, the
event-driven simulator (``zorse_fx/sim``). Reported per planner: tokens/s,
MFU (model FLOPs / sum of the GPUs' 16-bit tensor peaks), the ratio to the scenario's
upper bound (sum over GPUs of each GPU's standalone throughput: the whole
model on that GPU alone, no communication, unlimited memory), peak memory vs
capacity (largest fraction in the table; per GPU in the JSON:
``peak_memory_bytes`` and ``memory_capacity_bytes``, indexed like the
cluster's GPUs), feasibility and planner wall time.

Writes ``bench/results/scenarios.json`` and ``bench/results/scenarios.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _timing import cpu_s  # noqa: E402  (bench/, the directory of this script)

CLUSTERS = ROOT / "examples" / "clusters"
#: Blocks per model (``capture.analyse``): a transformer layer has two candidate cuts (after
#: the attention and after the MLP residual add). Over 48 blocks, ``analyse`` keeps the layer
#: boundaries first and thins the cuts inside layers (every k-th), so up to 47 layers stay
#: whole (Llama-2 7B: all 32 boundaries plus every third mid-layer cut; 65B: every other boundary).
MAX_BLOCKS = int(__import__("os").environ.get("ZORSE_BENCH_MAX_BLOCKS", "48"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    name: str
    model: str
    cluster: str
    global_batch_size: int
    seq_len: int
    note: str
    #: Largest pipeline depth searched (``--max-stages`` overrides). 4, except where the training
    #: state cannot fit in 4: Llama-2 7B keeps 10 B/param replicated (62.8 GiB), 15.7 GiB per GPU over
    #: 4 stages, above a 16 GB T4/V100's usable 14.4 GiB (Zorse C); on FlashFlex's 24 GB RTX 3090/4090s
    #: 4 even stages need 20.2-21.9 GiB of the usable 21.6 at one sample per GPU with ZeRO-1 and
    #: recomputation everywhere (the last stage, with the LM head, over); 13B on 16 GB GPUs (Zorse B).
    max_stages: int = 4


SCENARIOS = (
    Scenario(name="metis", model="gpt3-1.5b", cluster="metis.yaml", global_batch_size=128, seq_len=1024,
             note="Metis (ATC'24): GPT-3 1.5B-class, 4 x A100 + 4 x T4, batch 128"),
    Scenario(name="amp", model="gpt2-medium", cluster="amp.yaml", global_batch_size=32, seq_len=1024,
             note="AMP (NeurIPS'22): GPT-2 medium, 12 x V100 + 4 x T4, batch 32"),
    Scenario(name="zorse_a", model="llama2-7b", cluster="zorse_a.yaml", global_batch_size=256, seq_len=4096,
             note="Zorse A: Llama-2 7B, 4 x H100 + 16 x A100, seq 4096, ~1M tokens/batch"),
    Scenario(name="flashflex", model="llama2-7b", cluster="flashflex.yaml", global_batch_size=256, seq_len=2048,
             note="FlashFlex/HexiScale: Llama-2 7B on 8 x 3090 + 24 x 4090 (3080 Ti left out); batch assumed",
             max_stages=8),
    Scenario(name="zorse_b", model="llama2-13b", cluster="zorse_b.yaml", global_batch_size=1024, seq_len=1024,
             note="Zorse B: Llama-2 13B, 8 x A100 + 16 x A10G + 16 x V100 + 24 x T4, seq 1024, ~1M tokens",
             max_stages=8),
    Scenario(name="zorse_c", model="llama2-7b", cluster="zorse_c_two_regions.yaml", global_batch_size=2048,
             seq_len=512, note="Zorse C: two regions (16 A10G + 48 T4 | 16 V100 + 48 T4), seq 512, ~1M tokens",
             max_stages=8),
    Scenario(name="sailor", model="opt-350m", cluster="sailor.yaml", global_batch_size=1024, seq_len=2048,
             note="Sailor (SOSP'25): OPT-350M, 32 x A100-40GB + 96 x V100-16GB, batch 1024"),
)


def selected(only: str) -> list[Scenario]:
    """The scenarios named in ``only`` (comma-separated; empty = all), in SCENARIOS order."""
    names = set(filter(None, only.split(",")))
    unknown = sorted(names - {sc.name for sc in SCENARIOS})
    if unknown:
        raise SystemExit(f"--only: unknown scenario(s) {unknown}; choose from {[sc.name for sc in SCENARIOS]}")
    return [sc for sc in SCENARIOS if not names or sc.name in names]


def write_results(out_dir: str, stem: str, rows: list[dict], markdown: str) -> None:
    """``<out_dir>/<stem>.json`` (the rows) and ``<stem>.md`` (the table), and print the table."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown + "\n")
    print(markdown)


def build_model(name: str) -> torch.nn.Module:
    """The scenario's model (a key of ``zorse_fx.models.published.CONFIGS``: the
    published configuration, one table shared with the tests) on the meta
    device in float32, the runtime's float32 master weights computing under
    autocast, wrapped as ``(input_ids, labels) -> loss``."""
    from zorse_fx.models.hf import CausalLMWithLoss
    from zorse_fx.models.published import build

    return CausalLMWithLoss(build(name, device="meta"))


def scenario_precision(cluster):
    """The precision policy zorse_fx's planner picks for ``cluster`` by
    default (``PlanOptions.precision="auto"``)."""
    from zorse_fx.precision import default_precision, precision_policy

    return precision_policy(default_precision(g.spec for g in cluster.gpus))


def price(sc: Scenario, cluster):
    """(block costs on the cluster's GPU types, model FLOPs per sample fwd+bwd),
    under ``scenario_precision(cluster)``."""
    from zorse_fx.capture import analyse, capture
    from zorse_fx.cost.roofline import block_costs, node_costs

    ids = torch.zeros((2, sc.seq_len), dtype=torch.long, device="meta")
    captured = capture(build_model(sc.model), (ids, ids), method="export")
    bg = analyse(captured, max_blocks=MAX_BLOCKS)
    costs = block_costs(bg, {g.type: g.spec for g in cluster.gpus}, precision=scenario_precision(cluster))
    flops = 3 * sum(c.flops for c in node_costs(bg).values())  # fwd + bwd (2x fwd)
    return costs, flops


def upper_bound_tokens_per_s(costs, cluster, seq_len: int) -> float:
    """Sum over GPUs of seq_len / (per-sample fwd+bwd time of the whole model on that GPU)."""
    return sum(seq_len / sum(costs.fwd_bwd_s_per_sample[g.type]) for g in cluster.gpus)


def run_scenario(sc: Scenario, args) -> list[dict]:
    from zorse_fx.baselines import BASELINES
    from zorse_fx.cluster import Cluster
    from zorse_fx.errors import InfeasiblePlanError
    from zorse_fx.options import PlanOptions
    from zorse_fx.solve import solve_cpsat
    from zorse_fx.solve.objective import evaluate_result

    cluster = Cluster.from_yaml(CLUSTERS / sc.cluster)
    t0 = time.perf_counter()
    costs, flops_per_sample = price(sc, cluster)
    print(f"[{sc.name}] priced {sc.model} on {len(cluster)} GPUs in {time.perf_counter() - t0:.0f} s", flush=True)
    devices = cluster.device_graph()
    opts = PlanOptions(global_batch_size=sc.global_batch_size, max_stages=args.max_stages or sc.max_stages,
                       time_limit_s=args.time_limit, solver_budget=args.solver_budget,
                       max_microbatches=args.max_microbatches,
                       sharding=args.sharding, recompute=args.recompute, max_interleave=args.max_interleave,
                       grad_sharding=args.grad_sharding,
                       param_sharding=args.param_sharding)
    ub = upper_bound_tokens_per_s(costs, cluster, sc.seq_len)
    peak = sum(g.spec.peak_flops_per_s(scenario_precision(cluster).compute_dtype) for g in cluster.gpus)
    # zorse_fx's planner="auto": per-GPU CP-SAT up to PER_GPU_MAX_GPUS (8) GPUs, class-level CP-SAT beyond.
    from functools import partial

    from zorse_fx.portfolio import auto_planner, solve_portfolio
    from zorse_fx.solve import solve_grouped

    cpsat = solve_cpsat if auto_planner(len(cluster)) == "cpsat" else solve_grouped
    planners = {"zorse_fx": partial(solve_portfolio, solver=cpsat), **BASELINES}
    rows = []
    for name, fn in planners.items():
        t0, c0 = time.perf_counter(), cpu_s()
        try:
            res = fn(costs, devices, opts)
        except (InfeasiblePlanError, ValueError) as exc:
            rows.append({"scenario": sc.name, "planner": name, "feasible": False, "tokens_per_s": 0.0,
                         "upper_bound_tokens_per_s": ub, "planner_wall_s": time.perf_counter() - t0,
                         "planner_cpu_s": cpu_s() - c0,
                         "error": str(exc).splitlines()[0][:300]})
            print(f"[{sc.name}] {name}: no plan ({type(exc).__name__})", flush=True)
            continue
        wall, cpu = time.perf_counter() - t0, cpu_s() - c0
        ev = evaluate_result(costs, devices, opts, res)
        step = ev.step_time_s
        sim_step = _simulate(costs, devices, opts, res)
        tokens = sc.global_batch_size * sc.seq_len / step
        mem = [(m, devices.memory_bytes[g]) for gs, ms in zip(res.decision.stage_gpus, ev.memory_bytes) for g,
               m in zip(gs, ms)]
        rows.append({
            "scenario": sc.name, "planner": name, "feasible": ev.feasible, "tokens_per_s": tokens,
            "upper_bound_tokens_per_s": ub, "fraction_of_upper_bound": tokens / ub,
            "mfu": flops_per_sample * sc.global_batch_size / step / peak,
            "step_time_s": step, "simulated_step_time_s": sim_step,
            "planner_wall_s": wall, "planner_cpu_s": cpu, "status": res.status, "optimality_gap": res.optimality_gap,
            "num_stages": res.num_stages, "num_microbatches": res.decision.num_microbatches,
            "interleave": res.decision.interleave,
            "gpus_used": len({g for gs in res.decision.stage_gpus for g in gs}),
            "max_memory_fraction": max(m / c for m, c in mem), "violations": list(ev.violations)[:3],
            # Per GPU of the cluster (index = GPU): predicted peak bytes (0 = idle) and capacity.
            "peak_memory_bytes": _per_gpu_memory(devices.num_gpus, res.decision.stage_gpus, ev.memory_bytes),
            "memory_capacity_bytes": list(devices.memory_bytes),
            "sharded_stages": sum(m.zero >= 1 for m in ev.decision.memory),
            "recompute_stages": sum(m.recompute for m in ev.decision.memory),
            # zorse_fx: the interleave pass's best feasible try (None: nothing fit or was tried).
            "best_interleaved_step_time_s": min((c.step_time_s for c in res.candidates
                                                 if c.kind == "interleave" and c.feasible), default=None),
            # Each stage's memory policy (issue 50), e.g. "ZeRO-1+rc" (rc: recomputation; "opt@host",
            # "act@host": optimizer / activation offload), "plain" for none.
            "stage_policies": [policy_label(m) for m in ev.decision.memory],
            **(_idle_fields(costs, devices, opts, res, cluster) if name == "zorse_fx" else {}),
        })
        print(f"[{sc.name}] {name}: {tokens:,.0f} tokens/s ({tokens / ub:.0%} of bound), feasible {ev.feasible}, "
              f"{res.num_stages} stages, {wall:.1f} s", flush=True)
    return rows


def policy_label(mem) -> str:
    """A stage's ``StageMemory`` in a few characters: "plain", "ZeRO-1", "ZeRO-2+rc", "ZeRO-1+opt@host",
    "rc+stash@host" (host-stashed recomputation)."""
    parts = [f"ZeRO-{mem.zero}"] if mem.zero else []
    parts += ["rc"] if mem.recompute else []
    parts += ["opt@host"] if mem.optimizer == "host" else []
    parts += ["act@host"] if mem.activations == "host" else []
    parts += ["stash@host"] if mem.stash == "host" else []
    return "+".join(parts) or "plain"


def _idle_fields(costs, devices, opts, res, cluster) -> dict:
    """zorse_fx's row: the GPUs its plan leaves idle, the best scored plan on every GPU and why it is slower
    (``zorse_fx.idle.idle_gpus``, as plan.json's ``idle_gpus``); the polish's record."""
    from collections import Counter

    from zorse_fx.idle import idle_gpus

    idle = idle_gpus(costs, devices, opts, res, cluster)
    polish = next((c for c in res.candidates if c.kind == "polish"), None)
    return {"idle_gpus": 0 if idle is None else len(idle.gpus),
            "idle_gpu_types": {} if idle is None else dict(sorted(Counter(g.gpu_type for g in idle.gpus).items())),
            "all_gpus_step_time_s": None if idle is None else idle.all_gpus_step_time_s,
            "all_gpus_source": None if idle is None else idle.all_gpus_source,
            "idle_reason": None if idle is None else idle.reason,
            "polish_from_step_time_s": None if polish is None else polish.best_bound_s,
            "polish_step_time_s": None if polish is None else polish.step_time_s}


def _per_gpu_memory(num_gpus: int, stage_gpus, memory_bytes) -> list[int]:
    """Peak bytes per GPU index (a GPU's rows in its stages carry its whole memory; 0 = idle)."""
    peak = [0] * num_gpus
    for gs, ms in zip(stage_gpus, memory_bytes):
        for g, m in zip(gs, ms):
            peak[g] = max(peak[g], int(m))
    return peak


def _simulate(costs, devices, opts, res) -> float | None:
    try:
        from zorse_fx.sim import simulate
    except ImportError:
        return None
    return simulate(costs, devices, opts, res.decision).step_time_s


def _stages(row: dict) -> str:
    """'8' or, interleaved, '8 (4 groups x 2)'."""
    v = row.get("interleave", 1)
    return str(row["num_stages"]) + (f" ({row['num_stages'] // v} groups x {v})" if v > 1 else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    ap.add_argument("--solver-budget", type=float, default=5.0,
                    help="CP-SAT deterministic seconds (work units) for the whole (stages, micro-batches) search")
    ap.add_argument("--time-limit", type=float, default=100.0,
                    help="wall-clock safety stop per CP-SAT solve, seconds (a status ending in "
                         "'(wall-clock safety stop)' says it fired)")
    ap.add_argument("--max-stages", type=int, default=0,
                    help="largest pipeline depth for every scenario (default: the scenario's own, 4 or 8)")
    ap.add_argument("--max-microbatches", type=int, default=64)
    ap.add_argument("--sharding", default="auto", choices=("never", "auto", "always"),
                    help="ZeRO-1 optimizer-state sharding, for every planner alike")
    ap.add_argument("--grad-sharding", default="auto", choices=("never", "auto", "always"),
                    help="zorse_fx: ZeRO-2 (gradients sharded too) on sharded stages; the baselines never use it")
    ap.add_argument("--param-sharding", default="auto", choices=("never", "auto", "always"),
                    help="zorse_fx: ZeRO-3 (weights sharded too) on ZeRO-2 stages; the baselines never use it")
    ap.add_argument("--recompute", default="auto", choices=("never", "auto", "always"),
                    help="stage recomputation, for every planner alike")
    ap.add_argument("--max-interleave", type=int, default=4,
                    help="zorse_fx: most stages per GPU group (interleaved 1F1B) tried on its answer; 1 = none")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    rows = [row for sc in selected(args.only) for row in run_scenario(sc, args)]
    lines = ["| scenario | planner | feasible | tokens/s | of bound | MFU | stages | GPUs | sharded / recompute stages "
             "| max mem | planner s | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['scenario']} | {r['planner']} | no plan | - | - | - | - | - | - | - | "
                         f"{r['planner_wall_s']:.1f} | {r['error'][:60]} |")
            continue
        lines.append(f"| {r['scenario']} | {r['planner']} | {'yes' if r['feasible'] else 'NO'} | {r['tokens_per_s']:,.0f} | "
                     f"{r['fraction_of_upper_bound']:.0%} | {r['mfu']:.1%} | {_stages(r)} | {r['gpus_used']} | "
                     f"{r['sharded_stages']} / {r['recompute_stages']} | "
                     f"{r['max_memory_fraction']:.0%} | {r['planner_wall_s']:.1f} | {r['status']} |")
    write_results(args.out, "scenarios", rows, "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
