"""Training-state activations of the block graph: what autograd saves per
sample while each block runs forward (``measure_saved_activations``, see
[Note: saved activations] below), with the output-bytes estimate as the
fallback (``saved_activations_or_estimate``). Split from ``roofline.py``,
which re-exports these names and uses them in ``block_costs``.

Units: bytes per sample (batch 1)."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from ..capture.analysis import BlockGraph
from ..capture.trace import META_KEY, fetch_attr
from ..ir.tensor import ITEMSIZE
from ..precision import PrecisionPolicy, precision_policy
from .opclass import op_class, tensors_in

if TYPE_CHECKING:
    from .roofline import NodeCost

__all__ = ["SavedActivations", "measure_saved_activations", "saved_activations_or_estimate",
           "saved_activation_bytes", "loss_backward_transient_bytes"]

log = logging.getLogger(__name__)


def _out_bytes(node: fx.Node) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_in(node.meta[META_KEY].get("val_batch1")))


def _output_bytes_estimate(bg: BlockGraph, costs: dict[str, NodeCost]) -> list[int]:
    """The fallback: per block, the output bytes of its non-view nodes (an upper
    bound, about 2x what autograd saves for a transformer layer)."""
    nodes = {n.name: n for n in bg.graph.nodes}
    return [int(sum(_out_bytes(nodes[n]) for n in bg.block_nodes(b) if costs[n].bytes > 0))
            for b in range(bg.num_blocks)]


@dataclass(frozen=True, slots=True, kw_only=True)
class SavedActivations:
    """What one measurement run of the graph under a precision policy found
    (``measure_saved_activations``; see [Note: saved activations])."""

    #: ``(B,)`` bytes autograd saves per sample while block ``b`` runs forward.
    bytes_per_sample: tuple[int, ...]
    #: Act node name -> dtype name (``"float32"``, ``"bfloat16"``, ...) of its
    #: tensor output under the policy's autocast; empty when not measured.
    output_dtypes: dict[str, str]
    #: False: the measurement could not run and ``bytes_per_sample`` is the
    #: output-bytes estimate (``output_dtypes`` then empty: capture dtypes).
    measured: bool = True
    #: Trainable parameters (canonical names, as ``BlockGraph.block_attrs``) autocast cast to the compute dtype in the run: the
    #: weights whose 16-bit gradient the runtime casts back to float32 every micro-batch ([Note: the
    #: runtime's gradient work] in ``roofline.py``); empty under fp32; None: not measured (every
    #: trainable parameter is taken as cast under a mixed policy).
    cast_params: frozenset[str] | None = None


def saved_activations_or_estimate(bg: BlockGraph, precision: PrecisionPolicy) -> SavedActivations:
    """``measure_saved_activations(bg, precision)``, or, where the fake run
    fails, a ``UserWarning`` and the output bytes of every non-view node."""
    try:
        return measure_saved_activations(bg, precision)
    except Exception as exc:  # any op may fail on fake tensors; planning goes on with the estimate
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        warnings.warn(
            f"could not measure the activations autograd saves ({type(exc).__name__}: {first}); "
            "using the output bytes of every non-view node instead, which overestimates activation "
            "memory (about 2x for a transformer layer)", stacklevel=3)
        from .roofline import node_costs  # roofline imports this module
        estimate = _output_bytes_estimate(bg, node_costs(bg))
        return SavedActivations(bytes_per_sample=tuple(estimate), output_dtypes={}, measured=False)


# [Note: saved activations]
# What a training step keeps per sample between a block's forward and its
# backward is the set of tensors autograd saves (``ctx.save_for_backward`` and
# the saved inputs/outputs of the ATen backward formulas), nothing else: the
# other intermediate outputs are freed as soon as their last forward user ran.
# ``measure_saved_activations`` runs the captured graph once at batch 1 on
# FakeTensors (no real memory, so a 13B model on the meta device measures in
# seconds) with the trainable parameters requiring grad, under
# ``torch.autograd.graph.saved_tensors_hooks``; an ``fx.Interpreter`` knows
# which node, hence which block, is running when a tensor is packed.
#
# * Precision: under a mixed policy the run is inside
#   ``torch.autocast("cpu", dtype=compute_dtype)``, as the runtime's step is
#   inside autocast ([Note: mixed precision] in ``zorse_fx/precision.py``), so
#   the saved set is what autocast makes: 16-bit inputs of the matmuls,
#   float32 where the graph casts explicitly (an RMSNorm's ``.to(float32)``)
#   or autocast keeps float32 (the loss). The dtype of every node's output in
#   that run is recorded too (``SavedActivations.output_dtypes``): a tensor
#   crossing a pipeline cut travels in that dtype (``BlockGraph.with_dtypes``).
#   CPU autocast acts on CPU tensors only, so a model captured on the meta
#   device (planned without allocating it) is run as CPU fake tensors, every
#   ``device=meta`` in the graph's calls read as ``cpu``.
#   Autocast's own weight casts (``aten._to_copy`` of a trainable parameter,
#   recorded by a ``TorchDispatchMode`` inside the fake run) are skipped: the
#   runtime's one autocast region per step caches ONE 16-bit copy of each
#   weight for all micro-batches, charged per parameter
#   (``PrecisionPolicy.cast_bytes_per_param``), not per sample; which weights
#   were cast is kept (``SavedActivations.cast_params``): the runtime casts their
#   16-bit gradients back every micro-batch ([Note: the runtime's gradient work]
#   in roofline.py). Casts of a
#   *view* of a parameter (``mm(x, w.t())``) are not cached by autocast, are
#   made per use and stay counted (per sample: an overcount; the captured
#   graphs pass ``linear`` the parameter itself).
#   Known gap: the run uses autocast's CPU op lists. On CUDA autocast also
#   runs softmax, log_softmax, layer_norm, pow, exp, rsqrt and sum in float32
#   when given 16-bit inputs, and CPU autocast does not; a graph applying
#   those to 16-bit values (HF GPT-2's eager attention softmax and its
#   tanh-GELU's ``pow``) saves float32 tensors on a GPU where this counts
#   16-bit ones. The repo's GPT and HF Llama apply them to float32 values
#   only (the residual stream, RMSNorm's explicit float32, the float32 loss),
#   so the two agree there.
# * Counted: each distinct storage once (``untyped_storage()._cdata``, which
#   views of one tensor share, also for fake tensors), its full ``nbytes``
#   (a saved view keeps the whole storage alive). Parameters and buffers (and
#   views of them, e.g. ``weight.t()``) are training state, counted elsewhere,
#   so storages of ``get_attr`` values are skipped. Model inputs saved by an
#   op (token ids of an embedding) count.
# * Attribution: a storage saved by several nodes counts in the block of the
#   FIRST node that saves it, not the block that produced it. The residual
#   stream is produced at the end of block b and saved by the norm at the start
#   of block b+1, so when a pipeline cut falls between them the stage holding
#   that saved copy (the later one, which receives it) is charged, which is
#   right. The error at a cut: a value that crosses the cut and is saved on
#   BOTH sides is held by both stages but charged only to the earlier one, so
#   the later stage is undercounted by at most the crossing tensors (one
#   hidden state, ``cut_bytes_per_sample``, per cut); the earlier stage is exact.
# * Attention: which kernel ``scaled_dot_product_attention`` picks depends on
#   the device (on meta it is the math fallback, which saves the (T, S)
#   probabilities), but a GPU runs a fused kernel (FlashAttention-2 or
#   memory-efficient attention) that saves q, k, v, the mask, the output and
#   the (N, H, T) fp32 log-sum-exp. For sdpa nodes that set is recorded
#   instead of what the fake run saves. Under a mixed policy autocast hands
#   the kernel q, k, v (and a floating mask) in the compute dtype, copying
#   those that are not (Llama's rotary output is float32: bfloat16 q times
#   float32 cos); the recorded set is those 16-bit tensors and a 16-bit
#   output. Explicit (eager) attention, written as matmul + softmax in the
#   model, is measured like any other op.
# * Per sample: the run is at batch 1. Saved values that do not grow with the
#   batch (rotary tables, masks) are thus counted per sample, a small
#   overcount for micro-batches of more than one sample.
# * Recomputation ([C-recompute] in ``solve/objective.py``) keeps only the
#   stage inputs of in-flight micro-batches and re-creates these saved
#   tensors for one micro-batch at a time; that is what A_s means there too.


class _WeightCasts(TorchDispatchMode):
    """Records the storages of ``aten._to_copy`` outputs whose input is one of
    ``params`` (by identity): autocast's cached weight casts; and which of
    ``params`` were cast (``cast``: their ids)."""

    def __init__(self, params: list[torch.Tensor]):
        super().__init__()
        self.param_ids = {id(p) for p in params}
        self.storages: set[int] = set()
        self.cast: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and id(args[0]) in self.param_ids:
            self.storages.add(out.untyped_storage()._cdata)
            self.cast.add(id(args[0]))
        return out


class _SavedTensorRecorder(fx.Interpreter):
    """Runs a captured graph on fake tensors, recording ``(node, tensor)`` for
    every tensor autograd saves and the dtype of every node's tensor output
    (see [Note: saved activations])."""

    def __init__(self, gm: fx.GraphModule, attrs: dict[str, torch.Tensor], attention: set[str],
                 autocast_dtype: torch.dtype | None, meta_as_cpu: bool):
        super().__init__(gm)
        self.attrs = attrs
        self.attention = attention
        self.autocast_dtype = autocast_dtype
        self.meta_as_cpu = meta_as_cpu
        self.node: str | None = None
        self.suspended = False
        self.saved: list[tuple[str | None, torch.Tensor]] = []
        self.dtypes: dict[str, str] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if not self.suspended:
            self.saved.append((self.node, t))
        return t

    def get_attr(self, target, args, kwargs):
        return self.attrs[target] if target in self.attrs else super().get_attr(target, args, kwargs)

    def run_node(self, n: fx.Node):
        self.node = n.name
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.dtypes[n.name] = str(out.dtype).removeprefix("torch.")
        return out

    def _autocast(self, x):
        """What autocast makes of a fused-attention argument: floating tensors in the compute dtype."""
        if (self.autocast_dtype is not None and isinstance(x, torch.Tensor) and x.is_floating_point()
                and x.dtype not in (self.autocast_dtype, torch.float64)):
            return x.to(self.autocast_dtype)
        return x

    def _devices(self, args, kwargs):
        """``args``, ``kwargs`` with ``device=meta`` read as ``cpu`` (``meta_as_cpu``)."""
        if not self.meta_as_cpu:
            return args, kwargs
        cpu = torch.device("cpu")
        return tree_map(lambda x: cpu if isinstance(x, torch.device) and x.type == "meta" else x, (args, kwargs))

    def call_method(self, target, args, kwargs):
        return super().call_method(target, *self._devices(args, kwargs))

    def call_function(self, target, args, kwargs):
        args, kwargs = self._devices(args, kwargs)
        if self.node not in self.attention:
            return super().call_function(target, args, kwargs)
        self.suspended = True
        try:
            args = tuple(self._autocast(a) for a in args)
            kwargs = {k: self._autocast(v) for k, v in kwargs.items()}
            out = super().call_function(target, args, kwargs)
        finally:
            self.suspended = False
        # What a fused GPU attention kernel saves: q, k, v, mask, out, and the
        # fp32 log-sum-exp per (sample, head, query).
        q, k, v, mask = (args[i] if i < len(args) else kwargs.get(name)
                         for i, name in enumerate(("query", "key", "value", "attn_mask")))
        for t in (q, k, v, mask, out):
            if isinstance(t, torch.Tensor):
                self.saved.append((self.node, t))
        self.saved.append((self.node, torch.empty(tuple(q.shape[:-1]), dtype=torch.float32, device=q.device)))
        return out


def measure_saved_activations(bg: BlockGraph, precision: PrecisionPolicy) -> SavedActivations:
    """Per block: bytes of the tensors autograd saves for backward, for one
    sample, under ``precision``'s autocast; and the dtype of every node's output.

    Measured on FakeTensors at batch 1 (see [Note: saved activations]): each
    storage once, parameters, buffers and autocast's weight casts excluded, a
    storage saved by several blocks charged to the first.

    Raises:
        Exception: whatever the fake run raises (an op without a fake kernel,
            a backward setup that reads tensor data), or RuntimeError when the
            loss does not require grad (nothing was recorded).
    """
    from ..capture import cache

    gm = bg.captured.graph_module
    block_of = {name: b for b in range(bg.num_blocks) for name in bg.block_nodes(b)}
    # [Note: the analysis cached] in capture/cache.py: per node, the bytes of the storages first saved there
    key = cache.record_key(bg.captured, "activations", precision.name, precision.compute_dtype_name)
    rec = cache.load_record("activations", key)
    if rec is not None:
        try:
            first, run_dtypes, cast = rec["first_saved_bytes"], rec["output_dtypes"], rec["cast_params"]
            if not (isinstance(first, dict) and isinstance(run_dtypes, dict) and isinstance(cast, list)
                    and all(isinstance(v, int) for v in first.values())
                    and all(isinstance(v, str) for v in run_dtypes.values())
                    and all(isinstance(v, str) for v in cast)):
                raise ValueError("not a record of saved bytes, dtypes and cast parameters")
            acts = [0] * bg.num_blocks
            for name, nbytes in first.items():
                if name in block_of:
                    acts[block_of[name]] += nbytes
            return SavedActivations(bytes_per_sample=tuple(acts), output_dtypes={
                name: run_dtypes[name] for name in bg.act_order if name in run_dtypes}, cast_params=frozenset(cast))
        except (KeyError, TypeError, ValueError) as exc:
            log.info("activations record %s not used: %s: %s", key, type(exc).__name__, exc)
    nodes = {n.name: n for n in gm.graph.nodes}
    attention = {name for name in bg.act_order if op_class(nodes[name]) == "attention"}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    meta_as_cpu = precision.mixed  # CPU autocast needs CPU tensors (see the note)

    def as_fake(t: torch.Tensor) -> torch.Tensor:
        if meta_as_cpu and t.device.type == "meta":
            with mode:
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
        return mode.from_tensor(t)

    attrs: dict[str, torch.Tensor] = {}
    by_id: dict[int, torch.Tensor] = {}  # one fake tensor per real one: tied weights stay tied
    trainable: list[torch.Tensor] = []
    names_of: dict[int, list[str]] = {}  # fake parameter -> its get_attr targets
    for node in gm.graph.find_nodes(op="get_attr"):
        value = fetch_attr(gm, node.target)
        if not isinstance(value, torch.Tensor):
            continue
        if id(value) not in by_id:
            fake = as_fake(value.detach())
            if isinstance(value, torch.nn.Parameter) and value.requires_grad:
                fake.requires_grad_(True)
                trainable.append(fake)
            by_id[id(value)] = fake
        attrs[node.target] = by_id[id(value)]
        names_of.setdefault(id(by_id[id(value)]), []).append(node.target)
    inputs = tuple(as_fake(t[:1].clone()) for t in bg.captured.example_inputs)
    rec = _SavedTensorRecorder(gm, attrs, attention, precision.compute_dtype if precision.mixed else None,
                               meta_as_cpu)
    casts = _WeightCasts(trainable if precision.mixed else [])  # autocast's casts only
    with mode:
        state = {t.untyped_storage()._cdata for t in attrs.values()}
        # One autocast region for the whole run, as the runtime's step: its
        # cache holds each weight's cast once.
        with (torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t),
              precision.autocast("cpu"), casts):
            loss = rec.run(*inputs)
        if not (isinstance(loss, torch.Tensor) and loss.requires_grad):
            raise RuntimeError("the loss does not require grad in the measurement run")
        acts = [0] * bg.num_blocks
        first: dict[str, int] = {}  # per node: the bytes of the storages it is the first to save
        seen = state | casts.storages
        # rec.saved (and the autograd graph of ``loss``) keep every recorded
        # tensor alive, so no storage address is reused while counting.
        for name, t in rec.saved:
            storage = t.untyped_storage()
            cdata = storage._cdata
            if cdata in seen:
                continue
            seen.add(cdata)
            first[name] = first.get(name, 0) + int(storage.nbytes())
            if name in block_of:  # free nodes read no grad-requiring value, so save nothing
                acts[block_of[name]] += int(storage.nbytes())
    del loss
    dtypes = {name: rec.dtypes[name] for name in bg.act_order if name in rec.dtypes}
    tied = bg.captured.tied
    cast = sorted({tied.get(name, name) for i in casts.cast for name in names_of[i]})  # canonical names
    cache.save_record("activations", key, {"first_saved_bytes": first, "output_dtypes": dict(rec.dtypes),
                                           "cast_params": cast})
    return SavedActivations(bytes_per_sample=tuple(acts), output_dtypes=dtypes, cast_params=frozenset(cast))


def saved_activation_bytes(bg: BlockGraph, precision: PrecisionPolicy | None = None) -> list[int]:
    """``measure_saved_activations(bg, precision).bytes_per_sample`` as a list;
    ``precision`` None: fp32 (no autocast: the graph's own dtypes)."""
    return list(measure_saved_activations(bg, precision or precision_policy("fp32")).bytes_per_sample)


def loss_backward_transient_bytes(bg: BlockGraph, output_dtypes: dict[str, str]) -> int:
    """Bytes per sample (batch 1), the working memory of the loss block's backward beyond
    what autograd saves: while an op's backward runs, the gradient of its
    output and the gradient of its activation inputs are live together, so
    the block's transient is the largest (output + activation inputs) bytes
    of one of its floating ops, in the dtypes ``output_dtypes`` gives them
    (the policy's autocast; the capture dtype where missing). For a causal
    LM it is the log-softmax over the logits: two logits-sized float32
    gradients (``bench/memory_cpu.py`` measured exactly that, 2 x 32 MiB of
    "autograd detail" at the peak, on a 32768-token vocabulary; ``make
    gpu-check`` a 1.87 GiB gap on SmolLM2-135M where two logits are 1.5 GiB).

    Only the loss block's: it is the largest in a language model (the
    vocabulary is wider than the hidden size), it runs on the last stage,
    which holds one micro-batch in flight under 1F1B, so it is added to that
    block's saved bytes (``block_costs``). A body block's transient (an MLP's
    4h-wide gradient) is smaller and not modelled."""
    nodes = {n.name: n for n in bg.graph.nodes}

    def numel(n: fx.Node) -> int:  # floating elements of the node's batch-1 output
        return sum(t.numel() for t in tensors_in(n.meta[META_KEY].get("val_batch1")) if t.is_floating_point())

    def nbytes(n: fx.Node) -> int:
        dtype = output_dtypes.get(n.name)
        if dtype is None:  # not measured: the capture dtypes
            return sum(t.numel() * t.element_size() for t in tensors_in(n.meta[META_KEY].get("val_batch1"))
                       if t.is_floating_point())
        return numel(n) * ITEMSIZE[dtype]

    best = 0
    for name in bg.block_nodes(bg.num_blocks - 1):
        n = nodes[name]
        if n.op != "call_function" or not nbytes(n):
            continue
        ins = {a.name: a for a in n.all_input_nodes if a.meta.get(META_KEY, {}).get("kind") == "act"}
        here = nbytes(n) + sum(nbytes(a) for a in ins.values())
        if n.target is torch.ops.aten.cross_entropy_loss.default and n.args:
            # nll_loss(log_softmax(x)) inside one node: the log-softmax's input and output live together
            # in the loss's dtype (float32 under autocast, whatever x's dtype is: a 16-bit x is upcast).
            here = max(here, 2 * numel(n.args[0]) * ITEMSIZE[output_dtypes.get(n.name, "float32")])
        best = max(best, here)
    return best
