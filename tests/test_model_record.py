"""A warm `zorse plan` without the model ([Note: a warm plan without the model] in zorse_fx/api.py): the
plan made from the capture cache's record is the plan made from the loaded model, file for file; another
weights file, sequence length or damaged record loads the model; --no-cache reads and writes no record."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from conftest import CLUSTERS

import zorse_fx.cli_runs as cli_runs
from zorse_fx.capture import cache as capture_cache
from zorse_fx.cli import main
from zorse_fx.models.hf import CACHE_ENV


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(capture_cache.NO_CACHE_ENV, raising=False)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    path = tmp_path / "tiny-llama"
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _plan(model_dir: Path, out: Path, *extra: str, seq_len: int = 16) -> int:
    return main(["plan", "--model", str(model_dir), "--cluster", str(CLUSTERS / "small_hetero.yaml"),
                 "--global-batch-size", "4", "--seq-len", str(seq_len), "--solver-budget", "0.5", *extra,
                 "-o", str(out)])


def _files(plan_dir: Path) -> dict[str, object]:
    """Every file of a plan directory; plan.json without its wall-clock fields."""

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if "wall" not in k}
        return [strip(v) for v in x] if isinstance(x, list) else x

    return {p.name: strip(json.loads(p.read_text())) if p.name == "plan.json" else p.read_bytes()
            for p in sorted(plan_dir.iterdir()) if p.is_file()}


def _loads(monkeypatch) -> list[str]:
    """The names of the models loaded from here on."""
    loaded: list[str] = []
    real = cli_runs._load_model

    def counted(name, **kw):
        loaded.append(name)
        return real(name, **kw)

    monkeypatch.setattr(cli_runs, "_load_model", counted)
    import zorse_fx.cli as cli

    monkeypatch.setattr(cli, "_load_model", counted)
    return loaded


def _records(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "cache" / "capture").glob("model-*.json"))


def test_a_recorded_plan_is_the_loaded_models_plan(model_dir, tmp_path, monkeypatch):
    loaded = _loads(monkeypatch)
    assert _plan(model_dir, tmp_path / "miss") == 0
    assert loaded == [str(model_dir)] and len(_records(tmp_path)) == 1
    record = json.loads(_records(tmp_path)[0].read_text())
    tied = record["tensors"]["model.model.embed_tokens.weight"][0]
    assert tied is not None and record["tensors"]["model.lm_head.weight"][0] == tied  # one file tensor
    kept = sorted((tmp_path / "cache" / "capture").glob("weights-*.pt"))
    assert len(kept) == 1 and kept[0].read_bytes() == (tmp_path / "miss" / "weights.pt").read_bytes()
    restored = []
    real = capture_cache.restore_weights
    monkeypatch.setattr(capture_cache, "restore_weights", lambda *a: restored.append(real(*a)) or restored[-1])
    assert _plan(model_dir, tmp_path / "hit") == 0
    assert loaded == [str(model_dir)] and restored == [True]  # no model loaded; weights.pt the kept copy
    assert _files(tmp_path / "hit") == _files(tmp_path / "miss")
    assert {"weights.pt", "hf_config.json", "plan.json", "plan_request.json", "stage_0.py"} <= set(
        _files(tmp_path / "hit"))
    weights = torch.load(tmp_path / "hit" / "weights.pt", weights_only=True)
    from transformers import AutoModelForCausalLM

    own = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert torch.equal(weights["model.model.embed_tokens.weight"], own["model.embed_tokens.weight"])


def test_another_weights_file_or_length_loads_the_model(model_dir, tmp_path, monkeypatch):
    loaded = _loads(monkeypatch)
    assert _plan(model_dir, tmp_path / "p1") == 0
    assert _plan(model_dir, tmp_path / "p2", seq_len=8) == 0  # another length: another key
    assert len(loaded) == 2 and len(_records(tmp_path)) == 2
    weights = next(model_dir.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # the file rewritten
    assert _plan(model_dir, tmp_path / "p3") == 0
    assert len(loaded) == 3 and len(_records(tmp_path)) == 3
    assert _files(tmp_path / "p3") == _files(tmp_path / "p1")


@pytest.mark.parametrize("damage", ["not json", '{"export_key": "0"}', ""])
def test_a_damaged_record_loads_the_model(model_dir, tmp_path, monkeypatch, caplog, damage):
    loaded = _loads(monkeypatch)
    assert _plan(model_dir, tmp_path / "p1") == 0
    for path in _records(tmp_path):
        path.write_text(damage)
    with caplog.at_level(logging.INFO, logger="zorse_fx"):
        assert _plan(model_dir, tmp_path / "p2") == 0
    assert len(loaded) == 2
    assert any("model record" in r.getMessage() for r in caplog.records)
    assert _files(tmp_path / "p2") == _files(tmp_path / "p1")
    assert json.loads(_records(tmp_path)[0].read_text())["tensors"]  # written again


def test_no_cache_reads_and_writes_no_record(model_dir, tmp_path, monkeypatch):
    loaded = _loads(monkeypatch)
    assert _plan(model_dir, tmp_path / "p1", "--no-cache") == 0
    assert not (tmp_path / "cache" / "capture").exists()
    assert _plan(model_dir, tmp_path / "p2") == 0
    assert _plan(model_dir, tmp_path / "p3", "--no-cache") == 0  # a record there, not read
    assert len(loaded) == 3 and len(_records(tmp_path)) == 1


def test_a_changed_copy_of_the_weights_is_written_afresh(model_dir, tmp_path, monkeypatch, caplog):
    """weights.pt's copy in the cache, changed (its size or modification time not the recorded ones), is
    not copied: weights.pt is written from the tensors (logged) and kept again."""
    assert _plan(model_dir, tmp_path / "p1") == 0
    first = _files(tmp_path / "p1")
    kept = next((tmp_path / "cache" / "capture").glob("weights-*.pt"))
    assert kept.stat().st_ino == (tmp_path / "p1" / "weights.pt").stat().st_ino  # kept as a link
    kept.write_bytes(kept.read_bytes()[:100])  # (p1's weights.pt too: the same file)
    with caplog.at_level(logging.INFO, logger="zorse_fx"):
        assert _plan(model_dir, tmp_path / "p2") == 0
    assert any("not as written" in r.getMessage() for r in caplog.records)
    assert _files(tmp_path / "p2") == first
    assert kept.read_bytes() == first["weights.pt"]  # kept again
