"""The training loop's options: one frozen tree, parsed from flags or read from a file.

``TrainingOptions`` is what every rank of ``python -m zorse_fx.train`` runs
with. Its records, each a frozen dataclass checked in ``__post_init__``:

- ``data`` (``DataOptions``): the plan, its weights, the token file and the held-out split;
- ``optimizer`` (``OptimizerOptions``): AdamW, the learning-rate schedule, clipping, the seed;
- ``loop`` (``LoopOptions``): the steps, validation and TensorBoard;
- ``checkpoint`` (``CheckpointOptions``): checkpoint interval, how many to keep, ``--resume``, ``--overwrite``;
- ``job`` (``JobOptions``): run directory, backend, precision, timeouts;
- ``testing`` (``TestingOptions``): the fault injection and dumps the tests use.

Every default is written once, here: ``runtime/optimizer.py`` (``OptimizerConfig``)
and ``runtime/lr_schedule.py`` (``LRSchedule``) take theirs from
``OptimizerOptions``. A value the loop cannot use raises ``OptionValueError``
(a ``ValueError``) whose message names the command-line flag, e.g.
``--steps must be >= 1, got 0``; so does an option the others make void
(``--warmup-steps 100 --steps 4``: [Note: options that cannot take effect]).

Command line (``parse_flags``): tyro builds the flags from the records, as
torchtitan parses its job config. Flag names are flat, the field names with
dashes (``tyro.conf.OmitArgPrefixes``: ``--lr``, not ``--optimizer.lr``);
booleans are plain flags (``tyro.conf.FlagCreatePairsOff``: ``--resume``); a
``None`` default is not a value one can type (``tyro.conf.DisallowNone``);
``--help`` shows each field's docstring. A rejected command line is printed
the way argparse prints one (``<prog>: error: <message>``, the flag named) and
exits with status 2.

Options file: ``zorse train`` writes the checked tree to
``<out>/train_options.json`` (``write_options_file``; ``"format":
"zorse_fx.train_options"``, ``"version": 1``, then one object per record) and
starts every rank as ``python -m zorse_fx.train --options-file <file>``;
``read_options_file`` reads it through ``file_schema`` (the loader of every
JSON file zorse_fx reads: its struct is built from these records, unknown
fields refused, and so is a record or field left out: the file is written
whole, and one that lost a part would otherwise train with defaults nobody
chose) and builds the records, whose checks run as on the command line. Its errors (``TrainOptionsFileError``,
a ``FileFormatError``) name the file, the field, the value and the fix.

The ``zorse train`` command line is these records plus the launcher's own
(``cli.TrainCommand``): both derive from ``TrainingRecords``, so no flag is
defined twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import tyro

from .errors import TrainOptionsFileError
from .file_schema import FileFormat, from_doc, struct_of
from .precision import GRAD_REDUCE_DTYPES, PRECISIONS, precision_policy

__all__ = ["TrainingOptions", "TrainingRecords", "DataOptions", "OptimizerOptions", "LoopOptions",
           "CheckpointOptions", "JobOptions", "TestingOptions", "LR_SCHEDULES", "BACKENDS", "OptionValueError",
           "TrainOptionsFileError", "UsageError", "check_lr_schedule", "RANK_STEP_HOOKS", "RANK_HOOKS",
           "parse_flags", "options_from_argv",
           "write_options_file", "read_options_file", "OPTIONS_FILE", "FORMAT", "VERSION", "TYRO_CONFIG"]

#: Learning-rate schedules (``runtime/lr_schedule.py`` computes them).
LR_SCHEDULES = ("constant", "cosine", "linear")
#: torch.distributed backends; auto: NCCL where CUDA is available, else Gloo.
BACKENDS = ("auto", "gloo", "nccl")
#: ``zorse train --node-lost-after``'s default (seconds): a node whose beat stood still this long (the
#: observer's clock) and that has not reported is lost (``elastic_nodes.LOST_AFTER_S``).
NODE_LOST_AFTER_S = 15.0
#: The options file ``zorse train`` writes into the run directory.
OPTIONS_FILE = "train_options.json"
#: The options file's ``format`` and ``version`` fields.
FORMAT, VERSION = "zorse_fx.train_options", 1


class OptionValueError(ValueError):
    """A training option the loop cannot use. The message names the flag
    (``--adam-beta1 must be in [0, 1), got 1.0``); ``field`` is the record's
    field it is about (``adam_beta1``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class UsageError(ValueError):
    """A command line ``parse_flags`` rejects; the message is argparse's kind
    (``argument --lr: could not convert string to float: 'x'``,
    ``--steps must be >= 1, got 0``)."""


def _rank_step(flag: str) -> tyro.constructors.PrimitiveConstructorSpec:
    """The command-line form ``RANK:STEP`` of a ``(rank, step)`` pair (``None``: off)."""

    def parse(args: list[str]) -> tuple[int, int]:
        (text,) = args
        try:
            pair = tuple(int(x) for x in text.split(":"))
        except ValueError:
            pair = ()
        if len(pair) != 2 or min(pair) < 0:
            raise OptionValueError(flag[2:].replace("-", "_"),
                                   f"{flag} expects RANK:STEP with two integers >= 0, got {text!r}")
        return pair  # type: ignore[return-value]

    return tyro.constructors.PrimitiveConstructorSpec(
        nargs=1, metavar="RANK:STEP", instance_from_str=parse, is_instance=lambda v: v is None or isinstance(v, tuple),
        str_from_instance=lambda v: ["None" if v is None else f"{v[0]}:{v[1]}"])


def _gpu_factor(flag: str) -> tyro.constructors.PrimitiveConstructorSpec:
    """The command-line form ``GPU:FACTOR`` of a ``(gpu, factor)`` pair (``None``: off)."""

    def parse(args: list[str]) -> tuple[int, float]:
        (text,) = args
        gpu, _, factor = text.partition(":")
        try:
            pair = (int(gpu), float(factor))
        except ValueError:
            pair = None
        if pair is None or pair[0] < 0 or not 1.0 <= pair[1] <= 1000.0:
            raise OptionValueError(flag[2:].replace("-", "_"),
                                   f"{flag} expects GPU:FACTOR, a GPU index of the cluster file (>= 0) and a "
                                   f"factor from 1 to 1000 (3: three times slower), got {text!r}")
        return pair

    return tyro.constructors.PrimitiveConstructorSpec(
        nargs=1, metavar="GPU:FACTOR", instance_from_str=parse,
        is_instance=lambda v: v is None or isinstance(v, tuple),
        str_from_instance=lambda v: ["None" if v is None else f"{v[0]}:{v[1]:g}"])


def _check_rank_step(field: str, value: tuple[int, int] | None) -> None:
    if value is not None and (len(value) != 2 or min(value) < 0):
        raise OptionValueError(field, f"--{field.replace('_', '-')} expects RANK:STEP with two integers >= 0, "
                                      f"got {value!r}")


def _at_least(record: object, minimum: int, *names: str, never: bool = False) -> None:
    for name in names:
        value = getattr(record, name)
        if value < minimum:
            raise OptionValueError(name, f"--{name.replace('_', '-')} must be >= {minimum}"
                                         f"{' (0: never)' if never else ''}, got {value}")


def _default(record: object, name: str) -> Any:
    return type(record).__dataclass_fields__[name].default


def _applies_with(record: object, name: str, needed: str, what: str) -> None:
    """Refuse ``name`` set away from its default while ``needed`` is 0: it
    would not take effect ([Note: options that cannot take effect]).
    ``what``: what ``name`` sets, for the message."""
    value = getattr(record, name)
    if value != _default(record, name) and not getattr(record, needed):
        flag, on = name.replace("_", "-"), needed.replace("_", "-")
        raise OptionValueError(name, f"--{flag} {value} ({what}) acts only with --{on}, which is off, so it would not "
                                     f"take effect: add --{on} N, or drop --{flag}")


def check_lr_schedule(name: str, lr: float, min_lr: float, warmup_steps: int) -> None:
    """Raise ``OptionValueError`` (the flag named) for a schedule the loop cannot
    follow: an unknown name, a rate that is negative or not finite, ``min_lr``
    outside ``[0, lr]``, a negative warm-up. Shared by ``OptimizerOptions`` and
    ``runtime/lr_schedule.py``'s ``LRSchedule``."""
    if name not in LR_SCHEDULES:
        raise OptionValueError("lr_schedule", f"--lr-schedule {name!r}: choose one of {', '.join(LR_SCHEDULES)}")
    if not (lr >= 0 and math.isfinite(lr)):
        raise OptionValueError("lr", f"--lr {lr}: the learning rate must be a finite number >= 0")
    if not (0 <= min_lr <= lr):
        raise OptionValueError("min_lr", f"--min-lr {min_lr}: must be between 0 and --lr {lr}")
    if warmup_steps < 0:
        raise OptionValueError("warmup_steps", f"--warmup-steps {warmup_steps}: must be >= 0")


def _arg(help: str | None = None, *, metavar: str | None = None, default: str | None = None) -> Any:
    """tyro's ``conf.arg`` for a field: ``help`` where the field's docstring would
    not fit one line (tyro keeps a docstring's line breaks), ``default``: what
    ``--help`` says instead of ``(default: None)``."""
    return tyro.conf.arg(help=help, metavar=metavar, help_behavior_hint=default and f"(default: {default})")


@dataclass(frozen=True, kw_only=True)
class DataOptions:
    """What the ranks train on."""

    plan: Annotated[str, tyro.conf.Positional, _arg(metavar="PLAN")]
    """plan directory (plan.json + stage_<i>.py) or plan.json"""
    weights: Annotated[str | None, _arg(default="<plan>/weights.pt")] = None
    """weights file (torch.save of {name: tensor})"""
    data: Annotated[str | None, _arg(
        "token file written by `zorse prepare-data` (<name>.bin or its <name>.json header); each rank reads only "
        "its samples", default="`zorse train`: --corpus tokenized into <out>/data/tokens.bin")] = None
    tokens: Annotated[str | None, _arg(default="none")] = None
    """legacy, instead of --data: torch.save file of a 1-D integer token tensor"""
    allow_repeat: bool = False
    """allow a corpus smaller than one global batch (samples repeat within a step)"""
    val_fraction: Annotated[float, _arg(
        "hold out this fraction (of 1) of the corpus's sequences (its last ones) for validation",
        default="0: with --val-every, the last --val-batches global batches")] = 0.0

    def __post_init__(self) -> None:
        if self.data is not None and self.tokens is not None:
            raise OptionValueError("tokens", "argument --tokens: not allowed with argument --data")
        if not 0.0 <= self.val_fraction < 1.0:
            raise OptionValueError("val_fraction", f"--val-fraction must be in [0, 1), got {self.val_fraction}")


@dataclass(frozen=True, kw_only=True)
class OptimizerOptions:
    """AdamW and its learning-rate schedule (the defaults are nanoGPT's where it has one)."""

    lr: float = 1e-4
    """peak learning rate (AdamW), per step"""
    lr_schedule: Literal[LR_SCHEDULES] = "constant"  # type: ignore[valid-type]
    """learning-rate schedule after the warm-up (runtime/lr_schedule.py)"""
    warmup_steps: int = 0
    """linear warm-up, in steps"""
    min_lr: float = 0.0
    """the rate cosine/linear decay ends at"""
    weight_decay: float = 0.0
    """AdamW weight decay, on matrices only (no decay on norms, biases, 1-D parameters)"""
    adam_beta1: float = 0.9
    """AdamW's first-moment decay rate, in [0, 1)"""
    adam_beta2: float = 0.95
    """AdamW's second-moment decay rate, in [0, 1)"""
    adam_eps: float = 1e-8
    """AdamW's epsilon, added to the root of the second moment"""
    clip_grad_norm: Annotated[float | None, _arg(metavar="MAX", default="no clipping")] = None
    """clip the global gradient norm (all stages and data-parallel groups) to MAX"""
    seed: int = 0
    """torch RNG seed of every rank (dropout)"""

    def __post_init__(self) -> None:
        check_lr_schedule(self.lr_schedule, self.lr, self.min_lr, self.warmup_steps)
        if self.lr_schedule == "constant" and self.min_lr != _default(self, "min_lr"):
            raise OptionValueError("min_lr", f"--min-lr {self.min_lr:g} is the rate --lr-schedule cosine or linear "
                                             f"decays to; the constant schedule never uses it: pass --lr-schedule "
                                             f"cosine (or linear), or drop --min-lr")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise OptionValueError("clip_grad_norm", f"--clip-grad-norm must be > 0, got {self.clip_grad_norm}")
        if self.weight_decay < 0:
            raise OptionValueError("weight_decay", f"--weight-decay must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise OptionValueError(name, f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")
        if not self.adam_eps > 0:
            raise OptionValueError("adam_eps", f"--adam-eps must be > 0, got {self.adam_eps}")


@dataclass(frozen=True, kw_only=True)
class LoopOptions:
    """How long to train, when to validate, what to log."""

    steps: int = 10
    """total training steps (a resumed run counts from step 1)"""
    val_every: Annotated[int, _arg(metavar="N")] = 0
    """validation loss on the held-out split every N steps and after the last (0: never)"""
    val_batches: int = 1
    """global batches per validation"""
    tensorboard: bool = False
    """also write TensorBoard scalars to <out>/tensorboard"""
    no_timings: bool = False
    """do not record each rank's phase timings per step in <out>/timings.jsonl (their cost: bench/README.md)"""

    def __post_init__(self) -> None:
        _at_least(self, 1, "steps", "val_batches")
        _at_least(self, 0, "val_every", never=True)
        _applies_with(self, "val_batches", "val_every", "global batches per validation")


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """Checkpoints (``runtime/checkpoint.py``)."""

    checkpoint_every: Annotated[int, _arg(
        "save a checkpoint to <out>/checkpoints/step_<k> every N steps (0: only the last step's, which every run "
        "writes, as does a SIGTERM or SIGINT before the ranks exit)", metavar="N")] = 0
    keep_checkpoints: Annotated[int, _arg(metavar="K")] = 3
    """keep the newest K checkpoints"""
    final_checkpoint: Literal["full", "model-only"] = "full"
    """what the last step's checkpoint holds: the whole training state (full: --resume with a larger --steps
    continues it) or the parameters alone (model-only: a third of the bytes under fp32 AdamW, for export and
    evaluation; a later --resume continues from the newest full checkpoint)"""
    resume: Annotated[bool, _arg(
        "continue from the newest complete checkpoint in <out>/checkpoints (any plan of the same model, global "
        "batch and sequence length) that its manifest's checksums pass (a damaged one is named and the one "
        "before it is used); metrics.jsonl is continued")] = False
    overwrite: Annotated[bool, _arg(
        "a fresh run into an --out holding another run's checkpoints or metrics.jsonl removes them first (without "
        "it such a run is refused)")] = False

    def __post_init__(self) -> None:
        _at_least(self, 1, "keep_checkpoints")
        _at_least(self, 0, "checkpoint_every", never=True)
        _applies_with(self, "keep_checkpoints", "checkpoint_every", "checkpoints kept")
        if self.resume and self.overwrite:
            raise OptionValueError("overwrite", "argument --overwrite: not allowed with argument --resume")


@dataclass(frozen=True, kw_only=True)
class JobOptions:
    """Where the run writes, how the ranks talk, in which precision."""

    out: str = "runs/train"
    """run directory (metrics.jsonl, checkpoints/, train_options.json)"""
    backend: Literal[BACKENDS] = "auto"  # type: ignore[valid-type]
    """torch.distributed backend (auto: nccl where CUDA is available, else gloo)"""
    precision: Annotated[Literal[PRECISIONS] | None,  # type: ignore[valid-type]
                         _arg(default="the plan's on GPUs, fp32 on a CPU")] = None
    """train with this precision instead of the plan's"""
    grad_reduce_dtype: Annotated[Literal[GRAD_REDUCE_DTYPES] | None,  # type: ignore[valid-type]
                                 _arg(default="the precision's, float32")] = None
    """with --precision: the gradient all-reduce dtype"""
    pg_timeout_min: Annotated[float, _arg(metavar="MIN")] = 10.0
    """minutes a collective may wait for a peer before the process group fails"""
    heartbeat_s: float = 1.0
    """seconds between the rank's heartbeats in <out>/.heartbeat (runtime/watchdog.py; 0: off)"""
    skip_device_check: Annotated[bool, _arg(
        "run even where a rank's GPU (type, memory) or node is not the one the plan assigned to its rank "
        "(runtime/device_check.py); the plan's timings and memory then do not hold")] = False

    def __post_init__(self) -> None:
        if self.grad_reduce_dtype and not self.precision:
            raise OptionValueError("grad_reduce_dtype", "--grad-reduce-dtype needs --precision (without it the "
                                                        "plan's own reduction dtype is used)")
        if self.precision:
            try:
                precision_policy(self.precision, self.grad_reduce_dtype)
            except ValueError as exc:
                raise OptionValueError("grad_reduce_dtype", str(exc)) from exc
        if not self.pg_timeout_min > 0 or not self.heartbeat_s >= 0:
            raise OptionValueError("pg_timeout_min" if not self.pg_timeout_min > 0 else "heartbeat_s",
                                   f"--pg-timeout-min must be > 0 and --heartbeat-s >= 0, got {self.pg_timeout_min}, "
                                   f"{self.heartbeat_s}")


@dataclass(frozen=True, kw_only=True)
class TestingOptions:
    """Fault injection and dumps, for the tests."""

    __test__ = False  # not a pytest test class

    kill_at_step: Annotated[tuple[int, int] | None, _rank_step("--kill-at-step"), _arg(
        "testing: in the first attempt (not after a torchrun restart), rank RANK sends itself SIGKILL after STEP",
        default="off")] = None
    fail_rank: Annotated[tuple[int, int] | None, _rank_step("--fail-rank"), _arg(
        "testing: a GPU lost for good: in every attempt (torchrun restarts too), rank RANK sends itself SIGKILL "
        "after each step from STEP on (before that step's checkpoint); zorse train --elastic re-plans without it",
        default="off")] = None
    raise_at_step: Annotated[tuple[int, int] | None, _rank_step("--raise-at-step"), _arg(
        "testing: rank RANK raises an error in STEP (before its optimizer step): what a rank alone finds, as one "
        "line", default="off")] = None
    inject_inf: Annotated[tuple[int, int] | None, _rank_step("--inject-inf"), _arg(default="off")] = None
    """testing: after STEP's gradient reduction, rank RANK writes an inf into a gradient"""
    slow_gpu: Annotated[tuple[int, float] | None, _gpu_factor("--slow-gpu"), _arg(
        "testing: a straggler: the rank the plan puts on GPU GPU (its index in the cluster file) takes FACTOR times "
        "as long for every forward and backward (it sleeps FACTOR - 1 times the compute's own time after it: "
        "runtime/worker.py); the GPU stays slow under a re-plan, as a throttled card would", default="off")] = None
    dump_grads: Annotated[int, _arg(
        "testing: after this step, each rank saves its reduced gradients (all its stages, by canonical name) to "
        "<out>/grads/rank<r>.pt (0: never)", metavar="STEP")] = 0
    dump_params: Annotated[bool, _arg(
        "testing: save each rank's parameters (all its stages) at the end to <out>/params/rank<r>.pt, and the "
        "elements and bytes of its optimizer state (per stage: key 'stages') to <out>/params/rank<r>.json")] = False

    def __post_init__(self) -> None:
        _check_rank_step("kill_at_step", self.kill_at_step)
        _check_rank_step("fail_rank", self.fail_rank)
        _check_rank_step("inject_inf", self.inject_inf)
        _check_rank_step("raise_at_step", self.raise_at_step)
        if self.slow_gpu is not None and (len(self.slow_gpu) != 2 or self.slow_gpu[0] < 0
                                          or not 1.0 <= self.slow_gpu[1] <= 1000.0):
            raise OptionValueError("slow_gpu", f"--slow-gpu expects GPU:FACTOR, a GPU index >= 0 and a factor from 1 "
                                               f"to 1000, got {self.slow_gpu!r}")
        _at_least(self, 0, "dump_grads", never=True)


#: The testing hooks that act at ``RANK:STEP`` (``TestingOptions``).
RANK_STEP_HOOKS = ("kill_at_step", "fail_rank", "raise_at_step", "inject_inf")
#: The testing hooks that name a rank (``--slow-gpu`` names a GPU of the cluster: any index may be idle).
RANK_HOOKS = RANK_STEP_HOOKS


# [Note: options that cannot take effect]
# An option that the other options make void is refused in one line naming
# both flags, rather than accepted and ignored: a user who passes it expects
# it to do something. The rule, the same everywhere:
# - a value that never acts within the run is an error: a warm-up longer than
#   --steps (the rate would never reach --lr), a testing hook at a step
#   outside 1..--steps or at a rank outside the job (the world size is
#   known only to `zorse train` and to the ranks, which both check:
#   ``runtime/preflight.check_hook_ranks``), --dump-grads past the last step;
# - a flag set away from its default while the flag it qualifies is off is an
#   error (``_applies_with``): --min-lr with the constant schedule,
#   --val-batches without --val-every, --keep-checkpoints without
#   --checkpoint-every (and --grad-reduce-dtype without --precision);
# - an interval longer than the run is fine: --checkpoint-every and
#   --val-every act at the last step too, so they do take effect once; so is
#   --val-fraction without --val-every (its chunks are still held out of
#   training), and a permission with nothing to permit (--overwrite into an
#   empty --out, --allow-repeat over a corpus that holds a global batch).
# Defaults cannot be told from values typed equal to them; those pass.


def _check_across(records: TrainingRecords) -> None:
    """The checks of [Note: options that cannot take effect] that tie two records together."""
    steps, opt, test = records.loop.steps, records.optimizer, records.testing
    if opt.warmup_steps > steps:
        decay = f" and the {opt.lr_schedule} decay never start" if opt.lr_schedule != "constant" else ""
        raise OptionValueError("optimizer.warmup_steps", f"--warmup-steps {opt.warmup_steps} is longer than the run "
                                                         f"(--steps {steps}): the rate would never reach --lr "
                                                         f"{opt.lr:g}{decay}; pass --warmup-steps {steps} or fewer, "
                                                         f"or --steps {opt.warmup_steps} or more")
    for name in RANK_STEP_HOOKS:
        hook = getattr(test, name)
        if hook is not None and not 1 <= hook[1] <= steps:
            flag = "--" + name.replace("_", "-")
            raise OptionValueError(f"testing.{name}", f"{flag} {hook[0]}:{hook[1]}: step {hook[1]} is not one of the "
                                                      f"run's steps 1..{steps} (--steps {steps}), so it would never "
                                                      f"act; pass a STEP from 1 to {steps}")
    if test.dump_grads > steps:
        raise OptionValueError("testing.dump_grads", f"--dump-grads {test.dump_grads}: the run ends at step {steps} "
                                                     f"(--steps {steps}), so no gradients would be saved; pass a step "
                                                     f"from 1 to {steps} (0: never)")


@dataclass(frozen=True, kw_only=True)
class TrainingRecords:
    """The records of the training options. ``TrainingOptions`` (what the
    ranks run) adds the check that there is a token file; ``zorse train``'s
    command line (``cli.TrainCommand``) adds the launcher's options.

    Raises:
        OptionValueError: two records' values that cannot act together
            ([Note: options that cannot take effect]), both flags named."""

    data: DataOptions
    """the plan and the tokens"""
    optimizer: OptimizerOptions = OptimizerOptions()
    """optimizer and schedule"""
    loop: LoopOptions = LoopOptions()
    """steps, evaluation and logging"""
    checkpoint: CheckpointOptions = CheckpointOptions()
    """checkpoints"""
    job: JobOptions = JobOptions()
    """run directory, process group, precision"""
    testing: TestingOptions = TestingOptions()
    """testing hooks"""

    def __post_init__(self) -> None:
        _check_across(self)


@dataclass(frozen=True, kw_only=True)
class TrainingOptions(TrainingRecords):
    """Every option of ``python -m zorse_fx.train``: the same on every rank.

    Raises:
        OptionValueError: a value the loop cannot use (the flag is named),
            or neither ``data.data`` nor ``data.tokens`` set."""

    def __post_init__(self) -> None:
        if self.data.data is None and self.data.tokens is None:
            raise OptionValueError("data.data", "one of the arguments --data --tokens is required")
        super().__post_init__()


# -- the command line ---------------------------------------------------------------------------

#: tyro's configuration of every training command line (see the module docstring).
TYRO_CONFIG = (tyro.conf.OmitArgPrefixes, tyro.conf.FlagCreatePairsOff, tyro.conf.DisallowNone)

T = TypeVar("T")

#: Former training flags that change what the planner priced: refused with what to do instead.
PLANNED_FLAGS = {
    "--bucket-mib": "--bucket-mib is not a training option: the gradient bucket size is priced by the planner and "
                    "recorded in the plan (grad_bucket_bytes), which the ranks train with; re-plan with `zorse plan "
                    "--bucket-mib MIB` (or PlanOptions(bucket_mib=...))",
}


class _Rejected(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _flag(arg: Any) -> str:
    """How a tyro argument is spelt on the command line (its metavar when positional)."""
    return str(arg.lowered.metavar) if arg.is_positional() else "/".join(arg.lowered.name_or_flags)


def _literal_values(tp: Any) -> list:
    """The values of the ``Literal`` types in ``tp`` (a Literal or a union of them), in order."""
    if typing.get_origin(tp) is Literal:
        return list(typing.get_args(tp))
    return [v for arg in typing.get_args(tp) for v in _literal_values(arg)]


def _argparse_message(event: Any) -> str | None:
    """The message argparse would print for a tyro parse-error event, or None
    (tyro prints its own) for an event this does not know."""
    from tyro import _errors as ev

    if isinstance(event, ev.InstantiationFailure):
        if event.argument is None:  # a record's check: its message names the flag
            return event.message
        flag = _flag(event.argument)
        return event.message if event.message.startswith(flag) else f"argument {flag}: {event.message}"
    if isinstance(event, ev.UnrecognizedArgs):
        return f"unrecognized arguments: {' '.join(event.tokens)}"
    if isinstance(event, ev.InvalidChoice):  # the choices in declaration order (tyro's may be a set's)
        declared = [str(v) for v in _literal_values(event.argument.field.type_stripped)]
        choices = [c for c in declared if c in event.choices] + [c for c in event.choices if c not in declared]
        return (f"argument {_flag(event.argument)}: invalid choice: {event.value!r} "
                f"(choose from {', '.join(repr(c) for c in choices if c != 'None')})")
    if isinstance(event, ev.MutexConflict):
        return f"argument {event.second_token}: not allowed with argument {event.first_token}"
    if isinstance(event, ev.MissingArgs):
        return f"the following arguments are required: {', '.join(_flag(a.arg) for a in event.missing_arguments)}"
    if isinstance(event, ev.BadValue):
        n = event.argument.lowered.nargs
        return f"argument {_flag(event.argument)}: expected {'one argument' if n == 1 else f'{n} arguments'}"
    return None


def _on_parse_error(event: Any) -> None:
    try:
        message = _argparse_message(event)
    except AttributeError:  # another tyro's event fields: let tyro print it
        return
    if message is not None:
        raise _Rejected(message)


def _argparse_errors():
    """tyro's parse errors as ``_Rejected`` with argparse's message. The hook
    (``tyro._errors.on_parse_error``) is private to tyro; without it tyro
    prints its own error box and exits with status 2 all the same."""
    try:
        from tyro import _errors
    except ImportError:
        return contextlib.nullcontext()
    hook = getattr(_errors, "on_parse_error", None)
    return hook(_on_parse_error) if hook is not None else contextlib.nullcontext()


def parse_flags(cls: type[T], argv: Sequence[str], *, prog: str, description: str | None = None) -> T:
    """``cls`` (a tree of frozen dataclasses: ``TrainingOptions``,
    ``cli.TrainCommand``, ``cli.PlanCommand``) from command-line flags, with tyro (``TYRO_CONFIG``).
    ``--help`` prints the flags and exits with status 0.

    Raises:
        UsageError: a flag or value tyro cannot parse, or one a record's check
            refuses; the message is argparse's kind, the flag named."""
    for flag in PLANNED_FLAGS if issubclass(cls, TrainingRecords) else ():  # (zorse plan's own flags there)
        if any(a == flag or a.startswith(flag + "=") for a in argv):
            raise UsageError(PLANNED_FLAGS[flag])
    try:
        with _argparse_errors():
            return tyro.cli(cls, args=list(argv), prog=prog, description=description, config=TYRO_CONFIG)
    except _Rejected as exc:
        raise UsageError(exc.message) from None


def options_from_argv(argv: Sequence[str], *, prog: str, description: str | None = None) -> TrainingOptions:
    """``python -m zorse_fx.train``'s options: from ``--options-file FILE``
    (which then is the whole command line) or from flags (``parse_flags``).

    Raises:
        UsageError: a command line that does not parse or a value refused.
        TrainOptionsFileError: an options file that does not read (see ``read_options_file``)."""
    argv = list(argv)
    files = [i for i, a in enumerate(argv) if a == "--options-file" or a.startswith("--options-file=")]
    if not files:
        return parse_flags(TrainingOptions, argv, prog=prog, description=description)
    i = files[0]
    path = argv[i].partition("=")[2] if "=" in argv[i] else (argv[i + 1] if i + 1 < len(argv) else "")
    rest = argv[:i] + argv[i + (1 if "=" in argv[i] else 2):]
    if not path:
        raise UsageError("argument --options-file: expected one argument")
    if rest:
        raise UsageError(f"--options-file holds every option; got other arguments too: {' '.join(rest)}")
    return read_options_file(path)


# -- the options file ---------------------------------------------------------------------------

def write_options_file(options: TrainingOptions, path: str | Path) -> Path:
    """Write ``options`` to ``path`` (JSON: ``format``, ``version``, then one
    object per record); returns the path. ``read_options_file`` reads it back
    equal."""
    path = Path(path)
    doc = {"format": FORMAT, "version": VERSION, **msgspec.to_builtins(options)}
    path.parent.mkdir(parents=True, exist_ok=True)
    # Whole or not at all: on a shared --out every node's zorse train writes it while the other nodes' ranks read it.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)
    return path


#: The options file as a ``file_schema.FileFormat`` (its struct built from the records, every field required:
#: ``write_options_file`` writes them all, and a record or field left out of a file is refused, naming it, rather
#: than read as its default). Built on first use.
_FILE: FileFormat | None = None


def _options_file() -> FileFormat:
    global _FILE
    if _FILE is None:
        docs: dict[type, type] = {}
        for record in (DataOptions, OptimizerOptions, LoopOptions, CheckpointOptions, JobOptions, TestingOptions):
            docs[record] = struct_of(record, record.__name__ + "Doc")
        doc = struct_of(TrainingOptions, "TrainingOptionsDoc", docs=docs,
                        extra={"": [("format", Literal[FORMAT], msgspec.NODEFAULT), ("version", int, msgspec.NODEFAULT)]})
        _FILE = FileFormat(name=FORMAT, what="training options", doc=doc, versions=(VERSION,),
                           remake="write it again with `zorse train` (or `write_options_file`)",
                           error=TrainOptionsFileError)
    return _FILE


def read_options_file(path: str | Path) -> TrainingOptions:
    """The ``TrainingOptions`` a ``write_options_file`` file holds, read by
    ``file_schema`` (the one loader of zorse_fx's JSON files).

    Raises:
        TrainOptionsFileError: the file is missing or not JSON, its ``format``
            or ``version`` is not this module's, a record or field is missing
            or unknown, a value has
            the wrong type, or a record's check refuses a value (the message
            names the file, the field, the value and the flag's rule)."""
    fmt = _options_file()
    d, doc = fmt.read(path, missing="`zorse train` writes <out>/train_options.json")
    source = str(path)
    records = {}
    for f in dataclasses.fields(TrainingOptions):
        kind = typing.get_type_hints(TrainingOptions)[f.name]
        try:
            records[f.name] = from_doc(getattr(doc, f.name), kind)
        except OptionValueError as exc:
            raise fmt.field_error(source, [f.name, exc.field], _lookup(d, f"{f.name}.{exc.field}"),
                                  reason=str(exc)) from None
    try:
        return TrainingOptions(**records)
    except OptionValueError as exc:
        raise fmt.field_error(source, exc.field.split("."), _lookup(d, exc.field), reason=str(exc)) from None


def _lookup(doc: object, dotted: str) -> object:
    for part in dotted.split("."):
        if not isinstance(doc, dict) or part not in doc:
            return None
        doc = doc[part]
    return doc
