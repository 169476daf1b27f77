"""The Plan IR: what every planner returns and the only thing a rank reads.

A plan says, for one model on one cluster: the pipeline stages (block range,
parameters, tensors received and sent per sample), the GPUs of each stage's
data-parallel group with the samples each takes from every micro-batch, the
micro-batch size and count, the schedule, and the planner's prediction.

On disk (``Plan.export(dir)``)::

    dir/plan.json        this record (format version PLAN_FORMAT_VERSION)
    dir/stage_<i>.py     readable source of stage i (from codegen), executed
                         by the runtime only if its sha256 is the one
                         plan.json records

beside what ``zorse plan`` adds (``weights.pt``, ``plan_request.json``) and
``zorse simulate`` writes (``simulate/``): ``PLAN_DIR_ENTRIES``. A plan is
written over an older one only in such a directory, and none of the old
plan's files stays behind ([Note: writing a plan directory]).

Written and read by ``_plan_io.py`` (``Plan.to_dict`` / ``Plan.load``); the
readable table (``Plan.table``) is drawn by ``plan_table.py``.

Stage sources (format version 5): a plan file is data, but a stage file is
Python that every rank executes. So ``plan.json`` records each stage file's
sha256 (``source_sha256``), a stage's ``source_file`` must be a plain file
name inside the plan directory, and ``Plan.load`` (checks: ``stage_sources.py``)
refuses a file whose hash differs (an edited or swapped stage file) with the stage, the file and both
hashes named. The runtime executes the text that was hashed
(``Plan.sources``), never the file again. A file of version 1-4 records no
hashes: it loads (``zorse show`` works) with ``Plan.sources_verified``
False, and the runtime refuses to run it until it is re-exported.

Checked before anything runs: ``Plan.load`` / ``Plan.from_dict``
check plan.json against its schema (``plan_schema.py``, built by
``file_schema.struct_of`` from the annotations of this module's dataclasses:
types, ranges, allowed values and each field's meaning; no unknown keys;
older versions upgraded first) before any
stage file is read, and ``Plan.__post_init__`` checks the rules tying fields
together. Every error is a ``PlanFileError`` naming the file, the field path
(``stages[1].gpus[0].samples_per_microbatch``), the value and the fix.

Ranks (format version 15; ``Plan.rank_order``): a plan numbers the GPUs it
uses node by node, in the cluster file's order of the nodes and then of each
node's GPUs (``GPUShare.gpu`` ascending), so ``world_size`` = number of GPUs
the plan uses and the ranks of a node are contiguous, as torchrun numbers
them when each node is started with ``--node-rank`` (``Plan.node_ranks``,
[Note: ranks node by node]). Files of version 1-14 numbered them stage by
stage (stage 0's GPUs 0..k0-1, and so on); they read with ``rank_order``
"stage" and keep their numbering: such a plan runs on one host, and on
several nodes only where each node's ranks happen to be contiguous.

Interleaving (format version 3; older files read with ``interleave = 1``):
with ``Plan.interleave = v > 1`` the ``S`` stages run on ``P = S / v`` GPU
groups, stage ``s`` on the GPUs of stage ``s % P`` (same GPUs, ranks and
sample shares, listed again), as chunk ``s // P`` of its group, under
interleaved 1F1B (``ir.schedule.interleaved_1f1b``). Ranks are numbered
over the first ``P`` stages; a rank hosts ``v`` stages (``Plan.stages_of``).

Precision (format version 4; older files read as ``fp32``, which is how their
runtime trained): ``Plan.precision`` is one of ``precision.PRECISIONS``
(``fp32``, ``bf16-mixed``, ``fp16-mixed``) and ``Plan.grad_reduce_dtype`` the
dtype of the gradient all-reduce; ``Plan.precision_policy()`` is the policy
the planner priced and the runtime trains with ([Note: mixed precision] in
``precision.py``). The stages' ``recv``/``send`` specs are in the dtypes that
policy's autocast gives the crossing tensors (the wire format).

Gradient buckets (format version 6; older files read with DDP's 25 MiB, what
their runtime used unless told otherwise): ``Plan.grad_bucket_bytes`` is the
bucket size the planner priced (``PlanOptions.bucket_mib``, ``zorse plan
--bucket-mib``) and the runtime's gradient all-reduce uses; it is not a
training option, so a run cannot use buckets the planner never priced.

Two memory-saving choices per stage (format version 2; a version-1 file reads
with both off):

- ``StagePlan.sharded``: ZeRO-1. The AdamW state of the stage (the two
  moments) is split across the stage's data-parallel group instead of
  replicated; GPU ``j`` holds the contiguous range ``shard_ranges(n)[j]`` of
  the stage's flattened trainable elements, sized in proportion to its
  ``GPUShare.state_shard_bytes`` (the state share is chosen apart from the
  compute share, as in Cephalo). See [Note: ZeRO-1 with unequal shards] in
  ``runtime/optimizer.py``.
- ``StagePlan.recompute``: the stage keeps only its inputs per in-flight
  micro-batch and re-runs its forward before the backward. See
  [Note: stage recomputation] in ``runtime/stage.py``.

16-bit working weights (format version 8; an older file reads with none):
``StagePlan.low_precision_params`` lists the parameters a sharded stage of
two or more GPUs holds in the compute dtype under a mixed precision, their
float32 masters moved into the ZeRO-1 shard ([Note: 16-bit working weights]
in ``zorse_fx/precision.py``).

Sharded gradients, ZeRO-2 (format version 9; an older file reads with it
off): ``StagePlan.grad_sharded`` makes a sharded stage of two or more GPUs
reduce every micro-batch's gradients to their shard owners instead of
accumulating float32 gradients of the whole stage on every GPU ([Note:
sharded gradients] in ``runtime/grad_sync.py``).

Sharded parameters, ZeRO-3 (format version 10; an older file reads with it
off): ``StagePlan.param_sharded`` makes a ZeRO-2 stage keep only each GPU's
range of its working weights, gathered block by block for the forward and
again for the backward ([Note: sharded parameters] in
``runtime/param_shard.py``).

Optimizer offload (format version 11; an older file reads with it off):
``StagePlan.offload_optimizer`` keeps the stage's AdamW moments and float32
master weights in host memory and steps them on the CPU ([Note: optimizer
offload] in ``runtime/optimizer.py``); ``StagePlan.offload_activations`` keeps
what autograd saves between a micro-batch's forward and backward there
([Note: activation offload] in ``runtime/act_offload.py``);
``GPUShare.predicted_host_memory_bytes`` is what each GPU's process holds there.

The cluster (format version 13; older files record none): ``Plan.cluster_gpus``
(its GPUs per node, readable) and ``Plan.cluster_sha256`` (``Cluster.fingerprint``:
GPUs, memory and links), so a plan is not simulated on another cluster.

The loss (format version 14; an older file reads as ``sample_mean``, which is
how its runtime trained): ``Plan.loss_reduction`` is ``sample_mean`` (each
GPU's loss weighted by its share of the samples) or ``token_mean`` (by its
count of the tokens the loss averages over, which the last stage's generated
``loss_count`` computes from the inputs: [Note: token-mean losses] in
``capture/loss_count.py``). The last stage file declares it too
(``LOSS_REDUCTION``), and ``Plan.load`` refuses a plan.json that says
otherwise (``stage_sources.check_agreement``).

Host-stashed recomputation (format version 17; an older file reads with it
off): ``StagePlan.stash_on_host`` makes a recomputing stage keep each block's
inputs in host memory and re-run its blocks one at a time in the backward,
instead of keeping its inputs on the GPU and re-running the whole stage
([Note: host-stashed recomputation] in ``runtime/block_stash.py``).

Idle GPUs (format version 16; older files record none): ``Plan.idle_gpus``
names the cluster's GPUs the plan gives no work (``IdleGPUs``), the predicted
step of the best plan the planner scored that uses every GPU and what makes
that plan slower, in one line ([Note: idle GPUs said aloud] in
``zorse_fx/idle.py``); absent when the plan uses every GPU.

TF32 (format version 12; an older file reads with it off, PyTorch's
default): ``Plan.tf32`` says whether float32 matmuls run on TF32 tensor
cores; the planner priced them so and every rank sets PyTorch's flags to it
(``PrecisionPolicy.tf32`` in ``zorse_fx/precision.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Iterator, Literal

from msgspec import Meta

from .errors import PlanDirectoryError, PlanFileError, short_repr
from .file_schema import NOT_IN_FILE, OPTIONAL
from .ir.buckets import BUCKET_BYTES
from .ir.costs import BlockCosts, shardable_kib, unique_params
from .ir.decision import Decision
from .ir.memory import StageMemory
from .ir.schedule import SCHEDULES
from .ir.tensor import TensorSpec
from .plan_table import GIB, plan_table  # noqa: F401 (GIB: importable from here as before)
from .precision import PRECISIONS, REDUCE_DTYPES, PrecisionPolicy, precision_policy
from .stage_sources import source_sha256

__all__ = ["PLAN_FORMAT_VERSION", "PLAN_DIR_ENTRIES", "RANK_ORDERS", "MemoryBreakdown", "GPUShare", "StagePlan",
           "SolverReport", "IdleGPU", "IdleGPUs", "Plan", "RankRole", "NodeRanks", "check_plan_dir", "new_plan_dir",
           "stage_memory"]

#: Bytes per KiB, the planner's memory unit (``solve.tables.MEMORY_UNIT_BYTES``), and per MiB, its shards'
#: unit (``Plan.decision``'s equal shards, rounded as the planner rounds them).
KIB, MIB = 1 << 10, 1 << 20

#: Bumped on any incompatible change of plan.json.
PLAN_FORMAT_VERSION = 17

#: ``Plan.rank_order`` values: "node" (format 15: node by node) and "stage" (formats 1-14: stage by stage).
RANK_ORDERS = ("node", "stage")


# Field types of plan.json: one declaration, read by the schema (``plan_schema``,
# through ``file_schema.struct_of``) for the ranges and the meaning its errors quote.
Count = Annotated[int, Meta(ge=1)]  # a size that must be at least 1 (samples, tokens, micro-batches)
Index = Annotated[int, Meta(ge=0)]  # a rank, GPU index, block index
Bytes = Annotated[int, Meta(ge=0)]
Seconds = Annotated[float, Meta(ge=0)]
Fraction = Annotated[float, Meta(ge=0)]
ScheduleName = Literal[SCHEDULES]  # type: ignore[valid-type]
PrecisionName = Literal[PRECISIONS]  # type: ignore[valid-type]


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryBreakdown:
    """A GPU's predicted peak memory by what holds it, bytes; the parts sum to
    ``GPUShare.predicted_memory_bytes`` (format version 7; all 0 in a plan
    read from an older file: not recorded). Over every stage the GPU hosts
    (interleaving), each tied parameter once per stage. Per unique parameter
    under the plan's precision ([Note: mixed precision] in
    ``zorse_fx/precision.py``):

    - ``weights_bytes``: float32 master weights (4 B) and, mixed, the step's
      16-bit copies in autocast's cache (2 B); a 16-bit working weight
      (``StagePlan.low_precision_params``) 2 B;
    - ``gradients_bytes``: float32 gradients (4 B; the gradient buckets); on
      a ZeRO-2 stage (``StagePlan.grad_sharded``) the GPU's gradient shard,
      its share of ``state_shard_bytes`` in proportion to 4 B per parameter
      beside the shardable bytes;
    - ``optimizer_bytes``: AdamW's two moments (8 B), or on a ZeRO-1 stage
      this GPU's shard (``state_shard_bytes``, which holds the float32
      masters of its 16-bit working weights; on a ZeRO-2 stage less its
      gradient shard);
    - ``communication_bytes``: the 16-bit copies of gradient buckets in flight
      (2 B with a 16-bit ``grad_reduce_dtype``, else 0), on a ZeRO-2 stage its
      reduction buffers (three buckets at most); point-to-point
      buffers are not modelled (one micro-batch's boundary tensors);
    - ``activations_bytes``: the rest of the prediction: what autograd saves
      for the micro-batches in flight (``cost/activations.py``), the
      recomputing stage's inputs and one re-run, the loss block's backward
      transient (two logits-sized gradients,
      ``cost.activations.loss_backward_transient_bytes``), a weight's gradient
      before autograd adds it into the bucket where it outgrows one
      micro-batch's activations (three of a tied embedding's on a stage
      holding both its uses: [Note: gradient transients] in
      ``solve/state_terms.py``) and the planner's rounding (< 1 KiB per block). Not modelled: a body block's backward
      transient (an MLP's 4h-wide gradient), small beside its saved tensors.
      Measured on this CPU: within 2% of one rank's peak (bench/README.md,
      ``bench/memory_cpu.py``; ``tests/test_runtime_memory.py``)."""

    #: Master weights and 16-bit copies, bytes (the class docstring's list).
    weights_bytes: Bytes = 0
    #: float32 gradients or the ZeRO-2 gradient shard, bytes.
    gradients_bytes: Bytes = 0
    #: AdamW's moments or this GPU's ZeRO-1 shard, bytes.
    optimizer_bytes: Bytes = 0
    #: Saved activations of the micro-batches in flight and transients, bytes.
    activations_bytes: Bytes = 0
    #: 16-bit gradient buckets in flight and ZeRO-2 reduction buffers, bytes.
    communication_bytes: Bytes = 0

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.gradients_bytes + self.optimizer_bytes + self.activations_bytes
                + self.communication_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class GPUShare:
    """One GPU of a stage's data-parallel group."""

    rank: Annotated[Index, Meta(description="the GPU's rank: 0..world_size-1, numbered node by node (rank_order "
                                            "'node') or stage by stage (rank_order 'stage')")]
    #: Index of the GPU in the cluster file (nodes in order, GPUs in order).
    gpu: Annotated[Index, Meta(description="the GPU's index in the cluster file")]
    #: The node the GPU is on (the cluster file's node name; its hostname on the cluster).
    node: str
    #: The GPU's type (the cluster file's ``type``, priced by its profile).
    gpu_type: str
    #: Samples this GPU takes from every micro-batch (>= 1).
    samples_per_microbatch: Annotated[Count, Meta(
        description="the samples this GPU takes from every micro-batch; the shares of a stage's GPUs sum to "
                    "microbatch_size")]
    predicted_memory_bytes: Annotated[Bytes, Meta(description="bytes")] = field(default=0, metadata=OPTIONAL)
    memory_capacity_bytes: Annotated[Bytes, Meta(description="bytes")] = field(default=0, metadata=OPTIONAL)
    #: Bytes of the stage's shardable optimizer state this GPU holds when the
    #: stage is ``sharded`` (ZeRO-1); the runtime splits the stage's elements
    #: in proportion to these (all 0: equally). Ignored when not sharded.
    state_shard_bytes: Annotated[Bytes, Meta(
        description="bytes of the stage's optimizer state this GPU holds; 0 on every GPU of the stage splits it "
                    "equally")] = 0
    #: ``predicted_memory_bytes`` by what holds it (version 7; all 0 when not recorded).
    predicted_memory: MemoryBreakdown = field(default=MemoryBreakdown(), metadata=OPTIONAL)
    #: Host memory this GPU's process holds for its offloads (version 11; 0: none): an offloaded
    #: optimizer's 12 B per parameter it steps ([C-offload]) and offloaded activations of the
    #: micro-batches in flight ([C-act-offload]); the objective's prediction.
    predicted_host_memory_bytes: Annotated[Bytes, Meta(description="bytes")] = field(default=0, metadata=OPTIONAL)


def stage_memory(stage) -> StageMemory:
    """The memory policy (``ir/memory.py``) of a plan stage: a ``StagePlan``, or
    any object with its fields, a field it lacks read as off (as in plan files
    from before the field). ``sharded`` / ``grad_sharded`` / ``param_sharded``
    give the ZeRO level (the highest set), ``offload_optimizer`` /
    ``offload_activations`` "host". ValueError (``StageMemory``'s) for fields
    no policy has (activation offload with recomputation or ZeRO-2/3)."""
    def on(name: str) -> bool:
        return bool(getattr(stage, name, False))

    return StageMemory(zero=3 if on("param_sharded") else 2 if on("grad_sharded") else int(on("sharded")),
                       recompute=on("recompute"), optimizer="host" if on("offload_optimizer") else "device",
                       activations="host" if on("offload_activations") else "device",
                       stash="host" if on("stash_on_host") else "device")


@dataclass(frozen=True, slots=True, kw_only=True)
class StagePlan:
    index: Annotated[Index, Meta(description="the stage's position in 'stages', from 0")]
    #: Block range [start, end) of the captured model.
    blocks: Annotated[tuple[Index, Index], Meta(description="the stage's block range [start, end) of the captured "
                                                            "model")]
    #: Human label of the first and last block (module paths).
    label: str
    gpus: Annotated[tuple[GPUShare, ...], Meta(min_length=1, description="the stage's GPUs, at least one")]
    #: The model inputs this stage reads from the data loader (the first stage's tokens, the last's labels).
    input_names: tuple[str, ...]
    #: Boundary tensors this stage receives from the previous one per micro-batch, in order.
    recv: tuple[TensorSpec, ...]
    #: Boundary tensors this stage sends to the next one per micro-batch, in order.
    send: tuple[TensorSpec, ...]
    #: flat attribute name -> canonical parameter name (trainable).
    params: Annotated[dict[str, str], Meta(description="flat attribute name -> canonical parameter name, both "
                                                       "strings")]
    #: flat attribute name -> canonical buffer/constant name.
    consts: Annotated[dict[str, str], Meta(description="flat attribute name -> canonical buffer name, both strings")]
    num_parameters: Annotated[Index, Meta(description="a count")]
    #: File name of the stage source, beside plan.json (a plain name: no directory part).
    #: (plan.json follows it with the file's ``source_sha256``: ``Plan.source_hashes``.)
    source_file: Annotated[str, Meta(description="it must be the plain name of a Python file beside plan.json, "
                                                 "like 'stage_0.py'")]
    #: Predicted compute time of one micro-batch (slowest GPU), seconds.
    predicted_time_s: Seconds = 0.0
    #: Predicted time of the stage's gradient all-reduce per step, seconds (0 on one GPU).
    predicted_allreduce_s: Seconds = 0.0
    #: ZeRO-1: AdamW state sharded over the stage's GPUs (see ``shard_ranges``).
    sharded: Annotated[bool, Meta(description="true or false")] = False
    #: Activation recomputation: keep only stage inputs, re-run forward in backward.
    recompute: Annotated[bool, Meta(description="true or false")] = False
    #: 16-bit working weights (format version 8; none in older files): flat
    #: names (keys of ``params``) of the parameters a sharded stage of two or
    #: more GPUs keeps in the compute dtype on the GPU under a mixed policy,
    #: their float32 masters in the optimizer shard ([Note: 16-bit working
    #: weights] in ``zorse_fx/precision.py``). Ignored by a run in fp32.
    low_precision_params: Annotated[tuple[str, ...], Meta(
        description="flat names of the stage's parameters held in 16 bits (keys of 'params')")] = field(
        default=(), metadata=OPTIONAL)
    #: ZeRO-2 (format version 9; off in older files): each micro-batch's
    #: gradients are reduced to the GPUs owning their ZeRO-1 ranges, which
    #: accumulate them in float32; no GPU holds the stage's whole gradient.
    #: Needs ``sharded`` and two or more GPUs.
    grad_sharded: Annotated[bool, Meta(description="true or false")] = field(default=False, metadata=OPTIONAL)
    #: ZeRO-3 (format version 10; off in older files): each GPU keeps only its
    #: ZeRO-1 range of the stage's working weights; every block's are gathered
    #: before its forward and again for its backward, freed after. Needs
    #: ``grad_sharded``.
    param_sharded: Annotated[bool, Meta(description="true or false")] = field(default=False, metadata=OPTIONAL)
    #: Optimizer offload (format version 11; off in older files): the stage's
    #: AdamW moments and float32 master weights in host memory, the step on
    #: the CPU (with any state layout).
    offload_optimizer: Annotated[bool, Meta(description="true or false")] = field(default=False, metadata=OPTIONAL)
    #: Activation offload (format version 11; off in older files): what autograd
    #: saves in a micro-batch's forward is kept in host memory until its
    #: backward. Not with ``recompute`` nor ``grad_sharded``.
    offload_activations: Annotated[bool, Meta(description="true or false")] = field(default=False,
                                                                                   metadata=OPTIONAL)
    #: Host-stashed recomputation (format version 17; off in older files): a recomputing stage keeps each
    #: block's inputs in host memory and re-runs its blocks one at a time in the backward. Needs
    #: ``recompute``; not with ``grad_sharded`` nor ``offload_activations``.
    stash_on_host: Annotated[bool, Meta(description="true or false")] = field(default=False, metadata=OPTIONAL)

    @property
    def memory(self) -> StageMemory:
        """The stage's memory policy as the planner's record (``ir/memory.py``): ``stage_memory``."""
        return stage_memory(self)

    @staticmethod
    def memory_fields(memory: StageMemory) -> dict[str, bool]:
        """The plan file's per-stage fields of ``memory`` (``sharded``, ``recompute``,
        ``grad_sharded``, ``param_sharded``, ``offload_optimizer``, ``offload_activations``, ``stash_on_host``),
        as ``StagePlan(...)`` takes them; ``stage_memory`` reads them back."""
        return {"sharded": memory.zero >= 1, "recompute": memory.recompute, "grad_sharded": memory.zero >= 2,
                "param_sharded": memory.zero == 3, "offload_optimizer": memory.optimizer == "host",
                "offload_activations": memory.activations == "host", "stash_on_host": memory.stash == "host"}

    @property
    def microbatch_size(self) -> int:
        return sum(g.samples_per_microbatch for g in self.gpus)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(g.rank for g in self.gpus)

    def sample_ranges(self) -> tuple[tuple[int, int], ...]:
        """Per GPU, its rows ``[start, end)`` within every micro-batch."""
        out, start = [], 0
        for g in self.gpus:
            out.append((start, start + g.samples_per_microbatch))
            start += g.samples_per_microbatch
        return tuple(out)

    def shard_ranges(self, num_elements: int) -> tuple[tuple[int, int], ...]:
        """Per GPU (stage order), its range ``[start, end)`` of the stage's
        ``num_elements`` flattened trainable elements under ZeRO-1.

        Sizes are proportional to ``state_shard_bytes`` with largest-remainder
        rounding (ties to the earlier GPU); all zero means an equal split. A
        GPU with ``state_shard_bytes == 0`` gets an empty range (unless all are
        0). The ranges are contiguous, in GPU order, and cover every element.
        """
        if num_elements < 0:
            raise ValueError(f"num_elements must be >= 0, got {num_elements}")
        weights = [g.state_shard_bytes for g in self.gpus]
        if any(w < 0 for w in weights):
            raise ValueError(f"stage {self.index}: state_shard_bytes must be >= 0, got {weights}")
        if sum(weights) == 0:
            weights = [1] * len(weights)
        total = sum(weights)
        sizes = [num_elements * w // total for w in weights]
        remainders = [num_elements * w % total for w in weights]
        # Exact integer largest remainder: the leftover count is below the
        # number of non-zero remainders, so a zero-weight GPU never gets one.
        for j in sorted(range(len(weights)), key=lambda j: (-remainders[j], j))[: num_elements - sum(sizes)]:
            sizes[j] += 1
        out, start = [], 0
        for n in sizes:
            out.append((start, start + n))
            start += n
        return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class SolverReport:
    #: The planner that made the plan (``zorse plan --planner``, or a baseline's name).
    planner: str
    #: How the search ended (CP-SAT's OPTIMAL or FEASIBLE, or the planner's own word), for readers.
    status: str
    # Objective, bound and gap may be inf / nan (no bound found): floats, unranged.
    #: The plan's objective: its predicted step time, seconds (inf: no plan found).
    objective_s: float
    #: The best lower bound the solver proved on its objective, seconds (nan: none).
    best_bound_s: float
    #: (objective - bound) / objective (nan where there is no bound).
    optimality_gap: float
    #: Wall-clock seconds the planning took (for readers: the plan does not depend on it).
    wall_s: Seconds
    #: The wall-clock safety stop of each CP-SAT solve, seconds
    #: (``PlanOptions.time_limit_s``; 0 = not recorded).
    time_limit_s: Seconds = field(default=0.0, metadata=OPTIONAL)
    #: The deterministic budget of each CP-SAT solve, in CP-SAT deterministic
    #: seconds (work units, not seconds; ``PlanOptions.solver_budget``); 0 = not
    #: recorded (plans made before it existed, or by ``plan_fixed``).
    solver_budget: Annotated[float, Meta(ge=0)] = field(default=0.0, metadata=OPTIONAL)
    #: CP-SAT solves the wall-clock safety stop ended before their budget; > 0:
    #: the plan may differ on another run (``status`` ends in "(wall-clock safety stop)").
    wall_clock_stops: Annotated[int, Meta(ge=0)] = field(default=0, metadata=OPTIONAL)
    #: What the planner tried (``ir.result.Candidate.to_dict``), for readers.
    candidates: tuple[dict[str, Any], ...] = field(default=(), metadata=OPTIONAL)
    #: The simulator's check of the answer (``sim.check_result``): step time
    #: (s), largest peak / usable memory over the GPUs, bubble fraction; 0 =
    #: not simulated (plans made by ``plan_fixed`` or before format 3's check).
    simulated_step_time_s: Seconds = field(default=0.0, metadata=OPTIONAL)
    #: The simulator's largest peak / usable memory over the GPUs (0: not simulated).
    simulated_max_memory_fraction: Fraction = field(default=0.0, metadata=OPTIONAL)
    #: The simulator's bubble: the fraction of the step the GPUs wait (0: not simulated).
    simulated_bubble_fraction: Fraction = field(default=0.0, metadata=OPTIONAL)
    #: A lower bound (s) on the step time of EVERY plan these options allow
    #: (``solve.bounds.throughput_bound_s``: every GPU busy all step at its
    #: speed, no communication, no bubble, perfect balance; or one sample's
    #: forward and backward through every block with its fixed per-micro-batch
    #: time, where that is longer), whatever the state
    #: layout, offload or interleaving (format 11; 0 = not recorded). The
    #: plan table reports the plan's distance to it; ``best_bound_s`` is the
    #: solver's own bound, over the solver's model only.
    throughput_bound_s: Seconds = field(default=0.0, metadata=OPTIONAL)

    def verdict(self, predicted_step_s: float) -> str:
        """One sentence on how good the plan is, in words that mean what they say
        (issue 32 item 3): "proven optimal" only for a CP-SAT optimum returned as
        it is, and then over CP-SAT's model (one stage per GPU group, no ZeRO-2/3,
        offload or interleaving); for every plan its distance to the throughput
        bound, which holds for every plan."""
        status = self.status
        if status == "OPTIMAL":
            words = ("proven optimal among the plans of CP-SAT's model (one stage per GPU group; no ZeRO-2/3, "
                     "offload or interleaving)")
        elif status == "FIXED":
            words = "a decision given by hand, not searched"
        elif "+SIM_RERANKED" in status:  # [Note: simulator re-rank] in portfolio.py
            words = (f"the best plan found ({status}: of the objective's best few plans, the one the simulator "
                     f"finds fastest)")
        elif "+POLISHED" in status:  # [Note: the final polish] in solve/polish.py
            words = (f"the best plan found ({status}: the planner's answer made faster by the final local search, "
                     f"a cut, a sample, a stage's memory policy or the micro-batch count one step over)")
        else:
            words = f"the best plan found ({status})"
        if self.throughput_bound_s > 0 and predicted_step_s > 0:
            over = predicted_step_s / self.throughput_bound_s - 1
            words += (f"; {over:.0%} slower than the throughput bound {fmt_seconds(self.throughput_bound_s)} "
                      f"(every GPU busy all step, or one sample through every block if longer; no communication "
                      f"or bubble: no plan of these options is faster)")
        return words


@dataclass(frozen=True, slots=True, kw_only=True)
class IdleGPU:
    """A GPU of the cluster that the plan gives no work (``IdleGPUs.gpus``)."""

    #: Index of the GPU in the cluster file (nodes in order, GPUs in order), as ``GPUShare.gpu``.
    gpu: Annotated[Index, Meta(description="the GPU's index in the cluster file")]
    #: The node the GPU is on (the cluster file's node name).
    node: str
    #: The GPU's type (the cluster file's ``type``).
    gpu_type: str


@dataclass(frozen=True, slots=True, kw_only=True)
class IdleGPUs:
    """The GPUs a plan leaves idle and what giving them work would cost
    (format version 16; ``Plan.idle_gpus``, None where the plan uses every
    GPU). Made by ``idle.idle_gpus`` from the plans the planner scored
    ([Note: idle GPUs said aloud] in ``zorse_fx/idle.py``)."""

    #: The idle GPUs, in the cluster file's order.
    gpus: Annotated[tuple[IdleGPU, ...], Meta(min_length=1, description="the GPUs no stage uses, at least one")]
    #: The predicted step time (the objective's, as ``Plan.predicted_step_time_s``), seconds, of the best plan
    #: the planner scored that gives every GPU work; None (null): none of those fits.
    all_gpus_step_time_s: Annotated[float, Meta(ge=0, description="seconds, or null where no plan using every "
                                                                 "GPU fits")] | None
    #: The planner part that made that plan (its status: "BASELINE:metis", "STAGE_DP", "OPTIMAL", ...; "STAGE_DP
    #: (every GPU)": the stage DP run with every GPU in use, where no scored plan used them all); "" where none fits.
    all_gpus_source: str
    #: What makes that plan slower than this one (which stage, GPU, link), or why no plan using every GPU
    #: fits: one line, for readers.
    reason: str


def fmt_seconds(t: float) -> str:
    """A time for a message, with its digits however small it is: "2.000 s" from
    1 s, "78.80 ms", "27.94 µs" below (4 significant digits), "0 s" for 0."""
    if t >= 1 or t <= 0:
        return f"{t:.3f} s" if t else "0 s"
    return f"{t * 1e3:.4g} ms" if t >= 1e-3 else f"{t * 1e6:.4g} µs"


@dataclass(frozen=True, slots=True, kw_only=True)
class RankRole:
    """What one rank does: its stage(s) and its rows of every micro-batch."""

    rank: int
    #: Its first stage (= its GPU group's index).
    stage: int
    position: int  # index of the GPU within the stage's DP group
    row_start: int
    row_end: int
    #: Every stage the rank runs, in order (``(stage,)`` without interleaving).
    stages: tuple[int, ...] = ()


# [Note: ranks node by node]
# torchrun started on N nodes (``--nnodes N --node-rank k --nproc-per-node n_k``,
# static rendezvous) gives node k the global ranks sum(n_j, j < k) ..
# sum(n_j, j <= k) - 1, local rank i being the node's i-th (the elastic agent's
# ``_assign_worker_ranks``: a cumulative sum over the nodes in --node-rank
# order, whatever n_k each brings). A rank runs what the plan gives its rank
# number, so a plan runs on its own cluster only where each node's ranks are
# contiguous, in the order the nodes are started. ``zorse plan`` therefore
# numbers the GPUs it uses node by node (``rank_order`` "node"): the cluster
# file's node order, then the GPU's order in its node, i.e. by ``GPUShare.gpu``;
# a node whose GPUs are partly idle brings fewer local ranks. Node k of the
# launch is then the k-th node the plan uses in the file's order, started with
# its own ranks' count (``Plan.node_ranks``; ``zorse train --nnodes N
# --node-rank k`` finds both there), and local rank i is the i-th of the node's
# planned GPUs (``CUDA_VISIBLE_DEVICES`` in the file's order where the plan
# leaves some idle). Nothing else assumes an order of the ranks: stages,
# process groups, point-to-point programs, gradient owners and checkpoints
# are derived from the plan's ranks (a ZeRO-2 reduce-scatter orders its parts
# by rank, not by the stage's GPU order). Plans of format 14 and older
# numbered stage by stage (``rank_order`` "stage") and keep that numbering:
# their ranks of one node need not be contiguous, and a multi-node launch of
# such a plan is refused with the advice to re-plan.


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeRanks:
    """One node of a plan as torchrun starts it (``Plan.node_ranks``, [Note:
    ranks node by node])."""

    #: torchrun's ``--node-rank``: the node's place among the plan's nodes, in the order of their lowest ranks.
    node_rank: int
    #: The node's name in the cluster file.
    node: str
    #: The plan's ranks on the node, ascending (its local ranks 0.. in that order).
    ranks: tuple[int, ...]
    #: Per rank (same order), the GPU's index in the cluster file (``GPUShare.gpu``).
    gpus: tuple[int, ...]

    @property
    def contiguous(self) -> bool:
        """Whether the ranks are consecutive (torchrun can start them as one node's local ranks)."""
        return self.ranks == tuple(range(self.ranks[0], self.ranks[0] + len(self.ranks)))

    def describe_ranks(self) -> str:
        """``"ranks 2-3"``, ``"rank 0"``, or ``"ranks 0, 3"`` where not contiguous."""
        if len(self.ranks) == 1:
            return f"rank {self.ranks[0]}"
        if self.contiguous:
            return f"ranks {self.ranks[0]}-{self.ranks[-1]}"
        return "ranks " + ", ".join(map(str, self.ranks))


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A plan; its fields in plan.json's order (plan.json adds ``format``
    first and ``compute_dtype`` after ``grad_reduce_dtype``)."""

    version: Annotated[int, Meta(ge=1)] = PLAN_FORMAT_VERSION
    #: The cluster file's ``name`` the plan was made for.
    cluster_name: str
    #: The planned-for cluster's GPUs per node (``Cluster.gpu_summary``; format
    #: version 13, "" in older files: not recorded), for readers and messages.
    cluster_gpus: str = field(default="", metadata=OPTIONAL)
    #: sha256 of the planned-for cluster (``Cluster.fingerprint``: GPUs, memory,
    #: links; not its name; format version 13, "" in older files): ``zorse
    #: simulate`` refuses a cluster file of another.
    cluster_sha256: Annotated[str, Meta(pattern="^([0-9a-f]{64})?$", description="the cluster's sha256, 64 hex "
                                        "digits, or '' (not recorded)")] = field(default="", metadata=OPTIONAL)
    #: The model the plan was captured from: a registry name or a local Hugging Face directory (absolute).
    model_name: str
    #: Model inputs, all ``(N, seq_len)`` int64 token tensors for LMs.
    input_names: tuple[str, ...]
    seq_len: Annotated[Count, Meta(description="tokens per sample")]
    #: How the data loader builds inputs: "same" (HF: labels = input_ids, the
    #: model shifts) or "shifted" (targets = input_ids shifted by one).
    label_mode: Literal["same", "shifted"]
    #: How the loss averages (format version 14; older files read as "sample_mean"): over the
    #: samples, or over the tokens the last stage's ``loss_count`` counts (see the module docstring).
    loss_reduction: Annotated[Literal["sample_mean", "token_mean"], Meta(
        description="how the loss averages: over the samples, or over the tokens the last stage's loss_count "
                    "counts")] = field(default="sample_mean", metadata=OPTIONAL)
    global_batch_size: Annotated[Count, Meta(description="samples per optimizer step = microbatch_size x "
                                                         "num_microbatches")]
    microbatch_size: Annotated[Count, Meta(description="samples per micro-batch")]
    num_microbatches: Annotated[Count, Meta(description="micro-batches per step")]
    #: The pipeline schedule: "1f1b" (one forward, one backward) or "gpipe" (all forwards first).
    schedule: ScheduleName
    #: Interleave degree v: stages per GPU group (see the module docstring).
    interleave: Annotated[Count, Meta(description="stages per GPU group, 1 without interleaving")] = 1
    #: How ``GPUShare.rank`` numbers the plan's GPUs (format version 15; older files read as "stage"):
    #: "node" node by node (the cluster file's node order, then each node's GPUs: ``gpu`` ascending),
    #: "stage" stage by stage. [Note: ranks node by node]
    rank_order: Annotated[Literal[RANK_ORDERS], Meta(  # type: ignore[valid-type]
        description="how the ranks number the GPUs: 'node' (node by node, in the order of the GPUs' index in "
                    "the cluster file) or 'stage' (stage by stage, plans of format 14 and older)")] = "node"
    #: Training precision, one of ``precision.PRECISIONS`` (format version 4;
    #: older files read as "fp32").
    precision: PrecisionName = "fp32"
    #: dtype of the gradient all-reduce, one of ``precision.REDUCE_DTYPES[precision]``
    #: (checked by ``__post_init__``, whose message names what the precision allows).
    grad_reduce_dtype: str = "float32"
    #: float32 matmuls on TF32 tensor cores where the GPU has them (format
    #: version 12; older files read as False): priced from the TF32 peak, set on
    #: every rank (``PrecisionPolicy.apply_matmul_precision``).
    tf32: bool = field(default=False, metadata=OPTIONAL)
    #: Gradient all-reduce bucket size, bytes (format version 6; older files read
    #: as 25 MiB, what their runtime used by default): ``PlanOptions.bucket_mib``,
    #: priced by the planner, used by the runtime's buckets (``runtime/grad_sync.py``).
    grad_bucket_bytes: Annotated[int, Meta(ge=1024, description="the gradient all-reduce bucket size in bytes, "
                                                                 "at least 1 KiB (zorse plan --bucket-mib)")] = BUCKET_BYTES
    #: The planner's predicted time of one optimizer step, seconds (its objective).
    predicted_step_time_s: Seconds
    #: How the plan was found: planner, status, objective, bound, budget and the simulator's check.
    solver: SolverReport
    #: The GPUs the plan leaves idle and the best plan scored that uses them (format version 16; absent or
    #: null: the plan uses every GPU, or a file of version <= 15 that did not say).
    idle_gpus: IdleGPUs | None = field(default=None, metadata=OPTIONAL)
    stages: Annotated[tuple[StagePlan, ...], Meta(min_length=1, description="the pipeline stages, at least one")]
    #: Stage sources (not in plan.json; written as stage_<i>.py beside it).
    sources: tuple[str, ...] = field(default=(), compare=False, repr=False, metadata=NOT_IN_FILE)
    #: Whether ``sources`` may be executed: True for a plan made in this
    #: process or loaded with every stage file's sha256 matching plan.json;
    #: False for a version 1-4 file (no hashes recorded).
    sources_verified: bool = field(default=True, compare=False, repr=False, metadata=NOT_IN_FILE)
    #: The stage sources' sha256 as the loaded plan.json recorded them (version >= 5).
    recorded_sha256: tuple[str, ...] = field(default=(), compare=False, repr=False, metadata=NOT_IN_FILE)

    def __post_init__(self) -> None:
        """The rules tying fields together (a plan file's types and ranges are
        checked before, by ``plan_schema``). Raises PlanFileError naming the
        field path and value (prefix ``plan:``; ``from_dict`` puts the file)."""
        if not isinstance(self.precision, str) or self.precision not in PRECISIONS:
            raise PlanFileError(f"plan: field 'precision' is {short_repr(self.precision)}; allowed: "
                                f"{', '.join(map(repr, PRECISIONS))}")
        allowed = REDUCE_DTYPES[self.precision]
        if not isinstance(self.grad_reduce_dtype, str) or self.grad_reduce_dtype not in allowed:
            raise PlanFileError(f"plan: field 'grad_reduce_dtype' is {short_repr(self.grad_reduce_dtype)}; precision "
                                f"{self.precision!r} allows {', '.join(map(repr, allowed))}")
        if self.microbatch_size * self.num_microbatches != self.global_batch_size:
            raise PlanFileError(
                f"plan: microbatch_size {self.microbatch_size} x num_microbatches "
                f"{self.num_microbatches} != global_batch_size {self.global_batch_size}; make global_batch_size "
                f"their product or re-export the plan with `zorse plan`"
            )
        self._check_stages()
        v = self.interleave
        if not isinstance(v, int) or v < 1 or len(self.stages) % v:
            raise PlanFileError(f"plan: field 'interleave': interleave {short_repr(v)} must be an integer >= 1 "
                                f"dividing the stage count {len(self.stages)} (stages per GPU group)")
        if v > 1 and self.schedule != "1f1b":
            raise PlanFileError(f"plan: field 'schedule': interleave {v} needs schedule '1f1b' (interleaved 1F1B), "
                                f"not {self.schedule!r}; set interleave to 1 or the schedule to '1f1b'")
        groups = len(self.stages) // v
        self._check_ranks(groups)
        self._check_idle()
        for s in self.stages[groups:]:
            home = self.stages[s.index % groups]
            key = [(g.rank, g.gpu, g.samples_per_microbatch) for g in s.gpus]
            if key != [(g.rank, g.gpu, g.samples_per_microbatch) for g in home.gpus]:
                raise PlanFileError(
                    f"plan: field stages[{s.index}].gpus: with interleave {v}, stage {s.index} must run on the GPUs "
                    f"of stage {home.index} (GPU group {home.index}): (rank, gpu, samples) {short_repr(key)} != "
                    f"{short_repr([(g.rank, g.gpu, g.samples_per_microbatch) for g in home.gpus])}")
        for s in self.stages:
            unknown = [n for n in s.low_precision_params if n not in s.params]
            if unknown:
                raise PlanFileError(
                    f"plan: field stages[{s.index}].low_precision_params names {short_repr(unknown)}, which "
                    f"{'is' if len(unknown) == 1 else 'are'} not among the stage's parameters ('params'); list "
                    f"only keys of stages[{s.index}].params, or re-export the plan with `zorse plan`")
            if s.low_precision_params and not (s.sharded and len(s.gpus) > 1 and self.precision != "fp32"):
                raise PlanFileError(
                    f"plan: field stages[{s.index}].low_precision_params lists {len(s.low_precision_params)} "
                    f"parameter(s), but 16-bit working weights need a mixed precision and a sharded stage of two "
                    f"or more GPUs (precision {self.precision!r}, sharded {s.sharded}, {len(s.gpus)} GPU(s)); "
                    f"set it to [] or re-export the plan with `zorse plan`")
            if s.grad_sharded is True and not (s.sharded and len(s.gpus) > 1):
                raise PlanFileError(
                    f"plan: field stages[{s.index}].grad_sharded is true, but sharded gradients (ZeRO-2) need a "
                    f"sharded stage of two or more GPUs (sharded {s.sharded}, {len(s.gpus)} GPU(s)); set it to "
                    f"false or re-export the plan with `zorse plan`")
            if s.param_sharded is True and s.grad_sharded is not True:
                raise PlanFileError(
                    f"plan: field stages[{s.index}].param_sharded is true, but sharded parameters (ZeRO-3) need "
                    f"sharded gradients (grad_sharded is {short_repr(s.grad_sharded)}); set grad_sharded to true "
                    f"(and sharded, on two or more GPUs) or param_sharded to false, or re-export the plan with "
                    f"`zorse plan`")
            if s.offload_activations is True and (s.recompute is True or s.grad_sharded is True):
                raise PlanFileError(
                    f"plan: field stages[{s.index}].offload_activations is true on a stage that "
                    f"{'recomputes' if s.recompute is True else 'shards its gradients'}; activation offload goes "
                    f"without recomputation and ZeRO-2/3: set one of them to false, or re-export the plan with "
                    f"`zorse plan`")
            if s.stash_on_host is True and not (s.recompute is True and s.grad_sharded is not True
                                                and s.offload_activations is not True):
                why = ("does not recompute" if s.recompute is not True else "shards its gradients"
                       if s.grad_sharded is True else "offloads its activations")
                raise PlanFileError(
                    f"plan: field stages[{s.index}].stash_on_host is true on a stage that {why}; host-stashed block "
                    f"inputs need recompute true and go without ZeRO-2/3 and activation offload: set stash_on_host "
                    f"to false, or re-export the plan with `zorse plan`")
            for name in ("sharded", "recompute", "grad_sharded", "param_sharded", "offload_optimizer",
                         "offload_activations", "stash_on_host"):
                if not isinstance(getattr(s, name), bool):
                    raise PlanFileError(f"plan: field stages[{s.index}].{name} is {short_repr(getattr(s, name))}; "
                                        f"it must be true or false")
            for j, g in enumerate(s.gpus):
                if not isinstance(g.state_shard_bytes, int) or g.state_shard_bytes < 0:
                    raise PlanFileError(
                        f"plan: field stages[{s.index}].gpus[{j}].state_shard_bytes is "
                        f"{short_repr(g.state_shard_bytes)}; it must be an integer >= 0 (bytes of the stage's "
                        "optimizer state this GPU holds; 0 on every GPU of the stage splits it equally)"
                    )
                parts = g.predicted_memory.total_bytes
                if parts and parts != g.predicted_memory_bytes:
                    raise PlanFileError(
                        f"plan: field stages[{s.index}].gpus[{j}].predicted_memory sums to {parts} bytes, but "
                        f"predicted_memory_bytes is {g.predicted_memory_bytes}; the parts must add up to the "
                        f"prediction (or all be 0: not recorded): re-export the plan with `zorse plan`")

    def _check_idle(self) -> None:
        """``idle_gpus`` names each GPU once, and only GPUs no stage uses."""
        if self.idle_gpus is None:
            return
        used = {g.gpu: s.index for s in reversed(self.stages) for g in s.gpus}
        seen: set[int] = set()
        for j, g in enumerate(self.idle_gpus.gpus):
            if g.gpu in used or g.gpu in seen:
                why = (f"stage {used[g.gpu]} runs on GPU {g.gpu}" if g.gpu in used else
                       f"GPU {g.gpu} is listed before")
                raise PlanFileError(
                    f"plan: field idle_gpus.gpus[{j}].gpu is {short_repr(g.gpu)}, but {why}: list each GPU no "
                    f"stage uses once, or re-export the plan with `zorse plan`")
            seen.add(g.gpu)

    def _check_ranks(self, groups: int) -> None:
        """The ranks of the first ``groups`` stages (every GPU of the world
        once) number the GPUs as ``rank_order`` says: "stage", 0..n-1 in
        stage order; "node", in the order of their ``gpu`` index (node by
        node, [Note: ranks node by node]; a GPU listed twice: stage order)."""
        if self.rank_order not in RANK_ORDERS:
            raise PlanFileError(f"plan: field 'rank_order' is {short_repr(self.rank_order)}; allowed: "
                                f"{', '.join(map(repr, RANK_ORDERS))}")
        where = [(s.index, j, g) for s in self.stages[:groups] for j, g in enumerate(s.gpus)]
        ranks = [g.rank for _, _, g in where]
        expected = list(range(len(where)))
        if self.rank_order == "node":
            for r, k in enumerate(sorted(range(len(where)), key=lambda k: where[k][2].gpu)):
                expected[k] = r
        if ranks != expected:
            i = next(k for k, (r, e) in enumerate(zip(ranks, expected)) if r != e)
            si, j, g = where[i]
            how = ("in stage order (stage 0's GPUs first, a permutation of the world)" if self.rank_order == "stage"
                   else "node by node (rank_order 'node': in the order of the GPUs' 'gpu' index in the cluster "
                        "file)")
            raise PlanFileError(
                f"plan: field stages[{si}].gpus[{j}].rank is {g.rank!r}, expected {expected[i]}: ranks must be "
                f"0..{len(ranks) - 1} {how}, got {short_repr(ranks)}; renumber them or re-export the plan with "
                f"`zorse plan`")

    def _check_stages(self) -> None:
        """Each stage's ``index`` is its position; the block ranges are
        ``[start, end)`` with start < end, contiguous from block 0; each
        stage's shares sum to ``microbatch_size``."""
        if not self.stages:
            raise PlanFileError("plan: field 'stages' is empty; a plan has at least one stage")
        end = 0
        for i, s in enumerate(self.stages):
            if s.index != i:
                raise PlanFileError(f"plan: field stages[{i}].index is {short_repr(s.index)}, expected {i}: stages "
                                    f"are listed in order, numbered from 0; re-export the plan with `zorse plan`")
            a, b = s.blocks
            if a != end or not b > a:
                need = (f"start at block {end} (where {'stages[%d] ends' % (i - 1) if i else 'the model starts'})"
                        if a != end else "end after it starts")
                raise PlanFileError(
                    f"plan: field stages[{i}].blocks is {short_repr(list(s.blocks))}: a stage's blocks are "
                    f"[start, end) with start < end and the stages' ranges contiguous, so it must {need}; "
                    f"re-export the plan with `zorse plan`")
            end = b
            if s.microbatch_size != self.microbatch_size:
                raise PlanFileError(
                    f"plan: field stages[{i}].gpus[*].samples_per_microbatch: stage {s.index} GPUs take "
                    f"{short_repr([g.samples_per_microbatch for g in s.gpus])} samples (sum {s.microbatch_size}) "
                    f"but microbatch_size is {self.microbatch_size}; the shares of a stage's GPUs must sum to it"
                )

    # -- queries -------------------------------------------------------------
    def precision_policy(self) -> PrecisionPolicy:
        """The precision policy the plan was priced under and trains with."""
        return precision_policy(self.precision, self.grad_reduce_dtype, tf32=self.tf32)

    @property
    def compute_dtype(self) -> str:
        """dtype name of the matmuls (the policy's autocast dtype): "float32",
        "bfloat16" or "float16"."""
        return self.precision_policy().compute_dtype_name

    @property
    def world_size(self) -> int:
        return sum(len(s.gpus) for s in self.stages[: self.num_groups])

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_groups(self) -> int:
        """GPU groups P = stages / interleave (= stages without interleaving)."""
        return len(self.stages) // self.interleave

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` runs, in order (one without interleaving)."""
        first = self.role(rank).stage
        return tuple(range(first, self.num_stages, self.num_groups))

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    def role(self, rank: int) -> RankRole:
        for s in self.stages[: self.num_groups]:
            for pos, (g, (a, b)) in enumerate(zip(s.gpus, s.sample_ranges())):
                if g.rank == rank:
                    return RankRole(rank=rank, stage=s.index, position=pos, row_start=a, row_end=b,
                                    stages=tuple(range(s.index, self.num_stages, self.num_groups)))
        raise ValueError(f"rank {rank} is not in this plan (world size {self.world_size})")

    def node_ranks(self) -> tuple[NodeRanks, ...]:
        """The plan's nodes with their ranks, in the order of each node's
        lowest rank: node k is torchrun's ``--node-rank k`` with
        ``len(ranks)`` local processes ([Note: ranks node by node]). Under
        ``rank_order`` "node" that is the cluster file's order of the nodes
        the plan uses (an idle node is not one of them) and every node's ranks
        are contiguous; a plan of format 14 or older may have a node whose
        ranks are not (``NodeRanks.contiguous``), which torchrun cannot start."""
        by_node: dict[str, list[GPUShare]] = {}
        for s in self.stages[: self.num_groups]:
            for g in s.gpus:
                by_node.setdefault(g.node, []).append(g)
        order = sorted(by_node, key=lambda n: min(g.rank for g in by_node[n]))
        out = []
        for k, n in enumerate(order):
            gs = sorted(by_node[n], key=lambda g: g.rank)
            out.append(NodeRanks(node_rank=k, node=n, ranks=tuple(g.rank for g in gs), gpus=tuple(g.gpu for g in gs)))
        return tuple(out)

    def shared_params(self) -> dict[str, tuple[int, ...]]:
        """Canonical parameter name -> stages holding it, for params held by >1 stage (tied)."""
        holders: dict[str, list[int]] = {}
        for s in self.stages:
            for canon in s.params.values():
                holders.setdefault(canon, []).append(s.index)
        return {k: tuple(v) for k, v in holders.items() if len(v) > 1}

    # -- serialisation -------------------------------------------------------
    def source_hashes(self) -> tuple[str | None, ...]:
        """sha256 (hex) of each stage's source as plan.json records it: of
        ``sources`` where the plan holds them, else the hashes it was loaded
        with, else None."""
        if len(self.sources) == self.num_stages:
            return tuple(source_sha256(src) for src in self.sources)
        if len(self.recorded_sha256) == self.num_stages:
            return self.recorded_sha256
        return (None,) * self.num_stages

    # plan.json is written and read by ``_plan_io`` (imported when used: its
    # schema, ``plan_schema``, is built from the classes of this module).
    def to_dict(self) -> dict:
        """plan.json's content as a JSON-ready dict (``_plan_io.plan_dict``)."""
        from ._plan_io import plan_dict

        return plan_dict(self)

    @classmethod
    def from_dict(cls, d: dict, *, source: str = "<dict>", sources: tuple[str, ...] = ()) -> "Plan":
        """The plan a parsed plan.json ``d`` (format version 1-6) holds.

        ``d`` is checked against the schema (``plan_schema.decode``: every
        field's type, range and allowed values), then the stage sources
        against the recorded sha256 (version >= 5), then the rules tying the
        fields together (``__post_init__``). Raises PlanFileError naming
        ``source``, the field path, the value and what would fix it.
        """
        from ._plan_io import plan_from_dict

        return plan_from_dict(d, source=source, sources=sources)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def export(self, directory: str | Path) -> Path:
        """Write ``plan.json`` and ``stage_<i>.py`` into ``directory`` (made
        if missing); returns plan.json's path. Over an older plan, its
        ``stage_<i>.py`` that this plan does not have are removed and the rest
        (``weights.pt``, ``plan_request.json``) kept: re-exporting a loaded
        plan in place keeps its weights ([Note: writing a plan directory]).

        Raises:
            PlanDirectoryError: ``directory`` holds files a plan does not
                write (``check_plan_dir``).
            PlanFileError: the plan was loaded without its stage sources.
        """
        directory = Path(directory)
        check_plan_dir(directory)
        if len(self.sources) != self.num_stages:
            raise PlanFileError("this plan has no stage sources to export (it was loaded without them)")
        directory.mkdir(parents=True, exist_ok=True)
        files = {s.source_file: src for s, src in zip(self.stages, self.sources)}
        files["plan.json"] = self.to_json() + "\n"  # last: a reader finds the old plan.json or the new one whole
        stale = [p for p in directory.iterdir() if _EXPORTED.fullmatch(p.name) and p.name not in files]
        for name, text in files.items():
            tmp = directory / f".{name}.{_unique()}"
            tmp.write_text(text)
            os.replace(tmp, directory / name)
        for p in stale:
            p.unlink()
        return directory / "plan.json"

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """Load ``plan.json`` (or a directory holding it) and the stage sources beside it
        (``_plan_io.load_plan``: their sha256 checked against plan.json's)."""
        from ._plan_io import load_plan

        return load_plan(path)

    def decision(self, costs: BlockCosts | None = None) -> Decision:
        """The planner's ``Decision`` this plan records (what ``solve.evaluate`` and
        ``sim.simulate`` take): the one conversion from a plan to a decision
        (``plan_build.build_plan`` the other way).

        Each stage's memory policy is ``stage_memory`` of its fields, each GPU's
        shard in MiB ``GPUShare.state_shard_bytes // 2**20``. A sharded stage
        whose shards are all 0 (the runtime then splits its state equally)
        gets equal whole-MiB shards covering its shardable state as the
        planner counts it (KiB per block rounded up, ZeRO-2 adding the float32
        gradients, ZeRO-3 the working weights at 4 B, an upper bound),
        computed from ``costs`` (ValueError without them). ``interleave`` and
        ``precision`` are the plan's. Works on any object with the fields a
        ``Plan`` has (``Plan.decision(obj)``), absent ones read as in plan files
        from before them: no memory policy, not interleaved, no precision."""
        memory = tuple(stage_memory(st) for st in self.stages)
        shards = []
        for st, mem in zip(self.stages, memory):
            row = tuple(int(getattr(g, "state_shard_bytes", 0)) // MIB for g in st.gpus) if mem.zero else ()
            if mem.zero and not any(row):
                if costs is None:
                    raise ValueError(f"plan stage {st.index} is sharded without state_shard_bytes: pass the "
                                     f"BlockCosts to split its optimizer state equally")
                i, j = st.blocks
                kib = shardable_kib(costs, i, j, KIB)
                if mem.zero >= 2:  # ZeRO-2: the shards hold the float32 gradients too
                    kib += -(-4 * unique_params(costs, i, j) // KIB)
                if mem.zero == 3:  # ZeRO-3: and the working weights (4 B, an upper bound)
                    kib += -(-4 * unique_params(costs, i, j) // KIB)
                need = -(-kib // (MIB // KIB))
                row = (-(-need // len(st.gpus)),) * len(st.gpus)
            shards.append(row)
        return Decision(stage_blocks=tuple(tuple(st.blocks) for st in self.stages),
                        stage_gpus=tuple(tuple(g.gpu for g in st.gpus) for st in self.stages),
                        samples_per_microbatch=tuple(tuple(g.samples_per_microbatch for g in st.gpus)
                                                     for st in self.stages),
                        num_microbatches=self.num_microbatches, memory=memory, shard_mib=tuple(shards),
                        interleave=int(getattr(self, "interleave", 1)),  # plans before format v3: not interleaved
                        precision=str(getattr(self, "precision", "") or ""))

    # -- readable form -------------------------------------------------------
    def table(self) -> str:
        """The plan as a text table (one row per GPU), at most 150 columns
        (``plan_table.plan_table``)."""
        return plan_table(self)

    def __str__(self) -> str:
        return self.table()


# [Note: writing a plan directory]
# A plan directory holds one plan: plan.json, its stage_<i>.py (which plan.json
# hashes), weights.pt and plan_request.json from `zorse plan` (and an `--elastic`
# re-plan's cluster.yaml), and `zorse simulate`'s output. A plan written over another must leave none of the old
# one's files: a stage_3.py of a 4-stage plan beside a 3-stage plan.json, or
# the old plan's weights, would be read by the next command as if they were the
# new plan's. So `zorse plan -o` writes the whole new directory beside the old
# one (``new_plan_dir``) and swaps it in when complete: the old plan goes as a
# whole, and a failed or interrupted `zorse plan` leaves the old one intact.
# ``Plan.export`` alone (an API user, a re-export in place) replaces plan.json
# and the stage files and removes the old stage files only, keeping the
# weights. Either refuses a directory holding anything else (``check_plan_dir``):
# an `-o` given by mistake (the project root, a run directory) must not be
# emptied.

#: The entries of a plan directory (``Plan.export``'s, ``zorse plan``'s, an
#: ``--elastic`` re-plan's cluster file and ``zorse simulate``'s output);
#: ``__pycache__``: a stage file imported by hand.
PLAN_DIR_ENTRIES = re.compile(
    r"plan\.json|stage_\d+\.py|weights\.pt|hf_config\.json|plan_request\.json|cluster\.yaml|simulate|__pycache__")
_EXPORTED = re.compile(r"stage_\d+\.py")  # the old plan's files Plan.export replaces (and plan.json)


def check_plan_dir(directory: str | Path, *, flag: str = "") -> None:
    """Refuse to write a plan into ``directory`` unless it is missing, empty
    or a plan directory (every entry matches ``PLAN_DIR_ENTRIES``);
    ``flag`` (``"-o"``) prefixes the message.

    Raises:
        PlanDirectoryError: one line naming the directory, what else it
            holds (up to 5 names) and the fix."""
    directory = Path(directory)
    where = f"{flag} {directory}" if flag else str(directory)
    if directory.exists() and not directory.is_dir():
        raise PlanDirectoryError(f"{where} is a file, not a plan directory; give a new directory for the plan")
    if not directory.is_dir():
        return
    others = sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir()
                    if not PLAN_DIR_ENTRIES.fullmatch(p.name))
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise PlanDirectoryError(
            f"{where} is not a plan directory: it holds {shown} (a plan directory holds only plan.json, "
            f"stage_<i>.py, weights.pt, hf_config.json, plan_request.json, cluster.yaml and simulate/), which "
            f"writing a plan there "
            f"would replace; give a new or empty directory for the plan")


def _unique() -> str:
    """A name part no other writer picks (the process and a random suffix)."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def new_plan_dir(directory: str | Path, *, flag: str = "") -> Iterator[Path]:
    """A new, empty directory beside ``directory`` to write a whole plan
    into; once the block ends without an error it replaces ``directory``
    (the old plan, if any, removed as a whole), else it is removed and
    ``directory`` is untouched ([Note: writing a plan directory]).

    Raises:
        PlanDirectoryError: ``directory`` is not a plan directory
            (``check_plan_dir``), checked before and again at the swap."""
    directory = Path(directory)
    check_plan_dir(directory, flag=flag)
    directory.parent.mkdir(parents=True, exist_ok=True)
    unique = _unique()
    tmp = directory.parent / f".{directory.name}.new-{unique}"
    tmp.mkdir()
    try:
        yield tmp
        check_plan_dir(directory, flag=flag)  # (nothing was added meanwhile)
        old = None
        if directory.exists():
            old = directory.parent / f".{directory.name}.old-{unique}"
            os.rename(directory, old)
        os.rename(tmp, directory)
        if old is not None:
            shutil.rmtree(old)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
