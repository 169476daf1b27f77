"""``python -m zorse_fx.train``: run an exported plan, one process per GPU.

Launch with torchrun (one node or many; torch.distributed is the engine, NCCL
on GPUs, Gloo on CPU)::

    torchrun --nproc-per-node 4 -m zorse_fx.train runs/x/plan \\
        --weights runs/x/plan/weights.pt --data runs/x/data/tokens.bin --steps 10 --out runs/x

``--data``: a token file of ``zorse prepare-data`` (``token_data.py``),
memory-mapped; each rank reads only the rows of the global batch it computes
on. ``--tokens``: a legacy ``torch.save`` 1-D integer tensor. Both are
checked against the model's vocabulary (stage 0's embedding) at start-up.

``zorse train`` wraps exactly this command. Each rank reads only plan.json,
its stage source, the weights and the token file; it never imports OR-Tools.
The loop (``--help`` lists the options): AdamW with weight decay on matrices
only, a learning-rate schedule (``runtime/lr_schedule.py``), clipping of the
global gradient norm, validation on held-out batches, checkpoints with
``torch.distributed.checkpoint`` (``runtime/checkpoint.py``: ``--checkpoint-every``,
``--resume``, under another plan of the same model too), resumption after a
torchrun restart (``zorse train --max-restarts``), and SIGTERM/SIGINT handled
at the end of a step on every rank alike (checkpoint, then exit ``128 + signal``).

Rank 0 writes ``<out>/metrics.jsonl`` (continued by ``--resume``; a new run
keeps an earlier file as ``metrics.<n>.jsonl``): one JSON object per step with
``step``, ``loss``, ``lr``, ``grad_norm`` (global, before clipping),
``val_loss`` (on validation steps), ``tokens_seen``, ``step_time_s``, ``tokens_per_s``, ``precision``,
``loss_scale`` and ``skipped`` (fp16-mixed: the scale the step used, and
whether every rank skipped it for an inf/NaN gradient) and ``ranks``: per rank
the seconds spent in the pipeline schedule (``pipeline_s``), waiting for the
gradient all-reduce still in flight after it (``allreduce_s``; the rest
overlapped the backward), the optimizer step (``optimizer_s``) and the
parameter all-gather of a ZeRO-1 stage (``allgather_s``, 0 elsewhere), and its
gradient buckets (``buckets``) of which ``buckets_during_backward`` were
launched while the backward was still running, each over all the stages the
rank hosts (``stages``: several in an interleaved
plan, see [Note: a rank with several stages] in ``runtime/worker.py``).
``--dump-grads`` / ``--dump-params`` save one file per rank, by canonical
parameter name over the rank's stages.

Precision (``--precision``): the plan's (``Plan.precision``) on GPUs; on a
CPU run, fp32 unless asked -- bf16 autocast runs on CPUs, slowly without
bf16 hardware, and float16 matmuls on a CPU are slower still.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from .errors import RuntimeExecutionError
from .plan import Plan
from .precision import PRECISIONS, precision_policy
from .runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .runtime.launch import init_process_group, rank_device
from .runtime.lr_schedule import LR_SCHEDULES, LRSchedule
from .runtime.watchdog import heartbeat_dir, start_heartbeat
from .runtime.worker import OptimizerConfig, StageWorker
from .token_data import TokenData, model_vocab_size, plan_rank_samples

__all__ = ["main", "parse_args", "add_training_options", "check_training_options", "training_argv"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m zorse_fx.train", description=__doc__.split("\n")[0])
    p.add_argument("plan", help="plan directory (plan.json + stage_<i>.py) or plan.json")
    p.add_argument("--weights", help="weights file (torch.save of {name: tensor}); default: <plan>/weights.pt")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="token file written by `zorse prepare-data` (<name>.bin or its <name>.json "
                                    "header); each rank reads only its samples")
    src.add_argument("--tokens", help="legacy: torch.save file of a 1-D integer token tensor")
    p.add_argument("--allow-repeat", action="store_true",
                   help="allow a corpus smaller than one global batch (samples repeat within a step)")
    p.add_argument("--val-fraction", type=float, default=0.0,
                   help="hold out this fraction of the corpus's sequences (its last ones) for validation "
                        "(default: with --val-every, the last --val-batches global batches)")
    p.add_argument("--steps", type=int, default=10, help="total training steps (a resumed run counts from step 1)")
    p.add_argument("--out", default="runs/train", help="run directory (metrics.jsonl, checkpoints/)")
    add_training_options(p)
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="train with this precision instead of the plan's (default: the plan's on GPUs, fp32 on CPU)")
    p.add_argument("--grad-reduce-dtype", choices=("float32", "bfloat16"), default=None,
                   help="with --precision: the gradient all-reduce dtype (default: the precision's, float32)")
    p.add_argument("--bucket-mib", type=float, default=25.0,
                   help="gradient all-reduce bucket size in MiB (DDP's bucket_cap_mb; default 25)")
    p.add_argument("--kill-at-step", default=None, metavar="RANK:STEP",
                   help="testing: in the first attempt (not after a torchrun restart), rank RANK sends itself "
                        "SIGKILL after STEP")
    p.add_argument("--pg-timeout-min", type=float, default=10.0,
                   help="minutes a collective may wait for a peer before the process group fails (default 10)")
    p.add_argument("--heartbeat-s", type=float, default=1.0,
                   help="seconds between the rank's heartbeats in <out>/.heartbeat (runtime/watchdog.py; 0: off)")
    p.add_argument("--inject-inf", default=None, metavar="RANK:STEP",
                   help="testing: after STEP's gradient reduction, rank RANK writes an inf into a gradient")
    p.add_argument("--dump-grads", type=int, default=0, metavar="STEP",
                   help="after this step, each rank saves its reduced gradients (all its stages, by "
                        "canonical name) to <out>/grads/rank<r>.pt (testing)")
    p.add_argument("--dump-params", action="store_true",
                   help="save each rank's parameters (all its stages) at the end to <out>/params/rank<r>.pt, "
                        "and the elements and bytes of its optimizer state (per stage: key 'stages') to "
                        "<out>/params/rank<r>.json (testing)")
    args = p.parse_args(argv)
    check_training_options(p, args)
    if args.grad_reduce_dtype and not args.precision:
        p.error("--grad-reduce-dtype needs --precision (without it the plan's own reduction dtype is used)")
    if args.precision:
        try:
            precision_policy(args.precision, args.grad_reduce_dtype)
        except ValueError as exc:
            p.error(str(exc))
    for name in ("inject_inf", "kill_at_step"):
        value = getattr(args, name)
        if value is not None:
            try:
                pair = tuple(int(x) for x in value.split(":"))
                if len(pair) != 2 or min(pair) < 0:
                    raise ValueError
            except ValueError:
                p.error(f"--{name.replace('_', '-')} expects RANK:STEP with two integers >= 0, got {value!r}")
            setattr(args, name, pair)
    if args.pg_timeout_min <= 0 or args.heartbeat_s < 0:
        p.error(f"--pg-timeout-min must be > 0 and --heartbeat-s >= 0, got {args.pg_timeout_min}, {args.heartbeat_s}")
    if args.bucket_mib <= 0:
        p.error(f"--bucket-mib must be > 0, got {args.bucket_mib}")
    if not 0.0 <= args.val_fraction < 1.0:
        p.error(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    return args


def add_training_options(p: argparse.ArgumentParser) -> None:
    """The options of the training loop, shared by ``zorse train`` and
    ``python -m zorse_fx.train`` (the defaults are nanoGPT's where it has one)."""
    g = p.add_argument_group("optimizer and schedule")
    g.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (AdamW)")
    g.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant",
                   help="learning-rate schedule after the warm-up (default constant)")
    g.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up steps (default 0)")
    g.add_argument("--min-lr", type=float, default=0.0, help="the rate cosine/linear decay ends at (default 0)")
    g.add_argument("--weight-decay", type=float, default=0.0,
                   help="AdamW weight decay, on matrices only (no decay on norms, biases, 1-D parameters)")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad-norm", type=float, default=None, metavar="MAX",
                   help="clip the global gradient norm (all stages and data-parallel groups) to MAX")
    g.add_argument("--seed", type=int, default=0, help="torch RNG seed of every rank (dropout; default 0)")
    g = p.add_argument_group("evaluation and logging")
    g.add_argument("--val-every", type=int, default=0, metavar="N",
                   help="validation loss on the held-out split every N steps and after the last (0: never)")
    g.add_argument("--val-batches", type=int, default=1, help="global batches per validation (default 1)")
    g.add_argument("--tensorboard", action="store_true", help="also write TensorBoard scalars to <out>/tensorboard")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="save a checkpoint to <out>/checkpoints/step_<k> every N steps and at the end (0: never); "
                        "with it, SIGTERM saves one before the ranks exit")
    g.add_argument("--keep-checkpoints", type=int, default=3, metavar="K", help="keep the newest K (default 3)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in <out>/checkpoints (any plan of the same "
                        "model, global batch and sequence length); metrics.jsonl is continued")


def training_argv(args: argparse.Namespace) -> list[str]:
    """The training-loop options of ``args`` (parsed by a parser that
    ``add_training_options`` extended, e.g. ``zorse train``'s) as the flags
    ``python -m zorse_fx.train`` takes; options left at their default are
    omitted."""
    p = argparse.ArgumentParser(add_help=False)
    add_training_options(p)
    out: list[str] = []
    for action in p._actions:
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[-1]
        out += [flag] if isinstance(action, argparse._StoreTrueAction) else [flag, str(value)]
    return out


def check_training_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``p.error`` (exit 2, the option named) for values the loop cannot use."""
    try:
        LRSchedule(name=args.lr_schedule, lr=args.lr, min_lr=args.min_lr, warmup_steps=args.warmup_steps,
                   total_steps=max(1, args.steps))
    except ValueError as exc:
        p.error(str(exc))
    for name in ("steps", "val_batches", "keep_checkpoints"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("val_every", "checkpoint_every"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0 (0: never), got {getattr(args, name)}")
    if args.clip_grad_norm is not None and not args.clip_grad_norm > 0:
        p.error(f"--clip-grad-norm must be > 0, got {args.clip_grad_norm}")
    if args.weight_decay < 0:
        p.error(f"--weight-decay must be >= 0, got {args.weight_decay}")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(args, name)}")
    if not args.adam_eps > 0:
        p.error(f"--adam-eps must be > 0, got {args.adam_eps}")


def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, flush=True)


def runtime_precision(plan: Plan, device: torch.device, asked: str | None, reduce_dtype: str | None = None):
    """(policy to train with, why): ``asked`` (with ``reduce_dtype``, else the
    plan's when it is the plan's precision), else the plan's on a GPU, else
    fp32 on a CPU.

    Raises:
        ValueError: a reduction dtype the precision does not allow."""
    planned, reduce = plan.precision, plan.grad_reduce_dtype
    if asked is not None:
        return precision_policy(asked, reduce_dtype or (reduce if asked == planned else None)), "--precision"
    if device.type == "cpu" and planned != "fp32":
        return precision_policy("fp32"), f"the plan's {planned} is for its GPUs; this is a CPU run"
    return precision_policy(planned, reduce), "the plan's"


_BREAKDOWN = ("pipeline_s", "allreduce_s", "optimizer_s", "allgather_s", "buckets", "buckets_during_backward")


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


def _metrics_file(out: Path, resumed_step: int | None):
    """metrics.jsonl, continued after ``resumed_step`` (later lines, from steps
    the interrupted run did after its last checkpoint, are dropped), or
    started anew with an earlier file kept as metrics.<n>.jsonl."""
    path = out / "metrics.jsonl"
    if resumed_step is not None and path.exists():
        kept = [ln for ln in path.read_text().splitlines()
                if ln.strip() and json.loads(ln).get("step", 0) <= resumed_step]
        path.write_text("".join(ln + "\n" for ln in kept))
        return open(path, "a")
    if path.exists() and path.stat().st_size:
        n = 1
        while (out / f"metrics.{n}.jsonl").exists():
            n += 1
        path.rename(out / f"metrics.{n}.jsonl")
        print(f"[zorse] an earlier {path} was kept as metrics.{n}.jsonl (use --resume to continue a run)",
              flush=True)
    return open(path, "w")


class _Progress:
    """Rank 0's progress: a tqdm bar (loss, tokens/s, ETA) on a terminal, one
    line per step otherwise (logs, tests)."""

    def __init__(self, total: int, start: int):
        self.bar = None
        if sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc="[zorse] train", unit="step", dynamic_ncols=True)
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
    args = parse_args(argv)
    torch.set_num_threads(1)  # one thread per rank: ranks share the host's cores
    stop = _Stop()
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = rank_device(backend)
    init_process_group(backend, timeout=timedelta(minutes=args.pg_timeout_min),  # restart-safe (--max-restarts)
                       device_id=device if device.type == "cuda" else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.heartbeat_s:  # the launcher's stall monitor reads these (zorse train --stall-timeout)
        start_heartbeat(heartbeat_dir(args.out), rank, interval_s=args.heartbeat_s)
    torch.manual_seed(args.seed)
    plan_path = Path(args.plan)
    plan_dir = plan_path if plan_path.is_dir() else plan_path.parent
    plan = Plan.load(plan_path)
    if world != plan.world_size:
        raise RuntimeExecutionError(
            f"the plan needs {plan.world_size} processes (one per GPU) but torchrun started {world}; "
            f"use --nproc-per-node {plan.world_size} on one node (or that many in total)"
        )
    weights_path = Path(args.weights) if args.weights else plan_dir / "weights.pt"
    if not weights_path.exists():
        raise RuntimeExecutionError(f"weights file {weights_path} not found; pass --weights or export with `zorse plan`")
    weights = torch.load(weights_path, mmap=True, weights_only=True)
    data = TokenData.load(args.data or args.tokens)  # memory-mapped; see token_data.py
    vocab = model_vocab_size(plan, weights)
    if vocab is not None:
        data.check_vocab(vocab)
    # The held-out split: --val-fraction, else (with --val-every) the last --val-batches global batches.
    held = dict(val_fraction=args.val_fraction) if args.val_fraction else dict(
        val_tokens=args.val_batches * plan.global_batch_size * (plan.seq_len + 1) if args.val_every else 0)
    batch_of = partial(data.global_batch, global_batch_size=plan.global_batch_size, seq_len=plan.seq_len,
                       input_names=plan.input_names, label_mode=plan.label_mode,
                       samples=plan_rank_samples(plan, rank), allow_repeat=args.allow_repeat, **held)
    batch_of(0)  # a corpus too small for a global batch fails here, before any rank trains
    policy, why = runtime_precision(plan, device, args.precision, args.grad_reduce_dtype)
    worker = StageWorker(
        plan, plan_dir, weights, rank=rank, device=device,
        optimizer=OptimizerConfig(lr=args.lr, weight_decay=args.weight_decay,
                                  betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps),
        precision=policy, bucket_bytes=max(1, int(args.bucket_mib * 2**20)), weights_source=str(weights_path),
    )
    del weights
    if args.inject_inf and args.inject_inf[0] == rank:
        worker.inject_inf_steps.add(args.inject_inf[1])
    schedule = LRSchedule(name=args.lr_schedule, lr=args.lr, min_lr=args.min_lr, warmup_steps=args.warmup_steps,
                          total_steps=args.steps)
    out = Path(args.out)
    ckpt_root = out / "checkpoints"
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    resumed_step = None
    if args.resume or restarted:
        latest = latest_checkpoint(ckpt_root)
        if latest is None:
            _log(rank, f"[zorse] no complete checkpoint in {ckpt_root}: starting at step 1")
        else:
            manifest = load_checkpoint(worker, latest)
            resumed_step = manifest["step"]
            if manifest["world_size"] != world:  # RNG states are per rank: re-seed
                torch.manual_seed(args.seed + resumed_step)
            _log(rank, f"[zorse] resumed from {latest} (step {resumed_step}, written on {manifest['world_size']} "
                       f"ranks{'' if manifest['world_size'] == world else ', now ' + str(world)})"
                       + (f" after torchrun restart {restarted}" if restarted else ""))
    start = (resumed_step or 0) + 1
    metrics = writer = progress = None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        metrics = _metrics_file(out, resumed_step)
        if args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(str(out / "tensorboard"))
    layout = (f"{plan.num_stages} stages" if plan.interleave == 1 else
              f"{plan.num_stages} stages interleaved x{plan.interleave} on {plan.num_groups} GPU groups")
    _log(rank, f"[zorse] {world} ranks ({backend}), {layout}, "
               f"{plan.num_microbatches} micro-batches of {plan.microbatch_size}, steps {start}..{args.steps}")
    _log(rank, f"[zorse] precision {policy.name} ({why}): {policy.describe()}")
    _log(rank, f"[zorse] point-to-point: {len(worker.program.groups)} batch_isend_irecv groups per step on rank 0, "
               f"{worker.program.prefetched} receives posted one compute early; gradient buckets: "
               f"{worker.reducer.num_buckets} on rank 0")
    _log(rank, f"[zorse] AdamW lr {args.lr:g} ({args.lr_schedule}, warm-up {args.warmup_steps}, min {args.min_lr:g}), "
               f"weight decay {args.weight_decay:g} on matrices, clip "
               f"{args.clip_grad_norm if args.clip_grad_norm else 'off'}, seed {args.seed}")
    dist.barrier()
    if rank == 0:
        progress = _Progress(args.steps, start - 1)
    saved = resumed_step
    for step in range(start, args.steps + 1):
        batch = batch_of(step - 1)  # only this rank's rows are read; the others are -1
        lr = schedule(step)
        t0 = time.perf_counter()
        loss = worker.train_step(batch, lr=lr, max_grad_norm=args.clip_grad_norm).reshape(1)
        dist.all_reduce(loss)  # on the device: sum of share-weighted contributions = global mean loss
        step_time = time.perf_counter() - t0
        if step == args.dump_grads:
            d = out / "grads"
            d.mkdir(parents=True, exist_ok=True)
            torch.save(worker.gradients(), d / f"rank{rank}.pt")
        mine = torch.tensor([worker.last_breakdown[k] for k in _BREAKDOWN] + [float(stop.signal)],
                            dtype=torch.float64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        stopping = int(torch.stack(gathered)[:, -1].max().item())  # one device-to-host copy
        val_loss = None
        if args.val_every and (step % args.val_every == 0 or step == args.steps):
            val = torch.zeros(1, dtype=torch.float32, device=device)
            for b in range(args.val_batches):
                val += worker.eval_step(batch_of(b, split="val"))
            dist.all_reduce(val)
            val_loss = float(val.item()) / args.val_batches
        if args.kill_at_step and args.kill_at_step == (rank, step) and not restarted:
            os.kill(os.getpid(), signal.SIGKILL)  # testing: a rank dies mid-run
        if rank == 0:
            parts = [{"rank": r, "stages": list(plan.stages_of(r)),
                      **{k: (int(x) if k.startswith("buckets") else x) for k, x in zip(_BREAKDOWN, t.tolist())}}
                     for r, t in enumerate(gathered)]
            grad_norm = float(worker.last_grad_norm) if worker.last_grad_norm is not None else None
            rec = {"step": step, "loss": float(loss.item()), "lr": lr, "grad_norm": grad_norm,
                   "step_time_s": step_time, "tokens_per_s": plan.tokens_per_step / step_time,
                   "tokens_seen": step * plan.tokens_per_step, "precision": policy.name,
                   "loss_scale": worker.last_loss_scale, "skipped": worker.last_skipped, "ranks": parts}
            if val_loss is not None:
                rec["val_loss"] = val_loss
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()
            if writer is not None:
                for k in ("loss", "lr", "grad_norm", "tokens_per_s", "val_loss"):
                    if rec.get(k) is not None:
                        writer.add_scalar(f"train/{k}" if k != "val_loss" else "val/loss", rec[k], step)
            progress.step(step, rec, (f"  val loss {val_loss:.4f}" if val_loss is not None else "")
                          + (f"  loss scale {worker.last_loss_scale:g}" if worker.scaler else "")
                          + ("  (skipped: inf/NaN gradient)" if worker.last_skipped else ""))
        if args.checkpoint_every and (step % args.checkpoint_every == 0 or step == args.steps or stopping):
            path = save_checkpoint(worker, ckpt_root, step, keep=args.keep_checkpoints)
            saved = step
            if progress:
                progress.write(f"[zorse] checkpoint {path}")
        if stopping:
            if progress:
                progress.write(f"[zorse] {signal.Signals(stopping).name} received: stopping after step {step}"
                               + (f" (checkpoint step_{saved})" if args.checkpoint_every else ""))
            break
    if progress:
        progress.close()
    if writer is not None:
        writer.close()
    if args.dump_params:
        d = out / "params"
        d.mkdir(parents=True, exist_ok=True)
        torch.save(worker.parameters_by_name(), d / f"rank{rank}.pt")
        (d / f"rank{rank}.json").write_text(json.dumps(worker.optimizer_state_summary()) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 128 + stopping if stopping else 0


if __name__ == "__main__":
    sys.exit(main())
