"""A training run's directory (``--out``) and the identity that keeps two
runs apart.

What a run leaves in ``<out>`` and the rules here guard: ``checkpoints/``
(``runtime/checkpoint.py``), ``metrics.jsonl`` (one record per step,
``zorse_fx/train.py``) and ``timings.jsonl`` (each rank's phases per step,
``runtime/timings.py``). Every checkpoint manifest and every metrics record
carries the run's identity: ``run_id``, drawn at random when a run starts
afresh and kept by every ``--resume`` (and torchrun restart) of it, and
``plan_hash``, the plan that trained that step (a resumed run may change
plans).

[Note: one run per directory]
A fresh run (no ``--resume``) into a directory that holds another run's
checkpoints or metrics is refused (``check_fresh_start``: the directory named,
``--overwrite`` or ``--resume`` to pass): otherwise its checkpoints would sit
beside the older run's, keeping the newest K would keep the older run's later
steps and delete the new ones, ``--resume`` would continue the older run, and
``metrics.jsonl`` would interleave both. ``--overwrite`` removes the older
run's checkpoints and ``metrics.jsonl`` first (``remove_previous_run``).
Other files of ``<out>`` (``train_options.json``, ``data/``, older
``metrics.<n>.jsonl``) are not a run's state and are left alone.

[Note: checkpoints bound to their run]
``--resume`` (and a torchrun restart) continues the run ``<out>`` holds:
the run id of its ``metrics.jsonl`` records (``metrics_run_id``), or, where
no record carries one, the run id its checkpoints share. A checkpoint of
another run (another ``step_<k>`` copied into ``checkpoints/``) is not
resumed: resuming it would take over its run id, and continuing
``metrics.jsonl`` keeps only the resumed run's records, deleting this run's.
Skipping it for this run's newest own checkpoint would instead train on
while a stranger's checkpoint sits among this run's, where keeping the
newest K could delete this run's. So it is refused in one line
(``check_checkpoint_run``) naming the checkpoint, both run ids and the two
ways on: move it out of ``checkpoints/``, or ``--overwrite`` to start anew.
A version-1 checkpoint (no run id) belongs to whichever run holds it. A
checkpoint of another plan of the same run is resumed (re-planning after a
lost GPU does that); ``checkpoint.check_resumable`` checks the model, the
global batch and the sequence length, and the start names both plans.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import shutil
from pathlib import Path

from ..errors import RunDirectoryError
from ..plan import Plan
from .timings import TIMINGS

__all__ = ["METRICS", "CHECKPOINTS", "REBALANCE_REQUEST", "REBALANCE_STOP", "new_run_id", "plan_hash", "previous_run", "check_fresh_start",
           "remove_previous_run", "metrics_run_id", "check_checkpoint_run"]

#: The per-step metrics file, and the checkpoint directory, under ``<out>``.
METRICS, CHECKPOINTS = "metrics.jsonl", "checkpoints"
#: The file under ``<out>`` by which ``zorse train --rebalance`` asks the ranks to stop after the step they
#: are in, with a checkpoint, and exit 0 ([Note: stopping to rebalance] in ``zorse_fx/rebalance.py``); and the
#: value rank 0 then puts where a received signal goes in the step's all-gather (no signal has this number).
REBALANCE_REQUEST, REBALANCE_STOP = "rebalance.request", 255
_STEP = re.compile(r"^step_(\d+)(\.tmp|\.damaged(\.\d+)?)?$")


def new_run_id() -> str:
    """A fresh run's id: 16 random hex digits."""
    return secrets.token_hex(8)


def plan_hash(plan: Plan) -> str:
    """The first 16 hex digits of the sha256 of ``plan``'s JSON form."""
    return hashlib.sha256(plan.to_json().encode()).hexdigest()[:16]


def _metrics_summary(path: Path) -> str | None:
    """``metrics.jsonl (<n> records, run <id>)``, or None when there is no such file or it is empty."""
    if not path.is_file() or not path.stat().st_size:
        return None
    records, runs = 0, []
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        records += 1
        try:
            run = json.loads(line).get("run_id")
        except (ValueError, AttributeError, RecursionError):
            continue
        if run and run not in runs:
            runs.append(run)
    label = f", run {', '.join(runs)}" if runs else ""
    return f"{path.name} ({records} record{'s' if records != 1 else ''}{label})"


def metrics_run_id(out: str | Path) -> str | None:
    """The run id of ``<out>/metrics.jsonl``'s last record that carries one
    (a line that does not parse is skipped), or None."""
    path = Path(out) / METRICS
    found = None
    if path.is_file():
        with open(path, errors="replace") as f:
            for line in f:
                try:
                    run = json.loads(line).get("run_id")
                except (ValueError, AttributeError, RecursionError):
                    continue
                found = run or found
    return found


def check_checkpoint_run(out: str | Path, checkpoint: str | Path, run_id: str) -> str | None:
    """Before ``checkpoint`` (of ``<out>/checkpoints``, written by run
    ``run_id``; '' for a version-1 checkpoint) is resumed: it is of the run
    ``out`` holds ([Note: checkpoints bound to their run]). Returns that
    run's id (None where nothing names one).

    Raises:
        RunDirectoryError: naming the checkpoint, its run id, this run's id
            and the fix (move it out, or --overwrite)."""
    from .checkpoint import list_checkpoints, read_manifest

    out, checkpoint = Path(out), Path(checkpoint)
    this, source = metrics_run_id(out), f"its {METRICS}"
    if this is None:  # no record names the run: the run its checkpoints share, if they share one
        ids = {}
        for _, d in list_checkpoints(out / CHECKPOINTS):
            try:
                ids.setdefault(read_manifest(d)["run_id"], []).append(d.name)
            except ValueError:  # a manifest that does not read: damaged, not a run's word
                continue
        ids.pop("", None)
        others = {k: v for k, v in ids.items() if k != run_id}
        if run_id and others:
            names = "; ".join(f"run {k}: {', '.join(v)}" for k, v in others.items())
            raise RunDirectoryError(
                f"checkpoint {checkpoint} was written by run {run_id}, but {checkpoint.parent} also holds another "
                f"run's ({names}) and no {METRICS} says which run {out} holds; move the other run's checkpoints "
                f"out of {checkpoint.parent} to resume run {run_id}, or pass --overwrite instead of --resume to "
                f"start anew")
        return run_id or None
    if run_id and run_id != this:
        raise RunDirectoryError(
            f"checkpoint {checkpoint} was written by run {run_id}, but {out} holds run {this} ({source}); resuming "
            f"it would continue the other run and drop this run's metrics: move {checkpoint.name} out of "
            f"{checkpoint.parent} to resume run {this} from its own newest checkpoint, or pass --overwrite instead "
            f"of --resume to start anew")
    return this


def previous_run(out: str | Path) -> str | None:
    """What of an earlier run ``out`` holds, in words (``checkpoints step_6,
    step_9 and metrics.jsonl (12 records, run 1f0c...)``), or None: no
    checkpoint directory (complete, being written or set aside) and no
    non-empty ``metrics.jsonl``."""
    out = Path(out)
    root = out / CHECKPOINTS
    steps = sorted((int(m.group(1)), d.name) for d in (root.iterdir() if root.is_dir() else ())
                   if (m := _STEP.match(d.name)) and d.is_dir())
    parts = []
    if steps:
        names = [name for _, name in steps]
        shown = ", ".join(names if len(names) <= 4 else [*names[:2], "...", *names[-2:]])
        parts.append(f"checkpoint{'s' if len(names) > 1 else ''} {shown}")
    metrics = _metrics_summary(out / METRICS)
    if metrics:
        parts.append(metrics)
    return " and ".join(parts) or None


def check_fresh_start(out: str | Path, *, overwrite: bool) -> str | None:
    """Before a fresh run (no ``--resume``) writes into ``out``: what of an
    earlier run it holds (``previous_run``), None if nothing.

    Raises:
        RunDirectoryError: ``out`` holds another run's state and not
            ``overwrite`` (see [Note: one run per directory])."""
    found = previous_run(out)
    if found and not overwrite:
        raise RunDirectoryError(f"{out} holds another run's {found}; pass --overwrite to replace that run or "
                                f"--resume to continue it (or choose another --out)")
    return found


def remove_previous_run(out: str | Path) -> None:
    """Remove an earlier run's checkpoints (every ``step_<k>`` directory of
    ``out/checkpoints``, complete, being written or set aside),
    ``metrics.jsonl`` and ``timings.jsonl`` (``--overwrite``)."""
    out = Path(out)
    root = out / CHECKPOINTS
    for d in list(root.iterdir()) if root.is_dir() else ():
        if _STEP.match(d.name) and d.is_dir():
            shutil.rmtree(d)
    (out / METRICS).unlink(missing_ok=True)
    (out / TIMINGS).unlink(missing_ok=True)
