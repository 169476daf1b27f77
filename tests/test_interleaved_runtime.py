"""Interleaved plans (``Plan.interleave = 2``: a rank hosts two stages) train
exactly as single-process training: same losses, same step-1 gradient of
every parameter, same parameters after a few AdamW steps (Gloo, torchrun).
See [Note: a rank with several stages] in ``runtime/worker.py``.

Tolerances are test_distributed.py's (fp32 sums in another order differ by
rounding only): losses to 1e-5 relative; each gradient to ``atol = 1e-6 +
1e-4 * max|g_ref|``; after the AdamW steps each parameter to ``rtol = 1e-4,
atol = 1e-6 * max|p_ref| + 5e-2 * lr``, where a lost, doubled or misrouted
update of an element is ~``lr`` (20x the tolerance). Every parameter is
checked to have moved by more than 1e-4, so a missing update shows.

- 2 GPU groups of one GPU each, 4 stages, 4 micro-batches (warm-up, steady
  and drain phases of interleaved 1F1B; stage 1 -> 2 goes from rank 1 back
  to rank 0; the tied embedding is held by stage 0 on rank 0 and stage 3 on
  rank 1);
- group 0 data-parallel over 2 GPUs with samples 3:1, group 1 one GPU;
  both of group 0's stages ZeRO-1 sharded with different unequal state
  shares (two sharded stages, and their all-gathers, on one rank), the loss
  stage recomputing its activations;
- 2 groups, 5 micro-batches: a micro-batch count that is not a multiple of
  the group count (rounds of 3 and 2);
- one process, one GPU group hosting both stages (P = 1, no torch.distributed:
  messages to the rank itself, the tied embedding's two copies on one rank
  summed locally).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import (assert_grads_match, assert_params_match, first_batch, fixed_plan, gpt4x64, reference_adamw,
                      reference_step, train_and_compare, with_memory_policy)
from zorse_fx.data import global_batch
from zorse_fx.runtime.worker import OptimizerConfig, StageWorker

LR, WEIGHT_DECAY = 1e-3, 0.1


def test_interleaved_two_groups_equal_single_process(lee_bytes, tmp_path):
    """P = 2 groups of one GPU, v = 2 (4 stages), 4 micro-batches of 2; 3 AdamW steps."""
    captured = gpt4x64()
    plan = fixed_plan(captured, ((0,), (2,), (0,), (2,)), ((2,), (2,), (2,), (2,)), num_microbatches=4,
                      global_batch_size=8, interleave=2)
    assert (plan.interleave, plan.num_groups, plan.world_size) == (2, 2, 2)
    assert plan.stages_of(0) == (0, 2) and plan.stages_of(1) == (1, 3)
    assert plan.shared_params() == {"wte.weight": (0, 3)}
    # Step-1 loss against the single-process forward on the same batch (before reference_adamw trains it).
    ref_loss, _ = reference_step(captured, first_batch(lee_bytes, plan))
    summaries, _ = train_and_compare(plan, captured, lee_bytes, tmp_path, steps=3, lr=LR, weight_decay=WEIGHT_DECAY)
    for rank, got in summaries.items():
        assert [s["stage"] for s in got["stages"]] == list(plan.stages_of(rank))
        assert got["stage"] == plan.stages_of(rank)[0] and got["sharded"] is False
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["loss"] == pytest.approx(ref_loss, rel=1e-5)


def test_interleaved_unequal_dp_zero1_recompute(lee_bytes, tmp_path):
    """Group 0 = 2 GPUs taking 3:1 samples, group 1 = 1 GPU (3 ranks), 2
    micro-batches of 4. Stages 0 and 2 (both on group 0) are ZeRO-1 sharded,
    state shares 3:1 and 1:2; stage 3 (the loss stage, group 1) recomputes.
    The tied embedding is reduced over ranks {0, 1, 2}. 3 AdamW steps."""
    captured = gpt4x64()
    plan = fixed_plan(captured, ((0, 1), (2,), (0, 1), (2,)), ((3, 1), (4,), (3, 1), (4,)), num_microbatches=2,
                      global_batch_size=8, interleave=2)
    plan = with_memory_policy(plan, sharded={0, 2}, recompute={3},
                              shard_bytes={0: (3 * 2**20, 2**20), 2: (2**20, 2 * 2**20)})
    assert plan.world_size == 3 and plan.stages_of(1) == (0, 2) and plan.stages_of(2) == (1, 3)
    assert plan.shared_params() == {"wte.weight": (0, 3)}
    summaries, _ = train_and_compare(plan, captured, lee_bytes, tmp_path, steps=3, lr=LR, weight_decay=WEIGHT_DECAY)
    # Per hosted stage: the ZeRO-1 owned range (shard_ranges) and AdamW moments for it only.
    for rank, got in summaries.items():
        per_stage = got["stages"]
        assert [s["stage"] for s in per_stage] == list(plan.stages_of(rank))
        assert {k: v for k, v in got.items() if k != "stages"} == per_stage[0]
        for summary in per_stage:
            s = plan.stages[summary["stage"]]
            zero1 = s.sharded and len(s.gpus) > 1
            pos = s.ranks.index(rank)
            a, b = s.shard_ranges(s.num_parameters)[pos] if zero1 else (0, s.num_parameters)
            assert summary["sharded"] is zero1 and summary["stage_elements"] == s.num_parameters
            assert tuple(summary["owned_range"]) == (a, b) and summary["optimizer_state_bytes"] == 2 * (b - a) * 4
    for stage, share in ((0, 0.75), (2, 1 / 3)):
        n = plan.stages[stage].num_parameters
        owned = [summaries[r]["stages"][stage // 2]["owned_elements"] for r in (0, 1)]
        assert sum(owned) == n and owned[0] == pytest.approx(share * n, abs=1)


def test_interleaved_microbatch_count_not_a_multiple_of_the_groups(lee_bytes, tmp_path):
    """P = 2 groups, v = 2, M = 5 micro-batches (issue 31 item 5): rounds of 3
    and 2 micro-batches (``interleave_rounds``), warm-up, steady state and
    drain crossing the round boundary; the point-to-point program checked
    deadlock-free under NCCL's rules by ``build_programs``. 3 AdamW steps."""
    from zorse_fx.ir.schedule import interleave_rounds, make_schedule

    captured = gpt4x64()
    plan = fixed_plan(captured, ((0,), (2,), (0,), (2,)), ((2,), (2,), (2,), (2,)), num_microbatches=5,
                      global_batch_size=10, interleave=2)
    assert (plan.num_groups, plan.num_microbatches, interleave_rounds(2, 5)) == (2, 5, (3, 2))
    sched = make_schedule(plan.schedule, plan.num_stages, plan.num_microbatches, plan.interleave)
    assert [str(a) for a in sched[1][:4]] == ["F0", "F1", "F2", "F0.1"]  # group 1: 3-micro-batch round first
    train_and_compare(plan, captured, lee_bytes, tmp_path, steps=3, lr=LR, weight_decay=WEIGHT_DECAY)


def one_group_two_stages(captured, tmp_path, precision=None):
    """A plan with both stages on ONE GPU (P = 1, interleave 2; the planner
    wants >= 2 GPU groups, the plan format and the runtime take one), exported
    to ``tmp_path / "plan"``, and rank 0's StageWorker for it (AdamW with
    ``LR``, ``WEIGHT_DECAY``; ``precision`` a PrecisionPolicy or None = fp32)."""
    plan = fixed_plan(captured, ((0,), (1,)), ((2,), (2,)), num_microbatches=2, global_batch_size=4)
    plan = dataclasses.replace(plan, interleave=2,
                               stages=(plan.stages[0], dataclasses.replace(plan.stages[1], gpus=plan.stages[0].gpus)))
    plan.export(tmp_path / "plan")
    kw = {"precision": precision} if precision is not None else {}
    worker = StageWorker(plan, tmp_path / "plan", captured.state(), rank=0, device=torch.device("cpu"),
                         optimizer=OptimizerConfig(lr=LR, weight_decay=WEIGHT_DECAY), **kw)
    return plan, worker


def train_in_process(worker, plan, tokens, steps):
    """``steps`` training steps of ``worker`` on the global batches of
    ``tokens``; returns (the losses, the step-1 gradients by canonical name)."""
    losses, grads1 = [], None
    for step in range(steps):
        batch = global_batch(tokens, step, global_batch_size=plan.global_batch_size, seq_len=plan.seq_len,
                             input_names=plan.input_names, label_mode=plan.label_mode)
        losses.append(float(worker.train_step(batch)))
        if step == 0:
            grads1 = worker.gradients()
    return losses, grads1


def test_one_group_two_stages_in_process(lee_bytes, tmp_path):
    """P = 1: one rank hosts both stages, so every message goes to itself and
    the tied embedding (stage 0 and stage 1) has two copies on the rank, whose
    gradients must be summed locally. No torch.distributed at all. 2 AdamW
    steps against single-process training."""
    captured = gpt4x64()
    initial = {k: v.clone() for k, v in captured.state().items()}
    plan, worker = one_group_two_stages(captured, tmp_path)
    assert plan.num_groups == 1 and plan.stages_of(0) == (0, 1) and plan.shared_params() == {"wte.weight": (0, 1)}
    assert [a.chunk for a in worker.schedule].count(1) == 4  # F and B of 2 micro-batches through chunk 1
    steps = 2
    losses, grads1 = train_in_process(worker, plan, lee_bytes, steps)
    ref_loss, _ = reference_step(captured, first_batch(lee_bytes, plan))
    assert losses[0] == pytest.approx(ref_loss, rel=1e-5)
    ref_losses, ref_grads, ref_params = reference_adamw(captured, lee_bytes, plan, steps, lr=LR,
                                                          weight_decay=WEIGHT_DECAY)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_grads_match({0: grads1}, ref_grads)
    # parameters_by_name checks that the rank's two wte copies still agree.
    assert_params_match({0: worker.parameters_by_name()}, ref_params, initial, steps, LR)
