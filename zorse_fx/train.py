"""``python -m zorse_fx.train``: run an exported plan, one process per GPU.

Launch with torchrun (one node or many; torch.distributed is the engine, NCCL
on GPUs, Gloo on CPU)::

    torchrun --nproc-per-node 4 -m zorse_fx.train runs/x/plan \\
        --weights runs/x/plan/weights.pt --data runs/x/data/tokens.bin --steps 10 --out runs/x
    torchrun --nproc-per-node 4 -m zorse_fx.train --options-file runs/x/train_options.json

The options (``--help`` lists them) are one frozen tree,
``train_options.TrainingOptions``: its records ``data``, ``optimizer``,
``loop``, ``checkpoint``, ``job`` and ``testing`` hold every default and check
every value (a refused one exits with status 2, the flag named). The flags
are parsed by tyro, flat as the field names (``--lr``, ``--checkpoint-every``);
``--options-file FILE`` instead reads the whole tree from the JSON file
``zorse train`` writes (``<out>/train_options.json``), refusing unknown fields.

``--data``: a token file of ``zorse prepare-data`` (``token_data.py``),
memory-mapped; each rank reads only the rows of the global batch it computes
on. ``--tokens``: a legacy ``torch.save`` 1-D integer tensor. Both are
checked against the model's vocabulary (stage 0's embedding): the header at
start-up, the ids of every batch as a rank reads them ([Note: token ids
checked where they are read] in ``token_data.py``).

``zorse train`` writes the options file and runs this module under torchrun
with ``--options-file``. Each rank reads only the options, plan.json, its
stage source, the weights and the token file; it never imports OR-Tools.
The loop: AdamW with weight decay on matrices
only, a learning-rate schedule (``runtime/lr_schedule.py``), clipping of the
global gradient norm, validation on held-out batches, checkpoints with
``torch.distributed.checkpoint`` (``runtime/checkpoint.py``: ``--checkpoint-every``,
``--resume``, under another plan of the same model too), resumption after a
torchrun restart (``zorse train --max-restarts``), and SIGTERM/SIGINT handled
at the end of a step on every rank alike (checkpoint, then exit ``128 + signal``).

One run per ``--out`` ([Note: one run per directory] in
``runtime/run_dir.py``): before any rank writes, rank 0 decides how the run
starts (``_decide_start``) and broadcasts it: a fresh run (refused where
``<out>`` holds another run's checkpoints or metrics, unless ``--overwrite``
removes them), the newest intact checkpoint to resume (damaged ones named
and set aside: [Note: checkpoint integrity] in ``runtime/checkpoint.py``),
or nothing to train (``--resume`` of a finished run: exit 0). A step whose
loss or gradients are not finite stops every rank with ``EXIT_NONFINITE``
and no checkpoint of it ([Note: non-finite steps] in ``runtime/worker.py``).

Errors: a rank that raises prints one line, ``zorse: rank <k> (stage <s>):
<cause>``, keeps the traceback in ``<out>/logs/rank<k>.log`` and exits 1
([Note: one line per error] in ``runtime/rank_errors.py``; under ``zorse
train`` the launcher prints the line, once for the job). Before training,
every rank checks that its GPU (name, memory) and node are the ones the plan
assigned to its rank ([Note: checking the devices against the plan] in
``runtime/device_check.py``; ``--skip-device-check``).

Rank 0 writes ``<out>/metrics.jsonl`` (continued by ``--resume``): one JSON
object per step with ``step``, ``run_id`` and ``plan_hash`` (the run's
identity), ``loss``, ``lr``, ``grad_norm`` (global, before clipping),
``val_loss`` (on validation steps), ``tokens_seen``, ``step_time_s`` (rank 0's wall time of the
whole step, the all-gather below included: consecutive steps' times add up to the run's),
``tokens_per_s``, ``precision``,
``loss_scale`` and ``skipped`` (fp16-mixed: the scale the step used, and
whether every rank skipped it for an inf/NaN gradient) and ``ranks``: per rank
when its step started on the wall clock (``start_unix_s``, ``time.time()``: the
ranks' phases line up; across hosts to their clocks' offset), the seconds spent
in the pipeline schedule (``pipeline_s``), waiting for the
gradient all-reduce still in flight after it (``allreduce_s``; the rest
overlapped the backward), the optimizer step (``optimizer_s``) and the
parameter all-gather of a ZeRO-1 stage (``allgather_s``, 0 elsewhere), and its
gradient buckets (``buckets``) of which ``buckets_during_backward`` were
launched while the backward was still running, each over all the stages the
rank hosts (``stages``: several in an interleaved
plan, see [Note: a rank with several stages] in ``runtime/worker.py``), and the
most memory its stages have held so far (``memory_peak_bytes``: on a GPU the
allocator's peak of tensor bytes, on a CPU the growth of the process's peak
resident set; [Note: measured rank memory] in ``runtime/memory_meter.py``),
the quantity the plan's per-GPU memory prediction is of.
``--dump-grads`` / ``--dump-params`` save one file per rank, by canonical
parameter name over the rank's stages.

[Note: one world collective after the step]
After ``Worker.train_step`` every rank takes part in ONE collective over the
world: an all-gather of a small float64 row per rank (its phase times, a
signal received, the stages with non-finite gradients or weights, its memory
peak and its loss contribution). Every rank then holds the same table, so all
stop, skip or go on alike, and the global batch's loss is the exact sum
(``math.fsum``, in rank order) of the gathered contributions: no separate
all-reduce of the loss. Across a WAN each world collective costs its ring's
round trips whatever its size (measured on the box, bench/LOG.md "The step's
world control collectives"), so the step has exactly two: the gradient norm's
all-reduce inside ``train_step`` and this all-gather (three under fp16, whose
loss scaler agrees on inf/NaN in one more). The planners price them
(``control_units`` in ``solve/tables.py``).

Precision (``--precision``): the plan's (``Plan.precision``) on GPUs; on a
CPU run, fp32 unless asked -- bf16 autocast runs on CPUs, slowly without
bf16 hardware, and float16 matmuls on a CPU are slower still.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from .errors import RunDirectoryError, RuntimeExecutionError
from .pacing import ENV_PACE, ENV_PACE_REFERENCE, Pacer
from .plan import Plan, fmt_seconds
from .precision import precision_policy
from .runtime import preflight
from .runtime.checkpoint import load_checkpoint, newest_intact_checkpoint, read_manifest, save_checkpoint, set_aside
from .runtime.device_check import check_devices, observe
from .runtime.launch import init_process_group, rank_device
from .runtime.lr_schedule import LRSchedule
from .runtime.memory_meter import MemoryMeter
from .runtime.rank_errors import EXIT_NONFINITE, record_rank_error  # (EXIT_NONFINITE: the launcher reads it too)
from .runtime.run_dir import (CHECKPOINTS, METRICS, REBALANCE_REQUEST, REBALANCE_STOP, check_checkpoint_run,
                              check_fresh_start, new_run_id, plan_hash, previous_run, remove_previous_run)
from .runtime.timings import TIMINGS, slowest_rank, timings_line
from .runtime.watchdog import heartbeat_dir, start_heartbeat
from .runtime.worker import OptimizerConfig, StageWorker
from .token_data import TokenData, model_vocab_size
from .train_options import (CheckpointOptions, TrainingOptions, TrainOptionsFileError, UsageError,
                            options_from_argv)

__all__ = ["main", "exit_rank", "parse_args", "runtime_precision", "PROG", "EXIT_NONFINITE"]

#: The program name ``--help`` and errors show.
PROG = "python -m zorse_fx.train"
_DESCRIPTION = ("Run an exported plan, one process per GPU (under torchrun). The options are flags, or all of them "
                "in one file: --options-file FILE (the <out>/train_options.json `zorse train` writes).")


def parse_args(argv=None) -> TrainingOptions:
    """``python -m zorse_fx.train``'s options from ``argv`` (default
    ``sys.argv[1:]``): the flags ``--help`` lists, or ``--options-file FILE``
    alone. A command line or file that is refused prints
    ``python -m zorse_fx.train: error: <message>`` (the flag, or the file,
    field and value, named) and exits with status 2, as argparse does."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return options_from_argv(argv, prog=PROG, description=_DESCRIPTION)
    except (UsageError, TrainOptionsFileError) as exc:
        print(f"usage: {PROG} [-h] [OPTIONS] PLAN\n       {PROG} --options-file FILE\n{PROG}: error: {exc}",
              file=sys.stderr)
        raise SystemExit(2) from None


def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, flush=True)


def runtime_precision(plan: Plan, device: torch.device, asked: str | None, reduce_dtype: str | None = None):
    """(policy to train with, why): ``asked`` (with ``reduce_dtype``, else the
    plan's when it is the plan's precision), else the plan's on a GPU, else
    fp32 on a CPU; TF32 as the plan says (``Plan.tf32``).

    Raises:
        ValueError: a reduction dtype the precision does not allow."""
    planned, reduce = plan.precision, plan.grad_reduce_dtype
    if asked is not None:
        return (precision_policy(asked, reduce_dtype or (reduce if asked == planned else None), tf32=plan.tf32),
                "--precision")
    if device.type == "cpu" and planned != "fp32":
        return precision_policy("fp32", tf32=plan.tf32), f"the plan's {planned} is for its GPUs; this is a CPU run"
    return precision_policy(planned, reduce, tf32=plan.tf32), "the plan's"


_BREAKDOWN = ("start_unix_s", "pipeline_s", "allreduce_s", "optimizer_s", "allgather_s", "buckets",
              "buckets_during_backward")


class _Stop:
    """SIGTERM / SIGINT on a rank: remember it; the loop agrees on it over the
    world at the end of the step (one extra element of the step's all-gather),
    saves a checkpoint when checkpoints are on, and exits."""

    def __init__(self) -> None:
        self.signal = 0
        self._old = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._on)

    def _on(self, signum, frame) -> None:
        if self.signal:  # a second signal: stop now
            signal.signal(signum, self._old.get(signum, signal.SIG_DFL))
            raise KeyboardInterrupt
        self.signal = signum


def _metrics_file(out: Path, resumed_step: int | None, run_id: str, name: str = METRICS):
    """metrics.jsonl (or ``name``: timings.jsonl), continued after ``resumed_step`` (later lines, from steps
    the interrupted run did after its last checkpoint, and lines of another
    run are dropped), or started anew (a fresh run: [Note: one run per
    directory] in ``runtime/run_dir.py``)."""
    path = out / name
    if resumed_step is not None and path.exists():
        kept = []
        for ln in path.read_text().splitlines():
            try:
                rec = json.loads(ln)
            except (ValueError, RecursionError):  # a line cut short by the interruption (or not ours)
                continue
            if rec.get("step", 0) <= resumed_step and rec.get("run_id", run_id) == run_id:
                kept.append(ln)
        path.write_text("".join(ln + "\n" for ln in kept))
        return open(path, "a")
    return open(path, "w")


_KINDS = ("fresh", "resume", "finished", "refused", "failed")


@dataclass(frozen=True, slots=True, kw_only=True)
class _Start:
    """How the run starts, decided by rank 0 (``_decide_start``) and
    broadcast: ``kind`` one of ``_KINDS``; ``step``: the checkpoint step it
    resumes from (``resume``, ``finished``); ``run_id`` (rank 0's: only it
    writes manifests and metrics); ``lines``: what rank 0 prints (a line
    starting ``zorse:`` on stderr); ``fell_back``: newer checkpoints were
    damaged (``resume``)."""

    kind: Literal["fresh", "resume", "finished", "refused", "failed"]
    step: int = 0
    run_id: str = ""
    lines: tuple[str, ...] = ()
    fell_back: bool = False


def _decide_start(out: Path, ckpt: CheckpointOptions, steps: int, restarted: int, *, this_plan: str = "") -> _Start:
    """Rank 0, before any rank writes: a fresh run (refused where ``out``
    holds another run, which ``--overwrite`` removes first), or the newest
    intact checkpoint to resume (damaged ones named and set aside; one of
    another run refused: [Note: checkpoints bound to their run] in
    ``runtime/run_dir.py``; one of a plan other than ``this_plan``, a plan
    hash, named), or nothing to train (that checkpoint is at ``steps`` or
    later)."""
    root = out / CHECKPOINTS
    if not (ckpt.resume or restarted):
        try:
            found = check_fresh_start(out, overwrite=ckpt.overwrite)
        except RunDirectoryError as exc:
            return _Start(kind="refused", lines=(f"zorse: {exc}",))
        if found:
            remove_previous_run(out)
        return _Start(kind="fresh", run_id=new_run_id(),
                      lines=(f"[zorse] --overwrite: removed the earlier run's {found} from {out}",) if found else ())
    latest, damaged = newest_intact_checkpoint(root)
    if latest is None:
        if damaged:
            return _Start(kind="refused", lines=(*(f"zorse: {exc}" for exc in damaged),
                                                 f"zorse: no intact checkpoint in {root} to resume; pass --overwrite "
                                                 f"instead of --resume to start the run anew"))
        found = previous_run(out)
        if found and not restarted:  # (a restarted job before its first checkpoint: its own metrics, started anew)
            return _Start(kind="refused", lines=(f"zorse: {out} holds a run's {found} but no checkpoint to resume it "
                                                 f"from (that run stopped before writing one); pass --overwrite "
                                                 f"instead of --resume to start it anew",))
        return _Start(kind="fresh", run_id=new_run_id(),
                      lines=(f"[zorse] no complete checkpoint in {root}: starting at step 1",))
    manifest = read_manifest(latest)
    try:
        this_run = check_checkpoint_run(out, latest, manifest["run_id"])
    except RunDirectoryError as exc:  # (before anything is set aside: nothing changes)
        return _Start(kind="refused", lines=(f"zorse: {exc}",))
    lines = tuple(f"[zorse] {exc}; set aside as {set_aside(exc.path).name}" for exc in damaged)
    if manifest["plan_hash"] and this_plan and manifest["plan_hash"] != this_plan:
        lines += (f"[zorse] {latest} was written under another plan (plan hash {manifest['plan_hash']}, this plan "
                  f"{this_plan}): resuming under this one (the model, global batch and sequence length are checked)",)
    step = manifest["step"]
    if step >= steps:
        where = "the final step" if step == steps else "past the final step"
        return _Start(kind="finished", step=step, lines=(*lines, (
            f"[zorse] nothing to train: the newest checkpoint {latest} is at step {step}, {where} (--steps {steps}); "
            f"pass a larger --steps to train on")))
    if manifest["contents"] != "full":  # (a last step's --final-checkpoint model-only: no optimizer state)
        full, older_damaged = newest_intact_checkpoint(root, resumable=True)
        lines += tuple(f"[zorse] {exc}; set aside as {set_aside(exc.path).name}" for exc in older_damaged)
        model_only = (f"{latest} holds the parameters only (--final-checkpoint model-only), not the optimizer state "
                      f"training continues from")
        if full is None:
            return _Start(kind="refused", lines=(*lines, f"zorse: {model_only}, and no checkpoint before it does; "
                                                         f"pass --overwrite instead of --resume to start anew"))
        latest, manifest = full, read_manifest(full)
        step = manifest["step"]
        lines += (f"[zorse] {model_only}: resuming from {full} (step {step}), the newest with it",)
    return _Start(kind="resume", step=step, run_id=manifest["run_id"] or this_run or new_run_id(), lines=lines,
                  fell_back=bool(damaged))


def _agree_on_start(start: _Start | None, rank: int, device: torch.device) -> tuple[str, int]:
    """Rank 0's decision (``start``; None elsewhere) on every rank: (kind, step), one broadcast on the device."""
    code = torch.zeros(2, dtype=torch.int64, device=device)
    if rank == 0:
        code[0], code[1] = _KINDS.index(start.kind), start.step
    dist.broadcast(code, 0)
    kind, step = code.tolist()
    return _KINDS[kind], step


def _nonfinite_message(step: int, loss: float, loss_ranks: list[int], grads: list[tuple[int, int]],
                       weights: list[tuple[int, int]], last_stage: int, checkpoint: str) -> str:
    """The one line naming a non-finite step: where the loss, the gradients and the weights were not finite."""

    def where(pairs) -> str:
        return ", ".join(f"rank {r} (stage {s})" for r, s in pairs)

    parts = []
    if loss_ranks:
        parts.append(f"loss {loss} on {where((r, last_stage) for r in loss_ranks)}")
    if grads:
        parts.append(f"non-finite gradients on {where(grads)}")
    if weights:
        parts.append(f"non-finite weights on {where(weights)}")
    return (f"zorse: step {step} is not finite: {'; '.join(parts)}; stopped without an optimizer step or a "
            f"checkpoint of it ({checkpoint})")


def _memory_line(plan: Plan, peaks: list[int], *, on_cpu: bool) -> str:
    """One line: per rank its measured memory peak ([Note: measured rank memory]) beside the plan's
    prediction for its GPU (over the stages it hosts; on a CPU run with the host bytes too, the same memory)."""
    planned = [0] * plan.world_size
    for s in plan.stages:
        for g in s.gpus:
            planned[g.rank] += g.predicted_memory_bytes + (g.predicted_host_memory_bytes if on_cpu else 0)

    def mib(b: int) -> str:
        return f"{b / 2**20:.4g}"

    what = "resident-set growth" if on_cpu else "allocated"
    return ("[zorse] memory peak per rank, MiB " + what + " (planned): "
            + ", ".join(f"{r}: {mib(m)} ({mib(planned[r])})" for r, m in enumerate(peaks)))


class _Progress:
    """Rank 0's progress: a tqdm bar (loss, tokens/s, ETA) on a terminal, one
    line per step otherwise (logs, tests)."""

    def __init__(self, total: int, start: int):
        self.bar = None
        if sys.stdout.isatty():
            from tqdm import tqdm

            # on stdout, the terminal: `zorse train` reads the ranks' stderr line by line (runtime/launch.py)
            self.bar = tqdm(total=total, initial=start, desc="[zorse] train", unit="step", dynamic_ncols=True,
                            file=sys.stdout)
        self.total, self.t0, self.start = total, time.perf_counter(), start

    def step(self, step: int, rec: dict, extra: str) -> None:
        done = step - self.start
        eta = (time.perf_counter() - self.t0) / done * (self.total - step) if done else 0.0
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {rec['loss']:.4f}, {rec['tokens_per_s']:,.0f} tok/s{extra}")
            self.bar.update(1)
            return
        print(f"[zorse] step {step:>3}/{self.total}  loss {rec['loss']:.4f}  {rec['step_time_s']:.2f} s  "
              f"{rec['tokens_per_s']:,.0f} tokens/s  lr {rec['lr']:.3g}  ETA {eta:.0f} s{extra}", flush=True)

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def main(argv=None) -> int:
    """One rank of the job: ``_run`` under the handler of [Note: one line per
    error] (``runtime/rank_errors.py``): an exception becomes one ``zorse:``
    line naming the rank, its stage and the cause, the traceback kept in
    ``<out>/logs/rank<k>.log``, and exit status 1. A rank killed in native
    code (SIGSEGV, SIGABRT, ...) prints every thread's Python stack on its
    stderr first (``faulthandler``; the signal, and so the exit status, is
    kept). Run as ``python -m zorse_fx.train`` the rank then ends by
    ``exit_rank`` ([Note: a rank ends without interpreter finalization])."""
    faulthandler.enable(all_threads=True)
    options = parse_args(argv)
    where = _Where(rank=int(os.environ.get("RANK", "0") or 0))
    try:
        return _run(options, where)
    except Exception as exc:
        record_rank_error(exc, out=options.job.out, rank=where.rank, stages=where.stages)
        return 1


@dataclass(slots=True, kw_only=True)
class _Where:
    """The rank and its stages, as far as known when an error is raised (for its one line)."""

    rank: int
    stages: tuple[int, ...] = ()


def _check_devices(plan: Plan, rank: int, world: int, device: torch.device, skip: bool) -> None:
    """Every rank on the GPU and node the plan assigned to it ([Note: checking
    the devices against the plan] in ``runtime/device_check.py``): the
    observations all-gathered, the same check on every rank."""
    if skip:
        _log(rank, "[zorse] --skip-device-check: the ranks' GPUs and nodes are not checked against the plan")
        return
    mine = observe(rank, device)
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    report = check_devices(plan, every)
    if report.skipped:
        _log(rank, f"[zorse] device check skipped for {'; '.join(report.skipped)}")


def _run(options: TrainingOptions, where: _Where) -> int:
    d, opt, loop, ckpt, job, test = (options.data, options.optimizer, options.loop, options.checkpoint,
                                     options.job, options.testing)
    torch.set_num_threads(1)  # one thread per rank: ranks share the host's cores
    stop = _Stop()
    backend = job.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = rank_device(backend)
    init_process_group(backend, timeout=timedelta(minutes=job.pg_timeout_min),  # restart-safe (--max-restarts)
                       device_id=device if device.type == "cuda" else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    where.rank = rank
    if job.heartbeat_s:  # the launcher's stall monitor reads these (zorse train --stall-timeout)
        start_heartbeat(heartbeat_dir(job.out), rank, interval_s=job.heartbeat_s)
    torch.manual_seed(opt.seed)
    plan_path = Path(d.plan)
    plan_dir = plan_path if plan_path.is_dir() else plan_path.parent
    plan = Plan.load(plan_path)
    if world != plan.world_size:
        raise RuntimeExecutionError(
            f"the plan needs {plan.world_size} processes (one per GPU) but torchrun started {world}; "
            f"use --nproc-per-node {plan.world_size} on one node, or on several nodes each node's planned ranks "
            f"(`zorse train --nnodes N --node-rank K` counts them)"
        )
    preflight.check_hook_ranks(test, world)  # (zorse train checked it with --nproc; torchrun may start others)
    where.stages = tuple(plan.stages_of(rank))
    _check_devices(plan, rank, world, device, job.skip_device_check)
    out = Path(job.out)
    ckpt_root = out / CHECKPOINTS
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    start_at = None
    if rank == 0:
        try:
            start_at = _decide_start(out, ckpt, loop.steps, restarted, this_plan=plan_hash(plan))
        except BaseException:
            _agree_on_start(_Start(kind="failed"), rank, device)  # the others stop too instead of waiting
            raise
        for line in start_at.lines:
            print(line, file=sys.stderr if line.startswith("zorse:") else sys.stdout, flush=True)
    kind, resumed_step = _agree_on_start(start_at, rank, device)
    if kind in ("refused", "failed", "finished"):  # (after "failed" rank 0 has raised: no barrier)
        if kind != "failed":
            dist.barrier()
        dist.destroy_process_group()
        return 0 if kind == "finished" else 1
    run_id = start_at.run_id if rank == 0 else ""
    weights_path = preflight.weights_path(plan_path, d.weights)
    weights = preflight.load_weights(weights_path)  # memory-mapped
    data = TokenData.load(d.data or d.tokens)  # memory-mapped; see token_data.py
    vocab = model_vocab_size(plan, weights)
    if vocab is not None:  # the header's claim; each batch's ids as it is read (token_data.py)
        data.check_vocab(vocab, scan=False)
    # The held-out split: --val-fraction, else (with --val-every) the last --val-batches global batches.
    batch_of = preflight.batch_source(plan, data, rank=rank, val_fraction=d.val_fraction, val_every=loop.val_every,
                                      val_batches=loop.val_batches, allow_repeat=d.allow_repeat)
    batch_of(0)  # a corpus too small for a global batch fails here, before any rank trains
    policy, why = runtime_precision(plan, device, job.precision, job.grad_reduce_dtype)
    meter = MemoryMeter(device)  # from here: the stage's own bytes ([Note: measured rank memory])
    worker = StageWorker(plan, plan_dir, weights, rank=rank, device=device, optimizer=OptimizerConfig.from_options(opt),
                         precision=policy, weights_source=str(weights_path), timings=not loop.no_timings)
    del weights
    if test.inject_inf and test.inject_inf[0] == rank:
        worker.add_inject_inf(test.inject_inf[1])
    pacer = Pacer.from_environment()  # the box: this CPU thread as its GPU type ([Note: paced compute] in pacing.py)
    pace = pacer.factor
    if pacer.active:
        if device.type != "cpu":
            raise RuntimeExecutionError(f"{ENV_PACE}={pace:g} on a {device.type} rank: pacing makes a CPU thread "
                                        f"stand in for a slower GPU; unset {ENV_PACE} (and {ENV_PACE_REFERENCE}) "
                                        f"on a GPU")
        worker.pacer = pacer
    if test.slow_gpu:  # [Note: a slowed rank] in runtime/worker.py
        gpus = {g.gpu: g.rank for st in plan.stages for g in st.gpus}
        if gpus.get(test.slow_gpu[0]) == rank:
            worker.slow_factor = test.slow_gpu[1]
            print(f"[zorse] testing: rank {rank} (GPU {test.slow_gpu[0]}) computes {test.slow_gpu[1]:g}x slower",
                  flush=True)
        elif test.slow_gpu[0] not in gpus:  # (an idle GPU: a re-plan may leave the slowed one out)
            _log(rank, f"[zorse] testing: --slow-gpu {test.slow_gpu[0]}:{test.slow_gpu[1]:g}: no rank of this plan "
                       f"is on GPU {test.slow_gpu[0]} (its GPUs: {', '.join(map(str, sorted(gpus)))}): nothing "
                       f"is slowed")
    schedule = LRSchedule.from_options(opt, total_steps=loop.steps)
    if kind == "resume":
        latest = ckpt_root / f"step_{resumed_step}"  # verified by rank 0 (_decide_start)
        manifest = load_checkpoint(worker, latest)
        if manifest["world_size"] != world:  # RNG states are per rank: re-seed
            torch.manual_seed(opt.seed + resumed_step)
        _log(rank, f"[zorse] resumed from {latest} (step {resumed_step}, written on {manifest['world_size']} "
                   f"ranks{'' if manifest['world_size'] == world else ', now ' + str(world)})"
                   + (f" after torchrun restart {restarted}" if restarted else "")
                   + (", the newest intact checkpoint" if start_at is not None and start_at.fell_back else ""))
    else:
        resumed_step = None
    start = (resumed_step or 0) + 1
    metrics = timings = writer = progress = None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        metrics = _metrics_file(out, resumed_step, run_id)
        if not loop.no_timings:  # [Note: step timings] in runtime/timings.py
            timings = _metrics_file(out, resumed_step, run_id, TIMINGS)
        identity = {"run_id": run_id, "plan_hash": plan_hash(plan)}
        if loop.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(str(out / "tensorboard"))
    layout = (f"{plan.num_stages} stages" if plan.interleave == 1 else
              f"{plan.num_stages} stages interleaved x{plan.interleave} on {plan.num_groups} GPU groups")
    _log(rank, f"[zorse] {world} ranks ({backend}), {layout}, "
               f"{plan.num_microbatches} micro-batches of {plan.microbatch_size}, steps {start}..{loop.steps}")
    _log(rank, f"[zorse] precision {policy.name} ({why}): {policy.describe()}")
    _log(rank, f"[zorse] point-to-point: {len(worker.program.groups)} batch_isend_irecv groups per step on rank 0, "
               f"{worker.program.prefetched} receives posted one compute early; gradient buckets: "
               f"{worker.reducer.num_buckets} on rank 0 (the plan's {plan.grad_bucket_bytes / 2**20:g} MiB)")
    _log(rank, f"[zorse] AdamW lr {opt.lr:g} ({opt.lr_schedule}, warm-up {opt.warmup_steps}, min {opt.min_lr:g}), "
               f"weight decay {opt.weight_decay:g} on matrices, clip "
               f"{opt.clip_grad_norm if opt.clip_grad_norm else 'off'}, seed {opt.seed}")
    in_box = bool(os.environ.get("ZORSE_BOX"))  # a box node: the steps at its GPU's speed ([Note: host and GPU
    if in_box:  # leaves] in zorse_fx/box/cgroups.py), the start and the end at the host's
        from .box.rank_enter import enter_rank_leaf

        if enter_rank_leaf("gpu"):
            how = (f"paced: {ENV_PACE} = {pace:.3g} on rank 0"
                   + (f", in units of a {pacer.reference_s * 1e3:.3g} ms reference probe" if pacer.reference_s else "")
                   if pacer.active else "CPU quotas")
            _log(rank, f"[zorse] box {os.environ['ZORSE_BOX']}: ranks compute at their GPU types' speed ({how})")
    dist.barrier()
    if rank == 0:
        progress = _Progress(loop.steps, start - 1)
    saved = resumed_step
    stopping = nonfinite = 0
    for step in range(start, loop.steps + 1):
        batch = batch_of(step - 1)  # only this rank's rows are read; the others are -1
        if test.raise_at_step == (rank, step):
            raise RuntimeExecutionError(f"testing: --raise-at-step {rank}:{step}")
        lr = schedule(step)
        t0 = time.perf_counter()
        # This rank's weighted contribution; the global batch's loss is the sum over the ranks, taken from
        # the one all-gather below ([Note: one world collective after the step]).
        local_loss = worker.train_step(batch, lr=lr, max_grad_norm=opt.clip_grad_norm).detach().reshape(1).to(
            torch.float64)
        if step == test.dump_grads:
            d = out / "grads"
            d.mkdir(parents=True, exist_ok=True)
            torch.save(worker.gradients(), d / f"rank{rank}.pt")
            torch.save(worker.gradient_pieces(), d / f"rank{rank}_pieces.pt")  # ZeRO-2's owned ranges
        # Per rank: the breakdown, a signal received, the first stage (+1; 0: none) with non-finite gradients
        # and weights ([Note: non-finite steps] in runtime/worker.py), and its loss contribution.
        grad_stage, weight_stage = worker.last_nonfinite or (None, None)
        host = [worker.last_breakdown[k] for k in _BREAKDOWN] + [
            float(stop.signal or (REBALANCE_STOP if rank == 0 and (out / REBALANCE_REQUEST).exists() else 0)),
            -1.0 if grad_stage is None else float(grad_stage),
            -1.0 if weight_stage is None else float(weight_stage), float(meter.peak_bytes())]
        host += worker.last_timings  # [Note: step timings]: the same count on every rank
        mine = torch.cat([torch.tensor(host, dtype=torch.float64, device=device), local_loss])
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        table = torch.stack(gathered).cpu()  # one device-to-host copy; the same on every rank
        step_time = time.perf_counter() - t0  # the whole step: through the all-gather every rank waits for
        n = len(_BREAKDOWN)
        stopping = int(table[:, n].max().item())
        parts_loss = table[:, -1].tolist()  # the ranks' contributions to the global batch's loss
        bad_loss = [r for r, x in enumerate(parts_loss) if not math.isfinite(x)]
        loss_value = sum(parts_loss) if bad_loss else math.fsum(parts_loss)  # exact (fsum refuses inf - inf)
        bad_grads = [(r, int(table[r, n + 1].item())) for r in range(world) if table[r, n + 1] >= 0]
        bad_weights = [(r, int(table[r, n + 2].item())) for r in range(world) if table[r, n + 2] >= 0]
        nonfinite = bool(bad_loss or bad_grads)
        val_loss = None
        if loop.val_every and (step % loop.val_every == 0 or step == loop.steps) and not nonfinite:
            val = torch.zeros(1, dtype=torch.float32, device=device)
            for b in range(loop.val_batches):
                val += worker.eval_step(batch_of(b, split="val"))
            dist.all_reduce(val)
            val_loss = float(val.item()) / loop.val_batches  # the mean of the batches' losses (token means, if so)
        if test.kill_at_step and test.kill_at_step == (rank, step) and not restarted:
            os.kill(os.getpid(), signal.SIGKILL)  # testing: a rank dies mid-run
        if test.fail_rank and test.fail_rank[0] == rank and step >= test.fail_rank[1]:
            os.kill(os.getpid(), signal.SIGKILL)  # testing: a GPU lost for good (every attempt)
        if rank == 0:
            parts = [{"rank": r, "stages": list(plan.stages_of(r)),
                      **{k: (int(x) if k.startswith("buckets") else x) for k, x in zip(_BREAKDOWN, t[:n].tolist())},
                      "memory_peak_bytes": int(t[n + 3].item())}
                     for r, t in enumerate(table)]
            grad_norm = float(worker.last_grad_norm) if worker.last_grad_norm is not None else None
            rec = {"step": step, **identity, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
                   "step_time_s": step_time, "tokens_per_s": plan.tokens_per_step / step_time,
                   "tokens_seen": step * plan.tokens_per_step, "precision": policy.name,
                   "loss_scale": worker.last_loss_scale, "skipped": worker.last_skipped, "ranks": parts}
            if val_loss is not None:
                rec["val_loss"] = val_loss
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()
            slow = ""
            if timings is not None:
                line = timings_line(plan, step, **identity, clock=worker.timer.clock, step_time_s=step_time,
                                    durations=table[:, n + 4:-1].tolist(), starts=table[:, 0].tolist())
                timings.write(json.dumps(line) + "\n")
                timings.flush()
                if world > 1:
                    r, busy = slowest_rank(line)
                    stages = ",".join(map(str, plan.stages_of(r)))
                    slow = f"  slowest rank {r} (stage {stages}, {fmt_seconds(busy)} compute)"
            if writer is not None:
                for k in ("loss", "lr", "grad_norm", "tokens_per_s", "val_loss"):
                    if rec.get(k) is not None:
                        writer.add_scalar(f"train/{k}" if k != "val_loss" else "val/loss", rec[k], step)
            progress.step(step, rec, slow + (f"  val loss {val_loss:.4f}" if val_loss is not None else "")
                          + (f"  loss scale {worker.last_loss_scale:g}" if worker.scaler else "")
                          + ("  (skipped: inf/NaN gradient)" if worker.last_skipped else ""))
        if nonfinite:  # every rank saw the same table: all stop here, no checkpoint of this step
            if progress:
                last = (f"the last checkpoint is {ckpt_root / f'step_{saved}'}" if saved else
                        "no checkpoint was written" + ("" if ckpt.checkpoint_every else
                                                       ": without --checkpoint-every only the last step writes one"))
                print(_nonfinite_message(step, loss_value, bad_loss, bad_grads, bad_weights,
                                         plan.num_stages - 1, last), file=sys.stderr, flush=True)
            break
        # The last step (or the one a signal stops after) always writes one: the trained model is never lost.
        if step == loop.steps or stopping or (ckpt.checkpoint_every and step % ckpt.checkpoint_every == 0):
            path = save_checkpoint(worker, ckpt_root, step, keep=ckpt.keep_checkpoints, run_id=run_id,
                                   plan_hash=identity["plan_hash"] if rank == 0 else "",
                                   model_only=(ckpt.final_checkpoint == "model-only" and step == loop.steps
                                               and not stopping))
            saved = step
            if progress:
                progress.write(f"[zorse] checkpoint {path}")
        if stopping == REBALANCE_STOP:  # [Note: stopping to rebalance] in zorse_fx/rebalance.py
            if progress:
                progress.write(f"[zorse] rebalance requested: stopping after step {step} (checkpoint step_{saved}) "
                               f"to resume under the re-plan")
            break
        if stopping:
            if progress:
                progress.write(f"[zorse] {signal.Signals(stopping).name} received: stopping after step {step} "
                               f"(checkpoint step_{saved})")
            break
    if in_box:
        enter_rank_leaf("host")
    if progress:
        progress.close()
        if start <= loop.steps:  # (a step ran: the table is this run's)
            print(_memory_line(plan, [int(t[n + 3].item()) for t in table], on_cpu=device.type == "cpu"), flush=True)
    if writer is not None:
        writer.close()
    for f in (metrics, timings):
        if f is not None:
            f.close()
    if test.dump_params:
        d = out / "params"
        d.mkdir(parents=True, exist_ok=True)
        torch.save(worker.parameters_by_name(), d / f"rank{rank}.pt")
        torch.save(worker.master_weights(), d / f"rank{rank}_masters.pt")
        (d / f"rank{rank}.json").write_text(json.dumps(worker.optimizer_state_summary()) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    if nonfinite:
        return EXIT_NONFINITE
    return 128 + stopping if stopping and stopping != REBALANCE_STOP else 0


def exit_rank(status: int):
    """End this process with ``status`` the way ``multiprocessing`` ends its
    children: stdio and ``logging`` flushed, then ``os._exit`` -- no
    interpreter finalization, no ``atexit`` handlers, no C++ static
    destructors. Never returns.

    [Note: a rank ends without interpreter finalization]
    ``dist.destroy_process_group()`` does not stop every Gloo group's threads:
    a group a ``P2POp`` (``batch_isend_irecv``) or ``torch.distributed.checkpoint``
    has held keeps its two ``pt_gloo_runloop`` threads and its
    ``gloo_tcp_loop`` thread alive, referenced from C++ (measured here,
    torch 2.13, from ``/proc/self/task/*/comm`` after ``destroy_process_group``
    and ``gc.collect()``). They were alive while the interpreter finalized,
    and twice in CI a torchrun rank that had trained, saved its last
    checkpoint and passed the final barrier died by SIGABRT with
    "terminate called without an active exception" (a C++ ``std::terminate``;
    tests/test_token_data.py and tests/test_run_integrity.py, about one
    torchrun rank exit in a thousand on a loaded 2-core machine). The ranks
    the tests fork (``conftest.spawn_ranks``, multiprocessing) end by
    ``os._exit`` and never showed it. The same class of abort is torch's own
    (a Gloo thread touching Python objects while the interpreter is torn
    down: pytorch/pytorch#179291, #190489), and its fix there was abandoned
    as not simple. By the time ``main`` returns, every file the rank writes
    is closed or flushed (metrics.jsonl after each step, TensorBoard,
    checkpoints, error records) and every collective waited for, so nothing
    is left for finalization to do but tear down those threads' objects: the
    rank skips it."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it
            pass
    logging.shutdown()
    os._exit(status)


if __name__ == "__main__":
    exit_rank(main())
