"""Gradient sync of a simulated step: the per-group bucketed all-reduce, the
all-reduce of tied parameters over the union of their holders, the step's
world control collectives ("control": the gradient norm's all-reduce, which
every optimizer waits for, and the per-step table's all-gather at the end),
the optimizer steps and the ZeRO-1 all-gathers ("Gradient sync" and "Tied
parameters" in the module note of ``sim/engine.py``; rings priced in
``sim/network.py``)."""

from __future__ import annotations

from collections.abc import Sequence

from ..ir.buckets import bucket_caps
from ..ir.costs import BlockCosts, unique_params
from ..ir.devices import DeviceGraph
from ..solve.objective import GRAD_BUCKET_BYTES_PER_PARAM as _FP32
from ..solve.objective import MEMORY_UNIT_BYTES, MIB_UNITS
from ..solve.tables import OFFLOAD_BYTES_PER_PARAM, OFFLOAD_LINK_BYTES, control_pass_s
from .gloo import allgather_program, allreduce_program, paced_transfer_s, replay
from .network import FlowResources, Ring, gloo_unequal_allgather_s, ring

__all__ = ["CONTROL_BYTES", "RECORD_ROW_BYTES", "gradient_sync"]

#: Bytes of a control all-reduce: one float32 (the gradient norm's sum of squares; fp16's inf/NaN flag).
CONTROL_BYTES = 4
#: Bytes per rank of the per-step all-gather of the ranks' records ([Note: one world collective after the
#: step] in zorse_fx/train.py): a few dozen float64 (phase times, flags, memory peak, per-action timings,
#: the loss contribution); latency-bound, so its exact length matters little.
RECORD_ROW_BYTES = 512


class _Timing:
    """When each block's gradients are ready on a GPU: its stage's last backward
    takes the blocks in reverse order, each for its share of the stage's
    backward time (``BlockCosts``' forward+backward less its forward part),
    after the re-run forward on a recomputing stage."""

    def __init__(self, costs, devices, stage_blocks, stage_gpus, samples, last_b_span, rc_dur):
        self.costs, self.devices, self.stage_blocks = costs, devices, stage_blocks
        self.stage_gpus, self.samples, self.span, self.rc_dur = stage_gpus, samples, last_b_span, rc_dur
        # per GPU type: each block's backward per sample and per micro-batch (seconds)
        self.bwd = {t: tuple([max(0.0, x - f) for x, f in zip(whole, part)]
                             for whole, part in ((costs.fwd_bwd_s_per_sample[t], costs.forward_s_per_sample(t)),
                                                 (costs.fixed_s(t), costs.forward_s_fixed(t))))
                    for t in set(devices.gpu_types)}

    def block_done(self, g: int, s: int, b: int) -> float:
        (i, j), (start, end) = self.stage_blocks[s], self.span[g, s]
        t = self.devices.gpu_types[g]
        n = self.samples[s][self.stage_gpus[s].index(g)]
        per, fixed = self.bwd[t]
        w = [n * per[c] + fixed[c] for c in range(i, j)]
        bwd = end - start - self.rc_dur[g, s]
        total = sum(w)
        return end if total <= 0 else start + self.rc_dur[g, s] + bwd * sum(w[b - i:]) / total


def _reduction(costs: BlockCosts, timing: _Timing, stage_blocks, stages, gpus, excluded: dict[int, int],
               ring_: Ring, grad_bytes: int, bucket_bytes: int, scatters: dict[int, int] | None = None,
               in_flight: int = 1):
    """The gradient buckets of one GPU group, all-reduced in order as the
    runtime does ([Note: overlapped gradient reduction] in
    ``runtime/grad_sync.py``): the group's parameters in reverse plan order
    (its last stage's last block first; ``excluded[b]`` of block b's
    parameters left out: tied parameters reduced elsewhere, or counted once) in buckets of
    ``bucket_bytes`` of float32 gradients (the first one 1 MiB at most,
    ``bucket_caps``; ``PlanOptions.bucket_bytes``); a bucket can start once every GPU's last backward of the
    stage finished the bucket's earliest block and the previous bucket is
    done; it takes a ring all-reduce of its gradients on the group's ring
    (``Ring.allreduce_s``). Yields ``(stage, start, end, params)`` per stage,
    from its first bucket's start to its last bucket's end, the parameters it reduces.
    ``scatters[s]`` = M for a ZeRO-2 stage: its parameters' part of a bucket
    takes M reduce-scatters (half a ring all-reduce each) instead, all after
    the last backward, as the objective counts them ([C-grad-shard]: an upper
    bound; the runtime starts each after its own micro-batch's backward).
    ``in_flight``: buckets that may reduce at once (1: NCCL's one stream; 2: Gloo, whose process group
    runs its collectives on two worker threads, ``ProcessGroupGloo``'s default ``threads`` =
    2 x devices): bucket k starts after bucket k - ``in_flight`` instead of k - 1; buckets in flight
    together overlap their rings' latencies but share their links, so a bucket's bandwidth part
    (``Ring.allreduce_s`` less its latency part) starts after its latency part and after the previous
    bucket's bandwidth part (with ``in_flight`` = 1, one ring after the other, as before)."""
    scatters = scatters or {}
    buckets: list[list] = []  # [ready, params, {stage: params}]
    caps = bucket_caps(bucket_bytes)
    cur = [0.0, 0, {}]
    for s in reversed(stages):
        i, j = stage_blocks[s]
        for b in range(j - 1, i - 1, -1):
            left = costs.param_count[b] - excluded.get(b, 0)
            ready = max(timing.block_done(g, s, b) for g in gpus)
            while left > 0:
                cap = caps[0] if not buckets else caps[1]
                room = max(1, -(-(cap - _FP32 * cur[1]) // _FP32))
                take = min(left, room)
                cur[0] = max(cur[0], ready)
                cur[1] += take
                cur[2][s] = cur[2].get(s, 0) + take
                left -= take
                if _FP32 * cur[1] >= cap:
                    buckets.append(cur)
                    cur = [0.0, 0, {}]
    if cur[1]:
        buckets.append(cur)
    ends = [0.0] * in_flight  # the last in_flight buckets' ends, oldest first
    span: dict[int, list] = {}
    for ready, params, by_stage in buckets:
        start = max(ready, ends[0])
        plain = sum(n for s, n in by_stage.items() if s not in scatters)
        whole = (ring_.allreduce_s(grad_bytes * plain) if plain else 0.0) + sum(
            scatters[s] * ring_.allreduce_s(grad_bytes * n) / 2 for s, n in by_stage.items() if s in scatters)
        latency = (ring_.allreduce_s(0.0) if plain else 0.0) + sum(
            scatters[s] * ring_.allreduce_s(0.0) / 2 for s in by_stage if s in scatters)
        t = max(start + latency, ends[-1]) + whole - latency
        ends = [*ends[1:], t]
        for s, n in by_stage.items():
            sp = span.setdefault(s, [start, t, 0])
            sp[1], sp[2] = t, sp[2] + n
    for s in sorted(span):
        yield s, *span[s]


def _tied_plan(costs: BlockCosts, stage_blocks, stage_gpus, n_p: int):
    """Per tied parameter where its holders differ from one GPU group: (param,
    holding stages, the union of their GPUs in stage order); and per block the
    parameters its group's buckets leave out (the runtime reduces a parameter
    once per holder set: [Note: overlapped gradient reduction])."""
    stage_of = {b: s for s, (i, j) in enumerate(stage_blocks) for b in range(i, j)}
    excluded: dict[int, int] = {}
    unions = []
    for tp in costs.tied_params:
        stages = sorted({stage_of[b] for b in tp.blocks})
        if len({s % n_p for s in stages}) == 1:  # one group holds every copy: reduced once, in its buckets
            for b in tp.blocks[1:]:
                excluded[b] = excluded.get(b, 0) + tp.numel
            continue
        for b in tp.blocks:
            excluded[b] = excluded.get(b, 0) + tp.numel
        union = tuple(dict.fromkeys(g for s in stages for g in stage_gpus[s]))
        unions.append((tp, stages, union))
    return excluded, unions


def gradient_sync(costs: BlockCosts, devices: DeviceGraph, *, stage_blocks, stage_gpus, samples, n_p: int, pol,
                  last_b: dict, last_b_span: dict, rc_dur: dict, resources: FlowResources, bucket_bytes: int,
                  num_microbatches: int = 1, rendezvous: bool = False):
    """Events and end of the step's gradient sync (see the engine's module note).
    ``bucket_bytes``: the gradient bucket size (``PlanOptions.bucket_bytes``); ``rendezvous``: Gloo's
    protocol: every ring step of the gradient all-reduces pays its latency twice (``ring``'s
    ``rendezvous``), two buckets reduce at once (``_reduction``'s ``in_flight``), a tied parameter's
    all-reduce is gloo's ring replayed from each holder's entry, its messages paced ([Note: TCP pacing of a
    message] in sim/gloo.py),
    ZeRO-1's all-gather is one binomial-tree broadcast per shard (``gloo_unequal_allgather_s``), and the
    world's small collectives (the one-element control all-reduces, the per-step all-gather of the ranks'
    records) are replayed operation by operation from each rank's entry ([Note: Gloo's collectives as
    programs] in sim/gloo.py): each GPU's optimizer starts, and its step ends, when its own part does.
    Otherwise (NCCL's pricing, the objective's) the control all-reduces end together after the last GPU's
    sync plus their rings' latencies, and so does the record all-gather.
    Returns ``(step_end_s, events, shard_bytes, ends)`` with ``shard_bytes`` per stage per GPU (0 where not
    sharded) and ``ends`` each used GPU's end of the step (its record all-gather's; all equal but under
    Gloo), ``step_end_s`` their latest."""
    from .engine import SimEvent  # the record lives with the engine

    n_s = len(stage_blocks)
    mib = MIB_UNITS * MEMORY_UNIT_BYTES
    timing = _Timing(costs, devices, stage_blocks, stage_gpus, samples, last_b_span, rc_dur)
    shard_bytes = tuple(tuple(z * mib for z in pol.shard_mib[s]) if pol.memory[s].zero else (0,) * len(gpus)
                        for s, gpus in enumerate(stage_gpus))
    excluded, unions = _tied_plan(costs, stage_blocks, stage_gpus, n_p)
    events, tied_end = _tied_reductions(costs, devices, stage_blocks, stage_gpus, unions, timing, resources,
                                        rendezvous)
    # Per group its buckets; then [C-control]: the gradient norm's all-reduce over every GPU used (and
    # fp16-mixed's inf/NaN agreement), which no optimizer passes; the optimizers; the per-step table's
    # all-gather at the end ([Note: one world collective after the step] in zorse_fx/train.py).
    t_red: dict[int, float] = {}
    for p in range(n_p):
        stages_p = list(range(p, n_s, n_p))
        gpus = stage_gpus[p]
        ring_p = ring(devices, gpus, resources, rendezvous=rendezvous)
        t_red.update({g: last_b[g] for g in gpus})
        if len(gpus) > 1:
            t_end = max(last_b[g] for g in gpus)
            scatters = {s: num_microbatches for s in stages_p if pol.memory[s].zero >= 2}  # ZeRO-2/3 stages
            gr_b = costs.grad_bytes_per_param
            for s, start, end, nparams in _reduction(costs, timing, stage_blocks, stages_p, gpus, excluded,
                                                       ring_p, gr_b, bucket_bytes, scatters,
                                                       in_flight=2 if rendezvous else 1):
                events += [SimEvent("allreduce", g, s, -1, start, end, None, gr_b * nparams) for g in gpus]
                t_end = max(t_end, end)
            t_red.update(dict.fromkeys(gpus, t_end))
    used = sorted(t_red)  # the GPUs in rank order (node by node)
    rounds = costs.step_control_rounds
    one_pass = control_pass_s(devices, used)  # [C-control]: one pass of the world's ring (NCCL)
    before, after = max(rounds - 1, 0), min(rounds, 1)  # the all-reduces' 2 each; the all-gather's 1
    ready = {g: max(t_red[g], tied_end.get(g, 0.0)) for g in used}
    home = {g: s for s in reversed(range(n_s)) for g in stage_gpus[s]}  # a GPU's first stage
    programs = _GlooWorld(devices, used) if rendezvous and len(used) > 1 else None
    start = dict(ready)  # when each GPU's optimizer may start
    if before and len(used) > 1:
        if programs is not None:  # [Note: Gloo's collectives as programs]: each rank leaves when its part ends
            for _ in range(before // 2):  # the one-element all-reduces (fp16's inf/NaN agreement, the norm)
                exits = programs.allreduce(start, CONTROL_BYTES)
                events += [SimEvent("control", g, home[g], -1, start[g], exits[g], None, 0) for g in used]
                start = exits
        else:
            barrier = max(ready.values()) + before * one_pass
            events += [SimEvent("control", g, home[g], -1, ready[g], barrier, None, 0) for g in used]
            start = dict.fromkeys(used, barrier)
    steps, done = _optimizer_steps(costs, devices, stage_blocks, stage_gpus, n_p, pol, shard_bytes, start,
                                   resources, rendezvous)
    events += steps
    if programs is None:  # every GPU waits for the last (the record all-gather below is one ring)
        done = dict.fromkeys(used, max(done.values(), default=0.0))
    if after and len(used) > 1:  # the per-step all-gather of the ranks' records
        if programs is not None:
            ends = programs.allgather(done, RECORD_ROW_BYTES)
        else:
            ends = {g: done[g] + after * one_pass for g in used}
        events += [SimEvent("control", g, home[g], -1, done[g], ends[g], None, 0) for g in used]
        done = ends
    if costs.step_overhead_s:  # a calibration's measured loop overhead (BlockCosts.step_overhead_s)
        ends = {g: done[g] + costs.step_overhead_s for g in used}
        events += [SimEvent("control", g, home[g], -1, done[g], ends[g], None, 0) for g in used]
        done = ends
    return max(done.values(), default=0.0), events, shard_bytes, done


def _tied_reductions(costs: BlockCosts, devices: DeviceGraph, stage_blocks, stage_gpus, unions, timing,
                     resources: FlowResources, rendezvous: bool) -> tuple[list, dict[int, float]]:
    """``gradient_sync``'s tied parameters over the union of their holders (``unions`` of ``_tied_plan``),
    each once the last holder's copy is final: their "tiedreduce" events and each holder's end (s)."""
    from .engine import SimEvent

    gr_b = costs.grad_bytes_per_param
    events: list = []
    tied_end: dict[int, float] = {}
    for tp, stages, union in unions:
        nbytes = gr_b * tp.numel
        own = {g: max(timing.block_done(g, s, b) for s in stages if g in stage_gpus[s]
                      for b in tp.blocks if stage_blocks[s][0] <= b < stage_blocks[s][1]) for g in union}
        if rendezvous:  # Gloo's ring in the group's (sorted) rank order, each holder entering when its copy is
            # final ([Note: Gloo's collectives as programs], each message paced) at the ring's slowest hop
            order = sorted(union)
            bw = ring(devices, order, resources).bandwidth_bytes_per_s
            start, end = own, _GlooWorld(devices, order, bw).allreduce(own, int(nbytes), max(int(gr_b), 1))
        else:
            ready = max(own.values())
            start = dict.fromkeys(union, ready)
            end = dict.fromkeys(union, ready + ring(devices, union, resources).allreduce_s(nbytes))
        events += [SimEvent("tiedreduce", g, stages[-1], -1, start[g], end[g], None, nbytes) for g in union]
        for g in union:
            tied_end[g] = max(tied_end.get(g, 0.0), end[g])
    return events, tied_end


def _optimizer_steps(costs: BlockCosts, devices: DeviceGraph, stage_blocks, stage_gpus, n_p: int, pol,
                     shard_bytes, start: dict, resources: FlowResources,
                     rendezvous: bool) -> tuple[list, dict[int, float]]:
    """``gradient_sync``'s optimizer steps of each GPU from ``start[g]`` (s), one stage after the other
    ([C-optim], [C-offload]), then each group's all-gathers of its ZeRO-1/2 stages' updated weights: the
    "optim" and "allgather" events and each GPU's end (s)."""
    from .engine import SimEvent

    n_s = len(stage_blocks)
    st_b = costs.optim_bytes  # [C-optim] moves 2 x optim_bytes per parameter
    sh_b, pa_b = costs.shardable_bytes_per_param, costs.param_bytes_per_param  # pa_b: a tied (float32) copy
    events: list = []
    done: dict[int, float] = {}  # per GPU: its optimizer steps and its group's all-gathers ended
    for p in range(n_p):
        stages_p = list(range(p, n_s, n_p))
        gpus = stage_gpus[p]
        ring_p = ring(devices, gpus, resources, rendezvous=rendezvous)
        t_opt = 0.0
        for k, g in enumerate(gpus):
            t0 = start[g]
            for s in stages_p:
                i, j = stage_blocks[s]
                params = unique_params(costs, i, j)  # a tied parameter once per stage ([C-tied])
                # A shard of z MiB holds z MiB / shardable_bytes_per_param parameters ([C-optim]; at the
                # float32 rate, an upper bound for 16-bit working weights: tables.IntTables.opt_per_mib).
                moved = ((2 * st_b * shard_bytes[s][k] / sh_b if sh_b else 0.0) if pol.memory[s].zero
                         else 2 * st_b * params)
                t1 = t0 + moved / devices.mem_bw_bytes_per_s[g]
                if pol.memory[s].optimizer == "host":  # [C-offload]: its parameters' gradients down, CPU AdamW,
                    # weights back, in turn
                    if pol.memory[s].zero:  # its shard's share of the parameters (objective.offload_host_kib)
                        params = params * shard_bytes[s][k] / max(sum(shard_bytes[s]), 1)
                    moved = OFFLOAD_BYTES_PER_PARAM * params
                    t1 = t0 + params * (OFFLOAD_LINK_BYTES / devices.host_link_bytes_per_s[g]
                                        + 2 * st_b / devices.host_mem_bw_bytes_per_s[g])
                events.append(SimEvent("optim", g, s, -1, t0, t1, None, int(round(moved))))
                t0 = t1
            t_opt = max(t_opt, t0)
            done[g] = t0
        for s in stages_p:  # all-gather the updated weights once the group's steps ended (not ZeRO-3's)
            if 1 <= pol.memory[s].zero < 3:
                i, j = stage_blocks[s]
                moved = (sum(costs.gather_bytes(b) for b in range(i, j))  # a tied parameter once ([C-tied])
                         - pa_b * (sum(costs.param_count[i:j]) - unique_params(costs, i, j)))
                if rendezvous:  # Gloo: one binomial-tree broadcast per shard, parts as the shards
                    z = shard_bytes[s]
                    t1 = t_opt + gloo_unequal_allgather_s(devices, gpus, [moved * x / max(sum(z), 1) for x in z]
                                                          if sum(z) else [moved / len(gpus)] * len(gpus), resources)
                else:
                    t1 = t_opt + ring_p.allgather_s(moved)
                events += [SimEvent("allgather", g, s, -1, t_opt, t1, None, moved) for g in gpus]
                t_opt = t1
                done.update(dict.fromkeys(gpus, t1))
    return events, done


class _GlooWorld:
    """Gloo's collectives over ``used`` replayed as Gloo runs them ([Note: Gloo's collectives as programs] in
    sim/gloo.py): the world's small ones, and a tied parameter's all-reduce over its holders; ``used`` (GPU
    indices) in rank order are the ring's positions, every message paced ([Note: TCP pacing of a
    message])."""

    def __init__(self, devices: DeviceGraph, used: Sequence[int], bytes_per_s: float | None = None):
        """``bytes_per_s``: every hop's bandwidth (a ring's slowest hop, shared links split); default each
        pair's own link."""
        self.used = list(used)
        lat = devices.link_latency_s
        self.latency = lambda a, b: max(lat[used[a]][used[b]], 0.0)

        def transfer_s(a: int, b: int, nbytes: int) -> float:  # [Note: TCP pacing of a message]
            g, h = used[a], used[b]
            bw = devices.link_bw_bytes_per_s[g][h] if bytes_per_s is None else bytes_per_s
            return paced_transfer_s(nbytes, bw, max(lat[g][h], 0.0) + max(lat[h][g], 0.0))

        self.transfer_s = transfer_s

    def _run(self, programs, entry: dict[int, float]) -> dict[int, float]:
        exits = replay(programs, [entry[g] for g in self.used], self.latency, self.transfer_s)
        return dict(zip(self.used, exits))

    def allreduce(self, entry: dict[int, float], nbytes: int, element_bytes: int = 4) -> dict[int, float]:
        n = len(self.used)
        return self._run([allreduce_program(n, k, nbytes, element_bytes) for k in range(n)], entry)

    def allgather(self, entry: dict[int, float], nbytes: int) -> dict[int, float]:
        n = len(self.used)
        return self._run([allgather_program(n, k, nbytes) for k in range(n)], entry)
