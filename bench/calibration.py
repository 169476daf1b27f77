"""Calibrated against uncalibrated step predictions, on plans held out of the calibration (issue 49 item 2).

    .venv/bin/python bench/calibration.py [--steps 8] [--out bench/results/calibration.json]

Plans (``PLANS``, each ``conftest.fixed_plan`` of ``zorse_fx.models``' ``gpt``:
4 layers, 128 wide, 4 heads; sequence 64, global batch 16, fp32, on
small_hetero's 2 x A100 + 2 x T4, each rank a Gloo CPU process with one
thread, real text) are trained ``--steps`` steps each, one after another.
Then, for every plan j:

- **uncalibrated**: the objective's (and the simulator's) step for plan j
  against its measured step (median of its steps after the first);
- **self**: calibrated on plan j's run alone, re-predicting it (the one fitted
  number, the links' time per byte, makes this ~0 by construction: it checks
  the fit, not the model);
- **held out**: calibrated on every other plan's run together
  (``calibrate_runs``), predicting plan j: what a calibration is worth for a
  plan it did not see (other cuts, shares, micro-batch sizes, GPU counts).

Proves: how far the calibrated objective and simulator are from measured steps
of plans other than the ones calibrated on, on this CPU, against how far the
uncalibrated ones are. Cannot: speak for GPUs (a CPU rank's costs are not a
GPU's: fixed per-micro-batch costs of milliseconds, no overlap of compute and
communication on one thread); the box cases do the same with emulated links
and GPU speeds (bench/box.py, once they record timings).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import tempfile
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

SEQ, BATCH = 64, 16
#: name -> (GPUs per stage, samples per GPU of each micro-batch, micro-batches, cut blocks (None: even))
PLANS = {
    "dp_a100": (((0, 1),), ((4, 4),), 2, None),
    "one_a100": (((0,),), ((4,),), 4, None),
    "one_t4": (((2,),), ((2,),), 8, None),
    "pipe_even": (((0, 1), (2, 3)), ((2, 2), (2, 2)), 4, None),
    "pipe_skew": (((0,), (2, 3)), ((4,), (1, 3)), 4, None),
    "pipe_3": (((0,), (1,), (2, 3)), ((2,), (2,), (1, 1)), 8, None),
}


def _captured():
    from zorse_fx.capture import capture
    from zorse_fx.models.registry import load_model

    model, _ = load_model("gpt")
    ids = torch.randint(0, 256, (2, SEQ))
    return capture(model, (ids, ids))


def main() -> int:
    from conftest import CLUSTERS, fixed_plan, spawn_ranks
    from zorse_fx.cluster import Cluster
    from zorse_fx.cost.calibration import apply_calibration
    from zorse_fx.data import read_corpus, tokenize
    from zorse_fx.pricing import evaluate_plan, options_for_plan, price, simulate_plan
    from zorse_fx.profiling.calibrate import calibrate_runs

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--only", default=None, help="comma-separated plan names (default: all)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "calibration.json"))
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(PLANS)
    cluster = Cluster.from_yaml(CLUSTERS / "small_hetero.yaml")
    cap = _captured()
    rows = []
    with tempfile.TemporaryDirectory(prefix="zorse-calibration-") as tmp:
        d = Path(tmp)
        torch.save(tokenize(read_corpus("lee")), d / "tokens.pt")
        runs = {}
        for name in names:
            gpus, shares, m, cuts = PLANS[name]
            plan = fixed_plan(cap, gpus, shares, num_microbatches=m, global_batch_size=BATCH, cuts=cuts,
                              precision="fp32")
            plan.export(d / name / "plan")
            torch.save(cap.state(), d / name / "plan" / "weights.pt")
            spawn_ranks(d / name / "plan", plan.world_size,
                        ["--tokens", str(d / "tokens.pt"), "--steps", str(args.steps), "--out", str(d / name / "run")])
            runs[name] = (d / name / "run", plan, price(cap, cluster, options_for_plan(plan)))
            print(f"[bench] {name}: trained", flush=True)
        for name in names:
            run, plan, priced = runs[name]
            own = calibrate_runs([runs[name]]).runs[0]
            others = [runs[n] for n in names if n != name]
            cal = calibrate_runs(others)
            costs, devices, _ = apply_calibration(priced.costs, priced.devices, cal, precision=plan.precision)
            held = dataclasses.replace(priced, costs=costs, devices=devices, calibration=cal)
            measured = own.measured_step_s
            row = {"plan": name, "stages": len(plan.stages), "gpus": plan.world_size,
                   "microbatches": plan.num_microbatches, "measured_step_s": measured,
                   "objective_s": evaluate_plan(plan, priced).step_time_s,
                   "simulator_s": simulate_plan(plan, priced, p2p="gloo").step_time_s,
                   "self_objective_s": own.calibrated_objective_step_s,
                   "self_simulator_s": own.calibrated_simulated_step_s,
                   "held_out_objective_s": evaluate_plan(plan, held).step_time_s,
                   "held_out_simulator_s": simulate_plan(plan, held, p2p="gloo").step_time_s,
                   "held_out_bandwidth_fit": cal.bandwidth_fit}
            for k in ("objective_s", "simulator_s", "self_objective_s", "self_simulator_s", "held_out_objective_s",
                      "held_out_simulator_s"):
                row[k[:-2] + "_error"] = row[k] / measured - 1
            rows.append(row)
            print(f"[bench] {name}: measured {measured * 1e3:.1f} ms; objective {row['objective_s'] * 1e3:.2f} ms "
                  f"({row['objective_error']:+.0%}), self {row['self_objective_error']:+.1%}, held out "
                  f"{row['held_out_objective_error']:+.1%} (simulator {row['held_out_simulator_error']:+.1%})",
                  flush=True)
    errs = [abs(r["held_out_objective_error"]) for r in rows]
    out = {"date": date.today().isoformat(), "machine": platform.machine(),
           "command": "bench/calibration.py " + " ".join(sys.argv[1:]), "steps": args.steps,
           "model": f"gpt (4 x 128), seq {SEQ}, global batch {BATCH}, fp32, small_hetero, Gloo CPU ranks",
           "held_out_objective_abs_error_median": statistics.median(errs),
           "held_out_objective_abs_error_max": max(errs), "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"[bench] held-out |error| of the calibrated objective: median "
          f"{out['held_out_objective_abs_error_median']:.1%}, "
          f"max {out['held_out_objective_abs_error_max']:.1%}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
