"""The ``zorse`` command line.

    zorse plan  --model smollm2-135m --cluster examples/clusters/demo.yaml \\
                --global-batch-size 8 --seq-len 64 -o runs/x/plan
    zorse prepare-data lee --tokenizer smollm2-135m -o runs/x/data/lee   # -> lee.bin + lee.json
    zorse train runs/x/plan --data runs/x/data/lee.bin --steps 10 --out runs/x
    zorse train runs/x/plan --corpus lee --tokenizer smollm2-135m --steps 10 --out runs/x  # prepares, then trains
    zorse show  runs/x/plan          # print a plan's table and schedule grid
    zorse simulate runs/x/plan --model ... --cluster ...  # runs/x/plan/simulate/: Perfetto JSON + Gantt PNG
    zorse bench kernels --model smollm2-135m -o profiles/<type>.json   # kernel profile
    zorse bench comm --nproc 2 --out profiles/comm.json                # link alpha-beta fits, `links:`
    zorse box up examples/clusters/small_hetero.yaml   # the cluster emulated here (root): zorse box run/down

``zorse train`` starts one local process per planned GPU with torchrun and
supervises it (``runtime/launch.py``, [Note: stopping a job]): SIGINT/SIGTERM
stop every rank, a stalled rank is named and stops the job. Its options are
``python -m zorse_fx.train``'s (``train_options.py``: the same records, flags
and checks, parsed by tyro) plus the launcher's (``LaunchOptions``); the
ranks get theirs as ``<out>/train_options.json`` (``--options-file``). On a
multi-node cluster run ``zorse train --nnodes N --node-rank K --master-addr
HOST`` on each of the plan's nodes (``--out`` on a shared path), which starts
that node's ranks ([Note: one zorse train per node] in ``runtime/launch.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
import tyro

from .errors import ZorseError
from .models.registry import MODEL_HELP
from .options import PlanOptions
from .cli_runs import (_load_model, cmd_calibrate, cmd_eval, cmd_export, cmd_show, cmd_simulate,  # noqa: F401
                       cmd_timings)
from .train_options import (NODE_LOST_AFTER_S, OPTIONS_FILE, OptionValueError, TrainingOptions, TrainingRecords,
                            UsageError, parse_flags, write_options_file)

__all__ = ["main", "build_parser", "LaunchOptions", "TrainCommand", "PlanInputs", "PlanCommand", "PLAN_FLAG_ALIASES"]

#: ``--no-cache``'s help, for every command that captures a model.
NO_CACHE_HELP = ("capture the model afresh and write nothing to the capture cache (default: a Hugging Face model's "
                 "exported graph is kept in ~/.cache/zorse_fx/capture, or $ZORSE_CACHE_DIR, keyed by its code, "
                 "configuration, shapes and versions; zorse_fx/capture/cache.py)")


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """``zorse plan``'s own inputs, beside the planner's options (``PlanOptions``): the model, the cluster, the
    sample length and where the plan goes."""

    model: Annotated[str, tyro.conf.arg(metavar="NAME", help=MODEL_HELP)]
    cluster: Annotated[str, tyro.conf.arg(metavar="FILE", help="cluster YAML file")]
    seq_len: Annotated[int, tyro.conf.arg(metavar="N", help="tokens per sample (at most the model's positions)")] = 64
    output: Annotated[str, tyro.conf.arg(aliases=("-o",), metavar="DIR", help=(
        "plan directory to write: a new or empty one, or an older plan's, which is replaced whole"))]
    no_cache: Annotated[bool, tyro.conf.arg(help=NO_CACHE_HELP)] = False


@dataclass(frozen=True, kw_only=True)
class PlanCommand:
    """``zorse plan``'s command line: its inputs and every field of ``PlanOptions``, each flag named after its
    field, its help the field's documentation."""

    plan: PlanInputs
    """what to plan and where the plan goes"""
    planner: Annotated[PlanOptions, tyro.conf.arg(help="zorse_fx.options.PlanOptions, what zorse.compile takes")]


#: Flags ``zorse plan`` had before its options came from ``PlanOptions``, read as the field's flag (the README's
#: and earlier sessions' commands keep working).
PLAN_FLAG_ALIASES = {"--time-limit": "--time-limit-s", "--use-all-gpus": "--no-allow-idle-gpus"}


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """``zorse train``'s own options: the token file it prepares, and how it
    starts and supervises torchrun (``runtime/launch.py``)."""

    nproc: int = 0
    """processes to start on this machine (0: the plan's GPU count)"""
    corpus: Annotated[str | None, tyro.conf.arg(metavar="SOURCE", help=(
        "instead of --data/--tokens: a corpus to tokenize into <out>/data/tokens.bin first, any prepare-data source "
        "('lee', a text file, a directory, a datasets file)"))] = None
    tokenizer: Annotated[str | None, tyro.conf.arg(metavar="NAME", help=(
        "--corpus's tokenizer: bytes | smollm2-135m | a Hugging Face tokenizer directory or hub name (default: the "
        "plan's model's own: smollm2-135m for smollm2-135m, bytes for gpt and gpt2-124m)"))] = None
    dry_run: bool = False
    """check the plan, the weights and the data, write <out>/train_options.json and print the torchrun command,
    but start nothing"""
    stall_timeout: Annotated[float, tyro.conf.arg(metavar="S", help=(
        "stop the job when a rank made no progress (no heartbeat: stopped, frozen host, a hang holding the GIL) "
        "for S seconds, naming it (0: never)"))] = 300.0
    term_grace_s: Annotated[float, tyro.conf.arg(metavar="S", help=(
        "on SIGTERM, seconds the ranks get to finish (write a checkpoint) before every process of the job is "
        "killed (SIGINT/Ctrl-C: 5 s)"))] = 60.0
    max_restarts: Annotated[int, tyro.conf.arg(metavar="R", help=(
        "torchrun restarts every worker when one dies, up to R times; with checkpoints the restarted ranks "
        "resume"))] = 0
    elastic: bool = False
    """when a rank fails for good (after --max-restarts), re-plan for the GPUs that remain (the plan's cluster
    without the failed rank's GPU, and its node where that was the node's last), write the plan under the run
    directory (<out>/plan.elastic<k>/, numbered after those there) and resume from the newest checkpoint on it
    (zorse_fx/elastic.py)"""
    max_replans: Annotated[int, tyro.conf.arg(metavar="N", help=(
        "--elastic / --rebalance: re-plan at most N times in one zorse train"))] = 1
    rebalance: bool = False
    """watch the ranks' timings (<out>/timings.jsonl) and, when a GPU computes more than --straggler-factor x its
    type's fit or a calibrated plan's step runs more than --slow-step-factor x its prediction, calibrate on the
    last --rebalance-window steps, re-plan with it (<out>/plan.rebalance<k>/), stop the ranks after a step with a
    checkpoint and resume on the re-plan (zorse_fx/rebalance.py)"""
    rebalance_window: Annotated[int, tyro.conf.arg(metavar="N", help=(
        "--rebalance: the steps each check calibrates on (after the run's first)"))] = 3
    straggler_factor: Annotated[float, tyro.conf.arg(metavar="X", help=(
        "--rebalance: a GPU whose forward or backward takes more than X times its GPU type's fit is a "
        "straggler"))] = 1.5
    slow_step_factor: Annotated[float, tyro.conf.arg(metavar="X", help=(
        "--rebalance: re-plan when a plan made with a calibration measures more than X times its predicted "
        "step"))] = 1.25
    node_lost_after: Annotated[float, tyro.conf.arg(metavar="S", help=(
        "--elastic on several nodes: a node whose zorse train has neither reported its job's failure nor beaten "
        "in the shared --out for S seconds is lost (zorse_fx/elastic_nodes.py)"))] = NODE_LOST_AFTER_S
    nnodes: Annotated[int, tyro.conf.arg(metavar="N", help=(
        "the nodes the job runs on: 1 starts every rank on this machine (torchrun --standalone); N > 1: run zorse "
        "train on each of the plan's N nodes with its --node-rank, which starts that node's ranks (torchrun's static "
        "rendezvous at --master-addr; zorse_fx/runtime/launch.py)"))] = 1
    node_rank: Annotated[int | None, tyro.conf.arg(metavar="K", help=(
        "with --nnodes N: this node's place among the plan's nodes in the cluster file's order, 0..N-1 (--dry-run "
        "lists them; the device check names the right one)"))] = None
    master_addr: Annotated[str | None, tyro.conf.arg(metavar="HOST", help=(
        "with --nnodes N: host name or address of node 0 (--node-rank 0), whose torchrun serves the rendezvous"))] = None
    master_port: Annotated[int, tyro.conf.arg(metavar="PORT", help=(
        "with --nnodes N: the TCP port of the rendezvous on --master-addr"))] = 29500

    def __post_init__(self) -> None:
        for name in ("nproc", "stall_timeout", "term_grace_s", "max_restarts", "max_replans"):
            if not getattr(self, name) >= 0:
                raise OptionValueError(name, f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not self.node_lost_after > 0:
            raise OptionValueError("node_lost_after", f"--node-lost-after must be > 0 seconds, got "
                                                      f"{self.node_lost_after}")
        if (self.node_lost_after != LaunchOptions.__dataclass_fields__["node_lost_after"].default
                and not (self.elastic and self.nnodes > 1)):
            raise OptionValueError("node_lost_after", f"--node-lost-after {self.node_lost_after} applies to --elastic "
                                                      f"on several nodes only (--elastic --nnodes N): add them, or "
                                                      f"drop --node-lost-after")
        if self.max_replans != 1 and not (self.elastic or self.rebalance):
            raise OptionValueError("max_replans", f"--max-replans {self.max_replans} applies to --elastic and "
                                                  f"--rebalance only: add one, or drop --max-replans")
        if self.rebalance and (self.elastic or self.nnodes > 1):
            drop = "--elastic" if self.elastic else "--nnodes"
            raise OptionValueError("rebalance", f"--rebalance runs on one node without --elastic (zorse_fx/"
                                                f"rebalance.py); drop {drop}")
        fields = LaunchOptions.__dataclass_fields__
        for name in ("rebalance_window", "straggler_factor", "slow_step_factor"):
            value = getattr(self, name)
            if value != fields[name].default and not self.rebalance:
                raise OptionValueError(name, f"--{name.replace('_', '-')} {value} applies to --rebalance only: add "
                                             f"--rebalance, or drop it")
        if self.rebalance_window < 1 or not self.straggler_factor > 1 or not self.slow_step_factor > 1:
            raise OptionValueError("rebalance", f"--rebalance-window must be >= 1 and --straggler-factor, "
                                                f"--slow-step-factor > 1; got {self.rebalance_window}, "
                                                f"{self.straggler_factor}, {self.slow_step_factor}")
        self._check_nodes()

    def _check_nodes(self) -> None:
        """The multi-node flags ([Note: one zorse train per node] in runtime/launch.py), each refused in one
        line naming the flag: --node-rank / --master-addr / --master-port on one node would not take effect."""
        n = self.nnodes
        if n < 1:
            raise OptionValueError("nnodes", f"--nnodes must be >= 1, got {n}")
        if n == 1:
            for name in ("node_rank", "master_addr", "master_port"):
                value = getattr(self, name)
                if value != LaunchOptions.__dataclass_fields__[name].default:
                    flag = name.replace("_", "-")
                    raise OptionValueError(name, f"--{flag} {value} applies to a multi-node job only (--nnodes 2 or "
                                                 f"more), so it would not take effect: add --nnodes N, or drop --{flag}")
            return
        if self.node_rank is None or not 0 <= self.node_rank < n:
            got = "" if self.node_rank is None else f", got {self.node_rank}"
            raise OptionValueError("node_rank", f"--nnodes {n} needs --node-rank K, this node's place among the "
                                                f"plan's nodes in the cluster file's order, 0..{n - 1}{got}")
        if not self.master_addr:
            raise OptionValueError("master_addr", f"--nnodes {n} needs --master-addr HOST: the host name or address "
                                                  f"of node 0 (--node-rank 0), where the nodes meet")
        if not 0 < self.master_port < 65536:
            raise OptionValueError("master_port", f"--master-port must be a TCP port, 1..65535, got "
                                                  f"{self.master_port}")
        refused = {"max_restarts": "torchrun's static rendezvous restarts one node's workers without the others'",
                   "corpus": "every node would tokenize into the same <out>/data/tokens.bin; prepare the token file "
                             "once with `zorse prepare-data` and pass --data on each node"}
        for name, why in refused.items():
            value = getattr(self, name)
            if value != LaunchOptions.__dataclass_fields__[name].default:
                flag = name.replace("_", "-")
                shown = f"--{flag}" if isinstance(value, bool) else f"--{flag} {value}"
                raise OptionValueError(name, f"{shown} does not work across nodes (--nnodes {n}): {why}; drop "
                                             f"--{flag}, or run on one node")

    def rendezvous(self):
        """This node's ``runtime.launch.Rendezvous`` (None on one node)."""
        from .runtime.launch import Rendezvous

        if self.nnodes == 1:
            return None
        return Rendezvous(nnodes=self.nnodes, node_rank=self.node_rank, master_addr=self.master_addr,
                          master_port=self.master_port)


@dataclass(frozen=True, kw_only=True)
class TrainCommand(TrainingRecords):
    """``zorse train``'s command line: the training options (the records of
    ``train_options.TrainingOptions``, the same flags as ``python -m
    zorse_fx.train``) and the launcher's."""

    launch: LaunchOptions = LaunchOptions()
    """zorse train: preparing the tokens, starting and supervising torchrun"""

    def __post_init__(self) -> None:
        super().__post_init__()
        given = "--data" if self.data.data is not None else "--tokens" if self.data.tokens is not None else None
        for name in ("corpus", "tokenizer"):  # [Note: options that cannot take effect] in train_options.py
            value = getattr(self.launch, name)
            if given and value != LaunchOptions.__dataclass_fields__[name].default:
                raise OptionValueError(name, f"--{name} {value} applies only where zorse train prepares the token "
                                             f"file itself; {given} names one, so it would not take effect: drop "
                                             f"--{name}, or drop {given}")
        beat, stall = self.job.heartbeat_s, self.launch.stall_timeout
        if stall and not beat:  # the stall monitor reads the ranks' heartbeats: none, no stall is ever seen
            raise OptionValueError("stall_timeout", f"--heartbeat-s 0 turns the ranks' heartbeats off, which "
                                                    f"--stall-timeout {stall:g} watches, so it would not take effect: "
                                                    f"pass --stall-timeout 0 too, or a --heartbeat-s above 0")
        if stall and beat >= stall:  # every healthy rank would look stalled between two beats
            raise OptionValueError("stall_timeout", f"--stall-timeout {stall:g} is not above --heartbeat-s "
                                                    f"{beat:g}: a healthy rank would look stalled between two beats; "
                                                    f"give a --stall-timeout several heartbeats long")

    def training_options(self, data: str | None = None) -> TrainingOptions:
        """The ranks' options; ``data``: the token file ``zorse train`` prepared (``--data``)."""
        records = {f.name: getattr(self, f.name) for f in dataclasses.fields(TrainingRecords)}
        if data is not None:
            records["data"] = dataclasses.replace(self.data, data=data)
        return TrainingOptions(**records)


def _check_seq_len(model, name: str, seq_len: int) -> None:
    """``--seq-len`` within the model's positions (``registry.max_positions``), else a
    ``PlanOptionsError`` naming the model's limit (not an IndexError inside capture)."""
    from .errors import PlanOptionsError
    from .models.registry import max_positions

    if seq_len < 1:
        raise PlanOptionsError(f"--seq-len {seq_len}: give the tokens per sample, an integer >= 1")
    limit = max_positions(model)
    if limit is not None and seq_len > limit[0]:
        raise PlanOptionsError(f"--seq-len {seq_len} is beyond the {limit[0]} positions of model {name!r} "
                               f"({limit[1]} = {limit[0]}); use --seq-len {limit[0]} or less")


@contextlib.contextmanager
def _long_lived_frozen():
    """[Note: the collector and long-lived objects]
    Python's cyclic garbage collector traverses every object it tracks at each full collection: 9 of
    them in a warm ``zorse plan`` of SmolLM2-135M took 1.5 CPU s (2026-12-07, the 2-core machine, gc
    callbacks), the later ones over the imported modules, transformers' and the model's objects, which
    live as long as the command. ``gc.freeze()`` moves what exists to a generation no collection visits:
    here on entering (the imports) and after the model is loaded; full collections then visit what came
    after (0.8 CPU s in all, the interpreter's collection at exit included). On leaving, ``gc.unfreeze()``
    gives them back to the collector (a process calling ``main`` again, the tests, collects them as
    before); ``main`` run as the ``zorse`` command freezes what is left before its process exits
    (nothing is collected at exit then: the OS frees it)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def cmd_plan(args) -> int:
    import zorse_fx as zorse

    from .api import compile_recorded, record_model
    from .cluster import Cluster
    from .elastic import PlanRequest
    from .models.registry import is_model_dir
    from .plan import check_plan_dir, new_plan_dir
    from .planner import check_host_memory

    cmd: PlanCommand = args.parsed
    inputs = cmd.plan
    check_plan_dir(inputs.output, flag="-o")  # before minutes of planning ([Note: writing a plan directory])
    plan_options = cmd.planner
    if plan_options.calibration:  # recorded absolute (a re-plan runs elsewhere)
        plan_options = dataclasses.replace(plan_options, calibration=str(Path(plan_options.calibration).resolve()))
    fields = {f.name: getattr(plan_options, f.name) for f in dataclasses.fields(PlanOptions)}
    # recorded in plan_request.json (zorse train --elastic plans with them again): every field but the batch
    # size (recorded on its own) and the processes (wall-clock only), tuples as JSON lists
    options = {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()
               if k not in ("global_batch_size", "jobs")}
    cluster = Cluster.from_yaml(inputs.cluster)
    if plan_options.calibration:  # a file that cannot be read: one line before minutes of capture
        from .cost.calibration import read_calibration

        read_calibration(plan_options.calibration)
    # The options and the cluster's host memory checked before the model is captured (one line each).
    check_host_memory(cluster, plan_options)
    model_name = inputs.model
    if is_model_dir(model_name):  # recorded absolute: `zorse train --elastic` and `zorse export` load it again
        model_name = str(Path(model_name).resolve())
    with _long_lived_frozen():
        # [Note: a warm plan without the model] in api.py: from the capture cache's record, where it has one
        compiled = compile_recorded(model_name, seq_len=inputs.seq_len, cluster=cluster, verbose=True, **fields)
        if compiled is None:
            model, _ = _load_model(model_name)
            gc.freeze()  # (the model lives as long as the command)
            _check_seq_len(model, model_name, inputs.seq_len)
            ids = torch.randint(0, 200, (2, inputs.seq_len))
            compiled = zorse.compile(model, cluster=cluster, example_inputs=(ids, ids), verbose=True,
                                     model_name=model_name, **fields)
            record_model(compiled, model_name, inputs.seq_len)
        print(compiled.plan.table())
        with new_plan_dir(inputs.output, flag="-o") as new:  # swapped in whole: no file of an older plan stays
            compiled.plan.export(new)
            compiled.save_weights(new)
            PlanRequest(model=model_name, seq_len=inputs.seq_len, global_batch_size=plan_options.global_batch_size,
                        options=options,
                        cluster=cluster.to_dict(), cluster_file=str(Path(inputs.cluster).resolve())).write(new)
    out = Path(inputs.output)
    print(f"[zorse] wrote {out / 'plan.json'}, {len(compiled.plan.stages)} stage sources and {out / 'weights.pt'}")
    return 0


def cmd_prepare_data(args) -> int:
    from .token_data import prepare_data

    prepare_data(args.source, args.out, tokenizer=args.tokenizer, text_field=args.text_field, fmt=args.format,
                 split=args.split, max_tokens=args.max_tokens, errors=args.errors)
    return 0


def cmd_train(args) -> int:
    """Prepare the token file (``--corpus``, tokenized with ``--tokenizer`` or
    the plan's model's own, unless ``--data`` or ``--tokens`` names one; with
    none of them it is refused, ``_training_tokenizer``), write the ranks'
    options to ``<out>/train_options.json`` (``--dry-run``: and stop there)
    and run the plan under torchrun
    (``python -m zorse_fx.train --options-file ...``), supervised: a SIGINT or
    SIGTERM stops every rank (SIGTERM after ``--term-grace-s``, for a checkpoint),
    a rank whose heartbeat stops for ``--stall-timeout`` seconds ends the job
    with that rank named, and ``--max-restarts`` lets torchrun restart all the
    workers when one dies (with checkpoints, the restarted job resumes);
    ``--elastic`` re-plans for the GPUs that remain when one fails for good
    (``elastic.py``). Before any of it, what the files show is checked ([Note: pre-flight
    checks] in ``runtime/preflight.py``); an error a rank finds is one line
    naming the rank ([Note: one line per error] in ``runtime/rank_errors.py``)."""
    from .runtime.launch import check_master_addr, launch, node_launch, torchrun_command
    from .runtime.preflight import check_data, check_hook_ranks, check_job
    from .runtime.run_dir import check_fresh_start
    from .runtime.watchdog import heartbeat_dir
    from .token_data import TokenData, prepare_data, token_file_paths

    cmd: TrainCommand = args.train
    tokenizer = _training_tokenizer(cmd, args.parser)  # what it trains on: said, never a silent default
    if cmd.launch.elastic or cmd.launch.rebalance:  # refused before anything starts where the plan does not say
        from .elastic import check_elastic  # how it was made

        check_elastic(cmd.data.plan)
    out = Path(cmd.job.out)
    rendezvous = cmd.launch.rendezvous()  # None: one host ([Note: one zorse train per node] in runtime/launch.py)
    # [Note: pre-flight checks] (runtime/preflight.py): what the files show is refused here, in one line each.
    plan, weights = check_job(cmd.data.plan, weights=cmd.data.weights, nproc=0 if rendezvous else cmd.launch.nproc,
                              resume=cmd.checkpoint.resume, out=out)
    node = None if rendezvous is None else node_launch(plan, rendezvous, cmd.launch.nproc, plan_path=cmd.data.plan)
    if node is not None and not cmd.job.skip_device_check:  # this host as the wrong node: said before torchrun
        from .runtime.device_check import check_node_host

        check_node_host(plan, rendezvous.node_rank)
    warning = None if rendezvous is None else check_master_addr(rendezvous)
    if warning:
        print(f"[zorse] warning: {warning}", flush=True)
    check_hook_ranks(cmd.testing, plan.world_size if node else cmd.launch.nproc or plan.world_size)  # (ranks: again)
    if not cmd.checkpoint.resume:  # another run's checkpoints or metrics: refused before anything starts
        check_fresh_start(out, overwrite=cmd.checkpoint.overwrite)  # (--overwrite: rank 0 removes them)
    out.mkdir(parents=True, exist_ok=True)
    data = None
    if cmd.launch.corpus is not None:  # --corpus [--tokenizer]: prepare the token file first
        _check_model_tokenizer(plan, tokenizer, f"--corpus {cmd.launch.corpus} --tokenizer {tokenizer}")
        data = str(token_file_paths(out / "data" / "tokens")[0])
        print(f"[zorse] training data: --corpus {cmd.launch.corpus} tokenized with {tokenizer} into {data}",
              flush=True)
        prepare_data(cmd.launch.corpus, out / "data" / "tokens", tokenizer=tokenizer)
    check_data(plan, weights, data or cmd.data.data or cmd.data.tokens, val_fraction=cmd.data.val_fraction,
               val_every=cmd.loop.val_every, val_batches=cmd.loop.val_batches, allow_repeat=cmd.data.allow_repeat)
    if data is None and cmd.data.data is not None and token_file_paths(cmd.data.data)[1].is_file():
        tokenizer = (TokenData.load(cmd.data.data).header or {}).get("tokenizer")  # (a torch file has no header)
        _check_model_tokenizer(plan, tokenizer, f"--data {cmd.data.data} (its header: tokenizer {tokenizer!r})")
    del weights
    options_file = write_options_file(cmd.training_options(data), out / OPTIONS_FILE)
    train_argv = ["--options-file", str(options_file)]
    nproc = len(node.ranks) if node else cmd.launch.nproc or plan.world_size
    kw = dict(max_restarts=cmd.launch.max_restarts, shutdown_timeout_s=cmd.launch.term_grace_s, rendezvous=rendezvous)
    if node is not None:
        nodes = ", ".join(f"--node-rank {n.node_rank} {n.node!r} ({n.describe_ranks()})" for n in plan.node_ranks())
        print(f"[zorse] node {node.node_rank} of {rendezvous.nnodes} ({node.node!r}): {node.describe_ranks()} of "
              f"{plan.world_size}; the plan's nodes: {nodes}", flush=True)
    print("[zorse] " + " ".join(torchrun_command(nproc, train_argv, **kw)), flush=True)
    if cmd.launch.dry_run:
        print(f"[zorse] --dry-run: plan, weights and data checked, {options_file} written; nothing started",
              flush=True)
        return 0
    supervision = dict(heartbeat_dir=heartbeat_dir(out), stall_timeout_s=cmd.launch.stall_timeout,
                       term_grace_s=cmd.launch.term_grace_s, max_restarts=cmd.launch.max_restarts, out=out,
                       **({} if node is None else dict(rendezvous=rendezvous, ranks=node.ranks)))
    if cmd.launch.elastic and node is not None:  # [Note: losing a node] in elastic_nodes.py
        from .elastic_nodes import run_elastic_nodes

        return run_elastic_nodes(cmd.training_options(data), rendezvous=rendezvous, node=node.node,
                                 max_replans=cmd.launch.max_replans, lost_after_s=cmd.launch.node_lost_after,
                                 launch_kw={k: v for k, v in supervision.items() if k not in ("rendezvous", "ranks")})
    if cmd.launch.rebalance:
        from .rebalance import RebalanceSettings, run_rebalance

        return run_rebalance(cmd.training_options(data), nproc=nproc, max_replans=cmd.launch.max_replans,
                             launch_kw=supervision,
                             settings=RebalanceSettings(window=cmd.launch.rebalance_window,
                                                        straggler_factor=cmd.launch.straggler_factor,
                                                        slow_step_factor=cmd.launch.slow_step_factor))
    if cmd.launch.elastic:
        from .elastic import run_elastic

        return run_elastic(cmd.training_options(data), nproc=nproc, max_replans=cmd.launch.max_replans,
                           launch_kw=supervision)
    launch(nproc, train_argv, **supervision)
    return 0


def _training_tokenizer(cmd: TrainCommand, parser: argparse.ArgumentParser) -> str | None:
    """The tokenizer ``zorse train`` tokenizes ``--corpus`` with (None: it reads
    ``--data`` / ``--tokens``): ``--tokenizer``, else the plan's model's own
    (``registry.model_tokenizer``). Refused (``parser.error``, exit 2): no
    data at all (``zorse train`` does not pick a corpus for you), and
    ``--corpus`` of a model whose tokenizer zorse_fx does not know.
    (``--corpus`` / ``--tokenizer`` beside ``--data`` / ``--tokens``: refused
    where the flags are parsed, [Note: options that cannot take effect].)"""
    from .models.registry import MODEL_NAMES, model_tokenizer
    from .plan import Plan

    given = cmd.data.data is not None or cmd.data.tokens is not None
    corpus, tokenizer = cmd.launch.corpus, cmd.launch.tokenizer
    if not given and corpus is None:
        parser.error("no training data: pass --data <name>.bin (a token file written by `zorse prepare-data`) or "
                     "--corpus SOURCE ('lee', a text file, a directory of *.txt, a datasets file) to tokenize one "
                     "into <out>/data/tokens.bin")
    if given:
        return None
    if tokenizer is None:
        model = Plan.load(cmd.data.plan).model_name
        tokenizer = model_tokenizer(model)
        if tokenizer is None:
            parser.error(f"--corpus {corpus}: which tokenizer? zorse_fx knows the tokenizers of "
                         f"{', '.join(MODEL_NAMES)}, not of the plan's model {model!r}; pass --tokenizer with the "
                         f"model's own (a Hugging Face tokenizer directory or hub name)")
    return tokenizer


def _check_model_tokenizer(plan, tokenizer: str | None, where: str) -> None:
    """Refuse byte tokens for a model with a tokenizer of its own (SmolLM2's
    pretrained embeddings read its token ids, not UTF-8 bytes); ``tokenizer``:
    the one ``--corpus`` is tokenized with, or the one a token file's header
    names (None: unknown, a ``--tokens`` tensor file); ``where``: what says so."""
    from .errors import DataError
    from .models.registry import model_tokenizer

    own = model_tokenizer(plan.model_name)
    if tokenizer == "bytes" and own not in (None, "bytes"):
        raise DataError(f"{where}: the tokens are UTF-8 bytes, but the plan's model {plan.model_name} reads {own} "
                        f"token ids; tokenize with its own: --tokenizer {own} (`zorse prepare-data SOURCE "
                        f"--tokenizer {own} -o OUT`, or zorse train --corpus SOURCE without --tokenizer)")


def cmd_bench(args) -> int:
    if args.what == "kernels":
        from .profiling.kernels_main import run

        return run(args)
    from .profiling.comm_launch import BenchOptionsError, run_comm_bench
    from .profiling.comm_main import sweep_argv

    if args.backend != "gloo" and torch.cuda.is_available() and args.nproc > torch.cuda.device_count():
        raise BenchOptionsError(
            f"--nproc {args.nproc}: NCCL ranks need a GPU each and this machine has {torch.cuda.device_count()}; "
            f"use --nproc {torch.cuda.device_count()} (>= 2) or --backend gloo (CPU links)")
    run_comm_bench(args.nproc, args.out, sweep_argv(args), timeout_s=None, capture=False)
    return 0


#: Longest error message printed (characters); the rest is counted, not shown.
MAX_ERROR_CHARS = 2000


def _one_line(exc: BaseException) -> str:
    """``exc``'s message for the terminal, cut to ``MAX_ERROR_CHARS``."""
    msg = str(exc) or type(exc).__name__
    if len(msg) > MAX_ERROR_CHARS:
        msg = f"{msg[:MAX_ERROR_CHARS]}... ({len(msg) - MAX_ERROR_CHARS} characters more; --debug shows all)"
    return msg


def _number(kind, ok, what):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; give {what}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"{text!r}: give {what}")
        return v

    parse.__name__ = what  # argparse names the type in its messages
    return parse


_at_least_two = _number(int, lambda v: v >= 2, "an integer >= 2 (links need two ranks)")


class _Parser(argparse.ArgumentParser):
    """``zorse``'s parsers: argparse, except a subcommand built from records
    (``command`` set: ``zorse train``), whose whole argv goes to tyro
    (``train_options.parse_flags``); its ``--help`` is tyro's, listing every
    flag, and a refused flag or value is ``parser.error`` (exit 2)."""

    command: type | None = None
    #: The namespace attribute the record goes to (``args.train``, ``args.parsed``).
    command_dest: str = "train"
    #: Former flags read as their record field's flag (``PLAN_FLAG_ALIASES``).
    aliases: dict[str, str] = {}

    def parse_known_args(self, args=None, namespace=None):
        if self.command is None:
            return super().parse_known_args(args, namespace)
        namespace, _ = super().parse_known_args([], namespace)  # the set_defaults (fn)
        argv = list(sys.argv[1:] if args is None else args)
        for i, a in enumerate(argv):
            flag, eq, value = a.partition("=")
            if flag in self.aliases:
                argv[i] = self.aliases[flag] + eq + value
        try:
            parsed = parse_flags(self.command, argv, prog=self.prog, description=self.description)
        except UsageError as exc:
            self.error(str(exc))
        setattr(namespace, self.command_dest, parsed)
        inputs = getattr(parsed, "plan", None)
        if inputs is not None and getattr(inputs, "no_cache", False):
            namespace.no_cache = True  # main() captures afresh ([Note: the capture cache])
        return namespace, []


def build_parser() -> argparse.ArgumentParser:
    """The ``zorse`` argument parser (every subcommand; tests parse README commands with it)."""
    from . import __version__

    p = _Parser(prog="zorse", description="Heterogeneous-cluster training planner and runtime.")
    p.add_argument("--version", action="version", version=f"zorse_fx {__version__} (torch {torch.__version__})")
    p.add_argument("--debug", action="store_true", help="on an error, show the Python traceback")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    pp = sub.add_parser("plan", help="model + cluster -> exported plan (plan.json, stage_<i>.py, weights.pt)",
                        usage="zorse plan [-h] --model NAME --cluster FILE --global-batch-size INT -o DIR [OPTIONS]",
                        description="Plan a model's training on a cluster and export the plan: plan.json, one "
                                    "stage_<i>.py per stage, weights.pt. The options are the fields of "
                                    "zorse_fx.options.PlanOptions (what zorse.compile takes), each flag named after "
                                    "its field.")
    pp.command, pp.command_dest, pp.aliases = PlanCommand, "parsed", PLAN_FLAG_ALIASES  # tyro, as zorse train
    pp.set_defaults(fn=cmd_plan)
    pt = sub.add_parser("train", help="run an exported plan with torchrun (one process per GPU)",
                        usage="zorse train [-h] [OPTIONS] PLAN",
                        description="Run an exported plan with torchrun, one process per GPU, supervised. The "
                                    "training options are those of `python -m zorse_fx.train`; zorse train writes "
                                    "them to <out>/train_options.json, which every rank reads.")
    pt.command = TrainCommand  # every flag from the records (zorse_fx/train_options.py), parsed by tyro
    pt.set_defaults(fn=cmd_train, parser=pt)
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
    pd.add_argument("--errors", choices=("strict", "replace"), default="strict",
                    help="bytes that are not UTF-8: strict refuses the file, naming it and the byte offset; "
                         "replace reads each as U+FFFD")
    pd.set_defaults(fn=cmd_prepare_data)
    ps = sub.add_parser("show", help="print a plan's table and schedule")
    ps.add_argument("plan")
    ps.set_defaults(fn=cmd_show)
    pm = sub.add_parser("simulate", help="event-driven simulation of a plan's step: trace + Gantt chart")
    pm.add_argument("plan")
    pm.add_argument("--model", required=True, help=f"the model the plan was made for (as in `zorse plan`): "
                                                    f"{MODEL_HELP}")
    pm.add_argument("--cluster", required=True, help="the cluster file the plan was made with (another is refused)")
    pm.add_argument("--out", default=None, help="directory for trace.json and gantt.png (default: "
                                                "<plan directory>/simulate)")
    pm.add_argument("--any-cluster", action="store_true",
                    help="simulate a plan that does not record its cluster (older than format 13), or on a cluster "
                         "other than the one it records, as long as --cluster has the planned GPU at every planned "
                         "index (default: refused)")
    pm.add_argument("--p2p", choices=("nccl", "gloo", "buffered"), default="nccl",
                    help="boundary sends as the runtime's point-to-point program runs on NCCL (default: fused "
                         "exchanges, in order per GPU), as Gloo runs it (gloo: the runtime on CPU; every send and "
                         "receive on its own, a message leaving once the receiver's ready crossed the link) or "
                         "eager (buffered: a send leaves when posted)")
    pm.add_argument("--calibration", metavar="FILE", default=None,
                    help="a calibration (`zorse calibrate RUN`): simulate with the prices it corrected")
    pm.add_argument("--no-cache", action="store_true", help=NO_CACHE_HELP)
    pm.set_defaults(fn=cmd_simulate)
    pcal = sub.add_parser("calibrate", help="a run's measured steps (timings.jsonl) against its plan's prices -> "
                                            "calibration.json for `zorse plan --calibration`")
    pcal.add_argument("run", nargs="+", help="run directories (`zorse train --out`: timings.jsonl, metrics.jsonl) "
                                             "of plans of this model on this cluster; runs of different "
                                             "micro-batch sizes tell per-sample from fixed costs")
    pcal.add_argument("--model", required=True, help=f"the model the plan was made for (as in `zorse plan`): "
                                                     f"{MODEL_HELP}")
    pcal.add_argument("--cluster", required=True, help="the cluster file the plan was made with")
    pcal.add_argument("--plan", action="append", default=None,
                      help="the plan a run trained, once per run in their order (default: the one each run's "
                           "train_options.json names)")
    pcal.add_argument("--warmup", type=int, default=1, help="first steps left out (default %(default)s)")
    pcal.add_argument("-o", "--output", default=None, help="calibration file to write (default: "
                                                            "calibration.json in the last run's directory)")
    pcal.add_argument("--any-cluster", action="store_true", help="as for `zorse simulate`")
    pcal.add_argument("--no-cache", action="store_true", help=NO_CACHE_HELP)
    pcal.set_defaults(fn=cmd_calibrate)
    pexp = sub.add_parser("export", help="a run's trained model as a Hugging Face directory (config, "
                                         "model.safetensors, tokenizer) or a safetensors state dict",
                          description="Export a checkpoint of a `zorse train` run, under any plan and layout, as a "
                                      "Hugging Face directory (`AutoModelForCausalLM.from_pretrained(DIR)` loads "
                                      "it); a model that is not a Hugging Face one as a safetensors state dict "
                                      "under its canonical parameter names.")
    pexp.add_argument("run", help="the run directory (`zorse train --out`)")
    pexp.add_argument("--hf", required=True, metavar="DIR", help="directory to write (new or empty)")
    pexp.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: the newest "
                                                             "intact one)")
    pexp.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                      help="the weights' dtype in the export (default %(default)s; training keeps float32 masters)")
    pexp.add_argument("--plan", default=None, metavar="DIR",
                      help="the plan directory the run trained (default: the one <run>/train_options.json names)")
    pexp.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                      help="split model.safetensors into shards of at most SIZE (default %(default)s)")
    pexp.set_defaults(fn=cmd_export)
    pev = sub.add_parser("eval", help="a trained model's loss and perplexity on held-out tokens",
                         description="Loss and perplexity on a token file (`zorse prepare-data`), in this process: "
                                     "of a run's checkpoint (a run directory), an exported or any local Hugging Face "
                                     "model directory, or a --model name (the untrained model).")
    pev.add_argument("target", help="a run directory (`zorse train --out`), a Hugging Face model directory, or a "
                                    f"model name: {MODEL_HELP}")
    pev.add_argument("--data", required=True, help="token file (<name>.bin or its .json header) of held-out text")
    pev.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: a run's plan's)")
    pev.add_argument("--batch-size", type=int, default=8, help="sequences per forward (default %(default)s)")
    pev.add_argument("--max-sequences", type=int, default=None, help="the first N sequences only (default: all)")
    pev.add_argument("--step", type=int, default=None, help="a run's checkpoint of this step (default: newest)")
    pev.add_argument("--plan", default=None, help="the run's plan directory (default: its train_options.json's)")
    pev.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                     help="compute dtype (default %(default)s)")
    pev.set_defaults(fn=cmd_eval)
    ptim = sub.add_parser("timings", help="where each rank's step goes: the median of every phase per rank "
                                          "(<run>/timings.jsonl)")
    ptim.add_argument("run", help="the run directory (`zorse train --out`)")
    ptim.add_argument("--skip", type=int, default=1, help="first steps left out (default %(default)s: the warm-up)")
    ptim.set_defaults(fn=cmd_timings)
    from .profiling import comm_main, kernels_main

    pb = sub.add_parser("bench", help="measure this machine: `kernels` (kernel profile) or `comm` (links)",
                        description="Measure this machine. `zorse bench kernels --help` and `zorse bench comm "
                                    "--help` list each one's options.")
    bsub = pb.add_subparsers(dest="what", required=True, metavar="{kernels,comm}")
    pk = bsub.add_parser("kernels", parents=[kernels_main.build_parser(add_help=False)],
                         help="kernel profile of this device (-o profiles/<type>.json)",
                         description=kernels_main.build_parser().description)
    pk.set_defaults(fn=cmd_bench, what="kernels", check=lambda args: kernels_main.check_args(pk, args))
    pc = bsub.add_parser("comm", parents=[comm_main.build_parser(add_help=False)],
                         help="alpha-beta fits of the links between local ranks; prints `links:` for a cluster file",
                         description=comm_main.DESCRIPTION + " Starts torchrun with --nproc local ranks; for "
                         "several machines run `torchrun ... -m zorse_fx.profiling.comm_main` on each.")
    pc.add_argument("--nproc", type=_at_least_two, default=2, help="local ranks to start (default 2)")
    pc.set_defaults(fn=cmd_bench, what="comm", check=lambda args: comm_main.check_args(pc, args))
    from .box import command as box_command

    box_command.add_parser(sub)  # zorse box up/run/down/gc: an emulated cluster on this machine (zorse_fx/box/)
    return p


def main(argv=None) -> int:
    """The ``zorse`` command. Returns the exit status: 0; 1 after an error,
    printed on stderr as ``zorse: <message>`` (``zorse --debug ...``: the
    exception propagates with its traceback instead); 3 when ``zorse train``'s
    ranks stopped at a non-finite step; 130 on Ctrl-C (SIGINT)
    and 143 on SIGTERM while a job runs, after every process of the job was
    stopped. Usage mistakes exit 2 through argparse."""
    from .runtime.launch import JobInterrupted

    p = build_parser()
    args = p.parse_args(argv)
    if getattr(args, "check", None):  # a subcommand's own checks of its values (argparse errors, exit 2)
        args = args.check(args)
    if getattr(args, "no_cache", False):  # this command captures afresh ([Note: the capture cache])
        from .capture.cache import disabled

        fn = args.fn
        args.fn = lambda a: disabled()(fn)(a)
    try:
        status = args.fn(args)
        if argv is None:  # the `zorse` command: its process exits next ([Note: the collector and long-lived objects])
            gc.freeze()
        return status
    except JobInterrupted as exc:  # the job (torchrun and every rank) is stopped already
        if args.debug:
            raise
        print(f"zorse: {exc}", file=sys.stderr)
        return 128 + exc.signum
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("zorse: interrupted", file=sys.stderr)
        return 130
    except ZorseError as exc:  # a bad input: the message says what to change
        if args.debug:
            raise
        if not getattr(exc, "reported", False):  # (a failed job whose rank printed its `zorse:` line already)
            print(f"zorse: {_one_line(exc)}", file=sys.stderr)
        return getattr(exc, "exit_status", 1)  # (a failed job: 3 after a non-finite step, README "Exit statuses")
    except Exception as exc:  # anything else may be a bug in zorse_fx: say how to see where
        if args.debug:
            raise
        print(f"zorse: {type(exc).__name__}: {_one_line(exc)} (rerun as `zorse --debug ...` for the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
