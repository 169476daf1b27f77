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
Rank 0 writes ``<out>/metrics.jsonl``: one JSON object per step with
``step``, ``loss``, ``step_time_s``, ``tokens_per_s``, ``precision``,
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
from .runtime.launch import rank_device
from .runtime.worker import OptimizerConfig, StageWorker
from .token_data import TokenData, model_vocab_size, plan_rank_samples

__all__ = ["main", "parse_args"]


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
                   help="hold out this fraction of the corpus's sequences (its last ones) for validation")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--out", default="runs/train", help="run directory (metrics.jsonl)")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="train with this precision instead of the plan's (default: the plan's on GPUs, fp32 on CPU)")
    p.add_argument("--grad-reduce-dtype", choices=("float32", "bfloat16"), default=None,
                   help="with --precision: the gradient all-reduce dtype (default: the precision's, float32)")
    p.add_argument("--bucket-mib", type=float, default=25.0,
                   help="gradient all-reduce bucket size in MiB (DDP's bucket_cap_mb; default 25)")
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
    if args.grad_reduce_dtype and not args.precision:
        p.error("--grad-reduce-dtype needs --precision (without it the plan's own reduction dtype is used)")
    if args.precision:
        try:
            precision_policy(args.precision, args.grad_reduce_dtype)
        except ValueError as exc:
            p.error(str(exc))
    if args.inject_inf is not None:
        try:
            args.inject_inf = tuple(int(x) for x in args.inject_inf.split(":"))
            if len(args.inject_inf) != 2 or min(args.inject_inf) < 0:
                raise ValueError
        except ValueError:
            p.error(f"--inject-inf expects RANK:STEP with two integers >= 0, got {args.inject_inf!r}")
    if args.bucket_mib <= 0:
        p.error(f"--bucket-mib must be > 0, got {args.bucket_mib}")
    if not 0.0 <= args.val_fraction < 1.0:
        p.error(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    return args


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


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # one thread per rank: ranks share the host's cores
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = rank_device(backend)
    dist.init_process_group(backend, timeout=timedelta(minutes=10),
                            device_id=device if device.type == "cuda" else None)
    rank, world = dist.get_rank(), dist.get_world_size()
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
    batch_of = partial(data.global_batch, global_batch_size=plan.global_batch_size, seq_len=plan.seq_len,
                       input_names=plan.input_names, label_mode=plan.label_mode,
                       samples=plan_rank_samples(plan, rank), val_fraction=args.val_fraction,
                       allow_repeat=args.allow_repeat)
    batch_of(0)  # a corpus too small for a global batch fails here, before any rank trains
    policy, why = runtime_precision(plan, device, args.precision, args.grad_reduce_dtype)
    worker = StageWorker(
        plan, plan_dir, weights, rank=rank, device=device,
        optimizer=OptimizerConfig(lr=args.lr, weight_decay=args.weight_decay), precision=policy,
        bucket_bytes=max(1, int(args.bucket_mib * 2**20)),
    )
    del weights
    if args.inject_inf and args.inject_inf[0] == rank:
        worker.inject_inf_steps.add(args.inject_inf[1])
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        metrics = open(out / "metrics.jsonl", "w")
    layout = (f"{plan.num_stages} stages" if plan.interleave == 1 else
              f"{plan.num_stages} stages interleaved x{plan.interleave} on {plan.num_groups} GPU groups")
    _log(rank, f"[zorse] {world} ranks ({backend}), {layout}, "
               f"{plan.num_microbatches} micro-batches of {plan.microbatch_size}, {args.steps} steps")
    _log(rank, f"[zorse] precision {policy.name} ({why}): {policy.describe()}")
    _log(rank, f"[zorse] point-to-point: {len(worker.program.groups)} batch_isend_irecv groups per step on rank 0, "
               f"{worker.program.prefetched} receives posted one compute early; gradient buckets: "
               f"{worker.reducer.num_buckets} on rank 0")
    dist.barrier()
    for step in range(1, args.steps + 1):
        batch = batch_of(step - 1)  # only this rank's rows are read; the others are -1
        t0 = time.perf_counter()
        loss = worker.train_step(batch).reshape(1)
        dist.all_reduce(loss)  # on the device: sum of share-weighted contributions = global mean loss
        step_time = time.perf_counter() - t0
        if step == args.dump_grads:
            d = out / "grads"
            d.mkdir(parents=True, exist_ok=True)
            torch.save(worker.gradients(), d / f"rank{rank}.pt")
        mine = torch.tensor([worker.last_breakdown[k] for k in _BREAKDOWN], dtype=torch.float64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        if rank == 0:
            parts = [{"rank": r, "stages": list(plan.stages_of(r)),
                      **{k: (int(x) if k.startswith("buckets") else x) for k, x in zip(_BREAKDOWN, t.tolist())}}
                     for r, t in enumerate(gathered)]
            rec = {"step": step, "loss": float(loss.item()), "step_time_s": step_time,
                   "tokens_per_s": plan.tokens_per_step / step_time, "precision": policy.name,
                   "loss_scale": worker.last_loss_scale, "skipped": worker.last_skipped, "ranks": parts}
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()
            print(f"[zorse] step {step:>3}/{args.steps}  loss {rec['loss']:.4f}  "
                  f"{step_time:.2f} s  {rec['tokens_per_s']:,.0f} tokens/s"
                  + (f"  loss scale {worker.last_loss_scale:g}" if worker.scaler else "")
                  + ("  (skipped: inf/NaN gradient)" if worker.last_skipped else ""), flush=True)
    if args.dump_params:
        d = out / "params"
        d.mkdir(parents=True, exist_ok=True)
        torch.save(worker.parameters_by_name(), d / f"rank{rank}.pt")
        (d / f"rank{rank}.json").write_text(json.dumps(worker.optimizer_state_summary()) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
