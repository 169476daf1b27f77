"""Cost model of GPU types without a measured profile.

Prices, instead of the plain roofline's single "0.6 of datasheet peak", the GPU
types of ``gpu_specs.csv`` whose ``arch`` is a fitted class (Pascal to Hopper;
B200, MI250X and MI300X have no cited measurement and stay on the plain
roofline, as do GPU types declared in a cluster file without an ``arch``; one
declared with the ``arch`` of a fitted class, ``tdp_w`` and, optionally,
``tf32_tensor_tflops`` is priced by that class's model from its own datasheet
figures, like a table row of that class without a measurement). Per block, for one
forward + backward, from the fx nodes' FLOPs and bytes (``roofline.node_costs``):

* **Matmul rate (sustained, per GPU class).** ``R = sustained_fp16_flops_per_s``
  where the table holds a public measurement of a large 16-bit GEMM, else
  ``min(ARCH_EFFICIENCY[arch] * peak16, tdp_w / ENERGY_J_PER_FLOP[arch])``:
  a die family reaches a fixed fraction of its datasheet peak while it is not
  power-capped, and a power-capped card (T4, L4, A10, PCIe A100/H100) runs
  at the rate its board power buys. On Pascal (no tensor cores) a 16-bit
  GEMM with FP32 accumulate runs at the FP32 rate, so ``peak16`` is the FP32
  peak there. Both constants are fitted, per class, to the cited GEMM
  measurements of ``reference_data.GEMM_POINTS`` (``_fit``, no other input).
  FP32 matmuls (no autocast) keep the plain roofline: ``MATMUL_EFFICIENCY``
  of the FP32 peak (PyTorch leaves TF32 off for matmuls by default). With
  TF32 on (``PrecisionPolicy.tf32``) on a GPU with TF32 tensor cores, an FP32
  matmul runs on the same tensor cores at the datasheet's TF32/16-bit peak
  ratio (half on A100, H100, A10, L4): ``R * tf32_peak / peak16`` for a
  fitted class (the same sustained fraction of the tensor peak, and the same
  power cap bought at that ratio, an assumption: no cited TF32 GEMM
  measurement per class), else ``MATMUL_EFFICIENCY`` x the TF32 peak.
* **Partly fused elementwise accounting.** Norms, rotary, activations,
  residual adds and casts are grouped into chains: connected through views,
  with no matmul/attention kernel on any dataflow path between two nodes of
  one chain (``roofline.graph_chains``; a residual add and the norm reading
  it are one chain, the next layer's residual add another). Fully fused, a
  chain moves only the bytes that enter it from outside it (matmuls,
  attention, other chains) and the bytes that leave it, once,
  and costs one kernel; run eagerly (every node its own kernel), it moves
  the sum of its nodes' bytes in one kernel per node. Real eager PyTorch
  is in between (some ops fused by the library: apex's layer norm, bias +
  GELU, SDPA; others separate kernels), so a chain of ``k`` nodes costs
  ``fused + UNFUSED_FRACTION * (eager - fused)`` bytes, at
  ``mem_bw * STREAM_EFFICIENCY`` (the median measured copy bandwidth /
  datasheet, ``BANDWIDTH_POINTS``), and ``1 + UNFUSED_FRACTION * (k - 1)``
  kernels. See [Note: unfused fraction] below for the fit.
* **Backward / forward per op class.** matmul: 2x (dgrad + wgrad, each a GEMM
  of the forward's size: Narayanan et al., SC'21, eq. 3); attention: 2.5x
  the forward FLOPs (FlashAttention's backward recomputes ``QK^T`` and runs
  five GEMMs against two: ``benchmarks/benchmark_flash_attention.py`` of
  Dao-AILab/flash-attention counts backward = 2.5 x forward); a chain:
  2x its bytes (reads the output gradient and the saved input, writes the
  input gradient). The per-GPU backward/forward ratio then follows from the
  class's compute/bandwidth balance plus the per-micro-batch term below
  (``bench/gpu_roofline_accuracy.py --layer`` reports it).
* **Per-micro-batch weight and gradient traffic.** Every backward reads each
  parameter's compute-dtype copy once and reads + writes its FP32 gradient
  (accumulation into ``.grad``): ``itemsize(compute) + 2 * itemsize(param)``
  bytes per trainable parameter (``roofline.weight_traffic_bytes``: 10 B
  mixed, 12 B fp32, float32 parameters and gradients under every zorse_fx
  policy, zorse_fx/precision.py [Note: mixed precision]), at
  ``mem_bw * STREAM_EFFICIENCY``,
  paid once per micro-batch whatever its size (``fwd_bwd_s_fixed``), plus
  ``KERNEL_OVERHEAD_S`` per kernel (1 forward + 2 backward per matmul or
  chain's kernel count, 1 + 1 per attention). A plan priced for zorse_fx's
  runtime adds what its backward moves beyond this (the accumulating add's
  second read, the 16-bit gradients' casts to float32: [Note: the runtime's
  gradient work] in ``roofline.py``); the fit below prices other runtimes'
  published steps with this term alone.

* **Attention rate (per GPU class and SDPA kernel).** A 16-bit fused
  attention node (``scaled_dot_product_attention``) runs at
  ``ATTENTION_EFFICIENCY[(arch, kernel)] * R`` (forward and backward
  separately), where ``kernel`` is the one PyTorch's SDPA dispatches on that
  class (``SDPA_KERNELS``: on Hopper cuDNN attention, without an explicit
  ``attn_mask`` and, at about half that rate, with one). The efficiencies are
  published (unmasked) and our measured (masked) attention rates over the
  same GPU's GEMM rate
  (``reference_data.ATTENTION_POINTS`` over ``GEMM_POINTS``,
  ``_fit_attention``); see [Note: attention rate]. Classes with no
  cited per-pass figure (Pascal to Ada) price attention at ``R``, both ways.

Causal attention (``is_causal=True``) does half the ``QK^T``/``PV`` work
(FlashAttention skips the masked blocks; its benchmark halves the FLOPs), at
the same rate as non-causal attention.

Units: FLOP/s, bytes/s, seconds, watts, joules per FLOP.

[Note: unfused fraction]
``UNFUSED_FRACTION`` is fitted to published whole training steps
(``step_reference_data.STEP_POINTS``: Lambda's deeplearning-benchmark logs of
NVIDIA's BERT SQuAD fine-tuning, seq 384, apex AMP O2, one GPU, each row
cited at its commit). The step price is linear in the fraction (every other
term is unchanged), so each measured step gives the fraction it implies,
``(measured - fused) / (eager - fused)`` with ``fused``/``eager`` the class
model's step price at fraction 0/1; the constant is the median of the
implied fractions over the FIT split, clipped to [0, 1]
(``fit_unfused_fraction``). Fit split: the 10 BERT-large rows (V100, A10,
A40, A100 PCIe and SXM4, RTX A6000, RTX 3090, RTX 3080, Quadro RTX 8000,
GTX 1080 Ti). Held out: the 6 BERT-base rows (other model width, batch
48-192, the same benchmark), class pricing: median |error| 8.6%, max
16.0% (fully fused: 22.7%, 35.0%). The other way round (fit on BERT-base,
fraction 0.464, scored on BERT-large): 4.5%, 16.5% (fused: 22.7%, 33.8%).
Each GPU class left out in turn (fit on the other classes' rows of both
models): held-out median |error| 1.6% (Volta) to 15.3% (Ampere GA10x pro
cards, A10/A40/A6000, priced too slow: their implied fractions are the
lowest, 0.32-0.48). Every BERT-base GPU also has a BERT-large row, so the
model split scores another model width on the same GPUs; the class split
scores unseen GPU classes. ``bench/gpu_layer_accuracy.py`` prints all
splits and the per-class errors; ``tests/test_gpu_layer_accuracy.py``
recomputes the constant from the fit rows. Not shown by this data: BERT's eager attention (scores
through scale, mask, softmax, dropout) against the SDPA of a Llama layer,
and apex O2 (float16 norms and softmax) against autocast.

[Note: attention rate]
Fused attention on Hopper runs well below the GEMM rate: the
FlashAttention-3 paper (Shah et al. 2024, arXiv 2407.08608, Figures 5 and 6,
H100 SXM5, FP16, head dim 128, no causal mask) measures FlashAttention-2 at
309-370 TFLOP/s forward and 214-322 backward, cuDNN at 497-617 and 305-518,
against 736 TFLOP/s for a large GEMM on the same GPU (``GEMM_POINTS``). The
class model takes, per (class, kernel) and pass, the median over the paper's
sequence lengths (512 to 16k) of attention rate / GEMM rate, and multiplies
the class's ``R`` by it. Relative to ``R``, not to the datasheet peak: both
kernels are tensor-core bound like a GEMM, so a power-capped SKU (H100 PCIe,
whose ``R`` is set by its board power) loses the same share on attention.
Which kernel runs (``SDPA_KERNELS``): PyTorch 2.11 on our H100 and H200 ran
cuDNN's kernels (``cudnn_generated_fort_native_sdpa_sm90_flash_fprop/bprop``,
by name in the ``attention`` rows of ``bench/results/gpu_h100.json`` and the
``diagnose`` rows of ``bench/results/gpu_h200.json``) for bfloat16 attention
with an explicit mask, with ``is_causal=True`` and with neither, so Hopper
is priced at the cuDNN ratios; older PyTorch tried the flash backend,
FlashAttention-2, first (https://github.com/huggingface/transformers/pull/48163,
2026, adds a cuDNN preference on Hopper for that reason). The unmasked cuDNN
rate we measured on the H100 at 8k-16k tokens (662-683 TFLOP/s forward,
437-506 backward) is within 12% of the paper's cuDNN bars, which are used.
An explicit ``attn_mask`` costs about half: cuDNN then computes every
query-key block and applies the mask, where ``is_causal`` skips the masked
half (measured: 333 TFLOP/s forward, 257 backward by the non-causal count,
against 683 and 506 unmasked, micro-batch 4 at seq 4096). No public rate
for the masked case was found, so ``("hopper", "cudnn_mask")`` is fitted to
our own H100 measurement (``reference_data.ATTENTION_POINTS``' last rows);
the H200, whose masked kernel ran at 328 / 299 TFLOP/s by the same count,
holds it out. Hugging Face Llama captured by ``capture(...,
method="export")`` passes an explicit causal mask, so it is priced at
``cudnn_mask``. Not covered: Ampere and Ada
(FlashAttention-2 without a mask, the memory-efficient kernel with one:
the FlashAttention-2 paper, Dao 2023, arXiv 2307.08691, gives A100 per-pass
rates only as plots and a 50-73%-of-peak range in its abstract), Volta,
Turing and Pascal (the flash backend needs sm80; SDPA runs the
memory-efficient kernel, no cited rate): attention stays at ``R`` there.
The published figures carry no mask (a mask adds its own read), are FP16
(bfloat16 is priced the same: same tensor-core peak) and head dim 128 (used
for every head dim).
``bench/gpu_class_check.py`` scores the result on our H200 (held out: none
of its timings set a constant).
"""

from __future__ import annotations

import statistics
import torch

from ..cluster import GPUSpec
from .reference_data import ATTENTION_POINTS, BANDWIDTH_POINTS, GEMM_POINTS, HELDOUT_PEAKS

__all__ = ["STREAM_EFFICIENCY", "ARCH_EFFICIENCY", "ENERGY_J_PER_FLOP", "ATTENTION_BWD_FACTOR", "MATMUL_BWD_FACTOR", "CHAIN_BWD_FACTOR",
           "UNFUSED_FRACTION", "fit_unfused_fraction", "sustained_matmul_flops_per_s", "predicted_sustained_fp16",
           "has_class_model", "reference_peak", "SDPA_KERNELS", "ATTENTION_EFFICIENCY", "attention_flops_per_s"]

#: backward FLOPs / forward FLOPs of a matmul (Narayanan et al. SC'21 eq. 3).
MATMUL_BWD_FACTOR = 2.0
#: backward FLOPs / forward FLOPs of fused attention (Dao-AILab/flash-attention,
#: benchmarks/benchmark_flash_attention.py: ``flops(..., mode="bwd") = 2.5 * fwd``).
ATTENTION_BWD_FACTOR = 2.5
#: backward bytes / forward bytes of an elementwise chain: reads dY and the
#: saved input, writes dX (3 tensors against 2 forward; 2x counting the
#: saved-input re-read as in the plain roofline's FWD_BWD_FACTOR - 1).
CHAIN_BWD_FACTOR = 2.0


def reference_peak(gpu: str, specs: dict[str, GPUSpec] | None = None) -> tuple[str, float, float]:
    """``(arch, dense 16-bit peak FLOP/s, tdp W)`` of a reference-table GPU
    (a ``gpu_specs.csv`` row, else ``reference_data.HELDOUT_PEAKS``). For
    Pascal the 16-bit matmul peak is the FP32 peak (see the module note)."""
    if gpu in HELDOUT_PEAKS:
        arch, p16, p32, tdp, _ = HELDOUT_PEAKS[gpu]
        return arch, (p32 if arch == "pascal" else p16) * 1e12, tdp
    from ..cluster import gpu_spec
    spec = (specs or {}).get(gpu) or gpu_spec(gpu)
    peak = spec.fp32_flops_per_s if spec.arch == "pascal" else spec.fp16_flops_per_s
    return spec.arch, peak, spec.tdp_w


def _fit() -> tuple[dict[str, float], dict[str, float]]:
    """Per-class efficiency (measured / peak16) and energy per FLOP (TDP /
    measured) from the ``fit`` rows of ``GEMM_POINTS`` (median per class)."""
    eff: dict[str, list[float]] = {}
    energy: dict[str, list[float]] = {}
    for p in GEMM_POINTS:
        if p.role != "fit":
            continue
        kind, arch = p.fits.split(":")
        _, peak, tdp = reference_peak(p.gpu)
        if kind == "efficiency":
            eff.setdefault(arch, []).append(p.tflops * 1e12 / peak)
        else:
            energy.setdefault(arch, []).append(tdp / (p.tflops * 1e12))
    e = {a: statistics.median(v) for a, v in eff.items()}
    # Classes without an unthrottled measurement borrow the nearest fitted
    # family (stated, not fitted): Turing's tensor cores are Volta's design
    # (Jia et al. 2019, "Dissecting the NVidia Turing T4 GPU via
    # Microbenchmarking": same instruction encoding, HMMA), Ada pro SKUs the
    # Ampere GA10x pro SKU efficiency.
    e.setdefault("turing", e["volta"])
    e.setdefault("ada", e["ampere-ga10x"])
    return e, {a: statistics.median(v) for a, v in energy.items()}


#: Fraction of the datasheet dense 16-bit peak (Pascal: FP32 peak) a large
#: GEMM reaches on a class when not power-capped (fitted, see ``_fit``).
#: GeForce classes exceed 1: their cards boost above the datasheet clock.
ARCH_EFFICIENCY: dict[str, float]
#: Joules per 16-bit tensor FLOP of a power-capped class: sustained FLOP/s
#: = TDP / this (fitted, see ``_fit``).
ENERGY_J_PER_FLOP: dict[str, float]
ARCH_EFFICIENCY, ENERGY_J_PER_FLOP = _fit()


def _fit_stream() -> float:
    """Median measured copy bandwidth / datasheet bandwidth over the ``fit``
    rows of ``BANDWIDTH_POINTS``."""
    from ..cluster import gpu_spec
    return statistics.median(p.gbps * 1e9 / gpu_spec(p.gpu).mem_bw_bytes_per_s
                             for p in BANDWIDTH_POINTS if p.role == "fit")


#: Fraction of datasheet memory bandwidth a streaming kernel (a large copy)
#: reaches (fitted, ``_fit_stream``): the class model's bandwidth for fused
#: elementwise chains, weight reads and gradient accumulation.
STREAM_EFFICIENCY: float = _fit_stream()


def fit_unfused_fraction(steps) -> float:
    """The fraction of the eager-minus-fused elementwise price a measured
    step implies, median over ``steps`` (iterable of ``(measured_s,
    fused_s, eager_s)``: a measured step and the class model's price of it
    with fully fused chains, fraction 0, and with every elementwise node its
    own kernel, fraction 1), clipped to [0, 1]. See [Note: unfused fraction].

    Raises:
        ValueError: ``steps`` is empty, or a step has ``eager_s <= fused_s``.
    """
    implied = []
    for measured, fused, eager in steps:
        if eager <= fused:
            raise ValueError(f"eager price {eager} s is not above the fused price {fused} s")
        implied.append((measured - fused) / (eager - fused))
    if not implied:
        raise ValueError("no measured steps to fit")
    return min(1.0, max(0.0, statistics.median(implied)))


#: Fraction of the elementwise traffic and kernels between full chain fusion
#: (0) and one kernel per node (1) that a training step pays: the median
#: fraction implied by the BERT-large rows of ``step_reference_data``
#: (``fit_unfused_fraction`` on the prices ``bench/gpu_layer_accuracy.py``
#: computes; a literal because the fit needs the captured BERT graph,
#: recomputed by ``tests/test_gpu_layer_accuracy.py``). See [Note: unfused
#: fraction].
UNFUSED_FRACTION: float = 0.6375


#: The kernel PyTorch's ``scaled_dot_product_attention`` runs on 16-bit
#: inputs per GPU class: ``{arch: (without attn_mask, with attn_mask)}``.
#: Only classes with a cited rate for that kernel are listed; the others
#: price attention at the matmul rate. See [Note: attention rate].
SDPA_KERNELS: dict[str, tuple[str, str]] = {"hopper": ("cudnn", "cudnn_mask")}


def _fit_attention() -> dict[tuple[str, str], tuple[float, float]]:
    """``{(arch, kernel): (forward, backward)}`` attention rate / sustained
    GEMM rate of the same GPU: per row of ``reference_data.ATTENTION_POINTS``,
    the median over its sequence lengths of ``tflops`` / that GPU's
    ``GEMM_POINTS`` fit row.

    Raises:
        ValueError: a row's GPU has no GEMM fit row, or a (class, kernel)
            has no forward or no backward row.
    """
    gemm = {p.gpu: p.tflops for p in GEMM_POINTS if p.role == "fit"}
    eff: dict[tuple[str, str], dict[str, float]] = {}
    for p in ATTENTION_POINTS:
        if p.gpu not in gemm:
            raise ValueError(f"attention row on {p.gpu} has no GEMM fit row to be relative to")
        arch = reference_peak(p.gpu)[0]
        eff.setdefault((arch, p.kernel), {})[p.direction] = statistics.median(t / gemm[p.gpu] for t in p.tflops)
    for key, d in eff.items():
        if set(d) != {"fwd", "bwd"}:
            raise ValueError(f"{key}: attention rows for both passes needed, got {sorted(d)}")
    return {key: (d["fwd"], d["bwd"]) for key, d in eff.items()}


#: Fused-attention rate / the class's sustained matmul rate ``R``, forward
#: and backward, per ``(arch, kernel)`` (``_fit_attention``: FlashAttention-3
#: paper figures on H100 SXM5, and our masked H100 measurement, over the same
#: GPU's GEMM rate).
ATTENTION_EFFICIENCY: dict[tuple[str, str], tuple[float, float]] = _fit_attention()


def attention_flops_per_s(arch: str | None, matmul_flops_per_s: float, masked: bool) -> tuple[float, float]:
    """``(forward, backward)`` FLOP/s of a 16-bit fused attention node on a
    GPU of class ``arch`` whose sustained 16-bit matmul rate is
    ``matmul_flops_per_s``, with (``masked``) or without an explicit
    ``attn_mask``. FLOPs are counted as in ``roofline.node_costs`` (forward
    ``4*N*H*T*S*D``, halved if causal; backward ``ATTENTION_BWD_FACTOR`` x
    forward). A class without a cited rate (not in ``SDPA_KERNELS``) gets the
    matmul rate both ways. See [Note: attention rate]."""
    kernels = SDPA_KERNELS.get(arch) if arch is not None else None
    if kernels is None:
        return matmul_flops_per_s, matmul_flops_per_s
    fwd, bwd = ATTENTION_EFFICIENCY[(arch, kernels[1] if masked else kernels[0])]
    return fwd * matmul_flops_per_s, bwd * matmul_flops_per_s


def has_class_model(spec: GPUSpec) -> bool:
    """Whether ``spec`` is priced by this model (a table row of a fitted class)."""
    return spec.arch is not None and (spec.arch in ARCH_EFFICIENCY or spec.sustained_fp16_flops_per_s is not None)


def predicted_sustained_fp16(arch: str, peak16: float, tdp_w: float | None) -> float:
    """Class-model sustained 16-bit GEMM FLOP/s (no measurement used)."""
    rate = ARCH_EFFICIENCY[arch] * peak16
    if tdp_w is not None and arch in ENERGY_J_PER_FLOP:
        rate = min(rate, tdp_w / ENERGY_J_PER_FLOP[arch])
    return rate


def sustained_matmul_flops_per_s(spec: GPUSpec, dtype: torch.dtype, fallback_efficiency: float, *,
                                 tf32: bool = False) -> float:
    """Sustained matmul FLOP/s of ``spec`` in ``dtype``: the measured figure,
    else the class model; FP32 (and types outside the fitted classes):
    ``fallback_efficiency`` x the datasheet peak of ``dtype``. FP32 with
    ``tf32`` on a GPU with TF32 tensor cores: the 16-bit rate scaled by the
    datasheet TF32/16-bit peak ratio (module docstring), or
    ``fallback_efficiency`` x the TF32 peak outside the fitted classes."""
    if dtype == torch.float32 and tf32 and spec.tf32_flops_per_s:
        if spec.sustained_fp16_flops_per_s is not None or spec.arch in ARCH_EFFICIENCY:
            return (sustained_matmul_flops_per_s(spec, torch.float16, fallback_efficiency)
                    * spec.tf32_flops_per_s / spec.fp16_flops_per_s)
        return spec.tf32_flops_per_s * fallback_efficiency
    if dtype in (torch.float16, torch.bfloat16):
        spec.peak_flops_per_s(dtype)  # raises for bf16 on a GPU without it
        if spec.sustained_fp16_flops_per_s is not None:
            return spec.sustained_fp16_flops_per_s
        if spec.arch in ARCH_EFFICIENCY:
            peak = spec.fp32_flops_per_s if spec.arch == "pascal" else spec.fp16_flops_per_s
            return predicted_sustained_fp16(spec.arch, peak, spec.tdp_w)
    return spec.peak_flops_per_s(dtype) * fallback_efficiency
