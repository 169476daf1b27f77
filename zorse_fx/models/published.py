"""Published model configurations the benchmark scenarios name, in one table.

``CONFIGS[name]()`` returns the Hugging Face ``transformers`` config of the
model a scenario (``bench/scenarios.py``, ``../shared/DESIGN.md``) names, with
its published shape; ``build(name)`` builds it on the meta device (no weights
allocated: a 65B model costs nothing to build) for capture and pricing.
Dropout is off in every config (the planner prices a deterministic step; it
does not change the parameter count).

Shapes, with the source of each (the parameter counts are checked against the
published figures in ``tests/test_published_models.py``):

- ``opt-350m``: facebook/opt-350m's ``config.json`` (Zhang et al. 2022, "OPT",
  arXiv 2205.01068, Table 1: 24 layers, 16 heads, width 1024): hidden 1024,
  FFN 4096, vocabulary 50272, 2048 positions, post-LayerNorm
  (``do_layer_norm_before=False``) and a 512-wide token embedding projected
  in and out (``word_embed_proj_dim=512``; ``project_in``/``project_out``).
- ``gpt2-medium``: Radford et al. 2019, Table 2 (24 layers, width 1024) and
  openai-community/gpt2-medium's ``config.json`` (16 heads, 1024 positions,
  vocabulary 50257, tied embedding).
- ``llama2-7b`` / ``llama2-13b``: Touvron et al. 2023b ("Llama 2", arXiv
  2307.09288) and meta-llama/Llama-2-{7b,13b}-hf ``config.json``: hidden
  4096/5120, FFN 11008/13824, 32/40 layers, 32/40 heads (no GQA below 34B),
  vocabulary 32000, 4096 positions, untied LM head.
- ``llama-65b``: LLaMA-1 65B (Touvron et al. 2023a, arXiv 2302.13971,
  Table 2: width 8192, 64 heads, 80 layers; FFN 22016 = the SwiGLU
  2/3 * 4 * 8192 rounded up to a multiple of 256), the "up to 65B" of Zorse.
- ``gpt3-1.5b``: the GPT-3 1.5B-class model of the Metis scenario
  (``../shared/DESIGN.md``: 10 layers, hidden 4096, seq 1024) on the GPT-2
  architecture and vocabulary (50257), 32 heads. Its parameters come to 2.22B
  (10 x 12 x 4096^2 in the layers plus a 206M embedding): "1.5B" is the
  scenario's label, not a count of this shape.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["CONFIGS", "build"]

_NO_DROPOUT_GPT2 = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _opt_350m():
    from transformers import OPTConfig

    return OPTConfig(vocab_size=50272, hidden_size=1024, num_hidden_layers=24, ffn_dim=4096,
                     num_attention_heads=16, max_position_embeddings=2048, word_embed_proj_dim=512,
                     do_layer_norm_before=False, activation_function="relu",
                     dropout=0.0, attention_dropout=0.0, layerdrop=0.0)


def _gpt2_medium():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=50257, n_positions=1024, n_embd=1024, n_layer=24, n_head=16, **_NO_DROPOUT_GPT2)


def _gpt3_1_5b():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=50257, n_positions=1024, n_embd=4096, n_layer=10, n_head=32, **_NO_DROPOUT_GPT2)


def _llama(hidden: int, ffn: int, layers: int, heads: int, positions: int):
    def make():
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=heads,
                           max_position_embeddings=positions, tie_word_embeddings=False)

    return make


#: Scenario model name -> factory of its ``transformers`` config (published shape, dropout off).
CONFIGS: dict[str, Callable[[], object]] = {
    "opt-350m": _opt_350m,
    "gpt2-medium": _gpt2_medium,
    "gpt3-1.5b": _gpt3_1_5b,
    "llama2-7b": _llama(4096, 11008, 32, 32, 4096),
    "llama2-13b": _llama(5120, 13824, 40, 40, 4096),
    "llama-65b": _llama(8192, 22016, 80, 64, 2048),
}


def build(name: str, *, device: str | torch.device = "meta", num_layers: int | None = None) -> torch.nn.Module:
    """The causal LM ``name`` (a key of :data:`CONFIGS`) in float32 on ``device``
    (default meta: shapes only, no memory), with randomly initialised weights
    off the meta device. The bare ``transformers`` model (``...ForCausalLM``).
    ``num_layers``: that many decoder layers instead of the published count
    (to measure a few layers of a large model on one GPU).

    Raises:
        ValueError: ``name`` is not in :data:`CONFIGS`.
    """
    from transformers import GPT2LMHeadModel, LlamaForCausalLM, OPTForCausalLM

    if name not in CONFIGS:
        raise ValueError(f"unknown scenario model {name!r}; choose from {sorted(CONFIGS)}")
    cfg = CONFIGS[name]()
    if num_layers is not None:
        setattr(cfg, "n_layer" if cfg.model_type == "gpt2" else "num_hidden_layers", int(num_layers))
    cls = {"opt": OPTForCausalLM, "gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM}[cfg.model_type]
    with torch.device(device):
        return cls(cfg)
