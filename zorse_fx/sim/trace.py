"""Views of a simulated step: a Perfetto / Chrome trace and a PNG Gantt chart.

Trace format: the Chrome "Trace Event Format" (JSON object with a
``traceEvents`` list; complete events ``"ph": "X"`` with ``ts`` and ``dur`` in
microseconds; ``"ph": "M"`` metadata events name processes and threads), which
ui.perfetto.dev and chrome://tracing both load. One process per node, one
thread per GPU for its compute (F, B, all-reduce, optimizer, all-gather of a
ZeRO-1 or ZeRO-2 stage's updated weights, named with its ZeRO stage) and one
thread per GPU for the messages it sends. Every slice of a stage carries how
it keeps its state (``args.memory``: "ZeRO-3, optimizer offloaded", as
``stage_memory`` says it); an offloaded optimizer's step is named so.
Complete events on one thread must nest, and a GPU's sends can overlap (a
forward feeds several receivers at once), so overlapping sends go to extra
lanes ("GPU g sends #2", ...) of the same GPU.

A backward of a recomputing stage is named ``B<m> (recompute)`` with
``args.recompute_s``, and carries a nested child slice ``re-run F<m>`` (cat
"recompute") over its first ``recompute_s`` seconds; the Gantt chart draws
that part hatched in its own colour. All-gathers have their own colour too.

Interleaved plans (``SimResult.interleave`` > 1, a GPU runs several stages):
compute slices carry their stage, ``F3 s2`` / ``B3 s2 (recompute)`` /
``re-run F3 s2``, sends their two stages, ``send mb3 s1->s2 to GPU 4``, and
the chart labels each bar ``3 s2``. Without interleaving the names are
``F3`` / ``send mb3 -> GPU 4`` and the bars ``3``.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..ir.memory import StageMemory
from .engine import SimEvent, SimResult

__all__ = ["to_perfetto", "gantt_png", "stage_memory", "COLORS"]

#: Colours of the chart (and the trace's ``cname``-free legend) per event kind.
COLORS = {"F": "#4C78A8", "B": "#F58518", "recompute": "#FFBF79", "allreduce": "#E45756", "optim": "#54A24B",
          "allgather": "#B279A2", "send": "#9D9D9D", "tiedreduce": "#FF9DA6", "control": "#72B7B2"}
_LEGEND = {"F": "forward", "B": "backward", "recompute": "backward: forward re-run", "allreduce": "all-reduce",
           "optim": "optimizer", "allgather": "all-gather", "send": "send",
           "tiedreduce": "all-reduce (tied parameter)",
           "control": "step control (gradient norm all-reduce, per-step table all-gather)"}
_COMPUTE = ("F", "B", "allreduce", "tiedreduce", "control", "optim", "allgather")


def stage_memory(result: SimResult, stage: int) -> str:
    """How stage ``stage`` keeps its training state, as the plan table says
    it: "ZeRO-1" / "ZeRO-2" / "ZeRO-3" (optimizer state / + gradients / +
    weights sharded) or "replicated", then ", optimizer offloaded" and
    ", activations offloaded" where so; "" for a result without the memory
    policy (``SimResult`` made by hand) or an event of no stage (-1)."""
    if not 0 <= stage < len(result.memory):
        return ""
    mem = result.memory[stage]
    text = f"ZeRO-{mem.zero}" if mem.zero else "replicated"
    if mem.optimizer == "host":
        text += ", optimizer offloaded"
    if mem.activations == "host":
        text += ", activations offloaded"
    return text


def _event_label(result: SimResult, e: SimEvent) -> str:
    """The name of an all-reduce / optimizer / all-gather slice: the legend's,
    with the stage's ZeRO stage on an all-gather (ZeRO-1 and ZeRO-2 gather the
    updated weights after the step; ZeRO-3 gathers inside F and B) and where
    an offloaded optimizer steps (on the host CPU)."""
    mem = result.memory[e.stage] if 0 <= e.stage < len(result.memory) else StageMemory()
    if e.kind == "allgather" and mem.zero:
        return f"all-gather (ZeRO-{mem.zero})"
    if e.kind == "optim" and mem.optimizer == "host":
        return "optimizer (offloaded: host CPU)"
    return _LEGEND[e.kind]


def _legend(result: SimResult, kind: str) -> str:
    """The chart legend's entry of ``kind``: the labels its slices carry."""
    names = sorted({_event_label(result, e) for e in result.events if e.kind == kind})
    if kind in ("allgather", "optim") and names:
        return ", ".join(names)
    return _LEGEND[kind]


def _labels(result: SimResult, gpu_labels) -> dict[int, str]:
    gpus = sorted({e.gpu for e in result.events})
    if gpu_labels is not None:
        return {g: str(gpu_labels[g]) for g in gpus}
    kind = result.gpu_types
    return {g: f"GPU {g}" + (f" ({kind[g]})" if g < len(kind) else "") for g in gpus}


def _task(e: SimEvent, staged: bool, kind: str | None = None) -> str:
    """``F3``, or ``F3 s2`` when the GPU runs several stages."""
    return f"{kind or e.kind}{e.microbatch}" + (f" s{e.stage}" if staged else "")


def _name(result: SimResult, e: SimEvent, staged: bool = False) -> str:
    if e.kind in ("F", "B"):
        return _task(e, staged) + (" (recompute)" if e.recompute_s > 0 else "")
    if e.kind == "send":
        if staged:
            return f"send mb{e.microbatch} s{e.stage}->s{e.peer_stage} to GPU {e.peer}"
        return f"send mb{e.microbatch} -> GPU {e.peer}"
    return _event_label(result, e)


def _staged(result: SimResult) -> bool:
    return getattr(result, "interleave", 1) > 1


def _lanes(events: list[SimEvent]) -> list[int]:
    """Greedy interval partitioning: lane per event so that lanes never overlap."""
    ends: list[float] = []
    out = []
    for e in events:
        for k, end in enumerate(ends):
            if end <= e.start_s:
                ends[k] = e.end_s
                out.append(k)
                break
        else:
            ends.append(e.end_s)
            out.append(len(ends) - 1)
    return out


def to_perfetto(result: SimResult, path, *, gpu_labels=None) -> Path:
    """Write the step as Chrome trace event JSON to ``path`` (returned as a Path).

    ``gpu_labels``: optional names indexed by GPU (default "GPU g (type)")."""
    labels = _labels(result, gpu_labels)
    staged = _staged(result)
    nodes = result.gpu_nodes or tuple(f"gpu{g}" for g in range(max(labels, default=-1) + 1))
    pid_of: dict[str, int] = {}
    for g in labels:
        pid_of.setdefault(nodes[g], len(pid_of) + 1)
    meta = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"node {node}"}}
            for node, pid in pid_of.items()]
    trace = []

    def thread(g: int, tid: int, name: str) -> None:
        meta.append({"name": "thread_name", "ph": "M", "pid": pid_of[nodes[g]], "tid": tid, "args": {"name": name}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": pid_of[nodes[g]], "tid": tid,
                     "args": {"sort_index": tid}})

    def slice_(e: SimEvent, tid: int) -> dict:
        args = {"stage": e.stage, "microbatch": e.microbatch, "start_s": e.start_s, "end_s": e.end_s}
        if e.kind == "send":
            args.update(peer=e.peer, bytes=e.nbytes)
            if e.peer_stage is not None:
                args.update(peer_stage=e.peer_stage)
        elif e.kind in ("allreduce", "tiedreduce", "optim", "allgather"):
            args.update(bytes=e.nbytes)
        elif e.recompute_s > 0:
            args.update(recompute=True, recompute_s=e.recompute_s)
        if stage_memory(result, e.stage):
            args.update(memory=stage_memory(result, e.stage))
        return {"name": _name(result, e, staged), "cat": e.kind, "ph": "X", "ts": e.start_s * 1e6,
                "dur": max(e.end_s - e.start_s, 0.0) * 1e6, "pid": pid_of[nodes[e.gpu]], "tid": tid, "args": args}

    for g, label in labels.items():
        base = 100 * (g + 1)
        thread(g, base, f"{label} compute")
        for e in result.events:
            if e.gpu == g and e.kind in _COMPUTE:
                trace.append(slice_(e, base))
                if e.recompute_s > 0:  # nested child: the re-run forward at the start of the backward
                    parent = trace[-1]
                    trace.append({**parent, "name": "re-run " + _task(e, staged, "F"), "cat": "recompute",
                                  "dur": min(e.recompute_s * 1e6, parent["dur"]),
                                  "args": {**parent["args"], "recompute_s": e.recompute_s}})
        sends = [e for e in result.events if e.gpu == g and e.kind == "send"]
        lanes = _lanes(sends)
        for k in sorted(set(lanes)):
            thread(g, base + 1 + k, f"{label} sends" + (f" #{k + 1}" if k else ""))
        trace += [slice_(e, base + 1 + k) for e, k in zip(sends, lanes)]
    doc = {"traceEvents": meta + trace, "displayTimeUnit": "ms",
           "otherData": {"step_time_s": result.step_time_s, "bubble_fraction": result.bubble_fraction,
                         "interleave": getattr(result, "interleave", 1)}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def gantt_png(result: SimResult, path, *, gpu_labels=None, dpi: int = 120) -> Path:
    """Draw a Gantt chart (one row per used GPU, time in ms) to a PNG at ``path``.

    Uses matplotlib's Agg canvas directly (no global backend switch). Compute
    bars fill a row (the forward re-run of a recomputing backward hatched in
    its own colour); sends are thin grey bars along its bottom edge. Bars
    show the micro-batch, and its stage when the plan is interleaved."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    labels = _labels(result, gpu_labels)
    staged = _staged(result)
    rows = {g: k for k, g in enumerate(sorted(labels))}
    step_ms = max(result.step_time_s * 1e3, 1e-12)
    fig = Figure(figsize=(12, 1.2 + 0.45 * max(len(rows), 1)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for e in result.events:
        y, x0, w = rows[e.gpu], e.start_s * 1e3, (e.end_s - e.start_s) * 1e3
        if e.kind == "send":
            ax.barh(y + 0.33, w, left=x0, height=0.1, color=COLORS["send"], alpha=0.6, linewidth=0)
            continue
        ax.barh(y, w, left=x0, height=0.6, color=COLORS[e.kind], edgecolor="white", linewidth=0.5)
        if e.recompute_s > 0:
            ax.barh(y, min(e.recompute_s * 1e3, w), left=x0, height=0.6, color=COLORS["recompute"],
                    edgecolor="white", hatch="///", linewidth=0.5)
        if e.kind in ("F", "B") and w >= 0.02 * step_ms:
            ax.text(x0 + w / 2, y, f"{e.microbatch} s{e.stage}" if staged else str(e.microbatch), ha="center",
                    va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(rows)), [labels[g] for g in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, step_ms * 1.01)
    ax.set_xlabel("time (ms)")
    ax.set_title(f"simulated step {step_ms:.2f} ms, bubble {result.bubble_fraction:.1%}"
                 + (f", interleaved 1F1B x{result.interleave}" if staged else ""))
    shown = {e.kind for e in result.events} | {"F", "B", "send"}
    if any(e.recompute_s > 0 for e in result.events):
        shown.add("recompute")
    ax.legend(handles=[Patch(facecolor=c, edgecolor="white", hatch="///" if k == "recompute" else None,
                             label=_legend(result, k)) for k, c in COLORS.items() if k in shown],
              loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    return path
