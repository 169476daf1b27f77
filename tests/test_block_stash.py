"""Recomputation with host-stashed block inputs (``StagePlan.stash_on_host``,
[Note: host-stashed recomputation] in ``runtime/block_stash.py``) trains
exactly as single-process training: same losses, same step-1 gradient of every
parameter, same parameters after a few AdamW steps (Gloo, torchrun), with
``train_and_compare``'s tolerances (those of test_distributed.py and, under
bf16-mixed, test_mixed_precision.py: the recomputed block runs the same kernels
on the same inputs, so it adds no rounding of its own).

The cases: the first stage stashing (its first block reads only token ids, no
tensor that requires grad: the wrapper's anchor input must still record it)
beside a loss stage on two GPUs with unequal samples, ZeRO-1 sharded, also
stashing; interleaved 1F1B with an unequal data-parallel group under
bf16-mixed; a Hugging Face Llama with a tied embedding whose two holders both
stash. Each run's summary says what moved: every block of every micro-batch
re-run once, its inputs copied to host memory.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import fixed_plan, gpt3x64, gpt4x64, tiny_llama_tied, train_and_compare, with_memory_policy
from zorse_fx.capture import analyse
from zorse_fx.errors import PlanFileError
from zorse_fx.ir.memory import StageMemory
from zorse_fx.plan import Plan

LR, WEIGHT_DECAY = 1e-3, 0.1


def with_stash(plan, stages, **policy):
    """``plan`` with host-stashed recomputation on ``stages`` (indices), after ``with_memory_policy(**policy)``."""
    plan = with_memory_policy(plan, recompute=set(stages) | set(policy.pop("recompute", ())), **policy)
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, stash_on_host=s.index in stages)
                                                  for s in plan.stages))


def _check_stash(plan, summaries, steps):
    """Every stashing stage re-ran each of its blocks once per micro-batch and step, on every GPU of it, and
    copied their inputs to host memory; no other stage has a stash."""
    for rank, got in summaries.items():
        for s in got.get("stages", [got]):
            stage = plan.stages[s["stage"]]
            if not stage.stash_on_host:
                assert s["block_stash"] is None, s
                continue
            blocks = stage.blocks[1] - stage.blocks[0]
            assert s["block_stash"]["recomputed_blocks"] == blocks * plan.num_microbatches * steps, s
            assert s["block_stash"]["stashed_bytes"] > 0 and s["block_stash"]["peak_held_bytes"] > 0, s


def test_first_and_loss_stage_stash_equal_single_process(lee_bytes, tmp_path):
    """GPT, 2 stages: stage 0 (1 GPU) and stage 1 (2 GPUs, 1:2 samples, ZeRO-1 3:1) both stash; 3 steps."""
    captured = gpt3x64()
    plan = fixed_plan(captured, ((0,), (2, 3)), ((3,), (1, 2)), num_microbatches=2, global_batch_size=6,
                      cuts=(analyse(captured).num_blocks // 2,))
    plan = with_stash(plan, {0, 1}, sharded={1}, shard_bytes={1: (3 * 2**20, 2**20)})
    assert [s.memory for s in plan.stages] == [StageMemory(recompute=True, stash="host"),
                                               StageMemory(zero=1, recompute=True, stash="host")]
    table = plan.table()  # the plan table says so: the stage column and the summary line
    assert "0 (recompute, stash)" in table and "Recomputation with host-stashed inputs on stages 0, 1" in table
    summaries, _ = train_and_compare(plan, captured, lee_bytes, tmp_path, steps=3, lr=LR, weight_decay=WEIGHT_DECAY)
    _check_stash(plan, summaries, 3)


def test_bf16_interleaved_unequal_dp_stash(lee_bytes, tmp_path):
    """Interleaved (v = 2), group 0 = 2 GPUs taking 3:1 samples, ZeRO-1 on stage 0; stages 0 and 3 (the loss
    stage) stash, stage 2 recomputes whole, under bf16-mixed; 2 micro-batches, 2 steps."""
    captured = gpt4x64()
    plan = fixed_plan(captured, ((0, 1), (2,), (0, 1), (2,)), ((3, 1), (4,), (3, 1), (4,)), num_microbatches=2,
                      global_batch_size=8, interleave=2)
    plan = with_stash(plan, {0, 3}, sharded={0}, recompute={2}, shard_bytes={0: (3 * 2**20, 2**20)})
    summaries, _ = train_and_compare(plan, captured, lee_bytes, tmp_path, steps=2, lr=LR, weight_decay=WEIGHT_DECAY,
                                     precision="bf16-mixed")
    _check_stash(plan, summaries, 2)


def test_hf_llama_tied_embedding_both_holders_stash(lee_bytes, tmp_path):
    """HF Llama, the tied embedding read by stage 0's first block and stage 1's last; both stages stash,
    stage 1 over 2 GPUs 1:2. 2 steps."""
    captured = tiny_llama_tied()
    plan = fixed_plan(captured, ((0,), (2, 3)), ((3,), (1, 2)), num_microbatches=2, global_batch_size=6,
                      cuts=(2,), label_mode="same")
    plan = with_stash(plan, {0, 1})
    assert plan.shared_params() == {"model.model.embed_tokens.weight": (0, 1)}
    summaries, _ = train_and_compare(plan, captured, lee_bytes, tmp_path, steps=2, lr=LR, weight_decay=WEIGHT_DECAY)
    _check_stash(plan, summaries, 2)


def test_the_stage_source_is_a_chain_of_block_methods():
    """[Note: block methods]: forward calls one method per block of the stage, in order, and each block
    binds the parameters it reads."""
    captured = gpt3x64()
    cut = analyse(captured).num_blocks // 2
    plan = fixed_plan(captured, ((0,), (1,)), ((2,), (2,)), num_microbatches=2, global_batch_size=4, cuts=(cut,))
    for stage, source in zip(plan.stages, plan.sources):
        blocks = list(range(*stage.blocks))
        assert f"    BLOCKS = {blocks!r}" in source
        forward = source[source.index("    def forward("):source.index(f"    def block_{blocks[0]}(")]
        assert [ln.split("self.block_")[1].split("(")[0] for ln in forward.splitlines() if "self.block_" in ln] \
            == [str(b) for b in blocks]
        for flat in stage.params:
            assert f"= self.{flat}\n" in source, flat


def test_stash_without_recompute_is_refused(tmp_path):
    """The record and the plan file refuse host-stashed block inputs on a stage that does not recompute,
    naming the field and what to change."""
    with pytest.raises(ValueError, match=r"StageMemory\(stash='host', recompute=False\)"):
        StageMemory(stash="host")
    with pytest.raises(ValueError, match=r"StageMemory\(stash='host', zero=2\)"):
        StageMemory(zero=2, recompute=True, stash="host")
    captured = gpt3x64()
    plan = fixed_plan(captured, ((0,), (1,)), ((2,), (2,)), num_microbatches=2, global_batch_size=4,
                      cuts=(analyse(captured).num_blocks // 2,))
    plan.export(tmp_path / "plan")
    path = tmp_path / "plan" / "plan.json"
    d = json.loads(path.read_text())
    d["stages"][1]["stash_on_host"] = True
    path.write_text(json.dumps(d))
    with pytest.raises(PlanFileError, match=r"stages\[1\]\.stash_on_host is true on a stage that does not "
                                            r"recompute.*set stash_on_host to false"):
        Plan.load(tmp_path / "plan")
    d["stages"][1]["recompute"] = True
    path.write_text(json.dumps(d))
    assert Plan.load(tmp_path / "plan").stages[1].memory == StageMemory(recompute=True, stash="host")
