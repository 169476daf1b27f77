"""One pipeline stage on one rank: its generated module with the weights
loaded, this GPU's rows of every micro-batch, and the forward / backward of
one micro-batch -- unpacking what it receives, packing what it sends (see
[Note: why activations are re-partitioned by sample range] in ``comm.py``).

It does no communication itself: ``P2PExecutor`` (``p2p.py``) hands it the
received buffers of an action, in route order, and posts the buffers it
returns. Gradients and the optimizer live in ``grad_sync.py`` and
``optimizer.py``; ``worker.py`` runs the schedule.

[Note: share-weighted gradients]
The last stage computes, for GPU ``g`` and micro-batch ``m``, the loss
``l_{g,m}`` of its ``n_g`` samples and back-propagates ``l_{g,m} w_{g,m}``:

- a mean over the samples (``Plan.loss_reduction == "sample_mean"``):
  ``w_{g,m} = n_g / N`` (``N`` = global batch), each GPU's gradient weighted
  by its share of the samples;
- a mean over counted tokens (``"token_mean"``): ``w_{g,m} = d_{g,m} / D``,
  ``d_{g,m}`` the tokens the stage's generated ``loss_count`` counts in its
  rows of the micro-batch and ``D`` their sum over the global batch, which
  the worker all-reduces over the last stage's GPUs before the schedule
  (``StageWorker._count_loss_tokens``, one float64 scalar on the device).
  A slice that counts no token has weight 0 and no backward: its loss
  ``0 / 0`` is not back-propagated, the stage sends zero gradients
  ([Note: token-mean losses] in ``capture/loss_count.py``).

Summing over micro-batches and over the GPUs of a data-parallel group
(all-reduce SUM) then gives exactly the gradient of the loss over the whole
global batch, as single-device training computes it, however unequal the
shares and the tokens per sample are ([Note: the loss contract] in
``capture/trace.py``). The forward returns ``l_{g,m} w_{g,m}`` as the GPU's
contribution: the sum over ranks is the global batch's loss. The weights are
Python floats from float64 counts, so a fixed-length LM's token mean (every
sample counts the same tokens) weighs ``n_g / N`` exactly, bit for bit.
Parameters held by several stages (tied embeddings) are reduced over the
union of their holders, which also sums the two stages' contributions. With
fp16-mixed the last stage back-propagates ``loss * w_{g,m} * scale`` (the
loss scale, see [Note: mixed precision] in ``zorse_fx/precision.py``).

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
grad enabled on the stashed inputs (received floats ``requires_grad_``), under
the same autocast as the first forward, and back-propagates exactly as a stage
without recomputation. Nothing extra moves between ranks; the cost is one
more forward per micro-batch.

Precision: the worker runs the whole schedule inside the policy's autocast
region (see [Note: mixed precision]); a backward runs with autocast off, as
in eager AMP (autocast wraps only forward passes), and a recomputed forward
turns it back on.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch

from ..codegen.split import load_stage_source
from ..errors import RuntimeExecutionError, WeightsFileError, short_repr
from ..ir.p2p import routes
from ..ir.tensor import as_run, on_wire
from ..plan import Plan, StagePlan, stage_memory
from ..precision import PrecisionPolicy
from ..stage_sources import source_sha256
from .comm import pack, torch_dtype, unpack

__all__ = ["StageRuntime", "check_weights"]


def check_weights(expected: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor], *, stage: int,
                  source: str | None = None) -> None:
    """Check that ``weights`` (canonical name -> tensor, as ``weights.pt``
    holds them) has, for every name of ``expected`` (canonical name -> the
    stage module's tensor, meta tensors are enough), a tensor of exactly its
    shape and dtype. ``copy_`` would broadcast a wrong shape (a ``(1, 32)``
    bias into ``(4, 32)``) and cast a wrong dtype without a word, and the
    stage would train on wrong values.

    Raises:
        WeightsFileError: naming ``source`` (the weights file, when known),
            the tensor's canonical name, the expected and the found shape and
            dtype, and how many other tensors do not fit either.
    """
    where = f"{source}: " if source else "weights: "
    if not isinstance(weights, Mapping):
        raise WeightsFileError(f"{where}holds a {type(weights).__name__}, not a dict canonical name -> tensor; save "
                               f"the weights with `zorse plan` (weights.pt) or CompiledModel.save_weights")
    problems = []
    for canon, target in expected.items():
        want = f"shape {tuple(target.shape)}, {target.dtype}"
        value = weights.get(canon)
        if value is None:
            problems.append(f"no tensor {canon!r}, which stage {stage} needs ({want})")
        elif not isinstance(value, torch.Tensor):
            problems.append(f"entry {canon!r} is a {type(value).__name__} ({short_repr(value)}), not a tensor; "
                            f"stage {stage} needs {want}")
        elif tuple(value.shape) != tuple(target.shape) or value.dtype != target.dtype:
            problems.append(f"tensor {canon!r} has shape {tuple(value.shape)}, {value.dtype} but stage {stage} "
                            f"expects {want}")
    if problems:
        more = f" (and {len(problems) - 1} more tensors do not fit)" if len(problems) > 1 else ""
        raise WeightsFileError(f"{where}{problems[0]}{more}; these are not the weights of the model the plan was "
                               f"made for: export them with the plan (`zorse plan` writes weights.pt, "
                               f"CompiledModel.save_weights) from that model, in its dtypes")


class StageRuntime:
    """One stage hosted by this rank (see the module docstring).

    Args:
        plan, index: the plan and the stage's index in it.
        plan_dir: the directory of ``stage_<i>.py``.
        weights: every tensor of the model by canonical name (``weights.pt``).
        rank, device: this rank and its device (``cuda:<local rank>`` or cpu).
        precision: the policy the step runs under; under a mixed policy every
            trainable floating parameter is a float32 master weight.
        weights_source: where ``weights`` came from (the weights file), for
            error messages.

    Raises:
        WeightsFileError: a tensor the stage needs is missing from ``weights``
            or has another shape or dtype (``check_weights``: the file, the
            tensor and both shapes and dtypes named).
        RuntimeExecutionError: the stage source may not be run (see ``_source``).
    """

    def __init__(self, plan: Plan, index: int, plan_dir: Path, weights: dict[str, torch.Tensor], *, rank: int,
                 device: torch.device, precision: PrecisionPolicy, weights_source: str | None = None):
        self.plan = plan
        self.weights_source = weights_source
        self.rank = rank
        self.device = device
        self.precision = precision
        self.stage: StagePlan = plan.stages[index]
        #: Its memory policy (ZeRO level, recomputation, offload: ``ir/memory.py``), read once.
        self.memory = stage_memory(self.stage)
        self.index = index
        # The boundary tensors as the stage computes them under the run's policy (the plan
        # recorded them under its own: ``as_run``), and as sent and received ([Note: 16-bit
        # boundary tensors] in zorse_fx/precision.py).
        self.send_specs = as_run(self.stage.send, plan.precision, precision)
        self.recv_specs = as_run(self.stage.recv, plan.precision, precision)
        self.send_wire = on_wire(self.send_specs, precision)
        self.recv_wire = on_wire(self.recv_specs, precision)
        #: This GPU's position in the stage's data-parallel group and its rows of every micro-batch.
        self.position = self.stage.ranks.index(rank)
        self.row_start, self.row_end = self.stage.sample_ranges()[self.position]
        self.rows = self.row_end - self.row_start
        self.module = self._load_module(plan_dir, weights)
        self.prev = plan.stages[index - 1] if index > 0 else None
        self.next = plan.stages[index + 1] if index + 1 < plan.num_stages else None
        # Routes from/to this GPU only (positions in the other stage), in row order.
        self.in_routes = (
            [r for r in routes(self.prev.sample_ranges(), self.stage.sample_ranges()) if r.dst_pos == self.position]
            if self.prev else []
        )
        self.out_routes = (
            [r for r in routes(self.stage.sample_ranges(), self.next.sample_ranges()) if r.src_pos == self.position]
            if self.next else []
        )
        #: Loss scale the last stage multiplies its backward by (fp16-mixed; set per step).
        self.loss_scale = 1.0
        #: The last stage of a token-mean plan: it weights micro-batch m's loss by its count of tokens
        #: (``set_loss_weights`` before each step); else by its share of the samples
        #: ([Note: share-weighted gradients]).
        self.token_mean = self.next is None and plan.loss_reduction == "token_mean"
        if self.token_mean and not callable(getattr(self.module, "loss_count", None)):
            raise RuntimeExecutionError(
                f"stage {index}: the plan's loss is a token mean but {self.stage.source_file} defines no loss_count "
                f"to count the tokens with; re-export the plan with `zorse plan`")
        #: Per micro-batch, the weight of the last stage's loss ([Note: share-weighted gradients]);
        #: a token mean's are set per step (None until then).
        self.loss_weights: list[float] | None = (
            None if self.token_mean else [self.rows / plan.global_batch_size] * plan.num_microbatches)
        # Per in-flight micro-batch: (received, outputs), or with recomputation
        # (inputs, received, rng state) (see [Note: stage recomputation]).
        self._stash: dict[int, tuple] = {}
        self._warned_dtypes: set[str] = set()
        #: ZeRO-3 (``StagePlan.param_sharded``): the unit gathers, set by the stage's optimizer
        #: ([Note: sharded parameters] in param_shard.py); None otherwise.
        self.param_shards = None
        #: ``StagePlan.offload_activations``: the hooks that keep saved tensors in host memory
        #: ([Note: activation offload] in act_offload.py); built at the first recorded forward.
        self.act_offload = None
        #: ``StagePlan.stash_on_host``: the wrapper of the block methods that keeps only their inputs, in host
        #: memory ([Note: host-stashed recomputation] in block_stash.py); None otherwise.
        self.block_stash = None
        if self.memory.stash == "host":
            from .block_stash import BlockStash

            self.block_stash = BlockStash(self.module, self.device)

    def _recorded(self):
        """The context of a forward autograd records: under ZeRO-3 the saved working weights are
        re-gathered when the backward reads them; with activation offload the other saved tensors
        wait in host memory."""
        if self.memory.activations == "host":
            if self.act_offload is None:
                from .act_offload import ActivationOffload

                inner = self.param_shards.hooks() if self.param_shards is not None else None
                self.act_offload = ActivationOffload(self.module, self.device, inner)
            return self.act_offload.saving()
        return self.param_shards.saving() if self.param_shards is not None else contextlib.nullcontext()

    def _source(self, plan_dir: Path) -> str:
        """The stage's source text: the one the plan holds (checked against
        plan.json's sha256 when it was loaded; see ``plan.py``), else the file,
        checked against the sha256 the plan recorded."""
        plan = self.plan
        if not plan.sources_verified:
            raise RuntimeExecutionError(
                f"plan.json in {plan_dir} records no sha256 of its stage sources (a file of format version < 5), "
                f"so zorse_fx will not run them: check the stage_<i>.py files, then re-export the plan "
                f"(`zorse plan`, or Plan.load(...).export(...)) to record their hashes")
        if len(plan.sources) == plan.num_stages:
            return plan.sources[self.stage.index]
        path = plan_dir / self.stage.source_file
        text = path.read_text()
        want = plan.source_hashes()[self.stage.index]
        if want is None or source_sha256(text) != want:
            raise RuntimeExecutionError(f"{path}: not the stage source the plan recorded (sha256 "
                                        f"{'none recorded' if want is None else want[:16] + '...'}); "
                                        f"load the plan with Plan.load or re-export it")
        return text

    def _load_module(self, plan_dir: Path, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
        self.source_text = self._source(plan_dir)
        cls = load_stage_source(self.source_text, plan_dir / self.stage.source_file, self.stage.index)
        with torch.device("meta"):
            module = cls()
        names = {**cls.PARAMETERS, **cls.CONSTANTS}
        # Checked on the meta module, before any memory is allocated or any value copied.
        check_weights({canon: getattr(module, flat) for flat, canon in names.items()}, weights,
                      stage=self.stage.index, source=self.weights_source)
        module = module.to_empty(device=self.device)
        with torch.no_grad():
            for flat, canon in names.items():
                getattr(module, flat).copy_(weights[canon])
        if self.precision.mixed:  # float32 master weights (see [Note: mixed precision])
            for name, p in module.named_parameters():
                if p.is_floating_point() and p.dtype != torch.float32:
                    setattr(module, name, torch.nn.Parameter(p.detach().float()))
        return module

    def first_use(self) -> dict[str, int]:
        """Flat parameter name -> the line of its first use in the stage's
        forward (the generated source binds every attribute to a local first,
        ``name = self.<flat>``: the first later line reading that local, or
        reading ``self.<flat>`` itself); -1 for one the forward never reads.
        A parameter's gradient is final when the backward of its first use
        ends, so the backward finalizes them in descending order of this
        (ZeRO-2's launch order: [Note: sharded gradients] in ``grad_sync.py``)."""
        import re

        text = self.source_text
        lines = text[text.find("def forward"):].splitlines()[1:]
        bind = re.compile(r"^\s*([A-Za-z_]\w*) = self\.([A-Za-z_]\w*)\s*$")
        ident = re.compile(r"\bself\.([A-Za-z_]\w*)|\b([A-Za-z_]\w*)\b")
        local_of: dict[str, str] = {}
        out: dict[str, int] = {}
        for k, line in enumerate(lines):
            b = bind.match(line)
            if b:
                local_of[b.group(1)] = b.group(2)
                continue
            for m in ident.finditer(line):
                flat = m.group(1) or local_of.get(m.group(2))
                if flat is not None:
                    out.setdefault(flat, k)
        return {flat: out.get(flat, -1) for flat in self.stage.params}

    def params(self) -> dict[str, torch.nn.Parameter]:
        """Trainable parameters by canonical name."""
        return {canon: getattr(self.module, flat) for flat, canon in self.stage.params.items()}

    # -- recomputation ---------------------------------------------------------
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

    # -- messages --------------------------------------------------------------
    def _unpack_rows(self, specs, route_list, bufs: list[torch.Tensor]) -> list[torch.Tensor]:
        """One packed buffer per route (row order) -> one tensor per spec, rows concatenated."""
        assert len(bufs) == len(route_list), f"stage {self.index}: {len(bufs)} buffers for {len(route_list)} routes"
        parts: list[list[torch.Tensor]] = [[] for _ in specs]
        for r, buf in zip(route_list, bufs):
            for i, t in enumerate(unpack(buf, specs, r.rows)):
                parts[i].append(t)
        return [torch.cat(p) if len(p) > 1 else p[0] for p in parts]

    def _wire(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The stage's outputs in their wire dtypes (``self.send_wire``: float32
        in the compute dtype under a mixed policy). Where autocast on this device
        gave another dtype than the planner measured (``StagePlan.send``: its CPU
        fake run, ``as_run`` under this policy), warn once per tensor: the message
        sizes stay what was priced."""
        out = []
        for t, s, w in zip(tensors, self.send_specs, self.send_wire, strict=True):
            if t.dtype != torch_dtype(s) and s.name not in self._warned_dtypes:
                self._warned_dtypes.add(s.name)
                warnings.warn(f"stage {self.index}: {s.name} is {t.dtype} here but the plan measured "
                              f"{s.dtype}; it is sent as {w.dtype}", stacklevel=3)
            out.append(t.to(torch_dtype(w)))
        return out

    # -- one micro-batch ---------------------------------------------------------
    def start_step(self) -> None:
        self._stash.clear()
        if self.token_mean:
            self.loss_weights = None  # counted anew for the step's batch

    def _inputs(self, m: int, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """This GPU's rows of micro-batch ``m`` of every model input the stage reads, on its device."""
        mb = self.plan.microbatch_size
        lo, hi = m * mb + self.row_start, m * mb + self.row_end
        return [batch[name][lo:hi].to(self.device, non_blocking=True) for name in self.stage.input_names]

    @torch.no_grad()
    def count_tokens(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The last stage of a token-mean plan: per micro-batch, the tokens its loss counts in this
        GPU's rows (the stage's ``loss_count``), ``(M,)`` float64 on the device."""
        return torch.stack([self.module.loss_count(*self._inputs(m, batch)).to(torch.float64).reshape(())
                            for m in range(self.plan.num_microbatches)])

    def set_loss_weights(self, counts: list[float], total: float) -> None:
        """Weight micro-batch ``m``'s loss by ``counts[m] / total`` (this GPU's tokens of it over the
        global batch's); 0 for a slice without a counted token ([Note: share-weighted gradients]).

        Raises:
            RuntimeExecutionError: a count that is negative or not finite (the model's count)."""
        bad = next((m for m, c in enumerate(counts) if not (c >= 0 and c != float("inf"))), None)
        if bad is not None or not (total >= 0 and total != float("inf")):
            what = f"micro-batch {bad} counts {counts[bad]!r}" if bad is not None else f"the batch counts {total!r}"
            raise RuntimeExecutionError(
                f"stage {self.index}: its loss_count is no count of tokens: {what}; the loss's divisor must be a "
                f"sum of non-negative per-token weights (a 0/1 mask, or the class weights of cross_entropy)")
        self.loss_weights = [c / total if c else 0.0 for c in counts]

    def forward(self, m: int, batch: dict[str, torch.Tensor], received: list[torch.Tensor]
                ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Forward of micro-batch ``m``. ``received``: one buffer per in-route.
        Returns (the weighted loss ``l_{g,m} w_{g,m}``, a 0-dim float32 tensor
        on the last stage, else None; one packed buffer per out-route)."""
        last = self.next is None
        recompute = self.memory.recompute and self.block_stash is None  # (host-stashed: block by block)
        inputs = self._inputs(m, batch)
        recv = [t.to(torch_dtype(spec)) for t, spec in
                zip(self._unpack_rows(self.recv_wire, self.in_routes, received), self.recv_specs, strict=True)
                ] if self.prev is not None else []
        if not recompute:
            for t in recv:
                if t.is_floating_point():
                    t.requires_grad_(True)
        if recompute:
            rng = self._rng_state()
            with torch.no_grad():
                out = self.module(*inputs, *recv)
            self._stash[m] = (inputs, recv, rng)
        else:
            if self.block_stash is not None:
                self.block_stash.start_forward()
            with self._recorded():
                out = self.module(*inputs, *recv)
            self._stash[m] = (recv, out if last else list(out))
        if last:
            assert self.loss_weights is not None, f"stage {self.index}: no loss weights for the step (count first)"
            weight = self.loss_weights[m]
            if not weight:  # a slice without a counted token: its loss is 0 / 0, its weight 0
                return torch.zeros((), dtype=torch.float32, device=self.device), []
            return out.detach().float() * weight, []
        outs = self._wire([o.detach() for o in out])
        return None, [pack(outs, r.start - self.row_start, r.end - self.row_start) for r in self.out_routes]

    def backward(self, m: int, received: list[torch.Tensor]) -> list[torch.Tensor]:
        """Backward of micro-batch ``m``. ``received``: one packed gradient
        buffer per out-route; returns one per in-route."""
        last = self.next is None
        whole = self.memory.recompute and self.block_stash is None  # whole-stage recomputation
        if last and not self.loss_weights[m]:  # no counted token: nothing to back-propagate, zero gradients
            recv = self._stash.pop(m)[1 if whole else 0]
            out = None
        elif whole:
            inputs, recv, rng = self._stash.pop(m)
            for t in recv:
                if t.is_floating_point():
                    t.requires_grad_(True)
            with self._replayed_rng(rng), torch.enable_grad(), \
                    self.precision.autocast(self.device.type), self._recorded():
                out = self.module(*inputs, *recv)
            out = out if last else list(out)
        else:
            recv, out = self._stash.pop(m)
        with torch.autocast(self.device.type, enabled=False):
            if last:
                if out is not None:
                    (out.float() * (self.loss_weights[m] * self.loss_scale)).backward()
            else:
                grads = self._unpack_rows(self.send_wire, self.out_routes, received)
                pairs = [(o, g.to(o.dtype)) for o, g in zip(out, grads) if o.requires_grad]
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if self.param_shards is not None:
            self.param_shards.end_backward()
        if self.prev is None:
            return []
        gin = [t.grad if t.grad is not None else torch.zeros_like(t) for t in recv if t.is_floating_point()]
        if len(gin) != len(self.stage.recv):
            raise RuntimeExecutionError(f"stage {self.index} receives a non-float tensor across its cut "
                                        f"({[s.dtype for s in self.stage.recv]}); cuts must carry float tensors only")
        gin = [g.to(torch_dtype(w)) for g, w in zip(gin, self.recv_wire, strict=True)]
        return [pack(gin, r.start - self.row_start, r.end - self.row_start) for r in self.in_routes]
