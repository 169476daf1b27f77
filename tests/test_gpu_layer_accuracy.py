"""The public training-step table (``cost/step_reference_data.py``) is well
formed, and ``bench/gpu_layer_accuracy.py`` prices a case through the
project's capture and cost path, between the fully fused and the eager
prices; ``gpu_model.UNFUSED_FRACTION`` is re-fitted from its fit rows. No
assertion on the error size: that is a measurement (bench/README.md), not a
test."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

from zorse_fx.cost import gpu_model
from zorse_fx.cost.roofline import saved_activations_or_estimate
from zorse_fx.precision import precision_policy
from zorse_fx.cost.step_reference_data import EXTRA_SPECS, MODELS, STEP_POINTS

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.gpu_layer_accuracy import bert_graph, price_step, price_step_at, price_step_eager, spec_of  # noqa: E402


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
    # unfused elementwise kernels never cost less than partly fused chains,
    # which never cost less than fully fused ones
    assert price_step_eager(one_layer, spec, 8) > big["step_s"] > price_step_at(one_layer, spec, 8, 0.0)


def test_step_price_interpolates_between_fused_and_eager(one_layer):
    """``block_costs`` prices the chains at ``UNFUSED_FRACTION``; the step
    price is linear in the fraction, with the all-eager price (every
    elementwise node its own kernel, computed separately) at 1."""
    spec = dataclasses.replace(spec_of("V100-16GB"), sustained_fp16_flops_per_s=None)
    fused = price_step_at(one_layer, spec, 4, 0.0)
    eager = price_step_eager(one_layer, spec, 4)
    f = gpu_model.UNFUSED_FRACTION
    assert price_step_at(one_layer, spec, 4, 1.0) == pytest.approx(eager, rel=1e-12)
    assert price_step(one_layer, spec, 4)["step_s"] == pytest.approx(price_step_at(one_layer, spec, 4, f), rel=1e-12)
    assert price_step_at(one_layer, spec, 4, f) == pytest.approx(fused + f * (eager - fused), rel=1e-12)


def test_unfused_fraction_is_refitted_from_the_bert_large_rows(one_layer):
    """``gpu_model.UNFUSED_FRACTION`` is ``fit_unfused_fraction`` over the
    BERT-large rows of ``STEP_POINTS`` (the fit split of [Note: unfused
    fraction]). A step price is affine in the number of identical encoder
    layers, so the 24-layer price is ``p1 + 23 * (p2 - p1)`` from 1- and
    2-layer captures (the bench captures all 24)."""
    pol = precision_policy("fp16-mixed")
    graphs = [(g, saved_activations_or_estimate(g, pol)) for g in (one_layer, bert_graph("bert-large", num_layers=2))]
    layers = MODELS["bert-large"]["num_hidden_layers"]
    steps = []
    for p in STEP_POINTS:
        if p.model != "bert-large":
            continue
        spec = dataclasses.replace(spec_of(p.gpu), sustained_fp16_flops_per_s=None)
        fused = [price_step_at(g, spec, p.micro_batch, 0.0, acts) for g, acts in graphs]
        eager = [price_step_eager(g, spec, p.micro_batch, acts) for g, acts in graphs]
        steps.append((p.step_s, fused[0] + (layers - 1) * (fused[1] - fused[0]),
                      eager[0] + (layers - 1) * (eager[1] - eager[0])))
    assert len(steps) == 10
    fitted = gpu_model.fit_unfused_fraction(steps)
    assert 0.0 <= fitted <= 1.0
    assert round(fitted, 4) == gpu_model.UNFUSED_FRACTION


def test_class_pricing_ignores_measured_gemm(one_layer):
    spec = spec_of("A10")  # has a measured sustained GEMM rate in gpu_specs.csv
    assert spec.sustained_fp16_flops_per_s is not None
    table = price_step(one_layer, spec, 4)["step_s"]
    cls = price_step(one_layer, dataclasses.replace(spec, sustained_fp16_flops_per_s=None), 4)["step_s"]
    assert table != cls
