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
