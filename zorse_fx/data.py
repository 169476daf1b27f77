"""Real text for training: corpora shipped in installed packages, tokenised once.

Corpora:
- ``lee``: gensim's ``test/test_data/lee_background.cor``, 300 English news
  articles (Lee et al., 2005) shipped in the gensim wheel.
- any text file path.

Tokenisers: ``bytes`` (UTF-8 bytes, vocabulary 256, for small test models)
or a Hugging Face tokenizer object. The global batch of step ``k`` is a
deterministic function of ``k``, so all ranks agree without communicating.
Training reads token files written by ``zorse prepare-data`` through
``zorse_fx.token_data.TokenData``, which serves the same batches as
``global_batch`` here (memory-mapped, only a rank's rows).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

__all__ = ["corpus_path", "read_corpus", "tokenize", "global_batch"]


def corpus_path(name: str) -> Path:
    """Path of a named corpus (``lee``) or of a text file.

    Raises:
        FileNotFoundError: unknown name and no such file.
    """
    if name == "lee":
        spec = importlib.util.find_spec("gensim")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("corpus 'lee' needs the gensim package (make venv installs it)")
        return Path(spec.submodule_search_locations[0]) / "test" / "test_data" / "lee_background.cor"
    path = Path(name)
    if not path.is_file():
        raise FileNotFoundError(f"corpus {name!r}: no such file (use 'lee' or a path to a UTF-8 text file)")
    return path


def read_corpus(name: str) -> str:
    return corpus_path(name).read_text(encoding="utf-8", errors="replace")


def tokenize(text: str, tokenizer="bytes") -> torch.Tensor:
    """1-D int64 token ids of ``text`` (``tokenizer``: "bytes" or an HF tokenizer)."""
    if tokenizer == "bytes":
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int64)
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)


def global_batch(
    tokens: torch.Tensor,
    step: int,
    *,
    global_batch_size: int,
    seq_len: int,
    input_names: tuple[str, ...],
    label_mode: str,
) -> dict[str, torch.Tensor]:
    """The global batch of ``step``: ``{name: (global_batch_size, seq_len) int64}``.

    Sample ``i`` of step ``k`` is chunk ``(k * global_batch_size + i) mod C`` of
    the ``C`` non-overlapping ``seq_len + 1`` token chunks of the corpus.
    ``label_mode`` "same": inputs and labels are the same tokens (Hugging Face
    models shift internally); "shifted": labels are inputs shifted by one.
    """
    chunk = seq_len + 1
    num_chunks = tokens.numel() // chunk
    if num_chunks < 1:
        raise ValueError(f"corpus has {tokens.numel()} tokens, fewer than one sequence of {chunk}")
    idx = (torch.arange(global_batch_size) + step * global_batch_size) % num_chunks
    rows = tokens[: num_chunks * chunk].view(num_chunks, chunk)[idx]  # (N, T+1)
    if len(input_names) != 2:
        raise ValueError(f"language-model data needs 2 inputs (ids, labels), the plan has {input_names}")
    if label_mode == "same":
        ids = rows[:, :seq_len].contiguous()
        return {input_names[0]: ids, input_names[1]: ids.clone()}
    if label_mode == "shifted":
        return {input_names[0]: rows[:, :seq_len].contiguous(), input_names[1]: rows[:, 1:].contiguous()}
    raise ValueError(f"label_mode must be 'same' or 'shifted', got {label_mode!r}")
