"""``make gpu-check``'s CPU dry run (bench/gpu_check.py ``--dry-run``): the
same two phases as on a GPU -- plans made here, then the kernel tests (a
subset, interpreted), training over the plan as a world of one, the step-1
loss against the single-process Hugging Face model under the same autocast,
and a resume from the middle checkpoint -- with a 2-layer model of the same
family and Gloo, so the command cannot rot while no GPU is at hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    script = str(ROOT / "bench" / "gpu_check.py")
    subprocess.run([sys.executable, script, "prepare", "--dry-run", "--out", str(tmp_path / "prep"), "--types",
                    "H200", "--no-wheels"], env=env, check=True, capture_output=True, timeout=600)
    r = subprocess.run([sys.executable, script, "run", "--dry-run", "--prepared", str(tmp_path / "prep"), "--out",
                        str(tmp_path / "out"), "--kernels-k", "test_forward and rmsnorm"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu_check_H200_dry.json").read_text())
    assert report["ok"] and report["dry_run"] and report["gpu_type"] == "H200"
    assert report["kernels"]["ok"] and " passed" in report["kernels"]["summary"]
    train = report["train"]
    # bf16-mixed as on the GPU; both sides round the same ops in bfloat16 (8 bits: 2^-8 per rounding).
    assert train["precision"] == "bf16-mixed" and train["relative_difference"] <= 2e-3
    assert len(train["losses"]) == 4 and train["losses"][-1] < train["losses"][0]
    assert report["resume"]["ok"] and report["resume"]["steps"] == [3, 4]
    assert report["memory"]["predicted_peak_bytes"] > 0 and report["memory"]["measured_peak_bytes"] is None
    assert report["step_time"]["predicted_s"] > 0 and report["step_time"]["measured_median_s"] > 0
    off = report["offload"]  # (f): optimizer and activations offloaded, the same losses
    assert off["ok"] and off["steps"] == 4 and off["relative_difference"][0] <= 2e-3, off
    assert off["predicted_host_bytes"] > 0 and off["predicted_step_s"] > report["step_time"]["predicted_s"]
    st = report["stash"]  # (i): recomputation from the blocks' inputs in host memory, the same losses
    assert st["ok"] and st["steps"] == 4 and st["relative_difference"][0] <= 2e-3, st
    assert st["predicted_host_bytes"] > 0 and st["predicted_peak_bytes"] < report["memory"]["predicted_peak_bytes"]
    hf = report["hf"]  # (g): Hugging Face eager and torch.compile'd (aot_eager on a CPU), the same batches
    assert hf["ok"] and hf["compiled"]["backend"] == "aot_eager" and len(hf["eager"]["losses"]) == hf["steps"]
    # the same model, weights and first batch in the same precision: the first step's loss is the run's
    assert abs(hf["eager"]["losses"][0] - train["hf_step1_loss"]) <= 2e-3 * abs(train["hf_step1_loss"])
    assert hf["eager"]["tokens_per_s"] > 0 and hf["compiled"]["tokens_per_s"] > 0
    cal = report["calibration"]  # (h): the run's timings against the shipped profile's and the class model's prices
    assert cal["ok"] and (tmp_path / "out" / "calibration_H200_dry.json").is_file()
    for label in ("shipped_profile", "class_model"):
        assert cal[label]["forward_measured_s"] > 0 and cal[label]["backward_priced_s"] > 0
    assert cal["class_model"]["sources"] != cal["shipped_profile"]["sources"]
