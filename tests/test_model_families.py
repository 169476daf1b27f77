"""Which models zorse_fx trains and which it refuses, and how."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import assert_grads_match, first_batch, fixed_plan, reference_step, run_distributed
from zorse_fx.capture import analyse, capture


class _NarrowTail(nn.Module):
    """A model whose last block reads no parameter: the head's 256 logits per
    token are averaged to 16 (the cheapest cut), then widened back without a
    parameter before the loss."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 32)
        self.l1 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 256)

    def forward(self, ids, labels):
        h = self.l1(self.emb(ids)).relu()
        z = self.head(h).unflatten(-1, (16, 16)).mean(-1)  # (N, T, 16)
        z = torch.tanh(z).repeat_interleave(16, -1) * 3.0  # (N, T, 256)
        return F.cross_entropy(z.flatten(0, 1), labels.flatten())


def test_parameterless_stage_trains_equal_to_eager(lee_bytes, tmp_path):
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (4, 16))
    captured = capture(_NarrowTail(), (ids, ids))
    bg = analyse(captured)
    assert bg.block_attrs[-1] == ()
    plan = fixed_plan(captured, ((0,), (1,)), ((2,), (2,)), num_microbatches=2, global_batch_size=4,
                      cuts=(bg.num_blocks - 1,))
    assert [s.num_parameters for s in plan.stages][-1] == 0
    ref_loss, ref_grads = reference_step(captured, first_batch(lee_bytes, plan))
    rows, grads = run_distributed(plan, captured.state(), lee_bytes, tmp_path)
    assert rows[0]["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_match(grads, ref_grads)


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    from zorse_fx.models.hf import CausalLMWithLoss

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    ids = torch.randint(0, 256, (4, 32))
    return capture(CausalLMWithLoss(MixtralForCausalLM(cfg)), (ids, ids))


def test_mixtral_trains_equal_to_eager(lee_bytes, tmp_path):
    """Mixtral's experts run transformers' grouped-matmul custom op; the stage
    sources import the module that registers it, so every rank finds it."""
    captured = _mixtral()
    plan = fixed_plan(captured, ((0,), (2, 3)), ((3,), (1, 2)), num_microbatches=2, global_batch_size=6,
                      label_mode="same")
    assert any("import transformers.integrations.moe" in src for src in plan.sources)
    ref_loss, ref_grads = reference_step(captured, first_batch(lee_bytes, plan))
    rows, grads = run_distributed(plan, captured.state(), lee_bytes, tmp_path)
    assert rows[0]["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_match(grads, ref_grads)
