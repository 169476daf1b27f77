"""Fused boundary messages and sample-range routing between stages.

[Note: why activations are re-partitioned by sample range]
Stage ``s`` and stage ``s+1`` may have data-parallel groups of different width
and different sample shares. Within every micro-batch, GPU ``i`` of a stage owns
the rows ``[a_i, b_i)`` (its shares laid end to end, in GPU order). Sender
``i`` sends to receiver ``j`` exactly the rows ``[a_i, b_i) ∩ [a_j, b_j)``;
gradients flow back over the same pairs with the same rows. Every sample
therefore crosses each boundary once, and a receiver concatenates what it got
from its senders in row order.

One message per (sender, receiver, micro-batch): every tensor crossing the
boundary is flattened to bytes and concatenated into one ``uint8`` buffer, so
the number of messages does not grow with the number of crossing tensors.
"""

from __future__ import annotations

import torch

from ..ir.tensor import TensorSpec

__all__ = ["pack", "unpack", "message_bytes", "torch_dtype"]


def torch_dtype(spec: TensorSpec) -> torch.dtype:
    """The torch dtype of ``spec.dtype`` (``"float32"`` -> ``torch.float32``)."""
    return getattr(torch, spec.dtype)


def message_bytes(specs: tuple[TensorSpec, ...], rows: int) -> int:
    return rows * sum(s.bytes_per_sample for s in specs)


def pack(tensors: list[torch.Tensor], start: int, end: int) -> torch.Tensor:
    """Rows ``[start, end)`` of every tensor, as one flat ``uint8`` buffer: a
    copy when several tensors cross, else a view of the one tensor's rows
    (no copy; the caller keeps it alive until the send completed and does not
    write to it meanwhile)."""
    parts = [t[start:end].contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def unpack(buf: torch.Tensor, specs: tuple[TensorSpec, ...], rows: int) -> list[torch.Tensor]:
    """Inverse of :func:`pack` for ``rows`` samples of tensors described by ``specs``."""
    out, offset = [], 0
    for s in specs:
        n = rows * s.bytes_per_sample
        out.append(buf[offset : offset + n].view(torch_dtype(s)).reshape(rows, *s.shape_per_sample))
        offset += n
    if offset != buf.numel():
        raise AssertionError(f"message has {buf.numel()} bytes, specs account for {offset}")
    return out
