"""Capture: ``nn.Module`` -> ``torch.fx.GraphModule`` with shapes on ``node.meta``.

Two routes (see ``../shared/DESIGN.md``):

- ``"fx"``: ``torch.fx.symbolic_trace`` for plain PyTorch modules (nanoGPT-style
  code). Tensor sizes stay symbolic (``x.size()`` is traced), so one graph
  serves every micro-batch size.
- ``"export"``: ``torch.export.export(strict=False)`` with a dynamic batch
  dimension, then ``run_decompositions({})`` so higher-order ops (autocast /
  grad-mode regions in Hugging Face rotary embeddings) are inlined and the
  graph is flat ATen. This is the route for Hugging Face models, which
  ``symbolic_trace`` rejects.

The captured model's ``forward(*inputs)`` must return the scalar training loss
(the mean over the samples it was given, or over the tokens it counts). Every
input is a tensor whose dim 0 is the batch dimension. Wrap a Hugging Face
causal LM with :class:`zorse_fx.models.hf.CausalLMWithLoss` (``zorse.compile``
does this).

[Note: the loss contract]
Each GPU computes the loss of its rows of each micro-batch, and the runtime
weights it so that the sum over GPUs and micro-batches is single-device
training's loss on the whole global batch, and so are the gradients
([Note: share-weighted gradients] in ``runtime/stage.py``). Two losses are
trained so, and ``capture`` records which one (``CapturedModel.loss_reduction``):

- ``"sample_mean"``: the mean over the samples, weighted by the GPU's share
  of the samples;
- ``"token_mean"``: a sum over tokens divided by a count of tokens that the
  graph computes from the inputs alone (``cross_entropy(...,
  ignore_index=PAD)``, Hugging Face's loss with labels -100,
  ``(ce * mask).sum() / mask.sum()``), weighted by the GPU's count of
  tokens: [Note: token-mean losses] in ``capture/loss_count.py``, which
  finds the count (``loss_tail``). A fixed-length LM's token mean counts the
  same tokens in every sample and trains bit for bit as a sample mean.

``check_mean_loss`` checks the contract on the example batch: in eval mode
(no dropout module) and without touching the global RNG, the batch's loss
must equal the count-weighted mean of its two halves' losses where the loss
has a count (which must be additive: the batch's count is the sum of its
samples'), else their sample-weighted mean, to a relative tolerance of 1000
machine epsilons of the weights' dtype (at most 5%). A forward that is
random even in eval mode (``F.dropout(..., training=True)``: two seeds give
two losses) is held to 25% only, which a sum still fails. A sum
(``reduction="sum"``) is the sum of the halves' losses and is refused; so is
what neither weighting explains (a divisor that reads a parameter, or that
is not a sum over the samples, is named). The example batch may have no
padding: a count found in the graph is used all the same (it then agrees
with the sample mean).

Legend: ``N`` = samples (batch), ``T`` = sequence length.
"""

from __future__ import annotations

import inspect
import logging
import sys
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..errors import ModelCaptureError
from ..models.hf import check_wrapped_models
from .causal import causal_masks_to_is_causal
from .loss_count import LossTail, loss_tail

__all__ = ["CapturedModel", "capture", "capture_lm", "capture_recorded", "check_mean_loss", "fetch_attr"]

log = logging.getLogger(__name__)

#: ``node.meta`` key under which capture stores per-sample tensor facts.
META_KEY = "zorse"

# Ops that only check metadata; they carry no value and would pin a tensor to a
# stage for no reason, so capture drops them.
_ASSERT_OPS = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class CapturedModel:
    """A captured training graph: ``forward(*inputs) -> scalar loss``.

    ``graph_module`` holds every parameter and buffer under its ``get_attr``
    target. ``tied`` maps each ``get_attr`` target to its canonical name: two
    targets that are the same ``nn.Parameter`` (tied input/output embeddings)
    share one canonical name, so the runtime can keep them equal across
    stages.
    """

    graph_module: fx.GraphModule
    #: Names of the model inputs, in call order (placeholders).
    input_names: tuple[str, ...]
    #: ``get_attr`` target -> canonical target (first name of its tie group).
    tied: dict[str, str]
    #: "fx" or "export".
    method: str
    #: Example inputs used for capture (batch ``N``), kept for shape analysis.
    example_inputs: tuple[torch.Tensor, ...]
    #: Attention nodes whose explicit causal mask became ``is_causal=True``
    #: ([Note: causal masks] in ``capture/causal.py``).
    causal_masks: int = 0
    #: "sample_mean" or "token_mean" ([Note: the loss contract]).
    loss_reduction: str = "sample_mean"
    #: A token mean's count: ``loss_count(*inputs)`` -> the tokens the loss averages over, a 0-dim
    #: tensor additive over the samples ([Note: token-mean losses] in ``capture/loss_count.py``);
    #: None for a sample mean.
    loss_count: fx.GraphModule | None = None
    #: The capture cache key of the graph (``cache.export_key``), under which the answers of its fake
    #: runs are kept too ([Note: the analysis cached] in ``capture/cache.py``); None: not cached.
    cache_key: str | None = None

    def state(self) -> dict[str, torch.Tensor]:
        """Every parameter/buffer/constant the graph reads, by canonical name."""
        out: dict[str, torch.Tensor] = {}
        for node in self.graph_module.graph.find_nodes(op="get_attr"):
            canon = self.tied.get(node.target, node.target)
            if canon not in out:
                out[canon] = fetch_attr(self.graph_module, node.target).detach()
        return out

    def trainable(self) -> set[str]:
        """Canonical names of the trainable parameters."""
        names = set()
        for node in self.graph_module.graph.find_nodes(op="get_attr"):
            value = fetch_attr(self.graph_module, node.target)
            if isinstance(value, torch.nn.Parameter) and value.requires_grad:
                names.add(self.tied.get(node.target, node.target))
        return names


def fetch_attr(module: torch.nn.Module, target: str):
    """The attribute a ``get_attr`` node's dotted ``target`` names (``"h.0.attn.c_attn.weight"``)
    on ``module``: a parameter, buffer or constant tensor. Raises ``AttributeError`` naming
    the missing part."""
    obj = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _input_names(model: torch.nn.Module, n: int) -> tuple[str, ...]:
    params = [
        p.name
        for p in inspect.signature(model.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(params) < n:
        raise ModelCaptureError(
            f"{type(model).__name__}.forward takes {len(params)} positional inputs "
            f"but {n} example inputs were given"
        )
    return tuple(params[:n])


def _tie_map(gm: fx.GraphModule) -> dict[str, str]:
    """get_attr target -> canonical target, grouping targets that are one tensor."""
    first_by_id: dict[int, str] = {}
    tied: dict[str, str] = {}
    for node in gm.graph.find_nodes(op="get_attr"):
        value = fetch_attr(gm, node.target)
        if not isinstance(value, torch.Tensor):
            continue
        canon = first_by_id.setdefault(id(value), node.target)
        tied[node.target] = canon
    return tied


class _FlatTracer(fx.Tracer):
    """Traces *through* every submodule (``nn.Linear`` becomes ``F.linear`` on a
    ``get_attr`` weight), so every parameter is a ``get_attr`` node that codegen
    can assign to a stage."""

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return False


def _unaliased(example_inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``example_inputs`` with every input that is, or shares storage with, an
    earlier input replaced by a clone.

    ``torch.export`` deduplicates aliased inputs: for ``capture(m, (ids, ids))``
    one placeholder stands for both, and the graph reads ``labels`` where the
    model reads ``input_ids`` (wrong loss as soon as the labels differ from
    the ids). A clone gives each model input its own placeholder.
    """
    seen: set[tuple[str, int]] = set()
    out = []
    for t in example_inputs:
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if storage.nbytes() and key in seen:
            t = t.clone()
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
        seen.add(key)
        out.append(t)
    return tuple(out)


def _capture_fx(model: torch.nn.Module) -> fx.GraphModule:
    graph = _FlatTracer().trace(model)
    return fx.GraphModule(model, graph, type(model).__name__)


def _capture_export(model: torch.nn.Module, example_inputs, names) -> tuple[fx.GraphModule, str | None]:
    """``model``'s graph by ``torch.export``, and its capture cache key (None: not cached)."""
    from . import cache

    key = (cache.export_key(model, tuple(example_inputs), names)
           if cache.enabled() and cache.cacheable(model) else None)
    live = cache._live_tensors(model)
    got = cache.load_graph(key, live) if key is not None else None  # [Note: the graph record]
    if got is not None:
        log.info("capture of %s read from its graph record", type(model).__name__)
        return got[0], key
    ep = cache.load_exported(key, model) if key is not None else None  # [Note: the capture cache]
    if ep is not None:
        log.info("capture of %s read from %s", type(model).__name__, cache.cache_file(key))
        gm = _module_of(ep)
        cache.save_graph(key, gm, live)
        return gm, key
    batch = torch.export.Dim("batch", min=1, max=1 << 20)
    dynamic = {name: {0: batch} for name in names}
    try:
        ep = torch.export.export(model, tuple(example_inputs), dynamic_shapes=dynamic, strict=False)
        ep = ep.run_decompositions({})
    except Exception as exc:  # torch.export raises many types; re-raise as a user error
        raise ModelCaptureError(
            f"torch.export could not capture {type(model).__name__} with a dynamic batch "
            f"dimension: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}. "
            "Make sure forward(*inputs) returns the scalar loss, every input has the batch in "
            "dim 0, and no Python control flow depends on the batch size."
        ) from exc
    gm = _module_of(ep)
    if key is not None:
        cache.save_exported(key, ep)
        cache.save_graph(key, gm, live)
    return gm, key


#: ``ep.module()`` without its input-guard submodule (torch >= 2.9 generates one by default: code made from
#: guard strings, called first in the graph; the stage modules never held it, and a graph record cannot say
#: it: [Note: the graph record]); an older torch makes none.
_NO_GUARDS = ({"check_guards": False}
              if "check_guards" in inspect.signature(torch.export.ExportedProgram.module).parameters
              else {})


def _module_of(ep) -> fx.GraphModule:
    """``ep`` as a plain graph module. ``ep.module()`` flattens inputs through
    a pytree codegen; the stage modules get a plain graph, so drop it here
    (recompiled by ``_normalise``, which ``capture`` calls next: one recompile of
    ~2,000 nodes less).

    [Note: recompiles deferred while unlifting]
    ``ep.module()`` generates and compiles the Python code of the ~2,000-node graph five times (torch 2.13:
    three times for a copy of the program's module, whose graph it then moves, twice for the unlifted
    module), and ``_normalise`` recompiles the answer once more: 0.75 of 1.1 CPU s of a warm capture's
    ``ep.module()`` (SmolLM2-135M, 2026-12-07, the 2-core machine). Within it, ``GraphModule.recompile``
    is lazy, as torch's own ``_LazyGraphModule``: it sets what it sets without code (``_in_spec`` and
    ``_out_spec`` of a pytree codegen) and makes the module's ``forward`` (its class is its own) compile
    on first access (``inspect.signature(module.forward)``, which the unlifting reads for its input guards,
    or a call); after it, every submodule of the answer still pending is recompiled, and the answer itself
    by ``_normalise``. tests/test_capture_cache.py compares the module with the one made without."""
    real, pending = fx.GraphModule.recompile, {}

    class _CompileOnAccess:
        def __get__(self, obj, cls):
            if obj is None:
                return self
            pending.pop(id(obj), None)
            real(obj)  # sets cls.forward, replacing this
            return obj.forward

    def deferred(self):
        if isinstance(self._graph._codegen, fx.graph._PyTreeCodeGen):
            self._in_spec = self._graph._codegen.pytree_info.in_spec
            self._out_spec = self._graph._codegen.pytree_info.out_spec
        if type(self) is fx.GraphModule:  # (a class of its own per module, as GraphModule.__new__ makes it)
            return real(self)
        type(self).forward = _CompileOnAccess()
        pending[id(self)] = self

    from .cache import collector_paused

    fx.GraphModule.recompile = deferred
    try:
        with collector_paused():  # [Note: the collector paused while loading] in cache.py
            gm = ep.module(**_NO_GUARDS)
    finally:
        fx.GraphModule.recompile = real
    for node in gm.graph.find_nodes(op="call_module", target="_guards_fn"):  # (a torch without check_guards)
        gm.graph.erase_node(node)
        del gm._guards_fn
    for sub in gm.modules():
        if sub is not gm and id(sub) in pending:
            sub.recompile()
    gm.graph._codegen = fx.graph.CodeGen()
    return gm


def _normalise(gm: fx.GraphModule) -> None:
    """Drop metadata asserts; make a 1-tuple output a plain value."""
    out = next(iter(gm.graph.find_nodes(op="output")))
    if isinstance(out.args[0], (tuple, list)) and len(out.args[0]) == 1:
        out.args = (out.args[0][0],)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _ASSERT_OPS and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


def capture(
    model: torch.nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    *,
    method: str = "auto",
    causal_masks: bool = True,
) -> CapturedModel:
    """Capture ``model`` as an fx graph of one training forward (inputs -> loss).

    Args:
        model: returns a scalar loss from ``forward(*example_inputs)``.
        example_inputs: tensors with the batch in dim 0 (``(N, T)`` token ids,
            labels, ...); ``N >= 2`` so the batch dimension is not specialised.
            One tensor may be passed for several inputs (``(ids, ids)``): an
            input sharing storage with an earlier one is cloned first, so each
            input keeps its own placeholder (``torch.export`` would merge them).
        method: "fx", "export" or "auto" (fx first, export if fx tracing fails;
            Hugging Face ``PreTrainedModel`` submodules go straight to export).
        causal_masks: turn an explicit causal attention mask into
            ``is_causal=True`` where the graph shows them equal
            (``capture.causal``, [Note: causal masks]); False keeps every mask.

    Raises:
        ModelCaptureError: the model cannot be captured, does not return a
            scalar, or an input has no batch dimension; a batch-norm layer is
            in training mode; the loss is neither the mean over the samples
            nor over the tokens it counts ([Note: the loss contract]).
    """
    if not isinstance(example_inputs, tuple) or not example_inputs:
        raise ModelCaptureError("example_inputs must be a non-empty tuple of tensors")
    for i, t in enumerate(example_inputs):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            raise ModelCaptureError(
                f"example_inputs[{i}] must be a tensor with the batch in dim 0, got "
                f"{type(t).__name__}{'' if not isinstance(t, torch.Tensor) else ' of shape ' + str(tuple(t.shape))}"
            )
        if t.shape[0] < 2:
            raise ModelCaptureError(
                f"example_inputs[{i}] has batch size {t.shape[0]}; use at least 2 so the batch "
                "dimension stays symbolic"
            )
    _refuse_batch_statistics(model)
    check_wrapped_models(model)  # a T5 or a masked LM inside a wrapper: one line, not a tracing error
    names = _input_names(model, len(example_inputs))
    example_inputs = _unaliased(example_inputs)
    key = None  # the capture cache key of an exported graph ([Note: the loss check cached] in cache.py)
    if method == "auto":
        method = "export" if _is_hf(model) else "fx"
        if method == "fx":
            try:
                gm = _capture_fx(model)
            except Exception as exc:  # symbolic_trace raises TraceError, TypeError, ...
                log.info("symbolic_trace failed (%s); falling back to torch.export", exc)
                method = "export"
    if method == "fx":
        gm = _capture_fx(model) if "gm" not in locals() else gm
    elif method == "export":
        gm, key = _capture_export(model, example_inputs, names)
    else:
        raise ModelCaptureError(f"unknown capture method {method!r}; use 'fx', 'export' or 'auto'")
    _normalise(gm)
    rewritten = causal_masks_to_is_causal(gm) if causal_masks else 0
    reduction = _recorded_reduction((*model.parameters(), *model.buffers()), gm, key)  # [Note: the loss check cached]
    if reduction is not None:
        tail = loss_tail(gm, example_inputs)
    else:
        with torch.no_grad():
            loss = gm(*example_inputs)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            got = type(loss).__name__ if not isinstance(loss, torch.Tensor) else f"shape {tuple(loss.shape)}"
            raise ModelCaptureError(
                f"{type(model).__name__}.forward must return the scalar training loss, got {got}. "
                "Wrap the model so forward(*inputs) returns loss (e.g. zorse_fx.models.hf.CausalLMWithLoss)."
            )
        tail = loss_tail(gm, example_inputs)
        reduction = check_mean_loss(model, example_inputs, tail=tail)
        if key is not None and not _on_meta(model, example_inputs):  # checked on values: recorded
            from . import cache

            cache.save_loss_check(key, reduction)
    placeholders = [n.target for n in gm.graph.find_nodes(op="placeholder")]
    return CapturedModel(
        graph_module=gm,
        input_names=tuple(placeholders),
        tied=_tie_map(gm),
        method=method,
        example_inputs=tuple(example_inputs),
        causal_masks=rewritten,
        loss_reduction=reduction,
        loss_count=tail.count if reduction == "token_mean" else None,
        cache_key=key,
    )


def _on_meta(model: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...]) -> bool:
    """Whether any input, parameter or buffer is on the meta device (shapes only, no values)."""
    return any(t.device.type == "meta" for t in (*example_inputs, *model.parameters(), *model.buffers()))


def _recorded_reduction(tensors, gm: fx.GraphModule, key: str | None) -> str | None:
    """The loss reduction a check of a model with capture key ``key`` recorded, where ``gm``'s output is a
    scalar by its recorded metadata and every one of ``tensors`` (the model's parameters and buffers) holds
    finite values; else None (the captured graph is run and the loss checked) ([Note: the loss check cached]
    in cache.py)."""
    if key is None:
        return None
    from . import cache

    recorded = cache.load_loss_check(key)
    if recorded is None:
        return None
    out = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    value = out.meta.get("val") if isinstance(out, fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        return None
    tensors = tuple(tensors)
    if any(t.device.type == "meta" for t in tensors):
        return None
    # One thread: ~300 sums of a few MB each, which torch's thread pool took 0.4-1.7 CPU s to run on two
    # threads on the 2-core machine while another process used it, and 0.03 on one (2026-12-07).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():  # a tensor holding a NaN or an infinity has a non-finite sum (so has one that overflows)
            sums = [t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32).double()
                    for t in tensors if t.is_floating_point()]
            if sums and not bool(torch.isfinite(torch.stack(sums)).all()):
                return None
    finally:
        torch.set_num_threads(threads)
    return recorded


def capture_recorded(key: str, tensors: dict[str, torch.Tensor], example_inputs: tuple[torch.Tensor, ...], *,
                     causal_masks: bool = True) -> CapturedModel | None:
    """What ``capture(model, example_inputs)`` gives for a model whose capture cache key is ``key``, from
    the cached graph and the model's parameters and buffers by name (``tensors``: as ``named_parameters``
    and ``named_buffers`` with duplicates name them, tied ones the same object), without the model; None
    where the graph is not in the cache, does not fit ``tensors``, or its loss check is not recorded (then
    the model is captured) ([Note: a warm plan without the model] in api.py)."""
    from . import cache

    example_inputs = _unaliased(example_inputs)
    got = cache.load_graph(key, tensors)  # [Note: the graph record]
    if got is not None:
        gm, constants = got
    else:
        ep = cache.load_exported(key, tensors)
        if ep is None:
            return None
        constants = [c for c in ep.constants.values() if isinstance(c, torch.Tensor)]
        gm = _module_of(ep)
        cache.save_graph(key, gm, tensors)
    _normalise(gm)
    rewritten = causal_masks_to_is_causal(gm) if causal_masks else 0
    reduction = _recorded_reduction((*{id(t): t for t in tensors.values()}.values(), *constants), gm, key)
    if reduction is None:
        return None
    tail = loss_tail(gm, example_inputs)
    placeholders = [n.target for n in gm.graph.find_nodes(op="placeholder")]
    return CapturedModel(graph_module=gm, input_names=tuple(placeholders), tied=_tie_map(gm), method="export",
                         example_inputs=tuple(example_inputs), causal_masks=rewritten, loss_reduction=reduction,
                         loss_count=tail.count if reduction == "token_mean" else None, cache_key=key)


def _refuse_batch_statistics(model: torch.nn.Module) -> None:
    """Refuse a batch-norm layer in training mode: it normalises each sample by
    statistics of the batch it is given, so a micro-batch split over GPUs (and
    over micro-batches) computes another function than the whole batch."""
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training:
            raise ModelCaptureError(
                f"{type(m).__name__} {name or type(model).__name__!r} normalises with batch statistics in "
                "training mode, which a batch split over GPUs and micro-batches changes; zorse_fx cannot train it "
                "equal to single-device training: use a per-sample norm (LayerNorm, GroupNorm) or freeze its "
                "statistics (call .eval() on it)")


def check_mean_loss(model: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], *,
                    tail: LossTail | None = None) -> str:
    """Check the loss contract on the example batch ([Note: the loss
    contract]): ``forward`` returns the mean loss over its samples, or over
    the tokens ``tail.count`` counts (``capture.loss_count.loss_tail`` of the
    captured graph; None: no count).

    Returns:
        "token_mean" where the count explains the loss (it is additive over
        the samples and the batch's loss is the count-weighted mean of its
        halves' losses; on an example batch without padding the sample mean
        agrees), else "sample_mean".

    Raises:
        ModelCaptureError: one line: the loss is a sum over the samples, or
            neither weighting explains it (the divisor and why it is not a
            count named where the graph has one), and what to change.
    """
    tail = tail or LossTail()
    name = type(model).__name__
    if tail.refusal:
        raise ModelCaptureError(f"{name}.forward {tail.refusal}")
    tensors = (*example_inputs, *model.parameters(), *model.buffers())
    if any(t.device.type == "meta" for t in tensors):  # shapes only (a model built on the meta device)
        return "token_mean" if tail.count is not None else "sample_mean"  # the graph's word: no values
    n = int(example_inputs[0].shape[0])
    h = n // 2
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    rtol = min(0.05, 1e3 * torch.finfo(dtype).eps)  # float32: 1.2e-4; 16-bit weights: 0.05

    def close(a: float, b: float, tol: float) -> bool:
        return abs(a - b) <= tol * max(abs(a), abs(b)) + 1e-6

    def loss(a: int, b: int, seed: int) -> float:
        torch.manual_seed(seed)
        return float(model(*(t[a:b] for t in example_inputs)).double())

    counts = None
    if tail.count is not None:
        with torch.no_grad():
            per = [float(tail.count(*(t[i:i + 1] for t in example_inputs))) for i in range(n)]
            value = tail.count(*example_inputs)
        whole = float(value)
        counts = (whole, sum(per[:h]), sum(per[h:]))
        # integer counts add exactly; float ones (class weights) to their rounding over the batch's elements
        ctol = min(0.05, torch.finfo(value.dtype).eps * example_inputs[0].numel()) if value.is_floating_point() else 0.0
        if not close(whole, sum(per), ctol) or min(per) < 0:
            raise ModelCaptureError(
                f"{name}.forward divides its loss by {tail.divisor}, which is not a count over the samples: it "
                f"is {whole:.6g} on the example batch of {n} but its samples' values {_few(per)} sum to "
                f"{sum(per):.6g}; zorse_fx weights each GPU's loss by the tokens it counts, so the divisor must be "
                f"a sum over the samples' tokens: divide by mask.sum() with a 0/1 mask of the inputs (or use "
                f"cross_entropy(..., ignore_index=PAD))")
        if whole == 0:
            raise ModelCaptureError(
                f"{name}.forward divides its loss by {tail.divisor}, which counts no token on the example batch "
                f"of {n}: capture cannot check the loss on it; give example inputs with counted tokens (labels "
                f"that are not all ignored)")

    def explained(full: float, first: float, second: float, tol: float) -> str | None:
        if counts is not None:
            whole, c1, c2 = counts
            token = (c1 * (first if c1 else 0.0) + c2 * (second if c2 else 0.0)) / whole
            if close(full, token, tol):
                return "token_mean"
        if close(full, (h * first + (n - h) * second) / n, tol):
            return "sample_mean"
        return None

    training = {m: m.training for m in model.modules()}
    model.eval()  # no dropout modules: the three forwards see the same function
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            full, first, second = loss(0, n, 0), loss(0, h, 0), loss(h, n, 0)
            if explained(full, first, second, rtol) is None and not close(full, loss(0, n, 1), rtol):
                rtol = _STOCHASTIC_RTOL  # random even in eval mode (functional dropout): gross errors only
    finally:
        for m, flag in training.items():
            m.training = flag
    found = explained(full, first, second, rtol)
    if found is not None:
        return found
    mean = (h * first + (n - h) * second) / n
    halves = (f"on the example batch of {n} it returns {full:.6g}, but its halves return {first:.6g} and "
              f"{second:.6g}, whose mean is {mean:.6g}")
    if counts is not None:
        whole, c1, c2 = counts
        token = (c1 * (first if c1 else 0.0) + c2 * (second if c2 else 0.0)) / whole
        raise ModelCaptureError(
            f"{name}.forward must return the mean loss over its samples or over the tokens it counts: it divides "
            f"by {tail.divisor} ({whole:.6g} on the example batch of {n}, {c1:.6g} and {c2:.6g} on its halves), "
            f"but returns {full:.6g} where its halves' {first:.6g} and {second:.6g} give {token:.6g} weighted by "
            f"their counts and {mean:.6g} by their samples; the numerator must be a sum over the same tokens: "
            f"return sum(loss * mask) / mask.sum(), or cross_entropy(..., ignore_index=PAD)")
    if close(full, first + second, rtol):
        looks = "it is their sum: a sum over the samples"
    elif tail.problem:
        looks = (f"it is not their mean, and it divides by {tail.divisor}, which {tail.problem}, so it is no "
                 f"count of tokens either (a token mean divides by a count computed from the inputs alone)")
    else:
        looks = "it is not their mean"
    raise ModelCaptureError(
        f"{name}.forward must return the mean loss over its samples (or over the tokens it counts from its "
        f"inputs): {halves}; {looks}. Each GPU's loss is weighted by its share of the batch (or of the counted "
        f"tokens), so another reduction trains wrong: use reduction='mean' (or divide the loss by the batch "
        f"size, or a sum over tokens by mask.sum() with a mask computed from the inputs)")


def _few(values: list[float]) -> str:
    """``values`` for a message: the first 6 and a count of the rest."""
    shown = ", ".join(f"{v:.6g}" for v in values[:6])
    return f"[{shown}{f', ... ({len(values) - 6} more)' if len(values) > 6 else ''}]"


#: ``check_mean_loss``'s relative tolerance for a forward that is random in eval
#: mode: a sum over the samples is at least twice the mean of its halves' sums
#: (50% off), noise of a few percent passes.
_STOCHASTIC_RTOL = 0.25


def _is_hf(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds a Hugging Face ``PreTrainedModel``. A model of
    that class exists only once ``transformers`` is imported, so a model built
    without it is answered without importing it (seconds on a small CPU)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return False
    return any(isinstance(m, transformers.PreTrainedModel) for m in model.modules())


def capture_lm(model: torch.nn.Module, seq_len: int) -> tuple[CapturedModel, str]:
    """A language model captured for pricing a plan of sequence length ``seq_len`` (tokens): a Hugging
    Face causal LM wrapped in ``CausalLMWithLoss`` (``(input_ids, labels) -> loss``, label mode
    ``"same"``: the model shifts its labels), any other model as given (``"shifted"``); the example
    inputs are (2, ``seq_len``) token ids below 200 (only their shapes and dtype matter to the graph).
    Returns (the captured model, its label mode).

    Raises:
        ModelCaptureError: as ``capture``."""
    from ..models.hf import CausalLMWithLoss, is_hf_causal_lm

    label_mode = "shifted"
    if is_hf_causal_lm(model):
        model, label_mode = CausalLMWithLoss(model), "same"
    ids = torch.randint(0, 200, (2, seq_len))
    return capture(model, (ids, ids)), label_mode
