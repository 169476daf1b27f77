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

__all__ = ["BlockCosts", "DeviceGraph", "SharedLink", "TiedParam", "SolverOptions", "SolverResult", "MEMORY_MODES", "SAFETY_STOP",
           "with_safety_stop"]

#: Appended to a result's status when the wall-clock safety stop cut a CP-SAT
#: solve short ([Note: reproducible plans] in ``solve/_search.py``).
SAFETY_STOP = " (wall-clock safety stop)"


def with_safety_stop(status: str, wall_clock_stops: int) -> str:
    """``status`` without ``SAFETY_STOP``, then with it again at the end when
    ``wall_clock_stops`` > 0 (so "+INTERLEAVED" and the portfolio's names go before it)."""
    base = status.replace(SAFETY_STOP, "")
    return base + SAFETY_STOP if wall_clock_stops else base

#: Values of ``SolverOptions.sharding`` / ``SolverOptions.recompute``.
MEMORY_MODES = ("never", "auto", "always")


@dataclass(frozen=True, slots=True, kw_only=True)
class TiedParam:
    """A trainable parameter read by several blocks (a tied input/output
    embedding: GPT-2, OPT). Its elements count in ``BlockCosts.param_count``
    of every block in ``blocks`` (each stage holding one of them keeps a copy);
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

    def __post_init__(self) -> None:
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
        if g in self.gpus_a:
            return 0 if h in self.gpus_b else None
        if g in self.gpus_b:
            return 1 if h in self.gpus_a else None
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
class SolverOptions:
    """Knobs of the planners (CP-SAT and brute force share them)."""

    #: Samples per global batch (all micro-batches of all stages together).
    global_batch_size: int
    #: Largest number of pipeline stages to consider (of GPU groups, when
    #: interleaving puts several stages on each; see ``max_interleave``).
    max_stages: int = 4
    #: Candidate micro-batch counts; ``None`` = every divisor of the global
    #: batch size up to ``max_microbatches``.
    num_microbatches: tuple[int, ...] | None = None
    max_microbatches: int = 16
    #: "1f1b" or "gpipe": decides activations in flight per stage.
    schedule: str = "1f1b"
    #: Fraction of each GPU's memory the plan may use (rest: allocator, CUDA
    #: context, fragmentation).
    memory_fraction: float = 0.9
    #: Work budget of each CP-SAT solve (one (stages, micro-batches) candidate),
    #: in CP-SAT *deterministic seconds* (``max_deterministic_time``): work
    #: units counted by the solver, roughly one second of one worker on an idle
    #: machine but independent of the machine's load, so the same inputs give
    #: the same plan ([Note: reproducible plans] in ``solve/_search.py``).
    deterministic_time: float = 5.0
    #: Wall-clock safety stop of each CP-SAT solve, seconds. Only a safety
    #: stop: when it fires before ``deterministic_time`` is spent, the answer
    #: depends on the machine's load, the status says "(wall-clock safety
    #: stop)" and a warning says so; raise it (or lower ``deterministic_time``).
    time_limit_s: float = 100.0
    #: CP-SAT worker threads. 1 (default): CP-SAT's sequential search,
    #: deterministic. More: the workers interleave (``interleave_search``, which
    #: keeps the search deterministic; "core" left out), which OR-Tools 9.15
    #: marks experimental and which did worse per deterministic second on the
    #: 64-GPU instance of tests/test_grouped.py (step 1.18 s vs 1.06 s at 3
    #: deterministic s per candidate; [Note: reproducible plans]).
    num_workers: int = 1
    #: Allow GPUs to stay unused when that is faster.
    allow_idle_gpus: bool = True
    #: Random seed for CP-SAT (``random_seed``; reproducible plans).
    seed: int = 0
    #: ZeRO-1 optimizer-state sharding per stage: "never", "auto" (the planner
    #: decides per stage; it costs an all-gather of the weights after the
    #: optimizer step and saves memory and optimizer time) or "always" (every
    #: stage with >= 2 GPUs is sharded).
    sharding: str = "never"
    #: Stage-level activation recomputation: "never", "auto" (per stage) or
    #: "always" (every stage).
    recompute: str = "never"
    #: Largest interleave degree v (stages per GPU group, interleaved 1F1B)
    #: ``solve.interleave`` tries on a finished plan; 1 = never interleave.
    max_interleave: int = 4

    def __post_init__(self) -> None:
        if not self.deterministic_time > 0:
            raise ValueError(f"SolverOptions.deterministic_time={self.deterministic_time!r}: use a number > 0 "
                             f"(CP-SAT deterministic seconds per candidate, e.g. 10)")
        if not self.time_limit_s > 0:
            raise ValueError(f"SolverOptions.time_limit_s={self.time_limit_s!r}: use a number of seconds > 0 "
                             f"(the wall-clock safety stop of each CP-SAT solve, e.g. 100)")
        if not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise ValueError(f"SolverOptions.num_workers={self.num_workers!r}: use an int >= 1")
        if not isinstance(self.max_interleave, int) or self.max_interleave < 1:
            raise ValueError(f"SolverOptions.max_interleave={self.max_interleave!r}: use an int >= 1 "
                             f"(1 = no interleaving)")
        for name in ("sharding", "recompute"):
            v = getattr(self, name)
            if v not in MEMORY_MODES:
                raise ValueError(f"SolverOptions.{name}={v!r}: use one of {MEMORY_MODES}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SolverResult:
    """The planner's decision, before it is turned into a ``Plan``."""

    #: Per stage ``(start_block, end_block)``, end exclusive, contiguous, in order.
    stage_blocks: tuple[tuple[int, int], ...]
    #: Per stage, the GPU indices (into ``DeviceGraph``) that form its DP group.
    stage_gpus: tuple[tuple[int, ...], ...]
    #: Per stage, samples each of its GPUs takes from every micro-batch
    #: (aligned with ``stage_gpus``; each row sums to ``microbatch_size``).
    samples_per_microbatch: tuple[tuple[int, ...], ...]
    num_microbatches: int
    microbatch_size: int
    schedule: str
    #: Predicted step time by the planner's objective, seconds.
    predicted_step_time_s: float
    #: Breakdown (seconds): per stage compute, comm, all-reduce, optimizer.
    predicted_stage_time_s: tuple[float, ...] = ()
    predicted_allreduce_s: tuple[float, ...] = ()
    #: ``(G_used,)``-aligned with stage_gpus: predicted peak memory bytes.
    predicted_memory_bytes: tuple[tuple[int, ...], ...] = ()
    #: Per stage: ZeRO-1 sharded optimizer state; per stage per GPU (aligned
    #: with stage_gpus): bytes of the stage's shardable state it holds (0 when
    #: the stage is not sharded); per stage: activation recomputation.
    stage_sharded: tuple[bool, ...] = ()
    state_shard_bytes: tuple[tuple[int, ...], ...] = ()
    stage_recompute: tuple[bool, ...] = ()
    #: Interleave degree v: the stages run on ``num_stages / v`` GPU groups,
    #: stage s on the GPUs of stage s mod (num_stages / v) (listed again).
    interleave: int = 1
    #: "OPTIMAL", "FEASIBLE", "BRUTE_FORCE", ... and the gap (0 = proven optimal);
    #: ends in ``SAFETY_STOP`` when ``wall_clock_stops`` > 0.
    status: str = "UNKNOWN"
    objective: float = 0.0
    best_bound: float = 0.0
    optimality_gap: float = 0.0
    wall_s: float = 0.0
    #: CP-SAT solves the wall-clock safety stop (``SolverOptions.time_limit_s``)
    #: cut short before their deterministic budget: when > 0 the decision may
    #: differ on another run or machine, and ``status`` ends in
    #: " (wall-clock safety stop)".
    wall_clock_stops: int = 0
    #: Every (num_stages, num_microbatches) candidate tried and its result.
    candidates: tuple[dict, ...] = field(default_factory=tuple)

    def decision_kwargs(self) -> dict:
        """The decision and its memory policy as keyword arguments of
        ``solve.evaluate`` and ``sim.simulate``: stage blocks, GPUs, samples,
        micro-batches, per-stage sharded / recompute flags, each GPU's shard in
        whole MiB (as the planners chose it; bytes here) and the interleave degree."""
        n_s, mib = len(self.stage_blocks), 1 << 20
        sharded = tuple(self.stage_sharded) or (False,) * n_s
        return dict(stage_blocks=self.stage_blocks, stage_gpus=self.stage_gpus,
                    samples_per_microbatch=self.samples_per_microbatch, num_microbatches=self.num_microbatches,
                    stage_sharded=sharded,
                    state_shard_mib=tuple(tuple(b // mib for b in row) if sh else ()
                                          for sh, row in zip(sharded, self.state_shard_bytes or ((),) * n_s)),
                    stage_recompute=tuple(self.stage_recompute) or None, interleave=self.interleave)

    @classmethod
    def from_evaluation(cls, ev, *, stage_blocks, stage_gpus, samples_per_microbatch, num_microbatches: int,
                        options: "SolverOptions", status: str, best_bound: float, wall_s: float = 0.0,
                        candidates: tuple[dict, ...] = ()) -> "SolverResult":
        """The record of a decision scored by ``objective.evaluate`` (``ev``, an
        ``Evaluation``): predictions and memory policy from ``ev``, objective =
        its step time (s), gap = (objective - best_bound) / objective (0 when
        the objective is 0). Used by every planner, so the fields stay in step."""
        obj = ev.step_time_s
        return cls(
            stage_blocks=tuple(stage_blocks), stage_gpus=tuple(stage_gpus),
            samples_per_microbatch=tuple(samples_per_microbatch), num_microbatches=num_microbatches,
            microbatch_size=options.global_batch_size // num_microbatches, schedule=options.schedule,
            predicted_step_time_s=ev.step_time_s, predicted_stage_time_s=ev.stage_time_s,
            predicted_allreduce_s=ev.allreduce_s, predicted_memory_bytes=ev.memory_bytes,
            stage_sharded=ev.stage_sharded, state_shard_bytes=ev.state_shard_bytes,
            stage_recompute=ev.stage_recompute, interleave=ev.interleave, status=status, objective=obj, best_bound=best_bound,
            optimality_gap=(obj - best_bound) / obj if obj > 0 else 0.0, wall_s=wall_s, candidates=candidates)

    @property
    def num_stages(self) -> int:
        return len(self.stage_blocks)
