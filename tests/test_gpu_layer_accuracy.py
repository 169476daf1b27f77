"""The public training-step table (``cost/step_reference_data.py``) is well
formed, and ``bench/gpu_layer_accuracy.py`` prices a case through the
project's capture and cost path. No assertion on the error size: that is a
measurement (bench/README.md), not a test."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

from zorse_fx.cost import gpu_model
from zorse_fx.cost.step_reference_data import EXTRA_SPECS, MODELS, STEP_POINTS

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.gpu_layer_accuracy import bert_graph, price_step, price_step_eager, spec_of  # noqa: E402


def test_step_table_well_formed():
    seen = set()
    for p in STEP_POINTS:
        assert (p.model, p.gpu) not in seen, p
        seen.add((p.model, p.gpu))
        assert p.model in MODELS
        assert f"PyTorch_bert_{p.model.split('-')[1]}_squad_FP16/" in p.source, p.source
        spec = spec_of(p.gpu)
        assert gpu_model.has_class_model(spec), p.gpu
        assert p.micro_batch >= 1 and p.interval_steps >= 1 and p.interval_s > 0
        # the raw log is cited at a commit, with the lines read
        assert re.search(r"/blob/[0-9a-f]{40}/pytorch/results/.+\.txt \(iteration 51 at ", p.source), p.source
        if p.gpu in EXTRA_SPECS:
            assert "https://" in EXTRA_SPECS[p.gpu][-1]
        # steady-state step vs the log's own throughput (which includes the
        # first, slower steps): not faster (1% timing noise), and within 10%
        if p.reported_seq_per_s is None:
            assert "disagrees" in p.source
            continue
        implied = p.micro_batch / p.reported_seq_per_s
        assert 0.99 * p.step_s <= implied <= 1.10 * p.step_s, (p.gpu, p.step_s, implied)


@pytest.fixture(scope="module")
def one_layer():
    return bert_graph("bert-large", num_layers=1)


def test_price_step_runs_and_scales(one_layer):
    spec = spec_of(STEP_POINTS[0].gpu)
    small = price_step(one_layer, spec, 1)
    big = price_step(one_layer, spec, 8)
    # one layer + embeddings + SQuAD head of BERT-large's width
    m = MODELS["bert-large"]
    h, f, v = m["hidden_size"], m["intermediate_size"], m["vocab_size"]
    layer = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 2 * 2 * h
    embeddings = (v + 512 + 2) * h + 2 * h
    assert small["params"] == layer + embeddings + (2 * h + 2)
    assert small["optimizer_s"] == big["optimizer_s"] > 0
    assert big["fwd_bwd_s"] > small["fwd_bwd_s"] > 0
    # unfused elementwise kernels never cost less than fused chains
    assert price_step_eager(one_layer, spec, 8) >= big["step_s"]


def test_class_pricing_ignores_measured_gemm(one_layer):
    spec = spec_of("A10")  # has a measured sustained GEMM rate in gpu_specs.csv
    assert spec.sustained_fp16_flops_per_s is not None
    table = price_step(one_layer, spec, 4)["step_s"]
    cls = price_step(one_layer, dataclasses.replace(spec, sustained_fp16_flops_per_s=None), 4)["step_s"]
    assert table != cls
