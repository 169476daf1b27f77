"""The readable form of a plan: ``Plan.table()`` (and ``str(plan)``), the
text table ``zorse show`` and ``zorse plan`` print.

One row per GPU of each stage (at most 150 columns, drawn with ``rich``),
then a summary: global batch and schedule, predicted step time and
throughput, the planner's status, the simulator's check when the plan holds
one, the GPUs it leaves idle (``idle_line``) and the precision policy. Split from ``plan.py`` (the Plan IR), which
keeps ``Plan.table`` as the entry point; this module reads only the plan's
fields and queries.
"""

from __future__ import annotations

import io
import textwrap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plan import Plan

__all__ = ["GIB", "plan_table", "idle_line"]

GIB = 1024**3


def _memory_table(plan: Plan):
    """Per rank, its predicted peak by what holds it (``GPUShare.predicted_memory``),
    GiB; None when the plan records no breakdown (a file of version < 7)."""
    from rich.table import Table

    seen: dict[int, object] = {}
    for s in plan.stages:
        for g in s.gpus:
            seen.setdefault(g.rank, g)
    if not any(g.predicted_memory.total_bytes for g in seen.values()):
        return None
    t = Table(title="predicted peak memory per rank, GiB (plan.json: gpus[].predicted_memory)", show_lines=False)
    for col in ("rank", "GPU @ node", "weights", "gradients", "optimizer", "activations", "comm", "total / capacity"):
        t.add_column(col, justify="left" if col == "GPU @ node" else "right")
    for rank in sorted(seen):
        g = seen[rank]
        m = g.predicted_memory
        t.add_row(str(rank), f"{g.gpu_type} @ {g.node}", *(f"{b / GIB:.2f}" for b in (
            m.weights_bytes, m.gradients_bytes, m.optimizer_bytes, m.activations_bytes, m.communication_bytes)),
            f"{g.predicted_memory_bytes / GIB:.2f} / {g.memory_capacity_bytes / GIB:.1f}")
    return t


def idle_line(plan: Plan) -> str:
    """The plan table's line on the GPUs ``plan`` leaves idle (``plan.idle_gpus``, not None): how many of each
    type on which nodes, the predicted step of the best plan scored that uses them, how much slower that is
    and why ([Note: idle GPUs said aloud] in ``zorse_fx/idle.py``)."""
    from .plan import fmt_seconds  # (plan.py imports this module)

    idle = plan.idle_gpus
    nodes_of: dict[str, list[str]] = {}
    for g in idle.gpus:
        nodes_of.setdefault(g.gpu_type, []).append(g.node)
    parts = []
    for gpu_type, nodes in nodes_of.items():
        names = list(dict.fromkeys(nodes))
        where = (f"node {names[0]}" if len(names) == 1 else f"nodes {', '.join(names)}" if len(names) <= 4
                 else f"nodes {', '.join(names[:3])}, ... ({len(names)} nodes)")
        parts.append(f"{len(nodes)} x {gpu_type} ({where})")
    head = "idle: " + ", ".join(parts)
    if idle.all_gpus_step_time_s is None:
        return f"{head} -- {idle.reason}"
    step = plan.predicted_step_time_s
    more = f"{idle.all_gpus_step_time_s / step - 1:+.0%}, " if step > 0 else ""
    return (f"{head} -- the best plan scored that uses them: {fmt_seconds(idle.all_gpus_step_time_s)}/step "
            f"({more}{idle.all_gpus_source}): {idle.reason} (zorse plan --use-all-gpus searches for the best)")


def plan_table(plan: Plan) -> str:
    """``plan`` as a text table (one row per GPU), at most 150 columns.

    "optimizer state" is ``replicated`` or, for a ZeRO-1 stage, this GPU's
    ``state_shard_bytes`` and its share of the stage's elements (", 16-bit
    weights" where the stage keeps 16-bit working weights); a stage
    that recomputes its activations reads ``<i> (recompute)``, ``<i> (recompute, stash)``
    with its blocks' inputs in host memory; with
    interleaving a stage reads ``<i> g<p>`` (GPU group p) and "memory"
    is the GPU's total over all its stages.
    """
    from .plan import fmt_seconds  # (plan.py imports this module)

    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"zorse_fx plan: {plan.model_name} on {plan.cluster_name}", show_lines=False)
    cols = ("stage", "blocks: layers", "params", "rank", "GPU @ node", "samples", "memory GiB",
            "optimizer state", "µbatch")
    for col in cols:
        t.add_column(col, justify="left" if col in ("blocks: layers", "GPU @ node", "optimizer state") else "right")
    for s in plan.stages:
        mem = s.memory  # the stage's memory policy (ir/memory.py)
        shards = s.shard_ranges(s.num_parameters) if mem.zero else ()
        for i, g in enumerate(s.gpus):
            first = i == 0
            if mem.zero:
                a, b = shards[i]
                pct = f"{(b - a) / s.num_parameters:.0%}" if s.num_parameters else "-"
                state = (f"sharded {g.state_shard_bytes / GIB:.2f} GiB ({pct})" if g.state_shard_bytes
                         else f"sharded ({pct})") + (f", ZeRO-{mem.zero}" if mem.zero >= 2 else "") + (
                    ", 16-bit weights" if s.low_precision_params else "")
            else:
                state = "replicated"
            if mem.optimizer == "host" or mem.activations == "host" or mem.stash == "host":
                acts = "activations" if mem.activations == "host" else "block inputs"
                what = "offloaded" if mem.activations == mem.stash == "device" else (
                    f"offloaded, {acts} too" if mem.optimizer == "host" else f"{acts} offloaded")
                state += f", {what} ({g.predicted_host_memory_bytes / GIB:.2f} GiB host)"
            name = str(s.index) + (f" g{s.index % plan.num_groups}" if plan.interleave > 1 else "")
            t.add_row(
                (f"{name} (recompute{', stash' if mem.stash == 'host' else ''})" if mem.recompute else name)
                if first else "",
                f"[{s.blocks[0]}, {s.blocks[1]}): {s.label}" if first else "",
                f"{s.num_parameters / 1e6:.1f}M" if first else "",
                str(g.rank),
                f"{g.gpu_type} @ {g.node}",
                f"{g.samples_per_microbatch}/{s.microbatch_size}",
                f"{g.predicted_memory_bytes / GIB:.2f} / {g.memory_capacity_bytes / GIB:.1f}",
                state,
                f"{s.predicted_time_s * 1e3:.1f} ms" if first else "",
            )
        t.add_section()
    buf = io.StringIO()
    console = Console(file=buf, width=150, record=False)
    console.print(t)
    breakdown = _memory_table(plan)
    if breakdown is not None:
        console.print(breakdown)
    sv = plan.solver
    precision = textwrap.fill("precision " + plan.precision_policy().describe(), width=150,
                              subsequent_indent="  ")
    summary = (
        f"global batch {plan.global_batch_size} = {plan.num_microbatches} micro-batches x "
        f"{plan.microbatch_size} samples (seq {plan.seq_len}), schedule {plan.schedule}"
        + (f" interleaved x{plan.interleave} ({plan.num_groups} GPU groups, stage s on group s mod "
           f"{plan.num_groups})" if plan.interleave > 1 else "")
        + f", {plan.num_stages} stages on {plan.world_size} GPUs\n"
        f"predicted step time {fmt_seconds(plan.predicted_step_time_s)} "
        f"({plan.tokens_per_step / plan.predicted_step_time_s:,.0f} tokens/s); "
        f"planner {sv.planner} in {sv.wall_s:.2f} s: {sv.verdict(plan.predicted_step_time_s)}"
        + (f"\nsimulated step time {fmt_seconds(sv.simulated_step_time_s)} "
           f"({sv.simulated_step_time_s / plan.predicted_step_time_s:.2f}x predicted), "
           f"bubble {sv.simulated_bubble_fraction:.0%}, peak memory "
           f"{sv.simulated_max_memory_fraction:.0%} of usable"
           if sv.simulated_step_time_s and plan.predicted_step_time_s else "")
        + ("\n" + textwrap.fill(idle_line(plan), width=150, subsequent_indent="  ",
                                           break_on_hyphens=False) if plan.idle_gpus else "")
        + "\n" + precision
    )
    low = [s for s in plan.stages if s.low_precision_params]
    if low:
        summary += (f"\n16-bit working weights on stage{'s' if len(low) > 1 else ''} "
                    f"{', '.join(str(s.index) for s in low)} ({sum(len(s.low_precision_params) for s in low)} "
                    f"matmul weights in {plan.precision_policy().compute_dtype_name}, their float32 masters in the "
                    f"optimizer-state shards"
                    # the bytes of a ZeRO-1 stage; ZeRO-2/3 shard the gradients / weights too (their own lines)
                    + (": 6 + 12/k B per parameter on k GPUs instead of 10 + 8/k on ZeRO-1 stages"
                       if any(s.memory.zero < 2 for s in low) else "") + ")")
    for chosen, what, how in (
            ([s for s in plan.stages if s.memory.zero == 3], "Sharded parameters (ZeRO-3)",
             "each GPU keeps its shard of the working weights, every block's gathered before its forward and again "
             "for its backward"),
            ([s for s in plan.stages if s.memory.optimizer == "host"], "Optimizer offloaded",
             "AdamW moments and float32 masters in host memory, stepped on the CPU (each step: gradients to the "
             "host, weights back over the host link)"),
            ([s for s in plan.stages if s.memory.activations == "host"], "Activations offloaded",
             "what autograd saves waits in host memory between a micro-batch's forward and backward (one "
             "micro-batch's on the GPU)"),
            ([s for s in plan.stages if s.memory.stash == "host"], "Recomputation with host-stashed inputs",
             "each block's inputs wait in host memory between a micro-batch's forward and backward, the blocks "
             "re-run one at a time (one block's activations on the GPU)"),
            ([s for s in plan.stages if s.memory.zero == 2], "Sharded gradients (ZeRO-2)",
             "every micro-batch's gradients reduced to the shard owners, 4/k B per parameter on k GPUs instead of "
             "4 on each")):
        if chosen:
            summary += (f"\n{what} on stage{'s' if len(chosen) > 1 else ''} "
                        f"{', '.join(str(s.index) for s in chosen)}: {how}")
    return buf.getvalue() + summary
