"""The on-disk schema of ``plan.json``: types and ranges, checked before a
plan is built (a plan is data, checked before anything runs).

``decode(d, source)`` upgrades a parsed plan.json of any readable format
version (1-5) to the current shape (``upgrade``: fields added since take the
values those versions trained with) and converts it with ``msgspec`` into the
``PlanDoc`` structs below, which carry every field's type and range
(``msgspec.Meta``: ``samples_per_microbatch >= 1``, ``rank >= 0``, ...),
the allowed values of the enum-like fields (``Literal``) and no unknown keys
(``forbid_unknown_fields``). ``Plan.from_dict`` (``plan.py``) then builds the
in-memory IR (``Plan`` and friends, the dataclasses every module uses) from
the struct, and ``Plan.__post_init__`` checks the rules that tie fields
together (shares sum to the micro-batch, ranks 0..n-1 in stage order,
contiguous block ranges, interleaving).

Every error is a ``PlanFileError`` naming the file, the field path as
msgspec reports it (``stages[1].gpus[0].samples_per_microbatch``; a
top-level field is quoted: ``'precision'``), the value (cut to a readable
length by ``errors.short_repr``) and what would fix it, e.g.::

    runs/x/plan/plan.json: field stages[1].gpus[0].samples_per_microbatch is 0:
    expected `int` >= 1 (the samples this GPU takes from every micro-batch; the
    shares of a stage's GPUs sum to microbatch_size); correct it or re-export
    the plan with `zorse plan`
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta

from .errors import PlanFileError, short_repr
from .ir.schedule import SCHEDULES
from .ir.tensor import ITEMSIZE
from .precision import PRECISIONS, precision_policy

__all__ = ["READABLE_VERSIONS", "PlanDoc", "StageDoc", "GPUShareDoc", "TensorSpecDoc", "SolverDoc", "upgrade", "decode"]

#: Format versions ``decode`` reads (``upgrade`` fills in the fields added since).
READABLE_VERSIONS = (1, 2, 3, 4, 5)
_FIX = "correct it or re-export the plan with `zorse plan`"

Count = Annotated[int, Meta(ge=1)]  # a size that must be at least 1 (samples, tokens, micro-batches)
Index = Annotated[int, Meta(ge=0)]  # a rank, GPU index, block index
Bytes = Annotated[int, Meta(ge=0)]
Seconds = Annotated[float, Meta(ge=0)]
#: dtype names a stage's recv / send tensors may have (``str(torch dtype)`` without ``torch.``).
TensorDtype = Literal[tuple(ITEMSIZE)]  # type: ignore[valid-type]


class _Doc(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A part of plan.json: unknown keys are refused (a typo is not ignored)."""


class GPUShareDoc(_Doc, kw_only=True):
    rank: Index
    gpu: Index
    node: str
    gpu_type: str
    samples_per_microbatch: Count
    predicted_memory_bytes: Bytes = 0
    memory_capacity_bytes: Bytes = 0
    state_shard_bytes: Bytes


class TensorSpecDoc(_Doc, kw_only=True):
    name: str
    shape_per_sample: list[Index]
    dtype: TensorDtype


class StageDoc(_Doc, kw_only=True):
    index: Index
    blocks: tuple[Index, Index]
    label: str
    gpus: Annotated[list[GPUShareDoc], Meta(min_length=1)]
    input_names: list[str]
    recv: list[TensorSpecDoc]
    send: list[TensorSpecDoc]
    params: dict[str, str]
    consts: dict[str, str]
    num_parameters: Index
    source_file: str
    #: Checked by ``stage_sources.recorded_hashes`` (None: a version 1-4 file).
    source_sha256: str | None
    predicted_time_s: Seconds
    predicted_allreduce_s: Seconds
    sharded: bool
    recompute: bool


class SolverDoc(_Doc, kw_only=True):
    planner: str
    status: str
    # Objective, bound and gap may be inf / nan (no bound found): floats, unranged.
    objective_s: float
    best_bound_s: float
    optimality_gap: float
    wall_s: Seconds
    time_limit_s: Seconds = 0.0
    #: CP-SAT deterministic seconds per solve (0: not recorded, e.g. an older file).
    solver_budget: Annotated[float, Meta(ge=0)] = 0.0
    wall_clock_stops: Annotated[int, Meta(ge=0)] = 0
    candidates: list[dict[str, Any]] = []
    simulated_step_time_s: Seconds = 0.0
    simulated_max_memory_fraction: Annotated[float, Meta(ge=0)] = 0.0
    simulated_bubble_fraction: Annotated[float, Meta(ge=0)] = 0.0


class PlanDoc(_Doc, kw_only=True):
    format: Literal["zorse_fx.plan"]
    version: Annotated[int, Meta(ge=1)]
    cluster_name: str
    model_name: str
    input_names: list[str]
    seq_len: Count
    label_mode: Literal["same", "shifted"]
    global_batch_size: Count
    microbatch_size: Count
    num_microbatches: Count
    schedule: Literal[SCHEDULES]  # type: ignore[valid-type]
    interleave: Count
    precision: Literal[PRECISIONS]  # type: ignore[valid-type]
    #: One of ``precision.REDUCE_DTYPES[precision]``: checked by ``Plan.__post_init__``, whose message
    #: names what the file's precision allows.
    grad_reduce_dtype: str
    #: Written for readers (the precision decides it); checked by ``_check_compute_dtype``.
    compute_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    predicted_step_time_s: Seconds
    solver: SolverDoc
    stages: Annotated[list[StageDoc], Meta(min_length=1)]


#: What a field means, quoted in its error message (by field name).
_MEANING = {
    "samples_per_microbatch": "the samples this GPU takes from every micro-batch; the shares of a stage's GPUs sum "
                              "to microbatch_size",
    "rank": "the GPU's rank: 0..world_size-1, numbered stage by stage",
    "gpu": "the GPU's index in the cluster file",
    "seq_len": "tokens per sample",
    "global_batch_size": "samples per optimizer step = microbatch_size x num_microbatches",
    "microbatch_size": "samples per micro-batch",
    "num_microbatches": "micro-batches per step",
    "interleave": "stages per GPU group, 1 without interleaving",
    "state_shard_bytes": "bytes of the stage's optimizer state this GPU holds; 0 on every GPU of the stage splits "
                         "it equally",
    "predicted_memory_bytes": "bytes",
    "memory_capacity_bytes": "bytes",
    "sharded": "true or false",
    "recompute": "true or false",
    "index": "the stage's position in 'stages', from 0",
    "blocks": "the stage's block range [start, end) of the captured model",
    "gpus": "the stage's GPUs, at least one",
    "stages": "the pipeline stages, at least one",
    "params": "flat attribute name -> canonical parameter name, both strings",
    "consts": "flat attribute name -> canonical buffer name, both strings",
    "shape_per_sample": "the tensor's shape without the batch dimension",
    "num_parameters": "a count",
    "source_file": "it must be the plain name of a Python file beside plan.json, like 'stage_0.py'",
    "source_sha256": "the stage file's sha256, 64 hex digits",
}


def upgrade(d: dict) -> dict:
    """``d`` (a parsed plan.json of version 1-5) in the current shape: a
    copy with the fields added since its version at the values it trained
    with (v2: ``sharded``/``recompute`` off, ``state_shard_bytes`` 0; v3:
    ``interleave`` 1; v4: ``precision`` fp32 with float32 gradients, and the
    old ``compute_dtype`` dropped as it only chose datasheet peaks; v5:
    ``source_sha256`` None). Parts of the wrong type are left for the schema
    to name."""
    d = dict(d)
    version = d.get("version")
    if not isinstance(version, int) or version >= 5:
        return d
    if version < 3:
        d.setdefault("interleave", 1)
    if version < 4:
        d.update(precision="fp32", grad_reduce_dtype="float32")
        d.pop("compute_dtype", None)
    stages = d.get("stages")
    if isinstance(stages, list):
        d["stages"] = [_upgrade_stage(s, version) if isinstance(s, dict) else s for s in stages]
    return d


def _upgrade_stage(s: dict, version: int) -> dict:
    s = {**s, "source_sha256": s.get("source_sha256")}
    if version < 2:
        s.setdefault("sharded", False)
        s.setdefault("recompute", False)
        if isinstance(s.get("gpus"), list):
            s["gpus"] = [{"state_shard_bytes": 0, **g} if isinstance(g, dict) else g for g in s["gpus"]]
    return s


def decode(d: Any, source: str) -> PlanDoc:
    """Check ``d`` (a parsed plan.json, any readable version) against the
    schema and return it as a ``PlanDoc`` in the current shape: an object,
    ``format`` "zorse_fx.plan", a version in ``READABLE_VERSIONS``, every
    field's type, range and allowed values, and a ``compute_dtype`` (if
    written) that is the precision's. Raises PlanFileError naming ``source``,
    the field path, the value and what would fix it."""
    if not isinstance(d, dict):
        raise PlanFileError(f"{source}: a plan file holds a JSON object, not a {type(d).__name__}; "
                            f"re-export the plan with `zorse plan`")
    if d.get("format") != "zorse_fx.plan":
        raise PlanFileError(f"{source}: not a zorse_fx plan (field 'format' is {short_repr(d.get('format'))}, "
                            f"expected 'zorse_fx.plan')")
    version = d.get("version")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise PlanFileError(
            f"{source}: plan format version {short_repr(version)} is not supported by this zorse_fx "
            f"(reads versions {', '.join(map(str, READABLE_VERSIONS))}); re-export the plan with `zorse plan`"
        )
    current = upgrade(d)
    try:
        doc = msgspec.convert(current, PlanDoc)
    except msgspec.ValidationError as exc:
        raise PlanFileError(_message(str(exc), current, source)) from None
    _check_compute_dtype(doc, source)
    return doc


def _check_compute_dtype(doc: PlanDoc, source: str) -> None:
    """A version-4+ file's ``compute_dtype`` (written for readers; the precision
    decides it) must be the one its ``precision`` computes in (``doc``: a
    ``plan_schema.PlanDoc``; versions 1-3 have theirs dropped by ``upgrade``)."""
    name, stored = doc.precision, doc.compute_dtype
    if stored is None:
        return
    expected = precision_policy(name).compute_dtype_name
    if stored != expected:
        raise PlanFileError(f"{source}: field 'compute_dtype' is {stored!r} but precision {name!r} computes in "
                            f"{expected!r}; set compute_dtype to {expected!r} (or remove it) or change precision")


# -- error messages -------------------------------------------------------------------

_AT = re.compile(r"(?s)(.*) - at `\$(.*)`")
_PART = re.compile(r"\.(\w+)|\[(\d+|\.\.\.)\]")


class _Entry(str):
    """A dict entry in a field path, written ``[<key>]`` (``params['w']``)."""


def _render(path: list) -> str:
    """A field path as messages write it: ``stages[1].gpus[0].rank``; a
    top-level field quoted (``'precision'``)."""
    if len(path) == 1 and isinstance(path[0], str):
        return repr(path[0])
    text = ""
    for p in path:
        text += f"[{p}]" if isinstance(p, (int, _Entry)) else f".{p}"
    return text.lstrip(".")


def _message(error: str, d: dict, source: str) -> str:
    m = _AT.fullmatch(error)
    reason, at = (m.group(1), m.group(2)) if m else (error, "")
    path: list = [int(i) if i and i != "..." else (name or "...") for name, i in _PART.findall(at)]
    value, path = _value_at(d, path)
    missing = re.fullmatch(r"Object (missing required|contains unknown) field `(.+)`", reason)
    if missing:
        name, parent = missing.group(2), path
        path = [*path, name]
        if missing.group(1).startswith("missing"):
            return f"{source}: missing field {_render(path)}; re-export the plan with `zorse plan`"
        close = difflib.get_close_matches(name, _field_names(_type_at(parent)), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return (f"{source}: unknown field {_render(path)} (value {short_repr(value.get(name))}); {hint}remove it or "
                f"re-export the plan with `zorse plan`")
    kind = _type_at(path)
    if typing.get_origin(kind) is Literal:
        allowed = ", ".join(map(repr, typing.get_args(kind)))
        return f"{source}: field {_render(path)} is {short_repr(value)}; allowed: {allowed}"
    name = next((p for p in reversed(path) if isinstance(p, str) and not isinstance(p, _Entry)), "")
    meaning = f" ({_MEANING[name]})" if name in _MEANING else ""
    return f"{source}: field {_render(path)} is {short_repr(value)}: {reason[:1].lower()}{reason[1:]}{meaning}; {_FIX}"


def _value_at(d: Any, path: list) -> tuple[Any, list]:
    """The value at ``path`` in ``d`` and the path with a dict entry msgspec
    writes ``[...]`` replaced by the first entry whose key or value is not a
    string (the only dicts checked per entry are str -> str maps)."""
    out = []
    for p in path:
        if p == "..." and isinstance(d, dict):
            bad = next(((k, v) for k, v in d.items() if not (isinstance(k, str) and isinstance(v, str))), None)
            if bad is None:
                out.append(_Entry("..."))
                continue
            out.append(_Entry(short_repr(bad[0], 40)))
            d = bad[1]
            continue
        out.append(p)
        try:
            d = d[p]
        except (KeyError, IndexError, TypeError):
            d = None
    return d, out


def _strip(kind: Any) -> Any:
    """``kind`` without ``Annotated`` and without a ``| None``."""
    while True:
        if typing.get_origin(kind) is Annotated:
            kind = typing.get_args(kind)[0]
        elif typing.get_origin(kind) in (Union, types.UnionType):
            arms = [a for a in typing.get_args(kind) if a is not type(None)]
            if len(arms) != 1:
                return kind
            kind = arms[0]
        else:
            return kind


def _type_at(path: list) -> Any:
    """The schema type of the field at ``path`` (None where it has none)."""
    kind: Any = PlanDoc
    for p in path:
        kind = _strip(kind)
        if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
            kind = {f.name: f.type for f in msgspec.structs.fields(kind)}.get(p)
        elif typing.get_origin(kind) in (list, tuple, dict):
            args = typing.get_args(kind)
            if typing.get_origin(kind) is dict:
                kind = args[1]
            else:
                fixed = len(args) > 1 and args[-1] is not Ellipsis and isinstance(p, int) and p < len(args)
                kind = args[p] if fixed else args[0]
        else:
            return None
    return _strip(kind)


def _field_names(kind: Any) -> tuple[str, ...]:
    if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
        return tuple(f.name for f in msgspec.structs.fields(kind))
    return ()
