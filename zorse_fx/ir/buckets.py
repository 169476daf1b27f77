"""The gradient bucket layout the runtime reduces with and the objective and
simulator price: DDP's bucket sizes ([Note: overlapped gradient reduction] in
``zorse_fx/runtime/grad_sync.py``)."""

from __future__ import annotations

__all__ = ["BUCKET_BYTES", "FIRST_BUCKET_BYTES", "bucket_caps", "MAX_SHARD_BUCKETS_IN_FLIGHT"]

#: Gradient bucket size (bytes), DDP's default 25 MiB (``bucket_cap_mb``).
BUCKET_BYTES = 25 * 1024 * 1024
#: The first bucket of a key (its last parameters) is at most this big, as
#: DDP's ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB): it fills early in the
#: backward, so the first all-reduce starts early.
FIRST_BUCKET_BYTES = 1024 * 1024
#: ZeRO-2: shard buckets in flight per rank before launching another waits for
#: the oldest ([Note: sharded gradients] in ``runtime/grad_sync.py``); the
#: reduction buffers alive at once are one more, which the memory model charges.
MAX_SHARD_BUCKETS_IN_FLIGHT = 2


def bucket_caps(bucket_bytes: int) -> tuple[int, int]:
    """(first bucket's cap, every other bucket's cap) in bytes of gradients."""
    return min(FIRST_BUCKET_BYTES, bucket_bytes), bucket_bytes
