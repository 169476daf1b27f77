"""Elastic re-planning across nodes: ``zorse train --elastic --nnodes N``.

[Note: losing a node]
On one host ``--elastic`` (``elastic.py``) reads torchrun's failure report and
re-plans. Across nodes no launcher sees the whole job: each node's ``zorse
train`` supervises its own ranks ([Note: one zorse train per node] in
``runtime/launch.py``), a node that is gone (its host down, its processes
killed) says nothing, and its peers' ranks fail on their next message to it
(a reset connection: exit status 1, not the lost rank). So the surviving
nodes agree through the run directory, which every node shares already (each
rank writes its part of every checkpoint there, and a resume under another
plan reads all of them):

- ``<out>/.elastic/``: each node's launcher beats ``beat-<node>`` (its time
  rewritten every ``BEAT_INTERVAL_S``: ``runtime.watchdog.start_beat``) for as
  long as it runs; node 0 writes
  ``job`` (a fresh id) before it starts torchrun, so files of an earlier job
  in the same directory are never read as this job's.
- When a node's job fails, its launcher writes ``<job>/attempt<a>/report-<node>.json``
  (its ranks' failures as its torchrun reported them, or the rank its stall
  monitor stopped) and waits until every node of the plan has reported or is
  lost: its beat has not changed for ``lost_after_s`` seconds of the
  waiting node's own clock (no clocks compared across hosts), or the
  whole wait (``wait_s``) is over.
- The first node of the plan's order that reported decides
  (``decide``): the nodes that did not report are lost, all their GPUs; where
  every node reported, the rank that failed first over all reports is
  (``elastic.lost_rank``: a death by signal before a reset connection); a
  verdict of zorse's own (a non-finite step, a stop signal) is no loss and
  ends every node's ``zorse train`` with it. It re-plans (``elastic.replan``,
  under ``<out>/plan.elastic<k>/``) and publishes ``decision.json``, first
  writer wins (a hard link), which the others wait for and follow.
- The survivors restart under the re-plan: the nodes it uses, numbered in its
  order (``Plan.node_ranks``), each started again with its new
  ``--node-rank``; the rendezvous stays at ``--master-addr`` where node 0
  survived, else moves to the new node 0's host name (as its report records
  it) on the same ``--master-port``; every node resumes from the checkpoint
  the decision names. A node the re-plan leaves idle says so and exits 0.

A host that leaves the network without closing its connections (no reset
reaches its peers) is noticed when the survivors' ranks reach the process
group's timeout (``--pg-timeout-min``), not sooner: a rank waiting in a
collective still beats, so the stall monitor does not fire.

Not handled: the deciding node lost while it re-plans (the others stop after
``decide_wait_s`` with one line); a job that failed before every node joined
the rendezvous (no worker failed: raised as without ``--elastic``); a run
directory that is not shared (the nodes but node 0 find no job id and fail
as without ``--elastic``, node 0 would call the others lost: ``--elastic``
across nodes needs the shared ``--out`` that a resume under another plan
needs anyway).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from typing import Literal

import msgspec

from .elastic import (REPLAN_CLUSTER, STDERR_TAIL_CHARS, ElasticError, PlanRequest, RankFailure, lost_rank,
                      reduced_cluster, replan, replan_dir, what_changed)
from .runtime.rank_errors import VERDICTS, failed_ranks, stopped_pids
from .runtime.watchdog import start_beat
from .train_options import NODE_LOST_AFTER_S

__all__ = ["ELASTIC_DIRNAME", "BEAT_INTERVAL_S", "NodeReport", "Decision", "Agreement", "decide",
           "run_elastic_nodes"]

#: The run directory's folder the nodes agree through ([Note: losing a node]).
ELASTIC_DIRNAME = ".elastic"
#: Seconds between a node launcher's beats.
BEAT_INTERVAL_S = 1.0
#: A node whose beat has not changed for this long (seconds, the observer's clock) and that has not reported is lost
#: (``zorse train --node-lost-after``'s default).
LOST_AFTER_S = NODE_LOST_AFTER_S
#: The longest a node waits for the others' reports (seconds); the silent ones are then lost.
WAIT_S = 300.0
#: The longest a node waits for the deciding node's decision (seconds): a re-plan on the deciding host.
DECIDE_WAIT_S = 900.0


def _write_json(path: Path, doc: dict) -> None:
    """Whole or not at all (readers on other hosts never see half a file)."""
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _load(path: Path, cls):
    """The ``cls`` record in ``path`` (None: no file yet), every field checked against its type.

    Raises:
        ElasticError: a file that is not one ``zorse train --elastic`` wrote: its path and the field."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return msgspec.json.decode(raw, type=cls)
    except msgspec.DecodeError as exc:  # (ValidationError included: it names the field, "at `$.master_port`")
        raise ElasticError(f"--elastic: {path} is not a {cls.__name__} that `zorse train --elastic` writes "
                           f"({exc}); something else wrote into {path.parent}: stop every node's zorse train and "
                           f"resume the run with `zorse train ... --resume`") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeReport:
    """How one node's part of the job ended, as its launcher saw it."""

    #: The node's name in the cluster file.
    node: str
    #: Its host name (``socket.gethostname()``): where a rendezvous moved to it is reached.
    host: str
    #: Its ranks' failures as its torchrun reported them, root cause first.
    failures: tuple[RankFailure, ...] = ()
    #: The pids its torchrun stopped itself (``rank_errors.stopped_pids``).
    stopped: tuple[int, ...] = ()
    #: The job's one-line error on this node.
    error: str = ""

    @classmethod
    def from_error(cls, node: str, exc) -> NodeReport:
        """The report of a ``JobFailedError`` (torchrun's report in its stderr) or ``JobStalledError``."""
        from .runtime.launch import JobStalledError

        if isinstance(exc, JobStalledError):
            failures = [RankFailure(rank=exc.rank, stalled=True)] if exc.rank is not None else []
            stopped: frozenset[int] = frozenset()
        else:
            text = exc.stderr or ""
            failures, stopped = failed_ranks(text), stopped_pids(text)
        return cls(node=node, host=socket.gethostname(), failures=tuple(failures),
                   stopped=tuple(sorted(stopped)), error=" ".join(str(exc).split())[:2000])


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """What the deciding node published for one attempt ([Note: losing a node])."""

    #: "replan": restart under ``plan``; "stop": no GPU was lost, every node ends with ``reason``.
    action: Literal["replan", "stop"]
    #: Why, in one phrase: the node(s) or rank lost and how, or the verdict.
    reason: str
    #: The node that decided.
    decided_by: str
    #: The re-plan's directory (absolute); "" for "stop".
    plan: str = ""
    #: The re-plan's nodes in torchrun's order (``Plan.node_ranks``): a node's place is its new ``--node-rank``.
    nodes: tuple[str, ...] = ()
    #: Where the new rendezvous is (node 0's host), and its port.
    master_addr: str = ""
    master_port: int = 0
    #: The checkpoint every node resumes from ("" : none intact, the run starts anew).
    resume: str = ""


class Agreement:
    """One node's side of the agreement of job ``job`` in ``<out>/.elastic``
    ([Note: losing a node]). ``clock``/``sleep`` are the waiting node's own
    (``time.monotonic``/``time.sleep``; tests pass their own)."""

    def __init__(self, out: str | Path, job: str, node: str, *, lost_after_s: float = LOST_AFTER_S,
                 wait_s: float = WAIT_S, decide_wait_s: float = DECIDE_WAIT_S, poll_s: float = 0.2,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.root, self.job, self.node = Path(out) / ELASTIC_DIRNAME, job, node
        self.lost_after_s, self.wait_s, self.decide_wait_s, self.poll_s = lost_after_s, wait_s, decide_wait_s, poll_s
        self.clock, self.sleep = clock, sleep

    @staticmethod
    def start_job(out: str | Path) -> str:
        """Node 0, before it starts torchrun: a fresh job id in ``<out>/.elastic/job``; returns it."""
        root = Path(out) / ELASTIC_DIRNAME
        root.mkdir(parents=True, exist_ok=True)
        job = uuid.uuid4().hex[:12]
        _write_json(root / "job", {"job": job})
        return job

    @staticmethod
    def current_job(out: str | Path) -> str | None:
        doc = _read_json(Path(out) / ELASTIC_DIRNAME / "job")
        job = doc.get("job") if doc else None
        return job if isinstance(job, str) and job.isalnum() else None

    def attempt_dir(self, attempt: int) -> Path:
        return self.root / self.job / f"attempt{attempt}"

    def _beat(self, node: str) -> object:
        """What ``node``'s beat file holds now (its writer's time; only whether it changes is read)."""
        doc = _read_json(self.root / f"beat-{node}")
        return doc.get("time") if doc else None

    def gather(self, attempt: int, nodes: tuple[str, ...], mine: NodeReport) -> tuple[dict[str, NodeReport], list[str]]:
        """Write ``mine`` and wait for the other nodes of ``nodes``: returns (the reports by node, the nodes
        lost: no report, and no beat for ``lost_after_s`` or none by the end of ``wait_s``), in ``nodes``' order."""
        d = self.attempt_dir(attempt)
        d.mkdir(parents=True, exist_ok=True)
        _write_json(d / f"report-{self.node}.json", dataclasses.asdict(mine))
        start = self.clock()
        seen: dict[str, tuple[object, float]] = {}  # node -> (its beat, when this node saw it change)
        while True:
            now = self.clock()
            reports, lost = {}, []
            for n in nodes:
                report = _load(d / f"report-{n}.json", NodeReport)
                if report is not None:
                    reports[n] = report
                    continue
                beat = self._beat(n)
                if n not in seen or seen[n][0] != beat:
                    seen[n] = (beat, now)
                if now - seen[n][1] >= self.lost_after_s:
                    lost.append(n)
            if len(reports) + len(lost) == len(nodes) or now - start >= self.wait_s:
                return reports, [n for n in nodes if n not in reports]
            self.sleep(self.poll_s)

    def publish(self, attempt: int, decision: Decision) -> Decision:
        """``decision`` as this attempt's, unless another node's is there first: then that one."""
        d = self.attempt_dir(attempt)
        tmp = d / f".decision.{self.node}.tmp"
        tmp.write_text(json.dumps(dataclasses.asdict(decision), indent=1) + "\n")
        try:
            os.link(tmp, d / "decision.json")  # first writer wins, on every POSIX filesystem (NFS included)
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
        return self.wait_decision(attempt, leader=decision.decided_by)

    def wait_decision(self, attempt: int, *, leader: str) -> Decision:
        """This attempt's decision, waiting up to ``decide_wait_s`` for it.

        Raises:
            ElasticError: none came (the deciding node ``leader`` was lost too, or cannot write)."""
        path = self.attempt_dir(attempt) / "decision.json"
        start = self.clock()
        while True:
            decision = _load(path, Decision)
            if decision is not None:
                return decision
            if self.clock() - start >= self.decide_wait_s:
                raise ElasticError(f"--elastic: node {self.node!r} waited {self.decide_wait_s:.0f} s for node "
                                   f"{leader!r} to re-plan (its decision {path}) and none came: that node may be lost "
                                   f"too; resume with `zorse train ... --resume` under a plan for the nodes that work")
            self.sleep(self.poll_s)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _clip(text: str, chars: int = 240) -> str:
    """``text`` on one line, at most ``chars`` characters (the whole is in the run's logs)."""
    text = " ".join(text.split())
    return text if len(text) <= chars else text[:chars].rsplit(" ", 1)[0] + " ..."


def decide(plan, reports: dict[str, NodeReport], lost_nodes: list[str]) -> tuple[set[int] | None, str]:
    """What failed, from every node's report ([Note: losing a node]): ``(the GPUs lost (cluster indices), one
    phrase naming them and how)``, or ``(None, the verdict or errors)`` where no GPU was lost."""
    by_rank = {g.rank: g for s in plan.stages for g in s.gpus}
    if lost_nodes:
        gone = sorted((g for g in by_rank.values() if g.node in lost_nodes), key=lambda g: g.rank)
        what = "; ".join(f"node {n!r} ({_ranks([g.rank for g in gone if g.node == n])}) was lost: no report from "
                         f"its zorse train" for n in lost_nodes)
        return {g.gpu for g in gone}, what
    merged: list[RankFailure] = []
    stopped: set[int] = set()
    for r in reports.values():
        fails = list(r.failures)
        if fails and not fails[0].stalled and fails[0].exitcode in VERDICTS:
            return None, f"node {r.node!r}: {r.error}"  # the run stopped itself (a verdict): no GPU lost
        merged += fails
        stopped |= set(r.stopped)
    stalled = [f for f in merged if f.stalled]
    lost = stalled[0] if stalled else lost_rank(merged, stopped=frozenset(stopped))
    if lost is None or lost.rank not in by_rank:
        errors = "; ".join(f"node {r.node!r}: {r.error}" for r in reports.values() if r.error)
        return None, errors or "no rank failed"
    g = by_rank[lost.rank]
    return {g.gpu}, (f"rank {lost.rank} (GPU {g.gpu}, {g.gpu_type} on node {g.node!r}) failed for good "
                     f"({lost.describe()})")


def run_elastic_nodes(options, *, rendezvous, node: str, max_replans: int, launch_kw: dict,
                      lost_after_s: float = LOST_AFTER_S, wait_s: float = WAIT_S) -> int:
    """``zorse train --elastic --nnodes N`` on node ``node`` (``rendezvous``:
    its ``runtime.launch.Rendezvous``): train ``options``; after a failure,
    agree with the other nodes on what was lost, re-plan without it (at most
    ``max_replans`` times) and resume on the new plan ([Note: losing a
    node]). ``launch_kw``: ``runtime.launch.launch``'s supervision options
    (without ``rendezvous``/``ranks``). Returns 0 once the run finished here
    (or the re-plan left this node idle).

    Raises:
        ElasticError: no plan request, no plan for what remains, re-plans spent, no decision came.
        JobFailedError, JobStalledError: a failure that lost no GPU (raised unchanged on every node).
    """
    from .cluster import Cluster
    from .plan import Plan
    from .runtime.checkpoint import newest_intact_checkpoint
    from .runtime.launch import JobFailedError, JobStalledError, launch, node_launch, torchrun_command
    from .runtime.rank_errors import failed_ranks as _reported
    from .runtime.run_dir import CHECKPOINTS
    from .train_options import OPTIONS_FILE, write_options_file

    first = Path(options.data.plan)
    plan_dir = first if first.is_dir() else first.parent
    request = PlanRequest.read(plan_dir)  # refused before anything starts
    out = Path(options.job.out)
    beating = threading.Event()  # set: this node's beat stops (the launcher is done)
    start_beat(out / ELASTIC_DIRNAME / f"beat-{node}", {"node": node, "pid": os.getpid()}, BEAT_INTERVAL_S,
               stop=beating)
    job = Agreement.start_job(out) if rendezvous.node_rank == 0 else None
    replans = attempt = 0
    try:
        while True:
            plan = Plan.load(plan_dir)
            here = node_launch(plan, rendezvous, 0, plan_path=plan_dir)
            options_file = write_options_file(options, out / OPTIONS_FILE)
            argv = ["--options-file", str(options_file)]
            if replans:  # (the first launch's command is zorse train's own line)
                print("[zorse] " + " ".join(torchrun_command(len(here.ranks), argv, rendezvous=rendezvous,
                                                             shutdown_timeout_s=launch_kw.get("term_grace_s"))),
                      flush=True)
            try:
                launch(len(here.ranks), argv, rendezvous=rendezvous, ranks=here.ranks,
                       stderr_tail_chars=STDERR_TAIL_CHARS, **launch_kw)
                return 0
            except (JobFailedError, JobStalledError) as exc:
                if isinstance(exc, JobFailedError) and not _reported(exc.stderr or "") and exc.returncode >= 0:
                    raise  # no worker failed: torchrun itself (a rendezvous that never formed)
                job = job or Agreement.current_job(out)
                if job is None:
                    raise
                agreement = Agreement(out, job, node, lost_after_s=lost_after_s, wait_s=wait_s)
                nodes = tuple(n.node for n in plan.node_ranks())
                print(f"[zorse] elastic: node {node!r}: its ranks stopped ({_clip(str(exc))}); waiting for the "
                      f"other nodes' reports in {out / ELASTIC_DIRNAME}", flush=True)
                reports, lost_nodes = agreement.gather(attempt, nodes, NodeReport.from_error(node, exc))
                leader = next(n for n in nodes if n in reports)
                if leader == node:
                    decision = _decide_and_replan(plan, plan_dir, request, reports, lost_nodes, out=out,
                                                  rendezvous=rendezvous, replans=replans, max_replans=max_replans,
                                                  node=node, newest=lambda: newest_intact_checkpoint(out / CHECKPOINTS)[0])
                    decision = agreement.publish(attempt, decision)
                else:
                    print(f"[zorse] elastic: node {node!r}: reports in (lost: "
                          f"{', '.join(map(repr, lost_nodes)) or 'none'}); node {leader!r} decides", flush=True)
                    decision = agreement.wait_decision(attempt, leader=leader)
                attempt += 1
                if decision.action != "replan":
                    if decision.reason.startswith("--elastic:"):
                        raise ElasticError(decision.reason) from exc
                    print(f"[zorse] elastic: no GPU was lost ({_clip(decision.reason)}; decided by node "
                          f"{decision.decided_by!r}): the job ends as without --elastic", flush=True)
                    raise
                replans += 1
                new_plan, new_request = Plan.load(decision.plan), PlanRequest.read(decision.plan)
                old_cluster, new_cluster = Cluster.from_dict(request.cluster), Cluster.from_dict(new_request.cluster)
                print(f"[zorse] elastic: {decision.reason} (decided by node {decision.decided_by!r})", flush=True)
                for line in what_changed(plan, new_plan, old_cluster, new_cluster):
                    print(line, flush=True)
                if node not in decision.nodes:
                    print(f"[zorse] elastic: node {node!r} has no GPU in the re-plan {decision.plan} (its nodes: "
                          f"{', '.join(map(repr, decision.nodes))}): nothing more to run here", flush=True)
                    return 0
                d = options.data
                weights = None if d.weights is None or Path(d.weights).parent == plan_dir else d.weights
                options = dataclasses.replace(
                    options, data=dataclasses.replace(d, plan=decision.plan, weights=weights),
                    checkpoint=dataclasses.replace(options.checkpoint, resume=bool(decision.resume),
                                                   overwrite=not decision.resume),
                    testing=dataclasses.replace(options.testing, fail_rank=None, kill_at_step=None, inject_inf=None))
                plan_dir, request = Path(decision.plan), new_request
                resuming = (f"resuming from {decision.resume}" if decision.resume else "starting anew") + \
                    f" (re-plan {replans} of --max-replans {max_replans})"
                if len(decision.nodes) == 1:  # one node left: torchrun --standalone, as a one-host job
                    from .elastic import run_elastic

                    print(f"[zorse] elastic: node {node!r} is the re-plan's only node: it restarts on its own "
                          f"(torchrun --standalone), {resuming}", flush=True)
                    return run_elastic(options, nproc=new_plan.world_size, max_replans=max_replans - replans,
                                       launch_kw=launch_kw)
                rendezvous = dataclasses.replace(rendezvous, nnodes=len(decision.nodes),
                                                 node_rank=decision.nodes.index(node),
                                                 master_addr=decision.master_addr, master_port=decision.master_port)
                print(f"[zorse] elastic: node {node!r} restarts as --node-rank {rendezvous.node_rank} of "
                      f"{rendezvous.nnodes} (rendezvous {rendezvous.master_addr}:{rendezvous.master_port}), "
                      f"{resuming}", flush=True)
    finally:
        beating.set()


def _decide_and_replan(plan, plan_dir: Path, request: PlanRequest, reports: dict[str, NodeReport],
                       lost_nodes: list[str], *, out: Path, rendezvous, replans: int, max_replans: int, node: str,
                       newest) -> Decision:
    """The deciding node's part ([Note: losing a node]): what was lost, the re-plan, the new rendezvous."""
    from .cluster import Cluster

    lost_gpus, what = decide(plan, reports, lost_nodes)
    if lost_gpus is None:
        return Decision(action="stop", reason=what, decided_by=node)
    if replans >= max_replans:
        return Decision(action="stop", decided_by=node,
                        reason=f"--elastic: {what} under {plan_dir}, after {replans} re-plan(s): --max-replans "
                               f"{max_replans} spent; resume with `zorse train ... --resume` under a plan for the "
                               f"GPUs that work")
    cluster = Cluster.from_dict(request.cluster)
    smaller, dropped = reduced_cluster(cluster, lost_gpus)
    print(f"[zorse] elastic: dropped {dropped}; re-planning for the {len(smaller.gpus)} GPU(s) left", flush=True)
    latest = newest()
    new_dir = replan_dir(out)
    go_on = (f"resume from {latest}: `zorse train <that plan> --resume --out {out} ...`" if latest is not None
             else f"start anew: `zorse train <that plan> --overwrite --out {out} ...`")
    try:
        new = replan(request, smaller, new_dir, lost=what, replanned_from=plan_dir, run=out,
                     fix=f"make a plan for GPUs that fit (`zorse plan --cluster FILE ...`) and {go_on}")
    except ElasticError as exc:
        return Decision(action="stop", reason=str(exc), decided_by=node)
    nodes = tuple(n.node for n in new.node_ranks())
    old_first = plan.node_ranks()[0].node
    if nodes[0] == old_first:
        master = rendezvous.master_addr
    else:
        master = reports[nodes[0]].host
    print(f"[zorse] elastic: wrote {new_dir} (its cluster: {new_dir / REPLAN_CLUSTER})", flush=True)
    return Decision(action="replan", reason=what, decided_by=node, plan=str(new_dir.resolve()), nodes=nodes,
                    master_addr=master, master_port=rendezvous.master_port,
                    resume=str(latest) if latest is not None else "")
