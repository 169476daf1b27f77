"""``zorse export RUN --hf DIR``: a trained model out of a run's checkpoint, as a Hugging Face directory
(``config.json``, ``model.safetensors`` sharded above ``--max-shard-size``, the tokenizer where the run
knows it) or, for a model that is not a Hugging Face one, its state dict as safetensors under its
canonical parameter names ([Note: exporting a checkpoint]).

[Note: exporting a checkpoint]
A checkpoint stores every trainable parameter under its canonical name, whole or (ZeRO-3, the float32
masters of 16-bit working weights) as flat ranges of it ([Note: checkpoint contents] in
``runtime/checkpoint.py``), whatever the plan's layout: so one reader serves every plan. ``model_state``
reads the ``model/`` keys alone with DCP's own loader (no process group: DCP loads in one process when
none is initialised; through ``checkpoint_reader``, which unpickles only DCP's metadata classes), joins the
ranges, and checks them against the plan's ``weights.pt`` (``torch.load(weights_only=True)``): same
names, same shapes; the tensors a plan reads but does not train (buffers such as rotary frequencies)
come from ``weights.pt``. A Hugging Face model's plan directory holds its configuration
(``hf_config.json``, written by ``CompiledModel.save_weights``); its canonical names are the wrapper's
(``CausalLMWithLoss``: ``model.`` + the Hugging Face name), and tied weights appear once (the first of
the tie group): the model made from the configuration ties them again, and every name it expects is
either loaded or tied to a loaded one (checked), so the export is ``from_pretrained``-loadable with its
ties. Weights are float32 in the checkpoint; ``dtype`` rounds them once, on writing.
"""

from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CheckpointError, RunDirectoryError
from .models.hf import HF_CONFIG
from .plan import Plan
from .runtime.checkpoint import checkpoint_reader, list_checkpoints, newest_intact_checkpoint, read_manifest, \
    verify_checkpoint

__all__ = ["DTYPES", "ExportResult", "model_state", "export_run", "pick_checkpoint", "hf_model_from_config"]
#: ``--dtype`` choices.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: The wrapper's prefix on a Hugging Face model's canonical names (``models.hf.CausalLMWithLoss.model``).
_HF_PREFIX = "model."


@dataclass(frozen=True, slots=True)
class ExportResult:
    """What ``export_run`` wrote."""

    out: Path
    checkpoint: Path
    step: int
    #: ``"hf"`` (a Hugging Face directory) or ``"safetensors"`` (a state dict under canonical names).
    kind: str
    dtype: str
    files: tuple[str, ...]
    parameters: int
    #: The tokenizer saved with it (None: the run trained on bytes or does not say).
    tokenizer: str | None


def pick_checkpoint(run: Path, step: int | None) -> Path:
    """Run ``run``'s checkpoint of ``step`` (verified), or its newest intact one.

    Raises:
        RunDirectoryError: no checkpoint, or none of that step (listing the steps); CheckpointError: all
            damaged."""
    root = run / "checkpoints"
    found = list_checkpoints(root)
    if not found:
        raise RunDirectoryError(f"{run}: no checkpoint under {root} (`zorse train --out {run}` writes one at its "
                                f"last step); give the run directory of a finished or checkpointed run")
    if step is None:
        path, damaged = newest_intact_checkpoint(root)
        if path is None:
            raise CheckpointError(f"{run}: every checkpoint is damaged ({'; '.join(map(str, damaged))}); nothing "
                                  f"to export")
        return path
    by_step = dict(found)
    if step not in by_step:
        raise RunDirectoryError(f"{run}: --step {step}: no checkpoint of that step; its checkpoints are of steps "
                                f"{', '.join(str(k) for k, _ in found)}")
    verify_checkpoint(by_step[step])
    return by_step[step]


def model_state(checkpoint: str | Path, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor of the model by canonical name, float32 as trained: the checkpoint's parameters (whole, or
    their saved ranges joined) and, for the tensors the plan reads but does not train, ``weights`` (the plan's
    ``weights.pt``) ([Note: exporting a checkpoint]).

    Raises:
        CheckpointError: a parameter the plan's weights do not have, one of another shape, or ranges that do not
            cover it (the checkpoint is of another model or incomplete), named with the shapes."""
    import torch.distributed.checkpoint as dcp

    path = Path(checkpoint)
    reader = checkpoint_reader(path)
    meta = reader.read_metadata().state_dict_metadata
    request: dict[str, torch.Tensor] = {}
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    for key, m in meta.items():
        if not key.startswith("model/"):
            continue
        name = key[len("model/"):]
        head, _, tail = name.rpartition("/")
        a, _, b = tail.partition("-")
        if head and a.isdigit() and b.isdigit():
            ranges.setdefault(head, []).append((int(a), int(b), key))
            name = head
        if name not in weights:
            raise CheckpointError(f"{path}: holds parameter {name!r}, which the plan's weights.pt does not have; the "
                                  f"checkpoint is of another model than its run's plan")
        request[key] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    if not request:
        raise CheckpointError(f"{path}: holds no model parameters (no 'model/' keys); it is not a zorse_fx checkpoint")
    with warnings.catch_warnings():  # ("assuming the intent is to load in a single process": it is)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(request, storage_reader=reader)
    state = dict(weights)
    for key, t in request.items():
        name = key[len("model/"):]
        if name in weights:  # a whole parameter
            if tuple(t.shape) != tuple(weights[name].shape):
                raise CheckpointError(f"{path}: parameter {name!r} has shape {tuple(t.shape)} in the checkpoint but "
                                      f"{tuple(weights[name].shape)} in the plan's weights.pt; the checkpoint is of "
                                      f"another model")
            state[name] = t
    for name, pieces in ranges.items():
        want = weights[name]
        pieces.sort()
        ends = [0] + [b for _, b, _ in pieces]
        if any(a != e for (a, _, _), e in zip(pieces, ends)) or ends[-1] != want.numel():
            raise CheckpointError(f"{path}: parameter {name!r} is saved as ranges {[(a, b) for a, b, _ in pieces]} "
                                  f"that do not cover its {want.numel()} elements {tuple(want.shape)}; the "
                                  f"checkpoint is incomplete or of another model")
        state[name] = torch.cat([request[k].reshape(-1) for *_, k in pieces]).view(want.shape)
    return {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in state.items()}


def hf_model_from_config(config_path: Path, state: dict[str, torch.Tensor], source: Path):
    """The Hugging Face model of ``config_path`` (a plan's ``hf_config.json``) holding ``state`` (canonical
    names: ``model.`` + its own), in float32, its ties kept ([Note: exporting a checkpoint]).

    Raises:
        CheckpointError: names that are not the model's, or a tensor given no value (named)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    doc = json.loads(config_path.read_text())
    model_type = doc.get("model_type")
    if not isinstance(model_type, str):
        raise CheckpointError(f"{config_path}: field model_type is {model_type!r}; a Hugging Face configuration "
                              f"names its model type (re-plan with `zorse plan` to write it again)")
    config = AutoConfig.for_model(model_type, **{k: v for k, v in doc.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if not all(k.startswith(_HF_PREFIX) for k in state):
        raise CheckpointError(f"{source}: the plan's tensor names do not all start with {_HF_PREFIX!r} (e.g. "
                              f"{next(k for k in state if not k.startswith(_HF_PREFIX))!r}): not the Hugging Face "
                              f"model of {config_path.name}")
    hf_state = {k[len(_HF_PREFIX):]: v for k, v in state.items()}
    buffers = {n for n, _ in model.named_buffers()}
    expected = set(model.state_dict())
    unknown = sorted(set(hf_state) - expected - buffers)
    if unknown:
        raise CheckpointError(f"{source}: tensors {unknown[:5]} are not in the {type(model).__name__} of "
                              f"{config_path.name}; the plan's weights are of another model")
    model.load_state_dict({k: v for k, v in hf_state.items() if k in expected}, strict=False, assign=True)
    for name, buf in list(model.named_buffers()):  # non-persistent buffers: the plan's values, else recomputed
        if name in hf_state:
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner).register_buffer(attr, hf_state[name].clone(),
                                                       persistent=name in expected)
    model.tie_weights()
    left = [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
    left += [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        raise CheckpointError(f"{source}: the checkpoint and weights.pt give no value for {left[:5]} of the "
                              f"{type(model).__name__} (neither saved nor tied to a saved tensor)")
    return model


def export_run(run_dir: str | Path, out_dir: str | Path, *, step: int | None = None, dtype: str = "float32",
               max_shard_size: str = "5GB", plan: str | Path | None = None, progress=print) -> ExportResult:
    """Export the checkpoint of step ``step`` (default: the newest intact one) of run ``run_dir`` into
    ``out_dir`` (new or empty) in ``dtype`` ([Note: exporting a checkpoint]). ``plan``: the run's plan
    directory (default: the one its ``train_options.json`` names; a run of ``python -m zorse_fx.train``
    has none); any plan of the same model serves (the names and shapes are checked).

    Raises:
        RunDirectoryError: no checkpoint, no such step, the run's plan directory is missing, ``out_dir`` holds
            files.
        CheckpointError / CheckpointDamagedError: the checkpoint is damaged or not of the run's model."""
    from .train_options import OPTIONS_FILE, read_options_file

    run, out = Path(run_dir), Path(out_dir)
    if dtype not in DTYPES:
        raise RunDirectoryError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RunDirectoryError(f"--hf {out}: exists and is not an empty directory; give a new directory (nothing "
                                f"in it is replaced)")
    if not run.is_dir():
        raise RunDirectoryError(f"{run}: no such run directory (give the --out of a `zorse train` run)")
    ckpt = pick_checkpoint(run, step)
    manifest = read_manifest(ckpt)
    options = read_options_file(run / OPTIONS_FILE) if (run / OPTIONS_FILE).exists() else None
    if plan is None and options is None:
        raise RunDirectoryError(f"{run}: no {OPTIONS_FILE} naming the run's plan (a run of `python -m "
                                f"zorse_fx.train`); pass the plan directory it trained with (--plan)")
    plan_path = Path(plan if plan is not None else options.data.plan)
    plan_dir = plan_path if plan_path.is_dir() else plan_path.parent
    weights_path = (Path(options.data.weights) if plan is None and options.data.weights
                    else plan_dir / "weights.pt")
    if not weights_path.exists():
        raise RunDirectoryError(f"{weights_path}: no such file; the export needs the run's plan directory (its "
                                f"weights.pt names and shapes every tensor): pass it with --plan")
    trained = Plan.load(plan_dir)
    if trained.model_name != manifest["model_name"]:
        raise CheckpointError(f"{ckpt}: a checkpoint of model {manifest['model_name']!r}, but the run's plan "
                              f"{plan_dir} is of {trained.model_name!r}")
    weights = torch.load(weights_path, map_location="cpu", weights_only=True)
    progress(f"[zorse] export: {ckpt} (step {manifest['step']}, model {trained.model_name}, plan of "
             f"{trained.num_stages} stages on {trained.world_size} ranks)")
    state = model_state(ckpt, weights)
    torch_dtype = DTYPES[dtype]
    tokenizer = None
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        config = plan_dir / HF_CONFIG
        if config.exists():
            model = hf_model_from_config(config, state, plan_dir)
            model.to(torch_dtype)
            model.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_size)
            tokenizer = _save_tokenizer(options, tmp) if options is not None else None
            kind, n = "hf", sum(p.numel() for p in model.parameters())
        else:
            from huggingface_hub import save_torch_state_dict

            sd = {k: (v.to(torch_dtype) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
            save_torch_state_dict(sd, tmp, max_shard_size=max_shard_size,
                                  metadata={"format": "pt", "zorse_model": trained.model_name})
            kind, n = "safetensors", sum(v.numel() for v in sd.values())
        (tmp / "zorse_export.json").write_text(json.dumps({
            "format": "zorse_fx.export", "version": 1, "run": str(run.resolve()), "checkpoint": ckpt.name,
            "step": manifest["step"], "run_id": manifest.get("run_id", ""), "plan_hash": manifest.get("plan_hash", ""),
            "model_name": trained.model_name, "dtype": dtype, "kind": kind}, indent=1) + "\n")
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = tuple(sorted(p.name for p in out.iterdir()))
    return ExportResult(out=out, checkpoint=ckpt, step=int(manifest["step"]), kind=kind, dtype=dtype, files=files,
                        parameters=n, tokenizer=tokenizer)


def _save_tokenizer(options, out: Path) -> str | None:
    """The run's tokenizer into ``out`` where its token file's header names one other than bytes."""
    from .token_data import TokenData, load_tokenizer, token_file_paths

    data = options.data.data
    if data is None or not token_file_paths(data)[1].is_file():  # (a legacy --tokens file has no header)
        return None
    name = (TokenData.load(data).header or {}).get("tokenizer")
    if not name or name == "bytes":
        return None
    tok = load_tokenizer(name)
    if tok.hf is None:
        return None
    tok.hf.save_pretrained(out)
    return name
