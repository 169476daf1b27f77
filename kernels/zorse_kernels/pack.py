"""Pack/unpack of the fused boundary messages between pipeline stages.

A message carries rows ``[a, b)`` of every tensor crossing a stage boundary, as
one flat ``uint8`` buffer, tensors in order (``zorse_fx.runtime.comm.pack``)::

    tensors t_i (n, *per_sample_i), any dtypes, row-major
    buf = cat_i( t_i[a:b].contiguous().reshape(-1).view(uint8) )     (uint8, sum_i (b-a)*row_bytes_i)

where ``row_bytes_i = prod(per_sample_i) * itemsize_i``. Rows ``[a, b)`` of a
row-major tensor are one contiguous byte range, ``[a*row_bytes, b*row_bytes)``,
so packing is one copy per tensor from there to its offset in the buffer.
:func:`unpack` is the inverse: it writes the buffer's rows into rows ``[a, b)`` of
preallocated tensors (a receiver assembling a micro-batch from several senders).

Each copy moves the widest word (8, 4, 2 or 1 bytes) that divides both byte
addresses and the length, through one Triton kernel (``BLOCK`` words per program).

Registered op ``pack`` (shape keys N samples, T tokens, H hidden, row range
``[start, end)``) packs a realistic boundary: hidden states (N, T, H) in the given
dtype, int64 positions (N, T) and a bool mask (N, T). Its first input is the row
range as a CPU int64 tensor ``[start, end]``.

Cost: ``flops = 0``; ``bytes = 2 * (end - start) * T * (H*itemsize + 8 + 1)``
(every selected byte read once and written once).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .registry import KernelOp, generator, randn

__all__ = ["pack", "unpack", "pack_reference", "copy_bytes", "OPS"]

_BLOCK = 4096
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


@triton.jit
def _copy_kernel(SRC, DST, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(DST + offs, tl.load(SRC + offs, mask=offs < n), mask=offs < n)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def copy_bytes(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the 1-D uint8 tensor ``src`` into the 1-D uint8 tensor ``dst`` (same length) with the Triton kernel."""
    n = src.numel()
    if n != dst.numel():
        raise ValueError(f"copy_bytes: {n} bytes into {dst.numel()}")
    if n == 0:
        return
    for width, dt in _WORDS:
        if n % width == 0 and all(x.data_ptr() % width == 0 and x.storage_offset() % width == 0 for x in (src, dst)):
            s, d = src.view(dt), dst.view(dt)
            break
    _copy_kernel[(triton.cdiv(s.numel(), _BLOCK),)](s, d, s.numel(), BLOCK=_BLOCK, num_warps=4)


def _rows_bytes(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) of t as a uint8 view (through a contiguous copy only if t is not row-major)."""
    if not t.is_contiguous():
        t, start, end = t[start:end].contiguous(), 0, end - start
    row = math.prod(t.shape[1:]) * t.element_size()
    return _as_bytes(t)[start * row: end * row]


def _check_range(tensors, start: int, end: int) -> None:
    if not tensors:
        raise ValueError("pack/unpack: no tensors")
    for t in tensors:
        if t.dim() == 0 or not 0 <= start <= end <= t.shape[0]:
            raise ValueError(f"rows [{start}, {end}) out of range for a tensor of shape {tuple(t.shape)}")


def pack(tensors: list[torch.Tensor], start: int, end: int) -> torch.Tensor:
    """Rows ``[start, end)`` of every tensor as one flat uint8 buffer (the ``comm.pack`` layout)."""
    _check_range(tensors, start, end)
    parts = [_rows_bytes(t, start, end) for t in tensors]
    buf = torch.empty(sum(p.numel() for p in parts), dtype=torch.uint8, device=tensors[0].device)
    offset = 0
    for p in parts:
        copy_bytes(p, buf[offset: offset + p.numel()])
        offset += p.numel()
    return buf


def unpack(buf: torch.Tensor, outs: list[torch.Tensor], start: int, end: int) -> list[torch.Tensor]:
    """Inverse of :func:`pack`: write ``buf`` into rows ``[start, end)`` of the contiguous tensors ``outs``."""
    _check_range(outs, start, end)
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ValueError("unpack: buf must be a 1-D uint8 tensor")
    offset = 0
    for t in outs:
        if not t.is_contiguous():
            raise ValueError("unpack: output tensors must be contiguous")
        dst = _rows_bytes(t, start, end)
        if offset + dst.numel() > buf.numel():
            raise ValueError(f"unpack: message has {buf.numel()} bytes, outputs need more")
        copy_bytes(buf[offset: offset + dst.numel()], dst)
        offset += dst.numel()
    if offset != buf.numel():
        raise ValueError(f"unpack: message has {buf.numel()} bytes, outputs account for {offset}")
    return outs


def pack_reference(tensors: list[torch.Tensor], start: int, end: int) -> torch.Tensor:
    """The torch convention of ``zorse_fx.runtime.comm.pack``."""
    return torch.cat([t[start:end].contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def _inputs(shape, dtype, device):
    g = generator(device)
    N, T, H = shape["N"], shape["T"], shape["H"]
    dev = torch.device(device)
    hidden = randn(g, N, T, H, dtype=dtype, device=device)
    positions = torch.arange(T, device=dev, dtype=torch.int64).repeat(N, 1)
    mask = torch.rand(N, T, generator=g, device=dev) < 0.9
    return torch.tensor([shape["start"], shape["end"]], dtype=torch.int64), hidden, positions, mask


def _bounds(rng: torch.Tensor) -> tuple[int, int]:
    a, b = rng.tolist()
    return int(a), int(b)


OPS = (
    KernelOp(
        name="pack", op_class="copy", shape_keys=("N", "T", "H", "start", "end"),
        make_inputs=_inputs,
        reference=lambda rng, *ts: pack_reference(list(ts), *_bounds(rng)),
        triton_forward=lambda rng, *ts: pack(list(ts), *_bounds(rng)),
        triton_backward=None,
        flops=lambda s: 0,
        bytes_moved=lambda s, dt: 2 * (s["end"] - s["start"]) * s["T"] * (s["H"] * dt.itemsize + 8 + 1),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        # odd T: the int64 and bool parts start at addresses not divisible by 8 -> narrower words
        test_shapes=({"N": 5, "T": 7, "H": 12, "start": 1, "end": 4}, {"N": 4, "T": 8, "H": 16, "start": 0, "end": 4}),
        standard_shapes=tuple({"N": 8, "T": 2048, "H": h, "start": a, "end": b}
                              for h in (768, 4096, 8192) for a, b in ((0, 8), (2, 5))),
    ),
)
