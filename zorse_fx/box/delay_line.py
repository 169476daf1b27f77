"""The box's delay line: every packet between two nodes held for its link's one-way delay.

Runs in the box's router namespace as its own process (``python delay_line.py CONFIG``; standard
library only, so it starts in a few tens of ms). It opens two TUN devices: the router routes every
packet between nodes into ``tun_in`` (policy routing, ``box/net.py``); this loop reads each packet,
looks up the (source, destination) address pair's delay and writes the packet into ``tun_out`` once
that delay has passed, from where the router forwards it to the destination node. Packets of one
pair leave in the order they came (one FIFO per distinct delay, each in arrival order). See [Note:
latency without netem] in ``zorse_fx/box/box.py`` for why and what it measures like.

CONFIG (JSON): ``{"tun_in": name, "tun_out": name, "delays": [[src, dst, seconds], ...],
"stats": path}``. It prints ``ready`` once both devices exist. On SIGUSR1 and on exit (SIGTERM,
SIGINT) it writes to ``stats`` ``{"packets", "bytes", "dropped", "late_mean_s", "late_p50_s",
"late_p99_s", "late_max_s"}``: how much later than due the packets left (the line's own added
delay; the last 65,536 packets for the percentiles).
"""

from __future__ import annotations

import collections
import fcntl
import json
import os
import select
import signal
import struct
import sys
import time

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_KEEP = 65536  # latenesses kept for the percentiles


def open_tun(name: str) -> int:
    """A TUN device called ``name`` in this process's network namespace (gone when the fd closes)."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    return fd


def main(argv: list[str]) -> int:
    config = json.loads(open(argv[0]).read())
    delays = {(bytes(map(int, s.split("."))), bytes(map(int, d.split(".")))): float(t)
              for s, d, t in config["delays"]}
    fd_in, fd_out = open_tun(config["tun_in"]), open_tun(config["tun_out"])
    os.set_blocking(fd_in, False)
    queues: dict[float, collections.deque] = {}
    stats = {"packets": 0, "bytes": 0, "dropped": 0}
    late: collections.deque = collections.deque(maxlen=_KEEP)
    late_sum = [0.0, 0.0]  # sum, max

    def write_stats(*_):
        kept = sorted(late)
        pick = (lambda q: kept[min(len(kept) - 1, int(q * len(kept)))]) if kept else (lambda q: 0.0)
        out = dict(stats, late_mean_s=late_sum[0] / max(stats["packets"], 1), late_p50_s=pick(0.5),
                   late_p99_s=pick(0.99), late_max_s=late_sum[1])
        tmp = config["stats"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f)
        os.replace(tmp, config["stats"])

    def stop(*_):
        write_stats()
        raise SystemExit(0)

    signal.signal(signal.SIGUSR1, write_stats)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print("ready", flush=True)
    now = time.monotonic
    while True:
        heads = [q[0][0] for q in queues.values() if q]
        timeout = max(0.0, min(heads) - now()) if heads else None
        readable, _, _ = select.select([fd_in], [], [], timeout)
        if readable:
            t = now()
            while True:
                try:
                    packet = os.read(fd_in, 65536)
                except BlockingIOError:
                    break
                delay = delays.get((packet[12:16], packet[16:20]), 0.0) if packet[:1] and packet[0] >> 4 == 4 else 0.0
                queues.setdefault(delay, collections.deque()).append((t + delay, packet))
        t = now()
        for q in queues.values():
            while q and q[0][0] <= t:
                due, packet = q.popleft()
                try:
                    os.write(fd_out, packet)
                except OSError:
                    stats["dropped"] += 1
                    continue
                stats["packets"] += 1
                stats["bytes"] += len(packet)
                lateness = now() - due
                late.append(lateness)
                late_sum[0] += lateness
                late_sum[1] = max(late_sum[1], lateness)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
