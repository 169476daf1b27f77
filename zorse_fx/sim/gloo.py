"""Gloo's transport as the simulator prices it under ``p2p="gloo"``: its collectives operation by operation
([Note: Gloo's collectives as programs]), the receiver's ready behind data ([Note: Gloo's ready behind
data]) and TCP's pacing of a message ([Note: TCP pacing of a message]).

[Note: Gloo's collectives as programs]
A ring priced as a whole (``network.Ring``) ends at one time for every rank. Gloo's does not: each
rank runs its own sequence of sends, receives and waits on unbound buffers, and a send's data leaves
only once the receiver has posted its receive and said so (``NOTIFY_RECV_READY``,
gloo/transport/tcp/pair.cc). Across a WAN the ranks therefore leave a collective up to a latency apart,
and the next step starts where each left. Measured on box case b_wan_shared (four single-rank nodes,
two per region, 200 ms one way between the regions; bench/LOG.md, "Gloo's small collectives, rank by
rank", 2026-12-07): every step, in every plan, rank 2 started 0.200 s after rank 0 and rank 3 0.200 s
before it; the gradient norm's one-element all-reduce ended 0.43 s after its last rank entered in one
plan and 0.65 s in another, by which rank entered last. The programs below are gloo's own loops
(gloo/allreduce.cc ``ring``, gloo/allgather.cc ``allgather``, pytorch/gloo at the mirrored head),
replayed with the rendezvous rule: the k-th send from rank a to rank b meets the k-th receive that b
posted from a; its data leaves at max(send posted, receive posted + latency(b, a)) and arrives a
latency(a, b) plus its transfer later (its bytes over the link's bandwidth, paced: [Note: TCP pacing of
a message]); a send completes when its data leaves
(the messages are a few bytes: the socket takes them at once), a receive when its data arrives, and a
wait returns the rank's oldest outstanding send (or receive). Replayed from the per-rank entry times
measured in that case, they give the per-rank exits measured within 5 ms (tests/test_sim_gloo.py).
The world's small collectives are replayed so (their links are not shared with anything priced at the
same time), and the all-reduce of a tied parameter over its holders (``sync.gradient_sync``: its ring at
the bandwidth of its slowest hop, shared links split, each message paced); the gradient buckets stay
rings with two latencies per step (``network.ring``).

[Note: Gloo's ready behind data]
Gloo's "ready to receive" travels in band, on the one TCP connection a rank pair shares, so it queues
behind data already crossing the other way: a stage that ends a backward posts its gradient's send and
its next forward's receive together, and that receive's ready reaches the sender only with the
gradient's last byte. Measured on box case (a) (bench/LOG.md, "Gloo's small collectives, rank by rank"):
the third and fourth activations of a 4-micro-batch pipeline arrived 0.21 and 0.41 s after a sender-side
rendezvous would have them, one and two gradient transfers later; a direct check on the same box
(131 KiB and 512 KiB messages both ways at once against one way) found each direction's data at full
rate, so only the ready is held up. Under ``p2p="gloo"`` a message whose receive was posted while data
of the reverse direction was on the wire leaves no earlier than one latency after that data arrived
(``engine._Pipeline._post``). The data itself keeps each direction's link (``link_resource``); NCCL's
and the buffered models do not have it.

[Note: TCP pacing of a message]
Linux paces every TCP flow (the qdisc's fq, or the stack's own pacing where there is none, as on the box) at
about its congestion window per smoothed round trip, and a window grows only while the flow needs more (in
slow start only while it is under twice the packets last in flight: ``tcp_is_cwnd_limited``,
include/net/tcp.h): a connection that carries one M-byte message at a time settles at a window of about
twice M above the initial one. Measured by bench/box_pacing.py on the box of
bench/clusters/box_b_wan_pairs.yaml (2026-12-07, bench/results/box_pacing.json, bench/LOG.md "TCP pacing
across sizes and round trips"): messages of 16 KiB-4 MiB, one a second, each size on a fresh connection
carrying nothing else, the receive posted 0.5 s before the send or 0.3 s after it, at round trips of 0.4 and
0.2 s: `ss -ti` read windows of 1.84-2.32 x M for M >= 256 KiB (1.6-3.4 x M below), and a message took its
latency plus 0.13-0.25 s (0.4 s round trip) or 0.06-0.11 s (0.2 s), where the link's rate alone gives
0.001-0.13 s, whichever end posted first. Pacing spaces a message's segments, so its first leaves at once:
under ``p2p="gloo"`` a message of M bytes takes at least ``(M - MSS_BYTES) x RTT / (PACED_WINDOW_MESSAGES x
M + INITIAL_WINDOW_BYTES)`` beyond its latency (``paced_transfer_s``; RTT: the pair's two one-way latencies;
PACED_WINDOW_MESSAGES = 1.8 fitted by least squares to those twenty medians (1.81; 1.80 on an earlier run of
the same sweep): 16 of them within 0.01 s, the others -0.036 to +0.046 s, all at the 0.4 s round trip with
the receive posted first; the law read earlier from one 512 KiB message, max(2.13 M, 10 segments), missed by
up to 0.063 s): on a long link, a message much smaller than its bandwidth-delay product takes about half a
round trip more; on a link where the bytes take longer than a round trip (box case (a)) nothing changes; a
message of one segment (the control collectives' 4 bytes, a record row) is not held. ``zorse bench comm``
fits the links from back-to-back messages whose windows grew (19.4 MB/s on that WAN), which is why the fit
alone priced the crossings fast. Paced so: the pipeline's point-to-point messages and every message of a
replayed program (a tied parameter's 2-rank all-reduce across box (b)'s WAN, 131 KiB in 32 KiB messages:
measured 1.09-1.12 s from its last holder's entry, 0.81 s unpaced; bench/LOG.md "A tied parameter's
all-reduce, paced"). The gradient buckets' rings are not: pacing their steps by the same rule priced box
(b)'s data-parallel plan 17% slow (their connections carry two buckets' steps back to back, and their
windows grow past one message). Not modelled: how a window that grew for larger messages carries over to
smaller ones on the same connection (a window only grows while slow start after idle is off: the box's
tuning), nor the spread of one crossing between connections (a 512 KiB message took 0.39-0.47 s across
runs).

[Note: a send's notice in flight]
gloo writes a NOTIFY_SEND_READY to the receiver when a send is posted (``Pair::send``, pair.cc). A send
posted before its receiver's ready arrives waits; if the ready arrives within a round trip of the post,
the data leaves while that notice is still unacknowledged, and such a connection's window settles larger.
Measured by bench/box_pacing.py (box of box_b_wan_pairs.yaml at scale 0.25: d = 0.2 s, 31 MB/s; 512 KiB,
30 messages per case on a fresh connection, /tmp/s60/pacing7.json, 2026-12-07, bench/LOG.md "TCP pacing
across sizes and round trips"): the receive posted 0.1 s after the send (the ready arrives 0.3 s after it,
the notice's acknowledgement 0.4 s after), window 2.54 x M and every message d + 0.161 s; the receive posted
0.5 s before the send, window 1.78 x M and d + 0.259 s. In training on box (b) the same split: a send that
waited so took d + 0.170 s by the run's 8th step, one whose receiver was long ready d + 0.214. So under
``p2p="gloo"`` a pipeline message whose send waited for its ready and left within a round trip of its post
moves with ``NOTIFIED_WINDOW_MESSAGES`` = 2.54 (that one reading) in place of ``PACED_WINDOW_MESSAGES``. The
replayed collectives' messages keep ``PACED_WINDOW_MESSAGES`` (not measured so).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["INITIAL_WINDOW_BYTES", "MSS_BYTES", "NOTIFIED_WINDOW_MESSAGES", "Op", "PACED_WINDOW_MESSAGES",
           "allgather_program", "allreduce_program", "paced_transfer_s", "replay"]

#: [Note: TCP pacing of a message]: a connection's congestion window in its steady state above the initial
#: window, in messages of the size it carries (fitted to bench/box_pacing.py's medians, 2026-12-07).
PACED_WINDOW_MESSAGES = 1.8
#: [Note: a send's notice in flight]: the window, in messages above the initial one, of a connection whose
#: sends leave while their notice is unacknowledged (bench/box_pacing.py, 512 KiB at a 0.4 s round trip).
NOTIFIED_WINDOW_MESSAGES = 2.54
#: A TCP segment's payload on the box's (and Ethernet's) 1,500-byte MTU with timestamps: 1,448 B.
MSS_BYTES = 1448
#: Linux's initial congestion window, 10 segments (RFC 6928): where a connection's window starts.
INITIAL_WINDOW_BYTES = 10 * MSS_BYTES


def paced_transfer_s(nbytes: float, bytes_per_s: float, rtt_s: float, *, notified: bool = False) -> float:
    """Seconds for a message of ``nbytes`` to cross a link of ``bytes_per_s`` once its first byte left, under
    TCP's pacing ([Note: TCP pacing of a message]): the longer of the bytes at the link's rate and all but
    its first segment at ``(k x nbytes + INITIAL_WINDOW_BYTES) / rtt_s``, k = ``PACED_WINDOW_MESSAGES``, or
    ``NOTIFIED_WINDOW_MESSAGES`` where ``notified`` (a send whose data left while gloo's notice of it was
    still unacknowledged: [Note: a send's notice in flight]).

    Raises:
        ValueError: ``bytes_per_s`` is not > 0."""
    if not bytes_per_s > 0:
        raise ValueError(f"link bandwidth must be > 0 bytes/s, got {bytes_per_s}")
    t = nbytes / bytes_per_s
    if rtt_s > 0 and nbytes > MSS_BYTES:
        k = NOTIFIED_WINDOW_MESSAGES if notified else PACED_WINDOW_MESSAGES
        t = max(t, (nbytes - MSS_BYTES) * rtt_s / (k * nbytes + INITIAL_WINDOW_BYTES))
    return t


@dataclass(frozen=True, slots=True)
class Op:
    """One operation of a rank's program: ``"send"`` / ``"recv"`` (``nbytes`` to / from ring position
    ``peer``; posted at once), ``"wait_send"`` / ``"wait_recv"`` (block until the oldest outstanding one
    completes)."""

    kind: str
    peer: int = -1
    nbytes: int = 0


def _round_up(value: int, multiple: int) -> int:
    return value if value % multiple == 0 else value + multiple - value % multiple


def allreduce_program(n: int, rank: int, total_bytes: int, element_bytes: int = 4) -> list[Op]:
    """Ring position ``rank``'s operations in gloo's ring all-reduce of ``total_bytes`` over ``n`` ranks
    (gloo/allreduce.cc ``ring``, one input buffer, no maximum segment size: ``2 n`` segments, as
    ``ProcessGroupGloo`` sets none): a reduce-scatter then an all-gather, each sending to ``rank - 1`` and
    receiving from ``rank + 1`` with two operations in flight; a segment beyond ``total_bytes`` is neither
    sent nor received (so a one-element all-reduce is one chain ``n-1 -> ... -> 0`` of hops, then
    ``0 -> n-1 -> ... -> 1``)."""
    if n < 2:
        return []
    num_seg = 2 * n
    per = num_seg // n
    seg = _round_up(-(-total_bytes // num_seg), element_bytes)
    recv_rank, send_rank = (rank + 1) % n, (rank - 1) % n

    def lengths(i: int, send_first: int, recv_first: int) -> tuple[int, int]:
        send_off = ((send_first * per + i) * seg) % (num_seg * seg)
        recv_off = ((recv_first * per + i) * seg) % (num_seg * seg)
        return min(seg, total_bytes - send_off), min(seg, total_bytes - recv_off)

    ops: list[Op] = []
    for send_first, recv_first in ((rank + 1, rank + 2), (rank, rank + 1)):  # reduce-scatter, all-gather
        for i in range(num_seg - per + 2):
            if i >= 2:
                send_len, recv_len = lengths(i - 2, send_first, recv_first)
                if recv_len > 0:
                    ops.append(Op("wait_recv"))
                if send_len > 0:
                    ops.append(Op("wait_send"))
            if i < num_seg - per:
                send_len, recv_len = lengths(i, send_first, recv_first)
                if recv_len > 0:
                    ops.append(Op("recv", recv_rank, recv_len))
                if send_len > 0:
                    ops.append(Op("send", send_rank, send_len))
    return ops


def allgather_program(n: int, rank: int, in_bytes: int) -> list[Op]:
    """Ring position ``rank``'s operations in gloo's all-gather of ``in_bytes`` per rank over ``n`` ranks
    (gloo/allgather.cc): each rank's part in two chunks, ``2 (n - 1)`` sends to ``rank + 1`` and receives
    from ``rank - 1``, two in flight."""
    if n < 2 or in_bytes <= 0:
        return []
    chunk = (in_bytes // 2, in_bytes - in_bytes // 2)
    send_rank, recv_rank = (rank + 1) % n, (rank - 1) % n
    ops: list[Op] = []
    for i in range(2 * (n - 1)):
        if i >= 2:
            ops += [Op("wait_send"), Op("wait_recv")]
        ops += [Op("send", send_rank, chunk[i & 1]), Op("recv", recv_rank, chunk[i & 1])]
    return ops + [Op("wait_send"), Op("wait_recv")] * 2


def replay(programs: Sequence[Sequence[Op]], entry: Sequence[float], latency: Callable[[int, int], float],
           transfer_s: Callable[[int, int, int], float]) -> list[float]:
    """Each rank's exit time (seconds) from ``programs`` (per ring position) entered at ``entry`` (seconds),
    under the rendezvous rule of the module note; ``latency(a, b)``: the link from position a to b (s), and
    ``transfer_s(a, b, nbytes)``: seconds a message of ``nbytes`` takes on it after its latency.

    Raises:
        RuntimeError: the programs deadlock (a wait whose operation never meets its peer's)."""
    n = len(programs)
    clock = [float(t) for t in entry]
    pc = [0] * n
    posted: dict[tuple[int, int, str], list[tuple[float, int]]] = defaultdict(list)  # (src, dst, side)
    done: dict[tuple[int, int, str, int], float] = {}  # (src, dst, side, k) -> completion time
    outstanding = {(r, side): deque() for r in range(n) for side in ("send", "recv")}

    def match(src: int, dst: int, k: int) -> None:
        sends, recvs = posted[src, dst, "send"], posted[src, dst, "recv"]
        if k < len(sends) and k < len(recvs):
            (t_send, nbytes), (t_recv, _) = sends[k], recvs[k]
            leave = max(t_send, t_recv + latency(dst, src))
            done[src, dst, "send", k] = leave
            done[src, dst, "recv", k] = leave + latency(src, dst) + transfer_s(src, dst, nbytes)

    moved = True
    while moved:
        moved = False
        for r in range(n):
            while pc[r] < len(programs[r]):
                op = programs[r][pc[r]]
                if op.kind in ("send", "recv"):
                    src, dst = (r, op.peer) if op.kind == "send" else (op.peer, r)
                    queue = posted[src, dst, op.kind]
                    queue.append((clock[r], op.nbytes))
                    outstanding[r, op.kind].append((src, dst, len(queue) - 1))
                    match(src, dst, len(queue) - 1)
                else:
                    side = op.kind.removeprefix("wait_")
                    src, dst, k = outstanding[r, side][0]
                    t = done.get((src, dst, side, k))
                    if t is None:
                        break
                    outstanding[r, side].popleft()
                    clock[r] = max(clock[r], t)
                pc[r] += 1
                moved = True
    stuck = [r for r in range(n) if pc[r] < len(programs[r])]
    if stuck:
        raise RuntimeError(f"Gloo programs deadlocked: ring positions {stuck} wait at operations "
                           f"{[pc[r] for r in stuck]}")
    return clock
