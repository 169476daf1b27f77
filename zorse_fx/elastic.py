"""Elastic re-planning: ``zorse train --elastic``.

When the job fails for good (a rank keeps failing after torchrun's
``--max-restarts``), the launcher finds the rank torchrun names, drops its GPU
from the cluster the plan was made for, re-plans the same model, global batch
and sequence length for the GPUs that remain, exports the new plan under the
run directory (``<out>/plan.elastic<k>/``, [Note: where re-plans go]), says
what changed, and relaunches on the new plan's process count with
``--resume`` from the newest intact checkpoint (a DCP checkpoint loads under
another plan: ``runtime/checkpoint.py``). Across nodes (``--nnodes N``) the
nodes first agree on what was lost and on one re-plan ([Note: losing a node]
in ``elastic_nodes.py``), which then uses this module's pieces.

[Note: which GPUs a failure removes]
torchrun names each failed worker (its rank, exit code and pid) in the
``ChildFailedError`` it prints on stderr; the workers it stopped itself
(SIGTERM, SIGINT; their pids in its "closing signal" lines) are listed too.
The lost rank is the one that failed first ([Note: the rank that died
first] in ``runtime/rank_errors.py``, as ``zorse train`` names it without
``--elastic``): the first of the others that died by a signal (SIGKILL,
SIGSEGV, SIGBUS: a GPU or host gone), else the first that exited with an
error, torchrun's root cause first (a Python error such as a CUDA fault).
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

[Note: where re-plans go]
A re-plan belongs to the run whose job lost the GPU: the checkpoints written
after it are of that run, and resuming the run takes the re-plan. So it goes
under the run directory, ``<out>/plan.elastic<k>/`` (``replan_dir``), k one
more than the largest already there: a second re-plan of the same
``zorse train``, a resumed run that re-plans again, or a new run into the
same ``--out`` after ``--overwrite`` each get a new directory and none
overwrites an earlier one; nothing is written beside the plan, which other
runs may share (or a read-only place). Its ``plan_request.json`` records
where it came from (``replanned_from``: the plan it re-plans;
``replan_reason``: the rank, GPU and how it failed; ``run``: the run
directory) and the reduced cluster, which is also written beside it as a
cluster file, ``cluster.yaml`` (``cluster_file``): ``zorse simulate
<re-plan> --cluster <re-plan>/cluster.yaml`` and ``zorse plan --cluster``
take it like any other.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from .errors import InfeasiblePlanError, PlanOptionsError, RuntimeExecutionError
from .runtime.rank_errors import VERDICTS, RankFailure, failed_ranks, first_failure, stopped_pids

__all__ = ["PLAN_REQUEST", "REPLAN_CLUSTER", "REPLAN_PREFIX", "PlanRequest", "RankFailure", "ElasticError",
           "failed_ranks", "lost_rank", "reduced_cluster", "replan_dir", "replan", "recorded_cluster_file",
           "what_changed", "check_elastic", "run_elastic"]

#: The file beside plan.json that records how ``zorse plan`` made the plan ([Note: how a plan was made]).
PLAN_REQUEST = "plan_request.json"
#: A re-plan's reduced cluster, as a cluster YAML file beside its plan.json ([Note: where re-plans go]).
REPLAN_CLUSTER = "cluster.yaml"
#: A re-plan's directory under the run directory: ``<out>/plan.elastic<k>`` ([Note: where re-plans go]).
REPLAN_PREFIX = "plan.elastic"
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
    #: The cluster file: ``zorse plan --cluster``'s (absolute), or a re-plan's ``cluster.yaml``
    #: beside it (``REPLAN_CLUSTER``, [Note: where re-plans go]); what ``zorse simulate`` takes.
    cluster_file: str = ""
    #: A re-plan ([Note: where re-plans go]): the plan directory it re-plans (absolute); "" for ``zorse plan``'s.
    replanned_from: str = ""
    #: A re-plan: why (the rank lost, its GPU and how it failed).
    replan_reason: str = ""
    #: A re-plan: the run directory (``--out``) whose job lost the GPU.
    run: str = ""

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
            if isinstance(data, dict) and isinstance(data.get("options"), dict):  # JSON lists: PlanOptions' tuples
                data["options"] = {k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()}
            return cls(**data)
        except (ValueError, TypeError, RecursionError) as exc:  # RecursionError: nested too deep
            raise ElasticError(f"--elastic: {path} is not a plan request `zorse plan` wrote ({exc}); export the "
                               f"plan again with `zorse plan`") from None


def lost_rank(failures: list[RankFailure], *, stopped: frozenset[int] = frozenset()) -> RankFailure | None:
    """The rank whose GPU a failure report (``failed_ranks``: root cause
    first; ``stopped``: the pids torchrun stopped itself, ``stopped_pids``)
    removes ([Note: which GPUs a failure removes]), or None: the rank that
    failed first (``runtime.rank_errors.first_failure``) unless a verdict
    ended the run."""
    if not failures or failures[0].exitcode in VERDICTS:
        return None  # the root cause is a verdict: the run itself stopped
    first = first_failure(failures, stopped=stopped, verdicts=VERDICTS)
    return None if first is None or first.exitcode in VERDICTS else first


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


def replan_dir(out: str | Path) -> Path:
    """``<out>/plan.elastic<k>``, k one more than the largest of an existing
    ``<out>/plan.elastic<j>`` ([Note: where re-plans go]); 1 where there is none."""
    taken = [int(p.name[len(REPLAN_PREFIX):]) for p in Path(out).glob(f"{REPLAN_PREFIX}*")
             if p.name[len(REPLAN_PREFIX):].isdigit()]
    return Path(out) / f"{REPLAN_PREFIX}{max(taken, default=0) + 1}"


def replan(request: PlanRequest, cluster, out_dir: str | Path, *, lost: str = "", fix: str = "",
           replanned_from: str | Path = "", run: str | Path = "", captured=None, label_mode: str | None = None):
    """Plan ``request``'s model, sequence length, global batch and options
    again for ``cluster``; export plan.json, the stage sources, weights.pt,
    ``cluster`` as ``cluster.yaml`` and the request (with ``cluster``, that
    file and where the re-plan came from: ``replanned_from``, ``lost`` (what
    failed: the rank, its GPU, how), ``run``; [Note: where re-plans go]) to
    ``out_dir``. Returns the ``Plan``. ``captured`` (with its ``label_mode``):
    the request's model already captured (``zorse train --rebalance`` keeps
    one), planned without capturing it again.

    Raises:
        ElasticError: no plan fits ``cluster``: one line with ``lost``, the
            planner's reason (its binding constraint) and ``fix``.
    """
    import torch
    import yaml

    from .api import compile
    from .models.registry import load_model

    try:
        if captured is not None:
            from .options import PlanOptions
            from .planner import plan_captured

            plan, _ = plan_captured(captured, cluster, PlanOptions(global_batch_size=request.global_batch_size,
                                                                   **request.options),
                                    model_name=request.model, label_mode=label_mode or "shifted")
        else:
            model, _ = load_model(request.model)
            ids = torch.randint(0, 200, (2, request.seq_len))  # example inputs: only their shapes matter
            compiled = compile(model, cluster=cluster, example_inputs=(ids, ids),
                               global_batch_size=request.global_batch_size, model_name=request.model,
                               **request.options)
            plan, captured = compiled.plan, compiled.captured
    except (InfeasiblePlanError, PlanOptionsError) as exc:  # (anything else is no planner's answer: raised as is)
        reason = " ".join(str(exc).split())
        raise ElasticError(f"--elastic: no plan of {request.model} (global batch {request.global_batch_size}, "
                           f"seq len {request.seq_len}) fits the {_gpus(len(cluster.gpus))} that "
                           f"{'remain' if len(cluster.gpus) != 1 else 'remains'} "
                           f"({cluster.gpu_summary()}){f' after {lost}' if lost else ''}: {reason.rstrip('.')}"
                           + (f"; {fix}" if fix else "")) from exc
    out = Path(out_dir).resolve()
    plan.export(out)
    torch.save({k: v.contiguous() for k, v in captured.state().items()}, out / "weights.pt")
    cluster_file = out / REPLAN_CLUSTER
    cluster_file.write_text(f"# {cluster.source}: the GPUs left after {lost or 'a GPU was lost'}; written by "
                            f"`zorse train --elastic` with the re-plan beside it\n"
                            + yaml.safe_dump(cluster.to_dict(), sort_keys=False))
    dataclasses.replace(request, cluster=cluster.to_dict(), cluster_file=str(cluster_file),
                        replanned_from=str(Path(replanned_from).resolve()) if replanned_from else "",
                        replan_reason=lost,
                        run=str(Path(run).resolve()) if run else "").write(out)
    return plan


def recorded_cluster_file(plan_dir: str | Path) -> str | None:
    """The cluster file ``plan_dir``'s ``plan_request.json`` records (``zorse
    plan --cluster``'s, or a re-plan's ``cluster.yaml``) where it still
    exists; None where there is none (no request, an unreadable one)."""
    d = Path(plan_dir)
    path = (d if d.is_dir() else d.parent) / PLAN_REQUEST
    try:
        recorded = json.loads(path.read_text()).get("cluster_file")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return recorded if isinstance(recorded, str) and recorded and Path(recorded).is_file() else None


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
                text = exc.stderr or ""
                lost = lost_rank(failed_ranks(text), stopped=stopped_pids(text))
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
            latest, _ = newest_intact_checkpoint(out / CHECKPOINTS)
            new_dir = replan_dir(out)  # [Note: where re-plans go]
            go_on = (f"resume from {latest}: `zorse train <that plan> --resume --out {out} ...`" if latest is not None
                     else f"start anew (no intact checkpoint in {out / CHECKPOINTS}): `zorse train <that plan> "
                          f"--overwrite --out {out} ...`")
            new = replan(request, smaller, new_dir, lost=failed, replanned_from=plan_dir, run=out,
                         fix=f"make a plan for GPUs that fit (`zorse plan --cluster FILE ...`) and {go_on}")
            for line in what_changed(plan, new, cluster, smaller):
                print(line, flush=True)
            print(f"[zorse] elastic: wrote {new_dir} (its cluster: {new_dir / REPLAN_CLUSTER}); "
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

