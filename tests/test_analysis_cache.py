"""The fake runs' answers kept beside a cached capture ([Note: the analysis cached] in
zorse_fx/capture/cache.py): a hit prices as a miss does, without the fake runs; another precision, another
graph or another model is a miss; a damaged record is a logged miss; $ZORSE_NO_CACHE reads and writes none."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import CLUSTERS

import zorse_fx.capture.analysis as analysis
import zorse_fx.cost.activations as activations
from zorse_fx.capture import capture
from zorse_fx.capture import cache as capture_cache
from zorse_fx.cluster import Cluster
from zorse_fx.models.hf import CACHE_ENV, CausalLMWithLoss
from zorse_fx.options import PlanOptions
from zorse_fx.pricing import price

_IDS = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(5))


def _llama(seed: int = 0, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return CausalLMWithLoss(LlamaForCausalLM(cfg))


def _priced(precision: str = "fp16-mixed", *, layers: int = 2, max_blocks: int = 64):
    captured = capture(_llama(layers=layers), (_IDS, _IDS))
    return captured, price(captured, Cluster.from_yaml(CLUSTERS / "small_hetero.yaml"),
                           PlanOptions(global_batch_size=8, precision=precision, max_blocks=max_blocks))


def _answer(captured, priced) -> tuple:
    """What pricing made of the graph: the blocks and their costs, and every node's batch-1 shapes and dtypes."""
    bg = priced.blocks
    vals = []
    for n in captured.graph_module.graph.nodes:
        v = n.meta["zorse"]["val_batch1"]
        ts = list(activations.tensors_in(v))
        vals.append((n.name, [(tuple(t.shape), tuple(t.stride()), t.dtype) for t in ts],
                     v if isinstance(v, (int, float, type(None))) else type(v).__name__ if not ts else None))
    return (bg.act_order, bg.blocks, bg.cut_tensors, bg.block_attrs, bg.specs, priced.costs, vals)


def _records(root, kind: str) -> list:
    return sorted((root / "capture").glob(f"{kind}-*.json"))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(capture_cache.NO_CACHE_ENV, raising=False)
    return tmp_path


def _no_fake_runs(monkeypatch) -> None:
    def refused(*a, **k):
        raise AssertionError("a fake run on a hit")

    monkeypatch.setattr(analysis, "_propagate", refused)
    monkeypatch.setattr(activations, "_SavedTensorRecorder", refused)


def test_a_hit_prices_as_a_miss_without_the_fake_runs(cache_dir, monkeypatch):
    captured, miss = _priced()
    assert len(_records(cache_dir, "analysis")) == 1 and len(_records(cache_dir, "activations")) == 1
    assert miss.blocks.captured.cache_key is not None
    with monkeypatch.context() as m:
        _no_fake_runs(m)
        again, hit = _priced()
    assert _answer(again, hit) == _answer(captured, miss)
    # another cut into blocks of the same graph: the same record, block sums of the same per-node bytes
    with monkeypatch.context() as m:
        _no_fake_runs(m)
        coarse_hit = _priced(max_blocks=3)
    coarse_miss = None
    with monkeypatch.context() as m:
        m.setenv(capture_cache.NO_CACHE_ENV, "1")
        coarse_miss = _priced(max_blocks=3)
    assert coarse_hit[1].blocks.num_blocks < hit.blocks.num_blocks
    assert _answer(*coarse_hit) == _answer(*coarse_miss)


def test_another_precision_graph_or_model_is_a_miss(cache_dir, monkeypatch):
    captured, _ = _priced("fp16-mixed")
    _priced("fp32")  # the same analysis, another measurement
    assert len(_records(cache_dir, "analysis")) == 1 and len(_records(cache_dir, "activations")) == 2
    _priced(layers=3)  # another model: another capture key
    assert len(_records(cache_dir, "analysis")) == 2 and len(_records(cache_dir, "activations")) == 3
    key = capture_cache.record_key(captured, "analysis")
    node = next(n for n in captured.graph_module.graph.nodes if n.op == "call_function")
    node.name = node.name + "_renamed"  # a graph changed after capture: another key
    assert capture_cache.record_key(captured, "analysis") != key
    monkeypatch.setenv(capture_cache.NO_CACHE_ENV, "1")
    assert capture_cache.record_key(captured, "analysis") is None


@pytest.mark.parametrize("damage", ["not json", '{"nodes": []}', '{"first_saved_bytes": 3}', ""])
def test_a_damaged_record_is_a_logged_miss(cache_dir, caplog, damage):
    captured, miss = _priced()
    for path in _records(cache_dir, "analysis") + _records(cache_dir, "activations"):
        path.write_text(damage)
    with caplog.at_level(logging.INFO, logger="zorse_fx"):
        again, hit = _priced()
    assert _answer(again, hit) == _answer(captured, miss)
    assert sum("record" in r.getMessage() and "not" in r.getMessage() for r in caplog.records) == 2
    for path in _records(cache_dir, "analysis") + _records(cache_dir, "activations"):  # written again
        assert path.read_text().startswith("{") and len(path.read_text()) > 100


def test_no_cache_reads_and_writes_no_record(cache_dir, monkeypatch):
    captured, miss = _priced()
    before = {p: p.read_bytes() for p in _records(cache_dir, "analysis") + _records(cache_dir, "activations")}
    for path in before:  # records that would give another answer, were they read
        path.write_text(path.read_text().replace('"float32"', '"float64"'))
    monkeypatch.setenv(capture_cache.NO_CACHE_ENV, "1")
    again, fresh = _priced()
    assert again.cache_key is None and _answer(again, fresh) == _answer(captured, miss)
    _priced("fp32")
    assert set(_records(cache_dir, "analysis") + _records(cache_dir, "activations")) == set(before)
