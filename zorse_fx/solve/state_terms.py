"""The training-state and optimizer terms of a stage with its tied parameters
counted once ([C-tied], [C-memory], [C-optim], [C-shard] in the module note
of ``objective.py``), shared by the evaluator, the stage DP, the baselines and
the simulator; the CP-SAT model (``model.py``) encodes the same sums.

A tied parameter (``BlockCosts.tied_params``) counts in ``param_count`` of
every block that reads it. A stage holding c >= 2 of those blocks holds ONE
parameter (one ``nn.Parameter`` in the stage module: one weight, one
gradient, one AdamW state), so its state, shardable state and optimizer time
are the per-block sums less (c - 1) copies of the tied parameter's. A tied
parameter on several stages keeps one copy per stage (each stage's module
holds its own), as before.

Rounding (``build_tables``): a copy's state and shardable state are rounded
DOWN to KiB (``tied_state``, ``tied_shard``), so a stage's table value (per
block rounded up, less whole copies rounded down) stays >= its exact bytes
and memory stays conservative; a copy's optimizer time is rounded to the
nearest ns per memory-bandwidth class (``tied_opt``) as the per-block times
are. Each block reading the parameter has ``param_count`` >= its numel
(``BlockCosts`` checks it) and rounding is monotone, so no stage term goes
below one copy's.
"""

from __future__ import annotations

import numpy as np

__all__ = ["extra_copies", "stage_state_kib", "stage_optim_units", "extra_copies_matrix", "unique_params",
           "shardable_kib", "grad_shard_kib"]


def extra_copies(tied_blocks, i: int, j: int) -> list[tuple[int, int]]:
    """``[(t, c - 1)]`` for every tied parameter t (``tied_blocks[t]``: the
    blocks that read it) of which blocks [i, j) hold c >= 2 blocks: the
    copies a stage over those blocks holds once, not c times."""
    out = []
    for t, blocks in enumerate(tied_blocks):
        c = sum(1 for b in blocks if i <= b < j)
        if c > 1:
            out.append((t, c - 1))
    return out


def stage_state_kib(tab, i: int, j: int) -> tuple[int, int]:
    """(state R_s + Q_s, shardable state Q_s) in KiB of a stage over blocks
    [i, j) of ``tab`` (an ``objective.IntTables``), each tied parameter
    counted once."""
    state = tab.state_prefix[j] - tab.state_prefix[i]
    shard = tab.shard_prefix[j] - tab.shard_prefix[i]
    for t, c in extra_copies(tab.tied_blocks, i, j):
        state -= c * tab.tied_state[t]
        shard -= c * tab.tied_shard[t]
    return state, shard


def stage_optim_units(tab, q: int, i: int, j: int) -> int:
    """Units (ns) of the unsharded optimizer step of blocks [i, j) on a GPU of
    memory-bandwidth class ``q`` (sum of the rounded per-block times), each
    tied parameter counted once ([C-optim])."""
    return tab.opt_prefix[q][j] - tab.opt_prefix[q][i] - sum(
        c * tab.tied_opt[t][q] for t, c in extra_copies(tab.tied_blocks, i, j))


def extra_copies_matrix(tied_blocks, num_blocks: int) -> list[tuple[int, np.ndarray]]:
    """Per tied parameter t: ``(t, E)`` with ``E[i, j]`` = the extra copies
    (``extra_copies``) a stage over blocks [i, j) holds once, a (B+1, B+1)
    int64 matrix (0 where i >= j), for the stage DP's vectorised terms."""
    idx = np.arange(num_blocks + 1)
    out = []
    for t, blocks in enumerate(tied_blocks):
        held = np.zeros((num_blocks + 1, num_blocks + 1), dtype=np.int64)
        for b in blocks:  # block b is in [i, j) iff i <= b < j
            held += ((idx[:, None] <= b) & (idx[None, :] > b)).astype(np.int64)
        out.append((t, np.maximum(held - 1, 0)))
    return out


def unique_params(costs, i: int = 0, j: int | None = None) -> int:
    """Parameters of blocks [i, j) (default: all) of ``costs`` (a ``BlockCosts``),
    each tied parameter counted once."""
    j = costs.num_blocks if j is None else j
    blocks = [tp.blocks for tp in costs.tied_params]
    return sum(costs.param_count[i:j]) - sum(c * costs.tied_params[t].numel for t, c in extra_copies(blocks, i, j))


def shardable_kib(costs, i: int, j: int, unit_bytes: int) -> int:
    """Shardable state Q_s of blocks [i, j) of ``costs`` (a ``BlockCosts``) in
    units of ``unit_bytes`` (``objective.MEMORY_UNIT_BYTES``), rounded as
    ``build_tables`` rounds it: per block UP, less each extra tied copy
    (``extra_copies``) rounded DOWN; equal to ``stage_state_kib(tab, i, j)[1]``
    of the tables built from ``costs``. For a caller holding a ``BlockCosts``
    and no tables (``plan_build.plan_decision``'s equal shards)."""
    sh = costs.shardable_bytes_per_param  # a tied parameter is float32 ([Note: 16-bit working weights])
    q = sum(-(-costs.shardable_bytes(b) // unit_bytes) for b in range(i, j))
    blocks = [tp.blocks for tp in costs.tied_params]
    return q - sum(c * (int(sh * costs.tied_params[t].numel) // unit_bytes) for t, c in extra_copies(blocks, i, j))


def grad_shard_kib(tab, i: int, j: int) -> tuple[int, int, int]:
    """[C-grad-shard] of a ZeRO-2 stage over blocks [i, j) of ``tab``: ``(up,
    down, transient)`` KiB. ``up`` >= and ``down`` <= the float32 gradient
    bytes the stage's shards take over (its parameters less every copy of a
    tied parameter another stage also holds, which keeps the all-reduce path:
    [Note: sharded gradients] in ``runtime/grad_sync.py``); the shards must
    cover ``up``, the replicated state drops by ``down`` (memory stays
    conservative: per block the rounding is < 1 KiB, per tied copy < 1 KiB).
    ``transient``: the reduction buffers alive at once: the buckets in
    flight (``MAX_SHARD_BUCKETS_IN_FLIGHT``) and their outputs (at most a
    bucket each), and one filling per optimizer buffer (two under a mixed
    precision: the 16-bit working weights' and the float32 rest), each
    bucket at most ``min(cap, up)`` (a stage of fewer buckets cycles through
    them every micro-batch), at float32 size (an upper bound under a 16-bit
    reduction)."""
    from ..ir.buckets import MAX_SHARD_BUCKETS_IN_FLIGHT

    up = tab.grad_kib_prefix[j] - tab.grad_kib_prefix[i]
    copies = 0
    for t, blocks in enumerate(tab.tied_blocks):
        c = sum(1 for b in blocks if i <= b < j)
        if c:
            gone = c - 1 if c == len(blocks) else c  # held once here, or also by another stage
            up -= gone * tab.tied_grad_kib[t]
            copies += gone
    up = max(up, 0)
    down = max(0, up - (j - i) - copies)
    return up, down, (2 * MAX_SHARD_BUCKETS_IN_FLIGHT + 2) * min(up, tab.bucket_caps[1])
