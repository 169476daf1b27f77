"""A distributed run equals single-process training: same loss, same gradient
for every parameter (Gloo, one process per planned GPU, torchrun).

Tolerances: fp32 sums in a different order (micro-batches, shares, all-reduce)
differ by rounding only: loss to 1e-5 relative, each gradient to
``atol = 1e-6 + 1e-4 * max|g_ref|``.
"""

from __future__ import annotations

import pytest
import torch

from conftest import CLUSTERS, first_batch, reference_step, run_distributed
from zorse_fx.capture import analyse, capture
from zorse_fx.cluster import Cluster
from zorse_fx.models.gpt import GPT, GPTConfig
from zorse_fx.planner import PlanOptions, plan_fixed

SEQ = 32


def _gpt_captured():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=3, n_embd=64, n_head=4, block_size=SEQ))
    ids = torch.randint(0, 256, (4, SEQ))
    return capture(model, (ids, ids))


def _check(plan, captured, lee_bytes, tmp_path):
    ref_loss, ref_grads = reference_step(captured, first_batch(lee_bytes, plan))
    rows, grads = run_distributed(plan, captured.state(), lee_bytes, tmp_path)
    assert rows[0]["loss"] == pytest.approx(ref_loss, rel=1e-5)
    seen = set()
    for rank, g in grads.items():
        for name, value in g.items():
            ref = ref_grads[name]
            tol = 1e-6 + 1e-4 * ref.abs().max().item()
            torch.testing.assert_close(value, ref, atol=tol, rtol=0, msg=lambda m: f"rank {rank} {name}: {m}")
            seen.add(name)
    assert seen == set(ref_grads), f"parameters without a gradient: {set(ref_grads) - seen}"


CASES = {
    # name: (stage_gpus, samples per micro-batch, micro-batches, global batch)
    "2x1": (((0,), (1,)), ((4,), (4,)), 2, 8),
    "1_then_2_unequal": (((0,), (2, 3)), ((3,), (2, 1)), 2, 6),
    "3_stages_asymmetric": (((0, 2), (1,), (3,)), ((2, 1), (3,), (3,)), 2, 6),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gpt_distributed_equals_single_process(case, lee_bytes, tmp_path):
    stage_gpus, samples, m, gb = CASES[case]
    captured = _gpt_captured()
    cluster = Cluster.from_yaml(CLUSTERS / "small_hetero.yaml")
    nb = analyse(captured).num_blocks
    ns = len(stage_gpus)
    cuts = [round(i * nb / ns) for i in range(ns + 1)]
    plan, _ = plan_fixed(
        captured, cluster, PlanOptions(global_batch_size=gb),
        stage_blocks=tuple((cuts[i], cuts[i + 1]) for i in range(ns)),
        stage_gpus=stage_gpus, samples_per_microbatch=samples, num_microbatches=m,
    )
    assert plan.num_stages == ns
    _check(plan, captured, lee_bytes, tmp_path)


def test_hf_llama_tied_embeddings_distributed(lee_bytes, tmp_path):
    """HF Llama (torch.export route), tied input/output embedding held by the
    first and the last stage: 1 GPU, then 2 GPUs with unequal shares."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from zorse_fx.models.hf import CausalLMWithLoss

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    ids = torch.randint(0, 256, (4, SEQ))
    captured = capture(CausalLMWithLoss(LlamaForCausalLM(cfg)), (ids, ids))
    cluster = Cluster.from_yaml(CLUSTERS / "small_hetero.yaml")
    plan, _ = plan_fixed(
        captured, cluster, PlanOptions(global_batch_size=6),
        stage_blocks=((0, 2), (2, analyse(captured).num_blocks)),
        stage_gpus=((0,), (2, 3)), samples_per_microbatch=((3,), (1, 2)), num_microbatches=2, label_mode="same",
    )
    assert plan.shared_params() == {"model.model.embed_tokens.weight": (0, 1)}
    _check(plan, captured, lee_bytes, tmp_path)
