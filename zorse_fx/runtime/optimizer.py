"""The optimizer side of a step: AdamW per hosted stage (over all its
parameters, or over this rank's ZeRO-1 shard), the ZeRO-1 all-gather, and the
fp16 loss scaler whose skip decision every rank shares.

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
union of their holders); after the step each owner's range of each flat buffer
goes to every GPU of the stage in one all-gather with unequal parts per
buffer ([Note: unequal all-gather] in ``param_shard.py``: one coalesced
NCCL group, no padding; one broadcast per non-empty range on Gloo). Per parameter
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
``StageOptimizer.state_summary`` reports the rule per buffer. The gradient
all-reduce buckets per dtype too (as DDP does), so a bf16 gradient is
reduced in bf16, not promoted to fp32.

16-bit working weights (``StagePlan.low_precision_params`` under a mixed
policy, [Note: 16-bit working weights] in ``zorse_fx/precision.py``): those
parameters form a buffer of the compute dtype (ordered among the others by
its name), split by the same rule; the rank keeps a float32 *master* of its
range of that buffer (``_FlatBuffer.master``, copied from the loaded float32
weights), and AdamW steps the masters, one leaf view per (parameter, owned
range) overlap as above, with the slices of the parameters' float32 main
gradients (``GradientReducer.grad_of``). After the step the masters'
rounding is written into the rank's range of the 16-bit buffer, which the
all-gather then broadcasts: 2 bytes per element instead of 4.

[Note: optimizer offload]
A stage with ``StagePlan.offload_optimizer`` (ZeRO-Offload's layout, Ren et
al., USENIX ATC 2021; [C-offload] in ``solve/objective.py``) keeps every
tensor AdamW steps in host memory: the float32 masters of its 16-bit working
weights are allocated there, and every other stepped tensor (a whole
parameter on a replicated stage, an owned range on a ZeRO-1 stage) gets a
host copy; AdamW's moments are created beside them, so they live there too
(pinned host memory when the stage is on a GPU, for the copies' speed). A
step: each stepped tensor's gradient (its float32 main gradient's range, or
its parameter's gradient) is copied to the host, ``torch.optim.AdamW`` steps
on the CPU, and the results are copied back into the GPU's weights (the
masters' rounding for 16-bit working weights, as without offload), after
which a ZeRO-1 stage all-gathers as usual. The copies and the CPU step run
in sequence, not overlapped with the next step's compute (what the planner
prices). The GPU keeps its weights and gradients: 8 B per parameter in
fp32 (float32 weight and gradient), 6 B per 16-bit working weight (its 2 B
weight and float32 gradient);
the host holds 12 B per stepped parameter (two moments and a master or a
float32 copy). AdamW is element-wise and runs the same arithmetic on the
CPU, so an offloaded step equals the on-GPU one up to the CPU's and GPU's
float32 rounding of the same operations. On the CPU it runs torch's fused
AdamW kernel, which ``bench/offload_cpu.py`` measured at about 0.4x the time
of streaming the same bytes, where the default foreach path takes 2.5x;
its arithmetic order differs from the reference's, within the float32
tolerances of the tests. A rank on a CPU (Gloo runs, the box) steps its
stage's float32 tensors with the same fused kernel: the default there is a Python loop over
the parameters, ~100 us per tensor (the box's 4-layer GPT, 52 tensors:
7.7 ms of a step where the profile's AdamW, timed on 32 tensors of 1 M
elements, priced 1.2 ms; bench/LOG.md 2026-12-07).
Any state layout: under ZeRO-2 the gradient of a stepped range is its
float32 gradient shard, under ZeRO-3 the write-back goes into the GPU's
owned range of the weights, which the next forward gathers.
Checkpoints save and load the host tensors as the GPU ones
(``state_pieces``, ``master_pieces``); after a load the host copies are
refreshed from the loaded weights (``refresh_host``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..precision import PrecisionPolicy
from ..train_options import OptimizerOptions
from .param_shard import ParamShards, all_gather_unequal
from .stage import StageRuntime

__all__ = ["OptimizerConfig", "StageOptimizer", "LossScaler"]

_DEFAULTS = OptimizerOptions()


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerConfig:
    """AdamW hyper-parameters (``torch.optim.AdamW``).

    ``weight_decay`` applies to matrices only (parameters of 2 or more
    dimensions: linear and embedding weights); norms, biases and every other
    1-D parameter are not decayed, as nanoGPT's ``configure_optimizers`` and
    Hugging Face's Trainer do (see ``decays``). ``lr`` is the peak learning
    rate; the training loop sets each step's rate (``runtime/lr_schedule.py``).
    The defaults are ``train_options.OptimizerOptions``'s (written once, there).
    """

    lr: float = _DEFAULTS.lr
    betas: tuple[float, float] = (_DEFAULTS.adam_beta1, _DEFAULTS.adam_beta2)
    eps: float = _DEFAULTS.adam_eps
    weight_decay: float = _DEFAULTS.weight_decay

    @classmethod
    def from_options(cls, options: OptimizerOptions) -> OptimizerConfig:
        """AdamW as ``options`` (``--lr``, ``--adam-beta1/2``, ``--adam-eps``, ``--weight-decay``) set it."""
        return cls(lr=options.lr, betas=(options.adam_beta1, options.adam_beta2), eps=options.adam_eps,
                   weight_decay=options.weight_decay)


def decays(param: torch.Tensor) -> bool:
    """Whether weight decay applies to ``param``: matrices (``dim() >= 2``) only."""
    return param.dim() >= 2


def param_groups(pairs, weight_decay: float) -> list[dict]:
    """AdamW parameter groups from ``(parameter, tensor the optimizer steps)``
    pairs: the decayed group (``weight_decay``) then the group without decay;
    an empty group is left out. The decision is made on ``parameter`` (a
    ZeRO-1 view of a matrix is 1-D but is decayed as its matrix)."""
    decay = [t for p, t in pairs if decays(p)]
    no_decay = [t for p, t in pairs if not decays(p)]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


@dataclass(frozen=True, slots=True, kw_only=True)
class _FlatBuffer:
    """ZeRO-1: the stage's parameters of one dtype as one flat buffer."""

    dtype: torch.dtype
    #: The buffer (ZeRO-3, ``StagePlan.param_sharded``: its owned range ``owned`` only).
    flat: torch.Tensor
    #: Per GPU of the stage (stage order): its range ``[a, b)`` of ``flat``.
    ranges: tuple[tuple[int, int], ...]
    #: This rank's range.
    owned: tuple[int, int]
    #: 16-bit working weights: the float32 masters of the owned range (None: the buffer is its own master).
    master: torch.Tensor | None = None
    #: The buffer's parameters in order, each with its offset in ``flat``.
    members: tuple[tuple[torch.nn.Parameter, int], ...] = ()


class StageOptimizer:
    """AdamW for one hosted stage: over every parameter, or, for a sharded
    stage of more than one GPU, over this rank's ranges (ZeRO-1, see the note).
    ``shard_group``: the process group of the stage's ranks (ZeRO-1 only)."""

    def __init__(self, stage: StageRuntime, cfg: OptimizerConfig, *, shard_group=None,
                 precision: PrecisionPolicy | None = None):
        self.stage = stage
        plan_stage = stage.stage
        memory = stage.memory  # the stage's memory policy (ir/memory.py)
        #: [Note: optimizer offload]: the stepped tensors and AdamW state in host memory.
        self.offload = memory.optimizer == "host"
        self.host = torch.device("cpu")
        #: Offload: (host tensor AdamW steps, the GPU tensor it is written back to) per copied tensor.
        self._host_copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: ZeRO-1 on this rank.
        self.zero1 = memory.zero >= 1 and len(plan_stage.gpus) > 1
        #: ZeRO-3: the stage's unit gathers ([Note: sharded parameters] in param_shard.py).
        self.param_shards: ParamShards | None = None
        self.shard_group = shard_group if self.zero1 else None
        kw = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
        if self.offload:  # the CPU's fused AdamW: ~5x the default foreach path here (bench/offload_cpu.py)
            kw["fused"] = True
        params = [getattr(stage.module, flat) for flat in plan_stage.params]
        #: 16-bit working weights (``StagePlan.low_precision_params``, under a mixed policy on a ZeRO-1
        #: stage): these parameters become the compute dtype, their float32 masters live in the shard.
        self.low_params: list[torch.nn.Parameter] = (
            [getattr(stage.module, flat) for flat in plan_stage.low_precision_params]
            if self.zero1 and precision is not None and precision.mixed else [])
        low = {id(p) for p in self.low_params}
        compute = precision.compute_dtype if low else None

        def working(p) -> torch.dtype:
            return compute if id(p) in low else p.dtype
        #: The gradient of a parameter: ``p.grad``, or for a 16-bit working weight its float32 main
        #: gradient (``GradientReducer.grad_of``; the worker sets it once the reducer exists).
        self.grad_of = lambda p: p.grad
        #: Elements ``[lo, hi)`` of a parameter's flattened gradient (a ZeRO-2 stage's: a view of this
        #: rank's float32 gradient shard, ``GradientReducer.piece_grad``; the worker sets it).
        self.piece_grad = lambda p, lo, hi: self.grad_of(p).reshape(-1)[lo:hi]
        #: Canonical name of each trainable parameter (by id).
        self.canonical = {id(getattr(stage.module, flat)): canon for flat, canon in plan_stage.params.items()}
        self.params = params
        #: Trainable elements of the stage.
        self.stage_elements = sum(p.numel() for p in params)
        #: The stage's parameter dtypes (16-bit working weights: the compute dtype), in buffer order (by name).
        self.dtypes = sorted({working(p) for p in params}, key=str)
        #: ZeRO-1: per dtype (buffer order), its flat buffer, the shard ranges of
        #: every GPU of the stage and this rank's range. Empty when not sharded.
        self.buffers: list[_FlatBuffer] = []
        #: ZeRO-1: (parameter, start, end, view) per overlap of a parameter with an owned range.
        self._pieces: list[tuple[torch.nn.Parameter, int, int, torch.Tensor]] = []
        if not self.zero1:
            #: The stage's parameters, a tied one once, and what AdamW steps for each: the
            #: parameter, or offloaded, its host copy.
            self._unique = list({id(p): p for p in params}.values())
            self._stepped = [self._host_copy(p) if self.offload else p for p in self._unique]
            kw["fused"] = kw.get("fused") or self._fused_on_cpu(self._stepped)
            # A stage that reads no parameter (a loss tail) steps nothing.
            self.optimizer = (torch.optim.AdamW(param_groups(list(zip(self._unique, self._stepped)),
                                                             cfg.weight_decay), **kw) if self._unique else None)
            return
        #: ZeRO-3 ([Note: sharded parameters] in param_shard.py): each buffer holds only the owned range.
        self.zero3 = memory.zero == 3
        masters = self._build_buffers(params, working, low, self._buffer_order(memory))
        if self.zero3:
            self.param_shards = stage.param_shards = ParamShards(stage, self.buffers, shard_group)
        if self.offload:  # every stepped range that is not a master (in host memory already) gets a host copy
            self._pieces = [(p, lo, hi, v if id(v) in masters else self._host_copy(v))
                            for p, lo, hi, v in self._pieces]
        kw["fused"] = kw.get("fused") or self._fused_on_cpu([v for *_, v in self._pieces])
        # A GPU may own no element (state_shard_bytes 0): it steps nothing and only receives.
        self.optimizer = (torch.optim.AdamW(param_groups([(p, v) for p, *_, v in self._pieces], cfg.weight_decay),
                                            **kw) if self._pieces else None)

    def _buffer_order(self, memory) -> dict[int, object] | None:
        """The order of a ZeRO-1 stage's parameters in its flat buffers, by parameter id (None: stage order).
        ZeRO-2: forward order (first use), so the backward completes its gradient buckets from the end to the
        start, one at a time ([Note: sharded gradients] in grad_sync.py); ZeRO-3: in unit order first, so that
        a unit is one range of each buffer."""
        stage, plan_stage = self.stage, self.stage.stage
        if memory.zero < 2:
            return None
        first = {id(getattr(stage.module, flat)): k for flat, k in stage.first_use().items()}
        if self.zero3:
            unit_of = {id(getattr(stage.module, flat)): u
                       for u, flats in enumerate(getattr(type(stage.module), "UNITS", ())) for flat in flats
                       if flat in plan_stage.params}
            first = {k: (unit_of.get(k, len(unit_of) + 1), line) for k, line in first.items()}
        return first

    def _build_buffers(self, params, working, low: set[int], first: dict[int, object] | None) -> set[int]:
        """ZeRO-1: per dtype of ``working`` (a parameter's working dtype), one flat buffer whose views the
        parameters become (ZeRO-3: the owned range only), this rank's pieces of it (``self._pieces``) and, for
        16-bit working weights (ids in ``low``), their float32 masters; ``first``: the buffer order
        (``_buffer_order``). Returns the ids of the pieces that are masters."""
        stage, plan_stage = self.stage, self.stage.stage
        pos = stage.position
        masters: set[int] = set()  # ids of the stepped views that are float32 masters
        with torch.no_grad():
            for dtype in self.dtypes:
                members = [p for p in params if working(p) == dtype]
                if first is not None:
                    members.sort(key=lambda p: first[id(p)])
                n = sum(p.numel() for p in members)
                # Parameters become views of one flat buffer (stage order), so a range is one slice;
                # ZeRO-3 keeps the owned range only (ParamShards then makes them views of unit buffers).
                ranges = plan_stage.shard_ranges(n)
                a, b = ranges[pos]
                flat = torch.empty(b - a if self.zero3 else n, dtype=dtype, device=stage.device)
                is_low = any(id(p) in low for p in members)
                # 16-bit working weights: the float32 masters of the owned range, from the loaded weights.
                master = (torch.empty(b - a, dtype=torch.float32, device=self.host if self.offload else stage.device,
                                      pin_memory=self.offload and stage.device.type == "cuda")
                          if is_low else None)
                offset, placed = 0, []
                for p in members:
                    placed.append((p, offset))
                    k = p.numel()
                    lo, hi = max(a, offset), min(b, offset + k)
                    if master is not None and lo < hi:
                        master[lo - a : hi - a].copy_(p.detach().reshape(-1)[lo - offset : hi - offset])
                    if self.zero3:
                        if lo < hi:
                            flat[lo - a : hi - a].copy_(p.detach().reshape(-1)[lo - offset : hi - offset])
                    else:
                        flat[offset : offset + k].copy_(p.detach().reshape(-1))
                        p.data = flat[offset : offset + k].view_as(p)
                    if lo < hi:
                        view = (master[lo - a : hi - a] if master is not None
                                else flat[lo - a : hi - a] if self.zero3
                                else p.detach().view(-1)[lo - offset : hi - offset])
                        self._pieces.append((p, lo - offset, hi - offset, view))
                        if master is not None:
                            masters.add(id(view))
                    offset += k
                self.buffers.append(_FlatBuffer(dtype=dtype, flat=flat, ranges=ranges, owned=(a, b), master=master,
                                                members=tuple(placed)))
        return masters

    def _fused_on_cpu(self, stepped: list[torch.Tensor]) -> bool:
        """Step with the fused kernel on a CPU rank whose stepped tensors are all float32 (see the note above;
        16-bit parameters keep the default path, whose per-operation rounding the tests' references follow)."""
        return (self.stage.device.type == "cpu" and bool(stepped)
                and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in stepped))

    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        """Offload: a host copy of ``t`` (pinned next to a GPU) that AdamW steps, written back into ``t``."""
        with torch.no_grad():
            h = torch.empty(t.shape, dtype=t.dtype, device=self.host,
                            pin_memory=self.stage.device.type == "cuda").copy_(t.detach())
        self._host_copies.append((h, t))
        return h

    def _write_back(self) -> None:
        """Offload: the stepped host copies back into the GPU's weights."""
        with torch.no_grad():
            for h, t in self._host_copies:
                h.grad = None
                t.copy_(h)

    def refresh_host(self) -> None:
        """Offload: copy the GPU's weights into their host copies (after a checkpoint load)."""
        with torch.no_grad():
            for h, t in self._host_copies:
                h.copy_(t.detach())

    def set_lr(self, lr: float) -> None:
        """Set this step's learning rate on every parameter group."""
        if self.optimizer is not None:
            for g in self.optimizer.param_groups:
                g["lr"] = lr

    def state_pieces(self) -> list[tuple[str, int, int, torch.Tensor]]:
        """The tensors this optimizer steps, as ``(canonical name, start, end,
        tensor)``: ``tensor`` holds elements ``[start, end)`` of the flattened
        parameter (the whole parameter when the stage is not sharded, this
        rank's ZeRO-1 overlap with it otherwise). Checkpoints key the AdamW
        moments by these ranges (``runtime/checkpoint.py``)."""
        if not self.zero1:
            return [(self.canonical[id(p)], 0, p.numel(), t) for p, t in zip(self._unique, self._stepped)]
        return [(self.canonical[id(p)], lo, hi, view) for p, lo, hi, view in self._pieces]

    def owned_pieces(self) -> list[tuple[torch.nn.Parameter, int, int]]:
        """ZeRO-1: ``(parameter, start, end)`` per overlap of a parameter with
        this rank's ranges (elements ``[start, end)`` of the flattened
        parameter); empty when the stage is not sharded."""
        return [(p, lo, hi) for p, lo, hi, _ in self._pieces]

    def master_pieces(self) -> list[tuple[str, int, int, torch.Tensor]]:
        """The float32 masters of this rank's 16-bit working weights, as
        ``(canonical name, start, end, tensor)`` over elements ``[start, end)``
        of the flattened parameter (empty without 16-bit working weights)."""
        low = {id(p) for p in self.low_params}
        return [(self.canonical[id(p)], lo, hi, view) for p, lo, hi, view in self._pieces if id(p) in low]

    def step(self) -> None:
        if self.optimizer is None:  # no parameter here (or, ZeRO-1, no element owned)
            return
        if not self.zero1:
            if not self.offload:
                self.optimizer.step()
                return
            for p, h in zip(self._unique, self._stepped):  # [Note: optimizer offload]: gradients to the host
                g = self.grad_of(p)
                h.grad = None if g is None else g.detach().to(device=self.host, dtype=h.dtype)
            self.optimizer.step()
            self._write_back()
            return
        for p, lo, hi, view in self._pieces:
            g = self.piece_grad(p, lo, hi)
            view.grad = g.to(device=view.device, dtype=view.dtype) if self.offload else g
        self.optimizer.step()
        for *_, view in self._pieces:
            view.grad = None  # do not keep last step's gradients alive
        self._write_back()
        with torch.no_grad():
            for buf in self.buffers:  # 16-bit working weights: the masters' rounding, what autocast would read
                if buf.master is not None:
                    (buf.flat if self.zero3 else buf.flat[buf.owned[0] : buf.owned[1]]).copy_(buf.master)

    def allgather(self) -> list:
        """ZeRO-1: each owner's updated range of every buffer to every GPU of the
        stage, one unequal all-gather per buffer (``param_shard.all_gather_unequal``);
        returns the asynchronous works (none when not sharded, or under ZeRO-3,
        whose units are gathered when the next forward reads them)."""
        if not self.zero1 or self.zero3:
            return []
        st = self.stage
        return [w for buf in self.buffers
                for w in all_gather_unequal([buf.flat[a:b] for a, b in buf.ranges], st.position, self.shard_group,
                                            st.stage.ranks)]

    def state_summary(self) -> dict:
        """See ``StageWorker.optimizer_state_summary``."""
        by_dtype: dict[torch.dtype, int] = defaultdict(int)
        buffer_of = {id(view): p.dtype for p, *_, view in self._pieces}  # a master steps for its 16-bit weight
        if self.optimizer is not None:
            for param, st in self.optimizer.state.items():
                for key, t in st.items():
                    if key != "step" and torch.is_tensor(t):
                        by_dtype[buffer_of.get(id(param), param.dtype)] += t.numel() * t.element_size()
        buffers = []
        for dtype in self.dtypes:
            n = sum(p.numel() for p in self.params if p.dtype == dtype)
            buf = next((buf for buf in self.buffers if buf.dtype == dtype), None)
            a, b = buf.owned if buf is not None else (0, n)
            master = buf.master.numel() * buf.master.element_size() if buf is not None and buf.master is not None else 0
            buffers.append({"dtype": str(dtype).removeprefix("torch."), "elements": n, "owned_range": [a, b],
                            "owned_elements": b - a, "optimizer_state_bytes": by_dtype.get(dtype, 0),
                            "master_bytes": master})
        owned = sum(d["owned_elements"] for d in buffers)
        if not self.zero1:
            owned_range = [0, self.stage_elements]
        elif len(buffers) == 1:
            owned_range = buffers[0]["owned_range"]
        else:
            owned_range = None
        return {"rank": self.stage.rank, "stage": self.stage.index, "sharded": self.zero1, "offload": self.offload,
                # [Note: optimizer offload]: bytes of the host copies AdamW steps (not the masters, counted above)
                "host_copy_bytes": sum(h.numel() * h.element_size() for h, _ in self._host_copies),
                # [Note: activation offload]: bytes of saved tensors moved to host memory so far
                "activation_offload": self.stage.act_offload.summary() if self.stage.act_offload is not None
                else None,
                # [Note: host-stashed recomputation]: block inputs moved to host memory, blocks re-run
                "block_stash": self.stage.block_stash.summary() if self.stage.block_stash is not None else None,
                "stage_elements": self.stage_elements, "owned_range": owned_range, "owned_elements": owned,
                "optimizer_state_bytes": sum(by_dtype.values()),
                "master_bytes": sum(d["master_bytes"] for d in buffers), "buffers": buffers,
                "zero3": self.param_shards.summary() if self.param_shards is not None else None}


class LossScaler:
    """Dynamic loss scaling for fp16-mixed with ``torch.amp.GradScaler``'s
    semantics, the found-inf decision agreed over every rank (see [Note: mixed
    precision] in ``zorse_fx/precision.py``).

    Per step: the last stages back-propagate ``loss * scale``; after the
    gradient reduction ``unscale_and_check`` divides every gradient of the
    rank by the scale and sets a flag if any is inf/NaN; ``agree`` takes the
    MAX of the flag over ``group`` (the world), so either every rank steps or
    every rank skips; ``update`` then halves the scale on a skip (backoff)
    or doubles it after ``growth_interval`` clean steps. The scale is a
    Python float, equal on every rank because every rank sees the same
    decisions."""

    def __init__(self, policy: PrecisionPolicy, device: torch.device):
        self.policy = policy
        self.device = device
        self.scale = float(policy.init_scale)
        self._growth = 0
        self._found = torch.zeros(1, dtype=torch.float32, device=device)

    def unscale_and_check(self, grads: list[torch.Tensor]) -> None:
        """Divide ``grads`` by the scale in place; note an inf/NaN among them."""
        self._found.zero_()
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
        for g in grads:
            by_dtype[g.dtype].append(g)
        inv = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=self.device)
        for gs in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(gs, self._found, inv)

    def agree(self, group=None) -> bool:
        """True if any rank found inf/NaN (one all-reduce MAX on the device)."""
        dist.all_reduce(self._found, op=dist.ReduceOp.MAX, group=group)
        return bool(self._found.item())

    def update(self, skipped: bool) -> None:
        if skipped:
            self.scale *= self.policy.backoff_factor
            self._growth = 0
        else:
            self._growth += 1
            if self._growth == self.policy.growth_interval:
                self.scale *= self.policy.growth_factor
                self._growth = 0

    def state_dict(self) -> dict:
        """``{"scale": float, "growth_tracker": int}`` (``GradScaler``'s names)."""
        return {"scale": self.scale, "growth_tracker": self._growth}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned (a checkpoint)."""
        self.scale = float(state["scale"])
        self._growth = int(state["growth_tracker"])
