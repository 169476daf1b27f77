"""Tiled matrix multiplication, used as ``F.linear`` forward and backward.

Shapes (legend: M rows of activations = tokens, K input features, N output features)::

    linear:  x (M, K), w (N, K)      ->  y = x @ w^T         (M, N)
    backward: dy (M, N)              ->  dx = dy @ w          (M, K)
                                         dw = dy^T @ x        (N, K)

All three are the same kernel, :func:`matmul` (``c = a @ b`` for 2-D ``a``, ``b`` of
any strides): transposes are strides, never copies. Inputs float32/float16/bfloat16,
accumulation in float32, output in the input dtype. float32 inputs use TF32 tensor
cores exactly when torch does (``torch.backends.cuda.matmul.allow_tf32``), so the
kernel and ``F.linear`` agree to float32 tolerance by default.

Block sizes are fixed functions of the shape (no autotuning, so a profile is
reproducible); tiles are visited in groups of ``GROUP_M`` row-tiles for L2 reuse
(the grouped ordering of the Triton matmul tutorial).

Cost (forward): ``flops = 2*M*N*K`` (one multiply-add per (m, n, k));
``bytes = (M*K + N*K + M*N) * itemsize`` (x and w read once, y written once).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .registry import KernelOp, generator, randn

__all__ = ["matmul", "linear", "linear_backward", "OPS"]


@triton.jit
def _matmul_kernel(A, B, C, M, N, K, s_am, s_ak, s_bk, s_bn, s_cm, s_cn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: GROUP_M row-tiles share the column-tiles of B while they are in L2.
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(A + rm[:, None] * s_am + kk[None, :] * s_ak,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(B + kk[:, None] * s_bk + rn[None, :] * s_bn,
                    mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    tl.store(C + rm[:, None] * s_cm + rn[None, :] * s_cn, acc.to(C.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def _tile(n: int, big: int) -> int:
    """Tile edge for a dimension of size ``n``: ``big`` for large n, 64 for medium, 16 (tl.dot's minimum) for small."""
    if n >= 2 * big:
        return big
    return 64 if n >= 64 else 16


def dot_precision(dtype: torch.dtype):
    """``tl.dot`` input precision matching torch: TF32 for float32 only where torch allows it."""
    if dtype != torch.float32:
        return None  # half-precision operands: tensor cores, fp32 accumulate
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-D tensors ``a`` (M, K) and ``b`` (K, N) of one dtype and any strides -> (M, N), contiguous."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul: bad shapes {tuple(a.shape)} @ {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"matmul: dtypes differ ({a.dtype}, {b.dtype})")
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_()
    bm, bn = _tile(M, 128), _tile(N, 128)
    bk = 32 if K >= 32 else 16
    big = bm * bn >= 128 * 128
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _matmul_kernel[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                         c.stride(0), c.stride(1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                         PREC=dot_precision(a.dtype), num_warps=8 if big else 4,
                         num_stages=2 if (big and a.dtype == torch.float32) else 3)
    return c


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` without bias: x (M, K), w (N, K) -> (M, N)."""
    return matmul(x, w.t())


def linear_backward(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`linear`: dx = dy @ w (M, K) and dw = dy^T @ x (N, K)."""
    return matmul(dy, w), matmul(dy.t(), x)


def _make_inputs(shape: dict, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = generator(device)
    x = randn(g, shape["M"], shape["K"], dtype=dtype, device=device)
    w = randn(g, shape["N"], shape["K"], dtype=dtype, device=device, scale=shape["K"] ** -0.5)
    return x, w


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def _flops(shape: dict) -> int:
    return 2 * shape["M"] * shape["N"] * shape["K"]


def _bytes(shape: dict, dtype: torch.dtype) -> int:
    M, N, K = shape["M"], shape["N"], shape["K"]
    return (M * K + N * K + M * N) * dtype.itemsize


def _standard_shapes() -> tuple[dict, ...]:
    """The four linears of a transformer block (QKV, attention out, MLP up, MLP down) for 8192 tokens."""
    out = []
    for h in (768, 1024, 2048, 4096, 8192):
        for n, k in ((3 * h, h), (h, h), (4 * h, h), (h, 4 * h)):
            out.append({"M": 8192, "N": n, "K": k})
    return tuple(out)


OPS = (
    KernelOp(
        name="matmul", op_class="matmul", shape_keys=("M", "N", "K"),
        make_inputs=_make_inputs, reference=_reference,
        triton_forward=linear, triton_backward=linear_backward,
        flops=_flops, bytes_moved=_bytes,
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        # 16-, 64- and 128-wide tiles, ragged in M, N and K (3x3 tiles of 128: grouped ordering)
        test_shapes=({"M": 40, "N": 48, "K": 72}, {"M": 130, "N": 20, "K": 16}, {"M": 260, "N": 300, "K": 40}),
        standard_shapes=_standard_shapes(),
    ),
)
