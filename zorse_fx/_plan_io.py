"""plan.json on disk, for ``plan.py``'s ``Plan``: the JSON form it writes
(``plan_dict``, behind ``Plan.to_dict`` / ``to_json`` / ``export``), the
plan a parsed file holds (``plan_from_dict``, behind ``Plan.from_dict``) and
the files ``Plan.load`` reads (``load_plan``, ``read_plan_files``: plan.json
parsed and checked against its schema, then every stage source beside it).

Both directions follow the schema (``plan_schema``, built from ``plan.py``'s
dataclasses by ``file_schema``): the writer walks a ``Plan`` in the schema's
field order and the reader builds the records from the checked struct, so
neither names a field but the three plan.json adds (``format``,
``compute_dtype``, ``source_sha256``). The format itself (fields, versions,
stage-source hashes) is described in ``plan.py``'s module docstring, the
stage-source checks are in ``stage_sources.py``. Errors are
``PlanFileError`` naming the file, the field path and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import PlanFileError
from .file_schema import from_doc, to_builtins
from .plan import PLAN_FORMAT_VERSION, Plan, StagePlan
from .plan_schema import PLAN_FILE, PlanDoc, _check_compute_dtype, decode
from .stage_sources import check_agreement, check_source_name, recorded_hashes, verify_sources

__all__ = ["plan_dict", "plan_from_dict", "load_plan", "read_plan_files"]


def plan_dict(plan: Plan) -> dict:
    """The JSON-ready dict of ``plan`` (plan.json's content, format
    ``plan.version``): every field in the schema's order, plus ``format``,
    ``compute_dtype`` and each stage's ``source_sha256``
    (``Plan.source_hashes``; None where unknown)."""
    hashes = plan.source_hashes()

    def file_only(record: Any) -> dict:
        if isinstance(record, Plan):
            return {"format": PLAN_FILE.name, "compute_dtype": record.compute_dtype}
        if isinstance(record, StagePlan):
            return {"source_sha256": hashes[record.index]}
        return {}

    return to_builtins(plan, PlanDoc, file_only)


def plan_from_dict(d: dict, *, source: str = "<dict>", sources: tuple[str, ...] = ()) -> Plan:
    """``Plan.from_dict``: ``d`` checked by ``plan_schema.decode``, then built."""
    return _build(d, decode(d, source), source, sources)


def load_plan(path: str | Path) -> Plan:
    """``Plan.load``: the files ``read_plan_files`` reads, built into a plan."""
    path, d, doc, sources = read_plan_files(path)
    return _build(d, doc, str(path), sources)


def _build(d: dict, doc: PlanDoc, source: str, sources: tuple[str, ...]) -> Plan:
    """The plan of ``d`` checked into ``doc``, its sources verified against
    the recorded sha256 (version >= 5), then ``Plan.__post_init__``'s rules,
    then plan.json's fields against what the sources declare
    (``stage_sources.check_agreement``)."""
    recorded = recorded_hashes(d, source) if doc.version >= 5 else ()
    if sources and recorded:
        verify_sources(d, sources, recorded, source)
    try:
        # An older file is read into (and re-exported as) the current format.
        plan = from_doc(doc, Plan, version=PLAN_FORMAT_VERSION, sources=sources,
                        sources_verified=bool(recorded) or not sources, recorded_sha256=recorded)
    except PlanFileError as exc:  # a __post_init__ check: name the file
        raise PlanFileError(f"{source}: {str(exc).removeprefix('plan: ')}") from None
    if sources:  # [Note: plan.json agrees with its stage files] in stage_sources.py
        check_agreement(plan, source)
    return plan


def read_plan_files(path: str | Path) -> tuple[Path, dict, PlanDoc, tuple[str, ...]]:
    """The files of the plan at ``path`` (``plan.json`` or a directory
    holding it): ``(plan.json's path, its parsed dict, that dict checked by
    ``plan_schema.decode``, the text of each stage's source file)``.

    The schema is checked before any stage file is read; each ``source_file``
    must be a plain name (``stage_sources.check_source_name``) of a file
    beside plan.json. The sources' sha256 are not checked here (``Plan.load``
    checks them). Raises PlanFileError for a missing plan.json, invalid JSON,
    a schema error or a missing stage file, naming the file and the field.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "plan.json"
    d, doc = PLAN_FILE.read(path, missing="create one with `zorse plan`")
    _check_compute_dtype(doc, str(path))
    sources = []
    for i, s in enumerate(doc.stages):
        name = check_source_name(s.source_file, i, str(path))
        src = path.parent / name
        if not src.is_file():
            raise PlanFileError(f"{path}: stage {i} source {src} (field stages[{i}].source_file) is missing; "
                                f"re-export the plan with `zorse plan`")
        sources.append(src.read_text())
    return path, d, doc, tuple(sources)
