"""Score the GPU cost model of types without a profile against cited public data.

Run: ``PYTHONPATH=. python bench/gpu_roofline_accuracy.py [--layer]``

Part 1 (always): for every row of ``zorse_fx/cost/reference_data.GEMM_POINTS``
(published large 16-bit ``torch.matmul`` rates, each with its source), the
class model's sustained rate (``gpu_model.predicted_sustained_fp16``: fitted
efficiency x datasheet peak, capped by TDP / energy per FLOP; the measured
column of gpu_specs.csv is NOT used here) against the measurement: per-GPU
signed error, then median and max |error| of the fit rows and of the
held-out rows separately. The old roofline (``MATMUL_EFFICIENCY`` x peak,
Pascal at its packed-FP16 peak) is scored on the same rows for comparison.

Part 1b: the streaming-bandwidth fraction (``gpu_model.STREAM_EFFICIENCY``)
against published copy-bandwidth measurements (``BANDWIDTH_POINTS``).

Part 2 (``--layer``): one Llama-2-7B-width decoder layer (h 4096, f 11008,
32 heads, causal SDPA) captured on the meta device, priced under fp16-mixed
at seq 512 / 2048 and micro-batch 1 / 4 on the GPU types of the table:
forward, backward, backward/forward ratio. There are no public per-layer
measurements to score these against (bench/README.md, "GPU cost model of
types without a profile"), so this part only shows the model's structure
(per-class ratios, the micro-batch-1 fixed cost). No GPU is used.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from zorse_fx.cost import gpu_model
from zorse_fx.cost.reference_data import BANDWIDTH_POINTS, GEMM_POINTS
from zorse_fx.cost.roofline import MATMUL_EFFICIENCY


def gemm_rows() -> list[dict]:
    """One dict per reference row: gpu, role, measured, predicted, old, errors (fractions)."""
    rows = []
    for p in GEMM_POINTS:
        arch, peak, tdp = gpu_model.reference_peak(p.gpu)
        pred = gpu_model.predicted_sustained_fp16(arch, peak, tdp) / 1e12
        old_peak = peak * (2 if arch == "pascal" else 1)  # the old table priced P100 at packed FP16 (2x FP32)
        old = MATMUL_EFFICIENCY * old_peak / 1e12
        rows.append(dict(gpu=p.gpu, arch=arch, role=p.role, fits=p.fits, measured=p.tflops, predicted=pred, old=old,
                         err=pred / p.tflops - 1, old_err=old / p.tflops - 1))
    return rows


def bandwidth_rows() -> list[dict]:
    """One dict per ``BANDWIDTH_POINTS`` row: predicted (STREAM_EFFICIENCY x datasheet) vs measured."""
    from zorse_fx.cluster import gpu_spec
    rows = []
    for p in BANDWIDTH_POINTS:
        sheet = gpu_spec(p.gpu).mem_bw_bytes_per_s / 1e9
        pred = gpu_model.STREAM_EFFICIENCY * sheet
        rows.append(dict(gpu=p.gpu, role=p.role, measured=p.gbps, predicted=pred, err=pred / p.gbps - 1,
                         old=0.7 * sheet, old_err=0.7 * sheet / p.gbps - 1))
    return rows


def summary(rows: list[dict], key: str = "err") -> tuple[float, float]:
    """(median |error|, max |error|) of ``rows``."""
    errs = [abs(r[key]) for r in rows]
    return statistics.median(errs), max(errs)


def layer_table(seqs=(512, 2048), mbss=(1, 4)) -> list[dict]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from zorse_fx.capture import analyse, capture
    from zorse_fx.cluster import gpu_spec, known_gpu_types
    from zorse_fx.cost.roofline import graph_chains, class_block_time, weight_traffic_bytes, node_costs, saved_activations_or_estimate
    from zorse_fx.models.hf import CausalLMWithLoss
    from zorse_fx.precision import precision_policy

    out = []
    pol = precision_policy("fp16-mixed")
    for s in seqs:
        with torch.device("meta"):
            m = LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                             num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=32,
                                             max_position_embeddings=4096))
        ids = torch.zeros((2, s), dtype=torch.long, device="meta")
        bg = analyse(capture(CausalLMWithLoss(m), (ids, ids), method="export"))
        acts = saved_activations_or_estimate(bg, pol)
        costs = node_costs(bg, acts, pol)
        layer = [b for b in range(bg.num_blocks) if bg.describe_blocks(b, b + 1) == "L0"]
        all_chains = graph_chains(bg, costs)
        chains = {b: all_chains[b] for b in layer}
        traffic = {b: weight_traffic_bytes(bg, b, pol) for b in layer}
        for g in known_gpu_types():
            spec = gpu_spec(g)
            if not gpu_model.has_class_model(spec):
                continue
            parts = [class_block_time(bg, costs, b, chains[b], traffic[b], spec, pol) for b in layer]
            f, bw, ff, fb = (sum(p[i] for p in parts) for i in range(4))
            for n in mbss:
                fwd, bwd = f * n + ff, bw * n + fb
                out.append(dict(gpu=g, arch=spec.arch, seq=s, mbs=n, fwd_ms=fwd * 1e3, bwd_ms=bwd * 1e3,
                                ratio=bwd / fwd, fixed_ms=(ff + fb) * 1e3))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layer", action="store_true", help="also price a Llama-7B-width layer on every table GPU")
    args = ap.parse_args(argv)
    rows = gemm_rows()
    print(f"{'gpu':16s} {'class':22s} {'role':8s} {'measured':>9s} {'model':>8s} {'err':>7s} {'old':>8s} {'old err':>8s}")
    for r in rows:
        print(f"{r['gpu']:16s} {r['arch']:22s} {r['role']:8s} {r['measured']:9.2f} {r['predicted']:8.2f} "
              f"{r['err']:+7.1%} {r['old']:8.2f} {r['old_err']:+8.1%}")
    for role in ("fit", "holdout"):
        sel = [r for r in rows if r["role"] == role]
        med, mx = summary(sel)
        omed, omx = summary(sel, "old_err")
        print(f"{role:8s} n={len(sel):2d}  model: median |err| {med:.1%}, max {mx:.1%}   "
              f"old roofline: median {omed:.1%}, max {omx:.1%}")
    print()
    print(f"memory bandwidth: STREAM_EFFICIENCY = {gpu_model.STREAM_EFFICIENCY:.3f} of datasheet (old: 0.7)")
    brows = bandwidth_rows()
    for r in brows:
        print(f"{r['gpu']:16s} {r['role']:8s} {r['measured']:9.1f} {r['predicted']:8.1f} {r['err']:+7.1%} "
              f"{r['old']:8.1f} {r['old_err']:+8.1%}")
    for role in ("fit", "holdout"):
        sel = [r for r in brows if r["role"] == role]
        med, mx = summary(sel)
        print(f"{role:8s} n={len(sel):2d}  model: median |err| {med:.1%}, max {mx:.1%}")
    print()
    print("implied sustained clock (boost x sustained / (class efficiency x peak)), table GPUs with clocks:")
    from zorse_fx.cluster import gpu_spec, known_gpu_types
    for t in known_gpu_types():
        spec = gpu_spec(t)
        if spec.boost_clock_mhz is None or spec.arch not in gpu_model.ARCH_EFFICIENCY:
            continue
        peak = spec.fp32_flops_per_s if spec.arch == "pascal" else spec.fp16_flops_per_s
        rate = gpu_model.sustained_matmul_flops_per_s(spec, torch.float16, MATMUL_EFFICIENCY)
        clock = spec.boost_clock_mhz * rate / (gpu_model.ARCH_EFFICIENCY[spec.arch] * peak)
        base = f"{spec.base_clock_mhz:.0f}" if spec.base_clock_mhz else "n/a"
        print(f"{t:16s} boost {spec.boost_clock_mhz:6.0f} MHz  base {base:>5s} MHz  implied sustained {clock:6.0f} MHz")
    if args.layer:
        print()
        print(f"{'gpu':16s} {'class':22s} {'seq':>5s} {'mbs':>4s} {'fwd ms':>8s} {'bwd ms':>8s} {'bwd/fwd':>8s} "
              f"{'fixed ms':>9s}")
        for r in layer_table():
            print(f"{r['gpu']:16s} {r['arch']:22s} {r['seq']:5d} {r['mbs']:4d} {r['fwd_ms']:8.2f} {r['bwd_ms']:8.2f} "
                  f"{r['ratio']:8.2f} {r['fixed_ms']:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
