"""The point-to-point program ([Note: point-to-point program] in
``ir/p2p.py``): derived from the plan, the same order on both ends of
every channel, and deadlock-free under NCCL's rules (in-order groups per
rank, an operation completes only when its peer's is posted, no tags) for
every plan shape the runtime tests train -- and the checker does catch a
program that would hang or mismatch on NCCL.

The distributed equivalence tests (test_distributed.py,
test_interleaved_runtime.py, test_mixed_precision.py) run these programs on
Gloo with every tag 0 (``p2p.TAG``), i.e. with NCCL's matching."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import fixed_plan

from zorse_fx.capture import capture
from zorse_fx.ir.p2p import ProgramError, _check_channels, _Op, _waits, simulate_nccl
from zorse_fx.models.gpt import GPT, GPTConfig
from zorse_fx.runtime import p2p
from zorse_fx.runtime.p2p import _initial_groups, build_programs


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=32, n_head=4, block_size=16))
    ids = torch.randint(0, 256, (4, 16))
    return capture(model, (ids, ids))


# name: (stage GPUs, samples per micro-batch, micro-batches, global batch, interleave)
SHAPES = {
    "2x1": (((0,), (1,)), ((2,), (2,)), 4, 8, 1),
    "1_then_2_unequal": (((0,), (2, 3)), ((3,), (2, 1)), 4, 12, 1),
    "3_stages_asymmetric": (((0, 2), (1,), (3,)), ((2, 1), (3,), (3,)), 2, 6, 1),
    "4_stages_8_microbatches": (((0,), (1,), (2,), (3,)), ((1,), (1,), (1,), (1,)), 8, 8, 1),
    "many_to_many": (((0, 1), (2, 3)), ((1, 2), (2, 1)), 3, 9, 1),
    "interleaved_2_groups": (((0,), (2,), (0,), (2,)), ((2,), (2,), (2,), (2,)), 4, 8, 2),
    "interleaved_unequal_dp": (((0, 1), (2,), (0, 1), (2,)), ((3, 1), (4,), (3, 1), (4,)), 2, 8, 2),
    "interleaved_3_groups": (((0,), (1,), (2,)) * 2, ((1,), (1,), (1,)) * 2, 6, 6, 2),
    "interleaved_x4": (((0,), (1,)) * 4, ((1,), (1,)) * 4, 4, 4, 4),
    # Micro-batch counts that are not multiples of the group count (issue 31 item 5).
    "interleaved_2_groups_5_microbatches": (((0,), (2,), (0,), (2,)), ((2,), (2,), (2,), (2,)), 5, 10, 2),
    "interleaved_3_groups_4_microbatches_unequal_dp": (((0, 1), (2,), (3,)) * 2, ((1, 1), (2,), (2,)) * 2, 4, 8, 2),
    "interleaved_3_groups_2_microbatches": (((0,), (1,), (2,)) * 3, ((1,), (1,), (1,)) * 3, 2, 2, 3),
}


def _shape_plan(captured, shape, schedule="1f1b"):
    """The plan of ``SHAPES[shape]``, blocks cut evenly."""
    stage_gpus, samples, m, gb, v = SHAPES[shape]
    return fixed_plan(captured, stage_gpus, samples, num_microbatches=m, global_batch_size=gb, interleave=v,
                      schedule=schedule)


def _check_program(plan):
    progs = build_programs(plan)
    assert set(progs) == set(range(plan.world_size))
    groups = {r: [list(g) for g in p.groups] for r, p in progs.items()}
    waits = {r: list(p.waits) for r, p in progs.items()}
    _check_channels(groups)  # raises on a mismatch
    assert simulate_nccl(groups, waits) == []
    for r, prog in progs.items():
        # Every network message of every action is posted exactly once, sends after the
        # action that produces them, receives no later than the action that needs them.
        posted = {(op.send, op.message): k for k, g in enumerate(prog.groups) for op in g}
        for k, (sends, recvs) in enumerate(zip(prog.sends, prog.recvs)):
            for m in sends:
                assert m.src == r and (m.dst == r or posted[True, m] == k + 1)
            for m in recvs:
                assert m.dst == r and (m.src == r or posted[False, m] <= k)
                if m.src != r:
                    assert posted[False, m] in prog.waits[k]
        assert len(posted) == sum(1 for k in range(len(prog.actions)) for m in prog.sends[k] + prog.recvs[k]
                                  if m.src != m.dst)
    return progs


@pytest.mark.parametrize("shape,schedule", [(shape, schedule) for shape in sorted(SHAPES)
                                            for schedule in ("1f1b", "gpipe")
                                            if schedule == "1f1b" or SHAPES[shape][4] == 1])
def test_program_is_consistent_and_deadlock_free(captured, shape, schedule):
    progs = _check_program(_shape_plan(captured, shape, schedule))
    # 1F1B and GPipe need no prefetch: the fused groups are deadlock-free as they are.
    if SHAPES[shape][4] == 1:
        assert all(p.prefetched == 0 for p in progs.values())


def test_interleaved_needs_and_gets_prefetched_receives(captured):
    """Interleaved 1F1B on 2 groups: with one group per compute, each rank's
    send waits for a receive the other posts a compute later (a deadlock on
    NCCL, not on Gloo with unique tags); the program posts those receives
    earlier and then runs."""
    plan = _shape_plan(captured, "interleaved_2_groups")
    built = {r: _initial_groups(plan, r) for r in range(plan.world_size)}
    groups = {r: built[r][2] for r in built}
    waits = {r: _waits(r, built[r][1], groups[r]) for r in built}
    stuck = simulate_nccl(groups, waits)
    assert {s.rank for s in stuck} == {0, 1}
    assert all(any(op.send for op, *_ in s.unmatched) for s in stuck)
    progs = build_programs(plan)
    assert all(p.prefetched > 0 for p in progs.values())


def test_sends_before_receives_in_separate_groups_deadlock(captured):
    """The checker can fail: posting each action's sends in a group of their
    own, and the next action's receives in another one after it (what one
    isend, then one recv, per message does on NCCL's in-order stream), hangs
    1F1B's steady state, where both neighbours send before they receive."""
    plan = _shape_plan(captured, "2x1")
    groups, waits = {}, {}
    for r in range(plan.world_size):
        actions, msgs, _ = _initial_groups(plan, r)
        # Groups [recvs(A0)], [sends(A0)], [recvs(A1)], [sends(A1)], ...: between the
        # send group and the receive group runs an empty action, so both are posted
        # before the real compute, each real action waiting for its receive group.
        gs, w = [], []
        for k in range(len(actions)):
            gs.append([_Op(False, m) for m in msgs[k][1] if m.src != r])
            gs.append([_Op(True, m) for m in msgs[k][0] if m.dst != r])
            w.append((2 * k,))
            if k < len(actions) - 1:
                w.append(())
        groups[r], waits[r] = gs, w
    stuck = simulate_nccl(groups, waits)
    assert {s.rank for s in stuck} == {0, 1}
    assert _fused_is_fine(plan)


def _fused_is_fine(plan) -> bool:
    built = {r: _initial_groups(plan, r) for r in range(plan.world_size)}
    groups = {r: built[r][2] for r in built}
    return simulate_nccl(groups, {r: _waits(r, built[r][1], groups[r]) for r in built}) == []


def test_channel_mismatch_is_named(captured):
    """Two receives of one channel swapped: tag-free matching would hand each
    the other's buffer; the check names the channel and both messages."""
    plan = _shape_plan(captured, "2x1")
    groups = {r: _initial_groups(plan, r)[2] for r in range(plan.world_size)}
    recvs = [(gi, i) for gi, g in enumerate(groups[1]) for i, op in enumerate(g) if not op.send and op.message.src == 0]
    (g1, i1), (g2, i2) = recvs[0], recvs[1]
    groups[1][g1][i1], groups[1][g2][i2] = groups[1][g2][i2], groups[1][g1][i1]
    with pytest.raises(ProgramError, match=r"channel rank 0 -> rank 1: message 0 is act cut 0->1 mb 0 .* on the "
                                           r"sender but act cut 0->1 mb 1"):
        _check_channels(groups)


def test_every_message_is_tag_zero():
    assert p2p.TAG == 0


@pytest.mark.parametrize("shape", ["3_stages_asymmetric", "interleaved_unequal_dp"])
def test_mixed_policy_sends_half_the_bytes(captured, shape):
    """[Note: 16-bit boundary tensors]: under bf16-mixed the float32 residual
    stream crosses every boundary in bfloat16, forward and backward: each
    message is half its float32 size, and the program (who posts what, in
    which group) is otherwise the same."""
    from zorse_fx.precision import precision_policy

    plan = _shape_plan(captured, shape)
    assert {t.dtype for s in plan.stages for t in s.send} == {"float32"}  # what the stages compute
    fp32 = build_programs(plan)
    bf16 = build_programs(plan, precision=precision_policy("bf16-mixed"))
    for r in fp32:
        a = [op.message for g in fp32[r].groups for op in g]
        b = [op.message for g in bf16[r].groups for op in g]
        assert [m.nbytes for m in b] == [m.nbytes // 2 for m in a] and a
        assert [m._replace(nbytes=0) for m in a] == [m._replace(nbytes=0) for m in b]


def test_receives_follow_the_senders_order_on_a_shared_channel(captured):
    """Interleaved on 2 groups with 5 micro-batches (rounds of 3 and 2): rank 0
    sends a gradient before the activation rank 1 computes with first, on the
    one channel 0 -> 1; the program posts rank 1's receives in rank 0's send
    order (``_align_receives``), and it runs under NCCL's rules."""
    from zorse_fx.ir.p2p import _align_receives, _fused_groups

    plan = _shape_plan(captured, "interleaved_2_groups_5_microbatches")
    built = {r: _initial_groups(plan, r) for r in range(plan.world_size)}
    groups = {r: _fused_groups(r, built[r][1]) for r in built}
    with pytest.raises(ProgramError, match="order mismatch on channel rank 0 -> rank 1"):
        _check_channels(groups)
    assert _align_receives(groups) > 0
    _check_channels(groups)
    _check_program(plan)
