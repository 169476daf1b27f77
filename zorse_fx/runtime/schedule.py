"""Pipeline schedules as data: per stage, the ordered list of actions.

``F3`` = forward of micro-batch 3, ``B2`` = backward of micro-batch 2. Every
GPU of a stage's data-parallel group runs the stage's list on its own rows of
each micro-batch.

- GPipe (Huang et al., NeurIPS'19): all forwards, then all backwards; M
  micro-batches' activations in flight.
- 1F1B (PipeDream-Flush, Narayanan et al., SC'21): stage ``s`` of ``S`` runs
  ``min(S - s - 1, M)`` warm-up forwards, then alternates one forward and one
  backward, then drains; at most ``S - s`` micro-batches in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Action", "one_f_one_b", "gpipe", "make_schedule", "validate", "format_grid", "inflight"]


@dataclass(frozen=True, slots=True)
class Action:
    kind: str  # "F" or "B"
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


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


_SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}


def make_schedule(name: str, num_stages: int, num_microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Per stage action lists for schedule ``name`` ("1f1b" or "gpipe")."""
    if name not in _SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(_SCHEDULES)}")
    return tuple(_SCHEDULES[name](s, num_stages, num_microbatches) for s in range(num_stages))


def inflight(schedule: tuple[Action, ...]) -> int:
    """Largest number of micro-batches whose activations a stage holds at once."""
    live = peak = 0
    for a in schedule:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak


def format_grid(schedules, *, mark: tuple[int, int] | None = None) -> str:
    """Stage-by-step grid; ``mark=(stage, step)`` is shown as ``>F3<``."""
    width = max(len(s) for s in schedules)
    lines = ["stage | " + " ".join(f"{i:>5}" for i in range(width))]
    for s, acts in enumerate(schedules):
        cells = []
        for i in range(width):
            text = str(acts[i]) if i < len(acts) else ""
            cells.append(f"{('>' + text + '<') if mark == (s, i) else text:>5}")
        lines.append(f"{s:>5} | " + " ".join(cells))
    return "\n".join(lines)


def validate(schedules) -> None:
    """Check that every micro-batch is run F then B once per stage and that the
    schedules can execute without deadlock under blocking point-to-point
    messages (F s needs F s-1; B s needs B s+1 and F s).

    Raises:
        ValueError: with the grid and the first action that can never run marked.
    """
    num_stages = len(schedules)
    for s, acts in enumerate(schedules):
        fs = [a.microbatch for a in acts if a.kind == "F"]
        bs = [a.microbatch for a in acts if a.kind == "B"]
        if sorted(fs) != sorted(bs) or len(set(fs)) != len(fs):
            raise ValueError(f"stage {s}: each micro-batch needs exactly one F and one B\n{format_grid(schedules)}")
    done: set[tuple[str, int, int]] = set()
    pc = [0] * num_stages
    progress = True
    while progress:
        progress = False
        for s, acts in enumerate(schedules):
            while pc[s] < len(acts):
                a = acts[pc[s]]
                if a.kind == "F":
                    ready = s == 0 or ("F", s - 1, a.microbatch) in done
                else:
                    ready = ("F", s, a.microbatch) in done and (s == num_stages - 1 or ("B", s + 1, a.microbatch) in done)
                if not ready:
                    break
                done.add((a.kind, s, a.microbatch))
                pc[s] += 1
                progress = True
    for s, acts in enumerate(schedules):
        if pc[s] < len(acts):
            raise ValueError(
                f"schedule deadlocks: stage {s} step {pc[s]} ({acts[pc[s]]}) waits forever\n"
                + format_grid(schedules, mark=(s, pc[s]))
            )
