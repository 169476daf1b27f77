"""The capture cache: a model's exported graph, kept between commands.

[Note: the capture cache]
Capturing a Hugging Face model is ``torch.export.export`` with a dynamic
batch dimension, then ``run_decompositions({})`` (``trace._capture_export``):
35 s for SmolLM2-135M's 30 layers on the 2-core CPU machine (cProfile of
``zorse simulate``, 2026-12-06), paid again by every ``zorse plan``,
``zorse simulate`` and ``zorse.compile`` of the same model. The graph depends
on the model's code and configuration, the parameter and buffer shapes, the
example inputs' shapes and dtypes, and the torch and transformers that
traced it; not on the weights' values. So the decomposed ``ExportedProgram``
is saved with ``torch.export.save`` with its state dict replaced by meta
tensors (the graph only: 1-10 MB, not the weights), under a key hashing all
of the above (``export_key``), and a later capture of a model with the same
key loads it and puts the live model's own parameters and buffers in place
by name (the same tensor objects export would have held, ties included).
A loaded program whose names, shapes or dtypes do not match the live model's
is not used (captured afresh and written again).

Only models made of torch, ``transformers`` and zorse_fx classes are cached
(``cacheable``: a Hugging Face model, wrapped by ``CausalLMWithLoss`` or not):
their graph follows from their code, configuration and versions. A user's
own module can read anything in its ``forward`` — a function held in an
attribute, a global — that no key sees, so it is captured afresh every time.
The key covers: the source of every module class in the model and of this
package's capture code (a changed ``forward`` or capture pass is a miss),
every module's training flag (dropout is in the graph or not),
each class's qualified name, Hugging Face configurations (``to_json_string``),
every parameter's and buffer's name, shape, dtype and ``requires_grad``, the
inputs' names, shapes and dtypes, and the versions of torch, transformers
and zorse_fx. Files live in ``<cache>/capture/<key>.pt2`` (``cache_root()``:
``$ZORSE_CACHE_DIR``, else ``~/.cache/zorse_fx``), written to a temporary
name and renamed into place. ``$ZORSE_NO_CACHE=1`` (``--no-cache`` on the
command line) captures afresh and writes nothing. A file that cannot be read
is ignored with a log line and replaced. Only files zorse_fx wrote are read
(its own cache directory), as with Python's ``__pycache__``. Beside each
``.pt2`` the unlifted graph is kept as plain data and read first, without
``torch.export.load`` ([Note: the graph record] in ``graph_record.py``).

[Note: the loss check cached]
``capture`` runs the captured graph on the example batch (its output must be
a scalar) and checks the loss contract with three eager forwards of the model
(``trace.check_mean_loss``): 2-3 and 2-5 CPU s of a warm ``zorse plan`` of
SmolLM2-135M (bench/plan_cli.py, 2026-12-07), more than reading the cached
graph. The check's answer ("sample_mean" or "token_mean") follows from the
model's code and the graph's loss count, which the key covers (``loss_count.py``
among the sources hashed), not from the weights' values (any finite weights
give the same reduction; the example inputs are random per command already).
So a check that ran on real values (not the meta device) is kept beside the
graph as ``<key>.json``, plain JSON (``{"loss_reduction": ...}``), and a
capture whose graph has that key takes the answer from it, with neither
forward, where the graph's output is a scalar by its recorded metadata and
every parameter and buffer is finite (``trace._recorded_reduction``: NaN
weights are run and refused as before). A missing or unreadable file, any
other value, a non-finite weight or a meta-device model runs both.
``$ZORSE_NO_CACHE`` reads and writes neither file.

[Note: the analysis cached]
Pricing a cached capture ran the graph three more times on fake tensors, each a
FakeTensor dispatch of ~2,000 nodes: the block analysis at batch 1 and 2
(``analysis.analyse``: every node's batch-1 value, and which values carry the
batch in dim 0) and the saved-activations measurement (``cost/activations.py``):
1.9 and 0.9 of the 2.9 CPU s of pricing in a warm ``zorse plan`` of
SmolLM2-135M (2026-12-07, the 2-core machine, busy). Their answers follow from
the graph, the parameters' and inputs' shapes, dtypes and devices, the code
that runs them and torch; not from any value. So where the capture has a key
(``CapturedModel.cache_key``: a cacheable model, the cache enabled), each is
kept beside the graph as plain JSON (``<cache>/capture/<kind>-<key>.json``,
``save_record``/``load_record``), keyed by ``record_key``: the capture key,
a fingerprint of the graph as it is now (every node's name, op, target, args
and kwargs: a graph changed after capture is a miss), every parameter's,
buffer's and input's device type, and the source of the modules that compute
the answer (``analysis.py``, ``activations.py``, ``opclass.py``,
``precision.py``, ``ir/tensor.py``, this file); the measurement also by the
precision (its name and compute dtype). What is kept: per node, the batch-1
value's structure (tensors as shape, stride and dtype, rebuilt as meta
tensors: what the cost model reads of them is their shape, dtype and size)
and its per-sample spec; per node, the bytes of the storages autograd saves
first at that node, and each node's output dtype (block sums follow for any
cut into blocks: [Note: saved activations]). A record also lists the graph's
node names, checked on reading. A record that is missing, cannot be read or
does not fit is a miss (logged where it exists): the fake runs run and write
it again. ``$ZORSE_NO_CACHE`` reads and writes none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from ..models.hf import cache_root

__all__ = ["NO_CACHE_ENV", "cacheable", "disabled", "enabled", "export_key", "load_exported", "save_exported", "cache_file",
           "load_loss_check", "save_loss_check", "record_key", "load_record", "save_record", "model_key",
           "source_digest", "collector_paused", "restore_weights", "keep_weights", "load_graph", "save_graph"]

log = logging.getLogger(__name__)

#: Set to 1 to capture afresh and write nothing (``zorse plan/simulate --no-cache``).
NO_CACHE_ENV = "ZORSE_NO_CACHE"

_OWN_SOURCES = ("trace.py", "cache.py", "causal.py", "loss_count.py", "graph_record.py")


@contextlib.contextmanager
def disabled():
    """Within it, captures are made afresh and nothing is written (``--no-cache``);
    ``$ZORSE_NO_CACHE`` is restored after."""
    before = os.environ.get(NO_CACHE_ENV)
    os.environ[NO_CACHE_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(NO_CACHE_ENV, None)
        else:
            os.environ[NO_CACHE_ENV] = before


def enabled() -> bool:
    """Whether captures are read from and written to the cache (not ``$ZORSE_NO_CACHE=1``)."""
    return os.environ.get(NO_CACHE_ENV, "") not in ("1", "true", "yes")


def _class_source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):  # a class without a source file (built at run time): its name only
        return cls.__qualname__


#: The packages whose modules' graphs follow from their code, configuration and version alone.
_LIBRARIES = ("torch", "transformers", "zorse_fx")


def cacheable(model: torch.nn.Module) -> bool:
    """Whether ``model``'s capture may be cached: every module of it is a class
    of torch, ``transformers`` or zorse_fx ([Note: the capture cache]). A user's own
    module can read anything in its ``forward`` (a function held in an
    attribute, a global), which no key can see, so it is captured afresh."""
    return all(type(m).__module__.split(".")[0] in _LIBRARIES for m in model.modules())


def export_key(model: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], names: tuple[str, ...]) -> str:
    """The cache key of capturing ``model`` on ``example_inputs`` (named
    ``names``) by export: 32 hex digits of a sha256 ([Note: the capture cache])."""
    h = hashlib.sha256()

    def add(*parts) -> None:
        for p in parts:
            h.update(str(p).encode())
            h.update(b"\0")

    transformers = sys.modules.get("transformers")
    add(torch.__version__, getattr(transformers, "__version__", "-"), _zorse_version())
    here = Path(__file__).parent
    for name in _OWN_SOURCES:
        add(hashlib.sha256((here / name).read_bytes()).hexdigest())
    for cls in sorted({type(m) for m in model.modules()}, key=lambda c: f"{c.__module__}.{c.__qualname__}"):
        add(f"{cls.__module__}.{cls.__qualname__}", hashlib.sha256(_class_source(cls).encode()).hexdigest())
    add("training", [m.training for m in model.modules()], torch.is_grad_enabled())  # (dropout in the graph or not)
    for _, m in model.named_modules():
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "to_json_string"):
            add(config.to_json_string(use_diff=False), getattr(config, "_attn_implementation", None))
    for kind, tensors in (("p", model.named_parameters(remove_duplicate=False)),
                          ("b", model.named_buffers(remove_duplicate=False))):
        for name, t in tensors:
            add(kind, name, tuple(t.shape), t.dtype, t.requires_grad)
    for name, t in zip(names, example_inputs, strict=True):
        add("in", name, tuple(t.shape), t.dtype)
    return h.hexdigest()[:32]


def _zorse_version() -> str:
    """zorse_fx's installed version (the package root imports every phase: not imported here)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("zorse_fx")
    except PackageNotFoundError:  # run from a checkout without installing it
        return "-"


def cache_file(key: str) -> Path:
    """Where the capture of ``key`` is kept."""
    return cache_root() / "capture" / f"{key}.pt2"


def _live_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    live = dict(model.named_parameters(remove_duplicate=False))
    live.update(model.named_buffers(remove_duplicate=False))
    return live


def save_exported(key: str, ep) -> None:
    """Write ``ep``'s graph (its state dict as meta tensors) under ``key``;
    a cache that cannot be written is logged and skipped."""
    path = cache_file(key)
    state = ep.state_dict
    original = dict(state)
    try:
        for k, t in original.items():  # the graph only: shapes and dtypes of the weights, not their values
            meta = torch.empty_like(t, device="meta")
            state[k] = torch.nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(
                t, torch.nn.Parameter) else meta
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            torch.export.save(ep, tmp)
            os.chmod(tmp, 0o644)  # (mkstemp's 0600: as readable as the rest of the cache)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except Exception as exc:  # noqa: BLE001 (a cache must never fail the capture: logged, skipped)
        log.info("capture cache %s not written: %s: %s", path, type(exc).__name__, exc)
    finally:
        state.clear()
        state.update(original)


@contextlib.contextmanager
def collector_paused():
    """[Note: the collector paused while loading]
    ``torch.export.load`` of SmolLM2-135M's program makes some 10^6 objects that live on (schema records,
    nodes, fake tensors, sympy expressions), and each full collection of Python's cyclic collector that
    their number sets off while it runs visits them all again: five of them, 0.54 CPU s of a warm plan
    (2026-12-07, the 2-core machine, gc callbacks), freeing a few dozen objects. Within this block the
    collector is off; it is on again after (if it was), and what became garbage meanwhile is collected then
    as before. ``ep.module()`` runs in one too (``trace._module_of``)."""
    import gc

    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextlib.contextmanager
def _memoized_type_hints():
    """[Note: type hints memoized while loading]
    ``torch.export.load`` rebuilds each of the program's schema records (~128,000 for SmolLM2's graph) with
    ``typing.get_type_hints(cls, globalns=vars(schema))``, which re-evaluates every annotation each time:
    3.5 of the 9.1 CPU s a cached capture took (cProfile, 2026-12-07, 45,982 calls). The schema's classes do
    not change while a program loads, so within this block that call is answered from a cache keyed by the
    class, for the schema module's namespace only (every other call passes through). The hints are read, not
    changed, by the loader (``torch._export.serde.serialize._dict_to_dataclass``)."""
    import typing

    try:
        from torch._export.serde import schema
    except ImportError:  # another torch's layout: nothing to memoize
        yield
        return
    original, namespace, cache = typing.get_type_hints, vars(schema), {}

    def memoized(obj, globalns=None, localns=None, include_extras=False):
        if globalns is namespace and localns is None and not include_extras and isinstance(obj, type):
            hints = cache.get(obj)
            if hints is None:
                hints = cache[obj] = original(obj, globalns=globalns)
            return hints
        return original(obj, globalns=globalns, localns=localns, include_extras=include_extras)

    typing.get_type_hints = memoized
    try:
        yield
    finally:
        typing.get_type_hints = original


@contextlib.contextmanager
def _planned_schema_decoding():
    """[Note: schema records decoded by a plan per type]
    ``torch.export.load`` turns the program's JSON into schema dataclasses with ``_dict_to_dataclass(cls,
    data)`` (``torch._export.serde.serialize``), ~128,000 calls for SmolLM2's graph, each working out
    again what ``cls`` is (a schema name, ``Annotated``, ``Optional``, a tagged union, a dataclass and its
    fields' type hints, a list or dict type): 2.2 of the 5.6 CPU s of a profiled load (2026-12-07, the 2-core
    machine), after [Note: type hints memoized while loading]. Within this block that function is one that
    works it out once per ``cls`` (the same branches in the same order: the schema's classes do not change
    while a program loads) and decodes ``data`` by it; ``cls`` it cannot key (unhashable) goes to torch's.
    tests/test_capture_cache.py checks the two give equal records for a real program."""
    import types
    import typing

    try:
        from torch._export.serde import schema, serialize
        from torch._export.serde.union import _Union
        original, resolve = serialize._dict_to_dataclass, serialize._resolve_schema_cls
    except (ImportError, AttributeError):  # another torch's layout: nothing to plan
        yield
        return
    namespace, plans = vars(schema), {}

    def plan(cls):
        c = resolve(cls)
        if isinstance(c, str):
            raise AssertionError(f"Unresolved class type: '{c}'.")
        origin = typing.get_origin(c)
        if origin is typing.Annotated:
            return "annotated", c.__origin__
        if origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(c):
            return "optional", typing.get_args(c)
        if isinstance(c, type) and issubclass(c, _Union):
            return "union", c, typing.get_type_hints(c, globalns=namespace)
        if dataclasses.is_dataclass(c):
            hints = typing.get_type_hints(c, globalns=namespace)
            return "dataclass", c, tuple((f.name, hints[f.name]) for f in dataclasses.fields(c))
        return "other", c

    def decode(cls, data):
        try:
            p = plans.get(cls)
        except TypeError:  # an unhashable cls
            return original(cls, data)
        if p is None:
            p = plans[cls] = plan(cls)
        kind = p[0]
        if kind == "annotated":
            return decode(p[1], data)
        if kind == "optional":
            if data is None:
                return None
            if len(p[1]) != 2:
                raise AssertionError(f"expected 2 type args, got {len(p[1])}")
            return decode(p[1][0], data)
        if kind == "union":
            if not isinstance(data, dict):
                raise AssertionError(f"expected dict, got {type(data).__name__}")
            if len(data) != 1:
                raise AssertionError(f"expected dict with 1 key, got {len(data)}")
            (tag, value), = data.items()
            if not isinstance(tag, str):
                raise AssertionError(f"expected str key, got {type(tag).__name__}")
            return p[1].create(**{tag: decode(p[2][tag], value)})
        if kind == "dataclass":
            return p[1](**{name: decode(hint, data[name]) for name, hint in p[2] if name in data})
        c = p[1]
        if isinstance(data, list):
            if not data:
                return data
            item = typing.get_args(c)[0]
            return [decode(item, d) for d in data]
        if isinstance(data, dict):
            item = typing.get_args(c)[1]
            return {k: decode(item, v) for k, v in data.items()}
        if c is float:
            return float(data)
        return data

    serialize._dict_to_dataclass = decode
    try:
        yield
    finally:
        serialize._dict_to_dataclass = original


@contextlib.contextmanager
def _memoized_sympify():
    """[Note: symbolic shapes parsed once while loading]
    ``torch.export.load`` parses every symbolic size of every node's tensor metadata with
    ``sympy.sympify(text, locals=...)`` (``_parse_sym_expr`` in ``torch._export.serde.serialize``): 1,687
    parses of 2 distinct texts for SmolLM2-135M's graph ("s0" and "64*s0" or alike), 0.3-0.4 of the 2.4-2.8
    CPU s the first load of a process took (2026-12-07, the 2-core machine). Within this block a text parsed
    before is answered with the expression parsed then, where every symbol in it is the very object the
    caller's ``locals`` give that name (the loader's own symbol table: so the answer is what parsing would
    give); anything else (other arguments, no ``locals``, a symbol not in them) passes through. sympy
    expressions are immutable, so sharing one is safe."""
    import sympy

    original, memo = sympy.sympify, {}

    def memoized(a, *args, locals=None, **kwargs):
        if isinstance(a, str) and not args and not kwargs and locals is not None:
            hit = memo.get(a)
            if hit is not None and all(locals.get(s.name) is s for s in hit.free_symbols):
                return hit
            memo[a] = out = original(a, locals=locals)
            return out
        return original(a, *args, locals=locals, **kwargs)

    sympy.sympify = memoized
    try:
        yield
    finally:
        sympy.sympify = original


def load_exported(key: str, model: torch.nn.Module | dict[str, torch.Tensor]):
    """The cached ``ExportedProgram`` of ``key`` with ``model``'s own
    parameters and buffers in place, or None (no such file, one that cannot
    be read, or one whose tensors are not the model's by name, shape and dtype).
    ``model`` may be the tensors themselves by name (``named_parameters`` and
    ``named_buffers`` with duplicates: [Note: a warm plan without the model] in api.py)."""
    path = cache_file(key)
    if not path.is_file():
        return None
    try:
        with _memoized_type_hints(), _memoized_sympify(), _planned_schema_decoding(), collector_paused():
            ep = torch.export.load(path)
    except Exception as exc:  # noqa: BLE001 (an unreadable cache file is a miss: logged, replaced)
        log.info("capture cache %s not read: %s: %s", path, type(exc).__name__, exc)
        return None
    live = dict(model) if isinstance(model, dict) else _live_tensors(model)
    state = ep.state_dict
    for name, t in list(state.items()):
        own = live.get(name)
        if own is None or tuple(own.shape) != tuple(t.shape) or own.dtype != t.dtype:
            log.info("capture cache %s: %s is not the model's (%s); capturing afresh", path, name,
                     json.dumps([tuple(t.shape), str(t.dtype)]))
            return None
        state[name] = own
    for name in list(ep.constants):  # non-persistent buffers (rotary inv_freq): the model's own values
        own = live.get(name)
        if own is not None and isinstance(ep.constants[name], torch.Tensor):
            if tuple(own.shape) != tuple(ep.constants[name].shape):
                return None
            ep.constants[name] = own
    return ep


def save_graph(key: str, gm, live: dict[str, torch.Tensor]) -> None:
    """Keep ``gm`` (the unlifted module of ``key``'s program, its tensors ``live``'s by name) as its graph
    record, where it can be said as one ([Note: the graph record] in graph_record.py)."""
    from .graph_record import encode

    data = encode(gm, live)
    if data is not None:
        save_record("graph", key, data)


def load_graph(key: str, live: dict[str, torch.Tensor]):
    """The graph module of ``key``'s graph record with ``live``'s tensors in place, and the constants it
    kept by value; None where there is no usable record (then the ``.pt2`` is read) ([Note: the graph
    record] in graph_record.py)."""
    from .graph_record import GraphRecordError, decode

    data = load_record("graph", key)
    if data is None:
        return None
    try:
        with collector_paused():
            return decode(data, live)
    except Exception as exc:  # noqa: BLE001 (GraphRecordError; or torch internals it uses changed: a miss, logged)
        log.info("graph record %s not used: %s: %s", _record_file("graph", key), type(exc).__name__, exc)
        return None


#: The answers ``trace.check_mean_loss`` can give ([Note: the loss check cached]).
_REDUCTIONS = ("sample_mean", "token_mean")


def _check_file(key: str) -> Path:
    return cache_root() / "capture" / f"{key}.json"


def load_loss_check(key: str) -> str | None:
    """The loss reduction a check of a model with capture key ``key`` found ("sample_mean" or
    "token_mean"), or None (no record, or one that cannot be read: the check runs) ([Note: the loss
    check cached])."""
    path = _check_file(key)
    try:
        value = json.loads(path.read_text()).get("loss_reduction")
    except (OSError, ValueError, AttributeError):
        return None
    return value if value in _REDUCTIONS else None


def save_loss_check(key: str, reduction: str) -> None:
    """Record ``reduction``, the answer of a loss check on real values, under ``key``; a record that
    cannot be written is logged and skipped."""
    assert reduction in _REDUCTIONS, reduction
    path = _check_file(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"loss_reduction": reduction}, f)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:
        log.info("loss check record %s not written: %s", path, exc)


#: The sources an analysis record's answer follows from, beside the capture's ([Note: the analysis cached]).
_RECORD_SOURCES = ("capture/analysis.py", "capture/cache.py", "cost/activations.py", "cost/opclass.py",
                   "precision.py", "ir/tensor.py")


def _target_text(target) -> str:
    if isinstance(target, str):
        return target
    name = getattr(target, "__qualname__", None)
    return f"{getattr(target, '__module__', '')}.{name}" if name and not isinstance(
        target, torch._ops.OpOverload) else str(target)


def record_key(captured, *parts) -> str | None:
    """The key of a record of ``captured``'s fake runs (``parts``: what else the answer depends on), or
    None where none is kept (no capture key, or the cache disabled) ([Note: the analysis cached])."""
    key = getattr(captured, "cache_key", None)
    if key is None or not enabled():
        return None
    h = hashlib.sha256()

    def add(*xs) -> None:
        for x in xs:
            h.update(str(x).encode())
            h.update(b"\0")

    add(key, *parts)
    root = Path(__file__).parents[1]
    for name in _RECORD_SOURCES:
        add(hashlib.sha256((root / name).read_bytes()).hexdigest())
    gm = captured.graph_module
    for n in gm.graph.nodes:
        add(n.name, n.op, _target_text(n.target), n.args, n.kwargs)
    add("devices", sorted({t.device.type for t in (*gm.parameters(), *gm.buffers(), *captured.example_inputs)}))
    return h.hexdigest()[:32]


def _record_file(kind: str, key: str) -> Path:
    return cache_root() / "capture" / f"{kind}-{key}.json"


def load_record(kind: str, key: str | None):
    """The record of ``kind`` kept under ``key`` (plain JSON), or None: no key, the cache disabled, no
    record, or one that cannot be read (logged) ([Note: the analysis cached])."""
    if key is None or not enabled():
        return None
    path = _record_file(kind, key)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.info("%s record %s not read: %s", kind, path, exc)
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        log.info("%s record %s not read: %s", kind, path, exc)
        return None


def save_record(kind: str, key: str | None, data) -> None:
    """Keep ``data`` (plain JSON) as the record of ``kind`` under ``key``; nothing without a key or with
    the cache disabled; a record that cannot be written is logged and skipped."""
    if key is None or not enabled():
        return
    path = _record_file(kind, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, separators=(",", ":"))
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except (OSError, TypeError, ValueError) as exc:
        log.info("%s record %s not written: %s", kind, path, exc)


def source_digest() -> str:
    """A sha256 of every source file of zorse_fx (a warm plan without the model follows from all of them:
    [Note: a warm plan without the model] in api.py)."""
    h = hashlib.sha256()
    root = Path(__file__).parents[1]
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def _file_identity(path: Path) -> list:
    st = path.stat()
    return [str(path), st.st_size, st.st_mtime_ns, st.st_ino]


def model_key(name: str, directory: Path, seq_len: int) -> str:
    """The key of the record that plans model ``name`` (its configuration and weights in ``directory``)
    at ``seq_len`` tokens without loading it ([Note: a warm plan without the model] in api.py): the name,
    every file of the directory by path, size, modification time and inode (and ``config.json``'s bytes),
    the sequence length, torch's, transformers' (as installed: not imported) and zorse_fx's versions and
    every zorse_fx source file."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        transformers = version("transformers")
    except PackageNotFoundError:
        transformers = "-"
    h = hashlib.sha256()
    for part in ("model-record-1", name, torch.__version__, transformers, _zorse_version(), source_digest(),
                 seq_len, json.dumps([_file_identity(f) for f in sorted(directory.iterdir()) if f.is_file()]),
                 hashlib.sha256((directory / "config.json").read_bytes()).hexdigest()):
        h.update(str(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def _weights_files(key: str) -> tuple[Path, Path]:
    root = cache_root() / "capture"
    return root / f"weights-{key}.pt", root / f"weights-{key}.json"


def restore_weights(key: str, path: Path) -> bool:
    """Link (else copy) the ``weights.pt`` kept under model record ``key`` to ``path``; False (nothing) where
    there is none, or its size or modification time is not the one recorded when it was written (logged)
    ([Note: a warm plan without the model] in api.py)."""
    if not enabled():
        return False
    kept, stamp = _weights_files(key)
    try:
        recorded = json.loads(stamp.read_text())
        st = kept.stat()
    except FileNotFoundError:
        return False
    except (OSError, ValueError) as exc:
        log.info("weights %s not used: %s", kept, exc)
        return False
    if not isinstance(recorded, dict) or [st.st_size, st.st_mtime_ns] != [recorded.get("size"),
                                                                       recorded.get("mtime_ns")]:
        log.info("weights %s not used: not as written (%s)", kept, recorded)
        return False
    try:
        try:  # a hard link: no 540 MB written (a file changed through either name changes its time: a miss)
            os.link(kept, path)
        except OSError:  # another file system, or a file there already
            shutil.copyfile(kept, path)
    except OSError as exc:
        log.info("weights %s not copied: %s", kept, exc)
        return False
    return True


def keep_weights(key: str, path: Path) -> None:
    """Keep ``weights.pt`` (``path``) under model record ``key`` (a hard link, else a copy), with its size and
    modification time; one that cannot be kept is logged and skipped."""
    if not enabled():
        return
    kept, stamp = _weights_files(key)
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=kept.name + ".", suffix=".tmp", dir=kept.parent)
        os.close(fd)
        try:
            try:  # a hard link to the plan's file: nothing written
                os.unlink(tmp)
                os.link(path, tmp)
            except OSError:  # another file system
                shutil.copyfile(path, tmp)
                os.chmod(tmp, 0o644)  # (mkstemp's 0600: as readable as weights.pt)
            os.replace(tmp, kept)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        st = kept.stat()
        save_record("weights", key, {"size": st.st_size, "mtime_ns": st.st_mtime_ns})
    except OSError as exc:
        log.info("weights %s not kept: %s", kept, exc)
