"""``zorse eval TARGET --data TOKENS``: a trained model's loss and perplexity on held-out tokens.

``TARGET`` is a run directory (its newest intact checkpoint, or ``--step``'s, read as ``zorse export``
reads it: [Note: exporting a checkpoint] in ``export.py``), an exported or any local Hugging Face model
directory, or a model name (``--model``'s: the untrained model, e.g. before fine-tuning). Evaluation runs
in this process, on this machine's CPU (or ``--device``): the whole model must fit it.

The tokens are cut into non-overlapping sequences from the start: ``seq_len`` tokens each for a Hugging
Face model (it shifts its labels: ``seq_len - 1`` predicted tokens per sequence), ``seq_len + 1`` for a
model that takes shifted labels (``seq_len`` predicted), as training cuts them (``zorse_fx.data``). The
loss is the mean next-token cross-entropy over every predicted token (each batch's mean weighted by its
token count), the perplexity ``exp(loss)``; in float32 unless ``dtype`` says otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import DataError, ModelCaptureError, RunDirectoryError
from .export import DTYPES, hf_model_from_config, model_state, pick_checkpoint
from .models.hf import HF_CONFIG, CausalLMWithLoss, is_hf_causal_lm
from .plan import Plan

__all__ = ["EvalResult", "Trained", "load_trained", "evaluate_tokens"]


@dataclass(frozen=True, slots=True)
class EvalResult:
    """One evaluation: mean next-token loss (nats) and ``exp`` of it over ``tokens`` predicted tokens of
    ``sequences`` sequences of ``seq_len``."""

    loss: float
    perplexity: float
    tokens: int
    sequences: int
    seq_len: int


@dataclass(frozen=True, slots=True)
class Trained:
    """A model to evaluate (``load_trained``)."""

    model: torch.nn.Module
    #: "same" (a Hugging Face model shifts its labels) or "shifted".
    label_mode: str
    #: Which model, for the output.
    what: str
    #: The run's plan's sequence length (None: not a run).
    seq_len: int | None = None


def load_trained(target: str | Path, *, step: int | None = None, plan: str | Path | None = None) -> Trained:
    """The model of ``target`` in float32, eval mode: a run directory's checkpoint (``step`` or the newest
    intact; ``plan`` or the one ``train_options.json`` names), a Hugging Face model directory, or a ``--model``
    name.

    Raises:
        RunDirectoryError, CheckpointError: as ``zorse export``; ModelCaptureError: a model name or directory
            that does not load (``models.registry.load_model``'s message)."""
    from .models.registry import load_model

    path = Path(target)
    if (path / "checkpoints").is_dir():
        from .train_options import OPTIONS_FILE, read_options_file

        ckpt = pick_checkpoint(path, step)
        if plan is None:
            if not (path / OPTIONS_FILE).exists():
                raise RunDirectoryError(f"{path}: no {OPTIONS_FILE} naming the run's plan; pass --plan")
            plan = read_options_file(path / OPTIONS_FILE).data.plan
        plan_dir = Path(plan) if Path(plan).is_dir() else Path(plan).parent
        p = Plan.load(plan_dir)
        state = model_state(ckpt, torch.load(plan_dir / "weights.pt", map_location="cpu", weights_only=True))
        if (plan_dir / HF_CONFIG).exists():
            model, mode = hf_model_from_config(plan_dir / HF_CONFIG, state, plan_dir), "same"
        else:
            model, _ = load_model(p.model_name)
            _load_canonical(model, state, ckpt)
            mode = p.label_mode
        return Trained(model.float().eval(), mode, f"{ckpt} (model {p.model_name})", p.seq_len)
    if step is not None:
        raise RunDirectoryError(f"--step {step}: {target} is not a run directory (no checkpoints/); --step "
                                f"picks a run's checkpoint")
    try:
        model, _ = load_model(str(target))
    except ValueError as exc:  # (a name or directory that does not load: one line, as `zorse plan` says it)
        raise ModelCaptureError(str(exc)) from None
    return Trained(model.float().eval(), "same" if is_hf_causal_lm(model) else "shifted",
                   f"{target} (untrained)" if not path.is_dir() else str(target))


def _load_canonical(model: torch.nn.Module, state: dict[str, torch.Tensor], source: Path) -> None:
    """``state`` (canonical names: the module's own, tied tensors once) into ``model``; every parameter loaded
    or tied to a loaded one, else ``RunDirectoryError`` naming them."""
    own = model.state_dict(keep_vars=True)
    unknown = sorted(set(state) - set(own))
    if unknown:
        raise RunDirectoryError(f"{source}: tensors {unknown[:5]} are not in the model {type(model).__name__}; "
                                f"the plan's model is not the one --model loads")
    model.load_state_dict(state, strict=False)
    loaded = {id(own[k]) for k in state}
    left = [k for k, t in own.items() if k not in state and id(t) not in loaded]
    if left:
        raise RunDirectoryError(f"{source}: no value for {left[:5]} of {type(model).__name__}")


def evaluate_tokens(model: torch.nn.Module, label_mode: str, tokens, *, seq_len: int, batch_size: int = 8,
                    max_sequences: int | None = None, dtype: str = "float32",
                    device: str | torch.device = "cpu") -> EvalResult:
    """Loss and perplexity of ``model`` on ``tokens`` (a 1-D integer array or tensor) cut as the module
    docstring says, ``batch_size`` sequences at a time, the first ``max_sequences`` (None: all).

    Raises:
        DataError: fewer tokens than one sequence; a ``seq_len`` below 2; a ``batch_size`` or ``max_sequences``
            below 1."""
    if seq_len < 2:
        raise DataError(f"--seq-len {seq_len}: give at least 2 tokens per sequence")
    if batch_size < 1 or (max_sequences is not None and max_sequences < 1):
        raise DataError(f"--batch-size {batch_size} / --max-sequences {max_sequences}: give numbers >= 1")
    span = seq_len if label_mode == "same" else seq_len + 1
    ids = torch.as_tensor(np.asarray(tokens)).to(torch.int64).reshape(-1)
    n = ids.numel() // span
    if max_sequences is not None:
        n = min(n, max_sequences)
    if n == 0:
        raise DataError(f"{ids.numel()} tokens: fewer than one sequence of {span}; give more tokens or a smaller "
                        f"--seq-len")
    seqs = ids[: n * span].view(n, span)
    wrapped = CausalLMWithLoss(model) if is_hf_causal_lm(model) else model
    wrapped = wrapped.to(device=device, dtype=DTYPES[dtype]).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for a in range(0, n, batch_size):
            b = seqs[a:a + batch_size].to(device)
            loss = wrapped(b, b) if label_mode == "same" else wrapped(b[:, :-1].contiguous(), b[:, 1:].contiguous())
            k = b.shape[0] * (span - 1)  # the tokens this batch's mean is over
            total += float(loss) * k
            count += k
    mean = total / count
    return EvalResult(loss=mean, perplexity=math.exp(mean), tokens=count, sequences=n, seq_len=seq_len)
