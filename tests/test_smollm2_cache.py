"""SmolLM2-135M's conversion cache ([Note: the SmolLM2 conversion cache] in
zorse_fx/models/hf.py): what later loads read is what the GGUF file holds."""

from __future__ import annotations

import numpy as np
import torch

from zorse_fx.models.hf import load_smollm2_135m, load_smollm2_tokenizer, smollm2_converted_dir, smollm2_gguf_path

# GGUF tensor -> the Hugging Face parameter it becomes: a Q8_0 and two Q4_1 matrices, and a float32
# vector (the attention's q/k matrices are left out: the conversion permutes their rows for rotary).
_SAMPLE = {"token_embd.weight": "model.embed_tokens.weight",
           "blk.7.ffn_down.weight": "model.layers.7.mlp.down_proj.weight",
           "blk.29.attn_v.weight": "model.layers.29.self_attn.v_proj.weight",
           "output_norm.weight": "model.norm.weight"}


def test_converted_smollm2_equals_its_gguf_file():
    """The loaded model (converted once, then read from the cache) holds
    exactly the GGUF file's de-quantised values (gguf's own de-quantiser, read
    apart from transformers), its output head tied to the embedding, and the
    tokenizer holds the file's vocabulary in its order; the cache directory is
    keyed by the file's sha256."""
    import gguf

    reader = gguf.GGUFReader(smollm2_gguf_path())
    model, tok = load_smollm2_135m()
    assert smollm2_converted_dir().is_dir()
    state = model.state_dict()
    seen = set()
    for t in reader.tensors:
        if t.name in _SAMPLE:
            name = _SAMPLE[t.name]
            want = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
            assert torch.equal(want.reshape(state[name].shape), state[name]), (t.name, t.tensor_type.name)
            seen.add(t.name)
    assert seen == set(_SAMPLE)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.dtype == torch.float32
    field = reader.fields["tokenizer.ggml.tokens"]
    vocab = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    assert len(vocab) == 49152 and tok.convert_ids_to_tokens(list(range(len(vocab)))) == vocab
    assert load_smollm2_tokenizer()("Hello world")["input_ids"] == tok("Hello world")["input_ids"]


def test_gguf_read_once_shares_readers_within_the_block(monkeypatch):
    """[Note: the GGUF file read once]: within the block one reader per path and one name map per
    (architecture, layers) are made; outside it gguf's own functions are back."""
    import gguf

    from zorse_fx.models.hf import _gguf_read_once

    made: list[tuple] = []

    def reader(path, mode="r"):
        made.append(("reader", str(path), mode))
        return object()

    def name_map(arch, n_blocks):
        made.append(("map", arch, n_blocks))
        return object()

    monkeypatch.setattr(gguf, "GGUFReader", reader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", name_map)
    with _gguf_read_once():
        a, b, c = gguf.GGUFReader("x.gguf"), gguf.GGUFReader("x.gguf"), gguf.GGUFReader("y.gguf")
        m1, m2, m3 = (gguf.get_tensor_name_map("llama", 30), gguf.get_tensor_name_map("llama", 30),
                      gguf.get_tensor_name_map("llama", 2))
    assert a is b and a is not c and m1 is m2 and m1 is not m3
    assert made == [("reader", "x.gguf", "r"), ("reader", "y.gguf", "r"), ("map", "llama", 30), ("map", "llama", 2)]
    assert gguf.GGUFReader is reader and gguf.get_tensor_name_map is name_map
