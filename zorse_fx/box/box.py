"""``Box``: a heterogeneous cluster emulated on one Linux machine ([Note: the box]).

    with Box.up("examples/clusters/small_hetero.yaml") as box:     # this process holds it
        print(box.layout.table())
        p = box.spawn("t4-node", ["python", "-c", "import socket; print(socket.gethostname())"], rank=0)
        p.wait()
    # gone: namespaces, veths, bridges, qdiscs, cgroups, the delay line and every process in them

``zorse box up/down/run/gc`` (cli.py) are the same operations from the command line; a box built by
``zorse box up`` stays until ``zorse box down <id>``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..cluster import Cluster
from ..errors import BoxConfigError, BoxSetupError, BoxStateFileError
from ..pacing import ENV_PACE, ENV_PACE_REFERENCE
from . import net
from .cgroups import AGENT_LEAF, ROUTER_LEAF, Cgroups, kill_and_remove, pids_under, rank_dir, rank_leaf
from .layout import NETNS_PREFIX, BoxLayout, BoxOptions, plan_box
from .state import (STATE_DIR, BoxState, box_file, holder_alive, process_start_ticks, read_state, state_ids,
                    state_path, write_state)

__all__ = ["Box", "check_machine", "netem_available", "gc", "remove_box", "ENV_BOX", "ENV_NODE"]

#: Set in every command the box starts: the box's id and the node it runs on (``rank_enter`` reads them).
ENV_BOX, ENV_NODE = "ZORSE_BOX", "ZORSE_BOX_NODE"
#: How long the delay line may take to open its devices.
_READY_TIMEOUT_S = 10.0

# [Note: the box]
# `zorse box up` turns a cluster file into namespaces, links and cgroups on this machine
# (layout.plan_box decides every number, net.build and cgroups.Cgroups make them), so that a
# `zorse train` started once per node meets real TCP, real rendezvous and real contention:
#   * a node is a network namespace zbox-<id>-<node> ([Note: the box's network] in net.py). Its
#     hostname is the node's name through a UTS namespace made per command: every command the box
#     starts runs as `nsenter --net=<node's netns> unshare --uts --mount sh -c 'hostname <node>;
#     mount --bind <id>.hosts /etc/hosts; exec cmd'`. Per command rather than one held UTS namespace
#     per node: nothing more to keep or remove (it ends with the command and its children, torchrun's
#     ranks included), and two commands on one node see the same name. The private mount namespace
#     carries the box's /etc/hosts, so node names resolve to box addresses as on a real cluster, and a
#     resolv.conf naming no reachable server, so other lookups (c10d's reverse lookups of its peers)
#     fail at once instead of waiting 5 s for the machine's DNS server.
#   * a rank is a cgroup leaf (with --memory, under a memory limit) and its GPU's speed: its compute
#     paced by ZORSE_PACE ([Note: paced compute] in zorse_fx/pacing.py; `--speed quota`: a CPU quota on
#     the leaf, [Note: CPU quotas] in layout.py); `spawn(node, argv, rank=j)` starts a process in it with
#     its pace, and torchrun's workers enter theirs by local rank through `python -m zorse_fx.box.rank_enter`.
#   * links are scaled by one factor s ([Note: the box's scale factor] in layout.py).
# Removal ([Note: removing a box]) kills every process in the box's cgroups and namespaces, then
# deletes the namespaces (their interfaces and qdiscs go with them), the cgroups and the files.

# [Note: latency without netem]
# Where the kernel has sch_netem, a netem leaf under each per-peer class makes the pair's one-way
# delay. Where it has not (this project's machines: no sch_netem, fq or cake; htb, tbf, IFB and TUN
# are there), the router runs a delay line (delay_line.py): policy routing hands every packet the
# router forwards between nodes to a TUN device, a Python loop holds it for its (source,
# destination) pair's delay and writes it into a second TUN device, from where it is routed on. It
# sits after the sender's NIC and any shared link, before the receiver's NIC: a message leaves at the
# link's rate and arrives one delay later, the alpha-beta model's alpha. Its own cost, measured by
# bench/box_selfcheck.py (bench/LOG.md, "The box"): a fraction of a millisecond added per packet,
# more under load, and a throughput ceiling of tens of MB/s -- against the box's delays of tens of ms
# and rates of a few MB/s (small_hetero: 53 ms, 1.2 MB/s). Delays under DELAY_LINE_FLOOR_S are left
# out and the box says so.

# [Note: removing a box]
# Every name the box will create is in its state file before the first one exists, so a box
# interrupted half-built is removed like a whole one; `down` also sweeps names with the box's prefix.
# Processes first (SIGKILL to everything in the box's cgroups and namespaces, until none is left:
# a namespace whose last process lives on keeps its veths), then namespaces, cgroups and files.
# `Box.up` removes its box on leaving the `with` (normally or by an exception), on SIGINT
# (KeyboardInterrupt) and on SIGTERM (turned into SystemExit(143) while the box is up); SIGINT and
# SIGTERM are held back while it removes. SIGKILL cannot be caught: the box then outlives its holder
# until `zorse box down <id>` or `zorse box gc`, which removes every box whose holder is gone and every
# zbox- namespace or cgroup without a state file.

_ENTER = ('hostname "$0" && mount --bind "$1" /etc/hosts && { [ ! -e /etc/resolv.conf ] || mount --bind "$2" '
          '/etc/resolv.conf; } && shift 2 && exec "$@"')
#: The resolver configuration every command in a box sees: no DNS server can be reached from the box, so
#: lookups that /etc/hosts does not answer fail at once (a closed local port) instead of timing out.
_RESOLV_CONF = "# zorse box: names come from /etc/hosts\nnameserver 127.0.0.1\noptions timeout:1 attempts:1\n"


@functools.cache
def netem_available() -> bool:
    """Whether this kernel has netem (tried on the loopback of a throwaway network namespace)."""
    r = net.run(["unshare", "--net", "sh", "-c", "ip link set lo up && tc qdisc add dev lo root netem delay 1ms"],
                check=False)
    return r.returncode == 0


def check_machine() -> str | None:
    """Why this machine cannot build a box, or None: each capability the box uses is tried (namespaces,
    veth, bridge, IFB, htb, TUN in a throwaway network namespace; a cgroup with a CPU quota)."""
    if os.geteuid() != 0:
        return "the box needs root (network namespaces, cgroups)"
    script = ("ip link add zb0 type veth peer name zb1 && ip link add zbr type bridge && ip link add zif type ifb "
              "&& tc qdisc add dev zb0 root handle 1: htb && "
              f"{sys.executable} -I -S -c 'import os, sys; sys.path.insert(0, sys.argv[1]); "
              "import delay_line; delay_line.open_tun(\"zt0\")' " + str(Path(__file__).parent))
    try:
        r = net.run(["unshare", "--net", "sh", "-c", script], check=False)
    except BoxSetupError as exc:
        return str(exc)
    if r.returncode:
        return f"no CAP_NET_ADMIN or a missing kernel feature (veth, bridge, ifb, htb, tun): {r.stderr.strip()}"
    try:
        Cgroups.detect().probe()
    except BoxSetupError as exc:
        return str(exc)
    return None


def _latency(option: str) -> str:
    if option == "auto":
        return "netem" if netem_available() else "delay-line"
    if option == "netem" and not netem_available():
        raise BoxSetupError("--latency netem: this kernel has no netem (sch_netem); use --latency delay-line (or "
                            "auto, which picks it)")
    return option


def _pace_reference() -> float:
    """The box's ``ZORSE_PACE_REFERENCE`` ([Note: drift-compensated pacing] in zorse_fx/pacing.py), measured in a
    child process of one thread, as its ranks run: not in this one, where torch's thread pool would then take
    the signals (a SIGINT delivered to a pool thread does not wake the holder's ``time.sleep``)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    code = "from zorse_fx.pacing import nominal_reference_s; print(repr(nominal_reference_s()))"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                             timeout=_READY_TIMEOUT_S * 4)
        value = float(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else None
    except (subprocess.TimeoutExpired, ValueError):
        value, out = None, None
    if value is None:
        why = (out.stderr.strip()[-500:] or f"exit status {out.returncode}") if out is not None else "timed out"
        raise BoxSetupError(f"the reference probe of the drift-compensated pacing did not run: {why}; "
                            f"`zorse box up --no-drift-probe` paces on raw CPU time instead")
    return value


class Box:
    """A box on this machine: its ``state`` (``layout`` inside) and the processes it started here."""

    def __init__(self, state: BoxState) -> None:
        self.state = state
        self.layout: BoxLayout = state.layout
        self._procs: list[subprocess.Popen] = []

    # -- making and finding -----------------------------------------------------------------
    @classmethod
    @contextlib.contextmanager
    def up(cls, cluster: Cluster | str | os.PathLike[str], options: BoxOptions | None = None,
           **fields) -> Iterator[Box]:
        """Build the box of ``cluster`` (a ``Cluster`` or a cluster file) for the ``with`` block, held by
        this process, and remove it on leaving the block, on an exception, on SIGINT and on SIGTERM
        ([Note: removing a box]). ``fields``: ``BoxOptions`` fields (instead of ``options``)."""
        if fields:
            options = dataclasses.replace(options or BoxOptions(), **fields)
        with _sigterm_as_exit():
            box = cls.create(cluster, options, hold=True)
            try:
                yield box
            finally:
                box.down()

    @classmethod
    def create(cls, cluster: Cluster | str | os.PathLike[str], options: BoxOptions | None = None, *,
               hold: bool) -> Box:
        """Build the box of ``cluster``; ``hold``: this process is its holder (``gc`` removes the box once the
        holder is gone), else it is detached (only ``down`` removes it). On any failure, and on
        KeyboardInterrupt, what was built is removed before the exception propagates.

        Raises:
            BoxConfigError: the cluster or the options cannot be emulated here, or the box id is taken.
            BoxSetupError: the machine refused a step (not root, no CAP_NET_ADMIN, no cgroup).
        """
        if not isinstance(cluster, Cluster):
            cluster = Cluster.from_yaml(cluster)
        options = options or BoxOptions()
        cgroups = Cgroups.detect()
        layout = plan_box(cluster, options, latency=_latency(options.latency))
        taken = [n for n in net.list_namespaces() if _box_of(n) == layout.box_id]
        if taken and not state_path(layout.box_id).exists():
            raise BoxConfigError(f"namespaces of an earlier box {layout.box_id!r} are left ({', '.join(taken)}); "
                                 f"remove them with `zorse box down {layout.box_id}` (or `zorse box gc`)")
        me = os.getpid()
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        state = BoxState(box_id=layout.box_id, created_at=now, holder_pid=me if hold else None,
                         holder_start=process_start_ticks(me) if hold else None, cgroups=cgroups,
                         cgroup_dirs=cgroups.box_dirs(layout.box_id),
                         netns=(layout.router_netns, *(n.netns for n in layout.nodes)), delay_line_pid=None,
                         layout=layout,
                         pace_reference_s=_pace_reference() if layout.speed == "pace" and options.drift_probe
                         else None)
        write_state(state, new=True)
        box = cls(state)
        try:
            box._build()
        except BaseException:
            box.down()
            raise
        return box

    @classmethod
    def find(cls, box_id: str) -> Box:
        """The box ``box_id`` from its state file (``BoxConfigError``: none; ``BoxStateFileError``: damaged)."""
        return cls(read_state(box_id))

    def _build(self) -> None:
        layout, cg = self.layout, self.state.cgroups
        box_file(layout.box_id, "hosts").write_text(layout.hosts_text())
        box_file(layout.box_id, "resolv.conf").write_text(_RESOLV_CONF)
        leaves: list[tuple[str | None, str, float | None, int | None]] = [(None, ROUTER_LEAF, None, None)]
        for n in layout.nodes:
            leaves.append((n.name, AGENT_LEAF, None, None))
            for r in n.ranks:  # [Note: host and GPU leaves] in cgroups.py
                leaves += [(n.name, rank_dir(r.local_rank), None, r.memory_limit_bytes),
                           (n.name, rank_leaf(r.local_rank, "host"), None, None),
                           (n.name, rank_leaf(r.local_rank, "gpu"),
                            r.cpu_quota_cores if layout.speed == "quota" else None, None)]
        cg.create(layout.box_id, leaves, layout.cpu_period_us)
        net.add_namespaces(layout)
        net.build(layout, netem=layout.latency == "netem")
        if layout.latency == "delay-line" and any(p.delay_s for p in layout.pairs):
            pid = self._start_delay_line()
            self.state = dataclasses.replace(self.state, delay_line_pid=pid)
            write_state(self.state)
            net.route_through_delay_line(layout)

    def _start_delay_line(self) -> int:
        layout = self.layout
        address = {n.name: n.address for n in layout.nodes}
        config = box_file(layout.box_id, "delay.json")
        config.write_text(json.dumps({
            "tun_in": net.TUN_IN, "tun_out": net.TUN_OUT,
            "delays": [[address[p.src], address[p.dst], p.delay_s] for p in layout.pairs if p.delay_s],
            "stats": str(box_file(layout.box_id, "delay-stats.json"))}))
        log_path = box_file(layout.box_id, "delay.log")
        procs = [Path(d) / "cgroup.procs" for d in self.state.cgroups.leaf_dirs(layout.box_id, None, ROUTER_LEAF)]
        with open(log_path, "w") as log:
            p = subprocess.Popen(
                ["nsenter", f"--net={net.NETNS_DIR / layout.router_netns}", "--", sys.executable, "-I", "-S",
                 str(Path(__file__).with_name("delay_line.py")), str(config)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, preexec_fn=_joiner(procs),
                start_new_session=True)  # Ctrl-C at a terminal reaches the holder, which removes the box
        self._procs.append(p)
        ready, _, _ = select.select([p.stdout], [], [], _READY_TIMEOUT_S)
        line = p.stdout.readline() if ready else b""
        p.stdout.close()
        if line.strip() != b"ready":
            p.kill()
            raise BoxSetupError(f"the delay line did not start within {_READY_TIMEOUT_S:g} s: "
                                f"{log_path.read_text().strip()[-500:] or 'no output'}")
        return p.pid

    # -- removing ---------------------------------------------------------------------------
    def down(self) -> None:
        """Remove the box: every process in it, its namespaces, cgroups and files ([Note: removing a box]).
        Idempotent; SIGINT and SIGTERM wait until it is done."""
        with _signals_held():
            remove_box(self.state.box_id, self.state)
            for p in self._procs:  # reap what this process started (killed above)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=5)

    # -- running commands on a node ---------------------------------------------------------
    def command(self, node: str, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on ``node``: in its network namespace, with its hostname and the box's /etc/hosts
        ([Note: the box]). It does not enter a cgroup: ``spawn`` and ``exec`` do."""
        n = self.layout.node(node)
        if not argv:
            raise BoxConfigError("no command given to run on the node")
        return ["nsenter", f"--net={net.NETNS_DIR / n.netns}", "--", "unshare", "--uts", "--mount", "--propagation",
                "private", "--", "sh", "-c", _ENTER, node, str(box_file(self.layout.box_id, "hosts")),
                str(box_file(self.layout.box_id, "resolv.conf")), *argv]

    def environment(self, node: str, env: dict[str, str] | None = None, *, rank: int | None = None) -> dict[str, str]:
        """The environment of a command on ``node``: ``env`` (default: this process's) with the box's id and
        the node (``ZORSE_BOX``, ``ZORSE_BOX_NODE``), one thread per process (OMP/MKL_NUM_THREADS=1) and, for
        local rank ``rank`` of a paced box, its ``ZORSE_PACE`` and the box's ``ZORSE_PACE_REFERENCE`` ([Note:
        paced compute], [Note: drift-compensated pacing] in zorse_fx/pacing.py); without a rank both are removed
        (torchrun's workers get theirs from ``rank_enter``)."""
        out = dict(os.environ if env is None else env)
        out.update({ENV_BOX: self.layout.box_id, ENV_NODE: node, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
        out.pop(ENV_PACE, None)
        out.pop(ENV_PACE_REFERENCE, None)
        if rank is not None:
            out.update(self.state.pace_environment(node, rank))
        return out

    def leaf(self, node: str, rank: int | None, phase: str = "gpu") -> str:
        """The cgroup leaf of local rank ``rank`` of ``node``: its ``gpu`` leaf (its CPU quota) or ``host`` leaf
        ([Note: host and GPU leaves] in cgroups.py); None: the node's ``agent`` leaf, no limit."""
        if rank is None:
            self.layout.node(node)
            return AGENT_LEAF
        return rank_leaf(self.layout.rank(node, rank).local_rank, phase)

    def spawn(self, node: str, argv: Sequence[str], *, rank: int | None = None, env: dict[str, str] | None = None,
              **popen) -> subprocess.Popen:
        """Start ``argv`` on ``node`` (``command``) in local rank ``rank``'s ``gpu`` leaf, under its CPU quota
        from the start (None: the node's agent cgroup, e.g. for torchrun, whose workers enter their ranks'
        ``host`` leaves through ``rank_enter`` and their ``gpu`` leaves at the first training step).
        ``popen``: ``subprocess.Popen``'s other arguments. The box kills it when it goes down."""
        procs = [Path(d) / "cgroup.procs"
                 for d in self.state.cgroups.leaf_dirs(self.layout.box_id, node, self.leaf(node, rank))]
        p = subprocess.Popen(self.command(node, argv), env=self.environment(node, env, rank=rank),
                             preexec_fn=_joiner(procs),
                             **popen)
        self._procs.append(p)
        return p

    def exec(self, node: str, argv: Sequence[str], *, rank: int | None = None) -> None:
        """Become ``argv`` on ``node`` in rank ``rank``'s cgroup (``zorse box run``): never returns."""
        leaf = self.leaf(node, rank)
        cmd = self.command(node, argv)
        self.state.cgroups.join(0, self.layout.box_id, node, leaf)
        os.execvpe(cmd[0], cmd, self.environment(node, rank=rank))

    def kill_node(self, node: str, *, timeout_s: float = 10.0) -> list[int]:
        """``node`` lost as a host that went down: SIGKILL every process in its network namespace (its
        ``zorse train``, torchrun, the ranks), again until none is left. Returns the pids killed.

        Raises:
            BoxSetupError: processes still there after ``timeout_s`` seconds."""
        netns, killed = self.layout.node(node).netns, []
        end = time.monotonic() + timeout_s
        while pids := sorted(net.netns_pids(netns)):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            if time.monotonic() > end:
                raise BoxSetupError(f"node {node!r} of box {self.layout.box_id}: processes {pids} still in "
                                    f"{netns} {timeout_s:.0f} s after SIGKILL")
            time.sleep(0.05)
        for p in self._procs:  # reap the ones this process started (no zombies left in the namespace's list)
            if p.poll() is None and p.pid in killed:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=1)
        return killed

    # -- reading back what the kernel has -----------------------------------------------------
    def cpu_quota(self, node: str, rank: int) -> tuple[int | None, int]:
        """``(quota_us, period_us)`` of a rank's cgroup as the kernel has it."""
        return self.state.cgroups.cpu_quota(self.layout.box_id, node, self.leaf(node, rank))

    def memory_limit_bytes(self, node: str, rank: int) -> int | None:
        """A rank's memory limit as the kernel has it (None: none)."""
        return self.state.cgroups.memory_limit(self.layout.box_id, node, rank_dir(self.layout.rank(node, rank).local_rank))

    def memory_peak_bytes(self, node: str, rank: int) -> int | None:
        """The most memory rank ``rank`` of ``node`` held at once since the box was built, bytes."""
        return self.state.cgroups.memory_peak(self.layout.box_id, node, rank_dir(self.layout.rank(node, rank).local_rank))

    def oom_kills(self, node: str, rank: int) -> int | None:
        """Processes of rank ``rank`` of ``node`` the kernel killed at its memory limit since the box was
        built (None: not known on this kernel)."""
        return self.state.cgroups.oom_kills(self.layout.box_id, node, rank_dir(self.layout.rank(node, rank).local_rank))

    def node_shaping(self, node: str) -> list[net.TcClass]:
        """The htb classes on ``node``'s eth0 (its NIC and per-pair links)."""
        return net.shaping(self.layout.node(node).netns, net.NODE_IF)

    def router_shaping(self, dev: str) -> list[net.TcClass]:
        """The htb classes on a router device: ``n<k>`` (node k's incoming NIC) or ``ifb0`` (the shared links)."""
        return net.shaping(self.layout.router_netns, dev)

    def delay_line_stats(self) -> dict | None:
        """The delay line's counters (packets, bytes, how late it released them; delay_line.py), or None."""
        pid = self.state.delay_line_pid
        if pid is None:
            return None
        path = box_file(self.layout.box_id, "delay-stats.json")
        before = path.stat().st_mtime_ns if path.exists() else None
        os.kill(pid, signal.SIGUSR1)
        end = time.monotonic() + 5
        while time.monotonic() < end:
            if path.exists() and path.stat().st_mtime_ns != before:
                return json.loads(path.read_text())
            time.sleep(0.01)
        raise BoxSetupError(f"the delay line (pid {pid}) wrote no statistics to {path} within 5 s")


# -- removal and garbage collection ----------------------------------------------------------

def _box_of(name: str) -> str | None:
    """The box id in a namespace's or cgroup's name ``zbox-<id>[-<node>]``, or None."""
    if not name.startswith(NETNS_PREFIX):
        return None
    return name[len(NETNS_PREFIX):].split("-", 1)[0] or None


def _cgroup_box_dirs() -> dict[str, list[str]]:
    """``{box id: [its cgroup directories]}`` for every ``zbox-*`` directory at the top of a hierarchy."""
    try:
        roots = Cgroups.detect().roots()
    except BoxSetupError:
        return {}
    out: dict[str, list[str]] = {}
    for root in roots:
        for d in Path(root).glob(f"{NETNS_PREFIX}*"):
            box = _box_of(d.name)
            if box and d.is_dir():
                out.setdefault(box, []).append(str(d))
    return out


def remove_box(box_id: str, state: BoxState | None = None) -> None:
    """Remove box ``box_id``: what ``state`` lists plus every namespace and cgroup named after it
    ([Note: removing a box]). ``BoxSetupError`` where a process or cgroup does not go."""
    netns = list(state.netns) if state else []
    netns += [n for n in net.list_namespaces() if _box_of(n) == box_id and n not in netns]
    cgroup_dirs = list(state.cgroup_dirs) if state else []
    cgroup_dirs += [d for d in _cgroup_box_dirs().get(box_id, []) if d not in cgroup_dirs]
    end = time.monotonic() + 10
    while True:
        pids = set().union(*(pids_under(d) for d in cgroup_dirs), *(net.netns_pids(n) for n in netns))
        pids.discard(os.getpid())
        if not pids:
            break
        if time.monotonic() > end:
            raise BoxSetupError(f"box {box_id!r}: processes {sorted(pids)} still run after 10 s of SIGKILL")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    for n in netns:
        net.delete_namespace(n)
    kill_and_remove(cgroup_dirs)
    for path in [state_path(box_id), *STATE_DIR.glob(f"{box_id}.*")]:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def gc() -> tuple[list[str], list[str]]:
    """Remove every box whose holder is gone and every ``zbox-`` namespace or cgroup without a state file;
    ``(removed ids, kept ids)`` (kept: held by a live process, or detached)."""
    names = [n for n in net.list_namespaces() if _box_of(n)]  # names first: a box in the making has its file
    orphans = {_box_of(n) for n in names} | set(_cgroup_box_dirs())
    removed, kept = [], []
    for box_id in state_ids():
        orphans.discard(box_id)
        try:
            state = read_state(box_id)
        except BoxStateFileError:  # damaged: nothing says who holds it; removed by its names
            state = None
        if state is not None and holder_alive(state):
            kept.append(box_id)
            continue
        remove_box(box_id, state)
        removed.append(box_id)
    for box_id in sorted(b for b in orphans if b):
        remove_box(box_id)
        removed.append(box_id)
    return removed, kept


# -- signals ---------------------------------------------------------------------------------

def _joiner(procs_files: list[Path]):
    """A ``preexec_fn`` that moves the new process into the cgroups whose ``cgroup.procs`` are given."""
    def join() -> None:
        for f in procs_files:
            with open(f, "w") as fh:
                fh.write(str(os.getpid()))
    return join


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit(143) inside the block (so ``finally`` removes the box), where SIGTERM is
    not handled already and this is the main thread."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def exit_143(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, exit_143)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held back (delivered after the block) in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
