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
