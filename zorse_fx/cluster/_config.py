"""Validation of a cluster description (YAML text or dict) into ``Cluster`` fields,
and the inverse (``Cluster`` -> dict). The format is documented in
``zorse_fx.cluster.cluster``; every error names source, field path, value, fix.
"""

from __future__ import annotations

import difflib
import math
import re
from typing import Any, Callable

import yaml

from zorse_fx.cluster.cluster import GPU, Cluster, Link, LinkOverride, SharedLinkSide, SharedLinkSpec
from zorse_fx.cluster.specs import (
    GPU_TYPES_HELP,
    GPUSpec,
    known_archs,
    lookup_builtin,
    normalize_gpu_name,
    unknown_gpu_message,
)
from zorse_fx.errors import ClusterConfigError, short_repr
from zorse_fx.file_schema import MAX_NESTING_DEPTH

__all__ = ["load_yaml", "parse", "unparse"]

_GiB = 2**30
_MISSING = object()

# Unit keys -> conversion to SI (bytes/s, seconds). Preferred spelling first (used by unparse).
_BANDWIDTH_KEYS: dict[str, Callable[[float], float]] = {
    "bandwidth_GBps": lambda v: v * 1e9,
    "bandwidth_Gbps": lambda v: v * 1e9 / 8,
    "bandwidth_bytes_per_s": float,
}
_LATENCY_KEYS: dict[str, Callable[[float], float]] = {
    "latency_us": lambda v: v / 1e6,
    "latency_ms": lambda v: v / 1e3,
    "latency_s": float,
}
_LINK_KEYS = (*_BANDWIDTH_KEYS, *_LATENCY_KEYS)
# gpu_types entry keys -> conversion to GPUSpec units.
_GPU_TYPE_NUMBERS: dict[str, Callable[[float], float]] = {
    "memory_GiB": lambda v: v * _GiB,
    "mem_bw_GBps": lambda v: v * 1e9,
    "fp32_tflops": lambda v: v * 1e12,
    "fp16_tensor_tflops": lambda v: v * 1e12,
}
_GPU_TYPE_KEYS = (*_GPU_TYPE_NUMBERS, "bf16_supported", "source")
#: Optional keys of a declared GPU type: its architecture class (priced by that
#: class's model, ``cost/gpu_model.py``, instead of the plain roofline), board
#: power (the class model's power cap) and dense TF32 tensor peak.
_GPU_TYPE_OPTIONAL = ("arch", "tdp_w", "tf32_tensor_tflops")
_LINK_EXAMPLE = "e.g. {bandwidth_GBps: 12.5, latency_us: 10}"
_MAX_GPUS_PER_GROUP = 4096  # far above any real node; stops a typo (count: 8000000) from hanging
#: Most YAML nodes a document may hold once its aliases are expanded: far above any cluster
#: file (1000 nodes of 10 values each are 1e4), far below a billion-laughs alias bomb (9^9).
MAX_EXPANDED_NODES = 100_000


class _AliasError(yaml.composer.ComposerError):
    """The document's aliases expand it too far (or make it recursive)."""


class _DepthError(yaml.composer.ComposerError):
    """The document nests values more than ``MAX_NESTING_DEPTH`` levels deep."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that rejects a key given twice in one mapping (a silent
    overwrite under plain ``yaml.safe_load``)."""

    def construct_mapping(self, node, deep=False):  # type: ignore[override]
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor` merges are allowed to be overridden
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:
                continue  # an unhashable key: SafeLoader reports it itself
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (the first value would be silently dropped)",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def compose_node(self, parent, index):  # type: ignore[override]
        """A node, refused (``_DepthError``) where values nest more than
        ``MAX_NESTING_DEPTH`` levels deep, in the text or through aliases
        ([Note: nesting depth] in ``file_schema.py``): PyYAML composes
        recursively, so a deeper document would end in a RecursionError. The
        text's depth is counted on the way down; each collection's height
        (aliases expanded: an alias is its anchor's node, composed before)
        from its children's on the way up, so no walk recurses deeper."""
        heights = self.__dict__.setdefault("_heights", {})  # id(node) -> collections nested in it, itself included
        outer = self.__dict__.get("_depth", 0)
        depth = outer + self.check_event(yaml.SequenceStartEvent, yaml.MappingStartEvent)
        if depth > MAX_NESTING_DEPTH:
            raise _DepthError(None, None, _too_deep(), self.peek_event().start_mark)
        self._depth = depth
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth = outer
        if id(node) not in heights:
            children = (node.value if isinstance(node, yaml.SequenceNode) else
                        [n for kv in node.value for n in kv] if isinstance(node, yaml.MappingNode) else None)
            heights[id(node)] = 0 if children is None else 1 + max((heights[id(c)] for c in children), default=0)
            if heights[id(node)] > MAX_NESTING_DEPTH:
                raise _DepthError(None, None, _too_deep(" once its aliases (*name) are expanded"), node.start_mark)
        return node

    def compose_document(self):  # type: ignore[override]
        """The document's node graph, refused if its aliases expand it past
        ``MAX_EXPANDED_NODES`` nodes or make it recursive: PyYAML shares an
        aliased node (the graph stays small), but a validator or a message
        walking the values would expand it (billion laughs)."""
        root = super().compose_document()
        sizes: dict[int, int] = {}  # id(node) -> expanded size; -1 while being counted

        def size(node: yaml.Node) -> int:
            known = sizes.get(id(node))
            if known == -1:
                raise _AliasError(None, None, "an alias refers to a node that contains it "
                                                  "(a recursive value); write the value out", node.start_mark)
            if known is not None:
                return known
            sizes[id(node)] = -1
            total = 1
            if isinstance(node, yaml.SequenceNode):
                total += sum(size(child) for child in node.value)
            elif isinstance(node, yaml.MappingNode):
                total += sum(size(k) + size(v) for k, v in node.value)
            if total > MAX_EXPANDED_NODES:
                raise _AliasError(
                    None, None, f"the aliases (*name) expand this value to more than {MAX_EXPANDED_NODES:,} "
                    f"values (a YAML alias bomb?); a cluster file is far smaller: write the values out",
                    node.start_mark)
            sizes[id(node)] = total
            return total

        if root is not None:
            size(root)
        return root


# [Note: YAML numbers with an exponent]
# PyYAML implements YAML 1.1, whose float needs a dot and a signed exponent:
# `1e9`, `1E9`, `2e-3` and `1.5e3` are read as *strings* there, and a cluster
# file's `host_memory_GiB: 1e9` would be refused as "not a positive number".
# YAML 1.2 (and every JSON reader) reads them as numbers, which is what the
# file's author meant, so the loader resolves plain (unquoted) scalars of that
# form as floats: every numeric field of the cluster file accepts them. A
# quoted number stays a string, and ``_Ctx.number`` says so.
_Y12_FLOAT = r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$"
_UniqueKeyLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(_Y12_FLOAT), list("-+0123456789."))


def _too_deep(how: str = "") -> str:
    return (f"values nested more than {MAX_NESTING_DEPTH} levels deep (lists or mappings inside each "
            f"other){how}; a cluster file is a few levels deep")


def load_yaml(text: str, source: str) -> Any:
    """Parse YAML text safely (plain data only); syntax errors name file and line."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "unknown line"
        problem = getattr(exc, "problem", None) or str(exc)
        what = ("refused YAML aliases" if isinstance(exc, _AliasError) else "refused YAML nesting"
                if isinstance(exc, _DepthError) else "YAML syntax error")
        raise ClusterConfigError(f"{source}: {what} at {where}: {problem}; fix the YAML there") from None


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class _Ctx:
    """Error factory bound to one source (file path or ``<dict>``)."""

    def __init__(self, source: str) -> None:
        self.source = source

    def error(self, path: str, problem: str, value: Any = _MISSING, fix: str = "") -> ClusterConfigError:
        # short_repr: a value quoted in a message is cut to a readable length without building its
        # whole repr (a YAML alias bomb is small in memory but billions of elements long).
        got = "" if value is _MISSING else f" (got {short_repr(value)})"
        return ClusterConfigError(f"{self.source}: {path}: {problem}{got}" + (f"; {fix}" if fix else ""))

    def mapping(self, path: str, value: Any, allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> dict:
        if not isinstance(value, dict):
            raise self.error(path or "<top level>", "must be a mapping", value,
                             f"allowed keys: {', '.join(allowed)}")
        for key in value:
            if key not in allowed:
                close = difflib.get_close_matches(str(key), allowed, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise self.error(_join(path, str(key)), f"unknown key {key!r}",
                                 fix=f"{hint}allowed keys: {', '.join(allowed)}")
        for key in required:
            if key not in value:
                raise self.error(_join(path, key), "missing", fix=f"add '{key}:' to {path or 'the top level'}")
        return value

    def number(self, path: str, value: Any, *, allow_zero: bool = False, fix: str = "") -> float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or value < 0 or (value == 0 and not allow_zero):
            need = "a number >= 0" if allow_zero else "a positive number"
            if isinstance(value, str) and _is_float(value):  # [Note: YAML numbers with an exponent]
                raise self.error(path, f"must be {need}; YAML read {short_repr(value)} as a string because it is "
                                 f"quoted", fix=f"write it without quotes: {path.rsplit('.', 1)[-1]}: {value.strip()}")
            raise self.error(path, f"must be {need}", value, fix)
        return value

    def count(self, path: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_GPUS_PER_GROUP:
            raise self.error(path, f"must be a positive integer (at most {_MAX_GPUS_PER_GROUP})", value,
                             "set it to the number of GPUs of this type in the node")
        return value

    def name(self, path: str, value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            raise self.error(path, "must be a non-empty string", value)
        return value

    def list(self, path: str, value: Any, what: str) -> list:
        if not isinstance(value, list) or not value:
            raise self.error(path, f"must be a non-empty list of {what}", value)
        return value

    def link(self, path: str, data: Any, kind: str, extra: tuple[str, ...] = ()) -> Link:
        self.mapping(path, data, (*extra, *_LINK_KEYS))
        values = []
        for keys in (_BANDWIDTH_KEYS, _LATENCY_KEYS):
            given = [k for k in keys if k in data]
            latency = keys is _LATENCY_KEYS
            what = "latency" if latency else "bandwidth"
            if len(given) != 1:
                problem = f"no {what}" if not given else f"{what} given twice ({' and '.join(given)})"
                raise self.error(path, problem, fix=f"give exactly one of {', '.join(keys)}, {_LINK_EXAMPLE}")
            key = given[0]
            number = self.number(_join(path, key), data[key], allow_zero=latency,
                                 fix="e.g. latency_us: 10 (0 is allowed)" if latency else _LINK_EXAMPLE)
            values.append(keys[key](number))
        return Link(kind=kind, bandwidth_bytes_per_s=values[0], latency_s=values[1])

    def bandwidth(self, path: str, data: Any, extra: tuple[str, ...] = ()) -> float:
        """A shared link's or NIC's capacity: exactly one bandwidth key, no latency."""
        self.mapping(path, data, (*extra, *_LINK_KEYS))
        lat = [k for k in _LATENCY_KEYS if k in data]
        if lat:
            raise self.error(_join(path, lat[0]), "a shared link, NIC or host link has no latency of its own", data[lat[0]],
                             "remove it: a flow's latency is that of its node pair's link (links:)")
        given = [k for k in _BANDWIDTH_KEYS if k in data]
        if len(given) != 1:
            problem = "no bandwidth" if not given else f"bandwidth given twice ({' and '.join(given)})"
            raise self.error(path, problem, fix=f"give exactly one of {', '.join(_BANDWIDTH_KEYS)}, "
                                                f"per direction, e.g. bandwidth_Gbps: 25")
        key = given[0]
        return _BANDWIDTH_KEYS[key](self.number(_join(path, key), data[key], fix="bandwidth per direction, "
                                                                                  "e.g. bandwidth_Gbps: 25"))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def parse(data: Any, source: str, *, default_name: str) -> dict[str, Any]:
    """Validate ``data`` and return the keyword arguments of ``Cluster``."""
    ctx = _Ctx(source)
    if data is None:
        raise ctx.error("<top level>", "empty cluster description", fix="give at least a 'nodes:' list")
    ctx.mapping("", data, ("name", "datacenters", "nodes", "links", "shared_links", "gpu_types"),
                required=("nodes",))
    name = ctx.name("name", data.get("name", default_name))
    custom = _parse_gpu_types(ctx, data.get("gpu_types", {}))
    datacenters = _parse_datacenters(ctx, data)

    gpus: list[GPU] = []
    nodes: list[str] = []
    node_links: list[Link | None] = []
    node_nics: list[float | None] = []
    host: dict[str, list] = {"node_host_memory_bytes": [], "node_host_memory_bandwidths": [], "node_host_links": []}
    for i, node in enumerate(ctx.list("nodes", data["nodes"], "nodes")):
        path = f"nodes[{i}]"
        ctx.mapping(path, node, ("name", "datacenter", "gpus", "intra_node", "nic", *_HOST_KEYS),
                    required=("name", "gpus"))
        node_name = ctx.name(f"{path}.name", node["name"])
        if node_name in nodes:
            raise ctx.error(f"{path}.name", "duplicate node name", node_name,
                            f"already used by nodes[{nodes.index(node_name)}]; node names must be unique")
        dc = _node_datacenter(ctx, path, node, datacenters)
        for j, group in enumerate(ctx.list(f"{path}.gpus", node["gpus"], "{type, count} groups")):
            spec, count, memory = _parse_gpu_group(ctx, f"{path}.gpus[{j}]", group, custom)
            local = sum(g.node == node_name for g in gpus)
            gpus += [GPU(index=len(gpus) + k, node=node_name, datacenter=dc, local_index=local + k,
                         type=spec.type, spec=spec, memory_bytes=memory) for k in range(count)]
        nodes.append(node_name)
        intra = node.get("intra_node")
        node_links.append(None if intra is None else ctx.link(f"{path}.intra_node", intra, "intra_node"))
        node_nics.append(ctx.bandwidth(f"{path}.nic", node["nic"]) if "nic" in node else None)
        for key, value in _parse_host(ctx, path, node).items():
            host[key].append(value)

    links = ctx.mapping("links", data.get("links", {}),
                        ("intra_node", "inter_node", "cross_datacenter", "overrides", "nic"))
    defaults = {k: ctx.link(f"links.{k}", links[k], k)
                for k in ("intra_node", "inter_node", "cross_datacenter") if k in links}
    node_dc = {g.node: g.datacenter for g in gpus}
    overrides = _parse_overrides(ctx, links.get("overrides", []), node_dc)
    _check_required_links(ctx, nodes, node_dc, node_links, gpus, defaults, overrides)
    nic = ctx.bandwidth("links.nic", links["nic"]) if "nic" in links else None
    shared = _parse_shared_links(ctx, data.get("shared_links", []), nodes, node_dc, datacenters)
    return dict(name=name, gpus=tuple(gpus), nodes=tuple(nodes), source=source, datacenters=datacenters,
                intra_node_link=defaults.get("intra_node"), inter_node_link=defaults.get("inter_node"),
                cross_datacenter_link=defaults.get("cross_datacenter"), node_intra_node_links=tuple(node_links),
                link_overrides=overrides, custom_gpu_types=tuple(custom.values()),
                nic_bandwidth_bytes_per_s=nic, node_nic_bandwidths=tuple(node_nics), shared_links=shared,
                **{k: tuple(v) for k, v in host.items()})


#: A node's host-memory keys (offload: ``zorse_fx/cluster/host.py``).
_HOST_KEYS = ("host_memory_GiB", "host_memory_bandwidth_GBps", "host_link")


def _parse_host(ctx: _Ctx, path: str, node: dict) -> dict[str, Any]:
    """A node's ``host_memory_GiB`` (bytes), ``host_memory_bandwidth_GBps`` (bytes/s) and
    ``host_link`` (bytes/s per GPU and direction), each None where not given."""
    mem = node.get("host_memory_GiB")
    if mem is not None:
        mem = round(ctx.number(f"{path}.host_memory_GiB", mem,
                               fix="the node's RAM training may use, in GiB, e.g. host_memory_GiB: 512") * _GiB)
    bw = node.get("host_memory_bandwidth_GBps")
    if bw is not None:
        bw = ctx.number(f"{path}.host_memory_bandwidth_GBps", bw,
                        fix="the node's memory bandwidth in GB/s, e.g. 204.8 (8 channels of DDR4-3200)") * 1e9
    link = node.get("host_link")
    if link is not None:
        link = ctx.bandwidth(f"{path}.host_link", link)
    return {"node_host_memory_bytes": mem, "node_host_memory_bandwidths": bw, "node_host_links": link}


_SHARED_EXAMPLE = "e.g. - {name: wan, between: [{datacenter: us}, {datacenter: eu}], bandwidth_Gbps: 1}"


def _parse_shared_links(ctx: _Ctx, entries: Any, nodes: list[str], node_dc: dict[str, str],
                        datacenters: tuple[str, ...]) -> tuple[SharedLinkSpec, ...]:
    if not isinstance(entries, list):
        raise ctx.error("shared_links", "must be a list", entries, _SHARED_EXAMPLE)
    out: list[SharedLinkSpec] = []
    for i, entry in enumerate(entries):
        path = f"shared_links[{i}]"
        ctx.mapping(path, entry, ("name", "between", *_LINK_KEYS), required=("name", "between"))
        name = ctx.name(f"{path}.name", entry["name"])
        if name in [o.name for o in out] or name.startswith("nic:"):
            raise ctx.error(f"{path}.name", "already used" if not name.startswith("nic:") else
                            "names 'nic:<node>' are the NICs' own", name, "give each shared link its own name")
        pair = entry["between"]
        if not (isinstance(pair, list) and len(pair) == 2):
            raise ctx.error(f"{path}.between", "must list the two sides", pair,
                            "e.g. between: [{datacenter: us-east}, {nodes: [node3, node4]}]")
        sides = tuple(_parse_side(ctx, f"{path}.between[{k}]", side, nodes, node_dc, datacenters)
                      for k, side in enumerate(pair))
        common = [n for n in sides[0].nodes if n in sides[1].nodes]
        if common:
            raise ctx.error(f"{path}.between", f"node(s) {', '.join(common)} on both sides", pair,
                            "the sides must be disjoint: a flow crosses the link from one side to the other")
        bw = ctx.bandwidth(path, entry, extra=("name", "between"))
        out.append(SharedLinkSpec(name=name, sides=sides, bandwidth_bytes_per_s=bw))
    return tuple(out)


def _parse_side(ctx: _Ctx, path: str, side: Any, nodes: list[str], node_dc: dict[str, str],
                datacenters: tuple[str, ...]) -> SharedLinkSide:
    ctx.mapping(path, side, ("datacenter", "nodes"))
    if len(side) != 1:
        raise ctx.error(path, "give exactly one of datacenter, nodes", side,
                        "e.g. {datacenter: us-east} or {nodes: [node0, node1]}")
    if "datacenter" in side:
        dc = side["datacenter"]
        if not isinstance(dc, str) or dc not in datacenters:
            raise ctx.error(f"{path}.datacenter", "no such datacenter", dc, f"datacenters: {', '.join(datacenters)}")
        members = tuple(n for n in nodes if node_dc[n] == dc)
        if not members:
            raise ctx.error(f"{path}.datacenter", "the datacenter has no nodes", dc, "name one that has")
        return SharedLinkSide(datacenter=dc, nodes=members)
    listed = ctx.list(f"{path}.nodes", side["nodes"], "node names")
    for k, n in enumerate(listed):
        if not isinstance(n, str) or n not in node_dc:
            raise ctx.error(f"{path}.nodes[{k}]", "no such node", n, f"nodes: {', '.join(nodes)}")
        if n in listed[:k]:
            raise ctx.error(f"{path}.nodes[{k}]", "listed twice", n, "list each node once")
    return SharedLinkSide(nodes=tuple(n for n in nodes if n in listed))


def _parse_datacenters(ctx: _Ctx, data: dict) -> tuple[str, ...]:
    if "datacenters" not in data:
        return ("dc0",)
    names: list[str] = []
    for i, dc in enumerate(ctx.list("datacenters", data["datacenters"], "{name: ...} mappings")):
        name = ctx.name(f"datacenters[{i}].name", ctx.mapping(f"datacenters[{i}]", dc, ("name",), ("name",))["name"])
        if name in names:
            raise ctx.error(f"datacenters[{i}].name", "duplicate datacenter name", name, "names must be unique")
        names.append(name)
    return tuple(names)


def _node_datacenter(ctx: _Ctx, path: str, node: dict, datacenters: tuple[str, ...]) -> str:
    if "datacenter" in node:
        dc = node["datacenter"]
        if dc not in datacenters:
            raise ctx.error(f"{path}.datacenter", "datacenter not declared", dc,
                            f"declared: {', '.join(datacenters)}; add '- name: {dc}' to 'datacenters:'")
        return dc
    if len(datacenters) == 1:
        return datacenters[0]
    raise ctx.error(f"{path}.datacenter", "missing", fix=f"the cluster has {len(datacenters)} datacenters "
                    f"({', '.join(datacenters)}); name the one holding this node")


def _parse_gpu_group(ctx: _Ctx, path: str, group: Any, custom: dict[str, GPUSpec]) -> tuple[GPUSpec, int, int]:
    """One ``{type, count, memory_GiB?}`` entry -> (spec, count, usable memory bytes)."""
    ctx.mapping(path, group, ("type", "count", "memory_GiB"), required=("type", "count"))
    spec = _resolve_type(ctx, f"{path}.type", group["type"], custom)
    count = ctx.count(f"{path}.count", group["count"])
    if "memory_GiB" not in group:
        return spec, count, spec.memory_bytes
    gib = ctx.number(f"{path}.memory_GiB", group["memory_GiB"], fix="usable memory per GPU in GiB")
    memory = round(gib * _GiB)
    if not 1 <= memory <= spec.memory_bytes:
        raise ctx.error(f"{path}.memory_GiB", f"must be in (0, {spec.memory_bytes / _GiB:g}] GiB for {spec.type}",
                        gib, "the override is usable memory, at most the datasheet capacity")
    return spec, count, memory


def _parse_overrides(ctx: _Ctx, entries: Any, node_dc: dict[str, str]) -> tuple[LinkOverride, ...]:
    if not isinstance(entries, list):
        raise ctx.error("links.overrides", "must be a list", entries, "e.g. - {between: [a, b], ...}")
    overrides: list[LinkOverride] = []
    for i, entry in enumerate(entries):
        path = f"links.overrides[{i}]"
        ctx.mapping(path, entry, ("between", *_LINK_KEYS), required=("between",))
        pair = entry["between"]
        if not (isinstance(pair, list) and len(pair) == 2 and pair[0] != pair[1]):
            raise ctx.error(f"{path}.between", "must list two different node names", pair,
                            "e.g. between: [node0, node1]")
        for k, name in enumerate(pair):
            if not isinstance(name, str) or name not in node_dc:
                raise ctx.error(f"{path}.between[{k}]", "no such node", name, f"nodes: {', '.join(node_dc)}")
        if any(set(prev.between) == set(pair) for prev in overrides):
            raise ctx.error(f"{path}.between", "this node pair is already overridden", pair, "give each pair once")
        kind = "inter_node" if node_dc[pair[0]] == node_dc[pair[1]] else "cross_datacenter"
        link = ctx.link(path, entry, kind, extra=("between",))
        overrides.append(LinkOverride(between=(pair[0], pair[1]), link=link))
    return tuple(overrides)


def _check_required_links(ctx: _Ctx, nodes, node_dc, node_links, gpus, defaults, overrides) -> None:
    if "intra_node" not in defaults:
        for i, node in enumerate(nodes):
            n = sum(g.node == node for g in gpus)
            if n > 1 and node_links[i] is None:
                raise ctx.error("links.intra_node",
                                f"missing, and node {node!r} has {n} GPUs without its own intra_node",
                                fix=f"add links.intra_node: {_LINK_EXAMPLE} (or intra_node: to nodes[{i}])")
    covered = {frozenset(o.between) for o in overrides}
    for kind, same_dc in (("inter_node", True), ("cross_datacenter", False)):
        if kind in defaults:
            continue
        for i, a in enumerate(nodes):
            for b in nodes[i + 1:]:
                if (node_dc[a] == node_dc[b]) == same_dc and frozenset((a, b)) not in covered:
                    where = (f"datacenter {node_dc[a]!r}" if same_dc
                             else f"datacenters {node_dc[a]!r} and {node_dc[b]!r}")
                    raise ctx.error(f"links.{kind}", f"missing, and nodes {a!r} and {b!r} ({where}) have no override",
                                    fix=f"add links.{kind}: {_LINK_EXAMPLE}")


def _parse_gpu_types(ctx: _Ctx, section: Any) -> dict[str, GPUSpec]:
    """``gpu_types:`` -> ``{normalized name: GPUSpec}`` of user-declared types."""
    if not isinstance(section, dict):
        raise ctx.error("gpu_types", "must be a mapping of type name -> specs", section, GPU_TYPES_HELP)
    custom: dict[str, GPUSpec] = {}
    for type_name, entry in section.items():
        path = f"gpu_types.{type_name}"
        type_name = ctx.name(path, type_name)
        if lookup_builtin(type_name) is not None:
            raise ctx.error(path, f"{type_name!r} is already the built-in type {lookup_builtin(type_name).type}",
                            fix="choose another name (or use a per-group memory_GiB override)")
        if normalize_gpu_name(type_name) in custom:
            raise ctx.error(path, "declared twice (names match case-insensitively)", type_name)
        ctx.mapping(path, entry, _GPU_TYPE_KEYS + _GPU_TYPE_OPTIONAL, required=_GPU_TYPE_KEYS)
        nums = {k: conv(ctx.number(f"{path}.{k}", entry[k])) for k, conv in _GPU_TYPE_NUMBERS.items()}
        if not isinstance(entry["bf16_supported"], bool):
            raise ctx.error(f"{path}.bf16_supported", "must be true or false", entry["bf16_supported"])
        arch = entry.get("arch")
        if arch is not None and arch not in known_archs():
            close = difflib.get_close_matches(str(arch), known_archs(), n=1)
            raise ctx.error(f"{path}.arch", "unknown architecture class", arch,
                            fix=(f"did you mean {close[0]!r}? " if close else "")
                            + f"use one of {', '.join(known_archs())} (gpu_specs.csv's arch column), or leave "
                              f"arch out to price the type by the plain roofline")
        tdp = ctx.number(f"{path}.tdp_w", entry["tdp_w"]) if "tdp_w" in entry else None
        tf32 = ctx.number(f"{path}.tf32_tensor_tflops", entry["tf32_tensor_tflops"]) * 1e12 \
            if "tf32_tensor_tflops" in entry else None
        custom[normalize_gpu_name(type_name)] = GPUSpec(
            type=type_name, memory_bytes=round(nums["memory_GiB"]), mem_bw_bytes_per_s=nums["mem_bw_GBps"],
            fp32_flops_per_s=nums["fp32_tflops"], fp16_flops_per_s=nums["fp16_tensor_tflops"],
            bf16_supported=entry["bf16_supported"], source=ctx.name(f"{path}.source", entry["source"]),
            arch=arch, tdp_w=tdp, tf32_flops_per_s=tf32)
    return custom


def _resolve_type(ctx: _Ctx, path: str, name: Any, custom: dict[str, GPUSpec]) -> GPUSpec:
    if isinstance(name, int) and not isinstance(name, bool):
        name = str(name)  # YAML reads `type: 4090` as an int
    name = ctx.name(path, name)
    spec = custom.get(normalize_gpu_name(name)) or lookup_builtin(name)
    if spec is None:
        extra = tuple(s.type for s in custom.values())
        raise ClusterConfigError(f"{ctx.source}: {path}: {unknown_gpu_message(name, extra)}")
    return spec


# -- Cluster -> dict ------------------------------------------------------
def _unscale(x: float, to_si: Callable[[float], float], guess: float) -> float | None:
    """A number ``u`` near ``guess`` with ``to_si(u) == x`` exactly, or ``None``."""
    for step in range(9):  # guess, then neighbours 1..8 ulps away on each side
        for cand in (guess,) if step == 0 else (_nudge(guess, step), _nudge(guess, -step)):
            if to_si(cand) == x:
                return int(cand) if float(cand).is_integer() and abs(cand) < 2**53 else cand
    return None


def _nudge(x: float, steps: int) -> float:
    for _ in range(abs(steps)):
        x = math.nextafter(x, math.inf if steps > 0 else -math.inf)
    return x


def _unit_value(x: float, keys: dict[str, Callable[[float], float]], guesses: dict[str, float]) -> dict[str, float]:
    """``{key: value}`` in the first unit of ``keys`` that reproduces ``x`` exactly."""
    for key, guess in guesses.items():
        u = _unscale(x, keys[key], guess)
        if u is not None:
            return {key: u}
    raise AssertionError(f"cannot write {x!r} exactly in {list(keys)}")  # the SI key always matches


def _memory_gib(nbytes: int) -> float:
    """The shortest decimal GiB figure that ``parse`` turns back into ``nbytes``."""
    for digits in range(13):
        gib = round(nbytes / _GiB, digits)
        if round(gib * _GiB) == nbytes:
            return int(gib) if float(gib).is_integer() else gib
    return nbytes / _GiB  # exact: power-of-two scale


def _link_dict(link: Link) -> dict[str, float]:
    bw, lat = link.bandwidth_bytes_per_s, link.latency_s
    return {**_unit_value(bw, _BANDWIDTH_KEYS, {"bandwidth_GBps": bw / 1e9, "bandwidth_bytes_per_s": bw}),
            **_unit_value(lat, _LATENCY_KEYS, {"latency_us": lat * 1e6, "latency_ms": lat * 1e3, "latency_s": lat})}


def _bandwidth_dict(bw: float) -> dict[str, float]:
    return _unit_value(bw, _BANDWIDTH_KEYS, {"bandwidth_GBps": bw / 1e9, "bandwidth_bytes_per_s": bw})


def unparse(cluster: Cluster) -> dict[str, Any]:
    """``Cluster`` -> plain dict in the file format; ``parse`` of it gives an equal cluster."""
    nodes = []
    for i, node in enumerate(cluster.nodes):
        gpus = [g for g in cluster.gpus if g.node == node]
        groups = []
        for g in gpus:
            if groups and groups[-1]["type"] == g.type and groups[-1]["_mem"] == g.memory_bytes:
                groups[-1]["count"] += 1
            else:
                groups.append({"type": g.type, "count": 1, "_mem": g.memory_bytes, "_spec": g.spec.memory_bytes})
        for grp in groups:
            mem, spec_mem = grp.pop("_mem"), grp.pop("_spec")
            if mem != spec_mem:
                grp["memory_GiB"] = _memory_gib(mem)
        entry: dict[str, Any] = {"name": node, "datacenter": gpus[0].datacenter, "gpus": groups}
        if cluster.node_intra_node_links[i] is not None:
            entry["intra_node"] = _link_dict(cluster.node_intra_node_links[i])
        if cluster.node_nic_bandwidths[i] is not None:
            entry["nic"] = _bandwidth_dict(cluster.node_nic_bandwidths[i])
        if cluster.node_host_memory_bytes[i] is not None:
            entry["host_memory_GiB"] = _memory_gib(cluster.node_host_memory_bytes[i])
        if cluster.node_host_memory_bandwidths[i] is not None:
            bw = cluster.node_host_memory_bandwidths[i]
            u = _unscale(bw, lambda v: v * 1e9, bw / 1e9)
            entry["host_memory_bandwidth_GBps"] = u if u is not None else bw / 1e9
        if cluster.node_host_links[i] is not None:
            entry["host_link"] = _bandwidth_dict(cluster.node_host_links[i])
        nodes.append(entry)
    links: dict[str, Any] = {}
    for kind in ("intra_node", "inter_node", "cross_datacenter"):
        link = getattr(cluster, f"{kind}_link")
        if link is not None:
            links[kind] = _link_dict(link)
    if cluster.link_overrides:
        links["overrides"] = [{"between": list(o.between), **_link_dict(o.link)} for o in cluster.link_overrides]
    if cluster.nic_bandwidth_bytes_per_s is not None:
        links["nic"] = _bandwidth_dict(cluster.nic_bandwidth_bytes_per_s)
    out: dict[str, Any] = {"name": cluster.name, "datacenters": [{"name": d} for d in cluster.datacenters],
                           "nodes": nodes, "links": links}
    if cluster.shared_links:
        out["shared_links"] = [
            {"name": spec.name,
             "between": [{"datacenter": side.datacenter} if side.datacenter is not None else {"nodes": list(side.nodes)}
                         for side in spec.sides],
             **_bandwidth_dict(spec.bandwidth_bytes_per_s)} for spec in cluster.shared_links]
    if cluster.custom_gpu_types:
        out["gpu_types"] = {s.type: _gpu_type_dict(s) for s in cluster.custom_gpu_types}
    return out


def _gpu_type_dict(spec: GPUSpec) -> dict[str, Any]:
    si = {"memory_GiB": spec.memory_bytes, "mem_bw_GBps": spec.mem_bw_bytes_per_s,
          "fp32_tflops": spec.fp32_flops_per_s, "fp16_tensor_tflops": spec.fp16_flops_per_s}
    scale = {"memory_GiB": _GiB, "mem_bw_GBps": 1e9, "fp32_tflops": 1e12, "fp16_tensor_tflops": 1e12}
    out: dict[str, Any] = {}
    for key, x in si.items():
        if key == "memory_GiB":
            out[key] = _memory_gib(x)
            continue
        u = _unscale(x, _GPU_TYPE_NUMBERS[key], x / scale[key])
        out[key] = u if u is not None else x / scale[key]  # only a hand-built GPUSpec can miss by an ulp
    out = {**out, "bf16_supported": spec.bf16_supported, "source": spec.source}
    if spec.arch is not None:
        out["arch"] = spec.arch
    if spec.tdp_w is not None:
        out["tdp_w"] = spec.tdp_w
    if spec.tf32_flops_per_s is not None:
        u = _unscale(spec.tf32_flops_per_s, lambda v: v * 1e12, spec.tf32_flops_per_s / 1e12)
        out["tf32_tensor_tflops"] = u if u is not None else spec.tf32_flops_per_s / 1e12
    return out
