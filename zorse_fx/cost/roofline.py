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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ..capture.analysis import BlockGraph
from ..capture.trace import META_KEY, _fetch_attr
from ..cluster import GPUSpec
from ..solve.records import BlockCosts
from .opclass import flops_bytes, op_class, tensors_in

__all__ = ["NodeCost", "node_costs", "block_costs", "MATMUL_EFFICIENCY", "MEMORY_EFFICIENCY", "FWD_BWD_FACTOR",
           "KERNEL_OVERHEAD_S"]

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

    Args:
        specs: ``{gpu_type: GPUSpec}`` of the cluster's GPU types.
        compute_dtype: dtype of the matmuls (selects the datasheet peak).
        state_bytes_per_param: weights + grads + AdamW moments (fp32: 16 B).
    """
    costs = node_costs(bg)
    nodes = {n.name: n for n in bg.graph.nodes}
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
        # Saved activations: outputs of the non-view nodes of the block.
        acts.append(int(sum(_out_bytes(nodes[n]) for n in names if costs[n].bytes > 0)))
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
