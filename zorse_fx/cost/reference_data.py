"""Public measurements the GPU cost model (``gpu_model.py``) is fitted to and checked on.

Every row is one published measurement of a large 16-bit ``torch.matmul``
(FP16 inputs, FP32 accumulate: PyTorch's default cuBLAS compute type) on one
GPU, in TFLOP/s (1e12 FLOP/s, ``2*M*N*K / time``). Rule for which number of a
report is taken: the 8192^3 entry where the report lists sizes (the longest
kernels of the run, so the clock the card sustains under its power limit);
the report's best size where it gives only one number (noted). ``role``:
``fit`` rows set a constant of ``gpu_model`` (which one is named in
``fits``), ``holdout`` rows are never used to set anything and only score the
class model (``bench/gpu_roofline_accuracy.py``).

``ATTENTION_POINTS`` (at the end) are fused-attention rates (FlashAttention-2
and cuDNN kernels on H100 SXM5, forward and backward: published; cuDNN with an
explicit mask: our own H100 measurement, ``bench/results/gpu_h100.json``), all
``fit`` data for ``gpu_model.ATTENTION_EFFICIENCY``; our own H200 measurement
scores them (``bench/gpu_class_check.py``).

Peaks of held-out GPUs that are not rows of ``gpu_specs.csv`` are given here
with their datasheet source. No public per-layer forward/backward timings of
Llama decoder layers on these GPU types were found (see bench/README.md);
published whole-model training steps (BERT-large/base on 10 GPU types) check the
model above the GEMM level: ``step_reference_data.py``, scored by
``bench/gpu_layer_accuracy.py``, never fitted.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GemmPoint", "GEMM_POINTS", "HELDOUT_PEAKS", "BandwidthPoint", "BANDWIDTH_POINTS", "AttentionPoint",
           "ATTENTION_POINTS"]

_Z = "https://github.com/zzc0721/torch-performance-test-data"


@dataclass(frozen=True, slots=True)
class GemmPoint:
    """One measured large 16-bit GEMM rate."""

    #: ``gpu_specs.csv`` type, or a key of ``HELDOUT_PEAKS``.
    gpu: str
    #: Measured TFLOP/s.
    tflops: float
    #: ``"fit"`` or ``"holdout"``.
    role: str
    #: The ``gpu_model`` constant a fit row sets (``"efficiency:<arch>"`` or
    #: ``"energy:<arch>"``); empty for held-out rows.
    fits: str
    #: Where it was published, and which entry was read.
    source: str


GEMM_POINTS: tuple[GemmPoint, ...] = (
    # -- fit: unthrottled efficiency of each class (measured / datasheet dense 16-bit peak)
    GemmPoint("P100-16GB", 7.29, "fit", "efficiency:pascal",
              f"{_Z}/issues/180 (Tesla P100-SXM2-16GB, FP16 8192^3; no tensor cores: "
              "FP16 with FP32 accumulate runs at the FP32 rate, so the ratio is to the FP32 peak)"),
    GemmPoint("V100-16GB", 97.36, "fit", "efficiency:volta", f"{_Z}/issues/140 (Tesla V100-SXM2-16GB, FP16 8192^3)"),
    GemmPoint("A100-80GB", 258.74, "fit", "efficiency:ampere-ga100",
              f"{_Z}/blob/main/database.md (NVIDIA A100 SXM4 80GB, FP16, best of 1024..10240)"),
    GemmPoint("RTX-A6000", 120.49, "fit", "efficiency:ampere-ga10x",
              f"{_Z}/issues/46 (NVIDIA RTX A6000, FP16, best of 1024..10240)"),
    GemmPoint("RTX-3090", 75.64, "fit", "efficiency:ampere-ga10x-geforce",
              f"{_Z}/blob/main/database.md (NVIDIA RTX 3090 24GB bare metal, FP16, best of 1024..10240)"),
    GemmPoint("RTX-4090", 165.08, "fit", "efficiency:ada-geforce",
              f"{_Z}/blob/main/database.md (NVIDIA RTX 4090 24GB bare metal, FP16, best of 1024..10240)"),
    GemmPoint("H100-80GB", 736.19, "fit", "efficiency:hopper", f"{_Z}/issues/79 (NVIDIA H100 80GB HBM3, FP16 8192^3)"),
    # -- fit: energy per FLOP of power-capped cards (TDP / measured rate)
    GemmPoint("T4", 24.0, "fit", "energy:turing",
              "https://forums.developer.nvidia.com/t/about-gpu-peak-performance/264462 "
              "(cuBLAS FP16 4096^3, mean of 100 iterations: ~24 TFLOP/s; NVIDIA: power capping at ~70 W)"),
    GemmPoint("RTX-A2000", 28.41, "fit", "energy:ampere-ga10x",
              f"{_Z}/issues/72 (NVIDIA RTX A2000 12GB, FP16 8192^3)"),
    GemmPoint("L4", 53.80, "fit", "energy:ada", f"{_Z}/issues/120 (NVIDIA L4, FP16 8192^3)"),
    GemmPoint("A100-PCIE-40GB", 197.51, "fit", "energy:ampere-ga100",
              f"{_Z}/issues/108 (NVIDIA A100-PCIE-40GB, FP16 8192^3)"),
    GemmPoint("H100-PCIE", 437.07, "fit", "energy:hopper", f"{_Z}/issues/95 (NVIDIA H100 PCIe, FP16 8192^3)"),
    # -- held out
    GemmPoint("A40", 108.47, "holdout", "", f"{_Z}/issues/185 (NVIDIA A40, FP16 8192^3)"),
    GemmPoint("A10G", 65.67, "holdout", "", f"{_Z}/issues/126 (NVIDIA A10G, FP16 8192^3)"),
    GemmPoint("P100-PCIE-16GB", 7.72, "holdout", "", f"{_Z}/issues/174 (Tesla P100-PCIE-16GB, FP16 8192^3)"),
    GemmPoint("V100S-PCIE-32GB", 88.92, "holdout", "",
              f"{_Z}/blob/main/database.md (NVIDIA Tesla V100S 32GB, FP16, best of 1024..10240)"),
    GemmPoint("RTX-3080", 63.94, "holdout", "", f"{_Z}/issues/114 (NVIDIA GeForce RTX 3080 10GB, FP16 8192^3)"),
    GemmPoint("A10", 54.0, "holdout", "",
              "https://github.com/chsasank/device-benchmarks (README table 'Nvidia A10 24GB', FP16 54 TFLOP/s: "
              "best of single torch.matmul calls up to 6888^3, so an upper bound on the sustained rate)"),
    GemmPoint("A100-40GB", 247.63, "holdout", "",
              f"{_Z}/blob/main/database.md (NVIDIA A100 40GB, FP16, best of 1024..10240; form factor not stated)"),
)

#: Datasheet figures of held-out GPUs that are not rows of ``gpu_specs.csv``:
#: ``{gpu: (arch, dense 16-bit FP32-accumulate TFLOP/s, FP32 TFLOP/s, TDP W, source)}``.
HELDOUT_PEAKS: dict[str, tuple[str, float, float, float, str]] = {
    "P100-PCIE-16GB": ("pascal", 18.7, 9.3, 250.0,
                       "https://www.tomshardware.com/news/nvidia-tesla-p100-pcie-gpu,32119.html "
                       "(reference/gpu_specs.csv row 'P100 PCIe 16GB': FP32 9.3, non-tensor FP16 18.7, 250 W)"),
    "V100S-PCIE-32GB": ("volta", 130.0, 16.4, 250.0,
                        "https://yobitel.com/knowledge-base/nvidia-v100 (reference/gpu_specs.csv note: "
                        "V100S PCIe 130 TF tensor; 250 W as V100 PCIe; FP32 16.4 not used by the model)"),
    "RTX-3080": ("ampere-ga10x-geforce", 59.5, 29.8, 320.0,
                 "https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf "
                 "(GA102 whitepaper, RTX 3080 column: FP16 tensor with FP32 accumulate 59.5 dense, 320 W)"),
    "RTX-A2000": ("ampere-ga10x", 31.95, 8.0, 70.0,
                  "https://www.nvidia.com/content/dam/en-zz/Solutions/design-visualization/rtx-a2000/"
                  "nvidia-rtx-a2000-datasheet.pdf (RTX A2000: tensor performance 63.9 TFLOP/s is the "
                  "with-sparsity figure, dense = 31.95; 70 W max power; used for its 70 W energy-per-FLOP fit)"),
}


_CHS = "https://github.com/chsasank/device-benchmarks"


@dataclass(frozen=True, slots=True)
class BandwidthPoint:
    """One measured device-memory copy bandwidth (``a.copy_(b)`` of a 0.38 GB
    float32 tensor, read + write counted: ``benchmark.py`` of the source)."""

    #: ``gpu_specs.csv`` type (its datasheet ``mem_bw_GBps`` is the reference).
    gpu: str
    #: Measured GB/s (1e9 bytes/s).
    gbps: float
    #: ``"fit"`` or ``"holdout"``.
    role: str
    source: str


BANDWIDTH_POINTS: tuple[BandwidthPoint, ...] = (
    BandwidthPoint("T4", 240.0, "fit", f"{_CHS} (README table, Nvidia T4: 240 GB/s)"),
    BandwidthPoint("A10", 469.0, "fit", f"{_CHS} (README table, Nvidia A10 24GB: 469 GB/s)"),
    BandwidthPoint("A100-80GB", 1490.0, "fit",
                   f"{_CHS} (README table, Nvidia A100 80GB: 1490 GB/s; form factor not stated, SXM4 assumed)"),
    BandwidthPoint("RTX-3090", 831.0, "fit", f"{_CHS} (README table, Nvidia 3090: 831 GB/s)"),
    BandwidthPoint("V100-32GB", 766.0, "holdout", f"{_CHS} (README table, Nvidia V100 32GB: 766 GB/s)"),
    BandwidthPoint("RTX-4090", 912.0, "holdout", f"{_CHS} (README table, Nvidia 4090: 912 GB/s)"),
)


_FA3 = "https://arxiv.org/abs/2407.08608"


@dataclass(frozen=True, slots=True)
class AttentionPoint:
    """One published (or, where ``source`` is a file of this repository, our
    own measured) fused-attention throughput sweep: one kernel, one pass,
    16-bit inputs, on one GPU, in TFLOP/s per sequence length. FLOPs are
    FlashAttention's count (forward ``4 * batch * heads * seq^2 * head_dim``
    without a causal mask; backward 2.5x that, ``gpu_model.ATTENTION_BWD_FACTOR``),
    so ``flops / tflops`` is the kernel's time under either count."""

    #: ``gpu_specs.csv`` type; its ``GEMM_POINTS`` fit row is the same GPU's
    #: sustained matmul rate the attention rate is taken relative to.
    gpu: str
    #: ``"flash2"`` (FlashAttention-2: the kernel of PyTorch SDPA's flash
    #: backend), ``"cudnn"`` (cuDNN's fused attention: SDPA's cuDNN backend)
    #: or ``"cudnn_mask"`` (the cuDNN backend given an explicit boolean
    #: ``attn_mask``: it computes every query-key block and applies the mask).
    kernel: str
    #: ``"fwd"`` or ``"bwd"``.
    direction: str
    head_dim: int
    causal: bool
    #: Sequence lengths of the sweep (batch x seq = 16k tokens, hidden 2048).
    seq_lens: tuple[int, ...]
    #: TFLOP/s at each of ``seq_lens``.
    tflops: tuple[float, ...]
    #: Where it was published, and which figure was read.
    source: str


_SEQ = (512, 1024, 2048, 4096, 8192, 16384)

#: H100 SXM5 figures of the FlashAttention-3 paper (Shah, Bikshandi, Zhang,
#: Thakkar, Ramani, Dao 2024, "FlashAttention-3: Fast and Accurate Attention
#: with Asynchrony and Low-precision", NeurIPS 2024): FP16, head dim 128, no
#: causal mask, the bar labels of Figure 5 (forward) and Figure 6 (backward),
#: as read from public transcriptions of those figures, not yet checked against
#: the PDF (one transcription swaps the cuDNN and FlashAttention-3 bars at seq 512
#: of Figure 5, 497 vs 467; the median used does not depend on that bar),
#: FlashAttention-2 and cuDNN bars (the FlashAttention-3 kernel is not what
#: PyTorch's SDPA runs, so its bars are not used). No per-pass figure at head dim 128 was found for other GPU classes: the
#: FlashAttention-2 paper (Dao 2023, arXiv 2307.08691) gives A100 per-pass
#: figures only as plots and, in its abstract, a range (50-73% of the
#: theoretical maximum), not a single rate per pass.
ATTENTION_POINTS: tuple[AttentionPoint, ...] = (
    AttentionPoint("H100-80GB", "flash2", "fwd", 128, False, _SEQ, (309.0, 350.0, 362.0, 368.0, 370.0, 370.0),
                   f"{_FA3} (Figure 5, forward, without causal mask, head dim 128, H100 80GB SXM5: "
                   "FlashAttention-2 bars)"),
    AttentionPoint("H100-80GB", "cudnn", "fwd", 128, False, _SEQ, (497.0, 574.0, 617.0, 609.0, 600.0, 595.0),
                   f"{_FA3} (Figure 5, forward, without causal mask, head dim 128, H100 80GB SXM5: cuDNN bars)"),
    AttentionPoint("H100-80GB", "flash2", "bwd", 128, False, _SEQ, (214.0, 260.0, 291.0, 310.0, 318.0, 322.0),
                   f"{_FA3} (Figure 6, backward, without causal mask, head dim 128, H100 80GB SXM5: "
                   "FlashAttention-2 bars)"),
    AttentionPoint("H100-80GB", "cudnn", "bwd", 128, False, _SEQ, (305.0, 408.0, 465.0, 499.0, 518.0, 516.0),
                   f"{_FA3} (Figure 6, backward, without causal mask, head dim 128, H100 80GB SXM5: cuDNN bars)"),
    # Our own measurement (not published): PyTorch 2.11 SDPA on one H100 80GB HBM3 (SXM), bfloat16,
    # 32 heads x head dim 128, micro-batch 4 (2k-16k tokens), an explicit lower-triangular boolean mask
    # (what the export-captured Hugging Face Llama passes), cuDNN's sm90 kernels by name; FLOPs counted
    # without the causal halving (the kernel computes every block), backward = fwd+bwd - fwd.
    AttentionPoint("H100-80GB", "cudnn_mask", "fwd", 128, True, (512, 2048, 4096), (221.2, 336.7, 333.4),
                   "bench/results/gpu_h100.json (attention, variant sdpa_mask, micro_batch 4; "
                   "bench/README.md 'One H100 measured')"),
    AttentionPoint("H100-80GB", "cudnn_mask", "bwd", 128, True, (512, 2048, 4096), (142.5, 256.8, 291.0),
                   "bench/results/gpu_h100.json (attention, variant sdpa_mask, micro_batch 4; "
                   "bench/README.md 'One H100 measured')"),
)
