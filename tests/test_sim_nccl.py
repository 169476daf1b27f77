"""The simulator's NCCL point-to-point model (``simulate(p2p="nccl")``,
[Note: point-to-point models] in ``zorse_fx/sim/engine.py``): it replays the
runtime's own point-to-point program (``runtime/p2p.py``) under NCCL's rules --
fused groups in order on each rank's stream, a message moving only while the
groups at both ends are at their heads, a compute waiting for the whole group
holding its receives, sends included -- the simulator's default, where
``p2p="buffered"`` lets a send leave when its task ends, as Gloo does; and the
objective prices it (network_terms.py [Note: pipeline period],
pipeline_terms.program_ends)."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import CLUSTERS, fixed_decision, gpt4x64, make_devices, solver_options

from zorse_fx.cluster import Cluster
from zorse_fx.cost.roofline import block_costs
from zorse_fx.planner import PlanOptions, plan_fixed
from zorse_fx.precision import precision_policy
from zorse_fx.runtime.p2p import build_programs
from zorse_fx.sim import simulate
from zorse_fx.sim.engine import decision_programs
from zorse_fx.solve import BlockCosts, Decision

GIB = 1 << 30
MS = 1e-3


def _two_stage(m=3, x_ms=3.0):
    """Two 1-GPU stages on two nodes (1 Gbyte/s, no latency): F 1 ms, B 2 ms
    per micro-batch of one sample; each boundary message takes ``x_ms``."""
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (3 * MS, 3 * MS)}, param_count=(0, 0),
                       act_bytes_per_sample=(100, 100), cut_bytes_per_sample=(0, int(x_ms * 1e6), 0))
    devices = make_devices(["A", "A"], ["n0", "n1"], [GIB] * 2, [1e12] * 2, inter=(1e9, 0.0))
    dec = Decision(stage_blocks=((0, 1), (1, 2)), stage_gpus=((0,), (1,)), samples_per_microbatch=((1,), (1,)),
                   num_microbatches=m)
    return costs, devices, solver_options(global_batch_size=m), dec


def test_two_stage_exchange_by_hand():
    """1F1B, M = 3, F 1, B 2, one message 3 (ms). Stage 0 runs F0 F1 B0 F2 B1 B2,
    stage 1 F0 B0 F1 B1 F2 B2; group k of a rank = the sends of action k-1 + the
    receives of action k.

    NCCL: a0 leaves at 1, arrives 4 (stage 0's F1 has no receive, so it runs 1-2
    and queues a1 with the receive of g0 behind a0). Stage 1: F0 4-5, B0 5-7,
    then its group (g0 out, a1 in) meets stage 0's (a1 out, g0 in): both
    directions 7-10. B0 on stage 0 10-12, F2 12-13; stage 1 F1 10-11, B1 11-13;
    the groups (a2 out, g1 in) / (g1 out, a2 in) move 13-16; stage 1 F2 16-17,
    B2 17-19, g2 19-22; stage 0 B1 16-18 and B2 22-24. Step 24.

    Buffered: a0 alone 1-2 (1/3 done), then a0 and a1 share the link: a0
    arrives 6, a1 7. Stage 1: F0 6-7, B0 7-9 (g0 9-12), F1 9-10, B1 10-12
    (g1 12-15). Stage 0: B0 12-14, F2 14-15 (a2 15-18), B1 15-17; stage 1 F2
    18-19, B2 19-21, g2 21-24; stage 0 B2 24-26. Step 26: the two warm-up
    messages sharing the link hold the first backward back longer than the
    NCCL stream's one at a time."""
    costs, devices, opts, dec = _two_stage()
    nccl = simulate(costs, devices, opts, dec, p2p="nccl")
    assert nccl.step_time_s == pytest.approx(24 * MS, rel=1e-9)
    spans = {(e.gpu, e.kind, e.microbatch): (e.start_s / MS, e.end_s / MS) for e in nccl.events if e.kind in "FB"}
    want = {(0, "F", 0): (0, 1), (0, "F", 1): (1, 2), (0, "B", 0): (10, 12), (0, "F", 2): (12, 13),
            (0, "B", 1): (16, 18), (0, "B", 2): (22, 24),
            (1, "F", 0): (4, 5), (1, "B", 0): (5, 7), (1, "F", 1): (10, 11), (1, "B", 1): (11, 13),
            (1, "F", 2): (16, 17), (1, "B", 2): (17, 19)}
    assert spans.keys() == want.keys()
    for k, (a, b) in want.items():
        assert spans[k] == (pytest.approx(a), pytest.approx(b)), k
    # A send event runs from the end of the task that produced it to its arrival.
    sends = {(e.gpu, e.microbatch): (e.start_s / MS, e.end_s / MS) for e in nccl.events if e.kind == "send"}
    assert sends[0, 1] == (pytest.approx(2), pytest.approx(10))  # a1: queued behind a0, then met at 7
    assert sends[1, 0] == (pytest.approx(7), pytest.approx(10))  # g0
    buffered = simulate(costs, devices, opts, dec, p2p="buffered")
    assert buffered.step_time_s == pytest.approx(26 * MS, rel=1e-9)
    assert simulate(costs, devices, opts, dec).step_time_s == nccl.step_time_s  # the default: the GPU runtime


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("num_stages", [2, 3])
def test_free_links_give_the_same_step(schedule, num_stages):
    """With zero-byte cuts and no latency a group completes the moment both ends
    post it, so NCCL's rules add nothing: (M + S - 1) stage times, as buffered."""
    t, m = 6e-3, 4
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (t,) * num_stages}, param_count=(0,) * num_stages,
                       act_bytes_per_sample=(100,) * num_stages, cut_bytes_per_sample=(0,) * (num_stages + 1))
    devices = dataclasses.replace(make_devices(["A"] * num_stages, [f"n{s}" for s in range(num_stages)],
                                               [GIB] * num_stages, [1e12] * num_stages),
                                  link_latency_s=((0.0,) * num_stages,) * num_stages)
    dec = Decision(stage_blocks=tuple((s, s + 1) for s in range(num_stages)),
                   stage_gpus=tuple((s,) for s in range(num_stages)), samples_per_microbatch=((1,),) * num_stages,
                   num_microbatches=m)
    opts = solver_options(global_batch_size=m, schedule=schedule)
    assert simulate(costs, devices, opts, dec, p2p="nccl").step_time_s == pytest.approx((m + num_stages - 1) * t)
    assert simulate(costs, devices, opts, dec, p2p="buffered").step_time_s == pytest.approx((m + num_stages - 1) * t)
    assert simulate(costs, devices, opts, dec, p2p="gloo").step_time_s == pytest.approx((m + num_stages - 1) * t)


def test_gloo_rendezvous_by_hand():
    """``p2p="gloo"``: a message leaves at max(send post, receive post + d)
    and arrives d later (bench/box_p2p.py measured 2 d from the later post on
    the box). Two 1-GPU stages, one micro-batch, F 1 ms, B 2 ms, free
    bandwidth, d = 5 ms. Stage 1 posts its receive of a0 at 0, stage 0 sends
    it at 1: it leaves at max(1, 0 + 5) = 5 and arrives 10; stage 1 runs F0
    10-11, B0 11-13 and sends g0 at 13, whose receive stage 0 posted at 1
    (ready at 6): it leaves at 13 and arrives 18; stage 0's B0 18-20. Step
    20. Buffered and NCCL (a message moves d after both ends posted): a0
    arrives 6, F0 6-7, B0 7-9, g0 arrives 14, B0 14-16: step 16."""
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (3 * MS, 3 * MS)}, param_count=(0, 0),
                       act_bytes_per_sample=(100, 100), cut_bytes_per_sample=(0, 0, 0))
    devices = make_devices(["A", "A"], ["n0", "n1"], [GIB] * 2, [1e12] * 2, inter=(1e9, 5 * MS))
    dec = Decision(stage_blocks=((0, 1), (1, 2)), stage_gpus=((0,), (1,)), samples_per_microbatch=((1,), (1,)),
                   num_microbatches=1)
    opts = solver_options(global_batch_size=1)
    gloo = simulate(costs, devices, opts, dec, p2p="gloo")
    assert gloo.step_time_s == pytest.approx(20 * MS, rel=1e-9)
    spans = {(e.gpu, e.kind): (e.start_s / MS, e.end_s / MS) for e in gloo.events if e.kind in ("F", "B", "send")}
    want = {(0, "F"): (0, 1), (1, "F"): (10, 11), (1, "B"): (11, 13), (0, "B"): (18, 20),
            (0, "send"): (1, 10), (1, "send"): (13, 18)}
    assert spans.keys() == want.keys()
    for k, (a, b) in want.items():
        assert spans[k] == (pytest.approx(a), pytest.approx(b)), k
    for p2p in ("buffered", "nccl"):
        assert simulate(costs, devices, opts, dec, p2p=p2p).step_time_s == pytest.approx(16 * MS, rel=1e-9), p2p
    with pytest.raises(ValueError, match="p2p must be one of 'nccl', 'gloo', 'buffered', got 'eager'"):
        simulate(costs, devices, opts, dec, p2p="eager")


# (stage GPUs, samples per micro-batch, micro-batches, interleave): data-parallel stages with
# unequal shares (many-to-many routes), three stages, and interleaved groups (prefetched receives).
SHAPES = {
    "many_to_many": (((0, 1), (2, 3)), ((1, 2), (2, 1)), 3, 1),
    "3_stages_asymmetric": (((0, 2), (1,), (3,)), ((2, 1), (3,), (3,)), 2, 1),
    "interleaved_unequal_dp": (((0, 1), (2,), (0, 1), (2,)), ((3, 1), (4,), (3, 1), (4,)), 2, 2),
    "interleaved_x4": (((0,), (1,)) * 4, ((1,), (1,)) * 4, 4, 4),
}


def _shape_instance(shape, *, cut_bytes, intra_s, inter_s):
    """(costs, devices, options, decision) of ``SHAPES[shape]``: one block per stage (A: 4 ms, B: 7 ms per
    sample), ``cut_bytes`` per sample across every cut, GPUs A B A B on two nodes (5 GB/s and ``intra_s`` within,
    1 GB/s and ``inter_s`` across)."""
    gpus, samples, m, v = SHAPES[shape]
    n_s = len(gpus)
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (4e-3,) * n_s, "B": (7e-3,) * n_s}, param_count=(10**6,) * n_s,
                       act_bytes_per_sample=(10**5,) * n_s, cut_bytes_per_sample=(0, *(cut_bytes,) * (n_s - 1), 0))
    devices = make_devices(["A", "B", "A", "B"], ["n0", "n0", "n1", "n1"], [GIB] * 4, [1e12] * 4,
                           intra=(5e9, intra_s), inter=(1e9, inter_s))
    dec = Decision(stage_blocks=tuple((s, s + 1) for s in range(n_s)), stage_gpus=gpus,
                   samples_per_microbatch=samples, num_microbatches=m, interleave=v)
    return costs, devices, solver_options(global_batch_size=m * sum(samples[0])), dec


@pytest.fixture(scope="module")
def captured():
    return gpt4x64()


@pytest.mark.parametrize("shape", SHAPES)
def test_the_simulator_replays_the_runtimes_program(captured, shape):
    """``decision_programs`` of a plan's decision is ``build_programs(plan)``: the
    same actions, groups (prefetched receives included) and waits, message by
    message -- only the bytes differ (the plan's packed tensors against the
    cost model's cut bytes)."""
    gpus, samples, m, v = SHAPES[shape]
    gb = m * sum(samples[0])
    dec = fixed_decision(captured, gpus, samples, num_microbatches=m, interleave=v)
    cluster = Cluster.from_yaml(CLUSTERS / "small_hetero.yaml")
    plan, bg = plan_fixed(captured, cluster, PlanOptions(global_batch_size=gb), dec)
    costs = block_costs(bg, {g.type: g.spec for g in cluster.gpus}, precision=precision_policy("fp32"))
    rank_of = {g.gpu: g.rank for st in plan.stages for g in st.gpus}
    runtime = build_programs(plan)
    sim = decision_programs(costs, plan.decision(costs), plan.schedule)
    assert sorted(rank_of[g] for g in sim) == sorted(runtime)

    def shape_of(op):
        msg = op.message
        return (op.send, msg.boundary, msg.microbatch, msg.backward, msg.src if msg.src not in rank_of else
                rank_of[msg.src], rank_of[msg.dst], msg.start, msg.end)

    for g, prog in sim.items():
        ref = runtime[rank_of[g]]
        assert prog.actions == ref.actions
        assert prog.waits == ref.waits
        assert prog.prefetched == ref.prefetched
        assert [[shape_of(op) for op in grp] for grp in prog.groups] == \
            [[(op.send, op.message.boundary, op.message.microbatch, op.message.backward, op.message.src,
               op.message.dst, op.message.start, op.message.end) for op in grp] for grp in ref.groups]
    if shape == "interleaved_x4":
        assert any(p.prefetched for p in sim.values())  # the repaired program, not the fused one


@pytest.mark.parametrize("shape", SHAPES)
def test_a_compute_waits_for_its_whole_group(shape):
    """Under NCCL's rules an action whose group holds receives starts only after
    every message of that group -- the previous action's sends too -- has
    arrived, and no message of a rank's group k + 1 arrives before its group k
    is done (one stream per rank). Checked on every action of every GPU."""
    gpus, samples, m, v = SHAPES[shape]
    n_s = len(gpus)
    costs, devices, opts, dec = _shape_instance(shape, cut_bytes=3 * 10**6, intra_s=1e-5, inter_s=5e-5)
    sim = simulate(costs, devices, opts, dec, p2p="nccl")
    progs = decision_programs(costs, dec, opts.schedule)
    arrival = {(e.gpu, e.peer, e.stage, e.peer_stage, e.microbatch): e.end_s for e in sim.events
               if e.kind == "send"}
    n_p = n_s // v

    def arrived(msg):  # (sender stage, receiving stage): an interleaved GPU pair carries both directions
        c = msg.boundary
        stages = (c + 1, c) if msg.backward else (c, c + 1)
        return arrival[msg.src, msg.dst, *stages, msg.microbatch]

    checked = 0
    for g, prog in progs.items():
        tasks = sorted((e for e in sim.events if e.gpu == g and e.kind in "FB"), key=lambda e: e.start_s)
        group = next(p for p in range(n_p) if g in gpus[p])
        assert [(e.kind, e.microbatch, e.stage) for e in tasks] == \
            [(a.kind, a.microbatch, group + a.chunk * n_p) for a in prog.actions]
        done = [max((arrived(op.message) for op in grp), default=0.0) for grp in prog.groups]
        for k, task in enumerate(tasks):
            for gi in prog.waits[k]:
                assert task.start_s >= done[gi] - 1e-12, (g, k, gi)
                checked += 1
        for gi in range(1, len(prog.groups)):
            for op in prog.groups[gi]:
                assert arrived(op.message) >= max(done[:gi]) - 1e-12
    assert checked > 0


def test_unknown_p2p_model_is_refused():
    costs, devices, opts, dec = _two_stage()
    with pytest.raises(ValueError, match=r"p2p must be one of 'nccl', 'gloo', 'buffered', got 'mpi'"):
        simulate(costs, devices, opts, dec, p2p="mpi")


@pytest.mark.parametrize("shape", SHAPES)
def test_gloo_messages_leave_after_the_receivers_ready_crossed_the_link(shape):
    """``p2p="gloo"`` on every message of every shape: a message's send event
    starts when its group was posted (the end of the action before it) and it
    arrives no earlier than max(send post, receive post + d) + d + bytes / bw,
    the receive's post being the end of the action before its group (0 for
    group 0); every action starts after the receives of the groups it waits
    for arrived (its own receives only: a sender never waits)."""
    costs, devices, opts, dec = _shape_instance(shape, cut_bytes=3 * 10**5, intra_s=2e-3, inter_s=6e-3)
    sim = simulate(costs, devices, opts, dec, p2p="gloo")
    progs = decision_programs(costs, dec, opts.schedule)
    sends = {(e.gpu, e.peer, e.stage, e.peer_stage, e.microbatch): (e.start_s, e.end_s) for e in sim.events
             if e.kind == "send"}
    tasks = {g: sorted((e for e in sim.events if e.gpu == g and e.kind in "FB"), key=lambda e: e.start_s)
             for g in progs}
    posted = {(g, gi): (tasks[g][gi - 1].end_s if gi else 0.0) for g, prog in progs.items()
              for gi in range(len(prog.groups))}
    where = {(op.send, op.message): (g, gi) for g, prog in progs.items() for gi, grp in enumerate(prog.groups)
             for op in grp}
    checked = 0
    for (send, msg), (g, gi) in where.items():
        if not send:
            continue
        c = msg.boundary
        stages = (c + 1, c) if msg.backward else (c, c + 1)
        start, end = sends[msg.src, msg.dst, *stages, msg.microbatch]
        d = devices.link_latency_s[msg.src][msg.dst]
        t_s, t_r = posted[g, gi], posted[where[False, msg]]
        assert start == pytest.approx(t_s)
        assert end >= max(t_s, t_r + d) + d + msg.nbytes / devices.link_bw_bytes_per_s[msg.src][msg.dst] - 1e-12
        checked += 1

    def arrival(msg):
        c = msg.boundary
        return sends[msg.src, msg.dst, *((c + 1, c) if msg.backward else (c, c + 1)), msg.microbatch][1]

    for g, prog in progs.items():
        got = {gi: max((arrival(op.message) for op in grp if not op.send), default=0.0)
               for gi, grp in enumerate(prog.groups)}
        for k, task in enumerate(tasks[g]):
            assert all(task.start_s >= got[gi] - 1e-12 for gi in prog.waits[k])
    assert checked > 0
