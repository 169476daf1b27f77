"""A heterogeneous GPU cluster: which GPUs exist, where, and how they are linked.

A cluster is written as YAML (or the same structure as a dict)::

    name: hetero-demo              # optional; default: the file name
    datacenters:                   # optional; default one datacenter "dc0"
      - name: us-east
      - name: eu-west
    nodes:                         # required, in order: GPU indices follow it
      - name: node0
        datacenter: us-east        # optional when only one datacenter
        gpus:
          - {type: A100-40GB, count: 2}
          - {type: T4, count: 1, memory_GiB: 15}  # optional usable-memory override
        intra_node: {bandwidth_GBps: 300, latency_us: 5}  # optional, this node only
        nic: {bandwidth_GBps: 12.5}  # optional: this node's network card (see below)
        host_memory_GiB: 512       # optional: the node's RAM, needed to offload there
        host_memory_bandwidth_GBps: 204.8  # optional (default: cluster/host.py)
        host_link: {bandwidth_GBps: 12}    # optional: each GPU's link to host memory
      - name: node1
        datacenter: eu-west
        gpus: [{type: T4, count: 4}]
    links:
      intra_node:       {bandwidth_GBps: 16, latency_us: 10}   # GPUs of one node
      inter_node:       {bandwidth_GBps: 3.125, latency_us: 20} # nodes of one datacenter
      cross_datacenter: {bandwidth_Gbps: 1.0, latency_ms: 50}   # nodes of two datacenters
      overrides:                   # one node pair, instead of the defaults above
        - {between: [node0, node1], bandwidth_GBps: 12.5, latency_us: 8}
      nic: {bandwidth_Gbps: 25}    # optional: every node's NIC, unless it gives its own
    shared_links:                  # optional: links that the flows of several node pairs share
      - name: wan-us-eu
        between: [{datacenter: us-east}, {datacenter: eu-west}]  # or {nodes: [node0, ...]}
        bandwidth_Gbps: 1
    gpu_types:                     # optional: GPU types the built-in table lacks
      MyGPU: {memory_GiB: 32, mem_bw_GBps: 900, fp32_tflops: 15,
              fp16_tensor_tflops: 120, bf16_supported: false, source: "<URL>",
              arch: volta, tdp_w: 250}  # optional: priced by that class's model (cost/gpu_model.py)

Units: a link gives exactly one of ``bandwidth_GBps`` (1e9 bytes/s),
``bandwidth_Gbps`` (1e9 bits/s, i.e. /8) or ``bandwidth_bytes_per_s``, and
exactly one of ``latency_us``, ``latency_ms`` or ``latency_s``. Bandwidths are
per direction. ``memory_GiB`` is 2**30 bytes. GPU types are the keys (or
aliases) of ``gpu_specs.csv`` (see ``zorse_fx.cluster.specs``).

Required links: ``intra_node`` when some node has more than one GPU and no
``intra_node`` of its own; ``inter_node`` when two nodes of one datacenter
have no override; ``cross_datacenter`` likewise for nodes of two datacenters.

Shared links. A link above (default or override) belongs to one node pair:
two node pairs never slow each other down through it. Where they do share
hardware, declare it:

* ``shared_links``: every flow between a node of one side and a node of the
  other crosses the link (one WAN path between two regions, a rack's
  uplink). A side is ``{datacenter: name}`` (its nodes) or ``{nodes: [...]}``;
  the two sides are disjoint and non-empty. Each entry has a unique
  ``name`` and exactly one bandwidth key, the capacity *per direction*
  (full duplex: the flows from side 1 to side 2 share one, those back the
  other), and no latency: a flow's latency is its node pair's link's.
* ``nic`` (on a node, or ``links.nic`` for every node without one): every
  flow between this node and another node crosses the node's network card,
  outgoing flows sharing its bandwidth, incoming flows the same bandwidth
  again (full duplex). Bandwidth only, as above. Flows inside a node do not
  use it. On the device graph it is the shared link ``nic:<node>`` between the
  node's GPUs and every other GPU.

A flow is then limited by its pair's link and by every shared link it
crosses; the simulator divides each among the flows crossing it at that
moment (max-min fair, [Note: network resources] in
``zorse_fx/sim/network.py``).

Host memory (offload, ``zorse_fx/cluster/host.py``): ``host_memory_GiB`` is
the node's RAM that training may use (shared evenly by its GPUs; without it
the node offers none and nothing is offloaded there),
``host_memory_bandwidth_GBps`` its memory bandwidth (the CPU optimizer step's
rate, shared by the GPUs), ``host_link`` one GPU's link to host memory per
direction (bandwidth only; default by GPU class: PCIe Gen3/4/5 x16).

Every mistake raises ``ClusterConfigError`` naming the file (or ``<dict>``),
the field path (``nodes[1].gpus[0].count``), the bad value and a fix.
Communication time over a link is the alpha-beta model
``latency_s + nbytes / bandwidth_bytes_per_s``.
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass, field

from zorse_fx.cluster.specs import GPUSpec
from zorse_fx.errors import ClusterConfigError

from ..ir.devices import DeviceGraph, SharedLink

__all__ = ["Cluster", "GPU", "Link", "LinkOverride", "LINK_KINDS", "SAME_GPU_BANDWIDTH_BYTES_PER_S",
           "SharedLinkSide", "SharedLinkSpec"]

#: Link kinds, fastest first.
LINK_KINDS = ("same_gpu", "intra_node", "inter_node", "cross_datacenter")
#: Stand-in bandwidth of a GPU "talking to itself" (device-graph diagonal):
#: large and finite so integer-scaled solvers stay well defined.
SAME_GPU_BANDWIDTH_BYTES_PER_S = 1e15


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """One direction of the connection between two GPUs (alpha-beta model)."""

    #: ``"same_gpu"``, ``"intra_node"``, ``"inter_node"`` or ``"cross_datacenter"``.
    kind: str
    #: Sustained bandwidth per direction, bytes/s.
    bandwidth_bytes_per_s: float
    #: Start-up latency of one message, seconds.
    latency_s: float

    def __post_init__(self) -> None:
        if self.kind not in LINK_KINDS:
            raise ClusterConfigError(f"Link.kind must be one of {LINK_KINDS}, got {self.kind!r}")
        if not (self.bandwidth_bytes_per_s > 0 and math.isfinite(self.bandwidth_bytes_per_s)):
            raise ClusterConfigError(f"Link.bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s!r}")
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ClusterConfigError(f"Link.latency_s must be >= 0, got {self.latency_s!r}")

    def time_s(self, nbytes: int) -> float:
        """Seconds to send one message of ``nbytes``: ``latency_s + nbytes / bandwidth``."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkOverride:
    """A link between two named nodes that replaces the default for that pair."""

    #: The two node names (distinct, order irrelevant).
    between: tuple[str, str]
    link: Link


@dataclass(frozen=True, slots=True, kw_only=True)
class SharedLinkSide:
    """One side of a shared link: the nodes of ``datacenter`` (when given) or the listed nodes."""

    #: The datacenter the side was declared by, or None (declared by ``nodes``).
    datacenter: str | None = None
    #: The side's nodes, in file order (a datacenter's: all of its nodes).
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class SharedLinkSpec:
    """A ``shared_links:`` entry: every flow between a node of one side and a node of the other crosses it."""

    name: str
    sides: tuple[SharedLinkSide, SharedLinkSide]
    #: Capacity per direction, bytes/s.
    bandwidth_bytes_per_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class GPU:
    """One GPU of a cluster."""

    #: Global index 0..G-1 in file order (nodes in order, GPUs in order within a node).
    index: int
    #: Name of the node holding the GPU.
    node: str
    #: Name of the node's datacenter.
    datacenter: str
    #: Index of the GPU within its node (0-based).
    local_index: int
    #: Canonical GPU type key (``"A100-40GB"``).
    type: str
    #: Datasheet numbers of the type.
    spec: GPUSpec
    #: Usable memory in bytes: the cluster file's ``memory_GiB`` override, else ``spec.memory_bytes``.
    memory_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """A validated cluster: GPUs in file order plus the links between them.

    Build with ``Cluster.from_yaml(path)`` or ``Cluster.from_dict(data)``;
    ``to_dict()`` gives back a dict that ``from_dict`` turns into an equal
    ``Cluster`` (``source`` is not compared).
    """

    name: str
    #: ``(G,)`` every GPU, ``gpus[i].index == i``.
    gpus: tuple[GPU, ...]
    #: Node names in file order.
    nodes: tuple[str, ...]
    #: Where the cluster came from: file path or ``"<dict>"``.
    source: str = field(default="<dict>", compare=False)
    #: Datacenter names in declaration order.
    datacenters: tuple[str, ...] = ("dc0",)
    #: Default links (``links:`` section); ``None`` where the file gives none.
    intra_node_link: Link | None = None
    inter_node_link: Link | None = None
    cross_datacenter_link: Link | None = None
    #: Per node (aligned with ``nodes``): its own ``intra_node`` link, or ``None``.
    node_intra_node_links: tuple[Link | None, ...] = ()
    link_overrides: tuple[LinkOverride, ...] = ()
    #: GPU types declared in the file's ``gpu_types:`` section.
    custom_gpu_types: tuple[GPUSpec, ...] = ()
    #: ``links.nic``: every node's NIC bandwidth per direction (bytes/s), None = no NIC modelled.
    nic_bandwidth_bytes_per_s: float | None = None
    #: Per node (aligned with ``nodes``): its own ``nic`` bandwidth (bytes/s), or None.
    node_nic_bandwidths: tuple[float | None, ...] = ()
    #: The ``shared_links:`` entries, in file order.
    shared_links: tuple[SharedLinkSpec, ...] = ()
    #: Per node (aligned with ``nodes``): ``host_memory_GiB`` in bytes, or None (no offload there).
    node_host_memory_bytes: tuple[int | None, ...] = ()
    #: Per node: ``host_memory_bandwidth_GBps`` in bytes/s, or None (``host.DEFAULT_HOST_MEMORY_BANDWIDTH_BYTES_PER_S``).
    node_host_memory_bandwidths: tuple[float | None, ...] = ()
    #: Per node: ``host_link`` bandwidth per GPU and direction, bytes/s, or None (by GPU class: ``cluster/host.py``).
    node_host_links: tuple[float | None, ...] = ()

    def __post_init__(self) -> None:
        for name in ("node_host_memory_bytes", "node_host_memory_bandwidths", "node_host_links"):
            if not getattr(self, name):
                object.__setattr__(self, name, (None,) * len(self.nodes))
            if len(getattr(self, name)) != len(self.nodes):
                raise ClusterConfigError(f"Cluster {self.name!r}: {name} has {len(getattr(self, name))} entries "
                                         f"for {len(self.nodes)} nodes")
        if not self.node_intra_node_links:
            object.__setattr__(self, "node_intra_node_links", (None,) * len(self.nodes))
        if not self.node_nic_bandwidths:
            object.__setattr__(self, "node_nic_bandwidths", (None,) * len(self.nodes))
        if len(self.node_nic_bandwidths) != len(self.nodes):
            raise ClusterConfigError(f"Cluster {self.name!r}: node_nic_bandwidths has "
                                     f"{len(self.node_nic_bandwidths)} entries for {len(self.nodes)} nodes")
        for spec in self.shared_links:
            unknown = [n for side in spec.sides for n in side.nodes if n not in self.nodes]
            if unknown or set(spec.sides[0].nodes) & set(spec.sides[1].nodes):
                raise ClusterConfigError(f"Cluster {self.name!r}: shared link {spec.name!r} has unknown "
                                         f"or overlapping sides {spec.sides}")
        if len(self.node_intra_node_links) != len(self.nodes):
            raise ClusterConfigError(
                f"Cluster {self.name!r}: node_intra_node_links has {len(self.node_intra_node_links)} "
                f"entries for {len(self.nodes)} nodes"
            )
        if len(set(self.nodes)) != len(self.nodes):
            raise ClusterConfigError(f"Cluster {self.name!r}: duplicate node names in {self.nodes}")
        for i, gpu in enumerate(self.gpus):
            if gpu.index != i or gpu.node not in self.nodes or gpu.datacenter not in self.datacenters:
                raise ClusterConfigError(f"Cluster {self.name!r}: inconsistent GPU record {gpu!r} at position {i}")

    # -- construction ---------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> Cluster:
        """Read and validate a cluster YAML file (format: module docstring)."""
        from zorse_fx.cluster import _config  # imports this module's records: load lazily, no cycle

        source = os.fspath(path)
        try:
            with open(source, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise ClusterConfigError(
                f"{source}: cluster file not found (cwd {os.getcwd()}); "
                f"check the path, examples live in examples/clusters/"
            ) from None
        except OSError as exc:
            raise ClusterConfigError(f"{source}: cannot read cluster file: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise ClusterConfigError(f"{source}: not a UTF-8 text file ({exc.reason} at byte {exc.start})") from None
        data = _config.load_yaml(text, source)
        default_name = os.path.splitext(os.path.basename(source))[0]
        return cls(**_config.parse(data, source, default_name=default_name))

    @classmethod
    def from_dict(cls, data: dict, *, source: str = "<dict>") -> Cluster:
        """Validate a cluster given as a dict (same structure as the YAML file)."""
        from zorse_fx.cluster import _config

        return cls(**_config.parse(data, source, default_name="cluster"))

    def to_dict(self) -> dict:
        """Plain-data form (YAML/JSON-safe) that ``from_dict`` reads back into an equal cluster."""
        from zorse_fx.cluster import _config

        return _config.unparse(self)

    def gpu_summary(self) -> str:
        """The GPUs per node in one line: ``"4 GPUs; a: P100-16GB x1, T4 x1; b: V100-16GB x1, T4 x1"``
        (a GPU whose memory differs from its type's datasheet reads ``T4 (12.0 GiB)``)."""
        parts = []
        for node in self.nodes:
            counts: dict[str, int] = {}
            for g in self.gpus:
                if g.node == node:
                    name = g.type if g.memory_bytes == g.spec.memory_bytes else f"{g.type} ({g.memory_bytes / 2**30:.1f} GiB)"
                    counts[name] = counts.get(name, 0) + 1
            parts.append(f"{node}: " + ", ".join(f"{t} x{n}" for t, n in counts.items()))
        return f"{len(self.gpus)} GPU{'' if len(self.gpus) == 1 else 's'}; " + "; ".join(parts)

    def fingerprint(self) -> str:
        """sha256 (64 hex digits) of the cluster's content: its ``to_dict()`` without
        its name, as canonical JSON. Equal for two files that describe the same
        GPUs, memory, host memory and links, whatever their names and layout."""
        import hashlib
        import json

        data = {k: v for k, v in self.to_dict().items() if k != "name"}
        return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    # -- queries --------------------------------------------------------
    def __len__(self) -> int:
        """Number of GPUs."""
        return len(self.gpus)

    def gpu_types(self) -> tuple[str, ...]:
        """Distinct GPU types, in order of first appearance."""
        return tuple(dict.fromkeys(g.type for g in self.gpus))

    def node_datacenter(self, node: str) -> str:
        """Datacenter of node ``node``."""
        return next(g.datacenter for g in self.gpus if g.node == node)

    def link(self, g: int, h: int) -> Link:
        """The link GPU ``g`` uses to send to GPU ``h`` (symmetric)."""
        for i in (g, h):
            if not 0 <= i < len(self.gpus):
                raise IndexError(f"GPU index {i} out of range for {len(self.gpus)} GPUs")
        a, b = self.gpus[g], self.gpus[h]
        if g == h:
            return Link(kind="same_gpu", bandwidth_bytes_per_s=SAME_GPU_BANDWIDTH_BYTES_PER_S, latency_s=0.0)
        if a.node == b.node:
            link = self.node_intra_node_links[self.nodes.index(a.node)] or self.intra_node_link
        else:
            pair = {a.node, b.node}
            link = next((o.link for o in self.link_overrides if set(o.between) == pair), None)
            if link is None:
                link = self.inter_node_link if a.datacenter == b.datacenter else self.cross_datacenter_link
        if link is None:
            raise ClusterConfigError(f"{self.source}: no link between GPU {g} ({a.node}) and GPU {h} ({b.node})")
        return link

    def device_graph(self) -> DeviceGraph:
        """The cluster as the planners see it (diagonal: 1e15 bytes/s, 0 s)."""
        n = len(self.gpus)
        links = [[self.link(g, h) for h in range(n)] for g in range(n)]
        return DeviceGraph(
            gpu_types=tuple(g.type for g in self.gpus),
            memory_bytes=tuple(g.memory_bytes for g in self.gpus),
            mem_bw_bytes_per_s=tuple(g.spec.mem_bw_bytes_per_s for g in self.gpus),
            link_bw_bytes_per_s=tuple(tuple(l.bandwidth_bytes_per_s for l in row) for row in links),
            link_latency_s=tuple(tuple(l.latency_s for l in row) for row in links),
            node_names=tuple(g.node for g in self.gpus),
            datacenter_names=tuple(g.datacenter for g in self.gpus),
            shared_links=self.device_shared_links(),
            **self._host_terms(),
        )

    def _host_terms(self) -> dict:
        """Per GPU: its share of its node's host memory and host memory bandwidth
        (split evenly over the node's GPUs) and its host link (``cluster/host.py``)."""
        from zorse_fx.cluster.host import DEFAULT_HOST_MEMORY_BANDWIDTH_BYTES_PER_S, default_host_link_bytes_per_s

        per_node = {n: sum(g.node == n for g in self.gpus) for n in self.nodes}
        k = {n: i for i, n in enumerate(self.nodes)}
        mem = tuple((self.node_host_memory_bytes[k[g.node]] or 0) // per_node[g.node] for g in self.gpus)
        bw = tuple((self.node_host_memory_bandwidths[k[g.node]] or DEFAULT_HOST_MEMORY_BANDWIDTH_BYTES_PER_S)
                   / per_node[g.node] for g in self.gpus)
        link = tuple(self.node_host_links[k[g.node]] or default_host_link_bytes_per_s(g.spec.arch) for g in self.gpus)
        return dict(host_memory_bytes=mem, host_mem_bw_bytes_per_s=bw, host_link_bytes_per_s=link)

    def nic_bandwidth(self, node: str) -> float | None:
        """Bandwidth per direction (bytes/s) of ``node``'s NIC: its own ``nic``, else ``links.nic``, else None."""
        own = self.node_nic_bandwidths[self.nodes.index(node)]
        return own if own is not None else self.nic_bandwidth_bytes_per_s

    def device_shared_links(self) -> tuple[SharedLink, ...]:
        """The ``shared_links:`` entries (in file order), then one ``nic:<node>``
        link per node with a NIC (node order; none in a one-node cluster), as GPU sets."""
        def gpus_of(nodes) -> tuple[int, ...]:
            return tuple(g.index for g in self.gpus if g.node in nodes)

        out = [SharedLink(name=spec.name, gpus_a=gpus_of(spec.sides[0].nodes), gpus_b=gpus_of(spec.sides[1].nodes),
                          bandwidth_bytes_per_s=spec.bandwidth_bytes_per_s) for spec in self.shared_links]
        if len(self.nodes) > 1:
            for node in self.nodes:
                bw = self.nic_bandwidth(node)
                if bw is not None:
                    out.append(SharedLink(name=f"nic:{node}", gpus_a=gpus_of((node,)),
                                          gpus_b=gpus_of(tuple(n for n in self.nodes if n != node)),
                                          bandwidth_bytes_per_s=bw))
        return tuple(out)

    def summary_table(self) -> str:
        """A readable text table: per node its GPUs, memory, peak FLOP/s and links."""
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        nodes = Table(title=escape(f"cluster {self.name!r}: {len(self)} GPUs, {len(self.nodes)} nodes, "
                                   f"{len(self.datacenters)} datacenter(s)  [{self.source}]"))
        for col in ("node", "datacenter", "GPUs", "memory GiB", "peak fp16 TFLOP/s", "intra-node link"):
            nodes.add_column(col, justify="right" if col[0] in "mp" else "left")
        for i, node in enumerate(self.nodes):
            gpus = [g for g in self.gpus if g.node == node]
            groups = _groups(gpus)
            intra = self.node_intra_node_links[i] or self.intra_node_link
            nodes.add_row(
                escape(node), escape(gpus[0].datacenter),
                escape(", ".join(f"{t} x{len(gs)}" for t, _, gs in groups)),
                f"{sum(g.memory_bytes for g in gpus) / 2**30:g}",
                f"{sum(g.spec.fp16_flops_per_s for g in gpus) / 1e12:g}",
                _fmt_link(intra) if len(gpus) > 1 else "-",
            )
        nodes.add_row("total", "", f"{len(self)} GPUs", f"{sum(g.memory_bytes for g in self.gpus) / 2**30:g}",
                      f"{sum(g.spec.fp16_flops_per_s for g in self.gpus) / 1e12:g}", "", style="bold")
        links = Table(title="links (per direction)")
        for col in ("kind", "between", "bandwidth, latency"):
            links.add_column(col)
        for kind, link in (("intra_node", self.intra_node_link), ("inter_node", self.inter_node_link),
                           ("cross_datacenter", self.cross_datacenter_link)):
            if link is not None:
                links.add_row(kind, "default", _fmt_link(link))
        for o in self.link_overrides:
            links.add_row(o.link.kind, escape(" <-> ".join(o.between)), _fmt_link(o.link))
        for spec in self.shared_links:
            sides = [side.datacenter or ", ".join(side.nodes) for side in spec.sides]
            links.add_row(f"shared {escape(spec.name)}", escape(" <-> ".join(sides)),
                          f"{spec.bandwidth_bytes_per_s / 1e9:g} GB/s (all flows)")
        nics = {node: self.nic_bandwidth(node) for node in self.nodes}
        for bw in dict.fromkeys(b for b in nics.values() if b is not None):
            which = [n for n, b in nics.items() if b == bw]
            links.add_row("nic", escape("every node" if len(which) == len(nics) else ", ".join(which)),
                          f"{bw / 1e9:g} GB/s (per node, all its flows)")
        buf = io.StringIO()
        console = Console(file=buf, width=120, color_system=None, force_terminal=False, highlight=False)
        console.print(nodes)
        console.print(links)
        return buf.getvalue()


def _groups(gpus: list[GPU]) -> list[tuple[str, int, list[GPU]]]:
    """Consecutive runs of GPUs with equal (type, memory_bytes)."""
    runs: list[tuple[str, int, list[GPU]]] = []
    for g in gpus:
        if runs and runs[-1][0] == g.type and runs[-1][1] == g.memory_bytes:
            runs[-1][2].append(g)
        else:
            runs.append((g.type, g.memory_bytes, [g]))
    return runs


def _fmt_link(link: Link | None) -> str:
    if link is None:
        return "-"
    lat = f"{link.latency_s * 1e3:g} ms" if link.latency_s >= 1e-3 else f"{link.latency_s * 1e6:g} us"
    return f"{link.bandwidth_bytes_per_s / 1e9:g} GB/s, {lat}"
