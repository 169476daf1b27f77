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
from .models.hf import HF_CONFIG, is_hf_causal_lm, write_hf_config
from .plan import Plan
from .planner import PlanOptions, plan_captured

__all__ = ["compile", "CompiledModel", "compile_recorded", "record_model"]


class CompiledModel(nn.Module):
    """A model with its plan. ``forward`` runs the original model unchanged;
    ``pipeline_forward`` runs the generated stage modules chained in one
    process (the split-vs-unsplit check)."""

    def __init__(self, model: nn.Module | None, captured, plan: Plan, block_graph, *, hf_config: str | None = None):
        super().__init__()
        #: None for a plan made from the cache without the model ([Note: a warm plan without the model]);
        #: then ``hf_config`` is its Hugging Face configuration as ``write_hf_config`` writes it.
        self.model = model
        self.captured = captured
        self.plan = plan
        self.block_graph = block_graph
        self.hf_config = hf_config
        #: The model record whose copy of weights.pt ``save_weights`` may copy (and keeps one under): its key
        #: ([Note: a warm plan without the model]); None: written from the tensors.
        self.weights_key: str | None = None

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def weights(self) -> dict[str, torch.Tensor]:
        """Every tensor the stages read, by canonical name (tied weights once)."""
        return self.captured.state()

    def save_weights(self, directory: str | Path) -> Path:
        path = Path(directory) / "weights.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        from .capture import cache

        if self.weights_key is None or not cache.restore_weights(self.weights_key, path):
            torch.save({k: v.contiguous() for k, v in self.weights().items()}, path)
            if self.weights_key is not None:
                cache.keep_weights(self.weights_key, path)
        if self.model is not None:
            write_hf_config(self.model, path.parent)  # a Hugging Face model's configuration, for `zorse export`
        elif self.hf_config is not None:
            (path.parent / HF_CONFIG).write_text(self.hf_config)
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
    captured = capture(model, tuple(example_inputs))
    return _planned(model, type(inner).__name__, captured, cluster=cluster, global_batch_size=global_batch_size,
                    label_mode=label_mode, name=name, verbose=verbose, **options)


def _planned(model: nn.Module | None, class_name: str, captured, *, cluster: Cluster, global_batch_size: int,
             label_mode: str, name: str, verbose: bool, hf_config: str | None = None, **options) -> CompiledModel:
    """``captured`` (of a model of class ``class_name``) planned on ``cluster``."""
    say = print if verbose else None
    if say:
        say(f"[zorse] captured {class_name} with {captured.method} "
            f"({sum(1 for _ in captured.graph_module.graph.nodes)} fx nodes"
            + (f"; {captured.causal_masks} explicit causal attention masks made is_causal=True"
               if captured.causal_masks else "")
            + ("; loss: a mean over the tokens it counts, weighted by each GPU's count"
               if captured.loss_reduction == "token_mean" else "; loss: a mean over the samples") + ")")
    plan, bg = plan_captured(captured, cluster, PlanOptions(global_batch_size=global_batch_size, **options),
                             model_name=name, label_mode=label_mode,
                             progress=(lambda m: say("[zorse] " + m)) if say else None)
    return CompiledModel(model, captured, plan, bg, hf_config=hf_config)


# [Note: a warm plan without the model]
# A warm `zorse plan` of SmolLM2-135M spent 3.2-4.4 CPU s loading the model (2026-12-07, bench/plan_cli.py,
# the 2-core machine), nearly all of it importing transformers (its Llama module pulls in
# torch.distributed.tensor), for a model of which the plan reads nothing the capture cache does not hold
# already: the graph, the loss check's answer and the analysis' records are kept by key, and the weights
# are the safetensors files' tensors as transformers loaded them. So for a model loaded from a directory
# of config.json and safetensors weights (SmolLM2's converted copy, a local model directory:
# ``registry.weights_dir``), a plan made with the cache on records beside the graph (``record_model``,
# ``<cache>/capture/model-<key>.json``, plain JSON) which tensor of the files each parameter and buffer of
# the wrapped model is (by name; a tied one the same file tensor; each checked equal in dtype, shape and
# values, else nothing is recorded; a buffer the files lack, as rotary ``inv_freq``, must be one the cached
# program keeps as a constant), the capture key, the model's class name, its Hugging Face configuration as
# ``write_hf_config`` writes it, and the source file of every module class (path, size, modification time).
# The key (``cache.model_key``) covers the model name, every file of the directory (path, size,
# modification time, inode; config.json's bytes), the sequence length, torch's, transformers' (as
# installed) and zorse_fx's versions and every zorse_fx source file. A later plan with that key
# (``compile_recorded``) reads the safetensors files, makes each tensor a parameter or buffer as recorded
# (ties the same object) and captures from the cache (``trace.capture_recorded``) without importing
# transformers; anything missing, changed or unreadable (the record, a class's source file, the graph, the
# loss check's record, a tensor that does not fit) loads the model as before (logged). ``--no-cache`` /
# ``$ZORSE_NO_CACHE`` read and write no record. The plan, its stage sources, weights.pt and hf_config.json
# are the bytes the model's own load gives (tests/test_model_record.py).
# weights.pt follows from the same key (the files' tensors, the graph's names for them, torch's format and
# zorse_fx's code), and writing it took 1.0-1.3 CPU s of a warm plan (torch.save: its CRC-32s and 540 MB of
# writes): ``save_weights`` keeps it beside the record (``cache.keep_weights``: ``weights-<key>.pt``, a hard
# link, its size and modification time in ``weights-<key>.json``) and a plan under that key hard-links it as its
# weights.pt (``cache.restore_weights``; a copy across file systems) where its size and modification time are
# still the recorded ones, else writes it from the tensors as before (logged) and keeps it again. A copy
# (1.0 CPU s back to back with the plan that wrote it: the kernel's dirty-page writeback) would save little;
# a link writes nothing, and a weights.pt rewritten in place later changes the kept copy's time too, so it
# is not used again. The cost: the cache holds the weights once more per model, sequence length and
# zorse_fx version (the same disk blocks as the plans' weights.pt while one of them is there).


def _class_files(model: nn.Module) -> list[list] | None:
    """Per module class of ``model`` outside torch and zorse_fx: its source file's path, size and
    modification time; None where one has no file."""
    import inspect

    out = {}
    for m in model.modules():
        cls = type(m)
        if cls.__module__.split(".")[0] in ("torch", "zorse_fx"):
            continue
        try:
            path = Path(inspect.getsourcefile(cls) or "")
            st = path.stat()
        except (OSError, TypeError):
            return None
        out[str(path)] = [str(path), st.st_size, st.st_mtime_ns]
    return sorted(out.values())


def record_model(compiled: CompiledModel, model_name: str, seq_len: int) -> None:
    """Record what a later ``compile_recorded(model_name, seq_len=seq_len, ...)`` needs to plan without the
    model, where ``compiled`` was captured from the cache and its model loaded from a directory of
    safetensors weights ([Note: a warm plan without the model]); a model whose tensors are not the files'
    is not recorded."""
    from .capture import cache
    from .models.hf import CausalLMWithLoss
    from .models.registry import load_weights, weights_dir

    key = compiled.captured.cache_key
    model = compiled.model
    if key is None or model is None or not cache.enabled() or not isinstance(model, CausalLMWithLoss):
        return
    directory = weights_dir(model_name)
    if directory is None:
        return
    files, sources = load_weights(directory), _class_files(model)
    if sources is None:
        return
    live = dict(model.named_parameters(remove_duplicate=False))
    params = set(live)
    live.update(model.named_buffers(remove_duplicate=False))
    by_id: dict[int, str] = {}
    threads = torch.get_num_threads()  # ~300 comparisons of a few MB: one thread (as trace._recorded_reduction)
    torch.set_num_threads(1)
    try:
        for name, t in live.items():  # a tensor of the files by its own name (the wrapper's "model." dropped)
            file = files.get(name.removeprefix("model."))
            if (file is not None and file.dtype == t.dtype and file.shape == t.shape
                    and torch.equal(file, t.detach())):
                by_id.setdefault(id(t), name.removeprefix("model."))
    finally:
        torch.set_num_threads(threads)
    tensors = {}
    for name, t in live.items():
        source = by_id.get(id(t))  # a tied parameter: its tie's file tensor
        if source is None and name in params:
            return
        tensors[name] = [source, name in params, bool(t.requires_grad)]
    inner = model.model
    record = cache.model_key(model_name, directory, seq_len)
    cache.save_record("model", record, {
        "export_key": key, "class_name": type(inner).__name__, "tensors": tensors, "class_files": sources,
        "hf_config": inner.config.to_json_string(use_diff=False)})
    compiled.weights_key = record  # (weights.pt, written next, is kept under it)


def compile_recorded(model_name: str, *, seq_len: int, cluster: Cluster, global_batch_size: int,
                     verbose: bool = False, **options) -> CompiledModel | None:
    """What ``compile`` gives for the Hugging Face model ``model_name`` (a registry name or directory) on
    ``(2, seq_len)`` token batches, made from its record in the capture cache without loading the model
    or importing transformers; None where there is no usable record ([Note: a warm plan without the
    model])."""
    import logging

    from .capture import cache
    from .capture.trace import capture_recorded
    from .models.registry import load_weights, weights_dir

    if not cache.enabled():
        return None
    directory = weights_dir(model_name)
    if directory is None:
        return None
    key = cache.model_key(model_name, directory, seq_len)
    rec = cache.load_record("model", key)
    if rec is None:
        return None
    log = logging.getLogger(__name__)
    try:
        for path, size, mtime in rec["class_files"]:
            st = Path(path).stat()
            if (st.st_size, st.st_mtime_ns) != (size, mtime):
                log.info("model record %s: %s changed; loading the model", key, path)
                return None
        files = load_weights(directory)
        made: dict[str, torch.Tensor] = {}
        tensors: dict[str, torch.Tensor] = {}
        for name, (source, is_param, requires_grad) in rec["tensors"].items():
            if source is None:
                continue  # a buffer the cached program keeps as a constant
            if source not in made:
                t = files[source]
                made[source] = nn.Parameter(t, requires_grad=requires_grad) if is_param else t
            tensors[name] = made[source]
        export_key, class_name, hf_config = rec["export_key"], rec["class_name"], rec["hf_config"]
    except (KeyError, TypeError, ValueError, OSError) as exc:
        log.info("model record %s not used: %s: %s", key, type(exc).__name__, exc)
        return None
    ids = torch.randint(0, 200, (2, seq_len))
    captured = capture_recorded(export_key, tensors, (ids, ids))
    if captured is None:
        log.info("model record %s: the cached capture %s is not usable; loading the model", key, export_key)
        return None
    compiled = _planned(None, class_name, captured, cluster=cluster, global_batch_size=global_batch_size,
                        label_mode="same", name=model_name, verbose=verbose, hf_config=hf_config, **options)
    compiled.weights_key = key
    return compiled


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
