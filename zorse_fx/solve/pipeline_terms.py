"""The pipeline terms of interleaved plans: ``forward_units`` (the forward
task of a stage), ``program_ends`` (the runtime's point-to-point program
replayed under NCCL's rules with fixed times: each GPU group's end and each
stage's last backward, integer ns), ``group_sync_units`` (a group's gradient
sync) and ``interleaved_units`` (step and memory of an interleaved decision).
``objective.evaluate_units`` (whose module note is the model; this is its
v > 1 part) calls ``interleaved_units`` when v > 1 (or ``task_graph``:
``solve.interleave.base_makespan_s`` scores the v = 1 plan it starts from by
the same replay).

[Note: interleaved stages]
With interleave degree v the S = P v stages run on P GPU groups, stage s
on group p = s mod P (``ir.schedule.interleaved_1f1b``). Per-stage
terms (compute, boundary, all-reduce, optimizer) are those of the module
note; what changes:

  step  = max_p (max(sync_p, makespan + max_{s = p mod P} tied_s
                 + sum_{s = p mod P} ag_s) + sum_{s = p mod P} optim_s)
                 (tied_s, ag_s: [C-tied], the sharded stages' all-gathers
                 follow the optimizer; a group holding none: sync_p + ...)
          free_p = the end of group p's last task and its last sends in
                   the runtime's point-to-point program replayed under
                   NCCL's rules (``program_ends``), makespan = max_p free_p:
                   a tied ring (over several groups) starts when the
                   pipeline has drained ([C-objective]);
          sync_p = max(free_p, the end of the group's own gradient
                   sync: ``group_sync_units``): its buckets in the
                   runtime's order (its stages s = p mod P, the last
                   first), bucket q at max(the end of q - 1, the latest
                   lastB_s of the stages whose gradients q holds) + q's
                   KiB share of those stages' bandwidth terms + 2 (k - 1)
                   lat_max; lastB_s = the end of stage s's last backward
                   in that replay (its gradients are final: the
                   runtime and ``sim/sync.py`` start its buckets then,
                   or earlier, block by block during that backward; the
                   interleaved cooldown ends the group's stages one
                   after the other, so their rings overlap the group's
                   remaining backwards);
          the group's gradients fill one sequence of buckets across
          its stages (``runtime/grad_sync.py``: one key per holder set;
          ``sim/sync.py``'s ``_reduction``), so the bucket count of
          [C-allreduce] is that of the group's G = sum of its stages'
          G_s, not the sum of the stages' counts (the bandwidth
          terms and the ZeRO-1 all-gathers stay per stage; every
          stage of a group has the group's k and lat_max);
          ``allreduce_s`` reported per stage keeps its own count
          nb(G_s);
          where the forward of stage s takes f_s = its slowest GPU's
          forward (the forward tables ``rc_work_prefix`` / ``rc_fixed_prefix``:
          ``BlockCosts``' own split of each block, 1/3 where it gives
          none), the backward cmax_s - f_s (the rest of its compute and
          the re-run forward) and a message across the cut after s h_s =
          boundary_s / 2 (one direction), and the program's rules decide
          when each starts: a message once both ends have posted its
          group, a compute once the groups holding its receives -- and
          the sends fused with them -- have completed;
  memory_g = sum over g's stages of their state (replicated, or the
          shard) + max over the moments of ``schedule.live_profile`` of
          sum_c live_c * held_{p + cP} (+ rerun of the backward's chunk)
          held_s = n_g A_s, or n_g X_s on a recomputing stage;
          rerun_s = n_g A_s on a recomputing stage, else 0.

Why a replay and not a closed form: for P equal groups of v equal
chunks of time t and buffered sends the makespan is (M v + P - 1) t --
the 1F1B bubble of (P - 1) stage times shrinks to (P - 1) / v of them
(Narayanan et al., SC'21, section 2.2.2) -- but where a group's chunks
are unequal the chunks of different groups stall each other in the
steady state (the closed form M max_p T_p + (sum T - max T) / v was up
to 45% below the simulator), and under NCCL's rules the fused groups
hold a rank's next compute until its peer has posted the matching
receive, which stalls even on free links (4 groups of equal chunks:
tests/test_sim_interleaved.py). The task graph of buffered sends with
the boundary charged on the sending task was 10% optimistic against the
runtime's NCCL program on the 8-GPU scaling plan and 30% on the 256-GPU
one (bench/README.md "The runtime's NCCL program in the simulator"). Links shared by two
boundaries (P = 2: 0 -> 1 and the wrap-around 1 -> 0 on one node pair)
are not modelled. A group's buckets run one after the other,
each from the last backwards of the stages it holds (sync_p): the runtime
launches a bucket once its parameters are final ([Note: overlapped
gradient reduction] in ``runtime/grad_sync.py``); charging the whole
group's sync after its last task was 8% pessimistic on the 8-GPU
scaling plan (bench/README.md, "Interleaved stages' gradient sync").
The memory term
is the schedule's exact peak (the simulator tracks the same moments and
agrees to the KiB). The CP-SAT models and the DP do not choose v:
``solve.interleave`` re-cuts a finished plan's groups into P v stages and
keeps the result when this objective -- compared against the same
makespan of the plan it started from -- says it is faster. Every GPU's
row in each of its stages carries its whole memory.
"""

from __future__ import annotations

import functools

import numpy as np

from .objective import StageUnits, act_units, bucket_count, stash_units

__all__ = ["forward_units", "program_ends", "group_sync_units", "interleaved_units"]


def forward_units(tab, stage_blocks, stage_gpus, samples, bnd) -> tuple[int, ...]:
    """Per stage: its slowest GPU's forward (the forward tables) +
    floor(boundary / 2), the forward task of [Note: interleaved stages]."""
    out = []
    for (i, j), gpus, ns, b in zip(stage_blocks, stage_gpus, samples, bnd):
        f = max(n * (tab.rc_work_prefix[tab.gpu_types[g]][j] - tab.rc_work_prefix[tab.gpu_types[g]][i])
                + tab.rc_fixed_prefix[tab.gpu_types[g]][j] - tab.rc_fixed_prefix[tab.gpu_types[g]][i]
                for g, n in zip(gpus, ns))
        out.append(f + b // 2)
    return tuple(out)


@functools.lru_cache(maxsize=32)
def _one_rank_programs(schedule: str, num_microbatches: int, interleave: int, num_stages: int):
    """(programs, where) of ``program_ends``: the runtime's program for one rank per GPU group
    (``ir.p2p.programs_from``: its deadlock repairs are the slow part, and the program
    depends on the shape alone, so it is built once per shape), and per (is_send, message)
    the (rank, group) holding it.

    Raises:
        ValueError: the program deadlocks."""
    from ..ir.p2p import ProgramError, programs_from, route_messages
    from ..ir.schedule import make_schedule

    n_s, n_p = num_stages, num_stages // interleave
    sched = make_schedule(schedule, n_s, num_microbatches, interleave)
    # One rank per GPU group holding the whole micro-batch as one row of one byte: the runtime's
    # routing (``route_messages``) then gives one message per action and neighbour.
    ranks, ranges, row_bytes = [(s % n_p,) for s in range(n_s)], [((0, 1),)] * n_s, (1,) * (n_s - 1)
    built = {p: (acts, [route_messages(a, p + a.chunk * n_p, 0, p, ranks, ranges, row_bytes) for a in acts])
             for p, acts in enumerate(sched)}
    try:
        progs = programs_from(built)
    except ProgramError as exc:
        raise ValueError(f"schedule {schedule!r} (interleave {interleave}): {exc}") from exc
    where = {(op.send, op.message): (r, gi) for r, pr in progs.items() for gi, grp in enumerate(pr.groups)
             for op in grp}
    return progs, where


def program_ends(schedule: str, num_microbatches: int, interleave: int, fwd, bwd, half):
    """The runtime's point-to-point program replayed under NCCL's rules with
    fixed times: ``(free, last_backward)`` (units): ``free[p]`` when GPU group
    p's last task and its last messages have ended, ``last_backward[s]`` when
    stage s's last backward ended (its gradients are final), for
    P = S / ``interleave`` GPU groups, one rank each, with a forward of
    ``fwd[s]``, a backward of ``bwd[s]`` and a message across the cut after
    stage s of ``half[s]`` units (one direction, either way).

    The program is ``ir.p2p.programs_from``'s (fused groups, receives
    prefetched where interleaving needs it) and the rules the simulator's
    ``p2p="nccl"`` ([Note: point-to-point models] in sim/engine.py): group k
    of a rank is posted when its action k - 1 ends and reaches the head of the
    rank's stream when group k - 1 has completed; a message runs from the
    later of its two groups' head times for ``half`` units (no contention:
    the groups' links are the stages' own); a group completes when its
    messages have; action k starts when action k - 1 has ended and every
    group holding its receives has completed. Without contention every time
    is a max of earlier times plus a duration, so the replay does not depend
    on the order it visits ranks in.

    Raises:
        ValueError: the program deadlocks (``ir.p2p.ProgramError``).

    Evaluated on the shape's ``_Tape`` ([Note: replay tape]), which equals
    ``replay_program`` with integer times (tests/test_interleave.py)."""
    tape = _tape(schedule, num_microbatches, interleave, len(fwd))
    return tape.run(fwd, bwd, half)


class _Concrete:
    """``replay_program``'s algebra on integer times (units)."""

    def __init__(self, fwd, bwd, half):
        self.dur = {"F": fwd, "B": bwd, "H": half}
        self.zero = 0

    def max(self, xs):
        return max(xs)

    def add(self, x, kind: str, index: int):
        return x + self.dur[kind][index]


class _Symbolic:
    """``replay_program``'s algebra recording a tape: every time is a node
    ``max(deps) + duration`` (node 0: the constant 0)."""

    def __init__(self):
        self.deps: list[tuple[int, ...]] = [()]
        self.dur: list[tuple[str, int] | None] = [None]
        self.zero = 0

    def _node(self, deps, dur) -> int:
        self.deps.append(tuple(deps))
        self.dur.append(dur)
        return len(self.deps) - 1

    def max(self, xs):
        xs = tuple(dict.fromkeys(xs))
        return xs[0] if len(xs) == 1 else self._node(xs, None)

    def add(self, x, kind: str, index: int):
        return self._node((x,), (kind, index))


def replay_program(schedule: str, num_microbatches: int, interleave: int, num_stages: int, alg):
    """``program_ends``' replay in the algebra ``alg`` (``_Concrete``: integer
    times; ``_Symbolic``: a tape). Returns (free, last_backward) as ``alg``'s values."""
    n_s = num_stages
    n_p = n_s // interleave
    progs, where = _one_rank_programs(schedule, num_microbatches, interleave, n_s)
    zero = alg.zero
    head_at: dict[tuple[int, int], object] = {}  # (rank, group) -> when it reached its stream's head
    done_at: dict[tuple[int, int], object] = {}  # (rank, group) -> when it completed
    posted = {r: [zero] for r in progs}  # per rank, when each group was posted (group 0 at 0)
    head = dict.fromkeys(progs, 0)  # per rank: its first group not yet completed
    end_of: dict = {}  # Message -> its arrival
    pc = dict.fromkeys(progs, 0)
    free = dict.fromkeys(progs, zero)
    last_b: list[list] = [[] for _ in range(n_s)]
    moved = True
    while moved:
        moved = False
        for r, pr in progs.items():
            while head[r] < len(posted[r]):  # the stream: complete its head groups
                gi = head[r]
                if (r, gi) not in head_at:
                    head_at[r, gi] = alg.max([posted[r][gi], done_at[r, gi - 1] if gi else zero])
                    moved = True
                ends = []
                for op in pr.groups[gi]:
                    msg = op.message
                    if msg not in end_of:
                        peer = where[not op.send, msg]
                        if peer not in head_at:  # the peer's group has not reached its head yet
                            break
                        end_of[msg] = alg.add(alg.max([head_at[r, gi], head_at[peer]]), "H", msg.boundary)
                    ends.append(end_of[msg])
                else:
                    done_at[r, gi] = alg.max([head_at[r, gi], *ends])
                    head[r] += 1
                    moved = True
                    continue
                break
            k = pc[r]
            if k < len(pr.actions) and all((r, g) in done_at for g in pr.waits[k]):
                a = pr.actions[k]
                s = r + a.chunk * n_p
                start = alg.max([free[r], *(done_at[r, g] for g in pr.waits[k])])
                free[r] = alg.add(start, a.kind, s)
                if a.kind == "B":
                    last_b[s].append(free[r])
                posted[r].append(free[r])  # group k + 1: this action's sends, the next one's receives
                pc[r] += 1
                moved = True
    if any(pc[r] < len(pr.actions) or head[r] < len(pr.groups) for r, pr in progs.items()):
        raise ValueError(f"schedule {schedule!r} (interleave {interleave}): the program's replay is stuck")
    ends = tuple(alg.max([free[r], done_at[r, len(progs[r].groups) - 1]]) for r in range(n_p))
    return ends, tuple(alg.max(b) if b else zero for b in last_b)


class _Tape:
    """[Note: replay tape]
    The replay's times are maxima of earlier times plus one duration each, in
    an order that does not depend on the durations (``program_ends``), so one
    symbolic replay per shape (``_Symbolic``) records them as nodes
    ``max(deps) + duration`` and ``run`` evaluates the nodes level by level
    (a node's level: one more than its deepest dependency's) with one numpy
    step per level: ~25x faster than replaying the program's dictionaries
    (the interleave search scores hundreds of decisions per plan). int64,
    exact for the integer units."""

    def __init__(self, sym: _Symbolic, free, last_b, num_stages: int):
        n = len(sym.deps)
        level = [0] * n
        for v in range(1, n):
            level[v] = 1 + max(level[d] for d in sym.deps[v])
        # duration index into [0, fwd..., bwd..., half...]
        base = {"F": 1, "B": 1 + num_stages, "H": 1 + 2 * num_stages}
        dur = [0 if d is None else base[d[0]] + d[1] for d in sym.dur]
        by_level: dict[int, list[int]] = {}
        for v in range(1, n):
            by_level.setdefault(level[v], []).append(v)
        self.levels = []
        for lv in sorted(by_level):
            nodes = by_level[lv]
            width = max(len(sym.deps[v]) for v in nodes)
            deps = np.zeros((len(nodes), width), dtype=np.int64)  # padded with node 0 (time 0: max unchanged)
            for row, v in enumerate(nodes):
                deps[row, :len(sym.deps[v])] = sym.deps[v]
            self.levels.append((np.asarray(nodes, dtype=np.int64), deps, np.asarray([dur[v] for v in nodes])))
        self.n, self.free, self.last_b = n, np.asarray(free), np.asarray(last_b)

    def run(self, fwd, bwd, half):
        """(free, last_backward) of ``program_ends`` for these durations (units)."""
        durs = np.asarray([0, *fwd, *bwd, *half], dtype=np.int64)
        vals = np.zeros(self.n, dtype=np.int64)
        for nodes, deps, dur in self.levels:
            vals[nodes] = vals[deps].max(axis=1) + durs[dur]
        return tuple(int(x) for x in vals[self.free]), tuple(int(x) for x in vals[self.last_b])


@functools.lru_cache(maxsize=64)
def _tape(schedule: str, num_microbatches: int, interleave: int, num_stages: int) -> _Tape:
    """The shape's ``_Tape`` (built once per shape)."""
    sym = _Symbolic()
    free, last_b = replay_program(schedule, num_microbatches, interleave, num_stages, sym)
    return _Tape(sym, free, last_b, num_stages)


def group_sync_units(stages, last_b, ar, grad_kib, ring_lat, sharded, caps) -> int:
    """When (units) a GPU group's own gradient sync ends (sync_p of [Note:
    interleaved stages]): the group's float32 gradients, its ``stages`` in
    reverse plan order, in the buckets of ``caps`` (KiB: the first, then
    every other), each bucket ready at the latest ``last_b`` (last backward
    end) of the stages it holds gradients of and run after the one before:
    t = max(t, ready) + its share of those stages' bandwidth terms + 2
    ``ring_lat`` (a ring's 2 (k - 1) latencies); then a sharded stage's
    all-gather latency. Stage s's bandwidth term bw_s = ``ar[s]`` less its
    latencies (2 nb_s + sh_s) ``ring_lat[s]``; a bucket over its KiB [a, b)
    takes ceil(bw_s (b - lo_s) / G_s) - ceil(bw_s (a - lo_s) / G_s), so the
    shares add up to bw_s. With every stage ready at 0 the sync is the sum of
    the stages' terms with the group's bucket count (``bucket_count`` of the
    summed KiB); with one stage, ``last_b`` + its term."""
    order = list(reversed(stages))
    lat = ring_lat[stages[0]]
    bw = {s: ar[s] - (2 * bucket_count(grad_kib[s], caps) + sharded[s]) * ring_lat[s] for s in order}
    total = sum(grad_kib[s] for s in order)
    tail = sum(bw[s] for s in order if grad_kib[s] == 0) + sum(sharded[s] for s in order) * lat
    if total == 0:  # no gradients: the one (empty) bucket [C-allreduce] counts, once every stage is done
        return max(last_b[s] for s in order) + 2 * lat + tail
    first, cap = caps
    edges = [0, min(first, total)]
    while edges[-1] < total:
        edges.append(min(edges[-1] + cap, total))
    spans, lo = [], 0
    for s in order:  # stage s holds KiB [lo, lo + G_s) of the sequence
        if grad_kib[s]:
            spans.append((s, lo, lo + grad_kib[s]))
        lo += grad_kib[s]
    t = 0
    for a, b in zip(edges, edges[1:]):
        held = [(s, x, y) for s, x, y in spans if x < b and y > a]
        # telescoping shares: ceil(bw_s (b - x) / G_s) - ceil(bw_s (a - x) / G_s), a stage's sum is bw_s
        work = sum(-(-bw[s] * (min(y, b) - x) // (y - x)) + -bw[s] * (max(x, a) - x) // (y - x)
                   for s, x, y in held)
        t = max(t, max(last_b[s] for s, _, _ in held)) + work + 2 * lat
    return t + tail


def interleaved_units(tab, stage_blocks, stage_gpus, samples, pol, *, v, comp, bnd, stage, ar, opt, mem, unc,
                      tied=None, buckets, gather) -> StageUnits:
    """Step and memory of a decision with interleave degree ``v`` ([Note:
    interleaved stages] in this module). Per stage (S of them): ``comp``,
    ``bnd``, ``stage``, ``ar``, ``opt``, ``unc``: ``objective.evaluate_units``'
    compute, boundary, compute + boundary, all-reduce, optimizer and
    uncovered terms; ``mem[s][k]``: the one-stage memory of the stage's k-th
    GPU; ``tied[s]``: the stage's cross-group tied ring (None: none);
    ``buckets``: (G_s KiB, (k - 1) lat_max) per stage; ``gather``: each
    sharded stage's all-gather (0 for the others). Integer ns and KiB."""
    n_s = len(stage_blocks)
    tied = tied or [None] * n_s  # None: the stage holds no tied parameter of two groups
    step = _interleaved_step(tab, stage_blocks, stage_gpus, samples, pol, v=v, comp=comp, bnd=bnd, ar=ar,
                             opt=opt, tied=tied, buckets=buckets, gather=gather)
    memory = _interleaved_memory(tab, stage_blocks, stage_gpus, samples, pol, v=v, mem=mem)
    return StageUnits(compute=tuple(comp), boundary=tuple(bnd), stage=stage,
                      allreduce=tuple(a if t is None else max(a, t) for a, t in zip(ar, tied)),
                      optim=tuple(opt), memory=memory, step=step, uncovered=tuple(unc))


def _interleaved_step(tab, stage_blocks, stage_gpus, samples, pol, *, v, comp, bnd, ar, opt, tied, buckets,
                      gather) -> int:
    """The note's ``step`` = max_p (max(sync_p, makespan + tied + ag) + optim)."""
    n_s, m = len(stage_blocks), tab.num_microbatches
    groups = n_s // v
    fwd = [f - b // 2 for f, b in zip(forward_units(tab, stage_blocks, stage_gpus, samples, bnd), bnd)]
    grad_kib, ring_lat = buckets  # per stage: G_s (KiB) and (k - 1) lat_max, from evaluate_units
    # [C-tied]: a group's optimizer steps wait for its own reductions and the tied ones it holds.
    free, last_b = program_ends(tab.schedule, m, v, fwd, [c - f for c, f in zip(comp, fwd)], [b // 2 for b in bnd])
    ends = []
    for p in range(groups):
        own = max(free[p], group_sync_units(list(range(p, n_s, groups)), last_b, ar, grad_kib, ring_lat,
                                            [mem.zero >= 1 for mem in pol.memory], tab.bucket_caps))
        held = [t for t in tied[p::groups] if t is not None]
        # the group's sharded stages all-gather after their optimizer steps, so after a tied ring too
        ag = sum(gather[p::groups])
        ready = max([own, *(max(free) + t + ag for t in held)])
        ends.append(ready + sum(opt[p::groups]))
    return max(ends)


def _interleaved_memory(tab, stage_blocks, stage_gpus, samples, pol, *, v, mem) -> tuple[tuple[int, ...], ...]:
    """The note's ``memory_g``, in every row of each of g's stages."""
    from ..ir.schedule import live_profile

    n_s, m = len(stage_blocks), tab.num_microbatches
    groups = n_s // v
    memory = [list(row) for row in mem]
    for p in range(groups):
        profile = live_profile(tab.schedule, n_s, m, v, p)
        acts: dict[int, int] = {}  # samples -> the group's peak in-flight activations of a GPU taking them
        for k, (g, n) in enumerate(zip(stage_gpus[p], samples[p])):
            state, held, rerun = 0, [], []
            for s in range(p, n_s, groups):
                i, j = stage_blocks[s]
                a = tab.act_prefix[j] - tab.act_prefix[i]
                sm = pol.memory[s]
                if sm.stash == "host":  # [C-stash]: the received and sent tensors held, one block re-run in B
                    st = stash_units(tab, s, n_s, i, j, n)
                    state += mem[s][k] - st.device
                    held.append(st.held)
                    rerun.append(st.peak)
                    continue
                own = act_units(tab, s, n_s, i, n, a, recompute=sm.recompute, offload=sm.activations == "host")
                state += mem[s][k] - own
                if sm.activations == "host":  # [C-act-offload]: none held between F and B, one micro-batch's in B
                    held.append(0)
                    rerun.append(n * a)
                elif sm.recompute:
                    held.append(n * (tab.cut_kib[i] if s > 0 else 0))
                    rerun.append(n * a)
                else:
                    held.append(n * a)
                    rerun.append(0)
            if n not in acts:  # held and rerun depend on the GPU only through n
                acts[n] = max(sum(c * h for c, h in zip(live, held)) + (rerun[b] if b >= 0 else 0)
                              for live, b in profile)
            for s in range(p, n_s, groups):
                memory[s][k] = state + acts[n]
    return tuple(tuple(r) for r in memory)
