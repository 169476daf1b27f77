"""Records passed into and out of the planners (CP-SAT solver, brute force).

Everything here is plain data: the planners never see fx graphs or
``Cluster`` objects, only per-block costs and a device graph, so they can be
tested on small hand-made instances.

Legend: ``B`` = number of blocks (contiguous pieces of the model graph between
legal cut points), ``G`` = number of GPUs in the cluster.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .decision import Decision

if TYPE_CHECKING:
    from ..options import PlanOptions

__all__ = ["BlockCosts", "DeviceGraph", "SharedLink", "TiedParam", "SolverResult", "SAFETY_STOP",
           "with_safety_stop"]

#: Appended to a result's status when the wall-clock safety stop cut a CP-SAT
#: solve short ([Note: reproducible plans] in ``solve/_search.py``).
SAFETY_STOP = " (wall-clock safety stop)"


def with_safety_stop(status: str, wall_clock_stops: int) -> str:
    """``status`` without ``SAFETY_STOP``, then with it again at the end when
    ``wall_clock_stops`` > 0 (so "+INTERLEAVED" and the portfolio's names go before it)."""
    base = status.replace(SAFETY_STOP, "")
    return base + SAFETY_STOP if wall_clock_stops else base

@dataclass(frozen=True, slots=True, kw_only=True)
class TiedParam:
    """A trainable parameter read by several blocks (a tied input/output
    embedding: GPT-2, OPT). Its elements count in ``BlockCosts.param_count``
    of every block in ``blocks`` (each stage holding one or more of them keeps
    one copy, which the cost model counts once: [C-tied], ``state_terms.py``);
    where those blocks fall in different stages the runtime reduces its
    gradient once over the union of the holding stages' GPUs ([Note:
    overlapped gradient reduction] in ``runtime/grad_sync.py``), not per stage."""

    #: Canonical parameter name (``CapturedModel.tied`` values), for messages.
    name: str
    #: The blocks that read it, ascending, at least two.
    blocks: tuple[int, ...]
    #: Elements of the parameter.
    numel: int

    def __post_init__(self) -> None:
        if len(self.blocks) < 2 or list(self.blocks) != sorted(set(self.blocks)) or self.blocks[0] < 0:
            raise ValueError(f"TiedParam {self.name!r}: blocks={self.blocks!r} must be >= 2 distinct block "
                             f"indices >= 0 in ascending order")
        if not isinstance(self.numel, int) or self.numel <= 0:
            raise ValueError(f"TiedParam {self.name!r}: numel={self.numel!r} must be an int > 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockCosts:
    """Per-block costs of one training step of the model, per sample.

    Block ``b`` is the ``b``-th contiguous piece of the graph; a pipeline stage
    is a contiguous range of blocks ``[start, end)``.
    """

    #: ``{gpu_type: (B,)}`` forward+backward time of one sample through block
    #: ``b`` on one GPU of that type, in seconds (cost model: roofline or
    #: measured profile).
    fwd_bwd_s_per_sample: dict[str, tuple[float, ...]]
    #: ``{gpu_type: (B,)}`` forward+backward time of block ``b`` per
    #: micro-batch that does not grow with its samples (kernel launches), in
    #: seconds. Missing types count as zero.
    fwd_bwd_s_fixed: dict[str, tuple[float, ...]] = field(default_factory=dict)
    #: ``(B,)`` trainable parameters first used in block ``b``.
    param_count: tuple[int, ...]
    #: ``(B,)`` activation bytes one sample keeps alive for the backward pass
    #: (measured under the plan's precision: what autograd saves under its autocast).
    act_bytes_per_sample: tuple[int, ...]
    #: ``(B+1,)`` bytes per sample crossing a cut placed *before* block ``c``,
    #: in the dtypes the plan's autocast gives the crossing tensors (entries 0
    #: and B are 0: nothing crosses the ends of the model).
    cut_bytes_per_sample: tuple[int, ...]
    #: Bytes of training state the runtime keeps per trainable parameter
    #: under the plan's precision (``PrecisionPolicy.state_bytes_per_param``,
    #: [Note: mixed precision] in ``zorse_fx/precision.py``): float32 weight 4
    #: + float32 gradient 4 + AdamW moments 8 = 16 B in fp32; + 2 B for
    #: autocast's 16-bit weight copy in bf16/fp16-mixed (18 B); + 2 B for
    #: 16-bit gradient buckets when gradients are reduced in bfloat16 (20 B).
    state_bytes_per_param: int = 16
    #: Bytes per parameter the optimizer step reads and writes once ([C-optim]:
    #: ``2 x`` this over the memory bandwidth): the float32 weight, gradient and
    #: AdamW moments, 16 B in every precision (AdamW does not touch the 16-bit
    #: weight copies); None = ``state_bytes_per_param``.
    optimizer_bytes_per_param: int | None = None
    #: Bytes of each gradient element in the DP all-reduce: 4 (float32
    #: reduction, every precision's default), 2 (bfloat16 reduction).
    grad_bytes_per_param: int = 4
    #: The part of ``state_bytes_per_param`` that ZeRO-1 shards across a
    #: stage's data-parallel group: AdamW's two float32 moments (8 B), in every
    #: precision. Weights (float32 masters, which autocast reads), gradients
    #: and the 16-bit weight copies stay replicated.
    shardable_bytes_per_param: int = 8
    #: Bytes of each weight in the all-gather after a sharded optimizer step:
    #: 4 (the float32 master weights, in every precision).
    param_bytes_per_param: int = 4
    #: Parameters read by several blocks (tied embeddings), each counted in
    #: ``param_count`` of every block that reads it; empty = none.
    tied_params: tuple[TiedParam, ...] = ()

    def __post_init__(self) -> None:
        nb = len(self.param_count)
        if nb == 0:
            raise ValueError("BlockCosts needs at least one block")
        if not 0 <= self.shardable_bytes_per_param <= self.state_bytes_per_param:
            raise ValueError(
                f"shardable_bytes_per_param={self.shardable_bytes_per_param} must be between 0 and "
                f"state_bytes_per_param={self.state_bytes_per_param}")
        if len(self.act_bytes_per_sample) != nb:
            raise ValueError(
                f"act_bytes_per_sample has {len(self.act_bytes_per_sample)} entries, "
                f"param_count has {nb}"
            )
        if len(self.cut_bytes_per_sample) != nb + 1:
            raise ValueError(
                f"cut_bytes_per_sample needs {nb + 1} entries (one per cut position), "
                f"got {len(self.cut_bytes_per_sample)}"
            )
        for gpu_type, times in self.fwd_bwd_s_per_sample.items():
            if len(times) != nb:
                raise ValueError(
                    f"fwd_bwd_s_per_sample[{gpu_type!r}] has {len(times)} entries, "
                    f"expected {nb} (one per block)"
                )
            if any(t < 0 for t in times):
                raise ValueError(f"negative block time for {gpu_type!r}: {times}")
        for gpu_type, times in self.fwd_bwd_s_fixed.items():
            if len(times) != nb or any(t < 0 for t in times):
                raise ValueError(
                    f"fwd_bwd_s_fixed[{gpu_type!r}] must have {nb} non-negative entries, got {times}"
                )
        for tp in self.tied_params:
            if not isinstance(tp, TiedParam):
                raise ValueError(f"tied_params must hold TiedParam records, got {tp!r}")
            bad = [b for b in tp.blocks if b >= nb or self.param_count[b] < tp.numel]
            if bad:
                raise ValueError(
                    f"tied parameter {tp.name!r}: block(s) {bad} out of range or with param_count below its "
                    f"{tp.numel} elements; a tied parameter counts in param_count of every block in {tp.blocks}")
        if len({tp.name for tp in self.tied_params}) != len(self.tied_params):
            raise ValueError(f"tied_params names must be unique, got {[tp.name for tp in self.tied_params]}")

    @property
    def optim_bytes(self) -> int:
        """``optimizer_bytes_per_param``, or ``state_bytes_per_param`` when unset."""
        return self.state_bytes_per_param if self.optimizer_bytes_per_param is None else self.optimizer_bytes_per_param

    @property
    def num_blocks(self) -> int:
        return len(self.param_count)


@dataclass(frozen=True, slots=True, kw_only=True)
class SharedLink:
    """A network link that the flows of several GPU pairs cross (a region's
    WAN uplink, a node's NIC), declared in the cluster file (``shared_links:``,
    ``nic:``; ``zorse_fx.cluster.cluster``). A flow from GPU g to GPU h crosses
    it when g is on side a and h on side b (direction 0) or the reverse
    (direction 1); each direction has ``bandwidth_bytes_per_s`` of its own
    (full duplex), shared by every flow crossing it that way, on top of the
    pair's own link (``DeviceGraph.link_bw_bytes_per_s``) ([Note: network
    resources] in ``zorse_fx/sim/network.py``)."""

    #: Name for tables and messages (``"wan-us-eu"``, ``"nic:node0"``).
    name: str
    #: The GPUs of either side, ascending, disjoint, non-empty.
    gpus_a: tuple[int, ...]
    gpus_b: tuple[int, ...]
    #: Capacity of each direction, bytes/s.
    bandwidth_bytes_per_s: float
    #: ``gpus_a`` / ``gpus_b`` as sets (derived; O(1) membership for ``direction``).
    _side_a: frozenset = field(init=False, repr=False, compare=False)
    _side_b: frozenset = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_side_a", frozenset(self.gpus_a))
        object.__setattr__(self, "_side_b", frozenset(self.gpus_b))
        for side in ("gpus_a", "gpus_b"):
            gpus = getattr(self, side)
            if not gpus or list(gpus) != sorted(set(gpus)) or gpus[0] < 0:
                raise ValueError(f"SharedLink {self.name!r}: {side}={gpus!r} must be distinct GPU indices "
                                 f">= 0 in ascending order, at least one")
        common = set(self.gpus_a) & set(self.gpus_b)
        if common:
            raise ValueError(f"SharedLink {self.name!r}: GPUs {sorted(common)} are on both sides; "
                             f"a flow crosses the link from one side to the other")
        if not (self.bandwidth_bytes_per_s > 0 and math.isfinite(self.bandwidth_bytes_per_s)):
            raise ValueError(f"SharedLink {self.name!r}: bandwidth_bytes_per_s={self.bandwidth_bytes_per_s!r} "
                             f"must be a finite number > 0 (bytes/s per direction)")

    def direction(self, g: int, h: int) -> int | None:
        """0 when a flow g -> h crosses the link from side a to side b, 1 from
        b to a, None when it does not cross it."""
        if g in self._side_a:
            return 0 if h in self._side_b else None
        if g in self._side_b:
            return 1 if h in self._side_a else None
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceGraph:
    """The GPUs of a cluster as the planners see them.

    GPU ``g`` is index ``g`` of every per-GPU tuple; links are symmetric.
    """

    #: ``(G,)`` GPU type names, keys of ``BlockCosts.fwd_bwd_s_per_sample``.
    gpu_types: tuple[str, ...]
    #: ``(G,)`` usable memory per GPU in bytes.
    memory_bytes: tuple[int, ...]
    #: ``(G,)`` memory bandwidth per GPU in bytes/s (optimizer-step time).
    mem_bw_bytes_per_s: tuple[float, ...]
    #: ``(G, G)`` link bandwidth between GPU g and h, bytes/s (diagonal unused).
    link_bw_bytes_per_s: tuple[tuple[float, ...], ...]
    #: ``(G, G)`` link latency between GPU g and h, seconds (diagonal unused).
    link_latency_s: tuple[tuple[float, ...], ...]
    #: ``(G,)`` node name of each GPU (for tables and symmetry breaking).
    node_names: tuple[str, ...] = ()
    #: Links the flows of several GPU pairs share (WAN uplinks, NICs), on top
    #: of each pair's own link; empty = every pair has its link to itself.
    shared_links: tuple[SharedLink, ...] = ()

    def __post_init__(self) -> None:
        g = len(self.gpu_types)
        for name in ("memory_bytes", "mem_bw_bytes_per_s", "link_bw_bytes_per_s", "link_latency_s"):
            if len(getattr(self, name)) != g:
                raise ValueError(f"DeviceGraph.{name} has {len(getattr(self, name))} rows, expected {g}")
        for name in ("link_bw_bytes_per_s", "link_latency_s"):
            for row in getattr(self, name):
                if len(row) != g:
                    raise ValueError(f"DeviceGraph.{name} must be {g}x{g}")
        if self.node_names and len(self.node_names) != g:
            raise ValueError(f"DeviceGraph.node_names has {len(self.node_names)} entries, expected {g}")
        for link in self.shared_links:
            if not isinstance(link, SharedLink):
                raise ValueError(f"DeviceGraph.shared_links must hold SharedLink records, got {link!r}")
            if max(link.gpus_a[-1], link.gpus_b[-1]) >= g:
                raise ValueError(f"DeviceGraph.shared_links: {link.name!r} names GPU "
                                 f"{max(link.gpus_a[-1], link.gpus_b[-1])}, the graph has {g} GPUs")
        names = [link.name for link in self.shared_links]
        if len(set(names)) != len(names):
            raise ValueError(f"DeviceGraph.shared_links: names must be unique, got {names}")

    @property
    def num_gpus(self) -> int:
        return len(self.gpu_types)


@dataclass(frozen=True, slots=True, kw_only=True)
class SolverResult:
    """A planner's answer, before it is turned into a ``Plan``: the decision,
    its predictions and how the planner got it."""

    #: The decision (stages, GPUs, samples, micro-batches, interleaving,
    #: memory policy), each sharded stage's shards chosen (``shard_mib`` set).
    decision: Decision
    #: "1f1b" or "gpipe" (``PlanOptions.schedule``).
    schedule: str
    #: Predicted step time by the planner's objective, seconds.
    predicted_step_time_s: float
    #: Breakdown (seconds): per stage compute, comm, all-reduce, optimizer.
    predicted_stage_time_s: tuple[float, ...] = ()
    predicted_allreduce_s: tuple[float, ...] = ()
    #: Per stage, per GPU (aligned with ``decision.stage_gpus``): predicted peak memory bytes.
    predicted_memory_bytes: tuple[tuple[int, ...], ...] = ()
    #: "OPTIMAL", "FEASIBLE", "BRUTE_FORCE", ... and the gap (0 = proven optimal);
    #: ends in ``SAFETY_STOP`` when ``wall_clock_stops`` > 0.
    status: str = "UNKNOWN"
    objective: float = 0.0
    best_bound: float = 0.0
    optimality_gap: float = 0.0
    wall_s: float = 0.0
    #: CP-SAT solves the wall-clock safety stop (``PlanOptions.time_limit_s``)
    #: cut short before their deterministic budget: when > 0 the decision may
    #: differ on another run or machine, and ``status`` ends in
    #: " (wall-clock safety stop)".
    wall_clock_stops: int = 0
    #: Every (num_stages, num_microbatches) candidate tried and its result.
    candidates: tuple[dict, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not isinstance(self.decision, Decision) or self.decision.shard_mib is None:
            raise ValueError(f"SolverResult.decision must be a Decision with its shards chosen (shard_mib set), "
                             f"got {self.decision!r}: build the result with SolverResult.from_evaluation")

    @classmethod
    def from_evaluation(cls, ev, *, options: "PlanOptions", status: str, best_bound: float, wall_s: float = 0.0,
                        candidates: tuple[dict, ...] = ()) -> "SolverResult":
        """The record of a decision scored by ``objective.evaluate`` (``ev``, an
        ``Evaluation``): the decision as scored (``ev.decision``, shards
        included), predictions from ``ev``, objective = its step time (s),
        gap = (objective - best_bound) / objective (0 when the objective is 0).
        Used by every planner, so the fields stay in step."""
        obj = ev.step_time_s
        return cls(
            decision=ev.decision, schedule=options.schedule,
            predicted_step_time_s=ev.step_time_s, predicted_stage_time_s=ev.stage_time_s,
            predicted_allreduce_s=ev.allreduce_s, predicted_memory_bytes=ev.memory_bytes,
            status=status, objective=obj, best_bound=best_bound,
            optimality_gap=(obj - best_bound) / obj if obj > 0 else 0.0, wall_s=wall_s, candidates=candidates)

    @property
    def num_stages(self) -> int:
        return self.decision.num_stages
