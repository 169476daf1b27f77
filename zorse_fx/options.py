"""``PlanOptions``: what the user asks of the planner, and the one options
record every planner reads (the CP-SAT models, the stage DP, brute force,
the baselines, the interleave pass, the evaluator and the simulator).

Light on purpose (no torch, no OR-Tools): the runtime, the cluster files and
the command line can import it without loading the solvers.

[Note: memory flags]
Each memory technique has a flag ("never" / "auto" / "always") and one meaning,
which every planner (the CP-SAT models, the stage DP, brute force, the
baselines and their seeds, the interleave pass) and the evaluator
(``solve.objective.mode_violations``) read the same way: "never" -- no stage
uses it; "auto" -- the planner decides per stage; "always" -- every stage uses
it, where the state layouts below allow it at all. The layouts are those the
runtime has: a stage's state is replicated, ZeRO-1 (``sharding``: optimizer
state sharded), ZeRO-2 (``grad_sharding``: a ZeRO-1 stage whose gradients are
reduce-scattered into the shards, ``runtime/grad_sync.py``) or ZeRO-3
(``param_sharding``: a ZeRO-2 stage whose working weights are sharded too,
gathered from the owners of the ZeRO-1 ranges, ``runtime/param_shard.py``),
each level built on the one before; a shard needs two GPUs, so the ZeRO flags'
"always" means every stage of two or more GPUs. So "always" on a level makes
the levels below it "always" (``param_sharding="always"`` is ZeRO-3 on every
such stage, hence ZeRO-2 and ZeRO-1 there), "never" on a level makes the levels
above it "never", and "never" below an "always" is refused. Optimizer offload
(``offload``) goes with every layout and every stage; "always" needs host
memory (the cluster file's ``host_memory_GiB``: ``planner.check_host_memory``).
Activation offload (``activation_offload``) goes without recomputation (a
recomputing stage keeps only its inputs) and, in the plans
(``StageMemory.activations``, [C-act-offload] in ``solve/objective.py``), without
ZeRO-2/3, so its "always" makes ``recompute``, ``grad_sharding`` and
``param_sharding`` "never", and is refused with an "always" of any of them.
Host-stashed recomputation (``stash``) is a way to recompute, without ZeRO-2/3
or activation offload: its "always" makes ``recompute`` "always" and those
"never" (refused with ``recompute`` "never" or an "always" of any of them), and
``recompute`` "never" makes it "never". The
CP-SAT models have ZeRO-1 and recomputation only ([Note: ZeRO-2 outside CP-SAT]
in ``portfolio.py``): an "always" outside them leaves the portfolio's answer to
the stage DP and the baselines (``solve._search.outside_model``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from .errors import PlanOptionsError
from .ir.schedule import SCHEDULES  # the values of PlanOptions.schedule
from .precision import GRAD_REDUCE_DTYPES, PRECISIONS, PrecisionPolicy, precision_policy

__all__ = ["PlanOptions", "MEMORY_MODES", "PLANNERS", "SCHEDULES", "MemoryMode", "PlannerName", "Schedule",
           "PrecisionChoice", "GradReduceDtype"]

# The fields' value sets as ``Literal`` types: what `zorse plan` (tyro) offers as choices; checked against the
# tuples the rest of zorse_fx reads (tests/test_cli_checks.py) and at run time by ``PlanOptions.__post_init__``.
#: Values of ``PlanOptions.sharding`` / ``PlanOptions.recompute`` and the other memory flags.
MemoryMode = Literal["never", "auto", "always"]
#: Values of ``PlanOptions.planner``.
PlannerName = Literal["auto", "cpsat", "grouped", "stage_dp", "brute_force"]
#: Values of ``PlanOptions.schedule`` (``ir.schedule.SCHEDULES``).
Schedule = Literal["1f1b", "gpipe"]
#: Values of ``PlanOptions.precision``: "auto" or one of ``precision.PRECISIONS``.
PrecisionChoice = Literal["auto", "fp32", "bf16-mixed", "fp16-mixed"]
#: Values of ``PlanOptions.grad_reduce_dtype`` (``precision.GRAD_REDUCE_DTYPES``).
GradReduceDtype = Literal["float32", "bfloat16"]
MEMORY_MODES: tuple[str, ...] = get_args(MemoryMode)
PLANNERS: tuple[str, ...] = get_args(PlannerName)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanOptions:
    """What the user asks of the planner; also the knobs of every solver.

    Raises ``PlanOptionsError`` (a ``ValueError``) naming the field, the value
    and the fix."""

    global_batch_size: int
    """samples per optimizer step, over all micro-batches and GPUs"""
    #: Largest number of pipeline stages considered (of GPU groups, when
    #: interleaving puts several stages on each; see ``max_interleave``).
    max_stages: int = 4
    """most pipeline stages the planner tries (GPU groups, when interleaving puts several stages on each)"""
    #: "1f1b" or "gpipe": decides activations in flight per stage.
    schedule: Schedule = "1f1b"
    """pipeline schedule: 1f1b (one forward, one backward: fewer activations in flight) or gpipe"""
    #: Micro-batch counts to consider; None = every divisor of the global
    #: batch size up to ``max_microbatches``.
    num_microbatches: tuple[int, ...] | None = None
    """micro-batch counts to try (default: every divisor of the global batch size up to --max-microbatches)"""
    max_microbatches: int = 16
    """most micro-batches per step the planner tries: divisors of the global batch size up to this"""
    #: Fraction of each GPU's memory a plan may fill (rest: allocator, CUDA
    #: context, fragmentation).
    memory_fraction: float = 0.9
    """share of each GPU's memory a plan may fill (the rest: allocator, CUDA context, fragmentation)"""
    #: CP-SAT's work budget for the whole (stages, micro-batches) search, in
    #: CP-SAT deterministic seconds (``max_deterministic_time``: work units
    #: counted by the solver, about a second of one worker on an idle machine
    #: but independent of the machine's load), so the same inputs give the same
    #: plan ([Note: reproducible plans], [Note: search budget] in
    #: ``solve/_search.py``). More buys a better plan or a proof, never
    #: feasibility: the heuristics' plan is kept when CP-SAT finds nothing better.
    solver_budget: float = 5.0
    """CP-SAT work for the whole search, in CP-SAT deterministic seconds (work units, about a second of one
    worker on an idle machine; the same plan on any machine load); more buys a better plan or a proof, the
    heuristics' plan is kept either way"""
    #: Wall-clock safety stop per CP-SAT solve, seconds. Only a safety stop:
    #: when it fires before ``solver_budget`` is spent, the answer depends on
    #: the machine's load, the status says "(wall-clock safety stop)", a
    #: warning says the plan may vary, and raising it (or lowering
    #: ``solver_budget``) fixes that.
    time_limit_s: float = 100.0
    """wall-clock safety stop per CP-SAT solve, seconds; if it fires first the status says '(wall-clock safety
    stop)' and the plan may vary"""
    #: CP-SAT worker threads. 1 (default): CP-SAT's sequential search,
    #: deterministic. More: the workers interleave (``interleave_search``, which
    #: keeps the search deterministic; "core" left out), which OR-Tools 9.15
    #: marks experimental and which did worse per deterministic second on the
    #: 64-GPU instance of tests/test_grouped.py (step 1.18 s vs 1.06 s at 3
    #: deterministic s per candidate; [Note: reproducible plans]).
    num_workers: int = 1
    """CP-SAT worker threads (1: its sequential search, deterministic; more: interleaved workers, experimental
    in OR-Tools)"""
    #: Forked processes side by side (None: the cores this process may use): CP-SAT
    #: candidates ([Note: candidate waves] in ``solve/_search.py``), the portfolio's
    #: heuristics, the stage DP's (M, unit order) DPs, the interleave search's tries
    #: and the simulator's finalists (``solve/isolated.map_isolated``). Buys
    #: wall-clock time only: the plan is the same for every value. None: CP-SAT
    #: on the cores; the Python parts in this process up to 64 GPUs, on the
    #: cores beyond (``solve/isolated.work_jobs``: [Note: small searches in process]).
    jobs: int | None = None
    """processes side by side: CP-SAT candidates, the heuristics, the stage DP's and the interleave search's
    independent parts, the simulator's finalists (default: the cores this process may use; the Python parts in
    one process up to 64 GPUs); wall-clock time only, the plan is the same for every value"""
    #: Random seed for CP-SAT (``random_seed``; reproducible plans).
    seed: int = 0
    """CP-SAT's random seed (the same seed and inputs give the same plan)"""
    #: "auto" (per-GPU CP-SAT up to 8 GPUs, class-level CP-SAT beyond:
    #: ``portfolio.auto_planner``),
    #: "cpsat", "grouped" (each checked against the heuristics, which also
    #: warm-start it), "stage_dp" (only the memory-first stage DP: seconds at
    #: 1024 GPUs, no CP-SAT, no optimality gap) or "brute_force" (tiny instances only).
    planner: PlannerName = "auto"
    """auto: CP-SAT (per GPU up to 8 GPUs, per GPU class beyond) checked against the stage DP and the
    baselines; cpsat or grouped: that CP-SAT model, checked likewise; stage_dp: the DP alone (seconds at 1,024
    GPUs); brute_force: tiny clusters only"""
    #: Training precision ([Note: mixed precision] in ``zorse_fx/precision.py``):
    #: "auto" (bf16-mixed where every GPU of the cluster supports bfloat16,
    #: else fp16-mixed), "fp32", "bf16-mixed" or "fp16-mixed". It decides the
    #: bytes of training state per parameter, the activations (measured under
    #: its autocast), the dtype of tensors crossing a cut and the matmul peak.
    #: The solvers do not read it: they see its prices in ``BlockCosts``.
    precision: PrecisionChoice = "auto"
    """training precision; auto: bf16-mixed where every GPU supports bfloat16, else fp16-mixed"""
    #: dtype of the gradient all-reduce: None = the precision's default
    #: (float32), or "bfloat16" (bf16-mixed only; +2 B/param of buckets).
    grad_reduce_dtype: GradReduceDtype | None = None
    """dtype of the gradient all-reduce (default float32; bfloat16 needs bf16-mixed)"""
    #: float32 matmuls on TF32 tensor cores (Ampere and later): priced from the
    #: datasheet TF32 peak and set on every rank (``Plan.tf32``). Off by
    #: default, as in PyTorch. Only fp32 plans have float32 matmuls to speed up.
    tf32: bool = False
    """float32 matmuls on TF32 tensor cores (Ampere and later), priced and set on every rank (default off, as
    in PyTorch; only fp32 plans have float32 matmuls)"""
    #: Upper bound on blocks the graph is cut into.
    max_blocks: int = 32
    """most blocks the model's graph is cut into before stages are formed from them"""
    #: Allow GPUs to stay unused when that is faster.
    allow_idle_gpus: bool = True
    """a GPU may stay idle where that is faster; --no-allow-idle-gpus (or --use-all-gpus): only plans that
    give work to every GPU, refused with the reason when none exists"""
    #: Kernel profiles (files or directories) to price nodes with; None = the
    #: profiles shipped in ``zorse_fx/profiles``; () = roofline only.
    profiles: tuple[str, ...] | None = None
    """kernel profiles (files or directories, `zorse bench kernels`) to price the model with (default: those
    shipped in zorse_fx/profiles)"""
    #: Two micro-batch sizes the measured cost model is evaluated at (per-sample
    #: slope + fixed part); None = (1, max(2, global_batch_size // 4)).
    profile_batches: tuple[int, int] | None = None
    """the two micro-batch sizes the measured cost model is evaluated at (per-sample slope and fixed part;
    default: 1 and a quarter of the global batch size, at least 2)"""
    #: A calibration file (``zorse calibrate <run dir>``: a run's measured steps against its
    #: plan's prices, [Note: calibration] in ``cost/calibration.py``) applied to the prices;
    #: None = none.
    calibration: str | None = None
    """a calibration (`zorse calibrate RUN` of a run on this cluster): prices corrected by that run's measured
    steps"""
    #: ZeRO-1 sharding of each stage's optimizer state across its GPUs, in
    #: shares the planner picks per GPU: "auto" (per stage, where it pays: it
    #: costs an all-gather of the weights after the optimizer step and saves
    #: memory and optimizer time), "never" or "always" (every stage with >= 2
    #: GPUs; implied by ``grad_sharding`` / ``param_sharding`` "always":
    #: [Note: memory flags]).
    sharding: MemoryMode = "auto"
    """ZeRO-1: shard each stage's optimizer state over its GPUs (auto: per stage, where it pays)"""
    #: ZeRO-2 on a sharded stage: every micro-batch's gradients reduce-scattered
    #: into the shards, so no GPU holds the stage's float32 gradients
    #: ([Note: sharded gradients] in ``runtime/grad_sync.py``): "auto" (per
    #: sharded stage, where it pays: it moves the stage's gradients M times per
    #: step instead of once and frees 4 (k - 1)/k B per parameter), "never" or
    #: "always" (every stage with >= 2 GPUs, so ``sharding`` "always" too;
    #: implied by ``param_sharding`` "always", "never" under
    #: ``activation_offload`` "always": [Note: memory flags]).
    grad_sharding: MemoryMode = "auto"
    """ZeRO-2 on sharded stages: every micro-batch's gradients reduce-scattered into the shards"""
    #: ZeRO-3 on a ZeRO-2 stage: its working weights sharded too, each block's
    #: gathered before its forward and again for its backward ([Note: sharded
    #: parameters] in ``runtime/param_shard.py``): "auto" (per ZeRO-2 stage,
    #: where it pays: 2-3 all-gathers of the stage's weights per micro-batch,
    #: and the weights' 2-4 (k - 1)/k B per parameter freed), "never" or
    #: "always" (every stage with >= 2 GPUs, so ``grad_sharding`` and
    #: ``sharding`` "always" too: [Note: memory flags]).
    param_sharding: MemoryMode = "auto"
    """ZeRO-3 on ZeRO-2 stages: the weights sharded too, gathered block by block"""
    #: Optimizer offload (ZeRO-Offload): a stage's AdamW moments and float32
    #: master weights in host memory, the step on the CPU ([C-offload] in
    #: ``solve/objective.py``; only on nodes whose cluster file gives
    #: ``host_memory_GiB``): "auto" (where nothing fits without it: it costs
    #: the gradients' and weights' trip over the host link and a CPU step every
    #: step), "never" or "always" (every stage, so only GPUs whose node has
    #: host memory take work; ``zorse plan`` refuses it for a cluster file
    #: without ``host_memory_GiB``).
    offload: MemoryMode = "auto"
    """optimizer offload: AdamW state in host memory, stepped on the CPU (auto: where nothing fits without it;
    needs host_memory_GiB on the cluster file's nodes)"""
    #: Activation offload: what autograd saves during a micro-batch's forward
    #: goes to host memory and comes back for its backward ([C-act-offload];
    #: not with recomputation or ZeRO-2/3; host memory as for ``offload``):
    #: "auto" (where nothing fits without it), "never" or "always" (every
    #: stage, so ``recompute`` and ``grad_sharding`` "never": [Note: memory flags]).
    activation_offload: MemoryMode = "auto"
    """keep what autograd saves in host memory between a micro-batch's forward and backward (auto: where
    nothing fits without it; needs host_memory_GiB)"""
    #: Stage-level activation recomputation: "auto" (per stage, where memory
    #: needs it), "never" or "always" (every stage).
    recompute: MemoryMode = "auto"
    """stage recomputation: re-run each stage's forward before its backward"""
    #: Host-stashed recomputation (Zorse's; [C-stash] in ``solve/objective.py``): a
    #: recomputing stage keeps each block's inputs in host memory between a
    #: micro-batch's forward and backward and re-runs its blocks one at a time, so
    #: the GPU holds one block's activations instead of the stage's (not with
    #: ZeRO-2/3 or activation offload; host memory as for ``offload``): "auto" (per
    #: recomputing stage, where it pays), "never" or "always" (every stage, so
    #: ``recompute`` "always", ``activation_offload``, ``grad_sharding`` and
    #: ``param_sharding`` "never": [Note: memory flags]).
    stash: MemoryMode = "auto"
    """recomputation with each block's inputs kept in host memory, the blocks re-run one at a time (auto: per
    recomputing stage, where it pays; needs host_memory_GiB)"""
    #: Largest interleave degree (stages per GPU group, interleaved 1F1B) the
    #: planner tries on its answer (``solve.interleave``); 1 = one stage per
    #: group. Needs "1f1b".
    max_interleave: int = 4
    """most stages per GPU group (interleaved 1F1B) the planner tries; 1 = none"""
    #: Gradient all-reduce bucket size, MiB (DDP's ``bucket_cap_mb``, 25 by
    #: default; the first bucket 1 MiB or this, the smaller). The planner prices
    #: the buckets' all-reduce latencies with it and the plan records it
    #: (``Plan.grad_bucket_bytes``), which the runtime trains with.
    bucket_mib: float = 25.0
    """gradient all-reduce bucket size in MiB (DDP's bucket_cap_mb): priced by the planner and recorded in the
    plan, which the runtime trains with"""

    def __post_init__(self) -> None:
        if self.planner not in PLANNERS:
            raise PlanOptionsError(f"PlanOptions.planner={self.planner!r}: use one of {', '.join(map(repr, PLANNERS))}")
        if self.schedule not in SCHEDULES:
            raise PlanOptionsError(f"PlanOptions.schedule={self.schedule!r}: use one of {', '.join(map(repr, SCHEDULES))}")
        if not self.solver_budget > 0:
            raise PlanOptionsError(f"PlanOptions.solver_budget={self.solver_budget!r}: use a number > 0 (CP-SAT "
                                   f"deterministic seconds per candidate, e.g. 5; zorse plan --solver-budget)")
        if not self.time_limit_s > 0:
            raise PlanOptionsError(f"PlanOptions.time_limit_s={self.time_limit_s!r}: use a number of seconds > 0 "
                                   f"(the wall-clock safety stop per CP-SAT solve, e.g. 100; zorse plan "
                                   f"--time-limit-s)")
        if self.jobs is not None and (isinstance(self.jobs, bool) or not isinstance(self.jobs, int) or self.jobs < 1):
            raise PlanOptionsError(f"PlanOptions.jobs={self.jobs!r}: use None (the cores this process may use) or an "
                                   f"int >= 1 (processes side by side; zorse plan --jobs)")
        if not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise PlanOptionsError(f"PlanOptions.num_workers={self.num_workers!r}: use an int >= 1 "
                                   f"(CP-SAT worker threads; 1 = deterministic sequential search)")
        if not isinstance(self.max_interleave, int) or self.max_interleave < 1:
            raise PlanOptionsError(f"PlanOptions.max_interleave={self.max_interleave!r}: use an int >= 1 "
                                   f"(1 = no interleaving)")
        for name in ("sharding", "recompute", "grad_sharding", "param_sharding", "offload", "activation_offload",
                     "stash"):
            v = getattr(self, name)
            if v not in MEMORY_MODES:
                raise PlanOptionsError(f"PlanOptions.{name}={v!r}: use one of {MEMORY_MODES}")
        self._imply_memory_modes()
        if self.precision not in ("auto", *PRECISIONS):
            raise PlanOptionsError(f"PlanOptions.precision={self.precision!r}: use 'auto' or one of "
                                   f"{', '.join(map(repr, PRECISIONS))}")
        if self.grad_reduce_dtype is not None and self.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
            raise PlanOptionsError(f"PlanOptions.grad_reduce_dtype={self.grad_reduce_dtype!r}: use None (the "
                                   f"precision's default) or one of {', '.join(map(repr, GRAD_REDUCE_DTYPES))}")
        if isinstance(self.bucket_mib, bool) or not isinstance(self.bucket_mib, (int, float)) \
                or not self.bucket_mib * 1024 >= 1 or self.bucket_mib > 2**20:
            raise PlanOptionsError(f"PlanOptions.bucket_mib={self.bucket_mib!r}: use a number of MiB from 1/1024 (1 "
                                   f"KiB) to 2**20 (the gradient bucket size, e.g. 25; zorse plan --bucket-mib)")
        if not isinstance(self.tf32, bool):
            raise PlanOptionsError(f"PlanOptions.tf32={self.tf32!r}: use True (float32 matmuls on TF32 tensor cores) "
                                   f"or False (PyTorch's default; zorse plan --tf32 / --no-tf32)")
        if self.precision != "auto":
            checked_policy(self.precision, self.grad_reduce_dtype, why="")

    def _imply_memory_modes(self) -> None:
        """[Note: memory flags]: refuse an "always" that another flag rules out, in one line
        naming both flags and why; then set in place what an "always" implies, so the record
        every planner reads has one meaning."""
        def flag(name: str) -> str:
            v = getattr(self, name)
            return f"{name}={v!r} (zorse plan --{name.replace('_', '-')} {v})"

        zero = {"grad_sharding": "ZeRO-2 reduce-scatters the gradients into a ZeRO-1 stage's optimizer shards "
                                 "(runtime/grad_sync.py)",
                "param_sharding": "ZeRO-3 shards the weights of a ZeRO-2 stage (runtime/param_shard.py)"}
        lower = {"grad_sharding": ("sharding",), "param_sharding": ("grad_sharding", "sharding")}
        for upper in ("param_sharding", "grad_sharding"):
            for name in lower[upper] if getattr(self, upper) == "always" else ():
                if getattr(self, name) == "never":
                    raise PlanOptionsError(f"PlanOptions.{flag(upper)} with {flag(name)}: {zero[upper]}, so every "
                                           f"such stage needs {name} too; set {name} to 'auto' or {upper} to "
                                           f"'auto'")
        if self.activation_offload == "always":
            zero23 = "a plan offloads no ZeRO-2/3 stage's activations ([C-act-offload] in solve/objective.py)"
            for name, why in (("recompute", "a recomputing stage keeps no activations between its forward and "
                                            "backward to offload"),
                              ("grad_sharding", zero23), ("param_sharding", zero23)):
                if getattr(self, name) == "always":
                    raise PlanOptionsError(f"PlanOptions.{flag('activation_offload')} with {flag(name)}: no stage "
                                           f"can do both, {why}; set one of them to 'auto'")
        if self.stash == "always":
            zero23 = "a plan stashes no ZeRO-2/3 stage's block inputs ([C-stash] in solve/objective.py)"
            for name, mode, why in (("recompute", "never", "host-stashed recomputation is recomputation"),
                                    ("activation_offload", "always", "a recomputing stage keeps no activations "
                                                                     "between its forward and backward to offload"),
                                    ("grad_sharding", "always", zero23), ("param_sharding", "always", zero23)):
                if getattr(self, name) == mode:
                    raise PlanOptionsError(f"PlanOptions.{flag('stash')} with {flag(name)}: no stage can do both, "
                                           f"{why}; set one of them to 'auto'")
        for upper in ("param_sharding", "grad_sharding"):
            for name in lower[upper] if getattr(self, upper) == "always" else ():
                object.__setattr__(self, name, "always")
        for name, uppers in (("sharding", ("grad_sharding", "param_sharding")), ("grad_sharding", ("param_sharding",))):
            for upper in uppers if getattr(self, name) == "never" else ():
                object.__setattr__(self, upper, "never")
        if self.activation_offload == "always":
            for name in ("recompute", "grad_sharding", "param_sharding"):
                object.__setattr__(self, name, "never")
        if self.stash == "always":
            object.__setattr__(self, "recompute", "always")
            for name in ("activation_offload", "grad_sharding", "param_sharding"):
                object.__setattr__(self, name, "never")
        if self.recompute == "never":
            object.__setattr__(self, "stash", "never")

    @property
    def bucket_bytes(self) -> int:
        """``bucket_mib`` in bytes, rounded to whole KiB (the CP-SAT model counts buckets in KiB)."""
        return round(self.bucket_mib * 1024) * 1024


def checked_policy(name: str, grad_reduce_dtype: str | None, *, why: str, tf32: bool = False) -> PrecisionPolicy:
    """``precision_policy(name, grad_reduce_dtype, tf32=tf32)``, its ValueError as a
    ``PlanOptionsError`` that names the option and the fix (``why``: a
    sentence on how the precision was chosen, or "")."""
    try:
        return precision_policy(name, grad_reduce_dtype, tf32=tf32)
    except ValueError as exc:
        raise PlanOptionsError(f"PlanOptions.grad_reduce_dtype={grad_reduce_dtype!r}: {exc}{why}; leave "
                               f"grad_reduce_dtype unset (float32) or ask for precision 'bf16-mixed'") from None
