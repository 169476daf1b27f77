"""Stage recomputation in one process (a 1-stage, 1-GPU plan needs no
torch.distributed): same loss and gradients as storing activations, with the
dropout masks of the first forward replayed in the recompute.

ZeRO-1 needs a data-parallel group, so it is tested with torchrun in
``test_distributed.py`` (parameters, losses, gradients and optimizer-state
sizes).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from conftest import CLUSTERS, first_batch
from zorse_fx.capture import analyse, capture
from zorse_fx.cluster import Cluster
from zorse_fx.models.gpt import GPT, GPTConfig
from zorse_fx.planner import PlanOptions, plan_fixed
from zorse_fx.runtime.worker import StageWorker

T = 16


class DropoutGPT(GPT):
    """GPT with dropout after the embeddings and after every block: a forward
    that depends on the RNG."""

    def forward(self, idx, targets):
        B, T = idx.size()
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = F.dropout(self.wte(idx) + self.wpe(pos), 0.3, training=True)
        for block in self.h:
            x = F.dropout(block(x), 0.3, training=True)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


@pytest.fixture(scope="module")
def dropout_plan():
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, T))
    captured = capture(DropoutGPT(GPTConfig(n_layer=2, n_embd=32, block_size=T)), (ids, ids))
    nb = analyse(captured).num_blocks
    plan, _ = plan_fixed(captured, Cluster.from_yaml(CLUSTERS / "small_hetero.yaml"),
                         PlanOptions(global_batch_size=4, schedule="gpipe"), stage_blocks=((0, nb),),
                         stage_gpus=((0,),), samples_per_microbatch=((2,),), num_microbatches=2)
    return plan, captured.state()


def _step(plan, weights, tmp_path, batch, seed):
    plan.export(tmp_path)
    worker = StageWorker(plan, tmp_path, weights, rank=0, device=torch.device("cpu"))
    grad_modes: list[bool] = []
    worker.module.register_forward_pre_hook(lambda *_: grad_modes.append(torch.is_grad_enabled()))
    torch.manual_seed(seed)
    loss = worker.train_step(batch)
    return loss, worker.gradients(), torch.get_rng_state(), grad_modes


def test_recompute_replays_dropout_masks(dropout_plan, lee_bytes, tmp_path):
    plan, weights = dropout_plan
    batch = first_batch(lee_bytes, plan)
    recomputing = dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], recompute=True),))
    loss, grads, rng_after, modes = _step(plan, weights, tmp_path / "a", batch, seed=1)
    loss_r, grads_r, rng_after_r, modes_r = _step(recomputing, weights, tmp_path / "b", batch, seed=1)
    # GPipe over 2 micro-batches: 2 forwards with a graph, vs 2 without + 2 recomputes with one.
    assert modes == [True, True]
    assert modes_r == [False, False, True, True]
    # Dropout matters here: another seed gives another loss.
    loss_other, *_ = _step(plan, weights, tmp_path / "c", batch, seed=2)
    assert abs(loss_other - loss) > 1e-4
    assert loss_r == pytest.approx(loss, rel=1e-6)
    assert set(grads_r) == set(grads) == set(plan.stages[0].params.values())
    for name, g in grads.items():
        # Same masks, same arithmetic: equal up to rounding (a different mask changes them at O(1)).
        torch.testing.assert_close(grads_r[name], g, rtol=1e-5, atol=1e-7 * g.abs().max().item(), msg=name)
    # The recompute ran under fork_rng: the global RNG stream is where it would be without it.
    assert torch.equal(rng_after_r, rng_after)
