"""Per-step timings of every rank, per stage and micro-batch: ``<out>/timings.jsonl``.

[Note: step timings]
Every rank times the phases of every training step (``StepTimer``, read by
``StageWorker.train_step``), and rank 0 writes one JSON line per step to
``<out>/timings.jsonl`` (format ``zorse_fx.timings``, version 1; checked line
by line by ``read_timings``). Per rank, in seconds:

==================  =============================================================
``count_s``         a token-mean plan's last stage counting its loss tokens
                    (one all-reduce over the stage's GPUs); 0 elsewhere
``actions[k]``      action k of the rank's schedule (``F``/``B``, stage,
                    micro-batch): ``post_s`` posting its point-to-point group
                    (the previous action's sends and this one's receives),
                    ``wait_s`` waiting for the receives it needs,
                    ``compute_s`` its forward or backward (a recomputing
                    stage's backward includes the re-run forward)
``finish_s``        the last sends posted and waited for (the pipeline's end)
``allreduce_s``     the gradient reductions still in flight after the pipeline
``unscale_s``       fp16-mixed: unscaling and agreeing on inf/NaN (world)
``grad_norm_s``     the global gradient norm (one world all-reduce of a scalar)
``adamw_s``         clipping and AdamW on the rank's stages
``allgather_s``     ZeRO-1 all-gathers after the step
==================  =============================================================

Their sum is the rank's part of the step (``StageWorker.train_step``), from
``start_unix_s`` (the rank's wall clock); the line's ``step_time_s`` is rank
0's whole step, through the step's all-gather of these numbers
(``zorse_fx/train.py``), so rank 0's start plus ``step_time_s``, less the
latest rank's end (its start plus its sum), is what the loop costs after the
step (the all-gather, the loss): on one host exactly, across hosts to their
clocks' offset.

How a phase is timed: on a CUDA device by CUDA events recorded on the
rank's current stream at each boundary (``torch.cuda.Event``, read after the
step's last synchronisation): a phase is the device time between its two
events, so ``wait_s`` is how long the stream stalled on the receives (NCCL's
``work.wait()`` makes the stream wait, not the host) and ``post_s`` is about
0 (NCCL runs the sends on its own stream). On a CPU by ``time.perf_counter``
at each boundary: there every operation the host runs is the work itself
(Gloo's ``wait()`` blocks the host). The cost: one ``perf_counter`` call or
one event record per boundary (3 per action, 8 more per step) and the
numbers' share of the step's one all-gather; measured in bench/README.md
("timings overhead").
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import torch
from msgspec import Meta

from ..errors import TimingsFileError
from ..file_schema import FileFormat, json_too_deep
from ..ir.schedule import make_schedule

__all__ = ["TIMINGS", "PHASES", "StepTimer", "TimingsLine", "RankTimings", "ActionTiming", "TimingsFileError",
           "num_marks", "timings_line", "read_timings", "slowest_rank", "phase_table"]

#: The timings file under ``<out>``.
TIMINGS = "timings.jsonl"
FORMAT, VERSION = "zorse_fx.timings", 1

#: The phases after the schedule's actions, in step order ([Note: step timings]).
PHASES = ("finish_s", "allreduce_s", "unscale_s", "grad_norm_s", "adamw_s", "allgather_s")

Seconds = Annotated[float, Meta(ge=0.0, description="seconds")]
Index = Annotated[int, Meta(ge=0)]


class ActionTiming(msgspec.Struct, forbid_unknown_fields=True):
    kind: Annotated[Literal["F", "B"], Meta(description="forward or backward")]
    stage: Index
    microbatch: Index
    post_s: Seconds
    wait_s: Seconds
    compute_s: Seconds


class RankTimings(msgspec.Struct, forbid_unknown_fields=True):
    rank: Index
    gpu: Annotated[int, Meta(ge=0, description="the GPU's index in the cluster file")]
    node: str
    gpu_type: str
    stages: list[Index]
    start_unix_s: Annotated[float, Meta(ge=0.0, description="the step's start on the rank's wall clock "
                                                            "(time.time(), seconds since 1970)")]
    count_s: Seconds
    actions: list[ActionTiming]
    finish_s: Seconds
    allreduce_s: Seconds
    unscale_s: Seconds
    grad_norm_s: Seconds
    adamw_s: Seconds
    allgather_s: Seconds

    @property
    def total_s(self) -> float:
        """The rank's part of the step: every phase summed."""
        return (self.count_s + sum(a.post_s + a.wait_s + a.compute_s for a in self.actions)
                + sum(getattr(self, p) for p in PHASES))

    def compute_s(self, kind: str | None = None) -> float:
        """The rank's forward and backward compute (``kind`` "F" or "B": one of them)."""
        return sum(a.compute_s for a in self.actions if kind is None or a.kind == kind)


class TimingsLine(msgspec.Struct, forbid_unknown_fields=True):
    format: Literal["zorse_fx.timings"]
    version: Literal[1]
    step: Annotated[int, Meta(ge=1)]
    run_id: str
    plan_hash: str
    clock: Annotated[Literal["perf_counter", "cuda_events"], Meta(
        description="how the phases were timed: host wall time, or CUDA events on the rank's stream")]
    step_time_s: Annotated[float, Meta(ge=0.0, description="rank 0's whole step, seconds")]
    ranks: list[RankTimings]


TIMINGS_FILE = FileFormat(name=FORMAT, what="timings", doc=TimingsLine, versions=(VERSION,),
                          remake="train again to record them (`zorse train` writes <out>/timings.jsonl)",
                          error=TimingsFileError)


def num_marks(plan) -> int:
    """Boundaries a rank of ``plan`` marks per step: the start, after the token
    count, 3 per action (its group posted, its receives waited for, its
    compute done) and one after each of ``PHASES``. Every rank runs 2 M v
    actions (M micro-batches, v model chunks), so every rank marks the same
    number."""
    return 2 + 3 * 2 * plan.num_microbatches * plan.interleave + len(PHASES)


class StepTimer:
    """The boundaries of one rank's step ([Note: step timings]): ``start()``,
    then ``mark()`` at each boundary, ``durations()`` after the step's last
    device synchronisation: the seconds between consecutive marks.

    Args:
        device: the rank's device: CUDA events on a CUDA device, ``time.perf_counter`` elsewhere.
        marks: boundaries per step, the start included (``num_marks``).
        enabled: False: every call is a no-op and ``durations()`` is all 0.
    """

    def __init__(self, device: torch.device, marks: int, *, enabled: bool = True):
        self.enabled, self.marks = enabled, marks
        self.cuda = device.type == "cuda" and enabled
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(marks)] if self.cuda else []
        self._times = [0.0] * marks
        self._i = 0

    @property
    def clock(self) -> str:
        return "cuda_events" if self.cuda else "perf_counter"

    def start(self) -> None:
        self._i = 0
        self.mark()

    def mark(self) -> None:
        if not self.enabled:
            return
        if self.cuda:
            self._events[self._i].record()
        else:
            self._times[self._i] = time.perf_counter()
        self._i += 1

    def durations(self) -> list[float]:
        """``marks - 1`` seconds, each >= 0.

        Raises:
            AssertionError: the step marked another number of boundaries than ``marks``."""
        if not self.enabled:
            return [0.0] * (self.marks - 1)
        assert self._i == self.marks, f"a step marked {self._i} boundaries, expected {self.marks}"
        if self.cuda:
            spans = [a.elapsed_time(b) * 1e-3 for a, b in zip(self._events, self._events[1:])]
        else:
            spans = [b - a for a, b in zip(self._times, self._times[1:])]
        return [round(max(0.0, x), 7) for x in spans]  # 0.1 us: below either clock's resolution


@functools.lru_cache(maxsize=8)
def _schedules(name: str, num_stages: int, num_microbatches: int, interleave: int):
    """``make_schedule``'s answer, kept: rank 0 writes a line every step."""
    return make_schedule(name, num_stages, num_microbatches, interleave)


def timings_line(plan, step: int, *, run_id: str, plan_hash: str, clock: str, step_time_s: float,
                 durations: list[list[float]], starts: list[float]) -> dict:
    """The JSON-ready line of step ``step``: ``durations[r]`` is rank r's
    ``StepTimer.durations()`` (``num_marks(plan) - 1`` seconds), ``starts[r]``
    the wall-clock time its step started."""
    schedules = _schedules(plan.schedule, plan.num_stages, plan.num_microbatches, plan.interleave)
    gpu_of = {g.rank: g for st in plan.stages for g in st.gpus}
    P, ranks = plan.num_groups, []
    for r, d in enumerate(durations):
        role, g = plan.role(r), gpu_of[r]
        acts = schedules[role.stage]
        assert len(d) == 1 + 3 * len(acts) + len(PHASES), (r, len(d), len(acts))
        actions = [{"kind": a.kind, "stage": role.stage + a.chunk * P, "microbatch": a.microbatch,
                    "post_s": d[1 + 3 * k], "wait_s": d[2 + 3 * k], "compute_s": d[3 + 3 * k]}
                   for k, a in enumerate(acts)]
        ranks.append({"rank": r, "gpu": g.gpu, "node": g.node, "gpu_type": g.gpu_type,
                      "stages": list(plan.stages_of(r)), "start_unix_s": starts[r], "count_s": d[0],
                      "actions": actions,
                      **dict(zip(PHASES, d[1 + 3 * len(acts):]))})
    return {"format": FORMAT, "version": VERSION, "step": step, "run_id": run_id, "plan_hash": plan_hash,
            "clock": clock, "step_time_s": step_time_s, "ranks": ranks}


def read_timings(path: str | Path) -> list[TimingsLine]:
    """Every step's line of a timings file, checked.

    A last line without its newline that is not JSON (a run killed while
    writing it) is left out; anything else wrong raises ``TimingsFileError``
    naming the file, the line, the field and the value."""
    path = Path(path)
    if not path.is_file():
        raise TimingsFileError(f"{path}: no such timings file; {TIMINGS_FILE.remake}", path=str(path))
    text = path.read_text()
    lines = text.splitlines()
    out = []
    for n, ln in enumerate(lines, 1):
        if not ln.strip():
            continue
        source = f"{path}:{n}"
        if json_too_deep([ln]) is not None:
            raise TimingsFileError(f"{source}: values nested too deep; {TIMINGS_FILE.remake}", path=str(path))
        try:
            d = json.loads(ln)
        except ValueError as exc:
            if n == len(lines) and not text.endswith("\n"):
                break  # cut short by the run's end
            raise TimingsFileError(f"{source}: invalid JSON ({exc}); {TIMINGS_FILE.remake}", path=str(path)) from None
        out.append(TIMINGS_FILE.decode(d, source))
    return out


def slowest_rank(line: dict) -> tuple[int, float]:
    """(the rank with the most forward + backward compute in the step, its
    compute seconds) from a step's ``timings_line``: in a pipeline every
    rank's step is as long as the slowest's, which the others spend waiting."""
    compute = [sum(a["compute_s"] for a in r["actions"]) for r in line["ranks"]]
    r = max(range(len(compute)), key=compute.__getitem__)
    return r, compute[r]


def phase_table(lines: list[TimingsLine], *, title: str = "") -> str:
    """Each rank's phases, the median over ``lines`` (ms), as a plain-text table (``zorse timings``):
    stages, GPU, forward and backward compute, waiting for receives, posting sends, the phases after
    the schedule, the rank's total; below it the median whole step (rank 0's, through the step's
    all-gather)."""
    import io
    import statistics

    from rich.console import Console
    from rich.table import Table

    med = statistics.median

    def ms(f) -> str:
        return f"{med(f(t) for t in lines) * 1e3:.1f}"

    table = Table(title=title or f"Per rank, median of steps {lines[0].step}..{lines[-1].step}, ms")
    cols = ("rank", "stages", "GPU", "forward", "backward", "wait", "post", "count", "finish", "all-reduce",
            "unscale", "grad norm", "AdamW", "all-gather", "total")
    for c in cols:
        table.add_column(c, justify="left" if c == "GPU" else "right")
    for r in range(len(lines[0].ranks)):
        x = lines[0].ranks[r]
        table.add_row(str(r), ",".join(map(str, x.stages)), f"{x.gpu} {x.gpu_type} @ {x.node}",
                      ms(lambda t: t.ranks[r].compute_s("F")), ms(lambda t: t.ranks[r].compute_s("B")),
                      ms(lambda t: sum(a.wait_s for a in t.ranks[r].actions)),
                      ms(lambda t: sum(a.post_s for a in t.ranks[r].actions)), ms(lambda t: t.ranks[r].count_s),
                      *[ms(lambda t, p=p: getattr(t.ranks[r], p)) for p in PHASES], ms(lambda t: t.ranks[r].total_s))
    buf = io.StringIO()
    Console(file=buf, width=200).print(table)
    return buf.getvalue() + f"step (rank 0, through the step's all-gather): {ms(lambda t: t.step_time_s)} ms\n"
