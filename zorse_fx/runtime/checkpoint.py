"""Training checkpoints with ``torch.distributed.checkpoint`` (DCP), keyed by
canonical parameter name so that a checkpoint written under one plan loads
under another plan of the same model.

Layout (``<out>/checkpoints/``)::

    step_<k>/                 one complete checkpoint (after step k)
        .metadata, __*.distcp DCP's files: every rank writes its part
        zorse_checkpoint.json  the manifest, written last (see below)
    step_<k>.tmp/             a checkpoint being written (never loaded)

[Note: checkpoint contents]
Every tensor of the training state is stored under a name that does not
depend on the plan:

- ``model/<canonical name>``: each trainable parameter, whole (float32 master
  weights under mixed precision). Every rank holding it writes the same key;
  DCP's planner keeps one copy (``dedup_save_plans``). A 16-bit working
  weight ([Note: 16-bit working weights] in ``zorse_fx/precision.py``) has
  its float32 master only in the ranks' shards: each rank writes its range
  as ``model/<canonical name>/<a>-<b>``, and a loading rank joins the ranges
  into the whole parameter, whatever layout it loads into (the 16-bit
  weight takes their rounding, its master the range it now owns).
- ``optim/exp_avg/<canonical name>/<a>-<b>`` and ``optim/exp_avg_sq/...``:
  AdamW's moments of elements ``[a, b)`` of the flattened parameter -- the
  whole parameter on a stage without ZeRO-1, the rank's shard overlap on a
  ZeRO-1 stage (``StageOptimizer.state_pieces``). Under another plan a rank
  reads every saved range that overlaps the range it now owns and copies the
  overlap, so the shards are re-cut to the new plan's ranges (and a sharded
  state loads into a replicated one and back).
- ``optim/step`` (AdamW's step count: optimizer steps taken, skipped fp16
  steps excluded), ``train/step``, ``scaler/scale`` and
  ``scaler/growth_tracker`` (fp16-mixed) and ``rng/rank<r>/cpu`` (and
  ``/cuda``): each rank's RNG state, restored when the world size is the
  same (dropout then continues exactly; under another world size each rank
  is re-seeded from ``--seed`` and the step).

A model-only checkpoint (the last step's under ``zorse train
--final-checkpoint model-only``; manifest ``contents`` "model") holds the
``model/`` keys and ``train/step`` alone: a third of a full checkpoint's
bytes under AdamW in float32, for export and evaluation; training does not
continue from it (``load_checkpoint`` refuses it; a ``--resume`` asking for
more steps falls back to the newest full checkpoint).

The data position is the step: the global batch of step k is a function of k
(``zorse_fx.data``), so a resumed run must keep the global batch size and
the sequence length (checked, with the value to set).

Atomicity: every rank writes into ``step_<k>.tmp``; after DCP's save (which
ends with a collective) rank 0 writes the manifest, syncs it and renames the
directory to ``step_<k>`` (one ``os.replace``). A checkpoint is therefore
complete or absent; ``latest_checkpoint`` only considers ``step_<k>``
directories that hold a manifest. Rank 0 then deletes all but the newest
``keep`` checkpoints up to that step. Several nodes need ``<out>`` on a
shared file system. Before a resume the files are checked against the
manifest's sizes and sha256 ([Note: checkpoint integrity]).

The manifest (``zorse_checkpoint.json``, ``"format": "zorse_fx.checkpoint"``,
version 3: version 2 plus ``contents``; version 2: version 1 plus the run's
identity ``run_id`` / ``plan_hash``, ``runtime/run_dir.py``, and ``files``;
older versions are read with those empty and ``contents`` "full")
is declared once, as ``CheckpointManifest``: its annotations carry
each field's type, range and meaning, ``file_schema.struct_of`` builds the
schema ``ManifestDoc`` from them, ``save_checkpoint`` writes a manifest
through it and ``read_manifest`` checks one against it (``MANIFEST_FILE``:
unknown fields refused), raising ``errors.CheckpointManifestError`` (a
``CheckpointError`` and a ``FileFormatError``) that names the file, the
field, the value and the fix.

Loading runs no code from the checkpoint: DCP's tensor files are read with
``torch.load(weights_only=True)``, and its pickled ``.metadata`` file is read
by ``_SafeReader`` with an unpickler that admits only DCP's metadata classes,
``torch.Size`` and dtypes.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import pickle
import re
import shutil
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import torch
import torch.distributed as dist
from msgspec import Meta

from ..errors import CheckpointDamagedError, CheckpointError, CheckpointManifestError
from ..file_schema import FileFormat, struct_of, to_builtins
from ..precision import PRECISIONS
from .worker import StageWorker

__all__ = ["MANIFEST", "CheckpointManifest", "CheckpointFile", "ManifestDoc", "MANIFEST_FILE", "latest_checkpoint",
           "list_checkpoints", "save_checkpoint", "load_checkpoint", "read_manifest", "verify_checkpoint",
           "newest_intact_checkpoint", "set_aside", "check_resumable", "checkpoint_reader"]

#: The manifest file of a complete checkpoint.
MANIFEST = "zorse_checkpoint.json"
FORMAT = "zorse_fx.checkpoint"
VERSION = 3
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointFile:
    """One file of a checkpoint directory as the manifest records it."""

    bytes: Annotated[int, Meta(ge=0, description="the file's size in bytes")]
    sha256: Annotated[str, Meta(pattern="^[0-9a-f]{64}$", description="the file's sha256, 64 lowercase hex digits")]


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointManifest:
    """What a checkpoint's manifest records (fields in the file's order,
    after ``format`` and ``version``); written by rank 0, last."""

    step: Annotated[int, Meta(ge=0, description="training steps taken when it was written")]
    optimizer_steps: Annotated[int, Meta(ge=0, description="AdamW steps taken, skipped fp16 steps excluded")]
    world_size: Annotated[int, Meta(ge=1, description="the ranks that wrote it")]
    num_stages: Annotated[int, Meta(ge=1, description="the pipeline stages of the plan that wrote it")]
    model_name: Annotated[str, Meta(description="the model of the plan that wrote it")]
    cluster_name: Annotated[str, Meta(description="the cluster of the plan that wrote it")]
    global_batch_size: Annotated[int, Meta(ge=1, description="samples per step; a resumed run must keep it")]
    seq_len: Annotated[int, Meta(ge=1, description="tokens per sample; a resumed run must keep it")]
    precision: Literal[PRECISIONS]  # type: ignore[valid-type]
    samples_seen: Annotated[int, Meta(ge=0, description="step x global_batch_size")]
    run_id: Annotated[str, Meta(description="the run that wrote it (runtime/run_dir.py; '' in version 1)")]
    plan_hash: Annotated[str, Meta(description="sha256 prefix of the plan that wrote it ('' in version 1)")]
    files: Annotated[dict[str, CheckpointFile] | None, Meta(
        description="every other file of the directory: size and sha256 (None in version 1)")]
    contents: Annotated[Literal["full", "model"], Meta(
        description="full: the whole training state, which --resume continues; model: the parameters alone "
                    "(a last step's checkpoint under --final-checkpoint model-only); 'full' before version 3")]


FileDoc = struct_of(CheckpointFile, "CheckpointFileDoc")
ManifestDoc = struct_of(CheckpointManifest, "ManifestDoc", docs={CheckpointFile: FileDoc}, extra={
    "": [("format", Literal["zorse_fx.checkpoint"], msgspec.NODEFAULT), ("version", Literal[3], msgspec.NODEFAULT)],
})


def _upgrade(d: dict) -> dict:
    """An older manifest in the current shape: version 1 has no run identity
    (``run_id``, ``plan_hash`` ''), no file records (``files`` None: not
    verifiable); versions 1 and 2 wrote only whole training states
    (``contents`` "full")."""
    version = d.get("version")
    if version == 1:
        d = {**d, "run_id": "", "plan_hash": "", "files": None}
    if version in (1, 2):
        d = {**d, "version": VERSION, "contents": "full"}
    return d


#: The manifest as a ``file_schema.FileFormat``.
MANIFEST_FILE = FileFormat(name=FORMAT, what="checkpoint manifest", doc=ManifestDoc, versions=(1, 2, VERSION),
                           remake="resume from another step_<k> directory of <out>/checkpoints",
                           error=CheckpointManifestError, upgrade=_upgrade)


def _manifest_dict(manifest: CheckpointManifest) -> dict[str, Any]:
    """``manifest`` as the JSON-ready dict of ``zorse_checkpoint.json``."""
    files = None if manifest.files is None else {
        name: {"bytes": f.bytes, "sha256": f.sha256} for name, f in manifest.files.items()}
    return to_builtins(manifest, ManifestDoc, lambda record: {"format": FORMAT, "version": VERSION, "files": files})


# -- finding checkpoints ---------------------------------------------------------
def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` (``<out>/checkpoints``) as (step,
    directory), oldest first. A directory without a manifest (a save cut
    short) is not listed."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and d.is_dir() and (d / MANIFEST).is_file():
            found.append((int(m.group(1)), d))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def read_manifest(path: str | Path) -> dict:
    """The manifest of checkpoint directory ``path`` (its parsed
    ``zorse_checkpoint.json``, a version-1 file brought to the current
    shape), checked against ``ManifestDoc``: format, version, every
    ``CheckpointManifest`` field's type and range, no unknown field.

    Raises:
        CheckpointManifestError (a CheckpointError): no manifest (not a
            complete checkpoint), not JSON, or a field the schema refuses
            (the message names the file, the field, the value and the fix)."""
    d, _ = MANIFEST_FILE.read(Path(path) / MANIFEST, missing=f"{path} is not a complete zorse_fx checkpoint (no "
                                                             f"{MANIFEST}); use a step_<k> directory from "
                                                             f"<out>/checkpoints")
    return _upgrade(d)


# -- integrity ---------------------------------------------------------------------
# [Note: checkpoint integrity]
# After DCP's save has returned on every rank (it ends with a collective, so
# every rank's files are written), rank 0 records the size and sha256 of every
# file of the directory in the manifest, which it writes last. Before a run
# resumes, rank 0 checks them (``verify_checkpoint``): a missing file, one of
# another size (truncated) or with another sha256 (bit rot, a partial
# overwrite), or a manifest that does not read, makes the checkpoint damaged,
# and so does DCP's ``.metadata`` missing or not reading, or a file it points
# into missing or short (checked for every manifest version: a version-1
# manifest records no files, and DCP's index names them too);
# ``newest_intact_checkpoint`` then falls back to the previous one, and the
# caller sets the damaged ones aside (``set_aside``: ``step_<k>.damaged``, no
# longer a checkpoint) so that keeping the newest K never deletes the
# checkpoints the resumed run writes. Hashing reads every byte once (sha256 at
# about 1 GB/s per core): a few seconds for a model of a billion parameters.

_CHUNK = 1 << 20


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _file_records(d: Path) -> dict[str, CheckpointFile]:
    """Size and sha256 of every file under ``d`` but the manifest, by path relative to ``d``."""
    files = sorted(p for p in d.rglob("*") if p.is_file() and p.name != MANIFEST)
    return {p.relative_to(d).as_posix(): CheckpointFile(bytes=p.stat().st_size, sha256=_sha256(p)) for p in files}


def verify_checkpoint(path: str | Path, *, contents: bool = True) -> dict:
    """Check checkpoint directory ``path`` against its manifest: every file
    the manifest records is present, of the recorded size and (``contents``)
    sha256 (see [Note: checkpoint integrity]); sizes first (cheap), then
    contents. Then DCP's own files: ``.metadata`` is there and reads, and
    every file it points into is there and long enough (``_check_dcp_files``:
    what a version-1 manifest, which records no files, is checked by).
    Returns the manifest.

    Raises:
        CheckpointDamagedError: the first problem, in one line naming the
            checkpoint, the file and what is wrong."""
    path = Path(path)

    def damaged(file: str | None, what: str) -> CheckpointDamagedError:
        return CheckpointDamagedError(f"checkpoint {path} is damaged: {what}", path=str(path), file=file)

    try:
        manifest = read_manifest(path)
    except CheckpointManifestError as exc:
        raise damaged(MANIFEST, f"its manifest does not read ({exc})") from None
    m = _STEP_DIR.match(path.name)
    if m and int(m.group(1)) != manifest["step"]:
        raise damaged(MANIFEST, f"{MANIFEST} says step {manifest['step']}, the directory step {m.group(1)}")
    files = manifest["files"] or {}
    for name, rec in files.items():
        f = path / name
        if not f.is_file():
            raise damaged(name, f"file {name} is missing")
        size = f.stat().st_size
        if size != rec["bytes"]:
            raise damaged(name, f"file {name} has {size} bytes, the manifest records {rec['bytes']} "
                                f"({'truncated' if size < rec['bytes'] else 'grown'})")
    for name, rec in files.items() if contents else ():
        got = _sha256(path / name)
        if got != rec["sha256"]:
            raise damaged(name, f"file {name} has sha256 {got[:12]}..., the manifest records "
                                f"{rec['sha256'][:12]}... (its bytes changed since it was written)")
    _check_dcp_files(path, damaged)
    return manifest


def _check_dcp_files(path: Path, damaged) -> None:
    """DCP's ``.metadata`` is in checkpoint ``path`` and reads (``_SafeReader``),
    and every file its storage records point into is there and holds the
    bytes they point at; else ``damaged(file, what)`` is raised."""
    if not (path / ".metadata").is_file():
        raise damaged(".metadata", "file .metadata (DCP's index of every tensor) is missing")
    try:
        meta = _SafeReader(path).read_metadata()
    except Exception as exc:  # a pickle cut short or of something else: what unpickling raises varies
        raise damaged(".metadata", f"file .metadata does not read ({type(exc).__name__}: "
                                   f"{' '.join(str(exc).split())[:200]})") from None
    need: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            need[rel] = max(need.get(rel, 0), info.offset + info.length)
    for rel, end in sorted(need.items()):
        f = path / rel
        if not f.is_file():
            raise damaged(rel, f"file {rel}, which .metadata points into, is missing")
        if f.stat().st_size < end:
            raise damaged(rel, f"file {rel} has {f.stat().st_size} bytes, .metadata points up to byte {end} "
                               f"(truncated)")


def newest_intact_checkpoint(root: str | Path, *, contents: bool = True,
                             resumable: bool = False) -> tuple[Path | None, list[CheckpointDamagedError]]:
    """(the newest checkpoint under ``root`` that ``verify_checkpoint``
    passes (``contents``: hashes too, else sizes and files only), or None;
    the damaged ones newer than it, newest first). ``resumable``: only a
    checkpoint of the whole training state (manifest ``contents`` "full"):
    an intact model-only one is passed over, not counted as damaged."""
    damaged: list[CheckpointDamagedError] = []
    for _, d in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(d, contents=contents)
        except CheckpointDamagedError as exc:
            damaged.append(exc)
            continue
        if resumable and read_manifest(d)["contents"] != "full":
            continue
        return d, damaged
    return None, damaged


def set_aside(path: str | Path) -> Path:
    """Rename checkpoint directory ``path`` (``step_<k>``) to
    ``step_<k>.damaged`` (``.damaged.<n>`` if taken): kept for inspection, no
    longer listed as a checkpoint. Returns the new path."""
    path = Path(path)
    new, n = path.with_name(path.name + ".damaged"), 1
    while new.exists():
        new, n = path.with_name(f"{path.name}.damaged.{n}"), n + 1
    os.replace(path, new)
    return new


# -- DCP metadata without arbitrary unpickling ------------------------------------
_SAFE_TORCH = {"Size", "strided", "contiguous_format", "preserve_format", "channels_last"}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes, ``torch.Size``, dtypes, layouts and
    plain containers: anything else in ``.metadata`` is refused."""

    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint.") or module == "torch.distributed.checkpoint":
            return super().find_class(module, name)
        if module == "torch" and (name in _SAFE_TORCH or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):  # a layout by name: "torch.strided"
            return super().find_class(module, name)
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            return super().find_class(module, name)  # the checkpoint id DCP records
        if module in ("collections",) and name == "OrderedDict":
            return super().find_class(module, name)
        if module == "builtins" and name in ("dict", "list", "tuple", "set", "frozenset", "int", "float", "str",
                                             "bytes", "bool", "slice", "getattr"):
            return super().find_class(module, name)
        raise CheckpointError(f"checkpoint metadata refers to {module}.{name}, which a DCP checkpoint "
                              f"does not contain; refusing to load it")


@functools.cache
def _safe_reader_class() -> type:
    """``dcp.FileSystemReader`` whose metadata is read by ``_MetadataUnpickler``, made on first use:
    ``torch.distributed.checkpoint`` takes 0.75 s to import (python -X importtime, 2026-12-06), paid by
    every rank at start where only a checkpoint's save or load needs it."""
    import torch.distributed.checkpoint as dcp

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            path = Path(self.path) / ".metadata"
            try:
                metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
            except FileNotFoundError:
                raise CheckpointError(f"checkpoint {self.path}: file .metadata (DCP's index of every tensor) is "
                                      f"missing; resume from another step_<k> of its directory") from None
            if getattr(metadata, "storage_meta", None) is None:
                from torch.distributed.checkpoint.metadata import StorageMeta

                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader


def _SafeReader(path):  # noqa: N802 (constructs the class above)
    """The checkpoint ``path``'s reader (``_safe_reader_class``)."""
    return _safe_reader_class()(path)


def checkpoint_reader(path: str | Path):
    """A DCP storage reader over checkpoint ``path`` whose ``.metadata`` is unpickled admitting only DCP's
    metadata classes, ``torch.Size`` and dtypes (``_SafeReader``): for ``dcp.load`` outside the runtime
    (``zorse export``, ``zorse eval``)."""
    return _SafeReader(path)


# -- save ------------------------------------------------------------------------
def _plain(t: torch.Tensor) -> torch.Tensor:
    """A tensor DCP writes as itself (a view of a larger buffer is copied)."""
    t = t.detach()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
        t = t.clone()
    return t


def _rng_state(worker: StageWorker) -> dict[str, torch.Tensor]:
    out = {f"rng/rank{worker.rank}/cpu": torch.get_rng_state()}
    if worker.device.type == "cuda":
        out[f"rng/rank{worker.rank}/cuda"] = torch.cuda.get_rng_state(worker.device)
    return out


def _state_to_save(worker: StageWorker, step: int) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    low = worker.reducer.main_grads  # 16-bit working weights: their float32 masters are saved, by range
    for st in worker.stages:
        if st.param_shards is not None:  # ZeRO-3: the owned ranges (masters: below), no whole tensor anywhere
            canon_of = {id(p): canon for canon, p in st.params().items()}
            for p, a, b, t in st.param_shards.owned_values():
                if id(p) not in low:
                    sd.setdefault(f"model/{canon_of[id(p)]}/{a}-{b}", t.detach().clone())
            continue
        for canon, p in st.params().items():
            if id(p) not in low:
                sd.setdefault(f"model/{canon}", _plain(p))
    for canon, pieces in worker.master_weights().items():
        for a, b, t in pieces:
            sd.setdefault(f"model/{canon}/{a}-{b}", _plain(t.reshape(-1)))
    for opt in worker.optimizers:
        state = opt.optimizer.state if opt.optimizer is not None else {}
        for canon, a, b, t in opt.state_pieces():
            for moment in ("exp_avg", "exp_avg_sq"):
                key = f"optim/{moment}/{canon}/{a}-{b}"
                if key not in sd:
                    m = state.get(t, {}).get(moment)
                    sd[key] = _plain(m.reshape(-1)) if m is not None else torch.zeros(b - a, dtype=t.dtype)
    sd["optim/step"] = torch.tensor(worker.optimizer_steps, dtype=torch.int64)
    sd["train/step"] = torch.tensor(step, dtype=torch.int64)
    if worker.scaler is not None:
        scaler = worker.scaler.state_dict()
        sd["scaler/scale"] = torch.tensor(scaler["scale"], dtype=torch.float64)
        sd["scaler/growth_tracker"] = torch.tensor(scaler["growth_tracker"], dtype=torch.int64)
    sd.update(_rng_state(worker))
    return sd


def save_checkpoint(worker: StageWorker, root: str | Path, step: int, *, keep: int = 3, run_id: str = "",
                    plan_hash: str = "", model_only: bool = False) -> Path:
    """Save the training state after ``step`` to ``root/step_<step>``,
    atomically (see [Note: checkpoint contents] and the module docstring);
    keep the newest ``keep`` checkpoints of steps up to ``step``. Collective:
    call on every rank. Rank 0 writes the manifest (a ``CheckpointManifest``
    with the run's identity ``run_id`` / ``plan_hash`` and every file's size
    and sha256: [Note: checkpoint integrity]). ``model_only``: the
    parameters alone (``model/`` keys and the step; manifest ``contents``
    "model"), for a run's last step under ``--final-checkpoint model-only``:
    no AdamW moments, loss scaler or RNG, so it cannot be resumed. Returns
    the checkpoint directory."""
    root = Path(root)
    tmp, final = root / f"step_{step}.tmp", root / f"step_{step}"
    if worker.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    dist.barrier()
    import torch.distributed.checkpoint as dcp  # (on first use: see _SafeReader)

    state = _state_to_save(worker, step)
    if model_only:
        state = {k: v for k, v in state.items() if k.startswith("model/") or k == "train/step"}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp))
    if worker.rank == 0:  # DCP's save ended with a collective: every rank's files are written
        plan = worker.plan
        manifest = _manifest_dict(CheckpointManifest(
            step=step, optimizer_steps=worker.optimizer_steps, world_size=plan.world_size,
            num_stages=plan.num_stages, model_name=plan.model_name, cluster_name=plan.cluster_name,
            global_batch_size=plan.global_batch_size, seq_len=plan.seq_len, precision=worker.precision.name,
            samples_seen=step * plan.global_batch_size, run_id=run_id, plan_hash=plan_hash,
            files=_file_records(tmp), contents="model" if model_only else "full"))
        with open(tmp / MANIFEST, "w") as f:
            f.write(json.dumps(manifest, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # the same step saved again (a restarted run): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        # Only checkpoints up to this step count: one of a later step is not of this run's past.
        for _, old in [c for c in list_checkpoints(root) if c[0] <= step][:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


# -- load ------------------------------------------------------------------------
def _model_range_key(key: str) -> tuple[str, int, int] | None:
    """``model/<canon>/<a>-<b>`` (a float32 master's range) -> (canon, a, b)."""
    if not key.startswith("model/"):
        return None
    canon, _, rng = key[len("model/"):].rpartition("/")
    a, dash, b = rng.partition("-")
    if not canon or not dash or not a.isdigit() or not b.isdigit():
        return None
    return canon, int(a), int(b)


def _range_key(key: str) -> tuple[str, str, int, int] | None:
    """``optim/<moment>/<canon>/<a>-<b>`` -> (moment, canon, a, b)."""
    parts = key.split("/")
    if len(parts) < 4 or parts[0] != "optim":
        return None
    a, _, b = parts[-1].partition("-")
    return parts[1], "/".join(parts[2:-1]), int(a), int(b)


def _check_batch(path: Path, manifest: dict, plan) -> None:
    for key, want in (("global_batch_size", plan.global_batch_size), ("seq_len", plan.seq_len)):
        if manifest[key] != want:
            raise CheckpointError(f"{path}: written with {key} {manifest[key]}, but this plan has {want}; "
                                  f"the data position (step x global batch) would not carry over: resume "
                                  f"with a plan of {key} {manifest[key]}")


def check_resumable(path: str | Path, plan, shapes: dict[str, tuple[int, ...]]) -> dict:
    """Before any rank starts (``zorse train --resume``): checkpoint ``path``
    fits ``plan``, whose parameters have ``shapes`` (canonical name -> shape):
    the same global batch and sequence length, and every parameter saved
    with that shape (whole, or as ranges: those are checked when loaded).
    What ``load_checkpoint`` checks on every rank, from the manifest and
    DCP's metadata only (no tensor is read). Returns the manifest.

    Raises:
        CheckpointError: naming the checkpoint, the field or parameter, both values and the fix."""
    path = Path(path)
    manifest = read_manifest(path)
    _check_batch(path, manifest, plan)
    meta = _SafeReader(path).read_metadata().state_dict_metadata
    ranged = {r[0] for key in meta if (r := _model_range_key(key)) is not None}
    for canon, shape in shapes.items():
        key = f"model/{canon}"
        if key not in meta:
            if canon in ranged:
                continue
            raise CheckpointError(f"{path}: holds no parameter {canon!r}, which this plan trains; the checkpoint is "
                                  f"of another model (manifest model {manifest['model_name']!r}, plan model "
                                  f"{plan.model_name!r}): resume with that model's plan, or start anew with "
                                  f"--overwrite")
        if tuple(meta[key].size) != tuple(shape):
            raise CheckpointError(f"{path}: parameter {canon!r} has shape {tuple(meta[key].size)} in the checkpoint "
                                  f"but this plan's is {tuple(shape)}; the checkpoint is of another model: resume "
                                  f"with that model's plan, or start anew with --overwrite")
    return manifest


def load_checkpoint(worker: StageWorker, path: str | Path, *, check_batch: bool = True) -> dict:
    """Load checkpoint ``path`` into ``worker`` (parameters, AdamW state re-cut
    to this plan's ranges, loss scaler, step counters, RNG when the world size
    is the same). Collective: call on every rank. Returns the manifest.

    Raises:
        CheckpointError: the checkpoint holds the parameters only (manifest
            ``contents`` "model"), is not of this model (a parameter is
            missing or has another shape: named with both shapes), its global
            batch or sequence length differs from the plan's (the data
            position would not carry over), or part of an owned optimizer
            range was never saved."""
    path = Path(path)
    manifest = read_manifest(path)
    if manifest["contents"] != "full":
        raise CheckpointError(f"{path} holds the model's parameters only (a last step's checkpoint written with "
                              f"--final-checkpoint model-only): training cannot continue from it; resume from a "
                              f"checkpoint with the optimizer state, or start anew from its weights")
    plan = worker.plan
    if check_batch:
        _check_batch(path, manifest, plan)
    reader = _SafeReader(path)
    meta = reader.read_metadata().state_dict_metadata
    pieces: dict[tuple[str, str], list[tuple[int, int, str]]] = defaultdict(list)
    for key in meta:
        r = _range_key(key)
        if r is not None:
            pieces[(r[0], r[1])].append((r[2], r[3], key))

    def empty(key: str) -> torch.Tensor:
        m = meta[key]
        return torch.empty(tuple(m.size), dtype=m.properties.dtype)

    # Parameters saved by range (float32 masters of 16-bit working weights): canon -> [(a, b, key)].
    ranged: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    for key in meta:
        r = _model_range_key(key)
        if r is not None:
            ranged[r[0]].append((r[1], r[2], key))
    request: dict[str, torch.Tensor] = {}
    for st in worker.stages:
        for canon, p in st.params().items():
            key = f"model/{canon}"
            if key not in meta and canon in ranged:
                covered = sorted(ranged[canon])
                if covered[-1][1] != p.numel() or sum(b - a for a, b, _ in covered) != p.numel():
                    raise CheckpointError(f"{path}: parameter {canon!r} is saved as ranges "
                                          f"{[(a, b) for a, b, _ in covered]} that do not cover its {p.numel()} "
                                          f"elements ({tuple(p.shape)} in stage {st.index} of this plan); the "
                                          f"checkpoint is incomplete or of another model")
                for *_, k in covered:
                    request.setdefault(k, empty(k))
                continue
            if key not in meta:
                raise CheckpointError(f"{path}: holds no parameter {canon!r}, which stage {st.index} of this plan "
                                      f"trains; the checkpoint is of another model (manifest model "
                                      f"{manifest['model_name']!r}, plan model {plan.model_name!r})")
            if tuple(meta[key].size) != tuple(p.shape):
                raise CheckpointError(f"{path}: parameter {canon!r} has shape {tuple(meta[key].size)} in the "
                                      f"checkpoint but stage {st.index} of this plan needs {tuple(p.shape)}; "
                                      f"the checkpoint is of another model")
            request.setdefault(key, empty(key))
    optim_steps = manifest["optimizer_steps"]
    # Per optimizer tensor: (optimizer, tensor, its range [a, b), {moment: saved ranges overlapping it}).
    wanted = []
    for opt in worker.optimizers:
        for canon, a, b, t in opt.state_pieces():
            over = {m: [(lo, hi, k) for lo, hi, k in pieces.get((m, canon), ()) if lo < b and hi > a]
                    for m in ("exp_avg", "exp_avg_sq")}
            for *_, k in (x for ranges in over.values() for x in ranges):
                request.setdefault(k, empty(k))
            wanted.append((opt, t, a, b, over))
    scalars = ["optim/step", "train/step"]
    if worker.scaler is not None and "scaler/scale" in meta:
        scalars += ["scaler/scale", "scaler/growth_tracker"]
    same_world = manifest["world_size"] == plan.world_size
    rng = [k for k in _rng_state(worker) if k in meta] if same_world else []
    for k in scalars + rng:
        request[k] = empty(k)
    import torch.distributed.checkpoint as dcp

    dcp.load(request, storage_reader=reader)

    def assemble(moment: str, t: torch.Tensor, a: int, b: int, over) -> torch.Tensor:
        """Elements [a, b) of ``moment`` from the saved ranges ``over``, shaped and placed as ``t``."""
        buf = torch.zeros(b - a, dtype=t.dtype)
        reached = a  # saved ranges cover [a, reached) so far
        for lo, hi, k in sorted(over):
            x, y = max(a, lo), min(b, hi)
            buf[x - a : y - a].copy_(request[k][x - lo : y - lo])
            if x <= reached:
                reached = max(reached, y)
        if reached < b:
            raise CheckpointError(f"{path}: AdamW {moment} of elements [{a}, {b}) of its parameter is not in "
                                  f"the checkpoint (saved ranges {[(lo, hi) for lo, hi, _ in over]}); "
                                  f"it is incomplete")
        return buf.view_as(t).to(device=t.device, dtype=t.dtype)

    def whole(canon: str) -> torch.Tensor:
        """Parameter ``canon`` as saved: whole, or its float32 ranges joined (float32 masters)."""
        key = f"model/{canon}"
        if key in request:
            return request[key]
        return torch.cat([request[k].reshape(-1) for *_, k in sorted(ranged[canon])])

    with torch.no_grad():
        for st in worker.stages:
            for canon, p in st.params().items():
                if st.param_shards is not None:  # ZeRO-3: into the owned range
                    st.param_shards.load_values(p, whole(canon))
                else:
                    p.copy_(whole(canon).view_as(p))  # (a 16-bit working weight: the masters' rounding)
        for opt in worker.optimizers:  # the float32 masters of this plan's ranges
            for canon, a, b, t in opt.master_pieces():
                t.copy_(whole(canon).reshape(-1)[a:b].to(device=t.device, dtype=t.dtype))
            opt.refresh_host()  # [Note: optimizer offload]: the host copies of the loaded weights
        if optim_steps:  # (no optimizer step taken yet: AdamW creates its state at the first one)
            for opt, t, a, b, over in wanted:
                opt.optimizer.state[t] = {"step": torch.tensor(float(optim_steps), dtype=torch.float32),
                                          **{m: assemble(m, t, a, b, ranges) for m, ranges in over.items()}}
    if worker.scaler is not None and "scaler/scale" in request:
        worker.scaler.load_state_dict({"scale": float(request["scaler/scale"]),
                                       "growth_tracker": int(request["scaler/growth_tracker"])})
    for k in rng:
        if k.endswith("/cpu"):
            torch.set_rng_state(request[k])
        else:
            torch.cuda.set_rng_state(request[k], worker.device)
    worker.steps = int(request["train/step"])
    worker.optimizer_steps = int(request["optim/step"])
    return manifest
