"""Models bench/box.py trains on the box besides the registry's ``gpt`` (``--model bench.box_models:<name>``,
run from the repository root)."""

from __future__ import annotations

import torch

from zorse_fx.models.gpt import GPT, GPTConfig


def gpt_big_vocab():
    """Case (c)'s model: the GPT of ``zorse_fx.models.gpt`` with 2 layers of width 512 and a 65,536-token
    vocabulary whose embedding is tied to the output layer: 39.9 M parameters, 84% of them the embedding
    (33.6 M), which the first and the last block share. A pipeline does not divide it (each stage holding
    an end holds it whole): only sharding its training state over data-parallel GPUs does, as for a
    large-vocabulary model on small GPUs. Random weights (seed 0); byte tokens are valid ids."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=65536, n_layer=2, n_embd=512, n_head=8, block_size=64)), "bytes"
