"""Cost-model accuracy on this machine: predicted vs measured, per stage and per step.

    .venv/bin/python bench/cost_accuracy.py [--profile zorse_fx/profiles/cpu-x86_64-1thread.json]

For SmolLM2-135M and GPT-2 (124M config), planned for ``bench/clusters/cpu_local.yaml``
(two single-thread CPU ranks, the device type the shipped CPU profile
describes):

- ``fwd_bwd_ms``: each stage's forward + backward of one micro-batch share,
  predicted by the measured cost model (``cost/measured.py``) vs measured by
  running the generated stage module alone (1 thread, median of repeats);
- ``step_ms``: the plan's predicted step time vs the median step time of the
  real 2-process Gloo run (``python -m zorse_fx.train``); the row also
  carries the step's components, ``predicted_breakdown_s`` (the simulator,
  ``sim/engine.py``, on the plan and its memory policy) and
  ``measured_breakdown_s`` (the runtime's ``last_breakdown``), each the max
  over ranks of ``pipeline_s`` / ``allreduce_s`` / ``optimizer_s`` /
  ``allgather_s``;
- ``allgather_ms`` (plans with a ZeRO-1 stage of >= 2 GPUs only): the weight
  all-gather after the optimizer step, predicted (objective.py
  [C-allreduce]'s ``param_bytes * P_s / bw_min + (k - 1) * lat_max``, the
  simulator's "allgather" events) vs measured (``allgather_s``: the owners'
  broadcasts in ``runtime/worker.py``); ``--sharding always`` makes the
  solver shard its data-parallel stage so that this row appears;
- ``peak_memory_bytes``: predicted per-GPU memory (training state + saved
  activations x micro-batches in flight) vs measured: exact state bytes
  (fp32 weights, gradients and AdamW moments; on a ZeRO-1 stage the moments
  of the GPU's shard only) plus the bytes autograd saves for backward,
  counted with saved-tensor hooks (a CPU has no allocator peak counter).

Writes ``bench/results/cost_accuracy.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _median_ms(fn, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def _stage_inputs(stage, plan, tokens, n):
    from zorse_fx.data import global_batch

    batch = global_batch(tokens, 0, global_batch_size=max(n, plan.global_batch_size), seq_len=plan.seq_len,
                         input_names=plan.input_names, label_mode=plan.label_mode)
    ins = [batch[name][:n] for name in stage.input_names]
    gen = torch.Generator().manual_seed(0)
    recv = [torch.randn((n, *t.shape_per_sample), generator=gen).to(getattr(torch, t.dtype)).requires_grad_(True)
            for t in stage.recv]
    return ins, recv


def measure_stage(plan, plan_dir, weights, s, n, tokens, repeats):
    """(fwd+bwd ms, saved-activation bytes) of stage ``s`` on ``n`` samples."""
    from zorse_fx.codegen.split import load_stage_class

    stage = plan.stages[s]
    cls = load_stage_class(Path(plan_dir) / stage.source_file, s)
    mod = cls()
    with torch.no_grad():
        for flat, canon in {**cls.PARAMETERS, **cls.CONSTANTS}.items():
            getattr(mod, flat).copy_(weights[canon])
    ins, recv = _stage_inputs(stage, plan, tokens, n)

    def step():
        out = mod(*ins, *recv)
        if stage.send:
            outs = list(out)
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        else:
            out.backward()

    ms = _median_ms(step, repeats)
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = mod(*ins, *recv)
    del out
    return ms, sum(saved.values())


def run(model_name: str, args, rows: list[dict]) -> None:
    """The solver's plan and a balanced 2-stage pipeline plan of ``model_name``."""
    import zorse_fx as zorse
    from zorse_fx.data import read_corpus, tokenize
    from zorse_fx.models.registry import load_model
    from zorse_fx.planner import PlanOptions, plan_fixed
    from zorse_fx.pricing import price
    from zorse_fx.solve import Decision

    model, tokenizer = load_model(model_name)
    tokens = tokenize(read_corpus("lee"), tokenizer)
    ids = tokens[: 2 * args.seq_len].view(2, args.seq_len)
    # (inputs, targets): what a plain model (``gpt``) takes; a Hugging Face model gets labels = inputs
    # either way (``api._compile_instance``).
    # precision "fp32": the CPU ranks measured here train in float32 (the CPU
    # cluster's bf16_supported would make "auto" choose bf16-mixed).
    compiled = zorse.compile(model, cluster=args.cluster, example_inputs=(ids, ids),
                             global_batch_size=args.global_batch_size, model_name=model_name, max_stages=2,
                             allow_idle_gpus=False, profiles=(args.profile,), solver_budget=5.0,
                             num_microbatches=(args.microbatches,), sharding=args.sharding, precision="fp32",
                             verbose=True)
    captured, cluster = compiled.captured, zorse_cluster(args.cluster)
    opts = PlanOptions(global_batch_size=args.global_batch_size, profiles=(args.profile,), precision="fp32")
    costs = price(captured, cluster, opts).costs
    plans = [("solver", compiled.plan)]
    # Balanced 2-stage pipeline, one rank per stage: cut where the slower half is fastest.
    t = costs.fwd_bwd_s_per_sample[cluster.gpus[0].type]
    cut = min(range(1, len(t)), key=lambda c: max(sum(t[:c]), sum(t[c:])))
    b = args.global_batch_size // args.microbatches
    pipe, _ = plan_fixed(captured, cluster, opts,
                         Decision(stage_blocks=((0, cut), (cut, len(t))), stage_gpus=((0,), (1,)),
                                  samples_per_microbatch=((b,), (b,)), num_microbatches=args.microbatches),
                         model_name=model_name, label_mode=compiled.plan.label_mode)
    plans.append(("pipeline", pipe))
    for label, plan in plans:
        print(plan.table())
        _evaluate(model_name, label, plan, captured, costs, tokens, args, rows)


#: The step's components, as the runtime reports them per rank (``StageWorker.last_breakdown``).
COMPONENTS = ("pipeline_s", "allreduce_s", "optimizer_s", "allgather_s")


def predicted_breakdown(plan, costs, args) -> tuple[float, dict[str, float]]:
    """(simulated step seconds, per component the max over GPUs of its
    predicted seconds) for ``plan`` with its memory policy: ``pipeline_s`` =
    end of the GPU's last forward/backward, the others = the duration of its
    "allreduce" / "optim" / "allgather" events (``sim/engine.py``; the
    all-gather of a ZeRO-1 stage is objective.py [C-allreduce]'s
    ``sh_s * param_bytes * P_s / bw_min + (k - 1) * lat_max``)."""
    from zorse_fx.planner import PlanOptions
    from zorse_fx.pricing import device_graph
    from zorse_fx.sim import simulate

    opts = PlanOptions(global_batch_size=plan.global_batch_size, schedule=plan.schedule,
                       max_stages=plan.num_stages, profiles=(args.profile,), precision=plan.precision,
                       grad_reduce_dtype=plan.grad_reduce_dtype)
    sim = simulate(costs, device_graph(zorse_cluster(args.cluster), opts), opts,
                   plan.decision(costs))
    per_gpu: dict[int, dict[str, float]] = defaultdict(lambda: dict.fromkeys(COMPONENTS, 0.0))
    key = {"allreduce": "allreduce_s", "optim": "optimizer_s", "allgather": "allgather_s"}
    for e in sim.events:
        if e.kind in ("F", "B"):
            per_gpu[e.gpu]["pipeline_s"] = max(per_gpu[e.gpu]["pipeline_s"], e.end_s)
        elif e.kind in key:
            per_gpu[e.gpu][key[e.kind]] += e.end_s - e.start_s
    return sim.step_time_s, {k: max(d[k] for d in per_gpu.values()) for k in COMPONENTS}


def _evaluate(model_name, label, plan, captured, costs, tokens, args, rows) -> None:
    from zorse_fx.ir.schedule import inflight, make_schedule
    from zorse_fx.runtime.launch import launch

    if plan.interleave != 1:  # the per-stage memory rows below assume one stage per rank
        raise ValueError(f"{label}: cost_accuracy compares one stage per rank; this plan has interleave "
                         f"{plan.interleave}: build it with interleave=1")
    with tempfile.TemporaryDirectory() as tmp:
        plan_dir = Path(tmp) / "plan"
        plan.export(plan_dir)
        weights = captured.state()
        torch.save(weights, plan_dir / "weights.pt")
        torch.set_num_threads(1)
        sched = make_schedule(plan.schedule, plan.num_stages, plan.num_microbatches)
        for s, stage in enumerate(plan.stages):
            g = stage.gpus[0]
            n = g.samples_per_microbatch
            a, b = stage.blocks
            pred = n * sum(costs.fwd_bwd_s_per_sample[g.gpu_type][a:b]) + sum(costs.fwd_bwd_s_fixed[g.gpu_type][a:b])
            ms, act_bytes = measure_stage(plan, plan_dir, weights, s, n, tokens, args.repeats)
            common = {"model": model_name, "plan": label, "stage": s, "device_type": g.gpu_type, "samples": n}
            rows.append({**common, "quantity": "fwd_bwd_ms", "predicted": pred * 1e3, "measured": ms})
            # fp32 weights + gradients (8 B/param) and AdamW moments (8 B/param), on a ZeRO-1 stage
            # for the elements of this GPU's shard only (runtime/worker.py).
            n_par = stage.num_parameters
            lo, hi = stage.shard_ranges(n_par)[0] if _zero1(stage) else (0, n_par)
            rows.append({**common, "quantity": "peak_memory_bytes", "predicted": g.predicted_memory_bytes,
                         "measured": 8 * n_par + 8 * (hi - lo) + act_bytes * inflight(sched[s])})
        torch.save(tokens, Path(tmp) / "tokens.pt")
        launch(plan.world_size, [str(plan_dir), "--tokens", str(Path(tmp) / "tokens.pt"), "--steps", str(args.steps),
                                 "--out", str(Path(tmp) / "run")], capture=True)
        metrics = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
        steady = metrics[1:]
        measured = {k: statistics.median(max(r[k] for r in m["ranks"]) for m in steady) for k in COMPONENTS}
        sim_step, predicted = predicted_breakdown(plan, costs, args)
        common = {"model": model_name, "plan": label, "stage": "all", "device_type": plan.stages[0].gpus[0].gpu_type,
                  "samples": plan.global_batch_size}
        rows.append({**common, "quantity": "step_ms",
                     "predicted": plan.predicted_step_time_s * 1e3,
                     "measured": statistics.median(m["step_time_s"] for m in steady) * 1e3,
                     "simulated_step_s": sim_step, "predicted_breakdown_s": predicted,
                     "measured_breakdown_s": measured})
        if any(_zero1(st) for st in plan.stages):
            rows.append({**common, "quantity": "allgather_ms", "predicted": predicted["allgather_s"] * 1e3,
                         "measured": measured["allgather_s"] * 1e3})


def _zero1(stage) -> bool:
    """The runtime shards this stage's optimizer state (ZeRO-1) and all-gathers its weights."""
    return stage.sharded and len(stage.gpus) > 1


def zorse_cluster(path):
    from zorse_fx.cluster import Cluster

    return Cluster.from_yaml(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m,gpt2-124m")
    ap.add_argument("--cluster", default=str(ROOT / "bench" / "clusters" / "cpu_local.yaml"))
    ap.add_argument("--profile", default=str(ROOT / "zorse_fx" / "profiles" / "cpu-x86_64-1thread.json"))
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--global-batch-size", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sharding", choices=("auto", "never", "always"), default="auto",
                    help="the solver's ZeRO-1 policy (PlanOptions.sharding); 'always' shards its multi-GPU "
                         "stage, so the allgather_ms row compares the weight all-gather")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cost_accuracy.json"))
    args = ap.parse_args()
    rows: list[dict] = []
    for name in args.models.split(","):
        run(name, args, rows)
    for r in rows:
        r["error"] = r["predicted"] / r["measured"] - 1 if r["measured"] else None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print("| model | plan | stage | device | samples | quantity | predicted | measured | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fmt = (lambda v: f"{v / 2**20:.1f} MiB") if r["quantity"] == "peak_memory_bytes" else (lambda v: f"{v:.1f} ms")
        err = "-" if r["error"] is None else f"{r['error']:+.1%}"
        print(f"| {r['model']} | {r['plan']} | {r['stage']} | {r['device_type']} | {r['samples']} | {r['quantity']} | "
              f"{fmt(r['predicted'])} | {fmt(r['measured'])} | {err} |")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
