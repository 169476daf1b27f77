"""Sharded gradients, ZeRO-2 ([Note: sharded gradients] in
``runtime/grad_sync.py``): every micro-batch's gradients reduced to the GPUs
owning their ZeRO-1 ranges, which alone keep them in float32. Equal to
single-process training (losses, step-1 gradients joined from the owners'
shards, parameters after several steps) on Gloo with NCCL's semantics, with
unequal shards and unequal sample shares together, a tied embedding that
stays on the all-reduce path, clipping, fp32, bf16 with 16-bit working
weights, fp16 loss scaling, and interleaving with M not a multiple of the
group count. Tolerances: ``conftest.TOLERANCES`` (explained in
test_mixed_precision.py); the float32 sums are ZeRO-1's in another order.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import (fixed_plan, gpt3x64, gpt4x64, train_and_compare, with_grad_sharding, with_low_precision,
                      with_memory_policy)
from zorse_fx.capture import analyse
from zorse_fx.errors import PlanFileError
from zorse_fx.plan import Plan

LR, WEIGHT_DECAY = 1e-3, 0.1
#: Small buckets (51 KiB): several shard buckets per stage, some split between two owners.
SMALL_BUCKETS = 0.05


def _two_stage_plan(captured, *, microbatches=3):
    """GPT, 2 stages: stage 0 on GPU 0; stage 1 on GPUs 2, 3 taking 1:2 of each
    micro-batch, ZeRO-1 shards 3:1 (a fast GPU with little memory holds less)."""
    plan = fixed_plan(captured, ((0,), (2, 3)), ((3,), (1, 2)), num_microbatches=microbatches,
                      global_batch_size=3 * microbatches, cuts=(analyse(captured).num_blocks // 2,),
                      bucket_mib=SMALL_BUCKETS)
    return with_memory_policy(plan, sharded={1}, shard_bytes={1: (3 * 2**20, 2**20)})


def _shard_elements(summaries, rank):
    return sum(b["owned_elements"] for b in summaries[rank]["buffers"])


def test_fp32_zero2_unequal_shards_and_shares_with_clipping(lee_bytes, tmp_path):
    """fp32, M = 3, clipping at 0.5: the global norm adds each gradient
    shard's squares once, on its owner. The tied embedding (stages 0 and 1)
    stays on the all-reduce path beside the shards."""
    captured = gpt3x64()
    plan = with_grad_sharding(_two_stage_plan(captured))
    assert plan.stages[1].grad_sharded and not plan.stages[0].grad_sharded
    summaries, rows = train_and_compare(plan, captured, lee_bytes, tmp_path, steps=3, lr=LR,
                                        weight_decay=WEIGHT_DECAY, extra=("--clip-grad-norm", "0.5"),
                                        ref_kwargs={"clip": 0.5})
    pieces = {r: torch.load(tmp_path / "run" / "grads" / f"rank{r}_pieces.pt") for r in (1, 2)}
    assert pieces[1] and pieces[2]
    tied = set(plan.shared_params())
    assert tied and not tied & (pieces[1].keys() | pieces[2].keys())  # (tied: whole gradients, all-reduced)
    whole = torch.load(tmp_path / "run" / "grads" / "rank1.pt")
    assert tied <= whole.keys()
    # The owners hold 3:1 of the stage's elements, and no rank a whole sharded gradient.
    assert _shard_elements(summaries, 1) > 2 * _shard_elements(summaries, 2)
    for r in (1, 2):
        assert not set(pieces[r]) & set(torch.load(tmp_path / "run" / "grads" / f"rank{r}.pt"))
    # Every micro-batch's buckets launch while its backward runs.
    part = rows[-1]["ranks"][1]
    assert part["buckets"] >= 3 and part["buckets_during_backward"] >= 3 * 2, part


def test_bf16_zero2_with_sixteen_bit_working_weights(lee_bytes, tmp_path):
    """bf16-mixed, the 16-bit working weights' gradients reduced per
    micro-batch (in float32, the plan's reduction dtype) into float32 shards
    beside their float32 masters: 4 + 8 + 4 B per owned element, 2 B per
    element replicated."""
    captured = gpt3x64()
    plan = with_grad_sharding(with_low_precision(_two_stage_plan(captured), captured))
    assert plan.stages[1].low_precision_params
    summaries, _ = train_and_compare(plan, captured, lee_bytes, tmp_path, steps=3, lr=LR, weight_decay=WEIGHT_DECAY,
                                     precision="bf16-mixed")
    for r in (1, 2):
        bf16 = next(b for b in summaries[r]["buffers"] if b["dtype"] == "bfloat16")
        assert bf16["master_bytes"] == 4 * bf16["owned_elements"]


def test_bf16_zero2_reduced_in_bfloat16(lee_bytes, tmp_path):
    """With ``--grad-reduce-dtype bfloat16`` each micro-batch's reduction is
    in bfloat16 (M roundings of the partial sums instead of one): still
    within the bf16 tolerance of single-process training."""
    captured = gpt3x64()
    plan = with_grad_sharding(with_low_precision(_two_stage_plan(captured, microbatches=2), captured))
    train_and_compare(plan, captured, lee_bytes, tmp_path, steps=2, lr=LR, weight_decay=WEIGHT_DECAY,
                      precision="bf16-mixed", extra=("--grad-reduce-dtype", "bfloat16"))


def test_fp16_zero2_skips_the_same_step(lee_bytes, tmp_path):
    """fp16-mixed: rank 2 writes an inf into its gradient shard after step 2's
    reduction; every rank skips step 2 as GradScaler does."""
    captured = gpt3x64()
    plan = with_grad_sharding(with_low_precision(_two_stage_plan(captured, microbatches=2), captured))
    _, rows = train_and_compare(plan, captured, lee_bytes, tmp_path, steps=3, lr=LR, weight_decay=WEIGHT_DECAY,
                                precision="fp16-mixed", inject_inf=(2, 2))
    assert [r["skipped"] for r in rows] == [False, True, False]


def test_bf16_zero2_interleaved_three_microbatches(lee_bytes, tmp_path):
    """Interleaved, P = 2 groups, v = 2, M = 3 (not a multiple of P); group 0
    (2 GPUs, 2:1 samples) runs stages 0 and 2 with sharded gradients, shards
    1:2 and 3:1: two ZeRO-2 stages on one rank, their buckets on one group."""
    captured = gpt4x64()
    plan = fixed_plan(captured, ((0, 1), (2,), (0, 1), (2,)), ((2, 1), (3,), (2, 1), (3,)), num_microbatches=3,
                      global_batch_size=9, interleave=2, bucket_mib=SMALL_BUCKETS)
    plan = with_memory_policy(plan, sharded={0, 2}, shard_bytes={0: (2**20, 2 * 2**20), 2: (3 * 2**20, 2**20)})
    plan = with_grad_sharding(with_low_precision(plan, captured))
    assert [s.grad_sharded for s in plan.stages] == [True, False, True, False]
    train_and_compare(plan, captured, lee_bytes, tmp_path, steps=2, lr=LR, weight_decay=WEIGHT_DECAY,
                      precision="bf16-mixed")


def test_grad_sharded_needs_a_sharded_stage_of_two_gpus(tmp_path):
    """The plan file: ``grad_sharded`` on a stage that is not sharded, or of
    one GPU, is refused naming the field, the values and the fix; a version-8
    file reads with it off."""
    captured = gpt3x64()
    plan = _two_stage_plan(captured)
    bad = plan.to_dict()
    bad["stages"][0]["grad_sharded"] = True
    with pytest.raises(PlanFileError, match=r"stages\[0\]\.grad_sharded is true, but sharded gradients \(ZeRO-2\) "
                                            r"need a sharded stage of two or more GPUs \(sharded False, 1 GPU\(s\)\); "
                                            r"set it to false"):
        Plan.from_dict(bad)
    good = with_grad_sharding(plan)
    d = good.to_dict()
    assert d["stages"][1]["grad_sharded"] is True
    assert Plan.from_dict(d).stages[1].grad_sharded
    d["version"] = 8
    for s in d["stages"]:
        del s["grad_sharded"]
    assert not any(s.grad_sharded for s in Plan.from_dict(d).stages)
    assert "ZeRO-2" in good.table()
    assert json.loads(json.dumps(d))  # (plain data)


def test_checkpoints_move_between_zero1_and_zero2(lee_bytes, tmp_path):
    """fp32, 4 ranks, both stages sharded (2:1 and 3:1 shards). Steps 1-2 with
    sharded gradients, step 3 resumed under ZeRO-1, step 4 under ZeRO-2 again:
    the losses and parameters equal 4 uninterrupted ZeRO-1 steps within fp32
    tolerance (ZeRO-2's float32 sums are ZeRO-1's in another order; its
    buffers are in forward order, so the owned ranges differ: the checkpoint
    keys state by parameter and element range, and each layout loads the
    other's)."""
    from conftest import assert_resume_across_layouts
    from test_training_loop import _plan_a4

    captured = gpt3x64()
    z1 = with_memory_policy(_plan_a4(captured), sharded={0, 1}, shard_bytes={0: (2**20, 2**20),
                                                                             1: (3 * 2**20, 2**20)})
    z2 = with_grad_sharding(z1)
    assert all(s.grad_sharded for s in z2.stages)
    assert_resume_across_layouts(captured, lee_bytes, tmp_path, z1, z2)

