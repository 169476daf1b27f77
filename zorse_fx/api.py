"""``zorse.compile``: one call from a PyTorch model to a heterogeneous training plan.

    import zorse_fx as zorse
    cluster = zorse.Cluster.from_yaml("examples/clusters/small_hetero.yaml")
    model = zorse.compile(hf_model, cluster=cluster, example_inputs=(ids,), global_batch_size=16)
    print(model.plan)                     # readable table
    model.plan.export("runs/x/plan")      # plan.json + stage_<i>.py
    model.save_weights("runs/x/plan")     # weights.pt for `zorse train`

Also a decorator on an ``nn.Module`` class::

    @zorse.compile(cluster=cluster, example_inputs=(ids, ids), global_batch_size=16)
    class MyGPT(nn.Module): ...
    model = MyGPT(cfg)   # a CompiledModel
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
import torch.nn as nn

from .capture import capture
from .cluster import Cluster
from .errors import ModelCaptureError
from .models.hf import is_hf_causal_lm, write_hf_config
from .plan import Plan
from .planner import PlanOptions, plan_captured

__all__ = ["compile", "CompiledModel"]


class CompiledModel(nn.Module):
    """A model with its plan. ``forward`` runs the original model unchanged;
    ``pipeline_forward`` runs the generated stage modules chained in one
    process (the split-vs-unsplit check)."""

    def __init__(self, model: nn.Module, captured, plan: Plan, block_graph):
        super().__init__()
        self.model = model
        self.captured = captured
        self.plan = plan
        self.block_graph = block_graph

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def weights(self) -> dict[str, torch.Tensor]:
        """Every tensor the stages read, by canonical name (tied weights once)."""
        return self.captured.state()

    def save_weights(self, directory: str | Path) -> Path:
        path = Path(directory) / "weights.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.contiguous() for k, v in self.weights().items()}, path)
        write_hf_config(self.model, path.parent)  # a Hugging Face model's configuration, for `zorse export`
        return path

    def stage_modules(self) -> list[nn.Module]:
        """The generated stage classes, instantiated with the current weights."""
        from .codegen.split import split_stages

        state = self.weights()
        progs = split_stages(self.block_graph, tuple(s.blocks for s in self.plan.stages))
        return [p.build(state) for p in progs]

    def pipeline_forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Loss of the stage modules chained in this process (no communication)."""
        named = dict(zip(self.plan.input_names, inputs))
        carried: tuple = ()
        for stage, module in zip(self.plan.stages, self.stage_modules()):
            out = module(*[named[n] for n in stage.input_names], *carried)
            carried = tuple(out) if stage.send else out
        return carried


def _check_language_model_inputs(model: nn.Module, example_inputs) -> None:
    """A plan trains on language-model batches: ``zorse train`` feeds two
    ``(N, T)`` integer tensors, token ids and labels (``data.global_batch``).
    Refuse other inputs (images, per-sample labels) here, at plan time,
    instead of at the first step.

    Raises:
        ModelCaptureError: the example inputs are not two ``(N, T)`` integer tensors.
    """
    ok = len(example_inputs) == 2 and all(
        isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point() and not t.is_complex()
        and t.shape == example_inputs[0].shape for t in example_inputs)
    if not ok:
        got = ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" if isinstance(t, torch.Tensor)
                        else type(t).__name__ for t in example_inputs)
        raise ModelCaptureError(
            f"{type(model).__name__} takes inputs {got}; zorse_fx trains on token batches: two (N, T) integer "
            f"tensors (token ids, labels), as zorse train feeds them")


def _compile_instance(model: nn.Module, *, cluster: Cluster, example_inputs, global_batch_size: int,
                      label_mode: str | None, model_name: str | None, verbose: bool, **options) -> CompiledModel:
    if isinstance(cluster, (str, Path)):
        cluster = Cluster.from_yaml(cluster)
    inner = model
    if is_hf_causal_lm(model):
        from .models.hf import CausalLMWithLoss

        model = CausalLMWithLoss(model)
        label_mode = label_mode or "same"
        if len(example_inputs) == 1:  # labels = input_ids (the HF model shifts them)
            example_inputs = (example_inputs[0], example_inputs[0])
    label_mode = label_mode or "shifted"
    _check_language_model_inputs(inner, example_inputs)
    name = model_name or getattr(getattr(inner, "config", None), "_name_or_path", "") or type(inner).__name__
    say = print if verbose else None
    captured = capture(model, tuple(example_inputs))
    if say:
        say(f"[zorse] captured {type(inner).__name__} with {captured.method} "
            f"({sum(1 for _ in captured.graph_module.graph.nodes)} fx nodes"
            + (f"; {captured.causal_masks} explicit causal attention masks made is_causal=True"
               if captured.causal_masks else "")
            + ("; loss: a mean over the tokens it counts, weighted by each GPU's count"
               if captured.loss_reduction == "token_mean" else "; loss: a mean over the samples") + ")")
    plan, bg = plan_captured(captured, cluster, PlanOptions(global_batch_size=global_batch_size, **options),
                             model_name=name, label_mode=label_mode,
                             progress=(lambda m: say("[zorse] " + m)) if say else None)
    return CompiledModel(model, captured, plan, bg)


def compile(model: nn.Module | type | None = None, *, cluster, example_inputs, global_batch_size: int,
            label_mode: str | None = None, model_name: str | None = None, verbose: bool = False, **options):
    """Capture, plan and generate stage modules for ``model`` on ``cluster``.

    Args:
        model: a local Hugging Face model directory (a path: ``config.json`` and
            weights, loaded in float32 by ``AutoModelForCausalLM``), or an ``nn.Module`` whose ``forward(*example_inputs)`` returns the
            scalar mean loss over the samples or over the tokens it counts
            from its inputs (``cross_entropy(..., ignore_index=PAD)``,
            ``(ce * mask).sum() / mask.sum()``: [Note: the loss contract] in
            ``capture/trace.py``), or a Hugging Face causal LM
            (wrapped automatically: ``(input_ids, labels) -> loss``; other
            Hugging Face models are refused, [Note: which Hugging Face models]
            in ``models/hf.py``). Used without it, ``compile(...)`` returns a
            class decorator.
        cluster: a :class:`Cluster` or the path of a cluster YAML file.
        example_inputs: tensors with the batch in dim 0, e.g. ``(ids, ids)``
            of shape ``(N, T)``, ``N >= 2``; ``T`` is the training length.
        global_batch_size: samples per optimizer step.
        label_mode: "same" (HF: labels = input_ids) or "shifted"; inferred.
        **options: fields of :class:`zorse_fx.planner.PlanOptions`
            (max_stages, schedule, solver_budget: CP-SAT deterministic seconds
            per candidate, time_limit_s: the wall-clock safety stop,
            memory_fraction, ...), e.g.
            ``precision="auto" | "fp32" | "bf16-mixed" | "fp16-mixed"`` (auto:
            bf16-mixed where every GPU supports bfloat16, else fp16-mixed)
            and ``grad_reduce_dtype="float32" | "bfloat16"``.

    Returns:
        :class:`CompiledModel` (``.plan`` is the :class:`Plan`).

    Raises:
        ModelCaptureError, ClusterConfigError, PlanOptionsError, InfeasiblePlanError.
    """
    if isinstance(model, (str, os.PathLike)):  # a local Hugging Face model directory
        from .models.registry import load_model_dir

        model_name = model_name or str(Path(model).resolve())
        try:
            model, _ = load_model_dir(str(model))
        except ValueError as exc:
            raise ModelCaptureError(str(exc)) from None
    kw = dict(cluster=cluster, example_inputs=example_inputs, global_batch_size=global_batch_size,
              label_mode=label_mode, model_name=model_name, verbose=verbose, **options)
    if model is None:
        def decorator(cls: type):
            @functools.wraps(cls, updated=())
            def make(*args, **kwargs) -> CompiledModel:
                return _compile_instance(cls(*args, **kwargs), **kw)
            return make
        return decorator
    if isinstance(model, type):
        raise TypeError("compile(SomeClass, ...) is not supported; use @zorse.compile(...) as a decorator or pass an instance")
    return _compile_instance(model, **kw)
