"""Roofline cost of the block graph per GPU type: FLOPs and bytes per fx node.

GPU types of the built-in table (``gpu_specs.csv`` rows, which carry an
``arch``) are priced by the per-class model of ``gpu_model.py`` (issue 13):
sustained matmul rates fitted per GPU class to cited public measurements,
partly fused elementwise chains, per-op-class backward factors and a per-micro-batch
weight/gradient traffic term (``_graph_chains``, ``_class_block_time``,
``weight_traffic_bytes``). The plain roofline below prices the rest: GPU
types declared in a cluster file, which carry no class.

Per node (from the fake-tensor values at batch 1, i.e. per sample):

- matmul-class (``linear``, ``mm``, ``bmm``, ``addmm``, ``matmul``):
  ``2 * numel(out) * K`` FLOPs (one multiply-add = 2 FLOPs);
- ``scaled_dot_product_attention`` with q ``(N, H, T, D)``, k ``(N, H, S, D)``:
  ``4 * N * H * T * S * D`` FLOPs (``QK^T`` and ``PV``), as in FlashAttention
  (Dao et al. 2022) FLOP accounting;
- views (``view``, ``transpose``, ``expand``, ...): free;
- everything else: ``numel(out)`` FLOPs and the bytes it reads and writes.

Time of a node on a GPU: ``max(flops / (peak * MATMUL_EFFICIENCY),
bytes / (mem_bw * MEMORY_EFFICIENCY))``, with ``peak`` the datasheet FLOP/s
of the plan's compute dtype for matmul-class nodes (the 16-bit tensor peak
under a mixed precision policy) and the fp32 peak for the rest, and bytes in
the dtypes the values have under the plan's autocast. Forward+backward = 3x
forward (the backward of a matmul is two matmuls of the same size: Narayanan
et al., SC'21, "Efficient large-scale language model training on GPU
clusters", eq. 3).
Every non-view node also costs a fixed ``3 * KERNEL_OVERHEAD_S`` per
micro-batch (one forward and about two backward kernels), whatever its sample
count: this is what makes tiny micro-batches slow on a real GPU. The
efficiencies and the overhead are assumptions until a measured profile
replaces them (issue 3, ``zorse bench kernels``).

Activation memory (``act_bytes_per_sample``) is measured, not modelled: see
[Note: saved activations]. Bytes of training state per parameter come from the
plan's precision policy (``zorse_fx.precision``, [Note: mixed precision]).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from ..capture.analysis import BlockGraph
from ..capture.trace import META_KEY, _fetch_attr
from ..cluster import GPUSpec
from ..precision import PrecisionPolicy, precision_policy
from ..solve.records import BlockCosts, TiedParam
from . import gpu_model
from .opclass import flops_bytes, op_class, tensors_in

__all__ = ["NodeCost", "node_costs", "block_costs", "tied_params", "weight_traffic_bytes", "SavedActivations", "measure_saved_activations",
           "saved_activations_or_estimate", "saved_activation_bytes", "MATMUL_EFFICIENCY", "MEMORY_EFFICIENCY",
           "FWD_BWD_FACTOR", "KERNEL_OVERHEAD_S"]

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
    #: Bytes read per input node: ``((input node name, bytes), ...)`` (the
    #: fused-chain accounting of ``gpu_model`` needs them).
    reads: tuple[tuple[str, float], ...] = ()
    #: Bytes written (the node's tensor outputs in their run dtypes).
    out_bytes: float = 0.0
    #: An attention node with ``is_causal=True``.
    causal: bool = False
    #: A matmul/attention node whose floating inputs are all 16-bit as it
    #: runs (autocast's casts, or a half-precision graph).
    half: bool = False


def _as_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t``'s shape in ``dtype`` (a meta tensor: only numel and itemsize are read)."""
    if dtype is None or dtype == t.dtype:
        return t
    return torch.empty(t.shape, dtype=dtype, device="meta")


def _node_cost(node: fx.Node, gm: fx.GraphModule, dtypes: dict[str, str],
               autocast_dtype: torch.dtype | None) -> NodeCost:
    cls = op_class(node)
    if cls is None:
        return NodeCost(0.0, 0.0, False)
    compute = cls in ("matmul", "attention")

    def val(a):
        return _fetch_attr(gm, a.target) if a.op == "get_attr" else a.meta[META_KEY].get("val_batch1")

    def read(a, t):
        """The dtype the node reads ``t`` (the value of input node ``a``) in at run time."""
        if compute and autocast_dtype is not None and t.is_floating_point() and t.dtype != torch.float64:
            return _as_dtype(t, autocast_dtype)  # autocast's cast (of weights: the step's cached copy)
        return _as_dtype(t, getattr(torch, dtypes[a.name])) if a.name in dtypes else t

    pairs = [(a.name, read(a, t)) for a in node.all_input_nodes for t in tensors_in(val(a))]
    ins = [t for _, t in pairs]
    outs = list(tensors_in(node.meta[META_KEY].get("val_batch1")))
    if node.name in dtypes and len(outs) == 1:
        outs = [_as_dtype(outs[0], getattr(torch, dtypes[node.name]))]
    flops, nbytes = flops_bytes(cls, ins, outs)
    reads = tuple((name, float(t.numel() * t.element_size())) for name, t in pairs)
    out_bytes = float(sum(t.numel() * t.element_size() for t in outs))
    causal = cls == "attention" and bool(node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False))
    floats = [t for t in ins if t.is_floating_point()]
    half = compute and bool(floats) and all(t.dtype in (torch.float16, torch.bfloat16) for t in floats)
    return NodeCost(flops, nbytes, compute, reads, out_bytes, causal, half)


def node_costs(bg: BlockGraph, activations: "SavedActivations | None" = None,
               precision: PrecisionPolicy | None = None) -> dict[str, NodeCost]:
    """Per act node: forward FLOPs and bytes for one sample.

    Bytes are those of the values in their capture dtypes, or, given the
    measurement run under ``precision`` (``activations``), in the dtypes that
    run gave them: a node reads its inputs in their producers' run dtypes, a
    matmul or attention node under a mixed policy reads 16-bit copies
    (autocast's casts; the cast kernels themselves are not counted)."""
    gm = bg.captured.graph_module
    nodes = {n.name: n for n in gm.graph.nodes}
    dtypes = activations.output_dtypes if activations is not None else {}
    autocast_dtype = precision.compute_dtype if precision is not None and precision.mixed else None
    return {name: _node_cost(nodes[name], gm, dtypes, autocast_dtype) for name in bg.act_order}


def node_time_s(cost: NodeCost, spec: GPUSpec, dtype: torch.dtype) -> float:
    """Roofline forward time of one node on one GPU, seconds."""
    peak = spec.peak_flops_per_s(dtype) if cost.is_matmul else spec.fp32_flops_per_s
    return max(cost.flops / (peak * MATMUL_EFFICIENCY), cost.bytes / (spec.mem_bw_bytes_per_s * MEMORY_EFFICIENCY))


@dataclass(frozen=True, slots=True)
class _Chain:
    """An elementwise chain of one block: its nodes, the bytes it moves fully
    fused (inputs from outside, outputs used outside, once) and run eagerly
    (the sum of its nodes' bytes, one kernel per node)."""

    nodes: tuple[str, ...]
    bytes: float
    eager_bytes: float

    def priced(self, unfused_fraction: float) -> tuple[float, float]:
        """``(bytes, forward kernels)`` with ``unfused_fraction`` of the
        eager-minus-fused traffic and kernels paid (``gpu_model``)."""
        return (self.bytes + unfused_fraction * (self.eager_bytes - self.bytes),
                1.0 + unfused_fraction * (len(self.nodes) - 1))


def _graph_chains(bg: BlockGraph, costs: dict[str, NodeCost]) -> dict[int, list[_Chain]]:
    """The fused elementwise chains of the model (see ``gpu_model``): non-view,
    non-matmul, non-attention nodes with bytes, connected through views, found
    over the whole graph and each charged to the block of its last node. A
    chain is one sequence of kernels whatever the block cuts are, so a block's
    price does not depend on how finely the model is cut (a plan's step time
    is the same on coarser or finer blocks with the same stage boundaries)."""
    nodes = {n.name: n for n in bg.graph.nodes}
    block_of = {n: b for b in range(bg.num_blocks) for n in bg.block_nodes(b)}
    order = {n.name: i for i, n in enumerate(bg.graph.nodes)}
    members = [n for b in range(bg.num_blocks) for n in bg.block_nodes(b)
               if costs[n].bytes > 0 and not costs[n].is_matmul]
    inside = set(members)
    parent = {n: n for n in members}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def producer(name: str) -> str:
        """The kernel behind ``name``: follows views (class None) back."""
        seen = 0
        while name in nodes and op_class(nodes[name]) is None and nodes[name].all_input_nodes and seen < 64:
            ins = nodes[name].all_input_nodes
            name, seen = ins[0].name, seen + 1
        return name

    def consumers(name: str) -> set[str]:
        """Kernels reading ``name`` (through views)."""
        out, todo = set(), list(nodes[name].users)
        while todo:
            u = todo.pop()
            if op_class(u) is None and u.op != "output":
                todo.extend(u.users)
            else:
                out.add(u.name)
        return out

    internal_reads: dict[str, float] = {}
    for n in members:
        for a, nbytes in costs[n].reads:
            p = producer(a)
            if p in inside:
                parent[find(n)] = find(p)
                internal_reads[n] = internal_reads.get(n, 0.0) + nbytes
    groups: dict[str, list[str]] = {}
    for n in members:
        groups.setdefault(find(n), []).append(n)
    chains: dict[int, list[_Chain]] = {b: [] for b in range(bg.num_blocks)}
    for ns in groups.values():
        group = set(ns)
        moved = sum(costs[n].bytes for n in ns) - sum(internal_reads.get(n, 0.0) for n in ns)
        moved -= sum(costs[n].out_bytes for n in ns if consumers(n) and consumers(n) <= group)
        chains[block_of[max(ns, key=order.__getitem__)]].append(
            _Chain(tuple(ns), max(moved, 0.0), sum(costs[n].bytes for n in ns)))
    return chains


def weight_traffic_bytes(bg: BlockGraph, b: int, precision: PrecisionPolicy) -> float:
    """Bytes block ``b``'s backward moves once per micro-batch for its
    trainable parameters: each weight read once in the dtype the matmuls use
    (the compute dtype under a mixed policy, else its own) and its gradient
    read and written once in the parameter's dtype (accumulation into
    ``.grad``; float32 parameters under every zorse_fx policy: 10 B/param
    mixed, 12 B fp32). See ``gpu_model``."""
    state, trainable = bg.captured.state(), bg.captured.trainable()
    total = 0.0
    for a in bg.block_attrs[b]:
        if a not in trainable:
            continue
        t = state[a]
        weight = torch.empty((), dtype=precision.compute_dtype).element_size() if precision.mixed else t.element_size()
        total += t.numel() * (weight + 2 * t.element_size())
    return total


def _class_block_time(bg: BlockGraph, costs: dict[str, NodeCost], b: int, chains: list[_Chain],
                      traffic_bytes: float, spec: GPUSpec, precision: PrecisionPolicy,
                      unfused_fraction: float | None = None) -> tuple[float, float, float, float]:
    """``(fwd per sample, bwd per sample, fwd fixed, bwd fixed)`` seconds of
    block ``b`` on ``spec`` under the class model of ``gpu_model``;
    ``traffic_bytes``: ``weight_traffic_bytes(bg, b, precision)``;
    ``unfused_fraction``: of the chains' eager-minus-fused price (None:
    ``gpu_model.UNFUSED_FRACTION``; 0: fully fused chains)."""
    frac = gpu_model.UNFUSED_FRACTION if unfused_fraction is None else unfused_fraction
    dtype = precision.compute_dtype
    rate32 = gpu_model.sustained_matmul_flops_per_s(spec, dtype, MATMUL_EFFICIENCY)
    # a half-precision graph under a non-mixed policy still runs 16-bit GEMMs
    rate16 = rate32 if precision.mixed else gpu_model.sustained_matmul_flops_per_s(
        spec, torch.float16, MATMUL_EFFICIENCY)
    bw = spec.mem_bw_bytes_per_s * gpu_model.STREAM_EFFICIENCY
    fwd = bwd = 0.0
    kernels_f = kernels_b = 0.0
    nodes = {n.name: n for n in bg.graph.nodes}
    for n in bg.block_nodes(b):
        c = costs[n]
        if not c.is_matmul:
            continue
        rate = rate16 if c.half else rate32
        if op_class(nodes[n]) == "attention":
            flops = 0.5 * c.flops if c.causal else c.flops
            fwd += max(flops / rate, c.bytes / bw)
            bwd += max(gpu_model.ATTENTION_BWD_FACTOR * flops / rate, 2 * c.bytes / bw)
            kernels_f, kernels_b = kernels_f + 1, kernels_b + 1
            continue
        t = max(c.flops / rate, c.bytes / bw)
        fwd, bwd = fwd + t, bwd + gpu_model.MATMUL_BWD_FACTOR * t
        kernels_f, kernels_b = kernels_f + 1, kernels_b + 2
    for ch in chains:
        nbytes, kernels = ch.priced(frac)
        t = nbytes / bw
        fwd, bwd = fwd + t, bwd + gpu_model.CHAIN_BWD_FACTOR * t
        kernels_f, kernels_b = kernels_f + kernels, kernels_b + 2 * kernels
    weight = traffic_bytes / bw
    return fwd, bwd, KERNEL_OVERHEAD_S * kernels_f, KERNEL_OVERHEAD_S * kernels_b + weight


def tied_params(bg: BlockGraph) -> tuple[TiedParam, ...]:
    """The trainable parameters read by more than one block (a tied input /
    output embedding), each with the blocks that read it and its elements, in
    order of first use; ``param_count`` counts them in every such block."""
    trainable, state = bg.captured.trainable(), bg.captured.state()
    users: dict[str, list[int]] = {}
    for b, attrs in enumerate(bg.block_attrs):
        for a in attrs:
            if a in trainable:
                users.setdefault(a, []).append(b)
    return tuple(TiedParam(name=a, blocks=tuple(bs), numel=state[a].numel())
                 for a, bs in users.items() if len(bs) > 1)


def block_costs(
    bg: BlockGraph,
    specs: dict[str, GPUSpec],
    *,
    precision: PrecisionPolicy,
    activations: "SavedActivations | None" = None,
) -> BlockCosts:
    """Per-block, per-sample costs of ``bg`` on each GPU type in ``specs``,
    trained under ``precision``.

    Times are the roofline model of the module docstring, with matmuls at the
    datasheet peak of the policy's compute dtype and bytes moved in the
    dtypes the policy's autocast gives the values (``node_costs``).
    Activation memory ``act_bytes_per_sample[b]`` is a measurement under the
    policy's autocast: the bytes of the tensors autograd saves for backward
    while block ``b`` runs forward on one sample, counted once per storage,
    without parameters, buffers and autocast's per-step weight copies (those
    are training state, ``cast_bytes_per_param``). A tensor is charged to the
    block that saves it (the first one, if several do), not to the block that
    produced it: the residual stream made by block ``b`` and saved by the norm
    opening block ``b+1`` counts in ``b+1``. At a pipeline cut this
    undercounts the later stage by at most the crossing tensors (one hidden
    state per sample) when both sides save them, and is exact otherwise (see
    [Note: saved activations]). Cross-check: Korthikanti et al. 2022,
    "Reducing Activation Recomputation in Large Transformer Models", sec.
    4.1: ``34*s*h + 5*a*s^2`` bytes per GPT layer with 16-bit activations and
    dropout (``tests/test_activation_memory.py`` derives the dropout-free
    variant for GPT-2).
    If the measurement cannot run on the graph, a ``UserWarning`` says why
    and the old upper estimate (output bytes of every non-view node) is used.
    Cut bytes are those of the crossing tensors in the dtypes the measurement
    run gave them (autocast may change a dtype; the residual stream of a
    pre-norm transformer stays float32).

    Training state per parameter (``state_bytes_per_param`` and the rest) is
    what the runtime keeps under ``precision`` ([Note: mixed precision] in
    ``zorse_fx/precision.py``): 16 B in fp32, 18 B mixed (20 B with a 16-bit
    gradient reduction), of which ZeRO-1 shards the AdamW moments (8 B).

    Args:
        specs: ``{gpu_type: GPUSpec}`` of the cluster's GPU types.
        precision: the plan's precision policy.
        activations: the measurement of ``saved_activations_or_estimate(bg,
            precision)`` when the caller already has it (one fake run less).
    """
    if activations is None:
        activations = saved_activations_or_estimate(bg, precision)
    costs = node_costs(bg, activations, precision)
    trainable = bg.captured.trainable()
    state = bg.captured.state()
    dtype = precision.compute_dtype
    times: dict[str, list[float]] = {t: [] for t in specs}
    fixed: dict[str, list[float]] = {t: [] for t in specs}
    params = []
    chains_of = None
    for b in range(bg.num_blocks):
        names = bg.block_nodes(b)
        params.append(sum(state[a].numel() for a in bg.block_attrs[b] if a in trainable))
        kernels = sum(1 for n in names if costs[n].bytes > 0)
        chains = traffic = None
        for gpu_type, spec in specs.items():
            if gpu_model.has_class_model(spec):
                if chains_of is None:
                    chains_of = _graph_chains(bg, costs)
                chains = chains_of[b]
                if traffic is None:
                    traffic = weight_traffic_bytes(bg, b, precision)
                f, bw_, ff, fb = _class_block_time(bg, costs, b, chains, traffic, spec, precision)
                times[gpu_type].append(f + bw_)
                fixed[gpu_type].append(ff + fb)
            else:
                fwd = sum(node_time_s(costs[n], spec, dtype) for n in names)
                times[gpu_type].append(FWD_BWD_FACTOR * fwd)
                fixed[gpu_type].append(FWD_BWD_FACTOR * KERNEL_OVERHEAD_S * kernels)
    cast = bg.with_dtypes(activations.output_dtypes)
    return BlockCosts(
        tied_params=tied_params(bg),
        fwd_bwd_s_per_sample={k: tuple(v) for k, v in times.items()},
        fwd_bwd_s_fixed={k: tuple(v) for k, v in fixed.items()},
        param_count=tuple(params),
        act_bytes_per_sample=activations.bytes_per_sample,
        cut_bytes_per_sample=tuple(sum(t.bytes_per_sample for t in ts) for ts in cast.cut_tensors),
        state_bytes_per_param=precision.state_bytes_per_param,
        optimizer_bytes_per_param=precision.optimizer_step_bytes_per_param,
        grad_bytes_per_param=precision.allreduce_bytes_per_param,
        param_bytes_per_param=precision.allgather_bytes_per_param,
        shardable_bytes_per_param=precision.shardable_bytes_per_param,
    )


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
#   (``PrecisionPolicy.cast_bytes_per_param``), not per sample. Casts of a
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
    ``params`` (by identity): autocast's cached weight casts."""

    def __init__(self, params: list[torch.Tensor]):
        super().__init__()
        self.param_ids = {id(p) for p in params}
        self.storages: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and id(args[0]) in self.param_ids:
            self.storages.add(out.untyped_storage()._cdata)
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
    gm = bg.captured.graph_module
    block_of = {name: b for b in range(bg.num_blocks) for name in bg.block_nodes(b)}
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
    for node in gm.graph.find_nodes(op="get_attr"):
        value = _fetch_attr(gm, node.target)
        if not isinstance(value, torch.Tensor):
            continue
        if id(value) not in by_id:
            fake = as_fake(value.detach())
            if isinstance(value, torch.nn.Parameter) and value.requires_grad:
                fake.requires_grad_(True)
                trainable.append(fake)
            by_id[id(value)] = fake
        attrs[node.target] = by_id[id(value)]
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
        seen = state | casts.storages
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
    dtypes = {name: rec.dtypes[name] for name in bg.act_order if name in rec.dtypes}
    return SavedActivations(bytes_per_sample=tuple(acts), output_dtypes=dtypes)


def saved_activation_bytes(bg: BlockGraph, precision: PrecisionPolicy | None = None) -> list[int]:
    """``measure_saved_activations(bg, precision).bytes_per_sample`` as a list;
    ``precision`` None: fp32 (no autocast: the graph's own dtypes)."""
    return list(measure_saved_activations(bg, precision or precision_policy("fp32")).bytes_per_sample)
