"""Split a block graph into per-stage programs and emit them as Python source.

A stage program is an fx graph ``forward(*model_inputs_it_reads, *received)
-> tuple(sent)`` (the last stage returns the loss). It holds:

- the ``act`` nodes of its block range, in the captured order;
- a copy of every ``free`` node they need (see [Note: rematerialise free
  values per stage] in ``capture/analysis.py``);
- a ``get_attr`` per parameter/constant, renamed to a flat identifier
  (``model.layers.0.mlp.up_proj.weight`` -> ``model_layers_0_mlp_up_proj_weight``).

``emit_source`` turns a program into a self-contained module file with one
``nn.Module`` class, readable by people and importable by the runtime, which
needs nothing else (no tracing, no OR-Tools, no model class) besides the
weights. The last stage declares ``LOSS_REDUCTION``; for a token-mean loss it
also has a method ``loss_count(*model inputs)``: the captured loss count, the
tokens its loss divides by ([Note: token-mean losses] in
``capture/loss_count.py``), which the runtime weights each GPU's loss by.

[Note: ZeRO-3 units]
Every emitted stage lists ``UNITS``: its trainable parameters grouped by the
block of the captured model that reads them first (a parameter first read by
a rematerialised free node joins the next act node's block), in forward
order; ``forward`` calls ``self.zorse_gather(u)`` just before the first line
reading a parameter of unit ``u`` and ``self.zorse_release(u)`` just after
the last (a tied weight read again by a later block keeps its unit gathered
until then). Both are no-ops in the class; a ZeRO-3 stage's runtime replaces
them with its gathers ([Note: sharded parameters] in
``runtime/param_shard.py``). A block is the unit FSDP wraps (a transformer
layer's attention or MLP here), so at most three units' weights are whole at
once: the one computing, the next one arriving, the last one leaving.

[Note: block methods]
``forward`` is a chain of calls, one method ``block_<b>`` per block ``b`` of
the stage (``BLOCKS`` lists them in order), each taking the values it reads
that an earlier block, a model input or a received tensor made and returning,
as a tuple, those it makes that a later block or the stage's output reads. A
node outside every block (a free node: [Note: rematerialise free values per
stage] in ``capture/analysis.py``) runs in the block of the next block node
after it (the last block's if none follows), so blocks run in the captured
order; each block binds the attributes it reads itself (``x = self.<flat>``
before the first reader), which ``StageRuntime.first_use`` and the ZeRO-3
hooks read. The runtime calls the methods as they are, or, on a stage that
recomputes with its blocks' inputs stashed in host memory, through a wrapper
that keeps only each block's inputs ([Note: host-stashed recomputation] in
``runtime/block_stash.py``).
"""

from __future__ import annotations

import builtins
import hashlib
import importlib
import inspect
import re
import sys
import types
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.fx as fx

from ..capture.analysis import BlockGraph
from ..capture.trace import META_KEY, fetch_attr
from ..ir.tensor import TensorSpec

__all__ = ["StageProgram", "split_stages", "emit_source", "load_stage_class", "load_stage_source", "flat_name"]


def flat_name(target: str) -> str:
    """``a.b.0.c`` -> ``a_b_0_c`` (a valid Python identifier)."""
    name = re.sub(r"[^0-9a-zA-Z_]", "_", target)
    return name if name[:1].isalpha() or name[:1] == "_" else f"p_{name}"


@dataclass(frozen=True, slots=True, kw_only=True)
class StageProgram:
    """One stage's computation, ready to emit or to run."""

    index: int
    num_stages: int
    #: (start_block, end_block) of the captured block graph, end exclusive.
    blocks: tuple[int, int]
    graph: fx.Graph
    #: Model inputs the stage reads (every rank loads them itself).
    input_names: tuple[str, ...]
    #: Tensors received from the previous stage, in placeholder order.
    recv: tuple[TensorSpec, ...]
    #: Tensors sent to the next stage, in output order (empty: last stage).
    send: tuple[TensorSpec, ...]
    #: flat attribute name -> canonical name, trainable parameters.
    params: dict[str, str]
    #: flat attribute name -> canonical name, buffers / constants.
    consts: dict[str, str]
    #: flat attribute name -> (shape, dtype) of every attribute.
    attr_meta: dict[str, tuple[tuple[int, ...], str]]
    #: Node name -> the captured block it belongs to (act nodes; the ZeRO-3 units of ``param_units``).
    block_of: dict[str, int] = dataclasses.field(default_factory=dict)
    #: The last stage of a token-mean loss: ``loss_count(*input_names)`` -> the tokens its loss
    #: averages over (``CapturedModel.loss_count`` on the stage's inputs, constants by flat name;
    #: [Note: token-mean losses] in ``capture/loss_count.py``). None elsewhere.
    loss_count: fx.Graph | None = None

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def loss_reduction(self) -> str | None:
        """The last stage's "sample_mean" or "token_mean" ([Note: the loss contract] in
        ``capture/trace.py``); None for another stage."""
        return ("token_mean" if self.loss_count is not None else "sample_mean") if self.is_last else None

    def param_units(self) -> tuple[tuple[tuple[str, ...], str, str], ...]:
        """ZeRO-3 units ([Note: ZeRO-3 units]): per block of the stage that
        first reads a trainable parameter, ``(flat names first read in that
        block in forward order, the node before which the unit is gathered,
        the node after which it is released)``, in forward order."""
        order = {n.name: k for k, n in enumerate(self.graph.nodes)}
        first_block = self.blocks[0]
        units: dict[int, list[tuple[int, str, int, int]]] = {}
        nodes = list(self.graph.nodes)
        for n in self.graph.find_nodes(op="get_attr"):
            if n.target not in self.params or not n.users:
                continue
            users = sorted(order[u.name] for u in n.users)
            # A parameter read first by a free node (copied per stage) joins the block of the next act node.
            block = next((self.block_of[m.name] for m in nodes[users[0]:] if m.name in self.block_of), first_block)
            units.setdefault(block, []).append((users[0], n.target, users[0], users[-1]))
        names = [n.name for n in nodes]
        out = []
        for block in sorted(units):
            members = sorted(units[block])
            out.append((tuple(flat for _, flat, _, _ in members), names[min(m[2] for m in members)],
                        names[max(m[3] for m in members)]))
        return tuple(out)

    def build(self, state: dict[str, torch.Tensor]) -> fx.GraphModule:
        """An executable module with parameters copied from ``state`` (canonical names)."""
        root = torch.nn.Module()
        for flat, canon in self.params.items():
            root.register_parameter(flat, torch.nn.Parameter(state[canon].detach().clone()))
        for flat, canon in self.consts.items():
            root.register_buffer(flat, state[canon].detach().clone())
        return fx.GraphModule(root, self.graph, f"Stage{self.index}")


def split_stages(bg: BlockGraph, stage_blocks: tuple[tuple[int, int], ...]) -> tuple[StageProgram, ...]:
    """Cut ``bg`` into one program per stage.

    Args:
        stage_blocks: per stage ``(start, end)`` block range, contiguous and
            covering ``0..bg.num_blocks``.

    Raises:
        ValueError: the ranges are not contiguous or do not cover the model.
    """
    expect = 0
    for s, (start, end) in enumerate(stage_blocks):
        if start != expect or end <= start:
            raise ValueError(f"stage {s} covers blocks [{start}, {end}); expected to start at {expect} and be non-empty")
        expect = end
    if expect != bg.num_blocks:
        raise ValueError(f"stages cover blocks [0, {expect}) but the model has {bg.num_blocks} blocks")
    return tuple(_build_stage(bg, s, len(stage_blocks), blk) for s, blk in enumerate(stage_blocks))


def _takes_device(n: fx.Node) -> bool:
    """Whether ``n`` must be told the stage's device: an aten overload with a
    keyword-only ``device`` argument that either names a device (the capture
    device, baked in) or has no tensor argument to follow (the factory ops:
    arange, empty, full, zeros, scalar_tensor, ...; with ``device=None`` they
    allocate on the CPU whatever ``torch.device`` mode is active)."""
    schema = getattr(n.target, "_schema", None)
    if n.op != "call_function" or schema is None:
        return False
    if not any(a.name == "device" and a.kwarg_only for a in schema.arguments):
        return False
    follows_a_tensor = any(isinstance(a.type, torch.TensorType) for a in schema.arguments)
    return n.kwargs.get("device") is not None or not follows_a_tensor


def _build_stage(bg: BlockGraph, s: int, num_stages: int, blocks: tuple[int, int]) -> StageProgram:
    gm = bg.captured.graph_module
    tied = bg.captured.tied
    nodes = {n.name: n for n in gm.graph.nodes}
    act = set(bg.stage_nodes(*blocks))
    recv = bg.cut_tensors[blocks[0]]
    send = bg.cut_tensors[blocks[1]]
    recv_names = {t.name for t in recv}

    # Everything the stage's act nodes read, through free nodes (transitively).
    needed: set[str] = set()
    stack = [a for name in act for a in nodes[name].all_input_nodes]
    out_node = next(iter(gm.graph.find_nodes(op="output")))
    is_last = s == num_stages - 1
    while stack:
        n = stack.pop()
        if n.name in needed or n.name in act or n.name in recv_names:
            continue
        kind = n.meta[META_KEY]["kind"]
        if kind == "act":
            raise AssertionError(f"stage {s} reads act node {n.name} that is neither local nor received")
        needed.add(n.name)
        stack.extend(n.all_input_nodes)

    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    input_names = tuple(n.name for n in gm.graph.find_nodes(op="placeholder") if n.name in needed)
    for name in input_names:
        env[name] = g.placeholder(name)
        env[name].meta = dict(nodes[name].meta)
    for t in recv:
        env[t.name] = g.placeholder(t.name)
        env[t.name].meta = dict(nodes[t.name].meta)
    # The device every factory op of the stage allocates on: read from its first
    # tensor input (model inputs and received tensors are on the rank's device).
    first_input = next((env[name] for name in (*input_names, *(t.name for t in recv))
                        if isinstance(nodes[name].meta.get("val"), torch.Tensor)), None)
    device: fx.Node | None = None
    params: dict[str, str] = {}
    consts: dict[str, str] = {}
    attr_meta: dict[str, tuple[tuple[int, ...], str]] = {}
    for n in gm.graph.nodes:
        if n.name in needed and n.op == "get_attr":
            canon = tied.get(n.target, n.target)
            flat = flat_name(canon)
            value = fetch_attr(gm, n.target)
            trainable = isinstance(value, torch.nn.Parameter) and value.requires_grad
            (params if trainable else consts)[flat] = canon
            attr_meta[flat] = (tuple(value.shape), str(value.dtype).removeprefix("torch."))
            env[n.name] = g.get_attr(flat)
        elif (n.name in needed and n.op not in ("placeholder", "get_attr")) or n.name in act:
            env[n.name] = g.node_copy(n, lambda a: env[a.name])
            if n.target is torch.ops.aten.view.default:
                # A view whose legality the capture's strides decided: export drops a
                # ``.contiguous()`` that was a no-op for the CPU kernel's output layout
                # (SDPA's), which another device's kernel may not share. ``reshape`` is the
                # same view where the strides allow it and a copy where they do not.
                env[n.name].target = torch.ops.aten.reshape.default
            if _takes_device(n):
                # Factory ops (aten.arange, aten.full, ...) allocate on the device of the
                # stage's first input, not on the capture device: a ``torch.device`` mode
                # does not reach ``torch.ops.aten.*`` overloads (device=None means the CPU).
                if device is None:
                    if first_input is None:
                        raise AssertionError(f"stage {s}: factory op {n.name} but no tensor input to take the device from")
                    with g.inserting_after(next(reversed(g.find_nodes(op="placeholder")))):
                        device = g.call_function(getattr, (first_input, "device"))
                env[n.name].kwargs = {**n.kwargs, "device": device}
    block_of = {env[name].name: b for b in range(*blocks) for name in bg.block_nodes(b) if name in env}
    if is_last:
        g.output(env[out_node.args[0].name])
    else:
        g.output(tuple(env[t.name] for t in send))
    g.lint()
    count = bg.captured.loss_count
    if is_last and count is not None:
        count = _stage_count_graph(count.graph, s, input_names, gm, tied, consts, attr_meta)
    else:
        count = None
    return StageProgram(
        index=s,
        num_stages=num_stages,
        blocks=blocks,
        graph=g,
        input_names=input_names,
        recv=recv,
        send=send,
        params=params,
        consts=consts,
        attr_meta=attr_meta,
        block_of=block_of,
        loss_count=count,
    )


def _stage_count_graph(count: fx.Graph, s: int, input_names: tuple[str, ...], gm: fx.GraphModule,
                       tied: dict[str, str], consts: dict[str, str], attr_meta: dict) -> fx.Graph:
    """The captured loss count (placeholders: every model input) as a graph of the last stage's
    model inputs ``input_names``, its constants read by flat name (added to ``consts`` /
    ``attr_meta`` where the forward does not read them), factory ops on the inputs' device."""
    g = fx.Graph()
    env: dict[str, fx.Node] = {name: g.placeholder(name) for name in input_names}
    device: fx.Node | None = None
    for n in count.nodes:
        if n.op == "placeholder":
            if n.name not in env and n.users:
                raise AssertionError(f"stage {s}: the loss count reads input {n.name}, which the stage does not")
        elif n.op == "output":
            g.output(env[n.args[0].name])
        elif n.op == "get_attr":
            canon = tied.get(n.target, n.target)
            flat = flat_name(canon)
            if flat not in consts:
                value = fetch_attr(gm, n.target)
                consts[flat] = canon
                attr_meta[flat] = (tuple(value.shape), str(value.dtype).removeprefix("torch."))
            env[n.name] = g.get_attr(flat)
        else:
            env[n.name] = g.node_copy(n, lambda a: env[a.name])
            if n.target is torch.ops.aten.view.default:  # (as in the forward: a view on other strides)
                env[n.name].target = torch.ops.aten.reshape.default
            if _takes_device(n):
                if device is None:
                    with g.inserting_after(next(reversed(g.find_nodes(op="placeholder")))):
                        device = g.call_function(getattr, (env[input_names[0]], "device"))
                env[n.name].kwargs = {**n.kwargs, "device": device}
    g.lint()
    return g


# -- source emission ---------------------------------------------------------


def _import_line(name: str, obj) -> str | None:
    """An import statement binding ``name`` to ``obj``, or None if builtin."""
    custom = fx.graph._custom_builtins.get(name)
    if custom is not None and custom.obj is obj:
        return custom.import_str
    if getattr(builtins, name, None) is obj:
        return None
    if inspect.ismodule(obj):
        return f"import {obj.__name__}" if obj.__name__ == name else f"import {obj.__name__} as {name}"
    module, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if module and qual and "." not in qual:
        try:
            if getattr(importlib.import_module(module), qual) is obj:
                return f"from {module} import {qual}" + ("" if qual == name else f" as {name}")
        except (ImportError, AttributeError):
            pass
    raise ValueError(f"codegen cannot emit an import for global {name!r} = {obj!r}")


def _custom_op_imports(graph: fx.Graph) -> set[str]:
    """An ``import`` of the Python module that registered each custom operator
    ``graph`` calls (``torch.library.custom_op``: ``torch.ops.transformers.grouped_mm_fallback``,
    the experts' grouped matmul of Hugging Face mixture-of-experts models), so
    that the stage source finds ``torch.ops.<namespace>.<op>`` in a fresh process."""
    from torch._library.custom_ops import OPDEFS

    out = set()
    for n in graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            opdef = OPDEFS.get(n.target._schema.name)
            module = getattr(getattr(opdef, "_init_fn", None), "__module__", None)
            if module and module != "__main__":
                out.add(f"import {module}  # registers torch.ops.{n.target._schema.name.replace('::', '.')}")
    return out


def emit_source(program: StageProgram, *, header: str = "", seq_len: int | None = None,
                model_inputs: tuple[str, ...] | None = None) -> str:
    """Readable, importable Python source of ``program`` (class ``Stage{i}``).
    ``seq_len`` / ``model_inputs``: the plan's tokens per sample and model
    inputs, declared as ``SEQ_LEN`` / ``MODEL_INPUTS`` for the load-time check
    ([Note: plan.json agrees with its stage files] in ``zorse_fx/stage_sources.py``)."""
    forward, block_graphs = _block_graphs(program)
    blocks = [(b, bg_.python_code(root_module="self")) for b, bg_ in block_graphs]
    count = program.loss_count.python_code(root_module="self") if program.loss_count is not None else None
    imports = {"import torch", *_custom_op_imports(program.graph)}
    bound: dict[str, object] = {}
    for name, obj in [*(kv for _, code in blocks for kv in code.globals.items()),
                      *(count.globals.items() if count else ())]:
        if bound.setdefault(name, obj) is not obj:
            raise AssertionError(f"codegen: global {name!r} names two objects in stage {program.index}'s source")
        line = _import_line(name, obj)
        if line:
            imports.add(line)
    if program.loss_count is not None:
        imports |= _custom_op_imports(program.loss_count)
    p = program
    lines = [
        f'"""Stage {p.index} of {p.num_stages}: blocks [{p.blocks[0]}, {p.blocks[1]}) of the captured model.',
        "",
        "Generated by zorse_fx codegen; executed as-is by the zorse_fx runtime.",
        f"Reads model inputs: {', '.join(p.input_names) or '-'}",
        "Receives (per sample): " + (", ".join(f"{t.name} {list(t.shape_per_sample)} {t.dtype}" for t in p.recv) or "-"),
        "Sends (per sample): " + (", ".join(f"{t.name} {list(t.shape_per_sample)} {t.dtype}" for t in p.send) or "- (returns the loss)"),
    ]
    if header:
        lines += ["", *header.splitlines()]
    lines += ['"""', "", *sorted(imports), "", "", f"class Stage{p.index}(torch.nn.Module):"]
    lines.append("    #: flat attribute -> name in the original model (state dict key)")
    lines.append("    PARAMETERS = {")
    lines += [f"        {k!r}: {v!r}," for k, v in p.params.items()]
    lines.append("    }")
    lines.append("    CONSTANTS = {")
    lines += [f"        {k!r}: {v!r}," for k, v in p.consts.items()]
    lines.append("    }")
    lines.append(f"    INPUTS = {list(p.input_names)!r}")
    lines.append(f"    RECV = {[t.to_dict() for t in p.recv]!r}")
    lines.append(f"    SEND = {[t.to_dict() for t in p.send]!r}")
    if seq_len is not None:
        lines.append("    #: what the shapes above were generated for (plan.json's seq_len and input_names must agree)")
        lines.append(f"    SEQ_LEN = {int(seq_len)!r}")
    if model_inputs is not None:
        lines.append(f"    MODEL_INPUTS = {list(model_inputs)!r}")
    if p.is_last:
        lines.append("    #: how the loss averages: 'sample_mean', or 'token_mean' over the tokens loss_count counts ([Note:")
        lines.append("    #: the loss contract] in zorse_fx/capture/trace.py); plan.json's loss_reduction must agree")
        lines.append(f"    LOSS_REDUCTION = {p.loss_reduction!r}")
    units = p.param_units()
    lines.append("    #: ZeRO-3 units ([Note: ZeRO-3 units] in zorse_fx/codegen/split.py): per block, the parameters it reads")
    lines.append("    #: first; a block calls zorse_gather(u) before unit u's first read, zorse_release(u) after its last.")
    lines.append("    #: the blocks of the captured model this stage runs, in order: forward calls block_<b> for each")
    lines.append(f"    BLOCKS = {[b for b, _ in blocks]!r}")
    lines.append("    UNITS = [")
    lines += [f"        {list(flats)!r}," for flats, _, _ in units]
    lines.append("    ]")
    lines += ["", "    def __init__(self):", "        super().__init__()"]
    for flat, (shape, dtype) in p.attr_meta.items():
        empty = f"torch.empty({shape!r}, dtype=torch.{dtype})"
        if flat in p.params:
            lines.append(f"        self.{flat} = torch.nn.Parameter({empty})")
        else:
            lines.append(f"        self.register_buffer({flat!r}, {empty})")
    lines += ["", "    def zorse_gather(self, unit):",
              '        """ZeRO-3: the runtime gathers unit `unit`\'s parameters here (a no-op otherwise)."""',
              "", "    def zorse_release(self, unit):",
              '        """ZeRO-3: the runtime frees unit `unit`\'s gathered parameters here (a no-op otherwise)."""']
    if count is not None:
        head, body_lines = count.src.strip("\n").split("\n", 1)
        if not head.startswith("def forward(") or not head.endswith(":"):
            raise AssertionError(f"codegen: unexpected loss count function head {head!r}")
        lines += ["", "    " + head.replace("def forward(", "def loss_count(", 1),
                  '        """The tokens the loss averages over in these samples (its divisor), a 0-dim tensor, a sum',
                  "        over the samples: the runtime weights this GPU's loss by its share of the global batch's",
                  '        count ([Note: token-mean losses] in zorse_fx/capture/loss_count.py)."""']
        lines += ["    " + ln if ln.strip() else "" for ln in body_lines.rstrip().splitlines()]
    lines += [""] + ["    " + ln if ln.strip() else "" for ln in forward.splitlines()]
    for b, block_code in blocks:
        head, body_lines = block_code.src.strip("\n").split("\n", 1)
        if not head.startswith("def forward(") or not head.endswith(":"):
            raise AssertionError(f"codegen: unexpected block function head {head!r}")
        body = _with_unit_hooks(body_lines.rstrip(), units)
        lines += ["", "    " + head.replace("def forward(", f"def block_{b}(", 1),
                  f'        """Block {b} of the captured model ([Note: block methods] in '
                  f'zorse_fx/codegen/split.py)."""']
        lines += ["    " + ln if ln.strip() else "" for ln in body.splitlines()]
    source = "\n".join(lines) + "\n"
    _check_unit_hooks(source, units, p.index)
    return source


def _block_graphs(program: StageProgram) -> tuple[str, list[tuple[int, fx.Graph]]]:
    """The stage's forward as calls of one graph per block ([Note: block methods]):
    (the forward's source, indented one level less than in the class, and
    ``[(b, graph of block b)]`` in order; each block graph's placeholders are the
    values it reads from outside it, its output the tuple of the values it makes
    that are read outside it)."""
    g = program.graph
    nodes = [n for n in g.nodes if n.op not in ("placeholder", "get_attr", "output")]
    last = max(program.block_of.values(), default=program.blocks[0])
    seg: dict[fx.Node, int] = {}
    nxt = last
    for n in reversed(nodes):
        nxt = program.block_of.get(n.name, nxt)
        seg[n] = nxt
    prev = program.blocks[0]
    for n in nodes:  # never back to an earlier block: graph order is kept
        prev = seg[n] = max(seg[n], prev)
    members: dict[int, list[fx.Node]] = {}  # per block, its nodes in graph order
    for n in nodes:
        members.setdefault(seg[n], []).append(n)
    order = list(members)
    out_node = next(iter(g.find_nodes(op="output")))
    outputs: dict[int, list[fx.Node]] = {b: [] for b in order}
    for n in nodes:
        if any(u is out_node or (u in seg and seg[u] != seg[n]) for u in n.users):
            outputs[seg[n]].append(n)
    graphs = []
    calls = []
    # The values each call reads for the last time are dropped after it, as fx's own code does ("x = None"):
    # otherwise the forward would keep every block's output alive until it returns.
    last_read: dict[str, int] = {}
    for k, b in enumerate(order):
        for n in members[b]:
            for a in n.all_input_nodes:
                if a.op != "get_attr" and (a.op == "placeholder" or seg[a] != b):
                    last_read[a.name] = k
    ret = out_node.args[0]
    returned = {a.name for a in (ret if isinstance(ret, (tuple, list)) else (ret,)) if isinstance(a, fx.Node)}
    for k, b in enumerate(order):
        bg_ = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        inputs: list[fx.Node] = []

        inside = set(members[b])
        for n in members[b]:  # the placeholders first, in first-read order
            for a in n.all_input_nodes:
                if a not in inside and a.op != "get_attr" and a not in env:
                    inputs.append(a)
                    env[a] = bg_.placeholder(a.name)
                    env[a].meta = a.meta
        for n in members[b]:
            for a in n.all_input_nodes:
                if a.op == "get_attr" and a not in env:  # bound just before its first reader in the block
                    env[a] = bg_.get_attr(a.target)
                    env[a].meta = a.meta
            env[n] = bg_.node_copy(n, lambda a: env[a])
        bg_.output(tuple(env[n] for n in outputs[b]))
        bg_.lint()
        graphs.append((b, bg_))
        outs = [n.name for n in outputs[b]]
        call = (f"    {', '.join(outs)}{',' if len(outs) == 1 else ''} = "
                f"self.block_{b}({', '.join(a.name for a in inputs)})" if outs
                else f"    self.block_{b}({', '.join(a.name for a in inputs)})")
        dropped = [a.name for a in inputs if last_read.get(a.name) == k and a.name not in returned]
        calls.append(call + (f";  {' = '.join(dropped)} = None" if dropped else ""))
    ret_src = (f"({', '.join(a.name for a in ret)}{',' if len(ret) == 1 else ''})" if isinstance(ret, (tuple, list))
               else ret.name)
    params = [n.name for n in g.find_nodes(op="placeholder")]
    forward = "\n".join([f"def forward(self, {', '.join(params)}):" if params else "def forward(self):",
                         *calls, f"    return {ret_src}"])
    return forward, graphs


def _with_unit_hooks(body: str, units) -> str:
    """``body`` (one block method's source, [Note: block methods]) with
    ``self.zorse_gather(u)`` before the line of unit ``u``'s first reader and
    ``self.zorse_release(u)`` after the line of its last, where those lines are
    in this block (a tied weight's unit may be gathered in one block and
    released in a later one; see ``StageProgram.param_units``)."""
    lines = body.splitlines()
    line_of = {}
    for k, ln in enumerate(lines):
        m = re.match(r"^\s+([A-Za-z_]\w*) = ", ln)
        if m:
            line_of.setdefault(m.group(1), k)
    before: dict[int, list[str]] = {}
    after: dict[int, list[str]] = {}
    for u, (_, first, last) in enumerate(units):
        if first in line_of:
            before.setdefault(line_of[first], []).append(f"    self.zorse_gather({u})")
        if last in line_of:
            after.setdefault(line_of[last], []).append(f"    self.zorse_release({u})")
    out = []
    for k, ln in enumerate(lines):
        out += before.get(k, [])
        out.append(ln)
        out += after.get(k, [])
    return "\n".join(out)


def _check_unit_hooks(source: str, units, index: int) -> None:
    """Every ZeRO-3 unit of stage ``index`` gathered once and released once in ``source``."""
    for u in range(len(units)):
        for hook in ("gather", "release"):
            if source.count(f"self.zorse_{hook}({u})\n") != 1:
                raise AssertionError(f"codegen: stage {index}'s ZeRO-3 unit {u} has no single zorse_{hook} line")


def load_stage_class(path: str | Path, index: int) -> type[torch.nn.Module]:
    """Import ``Stage{index}`` from a generated file (no package needed).
    For a stage of a loaded plan use ``load_stage_source(plan.sources[i], ...)``:
    it runs the text whose sha256 the plan checked, not the file as it is now."""
    path = Path(path)
    return load_stage_source(path.read_text(), path, index)


def load_stage_source(source: str, filename: str | Path, index: int) -> type[torch.nn.Module]:
    """Execute a generated stage source (``source``, the text itself; ``filename``
    names it in tracebacks) as a fresh module and return its ``Stage{index}``.

    Raises:
        RuntimeError: the source defines no class ``Stage{index}``.
    """
    mod_name = f"zorse_stage_{hashlib.sha256(source.encode()).hexdigest()[:16]}_{index}"
    module = types.ModuleType(mod_name)
    module.__file__ = str(filename)
    sys.modules[mod_name] = module
    exec(compile(source, str(filename), "exec"), module.__dict__)  # noqa: S102 - the plan checked its sha256
    cls = getattr(module, f"Stage{index}", None)
    if cls is None:
        raise RuntimeError(f"{filename}: defines no class Stage{index}; re-export the plan with `zorse plan`")
    return cls
