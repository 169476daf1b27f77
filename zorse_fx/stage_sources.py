"""Stage sources of an exported plan: names, sha256 checks (plan format 5)
and agreement with plan.json.

A plan file is data, but each ``stage_<i>.py`` beside it is Python that every
rank executes. ``plan.json`` records each stage file's sha256; these helpers
check a stage's ``source_file`` name and the recorded hashes before anything
is read or run (see "Stage sources" in ``plan.py``), then that plan.json says
what the stage files were generated for (``check_agreement``). Every error is
a ``PlanFileError`` naming the plan file, the field path and the value.

[Note: plan.json agrees with its stage files]
The sha256 check keeps the stage files as exported, but plan.json itself is
data a user may edit, and the runtime builds its buffers, batches and routes
from plan.json: a ``seq_len``, a received shape or an input name that the
stage code was not generated for only fails inside torch (a shape assertion,
a ``KeyError``). So ``check_agreement`` reads the literals each generated
``Stage<i>`` class declares (``codegen.split.emit_source``: ``INPUTS``,
``RECV``, ``SEND``, ``PARAMETERS``, ``CONSTANTS`` and, in files written since,
``SEQ_LEN``, ``MODEL_INPUTS`` and the last stage's ``LOSS_REDUCTION``) with
``ast.literal_eval`` -- nothing is executed -- and refuses a plan.json whose
fields disagree, naming the field, both values and the fix. A declaration a
stage file lacks (an older export) is not checked, but a ``token_mean``
plan's last stage file must define ``loss_count`` (the count its runtime
weights by).
"""

from __future__ import annotations

import ast
import hashlib
import re
from typing import TYPE_CHECKING, Any

from .errors import PlanFileError, short_repr

if TYPE_CHECKING:
    from .plan import Plan

__all__ = ["source_sha256", "check_source_name", "recorded_hashes", "verify_sources", "stage_declarations",
           "check_agreement"]

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


#: Class-level literals of a generated ``Stage<i>`` (``codegen.split.emit_source``) read by ``check_agreement``.
DECLARED = ("PARAMETERS", "CONSTANTS", "INPUTS", "RECV", "SEND", "SEQ_LEN", "MODEL_INPUTS", "LOSS_REDUCTION")


def stage_declarations(text: str, index: int) -> dict[str, Any]:
    """The ``DECLARED`` literals of class ``Stage{index}`` in a stage source,
    by name (those it has; none if it does not parse), and under ``"methods"``
    the names of the methods it defines. Read with ``ast.parse`` and
    ``ast.literal_eval``: nothing is executed."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return {}
    out: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == f"Stage{index}":
            out["methods"] = [stmt.name for stmt in node.body if isinstance(stmt, ast.FunctionDef)]
            for stmt in node.body:
                if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                        and stmt.targets[0].id in DECLARED):
                    try:
                        out[stmt.targets[0].id] = ast.literal_eval(stmt.value)
                    except ValueError:
                        pass
    return out


def check_agreement(plan: "Plan", source: str) -> None:
    """Raise PlanFileError where ``plan`` (loaded from ``source``) says other
    than its stage sources (``plan.sources``) declare: ``seq_len`` and
    ``input_names`` against every file's ``SEQ_LEN`` / ``MODEL_INPUTS``, each
    stage's ``input_names``, ``recv``, ``send``, ``params`` and ``consts``
    against its file's ``INPUTS``, ``RECV``, ``SEND``, ``PARAMETERS`` and
    ``CONSTANTS`` ([Note: plan.json agrees with its stage files])."""
    reexport = "re-export the plan with `zorse plan`"
    for s, text in zip(plan.stages, plan.sources):
        decl = stage_declarations(text, s.index)

        def refuse(field: str, value: Any, name: str, declared: Any, why: str = "", fix: str = "") -> None:
            fix = fix or f"set it back to {short_repr(declared)}, or {reexport}"
            raise PlanFileError(f"{source}: field {field} is {short_repr(value)}, but {s.source_file} (Stage{s.index}.{name}) was "
                                f"generated "
                                f"for {short_repr(declared)}{why}; plan.json must agree with its stage files: {fix}")

        if "SEQ_LEN" in decl and decl["SEQ_LEN"] != plan.seq_len:
            n = decl["SEQ_LEN"]
            refuse("'seq_len'", plan.seq_len, "SEQ_LEN", n, " tokens per sample (the shapes its tensors cross the "
                   "stage boundaries in)", f"set seq_len back to {n}, or plan for {plan.seq_len} tokens with "
                   f"`zorse plan --seq-len {plan.seq_len}`")
        if "MODEL_INPUTS" in decl and list(decl["MODEL_INPUTS"]) != list(plan.input_names):
            refuse("'input_names'", list(plan.input_names), "MODEL_INPUTS", decl["MODEL_INPUTS"],
                   " (the model's inputs, in order)")
        stage_inputs = list(s.input_names)
        if "INPUTS" in decl and list(decl["INPUTS"]) != stage_inputs:
            refuse(f"stages[{s.index}].input_names", stage_inputs, "INPUTS", decl["INPUTS"])
        unknown = [n for n in stage_inputs if n not in plan.input_names]
        if unknown:
            raise PlanFileError(f"{source}: field stages[{s.index}].input_names names {short_repr(unknown)}, which "
                                f"'input_names' ({short_repr(list(plan.input_names))}) does not: a stage reads model "
                                f"inputs only; correct one of them, or {reexport}")
        for field, name in (("recv", "RECV"), ("send", "SEND")):
            if name not in decl:
                continue
            mine, theirs = [t.to_dict() for t in getattr(s, field)], list(decl[name])
            if len(mine) != len(theirs):
                refuse(f"stages[{s.index}].{field}", mine, name, theirs, f" ({len(theirs)} tensors, not {len(mine)})")
            for k, (a, b) in enumerate(zip(mine, theirs)):
                for key in ("name", "shape_per_sample", "dtype"):
                    if key in b and a[key] != (list(b[key]) if key == "shape_per_sample" else b[key]):
                        refuse(f"stages[{s.index}].{field}[{k}].{key}", a[key], f"{name}[{k}]['{key}']", b[key])
        if s.index == plan.num_stages - 1:
            reduction = plan.loss_reduction
            if "LOSS_REDUCTION" in decl and decl["LOSS_REDUCTION"] != reduction:
                refuse("'loss_reduction'", reduction, "LOSS_REDUCTION", decl["LOSS_REDUCTION"],
                       " (how its loss averages, which the runtime weights each GPU's loss by)")
            if reduction == "token_mean" and "loss_count" not in decl.get("methods", ()):
                raise PlanFileError(f"{source}: field 'loss_reduction' is 'token_mean', but {s.source_file} (the last "
                                    f"stage) defines no loss_count to count the tokens with; set loss_reduction to "
                                    f"'sample_mean' if its loss is a mean over the samples, or {reexport}")
        for field, name in (("params", "PARAMETERS"), ("consts", "CONSTANTS")):
            if name in decl and dict(getattr(s, field)) != dict(decl[name]):
                mine, theirs = dict(getattr(s, field)), dict(decl[name])
                key = next((k for k in {**mine, **theirs} if mine.get(k) != theirs.get(k)), None)
                refuse(f"stages[{s.index}].{field}[{key!r}]", mine.get(key), f"{name}[{key!r}]", theirs.get(key))
