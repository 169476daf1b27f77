"""How zorse_fx reads the JSON files it writes: one loader, one error type.

Six formats pass through here: ``plan.json`` (``plan_schema``), kernel
profiles (``cost/profile.py``), communication profiles
(``profiling/comm.py``), checkpoint manifests (``runtime/checkpoint.py``),
token-file headers (``token_data.py``) and the lines of a run's
``timings.jsonl`` (``runtime/timings.py``). Each is one ``FileFormat``: the value
of its ``format`` field, the versions it reads, a ``msgspec.Struct`` holding
every field's type, range (``msgspec.Meta``: ``ge``, ``min_length``, ...),
allowed values (``Literal``) and meaning (``Meta(description=...)``), what
makes a good file again, and the error class it raises. Unknown fields are
refused (a typo is not ignored).

Where a format has an in-memory record (``Plan``, ``KernelProfile``, ...),
the struct is not written by hand: ``struct_of`` builds it from the
record's dataclass annotations, ``from_doc`` builds the record back from a
checked struct and ``to_builtins`` writes the record in the struct's field
order. A field is then declared once, on the dataclass; a file that lacks a
field the dataclass declares is an older version, which the format's
``upgrade`` brings up to date.

Every error is a ``FileFormatError`` (a subclass per format, so callers can
keep catching ``PlanFileError`` or ``CheckpointError``) naming the file, the
field path as msgspec reports it (``stages[1].gpus[0].samples_per_microbatch``;
a top-level field is quoted: ``'precision'``), the value (cut to a readable
length by ``errors.short_repr``), what was expected with the field's meaning,
and the fix::

    runs/x/plan/plan.json: field stages[1].gpus[0].samples_per_microbatch is 0:
    expected `int` >= 1 (the samples this GPU takes from every micro-batch; the
    shares of a stage's GPUs sum to microbatch_size); correct it or re-export
    the plan with `zorse plan`
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Union

import msgspec

from .errors import FileFormatError, short_repr

__all__ = ["FileFormat", "OPTIONAL", "NOT_IN_FILE", "MAX_NESTING_DEPTH", "struct_of", "from_doc", "to_builtins",
           "json_too_deep"]

#: Dataclass field metadata: the field may be left out of the file (it then takes its default).
OPTIONAL = {"file": "optional"}
#: Dataclass field metadata: an in-memory field the file does not hold.
NOT_IN_FILE = {"file": "no"}

#: Most levels of arrays / objects (JSON) or sequences / mappings (YAML) nested
#: inside each other that zorse_fx reads ([Note: nesting depth]).
MAX_NESTING_DEPTH = 100

# [Note: nesting depth]
# Python's json and PyYAML's composer parse nested values recursively: a file of
# 10,000 nested lists raises RecursionError (json, PyYAML) or overflows the C
# stack (pyarrow's JSON reader, behind `datasets`' json builder, crashes the
# process), at a depth that depends on how deep the reader's own call stack is.
# Every file zorse_fx reads is a few levels deep (plan.json: 5), so the depth
# is bounded before parsing, at MAX_NESTING_DEPTH for every reader:
# ``json_too_deep`` scans JSON text (brackets outside strings, line by line:
# a JSON string holds no raw newline) and the cluster-file loader counts the
# YAML composer's nesting, aliases expanded (``cluster/_config.py``). The
# error names the file, the line and the limit.


# -- dataclass <-> struct ---------------------------------------------------------------


def struct_of(cls: type, name: str, *, docs: dict[type, type] | None = None,
              extra: dict[str, list[tuple[str, Any, Any]]] | None = None,
              defaults_optional: bool = False) -> type[msgspec.Struct]:
    """The ``msgspec.Struct`` that checks the file form of dataclass ``cls``.

    One struct field per dataclass field in declaration order (the file's
    key order), with its annotation (``Annotated`` constraints kept) and with
    nested record types replaced by their structs (``docs``: dataclass ->
    struct). A field is required unless its metadata is ``OPTIONAL`` (then
    it defaults to the dataclass default); fields marked ``NOT_IN_FILE`` are
    left out (with ``defaults_optional``, every field with a default is
    optional: a file of options). ``extra`` adds file-only fields, ``{after: [(name, type,
    default), ...]}`` (``after`` "" = first; default ``msgspec.NODEFAULT`` =
    required). Unknown keys are refused."""
    docs = docs or {}
    extra = extra or {}
    hints = typing.get_type_hints(cls, include_extras=True)
    fields: list[tuple] = [_extra_field(e) for e in extra.get("", [])]
    for f in dataclasses.fields(cls):
        mode = f.metadata.get("file")
        if mode != "no":
            kind = _doc_type(hints[f.name], docs)
            has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            if mode == "optional" or (defaults_optional and has_default):
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                if dataclasses.is_dataclass(default):  # a record's default: its file form, made per instance
                    default = msgspec.field(default_factory=lambda d=msgspec.to_builtins(default), k=_strip(kind):
                                            msgspec.convert(d, k))
                fields.append((f.name, kind, default))
            else:
                fields.append((f.name, kind))
        fields += [_extra_field(e) for e in extra.get(f.name, [])]
    return msgspec.defstruct(name, fields, kw_only=True, forbid_unknown_fields=True, module=cls.__module__)


def _extra_field(e: tuple[str, Any, Any]) -> tuple:
    name, kind, default = e
    return (name, kind) if default is msgspec.NODEFAULT else (name, kind, default)


def _doc_type(kind: Any, docs: dict[type, type]) -> Any:
    """``kind`` with every record type in ``docs`` replaced by its struct."""
    if isinstance(kind, type) and kind in docs:
        return docs[kind]
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Annotated:
        return Annotated[(_doc_type(args[0], docs), *kind.__metadata__)]
    if origin in (Union, types.UnionType):
        return Union[tuple(_doc_type(a, docs) for a in args)]
    if origin in (tuple, list, dict):
        return origin[tuple(a if a is Ellipsis else _doc_type(a, docs) for a in args)]
    return kind


def from_doc(value: Any, kind: Any, **overrides: Any) -> Any:
    """The in-memory form of ``value`` (a checked struct or a part of one)
    as type ``kind``: a dataclass record is built from its file fields (plus
    ``overrides``, top level only), arrays become tuples, maps dicts."""
    if value is None:  # an optional field left unset
        return None
    kind = _strip(kind)
    if dataclasses.is_dataclass(kind):
        kwargs = {name: from_doc(getattr(value, name), hint)
                  for name, hint in _file_fields(kind) if name not in overrides}
        return kind(**kwargs, **overrides)
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_doc(x, args[0]) for x in value)
        return tuple(from_doc(x, a) for x, a in zip(value, args))
    if origin is dict:
        return dict(value)
    return value


@functools.cache
def _file_fields(cls: type) -> tuple[tuple[str, Any], ...]:
    """``(name, annotation)`` of the dataclass ``cls``'s fields a file holds
    (resolving the annotations once per class: ``get_type_hints`` is slow)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls) if f.metadata.get("file") != "no")


@functools.cache
def _struct_fields(doc: type) -> tuple[tuple[str, Any], ...]:
    return tuple((f.name, f.type) for f in msgspec.structs.fields(doc))


def to_builtins(record: Any, doc: type[msgspec.Struct], derived: Callable[[Any], dict] | None = None) -> dict:
    """``record`` (a dataclass) as its file's JSON-ready dict, keys in the
    order of ``doc``'s fields: nested records by their own struct (found
    through the field types), tuples as lists, file-only fields from
    ``derived(record)`` (a dict; called for every nested record)."""
    out = derived(record) if derived else {}
    return {name: out[name] if name in out else _plain(getattr(record, name), kind, derived)
            for name, kind in _struct_fields(doc)}


def _plain(value: Any, kind: Any, derived) -> Any:
    if value is None:  # an optional field left unset (``X | None``)
        return None
    kind = _strip(kind)
    if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
        return to_builtins(value, kind, derived)
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (tuple, list):
        fixed = origin is tuple and not (len(args) == 2 and args[1] is Ellipsis)
        return [_plain(x, args[i] if fixed else args[0], derived) for i, x in enumerate(value)]
    if origin is dict:
        return dict(value)
    return value


# -- one format ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FileFormat:
    """One JSON file format zorse_fx reads.

    Attributes:
        name: the value of the file's ``format`` field ("zorse_fx.plan").
        what: what the file is, for messages ("plan", "kernel profile").
        doc: the struct a file of the current version must match.
        versions: the ``version`` values it reads (older ones through ``upgrade``).
        remake: how to get a good file, ending every message that has no
            better fix ("re-export the plan with `zorse plan`").
        error: the ``FileFormatError`` subclass raised.
        upgrade: a parsed file of any readable version -> the current shape
            (a copy; fields added since at the values those versions meant).
    """

    name: str
    what: str
    doc: type[msgspec.Struct]
    versions: tuple[int, ...]
    remake: str
    error: type[FileFormatError] = FileFormatError
    upgrade: Callable[[dict], dict] | None = None

    def read(self, path: str | Path, *, missing: str | None = None) -> tuple[dict, Any]:
        """``(parsed dict, checked struct)`` of the file at ``path``.

        Raises ``error``: no such file (``missing`` says how to make one, else
        ``remake``), not UTF-8 JSON, a key given twice in one object (JSON
        would keep the last silently), or anything ``decode`` refuses."""
        path = Path(path)
        if not path.is_file():
            raise self.error(f"{path}: no such {self.what} file; {missing or self.remake}", path=str(path))
        try:
            text = path.read_text()
            deep = json_too_deep(text.splitlines())
            if deep is not None:
                raise self.error(f"{path}: values nested more than {MAX_NESTING_DEPTH} levels deep (arrays or "
                                 f"objects inside each other) at line {deep}; a {self.what} file is a few levels "
                                 f"deep: {self.remake}", path=str(path))
            d = _loads_unique(text)
        except _DuplicateKey as exc:
            where = _render([*exc.path, exc.key])
            raise self.error(f"{path}: field {where} is given twice ({short_repr(exc.first, 40)}, then "
                             f"{short_repr(exc.second, 40)}); JSON keeps only the last, so the file is refused: "
                             f"delete one of the two, or {self.remake}",
                             path=str(path), field=where, value=exc.second) from None
        except json.JSONDecodeError as exc:
            raise self.error(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}; {self.remake}",
                             path=str(path)) from None
        except UnicodeDecodeError as exc:
            raise self.error(f"{path}: not a text file ({exc.reason} at byte {exc.start}); {self.remake}",
                             path=str(path)) from None
        return d, self.decode(d, str(path))

    def decode(self, d: Any, source: str) -> Any:
        """``d`` (a parsed file of any readable version) checked and converted
        into ``doc``, upgraded to the current shape: a JSON object, ``format``
        ``name``, ``version`` one of ``versions``, every field's type, range
        and allowed values, no unknown field. Raises ``error`` naming
        ``source``, the field, the value and the fix."""
        if not isinstance(d, dict):
            raise self.error(f"{source}: a {self.what} file holds a JSON object, not a {type(d).__name__}; "
                             f"{self.remake}", path=source, value=d)
        if d.get("format") != self.name:
            raise self.error(f"{source}: not a zorse_fx {self.what} (field 'format' is {short_repr(d.get('format'))}, "
                             f"expected {self.name!r})", path=source, field="'format'", value=d.get("format"))
        version = d.get("version")
        if isinstance(version, bool) or version not in self.versions:
            raise self.error(f"{source}: {self.what} format version {short_repr(version)} is not supported by this "
                             f"zorse_fx (reads version{'s' if len(self.versions) > 1 else ''} "
                             f"{', '.join(map(str, self.versions))}); {self.remake}",
                             path=source, field="'version'", value=version)
        current = self.upgrade(d) if self.upgrade else d
        try:
            return msgspec.convert(current, self.doc)
        except msgspec.ValidationError as exc:
            raise self._validation_error(str(exc), current, source) from None

    def field_error(self, source: str, path: list, value: Any, expected: str | None = None, *,
                    reason: str | None = None) -> FileFormatError:
        """The error for a rule the struct cannot state (one tying two fields
        together, a record's own check), in the same words: ``field <path> is
        <value>: expected <expected>; correct it or <remake>`` (or ``: <reason>``
        where the rule's own message says what is wrong)."""
        why = reason if reason is not None else f"expected {expected}"
        return self.error(f"{source}: field {_render(path)} is {short_repr(value)}: {why}; "
                          f"correct it or {self.remake}", path=source, field=_render(path), value=value)

    def _validation_error(self, error: str, d: dict, source: str) -> FileFormatError:
        m = _AT.fullmatch(error)
        reason, at = (m.group(1), m.group(2)) if m else (error, "")
        path: list = [int(i) if i and i != "..." else (name or "...") for name, i in _PART.findall(at)]
        value, path = _value_at(d, path)
        missing = re.fullmatch(r"Object (missing required|contains unknown) field `(.+)`", reason)
        if missing:
            name, parent = missing.group(2), path
            path = [*path, name]
            where = _render(path)
            if missing.group(1).startswith("missing"):
                return self.error(f"{source}: missing field {where}; {self.remake}", path=source, field=where)
            close = difflib.get_close_matches(name, _field_names(_type_at(self.doc, parent)[0]), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            return self.error(f"{source}: unknown field {where} (value {short_repr(value.get(name))}); {hint}remove "
                              f"it or {self.remake}", path=source, field=where, value=value.get(name))
        kind, meaning = _type_at(self.doc, path)
        where = _render(path)
        if typing.get_origin(kind) is Literal:
            allowed = ", ".join(map(repr, typing.get_args(kind)))
            return self.error(f"{source}: field {where} is {short_repr(value)}; allowed: {allowed}", path=source,
                              field=where, value=value)
        meaning = f" ({meaning})" if meaning else ""
        return self.error(f"{source}: field {where} is {short_repr(value)}: {reason[:1].lower()}{reason[1:]}{meaning}; "
                          f"correct it or {self.remake}", path=source, field=where, value=value)


# -- nesting depth ------------------------------------------------------------------------

#: A JSON string (it holds no raw newline), and what is not a bracket, as str and bytes.
_JSON_STRING = re.compile(r'"[^"\\\n]*(?:\\.[^"\\\n]*)*"')
_JSON_STRING_BYTES = re.compile(rb'"[^"\\\n]*(?:\\.[^"\\\n]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_NOT_BRACKET_BYTES = re.compile(rb"[^\[\]{}]+")


def json_too_deep(lines: typing.Iterable[str | bytes], limit: int = MAX_NESTING_DEPTH) -> int | None:
    """The 1-based number of the first line where the JSON text ``lines``
    (one JSON document, or JSON Lines) nests arrays and objects more than
    ``limit`` levels deep, or None ([Note: nesting depth]). Brackets inside
    strings do not count; one pass over the text, no parsing (malformed JSON
    is the parser's to report)."""
    depth = 0
    for number, line in enumerate(lines, 1):
        if isinstance(line, bytes):
            brackets = _NOT_BRACKET_BYTES.sub(b"", _JSON_STRING_BYTES.sub(b"", line)).decode("ascii")
        else:
            brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", line))
        for c in brackets:
            if c in "[{":
                depth += 1
                if depth > limit:
                    return number
            else:
                depth = max(depth - 1, 0)
    return None


# -- duplicate keys -----------------------------------------------------------------------


class _DuplicateKey(Exception):
    """A key given twice in one JSON object: the key, both values and the object's path."""

    def __init__(self, key: str, first: Any, second: Any, path: list) -> None:
        super().__init__(key)
        self.key, self.first, self.second, self.path = key, first, second, path


def _loads_unique(text: str) -> Any:
    """``json.loads(text)``, refusing a key given twice in one object
    (``_DuplicateKey`` with the object's field path), where ``json.loads``
    keeps the last value without a word."""
    dups: list[tuple[str, Any, Any, dict]] = []

    def pairs_hook(pairs: list[tuple[str, Any]]) -> dict:
        d: dict = {}
        for k, v in pairs:
            if k in d and not dups:
                dups.append((k, d[k], v, d))
            d[k] = v
        return d

    value = json.loads(text, object_pairs_hook=pairs_hook)
    if dups:
        key, first, second, obj = dups[0]
        raise _DuplicateKey(key, first, second, _path_to(value, obj) or [])
    return value


def _path_to(root: Any, target: dict) -> list | None:
    """The field path of ``target`` (by identity) inside ``root``, or None."""
    if root is target:
        return []
    items = root.items() if isinstance(root, dict) else enumerate(root) if isinstance(root, list) else ()
    for k, v in items:
        if isinstance(v, (dict, list)):
            sub = _path_to(v, target)
            if sub is not None:
                return [k, *sub]
    return None


# -- error messages -----------------------------------------------------------------------

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


def _description(kind: Any) -> str | None:
    """The ``Meta(description=...)`` of an ``Annotated`` field type, if any."""
    if typing.get_origin(kind) is Annotated:
        for m in kind.__metadata__:
            if isinstance(m, msgspec.Meta) and m.description:
                return m.description
    return None


def _type_at(root: Any, path: list) -> tuple[Any, str | None]:
    """The schema type of the field at ``path`` under ``root`` (None where it
    has none) and the meaning of the last named field on the path."""
    kind, meaning = root, None
    for p in path:
        kind = _strip(kind)
        if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
            kind = {f.name: f.type for f in msgspec.structs.fields(kind)}.get(p)
            meaning = _description(kind)
        elif typing.get_origin(kind) in (list, tuple, dict):
            args = typing.get_args(kind)
            if typing.get_origin(kind) is dict:
                kind = args[1]
            else:
                fixed = len(args) > 1 and args[-1] is not Ellipsis and isinstance(p, int) and p < len(args)
                kind = args[p] if fixed else args[0]
        else:
            return None, meaning
    return _strip(kind), meaning


def _field_names(kind: Any) -> tuple[str, ...]:
    if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
        return tuple(f.name for f in msgspec.structs.fields(kind))
    return ()
