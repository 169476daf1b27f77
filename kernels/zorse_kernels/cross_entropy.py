"""Fused cross-entropy over a vocabulary, loss and gradient, blocked over the vocab.

Shapes (legend: R rows = tokens, V vocabulary size)::

    logits (R, V) float, targets (R,) int64  ->  loss (scalar, mean over non-ignored rows)
    dlogits (R, V) = (softmax(logits) - onehot(targets)) * grad_output / n_valid

as ``F.cross_entropy(logits, targets)`` (``reduction="mean"``, ``ignore_index=-100``:
ignored rows have loss 0 and zero gradient, and ``n_valid`` counts the others).
Targets must lie in ``[0, V)`` or equal ``ignore_index`` (not checked: that would
synchronise the GPU).

One program per row. Pass 1 walks the row in ``BLOCK_V`` chunks keeping a running
max ``m`` and running sum ``s = sum exp(x - m)`` (the online softmax normaliser of
Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"), so any V
works with a fixed block (V = 50k-128k on a GPU): ``lse = m + log(s)`` and
``loss_row = lse - x[target]``. Pass 2 (only when the gradient is asked for, in the
same kernel) re-reads the row and writes ``(exp(x - lse) - onehot) * scale``.
Statistics in float32; dlogits in the logits dtype.

Cost (forward): ``flops = 4*R*V`` (max, subtract, exp, add per logit; per-row log
and the target gather are not counted); ``bytes = R*V*itemsize + 8*R + 4*R``
(logits and int64 targets read, float32 per-row losses written).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .registry import KernelOp, generator, randn

__all__ = ["cross_entropy", "cross_entropy_rows", "cross_entropy_with_grad", "cross_entropy_backward", "OPS"]

IGNORE_INDEX = -100


@triton.jit
def _ce_kernel(X, TGT, LOSS, DX, SCALE, V, s_x, s_dx, ignore_index,
               COMPUTE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * s_x
    cols0 = tl.arange(0, BLOCK_V)
    m = tl.zeros((), tl.float32) - float("inf")
    s = tl.zeros((), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + cols0
        x = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))  # finite from the first block on (V >= 1)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    t = tl.load(TGT + row)
    valid = t != ignore_index
    x_t = tl.load(x_row + tl.where(valid, t, 0)).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, lse - x_t, 0.0))
    if COMPUTE_GRAD:
        scale = tl.where(valid, tl.load(SCALE), 0.0)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + cols0
            x = tl.load(x_row + cols, mask=cols < V, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) - tl.where(cols == t, 1.0, 0.0)
            tl.store(DX + row * s_dx + cols, (g * scale).to(DX.dtype.element_ty), mask=cols < V)


def _run(logits, targets, scale, ignore_index, block_v):
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy takes logits (R, V) and targets (R,), got {tuple(logits.shape)}, "
                         f"{tuple(targets.shape)}")
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    t = targets.contiguous()
    R, V = x.shape
    bv = block_v or min(4096, triton.next_power_of_2(V))
    loss = torch.empty((R,), dtype=torch.float32, device=x.device)
    dx = torch.empty((R, V), dtype=x.dtype, device=x.device) if scale is not None else None
    if R:
        _ce_kernel[(R,)](x, t, loss, dx if dx is not None else x, scale if scale is not None else loss,
                         V, x.stride(0), V, ignore_index, COMPUTE_GRAD=scale is not None, BLOCK_V=bv,
                         num_warps=8 if bv >= 2048 else 4)
    return loss, dx


def cross_entropy_rows(logits, targets, ignore_index: int = IGNORE_INDEX, block_v: int | None = None):
    """Per-row losses (R,) in float32 (0 for ignored rows)."""
    return _run(logits, targets, None, ignore_index, block_v)[0]


def _n_valid(targets, ignore_index):
    return (targets != ignore_index).sum().to(torch.float32)


def cross_entropy(logits, targets, ignore_index: int = IGNORE_INDEX, block_v: int | None = None):
    """``F.cross_entropy(logits, targets, ignore_index=ignore_index)`` (mean), in the logits dtype."""
    rows = cross_entropy_rows(logits, targets, ignore_index, block_v)
    return (rows.sum() / _n_valid(targets, ignore_index)).to(logits.dtype)


def cross_entropy_with_grad(logits, targets, grad_output=1.0, ignore_index: int = IGNORE_INDEX,
                            block_v: int | None = None):
    """(mean loss, dlogits) in one kernel: the fused forward + backward of a training step."""
    n = _n_valid(targets, ignore_index)
    go = torch.as_tensor(grad_output, dtype=torch.float32, device=logits.device)
    scale = (go / n).reshape(1)
    rows, dx = _run(logits, targets, scale, ignore_index, block_v)
    return (rows.sum() / n).to(logits.dtype), dx


def cross_entropy_backward(logits, targets, grad_output, ignore_index: int = IGNORE_INDEX,
                           block_v: int | None = None):
    """(dlogits,) of :func:`cross_entropy` for a scalar ``grad_output``."""
    return (cross_entropy_with_grad(logits, targets, grad_output, ignore_index, block_v)[1],)


def _inputs(shape, dtype, device):
    g = generator(device)
    R, V = shape["rows"], shape["vocab"]
    logits = randn(g, R, V, dtype=dtype, device=device, scale=2.0)
    targets = torch.randint(0, V, (R,), generator=g, device=torch.device(device), dtype=torch.int64)
    return logits, targets


OPS = (
    KernelOp(
        name="cross_entropy", op_class="cross_entropy", shape_keys=("rows", "vocab"),
        make_inputs=_inputs, reference=lambda logits, targets: F.cross_entropy(logits, targets),
        triton_forward=cross_entropy, triton_backward=cross_entropy_backward,
        flops=lambda s: 4 * s["rows"] * s["vocab"],
        bytes_moved=lambda s, dt: s["rows"] * s["vocab"] * dt.itemsize + 12 * s["rows"],
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        # one ragged block; two blocks of 4096 (online max/sum across blocks)
        test_shapes=({"rows": 6, "vocab": 1000}, {"rows": 4, "vocab": 5000}),
        # GPT-2 (50257), Llama-2 (32000), SmolLM2 (49152), Llama-3 (128256) vocabularies, 8192 tokens
        standard_shapes=tuple({"rows": 8192, "vocab": v} for v in (32000, 49152, 50257, 128256)),
    ),
)
