"""bench/gpu_class_check.py: its prices are block_costs' own sums.

A synthetic ``gpu_measure.py`` record of the ``tiny`` Llama shape (made-up
milliseconds and GEMM rates, not a measurement) goes through the script's ``main``; the
test checks every predicted time and error against ``block_costs`` summed
here on the same captured graphs, and that the ``sweep`` pricing
runs matmuls at the record's bfloat16 GEMM rate.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("gpu_class_check", ROOT / "bench" / "gpu_class_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tiny_fwd_bwd(script, layers: int, seq: int, micro_batch: int, gpu) -> float:
    """fwd+bwd seconds of the tiny Llama on ``gpu``: block_costs summed here
    (on the script's cached capture: one capture per layer count)."""
    from zorse_fx.cost.roofline import block_costs
    from zorse_fx.precision import precision_policy

    bc = block_costs(script.llama_graph("tiny", layers, seq), {gpu.type: gpu}, precision=precision_policy("bf16-mixed"))
    return sum(p * micro_batch + f for p, f in zip(bc.fwd_bwd_s_per_sample[gpu.type], bc.fwd_bwd_s_fixed[gpu.type]))


def test_prices_are_block_costs_sums(tmp_path):
    from zorse_fx.cluster import gpu_spec

    seq = 32
    measured_ms = {(1, 1): 3.0, (2, 1): 5.0, (1, 4): 7.0, (2, 4): 12.0}
    layers = [dict(shape="tiny", layers=n, seq=seq, micro_batch=mb, fwd_ms=1.0, fwd_bwd_ms=ms)
              for (n, mb), ms in measured_ms.items()]
    layers.append(dict(shape="tiny", layers=1, seq=64, micro_batch=1, fwd_ms=1.0, fwd_bwd_ms=2.0))  # no 2-layer row
    gemm = [dict(m=64, n=64, k=64, mode="bfloat16", ms=1.0, tflops=100.0),
            dict(m=8192, n=8192, k=8192, mode="bfloat16", ms=1.0, tflops=0.01),
            dict(m=8192, n=8192, k=8192, mode="float32", ms=1.0, tflops=40.0)]
    src, out = tmp_path / "m.json", tmp_path / "out.json"
    src.write_text(json.dumps(dict(args=dict(device_type="H200"), layers=layers, gemm=gemm)))
    script = _script()
    assert script.main(["--measured", str(src), "--out", str(out)]) == 0
    res = json.loads(out.read_text())

    rows = res["rows"]
    assert [(r["seq"], r["micro_batch"]) for r in rows] == [(seq, 1), (seq, 4)]
    assert res["sweep_sustained_tflops"] == pytest.approx(0.01)
    h200 = gpu_spec("H200")
    gpus = {"class": dataclasses.replace(h200, sustained_fp16_flops_per_s=None),
            "sweep": dataclasses.replace(h200, sustained_fp16_flops_per_s=0.01e12)}
    for r in rows:
        mb = r["micro_batch"]
        assert r["measured_layer_s"] == pytest.approx((measured_ms[(2, mb)] - measured_ms[(1, mb)]) * 1e-3)
        for name, gpu in gpus.items():
            one, two = _tiny_fwd_bwd(script, 1, seq, mb, gpu), _tiny_fwd_bwd(script, 2, seq, mb, gpu)
            assert r[f"{name}_one_s"] == pytest.approx(one, rel=1e-12)
            assert r[f"{name}_two_s"] == pytest.approx(two, rel=1e-12)
            assert r[f"{name}_layer_s"] == pytest.approx(two - one, rel=1e-9)
            assert r[f"{name}_two_err"] == pytest.approx(two / (measured_ms[(2, mb)] * 1e-3) - 1, rel=1e-9)
            assert r[f"{name}_layer_err"] == pytest.approx(
                (two - one) / ((measured_ms[(2, mb)] - measured_ms[(1, mb)]) * 1e-3) - 1, rel=1e-9)
    # A 10 GFLOP/s sweep rate makes the tiny model's matmuls compute-bound and slower than the class rate.
    assert all(r["sweep_two_s"] > r["class_two_s"] for r in rows)
    summ = {(d["pricing"], d["rows"]): d for d in res["summary"]}
    assert summ[("class", "all")]["two_max_abs_err"] == pytest.approx(max(abs(r["class_two_err"]) for r in rows))
