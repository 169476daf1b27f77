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

from dataclasses import dataclass

import torch

from ..capture.analysis import TensorSpec

__all__ = ["Route", "routes", "pack", "unpack", "message_bytes"]


@dataclass(frozen=True, slots=True)
class Route:
    """Rows ``[start, end)`` of a micro-batch going from one GPU to another."""

    src_pos: int  # GPU position in the sending stage
    dst_pos: int  # GPU position in the receiving stage
    start: int
    end: int

    @property
    def rows(self) -> int:
        return self.end - self.start


def routes(src: tuple[tuple[int, int], ...], dst: tuple[tuple[int, int], ...]) -> tuple[Route, ...]:
    """All non-empty overlaps between sender and receiver row ranges, in row order."""
    out = []
    for i, (a, b) in enumerate(src):
        for j, (c, d) in enumerate(dst):
            lo, hi = max(a, c), min(b, d)
            if lo < hi:
                out.append(Route(i, j, lo, hi))
    return tuple(sorted(out, key=lambda r: r.start))


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
        out.append(buf[offset : offset + n].view(s.torch_dtype).reshape(rows, *s.shape_per_sample))
        offset += n
    if offset != buf.numel():
        raise AssertionError(f"message has {buf.numel()} bytes, specs account for {offset}")
    return out
