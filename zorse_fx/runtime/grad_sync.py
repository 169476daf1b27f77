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
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..ir.buckets import bucket_caps
from ..plan import Plan
from ..precision import PrecisionPolicy
from .stage import StageRuntime

__all__ = ["GradientReducer", "holders_of"]

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


class GradientReducer:
    """Reduces the gradients of one rank's stages (see [Note: overlapped
    gradient reduction]). ``groups``: process group per key (sorted ranks)
    with more than one rank; ``bucket_bytes``: bucket size (default: the plan's)."""

    def __init__(self, plan: Plan, stages: list[StageRuntime], groups: dict[tuple[int, ...], object], *,
                 precision: PrecisionPolicy, bucket_bytes: int | None = None, main_grad=()):
        bucket_bytes = plan.grad_bucket_bytes if bucket_bytes is None else bucket_bytes
        self.precision = precision
        self.groups = groups
        #: 16-bit working weights (``StageOptimizer.low_params``): their gradients accumulate into float32
        #: main gradients, views of float32 buckets (see [Note: 16-bit working weights] in precision.py).
        low = {id(p) for p in main_grad}
        self._low = low
        holders = holders_of(plan)
        copies: dict[str, list[tuple[int, torch.nn.Parameter]]] = defaultdict(list)
        for st in stages:
            for canon, p in st.params().items():
                copies[canon].append((st.index, p))
        #: Entries of this rank, global order, that need a reduction or a local sum.
        self.entries: list[_Entry] = [
            _Entry(canon=c, copies=copies[c]) for c in holders
            if c in copies and (len(holders[c]) > 1 or len(copies[c]) > 1)]
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
        return sum(len(b) for b in self.buckets.values())

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
