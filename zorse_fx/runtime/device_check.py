"""Each rank runs on the GPU and node the plan assigned to it.

[Note: checking the devices against the plan]
A plan gives rank ``r`` one GPU of the cluster file: its type, its memory and
its node (``GPUShare``). torchrun numbers the ranks node by node in
``--node-rank`` order, each node's from the sum of the lower nodes' process
counts, and the local ranks of a node by ``LOCAL_RANK``, which is what a plan
numbers ([Note: ranks node by node] in ``plan.py``) where node k is started
with ``--node-rank k`` and its own count (``Plan.node_ranks``); a node started
with another ``--node-rank`` or count, or a machine with other GPUs, runs
every stage on GPUs it was not planned for: wrong memory, wrong timings, or an
out-of-memory error deep in a step. So after the process group is up every
rank observes itself (``observe``: host name, torchrun's node rank, device
type, GPU name and memory), the observations are all-gathered, and
``check_devices`` -- a pure function of the plan's assignment and the
observations, the same on every rank -- names the first rank that is not where
the plan put it, and says how to start the nodes (``_start_nodes``: each
node's ``--node-rank`` and process count, from the plan; for a plan whose
ranks of a node are not contiguous, numbered stage by stage by a zorse_fx
before format 15, that it must be re-planned to run on several nodes):

- GPU (a CUDA rank): the device name must resolve (``cluster.specs``:
  aliases, ``NVIDIA`` prefix) to the planned GPU type, and its memory must be
  at least ``MEMORY_TOLERANCE`` of what the plan assumed (a datasheet's "16
  GB" is 14.6-15.8 GiB as CUDA reports it). A type the built-in table does not
  know (declared in the cluster file) is checked by memory only. A CPU rank
  (Gloo, this machine standing in for GPUs) has no GPU name or memory: that
  part is skipped, and ``DeviceReport.skipped`` says why.
- Node: where the cluster file names its nodes by host name (a planned node
  equals a rank's host name), every rank's host must be its planned node;
  otherwise the ranks of one planned node must share one host and those of
  two planned nodes must not. A job whose ranks all run on one host's CPU
  simulates the plan's nodes there: that part is skipped too.

``zorse train --skip-device-check`` (``JobOptions.skip_device_check``) runs
anyway, e.g. a plan for another cluster tried on this one's GPUs.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from ..cluster.specs import lookup_builtin, normalize_gpu_name
from ..errors import RuntimeExecutionError

__all__ = ["DeviceObservation", "DeviceReport", "DeviceMismatchError", "MEMORY_TOLERANCE", "observe",
           "check_devices"]

#: The least fraction of the plan's memory (``GPUShare.memory_capacity_bytes``) a GPU may report:
#: CUDA's total memory is below a datasheet's round figure (a T4, "16 GB", reports 14.7 GiB).
MEMORY_TOLERANCE = 0.85


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceObservation:
    """What one rank finds itself running on."""

    rank: int
    #: ``socket.gethostname()`` of the rank's machine.
    host: str
    #: torchrun's ``GROUP_RANK``: the ``--node-rank`` its node was started with (-1: not started by torchrun).
    node_rank: int = -1
    #: ``"cuda"`` or ``"cpu"``.
    device_type: str
    #: ``torch.cuda.get_device_name`` ("NVIDIA A100-SXM4-40GB"); "" on a CPU.
    gpu_name: str = ""
    #: The GPU's total memory, bytes (0 on a CPU).
    memory_bytes: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceReport:
    """``check_devices``'s answer when every rank fits: the parts it skipped, and why."""

    skipped: tuple[str, ...] = ()


class DeviceMismatchError(RuntimeExecutionError):
    """A rank runs on another GPU or node than the plan assigned to it; ``rank``
    is that rank (the one the message is about, not necessarily the one raising)."""

    def __init__(self, message: str, *, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


def observe(rank: int, device) -> DeviceObservation:
    """This rank's observation on ``device`` (a ``torch.device``)."""
    import os

    import torch

    node_rank = int(os.environ.get("GROUP_RANK", "-1") or -1)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return DeviceObservation(rank=rank, host=socket.gethostname(), node_rank=node_rank, device_type="cuda",
                                 gpu_name=props.name, memory_bytes=int(props.total_memory))
    return DeviceObservation(rank=rank, host=socket.gethostname(), node_rank=node_rank, device_type=device.type)


def _short(host: str) -> str:
    return host.split(".", 1)[0].lower()


def _rank(plan, r: int) -> str:
    stages = tuple(plan.stages_of(r))
    return f"rank {r} ({'stage' if len(stages) == 1 else 'stages'} {', '.join(map(str, stages))})"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


#: Nodes ``_start_nodes`` lists by name; more are summed up.
_LISTED_NODES = 4


def _start_nodes(plan, *, gpus: bool = False) -> str:
    """How to start the plan's nodes, as the end of a mismatch message: each
    node's ``--node-rank`` and process count (``Plan.node_ranks``; ``gpus``:
    and which of its GPUs); for a plan with a node whose ranks are not
    contiguous (numbered stage by stage), that no start works but one host or
    a re-plan."""
    nodes = plan.node_ranks()
    split = next((n for n in nodes if not n.contiguous), None)
    if split is not None:
        return (f"this plan numbers its ranks stage by stage (rank_order {plan.rank_order!r}, made before format "
                f"15): node {split.node!r} has {split.describe_ranks()}, which torchrun cannot start on one node; "
                f"re-plan with `zorse plan` (ranks node by node) to run on several nodes, or run it on one host; "
                f"--skip-device-check runs anyway")
    shown = [f"{n.node_rank} on {n.node!r} ({len(n.ranks)} process{'es' if len(n.ranks) > 1 else ''}: "
             f"{n.describe_ranks()})" for n in nodes[:_LISTED_NODES]]
    if len(nodes) > _LISTED_NODES:
        shown.append(f"... up to {len(nodes) - 1} on {nodes[-1].node!r} (`zorse train --dry-run --nnodes "
                     f"{len(nodes)} --node-rank K` names node K)")
    where = (" and CUDA_VISIBLE_DEVICES listing the node's planned GPUs in the cluster file's order" if gpus else "")
    other = ", or plan for these GPUs (`zorse plan --cluster ...`)" if gpus else ""
    return (f"start each node with its --node-rank{where}: {', '.join(shown)}, the plan's nodes in the cluster "
            f"file's order (`zorse train --nnodes {len(nodes)} --node-rank K --master-addr HOST` on node K starts its "
            f"processes; torchrun: --nproc-per-node){other}; --skip-device-check runs anyway")


def _started_as(o: DeviceObservation, plan) -> str:
    """``"; host 't4-node' was started with --node-rank 0, which is the plan's node 'a100-node'"`` from
    torchrun's GROUP_RANK ("" where not known; the plan's node only where its nodes' ranks are contiguous)."""
    nodes = plan.node_ranks()
    if o.node_rank < 0:
        return ""
    if not 0 <= o.node_rank < len(nodes) or not all(n.contiguous for n in nodes):  # (no node k of the plan)
        return f"; host {o.host!r} was started with --node-rank {o.node_rank}"
    return (f"; host {o.host!r} was started with --node-rank {o.node_rank}, which is the plan's node "
            f"{nodes[o.node_rank].node!r}")


def check_node_host(plan, node_rank: int, host: str | None = None) -> None:
    """Before a node's processes start (``zorse train --nnodes N --node-rank K``): where the cluster file
    names its nodes by host name and this host (``host``, default ``socket.gethostname()``) is one of the
    plan's nodes, it must be node ``node_rank``. The ranks would find it out too, but only after every node
    has joined the rendezvous; said here it costs no rendezvous and the node's error is its own. A host
    named after none of the plan's nodes is left to the ranks' check ([Note: checking the devices against
    the plan]).

    Raises:
        DeviceMismatchError: naming the host, the --node-rank it was started with, that node of the
            plan and the --node-rank of each node (rank -1: no rank has started)."""
    host = socket.gethostname() if host is None else host
    nodes = plan.node_ranks()
    if not all(n.contiguous for n in nodes) or not 0 <= node_rank < len(nodes):
        return  # (node_launch refuses these with their own lines)
    mine = next((n for n in nodes if _short(n.node) == _short(host)), None)
    if mine is None or mine.node_rank == node_rank:
        return
    raise DeviceMismatchError(
        f"host {host!r} is the plan's node {mine.node!r} (--node-rank {mine.node_rank}), but it was started with "
        f"--node-rank {node_rank}, which is the plan's node {nodes[node_rank].node!r}; {_start_nodes(plan)}",
        rank=-1)


def check_devices(plan, observed: list[DeviceObservation]) -> DeviceReport:
    """Check every rank's ``observed`` device and host against ``plan``'s
    assignment (see [Note: checking the devices against the plan]).

    Raises:
        DeviceMismatchError: the first rank not where the plan put it, its
            GPU or host and the planned one named, with the fix."""
    shares = {g.rank: g for s in plan.stages for g in s.gpus}  # (interleaved: the same GPU again)
    skipped = []
    # -- the GPU of each rank ---------------------------------------------------------------------
    cpu = [o for o in observed if o.device_type != "cuda"]
    if cpu:
        skipped.append(f"GPU name and memory: rank{'s' if len(cpu) > 1 else ''} "
                       f"{', '.join(str(o.rank) for o in cpu)} run{'' if len(cpu) > 1 else 's'} on the CPU (no GPU "
                       f"to compare with the plan's)")
    for o in observed:
        if o.device_type != "cuda":
            continue
        g = shares[o.rank]
        where = f"{_rank(plan, o.rank)} runs on a {o.gpu_name} ({_gib(o.memory_bytes)}) on host {o.host!r}"
        planned = f"the plan assigned it GPU {g.gpu} of the cluster file, a {g.gpu_type} on node {g.node!r}"
        fix = _start_nodes(plan, gpus=True)
        want = lookup_builtin(g.gpu_type)  # None: a type the cluster file declares (memory only)
        if want is not None:
            got = lookup_builtin(o.gpu_name)
            if (got.type if got is not None else normalize_gpu_name(o.gpu_name)) != want.type:
                raise DeviceMismatchError(f"{where}, but {planned}; {fix}", rank=o.rank)
        if g.memory_capacity_bytes and o.memory_bytes < MEMORY_TOLERANCE * g.memory_capacity_bytes:
            raise DeviceMismatchError(f"{where}, but {planned} with {_gib(g.memory_capacity_bytes)}; {fix}",
                                      rank=o.rank)
    # -- the node of each rank --------------------------------------------------------------------
    nodes = {g.node for g in shares.values()}
    by_name = {_short(n): n for n in nodes}
    hosts = {o.rank: o.host for o in observed}
    seen = {o.rank: o for o in observed}
    fix = _start_nodes(plan)
    if any(_short(h) in by_name for h in hosts.values()):  # the cluster file names its nodes by host name
        for r in sorted(hosts):
            g = shares[r]
            if _short(hosts[r]) != _short(g.node):
                raise DeviceMismatchError(
                    f"{_rank(plan, r)} runs on host {hosts[r]!r}, but the plan assigned it GPU {g.gpu} "
                    f"({g.gpu_type}) on node {g.node!r}{_started_as(seen[r], plan)}; {fix}", rank=r)
        return DeviceReport(skipped=tuple(skipped))
    if len(set(hosts.values())) == 1 and not any(o.device_type == "cuda" for o in observed):
        skipped.append(f"nodes: every rank runs on the CPU of host {next(iter(hosts.values()))!r}, standing in for "
                       f"the plan's {len(nodes)} node{'s' if len(nodes) > 1 else ''}")
        return DeviceReport(skipped=tuple(skipped))
    host_of_node: dict[str, tuple[str, int]] = {}
    node_of_host: dict[str, tuple[str, int]] = {}
    for r in sorted(hosts):
        g = shares[r]
        h = hosts[r]
        seen = host_of_node.setdefault(g.node, (h, r))
        if seen[0] != h:
            raise DeviceMismatchError(
                f"{_rank(plan, r)} runs on host {h!r}, but the plan puts it on node {g.node!r} with rank "
                f"{seen[1]}, which runs on host {seen[0]!r}; {fix}", rank=r)
        other = node_of_host.setdefault(h, (g.node, r))
        if other[0] != g.node:
            raise DeviceMismatchError(
                f"{_rank(plan, r)} runs on host {h!r} beside rank {other[1]}, but the plan puts it on node "
                f"{g.node!r} and rank {other[1]} on node {other[0]!r}; {fix}", rank=r)
    return DeviceReport(skipped=tuple(skipped))

