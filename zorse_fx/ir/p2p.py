"""Point-to-point traffic of a pipeline as data: which messages each rank posts,
in which groups, in which order -- derived from the plan or decision alone, so
both peers of every message derive the same order. The runtime executes it
with ``dist.batch_isend_irecv`` (``runtime/p2p.py``); the simulator and the
objective replay it.

[Note: point-to-point program]
NCCL ignores tags: between two ranks it matches the i-th send on a channel
(sender -> receiver) with the i-th receive posted for it, and it runs a rank's
point-to-point groups one after another on one stream, each group blocking
until all of its operations are matched (a large send waits for its receive).
Gloo matches by (peer, tag) and buffers sends, so code that works on Gloo can
hang or exchange the wrong buffers on NCCL. The runtime therefore never relies
on tags (every message is tag 0, see ``TAG``) and issues its traffic as a
*program* that is correct under NCCL's rules:

- A rank runs its GPU group's action list ``A_0 .. A_{n-1}``
  (``schedule.make_schedule``). Before action ``k`` it posts group ``G_k``
  with ``dist.batch_isend_irecv``: the sends produced by ``A_{k-1}`` and the
  receives ``A_k`` needs, fused in one group as ``torch.distributed.pipelining``
  and Megatron-LM fuse a forward's send with the next backward's receive (two
  ranks that each send before they receive deadlock on NCCL). Action ``k``
  waits for the groups holding its receives -- on NCCL the whole group, as
  its coalesced work completes; where the backend returns one work per
  operation (Gloo) only the receives -- then computes. A last group after
  ``A_{n-1}`` holds its sends; every send is waited at the end of the step.
- ``build_programs`` derives every rank's program from the plan and checks
  it before any rank runs it: each channel's sends and receives list the same
  messages in the same order (what tag-free matching needs), and an execution
  under NCCL's rules -- in-order groups per rank; an operation completes only
  when its peer operation is in the peer's current group; a compute starts
  only when the groups holding its receives completed -- runs to the end
  (``simulate_nccl``). Where it would deadlock (interleaved 1F1B: a group's
  chunks exchange in both directions with one peer, so each rank's send
  waits for a receive the other posts one compute later), the receive a
  stuck send waits for is posted earlier, in its receiver's current group,
  before the compute that precedes it: receives are prefetched exactly where
  the schedule needs them, and the check is repeated. A plan that cannot be
  repaired is refused, naming the stuck ranks. Every rank computes the same
  programs from the same plan.
- Where a receiver needs a channel's messages in another order than its
  sender sends them (interleaved 1F1B on 2 groups with an odd micro-batch
  count >= 5: both directions of every cut share one pair of ranks, and the
  3-then-2 rounds make rank 0 send a gradient before the activation rank 1
  needs first), the receiver posts the message that is sent first before
  the one it needs first (``_align_receives``): an earlier receive of data
  already on its way, in the group of the receive it now precedes; the
  deadlock check then runs on the aligned program.
- Receives are not posted earlier than that: on NCCL's in-order stream an
  early receive also holds back the sends queued behind it, and a group that
  mixes one action's receives with the next one's makes the first compute
  wait for the second's data.

Messages between two stages hosted by the same rank (one GPU group, ``P = 1``)
never touch the network: the runtime hands them over in memory
(``runtime.p2p.Mailbox``).

What this costs on NCCL: a compute waits for its whole group, so a stage's
sends are on its critical path, exchanged with its neighbour's opposite
messages, and a send moves only once its receiver has posted the receive.
The simulator replays exactly these programs under these rules
(``simulate(p2p="nccl")``, [Note: point-to-point models] in
``sim/engine.py``) and the planner's objective prices them
(``solve/network_terms.py`` [Note: pipeline period]).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import RuntimeExecutionError
from .schedule import Action

__all__ = ["Route", "routes", "Message", "RankProgram", "ProgramError", "route_messages", "programs_from",
           "simulate_nccl"]


@dataclass(frozen=True, slots=True)
class Route:
    """Rows ``[start, end)`` of a micro-batch going from one GPU to another."""

    src_pos: int  # GPU position in the sending stage
    dst_pos: int  # GPU position in the receiving stage
    start: int
    end: int

    @property
    def rows(self) -> int:
        return self.end - self.start


def routes(src: tuple[tuple[int, int], ...], dst: tuple[tuple[int, int], ...]) -> tuple[Route, ...]:
    """All non-empty overlaps between sender and receiver row ranges, in row order."""
    out = []
    for i, (a, b) in enumerate(src):
        for j, (c, d) in enumerate(dst):
            lo, hi = max(a, c), min(b, d)
            if lo < hi:
                out.append(Route(i, j, lo, hi))
    return tuple(sorted(out, key=lambda r: r.start))


class Message(NamedTuple):
    """One packed message: rows ``[start, end)`` of micro-batch ``microbatch``
    crossing the cut after stage ``boundary``, forward (activations) or
    backward (their gradients), from rank ``src`` to rank ``dst``. A named
    tuple, not a dataclass: the deadlock check hashes and compares messages
    millions of times per plan, which a tuple does in C (``programs_from``
    built the interleave search's programs ~2x faster; issue 32)."""

    boundary: int
    microbatch: int
    backward: bool
    src: int
    dst: int
    start: int
    end: int
    nbytes: int

    def __str__(self) -> str:
        return (f"{'grad' if self.backward else 'act'} cut {self.boundary}->{self.boundary + 1} "
                f"mb {self.microbatch} rows [{self.start},{self.end}) rank {self.src}->{self.dst}")


class _Op(NamedTuple):
    send: bool
    message: Message


@dataclass(frozen=True, slots=True, kw_only=True)
class RankProgram:
    """One rank's point-to-point program for one step (see the note)."""

    rank: int
    #: The rank's actions, in order (its GPU group's schedule).
    actions: tuple[Action, ...]
    #: ``groups[k]`` is posted before action k (k = n: after the last action).
    #: Only network messages (src != dst), sends first, each in program order.
    groups: tuple[tuple[_Op, ...], ...]
    #: ``waits[k]``: indices of the groups action k waits for before it computes.
    waits: tuple[tuple[int, ...], ...]
    #: Per action: the messages it sends / receives, in route order (self messages included).
    sends: tuple[tuple[Message, ...], ...]
    recvs: tuple[tuple[Message, ...], ...]
    #: Receive groups posted before an earlier action than the one that needs
    #: them (prefetched where the schedule allows, see ``build_programs``).
    prefetched: int = 0


def route_messages(action: Action, s: int, pos: int, rank: int, stage_ranks, stage_ranges, row_bytes
                   ) -> tuple[tuple[Message, ...], tuple[Message, ...]]:
    """(sends, receives) of ``action`` of stage ``s`` run by ``rank``, the
    stage's member at position ``pos``, in route (row) order: a forward
    receives its rows' activations from stage s-1 and sends its outputs to
    stage s+1, a backward receives their gradients from s+1 and sends its
    inputs' gradients to s-1 (``routes`` over the stages' row ranges).

    ``stage_ranks[j]``: the ranks of stage j in order; ``stage_ranges[j]``:
    their ``[start, end)`` rows of a micro-batch; ``row_bytes[c]``: bytes of
    one row across the cut after stage c. The plan (``runtime.p2p.action_messages``) and
    the simulator (``sim/engine.py``, from a ``Decision``) both derive the
    point-to-point program from this."""
    n_s = len(stage_ranks)
    sends, recvs = [], []

    def cut(b):
        return routes(stage_ranges[b], stage_ranges[b + 1]), row_bytes[b], stage_ranks[b], stage_ranks[b + 1]

    m = action.microbatch
    if action.kind == "F":
        if s > 0:
            rs, per_row, a, c = cut(s - 1)
            recvs += [Message(s - 1, m, False, a[r.src_pos], rank, r.start, r.end, r.rows * per_row)
                      for r in rs if r.dst_pos == pos]
        if s < n_s - 1:
            rs, per_row, a, c = cut(s)
            sends += [Message(s, m, False, rank, c[r.dst_pos], r.start, r.end, r.rows * per_row)
                      for r in rs if r.src_pos == pos]
    else:
        if s < n_s - 1:
            rs, per_row, a, c = cut(s)
            recvs += [Message(s, m, True, c[r.dst_pos], rank, r.start, r.end, r.rows * per_row)
                      for r in rs if r.src_pos == pos]
        if s > 0:
            rs, per_row, a, c = cut(s - 1)
            sends += [Message(s - 1, m, True, rank, a[r.src_pos], r.start, r.end, r.rows * per_row)
                      for r in rs if r.dst_pos == pos]
    return tuple(sends), tuple(recvs)


def _fused_groups(rank: int, msgs) -> list[list[_Op]]:
    """Group k = the network receives of action k + the network sends of action k-1."""
    groups: list[list[_Op]] = [[] for _ in range(len(msgs) + 1)]
    for k, (sends, recvs) in enumerate(msgs):
        groups[k] += [_Op(False, m) for m in recvs if m.src != rank]
        groups[k + 1] += [_Op(True, m) for m in sends if m.dst != rank]
    return groups


class ProgramError(RuntimeExecutionError):
    """The plan's point-to-point program would deadlock or mismatch under NCCL."""


def _check_channels(groups: dict[int, list[list[_Op]]]) -> None:
    """Every channel lists the same messages in the same order on both ends."""
    sent: dict[tuple[int, int], list[Message]] = defaultdict(list)
    got: dict[tuple[int, int], list[Message]] = defaultdict(list)
    for r, gs in groups.items():
        for g in gs:
            for op in g:
                (sent if op.send else got)[op.message.src, op.message.dst].append(op.message)
    for ch in sorted(set(sent) | set(got)):
        a, b = sent.get(ch, []), got.get(ch, [])
        if a != b:
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            raise ProgramError(
                f"point-to-point order mismatch on channel rank {ch[0]} -> rank {ch[1]}: message {i} is "
                f"{a[i] if i < len(a) else 'nothing'} on the sender but {b[i] if i < len(b) else 'nothing'} on the "
                f"receiver; with tag-free (NCCL) matching the receiver would get the wrong buffer")


@dataclass(frozen=True, slots=True)
class _Stuck:
    """A rank that cannot finish: its head group and that group's unmatched
    operations, each with where its peer operation sits (rank, group)."""

    rank: int
    action: int
    group: int | None
    unmatched: tuple[tuple[_Op, int, int], ...]


def _waits(rank: int, msgs, groups: list[list[_Op]]) -> list[tuple[int, ...]]:
    at = {op.message: gi for gi, g in enumerate(groups) for op in g if not op.send}
    return [tuple(sorted({at[m] for m in recvs if m.src != rank})) for _, recvs in msgs]


def simulate_nccl(groups: dict[int, list[list[_Op]]], waits: dict[int, list[tuple[int, ...]]]) -> list[_Stuck]:
    """Run every rank's groups under NCCL's rules (see the note); returns the
    ranks that cannot finish (empty: no deadlock).

    An operation completes when the group holding it and the group holding
    its peer operation are both at the head of their ranks' streams; a group
    leaves the stream when all its operations completed; action ``k``
    computes when every group in ``waits[k]`` left the stream; group ``k + 1``
    is posted after action ``k``. Messages are matched per channel in order
    (``_check_channels`` made both ends agree)."""
    # An operation and its peer complete together, so "done" is kept per message; a
    # group leaves its stream only from the head, so a rank's finished groups are a
    # prefix (``nfin[r]`` of them).
    where: dict[tuple[bool, Message], tuple[int, int]] = {}
    for r, gs in groups.items():
        for gi, g in enumerate(gs):
            for op in g:
                where[op] = (r, gi)  # (an _Op is the tuple (send, message))
    remaining = {r: [len(g) for g in gs] for r, gs in groups.items()}
    done: set[Message] = set()
    stream: dict[int, deque] = {r: deque() for r in groups}
    posted = dict.fromkeys(groups, 0)
    computed = dict.fromkeys(groups, 0)
    nfin = dict.fromkeys(groups, 0)
    pending = deque(groups)

    def head(r):
        return stream[r][0] if stream[r] else None

    def post(r):
        stream[r].append(posted[r])
        posted[r] += 1

    for r in groups:
        post(r)  # G_0
    while pending:
        r = pending.popleft()
        progress = True
        while progress:
            progress = False
            h = head(r)
            if h is not None:
                for op in groups[r][h]:
                    msg = op.message
                    if msg in done:
                        continue
                    pr, pg = where[(not op.send, msg)]
                    if head(pr) == pg:
                        done.add(msg)
                        remaining[r][h] -= 1
                        remaining[pr][pg] -= 1
                        if remaining[pr][pg] == 0:
                            stream[pr].popleft()
                            nfin[pr] += 1
                            pending.append(pr)
                if remaining[r][h] == 0 and head(r) == h:
                    stream[r].popleft()
                    nfin[r] += 1
                    progress = True
            k = computed[r]
            if k < len(waits[r]) and all(g < nfin[r] for g in waits[r][k]):
                computed[r] += 1
                post(r)  # G_{k+1}
                progress = True
    stuck = []
    for r in groups:
        if computed[r] < len(waits[r]) or stream[r]:
            h = head(r)
            unmatched = tuple((op, *where[(not op.send, op.message)]) for op in (groups[r][h] if h is not None else ())
                              if op.message not in done)
            stuck.append(_Stuck(r, computed[r], h, unmatched))
    return stuck


def _pull_forward(groups: dict[int, list[list[_Op]]], heads: dict[int, int | None], stuck: list[_Stuck]) -> set[int]:
    """Repair one deadlock: where a stuck rank's send waits for a receive its
    peer posts only in a later group, post that receive (and the receives of
    the same channel before it) in the peer's current group instead -- an
    earlier receive is always allowed. Each channel keeps its order. Returns
    the ranks whose groups changed (empty if nothing can move)."""
    moved: set[int] = set()
    for st in stuck:
        for op, pr, pg in st.unmatched:
            if not op.send or heads[pr] is None or pg <= heads[pr]:
                continue
            h = heads[pr]
            ch = (op.message.src, op.message.dst)
            take = [(gi, o) for gi in range(h + 1, pg + 1) for o in groups[pr][gi]
                    if not o.send and (o.message.src, o.message.dst) == ch]
            take = take[: next(i for i, (_, o) in enumerate(take) if o.message == op.message) + 1]
            for gi, o in take:
                groups[pr][gi].remove(o)
                groups[pr][h].append(o)
            moved.add(pr)
    return moved


def _heads(stuck: list[_Stuck], ranks) -> dict[int, int | None]:
    h = dict.fromkeys(ranks)
    for st in stuck:
        h[st.rank] = st.group
    return h


def _align_receives(groups: dict[int, list[list[_Op]]]) -> int:
    """Reorder receives so each channel receives in its sender's order (see
    the note): walking a receiver's groups in order, where the next receive
    on a channel is not the message the sender sends next, the receive of
    that message moves (from a later group, or later in the same group) to
    just before it. Returns the number of receives moved. A channel whose
    two ends list different messages is left for ``_check_channels`` to name."""
    order: dict[tuple[int, int], list[Message]] = defaultdict(list)
    for gs in groups.values():
        for g in gs:
            for op in g:
                if op.send:
                    order[op.message.src, op.message.dst].append(op.message)
    moved = 0
    for gs in groups.values():
        at = {op.message: gi for gi, g in enumerate(gs) for op in g if not op.send}
        nxt: dict[tuple[int, int], int] = defaultdict(int)
        for gi, g in enumerate(gs):
            i = 0
            while i < len(g):
                op = g[i]
                ch = (op.message.src, op.message.dst)
                if not op.send and nxt[ch] < len(order[ch]) and order[ch][nxt[ch]] != op.message:
                    want = order[ch][nxt[ch]]
                    gj = at.get(want)
                    if gj is not None and gj >= gi:
                        w = next(o for o in gs[gj] if not o.send and o.message == want)
                        gs[gj].remove(w)
                        g.insert(i, w)
                        at[want] = gi
                        moved += 1
                        continue  # position i now holds ``want``
                if not op.send:
                    nxt[ch] += 1
                i += 1
    return moved


def programs_from(built: dict[int, tuple[tuple[Action, ...], list]]) -> dict[int, RankProgram]:
    """``build_programs``' fused program, checked and repaired, from each
    rank's (actions, per action its (sends, receives)) -- from a plan
    (``action_messages``) or a planner's decision (the simulator's NCCL
    point-to-point model, ``sim/engine.py``).

    Raises:
        ProgramError: as ``build_programs``."""
    ranks = sorted(built)
    groups = {r: _fused_groups(r, built[r][1]) for r in ranks}
    _align_receives(groups)
    _check_channels(groups)
    repairs = 0
    waits = {r: _waits(r, built[r][1], groups[r]) for r in ranks}
    while True:
        stuck = simulate_nccl(groups, waits)
        if not stuck:
            break
        changed = set() if repairs > 4 * sum(len(built[r][0]) for r in ranks) else \
            _pull_forward(groups, _heads(stuck, ranks), stuck)
        if not changed:
            lines = [f"rank {st.rank} before action {st.action}: group {st.group} waits for "
                     + "; ".join(str(op.message) for op, *_ in st.unmatched) for st in stuck]
            raise ProgramError("the plan's point-to-point program deadlocks under NCCL's rules (in-order "
                               "groups, no tags):\n  " + "\n  ".join(lines[:8]))
        repairs += 1
        for r in changed:  # (the other ranks' groups, and so their waits, are as they were)
            waits[r] = _waits(r, built[r][1], groups[r])
    _check_channels(groups)  # (a repair keeps each channel's order; checked again on the result)
    out = {}
    for r in ranks:
        (actions, msgs), gs = built[r], groups[r]
        ordered = tuple(tuple([o for o in g if o.send] + [o for o in g if not o.send]) for g in gs)
        out[r] = RankProgram(rank=r, actions=actions, groups=ordered, waits=tuple(waits[r]),
                             sends=tuple(s for s, _ in msgs), recvs=tuple(rc for _, rc in msgs),
                             prefetched=sum(1 for k, w in enumerate(waits[r]) for g in w if g < k))
    return out
