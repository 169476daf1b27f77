"""What ``zorse train`` checks before it starts a rank.

[Note: pre-flight checks]
An error a rank finds costs a torchrun start, a process group and one
traceback per rank. Whatever can be checked from the files alone is
therefore checked by ``zorse train`` first, each failure one ``zorse:`` line
naming the file or flag, the value and the fix (``check_job`` before the
token file is prepared, ``check_data`` after):

- the plan: its stage sources hashed (a plan.json of format version < 5 is
  refused until re-exported), the process count (``--nproc``) its world size,
  every testing hook's rank within it (``check_hook_ranks``);
- the weights: every tensor each stage's module needs (built on the meta
  device from the plan's stage sources: no memory), in its shape and dtype
  (``runtime/stage.check_weights``, the ranks' own check);
- with ``--resume``: the checkpoint rank 0 will resume (the newest of
  ``<out>`` whose files are all there, of their recorded sizes, DCP's
  ``.metadata`` among them) is of this run ([Note: checkpoints bound to
  their run] in ``runtime/run_dir.py``), of this model (its parameters and
  shapes) and of the plan's global batch and sequence length
  (``runtime/checkpoint.check_resumable``); no intact one at all is refused;
- the tokens: the token file exists and reads, every id of it is within the
  model's vocabulary (``TokenData.check_vocab`` scans the whole file, not
  only its header's ``max_token_id``), and the training split (after
  ``--val-fraction``) and, with ``--val-every``, the validation split hold a
  global batch (``batch_source``, the function the ranks draw batches with).

The ranks check all of it again (a rank may be started by hand, under
torchrun on another node); what only a rank can find (its GPU and node,
``runtime/device_check.py``; an out-of-memory error) reaches the user as one
line too ([Note: one line per error] in ``runtime/rank_errors.py``).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from ..codegen.split import load_stage_source
from ..errors import PlanFileError, RunDirectoryError, ZorseError
from ..plan import Plan
from ..token_data import TokenData, model_vocab_size, plan_rank_samples
from ..train_options import RANK_HOOKS, TestingOptions
from .checkpoint import check_resumable, newest_intact_checkpoint, read_manifest
from .run_dir import CHECKPOINTS, check_checkpoint_run
from .stage import check_weights

__all__ = ["LaunchError", "check_plan_version", "check_nproc", "check_hook_ranks", "weights_path",
           "load_weights", "stage_tensors", "batch_source", "check_job", "check_data"]


class LaunchError(ZorseError, ValueError):
    """A launch option that does not fit the plan (``--nproc``, a testing hook's rank)."""


def check_plan_version(plan: Plan, plan_path: str | Path) -> None:
    """Refuse a plan whose stage sources carry no recorded sha256 (format version < 5).

    Raises:
        PlanFileError: naming the plan and the fix (re-export it)."""
    if not plan.sources_verified:
        raise PlanFileError(
            f"{plan_path}: plan.json records no sha256 of its stage sources (a file of format version < 5), so "
            f"zorse_fx will not run them: check the stage_<i>.py files, then "
            f"re-export the plan (`zorse plan ...` again, or `Plan.load(...).export(...)`) to record their hashes",
            path=str(plan_path), field="version")


def check_nproc(plan: Plan, nproc: int) -> None:
    """``--nproc`` (0: the plan's) is the plan's world size: one process per planned GPU.

    Raises:
        LaunchError: naming both counts and the fix."""
    if nproc and nproc != plan.world_size:
        raise LaunchError(f"--nproc {nproc} does not match the plan: it needs {plan.world_size} processes, one per "
                          f"GPU it uses; leave --nproc out (or pass --nproc {plan.world_size}), or re-plan for "
                          f"{nproc} GPUs with `zorse plan`")


def check_hook_ranks(testing: TestingOptions, world: int) -> None:
    """Every testing hook at ``RANK:STEP`` (``train_options.RANK_HOOKS``)
    names a rank of the job, ``0..world - 1`` ([Note: options that cannot take
    effect] in ``train_options.py``). ``zorse train`` checks it with the
    process count before torchrun starts, each rank again with the process
    group's size.

    Raises:
        LaunchError: naming the flag, its rank and the job's ranks."""
    for name in RANK_HOOKS:
        hook = getattr(testing, name)
        if hook is not None and hook[0] >= world:
            raise LaunchError(f"--{name.replace('_', '-')} {hook[0]}:{hook[1]}: rank {hook[0]} is not in the job (its "
                              f"{world} ranks are 0..{world - 1}), so it would never act; pass a RANK from 0 to "
                              f"{world - 1}")


def weights_path(plan_path: str | Path, weights: str | None) -> Path:
    """``--weights``, else ``weights.pt`` beside the plan."""
    plan_path = Path(plan_path)
    plan_dir = plan_path if plan_path.is_dir() else plan_path.parent
    return Path(weights) if weights else plan_dir / "weights.pt"


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """The weights file, memory-mapped (only the tensors touched are read).

    Raises:
        WeightsFileError: no such file, or one ``torch.load`` cannot read."""
    from ..errors import WeightsFileError

    if not path.exists():
        raise WeightsFileError(f"weights file {path} not found; pass --weights or export the plan with "
                               f"`zorse plan` (it writes weights.pt beside plan.json)")
    try:
        return torch.load(path, mmap=True, weights_only=True)
    except Exception as exc:  # a pickle of anything else, a truncated file: torch's errors vary
        raise WeightsFileError(f"weights file {path} does not read as a torch.save file of tensors "
                               f"({type(exc).__name__}: {' '.join(str(exc).split())[:300]}); export the weights with "
                               f"`zorse plan` (weights.pt)") from None


def stage_tensors(plan: Plan, plan_dir: Path) -> list[dict[str, torch.Tensor]]:
    """Per stage: canonical name -> the stage module's tensor (parameters and
    constants), on the meta device (shapes and dtypes, no memory)."""
    out = []
    for s, src in zip(plan.stages, plan.sources):
        cls = load_stage_source(src, plan_dir / s.source_file, s.index)
        with torch.device("meta"):
            module = cls()
        out.append({canon: getattr(module, flat) for flat, canon in {**cls.PARAMETERS, **cls.CONSTANTS}.items()})
    return out


def batch_source(plan: Plan, data: TokenData, *, rank: int, val_fraction: float, val_every: int, val_batches: int,
                 allow_repeat: bool):
    """``step -> batch`` (``TokenData.global_batch`` with the plan's shapes and
    ``rank``'s samples) over the held-out split of ``--val-fraction``, else (with
    ``--val-every``) the last ``--val-batches`` global batches."""
    held = dict(val_fraction=val_fraction) if val_fraction else dict(
        val_tokens=val_batches * plan.global_batch_size * (plan.seq_len + 1) if val_every else 0)
    return partial(data.global_batch, global_batch_size=plan.global_batch_size, seq_len=plan.seq_len,
                   input_names=plan.input_names, label_mode=plan.label_mode,
                   samples=plan_rank_samples(plan, rank), allow_repeat=allow_repeat, **held)


def check_job(plan_path: str | Path, *, weights: str | None, nproc: int, resume: bool,
              out: str | Path) -> tuple[Plan, dict[str, torch.Tensor]]:
    """The checks of [Note: pre-flight checks] that need no token file: the
    plan, ``--nproc``, the weights, the checkpoint ``--resume`` would load.
    Returns the plan and the (memory-mapped) weights."""
    plan_path = Path(plan_path)
    plan = Plan.load(plan_path)
    check_plan_version(plan, plan_path)
    check_nproc(plan, nproc)
    path = weights_path(plan_path, weights)
    tensors = load_weights(path)
    expected = stage_tensors(plan, plan_path if plan_path.is_dir() else plan_path.parent)
    for s, want in zip(plan.stages, expected):
        check_weights(want, tensors, stage=s.index, source=str(path))
    if resume:  # the checkpoint rank 0 will pick: the newest whose files are all there (it names the others)
        root = Path(out) / CHECKPOINTS
        ckpt, damaged = newest_intact_checkpoint(root, contents=False)  # (sizes; rank 0 hashes them)
        if ckpt is None and damaged:
            raise RunDirectoryError(f"no intact checkpoint in {root} to resume ({'; '.join(map(str, damaged))}); "
                                    f"pass --overwrite instead of --resume to start the run anew")
        if ckpt is not None:
            check_checkpoint_run(out, ckpt, read_manifest(ckpt)["run_id"])
            shapes = {canon: tuple(want[canon].shape) for s, want in zip(plan.stages, expected)
                      for canon in s.params.values()}
            check_resumable(ckpt, plan, shapes)
    return plan, tensors


def check_data(plan: Plan, weights: dict[str, torch.Tensor], data: str, *, val_fraction: float, val_every: int,
               val_batches: int, allow_repeat: bool) -> None:
    """The token checks of [Note: pre-flight checks]: ``data`` (a token file or
    a ``--tokens`` tensor file) reads, its ids fit the model's vocabulary, and
    the splits hold a global batch.

    Raises:
        DataError: naming the file, the value and the fix."""
    tokens = TokenData.load(data)
    vocab = model_vocab_size(plan, weights)
    if vocab is not None:  # every id of the file ([Note: token ids checked where they are read])
        tokens.check_vocab(vocab, seq_len=plan.seq_len)
    batch_of = batch_source(plan, tokens, rank=0, val_fraction=val_fraction, val_every=val_every,
                            val_batches=val_batches, allow_repeat=allow_repeat)
    batch_of(0)
    if val_every:  # (validation draws batches only with --val-every)
        batch_of(0, split="val")
