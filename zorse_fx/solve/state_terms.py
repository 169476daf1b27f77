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

from ..ir.costs import extra_copies

__all__ = ["grad_transient_kib", "grad_transient_matrix", "transient_kib", "stage_state_kib", "stage_optim_units",
           "extra_copies_matrix", "grad_shard_kib", "block_weight_kib", "gathered_weight_kib",
           "gathered_weight_matrix", "GATHERED_UNITS", "max_window_sum", "stage_host_kib", "offload_host_kib",
           "offload_replicated_kib"]


# [Note: gradient transients]
# A weight's gradient exists as a tensor of its own before autograd adds it into the gradient
# bucket: the backward of each use makes one (a matmul's weight gradient, the embedding's dense
# gradient), AccumulateGrad adds it. A weight the stage uses twice -- a tied embedding with both of
# its blocks on the stage -- makes the most of it: autograd keeps the first contribution (the output
# layer's, made first) in its input buffer until the second (the embedding's) is made at the end of
# the backward, and their sum is a third: 3 Gt. A weight used once makes one, G1. Either is made
# once the backward has freed the gradients of its block's outputs, and the largest of them (the
# embedding's, the output layer's) come after or instead of the loss block's transient; this model
# lets them stand beside what is left of the micro-batch's activations, n A_s less:
#     peak = state + act + max(0, G - n A_s),  G = max(G1, 3 Gt)
# (``transient_kib``; G1 the float32 gradient of the stage's largest parameter, Gt of the largest
# tied parameter whose first and last blocks the stage holds). Measured (bench/LOG.md, "Memory on
# the box"): zorse_fx's one-stage plan of case (c), a 33.6 M-element tied embedding, peaked at 840 MiB
# of live tensors (torch.profiler) against 493 MiB predicted without this term -- parameters,
# gradients and moments 152 MiB each, three 128 MiB gradients of the embedding, activations 0 --;
# with it 456 + 41 + (384 - 41) = 840 MiB. Pricing G1 on top of act (no "- n A_s") over-predicted
# bench/memory_cpu.py's ZeRO-3 ranks by 9% (tests/test_runtime_memory.py's bound: 10%); with it they
# are as before (G1 <= n A_s there). Every evaluator adds the term where it adds activations: the
# objective, the shard balance, the stage DP and the baselines' fits, the simulator and CP-SAT's
# [C-memory] (model.py: one more row).


def grad_transient_kib(tab, i: int, j: int) -> int:
    """G KiB of a stage over blocks [i, j) ([Note: gradient transients]): the largest of its
    largest parameter's gradient and three gradients of a tied parameter whose first and last
    blocks it holds (0: none known)."""
    g1 = max(tab.gt_kib[i:j], default=0) if tab.gt_kib else 0
    g3 = max((tab.tied_gt3_kib[t] for t, b in enumerate(tab.tied_blocks)
              if tab.tied_gt3_kib and i <= b[0] and b[-1] < j), default=0)
    return max(g1, g3)


def transient_kib(tab, i: int, j: int, n: int, a: int) -> int:
    """KiB a GPU with ``n`` samples on a stage over blocks [i, j) (activations ``a`` KiB per
    sample) holds at its peak beyond state and activations: max(0, G - n a)."""
    return max(0, grad_transient_kib(tab, i, j) - n * a)


def grad_transient_matrix(tab) -> np.ndarray:
    """``grad_transient_kib`` for every (i, j) at once: a (B+1, B+1) int64 matrix."""
    nb = tab.num_blocks
    g = np.zeros((nb + 1, nb + 1), dtype=np.int64)
    if tab.gt_kib:
        gt = np.asarray(tab.gt_kib, dtype=np.int64)
        for i in range(nb):
            g[i, i + 1:] = np.maximum.accumulate(gt[i:])
    ii, jj = np.meshgrid(np.arange(nb + 1), np.arange(nb + 1), indexing="ij")
    for t, b in enumerate(tab.tied_blocks):
        if tab.tied_gt3_kib and tab.tied_gt3_kib[t]:
            g = np.maximum(g, np.where((ii <= b[0]) & (jj > b[-1]), tab.tied_gt3_kib[t], 0))
    return g


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


def stage_host_kib(tab, i: int, j: int) -> int:
    """[C-offload]: KiB of host memory the offloaded optimizer of blocks [i, j)
    holds (``tables.OFFLOAD_BYTES_PER_PARAM`` per parameter, a tied one once)."""
    host = tab.host_prefix[j] - tab.host_prefix[i]
    for t, c in extra_copies(tab.tied_blocks, i, j):
        host -= c * tab.tied_host[t]
    return host


def offload_replicated_kib(tab, i: int, j: int) -> int:
    """[C-offload]: KiB a replicated (unsharded) offloaded stage over blocks [i, j)
    keeps on each GPU: its float32 weights (and, mixed, their autocast copies) and
    gradients, each tied parameter once. Not R_s = state - Q_s: Q_s prices a 16-bit
    working weight's float32 master as shardable, but only a sharded stage of two or
    more GPUs has 16-bit working weights ([Note: 16-bit working weights]); a
    replicated stage keeps every weight in float32 on the GPU and a host copy of it
    ([Note: optimizer offload] in ``runtime/optimizer.py``)."""
    rep = tab.off_rep_prefix[j] - tab.off_rep_prefix[i]
    for t, c in extra_copies(tab.tied_blocks, i, j):
        rep -= c * tab.tied_off_rep[t]
    return rep


def offload_host_kib(tab, i: int, j: int, shard_mib) -> tuple[int, ...]:
    """[C-offload]: per GPU of an offloaded stage over blocks [i, j), its host
    KiB: the stage's host state H_s (``stage_host_kib``) when ``shard_mib`` is
    None (replicated), else its shard's part ceil(H_s * z_g / sum z) of it
    (the runtime splits the parameters in proportion to the shards, so the
    host state too). The planners place the shards so that z_g MiB <=
    host_g * Q_s / H_s, which implies this <= host_g since sum z MiB >= Q_s."""
    host = stage_host_kib(tab, i, j)
    if shard_mib is None:
        return (host,)
    total = max(sum(shard_mib), 1)
    return tuple(-(-host * z // total) for z in shard_mib)


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


#: ZeRO-3: the consecutive units whose working weights are whole at once ([Note: sharded parameters]
#: in ``runtime/param_shard.py``): in the forward the one computing and the next one arriving
#: (prefetch); in the backward the one computing and the one before it arriving, the one after it
#: freed already (its weight gradients accumulate, and free it, before autograd moves on: an
#: AccumulateGrad node runs as soon as it is ready). A unit whose weight is read again by a later
#: block (a tied embedding and LM head in one stage) stays gathered from its first read to its last.
GATHERED_UNITS = 2


def block_weight_kib(tab, b: int) -> int:
    """[C-param-shard]: the working-weight KiB of block ``b`` of ``tab``: its
    replicated state less its float32 gradients (4 B per parameter: the
    16-bit or float32 working weights, 2 or 4 B), + 1 KiB: the gradients are
    rounded up per block, so the difference could fall < 1 KiB short of the
    exact bytes (memory stays conservative); 0 for a block without parameters."""
    rep = (tab.state_prefix[b + 1] - tab.state_prefix[b]) - (tab.shard_prefix[b + 1] - tab.shard_prefix[b])
    return max(0, rep - (tab.grad_kib_prefix[b + 1] - tab.grad_kib_prefix[b]) + 1) if rep > 0 else 0


def max_window_sum(sizes, k: int) -> int:
    """The largest sum of ``k`` consecutive entries of ``sizes`` (all of them
    when there are fewer; 0 for none): the weights a ZeRO-3 stage holds
    gathered at once ([C-param-shard]; ``plan_build`` counts its units so)."""
    sizes = list(sizes)
    return sum(sizes) if len(sizes) <= k else max(sum(sizes[a:a + k]) for a in range(len(sizes) - k + 1))


def gathered_weight_kib(tab, i: int, j: int) -> int:
    """[C-param-shard]: the most working-weight KiB a ZeRO-3 stage over blocks
    [i, j) holds gathered at once: the largest sum of ``GATHERED_UNITS``
    consecutive blocks with weights (a unit per such block, [Note: ZeRO-3
    units] in ``codegen/split.py``; all of them when there are fewer), plus
    every tied parameter two of its blocks read (gathered throughout, at 4 B
    per parameter: tied parameters are float32)."""
    nz = [w for w in (block_weight_kib(tab, b) for b in range(i, j)) if w > 0]
    return max_window_sum(nz, GATHERED_UNITS) + sum(tab.tied_grad_kib[t] for t, _ in extra_copies(tab.tied_blocks, i, j))


def gathered_weight_matrix(tab) -> np.ndarray:
    """``gathered_weight_kib(tab, i, j)`` for every (i, j) as a (B+1, B+1) int64
    matrix (0 where i >= j), O(B^2)."""
    nb = tab.num_blocks
    w = [block_weight_kib(tab, b) for b in range(nb)]
    out = np.zeros((nb + 1, nb + 1), dtype=np.int64)
    k = GATHERED_UNITS
    for i in range(nb):
        last: list[int] = []
        best = 0
        for j in range(i + 1, nb + 1):
            if w[j - 1] > 0:
                last = (last + [w[j - 1]])[-k:]
                best = max(best, sum(last))
            out[i, j] = best
    for t, e in extra_copies_matrix(tab.tied_blocks, nb):
        out += (e > 0) * tab.tied_grad_kib[t]
    return out
