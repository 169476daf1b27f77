"""``Decision``: one planner answer, the record that passes between the
solvers, the baselines, the interleave pass, the evaluator, the simulator and
the plan builder.

A decision is plain data (GPU indices into a ``DeviceGraph``, block indices
into a ``BlockCosts``); ``Decision.__post_init__`` checks everything that
needs neither (shapes, contiguous stages, a GPU in one stage, samples,
interleaving, the memory policy: ``ir/memory.py``) and ``Decision.check`` the rest
against the instance (block and GPU counts, the global batch, the schedule).
Both raise ``ValueError`` with a message naming the field, the stage and
the value. The model they are scored by: ``solve/objective.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..precision import PRECISIONS
from .memory import StageMemory

__all__ = ["Decision"]


def _tuple2(rows) -> tuple[tuple, ...]:
    return tuple(tuple(r) for r in rows)


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """Stages, their GPUs and shares, micro-batches and memory policy of one plan.

    Legend: S = stages; with interleave degree v the S stages run on P = S / v
    GPU groups, stage s on the GPUs of stage s mod P, listed again for every
    stage ([Note: interleaved stages] in ``solve/pipeline_terms.py``).
    Lists are normalised to tuples.
    """

    #: (S,) ``(start_block, end_block)`` per stage, end exclusive: contiguous,
    #: non-empty, in order, from block 0.
    stage_blocks: tuple[tuple[int, int], ...]
    #: (S,) the GPU indices (into ``DeviceGraph``) that form each stage's
    #: data-parallel group; a GPU serves at most one GPU group.
    stage_gpus: tuple[tuple[int, ...], ...]
    #: (S,) per GPU of the stage (aligned with ``stage_gpus``): samples it takes
    #: from every micro-batch (>= 1); every stage's row sums to the micro-batch size.
    samples_per_microbatch: tuple[tuple[int, ...], ...]
    #: Micro-batches per step (M); micro-batch size = global batch / M.
    num_microbatches: int
    #: Interleave degree v (stages per GPU group, interleaved 1F1B); 1 = none.
    interleave: int = 1
    #: (S,) each stage's memory policy (ZeRO level, recomputation, optimizer and
    #: activation placement; ``ir/memory.py``); () = every stage plain.
    memory: tuple[StageMemory, ...] = ()
    #: (S,) per sharded stage (ZeRO >= 1), each GPU's shard of the stage's
    #: shardable state in whole MiB (aligned with ``stage_gpus``); () for an
    #: unsharded stage. None = not chosen yet: the evaluator and the
    #: simulator fill it with ``objective.balance_shards`` (the planners'
    #: choice for the memory left); ``SolverResult.decision`` always has it.
    shard_mib: tuple[tuple[int, ...], ...] | None = None
    #: The precision the decision was priced under ("fp32", "bf16-mixed",
    #: "fp16-mixed"; ``zorse_fx/precision.py``); "" = as priced, i.e. whatever
    #: ``BlockCosts`` the decision is scored with (the solvers see only costs).
    precision: str = ""

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "stage_blocks", tuple(tuple(b) for b in self.stage_blocks))
        put(self, "stage_gpus", _tuple2(self.stage_gpus))
        put(self, "samples_per_microbatch", _tuple2(self.samples_per_microbatch))
        n_s = len(self.stage_blocks)
        memory = tuple(self.memory) or (StageMemory(),) * n_s
        if len(memory) != n_s:
            raise ValueError(f"Decision.memory has {len(memory)} entries, the decision has {n_s} stages")
        put(self, "memory", memory)
        self._check_stages()
        self._check_memory()
        if self.shard_mib is None and not any(mem.zero for mem in memory):
            put(self, "shard_mib", ((),) * n_s)
        if self.shard_mib is not None:
            put(self, "shard_mib", self._checked_shards(_tuple2(self.shard_mib)))
        if not isinstance(self.precision, str) or self.precision not in ("", *PRECISIONS):
            raise ValueError(f"Decision.precision={self.precision!r}: use '' (as priced) or one of "
                             f"{', '.join(map(repr, PRECISIONS))}")

    def _check_memory(self) -> None:
        for s, (mem, gpus) in enumerate(zip(self.memory, self.stage_gpus)):
            if not isinstance(mem, StageMemory):
                raise ValueError(f"Decision.memory[{s}] is a {type(mem).__name__}: use a zorse_fx.ir.StageMemory")
            if mem.zero and len(gpus) < 2:
                raise ValueError(f"stage {s} is sharded (ZeRO-{mem.zero}) but has {len(gpus)} GPU: ZeRO needs >= 2 "
                                 f"GPUs in the stage's data-parallel group (Decision.memory[{s}].zero)")

    def _check_stages(self) -> None:
        blocks, gpus_of, samples = self.stage_blocks, self.stage_gpus, self.samples_per_microbatch
        n_s, v, m = len(blocks), self.interleave, self.num_microbatches
        if len(gpus_of) != n_s or len(samples) != n_s:
            raise ValueError(f"stage_blocks has {n_s} stages, stage_gpus {len(gpus_of)}, "
                             f"samples_per_microbatch {len(samples)}: they must be equal")
        if not blocks:
            raise ValueError("stage_blocks is empty: a plan needs at least one stage")
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise ValueError(f"Decision.num_microbatches={m!r}: use an int >= 1")
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"interleave={v!r} must be an int >= 1")
        groups = n_s
        if v > 1:
            if n_s % v or n_s // v < 2:
                raise ValueError(f"interleave={v} needs a stage count that is a multiple of {v} with at least 2 "
                                 f"GPU groups, got {n_s} stages")
            groups = n_s // v
            for s in range(groups, n_s):
                if (gpus_of[s], samples[s]) != (gpus_of[s % groups], samples[s % groups]):
                    raise ValueError(f"interleave={v}: stage {s} must have the GPUs and samples of stage "
                                     f"{s % groups} ({gpus_of[s % groups]}, {samples[s % groups]}), "
                                     f"got ({gpus_of[s]}, {samples[s]})")
        end = 0
        for s, (i, j) in enumerate(blocks):
            if i != end or j <= i:
                raise ValueError(f"stage {s} blocks ({i}, {j}): expected a non-empty range starting "
                                 f"at block {end} (stages must be contiguous and in order)")
            end = j
        seen: dict[int, int] = {}
        for s, (gpus, ns) in enumerate(zip(gpus_of[:groups], samples[:groups])):
            if not gpus:
                raise ValueError(f"stage {s} has no GPU")
            if len(ns) != len(gpus):
                raise ValueError(f"stage {s}: {len(gpus)} GPUs but {len(ns)} sample counts")
            for g, n in zip(gpus, ns):
                if not isinstance(g, int) or isinstance(g, bool) or g < 0:
                    raise ValueError(f"stage {s}: GPU index {g!r} must be an int >= 0")
                if g in seen:
                    where = f"twice in stage {s}" if seen[g] == s else f"in stage {seen[g]} and stage {s}"
                    raise ValueError(f"GPU {g} is {where}: each GPU serves at most one stage")
                seen[g] = s
                if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                    raise ValueError(f"stage {s} GPU {g}: samples per micro-batch must be an int >= 1, got {n!r}")
            if s and sum(ns) != sum(samples[0]):
                raise ValueError(f"stage {s}: samples {ns} sum to {sum(ns)}, stage 0's {samples[0]} to "
                                 f"{sum(samples[0])}: every stage takes the whole micro-batch")

    def _checked_shards(self, rows: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
        n_s = len(self.stage_blocks)
        if len(rows) != n_s:
            raise ValueError(f"Decision.shard_mib has {len(rows)} rows, the decision has {n_s} stages")
        out = []
        for s, (mem, gpus, row) in enumerate(zip(self.memory, self.stage_gpus, rows)):
            if not mem.zero:
                if any(row):
                    raise ValueError(f"stage {s} is not sharded but Decision.shard_mib gives it shards {row}")
                out.append(())
                continue
            if len(row) != len(gpus) or any(not isinstance(z, int) or isinstance(z, bool) or z < 0 for z in row):
                raise ValueError(f"stage {s}: Decision.shard_mib {row} must give one int >= 0 per GPU "
                                 f"({len(gpus)} GPUs)")
            out.append(row)
        return tuple(out)

    def check(self, *, num_blocks: int, num_gpus: int, global_batch_size: int, schedule: str = "1f1b") -> int:
        """Check the decision against an instance: the last stage ends at
        ``num_blocks``, GPU indices below ``num_gpus``, ``num_microbatches``
        divides ``global_batch_size`` and each stage's samples sum to the
        micro-batch size, interleaving only with "1f1b". Returns the
        micro-batch size. Raises ValueError naming the stage and the value."""
        gbs, m = global_batch_size, self.num_microbatches
        if self.interleave > 1 and schedule != "1f1b":
            raise ValueError(f"interleave={self.interleave} needs schedule '1f1b', got {schedule!r}")
        if gbs % m:
            raise ValueError(f"num_microbatches={m!r} must be a positive divisor of global_batch_size={gbs}")
        b = gbs // m
        end = self.stage_blocks[-1][1]
        if end != num_blocks:
            raise ValueError(f"last stage ends at block {end}, the model has {num_blocks} blocks")
        for s, (gpus, ns) in enumerate(zip(self.stage_gpus, self.samples_per_microbatch)):
            for g in gpus:
                if g >= num_gpus:
                    raise ValueError(f"stage {s}: GPU index {g!r} outside 0..{num_gpus - 1}")
            if sum(ns) != b:
                raise ValueError(f"stage {s}: samples {ns} sum to {sum(ns)}, the micro-batch has "
                                 f"{b} samples ({gbs} / {m} micro-batches)")
        return b

    @property
    def num_stages(self) -> int:
        return len(self.stage_blocks)

    @property
    def num_groups(self) -> int:
        """GPU groups P = S / v (= S without interleaving)."""
        return len(self.stage_blocks) // self.interleave

    @property
    def microbatch_size(self) -> int:
        """Samples per micro-batch (every stage's samples sum to it)."""
        return sum(self.samples_per_microbatch[0])

    @property
    def gpus_used(self) -> tuple[int, ...]:
        """The GPUs of the decision, ascending."""
        return tuple(sorted({g for gs in self.stage_gpus for g in gs}))

    def without_policy(self) -> "Decision":
        """This decision with every stage plain (same stages, GPUs, samples,
        micro-batches and interleaving)."""
        return dataclasses.replace(self, memory=(), shard_mib=None)

    def with_shards(self, shard_mib) -> "Decision":
        """This decision with each sharded stage's shards set to ``shard_mib`` (MiB)."""
        return dataclasses.replace(self, shard_mib=shard_mib)

    def shard_bytes(self) -> tuple[tuple[int, ...], ...]:
        """Per stage per GPU (aligned with ``stage_gpus``), the bytes of the
        stage's shardable state it holds: ``shard_mib`` x 2**20, 0 on an
        unsharded stage. ValueError while ``shard_mib`` is None."""
        if self.shard_mib is None:
            raise ValueError("Decision.shard_mib is None (the evaluator picks the shards): evaluate the "
                             "decision first (SolverResult.decision has them)")
        return tuple(tuple(z << 20 for z in row) if mem.zero else (0,) * len(gs)
                     for mem, row, gs in zip(self.memory, self.shard_mib, self.stage_gpus))
