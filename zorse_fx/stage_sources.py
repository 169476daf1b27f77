"""Stage sources of an exported plan: names and sha256 checks (plan format 5).

A plan file is data, but each ``stage_<i>.py`` beside it is Python that every
rank executes. ``plan.json`` records each stage file's sha256; these helpers
check a stage's ``source_file`` name and the recorded hashes before anything
is read or run (see "Stage sources" in ``plan.py``). Every error is a
``PlanFileError`` naming the plan file, the field path and the value.
"""

from __future__ import annotations

import hashlib
import re

from .errors import PlanFileError, short_repr

__all__ = ["source_sha256", "check_source_name", "recorded_hashes", "verify_sources"]

#: A stage's ``source_file``: a plain file name (no directory part, no leading dot).
_SOURCE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}\.py")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def source_sha256(text: str) -> str:
    """sha256 of a stage source's UTF-8 bytes, 64 lowercase hex digits."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def check_source_name(name, index: int, plan_file: str) -> str:
    """``name`` (stage ``index``'s ``source_file``) if it is the plain name of
    a ``.py`` file beside plan.json. Raises PlanFileError otherwise (absolute,
    ``..``, a directory part, hidden, not a string)."""
    if not isinstance(name, str) or not _SOURCE_NAME.fullmatch(name):
        raise PlanFileError(
            f"{plan_file}: field stages[{index}].source_file is {short_repr(name)}; it must be the plain name of a "
            f"Python file beside plan.json (like 'stage_{index}.py': no directory, no '..'); re-export the plan")
    return name


def recorded_hashes(d: dict, source: str) -> tuple[str, ...]:
    """The ``source_sha256`` of every stage of a version >= 5 plan dict ``d``
    (64 lowercase hex digits each). Raises PlanFileError on a missing or
    malformed one."""
    stages = d.get("stages")
    if not isinstance(stages, list):
        raise PlanFileError(f"{source}: field 'stages' must be a list; re-export the plan with `zorse plan`")
    out = []
    for i, st in enumerate(stages):
        h = st.get("source_sha256") if isinstance(st, dict) else None
        if not isinstance(h, str) or not _SHA256.fullmatch(h):
            raise PlanFileError(f"{source}: field stages[{i}].source_sha256 is {short_repr(h)}, not a sha256 (64 hex "
                                f"digits); re-export the plan with `zorse plan`")
        out.append(h)
    return tuple(out)


def verify_sources(d: dict, sources: tuple[str, ...], recorded: tuple[str, ...], source: str) -> None:
    """Raise PlanFileError for the first stage source whose sha256 is not the
    one plan.json records (the stage, its file and both hash prefixes named)."""
    for i, (text, want) in enumerate(zip(sources, recorded)):
        got = source_sha256(text)
        if got != want:
            name = d["stages"][i].get("source_file")
            raise PlanFileError(
                f"{source}: stage {i} source {name!r} has sha256 {got[:16]}... but plan.json records "
                f"{want[:16]}...: the file was changed after export, and zorse_fx will not run code the plan's "
                f"author did not export. Re-export the plan with `zorse plan` (or restore the file)")
