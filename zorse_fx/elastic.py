"""Elastic re-planning: ``zorse train --elastic``.

When the job fails for good (a rank keeps failing after torchrun's
``--max-restarts``), the launcher finds the rank torchrun names, drops its GPU
from the cluster the plan was made for, re-plans the same model, global batch
and sequence length for the GPUs that remain, exports the new plan beside the
old one (``<plan>.elastic<k>/``), says what changed, and relaunches on the new
plan's process count with ``--resume`` from the newest intact checkpoint
(a DCP checkpoint loads under another plan: ``runtime/checkpoint.py``).

[Note: which GPUs a failure removes]
torchrun names each failed worker (its rank and exit code) in the
``ChildFailedError`` it prints on stderr; the workers it stopped itself
(SIGTERM, SIGINT) are listed too. The lost rank is the first of the others
that died by a signal (SIGKILL, SIGSEGV, SIGBUS: a GPU or host gone), else the
one torchrun names as the root cause (a Python error such as a CUDA fault).
A rank the launcher stopped for making no progress (``--stall-timeout``: a
frozen host or GPU) is lost too.
Its GPU leaves the cluster; where that was its node's last GPU, the node
leaves too (with its link overrides and shared-link sides). The other GPUs of
its node stay: one process failing is evidence against one GPU, and on one
machine (``zorse train`` starts the ranks locally) every rank shares the
node. A node that is really gone fails all its ranks, and each re-plan
removes another of its GPUs (``--max-replans``). A rank that stopped with one
of zorse's own verdicts (a non-finite step, a refused option, a signal to the
job) is no lost GPU: that failure is raised unchanged.

[Note: how a plan was made]
``zorse plan`` writes ``plan_request.json`` beside ``plan.json``
(``PlanRequest``): the model name, sequence length, global batch size, the
planner options it was given and the cluster itself (``Cluster.to_dict``, so
a re-plan does not depend on the cluster file staying unchanged). plan.json
records what the plan is, not how it was asked for; a plan without this file
(exported by the Python API, or by an older ``zorse plan``) is refused by
``--elastic`` before anything starts.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

from .errors import InfeasiblePlanError, RuntimeExecutionError

__all__ = ["PLAN_REQUEST", "PlanRequest", "RankFailure", "ElasticError", "failed_ranks", "lost_rank",
           "reduced_cluster", "replan", "what_changed", "check_elastic", "run_elastic"]

#: The file beside plan.json that records how ``zorse plan`` made the plan ([Note: how a plan was made]).
PLAN_REQUEST = "plan_request.json"
#: Characters of torchrun's stderr kept to find the failed rank in (its failure report is a few KiB per rank).
STDERR_TAIL_CHARS = 256 * 1024


class ElasticError(RuntimeExecutionError):
    """``--elastic`` cannot go on: no record of how the plan was made, no plan
    for the GPUs that remain, or ``--max-replans`` spent. One line."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanRequest:
    """How ``zorse plan`` made a plan: what a re-plan repeats ([Note: how a plan was made])."""

    #: The model as ``zorse plan --model`` names it (``models/registry.py``).
    model: str
    #: Tokens per sample.
    seq_len: int
    #: Samples per optimizer step.
    global_batch_size: int
    #: ``PlanOptions`` fields as given to ``zorse_fx.compile`` (JSON values), less ``global_batch_size``.
    options: dict
    #: The cluster planned for, ``Cluster.to_dict()``.
    cluster: dict
    #: The cluster file it was read from ("" for a reduced cluster), for messages.
    cluster_file: str = ""

    def __post_init__(self) -> None:
        if self.seq_len < 1 or self.global_batch_size < 1:
            raise ValueError(f"PlanRequest: seq_len {self.seq_len} and global_batch_size "
                             f"{self.global_batch_size} must be >= 1")

    def write(self, plan_dir: str | Path) -> Path:
        path = Path(plan_dir) / PLAN_REQUEST
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, plan_dir: str | Path) -> PlanRequest:
        """The request recorded in ``plan_dir``; ``ElasticError`` (one line) where there is none or it is unreadable."""
        d = Path(plan_dir)
        d = d if d.is_dir() else d.parent
        path = d / PLAN_REQUEST
        if not path.exists():
            raise ElasticError(f"--elastic: {d} has no {PLAN_REQUEST} (how the plan was made, which a re-plan "
                               f"repeats); export the plan again with `zorse plan`, which writes it")
        try:
            data = json.loads(path.read_text())
            return cls(**data)
        except (ValueError, TypeError) as exc:
            raise ElasticError(f"--elastic: {path} is not a plan request `zorse plan` wrote ({exc}); export the "
                               f"plan again with `zorse plan`") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class RankFailure:
    """One failed worker as torchrun reports it."""

    rank: int
    #: The worker's exit status; negative: killed by signal ``-exitcode``.
    exitcode: int = 0
    #: No exit: the rank stopped making progress (no heartbeat for ``--stall-timeout``) and the job was stopped.
    stalled: bool = False

    def describe(self) -> str:
        if self.stalled:
            return "no progress for --stall-timeout"
        if self.exitcode < 0:
            try:
                return f"killed by {signal.Signals(-self.exitcode).name}"
            except ValueError:
                return f"killed by signal {-self.exitcode}"
        return f"exit status {self.exitcode}"


_ENTRY = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE)
_ROOT = "Root Cause (first observed failure):"


def failed_ranks(torchrun_stderr: str) -> list[RankFailure]:
    """The workers torchrun's last failure report names, its root cause first
    (empty where the text has no report: torchrun itself failed, or the job was stopped)."""
    end = torchrun_stderr.rfind(_ROOT)
    if end < 0:
        return []
    start = torchrun_stderr.rfind("Failures:", 0, end)
    others = torchrun_stderr[start:end] if start >= 0 else ""
    root = torchrun_stderr[end:]
    return [RankFailure(rank=int(r), exitcode=int(c)) for text in (root, others) for r, c in _ENTRY.findall(text)]


#: Workers torchrun stopped itself after another failed: no lost GPU.
_STOPPED = frozenset({-signal.SIGTERM, -signal.SIGINT})
#: Exit statuses that are zorse's own verdicts, no lost GPU ([Note: which GPUs a failure removes]):
#: options refused (2), the job stopped by a signal (128 + SIGTERM, SIGINT); and ``train.EXIT_NONFINITE``.
_VERDICTS = frozenset({2, 128 + signal.SIGTERM, 128 + signal.SIGINT})


def lost_rank(failures: list[RankFailure]) -> RankFailure | None:
    """The rank whose GPU a failure report (``failed_ranks``: root cause
    first) removes ([Note: which GPUs a failure removes]), or None."""
    from .train import EXIT_NONFINITE  # (the rank-side module: imported only after a failure)

    verdicts = _VERDICTS | {EXIT_NONFINITE}
    if not failures or failures[0].exitcode in verdicts:
        return None  # the root cause is a verdict: the run itself stopped
    lost = [f for f in failures if f.exitcode not in verdicts | _STOPPED]
    return next((f for f in lost if f.exitcode < 0), lost[0] if lost else None)


def reduced_cluster(cluster, lost_gpus):
    """``cluster`` (a ``Cluster``) without the GPUs of indices ``lost_gpus``,
    the others renumbered in order; a node left without GPUs goes too, with
    its link overrides and shared-link sides, and a datacenter left without
    nodes with it ([Note: which GPUs a failure removes]). Returns
    ``(Cluster, what)``: the reduced cluster and one phrase naming what went.

    Raises:
        ValueError: an index that is not a GPU of ``cluster``.
        ElasticError: no GPU would remain."""
    lost = set(lost_gpus)
    unknown = sorted(g for g in lost if not 0 <= g < len(cluster.gpus))
    if unknown:
        raise ValueError(f"GPU indices {unknown} are not GPUs of cluster {cluster.name!r} ({len(cluster.gpus)} GPUs)")
    parts, kept_nodes = [], []
    for node in cluster.nodes:
        mine = [g for g in cluster.gpus if g.node == node]
        gone = [g for g in mine if g.index in lost]
        if len(gone) == len(mine):
            parts.append(f"node {node!r} ({'its only GPU' if len(mine) == 1 else f'all its {len(mine)} GPUs'}: "
                         + ", ".join(f"GPU {g.index} {g.type}" for g in gone) + ")")
        else:
            kept_nodes.append(node)
            parts += [f"GPU {g.index} ({g.type} on node {node!r}, which keeps {len(mine) - len(gone)})" for g in gone]
    what = "; ".join(parts)
    if not kept_nodes:
        raise ElasticError(f"--elastic: no GPU of cluster {cluster.name!r} remains after dropping {what}")
    gpus, local = [], {}
    for g in cluster.gpus:
        if g.index not in lost:
            gpus.append(dataclasses.replace(g, index=len(gpus), local_index=local.get(g.node, 0)))
            local[g.node] = local.get(g.node, 0) + 1
    keep = [i for i, n in enumerate(cluster.nodes) if n in kept_nodes]
    per_node = {name: tuple(getattr(cluster, name)[i] for i in keep)
                for name in ("node_intra_node_links", "node_nic_bandwidths", "node_host_memory_bytes",
                             "node_host_memory_bandwidths", "node_host_links")}
    datacenters = tuple(d for d in cluster.datacenters if any(g.datacenter == d for g in gpus))
    shared = []
    for spec in cluster.shared_links:
        sides = tuple(dataclasses.replace(s, nodes=tuple(n for n in s.nodes if n in kept_nodes)) for s in spec.sides)
        if all(s.nodes for s in sides):  # a side without nodes carries no flow: the link goes
            shared.append(dataclasses.replace(spec, sides=sides))
    smaller = dataclasses.replace(
        cluster, gpus=tuple(gpus), nodes=tuple(kept_nodes), datacenters=datacenters, **per_node,
        link_overrides=tuple(o for o in cluster.link_overrides if set(o.between) <= set(kept_nodes)),
        shared_links=tuple(shared), source=f"{cluster.source} without GPU {', '.join(map(str, sorted(lost)))}")
    return smaller, what


def replan(request: PlanRequest, cluster, out_dir: str | Path, *, why: str = ""):
    """Plan ``request``'s model, sequence length, global batch and options
    again for ``cluster``; export plan.json, the stage sources, weights.pt
    and the request (with ``cluster``) to ``out_dir``. Returns the ``Plan``.

    Raises:
        ElasticError: no plan fits ``cluster`` (one line: the planner's reason).
    """
    import torch

    from .api import compile
    from .models.registry import load_model

    model, _ = load_model(request.model)
    ids = torch.randint(0, 200, (2, request.seq_len))  # example inputs: only their shapes matter
    try:
        compiled = compile(model, cluster=cluster, example_inputs=(ids, ids),
                           global_batch_size=request.global_batch_size, model_name=request.model,
                           **request.options)
    except (InfeasiblePlanError, ValueError) as exc:
        reason = " ".join(str(exc).split())
        raise ElasticError(f"--elastic: no plan of {request.model} (global batch {request.global_batch_size}, "
                           f"seq len {request.seq_len}) fits the {_gpus(len(cluster.gpus))} that "
                           f"{'remain' if len(cluster.gpus) != 1 else 'remains'} "
                           f"({cluster.gpu_summary()}){why}: {reason}") from exc
    out = Path(out_dir)
    compiled.plan.export(out)
    compiled.save_weights(out)
    dataclasses.replace(request, cluster=cluster.to_dict(), cluster_file="").write(out)
    return compiled.plan


def _gpus(n: int) -> str:
    return f"{n} GPU{'s' if n != 1 else ''}"


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def _layout(plan) -> str:
    """``"2 stages on 4 GPUs (2+2), 1 x 12 micro-batches"``."""
    gpus = "+".join(str(len(s.gpus)) for s in plan.stages[:plan.num_groups])
    return (f"{plan.num_stages} stages on {plan.world_size} GPUs ({gpus}), {plan.num_microbatches} micro-batches "
            f"of {plan.microbatch_size}")


def what_changed(old, new, old_cluster, new_cluster) -> list[str]:
    """The lines ``--elastic`` prints after a re-plan: GPUs, stages, predicted step time."""
    return [f"[zorse] elastic: GPUs {old_cluster.gpu_summary()} -> {new_cluster.gpu_summary()}",
            f"[zorse] elastic: stages {_layout(old)} -> {_layout(new)}",
            f"[zorse] elastic: predicted step time {old.predicted_step_time_s * 1e3:.1f} ms -> "
            f"{new.predicted_step_time_s * 1e3:.1f} ms ({new.predicted_step_time_s / old.predicted_step_time_s:.2f}x)"]


def check_elastic(plan_dir: str | Path) -> None:
    """``--elastic``'s pre-flight check: the plan records how it was made (else ``ElasticError``)."""
    PlanRequest.read(plan_dir)


def run_elastic(options, *, nproc: int, max_replans: int, launch_kw: dict) -> int:
    """``zorse train --elastic``: train ``options`` (a ``TrainingOptions``) on
    ``nproc`` local processes; after a failure that loses a GPU ([Note: which
    GPUs a failure removes]) re-plan without it, at most ``max_replans``
    times, and resume on the new plan. ``launch_kw``: ``runtime.launch.launch``'s
    supervision options. Returns 0 once the run finished.

    Raises:
        ElasticError: no plan request, no plan for the remaining GPUs, re-plans spent.
        JobFailedError, JobStalledError: a failure that is no lost GPU (raised unchanged).
    """
    from .cluster import Cluster
    from .plan import Plan
    from .runtime.checkpoint import newest_intact_checkpoint
    from .runtime.launch import JobFailedError, JobStalledError, launch, torchrun_command
    from .runtime.run_dir import CHECKPOINTS
    from .train_options import OPTIONS_FILE, write_options_file

    first = Path(options.data.plan)
    first = first if first.is_dir() else first.parent
    plan_dir, request = first, PlanRequest.read(first)  # refused before anything starts
    out = Path(options.job.out)
    replans = 0
    while True:
        options_file = write_options_file(options, out / OPTIONS_FILE)
        try:
            launch(nproc, ["--options-file", str(options_file)], stderr_tail_chars=STDERR_TAIL_CHARS, **launch_kw)
            return 0
        except (JobFailedError, JobStalledError) as exc:
            if isinstance(exc, JobStalledError):  # a frozen host or GPU: as lost as a dead one
                lost = RankFailure(rank=exc.rank, stalled=True) if exc.rank is not None else None
            else:
                lost = lost_rank(failed_ranks(exc.stderr or ""))
            if lost is None:
                raise
            plan = Plan.load(plan_dir)
            cluster = Cluster.from_dict(request.cluster)
            gpu = next(g for s in plan.stages for g in s.gpus if g.rank == lost.rank)
            restarts = launch_kw.get("max_restarts", 0) if not lost.stalled else 0
            failed = (f"rank {lost.rank} (GPU {gpu.gpu}, {gpu.gpu_type} on node {gpu.node!r}) failed for good "
                      f"({lost.describe()}{f', after {restarts} torchrun restart(s)' if restarts else ''})")
            if replans >= max_replans:
                raise ElasticError(f"--elastic: {failed} under {plan_dir}, after {replans} re-plan(s): "
                                   f"--max-replans {max_replans} spent; resume with `zorse train ... --resume` "
                                   f"under a plan for the GPUs that work") from exc
            replans += 1
            print(f"[zorse] elastic: {failed}", flush=True)
            smaller, dropped = reduced_cluster(cluster, {gpu.gpu})
            print(f"[zorse] elastic: dropped {dropped}; re-planning for the {_gpus(len(smaller.gpus))} left",
                  flush=True)
            new_dir = first.with_name(f"{first.name}.elastic{replans}")
            if (new_dir / PLAN_REQUEST).exists():  # an earlier --elastic run's plan: made again for this cluster
                shutil.rmtree(new_dir)
            new = replan(request, smaller, new_dir, why=f" after {failed}")
            for line in what_changed(plan, new, cluster, smaller):
                print(line, flush=True)
            latest, _ = newest_intact_checkpoint(out / CHECKPOINTS)
            print(f"[zorse] elastic: wrote {new_dir}; "
                  + (f"resuming from {latest} on {_ranks(new.world_size)}" if latest is not None else
                     f"no intact checkpoint in {out / CHECKPOINTS}: starting anew on {_ranks(new.world_size)}")
                  + f" (re-plan {replans} of --max-replans {max_replans})", flush=True)
            d = options.data
            weights = None if d.weights is None or Path(d.weights).parent == plan_dir else d.weights
            options = dataclasses.replace(
                options, data=dataclasses.replace(d, plan=str(new_dir), weights=weights),
                checkpoint=dataclasses.replace(options.checkpoint, resume=latest is not None,
                                               overwrite=latest is None),
                # the fault injection names the first plan's ranks: a re-planned run has none
                testing=dataclasses.replace(options.testing, fail_rank=None, kill_at_step=None, inject_inf=None))
            plan_dir, request, nproc = new_dir, PlanRequest.read(new_dir), new.world_size
            print("[zorse] " + " ".join(torchrun_command(nproc, ["--options-file", str(options_file)],
                                                         max_restarts=launch_kw.get("max_restarts", 0),
                                                         shutdown_timeout_s=launch_kw.get("term_grace_s"))),
                  flush=True)

