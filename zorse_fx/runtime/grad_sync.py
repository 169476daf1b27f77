"""Gradient reduction of one rank's stages: bucketed, asynchronous, overlapped
with the backward of the last micro-batch, as DDP does.

[Note: overlapped gradient reduction]
Every parameter is reduced over the ranks that hold it (``holders``: the
stage's data-parallel group, or for a tied parameter the union over the
stages that hold it); copies one rank holds in several of its stages are
summed on the rank first (see [Note: a rank with several stages] in
``worker.py``). Parameters with the same holders form a *key* (one process
group); a key's parameters of one dtype are laid out in reverse plan order
(the order the backward produces their gradients) in buckets of
``bucket_bytes`` (the plan's ``grad_bucket_bytes``, which the planner priced: DDP's
25 MiB by default; the first one 1 MiB at most, as DDP's, so
the first reduction starts early), closed at the first parameter that reaches
the size, and every parameter's ``.grad``
is a view into its bucket (DDP's ``gradient_as_bucket_view``): autograd
accumulates the micro-batches straight into the bucket, no copy and no extra
memory.

During the backward of a stage's last micro-batch (``begin_final`` /
``end_final`` around that action), a ``post_accumulate_grad`` hook marks each
parameter final; when all of a bucket's parameters (all their local copies)
are final, the bucket is all-reduced (SUM) asynchronously -- launched in
bucket order per key, so every member of a process group issues the same
collectives in the same order, as NCCL requires -- while the backward goes
on. After the stage's last backward, parameters that received no gradient
are marked final too, so every bucket is launched. ``wait`` (before the
optimizer step) waits for them in launch order. With a 16-bit
``grad_reduce_dtype`` a float32 bucket is cast to it for the all-reduce and
back (its 16-bit copy lives while in flight: ``reduce_copy_bytes_per_param``
in ``zorse_fx/precision.py``); buckets of 16-bit parameters are reduced in
their own dtype.

A 16-bit working weight ([Note: 16-bit working weights] in
``zorse_fx/precision.py``) cannot hold a float32 ``.grad``: its bucket is
float32 all the same (its *main gradient* is the bucket view, ``grad_of``),
and a ``post_accumulate_grad`` hook registered for the whole run adds each
micro-batch's 16-bit gradient into it and frees it; during the stage's last
backward the same hook marks the parameter final.

What this overlaps: a stage's reduction with the backward of its own last
micro-batch (all but the last bucket's), and, since every rank reduces as
soon as its own stages are done, with the drain of the pipeline on the
ranks of earlier stages. The simulator prices these two (``sim/engine.py``,
"Gradient sync"), a bucket ready when its parameters' blocks finished their
backward -- no earlier than this hook fires -- and taking the link to itself:
not more overlap than this code can get. The planner's objective lets every bucket
but the last run during the stage's last backward, from the end of the
backward of the stage's last block (it runs first: no bucket is ready before
it ends), and charges the rest after it: [C-objective], ``solve/network_terms.drain_offsets``;
bench/README.md, "Gradient buckets overlapping the stage's own last backward").

[Note: sharded gradients]
ZeRO-2 (``StagePlan.grad_sharded``, on a ZeRO-1 stage of k >= 2 GPUs): no
GPU keeps the stage's whole gradient. Each rank keeps a float32 *gradient
shard* per optimizer buffer, the size of its owned range of that buffer
([Note: ZeRO-1 with unequal shards] in ``optimizer.py``), and every
micro-batch's gradients are reduced into the shards as the backward makes
them:

- the stage's parameters reduced over the stage's own GPUs only (a tied
  parameter other stages hold, or one this rank holds twice, keeps the
  ZeRO-1 path above) form *shard buckets*: element ranges of one buffer of
  ``bucket_bytes`` of the reduction dtype (the first 1 MiB at most), cut
  through parameters where they fall, numbered from the buffer's end. A
  ZeRO-2 stage's buffer is in forward order (each parameter at its first
  use in the stage source: ``StageRuntime.first_use``, the same on every
  rank), so the backward completes the buckets in that order, one at a
  time. (In ``StagePlan.params`` order -- norms after a layer's matmuls, a
  tied embedding last -- the bucket holding the embedding would hold back
  every launch, and every bucket's buffer, until the end of the backward;
  and a bucket closed at whole parameters would be as large as the largest
  one, 180 MB of float32 for a Llama-2 7B MLP weight.);
- a ``post_accumulate_grad`` hook registered for the whole run copies each
  parameter's gradient of the micro-batch, piece by piece, into its
  buckets' reduction buffers (the plan's ``grad_reduce_dtype``; allocated
  at a bucket's first piece, zeros for a parameter without a gradient) and
  frees it; each complete bucket is launched, in bucket order, as one asynchronous
  ``dist.reduce_scatter`` whose parts are the owners' overlaps with the
  bucket (SUM; a GPU whose range misses the bucket gets an empty part).
  The parts are unequal, so it is not ``reduce_scatter_tensor`` (equal
  chunks, which would need padding to the largest shard); on NCCL torch
  runs unequal parts as k rooted reductions in one NCCL group
  (reduce_scatter_v), so they share the links as one reduce-scatter does:
  each rank sends (k-1)/k of the bucket, at k launches' latency;
- at most ``MAX_SHARD_BUCKETS_IN_FLIGHT`` buckets are in flight: launching
  one more first waits for the oldest, whose owner adds its slice (cast to
  float32) into its gradient shard and drops the buffer. So the transient
  is a few buckets, not the stage's gradient. After each backward of the
  stage (``end_backward``) parameters that got no gradient are marked,
  launching the rest; ``wait`` drains every bucket before the step.

The rank's gradient of a parameter's owned elements is then a view of its
shard (``piece_grad``), which the optimizer steps; ``shard_grads`` are what
the loss scaler unscales, clipping scales and the global norm squares (each
element once, on its owner). Traffic: every micro-batch moves the stage's
gradient once in the reduction dtype (M times per step instead of one
all-reduce of the sum), spread over the backwards instead of the drain;
the planner prices it so (``sim/engine.py``). The float32 sums are the
same numbers as ZeRO-1's in another order: micro-batches summed after the
ranks instead of before.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..ir.buckets import MAX_SHARD_BUCKETS_IN_FLIGHT, bucket_caps
from ..plan import Plan
from ..precision import PrecisionPolicy
from .stage import StageRuntime

__all__ = ["GradientReducer", "holders_of", "MAX_SHARD_BUCKETS_IN_FLIGHT"]


def holders_of(plan: Plan) -> dict[str, tuple[int, ...]]:
    """Canonical parameter name -> the ranks holding it (sorted), over every
    stage of the plan; dict order = first appearance (stage order, then the
    stage's parameter order): the one global parameter order every rank uses."""
    holders: dict[str, set[int]] = defaultdict(set)
    for s in plan.stages:
        for canon in s.params.values():
            holders[canon].update(s.ranks)
    return {canon: tuple(sorted(r)) for canon, r in holders.items()}


@dataclass(slots=True, kw_only=True)
class _Entry:
    """One canonical parameter on this rank: its copies (stage index, param)."""

    canon: str
    copies: list[tuple[int, torch.nn.Parameter]]
    ready: set[int] = field(default_factory=set)  # indices into copies that are final
    bucket: "_Bucket | None" = None
    offset: int = 0


@dataclass(slots=True, kw_only=True)
class _Bucket:
    key: tuple[int, ...]
    index: int  # position in the key's launch order
    flat: torch.Tensor
    entries: list[_Entry]
    pending: int = 0
    work: object = None
    low: torch.Tensor | None = None


@dataclass(slots=True, kw_only=True)
class _GradShard:
    """ZeRO-2: one optimizer buffer of a ``grad_sharded`` stage on this rank."""

    stage: int
    group: object
    #: Each GPU of the stage's range of the buffer (stage order), and this rank's position among them.
    ranges: tuple[tuple[int, int], ...]
    position: int
    #: The positions in the group's rank order (``new_group`` sorts the ranks; the stage's GPUs need not be in
    #: rank order: [Note: ranks node by node] in plan.py): the reduce-scatter's part j goes to group rank j.
    rank_order: tuple[int, ...] = ()
    #: This rank's range and its float32 gradient shard.
    owned: tuple[int, int]
    main: torch.Tensor
    buckets: list["_ShardBucket"] = field(default_factory=list)
    next: int = 0


@dataclass(slots=True, kw_only=True)
class _ShardBucket:
    """ZeRO-2: elements ``[start, end)`` of a buffer, reduced to their owners every micro-batch."""

    shard: _GradShard
    index: int
    start: int
    end: int
    #: (parameter, [lo, hi) of the buffer): the parameters' elements in the bucket; a parameter
    #: larger than a bucket is cut over several.
    members: list[tuple[torch.nn.Parameter, int, int]]
    marked: set[int] = field(default_factory=set)
    comm: torch.Tensor | None = None


class GradientReducer:
    """Reduces the gradients of one rank's stages (see [Note: overlapped
    gradient reduction]). ``groups``: process group per key (sorted ranks)
    with more than one rank; ``bucket_bytes``: bucket size (default: the plan's)."""

    def __init__(self, plan: Plan, stages: list[StageRuntime], groups: dict[tuple[int, ...], object], *,
                 precision: PrecisionPolicy, bucket_bytes: int | None = None, main_grad=(), shard_buffers=()):
        bucket_bytes = plan.grad_bucket_bytes if bucket_bytes is None else bucket_bytes
        self.precision = precision
        self.groups = groups
        holders = holders_of(plan)
        copies: dict[str, list[tuple[int, torch.nn.Parameter]]] = defaultdict(list)
        for st in stages:
            for canon, p in st.params().items():
                copies[canon].append((st.index, p))
        self._build_shards(plan, holders, copies, shard_buffers, bucket_bytes)
        #: 16-bit working weights (``StageOptimizer.low_params``): their gradients accumulate into float32
        #: main gradients, views of float32 buckets (see [Note: 16-bit working weights] in precision.py).
        low = {id(p) for p in main_grad} - self._shard_of.keys()
        self._low = low
        #: Entries of this rank, global order, that need a reduction or a local sum (ZeRO-2's aside).
        self.entries: list[_Entry] = [
            _Entry(canon=c, copies=copies[c]) for c in holders
            if c in copies and (len(holders[c]) > 1 or len(copies[c]) > 1)
            and id(copies[c][0][1]) not in self._shard_of]
        self._by_copy: dict[int, tuple[_Entry, int]] = {}
        for e in self.entries:
            for i, (_, p) in enumerate(e.copies):
                self._by_copy[id(p)] = (e, i)
        #: Buckets per key (sorted keys), in launch order.
        self.buckets: dict[tuple[int, ...], list[_Bucket]] = {}
        for key in sorted({holders[e.canon] for e in self.entries if len(holders[e.canon]) > 1}):
            mine = [e for e in self.entries if holders[e.canon] == key]
            out: list[_Bucket] = []
            first_cap, cap = bucket_caps(bucket_bytes)
            for dtype in sorted({self._grad_dtype(e) for e in mine}, key=str):
                chunk: list[_Entry] = []
                size = 0
                for e in reversed([e for e in mine if self._grad_dtype(e) == dtype]):
                    chunk.append(e)
                    size += e.copies[0][1].numel() * dtype.itemsize
                    if size >= (first_cap if not out else cap):
                        out.append(self._bucket(key, len(out), chunk))
                        chunk, size = [], 0
                if chunk:
                    out.append(self._bucket(key, len(out), chunk))
            self.buckets[key] = out
        self._next: dict[tuple[int, ...], int] = {}
        self._launched: list[_Bucket] = []
        #: Buckets of the last step launched from a gradient hook, i.e. while a
        #: backward was still running (the others at a stage's ``end_final``).
        self.launched_during_backward = 0
        self._in_hook = False
        #: Stages whose last micro-batch's backward is running.
        self._final: set[int] = set()
        #: Per stage: its parameters' copies that take part (hooks live only
        #: during the stage's last backward, so earlier micro-batches pay nothing).
        self._copies_of: dict[int, list[torch.nn.Parameter]] = defaultdict(list)
        for e in self.entries:
            for s, p in e.copies:
                if id(p) not in low:  # (16-bit working weights are marked by their own hook)
                    self._copies_of[s].append(p)
        self._hooks: dict[int, list] = {}
        #: Per bucket entry, its gradient view (made once; ``.grad`` is reset to it every step).
        self._views = {id(e): e.bucket.flat[e.offset: e.offset + e.copies[0][1].numel()].view_as(e.copies[0][1])
                       for e in self.entries if e.bucket is not None}
        #: 16-bit working weight (by id) -> its float32 main gradient (the bucket view).
        self.main_grads: dict[int, torch.Tensor] = {}
        for e in self.entries:
            p = e.copies[0][1]
            if id(p) in low:
                assert e.bucket is not None and len(e.copies) == 1, (
                    f"16-bit working weight {e.canon!r} must be held once and reduced (a sharded stage's)")
                self.main_grads[id(p)] = self._views[id(e)]
                # Every micro-batch: add its 16-bit gradient into the float32 main gradient and free it.
                p.register_post_accumulate_grad_hook(self._on_low_grad)

    # -- ZeRO-2 ----------------------------------------------------------------
    def _build_shards(self, plan: Plan, holders, copies, shard_buffers, bucket_bytes: int) -> None:
        """The gradient shards and shard buckets of the ``grad_sharded`` stages
        ([Note: sharded gradients]). ``shard_buffers``: per such stage hosted
        here, ``(StageRuntime, [optimizer._FlatBuffer])``."""
        #: Every ZeRO-2 shard of this rank, in stage then buffer order.
        self.shards: list[_GradShard] = []
        #: id(parameter) -> (its shard, its offset in the buffer, [(bucket, lo, hi): its elements
        #: [lo, hi) in that bucket, in launch order]).
        self._shard_of: dict[int, tuple[_GradShard, int, list]] = {}
        self._in_flight: deque[tuple[_ShardBucket, torch.Tensor, object]] = deque()
        red = self.precision.reduce_dtype
        first_cap, cap = (max(1, c // red.itemsize) for c in bucket_caps(bucket_bytes))  # in elements
        for st, buffers in shard_buffers:
            key = tuple(sorted(st.stage.ranks))
            for buf in buffers:
                a, b = buf.owned
                ranks = st.stage.ranks
                shard = _GradShard(stage=st.index, group=self.groups[key], ranges=buf.ranges, position=st.position,
                                   rank_order=tuple(sorted(range(len(ranks)), key=lambda j: ranks[j])),
                                   owned=(a, b), main=torch.zeros(b - a, dtype=torch.float32, device=buf.flat.device))
                canon_of = {id(p): c for c, p in st.params().items()}
                # Runs of parameters reduced over this stage's GPUs only, held once here, in buffer order
                # (forward order for a ZeRO-2 stage: StageOptimizer), as element ranges [start, end).
                runs, run = [], []
                for p, offset in buf.members:
                    c = canon_of[id(p)]
                    if holders[c] == key and len(copies[c]) == 1:
                        run.append((p, offset))
                    elif run:
                        runs.append(run)
                        run = []
                if run:
                    runs.append(run)
                # Buckets in backward order: from each run's end, ``cap`` elements each (the shard's first
                # ``first_cap``), cutting through parameters, so a bucket is never more than a cap.
                for run in reversed(runs):
                    lo_run, end = run[0][1], run[-1][1] + run[-1][0].numel()
                    while end > lo_run:
                        start = max(lo_run, end - (first_cap if not shard.buckets else cap))
                        pieces = [(p, max(start, off), min(end, off + p.numel())) for p, off in run
                                  if off < end and off + p.numel() > start]
                        shard.buckets.append(_ShardBucket(shard=shard, index=len(shard.buckets), start=start,
                                                          end=end, members=pieces))
                        end = start
                offset_of = {id(p): o for p, o in buf.members}
                for bk in shard.buckets:
                    for p, lo, hi in bk.members:
                        self._shard_of.setdefault(id(p), (shard, offset_of[id(p)], []))[2].append((bk, lo, hi))
                for p, _ in (m for run in runs for m in run):
                    p.register_post_accumulate_grad_hook(self._on_shard_grad)
                self.shards.append(shard)

    def _on_shard_grad(self, p: torch.Tensor) -> None:
        """ZeRO-2: ``p``'s gradient of one micro-batch is complete: copy each of
        its pieces into its bucket's reduction buffer, in launch order, launching
        each bucket it completes (so a parameter larger than a bucket goes out
        bucket by bucket, at most ``MAX_SHARD_BUCKETS_IN_FLIGHT`` in flight);
        free it."""
        shard, offset, pieces = self._shard_of[id(p)]
        flat = p.grad.reshape(-1)
        self._in_hook = True
        try:
            for bk, lo, hi in pieces:
                assert id(p) not in bk.marked, f"a gradient arrived twice in one backward (bucket {bk.index})"
                if bk.comm is None:  # (every range is written once: arrivals copy, the flush zeroes the rest)
                    bk.comm = torch.empty(bk.end - bk.start, dtype=self.precision.reduce_dtype, device=p.device)
                bk.comm[lo - bk.start: hi - bk.start].copy_(flat[lo - offset: hi - offset])  # (cast on the fly)
                bk.marked.add(id(p))
                self._launch_shards(shard)
        finally:
            self._in_hook = False
        p.grad = None

    def _launch_shards(self, shard: _GradShard, *, flush: bool = False) -> None:
        """Launch ``shard``'s complete buckets in bucket order (``flush``: every
        remaining one, its missing gradients zeros)."""
        while shard.next < len(shard.buckets):
            bk = shard.buckets[shard.next]
            if not flush and len(bk.marked) < len(bk.members):
                return
            comm = bk.comm if bk.comm is not None else torch.empty(
                bk.end - bk.start, dtype=self.precision.reduce_dtype, device=shard.main.device)
            for q, lo, hi in bk.members:  # parameters without a gradient this micro-batch add zeros
                if id(q) not in bk.marked:
                    comm[lo - bk.start: hi - bk.start].zero_()
            while len(self._in_flight) >= MAX_SHARD_BUCKETS_IN_FLIGHT:
                self._finish_oldest()
            # Per GPU of the stage, its owned part of the bucket (possibly empty): a reduce-scatter with
            # unequal parts (NCCL: torch's coalesced rooted reductions, reduce_scatter_v).
            parts = [comm[min(max(a, bk.start), bk.end) - bk.start: max(min(b, bk.end), bk.start) - bk.start]
                     for a, b in shard.ranges]
            mine = torch.empty_like(parts[shard.position])
            work = dist.reduce_scatter(mine, [parts[j] for j in shard.rank_order], op=dist.ReduceOp.SUM,
                                       group=shard.group, async_op=True)
            self._in_flight.append((bk, mine, work))
            bk.comm = None
            bk.marked.clear()
            shard.next += 1
            self.launched_during_backward += self._in_hook

    def _finish_oldest(self) -> None:
        """Wait for the oldest shard bucket in flight; its owner here adds its slice into the gradient shard."""
        bk, mine, work = self._in_flight.popleft()
        work.wait()
        shard = bk.shard
        a, b = shard.owned
        lo = max(a, bk.start)
        if mine.numel():
            shard.main[lo - a: lo - a + mine.numel()].add_(mine)

    def end_backward(self, stage: int) -> None:
        """A backward of ``stage`` ended: launch its shard buckets still waiting
        (parameters without a gradient in this micro-batch add zeros)."""
        for shard in self.shards:
            if shard.stage == stage:
                self._launch_shards(shard, flush=True)
                shard.next = 0  # the next micro-batch starts again at bucket 0

    def piece_grad(self, p: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of ``p``'s reduced, flattened gradient: for a
        ZeRO-2 parameter a view of this rank's gradient shard (the range must
        be owned here), else a slice of ``grad_of(p)``."""
        found = self._shard_of.get(id(p))
        if found is None:
            return self.grad_of(p).reshape(-1)[lo:hi]
        shard, offset, _ = found
        a, b = shard.owned
        assert a <= offset + lo and offset + hi <= b, "a ZeRO-2 gradient piece this rank does not own"
        return shard.main[offset + lo - a: offset + hi - a]

    def is_sharded(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s gradient lives in ZeRO-2 shards (``piece_grad``), not whole on this rank."""
        return id(p) in self._shard_of

    def shard_grads(self) -> list[torch.Tensor]:
        """This rank's float32 gradient shards (ZeRO-2; empty tensors left out)."""
        return [s.main for s in self.shards if s.main.numel()]

    def _grad_dtype(self, e: _Entry) -> torch.dtype:
        """The dtype of ``e``'s gradient bucket: float32 for a 16-bit working weight, else the parameter's."""
        p = e.copies[0][1]
        return torch.float32 if id(p) in self._low else p.dtype

    def grad_of(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s gradient: its float32 main gradient for a 16-bit working weight, else ``p.grad``."""
        return self.main_grads.get(id(p), p.grad)

    def _bucket(self, key, index, entries: list[_Entry]) -> _Bucket:
        p0 = entries[0].copies[0][1]
        n = sum(e.copies[0][1].numel() for e in entries)
        b = _Bucket(key=key, index=index, flat=torch.zeros(n, dtype=self._grad_dtype(entries[0]), device=p0.device),
                    entries=entries)
        offset = 0
        for e in entries:
            e.bucket, e.offset = b, offset
            offset += e.copies[0][1].numel()
        return b

    @property
    def num_buckets(self) -> int:
        return sum(len(b) for b in self.buckets.values()) + sum(len(s.buckets) for s in self.shards)

    # -- a step ------------------------------------------------------------------
    def start_step(self) -> None:
        """Zero the buckets and give every first copy its bucket view as ``.grad``."""
        for bs in self.buckets.values():
            for b in bs:
                b.flat.zero_()
                b.pending = len(b.entries)
                b.work, b.low = None, None
                for e in b.entries:
                    p = e.copies[0][1]
                    p.grad = None if id(p) in self._low else self._views[id(e)]
        for e in self.entries:
            e.ready.clear()
            for i, (_, p) in enumerate(e.copies):
                if e.bucket is None or i > 0:
                    p.grad = None
        assert not self._in_flight, "ZeRO-2 buckets of the last step are still in flight: wait() was not called"
        for shard in self.shards:
            shard.main.zero_()
            shard.next = 0
            for bk in shard.buckets:
                bk.marked.clear()
                bk.comm = None
                for p, *_ in bk.members:
                    p.grad = None
        self._next = dict.fromkeys(self.buckets, 0)
        self._launched.clear()
        self._final.clear()
        self.launched_during_backward = 0

    def begin_final(self, stage: int) -> None:
        """The backward of ``stage``'s last micro-batch starts: gradients that
        accumulate now are final."""
        self._final.add(stage)
        self._hooks[stage] = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._copies_of[stage]]

    def end_final(self, stage: int) -> None:
        """``stage``'s last backward ended: its parameters without a gradient
        are final too (zeros), so every bucket gets launched."""
        self._final.discard(stage)
        for h in self._hooks.pop(stage, ()):
            h.remove()
        for e in self.entries:
            for i, (s, p) in enumerate(e.copies):
                if s == stage and i not in e.ready:
                    if p.grad is None and id(p) not in self._low:  # (a main gradient is zeros already)
                        p.grad = torch.zeros_like(p)
                    self._mark(e, i)

    def _on_low_grad(self, p: torch.Tensor) -> None:
        """A 16-bit working weight's gradient of one micro-batch was accumulated:
        add it into the float32 main gradient (autocast's cast back to float32,
        then the float32 accumulation), free it, and mark it final during its
        stage's last backward."""
        self.main_grads[id(p)].add_(p.grad)
        p.grad = None
        self._on_grad(p)

    def _on_grad(self, p: torch.Tensor) -> None:
        """During its stage's last backward: ``p``'s copy is final."""
        e, i = self._by_copy[id(p)]
        if e.copies[i][0] in self._final and i not in e.ready:
            self._in_hook = True
            try:
                self._mark(e, i)
            finally:
                self._in_hook = False

    def _mark(self, e: _Entry, i: int) -> None:
        e.ready.add(i)
        if len(e.ready) < len(e.copies):
            return
        if e.bucket is not None:
            e.bucket.pending -= 1
            self._launch_ready(e.bucket.key)

    def _launch_ready(self, key) -> None:
        bs = self.buckets[key]
        while self._next[key] < len(bs) and bs[self._next[key]].pending == 0:
            b = bs[self._next[key]]
            self._next[key] += 1
            for e in b.entries:  # local copies in other stages of this rank: summed into the bucket
                view = self.grad_of(e.copies[0][1])
                for _, q in e.copies[1:]:
                    view.add_(q.grad)
            # A 16-bit reduction dtype applies to the float32 (master) gradients;
            # a parameter that is 16-bit itself is reduced in its own dtype, as DDP does.
            red = self.precision.reduce_dtype
            b.low = b.flat.to(red) if b.flat.dtype == torch.float32 and red != torch.float32 else None
            b.work = dist.all_reduce(b.flat if b.low is None else b.low, op=dist.ReduceOp.SUM,
                                     group=self.groups[key], async_op=True)
            self._launched.append(b)
            self.launched_during_backward += self._in_hook

    def wait(self) -> None:
        """Wait for every launched bucket (in launch order), write the sums back
        into every local copy; sum the copies of rank-local tied parameters."""
        for key, bs in self.buckets.items():
            assert self._next[key] == len(bs), (
                f"bucket {self._next[key]} of {len(bs)} for ranks {key} was never launched: a stage's last "
                f"backward did not run end_final")
        for shard in self.shards:
            assert shard.next == 0, (f"ZeRO-2 bucket {shard.next} of stage {shard.stage} was never launched: a "
                                     f"backward of the stage did not run end_backward")
        while self._in_flight:
            self._finish_oldest()
        for b in self._launched:
            b.work.wait()
            if b.low is not None:
                b.flat.copy_(b.low)
                b.low = None
            for e in b.entries:
                for _, q in e.copies[1:]:
                    q.grad.copy_(self.grad_of(e.copies[0][1]))
        for e in self.entries:
            if e.bucket is None:  # held by this rank only, in several of its stages
                first = e.copies[0][1]
                for _, q in e.copies[1:]:
                    first.grad.add_(q.grad)
                for _, q in e.copies[1:]:
                    q.grad.copy_(first.grad)
