"""The point-to-point program of a plan ([Note: point-to-point program] in
``zorse_fx/ir/p2p.py``: which messages each rank posts, in which groups, in
which order, checked deadlock-free under NCCL's rules) built from the plan,
and its execution with ``dist.batch_isend_irecv`` (``P2PExecutor``).

Messages between two stages hosted by the same rank (one GPU group, ``P = 1``)
never touch the network: they are handed over in memory (``Mailbox``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..ir.p2p import Message, RankProgram, _fused_groups, _Op, programs_from, route_messages
from ..ir.schedule import Action, make_schedule
from ..ir.tensor import as_run, on_wire
from ..plan import Plan
from ..precision import PrecisionPolicy

__all__ = ["TAG", "build_programs", "build_program", "P2PExecutor", "Mailbox", "action_messages"]

#: Every point-to-point message is tag 0: NCCL ignores tags, so the runtime
#: must be correct without them, and Gloo then matches in posting order as
#: NCCL does (see [Note: point-to-point program] in ``ir/p2p.py``).
TAG = 0


def _stage_bytes(specs, planned: str, precision: PrecisionPolicy | None) -> int:
    """Bytes per sample of a boundary a plan priced under precision ``planned``
    recorded as ``specs``, as sent under ``precision`` (``on_wire`` of ``as_run``;
    None: as recorded)."""
    return sum(s.bytes_per_sample for s in (on_wire(as_run(specs, planned, precision), precision)
                                            if precision else specs))


def action_messages(plan: Plan, rank: int, action: Action, precision: PrecisionPolicy | None = None
                    ) -> tuple[tuple[Message, ...], tuple[Message, ...]]:
    """(sends, receives) of ``action`` on ``rank``, in route (row) order;
    message sizes as sent under ``precision`` (the policy the ranks train with)."""
    P = plan.num_groups
    s = plan.role(rank).stage + action.chunk * P
    return route_messages(action, s, plan.stages[s].ranks.index(rank), rank,
                          tuple(tuple(g.rank for g in st.gpus) for st in plan.stages),
                          tuple(st.sample_ranges() for st in plan.stages),
                          tuple(_stage_bytes(st.send, plan.precision, precision) for st in plan.stages[:-1]))


def _initial_groups(plan: Plan, rank: int, forward_only: bool = False, precision: PrecisionPolicy | None = None
                    ) -> tuple[tuple[Action, ...], list, list[list[_Op]]]:
    """The fused program: group k = the sends of action k-1 + the receives of action k.
    ``forward_only``: the schedule's forward actions alone, in its order (evaluation)."""
    actions = make_schedule(plan.schedule, plan.num_stages, plan.num_microbatches,
                            plan.interleave)[plan.role(rank).stage]
    if forward_only:
        actions = tuple(a for a in actions if a.kind == "F")
    msgs = [action_messages(plan, rank, a, precision) for a in actions]
    return tuple(actions), msgs, _fused_groups(rank, msgs)


def build_programs(plan: Plan, *, forward_only: bool = False, precision: PrecisionPolicy | None = None
                   ) -> dict[int, RankProgram]:
    """Every rank's point-to-point program ([Note: point-to-point program] in ``ir/p2p.py``).
    ``forward_only``: the program of an evaluation step (the schedule's
    forwards alone, no backward), checked the same way. ``precision``: the
    policy the ranks train with, which sets the bytes of each boundary
    message ([Note: 16-bit boundary tensors] in ``zorse_fx/precision.py``;
    None: the stage's own dtypes).

    Starts from the fused program (each compute's sends and the next
    compute's receives in one group) and, while ``simulate_nccl`` finds a
    deadlock, posts the receive a stuck send waits for in its receiver's
    current group (``_pull_forward``): the receives are prefetched exactly
    where the schedule needs it. Deterministic in the plan, so every rank
    derives the same programs.

    Raises:
        ProgramError: the channels disagree, or the program still deadlocks
            (the message names the stuck ranks and what they wait for).
    """
    built = {r: _initial_groups(plan, r, forward_only, precision) for r in range(plan.world_size)}
    return programs_from({r: (b[0], b[1]) for r, b in built.items()})


def build_program(plan: Plan, rank: int, *, forward_only: bool = False, precision: PrecisionPolicy | None = None
                  ) -> RankProgram:
    """This rank's program (``build_programs(plan, forward_only=..., precision=...)[rank]``)."""
    return build_programs(plan, forward_only=forward_only, precision=precision)[rank]


class Mailbox:
    """Messages between two stages of one rank, handed over in memory."""

    def __init__(self) -> None:
        self._box: dict[Message, torch.Tensor] = {}

    def put(self, m: Message, buf: torch.Tensor) -> None:
        assert m not in self._box, f"{m} delivered twice"
        self._box[m] = buf

    def take(self, m: Message) -> torch.Tensor:
        return self._box.pop(m)

    def check_empty(self) -> None:
        assert not self._box, f"messages to self never received: {sorted(map(str, self._box))}"


class P2PExecutor:
    """Runs one rank's ``RankProgram`` for one step: ``post(k, outgoing)``
    before action k (k = n after the last), ``received(k)`` before computing
    action k, ``finish()`` at the end of the step."""

    def __init__(self, program: RankProgram, device: torch.device):
        self.program = program
        self.device = device
        self.mailbox = Mailbox()
        self._works: dict[int, list] = {}
        self._inbox: dict[Message, torch.Tensor] = {}
        self._keep: list[torch.Tensor] = []  # send buffers, alive until the step's end
        self._sends: list = []  # send works waited at the step's end (per-operation works)

    def post(self, k: int, sent: list[torch.Tensor]) -> None:
        """Post group k; ``sent`` are the buffers of action k-1's sends, aligned
        with ``program.sends[k - 1]`` (empty for k = 0)."""
        outgoing = dict(zip(self.program.sends[k - 1], sent, strict=True)) if k else {}
        ops, is_recv = [], []
        for op in self.program.groups[k]:
            m = op.message
            if op.send:
                buf = outgoing[m]
                assert buf.numel() == m.nbytes and buf.device == self.device, f"{m}: bad send buffer"
                self._keep.append(buf)
                ops.append(dist.P2POp(dist.isend, buf, m.dst, tag=TAG))
            else:
                buf = torch.empty(m.nbytes, dtype=torch.uint8, device=self.device)
                self._inbox[m] = buf
                ops.append(dist.P2POp(dist.irecv, buf, m.src, tag=TAG))
            is_recv.append(not op.send)
        for m, buf in outgoing.items():
            if m.dst == m.src:
                self.mailbox.put(m, buf)
        works = dist.batch_isend_irecv(ops) if ops else []
        if len(works) == len(ops):
            # One work per operation (Gloo): a compute waits for its receives only, the
            # sends are waited at the end of the step. NCCL returns one work for the
            # coalesced group, which completes as a whole.
            self._works[k] = [w for w, r in zip(works, is_recv) if r]
            self._sends += [w for w, r in zip(works, is_recv) if not r]
        else:
            self._works[k] = works

    def _wait(self, g: int) -> None:
        for w in self._works.pop(g, ()):
            w.wait()

    def received(self, k: int) -> list[torch.Tensor]:
        """The buffers action k receives, aligned with ``program.recvs[k]``
        (waits for the groups holding them)."""
        for g in self.program.waits[k]:
            self._wait(g)
        out = []
        for m in self.program.recvs[k]:
            buf = self.mailbox.take(m) if m.src == m.dst else self._inbox.pop(m)
            assert buf.numel() == m.nbytes, f"{m}: got {buf.numel()} bytes, expected {m.nbytes}"
            out.append(buf)
        return out

    def finish(self) -> None:
        """Wait for every group still in flight (the sends); the step is over."""
        for g in sorted(self._works):
            self._wait(g)
        for w in self._sends:
            w.wait()
        self._sends.clear()
        self._keep.clear()
        assert not self._inbox, f"posted receives never consumed: {sorted(map(str, self._inbox))}"
        self.mailbox.check_empty()
