"""``zorse train --rebalance`` against a plan made from scratch for the slowed cluster (issue 49 item 3).

    .venv/bin/python bench/rebalance.py [--steps 80] [--slow 3] [--out bench/results/rebalance.json]

The plan: ``zorse plan --model gpt --cluster small_hetero --planner stage_dp
--precision fp32 --global-batch-size 32 --seq-len 32`` (data parallel over the
two A100s, 16 samples each; each rank a Gloo CPU process, one thread; the Lee
corpus as bytes). Three runs of ``--steps`` steps, one after another, GPU 1
made ``--slow`` x slower (``--slow-gpu 1:SLOW``):

1. **rebalanced**: ``zorse train --rebalance``; measured: the re-plan's time
   (from the end of the last step the calibration used to the first step of the
   resumed run: checking, calibrating, planning, stopping with a checkpoint,
   starting the ranks again), the median step before and after;
2. **from scratch**: the same plan trained without ``--rebalance``,
   ``zorse calibrate`` on its steps, ``zorse plan --calibration`` (the plan
   made from scratch for the slowed cluster), trained from step 1; its median
   step after the first two;
3. the median step of the first plan with nothing slowed (for scale).

Proves: on this machine, whether the rebalanced run's step reaches the plan
made from scratch (the issue's bar: within 15%) and how long the re-plan takes
(bar: 30 s). Cannot: GPUs, or a cluster where re-planning trades links against
compute (one node, DP only); the watcher's own CPU work (capture, pricing) runs
beside the two ranks on a 2-core machine and slows the steps it measures.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rows(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def main() -> int:
    from zorse_fx.cli import main as zorse
    from zorse_fx.data import read_corpus
    from zorse_fx.runtime.timings import read_timings

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--slow", type=float, default=3.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "rebalance.json"))
    args = ap.parse_args()
    cluster = str(ROOT / "examples" / "clusters" / "small_hetero.yaml")
    plan_args = ["--model", "gpt", "--cluster", cluster, "--planner", "stage_dp", "--precision", "fp32",
                 "--global-batch-size", "32", "--seq-len", "32"]
    slow = ["--slow-gpu", f"1:{args.slow:g}"]
    with tempfile.TemporaryDirectory(prefix="zorse-rebalance-") as tmp:
        d = Path(tmp)
        (d / "lee.txt").write_text(read_corpus("lee"))
        assert zorse(["plan", *plan_args, "-o", str(d / "plan")]) == 0
        data = ["--corpus", str(d / "lee.txt"), "--steps", str(args.steps)]
        assert zorse(["train", str(d / "plan"), *data, "--out", str(d / "rb"), "--rebalance", *slow]) == 0
        rows = _rows(d / "rb")
        resumed = next((r["step"] for r in rows if r["plan_hash"] != rows[0]["plan_hash"]), None)
        if resumed is None:
            raise SystemExit("bench/rebalance.py: the run did not rebalance; more --steps?")
        cal = json.loads((d / "rb" / "calibration.rebalance1.json").read_text())
        window_end = cal["runs"][0]["steps"][-1]
        lines = {t.step: t for t in read_timings(d / "rb" / "timings.jsonl")}
        end = lines[window_end].ranks[0].start_unix_s + lines[window_end].step_time_s
        replan_s = lines[resumed].ranks[0].start_unix_s - end
        before = statistics.median(r["step_time_s"] for r in rows[1:resumed - 1])
        after = statistics.median(r["step_time_s"] for r in rows[resumed + 1:])
        assert zorse(["train", str(d / "plan"), *data, "--out", str(d / "slow"), *slow]) == 0
        assert zorse(["calibrate", str(d / "slow"), "--model", "gpt", "--cluster", cluster]) == 0
        assert zorse(["plan", *plan_args, "--calibration", str(d / "slow" / "calibration.json"),
                      "-o", str(d / "scratch_plan")]) == 0
        assert zorse(["train", str(d / "scratch_plan"), *data, "--out", str(d / "scratch"), *slow]) == 0
        scratch = statistics.median(r["step_time_s"] for r in _rows(d / "scratch")[2:])
        assert zorse(["train", str(d / "plan"), *data, "--out", str(d / "fast")]) == 0
        fast = statistics.median(r["step_time_s"] for r in _rows(d / "fast")[2:])

        def layout(plan_dir: Path) -> str:
            p = json.loads((plan_dir / "plan.json").read_text())
            return " | ".join(", ".join(f"GPU {g['gpu']} x{g['samples_per_microbatch']}" for g in s["gpus"])
                              for s in p["stages"]) + f" ({p['num_microbatches']} micro-batches)"

        row = {"date": date.today().isoformat(), "machine": platform.machine(),
               "command": "bench/rebalance.py " + " ".join(sys.argv[1:]), "steps": args.steps, "slow": args.slow,
               "plan": layout(d / "plan"), "rebalanced_plan": layout(d / "rb" / "plan.rebalance1"),
               "scratch_plan": layout(d / "scratch_plan"), "resumed_at_step": resumed,
               "calibrated_on_steps": cal["runs"][0]["steps"], "replan_to_resume_s": replan_s,
               "step_before_s": before, "step_after_s": after, "step_scratch_s": scratch, "step_unslowed_s": fast,
               "after_over_scratch": after / scratch}
    Path(args.out).write_text(json.dumps(row, indent=1) + "\n")
    print(f"[bench] rebalanced at step {resumed} ({replan_s:.1f} s from the calibrated steps to the resumed step): "
          f"step {before * 1e3:.1f} -> {after * 1e3:.1f} ms; a plan from scratch for the slowed cluster "
          f"{scratch * 1e3:.1f} ms (after / scratch {row['after_over_scratch']:.2f}); nothing slowed "
          f"{fast * 1e3:.1f} ms; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
