"""A captured graph as plain data: the capture cache's fast form of an exported graph.

[Note: the graph record]
A warm ``zorse plan`` of SmolLM2-135M spent 6.4 of its 13.5 CPU s reading the cached graph
(bench/plan_cli.py, 2026-12-07, the 2-core machine): importing torch's serializer, which imports
torch._dynamo (1.6 s), ``torch.export.load`` (4.0 s: most of it a FakeTensor per node made through the
fake mode's dispatch and each symbolic size parsed with sympy) and unlifting the program into a module
(``ep.module()``: 0.4 s). What a plan reads of that module is the unlifted graph (nodes, targets,
arguments), each node's metadata (its value's shape, stride and dtype, the batch dimension symbolic; the
module stack; the stack trace) and the module tree holding the parameters, buffers and constants. So
beside the ``.pt2`` the cache keeps exactly that as plain JSON (``<cache>/capture/graph-<key>.json``, under
the capture key, whose sources include this file): ``encode`` once the module is made (from a fresh
export or the ``.pt2``), ``decode`` before the ``.pt2`` is tried.

Decoding builds the graph with ``fx.Graph.create_node``; targets resolve only as
``torch.ops.<namespace>.<op>.<overload>`` (an ``OpOverload``) or a public function of ``operator``, and
every other field is checked for its type, so reading a record runs no code it holds. A node's value is a
meta tensor of the recorded shape and stride (the batch a ``SymInt`` of one ``ShapeEnv`` holding the
recorded symbol, hint and range), not the FakeTensor export makes: a ``FakeTensorMode`` imports
torch._dynamo (1.7 CPU s), and what zorse_fx reads of a value is its type, dimensions, sizes and dtype
(``causal._static_len``, ``loss_count._sums_everything``, ``trace._recorded_reduction``, ``split``'s
first tensor input), which are the same; its device reads ``meta`` (the FakeTensor's reads the model's).
Values of one shape, stride and dtype share one meta storage (symbolic sizes make each ``empty_strided``
~0.4 ms; nothing reads a value's storage). The ``ShapeEnv`` is made without importing torch._dynamo
([Note: a ShapeEnv without torch._dynamo]).

Anything a record cannot say (a call of a submodule, another target or argument type, a value that is not
a tensor, a symbolic integer or a plain number, a size that is not an integer polynomial in one symbol, a
large buffer or constant the model does not hold) writes no record: the ``.pt2`` is read as before. Small
buffers and constants (up to ``_MAX_CONSTANT`` elements, as rotary ``inv_freq``) are kept by value, used
where the model lacks them (a plan made without the model), as the ``.pt2``'s are. A record that does not
decode (``GraphRecordError``: another format, an unknown operator, a tensor the model lacks or of another
shape or dtype, anything unexpected) is a miss, logged: the ``.pt2`` is read and the record written again.
tests/test_graph_record.py compares a decoded module with the one made from the ``.pt2``.
"""

from __future__ import annotations

import json
import operator

import torch
import torch.fx as fx

__all__ = ["FORMAT", "GraphRecordError", "encode", "decode"]

#: The record's format; a record of another format is a miss.
FORMAT = 1

#: Node metadata kept (what zorse_fx and fx's code generation read); ``from_node`` (provenance objects) is not.
_META = ("val", "nn_module_stack", "stack_trace", "torch_fn")

#: A constant that is not one of the model's tensors is kept by value up to this many elements.
_MAX_CONSTANT = 1024


class GraphRecordError(ValueError):
    """A graph record that does not decode (a miss: the ``.pt2`` is read)."""


class _Unsupported(Exception):
    """Something ``encode`` cannot say as data: no record is written."""


# --------------------------------------------------------------------------- encoding


class _Encoder:
    def __init__(self) -> None:
        self.symbol: tuple[str, int] | None = None  # (name, hint) of the one batch symbol

    def dim(self, d):
        if isinstance(d, bool) or not isinstance(d, (int, torch.SymInt)):
            raise _Unsupported(f"a size {d!r}")
        if isinstance(d, int):
            return d
        import sympy

        expr = d.node.expr
        if expr.is_Integer:
            return int(expr)
        free = list(expr.free_symbols)
        if len(free) != 1:
            raise _Unsupported(f"a size {expr} of {len(free)} symbols")
        sym = free[0]
        if self.symbol is None:
            shape_env = d.node.shape_env
            values = getattr(shape_env, "backed_var_to_val", None)  # (torch 2.13; var_to_val before it)
            value = (values if values is not None else shape_env.var_to_val).get(sym)
            if value is None:
                raise _Unsupported(f"a symbol {sym} without a value")
            vr = getattr(shape_env, "var_to_range", {}).get(sym)
            bounds = [int(b) if vr is not None and getattr(b, "is_Integer", False) else None
                      for b in ((vr.lower, vr.upper) if vr is not None else (None, None))]
            self.symbol = (str(sym), int(value), *bounds)
        elif self.symbol[0] != str(sym):
            raise _Unsupported(f"a second symbol {sym}")
        poly = sympy.Poly(expr, sym)
        terms = []
        for (power,), coef in poly.terms():
            if not coef.is_Integer:
                raise _Unsupported(f"a size {expr}")
            terms.append([int(power), int(coef)])
        return {"s": terms}

    def value(self, v):
        if v is None or isinstance(v, (bool, int, float, str)):  # (a SymInt is none of them)
            return v
        if isinstance(v, torch.SymInt):
            return {"sym": self.dim(v)}
        if isinstance(v, torch.Tensor):
            if v.layout != torch.strided or v.is_quantized or v.is_complex():
                raise _Unsupported(f"a {v.layout} {v.dtype} value")
            return {"tensor": [[self.dim(d) for d in v.shape], [self.dim(d) for d in v.stride()],
                               str(v.dtype).removeprefix("torch."), str(v.device), bool(v.requires_grad)]}
        if isinstance(v, (tuple, list)):
            return {"t" if isinstance(v, tuple) else "l": [self.value(x) for x in v]}
        raise _Unsupported(f"a value of type {type(v).__name__}")

    def arg(self, a):
        if isinstance(a, fx.Node):
            return {"n": a.name}
        if a is None or isinstance(a, (bool, int, float, str)):
            return a
        if isinstance(a, torch.dtype):
            return {"dtype": str(a).removeprefix("torch.")}
        if isinstance(a, torch.device):
            return {"device": str(a)}
        if isinstance(a, torch.memory_format):
            return {"mf": str(a).removeprefix("torch.")}
        if isinstance(a, torch.layout):
            return {"layout": str(a).removeprefix("torch.")}
        if isinstance(a, tuple):
            return {"t": [self.arg(x) for x in a]}
        if isinstance(a, list):
            return [self.arg(x) for x in a]
        if isinstance(a, dict) and all(isinstance(k, str) for k in a):
            return {"d": [[k, self.arg(v)] for k, v in a.items()]}
        raise _Unsupported(f"an argument of type {type(a).__name__}")

    def meta(self, node: fx.Node) -> dict:
        out = {}
        for k in _META:
            if k not in node.meta:
                continue
            v = node.meta[k]
            if k == "val":
                out[k] = self.value(v)
            elif k == "nn_module_stack":
                if not isinstance(v, dict) or not all(isinstance(x, tuple) and all(isinstance(y, str) for y in x)
                                                      for x in v.values()):
                    raise _Unsupported("a module stack")
                out[k] = [[key, list(x)] for key, x in v.items()]
            elif k == "torch_fn":
                if not (isinstance(v, tuple) and all(isinstance(x, str) for x in v)):
                    raise _Unsupported("a torch_fn")
                out[k] = list(v)
            elif isinstance(v, str):
                out[k] = v
            elif v is not None:
                raise _Unsupported(f"a {k}")
        return out


def _target(node: fx.Node):
    t = node.target
    if node.op in ("placeholder", "get_attr", "output"):
        return t
    if node.op != "call_function":
        raise _Unsupported(f"a {node.op} node {node.name}")
    if isinstance(t, torch._ops.OpOverload):
        return ["op", t.namespace, t._opname, t._overloadname]
    if getattr(operator, getattr(t, "__name__", ""), None) is t:
        return ["operator", t.__name__]
    raise _Unsupported(f"a target {t!r}")


def _kept(name: str, t: torch.Tensor, live: dict[str, torch.Tensor]):
    """A buffer's or constant's values, kept where small (a plan made without the model has no
    non-persistent buffer, as rotary ``inv_freq``: the record's values stand in, as the ``.pt2``'s do);
    None where it is large and the model's (then a model without it does not decode: the ``.pt2`` is read)."""
    if t.numel() > _MAX_CONSTANT or t.is_complex() or t.layout != torch.strided or t.device.type == "meta":
        if name in live:
            return None
        raise _Unsupported(f"a constant {name} of {t.numel()} elements")
    return [list(t.shape), str(t.dtype).removeprefix("torch."), t.detach().cpu().reshape(-1).tolist()]


def _attributes(gm: fx.GraphModule, live: dict[str, torch.Tensor]) -> list:
    """The module tree: per module (``named_modules`` order) its qualified name and its parameters,
    buffers (with the persistent flag) and tensor constants read by ``get_attr``, in registration order.
    Raises ``_Unsupported`` for a submodule that is not a plain ``torch.nn.Module`` (a record rebuilds
    only those)."""
    reads = {n.target for n in gm.graph.find_nodes(op="get_attr")}
    tree = []
    for qual, mod in gm.named_modules(remove_duplicate=False):
        if not (type(mod) is torch.nn.Module or mod is gm):
            raise _Unsupported(f"a submodule {qual} of type {type(mod).__name__}")
        prefix = qual + "." if qual else ""
        entries = []
        for name, p in mod._parameters.items():
            if p is None:
                raise _Unsupported(f"an empty parameter {prefix}{name}")
            entries.append([name, "p", bool(p.requires_grad), None])
        for name, b in mod._buffers.items():
            if b is None:
                raise _Unsupported(f"an empty buffer {prefix}{name}")
            entries.append([name, "b", name not in mod._non_persistent_buffers_set, _kept(prefix + name, b, live)])
        for name, v in vars(mod).items():
            full = prefix + name
            if isinstance(v, torch.Tensor) and full in reads:
                entries.append([name, "c", None, _kept(full, v, live)])
        tree.append([qual, entries])
    return tree


def encode(gm: fx.GraphModule, live: dict[str, torch.Tensor]) -> dict | None:
    """``gm`` (an unlifted exported graph module whose tensors are ``live``'s by name, as
    ``named_parameters``/``named_buffers`` with duplicates name them) as plain JSON data, or None where
    it holds something a record cannot say ([Note: the graph record])."""
    enc = _Encoder()
    try:
        nodes = [[n.op, n.name, _target(n), enc.arg(n.args), enc.arg(n.kwargs), enc.meta(n)]
                 for n in gm.graph.nodes]
        tree = _attributes(gm, live)
    except _Unsupported as exc:
        import logging

        logging.getLogger(__name__).info("no graph record: the graph holds %s", exc)
        return None
    return {"format": FORMAT, "class_name": type(gm).__name__, "training": gm.training, "symbol": enc.symbol,
            "modules": tree, "nodes": nodes}


# --------------------------------------------------------------------------- decoding


def _fail(what: str):
    raise GraphRecordError(what)


def _shape_env():
    """A ``ShapeEnv`` as torch's deserializer makes one, without importing torch._dynamo.

    [Note: a ShapeEnv without torch._dynamo]
    ``ShapeEnv()`` asks ``torch.fx.experimental.validator.translation_validation_enabled()`` whether to
    validate its guards with z3, and importing that module imports torch._dynamo: 1.7 of the 2 CPU s a
    graph record's decoding took (``python -X importtime``, 2026-12-07, the 2-core machine). The answer is
    ``_HAS_Z3 and torch.fx.experimental._config.translation_validation`` (torch 2.11-2.13), so where that
    flag is off (its default; ``TORCHDYNAMO_TRANSLATION_VALIDATION=1`` turns it on) it is False whatever
    else holds, and the module is stood in for, for the constructor only, by one whose function says so.
    Where the flag is on, or the module is loaded already, the constructor imports it as usual.
    ``constrain_symbol_range`` imports torch._dynamo too, to name its caller's frame in the range's
    provenance: the decoder gives the range with a place named instead (``_update_var_to_range``). Both
    lean on torch internals, so any error while decoding is a miss: the ``.pt2`` is read."""
    import sys
    import types

    from torch.fx.experimental import _config
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    name = "torch.fx.experimental.validator"
    if name in sys.modules or _config.translation_validation:
        return ShapeEnv(assume_static_by_default=True)
    stand_in = types.ModuleType(name)
    stand_in.translation_validation_enabled = lambda: False
    sys.modules[name] = stand_in
    try:
        return ShapeEnv(assume_static_by_default=True)
    finally:
        if sys.modules.get(name) is stand_in:
            del sys.modules[name]


class _Decoder:
    def __init__(self, symbol) -> None:
        self.shape_env = _shape_env()
        self.sym = None
        if symbol is not None:
            import sympy

            if not (isinstance(symbol, list) and len(symbol) == 4 and isinstance(symbol[0], str)
                    and symbol[0].isidentifier() and type(symbol[1]) is int
                    and all(b is None or type(b) is int for b in symbol[2:])):
                _fail(f"symbol {symbol!r}")
            self.sym = sympy.Symbol(symbol[0], integer=True, positive=True)
            self.hint = symbol[1]
            add = getattr(self.shape_env, "add_backed_var_to_val", None) or self.shape_env.add_var_to_val
            add(self.sym, self.hint)
            from torch._guards import SLoc
            from torch.fx.experimental.symbolic_shapes import ValueRangesSLoc
            from torch.utils._sympy.numbers import int_oo
            from torch.utils._sympy.value_ranges import ValueRanges

            # ``constrain_symbol_range`` with the place it is said given (its own look-up of the caller's
            # frame imports torch._dynamo: [Note: a ShapeEnv without torch._dynamo])
            where = SLoc("zorse_fx graph record", None)
            self.shape_env._update_var_to_range(
                self.sym, ValueRanges(-int_oo if symbol[2] is None else symbol[2],
                                      int_oo if symbol[3] is None else symbol[3]), ValueRangesSLoc(where, where))
        self.nodes: dict[str, fx.Node] = {}
        self.protos: dict[str, torch.Tensor] = {}

    def dim(self, d):
        if type(d) is int:
            return d
        if not (isinstance(d, dict) and list(d) == ["s"] and isinstance(d["s"], list)) or self.sym is None:
            _fail(f"size {d!r}")
        expr, value = 0, 0
        for term in d["s"]:
            if not (isinstance(term, list) and len(term) == 2 and all(type(x) is int for x in term) and term[0] >= 0):
                _fail(f"size term {term!r}")
            expr += term[1] * self.sym ** term[0]
            value += term[1] * self.hint ** term[0]
        return self.shape_env.create_symintnode(expr, hint=value)

    @staticmethod
    def dtype(name):
        d = getattr(torch, name, None) if isinstance(name, str) else None
        return d if isinstance(d, torch.dtype) else _fail(f"dtype {name!r}")

    def value(self, v):
        if v is None or type(v) in (bool, int, float, str):
            return v
        if isinstance(v, dict) and len(v) == 1:
            (tag, x), = v.items()
            if tag == "sym":
                return self.dim(x)
            if tag in ("t", "l") and isinstance(x, list):
                items = [self.value(y) for y in x]
                return tuple(items) if tag == "t" else items
            if tag == "tensor" and isinstance(x, list) and len(x) == 5:
                shape, stride, dtype, device, grad = x
                if not (isinstance(shape, list) and isinstance(stride, list) and len(shape) == len(stride)
                        and isinstance(device, str) and isinstance(grad, bool)):
                    _fail(f"tensor {x!r}")
                key = json.dumps([shape, stride, dtype])
                proto = self.protos.get(key)
                if proto is None:  # (symbolic sizes make each empty_strided ~0.4 ms: one per kind of value)
                    proto = self.protos[key] = torch.empty_strided(
                        [self.dim(s) for s in shape], [self.dim(s) for s in stride], dtype=self.dtype(dtype),
                        device="meta")
                torch.device(device)  # (a device torch knows: else the record does not decode)
                return proto.detach().requires_grad_(grad)
        _fail(f"value {v!r}")

    def arg(self, a):
        if a is None or type(a) in (bool, int, float, str):
            return a
        if isinstance(a, list):
            return [self.arg(x) for x in a]
        if not (isinstance(a, dict) and len(a) == 1):
            _fail(f"argument {a!r}")
        (tag, x), = a.items()
        if tag == "n":
            return self.nodes[x] if x in self.nodes else _fail(f"argument: no earlier node {x!r}")
        if tag == "t" and isinstance(x, list):
            return tuple(self.arg(y) for y in x)
        if tag == "d" and isinstance(x, list) and all(isinstance(kv, list) and len(kv) == 2
                                                       and isinstance(kv[0], str) for kv in x):
            return {k: self.arg(v) for k, v in x}
        if tag == "dtype":
            return self.dtype(x)
        if tag == "device" and isinstance(x, str):
            return torch.device(x)
        if tag in ("mf", "layout"):
            kind = torch.memory_format if tag == "mf" else torch.layout
            got = getattr(torch, x, None) if isinstance(x, str) else None
            return got if isinstance(got, kind) else _fail(f"{tag} {x!r}")
        _fail(f"argument {a!r}")

    def meta(self, m) -> dict:
        if not isinstance(m, dict) or not set(m) <= set(_META):
            _fail(f"metadata {m!r}")
        out = {}
        for k, v in m.items():
            if k == "val":
                out[k] = self.value(v)
            elif k == "nn_module_stack":
                if not (isinstance(v, list) and all(isinstance(e, list) and len(e) == 2 and isinstance(e[0], str)
                                                    and isinstance(e[1], list) and all(isinstance(s, str) for s in e[1])
                                                    for e in v)):
                    _fail("nn_module_stack")
                out[k] = {key: tuple(x) for key, x in v}
            elif k == "torch_fn":
                if not (isinstance(v, list) and all(isinstance(s, str) for s in v)):
                    _fail("torch_fn")
                out[k] = tuple(v)
            else:
                out[k] = v if isinstance(v, str) else _fail(f"{k} {v!r}")
        return out


def _resolve(op: str, target):
    if op in ("placeholder", "get_attr", "output"):
        return target if isinstance(target, str) else _fail(f"{op} target {target!r}")
    if op != "call_function" or not isinstance(target, list) or not all(isinstance(t, str) for t in target):
        _fail(f"{op} target {target!r}")
    if target[0] == "operator" and len(target) == 2:
        fn = getattr(operator, target[1], None)
        return fn if callable(fn) and not target[1].startswith("_") else _fail(f"target {target!r}")
    if target[0] == "op" and len(target) == 4 and all(t.isidentifier() for t in target[1:3]):
        try:
            got = getattr(getattr(getattr(torch.ops, target[1]), target[2]), target[3])
        except (AttributeError, RuntimeError):
            _fail(f"target {target!r}: no such operator")
        return got if isinstance(got, torch._ops.OpOverload) else _fail(f"target {target!r}")
    _fail(f"target {target!r}")


def decode(data, live: dict[str, torch.Tensor]) -> tuple[fx.GraphModule, list[torch.Tensor]]:
    """The graph module ``data`` (from ``encode``) records, with ``live``'s tensors in place by name (tied
    ones the same object), and the tensors it holds that are not ``live``'s (kept constants).

    Raises:
        GraphRecordError: ``data`` is not a record of this format, names a target that is not an
            operator, a tensor ``live`` lacks or whose shape or dtype differs, or anything else unexpected.
    """
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        _fail(f"format {data.get('format') if isinstance(data, dict) else type(data).__name__!r}")
    dec = _Decoder(data.get("symbol"))
    graph = fx.Graph()
    nodes = data.get("nodes")
    if not isinstance(nodes, list):
        _fail("nodes")
    for entry in nodes:
        if not (isinstance(entry, list) and len(entry) == 6 and entry[0] in (
                "placeholder", "get_attr", "call_function", "output") and isinstance(entry[1], str)):
            _fail(f"node {entry!r:.200}")
        op, name, target, args, kwargs, meta = entry
        args, kwargs = dec.arg(args), dec.arg(kwargs)
        if not isinstance(args, tuple) or not isinstance(kwargs, dict):
            _fail(f"node {name}: arguments")
        node = graph.create_node(op, _resolve(op, target), args, kwargs, name=name)
        if node.name != name:
            _fail(f"node name {name!r} taken")
        node.meta.update(dec.meta(meta))
        dec.nodes[name] = node
    root = torch.nn.Module()
    kept: list[torch.Tensor] = []
    modules = data.get("modules")
    if not isinstance(modules, list) or not modules or modules[0][0] != "":
        _fail("modules")
    gm = fx.GraphModule(root, fx.Graph(), class_name=data.get("class_name") if isinstance(
        data.get("class_name"), str) and data["class_name"].isidentifier() else _fail("class_name"))
    for entry in modules:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and isinstance(entry[1], list)):
            _fail(f"module {entry!r:.200}")
        qual, entries = entry
        if qual:
            parent, _, leaf = qual.rpartition(".")
            try:
                owner = gm.get_submodule(parent)
            except AttributeError:
                _fail(f"module {qual!r}: no parent")
            if not leaf or leaf in owner._modules:
                _fail(f"module {qual!r}")
            owner.add_module(leaf, torch.nn.Module())
        mod = gm.get_submodule(qual)
        for item in entries:
            if not (isinstance(item, list) and len(item) == 4 and isinstance(item[0], str) and item[1] in "pbc"):
                _fail(f"attribute {item!r:.200} of {qual!r}")
            name, kind, flag, value = item
            full = f"{qual}.{name}" if qual else name
            t = live.get(full)  # the model's own where it has it (as ``cache.load_exported``), else the values kept
            if kind != "p" and value is not None and t is None:
                if not (isinstance(value, list) and len(value) == 3 and isinstance(value[2], list)):
                    _fail(f"constant {full}")
                shape, dtype, flat = value
                try:
                    t = torch.tensor(flat, dtype=dec.dtype(dtype)).reshape(shape)
                except (TypeError, ValueError, RuntimeError) as exc:
                    _fail(f"constant {full}: {exc}")
                kept.append(t)
            if t is None:
                _fail(f"{full}: not one of the model's tensors")
            if kind == "p":
                if not isinstance(t, torch.nn.Parameter) or t.requires_grad != flag:
                    _fail(f"parameter {full}")
                mod.register_parameter(name, t)
            elif kind == "b":
                if isinstance(t, torch.nn.Parameter) or not isinstance(flag, bool):
                    _fail(f"buffer {full}")
                mod.register_buffer(name, t, persistent=flag)
            else:
                setattr(mod, name, t)
    training = data.get("training")
    gm.train(training) if isinstance(training, bool) else _fail("training")
    for n in graph.find_nodes(op="get_attr"):
        *path, field = n.target.split(".")
        try:
            value = getattr(gm.get_submodule(".".join(path)), field)
        except AttributeError:
            _fail(f"get_attr {n.target}: no such attribute")
        val = n.meta.get("val")
        if isinstance(value, torch.Tensor) and isinstance(val, torch.Tensor) and (
                tuple(value.shape) != tuple(val.shape) or value.dtype != val.dtype):
            _fail(f"get_attr {n.target}: {tuple(value.shape)} {value.dtype} is not the recorded "
                  f"{tuple(val.shape)} {val.dtype}")
    gm.graph = graph
    return gm, kept
