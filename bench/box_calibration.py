"""Calibrated against uncalibrated step predictions on a box case's measured plans (issue 49; issue 47).

    .venv/bin/python bench/box_calibration.py --case a_shared_nic --work /tmp/zorse_box_bench [--out FILE]

Reads what ``bench/box.py`` left in ``--work`` for one time case (its cluster in the box's units,
``cluster_box.yaml``; the box's measured kernel profiles and link fits, ``measured.json``; each plan's
directory under ``plans/`` and each repetition's run under ``runs/<plan>.<rep>``, with its
``timings.jsonl``: runs of bench/box.py from 2026-12-06 on). Per plan, priced as bench/box.py prices it
(its profiles; fp32): the objective's and the simulator's error against the plan's measured step
(every repetition's steps after the first two, as bench/box.py counts them) uncalibrated, calibrated on
the plan's own runs, and calibrated on every other plan's runs of the case (held out).

Proves: whether calibrating on a box's own runs brings the objective and simulator to the measured steps
of plans the calibration did not see, on emulated links and GPU speeds (CPU quotas). Cannot: a real GPU
cluster (the box's GPUs are CPU quotas; its links Linux's shaping); no root needed (no box is started).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> int:
    import dataclasses

    import torch

    from box import CASES  # bench/box.py
    from zorse_fx.capture import capture
    from zorse_fx.cluster import Cluster
    from zorse_fx.cost.calibration import apply_calibration
    from zorse_fx.models.registry import load_model
    from zorse_fx.plan import Plan
    from zorse_fx.pricing import evaluate_plan, options_for_plan, price, simulate_plan
    from zorse_fx.profiling.calibrate import calibrate_runs

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", required=True, choices=sorted(CASES))
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "box_calibration.json"),
                    help="JSON the case's rows go into (other cases' rows kept)")
    args = ap.parse_args()
    case, work = CASES[args.case], Path(args.work)
    profiles = tuple(json.loads((work / "measured.json").read_text())["profiles"].values())
    cluster = Cluster.from_yaml(work / "cluster_box.yaml")
    model, _ = load_model(case.model)
    ids = torch.zeros(2, case.seq_len, dtype=torch.long)
    captured = capture(model, (ids, ids))
    plans = {}
    for d in sorted((work / "plans").iterdir()):
        runs = sorted(p for p in (work / "runs").glob(f"{d.name}.*") if (p / "timings.jsonl").exists())
        if runs:
            plan = Plan.load(d)
            plans[d.name] = (plan, runs, price(captured, cluster, options_for_plan(plan, profiles=profiles)))
    if len(plans) < 2:
        raise SystemExit(f"bench/box_calibration.py: {work} has {len(plans)} plan(s) with timings; a box run of "
                         f"2026-12-06 or later records them")
    rows = []
    for name, (plan, runs, priced) in plans.items():
        recs = [json.loads(ln) for r in runs for ln in (r / "metrics.jsonl").read_text().splitlines()]
        measured = statistics.median(rec["step_time_s"] for rec in recs if rec["step"] > 2)

        def predict(cal):
            costs, devices, _ = apply_calibration(priced.costs, priced.devices, cal, precision=plan.precision)
            p = dataclasses.replace(priced, costs=costs, devices=devices, calibration=cal)
            return evaluate_plan(plan, p).step_time_s, simulate_plan(plan, p, p2p="gloo").step_time_s

        own = calibrate_runs([(r, plan, priced) for r in runs], warmup=2)
        held = calibrate_runs([(r, p, pr) for n, (p, rs, pr) in plans.items() if n != name for r in rs], warmup=2)
        rows.append({"plan": name, "measured_s": measured,
                     "objective_s": evaluate_plan(plan, priced).step_time_s,
                     "simulated_s": simulate_plan(plan, priced, p2p="gloo").step_time_s,
                     "self_s": predict(own), "held_out_s": predict(held), "held_out_bandwidth_fit": held.bandwidth_fit})
        r = rows[-1]
        print(f"{name[:40]:<40} measured {measured:.3f} s; objective {r['objective_s'] / measured - 1:+.0%} "
              f"simulator {r['simulated_s'] / measured - 1:+.0%}; self {r['self_s'][0] / measured - 1:+.1%}/"
              f"{r['self_s'][1] / measured - 1:+.1%}; held out {r['held_out_s'][0] / measured - 1:+.1%}/"
              f"{r['held_out_s'][1] / measured - 1:+.1%} (objective/simulator)", flush=True)
    out = Path(args.out)
    doc = json.loads(out.read_text()) if out.exists() else {"cases": []}
    doc["cases"] = [c for c in doc["cases"] if c["case"] != args.case] + [{
        "case": args.case, "work": str(work), "date": datetime.date.today().isoformat(),
        "command": "bench/box_calibration.py " + " ".join(sys.argv[1:]), "rows": rows}]
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
