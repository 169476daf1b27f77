"""ZeRO-3: a stage's parameters sharded over its GPUs, gathered block by block.

[Note: sharded parameters]
A stage with ``StagePlan.param_sharded`` (it needs ZeRO-2, [Note: sharded
gradients] in ``grad_sync.py``) keeps, between uses, only this GPU's ZeRO-1
range of its working weights: the optimizer's buffer of each dtype is
``owned`` elements long instead of the stage's (``_FlatBuffer.flat`` is the
owned range, [Note: ZeRO-1 with unequal shards] in ``optimizer.py``), so a
GPU holds ``w_j / sum(w)`` of the stage's weights, its state share, however
unequal. What is resident per parameter element: owned / n x (working bytes
+ float32 gradient shard + AdamW state + float32 master for 16-bit working
weights), plus at most three gathered units.

Units: codegen groups the stage's trainable parameters by the block of the
model that reads them first (``StageProgram.param_units``, ``UNITS`` in the
stage source) and calls ``self.zorse_gather(u)`` before unit ``u``'s first
read in ``forward`` and ``self.zorse_release(u)`` after its last. In the
buffer of each dtype the parameters lie in unit order (then first use), so a
unit is one element range ``[c0, c1)`` of each buffer. Its working weights
live in one tensor per dtype, allocated for the gather and freed after
(``untyped_storage().resize_``, as FSDP does: the parameters stay views of
the same storage, so anything holding them sees the values again once it is
re-gathered).

What moves, per micro-batch, on the stage's GPUs:
- forward: each unit is gathered before its first read and the next unit's
  gather is launched at once (prefetch: one unit in flight while one
  computes), then freed after its last read;
- backward: autograd saves the weights it needs for the backward; a
  ``saved_tensors_hooks`` pair records, for a saved tensor whose storage is
  a gathered unit's, that unit, and re-gathers it when the backward unpacks
  the tensor (and prefetches the unit before it, which the backward reaches
  next); a unit is freed once every one of its parameters' gradients has
  been accumulated (``register_post_accumulate_grad_hook``), and every unit
  at the end of the stage's backward;
- gradients: ZeRO-2's reduce-scatters, unchanged.
So each unit is gathered twice per micro-batch (three times with
recomputation, whose first forward runs under ``no_grad``): 2M all-gathers of
the stage's working weights per step, against ZeRO-1's one after the step.

The collective ([Note: unequal all-gather] below, ``all_gather_unequal``):
every GPU contributes the overlap of its owned range with ``[c0, c1)`` (none,
some or all of it), so the parts are unequal. NCCL: one ``dist.all_gather``
with unequal output tensors, which torch runs as one broadcast per GPU
coalesced in a single NCCL group (``ProcessGroupNCCL::allgather``'s unequal
branch): every link carries what a ring all-gather carries, no padding.
Gloo requires equal parts for ``all_gather``; it gets one broadcast per
non-empty part. Every GPU of the stage issues the same gathers in the same
order: the forward's order is the source's, the backward's is autograd's,
which is the same for the same graph on every rank (row counts differ, the
graph does not).

Autocast caches the 16-bit copy of a float32 weight it casts for the whole
autocast region, which would keep every weight of a ZeRO-3 stage resident in
16 bits; the planner therefore pairs ZeRO-3 with 16-bit working weights
under a mixed policy (``StagePlan.low_precision_params``: the weights
autocast casts), which autocast does not copy.

Checkpoints save each GPU's owned range of every parameter
(``model/<name>/<a>-<b>``) and load by range (``load_values``): no GPU holds
a whole stage for it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import RuntimeExecutionError

__all__ = ["ParamShards", "all_gather_unequal"]

_RELEASED, _IN_FLIGHT, _GATHERED = 0, 1, 2


def all_gather_unequal(parts: list[torch.Tensor], position: int, group, ranks: tuple[int, ...]) -> list:
    """All-gather over ``group`` where GPU ``j`` (of the stage, in stage
    order; global rank ``ranks[j]``) contributes ``parts[j]``, of any size,
    0 included. On entry ``parts[position]`` holds this rank's values; on
    completion every part holds its owner's. Returns the asynchronous works.

    [Note: unequal all-gather]
    NCCL: one ``dist.all_gather`` with the parts as outputs in the group's
    rank order (``new_group`` sorts ranks), which torch runs for unequal
    sizes as broadcasts coalesced in one NCCL group: the bytes of one ring
    all-gather, no padding to the largest part. Gloo, whose all-gather needs
    equal sizes: one broadcast per non-empty part. Where a part is empty (a
    unit inside fewer GPUs' ranges, often one: then one broadcast moves it)
    NCCL gets the broadcasts too, so no zero-byte collective is issued.
    """
    if dist.get_backend(group) == "nccl" and all(p.numel() for p in parts):
        order = sorted(range(len(ranks)), key=lambda j: ranks[j])
        return [dist.all_gather([parts[j] for j in order], parts[position], group=group, async_op=True)]
    return [dist.broadcast(parts[j], src=ranks[j], group=group, async_op=True)
            for j in range(len(parts)) if parts[j].numel()]


@dataclass(slots=True, eq=False)
class _Unit:
    index: int
    params: list[torch.nn.Parameter]
    #: Per dtype buffer touched: (buffer, c0, c1, working-weight tensor of elements [c0, c1)).
    pieces: list[tuple[object, int, int, torch.Tensor]]
    state: int = _RELEASED
    works: list = field(default_factory=list)
    #: Parameters whose gradient of the running backward has been accumulated.
    done: set[int] = field(default_factory=set)


class _Saved:
    """A tensor autograd saved whose storage is unit ``unit``'s working weights."""

    __slots__ = ("unit", "tensor")

    def __init__(self, unit: int, tensor: torch.Tensor):
        self.unit, self.tensor = unit, tensor


class ParamShards:
    """ZeRO-3 for one hosted stage (see the note).

    Args:
        stage: the stage's ``StageRuntime``; its module's ``UNITS`` (flat
            names per unit) say which parameters form each unit.
        buffers: the optimizer's ``_FlatBuffer`` per dtype, members in unit
            order, ``flat`` the owned range holding the loaded values.
        group: the process group of the stage's ranks.

    Raises:
        RuntimeExecutionError: the stage source has no ``UNITS`` (written by
            a zorse_fx before ZeRO-3): re-export the plan.
    """

    def __init__(self, stage, buffers, group):
        units = getattr(type(stage.module), "UNITS", None)
        if units is None:
            raise RuntimeExecutionError(
                f"stage {stage.index}: the plan shards its parameters (param_sharded) but its source "
                f"{stage.stage.source_file} has no UNITS (written before ZeRO-3); re-export the plan with `zorse plan`")
        self.stage = stage
        self.group = group
        #: id(parameter) -> its owned (start, end, values) pieces, built at the first ``load_values``.
        self._owned_by_param: dict[int, list] | None = None
        self.ranks = stage.stage.ranks
        self.position = stage.position
        module = stage.module
        unit_of: dict[int, int] = {}
        for u, flats in enumerate(units):
            for flat in flats:
                if flat in stage.stage.params:
                    unit_of.setdefault(id(getattr(module, flat)), u)
        n_units = len(units) + 1  # (+1: parameters the forward never reads, never gathered)
        members: list[list] = [[] for _ in range(n_units)]
        for buf in buffers:
            for p, offset in buf.members:
                members[unit_of.get(id(p), n_units - 1)].append((buf, p, offset))
        self.units: list[_Unit] = []
        with torch.no_grad():
            for u in range(n_units):
                pieces, params = [], []
                for buf in buffers:
                    mine = [(p, off) for b, p, off in members[u] if b is buf]
                    if not mine:
                        continue
                    c0, c1 = mine[0][1], mine[-1][1] + mine[-1][0].numel()
                    if c1 - c0 != sum(p.numel() for p, _ in mine):
                        raise AssertionError(f"stage {stage.index}: unit {u} is not contiguous in its {buf.dtype} buffer")
                    work = torch.empty(c1 - c0, dtype=buf.dtype, device=buf.flat.device)
                    for p, off in mine:
                        p.data = work[off - c0: off - c0 + p.numel()].view(p.shape)
                        params.append(p)
                    pieces.append((buf, c0, c1, work))
                self.units.append(_Unit(index=u, params=params, pieces=pieces))
        self._unit_by_param = {id(p): unit for unit in self.units for p in unit.params}
        #: data_ptr of a gathered unit's working weights -> its index (what the pack hook looks up).
        self._ptr: dict[int, int] = {}
        for unit in self.units:
            self._free(unit)
            for p in unit.params:
                p.register_post_accumulate_grad_hook(self._on_grad)
        module.zorse_gather = self._forward_gather
        module.zorse_release = self._forward_release
        #: Gathers launched so far (a count for tests and the step report).
        self.gathers = 0

    # -- gather / free -----------------------------------------------------------
    def _launch(self, unit: _Unit) -> None:
        if unit.state != _RELEASED:
            return
        for buf, c0, c1, work in unit.pieces:
            work.untyped_storage().resize_(work.numel() * work.element_size())
            parts = []
            for a, b in buf.ranges:
                lo, hi = max(a, c0), min(b, c1)
                parts.append(work[lo - c0: hi - c0] if lo < hi else work[:0])
            a, b = buf.owned
            lo, hi = max(a, c0), min(b, c1)
            if lo < hi:
                parts[self.position].copy_(buf.flat[lo - a: hi - a])
            unit.works += all_gather_unequal(parts, self.position, self.group, self.ranks)
        unit.state = _IN_FLIGHT
        self.gathers += 1

    def _wait(self, unit: _Unit) -> None:
        if unit.state == _IN_FLIGHT:
            for w in unit.works:
                w.wait()
            unit.works = []
            unit.state = _GATHERED
            for *_, work in unit.pieces:
                self._ptr[work.untyped_storage().data_ptr()] = unit.index

    def gather(self, u: int, *, prefetch: int | None = None) -> None:
        """Make unit ``u``'s working weights whole (waiting for them); launch unit ``prefetch``'s gather."""
        unit = self.units[u]
        self._launch(unit)
        if prefetch is not None and 0 <= prefetch < len(self.units) - 1:
            self._launch(self.units[prefetch])
        self._wait(unit)

    def _free(self, unit: _Unit) -> None:
        if unit.state == _IN_FLIGHT:
            self._wait(unit)
        for *_, work in unit.pieces:
            self._ptr.pop(work.untyped_storage().data_ptr(), None)
            work.untyped_storage().resize_(0)
        unit.state = _RELEASED
        unit.done.clear()

    def release(self, u: int) -> None:
        """Free unit ``u``'s working weights (its owned range stays in the optimizer's buffer)."""
        self._free(self.units[u])

    def release_all(self) -> None:
        for unit in self.units:
            if unit.state != _RELEASED:
                self._free(unit)

    # -- the hooks -------------------------------------------------------------------
    def _forward_gather(self, u: int) -> None:
        self.gather(u, prefetch=u + 1)

    def _forward_release(self, u: int) -> None:
        self.release(u)

    def _pack(self, t: torch.Tensor):
        u = self._ptr.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
        return t if u is None else _Saved(u, t)

    def _unpack(self, x):
        if isinstance(x, _Saved):
            if self.units[x.unit].state != _GATHERED:
                self.gather(x.unit, prefetch=x.unit - 1)
            return x.tensor
        return x

    def hooks(self):
        """The (pack, unpack) pair of ``saving``, for a caller that composes it with its own
        (activation offload: [Note: activation offload] in act_offload.py)."""
        return self._pack, self._unpack

    def saving(self):
        """The context a forward that autograd records runs in: saved working weights are re-gathered
        when the backward needs them."""
        return torch.autograd.graph.saved_tensors_hooks(*self.hooks())

    def _on_grad(self, p: torch.Tensor) -> None:
        unit = self._unit_by_param[id(p)]
        unit.done.add(id(p))
        if len(unit.done) == len(unit.params) and unit.state != _RELEASED:
            self._free(unit)

    def end_backward(self) -> None:
        """After a stage's backward: free every unit still gathered."""
        self.release_all()
        for unit in self.units:
            unit.done.clear()

    @contextlib.contextmanager
    def gathered(self):
        """Every unit gathered for the block (reading the whole parameters: tests, exports); freed
        after. Collective: every GPU of the stage enters it at the same point."""
        for u in range(len(self.units)):
            self.gather(u)
        try:
            yield
        finally:
            self.release_all()

    def summary(self) -> dict:
        """``units`` (those the forward reads), ``gathers`` launched so far, the bytes of working
        weights gathered now (0 between steps) and the owned bytes kept (this GPU's shard)."""
        return {"units": len(self.units) - 1, "gathers": self.gathers,
                "gathered_bytes": sum(w.untyped_storage().nbytes() for u in self.units for *_, w in u.pieces),
                "owned_weight_bytes": sum({id(b): b.flat.numel() * b.flat.element_size()
                                           for u in self.units for b, *_ in u.pieces}.values())}

    def owned_values(self) -> list[tuple[torch.nn.Parameter, int, int, torch.Tensor]]:
        """``(parameter, start, end, values)``: this GPU's owned elements ``[start, end)`` of each
        flattened parameter, views of the optimizer's buffers (what checkpoints save)."""
        out = []
        for unit in self.units:
            for buf, *_ in unit.pieces:
                a, b = buf.owned
                for p, off in buf.members:
                    if self._unit_by_param.get(id(p)) is not unit:
                        continue
                    lo, hi = max(a, off), min(b, off + p.numel())
                    if lo < hi:
                        out.append((p, lo - off, hi - off, buf.flat[lo - a: hi - a]))
        return out

    def load_values(self, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        """Set parameter ``p`` (whole value ``value``) where this GPU holds it: its owned range."""
        if self._owned_by_param is None:  # built once: a checkpoint load calls this per parameter
            self._owned_by_param = {}
            for q, lo, hi, t in self.owned_values():
                self._owned_by_param.setdefault(id(q), []).append((lo, hi, t))
        with torch.no_grad():
            flat = value.reshape(-1)
            for lo, hi, t in self._owned_by_param.get(id(p), ()):
                t.copy_(flat[lo:hi].to(device=t.device, dtype=t.dtype))
