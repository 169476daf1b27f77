"""Activation functions, forward and backward: GELU (exact and tanh) and SiLU.

Shapes: any contiguous x, treated as a flat vector of ``numel`` elements
(legend: numel = tokens * MLP width); y and dx have the shape and dtype of x.
Math in float32.

Formulas (Phi: standard normal CDF, phi its density, sigma the logistic function)::

    GELU exact (Hendrycks & Gimpel 2016), torch ``approximate="none"``:
        y  = x * Phi(x) = 0.5 * x * (1 + erf(x / sqrt(2)))
        y' = Phi(x) + x * phi(x),          phi(x) = exp(-x^2 / 2) / sqrt(2*pi)
    GELU tanh approximation, torch ``approximate="tanh"``:
        u  = sqrt(2/pi) * (x + 0.044715 x^3),  t = tanh(u),  y = 0.5 * x * (1 + t)
        y' = 0.5 * (1 + t) + 0.5 * x * (1 - t^2) * sqrt(2/pi) * (1 + 3 * 0.044715 x^2)
    SiLU (Elfwing et al. 2018), ``F.silu``:
        y  = x * sigma(x),   y' = sigma(x) * (1 + x * (1 - sigma(x)))

tanh is computed as ``1 - 2 / (exp(2u) + 1)`` with u clamped to [-15, 15] (where
tanh is +-1 in float32), so the kernel needs no libdevice call and exp never overflows.

The registered ``gelu`` op is the exact one (``nn.GELU()``'s default);
:func:`gelu` takes ``approximate="tanh"`` too.

Cost (forward; per element, a transcendental counted as 1): GELU exact
``flops = 5*numel`` (scale, erf, add, 2 mul), GELU tanh ``9*numel`` (x^3: 2 mul,
mul + add, scale, tanh, add, 2 mul), SiLU ``4*numel`` (exp, add, divide, mul);
``bytes = 2*numel*itemsize`` (x read, y written).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .registry import KernelOp, generator, randn

__all__ = ["gelu", "gelu_backward", "silu", "silu_backward", "OPS", "ACTIVATIONS"]

#: Activation codes of the kernels.
ACTIVATIONS = {"gelu": 0, "gelu_tanh": 1, "silu": 2}
_BLOCK = 1024


@triton.jit
def _tanh(u):
    u = tl.minimum(tl.maximum(u, -15.0), 15.0)  # tanh(15) rounds to 1 in float32; no exp overflow
    return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)


@triton.jit
def _act_kernel(X, DY, OUT, n, ACT: tl.constexpr, BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
    if ACT == 0:  # exact GELU
        cdf = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476))
        if BACKWARD:
            y = cdf + x * tl.exp(-0.5 * x * x) * 0.3989422804014327
        else:
            y = x * cdf
    elif ACT == 1:  # tanh GELU
        t = _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))
        if BACKWARD:
            y = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * x * x)
        else:
            y = 0.5 * x * (1.0 + t)
    else:  # SiLU
        s = 1.0 / (1.0 + tl.exp(-x))
        if BACKWARD:
            y = s * (1.0 + x * (1.0 - s))
        else:
            y = x * s
    if BACKWARD:  # y holds f'(x): dx = dy * f'(x)
        y = y * tl.load(DY + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + offs, y.to(OUT.dtype.element_ty), mask=m)


def _launch(x: torch.Tensor, dy: torch.Tensor | None, act: str) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        d = dy.contiguous() if dy is not None else x
        _act_kernel[(triton.cdiv(n, _BLOCK),)](x, d, out, n, ACT=ACTIVATIONS[act], BACKWARD=dy is not None,
                                               BLOCK=_BLOCK, num_warps=4)
    return out


def _act_name(approximate: str) -> str:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return "gelu" if approximate == "none" else "gelu_tanh"


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``F.gelu(x, approximate=approximate)``."""
    return _launch(x, None, _act_name(approximate))


def gelu_backward(x: torch.Tensor, dy: torch.Tensor, approximate: str = "none") -> tuple[torch.Tensor]:
    """(dx,) of :func:`gelu`."""
    return (_launch(x, dy, _act_name(approximate)),)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``F.silu(x)``."""
    return _launch(x, None, "silu")


def silu_backward(x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor]:
    """(dx,) of :func:`silu`."""
    return (_launch(x, dy, "silu"),)


def _inputs(shape, dtype, device):
    return (randn(generator(device), shape["numel"], dtype=dtype, device=device, scale=2.0),)


_DT = (torch.float32, torch.float16, torch.bfloat16)
# 3000 = 2 full blocks + a ragged one
_TEST = ({"numel": 3000},)
# tokens (8192) x MLP width (4h for h = 768, 2048, 4096; 14336 for a Llama-3-8B-style SwiGLU)
_STANDARD = tuple({"numel": 8192 * w} for w in (3072, 8192, 14336, 16384))


def _bytes(s, dt) -> int:
    return 2 * s["numel"] * dt.itemsize


OPS = (
    KernelOp(
        name="gelu", op_class="elementwise", shape_keys=("numel",),
        make_inputs=_inputs, reference=lambda x: F.gelu(x), triton_forward=gelu,
        triton_backward=lambda x, dy: gelu_backward(x, dy),
        flops=lambda s: 5 * s["numel"], bytes_moved=_bytes,
        dtypes=_DT, test_shapes=_TEST, standard_shapes=_STANDARD,
    ),
    KernelOp(
        name="silu", op_class="elementwise", shape_keys=("numel",),
        make_inputs=_inputs, reference=F.silu, triton_forward=silu, triton_backward=silu_backward,
        flops=lambda s: 4 * s["numel"], bytes_moved=_bytes,
        dtypes=_DT, test_shapes=_TEST, standard_shapes=_STANDARD,
    ),
)
