"""bench/report.py: the "Current results" block of bench/README.md is what the result files say.

``--check`` against the committed README fails when a file under bench/results
was replaced without ``python bench/report.py --write``; the other tests feed
the script a hand-made results directory, so they fail when its rendering does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "report.py"


def _report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=False)  # (a hang bound, not a speed)


def _row(planner: str, tokens: float, feasible: bool, status: str) -> dict:
    """One scenarios.json row of a made-up scenario 'toy' (upper bound 200 tokens/s)."""
    return {"scenario": "toy", "planner": planner, "feasible": feasible, "tokens_per_s": tokens,
            "upper_bound_tokens_per_s": 200.0, "fraction_of_upper_bound": tokens / 200.0, "mfu": 0.25,
            "step_time_s": 2.0, "simulated_step_time_s": 1.9, "planner_wall_s": 3.5, "status": status,
            "num_stages": 2, "num_microbatches": 8, "interleave": 1, "gpus_used": 4}


def _toy_results(tmp_path: Path) -> Path:
    results = tmp_path / "results"
    results.mkdir()
    rows = [_row("zorse_fx", 120.0, True, "FEASIBLE"), _row("metis", 100.0, True, "BASELINE"),
            # faster but over memory: not the best *feasible* baseline
            _row("cephalo", 150.0, False, "BASELINE_INFEASIBLE")]
    (results / "scenarios.json").write_text(json.dumps(rows))
    return results


def test_readme_results_block_is_current():
    r = _report("--check")
    assert r.returncode == 0, r.stderr or r.stdout


def test_renders_a_scenario_against_its_best_feasible_baseline(tmp_path):
    r = _report("--results", str(_toy_results(tmp_path)))
    assert r.returncode == 0, r.stderr
    # zorse_fx 120 tokens/s = 60% of the bound, 1.20x metis (cephalo's 150 does not fit), 1.9 s / 2.0 s simulated
    assert "| toy |  | 120 (60%) | - | metis: 100 | 1.20x | 0.950 | - | 3.5 | FEASIBLE |" in r.stdout, r.stdout
    assert "| toy | cephalo | NO | 150 | 75% | 25.0% | - | 2 x 8 | 4 | 0.950 | BASELINE_INFEASIBLE | 3.5 |" in r.stdout
    assert "### Runtime against PyTorch" not in r.stdout  # files not in --results are skipped


def test_renders_the_rows_before_issue_50_beside_the_current_ones(tmp_path):
    """With ``scenarios_before_issue50.json`` beside scenarios.json, zorse_fx's tokens/s
    and planner seconds before sit next to the current ones (issue 32 item 6), and what
    zorse_fx chose, per-stage policies, idle GPUs and the polish, beside what it chose then
    (issue 50)."""
    results = _toy_results(tmp_path)
    before = dict(_row("zorse_fx", 100.0, True, "STAGE_DP"), planner_wall_s=250.0, planner_cpu_s=249.5,
                  sharded_stages=1, recompute_stages=0)
    (results / "scenarios_before_issue50.json").write_text(json.dumps([before]))
    rows = json.loads((results / "scenarios.json").read_text())
    for r in rows:
        if r["planner"] == "zorse_fx":
            r.update(stage_policies=["ZeRO-1", "ZeRO-1+rc"], idle_gpus=2, idle_gpu_types={"T4": 2},
                     all_gpus_step_time_s=2.5, all_gpus_source="BASELINE:metis", idle_reason="a slow link",
                     polish_from_step_time_s=2.1, polish_step_time_s=None)
    (results / "scenarios.json").write_text(json.dumps(rows))
    r = _report("--results", str(results))
    assert r.returncode == 0, r.stderr
    assert "| toy |  | 120 (60%) | 100 | metis: 100 | 1.20x | 0.950 | 250.0 / 249.5 | 3.5 | FEASIBLE |" in r.stdout
    assert "before: the same benchmark's rows before issue 50's changes to the planner (bench/results/" \
           "scenarios_before_issue50.json" in r.stdout
    assert "### Scenarios: what zorse_fx chose" in r.stdout
    line = next(x for x in r.stdout.splitlines() if x.startswith("| toy | 2 x 8, ") and "ZeRO-1, ZeRO-1+rc" in x)
    assert "no faster neighbour" in line and "2 (2 T4); every GPU: 2.5 s step (BASELINE:metis)" in line
    assert line.endswith("1 sharded / 0 recompute stages |"), line


def test_check_fails_on_a_stale_block_and_write_refreshes_it(tmp_path):
    results = _toy_results(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n<!-- report.py: begin -->\nSTALE-BLOCK\n<!-- report.py: end -->\n\nafter\n")
    r = _report("--results", str(results), "--readme", str(readme), "--check")
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1 and "stale" in r.stderr
    assert _report("--results", str(results), "--readme", str(readme), "--write").returncode == 0
    text = readme.read_text()
    assert "STALE-BLOCK" not in text and "| toy |  | 120 (60%)" in text
    assert text.endswith("<!-- report.py: end -->\n\nafter\n")
    assert _report("--results", str(results), "--readme", str(readme), "--check").returncode == 0


def test_box_pairs_ordered_alike_counts_only_pairs_the_measurement_tells_apart():
    """``_pairs_alike``: a pair whose measured ranges overlap is not counted; of the others, those the
    simulator orders as measured."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from report import _pairs_alike
    finally:
        sys.path.remove(str(ROOT / "bench"))

    def plan(lo: float, hi: float, sim: float) -> dict:
        return {"measured_min_s": lo, "measured_max_s": hi, "simulated_s": sim}

    # Measured a < b < c apart, d between them but overlapping b (not counted against b). Told apart:
    # (a,b) alike, (a,c) alike, (a,d) not (d simulated first), (b,c) not (swapped), (c,d) alike.
    plans = [plan(1.0, 1.1, 0.5), plan(2.0, 2.2, 0.9), plan(3.0, 3.1, 0.8), plan(2.1, 2.5, 0.1)]
    assert _pairs_alike(plans) == "3 of 5"


def test_box_rep_pairs_counts_only_pairs_every_repetition_orders(tmp_path):
    """bench/box.py ``rep_pairs`` ([Note: plans told apart by their repetitions]): a pair whose repetitions'
    medians interleave is a measured tie (not counted); of the pairs ordered, those the simulator orders
    alike, the others named; ``_rep_medians_from_runs`` reads each repetition's counted steps (after the
    first two) from the runs left; the report renders the count with its chance level."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from box import _rep_medians_from_runs, rep_pairs
        from report import _rep_pairs
    finally:
        sys.path.remove(str(ROOT / "bench"))

    # a < b apart in every repetition; c interleaves b (a tie); d slowest, simulated faster than c and b.
    plans = {"a": ([1.0, 1.1, 1.05, 1.02], 0.5), "b": ([2.0, 2.1, 2.05, 2.2], 0.9),
             "c": ([2.15, 1.99, 2.3, 2.12], 0.8), "d": ([3.0, 3.1, 3.2, 3.05], 0.7)}
    got = rep_pairs(plans)
    assert got == {"rep_pairs_ordered": 5, "rep_pairs_alike": 3, "rep_pairs_against": [["b", "d"], ["c", "d"]],
                   "rep_min": 4}
    assert _rep_pairs(got) == ("pairs every repetition orders (4 per plan, chance 0.029): 3 of 5 ordered alike; "
                               "against: b < d measured; against: c < d measured")
    assert _rep_pairs({}) == "repetitions' medians not recorded"
    runs = tmp_path / "runs"
    for rep, steps in enumerate(([9.0, 9.0, 1.0, 3.0, 2.0], [9.0, 9.0, 4.0])):
        (runs / f"p.{rep}").mkdir(parents=True)
        (runs / f"p.{rep}" / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": k + 1, "step_time_s": t}) + "\n" for k, t in enumerate(steps)))
    assert _rep_medians_from_runs(runs, "p") == [2.0, 4.0]
    assert _rep_medians_from_runs(runs, "q") == []


def test_box_reprice_refuses_a_case_without_its_runs_files(tmp_path):
    """``bench/box.py --reprice`` (no box, no root): a case not measured in --out, and one whose run left
    nothing in --work, are refused naming what to give; --out is left as it was."""
    out = tmp_path / "box.json"
    doc = {"cases": [{"case": "b_wan_pairs", "plans": [], "zorse_fx_sim_error": 0.0}]}
    out.write_text(json.dumps(doc))
    box = ROOT / "bench" / "box.py"

    def run(case: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(box), "--reprice", "--cases", case, "--out", str(out),
                               "--work", str(tmp_path / "work")], cwd=ROOT, capture_output=True, text=True,
                              timeout=600, check=False)

    r = run("b_wan_shared")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (f"bench/box.py --reprice: {out} has no measured plans of case "
                                                 f"b_wan_shared (only cases (a) and (b) are priced)")
    r = run("b_wan_pairs")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (
        f"bench/box.py --reprice: {tmp_path / 'work' / 'b_wan_pairs'} has no cluster_box.yaml and measured.json "
        f"of case b_wan_pairs's run; give the --work that run used")
    assert json.loads(out.read_text()) == doc
    missing = tmp_path / "none.json"
    r = subprocess.run([sys.executable, str(box), "--reprice", "--cases", "b_wan_pairs", "--out", str(missing)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 1 and not missing.exists()
    assert r.stderr.strip().splitlines()[-1] == (
        f"bench/box.py --reprice: --out {missing} does not exist; give the results file whose cases are re-priced "
        f"in place (a copy of bench/results/box.json)")
