"""Mixed precision in the runtime ([Note: mixed precision] in
``zorse_fx/precision.py``): a distributed run equals single-process training
under the same precision policy -- bf16 (or fp16) autocast forward, float32
master weights, gradients and AdamW state -- for the plan shapes the fp32
tests cover (test_distributed.py, test_interleaved_runtime.py), on Gloo with
every point-to-point tag 0 (NCCL's matching).

Tolerances (``conftest.BF16`` / ``FP16``), measured and explained:

- loss, every step: 1e-4 relative. The forward of a micro-batch computes the
  same rows as the whole batch does (measured: equal, or 1e-7 apart).
- gradients after step 1: 1e-2 (bf16) / 2e-3 (fp16) of the largest reference
  entry. Each micro-batch's 16-bit matmul gradients are rounded before they
  are accumulated in float32, the single-process run rounds the sum once:
  a relative error up to 2**-8 = 0.39% (bf16) / 2**-11 = 0.05% (fp16) of an
  entry's magnitude (measured worst: 0.39% / 0.05% of the largest entry). A
  misrouted or lost row changes a gradient by about its share of the batch
  (>= 10% here), so these bounds still catch routing and weighting bugs.
- parameters after the AdamW steps: at most 5% of a parameter's elements
  may differ by more than 0.5 lr. Adam divides the gradient by its own
  running magnitude, so where a gradient entry is rounding noise its update
  can flip sign (+-lr) between the two runs; a lost, doubled or misrouted
  update moves every element of a parameter by about lr (100% of them off).
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import (fixed_plan, gpt3x64, gpt4x64, run_distributed, tiny_llama_tied, train_and_compare,
                      with_low_precision, with_memory_policy)
from test_distributed import case_plan
from zorse_fx.capture import analyse

LR, WEIGHT_DECAY = 1e-3, 0.1
#: Small gradient buckets (51 KiB; PlanOptions.bucket_mib, recorded in the plan): several buckets per stage,
#: launched during the last backward.
SMALL_BUCKETS = 0.05


@pytest.mark.parametrize("case,extra,bucket_mib", [
    ("2x1", (), 25.0),
    # Unequal shares; gradients all-reduced in bfloat16; many small buckets.
    ("1_then_2_unequal", ("--grad-reduce-dtype", "bfloat16"), SMALL_BUCKETS),
    ("3_stages_asymmetric", (), SMALL_BUCKETS),
])
def test_bf16_gpt_equals_single_process(case, extra, bucket_mib, lee_bytes, tmp_path):
    captured = gpt3x64()
    plan = case_plan(captured, case, bucket_mib=bucket_mib)
    assert plan.grad_bucket_bytes == round(bucket_mib * 1024) * 1024
    _, rows = train_and_compare(plan, captured, lee_bytes, tmp_path, steps=2, lr=LR, weight_decay=WEIGHT_DECAY,
                                precision="bf16-mixed", extra=extra)
    assert all(r["loss_scale"] == 1.0 and r["skipped"] is False for r in rows)
    if bucket_mib == SMALL_BUCKETS:  # several buckets per data-parallel stage, reduced while the backward runs
        parts = [p for p in rows[-1]["ranks"] if p["buckets"] >= 2]
        assert parts, rows[-1]["ranks"]
        assert all(1 <= p["buckets_during_backward"] <= p["buckets"] for p in parts), parts


def test_bf16_hf_llama_tied_embeddings(lee_bytes, tmp_path):
    """HF Llama, tied embedding held by the first and the last stage (1 GPU,
    then 2 GPUs with unequal shares)."""
    captured = tiny_llama_tied()
    plan = fixed_plan(captured, ((0,), (2, 3)), ((3,), (1, 2)), num_microbatches=2, global_batch_size=6, cuts=(2,),
                      label_mode="same")
    assert plan.shared_params() == {"model.model.embed_tokens.weight": (0, 1)}
    train_and_compare(plan, captured, lee_bytes, tmp_path, steps=2, lr=LR, weight_decay=WEIGHT_DECAY,
                      precision="bf16-mixed")


def test_bf16_zero1_unequal_shards_and_recompute(lee_bytes, tmp_path):
    """GPT, 2 stages: stage 0 recomputes (its forward re-run under the same
    autocast); stage 1 (2 GPUs, 1:2 samples) shards its AdamW state 3:1 and
    holds the tied output embedding. 3 steps."""
    captured = gpt3x64()
    plan = fixed_plan(captured, ((0,), (2, 3)), ((3,), (1, 2)), num_microbatches=2, global_batch_size=6,
                      cuts=(analyse(captured).num_blocks // 2,), bucket_mib=SMALL_BUCKETS)
    plan = with_memory_policy(plan, sharded={1}, recompute={0}, shard_bytes={1: (3 * 2**20, 2**20)})
    summaries, _ = train_and_compare(plan, captured, lee_bytes, tmp_path, steps=3, lr=LR, weight_decay=WEIGHT_DECAY,
                                     precision="bf16-mixed")
    # float32 master weights: AdamW moments of the owned elements, 2 x 4 bytes each.
    for r in (1, 2):
        assert summaries[r]["optimizer_state_bytes"] == 2 * summaries[r]["owned_elements"] * 4


def test_bf16_sixteen_bit_working_weights_unequal_shards(lee_bytes, tmp_path):
    """GPT, 2 stages; stage 1 (2 GPUs, 1:2 samples) sharded 3:1 keeps its
    matmul weights in bfloat16, their float32 masters in the shards ([Note:
    16-bit working weights]); the tied embedding and the norms stay float32.
    Equal to single-process training under the same autocast: losses,
    gradients (the float32 main gradients), the float32 masters after 3
    steps, and the 16-bit weights are the masters' rounding."""
    captured = gpt3x64()
    plan = fixed_plan(captured, ((0,), (2, 3)), ((3,), (1, 2)), num_microbatches=2, global_batch_size=6,
                      cuts=(analyse(captured).num_blocks // 2,), bucket_mib=SMALL_BUCKETS)
    fp32_weights = with_memory_policy(plan, sharded={1}, shard_bytes={1: (3 * 2**20, 2**20)})
    plan = with_low_precision(fp32_weights, captured)
    low = plan.stages[1].low_precision_params
    assert low and not plan.stages[0].low_precision_params
    assert not any(plan.stages[1].params[f] in plan.shared_params() or "ln" in f for f in low)
    initial = {k: v.clone() for k, v in captured.state().items()}  # (the reference trains ``captured``)
    summaries, rows = train_and_compare(plan, captured, lee_bytes, tmp_path, steps=3, lr=LR,
                                        weight_decay=WEIGHT_DECAY, precision="bf16-mixed")
    # The same values as float32 weights under autocast, bit for bit: the same plan with ZeRO-1's float32
    # weights gives the same losses, the same (main) gradients and the same float32 weights.
    ref_rows, ref_grads = run_distributed(fp32_weights, initial, lee_bytes, tmp_path / "fp32_weights",
                                          steps=3, extra=("--dump-params", "--lr", str(LR), "--weight-decay",
                                                          str(WEIGHT_DECAY), "--precision", "bf16-mixed"))
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref_rows]
    grads = {r: torch.load(tmp_path / "run" / "grads" / f"rank{r}.pt") for r in range(plan.world_size)}
    for r in range(plan.world_size):
        assert grads[r].keys() == ref_grads[r].keys()
        for name, g in grads[r].items():
            assert g.dtype == torch.float32 and torch.equal(g, ref_grads[r][name]), (r, name)
        ref_params = torch.load(tmp_path / "fp32_weights" / "run" / "params" / f"rank{r}.pt")
        masters = torch.load(tmp_path / "run" / "params" / f"rank{r}_masters.pt")
        for name, pieces in masters.items():
            for a, b, t in pieces:
                assert torch.equal(t, ref_params[name].reshape(-1)[a:b]), (r, name, a, b)
    n16 = sum(captured.state()[plan.stages[1].params[f]].numel() for f in low)
    for r, share in ((1, 3), (2, 1)):
        bf16 = next(b for b in summaries[r]["buffers"] if b["dtype"] == "bfloat16")
        assert bf16["elements"] == n16 and bf16["owned_elements"] in (n16 * share // 4, n16 * share // 4 + 1)
        # float32 master (4 B) + AdamW moments (2 x 4 B) per owned 16-bit element.
        assert bf16["master_bytes"] == 4 * bf16["owned_elements"]
        assert bf16["optimizer_state_bytes"] == 8 * bf16["owned_elements"]


def test_bf16_hf_llama_tied_zero1_recompute(lee_bytes, tmp_path):
    """HF Llama, tied embedding held by both stages, both sharded (one GPU of
    stage 0 owns no state), the loss stage recomputing. 2 steps."""
    captured = tiny_llama_tied()
    plan = fixed_plan(captured, ((0, 1), (2, 3)), ((2, 1), (1, 2)), num_microbatches=2, global_batch_size=6,
                      cuts=(2,), label_mode="same")
    plan = with_memory_policy(plan, sharded={0, 1}, recompute={1}, shard_bytes={0: (5, 0), 1: (2**20, 2 * 2**20)})
    train_and_compare(plan, captured, lee_bytes, tmp_path, steps=2, lr=LR, weight_decay=WEIGHT_DECAY,
                      precision="bf16-mixed")


def test_bf16_interleaved_two_groups(lee_bytes, tmp_path):
    """P = 2 groups of one GPU, v = 2 (4 stages), 4 micro-batches; the tied
    embedding on rank 0 (stage 0) and rank 1 (stage 3). 3 steps."""
    captured = gpt4x64()
    plan = fixed_plan(captured, ((0,), (2,), (0,), (2,)), ((2,), (2,), (2,), (2,)), num_microbatches=4,
                      global_batch_size=8, interleave=2, bucket_mib=SMALL_BUCKETS)
    train_and_compare(plan, captured, lee_bytes, tmp_path, steps=3, lr=LR, weight_decay=WEIGHT_DECAY,
                      precision="bf16-mixed")


def test_bf16_interleaved_three_microbatches_on_two_groups(lee_bytes, tmp_path):
    """Interleaved with M = 3 on P = 2 groups (not a multiple; one round of 3),
    group 0 data-parallel 2:1 and ZeRO-1, 16-bit boundary tensors."""
    captured = gpt4x64()
    plan = fixed_plan(captured, ((0, 1), (2,), (0, 1), (2,)), ((2, 1), (3,), (2, 1), (3,)), num_microbatches=3,
                      global_batch_size=9, interleave=2)
    plan = with_memory_policy(plan, sharded={0, 2}, shard_bytes={0: (2**20, 2 * 2**20), 2: (3 * 2**20, 2**20)})
    train_and_compare(plan, captured, lee_bytes, tmp_path, steps=2, lr=LR, weight_decay=WEIGHT_DECAY,
                      precision="bf16-mixed")


def test_bf16_interleaved_unequal_dp_zero1_recompute(lee_bytes, tmp_path):
    """Group 0 = 2 GPUs taking 3:1 samples, group 1 = 1 GPU; stages 0 and 2
    ZeRO-1 sharded 3:1 and 1:2, the loss stage recomputing. 3 steps."""
    captured = gpt4x64()
    plan = fixed_plan(captured, ((0, 1), (2,), (0, 1), (2,)), ((3, 1), (4,), (3, 1), (4,)), num_microbatches=2,
                      global_batch_size=8, interleave=2)
    plan = with_memory_policy(plan, sharded={0, 2}, recompute={3},
                              shard_bytes={0: (3 * 2**20, 2**20), 2: (2**20, 2 * 2**20)})
    train_and_compare(plan, captured, lee_bytes, tmp_path, steps=3, lr=LR, weight_decay=WEIGHT_DECAY,
                      precision="bf16-mixed")


def test_fp16_loss_scaling_skips_the_same_step_on_every_rank(lee_bytes, tmp_path):
    """fp16-mixed on 3 asymmetric stages (4 ranks): rank 3 (the last stage)
    writes an inf into one gradient after step 2's reduction. Every rank must
    skip step 2 and halve the scale, as ``torch.amp.GradScaler`` does in the
    single-process reference with the same inf: losses, step-1 gradients and
    the parameters after 3 steps equal it, and no rank updated its
    parameters at step 2 (else they would differ from the reference by a
    whole AdamW step)."""
    captured = gpt3x64()
    plan = case_plan(captured, "3_stages_asymmetric")
    _, rows = train_and_compare(plan, captured, lee_bytes, tmp_path, steps=3, lr=LR, weight_decay=WEIGHT_DECAY,
                                precision="fp16-mixed", inject_inf=(3, 2))
    assert [r["skipped"] for r in rows] == [False, True, False]
    assert [r["loss_scale"] for r in rows] == [2.0**16, 2.0**16, 2.0**15]
    text = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert all(json.loads(line)["precision"] == "fp16-mixed" for line in text.splitlines())


def test_fp16_sixteen_bit_working_weights_skip_the_same_step(lee_bytes, tmp_path):
    """fp16-mixed with 16-bit working weights (float16) on the sharded stage:
    rank 2 (on it) writes an inf into a float32 main gradient after step 2's
    reduction; every rank skips step 2 (masters and moments untouched) and
    the 3 steps equal GradScaler's single-process training."""
    captured = gpt3x64()
    plan = fixed_plan(captured, ((0,), (2, 3)), ((3,), (1, 2)), num_microbatches=2, global_batch_size=6,
                      cuts=(analyse(captured).num_blocks // 2,))
    plan = with_low_precision(with_memory_policy(plan, sharded={1}, shard_bytes={1: (2**20, 3 * 2**20)}), captured)
    assert plan.precision == "fp16-mixed" and plan.stages[1].low_precision_params
    _, rows = train_and_compare(plan, captured, lee_bytes, tmp_path, steps=3, lr=LR, weight_decay=WEIGHT_DECAY,
                                precision="fp16-mixed", inject_inf=(2, 2))
    assert [r["skipped"] for r in rows] == [False, True, False]
    assert [r["loss_scale"] for r in rows] == [2.0**16, 2.0**16, 2.0**15]
    params = torch.load(tmp_path / "run" / "params" / "rank2.pt")
    assert {str(params[plan.stages[1].params[f]].dtype) for f in plan.stages[1].low_precision_params} == \
        {"torch.float16"}


def test_bf16_interleaved_sixteen_bit_working_weights(lee_bytes, tmp_path):
    """Interleaved, M = 3 on P = 2 groups: group 0 (2 GPUs, 2:1) hosts stages 0
    and 2, both ZeRO-1 with 16-bit working weights (one rank, two stages'
    main gradients and masters), stage 0 recomputing its forward with 16-bit
    weights; 2 steps equal single-process training."""
    captured = gpt4x64()
    plan = fixed_plan(captured, ((0, 1), (2,), (0, 1), (2,)), ((2, 1), (3,), (2, 1), (3,)), num_microbatches=3,
                      global_batch_size=9, interleave=2)
    plan = with_memory_policy(plan, sharded={0, 2}, recompute={0},
                              shard_bytes={0: (2**20, 2 * 2**20), 2: (3 * 2**20, 2**20)})
    plan = with_low_precision(plan, captured)
    assert plan.stages[0].low_precision_params and plan.stages[2].low_precision_params
    train_and_compare(plan, captured, lee_bytes, tmp_path, steps=2, lr=LR, weight_decay=WEIGHT_DECAY,
                      precision="bf16-mixed")


def test_fp16_without_inf_steps_every_time(lee_bytes, tmp_path):
    """The same run without the inf: no step is skipped and the result equals
    GradScaler's single-process training (2 steps; 2 GPUs with unequal shares)."""
    captured = gpt3x64()
    plan = case_plan(captured, "1_then_2_unequal")
    _, rows = train_and_compare(plan, captured, lee_bytes, tmp_path, steps=2, lr=LR, weight_decay=WEIGHT_DECAY,
                                precision="fp16-mixed")
    assert [r["skipped"] for r in rows] == [False, False]
    assert [r["loss_scale"] for r in rows] == [2.0**16, 2.0**16]


@pytest.mark.parametrize("argv, message", [
    (["--grad-reduce-dtype", "bfloat16"], "--grad-reduce-dtype needs --precision"),
    (["--precision", "fp16-mixed", "--grad-reduce-dtype", "bfloat16"],
     "precision 'fp16-mixed' reduces gradients in float32, not 'bfloat16'"),
    (["--precision", "bf17"], "invalid choice: 'bf17'"),
    (["--inject-inf", "1-2"], "--inject-inf expects RANK:STEP with two integers >= 0, got '1-2'"),
    (["--bucket-mib", "0.05"], "--bucket-mib is not a training option"),
])
def test_train_options_are_checked_before_any_rank_starts(argv, message, capsys):
    from zorse_fx.train import parse_args

    with pytest.raises(SystemExit):
        parse_args(["plan", "--tokens", "t.pt", *argv])
    assert message in capsys.readouterr().err


def test_cpu_run_trains_fp32_unless_asked():
    """The plan's precision is for its GPUs; a CPU run trains in fp32 unless
    --precision asks; a GPU run trains with the plan's (its reduction dtype too)."""
    import dataclasses

    from zorse_fx.train import runtime_precision

    captured = gpt3x64()
    plan = dataclasses.replace(case_plan(captured, "2x1"), precision="bf16-mixed", grad_reduce_dtype="bfloat16")
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert runtime_precision(plan, cpu, None)[0].name == "fp32"
    assert "this is a CPU run" in runtime_precision(plan, cpu, None)[1]
    asked = runtime_precision(plan, cpu, "bf16-mixed")[0]
    assert (asked.name, asked.grad_reduce_dtype) == ("bf16-mixed", "bfloat16")
    assert runtime_precision(plan, cpu, "fp16-mixed")[0].grad_reduce_dtype == "float32"
    on_gpu = runtime_precision(plan, gpu, None)[0]
    assert (on_gpu.name, on_gpu.grad_reduce_dtype) == ("bf16-mixed", "bfloat16")


def test_bf16_one_group_two_stages_in_process(lee_bytes, tmp_path):
    """P = 1: one rank hosts both stages (messages to itself, the tied
    embedding's two copies summed on the rank), no torch.distributed; bf16-mixed
    against single-process autocast training, 2 steps."""
    from conftest import TOLERANCES, assert_grads_match, assert_params_match, reference_adamw
    from test_interleaved_runtime import one_group_two_stages, train_in_process
    from zorse_fx.precision import precision_policy

    captured = gpt4x64()
    initial = {k: v.clone() for k, v in captured.state().items()}
    plan, worker = one_group_two_stages(captured, tmp_path, precision_policy("bf16-mixed"))
    steps = 2
    losses, grads1 = train_in_process(worker, plan, lee_bytes, steps)
    tol = TOLERANCES["bf16-mixed"]
    ref_losses, ref_grads, ref_params = reference_adamw(captured, lee_bytes, plan, steps, lr=LR,
                                                          weight_decay=WEIGHT_DECAY, precision="bf16-mixed")
    assert losses == pytest.approx(ref_losses, rel=tol.loss_rel)
    assert_grads_match({0: grads1}, ref_grads, tol)
    assert_params_match({0: worker.parameters_by_name()}, ref_params, initial, steps, LR, tol, ref_grads)
    assert all(p.dtype == torch.float32 for st in worker.stages for p in st.module.parameters())  # master weights
