"""The on-disk schema of ``plan.json``: types and ranges, checked before a
plan is built (a plan is data, checked before anything runs).

The schema is not written here: ``file_schema.struct_of`` builds the
``msgspec`` structs below from the plan records' dataclasses in ``plan.py``
(``Plan``, ``StagePlan``, ``GPUShare``, ``SolverReport``, ``ir.TensorSpec``),
whose annotations carry every field's type and range (``Meta(ge=1)``, ...),
its allowed values (``Literal``) and its meaning (``Meta(description=...)``,
quoted by the error messages). plan.json adds three file-only fields:
``format`` (first), ``compute_dtype`` (after ``grad_reduce_dtype``, for
readers) and each stage's ``source_sha256`` (after ``source_file``). Adding
a field to plan.json is one edit in ``plan.py`` plus, where older files lack
it, a line in ``upgrade`` (and a ``PLAN_FORMAT_VERSION`` bump).

``decode(d, source)`` upgrades a parsed plan.json of any readable format
version (1-17) to the current shape (``upgrade``: fields added since take the
values those versions trained with) and converts it into ``PlanDoc``,
refusing unknown keys; ``_plan_io`` then builds the ``Plan`` from it and
``Plan.__post_init__`` checks the rules that tie fields together (shares sum
to the micro-batch, ranks 0..n-1 in ``rank_order``, contiguous block ranges,
interleaving). Every error is a ``PlanFileError`` (a ``FileFormatError``)
naming the file, the field path, the value and what would fix it, e.g.::

    runs/x/plan/plan.json: field stages[1].gpus[0].samples_per_microbatch is 0:
    expected `int` >= 1 (the samples this GPU takes from every micro-batch; the
    shares of a stage's GPUs sum to microbatch_size); correct it or re-export
    the plan with `zorse plan`
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from .errors import PlanFileError
from .file_schema import FileFormat, struct_of
from .ir.buckets import BUCKET_BYTES
from .ir.tensor import TensorSpec
from .plan import PLAN_FORMAT_VERSION, GPUShare, IdleGPU, IdleGPUs, MemoryBreakdown, Plan, SolverReport, StagePlan
from .precision import precision_policy

__all__ = ["READABLE_VERSIONS", "PLAN_FILE", "PlanDoc", "StageDoc", "GPUShareDoc", "MemoryBreakdownDoc",
           "TensorSpecDoc", "SolverDoc", "IdleGPUDoc", "IdleGPUsDoc",
           "upgrade", "decode"]

#: Format versions ``decode`` reads (``upgrade`` fills in the fields added since).
READABLE_VERSIONS = tuple(range(1, PLAN_FORMAT_VERSION + 1))
_NEEDED = msgspec.NODEFAULT

MemoryBreakdownDoc = struct_of(MemoryBreakdown, "MemoryBreakdownDoc")
GPUShareDoc = struct_of(GPUShare, "GPUShareDoc", docs={MemoryBreakdown: MemoryBreakdownDoc})
TensorSpecDoc = struct_of(TensorSpec, "TensorSpecDoc")
SolverDoc = struct_of(SolverReport, "SolverDoc")
IdleGPUDoc = struct_of(IdleGPU, "IdleGPUDoc")
IdleGPUsDoc = struct_of(IdleGPUs, "IdleGPUsDoc", docs={IdleGPU: IdleGPUDoc})
StageDoc = struct_of(StagePlan, "StageDoc", docs={GPUShare: GPUShareDoc, TensorSpec: TensorSpecDoc}, extra={
    # Checked by ``stage_sources.recorded_hashes`` (None: a version 1-4 file).
    "source_file": [("source_sha256", Annotated[str | None, Meta(description="the stage file's sha256, 64 hex "
                                                                             "digits")], _NEEDED)],
})
PlanDoc = struct_of(Plan, "PlanDoc", docs={SolverReport: SolverDoc, StagePlan: StageDoc, IdleGPUs: IdleGPUsDoc}, extra={
    "": [("format", Literal["zorse_fx.plan"], _NEEDED)],
    # Written for readers (the precision decides it); checked by ``_check_compute_dtype``.
    "grad_reduce_dtype": [("compute_dtype", Literal["float32", "bfloat16", "float16"] | None, None)],
})


def upgrade(d: dict) -> dict:
    """``d`` (a parsed plan.json of version 1-17) in the current shape: a
    copy with the fields added since its version at the values it trained
    with (v2: ``sharded``/``recompute`` off, ``state_shard_bytes`` 0; v3:
    ``interleave`` 1; v4: ``precision`` fp32 with float32 gradients, and the
    old ``compute_dtype`` dropped as it only chose datasheet peaks; v5:
    ``source_sha256`` None; v6: ``grad_bucket_bytes`` 25 MiB, the runtime's
    default; v7: each GPU's ``predicted_memory`` breakdown, optional, all 0
    when absent; v8: each stage's ``low_precision_params``, optional, none
    when absent; v9: each stage's ``grad_sharded``, optional, off when
    absent; v10: each stage's ``param_sharded``, optional, off when absent; v11: each stage's
    ``offload_optimizer`` / ``offload_activations`` and each GPU's ``predicted_host_memory_bytes``, optional,
    off / 0 when absent; v12: ``tf32``, optional, off when absent: PyTorch's default; v13: ``cluster_gpus`` and
    ``cluster_sha256``, optional, "" (not recorded) when absent; v14: ``loss_reduction``, optional,
    "sample_mean" when absent: how older runtimes trained; v15: ``rank_order``, "stage": how older plans numbered
    their ranks; v16: ``idle_gpus``, optional, null when absent: not said; v17: each stage's ``stash_on_host``,
    optional, off when absent). Parts of the wrong type are left for
    the schema to name."""
    d = dict(d)
    version = d.get("version")
    if not isinstance(version, int) or version >= 15:
        return d
    d.setdefault("rank_order", "stage")  # (v15: the ranks' numbering, stage by stage before)
    if version >= 6:
        return d
    d.setdefault("grad_bucket_bytes", BUCKET_BYTES)
    if version >= 5:
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


#: plan.json as a ``file_schema.FileFormat``.
PLAN_FILE = FileFormat(name="zorse_fx.plan", what="plan", doc=PlanDoc, versions=READABLE_VERSIONS,
                       remake="re-export the plan with `zorse plan`", error=PlanFileError, upgrade=upgrade)


def decode(d: Any, source: str) -> PlanDoc:
    """Check ``d`` (a parsed plan.json, any readable version) against the
    schema and return it as a ``PlanDoc`` in the current shape: an object,
    ``format`` "zorse_fx.plan", a version in ``READABLE_VERSIONS``, every
    field's type, range and allowed values, and a ``compute_dtype`` (if
    written) that is the precision's. Raises PlanFileError naming ``source``,
    the field path, the value and what would fix it."""
    doc = PLAN_FILE.decode(d, source)
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
