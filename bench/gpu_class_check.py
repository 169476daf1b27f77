"""Score the GPU class model against our own H200 measurement of Llama layers.

Run: ``PYTHONPATH=. python bench/gpu_class_check.py [--measured FILE] [--out FILE]``

Input: the JSON that ``bench/gpu_measure.py`` writes (default
``bench/results/gpu_h200.json``). Its ``layers`` rows are eager Hugging Face
``LlamaForCausalLM`` (``attn_implementation="sdpa"``, vocabulary 32000,
Llama-2 7B/13B layer shapes) with 1 and 2 decoder layers, under bfloat16
autocast with float32 weights, forward + backward milliseconds per
(sequence length, micro-batch); one decoder layer is the 2-layer minus the
1-layer model (embedding, final norm, LM head and loss cancel). Its ``gemm``
rows are ``torch.matmul`` TFLOP/s per shape and mode.

What the model prices: for each (shape, sequence length) the same model with
1 and with 2 layers, captured on the meta device by the project's path
(``capture(..., method="export")`` + ``analyse``, as
``bench/gpu_layer_accuracy.py`` ``bert_graph``; one capture per (shape,
layers, sequence length)), priced by ``roofline.block_costs`` under
``bf16-mixed``: fwd+bwd = sum over blocks of ``fwd_bwd_s_per_sample *
micro_batch + fwd_bwd_s_fixed`` (no optimizer step: the measurement has
none). This is what a plan uses for a GPU type without a kernel profile.
Pricings of the measured GPU type (``args.device_type`` of the file):

* ``table``: ``gpu_spec(type)`` as shipped (the measured sustained GEMM rate
  of ``gpu_specs.csv`` where the row has one);
* ``class``: that rate removed, so matmuls run at
  ``gpu_model.predicted_sustained_fp16`` (as ``gpu_layer_accuracy.py``
  ``class``). Where the table has no sustained rate (H200 on 2026-11-26)
  the two coincide, and the output says so;
* ``sweep`` (diagnostic): the class model with the sustained rate set to this
  file's own bfloat16 8192^3 GEMM rate, i.e. the ``table`` pricing once the
  table holds this measurement;
* ``eager`` (diagnostic): the ``class`` pricing with every elementwise node
  its own kernel (unfused fraction 1 instead of the fitted
  ``gpu_model.UNFUSED_FRACTION``; ``gpu_layer_accuracy.price_step_eager``):
  the slowest the elementwise accounting can price.

Error = predicted / measured - 1 (positive: the model is too slow), for the
2-layer model, the 1-layer model, and one layer (the difference of both, on
both sides). The ``gemm`` rows are reported next to the table's 16-bit and
TF32 peaks and the class model's predicted sustained rate.

What it shows: how far the class model's price of a Llama-2 7B/13B decoder
layer (and of a 1-2 layer model with its 32000-token head) is from a real
forward + backward on one H200, per sequence length 512/2048/4096 and
micro-batch 1/4, and how much of it is the matmul rate.

What it cannot show: other GPU types or classes (one H200, one run, one
driver and PyTorch version); a published figure (this is our own
measurement, not reproduced elsewhere); fused or compiled runtimes (the
measured model is eager Hugging Face code: separate kernels for RMSNorm,
rotary, SiLU and residual adds, whose fraction the class model fits on
BERT, not on this run); the optimizer step, data loading, or communication;
whole 32/40-layer models (a 2-layer model at micro-batch 1 and seq 512 is
a few ms, where launch and host overhead weigh more than in a full model).
The layer difference subtracts two noisy timings, so its error is larger
than either's.

Writes ``--out`` (default ``bench/results/gpu_class_check.json``). No GPU is
used.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zorse_fx.cluster import GPUSpec, gpu_spec  # noqa: E402
from zorse_fx.cost import gpu_model  # noqa: E402

#: ``gpu_measure.py`` shape name -> ``zorse_fx.models.published`` config
#: name; ``tiny`` is ``gpu_measure.py``'s CPU test shape (its LLAMA2["tiny"]).
SHAPES = {"7b": "llama2-7b", "13b": "llama2-13b", "tiny": None}
#: Capture batch (the graph's costs are per sample; as ``bert_graph``).
CAPTURE_BATCH = 2


def llama_config(shape: str, layers: int):
    """The ``LlamaConfig`` of ``shape`` (a key of ``SHAPES``) with ``layers``
    decoder layers and SDPA attention, as ``gpu_measure.py`` builds it.

    Raises:
        ValueError: unknown shape.
    """
    from transformers import LlamaConfig

    from zorse_fx.models.published import CONFIGS

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {sorted(SHAPES)}")
    if SHAPES[shape] is None:
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_attention_heads=4,
                          num_key_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=False)
    else:
        cfg = CONFIGS[SHAPES[shape]]()
    cfg.num_hidden_layers = layers
    cfg._attn_implementation = "sdpa"
    return cfg


@functools.lru_cache(maxsize=None)
def llama_graph(shape: str, layers: int, seq: int):
    """The project's block graph of ``shape`` with ``layers`` layers at
    sequence length ``seq`` (causal-LM loss), captured on the meta device."""
    from transformers import LlamaForCausalLM

    from zorse_fx.capture import analyse, capture
    from zorse_fx.models.hf import CausalLMWithLoss

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(shape, layers))
    ids = torch.zeros((CAPTURE_BATCH, seq), dtype=torch.long, device="meta")
    return analyse(capture(CausalLMWithLoss(model), (ids, ids), method="export"))


def price_fwd_bwd(bg, spec: GPUSpec, micro_batch: int, precision: str = "bf16-mixed") -> float:
    """Predicted seconds of one forward + backward of ``micro_batch``
    samples of ``bg`` on ``spec`` (``gpu_layer_accuracy.price_step``'s
    ``fwd_bwd_s``: no optimizer step)."""
    from zorse_fx.cost.roofline import block_costs
    from zorse_fx.precision import precision_policy

    bc = block_costs(bg, {spec.type: spec}, precision=precision_policy(precision))
    per, fixed = bc.fwd_bwd_s_per_sample[spec.type], bc.fwd_bwd_s_fixed[spec.type]
    return sum(p * micro_batch + f for p, f in zip(per, fixed))


def sweep_rate(gemm: list[dict]) -> float | None:
    """The bfloat16 8192^3 GEMM rate of ``gemm`` (FLOP/s), else the largest
    square bfloat16 one, else None."""
    sq = [g for g in gemm if g["mode"] == "bfloat16" and g["m"] == g["n"] == g["k"]]
    if not sq:
        return None
    return max(sq, key=lambda g: (g["m"] == 8192, g["m"]))["tflops"] * 1e12


def pricing_specs(spec: GPUSpec, gemm: list[dict]) -> dict[str, GPUSpec]:
    """``{pricing: GPUSpec}``: ``table``, ``class`` and (if ``gemm`` has a
    bfloat16 square row) ``sweep``; see the module docstring."""
    out = {"table": spec, "class": dataclasses.replace(spec, sustained_fp16_flops_per_s=None)}
    rate = sweep_rate(gemm)
    if rate is not None:
        out["sweep"] = dataclasses.replace(spec, sustained_fp16_flops_per_s=rate)
    return out


def price_fwd_bwd_eager(bg, spec: GPUSpec, micro_batch: int, precision: str = "bf16-mixed") -> float:
    """Diagnostic: ``price_fwd_bwd`` with every elementwise node its own
    kernel (``gpu_layer_accuracy.price_step_eager``, unfused fraction 1,
    less its optimizer step)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_layer_accuracy import price_step, price_step_eager

    step = price_step_eager(bg, spec, micro_batch, precision=precision)
    return step - price_step(bg, spec, micro_batch, precision=precision)["optimizer_s"]


def pricers(specs: dict[str, GPUSpec]) -> dict:
    """``{pricing: fn(bg, micro_batch) -> seconds}``: ``price_fwd_bwd`` on
    each of ``specs`` and ``eager`` (``price_fwd_bwd_eager`` on the ``class``
    spec)."""
    def on(spec):
        return lambda bg, mb: price_fwd_bwd(bg, spec, mb)

    out = {name: on(spec) for name, spec in specs.items()}
    out["eager"] = lambda bg, mb: price_fwd_bwd_eager(bg, specs["class"], mb)
    return out


def check_rows(layers: list[dict], prices: dict, graph=llama_graph) -> list[dict]:
    """One dict per (shape, seq, micro_batch) of ``layers`` that has both a
    1- and a 2-layer row: measured and predicted fwd+bwd seconds of the
    2-layer model (``two_``), the 1-layer model (``one_``) and the layer
    (``layer_`` = two - one), per pricing of ``prices`` (``{name: fn(bg,
    micro_batch) -> s}``), and errors (predicted / measured - 1).
    ``graph(shape, layers, seq)`` gives the block graph.

    Raises:
        ValueError: a row's shape is not a key of ``SHAPES``.
    """
    unknown = {r["shape"] for r in layers} - set(SHAPES)
    if unknown:
        raise ValueError(f"unknown shapes {sorted(unknown)}; choose from {sorted(SHAPES)}")
    by = {(r["shape"], r["layers"], r["seq"], r["micro_batch"]): r["fwd_bwd_ms"] * 1e-3 for r in layers}
    out = []
    for (shape, n, seq, mb) in sorted(by, key=lambda k: (list(SHAPES).index(k[0]), k[2], k[3])):
        if n != 1 or (shape, 2, seq, mb) not in by:
            continue
        meas = {"one": by[(shape, 1, seq, mb)], "two": by[(shape, 2, seq, mb)]}
        meas["layer"] = meas["two"] - meas["one"]
        row = dict(shape=shape, seq=seq, micro_batch=mb, **{f"measured_{k}_s": v for k, v in meas.items()})
        for name, price in prices.items():
            pred = {"one": price(graph(shape, 1, seq), mb), "two": price(graph(shape, 2, seq), mb)}
            pred["layer"] = pred["two"] - pred["one"]
            for k in ("one", "two", "layer"):
                row[f"{name}_{k}_s"] = pred[k]
                row[f"{name}_{k}_err"] = pred[k] / meas[k] - 1
        out.append(row)
    return out


def summaries(rows: list[dict], pricings) -> list[dict]:
    """Median and max |error| of the layer and of the 2-layer model per
    pricing, over micro-batch 1, micro-batch 4 (each batch present) and all."""
    out = []
    groups = [(f"micro-batch {mb}", [r for r in rows if r["micro_batch"] == mb])
              for mb in sorted({r["micro_batch"] for r in rows})] + [("all", rows)]
    for name in pricings:
        for label, sel in groups:
            d = dict(pricing=name, rows=label, n=len(sel))
            for k in ("layer", "two"):
                errs = [abs(r[f"{name}_{k}_err"]) for r in sel]
                d[f"{k}_median_abs_err"] = statistics.median(errs)
                d[f"{k}_max_abs_err"] = max(errs)
            out.append(d)
    return out


def gemm_report(gemm: list[dict], spec: GPUSpec) -> dict:
    """The GEMM sweep's TFLOP/s per shape and mode, and the table's figures
    for ``spec``: 16-bit and TF32 tensor peaks, FP32 peak, the table's
    sustained rate (None if none) and the class model's predicted one."""
    peak = spec.fp32_flops_per_s if spec.arch == "pascal" else spec.fp16_flops_per_s
    predicted = (gpu_model.predicted_sustained_fp16(spec.arch, peak, spec.tdp_w) / 1e12
                 if spec.arch in gpu_model.ARCH_EFFICIENCY else None)
    shapes: dict[str, dict] = {}
    for g in gemm:
        shapes.setdefault(f"{g['m']}x{g['n']}x{g['k']}", {})[g["mode"]] = g["tflops"]
    return dict(table_fp16_bf16_peak_tflops=spec.fp16_flops_per_s / 1e12,
                table_tf32_peak_tflops=None if spec.tf32_flops_per_s is None else spec.tf32_flops_per_s / 1e12,
                table_fp32_peak_tflops=spec.fp32_flops_per_s / 1e12,
                table_sustained_fp16_tflops=(None if spec.sustained_fp16_flops_per_s is None
                                             else spec.sustained_fp16_flops_per_s / 1e12),
                class_predicted_sustained_fp16_tflops=predicted,
                measured_max_tflops={m: max(g["tflops"] for g in gemm if g["mode"] == m)
                                     for m in dict.fromkeys(g["mode"] for g in gemm)},
                measured_tflops=shapes)


def print_tables(rows, summ, gemm, device: str, pricings, coincide: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=210)
    t = Table(title=f"{device}: fwd+bwd ms, measured vs class model (err = predicted/measured - 1)")
    for c in ("shape", "seq", "mbs", "meas 2L", "meas 1L", "meas layer"):
        t.add_column(c, justify="right")
    shown = [p for p in pricings if not (coincide and p == "table")]
    for p in shown:
        for c in ("2L", "err", "1L", "err", "layer", "err"):
            t.add_column(f"{p} {c}", justify="right")
    for r in rows:
        cells = [r["shape"], str(r["seq"]), str(r["micro_batch"])]
        cells += [f"{r[f'measured_{k}_s'] * 1e3:.2f}" for k in ("two", "one", "layer")]
        for p in shown:
            for k in ("two", "one", "layer"):
                cells += [f"{r[f'{p}_{k}_s'] * 1e3:.2f}", f"{r[f'{p}_{k}_err']:+.1%}"]
        t.add_row(*cells)
    con.print(t)
    if coincide:
        con.print("table = class: the table has no sustained GEMM rate for this GPU type.")
    s = Table(title="|error| summary")
    for c in ("pricing", "rows", "n", "layer median", "layer max", "2-layer median", "2-layer max"):
        s.add_column(c, justify="right")
    for d in summ:
        s.add_row(d["pricing"], d["rows"], str(d["n"]), f"{d['layer_median_abs_err']:.1%}",
                  f"{d['layer_max_abs_err']:.1%}", f"{d['two_median_abs_err']:.1%}", f"{d['two_max_abs_err']:.1%}")
    con.print(s)
    if gemm is None:
        return
    g = Table(title=f"{device} GEMM sweep (torch.matmul TFLOP/s) against the table")
    modes = list(gemm["measured_max_tflops"])
    g.add_column("M x N x K", justify="right")
    for m in modes:
        g.add_column(m, justify="right")
    for shape, v in gemm["measured_tflops"].items():
        g.add_row(shape, *[f"{v[m]:.0f}" if m in v else "" for m in modes])
    con.print(g)

    def fmt(x):
        return "none" if x is None else f"{x:.1f}"

    con.print(f"table: 16-bit tensor peak {fmt(gemm['table_fp16_bf16_peak_tflops'])}, TF32 peak "
              f"{fmt(gemm['table_tf32_peak_tflops'])}, FP32 peak {fmt(gemm['table_fp32_peak_tflops'])}, "
              f"sustained 16-bit {fmt(gemm['table_sustained_fp16_tflops'])}; class model predicted sustained "
              f"16-bit {fmt(gemm['class_predicted_sustained_fp16_tflops'])} TFLOP/s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measured", default=str(ROOT / "bench" / "results" / "gpu_h200.json"),
                    help="gpu_measure.py output (its 'layers' and 'gemm' lists)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_class_check.json"))
    args = ap.parse_args(argv)
    data = json.loads(Path(args.measured).read_text())
    device = data.get("device_type") or data.get("args", {}).get("device_type") or "H200"
    spec = gpu_spec(device)
    gemm = data.get("gemm", [])
    specs = pricing_specs(spec, gemm)
    coincide = spec.sustained_fp16_flops_per_s is None
    prices = pricers(specs)
    rows = check_rows(data["layers"], prices)
    if not rows:
        raise SystemExit(f"{args.measured}: no (shape, seq, micro_batch) with both a 1- and a 2-layer row")
    summ = summaries(rows, prices)
    grep = gemm_report(gemm, spec) if gemm else None
    print_tables(rows, summ, grep, device, list(prices), coincide)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(
        command=f"PYTHONPATH=. python bench/gpu_class_check.py --measured {args.measured} --out {args.out}",
        measured=dict(file=args.measured, started=data.get("started"), env=data.get("env")),
        device_type=device, precision="bf16-mixed", unfused_fraction=gpu_model.UNFUSED_FRACTION,
        table_equals_class=coincide,
        sweep_sustained_tflops=None if "sweep" not in specs else specs["sweep"].sustained_fp16_flops_per_s / 1e12,
        summary=summ, gemm=grep, rows=rows), indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
