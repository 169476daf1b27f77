"""TCP's pacing of one message across a box's WAN, by message size and round trip (issue 47).

    sudo .venv/bin/python bench/box_pacing.py [--cluster bench/clusters/box_b_wan_pairs.yaml]
        [--scales 0.25,0.5] [--sizes 16384,65536,262144,1048576,4194304] [--offsets -0.5,0.3]
        [--settle 6] [--reps 6] [--both-ways] [--control] [--out bench/results/box_pacing.json]

Per scale, brings up the box of the cluster file (``zorse_fx.box.Box``, TCP tuned as bench/box.py's cases:
[Note: the box's TCP tuning]), starts two Gloo ranks, one on the file's first node and one on the first node
of the other region, and for each offset and size sends ``--settle`` + ``--reps`` messages from the first to
the second as the runtime sends an activation (``batch_isend_irecv``), the receive posted ``offset`` s after
the send (-0.5: its ready long there when the send is posted; 0.3: the send waits for it), one message a
second: the connection carries one message at a time, as a pipeline's boundary connection does (with
``--both-ways`` the same size goes back 0.1 s after each receipt, as a gradient does; with ``--control`` a
one-element all-reduce and a 512 B all-gather follow each message on the same connection, as a training step's
world collectives do); each case on a fresh connection (a new process group; ``tcp_no_metrics_save`` = 1 in
both nodes: no window inherited). Timed: from when the data may leave (the later of the send's post and the
ready's arrival, receive post + d) to the data received (the host's one clock), the median of the last
``--reps`` (the first ``--settle`` let the congestion window settle). After each case the sender reads its
connections to the receiver with ``ss -tin``; the case's own is the one not there before (cwnd, pacing rate,
smoothed RTT). Beside each median: the link's ``d + bytes / bw`` and the simulator's ``d +
paced_transfer_s(bytes, bw, 2 d)`` ([Note: TCP pacing of a message] in zorse_fx/sim/gloo.py, whose constant is
fitted to this benchmark's medians). Proves: how long one message takes on the box's delay line by size, round
trip and which end posted first, and so the simulator's pacing law. Cannot prove: a real WAN's (loss, cross
traffic, another congestion control or qdisc), nor NCCL's sockets, nor a connection that also carries other
traffic (in training the pipeline's pairs carry the world's collectives too).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_WORKER = r'''
import json, socket, subprocess, sys, time
import torch
import torch.distributed as dist

rank, addr, peer, sizes, settle, reps, offsets, both, control = (
    int(sys.argv[1]), sys.argv[2], sys.argv[3], [int(s) for s in sys.argv[4].split(",")], int(sys.argv[5]),
    int(sys.argv[6]), [float(s) for s in sys.argv[7].split(",")], sys.argv[8] == "1", sys.argv[9] == "1")
dist.init_process_group("gloo", init_method=f"tcp://{addr}:29537", rank=rank, world_size=2)
when = torch.zeros(1, dtype=torch.float64)
out = {}
for offset in offsets:  # the receive posted `offset` s after the send (negative: before)
    for size in sizes:
        buf = torch.zeros(size // 4)
        rows = [torch.zeros(128) for _ in range(2)]
        group = dist.new_group([0, 1])  # a fresh connection per case: its window grown by this case alone
        stamps = []
        for k in range(settle + reps):
            when[0] = time.time() + 1.0  # rank 0's choice of the send time, on the host's one clock
            dist.broadcast(when, 0)
            post = when.item() + (offset if rank == 1 else 0.0)
            time.sleep(max(0.0, post - time.time()))
            op = dist.P2POp(dist.isend if rank == 0 else dist.irecv, buf, 1 - rank, group)
            for w in dist.batch_isend_irecv([op]):
                w.wait()
            if k >= settle and rank == 1:
                stamps.append([when.item(), post, time.time()])  # send posted, receive posted, received
            if both:  # a pipeline's pair: the same size back 0.1 s later (a gradient), its receive long posted
                if rank == 1:
                    time.sleep(0.1)
                op = dist.P2POp(dist.isend if rank == 1 else dist.irecv, buf, 1 - rank, group)
                for w in dist.batch_isend_irecv([op]):
                    w.wait()
            if control:  # the training step's world collectives on the same connection: a one-element
                # all-reduce (the gradient norm) and a 512-byte-per-rank all-gather (the ranks' records)
                dist.all_reduce(torch.ones(1), group=group)
                dist.all_gather(rows, torch.ones(128), group=group)
        dist.barrier()
        ss = ""
        if rank == 0:  # the sender's connections to the receiver, as the kernel sees them now
            ss = subprocess.run(["ss", "-tin", "dst", socket.gethostbyname(peer)], capture_output=True,
                                text=True).stdout
        out[f"{offset}/{size}"] = {"stamps": stamps, "ss": ss}
print(json.dumps(out), flush=True)
dist.destroy_process_group()
'''

_FIELDS = {"cwnd": r"\bcwnd:(\d+)", "mss": r"\bmss:(\d+)", "rtt_ms": r"\brtt:([\d.]+)/",
           "pacing_bps": r"pacing_rate (\d+(?:\.\d+)?[KMG]?)bps"}


def _bps(text: str) -> float:
    scale = {"K": 1e3, "M": 1e6, "G": 1e9}
    return float(text[:-1]) * scale[text[-1]] if text[-1] in scale else float(text)


def parse_ss(text: str) -> list[dict]:
    """Per connection in ``ss -tin`` output that carried data (a congestion window and a pacing rate): its
    local address (``local``: the socket line before the information line), cwnd (segments), mss (bytes),
    smoothed rtt (ms) and pacing rate (bytes/s)."""
    rows, local = [], ""
    for line in text.splitlines():
        got = {k: re.search(p, line) for k, p in _FIELDS.items()}
        if all(got.values()):
            rows.append({"local": local, "cwnd": int(got["cwnd"].group(1)), "mss": int(got["mss"].group(1)),
                         "rtt_ms": float(got["rtt_ms"].group(1)),
                         "pacing_Bps": _bps(got["pacing_bps"].group(1)) / 8})
        elif line.split() and line.split()[0] == "ESTAB" and len(line.split()) >= 4:
            local = line.split()[3]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", default=str(ROOT / "bench" / "clusters" / "box_b_wan_pairs.yaml"))
    ap.add_argument("--scales", default="0.25,0.5", help="box scale factors, one box each (round trip 2 d / scale)")
    ap.add_argument("--sizes", default="16384,65536,262144,1048576,4194304", help="message sizes, bytes")
    ap.add_argument("--settle", type=int, default=6, help="messages per size before the timed ones")
    ap.add_argument("--reps", type=int, default=6, help="timed messages per size")
    ap.add_argument("--both-ways", action="store_true",
                    help="after each message the same size back, 0.1 s after its receipt (a pipeline's "
                         "activation and gradient on one connection)")
    ap.add_argument("--control", action="store_true",
                    help="after each message a one-element all-reduce and a 512 B-per-rank all-gather on the "
                         "same connection (a training step's world collectives)")
    ap.add_argument("--offsets", default="-0.5,0.3",
                    help="seconds from the send's post to the receive's (negative: the receive posted first)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "box_pacing.json"))
    args = ap.parse_args(argv)
    if args.reps < 1 or args.settle < 0:
        ap.error(f"--reps {args.reps} --settle {args.settle}: give at least one timed message (--reps >= 1) and "
                 f"--settle >= 0")

    from box_p2p import far_pair
    from zorse_fx.box import Box, check_machine
    from zorse_fx.cluster import Cluster
    from zorse_fx.sim.gloo import paced_transfer_s

    why = check_machine()
    if why:
        print(f"bench/box_pacing.py: the box cannot run here: {why}", file=sys.stderr)
        return 2
    cluster = Cluster.from_yaml(args.cluster)
    devices = cluster.device_graph()
    try:
        first, second = far_pair(devices)
    except ValueError as exc:
        ap.error(f"{args.cluster}: {exc}")
    g0, g1 = devices.node_names.index(first), devices.node_names.index(second)
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        worker = Path(tmp) / "worker.py"
        worker.write_text(_WORKER)
        for scale in (float(s) for s in args.scales.split(",")):
            d = devices.link_latency_s[g0][g1] / scale
            back = devices.link_latency_s[g1][g0] / scale
            bw = devices.link_bw_bytes_per_s[g0][g1] * scale
            with Box.up(args.cluster, box_id="bench_pacing", scale=scale) as box:
                for node in (first, second):  # no window carried from one connection to the next (tcp_metrics)
                    subprocess.run(box.command(node, ["sysctl", "-qw", "net.ipv4.tcp_no_metrics_save=1"]), check=True)
                env = dict(os.environ, OMP_NUM_THREADS="1")
                worker_args = [first, second, args.sizes, str(args.settle), str(args.reps), args.offsets,
                        "1" if args.both_ways else "0", "1" if args.control else "0"]
                procs = [box.spawn(node, [sys.executable, str(worker), str(r), *worker_args],
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                         for r, node in enumerate((first, second))]
                got = [json.loads(p.communicate(timeout=1800)[0].strip().splitlines()[-1]) for p in procs]
            seen: set[str] = set()  # the connections of earlier cases: a case's own is the one new in its reading
            for key in got[1]:
                offset, n = float(key.split("/")[0]), int(key.split("/")[1])
                # from when the data may leave (the send posted and the receiver's ready arrived) to its receipt
                took = [r - max(s, p + back) for s, p, r in got[1][key]["stamps"]]
                cases.append({"scale": scale, "d_s": d, "rtt_s": d + back, "bw_Bps": bw, "offset_s": offset,
                              "bytes": n, "measured_s": took, "median_s": statistics.median(took),
                              "link_s": d + n / bw, "paced_s": d + paced_transfer_s(n, bw, d + back),
                              "ss": [r for r in parse_ss(got[0][key]["ss"]) if r["local"] not in seen]})
                seen.update(r["local"] for r in parse_ss(got[0][key]["ss"]))
    print(f"{cluster.name}: one message {first} -> {second} (Gloo, batch_isend_irecv), one a second; median of "
          f"the last {args.reps} of {args.settle + args.reps}; from when it may leave (send posted, the receiver's "
          f"ready arrived) to received")
    print(f"  {'scale':>5} {'d ms':>6} {'MB/s':>6} {'recv-send':>9} {'bytes':>9} {'measured':>9} {'d + n/bw':>9} "
          f"{'paced':>7} {'cwnd':>6} {'cwnd/n':>7} {'srtt ms':>8} {'pace MB/s':>10}")
    for c in cases:
        ss = max(c["ss"], key=lambda r: r["cwnd"]) if c["ss"] else None
        extra = (f"{ss['cwnd']:>6} {ss['cwnd'] * ss['mss'] / c['bytes']:>7.2f} {ss['rtt_ms']:>8.1f} "
                 f"{ss['pacing_Bps'] / 1e6:>10.2f}" if ss else "  (no connection read)")
        print(f"  {c['scale']:>5g} {c['d_s'] * 1e3:>6.0f} {c['bw_Bps'] / 1e6:>6.1f} {c['offset_s']:>8.1f}s "
              f"{c['bytes']:>9,} "
              f"{c['median_s']:>8.3f}s {c['link_s']:>8.3f}s {c['paced_s']:>6.3f}s {extra}")
    Path(args.out).write_text(json.dumps({
        "command": "bench/box_pacing.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cluster": args.cluster, "from": first, "to": second, "settle": args.settle, "reps": args.reps,
        "offsets": args.offsets, "both_ways": args.both_ways, "control": args.control,
        "cases": cases}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
