"""Datasheet numbers of the GPU types zorse_fx knows, and how to look them up.

The table lives in ``gpu_specs.csv`` next to this module, one row per concrete
GPU type (memory variants are separate rows: ``V100-16GB``, ``V100-32GB``).
Its columns carry their units in their names:

==================== ==========================================================
``type``             canonical key (``A100-40GB``, ``T4``, ``H100-80GB`` ...)
``aliases``          ``;``-separated other names (``H100;H100-SXM``); matched
                     case-insensitively, ``_``/space/``-`` interchangeable, a
                     leading ``NVIDIA`` ignored (so ``torch.cuda.get_device_name``
                     strings such as ``NVIDIA A100-SXM4-40GB`` resolve)
``memory_GiB``       device memory, GiB (2**30 bytes)
``mem_bw_GBps``      peak memory bandwidth, GB/s (1e9 bytes/s)
``fp32_tflops``      peak FP32 (non-tensor) TFLOP/s (1e12 FLOP/s)
``fp16_tensor_tflops`` peak *dense* FP16/BF16 tensor-core TFLOP/s with FP32
                     accumulate (no sparsity). Fallback where a GPU has no
                     tensor cores (P100): the non-tensor packed FP16 peak; where
                     no datasheet exists (A10G): a measured peak. The
                     ``source_note`` of such rows says so.
``bf16_supported``   ``yes``/``no``
``tdp_w``            board power limit, W (datasheet TDP / max power; the
                     sustained-rate model of ``zorse_fx.cost.gpu_model`` caps
                     matmul throughput at ``tdp_w`` / energy per FLOP)
``arch``             GPU class: ``pascal``, ``volta``, ``turing``,
                     ``ampere-ga100``, ``ampere-ga10x``, ``ampere-ga10x-geforce``,
                     ``ada``, ``ada-geforce``, ``hopper``, ``blackwell``,
                     ``cdna2``, ``cdna3`` (die family: selects the sustained
                     efficiency of ``zorse_fx.cost.gpu_model``)
``tf32_tensor_tflops`` dense TF32 tensor TFLOP/s (empty: no TF32, pre-Ampere,
                     or not in the reference table); copied from the reference
                     table's ``tf32_tensor_dense_tflops`` (datasheets)
``boost_clock_mhz``  datasheet boost clock, MHz (empty where not retrieved)
``base_clock_mhz``   datasheet base clock, MHz: the clock guaranteed at the
                     power limit (empty where not retrieved)
``sustained_fp16_tflops`` MEASURED 16-bit (FP32 accumulate) ``torch.matmul``
                     TFLOP/s of a large square GEMM run for seconds, i.e. at the
                     clock the card sustains under its power limit (empty:
                     no public measurement found; the class model predicts it)
``sustained_source`` where the sustained figure and the clocks come from
``source_url``       where the numbers come from
``source_note``      how they were read (dense vs sparse, measured, ...)
==================== ==========================================================

The rows are a trimmed copy of the project's reference table
(``reference/gpu_specs.csv``); GPUs whose peaks the reference leaves
unverified (GH200 tensor peaks, H100 NVL FP32) are left out rather than
guessed. A GPU that is not in the table is an error, never a nearest match:
declare it in the cluster file's ``gpu_types:`` section instead (see
``zorse_fx.cluster.cluster``).
"""

from __future__ import annotations

import csv
import difflib
import functools
import importlib.resources
import io
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from zorse_fx.errors import ClusterConfigError

if TYPE_CHECKING:  # torch is not imported at run time: parsing a cluster stays fast
    import torch

__all__ = ["GPUSpec", "gpu_spec", "known_gpu_types", "known_archs", "normalize_gpu_name", "GPU_TYPES_HELP"]

_GiB = 2**30

#: How to declare a GPU type the table lacks (quoted by every "unknown type" error).
GPU_TYPES_HELP = (
    "to add a GPU type, declare it in the cluster YAML: "
    "gpu_types: {MyGPU: {memory_GiB: 32, mem_bw_GBps: 900, fp32_tflops: 15, "
    "fp16_tensor_tflops: 120, bf16_supported: false, source: \"<datasheet URL>\"}} "
    "(optional: arch: volta, tdp_w: 250, tf32_tensor_tflops: 156 -- arch prices it by that class's model)"
)

# dtype spellings accepted by ``GPUSpec.peak_flops_per_s`` -> "fp32" / "fp16" / "bf16".
_DTYPE_KIND = {
    "float32": "fp32", "fp32": "fp32", "float": "fp32",
    "float16": "fp16", "fp16": "fp16", "half": "fp16",
    "bfloat16": "bf16", "bf16": "bf16",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class GPUSpec:
    """Peak numbers of one GPU type, in SI units.

    Built from a row of ``gpu_specs.csv`` (``source`` = its URL and note) or
    from a ``gpu_types:`` entry of a cluster file (``source`` as given there).
    """

    #: Canonical type key, e.g. ``"A100-40GB"``.
    type: str
    #: Device memory in bytes (datasheet ``memory_GiB`` * 2**30).
    memory_bytes: int
    #: Peak memory bandwidth in bytes/s (datasheet GB/s * 1e9).
    mem_bw_bytes_per_s: float
    #: Peak FP32 (CUDA-core, non-tensor) FLOP/s.
    fp32_flops_per_s: float
    #: Peak dense FP16/BF16 tensor-core FLOP/s with FP32 accumulate. Fallbacks:
    #: no tensor cores -> non-tensor packed FP16 peak; no datasheet -> measured
    #: peak (see ``source``).
    fp16_flops_per_s: float
    #: Whether the GPU computes in bfloat16 natively (Ampere and later).
    bf16_supported: bool
    #: Where the numbers come from (URL(s), plus how they were read).
    source: str
    #: GPU class (die family) for the sustained-rate model (``gpu_specs.csv``
    #: ``arch``); None for a cluster-declared type: the plain roofline prices it.
    arch: str | None = None
    #: Board power limit, W (None: unknown).
    tdp_w: float | None = None
    #: Dense TF32 tensor FLOP/s (None: no TF32 or not published).
    tf32_flops_per_s: float | None = None
    #: Datasheet boost / base clocks, MHz (None: not retrieved).
    boost_clock_mhz: float | None = None
    base_clock_mhz: float | None = None
    #: Measured sustained 16-bit matmul FLOP/s of a large GEMM (None: not measured).
    sustained_fp16_flops_per_s: float | None = None

    def __post_init__(self) -> None:
        if not self.type:
            raise ClusterConfigError("GPUSpec.type must be a non-empty string")
        if isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, int) or self.memory_bytes <= 0:
            raise ClusterConfigError(
                f"GPUSpec {self.type!r}: memory_bytes must be a positive int, got {self.memory_bytes!r}"
            )
        for name in ("mem_bw_bytes_per_s", "fp32_flops_per_s", "fp16_flops_per_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ClusterConfigError(f"GPUSpec {self.type!r}: {name} must be > 0, got {value!r}")

    def peak_flops_per_s(self, dtype: torch.dtype | str, *, tf32: bool = False) -> float:
        """Peak FLOP/s for matmuls in ``dtype``.

        ``torch.float32``/``"fp32"`` -> ``fp32_flops_per_s``, or with ``tf32``
        on a GPU with TF32 tensor cores ``tf32_flops_per_s`` (datasheet, dense);
        ``torch.float16``/``torch.bfloat16`` (or ``"fp16"``/``"bf16"``) ->
        ``fp16_flops_per_s``. Raises ``ValueError`` for bf16 on a GPU without
        bf16 support and for any other dtype.
        """
        name = str(dtype).lower().removeprefix("torch.")
        kind = _DTYPE_KIND.get(name)
        if kind is None:
            raise ValueError(
                f"no peak FLOP/s for dtype {dtype!r} on {self.type}; "
                f"supported: torch.float32, torch.float16, torch.bfloat16"
            )
        if kind == "fp32":
            return self.tf32_flops_per_s if tf32 and self.tf32_flops_per_s else self.fp32_flops_per_s
        if kind == "bf16" and not self.bf16_supported:
            raise ValueError(
                f"{self.type} does not support bfloat16 (pre-Ampere); train in float16 "
                f"with a loss scaler or in float32 on this GPU"
            )
        return self.fp16_flops_per_s


def normalize_gpu_name(name: str) -> str:
    """The lookup key of a GPU name: lower case, ``_``/spaces -> ``-``, no
    leading ``nvidia-`` (``"NVIDIA A100_SXM4 40GB"`` -> ``"a100-sxm4-40gb"``)."""
    key = re.sub(r"[\s_\-]+", "-", name.strip().lower()).strip("-")
    return key.removeprefix("nvidia-")


def _parse_bool(text: str, where: str) -> bool:
    value = text.strip().lower()
    if value in ("yes", "true"):
        return True
    if value in ("no", "false"):
        return False
    raise AssertionError(f"gpu_specs.csv {where}: bf16_supported must be yes/no, got {text!r}")


def _opt_float(text: str, scale: float = 1.0) -> float | None:
    """``float(text) * scale``, None for an empty cell; a range ``300-350`` reads as its upper end."""
    text = text.strip()
    if not text:
        return None
    return float(text.split("-")[-1]) * scale


@functools.cache
def _table() -> tuple[dict[str, GPUSpec], dict[str, str]]:
    """``({type: GPUSpec}, {normalized name or alias: type})`` from the CSV, loaded once."""
    text = importlib.resources.files("zorse_fx.cluster").joinpath("gpu_specs.csv").read_text("utf-8")
    specs: dict[str, GPUSpec] = {}
    lookup: dict[str, str] = {}
    for row_no, row in enumerate(csv.DictReader(io.StringIO(text)), start=2):
        where = f"row {row_no} ({row['type']})"
        note = row["source_note"].strip()
        spec = GPUSpec(
            type=row["type"],
            memory_bytes=round(float(row["memory_GiB"]) * _GiB),
            mem_bw_bytes_per_s=float(row["mem_bw_GBps"]) * 1e9,
            fp32_flops_per_s=float(row["fp32_tflops"]) * 1e12,
            fp16_flops_per_s=float(row["fp16_tensor_tflops"]) * 1e12,
            bf16_supported=_parse_bool(row["bf16_supported"], where),
            source=f"{row['source_url'].strip()} ({note})" if note else row["source_url"].strip(),
            arch=row["arch"].strip() or None,
            tdp_w=_opt_float(row["tdp_w"]),
            tf32_flops_per_s=_opt_float(row["tf32_tensor_tflops"], 1e12),
            boost_clock_mhz=_opt_float(row["boost_clock_mhz"]),
            base_clock_mhz=_opt_float(row["base_clock_mhz"]),
            sustained_fp16_flops_per_s=_opt_float(row["sustained_fp16_tflops"], 1e12),
        )
        specs[spec.type] = spec
        names = [spec.type, *(a for a in row["aliases"].split(";") if a.strip())]
        for alias in names:
            key = normalize_gpu_name(alias)
            # Internal invariant of the shipped table: no name means two GPUs.
            assert lookup.get(key, spec.type) == spec.type, f"gpu_specs.csv: {alias!r} is ambiguous"
            lookup[key] = spec.type
    return specs, lookup


def known_archs() -> tuple[str, ...]:
    """The architecture classes of the table's rows (its ``arch`` column), sorted:
    what a cluster file's declared ``gpu_types.<T>.arch`` may name."""
    return tuple(sorted({s.arch for s in _table()[0].values() if s.arch}))


def known_gpu_types() -> tuple[str, ...]:
    """Canonical keys of the built-in table, in table order."""
    return tuple(_table()[0])


def lookup_builtin(name: str) -> GPUSpec | None:
    """The built-in spec ``name`` (or an alias) resolves to, ``None`` if none."""
    specs, lookup = _table()
    canonical = lookup.get(normalize_gpu_name(str(name)))
    return None if canonical is None else specs[canonical]


def suggest_gpu_types(name: str, extra: tuple[str, ...] = ()) -> list[str]:
    """Canonical types a mistyped ``name`` probably meant (prefix and fuzzy matches)."""
    _, lookup = _table()
    candidates = dict(lookup)
    candidates.update({normalize_gpu_name(t): t for t in extra})
    key = normalize_gpu_name(str(name))
    found = [t for k, t in candidates.items() if key and k.startswith(key)]
    if not found:
        found = [candidates[k] for k in difflib.get_close_matches(key, candidates, n=3, cutoff=0.75)]
    return list(dict.fromkeys(found))


def unknown_gpu_message(name: object, extra: tuple[str, ...] = ()) -> str:
    """The explanation shared by every "unknown GPU type" error."""
    hint = suggest_gpu_types(str(name), extra)
    did_you_mean = f"did you mean {', '.join(hint)}? " if hint else ""
    known = ", ".join((*known_gpu_types(), *extra))
    return f"unknown GPU type {name!r}; {did_you_mean}known types: {known}; {GPU_TYPES_HELP}"


def gpu_spec(name: str) -> GPUSpec:
    """The built-in ``GPUSpec`` of ``name`` (canonical key or alias).

    Raises ``ClusterConfigError`` for a type the table does not hold; the
    message lists the known types and how to declare a new one.
    """
    spec = lookup_builtin(name)
    if spec is None:
        raise ClusterConfigError(unknown_gpu_message(name))
    return spec
