"""A distributed run equals single-process training: same loss, same gradient
for every parameter (Gloo, one process per planned GPU, torchrun).

Tolerances: fp32 sums in a different order (micro-batches, shares, all-reduce)
differ by rounding only: loss to 1e-5 relative, each gradient to
``atol = 1e-6 + 1e-4 * max|g_ref|``. After several AdamW steps, each
parameter to ``rtol = 1e-4, atol = 1e-6 * max|p_ref| + 5e-2 * lr``. Adam
amplifies gradient rounding where the gradient is tiny or its moments cancel
across steps: the attention key bias (softmax is invariant to it, so its
gradient is pure rounding noise and moves by ``lr * g / eps``) and a few
elements whose gradient changes sign differ by up to ~0.006 lr after 3 steps
(measured); a lost or doubled update of an element is ~``lr`` (1e-3), 20x
the tolerance.

The memory-saving plans (ZeRO-1 with unequal shards, stage recomputation)
train for several steps and are compared with single-process AdamW training
step by step (losses), at step 1 (gradients) and at the end (parameters).
"""

from __future__ import annotations

import pytest

from conftest import (assert_grads_match, first_batch, fixed_plan, gpt3x64, reference_step, run_distributed,
                      tiny_llama_tied, train_and_compare, with_memory_policy)
from zorse_fx.capture import analyse


def _check(plan, captured, lee_bytes, tmp_path):
    ref_loss, ref_grads = reference_step(captured, first_batch(lee_bytes, plan))
    rows, grads = run_distributed(plan, captured.state(), lee_bytes, tmp_path)
    assert rows[0]["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_match(grads, ref_grads)


CASES = {
    # name: (stage_gpus, samples per micro-batch, micro-batches, global batch)
    "2x1": (((0,), (1,)), ((4,), (4,)), 2, 8),
    "1_then_2_unequal": (((0,), (2, 3)), ((3,), (2, 1)), 2, 6),
    "3_stages_asymmetric": (((0, 2), (1,), (3,)), ((2, 1), (3,), (3,)), 2, 6),
}


def case_plan(captured, case, **options):
    """The plan of ``CASES[case]``, blocks cut evenly (``fixed_plan``; ``options``: its other arguments)."""
    stage_gpus, samples, m, gb = CASES[case]
    return fixed_plan(captured, stage_gpus, samples, num_microbatches=m, global_batch_size=gb, **options)


@pytest.mark.parametrize("case", sorted(CASES))
def test_gpt_distributed_equals_single_process(case, lee_bytes, tmp_path):
    captured = gpt3x64()
    plan = case_plan(captured, case)
    assert plan.num_stages == len(CASES[case][0])
    _check(plan, captured, lee_bytes, tmp_path)


def test_hf_llama_tied_embeddings_distributed(lee_bytes, tmp_path):
    """HF Llama (torch.export route), tied input/output embedding held by the
    first and the last stage: 1 GPU, then 2 GPUs with unequal shares."""
    captured = tiny_llama_tied()
    plan = fixed_plan(captured, ((0,), (2, 3)), ((3,), (1, 2)), num_microbatches=2, global_batch_size=6, cuts=(2,),
                      label_mode="same")
    assert plan.shared_params() == {"model.model.embed_tokens.weight": (0, 1)}
    _check(plan, captured, lee_bytes, tmp_path)


# -- memory-saving plans: ZeRO-1 (unequal shards) and stage recomputation ----

LR, WEIGHT_DECAY = 1e-3, 0.1


def _check_state_sizes(plan, summaries):
    """ZeRO-1 ranks hold AdamW moments for their owned range only (2 x 4 bytes
    per owned fp32 element); ranges follow shard_ranges and tile the stage."""
    for s in plan.stages:
        zero1 = s.sharded and len(s.gpus) > 1
        expected = s.shard_ranges(s.num_parameters) if zero1 else [(0, s.num_parameters)] * len(s.gpus)
        for g, (a, b) in zip(s.gpus, expected):
            got = summaries[g.rank]
            assert got["sharded"] is zero1 and got["stage_elements"] == s.num_parameters
            assert tuple(got["owned_range"]) == (a, b) and got["owned_elements"] == b - a
            assert got["optimizer_state_bytes"] == 2 * (b - a) * 4, f"rank {g.rank}: {got}"


def test_zero1_unequal_shards_and_recompute_equal_single_process(lee_bytes, tmp_path):
    """GPT, 2 stages: stage 0 recomputes its activations; stage 1 (2 GPUs,
    1:2 samples) shards its AdamW state 3:1 (state share decoupled from
    compute share) and holds the tied output embedding. 3 AdamW steps."""
    captured = gpt3x64()
    plan = fixed_plan(captured, ((0,), (2, 3)), ((3,), (1, 2)), num_microbatches=2, global_batch_size=6,
                      cuts=(analyse(captured).num_blocks // 2,))
    plan = with_memory_policy(plan, sharded={1}, recompute={0}, shard_bytes={1: (3 * 2**20, 2**20)})
    assert plan.shared_params() == {"wte.weight": (0, 1)}
    summaries, _ = train_and_compare(plan, captured, lee_bytes, tmp_path, steps=3, lr=LR, weight_decay=WEIGHT_DECAY)
    _check_state_sizes(plan, summaries)
    n = plan.stages[1].num_parameters
    assert summaries[1]["owned_elements"] + summaries[2]["owned_elements"] == n
    assert summaries[1]["owned_elements"] == pytest.approx(0.75 * n, abs=1)


def test_hf_llama_tied_embeddings_zero1_recompute(lee_bytes, tmp_path):
    """HF Llama, tied embedding held by both stages, both stages sharded:
    stage 0 over 2 GPUs with one owning no state (state_shard_bytes 0), the
    last stage 1:2 and recomputing (the loss stage). 2 AdamW steps."""
    captured = tiny_llama_tied()
    plan = fixed_plan(captured, ((0, 1), (2, 3)), ((2, 1), (1, 2)), num_microbatches=2, global_batch_size=6,
                      cuts=(2,), label_mode="same")
    plan = with_memory_policy(plan, sharded={0, 1}, recompute={1}, shard_bytes={0: (5, 0), 1: (2**20, 2 * 2**20)})
    assert plan.shared_params() == {"model.model.embed_tokens.weight": (0, 1)}
    summaries, _ = train_and_compare(plan, captured, lee_bytes, tmp_path, steps=2, lr=LR, weight_decay=WEIGHT_DECAY)
    _check_state_sizes(plan, summaries)
    assert summaries[1]["owned_elements"] == 0 and summaries[1]["optimizer_state_bytes"] == 0
