"""Gloo's small world collectives replayed operation by operation (zorse_fx/sim/gloo.py, [Note: Gloo's
collectives as programs]) and the simulator's steady state under Gloo ([Note: the steady state under
Gloo] in zorse_fx/sim/engine.py)."""

from __future__ import annotations

import pytest

from zorse_fx.ir.costs import BlockCosts, TiedParam
from zorse_fx.ir.decision import Decision
from zorse_fx.sim import simulate
from zorse_fx.sim.gloo import Op, allgather_program, allreduce_program, replay

from conftest import make_devices, solver_options

D = 1e-3


def _free(a, b, nbytes):
    return 0.0


def test_one_element_allreduce_is_a_chain_of_hops():
    """gloo/allreduce.cc's ring with 2 n segments: a 4-byte all-reduce has one non-empty segment, so only
    its owner's chain moves: reduce-scatter n-1 -> ... -> 0, all-gather 0 -> n-1 -> ... -> 1. All four ranks
    enter at 0, every hop d: 3->2 leaves at d (2's ready crossed the link) and arrives 2d, 2->1 arrives 3d,
    1->0 4d; 0->3 leaves at 4d (3's all-gather receive was posted at d, after its send left) and arrives 5d,
    3->2 6d, 2->1 7d. Rank 0 leaves at 4d (its last send left then), 3 at 5d, 2 at 6d, 1 at 7d."""
    assert allreduce_program(4, 0, 4) == [Op("recv", 1, 4), Op("wait_recv"), Op("send", 3, 4), Op("wait_send")]
    assert allreduce_program(4, 1, 4) == [Op("recv", 2, 4), Op("wait_recv"), Op("send", 0, 4), Op("wait_send"),
                                          Op("recv", 2, 4), Op("wait_recv")]
    programs = [allreduce_program(4, r, 4) for r in range(4)]
    out = replay(programs, [0.0] * 4, lambda a, b: D, _free)
    assert out == pytest.approx([4 * D, 7 * D, 6 * D, 5 * D], rel=1e-12)
    assert allreduce_program(1, 0, 4) == [] and allgather_program(1, 0, 64) == []


def test_replay_reproduces_the_box_measured_exits():
    """Box case b_wan_shared (bench/LOG.md "Gloo's small collectives, rank by rank"): ranks 0, 1 in region 1,
    2, 3 in region 2, 200 ms one way between the regions (0.2 ms inside one). Each rank's entry into the
    gradient norm's all-reduce as measured in one step of two plans, and into the next all-gather of the
    ranks' records; the replay gives each rank's measured exit within 5 ms (the measured ones include the
    host's few ms between the operations)."""
    def lat(a, b):
        return 0.2 if (a < 2) != (b < 2) else 0.0002

    ar = [allreduce_program(4, r, 4) for r in range(4)]
    for entry, measured in (([2.517, 1.398, 0.914, 2.341], [2.542, 2.946, 2.744, 2.743]),   # flashflex
                            ([0.800, 2.252, 2.410, 1.246], [2.654, 3.056, 2.855, 2.853])):  # zorse_paper
        assert replay(ar, entry, lat, _free) == pytest.approx(measured, abs=5e-3)
    ag = [allgather_program(4, r, 512) for r in range(4)]
    assert replay(ag, [2.545, 2.949, 2.747, 2.746], lat, _free) == pytest.approx([3.752, 3.751, 3.952, 3.551],
                                                                                  abs=5e-3)


def test_allgather_by_hand_and_bytes():
    """Two ranks, each part in two chunks of 50 bytes, latency d, 1e-4 s per byte: both post both chunks at 0;
    each chunk leaves at d (the peer's ready crossed the link) and arrives d + 5 ms later, the two chunks one
    after the other in flight: every rank leaves at 2d + 5 ms (its receives' arrival)."""
    programs = [allgather_program(2, r, 100) for r in range(2)]
    assert [o.kind for o in programs[0]] == ["send", "recv", "send", "recv", "wait_send", "wait_recv",
                                             "wait_send", "wait_recv"]
    out = replay(programs, [0.0, 0.0], lambda a, b: D, lambda a, b, nbytes: 1e-4 * nbytes)
    assert out == pytest.approx([2 * D + 5e-3] * 2, rel=1e-12)


def test_replay_names_a_deadlock():
    programs = [[Op("recv", 1, 4), Op("wait_recv")], [Op("recv", 0, 4), Op("wait_recv")]]
    with pytest.raises(RuntimeError, match=r"Gloo programs deadlocked: ring positions \[0, 1\] wait at "
                                           r"operations \[1, 1\]"):
        replay(programs, [0.0, 0.0], lambda a, b: D, _free)


def test_steady_state_period_and_skewed_starts():
    """Four one-GPU stages on two nodes each side of a 50 ms link, under Gloo with the step's control
    collectives: the replay settles where every rank starts its step when its part of the last record
    all-gather ended, so the ranks start at different times (the earliest at 0) and each rank's step, start
    to end of its all-gather, is the period ``step_time_s``; NCCL's pricing starts every rank at 0."""
    t = 4 * D
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (t,) * 4}, param_count=(1000,) * 4, act_bytes_per_sample=(0,) * 4,
                       cut_bytes_per_sample=(0, 1000, 1000, 1000, 0), step_control_rounds=3)
    devices = make_devices(["A"] * 4, ["n0", "n1", "n2", "n3"], [1 << 30] * 4, [1e12] * 4, inter=(1e8, 50 * D))
    dec = Decision(stage_blocks=((0, 1), (1, 2), (2, 3), (3, 4)), stage_gpus=((0,), (1,), (2,), (3,)),
                   samples_per_microbatch=((1,),) * 4, num_microbatches=2)
    opts = solver_options(global_batch_size=2)
    gloo = simulate(costs, devices, opts, dec, p2p="gloo")
    assert min(gloo.start_s) == 0.0 and len(set(gloo.start_s)) > 1  # skewed starts, from the earliest
    for g in range(4):
        assert all(e.start_s >= gloo.start_s[g] - 1e-12 for e in gloo.events if e.gpu == g)
        end = max(e.end_s for e in gloo.events if e.gpu == g and e.kind == "control")
        assert end - gloo.start_s[g] == pytest.approx(gloo.step_time_s, rel=1e-9)  # the period, on every rank
    nccl = simulate(costs, devices, opts, dec, p2p="nccl")
    assert nccl.start_s == (0.0,) * 4


def test_receivers_ready_waits_behind_data_on_the_reverse_connection():
    """[Note: Gloo's ready behind data]: two 1-GPU stages, 1F1B, two micro-batches, F 1 ms and B 2 ms per
    stage, d = 5 ms, every message 10 ms on the wire. Stage 1 ends B0 and posts its group: g0's send and a1's
    receive at once; a1's ready goes 1 -> 0 on the connection g0's data is crossing, behind it, so it reaches
    stage 0 with g0's last byte, and a1 leaves then: it arrives d + 10 ms after g0 (measured so on box case
    (a), bench/LOG.md "Gloo's small collectives, rank by rank"; the box's duplex check showed each
    direction's data at full rate, so only the ready is held up)."""
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (3 * D, 3 * D)}, param_count=(0, 0),
                       act_bytes_per_sample=(100, 100), cut_bytes_per_sample=(0, 10_000, 0))
    devices = make_devices(["A", "A"], ["n0", "n1"], [1 << 30] * 2, [1e12] * 2, inter=(1e6, 5 * D))
    dec = Decision(stage_blocks=((0, 1), (1, 2)), stage_gpus=((0,), (1,)), samples_per_microbatch=((1,), (1,)),
                   num_microbatches=2)
    sim = simulate(costs, devices, solver_options(global_batch_size=2, schedule="1f1b"), dec, p2p="gloo")
    sends = {(e.gpu, e.microbatch): e for e in sim.events if e.kind == "send"}
    g0, a1 = sends[1, 0], sends[0, 1]
    assert a1.end_s == pytest.approx(g0.end_s + 5 * D + 10 * D, rel=1e-9)
    assert g0.end_s - g0.start_s == pytest.approx(5 * D + 10 * D, rel=1e-9)  # (its ready had crossed before)


def test_a_message_moves_at_most_at_its_paced_window_per_round_trip():
    """[Note: TCP pacing of a message], [Note: a send's notice in flight]: two 1-GPU stages 10 ms apart each
    way on a 1 GB/s link, one micro-batch, F and B 1.5 ms each per stage. The activation (1 MB, posted at 1.5
    ms) leaves when stage 1's ready (posted at 0) arrives, 10 ms: within a round trip of its post, so its
    window is 2.54 messages: all but its first segment at (2.54 MB + 14,480 B) / 20 ms = 127.7 MB/s, not the
    link's 1 GB/s, arriving 20 ms + (1 MB - 1,448 B) / 127.7 MB/s = 27.82 ms. The gradient back (stage 0's
    receive posted at 1.5 ms, long ready) leaves when posted and moves with 1.8 messages: (1 MB - 1,448 B)
    / 90.7 MB/s = 11.01 ms after its latency. A link slower than either pace (1 MB/s) keeps its own rate:
    1 s. NCCL's model paces nothing."""
    from zorse_fx.sim.gloo import INITIAL_WINDOW_BYTES, MSS_BYTES, NOTIFIED_WINDOW_MESSAGES, PACED_WINDOW_MESSAGES

    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (3 * D, 3 * D)}, param_count=(0, 0),
                       act_bytes_per_sample=(100, 100), cut_bytes_per_sample=(0, 1_000_000, 0))
    dec = Decision(stage_blocks=((0, 1), (1, 2)), stage_gpus=((0,), (1,)), samples_per_microbatch=((1,), (1,)),
                   num_microbatches=1)
    opts = solver_options(global_batch_size=1)
    notified = (1e6 - MSS_BYTES) * 20 * D / (NOTIFIED_WINDOW_MESSAGES * 1e6 + INITIAL_WINDOW_BYTES)
    paced = (1e6 - MSS_BYTES) * 20 * D / (PACED_WINDOW_MESSAGES * 1e6 + INITIAL_WINDOW_BYTES)
    assert (notified, paced) == pytest.approx((7.82e-3, 11.01e-3), rel=1e-3)
    for link, fwd_took, bwd_took in ((1e9, notified, paced), (1e6, 1.0, 1.0)):
        devices = make_devices(["A", "A"], ["n0", "n1"], [1 << 30] * 2, [1e12] * 2, inter=(link, 10 * D))
        sim = simulate(costs, devices, opts, dec, p2p="gloo")
        sends = {e.gpu: e for e in sim.events if e.kind == "send"}
        assert sends[0].end_s == pytest.approx(20 * D + fwd_took, rel=1e-9)
        assert sends[1].end_s - sends[1].start_s == pytest.approx(10 * D + bwd_took, rel=1e-9)
        nccl = simulate(costs, devices, opts, dec, p2p="nccl")
        (fwd,) = [e for e in nccl.events if e.kind == "send" and e.gpu == 0]
        assert fwd.end_s - fwd.start_s == pytest.approx(10 * D + 1e6 / link, rel=1e-9)  # NCCL: not paced


def test_paced_transfer_by_hand():
    """[Note: TCP pacing of a message]: one segment is never held; a 32 KiB message over a 0.4 s round trip
    moves its other 31,320 B at (1.8 x 32 KiB + 14,480 B) / 0.4 s; a 4,000 B one its other 2,552 B at
    (1.8 x 4,000 + 14,480 B) / 0.4 s; a slow link keeps its rate; no round trip, no pacing."""
    from zorse_fx.sim.gloo import paced_transfer_s

    assert paced_transfer_s(1448, 1e9, 0.4) == pytest.approx(1448 / 1e9, rel=1e-12)
    assert paced_transfer_s(32768, 31e6, 0.4) == pytest.approx(31320 * 0.4 / (1.8 * 32768 + 14480), rel=1e-12)
    assert paced_transfer_s(4000, 1e9, 0.4) == pytest.approx(2552 * 0.4 / (1.8 * 4000 + 14480), rel=1e-12)
    assert paced_transfer_s(1e6, 1e6, 0.4) == pytest.approx(1.0, rel=1e-12)
    assert paced_transfer_s(1e6, 1e9, 0.0) == pytest.approx(1e-3, rel=1e-12)
    with pytest.raises(ValueError, match="link bandwidth must be > 0 bytes/s, got 0"):
        paced_transfer_s(10, 0.0, 0.1)


def test_tied_allreduce_replayed_from_each_holders_entry():
    """A tied embedding on stage 0 (GPU 0, node n0) and stage 1 (GPU 1, node n1), d = 200 ms each way at
    31 MB/s (box case (b)'s WAN): under Gloo its gradient (131,072 B) is gloo's 2-rank ring of four 32 KiB
    messages, each paced (p = 31,320 B x 0.4 s / (1.8 x 32 KiB + 14,480 B) = 0.1705 s), replayed from each
    GPU's own entry. GPU 1 enters first (E1); GPU 0 at E0 >= E1 + d (its backward waits for GPU 1's gradient). By
    hand: reduce-scatter, GPU 0's sends leave at E0 (GPU 1's readies long there) and arrive E0 + d + p;
    GPU 1's leave when GPU 0's readies crossed, E0 + d, and arrive E0 + 2d + p; so GPU 1 enters the
    all-gather at E0 + d + p, GPU 0 at E0 + 2d + p. All-gather: GPU 0's sends leave at E0 + 2d + p and
    arrive E0 + 3d + 2p (GPU 1 leaves then); GPU 1's wait for GPU 0's readies, E0 + 3d + p, and arrive
    E0 + 4d + 2p (GPU 0 leaves then). Measured so on box (b) (bench/LOG.md "A tied parameter's all-reduce,
    paced"). NCCL's pricing keeps one ring from the last entry, one end for both."""
    from zorse_fx.sim.gloo import paced_transfer_s

    d = 200 * D
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (3 * D, 3 * D)}, param_count=(32768, 32768),
                       act_bytes_per_sample=(0, 0), cut_bytes_per_sample=(0, 100, 0),
                       tied_params=(TiedParam(name="wte.weight", blocks=(0, 1), numel=32768),))
    devices = make_devices(["A", "A"], ["n0", "n1"], [1 << 30] * 2, [1e12] * 2, inter=(31e6, d))
    dec = Decision(stage_blocks=((0, 1), (1, 2)), stage_gpus=((0,), (1,)), samples_per_microbatch=((1,), (1,)),
                   num_microbatches=1)
    opts = solver_options(global_batch_size=1)
    gloo = simulate(costs, devices, opts, dec, p2p="gloo")
    tied = {e.gpu: e for e in gloo.events if e.kind == "tiedreduce"}
    assert set(tied) == {0, 1} and all(e.nbytes == 131072 for e in tied.values())
    e0, e1 = tied[0].start_s, tied[1].start_s
    assert e0 >= e1 + d
    p = paced_transfer_s(32768, 31e6, 2 * d)
    assert p == pytest.approx(31320 * 0.4 / (1.8 * 32768 + 14480), rel=1e-12)
    assert tied[0].end_s == pytest.approx(e0 + 4 * d + 2 * p, rel=1e-12)
    assert tied[1].end_s == pytest.approx(e0 + 3 * d + 2 * p, rel=1e-12)
    nccl = simulate(costs, devices, opts, dec, p2p="nccl")
    assert len({e.end_s for e in nccl.events if e.kind == "tiedreduce"}) == 1
