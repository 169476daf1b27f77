"""Capture + codegen: stage modules chained in one process give exactly the
traced model's loss and gradients, for a plain GPT (fx), HF GPT-2 and HF
Llama (torch.export); generated sources import and run on their own."""

from __future__ import annotations

import pytest
import torch

from conftest import cached_capture
from zorse_fx.capture import analyse, capture
from zorse_fx.codegen import emit_source, load_stage_class, split_stages
from zorse_fx.errors import ModelCaptureError
from zorse_fx.models.gpt import GPT, GPTConfig
from zorse_fx.models.hf import CausalLMWithLoss

T = 16


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=3, n_embd=32, n_head=4, block_size=T))


def _hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=256, n_positions=T,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return CausalLMWithLoss(GPT2LMHeadModel(cfg))


def _hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return CausalLMWithLoss(LlamaForCausalLM(cfg))


MODELS = {"gpt_fx": (_gpt, "fx"), "hf_gpt2": (_hf_gpt2, "export"), "hf_llama": (_hf_llama, "export")}


@pytest.fixture(scope="module", params=sorted(MODELS))
def captured(request, lee_bytes):
    make, method = MODELS[request.param]
    c = _captured(request.param, lee_bytes)
    assert c.method == method
    return c


def _captured(name, lee_bytes):
    """MODELS[name] captured on the first 4 x T bytes, with ONE tensor object
    for ids and labels (as zorse.compile calls capture); once per session."""
    make, method = MODELS[name]
    ids = lee_bytes[: 4 * T].view(4, T)
    return cached_capture(f"capture_codegen/{name}", lambda: capture(make(), (ids, ids), method=method))


def _chain(stages, input_names, inputs):
    named = dict(zip(input_names, inputs))
    carried = ()
    for prog, mod in stages:
        out = mod(*[named[n] for n in prog.input_names], *carried)
        carried = tuple(out) if prog.send else out
    return carried


def test_blocks_are_cut_at_residual_stream(captured):
    bg = analyse(captured)
    assert bg.num_blocks >= 7  # embedding, 2 per layer x 3, head
    hidden = 32 * T * 4  # (T, C) fp32 per sample
    for c in range(1, bg.num_blocks):
        assert sum(t.bytes_per_sample for t in bg.cut_tensors[c]) == hidden
    assert bg.cut_tensors[0] == () and bg.cut_tensors[-1] == ()


@pytest.mark.parametrize("cuts", [(2,), (1, 4), (2, 3, 5)])
def test_chained_stages_equal_traced_model(captured, cuts, lee_bytes, tmp_path):
    bg = analyse(captured)
    bounds = (0, *cuts, bg.num_blocks)
    progs = split_stages(bg, tuple(zip(bounds[:-1], bounds[1:])))
    state = captured.state()
    stages = []
    for p in progs:  # through the emitted source, as the runtime loads it
        path = tmp_path / f"stage_{p.index}.py"
        path.write_text(emit_source(p))
        mod = load_stage_class(path, p.index)()
        with torch.no_grad():
            for flat, canon in {**mod.PARAMETERS, **mod.CONSTANTS}.items():
                getattr(mod, flat).copy_(state[canon])
        stages.append((p, mod))
    ids = lee_bytes[T : T + 3 * T].view(3, T)  # batch 3 != capture batch 4: dynamic batch
    ref = captured.graph_module(ids, ids)
    ref.backward()
    got = _chain(stages, captured.input_names, (ids, ids))
    got.backward()
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    # Gradients: sum over stages holding a parameter (tied embeddings) == reference.
    from zorse_fx.capture.trace import fetch_attr

    total: dict[str, torch.Tensor] = {}
    for p, mod in stages:
        for flat, canon in mod.PARAMETERS.items():
            g = getattr(mod, flat).grad
            total[canon] = total.get(canon, 0) + g
    for canon in captured.trainable():
        torch.testing.assert_close(total[canon], fetch_attr(captured.graph_module, canon).grad, rtol=1e-5, atol=1e-6)
    captured.graph_module.zero_grad(set_to_none=True)


def test_stages_allocate_on_their_inputs_device(captured, request, tmp_path):
    """Every tensor a stage makes is on the device of its inputs: aten factory
    overloads (arange, full, ...) allocate on the CPU when ``device=None``,
    whatever ``torch.device`` mode is active, so codegen hands each one the
    device of a stage input (the bug the first GPU check found: HF Llama's
    rotary positions made on the CPU beside CUDA weights).

    Statically; and by running the stages on the meta device, where a CPU
    tensor mixed with a meta one fails as it would with a CUDA one, and whose
    SDPA returns another memory layout than the CPU kernel the model was
    captured with (export dropped the ``.contiguous()`` that was a no-op there;
    codegen emits ``reshape`` for ``view``)."""
    bg = analyse(captured)
    progs = split_stages(bg, ((0, 2), (2, bg.num_blocks)))
    factories = 0
    for p in progs:
        for n in (n for n in p.graph.nodes if n.op == "call_function"):
            schema = getattr(n.target, "_schema", None)
            if schema is None or not any(a.name == "device" and a.kwarg_only for a in schema.arguments):
                continue
            assert not isinstance(n.kwargs.get("device"), torch.device), n.format_node()
            if not any(isinstance(a.type, torch.TensorType) for a in schema.arguments):
                factories += 1
                assert isinstance(n.kwargs.get("device"), torch.fx.Node), n.format_node()
    ids = torch.zeros(3, T, dtype=torch.long, device="meta")
    carried: tuple = ()
    for p in progs:
        path = tmp_path / f"stage_{p.index}.py"
        path.write_text(emit_source(p))
        with torch.device("meta"):
            mod = load_stage_class(path, p.index)()
        named = dict(zip(captured.input_names, (ids, ids)))
        out = mod(*[named[n] for n in p.input_names], *carried)
        carried = tuple(out) if p.send else (out,)
        assert all(t.device.type == "meta" for t in carried), p.index
    if request.node.callspec.params["captured"] == "hf_llama":
        assert factories > 0  # the rotary positions' arange at least


def test_free_values_are_recomputed_not_sent(captured):
    """Rotary tables, masks, position ids never cross a cut: only the hidden state does."""
    bg = analyse(captured)
    progs = split_stages(bg, ((0, 2), (2, bg.num_blocks)))
    assert len(progs[1].recv) == 1
    assert progs[1].input_names  # stage 1 reads the model inputs itself (labels, positions)


@pytest.mark.parametrize("labels_kind", ["other_tokens", "padded"])
@pytest.mark.parametrize("model_name", ["hf_gpt2", "hf_llama"])
def test_one_tensor_for_ids_and_labels_keeps_two_inputs(model_name, labels_kind, lee_bytes):
    """``capture(m, (ids, ids))`` with ONE tensor object for both inputs (the
    call pattern of zorse.compile, the CLI and the benchmarks): torch.export
    merges aliased inputs, so without a clone the graph embedded ``labels``.
    Run with labels that differ from the ids, the captured graph and the stages
    split from it must give the eager model's loss."""
    make, method = MODELS[model_name]
    model = make()  # the eager reference: the same seeded weights the capture started from
    ids = lee_bytes[: 4 * T].view(4, T)
    captured = _captured(model_name, lee_bytes)
    assert captured.method == method and captured.input_names == ("input_ids", "labels")

    x = lee_bytes[4 * T : 7 * T].view(3, T)  # batch 3 != capture batch 4
    g = torch.Generator().manual_seed(0)
    if labels_kind == "other_tokens":  # e.g. a different target: random byte tokens
        labels = torch.randint(0, 256, x.shape, generator=g)
    else:  # prompt masked out, as in instruction tuning
        labels = x.clone()
        labels[:, : T // 2] = -100
    assert not torch.equal(labels, x)
    with torch.no_grad():
        ref = model(x, labels)
        got = captured.graph_module(x, labels)
        bg = analyse(captured)
        progs = split_stages(bg, ((0, 2), (2, bg.num_blocks)))
        state = captured.state()
        chained = _chain([(p, p.build(state)) for p in progs], captured.input_names, (x, labels))
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(chained, ref, rtol=0, atol=1e-5)
    # The example inputs kept for shape analysis are two tensors, not one.
    a, b = captured.example_inputs
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    torch.testing.assert_close(a, ids, rtol=0, atol=0)
    torch.testing.assert_close(b, ids, rtol=0, atol=0)


def test_capture_clones_inputs_sharing_storage():
    """A shifted target that is a view of the same token rows is cloned too."""
    rows = torch.arange(4 * (T + 1)).view(4, T + 1) % 256
    ids, targets = rows[:, :T], rows[:, 1:]
    captured = capture(_gpt(), (ids, targets))
    a, b = captured.example_inputs
    assert a is ids and b is not targets
    assert b.untyped_storage().data_ptr() != rows.untyped_storage().data_ptr()
    torch.testing.assert_close(b, targets, rtol=0, atol=0)


def test_capture_rejects_non_scalar_output():
    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x)

    with pytest.raises(ModelCaptureError, match="must return the scalar training loss, got shape \\(2, 4\\)"):
        capture(Logits(), (torch.randn(2, 4),))


def test_capture_rejects_batch_of_one():
    with pytest.raises(ModelCaptureError, match="batch size 1; use at least 2"):
        capture(_gpt(), (torch.zeros(1, T, dtype=torch.long),) * 2)


def test_split_rejects_gaps():
    ids = torch.zeros(2, T, dtype=torch.long)
    bg = analyse(capture(_gpt(), (ids, ids)))
    with pytest.raises(ValueError, match="stage 1 covers blocks \\[3, 5\\); expected to start at 2"):
        split_stages(bg, ((0, 2), (3, 5), (5, bg.num_blocks)))
