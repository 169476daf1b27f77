"""The capture pass that turns an explicit causal attention mask into
``is_causal=True`` ([Note: causal masks] in zorse_fx/capture/causal.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zorse_fx.capture import capture
from zorse_fx.capture.causal import _SDPA

#: fp32 tolerance: the rewritten graph runs the same SDPA arithmetic on the same
#: values (the masked entries are exactly 0 after softmax either way); a fused causal
#: kernel may sum the S = 32 products of a row in another order: a few ulps of the
#: O(1) results, far inside this.
FP32 = dict(rtol=1e-5, atol=1e-6)


def _sdpa(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _SDPA]


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    from zorse_fx.models.hf import CausalLMWithLoss

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return CausalLMWithLoss(LlamaForCausalLM(cfg))


def test_hf_llama_mask_becomes_is_causal_with_equal_loss_and_gradients():
    """Hugging Face Llama builds its causal mask in the graph: every layer's SDPA gets
    is_causal=True and no mask, the mask's nodes are gone, and the loss and every
    parameter's gradient equal the graph with the mask kept (and eager) at another batch
    size than the captured one."""
    model = _tiny_llama()
    ids = torch.randint(0, 256, (4, 32))
    new, old = capture(model, (ids, ids)), capture(model, (ids, ids), causal_masks=False)
    assert (new.causal_masks, old.causal_masks) == (2, 0)
    assert all(n.args[3] is None and n.args[5] is True for n in _sdpa(new.graph_module))
    assert all(n.args[3] is not None for n in _sdpa(old.graph_module))
    assert len(new.graph_module.graph.nodes) < len(old.graph_module.graph.nodes)
    x = torch.randint(0, 256, (3, 32))
    losses, grads = [], []
    for gm in (new.graph_module, old.graph_module):
        gm.zero_grad()
        loss = gm(x, x.clone())
        loss.backward()
        losses.append(loss.detach())
        grads.append({k: p.grad.clone() for k, p in gm.named_parameters()})
    torch.testing.assert_close(losses[0], losses[1], **FP32)
    torch.testing.assert_close(losses[0], model(x, x).detach(), **FP32)
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], **FP32, msg=k)


class _Masked(nn.Module):
    """One attention layer whose mask is built by ``make_mask(ids, T)``."""

    def __init__(self, make_mask):
        super().__init__()
        self.emb, self.qkv, self.make_mask = nn.Embedding(64, 16), nn.Linear(16, 48), make_mask

    def forward(self, ids, targets):
        n, t = ids.shape
        q, k, v = self.qkv(self.emb(ids)).view(n, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.make_mask(ids, t))
        return F.cross_entropy(y.transpose(1, 2).reshape(n * t, 16)[:, :16] @ self.emb.weight.T, targets.reshape(-1))


def _causal(ids, t):
    return torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()


def _upper(ids, t):  # the transpose: attends to later tokens only
    return torch.ones(t, t, dtype=torch.bool, device=ids.device).triu()


def _padded(ids, t):  # causal and not padding: reads the input's values
    return _causal(ids, t)[None, None] & (ids != 0)[:, None, None, :]


def _additive(ids, t):  # HF's float form: 0 where allowed, the dtype's minimum elsewhere
    keep = _causal(ids, t)
    return torch.zeros(t, t).masked_fill(~keep, torch.finfo(torch.float32).min)


def _window(ids, t):  # causal, but a sliding window of 4: not is_causal
    i = torch.arange(t, device=ids.device)
    return (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 4)


@pytest.mark.parametrize(("make_mask", "rewritten"), [
    (_causal, 1), (_additive, 1), (_upper, 0), (_padded, 0), (_window, 0)])
def test_only_a_mask_equal_to_the_causal_one_is_rewritten(make_mask, rewritten):
    torch.manual_seed(0)
    model = _Masked(make_mask)
    ids = torch.randint(1, 64, (2, 8))
    cap = capture(model, (ids, ids.clone()), method="export")
    assert cap.causal_masks == rewritten
    x = torch.randint(0, 64, (3, 8))
    torch.testing.assert_close(cap.graph_module(x, x.clone()), model(x, x), **FP32)


def test_the_cost_model_prices_the_rewritten_attention_as_causal():
    """Once rewritten, the attention nodes are priced causal (half the QK^T/PV work)
    and unmasked (Hopper's unmasked cuDNN rate), not as an explicit mask."""
    from zorse_fx.capture import analyse
    from zorse_fx.cost.roofline import node_costs

    model = _tiny_llama()
    ids = torch.randint(0, 256, (4, 32))
    for keep, masked, causal in ((False, False, True), (True, True, False)):
        bg = analyse(capture(model, (ids, ids), causal_masks=not keep))
        costs = node_costs(bg)
        attn = [n.name for n in _sdpa(bg.captured.graph_module)]
        assert attn and all((costs[a].masked, costs[a].causal) == (masked, causal) for a in attn)
