"""Roofline cost of the block graph per GPU type: FLOPs and bytes per fx node.

GPU types of the built-in table (``gpu_specs.csv`` rows, which carry an
``arch``) are priced by the per-class model of ``gpu_model.py``:
sustained matmul rates fitted per GPU class to cited public measurements,
partly fused elementwise chains, per-op-class backward factors and a per-micro-batch
weight/gradient traffic term (``graph_chains``, ``class_block_time``,
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
efficiencies and the overhead are assumptions; a measured profile
(``zorse bench kernels``) replaces them.

Activation memory (``act_bytes_per_sample``) is measured, not modelled: see
[Note: saved activations] in ``activations.py``. Bytes of training state per parameter come from the
plan's precision policy (``zorse_fx.precision``, [Note: mixed precision]).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..capture.analysis import BlockGraph, low_precision_params
from ..capture.trace import META_KEY, fetch_attr
from ..cluster import GPUSpec
from ..ir.costs import BlockCosts, TiedParam
from ..ir.tensor import on_wire
from ..precision import PrecisionPolicy
from . import gpu_model
from .activations import (
    SavedActivations,
    loss_backward_transient_bytes,
    measure_saved_activations,
    saved_activation_bytes,
    saved_activations_or_estimate,
)
from .opclass import flops_bytes, op_class, tensors_in

__all__ = ["NodeCost", "node_costs", "block_costs", "tied_params", "weight_traffic_bytes", "grad_work_bytes",
           "SavedActivations", "measure_saved_activations",
           "saved_activations_or_estimate", "saved_activation_bytes", "MATMUL_EFFICIENCY", "MEMORY_EFFICIENCY",
           "FWD_BWD_FACTOR", "KERNEL_OVERHEAD_S", "Chain", "kernel_depths", "graph_chains", "class_block_time", "node_time_s"]

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
#: An assumption; a measured profile replaces it.
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
    #: An attention node given an explicit ``attn_mask`` (PyTorch's SDPA then
    #: cannot run its flash backend; ``gpu_model.SDPA_KERNELS``).
    masked: bool = False


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
        return fetch_attr(gm, a.target) if a.op == "get_attr" else a.meta[META_KEY].get("val_batch1")

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
    masked = cls == "attention" and node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None) is not None
    return NodeCost(flops, nbytes, compute, reads, out_bytes, causal, half, masked=masked)


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


def node_time_s(cost: NodeCost, spec: GPUSpec, dtype: torch.dtype, *, tf32: bool = False) -> float:
    """Roofline forward time of one node on one GPU, seconds (``tf32``: float32
    matmuls at the TF32 peak where the GPU has one)."""
    peak = spec.peak_flops_per_s(dtype, tf32=tf32) if cost.is_matmul else spec.fp32_flops_per_s
    return max(cost.flops / (peak * MATMUL_EFFICIENCY), cost.bytes / (spec.mem_bw_bytes_per_s * MEMORY_EFFICIENCY))


@dataclass(frozen=True, slots=True)
class Chain:
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


def kernel_depths(bg: BlockGraph, costs: dict[str, NodeCost]) -> dict[str, int]:
    """Per node of ``bg.graph`` (views, placeholders and parameters included):
    the largest number of matmul/attention nodes (``NodeCost.is_matmul``) on
    any dataflow path from the graph inputs to it, itself included. A path
    ``p -> ... -> m -> ... -> n`` through a matmul/attention node ``m`` gives
    ``depth(n) > depth(p)``, so two nodes of equal depth have no
    matmul/attention kernel between them (``graph_chains``). Nodes are visited
    in graph order, which is a topological order of an fx graph."""
    depth: dict[str, int] = {}
    for n in bg.graph.nodes:
        d = max((depth[a.name] for a in n.all_input_nodes), default=0)
        c = costs.get(n.name)
        depth[n.name] = d + 1 if c is not None and c.is_matmul else d
    return depth


def graph_chains(bg: BlockGraph, costs: dict[str, NodeCost]) -> dict[int, list[Chain]]:
    """The fused elementwise chains of the model (see ``gpu_model``), per block.

    Members are the non-view, non-matmul, non-attention nodes with bytes. A
    member joins the chain of a member it reads (through views) only when the
    two have the same kernel depth (``kernel_depths``): no matmul/attention
    kernel lies on any dataflow path between them. A chain therefore never
    contains two nodes with a matmul between them, which no compiler could
    fuse into one kernel: in a transformer the residual add after attention
    and the add after the MLP are different chains, and the residual stream
    is not one chain across all layers (a union over every producer/consumer
    edge would put every layer's residual adds and norms into one chain
    charged to the final norm's block).

    Each chain is charged whole to the block of its last node (graph order).
    Blocks are cut on the residual stream, and a residual add and the norm
    that reads it have the same depth, so a chain can still cross a block
    cut: the add closing block ``b`` (with any elementwise ops of ``b`` at its
    depth) and the norm opening ``b+1`` form one chain charged to ``b+1``.
    Charging it whole rather than splitting it at the cut keeps a block's
    price independent of how the model is cut elsewhere: the chains, and so
    a stage's summed price, are the same on coarser or finer blocks with the
    same stage boundaries (exact; ``tests/test_gpu_cost_model.py``). The cost
    of this choice: at a stage boundary the later stage pays the add of the
    earlier one and the pair is priced as one fused kernel, where the run has
    two kernels on two GPUs (one more read of the crossing tensors and one
    more kernel than priced).
    """
    nodes = {n.name: n for n in bg.graph.nodes}
    block_of = {n: b for b in range(bg.num_blocks) for n in bg.block_nodes(b)}
    order = {n.name: i for i, n in enumerate(bg.graph.nodes)}
    depth = kernel_depths(bg, costs)
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
            if p in inside and depth[p] == depth[n]:
                parent[find(n)] = find(p)
                internal_reads[n] = internal_reads.get(n, 0.0) + nbytes
    groups: dict[str, list[str]] = {}
    for n in members:
        groups.setdefault(find(n), []).append(n)
    chains: dict[int, list[Chain]] = {b: [] for b in range(bg.num_blocks)}
    for ns in groups.values():
        group = set(ns)
        moved = sum(costs[n].bytes for n in ns) - sum(internal_reads.get(n, 0.0) for n in ns)
        moved -= sum(costs[n].out_bytes for n in ns if consumers(n) and consumers(n) <= group)
        chains[block_of[max(ns, key=order.__getitem__)]].append(
            Chain(tuple(ns), max(moved, 0.0), sum(costs[n].bytes for n in ns)))
    return chains


def weight_traffic_bytes(bg: BlockGraph, b: int, precision: PrecisionPolicy, *, state=None, trainable=None) -> float:
    """Bytes block ``b``'s backward moves once per micro-batch for its
    trainable parameters: each weight read once in the dtype the matmuls use
    (the compute dtype under a mixed policy, else its own) and its gradient
    read and written once in the parameter's dtype (accumulation into
    ``.grad``; float32 parameters under every zorse_fx policy: 10 B/param
    mixed, 12 B fp32). See ``gpu_model``. ``state``, ``trainable``: ``bg.captured``'s, where the caller
    has them (each walks the graph's parameters)."""
    state = bg.captured.state() if state is None else state
    trainable = bg.captured.trainable() if trainable is None else trainable
    total = 0.0
    for a in bg.block_attrs[b]:
        if a not in trainable:
            continue
        t = state[a]
        weight = torch.empty((), dtype=precision.compute_dtype).element_size() if precision.mixed else t.element_size()
        total += t.numel() * (weight + 2 * t.element_size())
    return total


# [Note: the runtime's gradient work]
# What the runtime's backward does per micro-batch beyond the layers' own kernels, counted on the
# runtime itself (tests/test_grad_work.py: ``aten`` ops of a real ``StageWorker`` step at 2 and 4
# micro-batches, fp32 and bf16-mixed, equal to these bytes exactly):
#
# * accumulation: every trainable parameter's gradient of the micro-batch is added into its
#   float32 ``.grad`` (``AccumulateGrad``: an add reading both, writing one, 3 x 4 B per element;
#   DDP-style bucket views, [Note: overlapped gradient reduction] in runtime/grad_sync.py, are
#   zeroed per step and added into from the first micro-batch on; a parameter without a bucket
#   takes its first micro-batch's gradient as it is: one add less per step, not priced); a
#   parameter read by c blocks (a tied embedding) gets c contributions, summed by autograd with the
#   same add: 3 x 4 B per block that reads it;
# * gradient casts, under a mixed policy: the backward of autocast's cast of a weight (the
#   ``_to_copy`` the fake run records, ``SavedActivations.cast_params``) turns the matmul's 16-bit
#   weight gradient into float32 before it is accumulated: 2 B read + 4 B written per element;
#   a parameter autocast does not cast (norm weights, an embedding's table) has none;
# * once per step, not per micro-batch: autocast's cast of each such weight to 16 bits (4 B read,
#   2 B written): the runtime runs the step's whole schedule in ONE autocast region ([Note: mixed
#   precision] in precision.py), whose cache keeps the cast for every micro-batch; counted with the
#   optimizer phase ([C-optim], ``PrecisionPolicy.step_cast_bytes_per_param``).
#
# Priced at the memory bandwidth: the class model already charges 2 x 4 B of it per parameter
# (``weight_traffic_bytes``, fitted with it: [Note: unfused fraction] in gpu_model.py), so it adds the
# add's third 4 B and the casts at its stream bandwidth; the plain roofline adds the whole at
# ``MEMORY_EFFICIENCY``; a measured profile (``measured.grad_accumulate_ms``) times the add and adds
# the casts. Per micro-batch and per block (``fwd_bwd_s_fixed``, the backward's part). Not counted:
# a 16-bit working weight's gradient (a sharded stage under a mixed policy, [Note: 16-bit working
# weights]) is added in 16 bits into its float32 main gradient (2 + 4 + 4 B, priced as 3 x 4 + 6);
# a ZeRO-2 stage copies each micro-batch's gradient into its reduction buffer (priced the same as
# an add).
#: Tensors an accumulating add touches per element: two read, one written.
ADD_OPERANDS = 3


def grad_work_bytes(bg: BlockGraph, precision: PrecisionPolicy, cast: frozenset[str] | None = None, *,
                    state=None, trainable=None) -> tuple[list[float], list[float]]:
    """Per block, bytes the runtime's backward moves per micro-batch for its parameters' gradients
    ([Note: the runtime's gradient work]): ``(accumulation, casts)``, each ``(B,)``. Accumulation:
    ``3 * itemsize`` per element of each trainable parameter the block reads (each reading block of a
    tied one); casts, under a mixed policy: ``itemsize(compute) + itemsize`` per element of each
    parameter in ``cast`` (None: every trainable one), split evenly over the blocks that read it (one
    cast per micro-batch). ``state``, ``trainable``: ``bg.captured``'s, where the caller has them."""
    state = bg.captured.state() if state is None else state
    trainable = bg.captured.trainable() if trainable is None else trainable
    readers = Counter(a for attrs in bg.block_attrs for a in attrs)
    c16 = torch.empty((), dtype=precision.compute_dtype).element_size()
    accumulate, casts = [], []
    for b in range(bg.num_blocks):
        acc = cst = 0.0
        for a in bg.block_attrs[b]:
            if a not in trainable:
                continue
            t = state[a]
            acc += ADD_OPERANDS * t.element_size() * t.numel()
            if precision.mixed and (cast is None or a in cast):
                cst += (c16 + t.element_size()) * t.numel() / readers[a]
        accumulate.append(acc)
        casts.append(cst)
    return accumulate, casts


def class_block_time(bg: BlockGraph, costs: dict[str, NodeCost], b: int, chains: list[Chain],
                      traffic_bytes: float, spec: GPUSpec, precision: PrecisionPolicy,
                      unfused_fraction: float | None = None) -> tuple[float, float, float, float]:
    """``(fwd per sample, bwd per sample, fwd fixed, bwd fixed)`` seconds of
    block ``b`` on ``spec`` under the class model of ``gpu_model``;
    ``traffic_bytes``: ``weight_traffic_bytes(bg, b, precision)``;
    ``unfused_fraction``: of the chains' eager-minus-fused price (None:
    ``gpu_model.UNFUSED_FRACTION``; 0: fully fused chains)."""
    frac = gpu_model.UNFUSED_FRACTION if unfused_fraction is None else unfused_fraction
    dtype = precision.compute_dtype
    rate32 = gpu_model.sustained_matmul_flops_per_s(spec, dtype, MATMUL_EFFICIENCY, tf32=precision.tf32)
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
            rate_f, rate_b = gpu_model.attention_flops_per_s(spec.arch, rate, c.masked) if c.half else (rate, rate)
            fwd += max(flops / rate_f, c.bytes / bw)
            bwd += max(gpu_model.ATTENTION_BWD_FACTOR * flops / rate_b, 2 * c.bytes / bw)
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
    runtime_grad_work: bool = True,
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
    [Note: saved activations] in ``activations.py``). Cross-check: Korthikanti et al. 2022,
    "Reducing Activation Recomputation in Large Transformer Models", sec.
    4.1: ``34*s*h + 5*a*s^2`` bytes per GPT layer with 16-bit activations and
    dropout (``tests/test_activation_memory.py`` derives the dropout-free
    variant for GPT-2).
    If the measurement cannot run on the graph, a ``UserWarning`` says why
    and an upper estimate (output bytes of every non-view node) is used.
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
        runtime_grad_work: price the runtime's gradient casts and accumulation per micro-batch
            beyond what each type's model charges ([Note: the runtime's gradient work]); False: the
            models alone (the class model as fitted to other runtimes' published steps).
    """
    if activations is None:
        activations = saved_activations_or_estimate(bg, precision)
    costs = node_costs(bg, activations, precision)
    trainable = bg.captured.trainable()
    state = bg.captured.state()
    dtype = precision.compute_dtype
    times: dict[str, list[float]] = {t: [] for t in specs}
    fixed: dict[str, list[float]] = {t: [] for t in specs}
    # The forward's part, where the class model prices it apart (the plain roofline: FORWARD_SHARE).
    fwd_times: dict[str, list[float]] = {t: [] for t in specs if gpu_model.has_class_model(specs[t])}
    fwd_fixed: dict[str, list[float]] = {t: [] for t in fwd_times}
    params, params16, largest = [], [], []
    low = low_precision_params(bg) if precision.mixed else frozenset()
    # [Note: the runtime's gradient work]: bytes per micro-batch beyond the class model's weight traffic
    # (which reads and writes each gradient once: 2 x itemsize) and beyond the plain roofline's nothing
    accumulate, casts = grad_work_bytes(bg, precision, activations.cast_params, state=state, trainable=trainable)
    grad_roofline = [a + c if runtime_grad_work else 0.0 for a, c in zip(accumulate, casts)]
    grad_class = [r - sum(2 * state[a].element_size() * state[a].numel() for a in bg.block_attrs[b] if a in trainable)
                  if runtime_grad_work else 0.0 for b, r in enumerate(grad_roofline)]
    chains_of = None
    for b in range(bg.num_blocks):
        names = bg.block_nodes(b)
        params.append(sum(state[a].numel() for a in bg.block_attrs[b] if a in trainable))
        params16.append(sum(state[a].numel() for a in bg.block_attrs[b] if a in low))
        largest.append(max((state[a].numel() for a in bg.block_attrs[b] if a in trainable), default=0))
        kernels = sum(1 for n in names if costs[n].bytes > 0)
        chains = traffic = None
        for gpu_type, spec in specs.items():
            if gpu_model.has_class_model(spec):
                if chains_of is None:
                    chains_of = graph_chains(bg, costs)
                chains = chains_of[b]
                if traffic is None:
                    traffic = weight_traffic_bytes(bg, b, precision, state=state, trainable=trainable)
                f, bw_, ff, fb = class_block_time(bg, costs, b, chains, traffic, spec, precision)
                grad_s = grad_class[b] / (spec.mem_bw_bytes_per_s * gpu_model.STREAM_EFFICIENCY)
                times[gpu_type].append(f + bw_)
                fixed[gpu_type].append(ff + fb + grad_s)
                fwd_times[gpu_type].append(f)
                fwd_fixed[gpu_type].append(ff)
            else:
                fwd = sum(node_time_s(costs[n], spec, dtype, tf32=precision.tf32) for n in names)
                times[gpu_type].append(FWD_BWD_FACTOR * fwd)
                fixed[gpu_type].append(FWD_BWD_FACTOR * KERNEL_OVERHEAD_S * kernels
                                       + grad_roofline[b] / (spec.mem_bw_bytes_per_s * MEMORY_EFFICIENCY))
    cast = bg.with_dtypes(activations.output_dtypes)
    return BlockCosts(
        tied_params=tied_params(bg),
        fwd_bwd_s_per_sample={k: tuple(v) for k, v in times.items()},
        fwd_bwd_s_fixed={k: tuple(v) for k, v in fixed.items()},
        fwd_s_per_sample={k: tuple(v) for k, v in fwd_times.items()},
        fwd_s_fixed={k: tuple(v) for k, v in fwd_fixed.items()},
        param_count=tuple(params),
        max_param_numel=tuple(largest),
        # The loss block's backward transient rides on its saved bytes ([Note: saved activations]).
        act_bytes_per_sample=(*activations.bytes_per_sample[:-1], activations.bytes_per_sample[-1]
                              + loss_backward_transient_bytes(bg, activations.output_dtypes)),
        # As sent: float32 in the compute dtype under a mixed policy ([Note: 16-bit boundary tensors]).
        cut_bytes_per_sample=tuple(sum(t.bytes_per_sample for t in on_wire(ts, precision)) for ts in cast.cut_tensors),
        # As held on the GPU (the received tensors cast back, the sent ones before the cast; recomputation's
        # kept inputs): the dtypes the stage computes them in.
        cut_run_bytes_per_sample=tuple(sum(t.bytes_per_sample for t in ts) for ts in cast.cut_tensors),
        state_bytes_per_param=precision.state_bytes_per_param,
        # [C-optim] moves 2 x this per parameter: AdamW's state, and autocast's weight cast once per
        # step ([Note: the runtime's gradient work])
        optimizer_bytes_per_param=(precision.optimizer_step_bytes_per_param
                                   + (precision.step_cast_bytes_per_param // 2 if runtime_grad_work else 0)),
        grad_bytes_per_param=precision.allreduce_bytes_per_param,
        param_bytes_per_param=precision.allgather_bytes_per_param,
        shardable_bytes_per_param=precision.shardable_bytes_per_param,
        param16_count=tuple(params16) if any(params16) else (),
        shardable_bytes_per_param16=precision.shardable_bytes_per_param16,
        param_bytes_per_param16=precision.allgather_bytes_per_param16,
        step_control_rounds=precision.step_control_rounds,
    )
