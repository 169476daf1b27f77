"""The ``zorse`` command line.

    zorse plan  --model smollm2-135m --cluster examples/clusters/demo.yaml \\
                --global-batch-size 8 --seq-len 64 -o runs/x/plan
    zorse prepare-data lee --tokenizer smollm2-135m -o runs/x/data/lee   # -> lee.bin + lee.json
    zorse train runs/x/plan --data runs/x/data/lee.bin --steps 10 --out runs/x
    zorse train runs/x/plan --corpus lee --tokenizer smollm2-135m --steps 10 --out runs/x  # prepares, then trains
    zorse show  runs/x/plan          # print a plan's table and schedule grid
    zorse simulate runs/x/plan --model ... --cluster ...  # timeline: Perfetto JSON + Gantt PNG
    zorse bench kernels --model smollm2-135m -o profiles/<type>.json   # kernel profile
    zorse bench comm --out profiles/comm.json                          # link alpha-beta fits

``zorse train`` starts one local process per planned GPU with torchrun; on a
real multi-node cluster run the printed ``torchrun ... -m zorse_fx.train``
command on every node instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .errors import ZorseError
from .precision import GRAD_REDUCE_DTYPES, PRECISIONS

__all__ = ["main"]


def _load_model(name: str):
    from .models.registry import load_model

    try:
        return load_model(name)
    except ValueError as exc:
        raise SystemExit(f"zorse: {exc}") from exc


def cmd_plan(args) -> int:
    import zorse_fx as zorse

    model, _ = _load_model(args.model)
    ids = torch.randint(0, 200, (2, args.seq_len))
    compiled = zorse.compile(
        model, cluster=args.cluster, example_inputs=(ids, ids), global_batch_size=args.global_batch_size,
        max_stages=args.max_stages, schedule=args.schedule, time_limit_s=args.time_limit, planner=args.planner,
        max_interleave=args.max_interleave, precision=args.precision, grad_reduce_dtype=args.grad_reduce_dtype,
        verbose=True, model_name=args.model,
    )
    print(compiled.plan.table())
    path = compiled.plan.export(args.output)
    weights = compiled.save_weights(args.output)
    print(f"[zorse] wrote {path}, {len(compiled.plan.stages)} stage sources and {weights}")
    return 0


def cmd_prepare_data(args) -> int:
    from .token_data import prepare_data

    prepare_data(args.source, args.out, tokenizer=args.tokenizer, text_field=args.text_field, fmt=args.format,
                 split=args.split, max_tokens=args.max_tokens)
    return 0


def cmd_train(args) -> int:
    from .plan import Plan
    from .runtime.launch import launch, torchrun_command
    from .token_data import prepare_data, token_file_paths

    plan = Plan.load(args.plan)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = args.data
    if data is None:  # --corpus / --tokenizer: prepare the token file first
        data = str(token_file_paths(out / "data" / "tokens")[0])
        prepare_data(args.corpus, out / "data" / "tokens", tokenizer=args.tokenizer)
    train_args = ["--data", data, "--steps", str(args.steps), "--lr", str(args.lr), "--out", str(out)]
    if args.precision:
        train_args += ["--precision", args.precision]
    if args.allow_repeat:
        train_args += ["--allow-repeat"]
    if args.val_fraction:
        train_args += ["--val-fraction", str(args.val_fraction)]
    nproc = args.nproc or plan.world_size
    print("[zorse] " + " ".join(torchrun_command(args.plan, nproc, train_args)))
    launch(args.plan, nproc, train_args)
    return 0


def cmd_show(args) -> int:
    from .plan import Plan
    from .runtime.schedule import format_grid, make_schedule

    plan = Plan.load(args.plan)
    print(plan.table())
    print(format_grid(make_schedule(plan.schedule, plan.num_stages, plan.num_microbatches, plan.interleave)))
    return 0


def cmd_simulate(args) -> int:
    """Simulate an exported plan's step: summary, Perfetto trace and Gantt PNG."""
    from .api import _is_hf_causal_lm
    from .capture import capture
    from .cluster import Cluster
    from .models.hf import CausalLMWithLoss
    from .plan import Plan
    from .planner import PlanOptions, _analyse_and_price, _device_graph, _solver_options
    from .sim import gantt_png, simulate, to_perfetto
    from .sim.engine import plan_decision

    plan = Plan.load(args.plan)
    cluster = Cluster.from_yaml(args.cluster)
    model, _ = _load_model(args.model)
    if _is_hf_causal_lm(model):
        model = CausalLMWithLoss(model)
    ids = torch.randint(0, 200, (2, plan.seq_len))
    options = PlanOptions(global_batch_size=plan.global_batch_size, schedule=plan.schedule,
                          max_stages=plan.num_groups, max_interleave=plan.interleave,
                          precision=plan.precision, grad_reduce_dtype=plan.grad_reduce_dtype)
    _, costs, _ = _analyse_and_price(capture(model, (ids, ids)), cluster, options)
    decision = plan_decision(plan, costs)  # the plan's memory policy (ZeRO-1 shards, recomputation) too
    result = simulate(costs, _device_graph(cluster, options), _solver_options(options), **decision)
    labels = [f"{g.type}@{g.node}" for g in cluster.gpus]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    to_perfetto(result, out / "trace.json", gpu_labels=labels)
    gantt_png(result, out / "gantt.png", gpu_labels=labels)
    print(f"[zorse] simulated step {result.step_time_s * 1e3:.1f} ms (plan predicted "
          f"{plan.predicted_step_time_s * 1e3:.1f} ms), bubble {result.bubble_fraction:.0%}")
    for s, shards in zip(plan.stages, result.state_shard_bytes):
        policy = " (recompute)" if result.stage_recompute[s.index] else ""
        for g, shard in zip(s.gpus, shards):
            zero = f", ZeRO-1 shard {shard / 2**30:.2f} GiB" if result.stage_sharded[s.index] else ""
            print(f"  stage {s.index}{policy} rank {g.rank} {g.gpu_type:>10}: busy {result.busy_fraction[g.gpu]:.0%}, "
                  f"peak memory {result.peak_memory_bytes[g.gpu] / 2**30:.2f} GiB{zero}")
    print(f"[zorse] wrote {out / 'trace.json'} (open in ui.perfetto.dev) and {out / 'gantt.png'}")
    return 0


def cmd_bench(args) -> int:
    if args.what == "kernels":
        from .profiling.kernels_main import main as kernels_main

        return kernels_main(args.rest)
    from .profiling.comm_launch import run_comm_bench

    nproc = args.nproc or 2
    rest = list(args.rest)
    out = "profiles/comm.json"
    if "--out" in rest:
        i = rest.index("--out")
        out = rest[i + 1]
        del rest[i : i + 2]
    run_comm_bench(nproc, out, rest)
    return 0


#: Longest error message printed (characters); the rest is counted, not shown.
MAX_ERROR_CHARS = 2000


def _one_line(exc: BaseException) -> str:
    """``exc``'s message for the terminal, cut to ``MAX_ERROR_CHARS``."""
    msg = str(exc) or type(exc).__name__
    if len(msg) > MAX_ERROR_CHARS:
        msg = f"{msg[:MAX_ERROR_CHARS]}... ({len(msg) - MAX_ERROR_CHARS} characters more; --debug shows all)"
    return msg


def main(argv=None) -> int:
    """The ``zorse`` command. Returns the exit status: 0; 1 after an error,
    printed on stderr as ``zorse: <message>`` (``zorse --debug ...``: the
    exception propagates with its traceback instead); 130 on Ctrl-C.
    Usage mistakes exit 2 through argparse."""
    from . import __version__

    p = argparse.ArgumentParser(prog="zorse", description="Heterogeneous-cluster training planner and runtime.")
    p.add_argument("--version", action="version", version=f"zorse_fx {__version__} (torch {torch.__version__})")
    p.add_argument("--debug", action="store_true", help="on an error, show the Python traceback")
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("plan", help="model + cluster -> exported plan (plan.json, stage_<i>.py, weights.pt)")
    pp.add_argument("--model", required=True, help="smollm2-135m | gpt | module:factory")
    pp.add_argument("--cluster", required=True, help="cluster YAML file")
    pp.add_argument("--global-batch-size", type=int, required=True)
    pp.add_argument("--seq-len", type=int, default=64)
    pp.add_argument("--max-stages", type=int, default=4)
    pp.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    pp.add_argument("--max-interleave", type=int, default=4,
                    help="most stages per GPU group (interleaved 1F1B) the planner tries; 1 = none")
    pp.add_argument("--time-limit", type=float, default=10.0, help="CP-SAT seconds per candidate")
    pp.add_argument("--planner", default="auto", choices=("auto", "cpsat", "grouped", "stage_dp", "brute_force"),
                    help="auto: CP-SAT checked against the stage DP and the baselines; stage_dp: the DP alone (fast)")
    pp.add_argument("--precision", default="auto", choices=("auto", *PRECISIONS),
                    help="training precision; auto: bf16-mixed where every GPU supports bfloat16, else fp16-mixed")
    pp.add_argument("--grad-reduce-dtype", default=None, choices=GRAD_REDUCE_DTYPES,
                    help="dtype of the gradient all-reduce (default float32; bfloat16 needs bf16-mixed)")
    pp.add_argument("-o", "--output", required=True, help="plan directory to write")
    pp.set_defaults(fn=cmd_plan)
    pt = sub.add_parser("train", help="run an exported plan with torchrun (one process per GPU)")
    pt.add_argument("plan")
    pt.add_argument("--data", default=None, help="token file of `zorse prepare-data` (<name>.bin or <name>.json); "
                                                 "without it --corpus is tokenized into <out>/data/tokens.bin first")
    pt.add_argument("--corpus", default="lee", help="without --data: any prepare-data source ('lee', a text file, "
                                                   "a directory, a datasets file)")
    pt.add_argument("--tokenizer", default="bytes", help="without --data: bytes | smollm2-135m | a Hugging Face "
                                                        "tokenizer directory or hub name")
    pt.add_argument("--allow-repeat", action="store_true",
                    help="allow a corpus smaller than one global batch (samples repeat within a step)")
    pt.add_argument("--val-fraction", type=float, default=0.0,
                    help="hold out this fraction of the sequences (the last ones) for validation")
    pt.add_argument("--steps", type=int, default=10)
    pt.add_argument("--lr", type=float, default=1e-4)
    pt.add_argument("--nproc", type=int, default=0, help="processes (default: the plan's GPU count)")
    pt.add_argument("--out", default="runs/train")
    pt.add_argument("--precision", choices=("fp32", "bf16-mixed", "fp16-mixed"), default=None,
                    help="train with this precision (default: the plan's on GPUs, fp32 on a CPU)")
    pt.set_defaults(fn=cmd_train)
    pd = sub.add_parser("prepare-data", help="tokenize text / a datasets dataset into a memory-mapped token file",
                        description="Writes <out>.bin (uint16 ids when the vocabulary is < 65536, else uint32) "
                                    "and its header <out>.json; see zorse_fx/token_data.py.")
    pd.add_argument("source", help="'lee', a text file (one document), a directory of *.txt files (each a "
                                   "document) or written by Dataset.save_to_disk, or a .json/.jsonl/.parquet/.csv "
                                   "file (one document per row)")
    pd.add_argument("-o", "--out", required=True, help="output path without suffix: writes <out>.bin and <out>.json")
    pd.add_argument("--tokenizer", default="bytes",
                    help="bytes | smollm2-135m | a Hugging Face tokenizer directory (save_pretrained) or hub name "
                         "(hub names need network access or the local Hugging Face cache)")
    pd.add_argument("--text-field", default="text", help="datasets sources: the column holding the text")
    pd.add_argument("--format", default="auto", choices=("auto", "document", "text", "json", "parquet", "csv", "disk"),
                    help="how to read the source; auto: by suffix / directory contents; document: a file is one "
                         "document; text: one document per line (datasets' text builder)")
    pd.add_argument("--split", default="train", help="split of a saved DatasetDict")
    pd.add_argument("--max-tokens", type=int, default=None, help="keep only the first this many tokens")
    pd.set_defaults(fn=cmd_prepare_data)
    ps = sub.add_parser("show", help="print a plan's table and schedule")
    ps.add_argument("plan")
    ps.set_defaults(fn=cmd_show)
    pm = sub.add_parser("simulate", help="event-driven simulation of a plan's step: trace + Gantt chart")
    pm.add_argument("plan")
    pm.add_argument("--model", required=True, help="the model the plan was made for (as in `zorse plan`)")
    pm.add_argument("--cluster", required=True)
    pm.add_argument("--out", default="runs/simulate")
    pm.set_defaults(fn=cmd_simulate)
    pb = sub.add_parser("bench", help="measure this machine: `kernels` (kernel profile) or `comm` (links)",
                        description="zorse bench kernels --help / zorse bench comm --help for their options")
    pb.add_argument("what", choices=("kernels", "comm"))
    pb.add_argument("--nproc", type=int, default=0, help="comm: local ranks to start (default 2)")
    pb.add_argument("rest", nargs=argparse.REMAINDER, help="options of the sweep")
    pb.set_defaults(fn=cmd_bench)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("zorse: interrupted", file=sys.stderr)
        return 130
    except ZorseError as exc:  # a bad input: the message says what to change
        if args.debug:
            raise
        print(f"zorse: {_one_line(exc)}", file=sys.stderr)
        return 1
    except Exception as exc:  # anything else may be a bug in zorse_fx: say how to see where
        if args.debug:
            raise
        print(f"zorse: {type(exc).__name__}: {_one_line(exc)} (rerun as `zorse --debug ...` for the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
