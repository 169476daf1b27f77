"""What a box is made of, computed from a cluster without touching the machine.

``plan_box(cluster, options)`` gives the ``BoxLayout``: per node its network
namespace, hostname, address, region and NIC rate; per rank (one per GPU) its
CPU quota and memory limit; per ordered node pair the link's rate and one-way
delay; per shared link and direction its rate; the scale factor and how it was
chosen; and what the box does not emulate. ``box.Box`` builds it
([Note: the box] in ``zorse_fx/box/box.py``).

Units: bytes/s, seconds, cores (CPU time per wall-clock time), bytes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..cluster import Cluster
from ..errors import BoxConfigError
from ..pacing import MAX_PACE, PACE_HEADROOM
from .tcp import tcp_sysctls

__all__ = ["BoxOptions", "BoxLayout", "NodeLayout", "RankSlot", "PairLink", "SharedDirection", "ScaleDerivation",
           "plan_box", "gpu_rate_flops_per_s", "cpu_rate_flops_per_s", "LATENCY_MECHANISMS", "SPEED_MECHANISMS", "NETNS_PREFIX",
           "DELAY_LINE_FLOOR_S", "MAX_DELAY_S"]

#: Every namespace and cgroup of a box is named ``zbox-<id>...``: leftovers are found by it.
NETNS_PREFIX = "zbox-"
#: A box id: letters, digits and ``_`` (no ``-``: it separates the id from a node name in ``zbox-<id>-<node>``).
BOX_ID = re.compile(r"[A-Za-z0-9_]{1,24}")
#: A node name the box can use as a hostname and in a namespace's name: an RFC 1123 label (``_`` allowed).
_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")

#: How a link's latency is made: ``netem`` (the kernel's, where it exists), ``delay-line`` (a userspace
#: forwarder in the router namespace, ``box/delay_line.py``), ``none`` (not emulated, said in the table).
LATENCY_MECHANISMS = ("auto", "netem", "delay-line", "none")
#: How a rank gets its GPU type's speed (``BoxOptions.speed``).
SPEED_MECHANISMS = ("pace", "quota")

#: One-way delays below this are left out by the delay line: its own added delay, as measured by
#: bench/box_selfcheck.py (bench/LOG.md, "The box"), is of this order, so it cannot make them.
DELAY_LINE_FLOOR_S = 0.5e-3
#: Longest one-way delay the box builds: TCP's connect gives up after about 127 s of SYN retries, and
#: rendezvous and collectives time out long before that with several round trips per step.
MAX_DELAY_S = 5.0
#: The kernel's CFS bandwidth limits: the smallest quota (1 ms) and the period range (1 ms to 1 s); the box
#: uses periods from 10 ms (smooth throttling) up to what the smallest quota needs ([Note: CPU quotas]).
MIN_QUOTA_US = 1_000
MIN_PERIOD_US = 10_000
MAX_PERIOD_US = 1_000_000
#: The CPU kernel profile measured on the project's machine (1 thread): the CPU's matmul rate.
DEFAULT_CPU_PROFILE = Path(__file__).resolve().parent.parent / "profiles" / "cpu-x86_64-1thread.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class BoxOptions:
    """How to build a box (``zorse box up``'s flags)."""

    box_id: str | None = None
    """the box's name: letters, digits, ``_``; its namespaces are ``zbox-<id>`` (router) and
    ``zbox-<id>-<node>`` (default: the cluster's name with other characters as ``_``)"""
    scale: float | None = None
    """bandwidth_box = bandwidth_real x scale, delay_box = latency_real / scale (default: the factor that keeps
    the real cluster's communication-to-compute ratio, [Note: the box's scale factor])"""
    cores: float | None = None
    """CPU cores the ranks' quotas may sum to (default: the CPUs this process may run on)"""
    precision: Literal["auto", "fp32", "bf16-mixed", "fp16-mixed"] = "auto"
    """the real training's precision, which sets the GPU types' relative speed: fp32 the FP32 matmul rate, the
    others (and auto) the 16-bit rate"""
    cpu_profile: str | None = None
    """a kernel profile of this CPU with one thread (``zorse bench kernels``), whose matmul rate stands for the
    CPU's speed (default: zorse_fx/profiles/cpu-x86_64-1thread.json)"""
    memory_scale: float | None = None
    """per rank a memory limit of memory_scale x its GPU's memory + memory_base_bytes (default: no limit; the
    peak is measured either way)"""
    memory_base_bytes: int = 1 << 30
    """what a rank holds besides its GPU's memory (Python, torch, communication buffers), added to each limit"""
    latency: Literal["auto", "netem", "delay-line", "none"] = "auto"
    """how link latency is made: auto = netem where the kernel has it, else the delay line"""
    speed: Literal["pace", "quota"] = "pace"
    """how a rank gets its GPU type's speed: pace = each compute takes 1/q x its CPU time (ZORSE_PACE, [Note:
    paced compute] in zorse_fx/pacing.py); quota = a CFS CPU quota of q cores on the whole rank ([Note: CPU
    quotas])"""
    drift_probe: bool = True
    """with pace: measure each paced compute in units of a reference probe, fixed when the box comes up, so
    that the host's speed drift does not move the emulated GPUs' ([Note: drift-compensated pacing] in
    zorse_fx/pacing.py); off: raw CPU time"""
    tcp_tuning: bool = True
    """tune every node's TCP for long fat networks as WAN hosts are tuned ([Note: the box's TCP tuning] in
    box/tcp.py): socket buffers that autotune up to twice the box's largest bandwidth-delay product, no slow
    start after idle; off: the kernel's defaults, under which one TCP flow cannot fill a long, fast link"""

    def __post_init__(self) -> None:
        if self.box_id is not None and not BOX_ID.fullmatch(self.box_id):
            raise BoxConfigError(f"box id {self.box_id!r}: use 1 to 24 letters, digits or '_' (no '-': it separates "
                                 f"the id from node names in the namespaces' names)")
        for name in ("scale", "cores", "memory_scale"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise BoxConfigError(f"--{name.replace('_', '-')} {value}: give a number > 0")
        if self.memory_base_bytes < 0:
            raise BoxConfigError(f"memory_base_bytes {self.memory_base_bytes}: give a number of bytes >= 0")
        if self.latency not in LATENCY_MECHANISMS:
            raise BoxConfigError(f"--latency {self.latency!r}: one of {', '.join(LATENCY_MECHANISMS)}")
        if self.speed not in SPEED_MECHANISMS:
            raise BoxConfigError(f"--speed {self.speed!r}: one of {', '.join(SPEED_MECHANISMS)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSlot:
    """One emulated GPU: a process with one thread at a share of a core (paced, or under a CPU quota) and
    optionally a memory limit."""

    node: str
    local_rank: int
    #: The GPU's index in the cluster (file order).
    gpu_index: int
    gpu_type: str
    #: The GPU type's sustained matmul rate over the fastest type's (cost model, [Note: CPU quotas]).
    relative_speed: float
    #: Its speed as a share of one CPU thread's, in cores (<= 1): the CPU quota (``speed`` quota) or the
    #: inverse of its pace factor (``speed`` pace).
    cpu_quota_cores: float
    #: Memory limit of the rank's cgroup, bytes; None: none.
    memory_limit_bytes: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeLayout:
    """One emulated node: a network namespace with its hostname, address and NIC."""

    name: str
    #: The node's datacenter (one bridge per datacenter).
    region: str
    #: The network namespace, ``zbox-<id>-<node>``.
    netns: str
    #: IPv4 address of its interface (``eth0``), on its region's subnet.
    address: str
    #: The NIC's rate per direction in the box, bytes/s (real NIC x scale); None: no NIC in the cluster.
    nic_bytes_per_s: float | None
    ranks: tuple[RankSlot, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class PairLink:
    """The link from node ``src`` to node ``dst`` (one direction) in the box."""

    src: str
    dst: str
    #: The cluster's link kind (``inter_node`` or ``cross_datacenter``).
    kind: str
    #: Rate, bytes/s: the real link's bandwidth x scale (shared by every flow of the node pair).
    bytes_per_s: float
    #: One-way delay, s: the real latency / scale; 0 where below what the mechanism can make.
    delay_s: float
    #: The real latency / scale, s, before any floor.
    wanted_delay_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class SharedDirection:
    """One direction of a ``shared_links:`` entry: every flow from a ``src`` node to a ``dst`` node shares it."""

    name: str
    src: tuple[str, ...]
    dst: tuple[str, ...]
    #: Rate, bytes/s (the real capacity x scale).
    bytes_per_s: float
    #: Where the box shapes it ([Note: the box's network] in net.py; ``_place_shared``): ``"ifb"`` (the
    #: router's IFB), ``"egress:<node>"`` (its one sending node's eth0: a per-node cap such as a cloud's
    #: per-instance one, where the IFB holds another link of its flows), ``"ingress:<node>"`` (the router's
    #: port to its one receiving node).
    at: str = "ifb"


@dataclass(frozen=True, slots=True, kw_only=True)
class ScaleDerivation:
    """How the scale factor was chosen ([Note: the box's scale factor])."""

    #: s: bandwidth_box = bandwidth_real x s, delay_box = latency_real / s.
    factor: float
    #: q_max x cpu_flops_per_s / fastest_flops_per_s: the factor that keeps communication-to-compute ratios.
    ratio_preserving_factor: float
    #: Whether ``factor`` was given (``--scale``) instead of derived.
    explicit: bool
    #: The matmul rate the GPU types are compared by: ``"16-bit"`` or ``"fp32"``.
    gpu_rate_dtype: str
    #: One CPU thread's float32 matmul rate, FLOP/s (the kernel profile's median matmul).
    cpu_flops_per_s: float
    #: The profile it comes from and the CPU it was measured on.
    cpu_source: str
    fastest_type: str
    #: The fastest type's sustained matmul rate, FLOP/s (cost model).
    fastest_flops_per_s: float
    #: The fastest type's CPU quota, cores.
    max_quota_cores: float
    #: The cores the quotas may sum to.
    cores: float
    #: A drift-probed paced box's nominal host is this much slower than the CPU profile's thread (``PACE_HEADROOM``,
    #: [Note: drift-compensated pacing] in zorse_fx/pacing.py), so the factor divides the CPU's rate by it; else 1.
    drift_headroom: float = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class BoxLayout:
    """Everything a box builds for a cluster (see the module docstring)."""

    box_id: str
    cluster_name: str
    cluster_source: str
    scale: ScaleDerivation
    #: The CFS period of every rank's quota, microseconds ([Note: CPU quotas]).
    cpu_period_us: int
    #: How ranks get their speed: ``pace`` (``ZORSE_PACE`` = 1 / cores, no quota) or ``quota``.
    speed: str = "pace"
    nodes: tuple[NodeLayout, ...]
    #: Every ordered pair of distinct nodes.
    pairs: tuple[PairLink, ...]
    shared: tuple[SharedDirection, ...]
    #: ``netem``, ``delay-line`` or ``none``.
    latency: str
    #: The router namespace (``zbox-<id>``): the bridges, the shared links, the delay line.
    router_netns: str
    #: What the box does not emulate, one sentence each (printed under the table).
    limits: tuple[str, ...]
    #: ``(key, value)`` sysctls set in every node's namespace ([Note: the box's TCP tuning]); () = the kernel's.
    tcp_sysctls: tuple[tuple[str, str], ...] = ()

    def node(self, name: str) -> NodeLayout:
        """The node called ``name``; ``BoxConfigError`` naming the box's nodes otherwise."""
        for n in self.nodes:
            if n.name == name:
                return n
        raise BoxConfigError(f"box {self.box_id!r} has no node {name!r}; its nodes: "
                             f"{', '.join(n.name for n in self.nodes)}")

    def rank(self, node: str, local_rank: int) -> RankSlot:
        """Rank ``local_rank`` of ``node``; ``BoxConfigError`` naming the node's ranks otherwise."""
        n = self.node(node)
        if not 0 <= local_rank < len(n.ranks):
            raise BoxConfigError(f"node {node!r} of box {self.box_id!r} has local ranks 0..{len(n.ranks) - 1} "
                                 f"(one per GPU), not {local_rank}")
        return n.ranks[local_rank]

    def pace_factor(self, node: str, local_rank: int) -> float | None:
        """The ``ZORSE_PACE`` of a rank (1 / its cores) where the box paces its ranks, else None."""
        return 1.0 / self.rank(node, local_rank).cpu_quota_cores if self.speed == "pace" else None

    def speed_text(self) -> str:
        """How ranks get their GPU's speed, one phrase."""
        if self.speed == "pace":
            return "ranks paced (ZORSE_PACE = 1 / cores; no CPU quota)"
        return f"CPU quotas, period {self.cpu_period_us / 1000:g} ms"

    def hosts_text(self) -> str:
        """An /etc/hosts naming every node by its box address (each spawned command sees it)."""
        lines = ["127.0.0.1 localhost"] + [f"{n.address} {n.name}" for n in self.nodes]
        return "\n".join(lines) + "\n"

    def table(self) -> str:
        """What the box built, as text: per node its hostname, address, region, NIC rate, ranks and quotas;
        the WAN and other shared links; the pair links; the scale factor; the limits."""
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        s = self.scale
        nodes = Table(title=escape(f"box {self.box_id!r}: cluster {self.cluster_name!r} ({self.cluster_source}), "
                                   f"{len(self.nodes)} nodes, router namespace {self.router_netns}"))
        for col in ("node = hostname", "namespace", "address", "region", "NIC per direction", "ranks (GPU: cores)",
                    "memory limit"):
            nodes.add_column(col)
        for n in self.nodes:
            mem = {_fmt_bytes(r.memory_limit_bytes) if r.memory_limit_bytes else "-" for r in n.ranks}
            nodes.add_row(escape(n.name), escape(n.netns), n.address, escape(n.region),
                          _fmt_rate(n.nic_bytes_per_s) if n.nic_bytes_per_s else "- (per pair only)",
                          escape(", ".join(f"{r.local_rank}={r.gpu_type}: {r.cpu_quota_cores:.3f}" for r in n.ranks)),
                          ", ".join(sorted(mem)))
        links = Table(title=f"links (per direction; latency: {self.latency})")
        for col in ("from -> to", "kind", "rate", "one-way delay"):
            links.add_column(col)
        for p in self.pairs:
            delay = _fmt_s(p.delay_s) if p.delay_s or not p.wanted_delay_s else f"0 (wanted {_fmt_s(p.wanted_delay_s)})"
            links.add_row(escape(f"{p.src} -> {p.dst}"), p.kind, _fmt_rate(p.bytes_per_s), delay)
        for d in self.shared:
            links.add_row(escape(f"{', '.join(d.src)} -> {', '.join(d.dst)}"), escape(f"shared {d.name} ({d.at})"),
                          _fmt_rate(d.bytes_per_s) + " (all flows)", "-")
        buf = _console_text(Console, nodes, links)
        how = "given (--scale)" if s.explicit else "derived"
        buf += (f"scale s = {s.factor:.4g} ({how}; ratio-preserving: {s.max_quota_cores:.3f} cores x "
                f"{s.cpu_flops_per_s / 1e9:.4g} GFLOP/s (CPU, {s.cpu_source})"
                + (f" / {s.drift_headroom:g} (the drift probe's nominal host)" if s.drift_headroom != 1.0 else "")
                + f" / {s.fastest_flops_per_s / 1e12:.4g} "
                f"TFLOP/s ({s.fastest_type}, {s.gpu_rate_dtype} matmul) = {s.ratio_preserving_factor:.4g}); "
                f"{self.speed_text()} over {s.cores:g} cores\n")
        buf += "TCP on every node: " + (", ".join(f"{k.removeprefix('net.ipv4.')} = {v}" for k, v in self.tcp_sysctls)
                                       or "the kernel's defaults (--no-tcp-tuning)") + "\n"
        for line in self.limits:
            buf += f"not emulated: {line}\n"
        return buf


def _console_text(console_cls, *tables) -> str:
    import io

    buf = io.StringIO()
    console = console_cls(file=buf, width=140, color_system=None, force_terminal=False, highlight=False)
    for t in tables:
        console.print(t)
    return buf.getvalue()


def _fmt_rate(bytes_per_s: float) -> str:
    for unit, div in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= div:
            return f"{bytes_per_s / div:.4g} {unit}"
    return f"{bytes_per_s:.4g} B/s"


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.4g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.4g} us"


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"


# [Note: the box's scale factor]
# A GPU of type t computes at R_t FLOP/s (its sustained matmul rate in the cost model,
# zorse_fx/cost/gpu_model.py, from gpu_specs.csv's cited figures) and a link carries B bytes/s after
# a latency L. In the box the rank of that GPU is one CPU thread at q_t cores (paced: each compute
# takes 1/q_t x its CPU time, [Note: paced compute] in zorse_fx/pacing.py; or a quota of q_t cores), computing
# at q_t x R_cpu (R_cpu: one thread's float32 matmul rate, the median matmul of a CPU kernel profile).
# Quotas follow the GPUs' relative speed, q_t = q_max x R_t / R_max ([Note: CPU quotas]), so every
# rank computes slower than its GPU by the same factor q_max x R_cpu / R_max. Communication keeps the
# real cluster's ratio to compute when every link is slowed by that factor too:
#
#     s = q_max x R_cpu / R_max,   B_box = B x s,   L_box = L / s
#
# (small_hetero in 16-bit: q_max = 0.915 core of 2, R_cpu = 107 GFLOP/s, R_max = 259 TFLOP/s for the
# A100 -> s = 3.8e-4: its 25 GbE becomes 1.2 MB/s and 20 us becomes 53 ms). It holds for compute the
# matmul rate stands for; a CPU's memory bandwidth, kernel overheads and the CPU time of communication
# (on a GPU cluster a NIC's and the copy engines') are not in the ratio, which the box's limits say.
# `--scale` overrides s (the table then prints both). A paced box with the drift probe ([Note:
# drift-compensated pacing] in zorse_fx/pacing.py) computes on a nominal host PACE_HEADROOM (1.4) times
# slower than the thread its probe measured when it came up, so R_cpu is divided by that:
# s = q_max x R_cpu / 1.4 / R_max.


# [Note: CPU quotas]
# (With `--speed pace`, the default, q_t is no quota but the rank's pace, ZORSE_PACE = 1 / q_t, and no
# period is used: a quota throttles the rank's communication threads and lets short bursts through,
# [Note: paced compute] in zorse_fx/pacing.py. The shares are computed the same way.)
# Each rank is one process with one thread, so a quota above one core buys nothing: the fastest GPU
# type gets q_max = min(1, C / sum_i R_i / R_max) cores and every other rank R_i / R_max of that, so
# the quotas sum to at most the C cores given (default: every CPU this process may use). The CFS
# period is the shortest from 10 ms up to 1 s in which the smallest quota is still the kernel's
# minimum of 1 ms: short periods throttle smoothly (a rank at 0.09 cores runs 1 ms of every 11 ms,
# not 9 ms of every 100 ms), which matters for steps of a few hundred ms. A quota the kernel cannot
# give even with a 1 s period is refused, naming the GPU type. A rank is held to its quota from its
# first instruction: importing torch at 0.085 cores takes ~11x as long as on a free core (about 16 s
# here before small_hetero's T4 ranks reach rendezvous), so time steps, not start-up.


def gpu_rate_flops_per_s(spec, precision: str) -> float:
    """A GPU type's sustained matmul rate, FLOP/s, in the cost model (``cost.gpu_model``): the 16-bit rate
    for a mixed precision (and ``auto``), the FP32 rate for ``fp32``."""
    import torch

    from ..cost.gpu_model import sustained_matmul_flops_per_s
    from ..cost.roofline import MATMUL_EFFICIENCY

    dtype = torch.float32 if precision == "fp32" else torch.float16
    return sustained_matmul_flops_per_s(spec, dtype, MATMUL_EFFICIENCY)


def cpu_rate_flops_per_s(profile_path: str | os.PathLike[str]) -> tuple[float, str]:
    """``(FLOP/s, source)``: the median float32 matmul rate of a CPU kernel profile (one thread), and where it
    comes from (the file and the CPU named in it). ``BoxConfigError`` for a profile of a GPU or without a
    float32 matmul."""
    from ..cost.profile import KernelProfile

    prof = KernelProfile.load(profile_path)
    rates = [e.flops / (e.fwd_ms * 1e-3) for e in prof.entries
             if e.op_class == "matmul" and e.dtype == "float32" and e.flops > 0]
    if prof.device.backend != "cpu" or not rates:
        raise BoxConfigError(f"{profile_path}: not a CPU kernel profile with float32 matmuls (backend "
                             f"{prof.device.backend!r}, {len(rates)} matmuls); give one written by `zorse bench "
                             f"kernels` on this CPU with one thread")
    if prof.device.threads != 1:
        raise BoxConfigError(f"{profile_path}: measured with {prof.device.threads} threads; a rank is one thread: "
                             f"measure with one (OMP_NUM_THREADS=1)")
    return statistics.median(rates), f"{Path(profile_path).name}: {prof.device.name}"


def this_cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), or ``""``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def default_box_id(cluster: Cluster) -> str:
    """The cluster's name as a box id (characters other than letters, digits and ``_`` as ``_``, 24 at most)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", cluster.name)[:24] or "box"


def plan_box(cluster: Cluster, options: BoxOptions | None = None, *, latency: str = "delay-line",
             cores_available: float | None = None) -> BoxLayout:
    """The box for ``cluster``: see the module docstring. ``latency``: the mechanism the machine offers
    (``netem``, ``delay-line`` or ``none``; ``options.latency`` other than ``auto`` overrides it);
    ``cores_available``: CPUs of this machine (default: those this process may run on).

    Raises:
        BoxConfigError: a node name that is not a hostname label; more cores asked than the machine has;
            a quota below the kernel's smallest; a delay above ``MAX_DELAY_S``; a node pair whose flows
            cross two shared links shaped at one place (``SharedDirection.at``).
    """
    options = options or BoxOptions()
    box_id = options.box_id or default_box_id(cluster)
    if options.latency != "auto":
        latency = options.latency
    for node in cluster.nodes:
        if not _NODE_NAME.fullmatch(node):
            raise BoxConfigError(f"{cluster.source}: node {node!r} cannot be a hostname in the box: use letters, "
                                 f"digits, '-' and '_' (at most 63, starting with a letter or digit)")
    available = cores_available if cores_available is not None else float(len(os.sched_getaffinity(0)))
    cores = options.cores if options.cores is not None else available
    if cores > available:
        raise BoxConfigError(f"--cores {cores:g}: this machine gives this process {available:g} CPUs; the quotas "
                             f"cannot sum to more")
    precision = options.precision
    rate = {t: gpu_rate_flops_per_s(next(g.spec for g in cluster.gpus if g.type == t), precision)
            for t in cluster.gpu_types()}
    fastest = max(rate, key=rate.get)
    rel = {t: r / rate[fastest] for t, r in rate.items()}
    q_max = min(1.0, cores / sum(rel[g.type] for g in cluster.gpus))
    quota = {t: q_max * r for t, r in rel.items()}
    slowest = min(quota, key=quota.get)
    if options.speed == "pace" and 1.0 / quota[slowest] > MAX_PACE:
        raise BoxConfigError(
            f"{cluster.source}: a {slowest} rank would compute {1.0 / quota[slowest]:.3g}x slower than a CPU thread "
            f"({rel[slowest]:.3g} of the fastest type {fastest}, {q_max:.3g} cores, over {cores:g} cores for "
            f"{len(cluster.gpus)} ranks), beyond ZORSE_PACE's {MAX_PACE:g}; give more --cores or fewer GPUs")
    if options.speed == "quota" and quota[slowest] * MAX_PERIOD_US < MIN_QUOTA_US:
        raise BoxConfigError(
            f"{cluster.source}: a {slowest} rank would get {quota[slowest]:.2g} cores ({rel[slowest]:.3g} of the "
            f"fastest type {fastest}, {q_max:.3g} cores, over {cores:g} cores for {len(cluster.gpus)} ranks), below "
            f"the kernel's smallest CPU quota ({MIN_QUOTA_US / 1000:g} ms per {MAX_PERIOD_US / 1e6:g} s); give "
            f"more --cores or a cluster with fewer GPUs")
    period_us = min(MAX_PERIOD_US, max(MIN_PERIOD_US, math.ceil(MIN_QUOTA_US / quota[slowest] / 1000) * 1000))

    cpu_path = options.cpu_profile or DEFAULT_CPU_PROFILE
    cpu_flops, cpu_source = cpu_rate_flops_per_s(cpu_path)
    headroom = PACE_HEADROOM if options.speed == "pace" and options.drift_probe else 1.0
    ratio_factor = q_max * cpu_flops / headroom / rate[fastest]
    factor = options.scale if options.scale is not None else ratio_factor
    scale = ScaleDerivation(factor=factor, ratio_preserving_factor=ratio_factor, explicit=options.scale is not None,
                            gpu_rate_dtype="fp32" if precision == "fp32" else "16-bit", cpu_flops_per_s=cpu_flops,
                            cpu_source=cpu_source, fastest_type=fastest, fastest_flops_per_s=rate[fastest],
                            max_quota_cores=q_max, cores=cores, drift_headroom=headroom)

    regions = [dc for dc in cluster.datacenters if any(g.datacenter == dc for g in cluster.gpus)]
    nodes = []
    for node in cluster.nodes:
        gpus = [g for g in cluster.gpus if g.node == node]
        region = gpus[0].datacenter
        r = regions.index(region)
        i = [n for n in cluster.nodes if cluster.node_datacenter(n) == region].index(node) + 2
        nic = cluster.nic_bandwidth(node)
        ranks = tuple(RankSlot(
            node=node, local_rank=g.local_index, gpu_index=g.index, gpu_type=g.type, relative_speed=rel[g.type],
            cpu_quota_cores=quota[g.type],
            memory_limit_bytes=(None if options.memory_scale is None
                                else round(options.memory_scale * g.memory_bytes) + options.memory_base_bytes))
            for g in gpus)
        nodes.append(NodeLayout(name=node, region=region, netns=f"{NETNS_PREFIX}{box_id}-{node}",
                                address=f"10.{r + 1}.{i // 256}.{i % 256}",
                                nic_bytes_per_s=None if nic is None else nic * factor, ranks=ranks))

    floor = DELAY_LINE_FLOOR_S if latency == "delay-line" else 0.0
    first_gpu = {n: next(g.index for g in cluster.gpus if g.node == n) for n in cluster.nodes}
    pairs = []
    for a in cluster.nodes:
        for b in cluster.nodes:
            if a == b:
                continue
            link = cluster.link(first_gpu[a], first_gpu[b])
            wanted = link.latency_s / factor
            if wanted > MAX_DELAY_S:
                raise BoxConfigError(
                    f"{cluster.source}: the {link.kind} link {a} -> {b} ({link.latency_s * 1e3:g} ms) would take "
                    f"{wanted:.3g} s one way at scale {factor:.3g}, beyond the box's {MAX_DELAY_S:g} s (TCP and "
                    f"rendezvous time out); give --scale {link.latency_s / MAX_DELAY_S:.3g} or more (it then "
                    f"no longer keeps the communication-to-compute ratio), or a smaller latency in the cluster")
            delay = 0.0 if latency == "none" or wanted < floor else wanted
            pairs.append(PairLink(src=a, dst=b, kind=link.kind, bytes_per_s=link.bandwidth_bytes_per_s * factor,
                                  delay_s=delay, wanted_delay_s=wanted))

    shared = _place_shared(cluster, pairs, factor)
    layout = BoxLayout(box_id=box_id, cluster_name=cluster.name, cluster_source=cluster.source, scale=scale,
                       cpu_period_us=period_us, nodes=tuple(nodes), pairs=tuple(pairs), shared=tuple(shared),
                       latency=latency, router_netns=f"{NETNS_PREFIX}{box_id}", limits=(), speed=options.speed,
                       tcp_sysctls=tcp_sysctls(pairs) if options.tcp_tuning else ())
    return _with_limits(layout, cluster, floor)


def _place_shared(cluster: Cluster, pairs: list[PairLink], factor: float) -> list[SharedDirection]:
    """Each direction of each shared link with the place the box shapes it (``SharedDirection.at``): the
    router's IFB, else (a flow of it already crosses a link there) its sending side's eth0 where that is one
    node, else the router's port to its receiving side where that is one node; in declaration order.

    Raises:
        BoxConfigError: a direction with no place left, naming a flow and the links it crosses."""
    flows = [(p.src, p.dst) for p in pairs]
    placed: list[SharedDirection] = []
    for spec in cluster.shared_links:
        for src, dst in ((0, 1), (1, 0)):
            a, b = spec.sides[src].nodes, spec.sides[dst].nodes
            mine = [f for f in flows if f[0] in a and f[1] in b]
            taken = {d.at for d in placed for f in mine if f[0] in d.src and f[1] in d.dst}
            places = ["ifb"] + ([f"egress:{a[0]}"] if len(a) == 1 else []) + ([f"ingress:{b[0]}"] if len(b) == 1 else [])
            free = [at for at in places if at not in taken]
            if not free:
                f = next(f for f in mine if sum(f[0] in d.src and f[1] in d.dst for d in placed) >= len(places))
                crossed = [d.name for d in placed if f[0] in d.src and f[1] in d.dst] + [spec.name]
                raise BoxConfigError(
                    f"{cluster.source}: flows {f[0]} -> {f[1]} cross the shared links "
                    f"{', '.join(map(repr, crossed[:-1]))} and {crossed[-1]!r}; the box shapes a flow at one shared "
                    f"link per place (the router's IFB; the sending node's eth0 and the router's port to the "
                    f"receiving node, for a link whose side there is one node): declare fewer")
            placed.append(SharedDirection(name=spec.name, src=a, dst=b,
                                          bytes_per_s=spec.bandwidth_bytes_per_s * factor, at=free[0]))
    return placed


def _with_limits(layout: BoxLayout, cluster: Cluster, floor: float) -> BoxLayout:
    """``layout`` with its ``limits``: every way the box differs from the cluster's model, one sentence each."""
    limits = []
    s = layout.scale
    if s.explicit and not math.isclose(s.factor, s.ratio_preserving_factor, rel_tol=1e-9):
        limits.append(f"the communication-to-compute ratio: --scale {s.factor:.4g} makes links "
                      f"{s.factor / s.ratio_preserving_factor:.3g}x as fast relative to compute as on the cluster")
    multi = [n for n in cluster.nodes if sum(g.node == n for g in cluster.gpus) > 1]
    if multi:
        limits.append(f"intra-node links (GPUs of one node: {', '.join(multi)}): the ranks talk over the node's "
                      f"loopback, unshaped and without delay")
        if len(cluster.nodes) > 1:
            limits.append("one link per GPU pair: a node pair's link (inter_node, cross_datacenter, an override) "
                          "is shared by every flow between the two nodes")
    low = [p for p in layout.pairs if p.wanted_delay_s and not p.delay_s]
    if layout.latency == "none" and any(p.wanted_delay_s for p in layout.pairs):
        limits.append("link latency (--latency none): every delay is 0")
    elif low:
        limits.append(f"latencies below the delay line's {floor * 1e3:g} ms floor ({len(low)} node pairs, up to "
                      f"{max(p.wanted_delay_s for p in low) * 1e3:.3g} ms one way): 0")
    if layout.speed == "pace":
        limits.append("GPU speed other than the matmul rate: each rank's compute is paced by its GPU's sustained "
                      "matmul rate; memory bandwidth and kernel launches scale with the CPU; communication and the "
                      "host's Python run at the CPU's speed, as a real host's do")
    else:
        limits.append("GPU speed other than the matmul rate: each rank's CPU quota follows its GPU's sustained "
                      "matmul rate; memory bandwidth, kernel launches and the CPU time communication takes scale "
                      "with the CPU; compute bursts shorter than a quota's share of a period run at full speed")
    here = this_cpu_name()
    if here and not s.cpu_source.endswith(": " + here):
        limits.append(f"the CPU's speed is that of the profile ({s.cpu_source}), this machine's CPU is {here}: "
                      f"measure it (`zorse bench kernels`) and pass --cpu-profile")
    return dataclasses.replace(layout, limits=tuple(limits))
