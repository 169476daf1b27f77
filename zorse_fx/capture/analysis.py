"""Analyse a captured graph into the *block graph* the planner works on.

Every node of the captured graph falls in one class
(``node.meta["zorse"]["kind"]``):

- ``input``: a model input (placeholder). Every rank loads the global batch
  itself, so inputs are available in every stage (labels never travel).
- ``param``: a ``get_attr`` of a trainable parameter. Owned by the stages that
  read it (a tied embedding is owned by the first and the last stage).
- ``const``: a ``get_attr`` of a buffer or constant tensor.
- ``free``: a computation that reads no trainable parameter, only inputs,
  constants and shapes (position ids, rotary cos/sin, masks, shifted labels).
- ``act``: everything that depends on a trainable parameter: the activations.

[Note: rematerialise free values per stage]
Only ``act`` nodes are assigned to stages. A ``free`` node is copied into every
stage that needs it and recomputed there, because sending rotary tables or
masks between stages would cost link bandwidth for values that are cheap to
recompute from the inputs every stage already has.

[Note: legal cut points]
A cut between act node ``i-1`` and ``i`` sends every act value defined before
the cut and used after it. A cut is *legal* if every crossing value is a tensor
with the batch in dim 0 (so it can be re-partitioned by sample range, see
``runtime``); its price is the bytes per sample that cross (``cut_tensors``,
summed into ``BlockCosts.cut_bytes_per_sample`` by ``cost.roofline``), which the
planner charges on the link between the two stages. Candidate cuts are the
local minima of that bytes profile over the legal cuts: a run of equal-bytes
cuts (a chain of elementwise ops; its last cut stands for it) whose neighbours
carry more, and from which reaching a cheaper cut on either side means crossing
one at least ``_PROMINENCE`` (2) times as dear. So the residual stream between
every pair of transformer sub-layers is a candidate even where the model has a
narrower bottleneck elsewhere (OPT-350M's 512-wide ``project_in``/``project_out``
around its 1024-wide decoder: keeping only the globally cheapest cuts leaves
all 24 decoder layers in one block), while a dip inside
attention is not. When there are more than ``max_blocks - 1``, the cheapest and
then structurally coarsest (layer boundaries, by ``nn_module_stack``, before cuts
inside a layer) are kept. The segments between kept cuts are the *blocks*.

Legend: ``K`` = act nodes, ``B`` = blocks.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from ..errors import ModelCaptureError
from ..ir.tensor import TensorSpec
from .trace import META_KEY, CapturedModel, fetch_attr

__all__ = ["TensorSpec", "BlockGraph", "analyse", "low_precision_params", "AUTOCAST_LOWER_OPS"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockGraph:
    """The captured graph cut into blocks at legal cut points."""

    captured: CapturedModel
    #: Act node names in execution order, ``(K,)``.
    act_order: tuple[str, ...]
    #: Per block ``(start, end)`` into ``act_order``, ``(B,)``.
    blocks: tuple[tuple[int, int], ...]
    #: Per cut position ``c`` in ``0..B`` (before block ``c``): crossing tensors.
    cut_tensors: tuple[tuple[TensorSpec, ...], ...]
    #: Per block: canonical names of the parameters/constants its nodes read.
    block_attrs: tuple[tuple[str, ...], ...]
    #: Per act node name: output tensor spec (per sample), where batch-major.
    specs: dict[str, TensorSpec]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def graph(self) -> fx.Graph:
        return self.captured.graph_module.graph

    def block_nodes(self, b: int) -> tuple[str, ...]:
        start, end = self.blocks[b]
        return self.act_order[start:end]

    def stage_nodes(self, start_block: int, end_block: int) -> tuple[str, ...]:
        return self.act_order[self.blocks[start_block][0] : self.blocks[end_block - 1][1]]

    def with_dtypes(self, dtypes: dict[str, str]) -> "BlockGraph":
        """This block graph with the tensor specs of act nodes (and so the
        tensors crossing each cut) in ``dtypes`` (act node name -> dtype name,
        e.g. the dtypes a precision policy's autocast gives them:
        ``cost.roofline.SavedActivations.output_dtypes``); names missing from
        ``dtypes`` keep their capture dtype. ``self`` when nothing changes."""
        changed = {name: dataclasses.replace(spec, dtype=dtypes[name]) for name, spec in self.specs.items()
                   if dtypes.get(name, spec.dtype) != spec.dtype}
        if not changed:
            return self
        return dataclasses.replace(
            self, specs={**self.specs, **changed},
            cut_tensors=tuple(tuple(changed.get(t.name, t) for t in ts) for ts in self.cut_tensors))

    def describe_blocks(self, start: int, end: int) -> str:
        """Short label of blocks [start, end): modules in order, numbered layers
        as ``L0–L7`` (``layers.3.mlp`` -> ``L3``), e.g. ``embed_tokens, L0–L7``."""
        trainable = self.captured.trainable()
        parts: list[str] = []
        for b in range(start, end):
            for attr in self.block_attrs[b]:
                if attr not in trainable:
                    continue
                path = attr.rsplit(".", 1)[0].split(".")
                while path and path[0] == "model":
                    path = path[1:]
                idx = next((i for i, p in enumerate(path) if p.isdigit()), None)
                name = f"L{path[idx]}" if idx is not None else (path[-1] if path else attr)
                if not parts or parts[-1] != name:
                    parts.append(name)
        out: list[str] = []
        i = 0
        while i < len(parts):  # merge runs of consecutive layers L3, L4, L5 -> L3–L5
            j = i
            while (j + 1 < len(parts) and parts[j].startswith("L") and parts[j + 1].startswith("L")
                   and parts[j][1:].isdigit() and parts[j + 1][1:].isdigit()
                   and int(parts[j + 1][1:]) == int(parts[j][1:]) + 1):
                j += 1
            out.append(parts[i] if j == i else f"{parts[i]}–{parts[j]}")
            i = j + 1
        return ", ".join(dict.fromkeys(out)) or f"blocks {start}-{end - 1}"


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.values: dict[str, object] = {}

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        self.values[n.name] = out
        return out


def _propagate(gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...], batch: int) -> dict[str, object]:
    """Run the graph on fake tensors with batch ``batch``; return every node's value."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake = tuple(mode.from_tensor(t[:1].expand(batch, *t.shape[1:]).contiguous()) for t in inputs)
        rec = _Recorder(gm)
        rec.run(*fake)
    return rec.values


def _classify(gm: fx.GraphModule) -> dict[str, str]:
    kind: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            kind[node.name] = "input"
        elif node.op == "get_attr":
            value = fetch_attr(gm, node.target)
            trainable = isinstance(value, torch.nn.Parameter) and value.requires_grad
            kind[node.name] = "param" if trainable else "const"
        elif node.op == "output":
            kind[node.name] = "output"
        else:
            # A shape query of an input is free; of an activation it stays
            # with the activation (its value would otherwise have to travel).
            deps = [kind[a.name] for a in node.all_input_nodes]
            if any(k in ("param", "act") for k in deps):
                kind[node.name] = "act"
            else:
                kind[node.name] = "free"
        node.meta.setdefault(META_KEY, {})["kind"] = kind[node.name]
    return kind


def _spec(name: str, v1, v2) -> TensorSpec | None:
    """Per-sample spec if the value is a tensor with batch in dim 0, else None."""
    if not isinstance(v1, torch.Tensor) or not isinstance(v2, torch.Tensor):
        return None
    if v1.dim() == 0 or v1.shape[0] != 1 or v2.shape[0] != 2 or tuple(v1.shape[1:]) != tuple(v2.shape[1:]):
        return None
    return TensorSpec(name=name, shape_per_sample=tuple(int(d) for d in v1.shape[1:]), dtype=str(v1.dtype).removeprefix("torch."))


def _batch_values(captured: CapturedModel) -> tuple[dict[str, object], dict[str, TensorSpec | None]]:
    """Every node's value at batch 1, and its per-sample spec (``_spec``), from two fake runs (batch 1 and
    2: a dim that changes between them is the batch dim, which must be dim 0); or from the record of
    those runs a capture with a cache key keeps ([Note: the analysis cached] in ``capture/cache.py``)."""
    from . import cache

    gm = captured.graph_module
    names = [n.name for n in gm.graph.nodes]
    key = cache.record_key(captured, "analysis")
    rec = cache.load_record("analysis", key)
    if rec is not None:
        try:
            if rec["nodes"] != names:
                raise ValueError("its nodes are not the graph's")
            v1 = {name: _decode_value(v) for name, v in zip(names, rec["val_batch1"], strict=True)}
            specs = {name: None if s is None else TensorSpec(name=name, shape_per_sample=tuple(s[0]), dtype=s[1])
                     for name, s in zip(names, rec["specs"], strict=True)}
            return v1, specs
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
            log.info("analysis record %s not used: %s: %s", key, type(exc).__name__, exc)
    v1 = _propagate(gm, captured.example_inputs, 1)
    v2 = _propagate(gm, captured.example_inputs, 2)
    specs = {name: _spec(name, v1.get(name), v2.get(name)) for name in names}
    if key is not None:
        cache.save_record("analysis", key, {
            "nodes": names, "val_batch1": [_encode_value(v1.get(name)) for name in names],
            "specs": [None if (s := specs[name]) is None else [list(s.shape_per_sample), s.dtype] for name in names]})
    return {name: v1.get(name) for name in names}, specs


def _encode_value(v):
    """A node's fake value as plain JSON: a tensor as its shape, stride and dtype; tuples and lists as
    such; numbers, strings and None as they are; anything else by its type's name (the cost model
    reads tensors only)."""
    if isinstance(v, torch.Tensor):
        return {"t": [[int(d) for d in v.shape], [int(d) for d in v.stride()], str(v.dtype).removeprefix("torch.")]}
    if isinstance(v, tuple):
        return {"u": [_encode_value(x) for x in v]}
    if isinstance(v, list):
        return [_encode_value(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return {"o": type(v).__name__}


def _decode_value(v):
    """``_encode_value``'s answer back: tensors as meta tensors of that shape, stride and dtype."""
    if isinstance(v, dict):
        if "t" in v:
            shape, stride, dtype = v["t"]
            dt = getattr(torch, dtype)
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"not a dtype: {dtype!r}")
            return torch.empty_strided(shape, stride, dtype=dt, device="meta")
        if "u" in v:
            return tuple(_decode_value(x) for x in v["u"])
        return _Opaque(v["o"])
    if isinstance(v, list):
        return [_decode_value(x) for x in v]
    return v


@dataclass(frozen=True, slots=True)
class _Opaque:
    """A recorded value that is neither a tensor, a number, a string nor a sequence (its type's name)."""

    type_name: str


def analyse(captured: CapturedModel, *, max_blocks: int = 64, _minimal_cuts_only: bool = False) -> BlockGraph:
    """Cut ``captured`` into blocks at its candidate cut points ([Note: legal cut points]).

    Args:
        captured: from :func:`zorse_fx.capture.capture`.
        max_blocks: upper bound on blocks; when more candidate cuts exist,
            the cheapest and structurally coarsest are kept, a class that
            does not fit thinned to every k-th (coarser blocks, faster planning).
        _minimal_cuts_only: private, for tests only: the minimal-cuts rule
            (only the cuts of globally minimal bytes; every k-th when too many).

    Raises:
        ModelCaptureError: the graph has no trainable parameter, or no legal
            cut (then it can only run as one stage, which is still allowed).
    """
    gm = captured.graph_module
    kind = _classify(gm)
    v1, node_specs = _batch_values(captured)
    for node in gm.graph.nodes:
        node.meta[META_KEY]["val_batch1"] = v1.get(node.name)

    act_order = tuple(n.name for n in gm.graph.nodes if kind[n.name] == "act")
    if not act_order:
        raise ModelCaptureError("the captured graph reads no trainable parameter; nothing to train")
    pos = {name: i for i, name in enumerate(act_order)}
    specs = {name: s for name in act_order if (s := node_specs.get(name)) is not None}

    # Last act position that reads each act value (K means: the output reads it).
    nodes = {n.name: n for n in gm.graph.nodes}
    last_use = {}
    for name in act_order:
        uses = []
        for user in nodes[name].users:
            if user.op == "output":
                uses.append(len(act_order))
            elif kind[user.name] == "act":
                uses.append(pos[user.name])
            else:  # a free node cannot read an act value by definition
                raise AssertionError(f"free node {user.name} reads act node {name}")
        last_use[name] = max(uses) if uses else pos[name]

    # Sweep cut positions 1..K-1: crossing = defined before p and used at/after p.
    crossing_at: list[tuple[str, ...]] = [()]
    live: set[str] = set()
    for p in range(1, len(act_order)):
        prev = act_order[p - 1]
        if last_use[prev] >= p:
            live.add(prev)
        live = {n for n in live if last_use[n] >= p}
        crossing_at.append(tuple(sorted(live, key=pos.__getitem__)))

    def cut_bytes(p: int) -> int | None:
        total = 0
        for name in crossing_at[p]:
            if name not in specs:
                return None  # crossing value is not batch-major: illegal cut
            total += specs[name].bytes_per_sample
        return total

    cut_b: list[int | None] = [None] + [cut_bytes(p) for p in range(1, len(act_order))]
    if _minimal_cuts_only:  # the minimal-cuts rule, for the test that the prominence rule plans no worse
        legal = {p: b for p, b in enumerate(cut_b) if b}
        best = min(legal.values(), default=0)
        cands = sorted(p for p, b in legal.items() if b <= best)
        kept = [p for i, p in enumerate(cands) if i + 1 == len(cands) or cands[i + 1] != p + 1]
        if len(kept) + 1 > max_blocks:
            step = -(-len(kept) // max(max_blocks - 1, 1))
            kept = kept[step - 1 :: step] if max_blocks > 1 else []
    else:
        cands = _candidate_cuts(cut_b)
        depth = {p: _common_depth(nodes[act_order[p - 1]], nodes[act_order[p]]) for p in cands}
        kept = _thin_cuts(cands, cut_b, depth, max_blocks - 1)
    bounds = [0, *kept, len(act_order)]
    blocks = tuple((bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1))
    cut_tensors = tuple(
        () if c in (0, len(blocks)) else tuple(specs[n] for n in crossing_at[bounds[c]])
        for c in range(len(blocks) + 1)
    )

    block_attrs = []
    for start, end in blocks:
        seen: dict[str, None] = {}
        for name in act_order[start:end]:
            for arg in _attr_deps(nodes[name], kind):
                seen.setdefault(captured.tied.get(arg.target, arg.target), None)
        block_attrs.append(tuple(seen))
    return BlockGraph(
        captured=captured,
        act_order=act_order,
        blocks=blocks,
        cut_tensors=cut_tensors,
        block_attrs=tuple(block_attrs),
        specs=specs,
    )


def _attr_deps(node: fx.Node, kind: dict[str, str]):
    """get_attr nodes read by ``node`` directly or through its free inputs."""
    stack, seen = list(node.all_input_nodes), set()
    while stack:
        n = stack.pop()
        if n.name in seen:
            continue
        seen.add(n.name)
        if n.op == "get_attr":
            yield n
        elif kind[n.name] == "free":
            stack.extend(n.all_input_nodes)


#: A local minimum of the cut-bytes profile is a candidate cut when reaching a cheaper cut
#: from it, on either side, means crossing a legal cut at least this many times its bytes
#: ([Note: legal cut points]). 2: a residual-stream cut (R) is kept, whose neighbours inside a
#: sub-layer carry the residual plus at least one more R-sized value; a dip inside attention
#: (e.g. q, k, v live = 4R between 5R) is not.
_PROMINENCE = 2.0


def _candidate_cuts(cut_b: list[int | None]) -> list[int]:
    """Candidate cut positions, ascending, from the bytes per sample of each cut position.

    Args:
        cut_b: ``(K,)``; ``cut_b[p]`` = bytes per sample crossing a cut before act node
            ``p`` (``None``: illegal, some crossing value is not batch-major; index 0 unused).
            A cut that carries nothing (0 bytes) is not offered either.

    Illegal positions are skipped (a flattened ``(N*T, C)`` matmul input inside a layer is
    neither a cut nor a wall). A maximal run of adjacent legal positions with equal bytes
    ``b`` (a plateau; its last position stands for it) is a candidate when the nearest legal
    positions on both sides carry at least ``b`` (none: the graph's end), and, on each side,
    reaching a strictly cheaper cut crosses one of at least ``_PROMINENCE * b`` (a side
    without a cheaper cut counts as infinitely dear, so the globally cheapest cuts are
    always candidates).
    """
    legal = [p for p, b in enumerate(cut_b) if p > 0 and b]
    costs = [cut_b[p] for p in legal]
    out = []
    i = 0
    while i < len(legal):
        j = i
        while j + 1 < len(legal) and legal[j + 1] == legal[j] + 1 and costs[j + 1] == costs[i]:
            j += 1
        b = costs[i]
        if (i == 0 or costs[i - 1] >= b) and (j + 1 == len(costs) or costs[j + 1] >= b) \
                and min(_col(costs, i - 1, -1, b), _col(costs, j + 1, +1, b)) >= _PROMINENCE * b:
            out.append(legal[j])
        i = j + 1
    return out


def _col(costs: list[int], start: int, step: int, b: int) -> float:
    """Dearest of ``costs`` (bytes of the legal cuts in order) walking from index ``start`` by
    ``step`` before the first one cheaper than ``b``; ``inf`` where none is cheaper."""
    dearest = 0
    q = start
    while 0 <= q < len(costs):
        if costs[q] < b:
            return dearest
        dearest = max(dearest, costs[q])
        q += step
    return float("inf")


def _module_path(node: fx.Node) -> tuple[str, ...]:
    """Qualified names of the modules ``node`` ran in, outermost first (fx/export
    ``nn_module_stack``; empty where the capture recorded none)."""
    stack = node.meta.get("nn_module_stack") or {}
    return tuple(v[0] if isinstance(v, tuple) else str(v) for v in stack.values())


def _common_depth(a: fx.Node, b: fx.Node) -> int:
    """Number of enclosing modules two consecutive act nodes share: a cut between two
    decoder layers shares fewer (the model, the decoder) than a cut inside one."""
    n = 0
    for x, y in zip(_module_path(a), _module_path(b)):
        if x != y:
            break
        n += 1
    return n


def _thin_cuts(cands: list[int], cut_b: list[int | None], depth: dict[int, int], most: int) -> list[int]:
    """At most ``most`` of the candidate cuts ``cands``, ascending.

    Candidates are taken in classes of equal (bytes per sample, module depth), cheapest
    and then structurally coarsest (fewest shared enclosing modules: layer boundaries
    before cuts inside a layer) first; the first class that does not fit whole is thinned
    to every k-th of its members (k as small as fits) and the rest are dropped.
    """
    if len(cands) <= most:
        return list(cands)
    if most <= 0:
        return []
    classes: dict[tuple[int, int], list[int]] = {}
    for p in cands:
        classes.setdefault((cut_b[p], depth[p]), []).append(p)
    kept: list[int] = []
    for key in sorted(classes):
        members = classes[key]
        room = most - len(kept)
        if len(members) <= room:
            kept += members
            continue
        if room > 0:
            step = -(-len(members) // room)
            kept += members[step - 1 :: step]
        break
    return sorted(kept)


#: Ops that ``torch.autocast`` runs in the 16-bit compute dtype on CUDA and on
#: CPU alike, casting every floating input to it (PyTorch's autocast op lists,
#: "CUDA Ops that can autocast to float16" and "CPU Ops that can autocast to
#: bfloat16", docs/source/amp.rst), by op name.
AUTOCAST_LOWER_OPS = frozenset({
    "linear", "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "conv1d", "conv2d", "conv3d", "convolution",
    "_convolution", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})
#: Views that move values without changing them, whose backward moves the
#: gradient back without arithmetic (no sum: ``expand`` is not one).
_EXACT_VIEWS = frozenset({"t", "transpose", "permute", "view", "reshape", "_unsafe_view", "unsqueeze", "squeeze",
                          "alias", "detach"})


def _op_name(node: fx.Node) -> str | None:
    """``aten.linear.default`` / ``F.linear`` / ``operator.matmul`` / ``x.t()`` -> "linear" / "matmul" / "t"."""
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return None
    packet = getattr(node.target, "_overloadpacket", None)
    return getattr(packet if packet is not None else node.target, "__name__", None)


def low_precision_params(bg: BlockGraph) -> frozenset[str]:
    """Canonical names of the trainable parameters that can live in the 16-bit
    compute dtype on the GPU without changing a single value of the forward
    or of their gradients under the policy's autocast (16-bit working
    weights, [Note: 16-bit working weights] in ``zorse_fx/precision.py``):
    those read by one block only (not a tied embedding) whose every use
    reaches an autocast-lowered op (``AUTOCAST_LOWER_OPS``: linear, matmul,
    convolution) through exact views only. Autocast casts such a weight to
    the compute dtype before each use anyway, and the gradient it produces
    is that dtype's, cast to float32; a 16-bit weight skips the cast and its
    gradient is cast to float32 when it is added to the float32 main
    gradient, the same values in the same order. Embeddings (a lookup, not
    cast by autocast), norms and biases of non-matmul ops stay float32."""
    trainable = bg.captured.trainable()
    tied = bg.captured.tied
    readers: dict[str, int] = {}
    for attrs in bg.block_attrs:
        for a in attrs:
            if a in trainable:
                readers[a] = readers.get(a, 0) + 1
    ok: dict[str, bool] = {}
    for node in bg.graph.nodes:
        if node.op != "get_attr":
            continue
        canon = tied.get(node.target, node.target)
        if canon not in trainable:
            continue
        good = ok.get(canon, True)
        stack = list(node.users)
        while good and stack:
            user = stack.pop()
            name = _op_name(user)
            if name in _EXACT_VIEWS:
                stack.extend(user.users)
            elif name not in AUTOCAST_LOWER_OPS:
                good = False
        ok[canon] = good
    return frozenset(c for c, good in ok.items() if good and readers.get(c, 0) == 1)
