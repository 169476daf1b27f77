"""What one training step of the model costs, per block: the record the cost
model produces and every planner, the evaluator and the simulator read.

Legend: ``B`` = number of blocks (contiguous pieces of the model graph between
legal cut points).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["BlockCosts", "TiedParam", "FORWARD_SHARE", "extra_copies", "unique_params", "shardable_kib"]

#: The forward's share of a block's forward + backward time where the cost
#: model gives no split of its own (``BlockCosts.fwd_s_per_sample`` missing a
#: type): 1/3, the backward at twice the forward. Source: a matmul's backward
#: computes two products (the input's and the weight's gradient) for the
#: forward's one -- 2N FLOPs per token forward, 4N backward (Kaplan et al.
#: 2020, "Scaling Laws for Neural Language Models", sec. 2.1; Narayanan et al.
#: SC'21, sec. 5.1: 72 B s l h^2 FLOPs per step = 3 x the forward's 24).
FORWARD_SHARE = 1.0 / 3.0


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
    #: ``{gpu_type: (B,)}`` the forward's part of ``fwd_bwd_s_per_sample``
    #: (seconds per sample, <= it), where the cost model prices the passes
    #: apart (the GPU class model, measured profiles, the roofline); a type
    #: missing here: ``FORWARD_SHARE`` of its forward+backward. The backward
    #: is the rest. It sets the forward (F) and backward (B) tasks of the
    #: pipeline schedule in the simulator and the planners' replay, GPipe's
    #: period and the re-run forward of a recomputing stage.
    fwd_s_per_sample: dict[str, tuple[float, ...]] = field(default_factory=dict)
    #: ``{gpu_type: (B,)}`` the forward's part of ``fwd_bwd_s_fixed`` (<= it);
    #: a type missing here: ``FORWARD_SHARE`` of it.
    fwd_s_fixed: dict[str, tuple[float, ...]] = field(default_factory=dict)
    #: ``(B,)`` trainable parameters first used in block ``b``.
    param_count: tuple[int, ...]
    #: ``(B,)`` activation bytes one sample keeps alive for the backward pass
    #: (measured under the plan's precision: what autograd saves under its autocast).
    act_bytes_per_sample: tuple[int, ...]
    #: ``(B+1,)`` bytes per sample crossing a cut placed *before* block ``c``,
    #: in the dtypes the plan's autocast gives the crossing tensors (entries 0
    #: and B are 0: nothing crosses the ends of the model).
    cut_bytes_per_sample: tuple[int, ...]
    #: ``(B+1,)`` the same tensors in the dtypes the stage computes and keeps them (float32 residuals
    #: under a mixed policy, which travel in 16 bits): what a stage holds on its GPU of the tensors it
    #: receives or sends, and what recomputation keeps ([C-recompute], [C-stash]); () = as sent.
    cut_run_bytes_per_sample: tuple[int, ...] = ()
    #: Bytes of training state the runtime keeps per trainable parameter
    #: under the plan's precision (``PrecisionPolicy.state_bytes_per_param``,
    #: [Note: mixed precision] in ``zorse_fx/precision.py``): float32 weight 4
    #: + float32 gradient 4 + AdamW moments 8 = 16 B in fp32; + 2 B for
    #: autocast's 16-bit weight copy in bf16/fp16-mixed (18 B); + 2 B for
    #: 16-bit gradient buckets when gradients are reduced in bfloat16 (20 B).
    state_bytes_per_param: int = 16
    #: Bytes per parameter the optimizer step reads and writes once ([C-optim]:
    #: ``2 x`` this over the memory bandwidth): the float32 weight, gradient and
    #: AdamW moments, 16 B in every precision, + 3 B under a mixed policy for
    #: autocast's cast of the weight to 16 bits once per step (4 B read + 2 B
    #: written = 2 x 3: [Note: the runtime's gradient work] in cost/roofline.py);
    #: None = ``state_bytes_per_param``.
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
    #: ``(B,)`` the parameters of ``param_count[b]`` that a sharded stage of
    #: two or more GPUs holds as 16-bit working weights under a mixed policy
    #: (``capture.low_precision_params``: matmul weights read by one block;
    #: never a tied parameter); empty = none (fp32, or a caller without them).
    #: Such a parameter keeps the same total ``state_bytes_per_param`` but
    #: moves its float32 master weight into the shard: ``shardable_bytes_per_param16``
    #: (float32 master 4 + AdamW moments 8 = 12 B) is sharded, the rest (16-bit
    #: weight 2 + float32 gradient 4 [+ 16-bit bucket copy]) replicated; its
    #: all-gather after the step moves ``param_bytes_per_param16`` (2 B).
    #: See [Note: 16-bit working weights] in ``zorse_fx/precision.py``.
    param16_count: tuple[int, ...] = ()
    shardable_bytes_per_param16: int = 12
    param_bytes_per_param16: int = 2
    #: ``(B,)`` elements of the largest parameter block ``b`` reads (a tied one included); empty = not
    #: known. Its gradient exists as a tensor of its own before autograd adds it into the gradient
    #: bucket: [Note: gradient transients] in ``solve/state_terms.py``.
    max_param_numel: tuple[int, ...] = ()
    #: Ring latencies per (GPUs used - 1) of the step's control collectives over the world: all-reduces
    #: (2 each) and all-gathers (1 each) of a few bytes, priced as their ring's latency on the used GPUs'
    #: slowest link ([C-control] in ``solve/objective.py``; ``PrecisionPolicy.step_control_rounds``:
    #: 3, or 5 under fp16-mixed: what ``cost.roofline.block_costs`` sets); 0 = none (costs built by hand
    #: for the pipeline alone).
    step_control_rounds: int = 0
    #: Seconds per step the training loop spends outside every task priced above (its per-step
    #: all-gather of the ranks' records beyond one latency, host work between the phases), measured
    #: on the cluster by a calibration (``cost/calibration.py``, ``zorse calibrate``); added to the
    #: step as [C-control] is. 0 = not measured.
    step_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        nb = len(self.param_count)
        if nb == 0:
            raise ValueError("BlockCosts needs at least one block")
        if self.param16_count:
            if len(self.param16_count) != nb or any(not 0 <= q <= p for q, p in zip(self.param16_count,
                                                                                    self.param_count)):
                raise ValueError(f"param16_count must have {nb} entries, each between 0 and the block's "
                                 f"param_count, got {self.param16_count}")
            if not 0 <= self.shardable_bytes_per_param16 <= self.state_bytes_per_param:
                raise ValueError(f"shardable_bytes_per_param16={self.shardable_bytes_per_param16} must be "
                                 f"between 0 and state_bytes_per_param={self.state_bytes_per_param}")
            tied = {b for tp in self.tied_params for b in tp.blocks}
            if any(self.param16_count[b] > self.param_count[b] - sum(tp.numel for tp in self.tied_params
                                                                     if b in tp.blocks) for b in tied):
                raise ValueError("param16_count counts a tied parameter; tied parameters stay float32")
        if not (self.step_overhead_s >= 0 and self.step_overhead_s < float("inf")):
            raise ValueError(f"step_overhead_s must be a finite number of seconds >= 0, got {self.step_overhead_s!r}")
        if not (isinstance(self.step_control_rounds, int) and self.step_control_rounds >= 0):
            raise ValueError(f"step_control_rounds must be an integer >= 0, got {self.step_control_rounds!r}")
        if self.max_param_numel and (len(self.max_param_numel) != nb or any(
                not 0 <= q <= p for q, p in zip(self.max_param_numel, self.param_count))):
            raise ValueError(f"max_param_numel must have {nb} entries, each between 0 and the block's "
                             f"param_count, got {self.max_param_numel}")
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
        if self.cut_run_bytes_per_sample and len(self.cut_run_bytes_per_sample) != nb + 1:
            raise ValueError(f"cut_run_bytes_per_sample needs {nb + 1} entries (one per cut position) or none, "
                             f"got {len(self.cut_run_bytes_per_sample)}")
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
        for name, part, whole in (("fwd_s_per_sample", self.fwd_s_per_sample, self.fwd_bwd_s_per_sample),
                                  ("fwd_s_fixed", self.fwd_s_fixed, self.fwd_bwd_s_fixed)):
            for gpu_type, times in part.items():
                total = whole.get(gpu_type, (0.0,) * nb)
                # 1e-12 s: the forward and the sum it is part of are rounded apart
                if len(times) != nb or any(not 0 <= f <= t + 1e-12 for f, t in zip(times, total)):
                    raise ValueError(f"{name}[{gpu_type!r}] must have {nb} entries, each between 0 and the "
                                     f"forward+backward time of its block, got {times} against {total}")
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

    def fixed_s(self, gpu_type: str) -> tuple[float, ...]:
        """``fwd_bwd_s_fixed[gpu_type]``, zeros where the type has none (seconds, (B,))."""
        return self.fwd_bwd_s_fixed.get(gpu_type, (0.0,) * self.num_blocks)

    def forward_s_per_sample(self, gpu_type: str) -> tuple[float, ...]:
        """(B,) seconds: the forward's part of ``fwd_bwd_s_per_sample[gpu_type]``
        (``fwd_s_per_sample``, or ``FORWARD_SHARE`` of it where the type has none)."""
        got = self.fwd_s_per_sample.get(gpu_type)
        return got if got is not None else tuple(FORWARD_SHARE * x for x in self.fwd_bwd_s_per_sample[gpu_type])

    def forward_s_fixed(self, gpu_type: str) -> tuple[float, ...]:
        """(B,) seconds: the forward's part of ``fixed_s(gpu_type)``
        (``fwd_s_fixed``, or ``FORWARD_SHARE`` of it where the type has none)."""
        got = self.fwd_s_fixed.get(gpu_type)
        return got if got is not None else tuple(FORWARD_SHARE * x for x in self.fixed_s(gpu_type))

    def forward_share_max(self) -> float:
        """The largest forward share of any block's time on any GPU type, at any
        micro-batch size: max over types and blocks of forward / (forward +
        backward), per sample and fixed parts each (a ratio of sums lies between
        them); ``FORWARD_SHARE`` when every type takes the default split. The
        planners' drain bounds use 1 - this as the least backward share."""
        out = FORWARD_SHARE
        for t in self.fwd_bwd_s_per_sample:
            for part, whole in ((self.forward_s_per_sample(t), self.fwd_bwd_s_per_sample[t]),
                                (self.forward_s_fixed(t), self.fixed_s(t))):
                out = max([out] + [f / w for f, w in zip(part, whole) if w > 0])
        return min(out, 1.0)

    def param16(self, b: int) -> int:
        """``param16_count[b]`` (0 when none are recorded)."""
        return self.param16_count[b] if self.param16_count else 0

    def shardable_bytes(self, b: int) -> int:
        """Bytes of block ``b``'s state a sharded stage of >= 2 GPUs spreads
        over its GPUs: ``shardable_bytes_per_param`` per float32 parameter,
        ``shardable_bytes_per_param16`` per 16-bit working weight."""
        q = self.param16(b)
        return self.shardable_bytes_per_param * (self.param_count[b] - q) + self.shardable_bytes_per_param16 * q

    def gather_bytes(self, b: int) -> int:
        """Bytes of block ``b``'s weights in a sharded stage's all-gather after
        the step: ``param_bytes_per_param`` per float32 parameter,
        ``param_bytes_per_param16`` per 16-bit working weight."""
        q = self.param16(b)
        return self.param_bytes_per_param * (self.param_count[b] - q) + self.param_bytes_per_param16 * q


def extra_copies(tied_blocks, i: int, j: int) -> list[tuple[int, int]]:
    """``[(t, c - 1)]`` for every tied parameter t (``tied_blocks[t]``: the
    blocks that read it) of which blocks [i, j) hold c >= 2 blocks: the
    copies a stage over those blocks holds once, not c times."""
    out = []
    for t, blocks in enumerate(tied_blocks):
        c = sum(1 for b in blocks if i <= b < j)
        if c > 1:
            out.append((t, c - 1))
    return out


def unique_params(costs, i: int = 0, j: int | None = None) -> int:
    """Parameters of blocks [i, j) (default: all) of ``costs`` (a ``BlockCosts``),
    each tied parameter counted once."""
    j = costs.num_blocks if j is None else j
    blocks = [tp.blocks for tp in costs.tied_params]
    return sum(costs.param_count[i:j]) - sum(c * costs.tied_params[t].numel for t, c in extra_copies(blocks, i, j))


def shardable_kib(costs, i: int, j: int, unit_bytes: int) -> int:
    """Shardable state Q_s of blocks [i, j) of ``costs`` (a ``BlockCosts``) in
    units of ``unit_bytes`` (``solve.tables.MEMORY_UNIT_BYTES``), rounded as
    ``build_tables`` rounds it: per block UP, less each extra tied copy
    (``extra_copies``) rounded DOWN; equal to
    ``solve.state_terms.stage_state_kib(tab, i, j)[1]`` of the tables built
    from ``costs``. For a caller holding a ``BlockCosts``
    and no tables (``Plan.decision``'s equal shards)."""
    sh = costs.shardable_bytes_per_param  # a tied parameter is float32 ([Note: 16-bit working weights])
    q = sum(-(-costs.shardable_bytes(b) // unit_bytes) for b in range(i, j))
    blocks = [tp.blocks for tp in costs.tied_params]
    return q - sum(c * (int(sh * costs.tied_params[t].numel) // unit_bytes) for t, c in extra_copies(blocks, i, j))
