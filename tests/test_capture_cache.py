"""The capture cache ([Note: the capture cache] in zorse_fx/capture/cache.py):
a capture read back from the cache is the capture made afresh, with the live
model's own weights in it."""

from __future__ import annotations

import os

import torch

from zorse_fx.capture import capture
from zorse_fx.capture import cache as capture_cache
from zorse_fx.models.hf import CACHE_ENV, CausalLMWithLoss


def _llama(seed: int, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return CausalLMWithLoss(LlamaForCausalLM(cfg))


def _shape(v) -> str:
    """A node value's symbolic shape and dtype (a graph record's values are meta tensors, export's FakeTensors:
    [Note: the graph record])."""
    if isinstance(v, torch.Tensor):
        return f"{tuple(v.shape)} {v.dtype} {v.requires_grad}"
    return str([_shape(x) for x in v]) if isinstance(v, (tuple, list)) else str(v)


def _graph(captured) -> list[tuple]:
    """Every node's op, target and value shapes (the output node's: a loaded program records one, export not)."""
    return [(n.op, str(n.target), _shape(n.meta.get("val", "")) if n.op != "output" else "")
            for n in captured.graph_module.graph.nodes]


def test_cached_capture_equals_a_fresh_one_with_the_live_weights(tmp_path, monkeypatch):
    """A second model of the same configuration (other weights) is read from
    the cache: the same graph node for node (ops, targets, symbolic shapes),
    the same ties, and its loss and gradients are those of its own weights
    (eager, to float32 rounding of the same arithmetic: bitwise here, the same
    kernels in the same order). $ZORSE_NO_CACHE captures afresh; another
    configuration is another key."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    first = capture(_llama(0), (ids, ids))
    files = list((tmp_path / "capture").glob("*.pt2"))
    assert len(files) == 1 and files[0].stat().st_size < 5 * 2**20  # the graph, not the weights
    model = _llama(1)
    key = capture_cache.export_key(model, (ids, ids.clone()), ("input_ids", "labels"))
    assert capture_cache.cache_file(key) == files[0]
    second = capture(model, (ids, ids))
    monkeypatch.setenv(capture_cache.NO_CACHE_ENV, "1")
    fresh = capture(model, (ids, ids))
    assert _graph(second) == _graph(fresh) == _graph(first)
    assert second.tied == fresh.tied and second.input_names == fresh.input_names
    gm = second.graph_module
    assert sum(p is model.model.model.embed_tokens.weight for p in gm.parameters()) == 1  # the live, tied weight
    loss = gm(ids, ids)
    eager = model(ids, ids)
    assert torch.equal(loss, eager)
    loss.backward()
    assert model.model.model.embed_tokens.weight.grad is not None
    assert not torch.equal(first.graph_module(ids, ids), eager)  # the first model's weights are other weights
    monkeypatch.delenv(capture_cache.NO_CACHE_ENV)
    assert capture_cache.export_key(_llama(0, layers=3), (ids, ids.clone()), ("input_ids", "labels")) != key


def test_unreadable_cache_file_is_captured_afresh(tmp_path, monkeypatch):
    """A damaged cache file is a miss: the capture is made afresh and the file replaced."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(2))
    model = _llama(0)
    path = capture_cache.cache_file(capture_cache.export_key(model, (ids, ids.clone()), ("input_ids", "labels")))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a pt2 archive")
    captured = capture(model, (ids, ids))
    assert torch.equal(captured.graph_module(ids, ids), model(ids, ids))
    assert path.stat().st_size > 1000 and capture_cache.load_exported(path.stem, model) is not None


def test_no_cache_flag_captures_afresh_and_writes_nothing(tmp_path, monkeypatch):
    """`zorse plan --no-cache` (here with a module:function Hugging Face model): no
    file in the cache, and $ZORSE_NO_CACHE is as it was afterwards (the flag
    holds for that command only)."""
    from conftest import CLUSTERS
    from zorse_fx.capture.cache import NO_CACHE_ENV
    from zorse_fx.cli import main

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(NO_CACHE_ENV, raising=False)
    (tmp_path / "zorse_test_cachemod.py").write_text(
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "def build():\n"
        "    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,\n"
        "        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))\n")
    monkeypatch.chdir(tmp_path)
    argv = ["plan", "--model", "zorse_test_cachemod:build", "--cluster", str(CLUSTERS / "small_hetero.yaml"),
            "--global-batch-size", "4", "--seq-len", "16", "--solver-budget", "0.5"]
    assert main([*argv, "--no-cache", "-o", str(tmp_path / "p1")]) == 0
    assert not (tmp_path / "cache" / "capture").exists() and NO_CACHE_ENV not in os.environ
    assert main([*argv, "-o", str(tmp_path / "p2")]) == 0
    assert len(list((tmp_path / "cache" / "capture").glob("*.pt2"))) == 1


def test_a_users_own_module_is_captured_afresh(tmp_path, monkeypatch):
    """A module of the user's own class can read what no key sees (here a mask
    function held in an attribute: tests/test_causal_mask_pass.py's _Masked
    with two functions): nothing is cached, each capture is its own model's."""
    from test_causal_mask_pass import _Masked, _causal, _window

    from zorse_fx.capture.cache import cacheable

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    for fn, rewritten in ((_causal, 1), (_window, 0)):
        model = _Masked(fn)
        assert not cacheable(model)
        assert capture(model, (ids, ids.clone()), method="export").causal_masks == rewritten
    assert not (tmp_path / "capture").exists()
    assert cacheable(_llama(0))


def test_the_loss_check_is_read_from_the_cache(tmp_path, monkeypatch):
    """[Note: the loss check cached]: the first capture checks the loss contract and records its answer
    beside the graph; a capture with the same key takes it without the model's forwards; another
    configuration (another key), $ZORSE_NO_CACHE, a damaged record or a non-finite weight run the check."""
    import pytest

    import zorse_fx.capture.trace as trace
    from zorse_fx.errors import ModelCaptureError

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(capture_cache.NO_CACHE_ENV, raising=False)
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(4))
    checks = []
    real_check = trace.check_mean_loss

    def counted(*args, **kwargs):
        checks.append(1)
        return real_check(*args, **kwargs)

    monkeypatch.setattr(trace, "check_mean_loss", counted)
    first = capture(_llama(0), (ids, ids))
    key = capture_cache.export_key(_llama(1), (ids, ids.clone()), ("input_ids", "labels"))
    assert len(checks) == 1 and capture_cache.load_loss_check(key) == first.loss_reduction == "token_mean"
    assert capture(_llama(1), (ids, ids)).loss_reduction == "token_mean" and len(checks) == 1  # read, not run
    capture(_llama(0, layers=3), (ids, ids))  # another key: checked
    assert len(checks) == 2
    monkeypatch.setenv(capture_cache.NO_CACHE_ENV, "1")
    capture(_llama(1), (ids, ids))
    assert len(checks) == 3
    monkeypatch.delenv(capture_cache.NO_CACHE_ENV)
    (tmp_path / "capture" / f"{key}.json").write_text('{"loss_reduction": "sum"}')  # not an answer: checked
    assert capture_cache.load_loss_check(key) is None
    capture(_llama(1), (ids, ids))
    assert len(checks) == 4 and capture_cache.load_loss_check(key) == "token_mean"
    broken = _llama(2)
    with torch.no_grad():
        broken.model.lm_head.weight.fill_(float("nan"))  # (tied: the embedding too)
    with pytest.raises(ModelCaptureError, match="must return the mean loss"):
        capture(broken, (ids, ids))  # a non-finite weight: run and checked, and refused as before
    assert len(checks) == 5


def test_recompiles_deferred_while_unlifting_give_the_same_module(tmp_path, monkeypatch):
    """[Note: recompiles deferred while unlifting] in capture/trace.py: the graph module read from the
    cache with ``ep.module()``'s recompiles deferred has the code, attributes and submodules of the one
    ``ep.module()`` makes with them, and computes the same loss."""
    import torch.fx as fx

    from zorse_fx.capture import trace

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(capture_cache.NO_CACHE_ENV, raising=False)
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(6))
    model = _llama(0)
    capture(model, (ids, ids))
    key = capture_cache.export_key(model, (ids, ids.clone()), ("input_ids", "labels"))
    deferred = trace._module_of(capture_cache.load_exported(key, model))
    plain = capture_cache.load_exported(key, model).module(**trace._NO_GUARDS)  # (neither with input guards)
    plain.graph._codegen = fx.graph.CodeGen()
    assert fx.GraphModule.recompile.__name__ == "recompile"  # (put back)
    for gm in (deferred, plain):
        trace._normalise(gm)
    assert deferred.code == plain.code and set(vars(deferred)) == set(vars(plain))
    assert [n for n, _ in deferred.named_modules()] == [n for n, _ in plain.named_modules()]
    assert torch.equal(deferred(ids, ids), plain(ids, ids))


def test_planned_schema_decoding_gives_torchs_records(tmp_path, monkeypatch):
    """[Note: schema records decoded by a plan per type] in capture/cache.py: a real program's JSON decoded
    within the block equals torch's own decoding of it, record for record."""
    from torch._export.serde import schema, serialize

    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(7))
    model = _llama(0)
    ep = torch.export.export(model, (ids, ids.clone()), strict=False).run_decompositions({})
    data = serialize.serialize(ep).exported_program
    plain = serialize._bytes_to_dataclass(schema.ExportedProgram, data)
    with capture_cache._planned_schema_decoding():
        assert serialize._dict_to_dataclass.__name__ == "decode"
        planned = serialize._bytes_to_dataclass(schema.ExportedProgram, data)
    assert serialize._dict_to_dataclass.__name__ == "_dict_to_dataclass"  # (put back)
    assert planned == plain and serialize._to_json_bytes(planned) == serialize._to_json_bytes(plain) == data
