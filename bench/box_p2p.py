"""One pipeline message across a box's WAN, timed: Gloo's point-to-point protocol (issue 47, (b)).

    sudo .venv/bin/python bench/box_p2p.py [--cluster bench/clusters/box_b_wan_pairs.yaml] [--scale 0.25]
        [--sizes 16384,262144,1048576] [--offsets -0.5,0,0.5] [--reps 4] [--out bench/results/box_p2p.json]

Brings up the box of the cluster file (``zorse_fx.box.Box``), starts two Gloo ranks, one on the file's first
node and one on the first node of the other region, and sends one message of each size from the first to the
second as the runtime sends an activation (``batch_isend_irecv``, one operation each side). Both ranks post
at times rank 0 chose on the host's one clock (``time.time()``, the same in every namespace): the receive
``offset`` seconds after the send (negative: posted first), each message 2 s after the last. Per size and
offset the median, over ``--reps`` messages, of the time from the later of the two posts to the data's
arrival, beside the link's d + bytes / bw (what a send that leaves when posted costs: the simulator's
"buffered" and "nccl" models) and 2 d + bytes / bw (a rendezvous: the data leaves when the receiver's
"ready" has crossed the link; gloo/transport/tcp/pair.cc sends an unbound buffer on the peer's
NOTIFY_RECV_READY). Each case twice, with both nodes' ``net.ipv4.tcp_slow_start_after_idle`` at Linux's
default (1) and at 0. Found (2026-12-06): 2 d from the later post whenever the receive is posted at or
after the send (16 KB: 0.403 s against d = 0.200), ~d + 0.13 s when posted 0.5 s before; slow start
after idle changes little (the delay line). Hence ``simulate(p2p="gloo")``, what bench/box.py's
simulated column uses. Proves: what one message costs on real TCP with Gloo over the box's delay line.
Cannot prove: NCCL's protocol on a GPU cluster (its InfiniBand transport also waits for the receiver:
``ncclIbIrecv`` writes a clear-to-send into the sender's FIFO, ``ncclIbPostFifo``, before which
``ncclIbIsend`` returns no request; read in NCCL's source, not measured here), nor a real WAN's loss and
queueing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_WORKER = r'''
import json, sys, time
import torch
import torch.distributed as dist

rank, addr, sizes, offsets, reps = (int(sys.argv[1]), sys.argv[2], [int(s) for s in sys.argv[3].split(",")],
                                    [float(s) for s in sys.argv[4].split(",")], int(sys.argv[5]))
dist.init_process_group("gloo", init_method=f"tcp://{addr}:29534", rank=rank, world_size=2)
when = torch.zeros(1, dtype=torch.float64)
out = {}
for offset in offsets:  # the receiver posts its receive `offset` seconds after the sender posts its send
    for size in sizes:
        buf = torch.zeros(size // 4)
        stamps = []
        for k in range(reps + 1):  # the first message of each case not counted (connection warm-up)
            when[0] = time.time() + 2.0  # rank 0's choice of the send time, on the host's one clock
            dist.broadcast(when, 0)
            post = when.item() + (offset if rank == 1 else 0.0)
            time.sleep(max(0.0, post - time.time()))
            op = dist.P2POp(dist.isend if rank == 0 else dist.irecv, buf, 1 - rank)
            for w in dist.batch_isend_irecv([op]):
                w.wait()
            if k and rank == 1:
                stamps.append([when.item(), post, time.time()])  # send posted, receive posted, received
        out[f"{offset}/{size}"] = stamps
print(json.dumps(out), flush=True)
dist.destroy_process_group()
'''


def _set_slow_start(box, nodes: list[str], value: int) -> None:
    for node in nodes:
        subprocess.run(box.command(node, ["sysctl", "-qw", f"net.ipv4.tcp_slow_start_after_idle={value}"]),
                       check=True)



def far_pair(devices) -> tuple[str, str]:
    """The first node of ``devices`` (a ``DeviceGraph``) and the first node of another region: the first GPU whose
    latency from GPU 0 is over 10x GPU 0's to GPU 1 (a WAN beside a NIC).

    Raises:
        ValueError: no such GPU (one region, or GPU 0 alone), saying what the cluster needs."""
    near = devices.link_latency_s[0][1] if devices.num_gpus > 1 else None
    far = [g for g in range(devices.num_gpus) if near is not None and devices.link_latency_s[0][g] > 10 * near]
    if not far:
        raise ValueError("no node of another region (a GPU whose latency from GPU 0 is over 10x GPU 0's to GPU 1): "
                         "give a cluster of two regions joined by a WAN, e.g. bench/clusters/box_b_wan_pairs.yaml")
    return devices.node_names[0], devices.node_names[far[0]]

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", default=str(ROOT / "bench" / "clusters" / "box_b_wan_pairs.yaml"))
    ap.add_argument("--scale", type=float, default=0.25, help="the box's scale factor (bench/box.py's (b): 0.25)")
    ap.add_argument("--sizes", default="16384,262144,1048576", help="message sizes, bytes")
    ap.add_argument("--offsets", default="-0.5,0,0.5",
                    help="seconds from the sender's post to the receiver's (negative: the receive posted first)")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--pair", default="", help="sender,receiver node names (default: the file's first node and "
                                                "the first node of the other region)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "box_p2p.json"))
    args = ap.parse_args(argv)

    from zorse_fx.box import Box
    from zorse_fx.cluster import Cluster

    cluster = Cluster.from_yaml(args.cluster)
    devices = cluster.device_graph()
    if args.pair:
        first, second = args.pair.split(",")
        unknown = [n for n in (first, second) if n not in devices.node_names]
        if unknown:
            ap.error(f"--pair: no node {unknown[0]!r} in {args.cluster}; its nodes: {', '.join(dict.fromkeys(devices.node_names))}")
    else:
        try:
            first, second = far_pair(devices)
        except ValueError as exc:
            ap.error(f"{args.cluster}: {exc}")
    g0, g1 = devices.node_names.index(first), devices.node_names.index(second)
    d = devices.link_latency_s[g0][g1] / args.scale
    bw = devices.link_bw_bytes_per_s[g0][g1] * args.scale
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        worker = Path(tmp) / "worker.py"
        worker.write_text(_WORKER)
        with Box.up(args.cluster, box_id="bench_p2p", scale=args.scale) as box:
            env = dict(os.environ, OMP_NUM_THREADS="1")
            for slow_start in (1, 0):
                _set_slow_start(box, [first, second], slow_start)
                procs = [box.spawn(node, [sys.executable, str(worker), str(r), first, args.sizes, args.offsets,
                                          str(args.reps)],
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                         for r, node in enumerate((first, second))]
                results[slow_start] = [json.loads(p.communicate(timeout=1800)[0].strip().splitlines()[-1])
                                       for p in procs][1]
    print(f"{cluster.name}: one message {first} -> {second} (Gloo, batch_isend_irecv), box scale {args.scale:g}: "
          f"the link d = {d * 1e3:.0f} ms one way, {bw / 1e6:.2f} MB/s; each message 2 s after the last; "
          f"median of {args.reps}; times from the later post (send or receive) to the data received")
    print(f"  {'recv post - send post':>21} {'bytes':>9} {'slow start 1':>13} {'slow start 0':>13} "
          f"{'d + n/bw':>9} {'2d + n/bw':>10}")
    for key in results[1]:
        offset, size = key.split("/")
        med = [statistics.median(got - max(sent, posted) for sent, posted, got in results[v][key]) for v in (1, 0)]
        print(f"  {float(offset):>20.1f}s {int(size):>9,} {med[0]:>12.3f}s {med[1]:>12.3f}s "
              f"{d + int(size) / bw:>8.3f}s {2 * d + int(size) / bw:>9.3f}s")
    import datetime

    Path(args.out).write_text(json.dumps({
        "command": "bench/box_p2p.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cluster": args.cluster, "scale": args.scale, "from": first, "to": second, "d_s": d, "bw_Bps": bw,
        "stamps": "per tcp_slow_start_after_idle, per 'offset/bytes': [send posted, receive posted, received]",
        "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
