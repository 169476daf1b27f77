"""Fused LayerNorm and RMSNorm over the last dimension, forward and backward.

Shapes (legend: R rows = tokens, C cols = hidden size)::

    x (R, C), weight (C,), bias (C,) [LayerNorm only]  ->  y (R, C)

Formulas (statistics in float32, per row, ``n = C``)::

    LayerNorm (Ba et al. 2016):  mu = sum(x)/n,  rstd = 1/sqrt(sum((x-mu)^2)/n + eps),
                                 xhat = (x-mu)*rstd,  y = xhat*w + b
    RMSNorm (Zhang & Sennrich 2019): rstd = 1/sqrt(sum(x^2)/n + eps),  xhat = x*rstd,  y = xhat*w

Backward, with ``g = w*dy`` (row-wise means ``mean()`` over the C columns)::

    LayerNorm: dx = rstd * (g - xhat*mean(g*xhat) - mean(g))
    RMSNorm:   dx = rstd * (g - xhat*mean(g*xhat))
    dw = sum_rows(dy*xhat),  db = sum_rows(dy)

Forward: one program per row, the whole row in one block (``BLOCK`` = C rounded up
to a power of two). Backward: ``P`` programs each loop over rows ``p, p+P, ...``,
write dx and keep their share of dw/db in registers; a second kernel sums the
``P`` partial rows (deterministic, no atomics).

Cost (forward): LayerNorm ``flops = 7*R*C`` (per element: 1 add for the mean, 1 sub,
1 mul + 1 add for the variance, 1 mul by rstd, 1 mul + 1 add for the affine map);
RMSNorm ``flops = 4*R*C`` (1 mul + 1 add for the mean square, 1 mul by rstd,
1 mul by w); per-row sqrt/division are not counted.
``bytes = (2*R*C + k*C) * itemsize`` with k = 2 parameters (w, b) for LayerNorm and 1 for RMSNorm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .registry import KernelOp, generator, randn

__all__ = ["layer_norm", "rms_norm", "norm_backward", "LN_EPS", "RMS_EPS", "OPS"]

LN_EPS = 1e-5
RMS_EPS = 1e-6


@triton.jit
def _norm_fwd_kernel(X, W, B, Y, C, s_x, s_y, eps,
                     RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < C
    x = tl.load(X + row * s_x + cols, mask=m, other=0.0).to(tl.float32)
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, 0) / C
        xc = tl.where(m, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 0) / C + eps)
    w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
    y = xc * rstd * w
    if HAS_BIAS:
        y += tl.load(B + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(Y + row * s_y + cols, y.to(Y.dtype.element_ty), mask=m)


@triton.jit
def _norm_bwd_kernel(X, W, DY, DX, DWP, DBP, R, C, s_x, s_dy, s_dx, eps,
                     RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    m = cols < C
    w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    for r in range(pid, R, P):
        row = tl.cast(r, tl.int64)
        x = tl.load(X + row * s_x + cols, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * s_dy + cols, mask=m, other=0.0).to(tl.float32)
        if RMS:
            xc = x
        else:
            xc = tl.where(m, x - tl.sum(x, 0) / C, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 0) / C + eps)
        xhat = xc * rstd
        g = w * dy
        c1 = tl.sum(g * xhat, 0) / C
        if RMS:
            dx = (g - xhat * c1) * rstd
        else:
            dx = (g - xhat * c1 - tl.sum(g, 0) / C) * rstd
        tl.store(DX + row * s_dx + cols, dx.to(DX.dtype.element_ty), mask=m)
        dw += dy * xhat
        if HAS_BIAS:
            db += dy
    tl.store(DWP + pid * C + cols, dw, mask=m)
    if HAS_BIAS:
        tl.store(DBP + pid * C + cols, db, mask=m)


@triton.jit
def _col_sum_kernel(P, OUT, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """OUT[c] = sum_r P[r, c] for a contiguous float32 P (R, C); one program per BLOCK_C columns."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        acc += tl.load(P + rows[:, None] * C + cols[None, :], mask=(rows[:, None] < R) & (cols[None, :] < C), other=0.0)
    tl.store(OUT + cols, tl.sum(acc, 0).to(OUT.dtype.element_ty), mask=cols < C)


def _block(C: int) -> tuple[int, int]:
    block = triton.next_power_of_2(C)
    return block, min(16, max(1, block // 256))  # (BLOCK, num_warps)


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"norm kernels take (rows, cols), got {tuple(x.shape)}")
    return x if x.stride(1) == 1 else x.contiguous()


def _norm_fwd(x, w, b, eps, rms):
    x, w = _rows(x), w.contiguous()
    b = b.contiguous() if b is not None else None
    R, C = x.shape
    y = torch.empty((R, C), dtype=x.dtype, device=x.device)
    block, warps = _block(C)
    _norm_fwd_kernel[(R,)](x, w, b if b is not None else w, y, C, x.stride(0), y.stride(0), eps,
                           RMS=rms, HAS_BIAS=b is not None, BLOCK=block, num_warps=warps)
    return y


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float = LN_EPS) -> torch.Tensor:
    """``F.layer_norm(x, (C,), w, b, eps)`` for x (R, C)."""
    return _norm_fwd(x, w, b, eps, rms=False)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = RMS_EPS) -> torch.Tensor:
    """``F.rms_norm(x, (C,), w, eps)`` for x (R, C)."""
    return _norm_fwd(x, w, None, eps, rms=True)


def _num_partials(R: int, device: torch.device) -> int:
    """Programs of the backward kernel: ~4 per SM on a GPU, 4 in the interpreter (so rows loop there too)."""
    if device.type == "cuda":
        return max(1, min(R, 4 * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(R, 4))


def norm_backward(x, w, b, dy, *, eps: float, rms: bool, partials: int | None = None):
    """(dx, dw, db) of LayerNorm (``rms=False``; db is None when ``b`` is None) or RMSNorm (``rms=True``)."""
    x, dy, w = _rows(x), _rows(dy), w.contiguous()
    R, C = x.shape
    dx = torch.empty((R, C), dtype=x.dtype, device=x.device)
    P = partials or _num_partials(R, x.device)
    has_bias = b is not None
    dwp = torch.empty((P, C), dtype=torch.float32, device=x.device)
    dbp = torch.empty((P, C), dtype=torch.float32, device=x.device) if has_bias else dwp
    block, warps = _block(C)
    _norm_bwd_kernel[(P,)](x, w, dy, dx, dwp, dbp, R, C, x.stride(0), dy.stride(0), dx.stride(0), eps,
                           RMS=rms, HAS_BIAS=has_bias, BLOCK=block, num_warps=warps)
    grads = []
    for p, ref in ((dwp, w), (dbp, b)) if has_bias else ((dwp, w),):
        out = torch.empty((C,), dtype=ref.dtype, device=x.device)
        bc = min(256, triton.next_power_of_2(C))
        _col_sum_kernel[(triton.cdiv(C, bc),)](p, out, P, C, BLOCK_R=16, BLOCK_C=bc)
        grads.append(out)
    return (dx, *grads) if has_bias else (dx, grads[0])


def _ln_inputs(shape, dtype, device):
    g = generator(device)
    R, C = shape["rows"], shape["cols"]
    x = randn(g, R, C, dtype=dtype, device=device)
    w = (1.0 + randn(g, C, dtype=torch.float32, device=device, scale=0.1)).to(dtype)
    b = randn(g, C, dtype=dtype, device=device, scale=0.1)
    return x, w, b


def _rms_inputs(shape, dtype, device):
    return _ln_inputs(shape, dtype, device)[:2]


def _ln_ref(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, LN_EPS)


def _rms_ref(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, RMS_EPS)


def _ln_bwd(x, w, b, dy):
    return norm_backward(x, w, b, dy, eps=LN_EPS, rms=False)


def _rms_bwd(x, w, dy):
    return norm_backward(x, w, None, dy, eps=RMS_EPS, rms=True)


_DT = (torch.float32, torch.float16, torch.bfloat16)
# ragged (100 -> BLOCK 128) and exact (256) rows; 6 rows > 4 interpreter partials -> rows loop
_TEST = ({"rows": 6, "cols": 100}, {"rows": 5, "cols": 256})
_STANDARD = tuple({"rows": 8192, "cols": h} for h in (768, 1024, 2048, 4096, 5120, 8192))

OPS = (
    KernelOp(
        name="layernorm", op_class="norm", shape_keys=("rows", "cols"),
        make_inputs=_ln_inputs, reference=_ln_ref, triton_forward=layer_norm, triton_backward=_ln_bwd,
        flops=lambda s: 7 * s["rows"] * s["cols"],
        bytes_moved=lambda s, dt: (2 * s["rows"] * s["cols"] + 2 * s["cols"]) * dt.itemsize,
        dtypes=_DT, test_shapes=_TEST, standard_shapes=_STANDARD,
    ),
    KernelOp(
        name="rmsnorm", op_class="norm", shape_keys=("rows", "cols"),
        make_inputs=_rms_inputs, reference=_rms_ref, triton_forward=rms_norm, triton_backward=_rms_bwd,
        flops=lambda s: 4 * s["rows"] * s["cols"],
        bytes_moved=lambda s, dt: (2 * s["rows"] * s["cols"] + s["cols"]) * dt.itemsize,
        dtypes=_DT, test_shapes=_TEST, standard_shapes=_STANDARD,
    ),
)
