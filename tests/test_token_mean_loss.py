"""Losses averaged over counted tokens (issue 46): ``cross_entropy(...,
ignore_index=PAD)``, ``(ce * mask).sum() / mask.sum()`` and a Hugging Face
causal LM with labels -100 train equal to single-process training on padded
batches, however unequal the GPUs' sample shares and the samples' token
counts ([Note: token-mean losses] in zorse_fx/capture/loss_count.py,
[Note: share-weighted gradients] in zorse_fx/runtime/stage.py).

Tolerances are ``conftest.FP32`` (float32 sums in another order: see
test_distributed.py for where they come from); each distributed case also
computes, in this process, what the old weighting by sample shares gives on
the same batch and asserts that it is off by far more than that tolerance,
so the test can fail. What capture refuses is checked with its message.

The batches: ``--tokens`` files of ``seq_len + 1`` token chunks, each a run
of real tokens (1..255) of a random length followed by padding (``PAD`` = 0),
one chunk with a single real token (it counts no target at all: a GPU's
slice of a micro-batch that counts no token).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import FP32, fixed_plan, train_and_compare
from zorse_fx.capture import analyse, capture
from zorse_fx.data import global_batch
from zorse_fx.errors import ModelCaptureError
from zorse_fx.models.gpt import GPT, GPTConfig
from zorse_fx.runtime.worker import OptimizerConfig, StageWorker

PAD = 0
T = 16
LR, WD = 1e-3, 0.1


# -- models ----------------------------------------------------------------------------

class PaddedGPT(GPT):
    """The project's GPT with the loss of padded fine-tuning data: targets equal to PAD are ignored."""

    def forward(self, idx, targets):
        B, T_ = idx.size()
        x = self.wte(idx) + self.wpe(torch.arange(0, T_, dtype=torch.long, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=PAD)


class MaskedGPT(GPT):
    """The hand-written token mean: ``(ce * mask).sum() / mask.sum()``, the mask from the targets."""

    def forward(self, idx, targets):
        B, T_ = idx.size()
        x = self.wte(idx) + self.wpe(torch.arange(0, T_, dtype=torch.long, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        ce = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), reduction="none")  # (B T,)
        mask = (targets.view(-1) != PAD).float()
        return (ce * mask).sum() / mask.sum()


def _gpt(cls, method="auto"):
    """``cls`` (2 layers, 32 wide, T tokens), seed 0, captured on a padded example batch."""
    torch.manual_seed(0)
    model = cls(GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=T))
    ids, labels = _padded_example(4)
    return model, capture(model, (ids, labels), method=method)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=T, bos_token_id=1, eos_token_id=1,
                      pad_token_id=PAD)
    return LlamaForCausalLM(cfg)


class PaddedLlama(nn.Module):
    """A Hugging Face causal LM fed a padded token file: labels -100 where the ids are padding (the
    data collators' convention), Hugging Face's own loss on them (ignore_index -100)."""

    def __init__(self, model):
        super().__init__()
        from zorse_fx.models.hf import CausalLMWithLoss

        self.lm = CausalLMWithLoss(model)

    def forward(self, input_ids, labels):
        return self.lm(input_ids, labels.masked_fill(labels == PAD, -100))


def _padded_example(n: int, generator_seed: int = 1):
    """(ids, labels) of ``n`` samples of T tokens: real tokens, then PAD from a per-sample length."""
    g = torch.Generator().manual_seed(generator_seed)
    ids = torch.randint(1, 256, (n, T), generator=g)
    for i, k in enumerate(torch.randint(2, T, (n,), generator=g).tolist()):
        ids[i, k:] = PAD
    return ids, ids.clone()


def padded_tokens(chunks: int, single: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A 1-D token tensor of ``chunks`` chunks of T + 1 tokens: chunk i holds real tokens (1..255)
    for a random length in [2, T + 1], then PAD; the chunks in ``single`` hold one real token
    (their targets, and their labels after Hugging Face's shift, are all padding)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(1, 256, (chunks, T + 1), generator=g)
    lengths = torch.randint(2, T + 2, (chunks,), generator=g)
    for i in range(chunks):
        rows[i, (1 if i in single else int(lengths[i])):] = PAD
    return rows.reshape(-1)


def _batch(tokens, plan, step: int = 0):
    return global_batch(tokens, step, global_batch_size=plan.global_batch_size, seq_len=plan.seq_len,
                        input_names=plan.input_names, label_mode=plan.label_mode)


# -- single-process references -------------------------------------------------------------

def _slices(plan):
    """(micro-batch, first row, end row) of every last-stage GPU's slice of every micro-batch."""
    mb = plan.microbatch_size
    return [(m, m * mb + a, m * mb + b) for m in range(plan.num_microbatches)
            for a, b in plan.stages[-1].sample_ranges()]


def share_weighted(captured, plan, batch):
    """What weighting each last-stage GPU's loss by its share of the samples (the runtime before
    token means) computes, in this process: (loss, gradients by canonical name). A slice without a
    counted token (loss 0 / 0) is left out, the kindest reading of it."""
    from zorse_fx.capture.trace import fetch_attr

    gm = captured.graph_module
    gm.zero_grad(set_to_none=True)
    total = 0.0
    for _, a, b in _slices(plan):
        part = gm(*[batch[n][a:b] for n in captured.input_names])
        if torch.isfinite(part):
            (part * ((b - a) / plan.global_batch_size)).backward()
            total += float(part) * (b - a) / plan.global_batch_size
    grads = {c: fetch_attr(gm, c).grad.detach().clone() for c in captured.trainable()}
    gm.zero_grad(set_to_none=True)
    return total, grads


def assert_old_weighting_fails(captured, plan, batch, ref_loss: float, ref_grads) -> None:
    """The sample-share weighting is off by far more (100x) than the FP32 tolerance the run met."""
    old_loss, old_grads = share_weighted(captured, plan, batch)
    assert abs(old_loss - ref_loss) > 100 * FP32.loss_rel * abs(ref_loss), (old_loss, ref_loss)
    worst = max(float((old_grads[c] - g).abs().max() / (1e-6 + FP32.grad_rel_to_max * g.abs().max()))
                for c, g in ref_grads.items())
    assert worst > 100, f"the old weighting's gradients are only {worst:.1f}x the tolerance off"


def reference(captured, batch):
    """Single-process loss and gradients on the whole batch (the captured graph, as eager)."""
    from conftest import reference_step

    return reference_step(captured, batch)


# -- capture: what is a token mean, what is refused ---------------------------------------

@pytest.mark.parametrize("method", ["fx", "export"])
def test_cross_entropy_ignore_index_is_a_token_mean(method):
    model, captured = _gpt(PaddedGPT, method)
    ids, labels = _padded_example(5, generator_seed=7)
    assert captured.loss_reduction == "token_mean"
    assert int(captured.loss_count(ids, labels)) == int((labels != PAD).sum()) < ids.numel()
    with torch.no_grad():  # the count explains the loss: sum over tokens / count, additive over samples
        whole = float(model(ids, labels)) * int((labels != PAD).sum())
        parts = sum(float(model(ids[i:i + 1], labels[i:i + 1])) * int((labels[i] != PAD).sum()) for i in range(5))
    assert whole == pytest.approx(parts, rel=1e-5)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_masked_sum_over_mask_sum_is_a_token_mean(method):
    _, captured = _gpt(MaskedGPT, method)
    ids, labels = _padded_example(3, generator_seed=3)
    assert captured.loss_reduction == "token_mean"
    assert float(captured.loss_count(ids, labels)) == float((labels != PAD).sum())


class _Guarded(MaskedGPT):
    """``mask.sum().clamp(min=1)``: the guard against a batch without counted tokens."""

    def forward(self, idx, targets):
        B, T_ = idx.size()
        x = self.wte(idx) + self.wpe(torch.arange(0, T_, dtype=torch.long, device=idx.device))
        logits = self.lm_head(self.ln_f(x))
        ce = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), reduction="none")
        mask = (targets.view(-1) != PAD).to(ce.dtype)
        return (ce * mask).sum() / mask.sum().clamp(min=1.0) * 0.5  # a scaling by a number too


def test_clamped_count_is_a_token_mean():
    _, captured = _gpt(_Guarded)
    ids, labels = _padded_example(3, generator_seed=4)
    assert captured.loss_reduction == "token_mean"
    assert float(captured.loss_count(ids, labels)) == float((labels != PAD).sum())
    assert float(captured.loss_count(ids[:1] * 0, labels[:1] * 0)) == 0.0  # the raw count, not the clamp


class _ClassWeighted(nn.Module):
    """A bigram model whose cross-entropy has constant class weights: PyTorch's mean divides by the
    weights of the counted targets."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 16)
        self.head = nn.Linear(16, 256)
        self.register_buffer("class_weight", torch.linspace(0.5, 2.0, 256))

    def forward(self, idx, targets):
        logits = self.head(self.emb(idx))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), weight=self.class_weight, ignore_index=PAD)


def test_class_weighted_cross_entropy_counts_the_weights():
    torch.manual_seed(0)
    ids, labels = _padded_example(4)
    model = _ClassWeighted()
    captured = capture(model, (ids, labels))
    assert captured.loss_reduction == "token_mean"
    want = float((model.class_weight[labels] * (labels != PAD)).sum())
    assert float(captured.loss_count(ids, labels)) == pytest.approx(want, rel=1e-6)


def test_hf_causal_lm_with_ignored_labels_is_a_token_mean():
    """Hugging Face's loss (labels shifted inside, -100 ignored) captured with torch.export: the
    count is the labels after the first position that are not -100."""
    from zorse_fx.models.hf import CausalLMWithLoss

    model = CausalLMWithLoss(_llama())
    ids, _ = _padded_example(4)
    labels = ids.masked_fill(ids == PAD, -100)
    labels[0, :5] = -100  # a masked prompt too
    captured = capture(model, (ids, labels))
    assert captured.method == "export" and captured.loss_reduction == "token_mean"
    assert int(captured.loss_count(ids, labels)) == int((labels[:, 1:] != -100).sum())
    # labels = input ids (zorse train's fixed-length data): T - 1 tokens in every sample, a sample mean
    assert int(captured.loss_count(ids, ids)) == 4 * (T - 1)


def test_fixed_length_lm_loss_is_a_token_mean_counting_every_token():
    """The project's GPT (cross_entropy's default ignore_index -100) counts every target of
    token-file data: T per sample, so it weighs as the sample share (see the bitwise test below)."""
    from conftest import small_gpt

    captured = small_gpt(seq=T)
    ids = torch.randint(0, 256, (3, T))
    assert captured.loss_reduction == "token_mean" and int(captured.loss_count(ids, ids)) == 3 * T


class _SampleMean(nn.Module):
    def __init__(self, divide_by_batch: bool):
        super().__init__()
        self.emb = nn.Embedding(256, 16)
        self.head = nn.Linear(16, 256)
        self.divide_by_batch = divide_by_batch

    def forward(self, idx, targets):
        logits = self.head(self.emb(idx))  # (N, T, V)
        per_sample = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)  # (N,)
        return per_sample.sum() / idx.size(0) if self.divide_by_batch else per_sample.mean()


@pytest.mark.parametrize("divide_by_batch", [False, True])
def test_sample_mean_has_no_count(divide_by_batch):
    ids, labels = _padded_example(4)
    captured = capture(_SampleMean(divide_by_batch), (ids, labels))
    assert captured.loss_reduction == "sample_mean" and captured.loss_count is None


class _LearnedWeights(MaskedGPT):
    """Counted tokens weighted by a learned gate: the divisor reads a parameter."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.gate = nn.Linear(cfg.n_embd, 1)

    def forward(self, idx, targets):
        x = self.wte(idx)
        logits = self.lm_head(self.ln_f(x))
        ce = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), reduction="none")
        w = torch.sigmoid(self.gate(x)).view(-1) * (targets.view(-1) != PAD)
        return (ce * w).sum() / w.sum()


def test_token_mean_over_learned_weights_refused():
    """Refused from the graph: at initialisation the gate is near 0.5 everywhere, and the loss is
    within the example check's tolerance of a sample mean."""
    with pytest.raises(ModelCaptureError) as got:
        _gpt(_LearnedWeights)
    assert re.fullmatch(
        r"_LearnedWeights.forward divides its loss by sum_\d, which reads the parameter 'gate.bias': a normaliser "
        r"learned over the batch's tokens, which no weighting of the GPUs' losses splits over GPUs and micro-batches "
        r"equal to single-device training; divide by a count computed from the inputs alone \(mask.sum\(\)\), or "
        r"return a mean over the samples", str(got.value)), str(got.value)


class _SelectedMean(MaskedGPT):
    """The token mean written as the mean of the counted tokens' losses."""

    def forward(self, idx, targets):
        logits = self.lm_head(self.ln_f(self.wte(idx)))
        ce = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), reduction="none")
        return ce[targets.view(-1) != PAD].mean()


def test_mean_over_selected_tokens_refused_naming_the_mask_sum():
    """ce[mask].mean() is a token mean, but its shapes depend on the mask's values: refused from the
    graph (at initialisation it can pass the example check as a sample mean), with the loss to write."""
    with pytest.raises(ModelCaptureError) as got:
        _gpt(_SelectedMean)
    assert re.fullmatch(
        r"_SelectedMean.forward returns the mean of getitem(_\d)?, the tokens a boolean mask \(ne(_\d)?\) selects: "
        r"their number depends on the mask's values, which zorse_fx's shape analysis cannot plan with; return the "
        r"same token mean as \(loss \* mask\).sum\(\) / mask.sum\(\) \(or cross_entropy\(\.\.\., "
        r"ignore_index=PAD\)\), which it trains weighted by each GPU's count of tokens", str(got.value)), \
        str(got.value)


class _RootCount(MaskedGPT):
    def forward(self, idx, targets):
        logits = self.lm_head(self.ln_f(self.wte(idx)))
        ce = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), reduction="none")
        mask = (targets.view(-1) != PAD).float()
        return (ce * mask).sum() / mask.sum().sqrt()


def test_divisor_not_a_sum_over_tokens_refused():
    with pytest.raises(ModelCaptureError, match=r"^_RootCount.forward must return the mean loss over its samples .*"
                                                r"it is not their mean, and it divides by sqrt, a value of the input "
                                                r"targets, which is not a sum over the samples' tokens \(like "
                                                r"mask.sum\(\)\), so it is no count of tokens either"):
        _gpt(_RootCount)


class _SquaredCount(MaskedGPT):
    def forward(self, idx, targets):
        logits = self.lm_head(self.ln_f(self.wte(idx)))
        ce = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), reduction="none")
        mask = (targets.view(-1) != PAD).float()
        return (ce * mask).sum() / (mask * mask.sum()).sum()  # (sum mask)^2: not a sum over the samples


def test_divisor_not_additive_over_samples_refused():
    with pytest.raises(ModelCaptureError) as got:
        _gpt(_SquaredCount)
    msg = str(got.value)
    assert re.match(r"_SquaredCount.forward divides its loss by sum_\d, a value of the input targets, which is not "
                    r"a count over the samples: it is [0-9.e+]+ on the example batch of 4 but its samples' values "
                    r"\[[0-9., ]+\] sum to [0-9.e+]+; zorse_fx weights", msg), msg
    assert msg.endswith("so the divisor must be a sum over the samples' tokens: divide by mask.sum() with a 0/1 mask "
                        "of the inputs (or use cross_entropy(..., ignore_index=PAD))")


class _NormOverCount(MaskedGPT):
    """A numerator that is no sum over the samples (a norm) over a count of tokens."""

    def forward(self, idx, targets):
        logits = self.lm_head(self.ln_f(self.wte(idx)))
        ce = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), reduction="none")
        mask = (targets.view(-1) != PAD).float()
        return (ce * mask).pow(2).sum().sqrt() / mask.sum()


def test_numerator_not_a_sum_over_the_counted_tokens_refused():
    with pytest.raises(ModelCaptureError) as got:
        _gpt(_NormOverCount)
    msg = str(got.value)
    assert re.match(r"_NormOverCount.forward must return the mean loss over its samples or over the tokens it "
                    r"counts: it divides by sum_\d, a value of the input targets \(\d+ on the example batch of 4, "
                    r"\d+ and \d+ on its halves\), but returns [0-9.]+ where its halves' [0-9.]+ and [0-9.]+ give "
                    r"[0-9.]+ weighted by their counts and [0-9.]+ by their samples; the numerator must be a sum over "
                    r"the same tokens: return sum\(loss \* mask\) / mask.sum\(\), or cross_entropy\(\.\.\., "
                    r"ignore_index=PAD\)$", msg), msg


def test_example_batch_counting_no_token_refused():
    torch.manual_seed(0)
    ids = torch.full((2, T), PAD)
    with pytest.raises(ModelCaptureError, match=r"^PaddedGPT.forward divides its loss by the weight of the targets "
                                                r"of cross_entropy that are not its ignore_index 0, which counts no "
                                                r"token on the example batch of 2: .*give example inputs with counted "
                                                r"tokens"):
        capture(PaddedGPT(GPTConfig(n_layer=1, n_embd=32, block_size=T)), (ids, ids))


# -- the plan: loss_reduction in plan.json and the last stage file --------------------------

def test_token_mean_plan_records_its_count(tmp_path):
    from conftest import edit_plan_json, plan_load_error
    from zorse_fx.plan import Plan

    _, captured = _gpt(PaddedGPT)
    plan = fixed_plan(captured, ((0,), (2, 3)), ((3,), (1, 2)), num_microbatches=2, global_batch_size=6)
    assert plan.loss_reduction == "token_mean"
    assert "LOSS_REDUCTION = 'token_mean'" in plan.sources[-1] and "def loss_count(self, targets):" in plan.sources[-1]
    assert "loss_count" not in plan.sources[0]
    path = plan.export(tmp_path / "p")
    assert Plan.load(path) == plan
    edited = edit_plan_json(tmp_path / "p", lambda d: d.update(loss_reduction="sample_mean"))
    assert plan_load_error(edited) == (
        f"{edited}: field 'loss_reduction' is 'sample_mean', but stage_1.py (Stage1.LOSS_REDUCTION) was generated "
        f"for 'token_mean' (how its loss averages, which the runtime weights each GPU's loss by); plan.json must "
        f"agree with its stage files: set it back to 'token_mean', or re-export the plan with `zorse plan`")
    edited = edit_plan_json(tmp_path / "p", lambda d: d.update(loss_reduction="tokens"))
    assert "field 'loss_reduction' is 'tokens'" in plan_load_error(edited)


def test_plan_of_format_13_reads_as_a_sample_mean(tmp_path):
    from conftest import edit_plan_json, plan_load_error
    from zorse_fx.plan import Plan

    ids, labels = _padded_example(4)
    captured = capture(_SampleMean(False), (ids, labels))
    plan = fixed_plan(captured, ((0,), (2,)), ((2,), (2,)), num_microbatches=2, global_batch_size=4)
    assert plan.loss_reduction == "sample_mean"
    plan.export(tmp_path / "p")
    old = edit_plan_json(tmp_path / "p", lambda d: (d.pop("loss_reduction"), d.update(version=13)))
    assert Plan.load(old).loss_reduction == "sample_mean"
    # a token-mean plan.json over stage files without loss_count (or edited) is refused
    tm = edit_plan_json(tmp_path / "p", lambda d: d.update(loss_reduction="token_mean", version=14))
    assert "field 'loss_reduction' is 'token_mean', but stage_1.py (Stage1.LOSS_REDUCTION) was generated for " \
           "'sample_mean'" in plan_load_error(tm)


# -- the runtime in one process: micro-batches of unequal token counts ----------------------

def test_fixed_length_token_mean_trains_bitwise_as_the_sample_mean(lee_bytes, tmp_path):
    """The GPT's token mean over fixed-length data counts T tokens per sample: the count-weighted
    step is the sample-share-weighted step, bit for bit (loss and every gradient)."""
    from conftest import first_batch, small_gpt

    captured = small_gpt(seq=T)
    plan = fixed_plan(captured, ((0,),), ((3,),), num_microbatches=2, global_batch_size=6)
    assert plan.loss_reduction == "token_mean"
    batch = first_batch(lee_bytes, plan)
    out = []
    for p in (plan, dataclasses.replace(plan, loss_reduction="sample_mean")):
        worker = StageWorker(p, tmp_path, captured.state(), rank=0, device=torch.device("cpu"))
        out.append((worker.train_step(batch), worker.gradients()))
    (loss_t, grads_t), (loss_s, grads_s) = out
    assert torch.equal(loss_t, loss_s)
    assert grads_t.keys() == grads_s.keys() and all(torch.equal(grads_t[c], grads_s[c]) for c in grads_t)


def test_hf_ignored_labels_over_micro_batches_equal_single_process(tmp_path):
    """CausalLMWithLoss fed labels -100 directly (a masked prompt, padding): one GPU, 3
    micro-batches of unequal token counts, one counting none (Hugging Face's gradient-accumulation
    case); the step's loss, its gradients and the evaluation loss equal the whole batch's."""
    from zorse_fx.models.hf import CausalLMWithLoss

    ids, _ = _padded_example(6, generator_seed=5)
    labels = ids.masked_fill(ids == PAD, -100)
    labels[1, :6] = -100  # a masked prompt
    labels[[2, 3]] = -100  # micro-batch 1 (samples 2, 3) counts no token
    captured = capture(CausalLMWithLoss(_llama()), (ids[:4], labels[:4]))
    plan = fixed_plan(captured, ((0,),), ((2,),), num_microbatches=3, global_batch_size=6, label_mode="same")
    assert plan.loss_reduction == "token_mean"
    batch = {"input_ids": ids, "labels": labels}
    ref_loss, ref_grads = reference(captured, batch)
    worker = StageWorker(plan, tmp_path, captured.state(), rank=0, device=torch.device("cpu"),
                         optimizer=OptimizerConfig(lr=LR, weight_decay=WD))
    with torch.no_grad():
        eval_loss = float(worker.eval_step(batch))
    assert eval_loss == pytest.approx(ref_loss, rel=FP32.loss_rel)
    loss = float(worker.train_step(batch))
    assert loss == pytest.approx(ref_loss, rel=FP32.loss_rel)
    grads = worker.gradients()
    for c, g in ref_grads.items():
        torch.testing.assert_close(grads[c], g, rtol=0, atol=1e-6 + FP32.grad_rel_to_max * g.abs().max().item())
    assert worker.stages[-1].loss_weights[1] == 0.0
    assert_old_weighting_fails(captured, plan, batch, ref_loss, ref_grads)


# -- distributed: Gloo ranks, unequal shares, padded batches, 2 AdamW steps -----------------

def _train(captured, plan, tokens, tmp_path, extra=()):
    """2 AdamW steps under ``zorse_fx.train`` equal single-process training (``train_and_compare``:
    losses, step-1 gradients, final parameters), and the old weighting fails on step 1's batch.
    Returns the metrics rows; ``captured`` holds the reference's weights after the 2 steps."""
    assert plan.loss_reduction == "token_mean"
    batch = _batch(tokens, plan)
    ref_loss, ref_grads = reference(captured, batch)
    assert_old_weighting_fails(captured, plan, batch, ref_loss, ref_grads)
    slices = [int(captured.loss_count(*[batch[n][a:b] for n in captured.input_names])) for _, a, b in _slices(plan)]
    samples = [int(captured.loss_count(*[batch[n][i:i + 1] for n in captured.input_names]))
               for i in range(plan.global_batch_size)]
    assert 0 in slices and max(samples) > 3 * min(c for c in samples if c), (slices, samples)  # one slice empty
    _, rows = train_and_compare(plan, captured, tokens, tmp_path, steps=2, lr=LR, weight_decay=WD, extra=extra)
    return rows


def test_padded_cross_entropy_ignore_index_distributed_equals_single_process(tmp_path):
    """cross_entropy(..., ignore_index=PAD) (fx): stage 0 on GPU 0, stage 1 on GPUs 2, 3 taking
    1 and 2 samples of each of 2 micro-batches; GPU 2's slice of micro-batch 1 is all padding.
    The validation loss (--val-every 2: the corpus's last global batch, padded too, GPU 2's slice
    of micro-batch 0 all padding) is the token mean single-process evaluation gives."""
    _, captured = _gpt(PaddedGPT)
    plan = fixed_plan(captured, ((0,), (2, 3)), ((3,), (1, 2)), num_microbatches=2, global_batch_size=6,
                      cuts=(analyse(captured).num_blocks // 2,))
    tokens = padded_tokens(18, single=(3, 12))  # 2 training batches, then the validation batch
    rows = _train(captured, plan, tokens, tmp_path, extra=("--val-every", "2"))
    val = _batch(tokens, plan, step=2)  # chunks 12..17: the held-out batch
    with torch.no_grad():
        want = float(captured.graph_module(*[val[n] for n in captured.input_names]))  # after the 2 steps
    assert "val_loss" not in rows[0] and rows[1]["val_loss"] == pytest.approx(want, rel=FP32.loss_rel)
    assert abs(share_weighted(captured, plan, val)[0] - want) > 100 * FP32.loss_rel * want


def test_padded_mask_sum_distributed_equals_single_process(tmp_path):
    """(ce * mask).sum() / mask.sum() (torch.export): both stages on two GPUs (2:1 samples), 3
    micro-batches; GPU 3's slice of micro-batch 1 is all padding."""
    _, captured = _gpt(MaskedGPT, "export")
    plan = fixed_plan(captured, ((0, 1), (2, 3)), ((2, 1), (2, 1)), num_microbatches=3, global_batch_size=9,
                      cuts=(analyse(captured).num_blocks // 2,))
    _train(captured, plan, padded_tokens(18, single=(5,), seed=1), tmp_path)


def test_hf_llama_padded_labels_distributed_equals_single_process(tmp_path):
    """A tiny Llama (random init) whose labels are -100 at padding, Hugging Face's own loss:
    stage 0 on GPU 0, stage 1 on GPUs 2, 3 (1:2 samples), 2 micro-batches, label_mode "same"."""
    model = PaddedLlama(_llama())
    ids, _ = _padded_example(4)
    captured = capture(model, (ids, ids))
    tokens = padded_tokens(12, single=(3,), seed=2)
    plan = fixed_plan(captured, ((0,), (2, 3)), ((3,), (1, 2)), num_microbatches=2, global_batch_size=6, cuts=(2,),
                      label_mode="same")
    batch = _batch(tokens, plan)
    with torch.no_grad():  # the captured graph is Hugging Face's eager loss on the padded batch
        eager = float(model(batch["input_ids"], batch["labels"]))
    assert float(captured.graph_module(batch["input_ids"], batch["labels"])) == pytest.approx(eager, rel=1e-6)
    _train(captured, plan, tokens, tmp_path)
