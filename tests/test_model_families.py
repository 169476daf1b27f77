"""Which models zorse_fx trains and which it refuses, and how (issue 33).

Trained equal to eager (Gloo, one process per planned GPU, fp32 tolerances of
test_distributed.py): a plan whose last stage reads no parameter, planned in
fp16-mixed and trained in fp32 (a CPU run), and Mixtral (its experts call
transformers' grouped-matmul custom op; the Qwen2-MoE check is single-process).
Refused at capture, before the planner runs, with a one-line reason: a loss
that is not the mean over the samples ([Note: the loss contract] in
zorse_fx/capture/trace.py), Hugging Face models that are not decoder-only
causal LMs or add the router's batch-wide loss ([Note: which Hugging Face
models] in zorse_fx/models/hf.py), alone or inside a user's wrapper module,
inputs other than token batches, and batch-norm layers in training mode.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zorse_fx as zorse
from conftest import (CLUSTERS, FP32, assert_grads_match, first_batch, fixed_plan, reference_step, run_distributed,
                      with_memory_policy)
from zorse_fx.capture import analyse, capture
from zorse_fx.cli import main as zorse_main
from zorse_fx.errors import ModelCaptureError

T = 16
CLUSTER = CLUSTERS / "small_hetero.yaml"  # no bfloat16: plans are fp16-mixed


def _compile(model, *inputs):
    return zorse.compile(model, cluster=CLUSTER, example_inputs=inputs, global_batch_size=4, solver_budget=1.0)


# -- the loss contract ----------------------------------------------------------

class _Reduced(nn.Module):
    """A bigram model with dropout; its token cross-entropy reduced by ``reduction``."""

    def __init__(self, reduction: str, always_drop: bool = False):
        super().__init__()
        self.emb = nn.Embedding(256, 32)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(32, 256)
        self.reduction = reduction
        self.always_drop = always_drop  # functional dropout, random in eval mode too

    def forward(self, idx, targets):
        x = F.dropout(self.emb(idx), 0.1, training=True) if self.always_drop else self.drop(self.emb(idx))
        logits = self.head(x)  # (N, T, 256)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=self.reduction)


@pytest.mark.parametrize("always_drop", [False, True])
def test_loss_reduction_sum_refused(always_drop):
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (4, T))
    with pytest.raises(ModelCaptureError, match=r"must return the mean loss over its samples.*"
                                                r"it is their sum.*reduction='mean'"):
        capture(_Reduced("sum", always_drop), (ids, ids))


def test_loss_reduction_mean_accepted():
    """A token mean over equal-length samples is their mean. The check runs in
    eval mode: dropout (p = 0.5, training mode) would make the batch and its
    halves different functions; the model is left in training mode."""
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (3, T))  # odd: halves of 1 and 2 samples
    model = _Reduced("mean")
    captured = capture(model, (ids, ids))
    assert model.training and model.drop.training
    assert captured.input_names == ("idx", "targets")
    capture(_Reduced("mean", always_drop=True), (ids, ids))  # random in eval mode too: held to 25%


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
    """The last stage reads no parameter (two GPUs, unequal shares, ZeRO-1):
    it computes the loss and steps nothing."""
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (4, 16))
    captured = capture(_NarrowTail(), (ids, ids))
    bg = analyse(captured)
    assert bg.block_attrs[-1] == ()
    plan = fixed_plan(captured, ((0,), (2, 3)), ((3,), (1, 2)), num_microbatches=2, global_batch_size=6,
                      cuts=(bg.num_blocks - 1,))
    plan = with_memory_policy(plan, sharded=(1,))  # ZeRO-1 over nothing: both GPUs own no element
    assert [s.num_parameters for s in plan.stages][-1] == 0
    assert plan.precision == "fp16-mixed"  # and trained in fp32 (a CPU run): test_plan_fp16_trained_fp32
    ref_loss, ref_grads = reference_step(captured, first_batch(lee_bytes, plan))
    rows, grads = run_distributed(plan, captured.state(), lee_bytes, tmp_path)
    assert rows[0]["loss"] == pytest.approx(ref_loss, rel=FP32.loss_rel)
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


def test_moe_router_aux_loss_refused():
    from transformers import MixtralConfig, MixtralForCausalLM

    from zorse_fx.models.hf import CausalLMWithLoss

    cfg = MixtralConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, output_router_logits=True)
    with pytest.raises(ModelCaptureError, match=r"^MixtralForCausalLM adds its router's load-balancing loss "
                                                r"\(output_router_logits=True\).*output_router_logits = False$"):
        CausalLMWithLoss(MixtralForCausalLM(cfg))


def test_mixtral_trains_equal_to_eager(lee_bytes, tmp_path):
    """Mixtral's experts run transformers' grouped-matmul custom op; the stage
    sources import the module that registers it, so every rank finds it."""
    captured = _mixtral()
    plan = fixed_plan(captured, ((0,), (2, 3)), ((3,), (1, 2)), num_microbatches=2, global_batch_size=6,
                      label_mode="same")
    assert any("import transformers.integrations.moe" in src for src in plan.sources)
    ref_loss, ref_grads = reference_step(captured, first_batch(lee_bytes, plan))
    rows, grads = run_distributed(plan, captured.state(), lee_bytes, tmp_path)
    assert rows[0]["loss"] == pytest.approx(ref_loss, rel=FP32.loss_rel)
    assert_grads_match(grads, ref_grads)


# -- Hugging Face families zorse_fx does not train: refused before capture --------

def test_bert_masked_lm_refused():
    from transformers import BertConfig, BertForMaskedLM, BertLMHeadModel

    cfg = BertConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=T)
    ids = torch.randint(0, 256, (2, T))
    with pytest.raises(ModelCaptureError, match=r"^BertForMaskedLM is a masked LM; .*masked-LM training is not "
                                                r"supported$"):
        _compile(BertForMaskedLM(cfg), ids)
    with pytest.raises(ModelCaptureError, match=r"^BertLMHeadModel has is_decoder=False: .*is_decoder=True$"):
        _compile(BertLMHeadModel(cfg), ids)


def test_t5_refused():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, decoder_start_token_id=0)
    with pytest.raises(ModelCaptureError, match=r"^T5ForConditionalGeneration is an encoder-decoder model; "
                                                r"zorse_fx pipelines decoder-only causal LMs"):
        _compile(T5ForConditionalGeneration(cfg), torch.randint(0, 256, (2, T)))


def test_vit_refused():
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, image_size=16,
                    patch_size=8, num_labels=3)
    with pytest.raises(ModelCaptureError, match=r"^ViTForImageClassification reads 'pixel_values', not token ids"):
        _compile(ViTForImageClassification(cfg), torch.randn(2, 3, 16, 16))

    class Wrapped(nn.Module):  # a user's wrapper: the loss of an image batch
        def __init__(self):
            super().__init__()
            self.vit = ViTForImageClassification(cfg)

        def forward(self, pixel_values, labels):
            return self.vit(pixel_values=pixel_values, labels=labels).loss

    with pytest.raises(ModelCaptureError, match=r"^Wrapped takes inputs \(2, 3, 16, 16\) float32, \(2,\) int64; "
                                                r"zorse_fx trains on token batches"):
        _compile(Wrapped(), torch.randn(2, 3, 16, 16), torch.tensor([0, 2]))


T5_WRAPPER = """\
import torch
from transformers import T5Config, T5ForConditionalGeneration


class Seq2Seq(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.t5 = T5ForConditionalGeneration(T5Config(vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                                      num_heads=4, decoder_start_token_id=0))

    def forward(self, ids, labels):
        return self.t5(input_ids=ids, labels=labels).loss


def build():
    return Seq2Seq()
"""


def test_t5_in_a_wrapper_refused(tmp_path, monkeypatch, capsys):
    """`zorse plan --model mymod:build` of a wrapper holding a T5: the
    README's one-line refusal naming the wrapper and where the T5 sits, before
    capture (was a raw view error from tracing, or a plan of a model
    zorse_fx does not train)."""
    (tmp_path / "zorse_test_t5mod.py").write_text(T5_WRAPPER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "zorse_test_t5mod", raising=False)
    assert zorse_main(["plan", "--model", "zorse_test_t5mod:build", "--cluster", str(CLUSTER), "--global-batch-size",
                       "4", "--seq-len", str(T), "-o", str(tmp_path / "p")]) == 1
    out = capsys.readouterr()
    assert out.err == ("zorse: Seq2Seq holds a T5ForConditionalGeneration (.t5), which is an encoder-decoder model; "
                       "zorse_fx pipelines decoder-only causal LMs, not an encoder and a decoder\n")
    assert "[zorse] captured" not in out.out and not (tmp_path / "p").exists()


def test_non_causal_models_in_a_wrapper_refused():
    """What cannot be pipelined whatever a wrapper's loss, inside a wrapper: a
    MoE router loss over the whole batch (an encoder-decoder model and a
    vision model: test_t5_in_a_wrapper_refused, test_vit_refused). A base
    decoder under the wrapper's own head, a bidirectional encoder under a
    question-answering head and a masked LM are the wrapper's business and
    pass (its loss is its own: span prediction, its own masking)."""
    from transformers import (BertConfig, BertForMaskedLM, BertForQuestionAnswering, BertModel, LlamaConfig,
                              LlamaModel, MixtralConfig, MixtralForCausalLM)

    from zorse_fx.models.hf import check_wrapped_models

    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.body = nn.ModuleDict({"lm": inner})

    moe = MixtralForCausalLM(MixtralConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=2,
                                           output_router_logits=True))
    with pytest.raises(ModelCaptureError) as e:
        capture(Wrapper(moe), (torch.randint(0, 256, (2, T)),) * 2)
    assert str(e.value).startswith("Wrapper holds a MixtralForCausalLM (.body.lm), which adds its router's "
                                   "load-balancing loss (output_router_logits=True)"), str(e.value)
    bert = BertConfig(vocab_size=256, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    for inner in (LlamaModel(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4)),
                  BertModel(bert), BertForQuestionAnswering(bert), BertForMaskedLM(bert),
                  BertModel(BertConfig(**{**bert.to_dict(), "is_decoder": True}))):
        check_wrapped_models(Wrapper(inner))


def test_batchnorm_refused_at_plan_time():
    class Pooled(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(256, 32)
            self.bn = nn.BatchNorm1d(32)
            self.head = nn.Linear(32, 256)

        def forward(self, ids, labels):
            return F.cross_entropy(self.head(self.bn(self.emb(ids).mean(1))), labels[:, 0])

    ids = torch.randint(0, 256, (4, T))
    model = Pooled()
    with pytest.raises(ModelCaptureError, match=r"^BatchNorm1d 'bn' normalises with batch statistics in training "
                                                r"mode.*call \.eval\(\) on it\)$"):
        _compile(model, ids, ids)
    model.bn.eval()  # frozen statistics: a per-sample function
    assert _compile(model, ids, ids).plan.num_stages >= 1


# -- a plan trained in another precision than it was planned in -----------------

def test_plan_fp16_trained_fp32(tmp_path):
    """A cut tensor the fp16-mixed plan recorded as float16 (autocast's output)
    is computed, sent and received in float32 by an fp32 run (a CPU run of a GPU
    plan): the receiving stage never mixes Half and Float. (The parameter-less
    stage test below trains this plan in fp32 equal to eager.)"""
    from zorse_fx.precision import precision_policy
    from zorse_fx.runtime.p2p import build_programs
    from zorse_fx.runtime.stage import StageRuntime

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (4, T))
    captured = capture(_NarrowTail(), (ids, ids))
    plan = fixed_plan(captured, ((0,), (1,)), ((2,), (2,)), num_microbatches=2, global_batch_size=4,
                      cuts=(analyse(captured).num_blocks - 1,))
    assert plan.precision == "fp16-mixed" and [t.dtype for t in plan.stages[1].recv] == ["float16"]
    plan.export(tmp_path)
    fp32 = precision_policy("fp32")
    st = StageRuntime(plan, 1, tmp_path, captured.state(), rank=1, device=torch.device("cpu"), precision=fp32)
    assert [t.dtype for t in st.recv_specs] == [t.dtype for t in st.recv_wire] == ["float32"]
    row_bytes = T * 16 * 4  # (T, 16) float32 per sample
    sizes = {m.nbytes for p in build_programs(plan, precision=fp32).values() for ms in p.sends for m in ms}
    assert sizes == {2 * row_bytes}  # two samples per message
    received = torch.randn(2, T, 16).view(-1).view(torch.uint8)
    batch = {"ids": ids, "labels": ids}
    counts = st.count_tokens(batch).tolist()  # the loss's weights (a token mean; one GPU: the worker's sum)
    st.set_loss_weights(counts, sum(counts))
    loss, _ = st.forward(0, batch, [received])
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


def test_qwen2_moe_stage_sources_import_the_experts_op():
    """Qwen2-MoE's experts call transformers' grouped_mm_fallback: each stage
    source imports the module that registers it, and the stages loaded from
    their sources compute the captured model's loss."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from zorse_fx.codegen.split import emit_source, load_stage_source, split_stages
    from zorse_fx.models.hf import CausalLMWithLoss

    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                         shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=T)
    ids = torch.randint(0, 256, (2, T))
    captured = capture(CausalLMWithLoss(Qwen2MoeForCausalLM(cfg)), (ids, ids))
    bg = analyse(captured)
    half = bg.num_blocks // 2
    state = captured.state()
    carried: tuple = ()
    for prog in split_stages(bg, ((0, half), (half, bg.num_blocks))):
        src = emit_source(prog)
        assert "import transformers.integrations.moe  # registers torch.ops.transformers.grouped_mm_fallback" in src
        module = load_stage_source(src, f"stage_{prog.index}.py", prog.index)()
        module.load_state_dict({flat: state[c] for flat, c in {**prog.params, **prog.consts}.items()})
        named = {"input_ids": ids, "labels": ids}
        out = module(*[named[n] for n in prog.input_names], *carried)
        carried = tuple(out) if prog.send else out
    torch.testing.assert_close(carried, captured.graph_module(ids, ids), rtol=0, atol=1e-6)
