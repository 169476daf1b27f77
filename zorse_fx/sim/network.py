"""The simulator's network: the resources a flow uses, max-min fair rates over
several resources, and ring collectives priced on the actual links.

[Note: network resources]
A flow (a boundary message g -> h) uses
  * its pair's link in its direction (``link_resource``): the ordered node
    pair for GPUs on different nodes, the ordered GPU pair inside a node,
    capacity ``link_bw_bytes_per_s[g][h]`` (where the flows on one such
    resource have different figures -- a hand-made asymmetric graph -- the
    smallest). Links are full duplex, as NVLink, PCIe, InfiniBand and
    Ethernet are: an activation message and a gradient message going the
    other way do not share bandwidth (one resource for both directions
    stretches asynchronous boundary messages of opposite directions:
    bench/README.md "Full-duplex links and the pipeline period"), and
  * every shared link it crosses (``DeviceGraph.shared_links``: a region's
    WAN path, a node's NIC), one resource per direction (full duplex), of
    the link's capacity.
The flows in their transfer phase get max-min fair rates over these
resources (``max_min_rates``: progressive filling), recomputed at every
event. With no shared links every flow uses one resource and its rate is the
equal share ``bw / n`` of its pair's link.

Ring collectives (``Ring``): the gradient all-reduce / weight all-gather of
a GPU group runs as a ring over the group's GPUs in stage order, g_0 -> g_1
-> ... -> g_{k-1} -> g_0. Every hop sends at once; a hop's bandwidth is its
pair's link's, or its share of a shared link it crosses if smaller (the
link's capacity / the number of the ring's hops crossing it in the same
direction); the ring moves at its slowest hop. Ring all-reduce of n bytes:
``2 (k - 1) / k * n / bw + 2 (k - 1) * lat`` (reduce-scatter + all-gather,
k - 1 steps each, of n / k bytes per hop; Patarasuk & Yuan, "Bandwidth
optimal all-reduce algorithms for clusters of workstations", JPDC 2009);
all-gather of n bytes: ``(k - 1) / k * n / bw + (k - 1) * lat``, with lat
the largest hop latency. Hops on one node pair are counted as links of their
own (what they share is the nodes' NICs, when the cluster file declares
them). Collectives do not contend with boundary messages.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

from ..ir.devices import DeviceGraph

__all__ = ["FlowResources", "Ring", "broadcast_tree", "gloo_unequal_allgather_s", "link_resource", "max_min_rates",
           "ring"]


def link_resource(devices: DeviceGraph, g: int, h: int) -> tuple:
    """The pair's own link a message g -> h uses, in its direction (see [Note: network resources])."""
    nodes = devices.node_names or tuple(f"gpu{k}" for k in range(devices.num_gpus))
    if nodes[g] != nodes[h]:
        return ("node", nodes[g], nodes[h])
    return ("gpu", g, h)


class FlowResources:
    """The shared-link resources of every GPU pair of one device graph, computed once per pair.

    ``shared(g, h)``: ``((("shared", i, direction), capacity), ...)`` for the
    shared links ``devices.shared_links[i]`` a flow g -> h crosses."""

    def __init__(self, devices: DeviceGraph) -> None:
        self.devices = devices
        self._cache: dict[tuple[int, int], tuple] = {}

    def shared(self, g: int, h: int) -> tuple[tuple[tuple, float], ...]:
        key = (g, h)
        out = self._cache.get(key)
        if out is None:
            out = self._cache[key] = tuple(
                (("shared", i, d), sl.bandwidth_bytes_per_s)
                for i, sl in enumerate(self.devices.shared_links) if (d := sl.direction(g, h)) is not None)
        return out


def max_min_rates(flows: Sequence[Sequence[Hashable]], capacity: Mapping[Hashable, float]) -> list[float]:
    """Max-min fair rates of ``flows`` (each the resources it uses, at least
    one) over resources of the given ``capacity`` (> 0), by progressive
    filling: repeatedly the resource whose remaining capacity divided among
    its still unfrozen flows is smallest is the bottleneck; its unfrozen flows
    get that share and are frozen, and the share is taken off every resource
    they use. Ties go to the first-listed resource (they freeze the same rates)."""
    n = len(flows)
    rate = [0.0] * n
    left = dict(capacity)
    users: dict[Hashable, list[int]] = defaultdict(list)
    for f, res in enumerate(flows):
        if not res:
            raise ValueError(f"flow {f} uses no resource")
        for r in res:
            users[r].append(f)
    if all(len(res) == 1 for res in flows):  # no flow meets another resource: equal shares (the same rates)
        return [capacity[res[0]] / len(users[res[0]]) for res in flows]
    frozen = [False] * n
    unfrozen = {r: len(fs) for r, fs in users.items()}
    while unfrozen:
        best, share = None, 0.0
        for r, k in unfrozen.items():
            if best is None or left[r] / k < share:
                best, share = r, left[r] / k
        share = max(share, 0.0)
        for f in users[best]:
            if frozen[f]:
                continue
            frozen[f], rate[f] = True, share
            for r in flows[f]:
                left[r] -= share
                unfrozen[r] -= 1
                if not unfrozen[r]:
                    del unfrozen[r]
    return rate


@dataclass(frozen=True, slots=True)
class Ring:
    """A ring over ``gpus`` (in this order): its slowest hop's bandwidth
    (bytes/s, with shared links split among the hops crossing them) and the
    latency of one ring step (s): the largest hop latency, twice that under a
    rendezvous protocol (``ring(..., rendezvous=True)``); see [Note: network
    resources]. One GPU: no hops, every collective takes 0 s."""

    gpus: tuple[int, ...]
    bandwidth_bytes_per_s: float
    latency_s: float

    @property
    def size(self) -> int:
        return len(self.gpus)

    def allreduce_s(self, nbytes: float) -> float:
        """Ring all-reduce of ``nbytes`` per GPU: ``2 (k-1)/k n / bw + 2 (k-1) lat``."""
        k = self.size
        return 0.0 if k < 2 else 2 * (k - 1) / k * nbytes / self.bandwidth_bytes_per_s + 2 * (k - 1) * self.latency_s

    def allgather_s(self, nbytes: float) -> float:
        """Ring all-gather of ``nbytes`` in all (each GPU holds n / k): ``(k-1)/k n / bw + (k-1) lat``."""
        k = self.size
        return 0.0 if k < 2 else (k - 1) / k * nbytes / self.bandwidth_bytes_per_s + (k - 1) * self.latency_s


def ring(devices: DeviceGraph, gpus: Sequence[int], resources: FlowResources | None = None, *,
         rendezvous: bool = False) -> Ring:
    """The ring g_0 -> g_1 -> ... -> g_{k-1} -> g_0 over ``gpus`` (see [Note: network resources]).
    ``rendezvous``: each step's send waits for its receiver's "ready to receive" (Gloo,
    ``simulate(p2p="gloo")``), so a step pays its hop's latency twice: once for the notice, once for the data.
    Gloo's ring all-reduce posts a step's send and receive together (gloo/allreduce.cc), and its TCP pair sends
    an unbound buffer only on the peer's NOTIFY_RECV_READY (gloo/transport/tcp/pair.cc); measured on the box:
    a 4-rank all-reduce of 4 KiB over a 200 ms one-way WAN took 2.41 s = 6 steps x 2 x 200 ms (bench/LOG.md
    "The box's WAN: TCP windows and Gloo's rendezvous")."""
    gpus = tuple(gpus)
    k = len(gpus)
    if len(set(gpus)) != k:
        raise ValueError(f"a ring visits each GPU once, got {gpus}")
    if k < 2:
        return Ring(gpus, float("inf"), 0.0)
    resources = resources or FlowResources(devices)
    hops = [(gpus[i], gpus[(i + 1) % k]) for i in range(k)]  # k = 2: there and back
    crossing: dict[tuple, int] = defaultdict(int)
    for g, h in hops:
        for key, _ in resources.shared(g, h):
            crossing[key] += 1
    bw, lat = float("inf"), 0.0
    for g, h in hops:
        hop = devices.link_bw_bytes_per_s[g][h]
        if not hop > 0:
            raise ValueError(f"link bandwidth from GPU {g} to {h} must be > 0, got {hop}")
        for key, cap in resources.shared(g, h):
            hop = min(hop, cap / crossing[key])
        bw, lat = min(bw, hop), max(lat, max(devices.link_latency_s[g][h], 0.0))
    return Ring(gpus, bw, 2 * lat if rendezvous else lat)


def broadcast_tree(k: int, root: int) -> list[tuple[int, int, int]]:
    """Gloo's broadcast over k ranks from ``root`` (gloo/broadcast.cc): a binomial tree of
    ceil(log2 k) rounds; in round i every rank at distance v < 2**i from the root (v + root mod k)
    sends the whole buffer to the rank at v + 2**i, where that exists. ``(round, src, dst)`` ranks."""
    rounds = max(0, (k - 1).bit_length())
    return [(i, (v + root) % k, (v + (1 << i) + root) % k)
            for i in range(rounds) for v in range(min(1 << i, k)) if v + (1 << i) < k]


def gloo_unequal_allgather_s(devices: DeviceGraph, gpus: Sequence[int], part_bytes: Sequence[float],
                             resources: FlowResources | None = None) -> float:
    """Seconds of the runtime's ZeRO-1 all-gather of unequal parts on Gloo (``part_bytes[j]`` bytes held by
    ``gpus[j]``): one broadcast per non-empty part from the GPU holding it
    (``runtime/param_shard.all_gather_unequal``), each a binomial tree (``broadcast_tree``) over ``gpus`` in
    rank order, two at a time (``ProcessGroupGloo``'s two worker
    threads). Priced as its busiest link: every tree edge adds its part's bytes to its pair's link and to
    every shared link it crosses (one resource per direction, [Note: network resources]), the time is the
    largest bytes / capacity, plus per pair of broadcasts each round's rendezvous, 2 x the largest hop
    latency. Bytes are those the broadcasts move, not a ring's (k - 1) / k: a part crosses a link once per
    tree edge over it, so on two nodes a larger part of one node crosses the NIC twice per broadcast."""
    if len(part_bytes) != len(gpus):
        raise ValueError(f"one part per GPU: {len(gpus)} GPUs, {len(part_bytes)} parts")
    owners, gpus = tuple(gpus), tuple(sorted(gpus))  # a group's ranks number its GPUs in index order
    k = len(gpus)
    if k < 2:
        return 0.0
    resources = resources or FlowResources(devices)
    load: dict[tuple, float] = defaultdict(float)
    cap: dict[tuple, float] = {}
    lat, rounds, sends = 0.0, max(0, (k - 1).bit_length()), 0
    for owner, nbytes in zip(owners, part_bytes):
        if nbytes <= 0:
            continue
        sends += 1
        for _, a, b in broadcast_tree(k, gpus.index(owner)):
            g, h = gpus[a], gpus[b]
            key = link_resource(devices, g, h)
            cap[key] = min(cap.get(key, float("inf")), devices.link_bw_bytes_per_s[g][h])
            load[key] += nbytes
            for skey, c in resources.shared(g, h):
                cap[skey] = c
                load[skey] += nbytes
            lat = max(lat, devices.link_latency_s[g][h])
    transfer = max((load[r] / cap[r] for r in load), default=0.0)
    return transfer + -(-sends // 2) * rounds * 2 * lat
