"""Refit a shipped GPU profile's calibration from the whole-graph points its GPU run recorded.

    .venv/bin/python bench/gpu_recalibrate.py [--check]

For each shipped profile measured on a GPU with a whole-graph check (``zorse_fx/profiles/H200.json``
with ``bench/results/gpu_h200.json``, ``H100-80GB.json`` with ``gpu_h100.json``): the measured
forward + backward of Llama-2 7B's first two layers (``profile_check.points[].measured_ms``, timed on
the GPU by ``zorse bench kernels --model llama2-7b --layers 2``) and the points it was calibrated at
are read back, and ``profiling.kernels_main.calibrate_graph`` fits the profile's ``calibration`` and
``node_overhead_ms`` again with today's pricing of the graph (``predict_fwd_bwd_ms``). The profile and
the record's ``profile_check`` (fit, note, every point's prediction and error) are rewritten; the
kernel timings are not touched. ``--check``: print the refit, write nothing.

Run it after a change to what the measured-profile path prices beyond the kernels themselves (the
runtime's gradient work, [Note: the runtime's gradient work] in zorse_fx/cost/roofline.py): the
calibration absorbs whatever the prices leave out, so a new term must not be counted twice.

Proves: the shipped profiles' calibration is the least-squares fit of today's prices to the same GPU
measurements (no GPU needed, no number from elsewhere). Cannot: anything the recorded points do not
measure (other models, other sequence lengths than 512/2048/4096 at micro-batches 1 and 4).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PROFILES = {"H200": "gpu_h200.json", "H100-80GB": "gpu_h100.json"}


def _graph(seq: int, layers: int):
    from zorse_fx.capture import analyse, capture
    from zorse_fx.models import published
    from zorse_fx.models.hf import CausalLMWithLoss

    ids = torch.zeros((2, seq), dtype=torch.long, device="meta")
    return analyse(capture(CausalLMWithLoss(published.build("llama2-7b", num_layers=layers)), (ids, ids.clone()),
                           method="export"))


def refit(device_type: str, record: str, *, write: bool) -> dict:
    from zorse_fx.cost.profile import KernelProfile
    from zorse_fx.profiling.kernels_main import calibrate_graph

    prof_path = ROOT / "zorse_fx" / "profiles" / f"{device_type}.json"
    rec_path = ROOT / "bench" / "results" / record
    prof = KernelProfile.load(prof_path)
    rec = json.loads(rec_path.read_text())
    check = rec["profile_check"]
    if check["model"] != "llama2-7b":
        raise SystemExit(f"{rec_path}: profile_check.model={check['model']!r}; this script rebuilds llama2-7b only")
    graphs = {seq: _graph(seq, check["layers"]) for seq in sorted({p["seq"] for p in check["points"]})}
    whole = [dict(seq=p["seq"], micro_batch=p["micro_batch"], fwd_bwd_ms=p["measured_ms"]) for p in check["points"]]
    at = [tuple(p) for p in check["calibrate_at"]]
    a, b, note, rows = calibrate_graph(prof, whole, graphs, at, check["precision"])
    old = (prof.calibration, prof.node_overhead_ms)
    print(f"{device_type}: calibration {old[0]:.4f} -> {a:.4f}, node overhead {1e3 * old[1]:.2f} -> {1e3 * b:.2f} us")
    for r in rows:
        print(f"  seq {r['seq']} micro-batch {r['micro_batch']}: measured {r['measured_ms']:.2f} ms, predicted "
              f"{r['predicted_ms']:.2f} ({100 * r['error']:+.1f}%{', fitted' if r['calibration_point'] else ''})")
    if write:
        notes = re.sub(r"calibration: llama2-7b: calibration [^:]*: fitted to the whole graph's measured fwd\+bwd at "
                       r"[^;]*", f"calibration: llama2-7b: {note} (refit by bench/gpu_recalibrate.py)", prof.notes)
        dataclasses.replace(prof, calibration=a, node_overhead_ms=b, notes=notes).save(prof_path)
        check.update(calibration=a, node_overhead_ms=b, note=note, points=rows)
        rec_path.write_text(json.dumps(rec, indent=1) + "\n")
    return dict(device_type=device_type, calibration=a, node_overhead_ms=b, before=old)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="print the refit, write nothing")
    args = ap.parse_args()
    for device_type, record in PROFILES.items():
        refit(device_type, record, write=not args.check)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
