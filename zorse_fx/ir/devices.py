"""The GPUs of a cluster and the links between them, as the planners and the
simulator see them (``zorse_fx.cluster.Cluster.device_graph`` builds it from a
cluster file).

Legend: ``G`` = number of GPUs in the cluster.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["DeviceGraph", "SharedLink"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SharedLink:
    """A network link that the flows of several GPU pairs cross (a region's
    WAN uplink, a node's NIC), declared in the cluster file (``shared_links:``,
    ``nic:``; ``zorse_fx.cluster.cluster``). A flow from GPU g to GPU h crosses
    it when g is on side a and h on side b (direction 0) or the reverse
    (direction 1); each direction has ``bandwidth_bytes_per_s`` of its own
    (full duplex), shared by every flow crossing it that way, on top of the
    pair's own link (``DeviceGraph.link_bw_bytes_per_s``) ([Note: network
    resources] in ``zorse_fx/sim/network.py``)."""

    #: Name for tables and messages (``"wan-us-eu"``, ``"nic:node0"``).
    name: str
    #: The GPUs of either side, ascending, disjoint, non-empty.
    gpus_a: tuple[int, ...]
    gpus_b: tuple[int, ...]
    #: Capacity of each direction, bytes/s.
    bandwidth_bytes_per_s: float
    #: ``gpus_a`` / ``gpus_b`` as sets (derived; O(1) membership for ``direction``).
    _side_a: frozenset = field(init=False, repr=False, compare=False)
    _side_b: frozenset = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_side_a", frozenset(self.gpus_a))
        object.__setattr__(self, "_side_b", frozenset(self.gpus_b))
        for side in ("gpus_a", "gpus_b"):
            gpus = getattr(self, side)
            if not gpus or list(gpus) != sorted(set(gpus)) or gpus[0] < 0:
                raise ValueError(f"SharedLink {self.name!r}: {side}={gpus!r} must be distinct GPU indices "
                                 f">= 0 in ascending order, at least one")
        common = set(self.gpus_a) & set(self.gpus_b)
        if common:
            raise ValueError(f"SharedLink {self.name!r}: GPUs {sorted(common)} are on both sides; "
                             f"a flow crosses the link from one side to the other")
        if not (self.bandwidth_bytes_per_s > 0 and math.isfinite(self.bandwidth_bytes_per_s)):
            raise ValueError(f"SharedLink {self.name!r}: bandwidth_bytes_per_s={self.bandwidth_bytes_per_s!r} "
                             f"must be a finite number > 0 (bytes/s per direction)")

    def direction(self, g: int, h: int) -> int | None:
        """0 when a flow g -> h crosses the link from side a to side b, 1 from
        b to a, None when it does not cross it."""
        if g in self._side_a:
            return 0 if h in self._side_b else None
        if g in self._side_b:
            return 1 if h in self._side_a else None
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceGraph:
    """The GPUs of a cluster as the planners see them.

    GPU ``g`` is index ``g`` of every per-GPU tuple; links are symmetric.
    """

    #: ``(G,)`` GPU type names, keys of ``BlockCosts.fwd_bwd_s_per_sample``.
    gpu_types: tuple[str, ...]
    #: ``(G,)`` usable memory per GPU in bytes.
    memory_bytes: tuple[int, ...]
    #: ``(G,)`` memory bandwidth per GPU in bytes/s (optimizer-step time).
    mem_bw_bytes_per_s: tuple[float, ...]
    #: ``(G, G)`` link bandwidth between GPU g and h, bytes/s (diagonal unused).
    link_bw_bytes_per_s: tuple[tuple[float, ...], ...]
    #: ``(G, G)`` link latency between GPU g and h, seconds (diagonal unused).
    link_latency_s: tuple[tuple[float, ...], ...]
    #: ``(G,)`` node name of each GPU (for tables and symmetry breaking).
    node_names: tuple[str, ...] = ()
    #: ``(G,)`` datacenter name of each GPU ([C-control]'s ring crosses between datacenters once per
    #: datacenter, ``solve.tables.control_pass``); () = one datacenter.
    datacenter_names: tuple[str, ...] = ()
    #: Links the flows of several GPU pairs share (WAN uplinks, NICs), on top
    #: of each pair's own link; empty = every pair has its link to itself.
    shared_links: tuple[SharedLink, ...] = ()
    #: ``(G,)`` host memory each GPU may offload to, bytes (its node's
    #: ``host_memory_GiB`` / the node's GPUs; 0 = none); () = none anywhere.
    host_memory_bytes: tuple[int, ...] = ()
    #: ``(G,)`` each GPU's share of its node's host memory bandwidth, bytes/s
    #: (the CPU optimizer step's rate, [C-offload]); () = offload not modelled.
    host_mem_bw_bytes_per_s: tuple[float, ...] = ()
    #: ``(G,)`` each GPU's link to host memory, bytes/s per direction (PCIe); ().
    host_link_bytes_per_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        g = len(self.gpu_types)
        for name in ("host_memory_bytes", "host_mem_bw_bytes_per_s", "host_link_bytes_per_s"):
            v = getattr(self, name)
            if v and len(v) != g:
                raise ValueError(f"DeviceGraph.{name} has {len(v)} entries, expected {g} (or none)")
            if any(not (x >= 0 and math.isfinite(x)) for x in v):
                raise ValueError(f"DeviceGraph.{name} must hold finite numbers >= 0, got {v}")
        for name in ("memory_bytes", "mem_bw_bytes_per_s", "link_bw_bytes_per_s", "link_latency_s"):
            if len(getattr(self, name)) != g:
                raise ValueError(f"DeviceGraph.{name} has {len(getattr(self, name))} rows, expected {g}")
        for name in ("link_bw_bytes_per_s", "link_latency_s"):
            for row in getattr(self, name):
                if len(row) != g:
                    raise ValueError(f"DeviceGraph.{name} must be {g}x{g}")
        for name in ("node_names", "datacenter_names"):
            if getattr(self, name) and len(getattr(self, name)) != g:
                raise ValueError(f"DeviceGraph.{name} has {len(getattr(self, name))} entries, expected {g}")
        for link in self.shared_links:
            if not isinstance(link, SharedLink):
                raise ValueError(f"DeviceGraph.shared_links must hold SharedLink records, got {link!r}")
            if max(link.gpus_a[-1], link.gpus_b[-1]) >= g:
                raise ValueError(f"DeviceGraph.shared_links: {link.name!r} names GPU "
                                 f"{max(link.gpus_a[-1], link.gpus_b[-1])}, the graph has {g} GPUs")
        names = [link.name for link in self.shared_links]
        if len(set(names)) != len(names):
            raise ValueError(f"DeviceGraph.shared_links: names must be unique, got {names}")

    @property
    def num_gpus(self) -> int:
        return len(self.gpu_types)

    @property
    def datacenter_index(self) -> tuple[int, ...]:
        """``(G,)`` each GPU's datacenter as an index (first appearance order; all 0 without names)."""
        order: dict[str, int] = {}
        return tuple(order.setdefault(d, len(order)) for d in self.datacenter_names) or (0,) * self.num_gpus

