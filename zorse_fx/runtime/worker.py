"""One rank of a plan: its stage module, its rows, its messages, its optimizer.

A step (``StageWorker.train_step``):

1. run the stage's schedule (1F1B or GPipe) over the micro-batches; each
   forward reads the model inputs for this GPU's rows, receives activations
   from the previous stage (see [Note: why activations are re-partitioned by
   sample range] in ``comm.py``), and sends its outputs on; each backward
   receives output gradients and returns input gradients the same way;
2. reduce gradients (see [Note: share-weighted gradients]);
3. AdamW step.

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
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..codegen.split import load_stage_class
from ..plan import Plan
from .comm import pack, routes, unpack
from .schedule import make_schedule

__all__ = ["StageWorker", "OptimizerConfig"]

#: Gradient all-reduce bucket size (bytes), as DDP's default 25 MiB.
BUCKET_BYTES = 25 * 1024 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerConfig:
    """AdamW hyper-parameters (``torch.optim.AdamW``)."""

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0


class StageWorker:
    """Executes one rank's part of ``plan``. Call on every rank of the world."""

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
        self.stage = plan.stages[self.role.stage]
        cls = load_stage_class(Path(plan_dir) / self.stage.source_file, self.stage.index)
        with torch.device("meta"):
            module = cls()
        module = module.to_empty(device=device)
        with torch.no_grad():
            for flat, canon in {**cls.PARAMETERS, **cls.CONSTANTS}.items():
                if canon not in weights:
                    raise KeyError(f"weights have no tensor {canon!r} needed by stage {self.stage.index}")
                getattr(module, flat).copy_(weights[canon])
        self.module = module
        self.schedule = make_schedule(plan.schedule, plan.num_stages, plan.num_microbatches)[self.stage.index]
        self.prev = plan.stages[self.stage.index - 1] if self.stage.index > 0 else None
        self.next = plan.stages[self.stage.index + 1] if self.stage.index + 1 < plan.num_stages else None
        # Routes from/to this GPU only (positions in the other stage).
        self.in_routes = (
            [r for r in routes(self.prev.sample_ranges(), self.stage.sample_ranges()) if r.dst_pos == self.role.position]
            if self.prev else []
        )
        self.out_routes = (
            [r for r in routes(self.stage.sample_ranges(), self.next.sample_ranges()) if r.src_pos == self.role.position]
            if self.next else []
        )
        self._build_groups()
        self.optimizer = torch.optim.AdamW(
            list(self.module.parameters()),
            lr=optimizer.lr,
            betas=optimizer.betas,
            eps=optimizer.eps,
            weight_decay=optimizer.weight_decay,
        )
        self._pending: list = []  # (work, buffer) of in-flight sends

    # -- process groups -----------------------------------------------------
    def _build_groups(self) -> None:
        """Create every reduction group on every rank, in one global order."""
        holders: dict[str, set[int]] = defaultdict(set)
        for s in self.plan.stages:
            for canon in s.params.values():
                holders[canon].update(s.ranks)
        keys = sorted({tuple(sorted(r)) for r in holders.values() if len(r) > 1})
        groups = {k: dist.new_group(list(k)) for k in keys}
        # Buckets: params of this rank grouped by their reduction group.
        by_group: dict[tuple[int, ...], list[torch.nn.Parameter]] = defaultdict(list)
        for flat, canon in self.stage.params.items():
            key = tuple(sorted(holders[canon]))
            if len(key) > 1:
                by_group[key].append(getattr(self.module, flat))
        self.reductions = [(groups[k], ps) for k, ps in sorted(by_group.items())]

    # -- point to point -----------------------------------------------------
    def _rank_of(self, stage, pos: int) -> int:
        return stage.gpus[pos].rank

    def _send(self, buf: torch.Tensor, dst: int, tag: int) -> None:
        self._pending.append((dist.isend(buf, dst, tag=tag), buf))

    def _recv(self, nbytes: int, src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dist.recv(buf, src, tag=tag)
        return buf

    def _recv_rows(self, specs, route_list, stage, pos_attr: str, tag: int) -> list[torch.Tensor]:
        """Receive one packed message per route; concatenate rows per tensor."""
        parts: list[list[torch.Tensor]] = [[] for _ in specs]
        for r in route_list:
            nbytes = r.rows * sum(s.bytes_per_sample for s in specs)
            buf = self._recv(nbytes, self._rank_of(stage, getattr(r, pos_attr)), tag)
            for i, t in enumerate(unpack(buf, specs, r.rows)):
                parts[i].append(t)
        return [torch.cat(p) if len(p) > 1 else p[0] for p in parts]

    # -- one step -----------------------------------------------------------
    def train_step(self, batch: dict[str, torch.Tensor]) -> float:
        """Run one training step on the global ``batch``; returns this rank's
        share-weighted loss contribution (sum over ranks = global mean loss)."""
        plan, role = self.plan, self.role
        mb = plan.microbatch_size
        weight = (role.row_end - role.row_start) / plan.global_batch_size
        stash: dict[int, tuple[list[torch.Tensor], object]] = {}
        loss_sum = 0.0
        t_start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        for action in self.schedule:
            m = action.microbatch
            if action.kind == "F":
                lo, hi = m * mb + role.row_start, m * mb + role.row_end
                inputs = [batch[name][lo:hi].to(self.device) for name in self.stage.input_names]
                received: list[torch.Tensor] = []
                if self.prev is not None:
                    received = self._recv_rows(self.stage.recv, self.in_routes, self.prev, "src_pos", tag=m)
                    for t in received:
                        if t.is_floating_point():
                            t.requires_grad_(True)
                with torch.device(self.device):
                    out = self.module(*inputs, *received)
                if self.next is None:
                    stash[m] = (received, out)
                    loss_sum += float(out.detach()) * weight
                else:
                    outs = list(out)
                    for r in self.out_routes:
                        a, b = r.start - role.row_start, r.end - role.row_start
                        self._send(pack([o.detach() for o in outs], a, b), self._rank_of(self.next, r.dst_pos), tag=m)
                    stash[m] = (received, outs)
            else:
                received, out = stash.pop(m)
                if self.next is None:
                    (out * weight).backward()
                else:
                    grads = self._recv_rows(self.stage.send, self.out_routes, self.next, "dst_pos", tag=m)
                    pairs = [(o, g) for o, g in zip(out, grads) if o.requires_grad]
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                if self.prev is not None:
                    gin = [
                        t.grad if t.grad is not None else torch.zeros_like(t)
                        for t in received
                        if t.is_floating_point()
                    ]
                    specs = [s for s in self.stage.recv if s.torch_dtype.is_floating_point]
                    assert len(specs) == len(self.stage.recv), "non-float tensors cannot cross a cut yet"
                    for r in self.in_routes:
                        a, b = r.start - role.row_start, r.end - role.row_start
                        self._send(pack(gin, a, b), self._rank_of(self.prev, r.src_pos), tag=m)
        t_pipeline = time.perf_counter()
        self._reduce_gradients()
        t_reduce = time.perf_counter()
        self.optimizer.step()
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        t_end = time.perf_counter()
        #: Seconds of the last step: pipeline (compute + waits for messages),
        #: gradient all-reduce, optimizer step.
        self.last_breakdown = {"pipeline_s": t_pipeline - t_start, "allreduce_s": t_reduce - t_pipeline,
                               "optimizer_s": t_end - t_reduce}
        return loss_sum

    def _reduce_gradients(self) -> None:
        """Bucketed all-reduce (SUM) of the share-weighted gradients."""
        for group, params in self.reductions:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            bucket: list[torch.Tensor] = []
            size = 0
            for p in params + [None]:
                if p is not None:
                    bucket.append(p.grad)
                    size += p.grad.numel() * p.grad.element_size()
                if bucket and (p is None or size >= BUCKET_BYTES):
                    flat = _flatten_dense_tensors(bucket)
                    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
                    for g, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                        g.copy_(synced)
                    bucket, size = [], 0

    def gradients(self) -> dict[str, torch.Tensor]:
        """Current gradients by canonical parameter name (after reduction)."""
        return {
            canon: getattr(self.module, flat).grad.detach().clone()
            for flat, canon in self.stage.params.items()
            if getattr(self.module, flat).grad is not None
        }

    def parameters_by_name(self) -> dict[str, torch.Tensor]:
        return {canon: getattr(self.module, flat).detach().clone() for flat, canon in self.stage.params.items()}

