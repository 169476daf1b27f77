"""Roofline cost of the block graph per GPU type: FLOPs and bytes per fx node.

Per node (from the fake-tensor values at batch 1, i.e. per sample):

- matmul-class (``linear``, ``mm``, ``bmm``, ``addmm``, ``matmul``):
  ``2 * numel(out) * K`` FLOPs (one multiply-add = 2 FLOPs);
- ``scaled_dot_product_attention`` with q ``(N, H, T, D)``, k ``(N, H, S, D)``:
  ``4 * N * H * T * S * D`` FLOPs (``QK^T`` and ``PV``), as in FlashAttention
  (Dao et al. 2022) FLOP accounting;
- views (``view``, ``transpose``, ``expand``, ...): free;
- everything else: ``numel(out)`` FLOPs and the bytes it reads and writes.

Time of a node on a GPU: ``max(flops / (peak * MATMUL_EFFICIENCY),
bytes / (mem_bw * MEMORY_EFFICIENCY))``. Forward+backward = 3x forward (the
backward of a matmul is two matmuls of the same size: Narayanan et al.,
SC'21, "Efficient large-scale language model training on GPU clusters", eq. 3).
Every non-view node also costs a fixed ``3 * KERNEL_OVERHEAD_S`` per
micro-batch (one forward and about two backward kernels), whatever its sample
count: this is what makes tiny micro-batches slow on a real GPU. The
efficiencies and the overhead are assumptions until a measured profile
replaces them (issue 3, ``zorse bench kernels``).

Activation memory (``act_bytes_per_sample``) is measured, not modelled: see
[Note: saved activations].
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from ..capture.analysis import BlockGraph
from ..capture.trace import META_KEY, _fetch_attr
from ..cluster import GPUSpec
from ..solve.records import BlockCosts
from .opclass import flops_bytes, op_class, tensors_in

__all__ = ["NodeCost", "node_costs", "block_costs", "saved_activation_bytes", "MATMUL_EFFICIENCY",
           "MEMORY_EFFICIENCY", "FWD_BWD_FACTOR", "KERNEL_OVERHEAD_S"]

#: Fraction of datasheet peak FLOP/s a large matmul reaches (assumption; typical
#: for cuBLAS GEMMs of transformer sizes, replaced by measured profiles).
MATMUL_EFFICIENCY = 0.6
#: Fraction of datasheet memory bandwidth an elementwise kernel reaches (assumption).
MEMORY_EFFICIENCY = 0.7
#: forward + backward time = FWD_BWD_FACTOR x forward time.
FWD_BWD_FACTOR = 3.0
#: Fixed time per kernel (launch + tail), seconds, paid once per micro-batch per
#: non-view node in forward and twice in backward. "A few microseconds" per
#: launch: NVIDIA developer blog, "Getting Started with CUDA Graphs" (2019).
#: An assumption until measured profiles replace it (issue 3).
KERNEL_OVERHEAD_S = 5e-6

@dataclass(frozen=True, slots=True)
class NodeCost:
    """Forward cost of one node for one sample."""

    flops: float
    bytes: float
    is_matmul: bool


def _node_cost(node: fx.Node, gm: fx.GraphModule) -> NodeCost:
    cls = op_class(node)
    if cls is None:
        return NodeCost(0.0, 0.0, False)

    def val(a):
        return _fetch_attr(gm, a.target) if a.op == "get_attr" else a.meta[META_KEY].get("val_batch1")

    ins = [t for a in node.all_input_nodes for t in tensors_in(val(a))]
    outs = list(tensors_in(node.meta[META_KEY].get("val_batch1")))
    flops, nbytes = flops_bytes(cls, ins, outs)
    return NodeCost(flops, nbytes, cls in ("matmul", "attention"))


def node_costs(bg: BlockGraph) -> dict[str, NodeCost]:
    """Per act node: forward FLOPs and bytes for one sample."""
    gm = bg.captured.graph_module
    nodes = {n.name: n for n in gm.graph.nodes}
    return {name: _node_cost(nodes[name], gm) for name in bg.act_order}


def node_time_s(cost: NodeCost, spec: GPUSpec, dtype: torch.dtype) -> float:
    """Roofline forward time of one node on one GPU, seconds."""
    peak = spec.peak_flops_per_s(dtype) if cost.is_matmul else spec.fp32_flops_per_s
    return max(cost.flops / (peak * MATMUL_EFFICIENCY), cost.bytes / (spec.mem_bw_bytes_per_s * MEMORY_EFFICIENCY))


def block_costs(
    bg: BlockGraph,
    specs: dict[str, GPUSpec],
    *,
    compute_dtype: torch.dtype = torch.float32,
    state_bytes_per_param: int = 16,
) -> BlockCosts:
    """Per-block, per-sample costs of ``bg`` on each GPU type in ``specs``.

    Times are the roofline model of the module docstring. Activation memory
    ``act_bytes_per_sample[b]`` is a measurement: the bytes of the tensors
    autograd saves for backward while block ``b`` runs forward on one sample,
    counted once per storage, without parameters and buffers. A tensor is
    charged to the block that saves it (the first one, if several do), not to
    the block that produced it: the residual stream made by block ``b`` and
    saved by the norm opening block ``b+1`` counts in ``b+1``. At a pipeline
    cut this undercounts the later stage by at most the crossing tensors (one
    hidden state per sample) when both sides save them, and is exact otherwise
    (see [Note: saved activations]). Cross-check: Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models", sec. 4.1: ``34*s*h + 5*a*s^2``
    bytes per GPT layer with 16-bit activations and dropout (``tests/
    test_activation_memory.py`` derives the dropout-free variant for GPT-2).
    If the measurement cannot run on the graph, a ``UserWarning`` says why
    and the old upper estimate (output bytes of every non-view node) is used.

    Args:
        specs: ``{gpu_type: GPUSpec}`` of the cluster's GPU types.
        compute_dtype: dtype of the matmuls (selects the datasheet peak).
        state_bytes_per_param: weights + grads + AdamW moments (fp32: 16 B).
    """
    costs = node_costs(bg)
    trainable = bg.captured.trainable()
    state = bg.captured.state()
    times: dict[str, list[float]] = {t: [] for t in specs}
    params, acts, fixed = [], [], []
    for b in range(bg.num_blocks):
        names = bg.block_nodes(b)
        for gpu_type, spec in specs.items():
            fwd = sum(node_time_s(costs[n], spec, compute_dtype) for n in names)
            times[gpu_type].append(FWD_BWD_FACTOR * fwd)
        kernels = sum(1 for n in names if costs[n].bytes > 0)
        fixed.append(FWD_BWD_FACTOR * KERNEL_OVERHEAD_S * kernels)
        params.append(sum(state[a].numel() for a in bg.block_attrs[b] if a in trainable))
    acts = _activation_bytes(bg, costs)
    cut = tuple(sum(t.bytes_per_sample for t in ts) for ts in bg.cut_tensors)
    # Mixed precision (16-bit weights): 2 B weights + 2 B grads + 12 B fp32 master
    # weights and moments, of which the 12 B shard under ZeRO-1 (ZeRO paper, sec. 3.1);
    # fp32: 4 + 4 + 8 B moments (shardable).
    half = any(state[a].element_size() == 2 for a in trainable if a in state)
    return BlockCosts(
        fwd_bwd_s_per_sample={k: tuple(v) for k, v in times.items()},
        fwd_bwd_s_fixed={k: tuple(fixed) for k in specs},
        param_count=tuple(params),
        act_bytes_per_sample=tuple(acts),
        cut_bytes_per_sample=cut,
        state_bytes_per_param=state_bytes_per_param,
        grad_bytes_per_param=2 if half else 4,
        param_bytes_per_param=2 if half else 4,
        shardable_bytes_per_param=min(12 if half else 8, state_bytes_per_param),
    )


def _out_bytes(node: fx.Node) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_in(node.meta[META_KEY].get("val_batch1")))


def _output_bytes_estimate(bg: BlockGraph, costs: dict[str, NodeCost]) -> list[int]:
    """The fallback: per block, the output bytes of its non-view nodes (an upper
    bound, about 2x what autograd saves for a transformer layer)."""
    nodes = {n.name: n for n in bg.graph.nodes}
    return [int(sum(_out_bytes(nodes[n]) for n in bg.block_nodes(b) if costs[n].bytes > 0))
            for b in range(bg.num_blocks)]


def _activation_bytes(bg: BlockGraph, costs: dict[str, NodeCost]) -> list[int]:
    try:
        return saved_activation_bytes(bg)
    except Exception as exc:  # any op may fail on fake tensors; planning goes on with the estimate
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        warnings.warn(
            f"could not measure the activations autograd saves ({type(exc).__name__}: {first}); "
            "using the output bytes of every non-view node instead, which overestimates activation "
            "memory (about 2x for a transformer layer)", stacklevel=3)
        return _output_bytes_estimate(bg, costs)


# [Note: saved activations]
# What a training step keeps per sample between a block's forward and its
# backward is the set of tensors autograd saves (``ctx.save_for_backward`` and
# the saved inputs/outputs of the ATen backward formulas), nothing else: the
# other intermediate outputs are freed as soon as their last forward user ran.
# ``saved_activation_bytes`` runs the captured graph once at batch 1 on
# FakeTensors (no real memory, so a 13B model on the meta device measures in
# seconds) with the trainable parameters requiring grad, under
# ``torch.autograd.graph.saved_tensors_hooks``; an ``fx.Interpreter`` knows
# which node, hence which block, is running when a tensor is packed.
#
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
#   instead of what the fake run saves. Explicit (eager) attention, written as
#   matmul + softmax in the model, is measured like any other op.
# * Per sample: the run is at batch 1. Saved values that do not grow with the
#   batch (rotary tables, masks) are thus counted per sample, a small
#   overcount for micro-batches of more than one sample.
# * Recomputation ([C-recompute] in ``solve/objective.py``) keeps only the
#   stage inputs of in-flight micro-batches and re-creates these saved
#   tensors for one micro-batch at a time; that is what A_s means there too.


class _SavedTensorRecorder(fx.Interpreter):
    """Runs a captured graph on fake tensors, recording ``(node, tensor)`` for
    every tensor autograd saves (see [Note: saved activations])."""

    def __init__(self, gm: fx.GraphModule, attrs: dict[str, torch.Tensor], attention: set[str]):
        super().__init__(gm)
        self.attrs = attrs
        self.attention = attention
        self.node: str | None = None
        self.suspended = False
        self.saved: list[tuple[str | None, torch.Tensor]] = []

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if not self.suspended:
            self.saved.append((self.node, t))
        return t

    def get_attr(self, target, args, kwargs):
        return self.attrs[target] if target in self.attrs else super().get_attr(target, args, kwargs)

    def run_node(self, n: fx.Node):
        self.node = n.name
        return super().run_node(n)

    def call_function(self, target, args, kwargs):
        if self.node not in self.attention:
            return super().call_function(target, args, kwargs)
        self.suspended = True
        try:
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


def saved_activation_bytes(bg: BlockGraph) -> list[int]:
    """Per block: bytes of the tensors autograd saves for backward, for one sample.

    Measured on FakeTensors at batch 1 (see [Note: saved activations]): each
    storage once, parameters and buffers excluded, a storage saved by several
    blocks charged to the first.

    Raises:
        Exception: whatever the fake run raises (an op without a fake kernel,
            a backward setup that reads tensor data), or RuntimeError when the
            loss does not require grad (nothing was recorded).
    """
    gm = bg.captured.graph_module
    block_of = {name: b for b in range(bg.num_blocks) for name in bg.block_nodes(b)}
    nodes = {n.name: n for n in gm.graph.nodes}
    attention = {name for name in bg.act_order if op_class(nodes[name]) == "attention"}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    attrs: dict[str, torch.Tensor] = {}
    by_id: dict[int, torch.Tensor] = {}  # one fake tensor per real one: tied weights stay tied
    for node in gm.graph.find_nodes(op="get_attr"):
        value = _fetch_attr(gm, node.target)
        if not isinstance(value, torch.Tensor):
            continue
        if id(value) not in by_id:
            fake = mode.from_tensor(value.detach())
            if isinstance(value, torch.nn.Parameter) and value.requires_grad:
                fake.requires_grad_(True)
            by_id[id(value)] = fake
        attrs[node.target] = by_id[id(value)]
    inputs = tuple(mode.from_tensor(t[:1].clone()) for t in bg.captured.example_inputs)
    rec = _SavedTensorRecorder(gm, attrs, attention)
    with mode:
        state = {t.untyped_storage()._cdata for t in attrs.values()}
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
            loss = rec.run(*inputs)
        if not (isinstance(loss, torch.Tensor) and loss.requires_grad):
            raise RuntimeError("the loss does not require grad in the measurement run")
        acts = [0] * bg.num_blocks
        seen = set(state)
        # rec.saved (and the autograd graph of ``loss``) keep every recorded
        # tensor alive, so no storage address is reused while counting.
        for name, t in rec.saved:
            storage = t.untyped_storage()
            key = storage._cdata
            if key in seen:
                continue
            seen.add(key)
            if name in block_of:  # free nodes read no grad-requiring value, so save nothing
                acts[block_of[name]] += int(storage.nbytes())
    del loss
    return acts
