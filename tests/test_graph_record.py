"""The graph record ([Note: the graph record] in zorse_fx/capture/graph_record.py): the capture cache's
plain-data form of an exported graph decodes to the module the ``.pt2`` gives, and a record that does not
fit is a miss, never a wrong graph."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch
from test_capture_cache import _llama

from zorse_fx.capture import cache as capture_cache
from zorse_fx.capture import capture, graph_record, trace
from zorse_fx.models.hf import CACHE_ENV


def _value(v):
    """What zorse_fx reads of a node's value: type, sizes, strides, dtype, requires_grad (tuples itemwise)."""
    if isinstance(v, torch.Tensor):
        return ("tensor", str(tuple(v.shape)), str(v.stride()), v.dtype, v.requires_grad)
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, *[_value(x) for x in v])
    return (type(v).__name__, str(v))


def _meta(gm, torch_fn: bool = True):
    return [(n.name, _value(n.meta.get("val")), n.meta.get("nn_module_stack"), n.meta.get("stack_trace"),
             n.meta.get("torch_fn") if torch_fn else None) for n in gm.graph.nodes]


@pytest.fixture
def cached(tmp_path, monkeypatch):
    """A tiny Llama captured once (writing the .pt2 and the graph record) and a second model of its
    configuration (other weights), with their capture key."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(capture_cache.NO_CACHE_ENV, raising=False)
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(11))
    capture(_llama(0), (ids, ids))
    model = _llama(1)
    key = capture_cache.export_key(model, (ids, ids.clone()), ("input_ids", "labels"))
    return model, key, ids, tmp_path / "capture" / f"graph-{key}.json"


def test_a_decoded_record_is_the_module_the_pt2_gives(cached):
    """Code, module tree, parameters and buffers (by name and identity: the live model's, ties kept),
    every node's metadata as zorse_fx reads it, and the loss and gradients of the model's own weights."""
    model, key, ids, path = cached
    assert path.is_file()
    live = capture_cache._live_tensors(model)
    decoded, kept = capture_cache.load_graph(key, live)
    from_pt2 = trace._module_of(capture_cache.load_exported(key, model))
    for gm in (decoded, from_pt2):
        trace._normalise(gm)
    assert decoded.code == from_pt2.code
    assert [n for n, _ in decoded.named_modules()] == [n for n, _ in from_pt2.named_modules()]
    for a, b in ((decoded.named_parameters(remove_duplicate=False), from_pt2.named_parameters(remove_duplicate=False)),
                 (decoded.named_buffers(remove_duplicate=False), from_pt2.named_buffers(remove_duplicate=False))):
        a, b = list(a), list(b)
        assert [(n, id(t)) for n, t in a] == [(n, id(t)) for n, t in b] and a
    assert [k for k, _ in decoded.state_dict().items()] == [k for k, _ in from_pt2.state_dict().items()]
    # (a .pt2 drops get_attr nodes' torch_fn and records a value for the output node; export neither)
    assert _meta(decoded, torch_fn=False)[:-1] == _meta(from_pt2, torch_fn=False)[:-1]
    assert decoded.training == from_pt2.training and kept == []
    with pytest.MonkeyPatch.context() as mp:  # and a fresh capture's metadata, torch_fn included
        mp.setenv(capture_cache.NO_CACHE_ENV, "1")
        fresh = capture(model, (ids, ids)).graph_module
    from zorse_fx.capture.causal import causal_masks_to_is_causal

    causal_masks_to_is_causal(decoded)
    assert decoded.code == fresh.code and _meta(decoded) == _meta(fresh)
    eager = model(ids, ids)
    loss = decoded(ids, ids)
    assert torch.equal(loss, eager)  # the same kernels in the same order on the same weights
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    from_pt2(ids, ids).backward()
    assert all(torch.equal(grads[n], p.grad) for n, p in model.named_parameters())


def test_capture_reads_the_record_and_a_plan_without_the_model_keeps_its_constants(cached):
    """A capture with the key reads the record (the .pt2 is not opened); without the model's
    non-persistent buffers (a plan made without the model) the record's values stand in, equal to them."""
    model, key, ids, path = cached
    opened = []
    real = capture_cache.load_exported
    capture_cache.load_exported = lambda *a, **k: opened.append(1) or real(*a, **k)
    try:
        got = capture(model, (ids, ids))
    finally:
        capture_cache.load_exported = real
    assert opened == [] and torch.equal(got.graph_module(ids, ids), model(ids, ids))
    live = capture_cache._live_tensors(model)
    without = {k: v for k, v in live.items() if "inv_freq" not in k}
    assert len(without) < len(live)
    gm, kept = capture_cache.load_graph(key, without)
    assert kept and all(torch.equal(dict(gm.named_buffers())[k], live[k]) for k in live if "inv_freq" in k)


@pytest.mark.parametrize("damage", ["target", "private", "format", "tensor", "shape", "json"])
def test_a_record_that_does_not_fit_is_a_miss_and_written_again(cached, caplog, damage):
    """An unknown operator, a private function of ``operator``, another format, a tensor the model lacks,
    a recorded size the model's tensor does not have, or unreadable JSON: the record is not used (logged),
    the capture reads the .pt2 and is right, and the record is written again."""
    model, key, ids, path = cached
    data = json.loads(path.read_text())
    if damage == "json":
        path.write_text("{not json")
    else:
        call = next(n for n in data["nodes"] if n[0] == "call_function")
        if damage == "target":
            call[2] = ["op", "aten", "no_such_op", "default"]
        elif damage == "private":
            call[2] = ["operator", "__import__"]
        elif damage == "format":
            data["format"] = graph_record.FORMAT + 1
        elif damage == "tensor":
            data["modules"][-1][1].append(["extra", "p", True, None])
        elif damage == "shape":
            get_attr = next(n for n in data["nodes"] if n[0] == "get_attr" and n[5].get("val"))
            get_attr[5]["val"]["tensor"][0][0] += 1
        path.write_text(json.dumps(data))
    live = capture_cache._live_tensors(model)
    with caplog.at_level(logging.INFO, logger="zorse_fx.capture.cache"):
        assert capture_cache.load_graph(key, live) is None
    assert damage == "json" or any("graph record" in r.getMessage() and "not used" in r.getMessage()
                                   for r in caplog.records)
    got = capture(model, (ids, ids))
    assert torch.equal(got.graph_module(ids, ids), model(ids, ids))
    assert capture_cache.load_graph(key, live) is not None  # written again from the .pt2


def test_what_a_record_cannot_say_writes_none():
    """A graph calling a submodule (or any target but an operator overload or a function of operator)
    is not recorded: the .pt2 stays the only form."""
    import torch.fx as fx

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.lin(x).sum()

    gm = fx.symbolic_trace(M())  # (a call_module node)
    assert graph_record.encode(gm, dict(gm.named_parameters())) is None
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.sigmoid, (x,)))  # a torch function, not an OpOverload
    assert graph_record.encode(fx.GraphModule(torch.nn.Module(), g), {}) is None


def test_decoding_imports_no_dynamo(cached):
    """[Note: a ShapeEnv without torch._dynamo]: a fresh process decodes a record without importing
    torch._dynamo, and the module stood in for the validator is gone afterwards."""
    model, key, ids, path = cached
    code = f"""
import sys, json, torch
from zorse_fx.capture import graph_record
shapes = json.load(open({str(path)!r}))
live = {{}}
for qual, entries in shapes["modules"]:
    for name, kind, flag, value in entries:
        full = f"{{qual}}.{{name}}" if qual else name
        node = next((n for n in shapes["nodes"] if n[0] == "get_attr" and n[2] == full), None)
        if kind == "p":
            shape, dtype = node[5]["val"]["tensor"][0], node[5]["val"]["tensor"][2]
            live[full] = torch.nn.Parameter(torch.zeros(shape, dtype=getattr(torch, dtype)))
gm, kept = graph_record.decode(shapes, live)
assert "torch._dynamo" not in sys.modules, "dynamo imported"
assert "torch.fx.experimental.validator" not in sys.modules
from torch.fx.experimental.validator import translation_validation_enabled
assert translation_validation_enabled() is False and "torch._dynamo" in sys.modules
print("OK", len(kept))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("OK"), out.stderr[-2000:]
