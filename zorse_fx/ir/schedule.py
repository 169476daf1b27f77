"""Pipeline schedules as data: per GPU group, the ordered list of actions.

``F3`` = forward of micro-batch 3, ``B2`` = backward of micro-batch 2; with
interleaving, ``F3.1`` = forward of micro-batch 3 through the group's model
chunk 1. Every GPU of a group's data-parallel group runs the group's list on
its own rows of each micro-batch.

A plan has ``S = P * v`` stages on ``P`` GPU groups, ``v`` = the interleave
degree (``Plan.interleave``): stage ``s`` runs on group ``s % P`` as its
chunk ``s // P`` (Megatron-LM's round-robin "virtual stages"). With ``v = 1``
group ``p`` is stage ``p`` and every action is chunk 0.

- GPipe (Huang et al., NeurIPS'19): all forwards, then all backwards; M
  micro-batches' activations in flight.
- 1F1B (PipeDream-Flush, Narayanan et al., SC'21): stage ``s`` of ``S`` runs
  ``min(S - s - 1, M)`` warm-up forwards, then alternates one forward and one
  backward, then drains; at most ``S - s`` micro-batches in flight.
- Interleaved 1F1B (Narayanan et al., SC'21, section 2.2.2; the order of
  Megatron-LM's ``forward_backward_pipelining_with_interleaving``), for any
  micro-batch count M >= 1: the group's ``M * v`` (micro-batch, chunk)
  forwards run in rounds -- chunk 0 of the round's micro-batches, chunk 1 of
  the same, ..., then the next round -- and the backwards in the same order
  with the chunks reversed. The rounds (``interleave_rounds``): ``max(1, M //
  P)`` of them, sizes as equal as possible (the larger first), so each holds
  at least P micro-batches when M >= P -- P each when P divides M, as in
  Megatron-LM; one round of all M when M < P. (torch's
  ``ScheduleInterleaved1F1B`` also cuts M into ``M // P`` rounds but needs
  them equal; Megatron-LM runs a short last round, which deadlocks for some
  (P, v, M), e.g. P = 4, v = 3, M = 5.) Group ``p`` runs
  ``2 (P - p - 1) + (v - 1) R`` warm-up forwards, R = the first round's
  size (all ``M v`` when ``M <= P``), then one forward / one backward, then
  drains. The bubble shrinks from ``(P - 1)`` stage times to about
  ``(P - 1) / v`` of them, at ``v`` times more boundary messages.
  ``validate`` proves each schedule deadlock-free under blocking messages,
  and ``tests/test_plan.py`` checks every (P, v, M) with P <= 8, v <= 5,
  M <= 5 P + 2; the runtime's NCCL program check runs on every plan.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["Action", "one_f_one_b", "gpipe", "interleaved_1f1b", "interleave_rounds", "make_schedule", "validate", "format_grid",
           "inflight", "live_profile", "SCHEDULES"]

#: Schedule names a plan may carry.
SCHEDULES = ("1f1b", "gpipe")

_ACTION_RE = re.compile(r"(?P<kind>[FB])(?P<mb>\d+)(?:\.(?P<chunk>\d+))?")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of a GPU group's schedule: the forward (``"F"``) or backward
    (``"B"``) of micro-batch ``microbatch`` through the group's model chunk
    ``chunk``. Prints as ``F3`` / ``B2.1`` and parses back (``Action.parse``),
    like ``torch.distributed.pipelining``'s ``_Action``."""

    kind: str  # "F" or "B"
    microbatch: int
    #: Model chunk of the group (interleaving): the action runs stage ``group + chunk * P``.
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")

    @classmethod
    def parse(cls, text: str) -> "Action":
        """The action ``str(action)`` printed: ``"F3"``, ``"B2.1"`` (chunk 1).

        Raises:
            ValueError: ``text`` is not ``F`` or ``B``, a micro-batch >= 0 and
                optionally ``.chunk`` with chunk >= 1.
        """
        m = _ACTION_RE.fullmatch(text.strip()) if isinstance(text, str) else None
        if m is None:
            raise ValueError(f"action {text!r}: expected F or B, a micro-batch number and optionally .chunk "
                             f"(e.g. 'F3', 'B2.1')")
        chunk = int(m["chunk"]) if m["chunk"] is not None else 0
        if m["chunk"] is not None and chunk < 1:
            raise ValueError(f"action {text!r}: chunk 0 is written without a suffix ('{m['kind']}{m['mb']}')")
        return cls(m["kind"], int(m["mb"]), chunk)


def one_f_one_b(stage: int, num_stages: int, num_microbatches: int) -> tuple[Action, ...]:
    warmup = min(num_stages - stage - 1, num_microbatches)
    acts = [Action("F", m) for m in range(warmup)]
    f, b = warmup, 0
    while f < num_microbatches:
        acts += [Action("F", f), Action("B", b)]
        f, b = f + 1, b + 1
    acts += [Action("B", m) for m in range(b, num_microbatches)]
    return tuple(acts)


def gpipe(stage: int, num_stages: int, num_microbatches: int) -> tuple[Action, ...]:
    return tuple(Action("F", m) for m in range(num_microbatches)) + tuple(
        Action("B", m) for m in range(num_microbatches)
    )


def interleave_rounds(num_groups: int, num_microbatches: int) -> tuple[int, ...]:
    """Sizes of the micro-batch rounds of interleaved 1F1B (see the module
    docstring): ``max(1, M // P)`` rounds as equal as possible, the larger
    first; each >= P when M >= P. E.g. P = 4: M = 8 -> (4, 4); M = 10 -> (5, 5);
    M = 11 -> (6, 5); M = 3 -> (3,).

    Raises:
        ValueError: ``num_groups`` or ``num_microbatches`` < 1.
    """
    p, m = num_groups, num_microbatches
    if p < 1 or m < 1:
        raise ValueError(f"interleaved 1F1B needs >= 1 GPU group and >= 1 micro-batch, got {p} and {m}")
    q = max(1, m // p)
    return tuple(m // q + (1 if i < m % q else 0) for i in range(q))


def interleaved_1f1b(group: int, num_groups: int, num_chunks: int, num_microbatches: int) -> tuple[Action, ...]:
    """Group ``group``'s interleaved 1F1B actions, for any micro-batch count
    (see the module docstring).

    Raises:
        ValueError: ``num_groups`` or ``num_microbatches`` < 1.
    """
    p, v, m = num_groups, num_chunks, num_microbatches
    sizes = interleave_rounds(p, m)
    fwd: list[tuple[int, int]] = []
    bwd: list[tuple[int, int]] = []
    start = 0
    for size in sizes:
        mbs = range(start, start + size)
        fwd += [(mb, c) for c in range(v) for mb in mbs]
        bwd += [(mb, c) for c in reversed(range(v)) for mb in mbs]
        start += size
    total = m * v
    warmup = total if m <= p else min(2 * (p - group - 1) + (v - 1) * sizes[0], total)
    acts = [Action("F", *fwd[k]) for k in range(warmup)]
    for k in range(total - warmup):
        acts += [Action("F", *fwd[k + warmup]), Action("B", *bwd[k])]
    acts += [Action("B", *bwd[k]) for k in range(total - warmup, total)]
    return tuple(acts)


def make_schedule(name: str, num_stages: int, num_microbatches: int, interleave: int = 1
                  ) -> tuple[tuple[Action, ...], ...]:
    """Per GPU group action lists for schedule ``name`` ("1f1b" or "gpipe").

    ``interleave`` = v model chunks per group: ``num_stages / v`` groups, each
    running interleaved 1F1B (only with "1f1b"). With v = 1 there is one
    group per stage.

    Raises:
        ValueError: unknown schedule, ``num_stages`` not a multiple of v,
            interleaving with "gpipe", or M < 1 when interleaving.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    if interleave < 1 or num_stages % interleave:
        raise ValueError(f"interleave={interleave} must be >= 1 and divide the stage count {num_stages}")
    if interleave == 1:
        fn = one_f_one_b if name == "1f1b" else gpipe
        return tuple(fn(s, num_stages, num_microbatches) for s in range(num_stages))
    if name != "1f1b":
        raise ValueError(f"interleave={interleave} needs schedule '1f1b' (interleaved 1F1B); got {name!r}")
    groups = num_stages // interleave
    return tuple(interleaved_1f1b(p, groups, interleave, num_microbatches) for p in range(groups))


def inflight(schedule: tuple[Action, ...]) -> int:
    """Largest number of (micro-batch, chunk) activations a group holds at once."""
    live = peak = 0
    for a in schedule:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak


@lru_cache(maxsize=4096)
def live_profile(name: str, num_stages: int, num_microbatches: int, interleave: int, group: int
                 ) -> tuple[tuple[tuple[int, ...], int], ...]:
    """The distinct moments at which group ``group`` may reach its memory peak.

    Returns ``(live, chunk)`` pairs: ``live[c]`` = micro-batches whose chunk-c
    forward has ended and whose backward has not, either right after a
    forward (``chunk = -1``) or as the backward of ``chunk`` starts (when a
    recomputing stage re-materialises that chunk's activations). Any peak of
    ``sum_c live[c] * held_c (+ rerun_chunk)`` is at one of these moments, so
    the objective and the simulator take the same maximum over them."""
    sched = make_schedule(name, num_stages, num_microbatches, interleave)[group]
    live = [0] * interleave
    seen: dict[tuple[tuple[int, ...], int], None] = {}
    for a in sched:
        if a.kind == "F":
            live[a.chunk] += 1
            seen[tuple(live), -1] = None
        else:
            seen[tuple(live), a.chunk] = None
            live[a.chunk] -= 1
    return tuple(seen)


def format_grid(schedules, *, mark: tuple[int, int] | None = None) -> str:
    """Group-by-step grid (one row per stage when not interleaved); ``mark=(row, step)`` is shown as ``>F3<``."""
    width = max(len(s) for s in schedules)
    cell = max([5] + [len(str(a)) + 2 for s in schedules for a in s])
    lines = ["stage | " + " ".join(f"{i:>{cell}}" for i in range(width))]
    for s, acts in enumerate(schedules):
        cells = []
        for i in range(width):
            text = str(acts[i]) if i < len(acts) else ""
            cells.append(f"{('>' + text + '<') if mark == (s, i) else text:>{cell}}")
        lines.append(f"{s:>5} | " + " ".join(cells))
    return "\n".join(lines)


def validate(schedules, interleave: int = 1) -> None:
    """Check that every micro-batch is run F then B once per stage and that the
    schedules can execute without deadlock under blocking point-to-point
    messages (F s needs F s-1; B s needs B s+1 and F s). ``schedules`` has
    one list per GPU group; action ``a`` of group ``p`` runs stage
    ``p + a.chunk * P``.

    Raises:
        ValueError: with the grid and the first action that can never run marked.
    """
    groups = len(schedules)
    num_stages = groups * interleave
    for p, acts in enumerate(schedules):
        for c in range(interleave):
            fs = [a.microbatch for a in acts if a.kind == "F" and a.chunk == c]
            bs = [a.microbatch for a in acts if a.kind == "B" and a.chunk == c]
            if sorted(fs) != sorted(bs) or len(set(fs)) != len(fs) or (c and sorted(fs) != sorted(
                    a.microbatch for a in acts if a.kind == "F" and a.chunk == 0)):
                raise ValueError(f"stage {p + c * groups}: each micro-batch needs exactly one F and one B\n"
                                 f"{format_grid(schedules)}")
        if any(not 0 <= a.chunk < interleave for a in acts):
            raise ValueError(f"group {p}: chunks must be in 0..{interleave - 1}\n{format_grid(schedules)}")
    done: set[tuple[str, int, int]] = set()
    pc = [0] * groups
    progress = True
    while progress:
        progress = False
        for p, acts in enumerate(schedules):
            while pc[p] < len(acts):
                a = acts[pc[p]]
                s = p + a.chunk * groups
                if a.kind == "F":
                    ready = s == 0 or ("F", s - 1, a.microbatch) in done
                else:
                    ready = ("F", s, a.microbatch) in done and (s == num_stages - 1 or ("B", s + 1, a.microbatch) in done)
                if not ready:
                    break
                done.add((a.kind, s, a.microbatch))
                pc[p] += 1
                progress = True
    for p, acts in enumerate(schedules):
        if pc[p] < len(acts):
            what = "stage" if interleave == 1 else "group"
            raise ValueError(
                f"schedule deadlocks: {what} {p} step {pc[p]} ({acts[pc[p]]}) waits forever\n"
                + format_grid(schedules, mark=(p, pc[p]))
            )
