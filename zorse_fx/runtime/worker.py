"""One rank of a plan: its stage modules, its rows, its messages, its optimizers.

A rank hosts one stage, or ``v`` of them in an interleaved plan (see [Note: a
rank with several stages]); each hosted stage is a ``_Stage`` (module, routes,
optimizer, forward / backward of one micro-batch) and ``StageWorker`` is the
rank: its process groups, its schedule, its messages, its gradient reduction.

A step (``StageWorker.train_step``):

1. run the rank's GPU group's schedule (1F1B, GPipe or interleaved 1F1B) over
   the micro-batches, each action on the stage it names; each forward reads
   the model inputs for this GPU's rows, receives activations from the
   previous stage (see [Note: why activations are re-partitioned by sample
   range] in ``comm.py``), and sends its outputs on; each backward receives
   output gradients and returns input gradients the same way (a ``recompute``
   stage re-runs its forward first, see [Note: stage recomputation]);
2. reduce gradients (see [Note: share-weighted gradients]);
3. AdamW step, per hosted stage: on every parameter, or, for a ``sharded``
   stage with more than one GPU, on this rank's range of the stage's
   parameters only (one range per parameter dtype);
4. ``sharded`` stage: all-gather the updated parameters inside the stage's
   data-parallel group (see [Note: ZeRO-1 with unequal shards]).

[Note: share-weighted gradients]
The last stage computes, for GPU ``g`` and micro-batch ``m``, the mean loss
``l_{g,m}`` over its ``n_g`` samples. It back-propagates
``l_{g,m} * n_g / N`` (``N`` = global batch), i.e. each GPU's gradient is
weighted by its share of the samples. Summing over micro-batches and over the
GPUs of a data-parallel group (all-reduce SUM) then gives exactly the gradient
of the mean loss over the whole global batch, as single-device training
computes it, however unequal the shares are. (This is exact when every sample
has the same number of loss tokens, as with fixed-length LM sequences.)
Parameters held by several stages (tied embeddings) are reduced over the
union of their holders, which also sums the two stages' contributions.

[Note: ZeRO-1 with unequal shards]
A ``sharded`` stage (``StagePlan.sharded``) with ``k > 1`` GPUs keeps its
trainable parameters in one flat buffer per dtype (each parameter is a view
of the buffer of its dtype, in ``StagePlan.params`` order), so GPU ``j`` owns
one contiguous element range per buffer, sized in proportion to its
``state_shard_bytes`` (unequal on purpose: a GPU with more free memory holds
more state). What is stored per rank: the full parameters and full gradients
(ZeRO stage 1 shards only the optimizer state) and the AdamW moments
``exp_avg``/``exp_avg_sq`` of the owned elements only: ``2 x owned x 4``
bytes in fp32 instead of ``2 x n x 4``. The optimizer is handed one leaf view
per (parameter, owned range) overlap, ``p.detach().view(-1)[a:b]``; before
the step each view's ``.grad`` is set to the matching slice of ``p.grad``, so
the step writes straight into the parameter storage and nothing is copied.
What moves: the gradient all-reduce stays as it is (every rank needs the full
reduced gradient of its range, and tied parameters are reduced over the
union of their holders); after the step each owner broadcasts its range of
each flat buffer over a process group of the stage's ranks (one
``dist.broadcast`` per non-empty range, issued asynchronously then waited;
unequal ranges need no padding), which is an all-gather. Per parameter
element that is 2 x grad bytes (all-reduce) + 1 x param bytes (all-gather)
on the slowest link of the stage, what the planner's cost model charges.
Every update is element-wise (AdamW), so a sharded step equals the
replicated one. A tied parameter held by several stages is updated and
re-gathered by each holder stage on its own copy; the copies start equal
and receive the same reduced gradient, so they stay equal.

Mixed dtypes (e.g. fp32 parameters and a bf16 layer): one flat buffer per
dtype, buffers in the order of the dtype names (``str(dtype)``, e.g.
``torch.bfloat16`` before ``torch.float32``; the same on every rank). The
rule: each buffer of ``n_d`` elements is split by the plan's weights on its
own, GPU ``j`` owning ``StagePlan.shard_ranges(n_d)[j]``. So every GPU holds
the plan's fraction ``w_j / sum(w)`` (``w`` = ``state_shard_bytes``) of every
dtype's elements, hence of every dtype's AdamW state bytes (AdamW keeps its
moments in the parameter's dtype: ``2 x itemsize`` bytes per element) and of
the stage's total state bytes, up to one element per dtype from the
largest-remainder rounding; a GPU with weight 0 owns nothing in any buffer.
(One split of the concatenated buffers by bytes would give the same total
share but could hand a GPU a whole dtype and another none of it; a split per
buffer also keeps each buffer's all-gather balanced as the plan's shares
are.) A single-dtype stage is the special case of one buffer, the range
``StagePlan.shard_ranges(n)[j]`` of the stage's ``n`` elements.
``StageWorker.optimizer_state_summary`` reports the rule per buffer. The
gradient all-reduce buckets per dtype too (as DDP does), so a bf16 gradient
is reduced in bf16, not promoted to fp32.

[Note: stage recomputation]
A ``recompute`` stage (``StagePlan.recompute``, GPipe's re-materialisation)
runs each forward action under ``torch.no_grad()``: outputs are still sent on
and the last stage still records its loss, but no autograd graph is kept.
What is stored per in-flight micro-batch: the stage inputs only (this GPU's
rows of the model inputs, and the received tensors, detached) plus the RNG
state at the start of the forward (CPU, and the device's on CUDA). The
backward action restores that RNG state inside ``torch.random.fork_rng`` (as
``torch.utils.checkpoint`` does, so dropout masks match and the global RNG
stream is left as if no recompute had happened), re-runs the forward with
grad enabled on the stashed inputs (received floats ``requires_grad_``), and
back-propagates exactly as a stage without recomputation. Nothing extra
moves between ranks; the cost is one more forward per micro-batch.

[Note: a rank with several stages]
With ``Plan.interleave = v > 1`` a rank of GPU group ``p`` (of ``P``) hosts
the stages ``p, p + P, ..., p + (v - 1) P`` (``Plan.stages_of``), each a
``_Stage`` with its own module, routes, optimizer and stash; they share the
rank's rows (stage ``s >= P`` lists the GPUs and shares of stage ``s % P``),
its process groups and its message queue. What that takes:

- process groups are created once per rank, for the keys of every stage of
  the plan, in one sorted order on every rank (``dist.new_group`` is
  collective over the world), and shared by the rank's stages: a key is the
  same communicator on every rank, whichever stage uses it;
- the rank runs its group's list (``make_schedule(...)[p]``); action
  ``(kind, m, c)`` runs stage ``p + c P``;
- two ranks now exchange messages for several stage pairs (with ``P = 2``,
  group 0 sends stages 0 -> 1 and 2 -> 3 to group 1, group 1 sends stage
  1 -> 2 back to group 0), so a tag names the boundary, the micro-batch and
  the direction: ``(2 b + d) M + m`` for boundary ``b`` (stages ``b`` and
  ``b + 1``), ``d`` = 0 forward, 1 backward. Gloo matches a receive by (peer,
  tag) in posting order, so each receive gets exactly its message; sends stay
  asynchronous, so only the schedule's receives block, and the schedule is
  deadlock-free under blocking receives (``schedule.validate``). A message
  to the rank itself (stages ``b`` and ``b + 1`` on one group: ``P = 1``) is
  handed over in memory;
- gradients are reduced per canonical parameter: the copies one rank holds
  (a parameter tied between two of its stages) are summed locally, in stage
  order, then all-reduced over the union of the holders' ranks, then written
  back into every copy, which therefore stay equal. Reductions run key by
  key in sorted order, and within a key in one global parameter order (first
  appearance in the plan's stages), so every member issues the same
  collectives with the same buckets in the same order;
- optimizer steps and ZeRO-1 all-gathers run per stage, in stage order; a
  group's stages all have the group's ranks, so every member of a shard
  group issues the same broadcasts in the same order.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..codegen.split import load_stage_class
from ..plan import Plan, StagePlan
from .comm import pack, routes, unpack
from .schedule import make_schedule

__all__ = ["StageWorker", "OptimizerConfig"]

#: Gradient all-reduce bucket size (bytes), as DDP's default 25 MiB.
BUCKET_BYTES = 25 * 1024 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class _FlatBuffer:
    """ZeRO-1: the stage's parameters of one dtype as one flat buffer."""

    dtype: torch.dtype
    flat: torch.Tensor
    #: Per GPU of the stage (stage order): its range ``[a, b)`` of ``flat``.
    ranges: tuple[tuple[int, int], ...]
    #: This rank's range.
    owned: tuple[int, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerConfig:
    """AdamW hyper-parameters (``torch.optim.AdamW``)."""

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0


class _Messages:
    """The rank's point-to-point messages (see [Note: a rank with several stages])."""

    def __init__(self, rank: int, device: torch.device, num_microbatches: int):
        self.rank = rank
        self.device = device
        self.num_microbatches = num_microbatches
        self._pending: list = []  # (work, buffer) of in-flight sends
        self._local: dict[int, torch.Tensor] = {}  # tag -> message to this rank itself

    def tag(self, boundary: int, microbatch: int, backward: bool) -> int:
        """Unique per (boundary between stages ``boundary`` and ``boundary + 1``, micro-batch, direction)."""
        return (2 * boundary + int(backward)) * self.num_microbatches + microbatch

    def send(self, buf: torch.Tensor, dst: int, tag: int) -> None:
        if dst == self.rank:
            assert tag not in self._local, f"message {tag} to self sent twice"
            self._local[tag] = buf
        else:
            self._pending.append((dist.isend(buf, dst, tag=tag), buf))

    def recv(self, nbytes: int, src: int, tag: int) -> torch.Tensor:
        if src == self.rank:
            buf = self._local.pop(tag)
            assert buf.numel() == nbytes, f"message {tag} to self has {buf.numel()} bytes, expected {nbytes}"
            return buf
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dist.recv(buf, src, tag=tag)
        return buf

    def wait(self) -> None:
        """Wait for every send issued so far."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        assert not self._local, f"messages to self never received: tags {sorted(self._local)}"


class _Stage:
    """One stage hosted by this rank: its module, routes, optimizer and the
    forward / backward of one micro-batch on this GPU's rows."""

    def __init__(
        self,
        plan: Plan,
        index: int,
        plan_dir: Path,
        weights: dict[str, torch.Tensor],
        *,
        rank: int,
        device: torch.device,
        optimizer: OptimizerConfig,
        messages: _Messages,
        shard_group,
    ):
        self.plan = plan
        self.rank = rank
        self.device = device
        self.messages = messages
        self.stage: StagePlan = plan.stages[index]
        #: This GPU's position in the stage's data-parallel group and its rows of every micro-batch.
        self.position = self.stage.ranks.index(rank)
        self.row_start, self.row_end = self.stage.sample_ranges()[self.position]
        cls = load_stage_class(plan_dir / self.stage.source_file, self.stage.index)
        with torch.device("meta"):
            module = cls()
        module = module.to_empty(device=device)
        with torch.no_grad():
            for flat, canon in {**cls.PARAMETERS, **cls.CONSTANTS}.items():
                if canon not in weights:
                    raise KeyError(f"weights have no tensor {canon!r} needed by stage {self.stage.index}")
                getattr(module, flat).copy_(weights[canon])
        self.module = module
        self.prev = plan.stages[index - 1] if index > 0 else None
        self.next = plan.stages[index + 1] if index + 1 < plan.num_stages else None
        # Routes from/to this GPU only (positions in the other stage).
        self.in_routes = (
            [r for r in routes(self.prev.sample_ranges(), self.stage.sample_ranges()) if r.dst_pos == self.position]
            if self.prev else []
        )
        self.out_routes = (
            [r for r in routes(self.stage.sample_ranges(), self.next.sample_ranges()) if r.src_pos == self.position]
            if self.next else []
        )
        #: ZeRO-1 on this rank (see [Note: ZeRO-1 with unequal shards]).
        self.zero1 = self.stage.sharded and len(self.stage.gpus) > 1
        self.shard_group = shard_group if self.zero1 else None
        self._build_optimizer(optimizer)
        # Per in-flight micro-batch: (received, outputs), or with recomputation
        # (inputs, received, rng state) (see [Note: stage recomputation]).
        self._stash: dict[int, tuple] = {}

    def params(self) -> dict[str, torch.nn.Parameter]:
        """Trainable parameters by canonical name."""
        return {canon: getattr(self.module, flat) for flat, canon in self.stage.params.items()}

    # -- optimizer ----------------------------------------------------------
    def _build_optimizer(self, cfg: OptimizerConfig) -> None:
        """AdamW over every parameter, or over this rank's shard (ZeRO-1).

        ZeRO-1: one flat buffer per parameter dtype (dtype names in sorted
        order), each split by ``StagePlan.shard_ranges(n_d)`` on its own, so
        this rank owns the plan's share of every dtype's elements and state
        (see [Note: ZeRO-1 with unequal shards])."""
        kw = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
        params = [getattr(self.module, flat) for flat in self.stage.params]
        #: Trainable elements of the stage.
        self.stage_elements = sum(p.numel() for p in params)
        #: The stage's parameter dtypes, in buffer order (sorted by name).
        self.dtypes = sorted({p.dtype for p in params}, key=str)
        #: ZeRO-1: per dtype (buffer order), its flat buffer, the shard ranges of
        #: every GPU of the stage and this rank's range. Empty when not sharded.
        self.buffers: list[_FlatBuffer] = []
        #: ZeRO-1: (parameter, start, end, view) per overlap of a parameter with an owned range.
        self._pieces: list[tuple[torch.nn.Parameter, int, int, torch.Tensor]] = []
        if not self.zero1:
            self.optimizer = torch.optim.AdamW(list(self.module.parameters()), **kw)
            return
        pos = self.position
        with torch.no_grad():
            for dtype in self.dtypes:
                members = [p for p in params if p.dtype == dtype]
                n = sum(p.numel() for p in members)
                # Parameters become views of one flat buffer (stage order), so a range is one slice.
                flat = torch.empty(n, dtype=dtype, device=self.device)
                ranges = self.stage.shard_ranges(n)
                a, b = ranges[pos]
                offset = 0
                for p in members:
                    k = p.numel()
                    flat[offset : offset + k].copy_(p.detach().reshape(-1))
                    p.data = flat[offset : offset + k].view_as(p)
                    lo, hi = max(a, offset), min(b, offset + k)
                    if lo < hi:
                        self._pieces.append((p, lo - offset, hi - offset, p.detach().view(-1)[lo - offset : hi - offset]))
                    offset += k
                self.buffers.append(_FlatBuffer(dtype=dtype, flat=flat, ranges=ranges, owned=(a, b)))
        # A GPU may own no element (state_shard_bytes 0): it steps nothing and only receives.
        self.optimizer = torch.optim.AdamW([v for *_, v in self._pieces], **kw) if self._pieces else None

    def optimizer_step(self) -> None:
        if not self.zero1:
            self.optimizer.step()
            return
        if self.optimizer is None:
            return
        for p, lo, hi, view in self._pieces:
            view.grad = p.grad.reshape(-1)[lo:hi]
        self.optimizer.step()
        for *_, view in self._pieces:
            view.grad = None  # do not keep last step's gradients alive

    def allgather_parameters(self) -> list:
        """ZeRO-1: each owner broadcasts its updated range of every buffer over
        the stage's group; returns the asynchronous works (none when not sharded)."""
        if not self.zero1:
            return []
        return [
            dist.broadcast(buf.flat[a:b], src=self.stage.gpus[j].rank, group=self.shard_group, async_op=True)
            for buf in self.buffers
            for j, (a, b) in enumerate(buf.ranges)
            if b > a
        ]

    def optimizer_state_summary(self) -> dict:
        """See ``StageWorker.optimizer_state_summary``."""
        by_dtype: dict[torch.dtype, int] = defaultdict(int)
        if self.optimizer is not None:
            for param, st in self.optimizer.state.items():
                for key, t in st.items():
                    if key != "step" and torch.is_tensor(t):
                        by_dtype[param.dtype] += t.numel() * t.element_size()
        params = [getattr(self.module, flat) for flat in self.stage.params]
        buffers = []
        for dtype in self.dtypes:
            n = sum(p.numel() for p in params if p.dtype == dtype)
            a, b = next((buf.owned for buf in self.buffers if buf.dtype == dtype), (0, n))
            buffers.append({"dtype": str(dtype).removeprefix("torch."), "elements": n, "owned_range": [a, b],
                            "owned_elements": b - a, "optimizer_state_bytes": by_dtype.get(dtype, 0)})
        owned = sum(d["owned_elements"] for d in buffers)
        if not self.zero1:
            owned_range = [0, self.stage_elements]
        elif len(buffers) == 1:
            owned_range = buffers[0]["owned_range"]
        else:
            owned_range = None
        return {"rank": self.rank, "stage": self.stage.index, "sharded": self.zero1,
                "stage_elements": self.stage_elements, "owned_range": owned_range, "owned_elements": owned,
                "optimizer_state_bytes": sum(by_dtype.values()), "buffers": buffers}

    # -- recomputation -------------------------------------------------------
    def _rng_state(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    @contextlib.contextmanager
    def _replayed_rng(self, state: tuple[torch.Tensor, torch.Tensor | None]):
        """Run the block with the RNG as it was at the first forward; restore after."""
        cpu, cuda = state
        with torch.random.fork_rng(devices=[self.device] if cuda is not None else []):
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, self.device)
            yield

    # -- point to point -----------------------------------------------------
    def _recv_rows(self, specs, route_list, stage, pos_attr: str, tag: int) -> list[torch.Tensor]:
        """Receive one packed message per route; concatenate rows per tensor."""
        parts: list[list[torch.Tensor]] = [[] for _ in specs]
        for r in route_list:
            nbytes = r.rows * sum(s.bytes_per_sample for s in specs)
            buf = self.messages.recv(nbytes, stage.gpus[getattr(r, pos_attr)].rank, tag)
            for i, t in enumerate(unpack(buf, specs, r.rows)):
                parts[i].append(t)
        return [torch.cat(p) if len(p) > 1 else p[0] for p in parts]

    # -- one micro-batch ------------------------------------------------------
    def start_step(self) -> None:
        self.module.zero_grad(set_to_none=True)
        self._stash.clear()

    def forward(self, m: int, batch: dict[str, torch.Tensor]) -> float:
        """Forward of micro-batch ``m``; returns its share-weighted loss on the last stage, else 0."""
        plan, msg = self.plan, self.messages
        mb = plan.microbatch_size
        last = self.next is None
        recompute = self.stage.recompute
        lo, hi = m * mb + self.row_start, m * mb + self.row_end
        inputs = [batch[name][lo:hi].to(self.device) for name in self.stage.input_names]
        received: list[torch.Tensor] = []
        if self.prev is not None:
            received = self._recv_rows(self.stage.recv, self.in_routes, self.prev, "src_pos",
                                       tag=msg.tag(self.prev.index, m, backward=False))
            if not recompute:
                for t in received:
                    if t.is_floating_point():
                        t.requires_grad_(True)
        if recompute:
            rng = self._rng_state()
            with torch.no_grad(), torch.device(self.device):
                out = self.module(*inputs, *received)
            self._stash[m] = (inputs, received, rng)
        else:
            with torch.device(self.device):
                out = self.module(*inputs, *received)
            self._stash[m] = (received, out if last else list(out))
        if last:
            return float(out.detach()) * (self.row_end - self.row_start) / plan.global_batch_size
        outs = list(out)
        for r in self.out_routes:
            a, b = r.start - self.row_start, r.end - self.row_start
            msg.send(pack([o.detach() for o in outs], a, b), self.next.gpus[r.dst_pos].rank,
                     tag=msg.tag(self.stage.index, m, backward=False))
        return 0.0

    def backward(self, m: int) -> None:
        """Backward of micro-batch ``m``: receive output gradients, send input gradients."""
        plan, msg = self.plan, self.messages
        last = self.next is None
        if self.stage.recompute:
            inputs, received, rng = self._stash.pop(m)
            for t in received:
                if t.is_floating_point():
                    t.requires_grad_(True)
            with self._replayed_rng(rng), torch.enable_grad(), torch.device(self.device):
                out = self.module(*inputs, *received)
            out = out if last else list(out)
        else:
            received, out = self._stash.pop(m)
        if last:
            (out * ((self.row_end - self.row_start) / plan.global_batch_size)).backward()
        else:
            grads = self._recv_rows(self.stage.send, self.out_routes, self.next, "dst_pos",
                                    tag=msg.tag(self.stage.index, m, backward=True))
            pairs = [(o, g) for o, g in zip(out, grads) if o.requires_grad]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if self.prev is not None:
            gin = [t.grad if t.grad is not None else torch.zeros_like(t) for t in received if t.is_floating_point()]
            specs = [s for s in self.stage.recv if s.torch_dtype.is_floating_point]
            assert len(specs) == len(self.stage.recv), "non-float tensors cannot cross a cut yet"
            for r in self.in_routes:
                a, b = r.start - self.row_start, r.end - self.row_start
                msg.send(pack(gin, a, b), self.prev.gpus[r.src_pos].rank,
                         tag=msg.tag(self.prev.index, m, backward=True))


class StageWorker:
    """Executes one rank's part of ``plan``: every stage the rank hosts
    (``plan.stages_of(rank)``, see [Note: a rank with several stages]).
    Call on every rank of the world."""

    def __init__(
        self,
        plan: Plan,
        plan_dir: str | Path,
        weights: dict[str, torch.Tensor],
        *,
        rank: int,
        device: torch.device,
        optimizer: OptimizerConfig = OptimizerConfig(),
    ):
        self.plan = plan
        self.rank = rank
        self.device = device
        self.role = plan.role(rank)
        #: The rank's GPU group (= its first stage).
        self.group = self.role.stage
        self.schedule = make_schedule(plan.schedule, plan.num_stages, plan.num_microbatches,
                                      plan.interleave)[self.group]
        self.messages = _Messages(rank, device, plan.num_microbatches)
        self._build_groups()
        #: The stages this rank hosts, in stage order.
        self.stages: list[_Stage] = []
        for index in plan.stages_of(rank):
            s = plan.stages[index]
            shard_key = tuple(sorted(s.ranks))
            self.stages.append(_Stage(
                plan, index, Path(plan_dir), weights, rank=rank, device=device, optimizer=optimizer,
                messages=self.messages, shard_group=self._groups.get(shard_key) if len(shard_key) > 1 else None))
        self._by_index = {st.stage.index: st for st in self.stages}
        self._build_reductions()

    @property
    def stage(self) -> StagePlan:
        """The rank's first stage (its only one without interleaving)."""
        return self.stages[0].stage

    @property
    def module(self) -> torch.nn.Module:
        """The first stage's module (its only one without interleaving)."""
        return self.stages[0].module

    # -- process groups -----------------------------------------------------
    def _build_groups(self) -> None:
        """Create every reduction / all-gather group of the plan on every rank,
        once, in one global order (shared by the rank's stages)."""
        holders: dict[str, set[int]] = defaultdict(set)
        for s in self.plan.stages:
            for canon in s.params.values():
                holders[canon].update(s.ranks)
        #: Canonical name -> the ranks holding it (sorted), every stage of the plan.
        self._holders = {canon: tuple(sorted(r)) for canon, r in holders.items()}
        keys = {k for k in self._holders.values() if len(k) > 1}
        # All-gather groups of the sharded stages (often equal to a reduction group: shared).
        keys |= {tuple(sorted(s.ranks)) for s in self.plan.stages if s.sharded and len(s.gpus) > 1}
        self._groups = {k: dist.new_group(list(k)) for k in sorted(keys)}

    def _build_reductions(self) -> None:
        """Per reduction key (sorted), the rank's copies of each parameter with
        that key, in one global parameter order (first appearance in the plan)."""
        copies: dict[str, list[torch.nn.Parameter]] = defaultdict(list)
        for st in self.stages:
            for canon, p in st.params().items():
                copies[canon].append(p)
        by_key: dict[tuple[int, ...], list[list[torch.nn.Parameter]]] = defaultdict(list)
        for canon in self._holders:  # dicts keep insertion order: plan stage order, then parameter order
            if canon in copies and (len(self._holders[canon]) > 1 or len(copies[canon]) > 1):
                by_key[self._holders[canon]].append(copies[canon])
        #: (process group or None for a rank-local sum, [copies of one parameter, ...]) per key.
        self.reductions = [(self._groups[k] if len(k) > 1 else None, entries) for k, entries in sorted(by_key.items())]

    # -- one step -----------------------------------------------------------
    def train_step(self, batch: dict[str, torch.Tensor]) -> float:
        """Run one training step on the global ``batch``; returns this rank's
        share-weighted loss contribution (sum over ranks = global mean loss)."""
        P = self.plan.num_groups
        loss_sum = 0.0
        t_start = time.perf_counter()
        for st in self.stages:
            st.start_step()
        for action in self.schedule:
            st = self._by_index[self.group + action.chunk * P]
            if action.kind == "F":
                loss_sum += st.forward(action.microbatch, batch)
            else:
                st.backward(action.microbatch)
        t_pipeline = time.perf_counter()
        self._reduce_gradients()
        t_reduce = time.perf_counter()
        for st in self.stages:
            st.optimizer_step()
        t_step = time.perf_counter()
        works = [w for st in self.stages for w in st.allgather_parameters()]
        for w in works:
            w.wait()
        t_gather = time.perf_counter()
        self.messages.wait()
        t_end = time.perf_counter()
        #: Seconds of the last step: pipeline (compute + waits for messages),
        #: gradient all-reduce, optimizer step (+ waits for the last sends),
        #: parameter all-gather (ZeRO-1 stages; 0 otherwise), all of the rank's stages.
        self.last_breakdown = {"pipeline_s": t_pipeline - t_start, "allreduce_s": t_reduce - t_pipeline,
                               "optimizer_s": (t_step - t_reduce) + (t_end - t_gather),
                               "allgather_s": t_gather - t_step}
        return loss_sum

    def _reduce_gradients(self) -> None:
        """Sum the rank's copies of each parameter, then bucketed all-reduce
        (SUM) of the share-weighted gradients over the holders' ranks, one
        dtype at a time (dtype names in sorted order) so a bucket never mixes
        dtypes (flattening would promote bf16 gradients to fp32); then every
        copy gets the result (see [Note: a rank with several stages])."""
        for group, entries in self.reductions:
            for copies in entries:
                for p in copies:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                for p in copies[1:]:
                    copies[0].grad.add_(p.grad)
            if group is not None:
                for dtype in sorted({c[0].dtype for c in entries}, key=str):
                    bucket: list[torch.Tensor] = []
                    size = 0
                    same = [c[0] for c in entries if c[0].dtype == dtype]
                    for p in same + [None]:
                        if p is not None:
                            bucket.append(p.grad)
                            size += p.grad.numel() * p.grad.element_size()
                        if bucket and (p is None or size >= BUCKET_BYTES):
                            flat = _flatten_dense_tensors(bucket)
                            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
                            for g, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                                g.copy_(synced)
                            bucket, size = [], 0
            for copies in entries:
                for p in copies[1:]:
                    p.grad.copy_(copies[0].grad)

    # -- inspection -----------------------------------------------------------
    def _merged(self, per_stage, what: str, same) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for st, tensors in zip(self.stages, per_stage):
            for canon, t in tensors.items():
                if canon in out:
                    if not same(out[canon], t):
                        raise AssertionError(f"rank {self.rank}: the copies of {canon!r} held by its stages "
                                             f"{[s.stage.index for s in self.stages]} have different {what}")
                else:
                    out[canon] = t
        return out

    def gradients(self) -> dict[str, torch.Tensor]:
        """Current gradients by canonical parameter name (after reduction),
        over the rank's stages (a parameter two of them hold appears once)."""
        per_stage = [{canon: p.grad.detach().clone() for canon, p in st.params().items() if p.grad is not None}
                     for st in self.stages]
        return self._merged(per_stage, "gradients", torch.equal)

    def parameters_by_name(self) -> dict[str, torch.Tensor]:
        """Parameters by canonical name over the rank's stages (one per name)."""
        per_stage = [{canon: p.detach().clone() for canon, p in st.params().items()} for st in self.stages]
        return self._merged(per_stage, "values", lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=0))

    def optimizer_state_summary(self) -> dict:
        """Elements owned and bytes of AdamW state held (moments; the scalar
        ``step`` counters are not counted), after at least one step.

        The top-level keys describe the rank's first stage (its only one
        without interleaving); ``stages`` lists the same record for every
        stage the rank hosts, in stage order. Per stage:

        ``owned_elements`` / ``optimizer_state_bytes``: totals over dtypes.
        ``owned_range``: this rank's range of the stage's elements when the
        stage has one buffer (one dtype, or not sharded: all of them); None
        for a sharded stage with several dtypes, whose ranges are per dtype.
        ``buffers``: per dtype (buffer order), ``elements`` (n_d), this rank's
        ``owned_range`` = ``StagePlan.shard_ranges(n_d)[position]`` (all
        ``[0, n_d]`` when not sharded), ``owned_elements`` and the
        ``optimizer_state_bytes`` of that dtype's parameters (``2 x owned x
        itemsize`` for AdamW)."""
        summaries = [st.optimizer_state_summary() for st in self.stages]
        return {**summaries[0], "stages": summaries}
