"""The two sides of each comparison of ``bench/runtime.py`` (one rank of a
torchrun worker holds both): the zorse_fx runtime (``ZorseSide``: one
``StageWorker``) and the anchors it is timed against --
``torch.distributed.pipelining``'s 1F1B on the plan's generated stage modules
(``PipeliningSide``), ``DistributedDataParallel`` (``DDPSide``) and a plain
micro-batch loop (``EagerSide``, on a generated stage module or on the
original GPT, ``original_model``).

Every side has ``step(batch) -> float`` (one training step: forward and
backward of all micro-batches, then AdamW; returns this rank's
share-weighted loss, summed over ranks = the global mean loss) and
``breakdown() -> dict[str, float]`` (seconds of the last step's parts). The
method and what each comparison shows are in ``bench/runtime.py``'s module
docstring; that script pairs the sides per comparison (``_sides``), times
them and writes the rows. Split from ``bench/runtime.py``; nothing changed.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from runtime import BenchConfig


def load_stage_module(plan, plan_dir: Path, index: int, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A fresh instance of the generated ``Stage<index>`` holding ``weights``."""
    from zorse_fx.codegen.split import load_stage_class

    cls = load_stage_class(plan_dir / plan.stages[index].source_file, index)
    module = cls()
    with torch.no_grad():
        for flat, canon in {**cls.PARAMETERS, **cls.CONSTANTS}.items():
            getattr(module, flat).copy_(weights[canon])
    return module


def _adamw(params, cfg: BenchConfig) -> torch.optim.AdamW:
    """AdamW as the zorse_fx runtime builds it (``OptimizerConfig``: betas, eps)."""
    from zorse_fx.runtime.worker import OptimizerConfig

    oc = OptimizerConfig(lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=oc.lr, betas=oc.betas, eps=oc.eps, weight_decay=oc.weight_decay)


def _microbatch_rows(stage, position: int, num_microbatches: int, microbatch_size: int) -> list[slice]:
    """This GPU's rows of each micro-batch of the global batch, as the runtime takes them."""
    lo, hi = stage.sample_ranges()[position]
    return [slice(m * microbatch_size + lo, m * microbatch_size + hi) for m in range(num_microbatches)]


class ZorseSide:
    """The zorse_fx runtime: one ``StageWorker`` (its own weights and optimizer)."""

    def __init__(self, plan, plan_dir: Path, weights, rank: int, cfg: BenchConfig, precision: str | None = None):
        from zorse_fx.runtime.worker import OptimizerConfig, StageWorker

        kwargs = {}
        if precision is not None:
            # ``precision=`` (a PrecisionPolicy, default fp32) exists since the issue-11 rewrite; on an
            # older runtime bench/runtime.py's main() skips this comparison (``runtime_takes_precision``).
            from zorse_fx.precision import precision_policy

            kwargs["precision"] = precision_policy(precision)
        self.worker = StageWorker(plan, plan_dir, weights, rank=rank, device=torch.device("cpu"),
                                  optimizer=OptimizerConfig(lr=cfg.lr, weight_decay=cfg.weight_decay), **kwargs)

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        """One training step; this rank's share-weighted loss (sum over ranks = global mean loss)."""
        # The one place that depends on train_step's return type: a 0-dim tensor since the issue-11
        # rewrite, a float before it; float() takes both (on a GPU: the step's one host sync, as
        # on the anchor side).
        return float(self.worker.train_step(batch))

    def breakdown(self) -> dict[str, float]:
        return dict(self.worker.last_breakdown)


class LabelledLastStage(torch.nn.Module):
    """The generated last stage as ``torch.distributed.pipelining`` runs it.

    Pipelining passes the model inputs to the first stage only; the generated
    last stage reads the labels as its first input and returns the mean loss
    of its micro-batch. Before each step ``set_labels`` stores the labels of
    the ``M`` micro-batches; forward ``i`` of the step takes ``labels[i]``
    (1F1B runs the forward chunks in order ``0 .. M-1``)."""

    def __init__(self, stage: torch.nn.Module):
        super().__init__()
        self.stage = stage
        self._labels: list[torch.Tensor] = []
        self.forwards = 0

    def set_labels(self, labels: list[torch.Tensor]) -> None:
        self._labels, self.forwards = labels, 0

    def forward(self, *received: torch.Tensor) -> torch.Tensor:
        labels = self._labels[self.forwards]
        self.forwards += 1
        return self.stage(labels, *received)


def _stage_output_is_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``loss_fn`` of the anchor schedule: the last stage already returned the loss."""
    return output


class PipeliningSide:
    """``PipelineStage`` + ``Schedule1F1B`` on the plan's generated stage module of this rank."""

    def __init__(self, plan, plan_dir: Path, weights, rank: int, cfg: BenchConfig):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        if plan.num_groups != plan.num_stages or any(len(s.gpus) != 1 for s in plan.stages):
            raise ValueError("the pipelining anchor runs one stage per rank (interleave 1, 1 GPU per stage)")
        self.index = plan.role(rank).stage
        if self.index != rank:  # (plans number ranks node by node: [Note: ranks node by node] in zorse_fx/plan.py)
            raise ValueError(f"the pipelining anchor runs stage i on rank i (PipelineStage's default); this plan runs "
                             f"stage {self.index} on rank {rank}")
        self.first, self.last = self.index == 0, self.index == plan.num_stages - 1
        stage = plan.stages[self.index]
        # What pipelining can feed: the model inputs to the first stage, nothing else; the last
        # stage's only input must be the labels (``LabelledLastStage``).
        if self.last and tuple(stage.input_names) != (plan.input_names[1],):
            raise ValueError(f"the last stage reads {stage.input_names}, the anchor feeds it the labels only")
        if not self.first and not self.last and stage.input_names:
            raise ValueError(f"stage {self.index} reads model inputs {stage.input_names}; pipelining cannot feed them")
        self.module = load_stage_module(plan, plan_dir, self.index, weights)
        self.input_names = tuple(stage.input_names)
        self.submod = LabelledLastStage(self.module) if self.last else self.module
        self.M = plan.num_microbatches
        # Static shapes (what a user who knows them passes): pipelining then skips its
        # metadata-inference forward, which would also consume a micro-batch's labels.
        mb = plan.microbatch_size
        first_inputs = tuple(torch.zeros((mb, plan.seq_len), dtype=torch.int64) for _ in self.input_names)
        # Float activations crossing the cut carry gradients back (requires_grad: pipelining
        # allocates gradient buffers only for those).
        def example(t):
            return torch.empty((mb, *t.shape_per_sample), dtype=getattr(torch, t.dtype),
                               requires_grad=getattr(torch, t.dtype).is_floating_point)

        recv, send = tuple(map(example, stage.recv)), tuple(map(example, stage.send))
        self.pipe = PipelineStage(self.submod, self.index, plan.num_stages, torch.device("cpu"),
                                  input_args=first_inputs if self.first else recv,
                                  output_args=torch.empty(()) if self.last else send)
        self.schedule = Schedule1F1B(self.pipe, n_microbatches=self.M, loss_fn=_stage_output_is_loss,
                                     scale_grads=True)
        # Tied parameters (the GPT's input/output embedding, in stages 0 and 1): pipelining leaves
        # them to the user; their gradients are summed over the ranks holding them.
        flat_of = {canon: flat for flat, canon in stage.params.items()}
        shared = plan.shared_params()
        if any(len(stages) != plan.num_stages for stages in shared.values()):
            raise ValueError(f"tied parameters {shared} are not held by every stage; the anchor all-reduces "
                             "them over the world")
        self.tied = [getattr(self.module, flat_of[c]) for c in sorted(shared) if c in flat_of]
        self.optimizer = _adamw(list(self.module.parameters()), cfg)
        self._breakdown: dict[str, float] = {}

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if self.first:
            self.schedule.step(*(batch[n] for n in self.input_names), return_outputs=False)
        else:
            labels = batch[self.input_names[0]] if self.last else None
            if self.last:
                self.submod.set_labels(list(labels.tensor_split(self.M)))
            self.schedule.step(target=labels, losses=losses, return_outputs=False)
            if self.last and self.submod.forwards != self.M:
                raise AssertionError(f"the last stage ran {self.submod.forwards} forwards, expected {self.M}")
        t1 = time.perf_counter()
        for p in self.tied:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        t2 = time.perf_counter()
        self.optimizer.step()
        t3 = time.perf_counter()
        self._breakdown = {"pipeline_s": t1 - t0, "allreduce_s": t2 - t1, "optimizer_s": t3 - t2}
        return float(torch.stack(losses).mean()) if self.last else 0.0

    def breakdown(self) -> dict[str, float]:
        return dict(self._breakdown)


class EagerSide:
    """A plain loop over the micro-batches on one process: forward, ``(loss / M).backward()``, AdamW."""

    def __init__(self, module: torch.nn.Module, input_names, plan, cfg: BenchConfig):
        self.module = module
        self.input_names = tuple(input_names)
        self.rows = _microbatch_rows(plan.stages[0], 0, plan.num_microbatches, plan.microbatch_size)
        self.M = plan.num_microbatches
        self.optimizer = _adamw(list(module.parameters()), cfg)
        #: The reported loss: the mean over the micro-batches.
        self.loss_weight = 1.0 / self.M

    def _forward_backward(self, m: int, inputs) -> torch.Tensor:
        """Micro-batch ``m``'s forward and ``(loss / M).backward()``; returns its loss."""
        loss = self.module(*inputs)
        (loss / self.M).backward()
        return loss

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for m, rows in enumerate(self.rows):
            loss = self._forward_backward(m, [batch[n][rows] for n in self.input_names])
            total = total + loss.detach()
        t1 = time.perf_counter()
        self.optimizer.step()
        t2 = time.perf_counter()
        self._breakdown = {"pipeline_s": t1 - t0, "allreduce_s": 0.0, "optimizer_s": t2 - t1}
        return float(total) * self.loss_weight

    def breakdown(self) -> dict[str, float]:
        return dict(self._breakdown)


class DDPSide(EagerSide):
    """``DistributedDataParallel`` on the generated module of the 1-stage plan, this rank's rows:
    the eager loop, gradients all-reduced by DDP during the last micro-batch's backward."""

    def __init__(self, plan, plan_dir: Path, weights, rank: int, cfg: BenchConfig):
        from torch.nn.parallel import DistributedDataParallel

        if plan.num_stages != 1:
            raise ValueError("the DDP anchor runs a 1-stage plan")
        stage = plan.stages[0]
        position = stage.ranks.index(rank)
        self.rows = _microbatch_rows(stage, position, plan.num_microbatches, plan.microbatch_size)
        n, total = self.rows[0].stop - self.rows[0].start, plan.global_batch_size
        #: This rank's share of the global batch, per micro-batch (the runtime's loss weight n_g / N).
        self.loss_weight = n / total
        self.input_names = tuple(stage.input_names)
        self.module = load_stage_module(plan, plan_dir, 0, weights)
        # DDP as users run it: default buckets (25 MiB, the runtime's BUCKET_BYTES too, and a
        # first bucket of 1 MiB that DDP all-reduces as soon as the last layers' gradients are in).
        self.ddp = DistributedDataParallel(self.module)
        self.optimizer = _adamw(list(self.ddp.parameters()), cfg)
        self.M = plan.num_microbatches

    def _forward_backward(self, m: int, inputs) -> torch.Tensor:
        sync = m == self.M - 1
        with contextlib.nullcontext() if sync else self.ddp.no_sync():
            loss = self.ddp(*inputs)
            # DDP averages over the 2 ranks; / M averages over the micro-batches.
            (loss / self.M).backward()
        return loss


def original_model(cfg: BenchConfig, weights) -> torch.nn.Module:
    """The GPT zorse_fx captured, holding ``weights``."""
    from zorse_fx.models.gpt import GPT

    model = GPT(gpt_config(cfg))
    model.load_state_dict({**weights, "lm_head.weight": weights["wte.weight"]})  # tied: the same tensor
    return model


def gpt_config(cfg: BenchConfig):
    from zorse_fx.models.gpt import GPTConfig

    return GPTConfig(n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head, block_size=cfg.seq_len)


def runtime_takes_precision() -> bool:
    """The StageWorker constructor has a ``precision=`` argument (the runtime rewrite adds it)."""
    from zorse_fx.runtime.worker import StageWorker

    return "precision" in inspect.signature(StageWorker.__init__).parameters
