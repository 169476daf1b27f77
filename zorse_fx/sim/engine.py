"""Event-driven simulator of one training step of a plan (seconds, bytes).

NOTE "simulation model" -- the planners' objective (solve/objective.py) is a
closed-form 1F1B/GPipe estimate; this module replays the schedule task by task
so that compute, boundary messages and link contention interleave as they
would on the cluster. Decision arguments are those of ``solve.evaluate``.

Compute. GPU ``g`` of stage ``s`` runs the stage's action list
(``runtime.schedule.make_schedule(options.schedule, S, M)``) in order, one
task at a time. With W = sum over the stage's blocks of
``fwd_bwd_s_per_sample[type(g)]`` and F = sum of ``fwd_bwd_s_fixed`` (missing
type: 0), a micro-batch's forward + backward takes ``n_g * W + F`` seconds, of
which the forward is 1/3 and the backward 2/3 (the backward computes the
input and the weight gradient, two matmuls per forward matmul; Narayanan et
al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC'21).

Dependencies. F(s, m) on GPU j waits until the activations of every route
(i -> j) of micro-batch m from stage s-1 have *arrived*; B(s, m) waits for
F(s, m) (schedule order) and the gradients of every route (j -> k) from stage
s+1. Routes are ``runtime.comm.routes`` over the stages' row ranges (each
GPU's share laid end to end, in ``stage_gpus`` order): a route of ``rows``
samples across cut c carries ``rows * cut_bytes_per_sample[c]`` bytes, forward
when F ends on the sender, and the same bytes backward when B ends on the
receiver.

Links. A message g -> h first waits ``link_latency_s[g][h]`` (no bandwidth
used), then transfers its bytes at ``link_bw_bytes_per_s[g][h]`` divided by the
number of messages transferring on the same *link resource* at that moment
(equal fluid share, recomputed at every event; since each message uses one
resource this is the max-min fair share). Link resource: the unordered node
pair for GPUs on different nodes (one NIC / network path per node pair), the
unordered GPU pair inside a node (NVLink / PCIe peer link); both directions
share it. With no ``node_names`` every GPU is its own node.

Gradient sync. When every GPU of a stage with > 1 GPU has finished its last
backward, the stage's ring all-reduce runs for objective.py's [C-allreduce]:
``2 * grad_bytes * P_s / bw_min + 2 * (k - 1) * lat_max`` over the stage's GPU
pairs (it does not contend with boundary messages, which have all been sent
by then except possibly the last gradients towards stage s-1). Then each GPU
runs its optimizer step, ``2 * state_bytes * P_s / mem_bw_g`` ([C-optim]).
The step ends when the last optimizer step ends.

Memory. Peak per GPU = ``state_bytes * P_s`` + activation bytes per sample of
the stage x n_g x (largest number of micro-batches whose forward has ended and
whose backward has not, tracked through the simulation).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from ..runtime.comm import routes
from ..runtime.schedule import make_schedule
from ..solve.objective import _validate
from ..solve.records import BlockCosts, DeviceGraph, SolverOptions

__all__ = ["SimEvent", "SimResult", "simulate", "link_resource"]

KINDS = ("F", "B", "send", "allreduce", "optim")


@dataclass(frozen=True, slots=True)
class SimEvent:
    """One interval of the simulated step.

    ``kind``: "F" / "B" (compute of ``microbatch`` on ``gpu``), "send" (a
    boundary message from ``gpu`` to ``peer``, ``start_s`` = when the sender
    finished its task, ``end_s`` = arrival, ``nbytes`` bytes; forward
    activations go to stage+1, gradients to stage-1), "allreduce" (per GPU of
    the stage, ``nbytes`` = gradient bytes), "optim" (``nbytes`` = state bytes
    read and written). ``microbatch`` is -1 for "allreduce" and "optim".
    Times in seconds from the start of the step."""

    kind: str
    gpu: int
    stage: int
    microbatch: int
    start_s: float
    end_s: float
    peer: int | None = None
    nbytes: int = 0


@dataclass(frozen=True, slots=True)
class SimResult:
    """Outcome of :func:`simulate`. Per-GPU tuples are indexed like the DeviceGraph."""

    step_time_s: float
    #: F+B compute seconds / step time (0 for idle GPUs).
    busy_fraction: tuple[float, ...]
    #: Peak bytes (training state + activations in flight); 0 for idle GPUs.
    peak_memory_bytes: tuple[int, ...]
    events: tuple[SimEvent, ...]
    #: 1 - mean busy_fraction over the GPUs the plan uses.
    bubble_fraction: float
    #: Node name and GPU type per GPU (for traces and charts).
    gpu_nodes: tuple[str, ...] = ()
    gpu_types: tuple[str, ...] = ()


def link_resource(devices: DeviceGraph, g: int, h: int) -> tuple:
    """The shared resource a message g -> h uses (see the module note)."""
    nodes = devices.node_names or tuple(f"gpu{k}" for k in range(devices.num_gpus))
    if nodes[g] != nodes[h]:
        return ("node",) + tuple(sorted((nodes[g], nodes[h])))
    return ("gpu",) + tuple(sorted((g, h)))


class _Msg:
    __slots__ = ("src", "dst", "stage", "m", "fwd", "nbytes", "t0", "ready", "left", "bw", "res", "rate")

    def __init__(self, src, dst, stage, m, fwd, nbytes, t0, ready, bw, res):
        self.src, self.dst, self.stage, self.m, self.fwd = src, dst, stage, m, fwd
        self.nbytes, self.t0, self.ready, self.bw, self.res = nbytes, t0, ready, bw, res
        self.left, self.rate = float(nbytes), 0.0


def _ranges(ns) -> tuple[tuple[int, int], ...]:
    out, a = [], 0
    for n in ns:
        out.append((a, a + n))
        a += n
    return tuple(out)


def simulate(costs: BlockCosts, devices: DeviceGraph, options: SolverOptions, *, stage_blocks, stage_gpus,
             samples_per_microbatch, num_microbatches: int) -> SimResult:
    """Simulate one training step of the decision (see the module note).

    Raises ValueError for a malformed decision (as ``solve.evaluate``) and
    RuntimeError if the schedule deadlocks (it cannot for 1F1B / GPipe)."""
    _validate(costs, devices, options, stage_blocks, stage_gpus, samples_per_microbatch, num_microbatches)
    n_s, m_count = len(stage_blocks), num_microbatches
    sched = make_schedule(options.schedule, n_s, m_count)
    st_b, gr_b = costs.state_bytes_per_param, costs.grad_bytes_per_param
    stage_of, share, dur = {}, {}, {}
    for s, ((i, j), gpus, ns) in enumerate(zip(stage_blocks, stage_gpus, samples_per_microbatch)):
        for g, n in zip(gpus, ns):
            t = devices.gpu_types[g]
            w = sum(costs.fwd_bwd_s_per_sample[t][i:j])
            f = sum(costs.fwd_bwd_s_fixed.get(t, (0.0,) * costs.num_blocks)[i:j])
            stage_of[g], share[g] = s, n
            dur[g] = ((n * w + f) / 3.0, 2.0 * (n * w + f) / 3.0)
    # Routes across the cut after stage s: out_routes[g] = [(dst, bytes)], in_count[g].
    out_fwd: dict[int, list[tuple[int, int]]] = defaultdict(list)
    out_bwd: dict[int, list[tuple[int, int]]] = defaultdict(list)
    need_fwd: dict[int, int] = defaultdict(int)
    need_bwd: dict[int, int] = defaultdict(int)
    for s in range(n_s - 1):
        cut_b = costs.cut_bytes_per_sample[stage_blocks[s][1]]
        src, dst = stage_gpus[s], stage_gpus[s + 1]
        for r in routes(_ranges(samples_per_microbatch[s]), _ranges(samples_per_microbatch[s + 1])):
            g, h = src[r.src_pos], dst[r.dst_pos]
            out_fwd[g].append((h, r.rows * cut_b))
            out_bwd[h].append((g, r.rows * cut_b))
            need_fwd[h] += 1
            need_bwd[g] += 1

    used = sorted(stage_of)
    pc = {g: 0 for g in used}
    running: dict[int, tuple[float, float, str, int]] = {}  # g -> (start, end, kind, m)
    got_fwd: dict[tuple[int, int], int] = defaultdict(int)
    got_bwd: dict[tuple[int, int], int] = defaultdict(int)
    live = {g: 0 for g in used}
    peak_live = {g: 0 for g in used}
    busy = {g: 0.0 for g in used}
    last_b = {}
    events: list[SimEvent] = []
    waiting: list[_Msg] = []  # in their latency phase
    active: list[_Msg] = []  # transferring
    t = 0.0

    def post(src, dst, s, m, fwd, nbytes):
        lat = max(devices.link_latency_s[src][dst], 0.0)
        bw = devices.link_bw_bytes_per_s[src][dst]
        if not bw > 0:
            raise ValueError(f"link bandwidth from GPU {src} to {dst} must be > 0, got {bw}")
        waiting.append(_Msg(src, dst, s, m, fwd, nbytes, t, t + lat, bw, link_resource(devices, src, dst)))

    def arrive(msg: _Msg, when: float):
        events.append(SimEvent("send", msg.src, msg.stage, msg.m, msg.t0, when, msg.dst, msg.nbytes))
        (got_fwd if msg.fwd else got_bwd)[msg.dst, msg.m] += 1

    def ready(g) -> bool:
        a = sched[stage_of[g]][pc[g]]
        if a.kind == "F":
            return got_fwd[g, a.microbatch] >= need_fwd[g]
        return got_bwd[g, a.microbatch] >= need_bwd[g]

    while True:
        for g in used:
            if g not in running and pc[g] < len(sched[stage_of[g]]) and ready(g):
                a = sched[stage_of[g]][pc[g]]
                running[g] = (t, t + dur[g][a.kind == "B"], a.kind, a.microbatch)
        finish = {id(x): t + x.left / x.rate for x in active}
        cands = [e for _, e, _, _ in running.values()] + [x.ready for x in waiting] + list(finish.values())
        if not cands:
            break
        t_next = max(min(cands), t)
        for x in active:
            x.left -= x.rate * (t_next - t)
        t = t_next
        tol = 1e-12 * max(1.0, t)
        for g in sorted(running):
            start, end, kind, m = running[g]
            if end > t + tol:
                continue
            del running[g]
            pc[g] += 1
            s = stage_of[g]
            events.append(SimEvent(kind, g, s, m, start, t))
            busy[g] += t - start
            if kind == "F":
                live[g] += 1
                peak_live[g] = max(peak_live[g], live[g])
                for h, nb in out_fwd[g]:
                    post(g, h, s, m, True, nb)
            else:
                live[g] -= 1
                last_b[g] = t
                for h, nb in out_bwd[g]:
                    post(g, h, s, m, False, nb)
        for x in [x for x in active if finish[id(x)] <= t + tol]:
            active.remove(x)
            arrive(x, t)
        for x in [x for x in waiting if x.ready <= t + tol]:
            waiting.remove(x)
            if x.nbytes <= 0 or math.isinf(x.bw):
                arrive(x, t)
            else:
                active.append(x)
        count: dict[tuple, int] = defaultdict(int)
        for x in active:
            count[x.res] += 1
        for x in active:
            x.rate = x.bw / count[x.res]
    stuck = [g for g in used if pc[g] < len(sched[stage_of[g]])]
    if stuck:
        raise RuntimeError(f"schedule deadlocked: GPUs {stuck} wait at actions "
                           f"{[str(sched[stage_of[g]][pc[g]]) for g in stuck]}")

    step = 0.0
    for s, ((i, j), gpus) in enumerate(zip(stage_blocks, stage_gpus)):
        params = sum(costs.param_count[i:j])
        t_ar = max(last_b[g] for g in gpus)
        pairs = [(g, h) for a, g in enumerate(gpus) for h in gpus[a + 1:]]
        if pairs:
            bw_min = min(min(devices.link_bw_bytes_per_s[g][h], devices.link_bw_bytes_per_s[h][g])
                         for g, h in pairs)
            lat_max = max(max(devices.link_latency_s[g][h], devices.link_latency_s[h][g]) for g, h in pairs)
            t_end = t_ar + 2 * gr_b * params / bw_min + 2 * (len(gpus) - 1) * lat_max
            events += [SimEvent("allreduce", g, s, -1, t_ar, t_end, None, gr_b * params) for g in gpus]
            t_ar = t_end
        for g in gpus:
            t0 = t_ar if pairs else last_b[g]
            t1 = t0 + 2 * st_b * params / devices.mem_bw_bytes_per_s[g]
            events.append(SimEvent("optim", g, s, -1, t0, t1, None, 2 * st_b * params))
            step = max(step, t1)

    n_g = devices.num_gpus
    busy_frac = tuple(busy.get(g, 0.0) / step if step > 0 else 0.0 for g in range(n_g))
    peak = [0] * n_g
    for g in used:
        i, j = stage_blocks[stage_of[g]]
        peak[g] = (st_b * sum(costs.param_count[i:j])
                   + sum(costs.act_bytes_per_sample[i:j]) * share[g] * peak_live[g])
    bubble = 1.0 - sum(busy_frac[g] for g in used) / len(used)
    events.sort(key=lambda e: (e.start_s, e.gpu, KINDS.index(e.kind), e.end_s))
    return SimResult(step_time_s=step, busy_fraction=busy_frac, peak_memory_bytes=tuple(peak),
                     events=tuple(events), bubble_fraction=bubble,
                     gpu_nodes=tuple(devices.node_names or (f"gpu{g}" for g in range(n_g))),
                     gpu_types=tuple(devices.gpu_types))
