"""The box measured against itself: does it make the rates and delays it was asked for?

    .venv/bin/python bench/box_selfcheck.py            # root; about a minute; prints one JSON line per check

Each check builds a box (``zorse_fx.box.Box``), runs small stdlib TCP programs on its nodes and
compares what they see with what the box configured ([Note: latency without netem] and [Note: the
box's network] in zorse_fx/box/):

* ``delay``: TCP ping-pong (1 byte, TCP_NODELAY) between two nodes of small_hetero at the derived
  scale (53 ms one way) and at a 1 ms delay; the round trip minus twice the configured delay is what
  the delay line and the kernel add. The delay line's own count of how late it released packets is
  reported beside it. ``latency none`` (kernel forwarding only) gives the path's floor.
* ``ceiling``: one bulk TCP transfer through the delay line with links far faster than it (25 GB/s
  at scale 1, 1 ms): the delay line's throughput ceiling; the same without the delay line for reference.
* ``nic``: small_hetero at the derived scale: one flow over the 25 GbE pair link (1.19 MB/s in the
  box); the goodput over the transfer's second half against the configured rate (TCP/IP headers are
  52 of every 1,500 bytes: 0.965 of the wire rate is the most a flow can get).
* ``shared``: four nodes behind NICs in two regions joined by a WAN: two flows out of one node, one of
  them across the WAN, share its NIC max-min fairly (the WAN flow gets the WAN's rate, the other the
  rest of the NIC); two flows from two nodes of one region to two of the other share the WAN (their
  bytes over the time from the first to the last byte against the WAN's rate).

Nothing here asserts; the numbers go into bench/LOG.md ("The box") with the machine and the date.
"""

from __future__ import annotations

import json
import select
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zorse_fx.box import Box, check_machine  # noqa: E402
from zorse_fx.cluster import Cluster  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMALL_HETERO = ROOT / "examples" / "clusters" / "small_hetero.yaml"

_SERVER = """
import json, socket, sys, threading, time
port, conns, size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", port)); s.listen()
print("ready", flush=True)
out = [None] * conns
def serve(i, c):
    mode = c.recv(1)
    if mode == b"p":
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while (b := c.recv(1)):
            c.sendall(b)
        out[i] = {}
        return
    n, marks, first = 0, {}, None
    while (b := c.recv(1 << 16)):
        first = first or time.monotonic()
        n += len(b)
        for q in (0.5, 1.0):
            if q not in marks and n >= q * size:
                marks[q] = time.monotonic()
    out[i] = {"bytes": n, "first_s": first, "last_s": marks[1.0],
              "second_half_bytes_per_s": (size - 0.5 * size) / (marks[1.0] - marks[0.5])}
threads = []
for i in range(conns):
    c, _ = s.accept()
    t = threading.Thread(target=serve, args=(i, c)); t.start(); threads.append(t)
for t in threads:
    t.join()
print(json.dumps(out), flush=True)
"""

_BULK = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=120)
c.sendall(b"b"); c.sendall(b"x" * int(sys.argv[3])); c.close()
"""

_PING = """
import json, socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=120)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); c.sendall(b"p")
rtts = []
for _ in range(int(sys.argv[3])):
    t = time.perf_counter(); c.sendall(b"x"); c.recv(1); rtts.append(time.perf_counter() - t)
c.close()
print(json.dumps(rtts))
"""


def _py(code: str, *args) -> list[str]:
    return [sys.executable, "-I", "-S", "-c", textwrap.dedent(code), *map(str, args)]


def _server(box: Box, node: str, conns: int, size: int, port: int = 5000) -> subprocess.Popen:
    p = box.spawn(node, _py(_SERVER, port, conns, size), stdout=subprocess.PIPE, text=True)
    assert select.select([p.stdout], [], [], 60)[0] and p.stdout.readline().strip() == "ready"
    return p


def _together(rs: list[dict]) -> float:
    """The flows' bytes over the time from the first byte of any to the last byte of all, bytes/s."""
    return sum(r["bytes"] for r in rs) / (max(r["last_s"] for r in rs) - min(r["first_s"] for r in rs))


def _flows(box: Box, flows: list[tuple[str, str]], size: int) -> list[dict]:
    """Bulk transfers of ``size`` bytes, all at once, ``(src, dst)`` each; one server per destination."""
    servers = {}
    for dst in dict.fromkeys(d for _, d in flows):
        servers[dst] = _server(box, dst, sum(d == dst for _, d in flows), size)
    clients = [box.spawn(src, _py(_BULK, dst, 5000, size)) for src, dst in flows]
    for c in clients:
        c.wait(timeout=600)
    return [r for s in servers.values() for r in json.loads(s.communicate(timeout=600)[0])]


def _pingpong(box: Box, src: str, dst: str, n: int) -> list[float]:
    server = _server(box, dst, 1, 1)
    client = box.spawn(src, _py(_PING, dst, 5000, n), stdout=subprocess.PIPE, text=True)
    rtts = json.loads(client.communicate(timeout=600)[0])
    server.communicate(timeout=60)
    return rtts


def _summary(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"min": xs[0], "median": statistics.median(xs), "p90": xs[int(0.9 * (len(xs) - 1))], "max": xs[-1]}


def _report(name: str, **fields) -> None:
    print(json.dumps({"check": name, **fields}), flush=True)


def check_delay() -> None:
    for label, options in (("derived scale", {}), ("1 ms", {"scale": 20e-6 / 1e-3}),
                           ("kernel only (latency none)", {"scale": 20e-6 / 1e-3, "latency": "none"})):
        with Box.up(SMALL_HETERO, box_id="selfcheck_delay", **options) as box:
            pair = next(p for p in box.layout.pairs if p.src == "a100-node")
            rtts = _pingpong(box, "a100-node", "t4-node", 200)
            added = [r - 2 * pair.delay_s for r in rtts[5:]]
            _report("delay", case=label, configured_one_way_s=pair.delay_s, rtt_s=_summary(rtts[5:]),
                    rtt_minus_twice_delay_s=_summary(added), delay_line=box.delay_line_stats())


def check_ceiling() -> None:
    fast = {"name": "fast", "nodes": [{"name": "a", "gpus": [{"type": "T4", "count": 1}]},
                                      {"name": "b", "gpus": [{"type": "T4", "count": 1}]}],
            "links": {"inter_node": {"bandwidth_GBps": 25, "latency_ms": 1}}}
    for latency in ("delay-line", "none"):
        with Box.up(Cluster.from_dict(fast), box_id="selfcheck_ceiling", scale=1.0, latency=latency) as box:
            size = 200_000_000
            t = time.monotonic()
            r = _flows(box, [("a", "b")], size)[0]
            _report("ceiling", latency=latency, configured_bytes_per_s=box.layout.pairs[0].bytes_per_s,
                    wall_s=time.monotonic() - t, second_half_bytes_per_s=r["second_half_bytes_per_s"],
                    delay_line=box.delay_line_stats())


def check_nic() -> None:
    with Box.up(SMALL_HETERO, box_id="selfcheck_nic") as box:
        pair = next(p for p in box.layout.pairs if p.src == "a100-node")
        r = _flows(box, [("a100-node", "t4-node")], 4_000_000)[0]
        _report("nic", case="small_hetero pair link", configured_bytes_per_s=pair.bytes_per_s,
                second_half_bytes_per_s=r["second_half_bytes_per_s"],
                fraction=r["second_half_bytes_per_s"] / pair.bytes_per_s)


def check_shared() -> None:
    cluster = {"name": "shared", "datacenters": [{"name": "east"}, {"name": "west"}],
               "nodes": [{"name": n, "datacenter": dc, "gpus": [{"type": "T4", "count": 1}]}
                         for n, dc in (("e1", "east"), ("e2", "east"), ("w1", "west"), ("w2", "west"))],
               "links": {"inter_node": {"bandwidth_GBps": 25, "latency_us": 20},
                         "cross_datacenter": {"bandwidth_GBps": 25, "latency_us": 20},
                         "nic": {"bandwidth_Gbps": 25}},
               "shared_links": [{"name": "wan", "between": [{"datacenter": "east"}, {"datacenter": "west"}],
                                 "bandwidth_Gbps": 10}]}
    with Box.up(Cluster.from_dict(cluster), box_id="selfcheck_shared", scale=1e-3, latency="none") as box:
        nic = box.layout.node("e1").nic_bytes_per_s
        wan = box.layout.shared[0].bytes_per_s
        for case, flows, rate in (("two flows out of one NIC (e1 -> e2, e1 -> w1 over the WAN)",
                                   [("e1", "e2"), ("e1", "w1")], nic),
                                  ("two flows across the WAN (e1 -> w1, e2 -> w2)", [("e1", "w1"), ("e2", "w2")], wan)):
            rs = _flows(box, flows, 4_000_000)
            start = min(r["first_s"] for r in rs)
            _report("shared", case=case, configured_bytes_per_s=rate, together_bytes_per_s=_together(rs),
                    max_min_fair_bytes_per_s=[nic - wan, wan] if rate == nic else [wan / 2, wan / 2],
                    fraction=_together(rs) / rate,
                    flows=[{"from_s": r["first_s"] - start, "to_s": r["last_s"] - start,
                            "second_half_bytes_per_s": r["second_half_bytes_per_s"]} for r in rs])


def main() -> int:
    reason = check_machine()
    if reason:
        print(f"box_selfcheck: cannot build a box here: {reason}", file=sys.stderr)
        return 1
    for check in (check_delay, check_ceiling, check_nic, check_shared):
        check()
    return 0


if __name__ == "__main__":
    sys.exit(main())
