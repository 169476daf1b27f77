"""The "Current results" tables of bench/README.md, rendered from bench/results/*.json.

    python bench/report.py            # print the Markdown
    python bench/report.py --write    # replace the block between the markers in bench/README.md
    python bench/report.py --check    # exit 1 if that block differs from what --write would put there
        [--results DIR] [--readme FILE]

One table (or a few) per benchmark, from the result files each benchmark
writes (``RESULT_FILES``); under each, the command that produced it, the
machine and the date. Where a file records them (``runtime.json`` rows,
``gpu_h100.json``, ``gpu_h200.json``, ``gpu_class_check*.json``,
``gpu_layer_accuracy.json``, ``comm_loopback.json``'s ``measured_at``) they
come from the file; otherwise from ``PROVENANCE`` below, copied from the
section of bench/LOG.md (or bench/README.md) that reports the run, named in a
comment at each entry. Files of superseded runs (``SUPERSEDED``) are not
rendered: bench/LOG.md reports them. A file missing from ``--results`` is
skipped, so a partial results directory renders what it has.

Standard library only (no torch, no zorse_fx import, no network): the
scenario descriptions are read from ``bench/scenarios.py``'s source with
``ast``, and the bound-gap verdict is ``bench/bound_gap.verdict``'s rule,
restated in ``verdict``. The output is deterministic: rows in a fixed order,
numbers at a fixed precision.

``tests/test_bench_report.py`` runs ``--check``, so a result file replaced
without ``--write`` fails the tests.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
README = ROOT / "bench" / "README.md"
BEGIN = "<!-- report.py: begin -->"
END = "<!-- report.py: end -->"

#: Result files rendered, in the order of their tables.
RESULT_FILES = (
    "scenarios.json",
    "bound_gap.json",
    "scaling.json",
    "objective_vs_sim.json",
    "runtime.json",
    "cost_accuracy.json",
    "memory_cpu.json",
    "memory_cpu_layouts.json",
    "memory_cpu_recompute.json",
    "offload_cpu.json",
    "comm_loopback.json",
    "gpu_h100.json",
    "gpu_h200.json",
    "gpu_class_check_h100.json",
    "gpu_class_check.json",
    "gpu_layer_accuracy.json",
    "box.json",
    "timings_overhead.json",
    "calibration.json",
    "rebalance.json",
    "box_calibration.json",
    "plan_cli.json",
    "drift_probe.json",
)

#: The runs before issue 32 (the planner in seconds), kept to show its planner
#: times before and after side by side (issue 32 item 6): ``render_scenarios`` and
#: ``render_scaling`` read the matching zorse_fx row of these.
BEFORE = {
    "scenarios.json": "scenarios_before_issue50.json",
    "scaling.json": "scaling_before_issue32.json",
}
#: Where the BEFORE files' rows come from (their own provenance in PROVENANCE's older entries,
#: bench/LOG.md's sections named there).
BEFORE_NOTES = {
    "scenarios.json": ("before: the same benchmark's rows before issue 50's changes to the planner (bench/results/"
                       "{file}: every scenario at 83cdc2a, 2026-12-02 03:50-03:57, the project's 2-core CPU machine, "
                       "alone; bench/LOG.md \"Heuristics side by side, the budget respected, the scenarios re-run\")"),
    "scaling.json": ("before: the same benchmark's rows before issue 32 (bench/results/{file}: scaling at 1752332, "
                     "2026-11-28 01:25), on the same machine, often beside other runs"),
}

#: Files under bench/results that are logs of superseded runs, not rendered (bench/LOG.md reports them).
SUPERSEDED = {
    "scenarios_max8.json": "issue 11's 8-stage FlashFlex and Zorse C run, under issue 11's pricing",
    "scenarios_sailor_issue13.json": "Sailor alone on 2026-11-24, before the network terms",
    "scenarios_zorse_c_shared_wan.json": "Zorse C's 8-stage run; its rows are copied into scenarios.json",
    "bound_gap_issue13_log.txt": "the bound-gap run of 2026-11-25, stopped before it wrote its json",
    "scenarios_before_issue32.json": "the scenario rows before issue 32 (66b3dec-faba7a3, 2026-11-26/27), the "
                                     "before file until issue 50",
    "scenarios_cb7ceac.json": "every scenario at cb7ceac (2026-12-07 18:59-19:06), before issue 50 item 7 priced "
                              "the runtime's gradient work",
    "scenarios_a72d135.json": "every scenario at a72d135 (2026-12-07 20:55-21:10), before the stage DP put a tied "
                              "model's ends on one node",
    "scenarios_06c8c7c.json": "every scenario at 06c8c7c (2026-12-08 00:08-00:25, a slow hour), before host-stashed "
                              "recomputation and the Zorse files' host memory: the same plans",
    "scenarios_32103ad.json": "every scenario at 32103ad (2026-12-08 02:29-02:35), before recomputation's kept "
                              "inputs were priced in the dtypes the stage holds them (FlashFlex's plan differs)",
}

SCENARIO_ORDER = ("metis", "amp", "zorse_a", "flashflex", "zorse_b", "zorse_c", "sailor")
PLANNER_ORDER = ("zorse_fx", "homogeneous_all", "homogeneous_best", "cephalo", "zorse_paper", "metis", "flashflex")
VARIANTS = ("real", "ideal_links", "ideal_memory", "ideal_both")
FAMILY_ORDER = ("tests (random_instance)", "scaling (planner_scaling.py)", "metis", "amp")
#: |simulated / objective - 1| at most this counts as "within 5%".
WITHIN = 0.05
CPU_MACHINE = "the project's 2-core CPU machine (AMD EPYC)"

# Command, code, machine and date of the runs whose result files do not record them. Each entry names
# the section that reports the run: bench/LOG.md's dated sections, or bench/README.md's method notes.
PROVENANCE = {
    "scenarios.json": {
        # bench/LOG.md, "Recomputation with host-stashed block inputs, per-chunk policies when interleaving
        # (issue 50 items 2-3, 2026-12-08, twenty-eighth session)"; the rows before are in
        # scenarios_before_issue50.json (their run: bench/LOG.md, "Heuristics side by side, the budget respected,
        # the scenarios re-run (issue 32, 2026-12-02, eleventh session)", code 83cdc2a); the runs before this one:
        # scenarios_32103ad.json, scenarios_06c8c7c.json, scenarios_a72d135.json, scenarios_cb7ceac.json
        tuple(SCENARIO_ORDER): dict(
            command="bench/scenarios.py --out DIR (every scenario in one run; zorse_c's own --max-stages 8), --jobs "
            "default (2)", code="41c758f", machine=f"{CPU_MACHINE}, alone, a fast hour (the unchanged baselines' "
            "planner seconds 1/3.1-1/3.4 of 06c8c7c's run)", date="2026-12-08 03:20-03:27"),
    },
    "bound_gap.json": {
        # bench/LOG.md, "What bounds each scenario, re-run under the NCCL program (issue 13 item 3,
        # 2026-11-26, eleventh session)"
        (("metis", "amp"), ("real", "ideal_memory")): dict(
            command="bench/bound_gap.py --only metis,amp --variants real,ideal_memory --solver-budget 5",
            code="66b3dec", machine=f"{CPU_MACHINE}, beside other runs", date="2026-11-26 18:50-19:06"),
        (("zorse_a",), ("real", "ideal_memory")): dict(
            command="bench/bound_gap.py --only zorse_a --variants real,ideal_memory --solver-budget 5",
            code="66b3dec", machine=f"{CPU_MACHINE}, beside other runs", date="2026-11-26 19:07-19:29"),
        # bench/LOG.md, "What bounds each scenario, re-run (issue 13 item 3, 2026-11-26, ninth session)"
        (("metis", "amp"), ("ideal_links", "ideal_both")): dict(
            command="bench/bound_gap.py --only metis,amp --solver-budget 5", code="968387e",
            machine=f"{CPU_MACHINE}, beside a CI run", date="2026-11-26 12:36-13:23"),
        (("zorse_a",), ("ideal_links", "ideal_both")): dict(
            command="bench/bound_gap.py --only zorse_a --solver-budget 5", code="968387e",
            machine=f"{CPU_MACHINE}, beside a CI run", date="2026-11-26 13:07-14:06"),
        # bench/LOG.md, "FlashFlex planned with up to 8 stages (issue 13 item 3, 2026-11-26, twelfth session)"
        (("flashflex",), ("real", "ideal_links")): dict(
            command="bench/bound_gap.py --only flashflex --variants real,ideal_links --solver-budget 5",
            code="0a1151c", machine=f"{CPU_MACHINE}, beside other runs", date="2026-11-26 20:39-21:19"),
        (("flashflex",), ("ideal_memory", "ideal_both")): dict(
            command="bench/bound_gap.py --only flashflex --variants ideal_memory,ideal_both --solver-budget 5",
            code="0a1151c", machine=f"{CPU_MACHINE}, beside `make test`, `make demo` and a CI run",
            date="2026-11-26 20:58-22:19"),
        # bench/LOG.md, "What bounds each scenario: re-planning on idealised clusters (issue 4, 2026-11-22,
        # fifth session)": issue 4's pricing, CP-SAT under a 5 s wall-clock limit per candidate
        (("zorse_b", "zorse_c", "sailor"), VARIANTS): dict(
            command="bench/bound_gap.py --time-limit 5", note="issue 4's code and pricing",
            machine=f"{CPU_MACHINE}, partly beside `make test`", date="2026-11-22 12:13-13:04"),
    },
    # bench/LOG.md, "Heuristics side by side, the budget respected, the scenarios re-run (issue 32,
    # 2026-12-02, eleventh session)"
    "scaling.json": dict(
        command="bench/planner_scaling.py", note="5 deterministic CP-SAT seconds for the whole search, the "
                                                 "default; --jobs default (2)",
        code="83cdc2a", machine=f"{CPU_MACHINE}, alone", date="2026-12-02 03:57-04:00"),
    # bench/README.md, method note "Sharded holders of a tied parameter"
    "objective_vs_sim.json": dict(
        command=("bench/objective_vs_sim.py --only amp,metis --solver-budget 1 --seeds 40 "
                 "--scaling 8x16,16x16,32x32,64x40,128x40,256x40,512x40,1024x40"),
        code="66b3dec", machine=f"{CPU_MACHINE}, shared with a scenario run", date="2026-11-26 18:37-18:44"),
    # bench/LOG.md, "Cost-model accuracy on CPU (issue 3)"
    "cost_accuracy.json": dict(
        command="bench/cost_accuracy.py", note="issue 3's code, before the ZeRO-1 all-gather row",
        machine=f"{CPU_MACHINE}, 1 thread per rank, torch 2.13.0+cpu; cluster bench/clusters/cpu_local.yaml",
        date="2026-11-22"),
    "memory_cpu.json": dict(command="bench/memory_cpu.py", note="fp32, one stage, 2 micro-batches of 4 x 64 tokens",
                            machine=f"{CPU_MACHINE}, 1 thread, torch 2.13.0+cpu", date="2026-11-28"),
    "memory_cpu_layouts.json": dict(
        command="bench/memory_cpu.py", note="one stage over 2 Gloo ranks, samples 2:2, shards 3:1, 2 micro-batches "
                                            "of 4 x 32 tokens",
        machine=f"{CPU_MACHINE}, 1 thread per rank, torch 2.13.0+cpu", date="2026-11-28"),
    # bench/LOG.md, "Recomputation with host-stashed block inputs (issue 50 item 2)"
    "memory_cpu_recompute.json": dict(
        command="bench/memory_cpu.py", note="fp32, one stage on one GPU, a 4-layer Llama 64 wide at 256 tokens, "
                                            "2 micro-batches of 4",
        machine=f"{CPU_MACHINE}, 1 thread, torch 2.13.0+cpu", date="2026-12-08"),
    # bench/LOG.md, "Optimizer and activation offload (issue 31 item 3)"
    "offload_cpu.json": dict(command="bench/offload_cpu.py", note="2^23 float32 parameters, best of 5",
                             machine=f"{CPU_MACHINE}, alone", date="2026-11-28"),
    # bench/LOG.md, "Links of this machine (issue 3)"
    "comm_loopback.json": dict(
        command="zorse bench comm --out bench/results/comm_loopback.json --plot bench/results/comm_loopback.png",
        note="2 Gloo ranks on loopback, 1 KiB - 4 MiB, 20 iterations", machine=CPU_MACHINE),
    # bench/README.md, "One H200 measured" (the file records no date)
    "gpu_h200.json": dict(date="2026-11-26"),
    # bench/README.md, "One H100 measured", "The class model with the masked attention rate (item 1)": both
    # files re-made on 2026-11-26 by the commands they record, pricing only
    "gpu_class_check.json": dict(machine=f"{CPU_MACHINE} (pricing only, no GPU)", date="2026-11-26"),
    "gpu_class_check_h100.json": dict(machine=f"{CPU_MACHINE} (pricing only, no GPU)", date="2026-11-26"),
    # bench/README.md, method note "Elementwise chains stop at matmuls" (UNFUSED_FRACTION re-fitted)
    "gpu_layer_accuracy.json": dict(machine=f"{CPU_MACHINE} (no GPU)", date="2026-11-26"),
}


# ---------------------------------------------------------------- formatting


def _int(x: float) -> str:
    return f"{round(x):,}"


def _pct(x: float, digits: int = 0) -> str:
    return f"{100 * x:.{digits}f}%"


def _err(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _r3(x: float) -> str:
    return f"{x:.3f}"


def _s(x: float, digits: int = 1) -> str:
    return f"{x:,.{digits}f}"


def _cell(x) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: list[list]) -> list[str]:
    """A Markdown table (cells escaped; ``|`` inside a cell is ``\\|``)."""
    out = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out


def _ordered(names, order) -> list[str]:
    """``names`` (unique) in ``order``, the rest sorted after it."""
    names = list(dict.fromkeys(names))
    known = [n for n in order if n in names]
    return known + sorted(n for n in names if n not in order)


def _provenance_line(p: dict) -> str:
    parts = []
    if p.get("command"):
        parts.append(f"`{p['command']}`" + (f" at {p['code']}" if p.get("code") else "")
                     + (f" ({p['note']})" if p.get("note") else ""))
    if p.get("machine"):
        parts.append(p["machine"])
    if p.get("date"):
        parts.append(p["date"])
    return "; ".join(parts) if parts else "not recorded"


def _source(p: dict, label: str = "Run") -> list[str]:
    return ["", f"{label}: {_provenance_line(p)}."]


def _driver(env: dict) -> str:
    """The driver version from a gpu_measure ``env``'s nvidia-smi CSV ('' if absent)."""
    lines = [ln for ln in str(env.get("nvidia_smi", "")).splitlines() if ln.strip()]
    if len(lines) < 2:
        return ""
    cells = [c.strip() for c in lines[1].split(",")]
    return cells[1] if len(cells) > 1 else ""


def _gpu_machine(env: dict) -> str:
    parts = [env.get("name", "one GPU")]
    if _driver(env):
        parts.append(f"driver {_driver(env)}")
    for key, label in (("torch", "torch"), ("triton", "Triton"), ("cuda", "CUDA"), ("python", "Python")):
        if env.get(key):
            parts.append(f"{label} {env[key]}")
    return ", ".join(parts)


# ---------------------------------------------------------------- scenarios


def scenario_notes() -> dict[str, str]:
    """``{name: note}`` of ``bench/scenarios.py``'s ``SCENARIOS``, read from its source (no import:
    the module imports torch)."""
    path = ROOT / "bench" / "scenarios.py"
    if not path.exists():
        return {}
    notes = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Scenario":
            kw = {k.arg: k.value for k in node.keywords}
            if isinstance(kw.get("name"), ast.Constant) and isinstance(kw.get("note"), ast.Constant):
                notes[kw["name"].value] = kw["note"].value
    return notes


def _has_plan(r: dict) -> bool:
    return r.get("step_time_s") is not None and (r.get("tokens_per_s") or 0) > 0


def _best_baselines(rows: list[dict]) -> tuple[list[str], float]:
    """Names of the best feasible baseline(s) of one scenario (tied ones all named) and their tokens/s."""
    feasible = [r for r in rows if r["planner"] != "zorse_fx" and r.get("feasible") and _has_plan(r)]
    if not feasible:
        return [], 0.0
    best = max(r["tokens_per_s"] for r in feasible)
    names = [r["planner"] for r in feasible if r["tokens_per_s"] >= best * (1 - 1e-9)]
    return _ordered(names, PLANNER_ORDER), best


def _sim_over_objective(r: dict) -> str:
    if r.get("simulated_step_time_s") and r.get("step_time_s"):
        return _r3(r["simulated_step_time_s"] / r["step_time_s"])
    return "-"


def _shape(r: dict) -> str:
    s = f"{r['num_stages']} x {r['num_microbatches']}"
    return s + (f", v = {r['interleave']}" if (r.get("interleave") or 1) > 1 else "")


def _planner_s(r: dict | None) -> str:
    """A row's planner time: wall seconds, and the CPU seconds of this process and its
    forked CP-SAT children where the run recorded them (``planner_cpu_s``; issue 32 item 6)."""
    if not r or r.get("planner_wall_s") is None:
        return "-"
    cpu = r.get("planner_cpu_s")
    return _s(r["planner_wall_s"]) + (f" / {_s(cpu)}" if cpu is not None else "")


def _before_row(before: list[dict] | None, **key) -> dict | None:
    """The row of ``before`` (a BEFORE file's rows) matching ``key``, or None."""
    return next((r for r in before or () if all(r.get(k) == v for k, v in key.items())), None)


def _g(x: float) -> str:
    return f"{x:.4g}"


def _policies(r: dict) -> str:
    """A row's per-stage memory policies, runs of equal ones merged ("ZeRO-1 x 3, ZeRO-1+rc x 2"); the
    counts of sharded / recomputing stages where the row predates per-stage records."""
    pol = r.get("stage_policies")
    if not pol:
        return f"{r.get('sharded_stages', '-')} sharded / {r.get('recompute_stages', '-')} recompute stages"
    runs: list[list] = []
    for p in pol:
        if runs and runs[-1][0] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return ", ".join(p if n == 1 else f"{p} x {n}" for p, n in runs)


def _idle_cell(r: dict) -> str:
    n = r.get("idle_gpus")
    if n is None:
        return "-" if r.get("gpus_used") is None else "not recorded"
    if n == 0:
        return "none"
    types = ", ".join(f"{c} {t}" for t, c in (r.get("idle_gpu_types") or {}).items())
    alt = r.get("all_gpus_step_time_s")
    step = (f"every GPU: {_g(alt)} s step ({r.get('all_gpus_source')}) against {_g(r['step_time_s'])} s: "
            if alt is not None else "")
    return f"{n} ({types}); {step}{r.get('idle_reason') or ''}"


def _scenario_choices(scenarios, by: dict, before: list[dict] | None) -> list[str]:
    """Issue 50: per scenario what zorse_fx's planner chose (shape, policies per stage, idle GPUs and why,
    the final polish) and, where a before file has the row, what it chose then."""
    rows = []
    for sc in scenarios:
        z = next((r for r in by[sc] if r["planner"] == "zorse_fx"), None)
        if z is None or not _has_plan(z):
            continue
        old = _before_row(before, scenario=sc, planner="zorse_fx")
        was = (f"{_shape(old)}, {old.get('gpus_used', '-')} GPUs; {_policies(old)}"
               if old and _has_plan(old) else "-")
        pol = z.get("polish_step_time_s")
        polish = ("-" if "polish_from_step_time_s" not in z else "no faster neighbour" if pol is None
                  else f"{_g(z['polish_from_step_time_s'])} -> {_g(pol)} s")
        rows.append([sc, f"{_shape(z)}, {z.get('gpus_used', '-')} GPUs", _policies(z), polish, _idle_cell(z), was])
    if not rows:
        return []
    return ["", "### Scenarios: what zorse_fx chose", "",
            "Stages x micro-batches (v: interleaved stages per GPU group) and GPUs used; each stage's memory policy "
            "in order (ZeRO level, rc: recomputation, opt@host / act@host: offload, stash@host: host-stashed "
            "recomputation); the final polish's step before -> after (the objective's, [Note: the final polish] in zorse_fx/solve/polish.py); the GPUs "
            "the plan leaves idle, the best scored plan on every GPU and what makes it slower (plan.json's "
            "`idle_gpus`); and the same scenario's plan in the before file.", ""] + table(
        ["scenario", "zorse_fx's plan", "memory policy per stage", "polish", "idle GPUs: why", "before"], rows)


def render_scenarios(rows: list[dict], name: str, before: list[dict] | None = None) -> list[str]:
    by = {}
    for r in rows:
        by.setdefault(r["scenario"], []).append(r)
    scenarios = _ordered(by, SCENARIO_ORDER)
    notes = scenario_notes()

    head = []
    for sc in scenarios:
        mine = by[sc]
        z = next((r for r in mine if r["planner"] == "zorse_fx"), None)
        names, best = _best_baselines(mine)
        if z is None or not _has_plan(z) or not z.get("feasible"):
            zcell, ratio, sim, status = "no plan", "-", "-", "-"
        else:
            zcell = f"{_int(z['tokens_per_s'])} ({_pct(z['fraction_of_upper_bound'])})"
            ratio = f"{z['tokens_per_s'] / best:.2f}x" if best else "-"
            sim, status = _sim_over_objective(z), z.get("status", "")
        bcell = f"{' = '.join(names)}: {_int(best)}" if names else "none feasible"
        old = _before_row(before, scenario=sc, planner="zorse_fx")
        before_tps = _int(old["tokens_per_s"]) if old and _has_plan(old) and old.get("feasible") else "-"
        head.append([sc, notes.get(sc, ""), zcell, before_tps, bcell, ratio, sim, _planner_s(old), _planner_s(z),
                     status])
    out = ["### Scenarios: zorse_fx against the best feasible baseline", "",
           "Tokens/s and the fraction of the scenario's upper bound (the sum of each GPU's standalone "
           "throughput) are the objective's for the plan; simulated / objective is the event-driven "
           "simulator's step over the objective's (> 1: the objective is optimistic). A baseline is feasible "
           "when its plan fits every GPU's memory. zorse_fx's portfolio includes the baselines' plans, so its "
           "ratio is >= 1.00 by construction.", ""]
    out += table(["scenario", "setting", "zorse_fx tokens/s (of bound)", "tokens/s before",
                  "best feasible baseline: tokens/s",
                  "zorse_fx / best baseline", "simulated / objective", "planner s before (wall / CPU)",
                  "planner s (wall / CPU)", "status"], head)
    if before is not None:
        out += ["", BEFORE_NOTES[name].format(file=BEFORE[name]) + "."]

    out += _scenario_choices(scenarios, by, before)

    full = []
    for sc in scenarios:
        mine = {r["planner"]: r for r in by[sc]}
        _, best = _best_baselines(by[sc])
        for p in _ordered(mine, PLANNER_ORDER):
            r = mine[p]
            if not _has_plan(r):
                full.append([sc, p, "no plan"] + ["-"] * 8 + [_planner_s(r)])
                continue
            ok = bool(r.get("feasible"))
            full.append([sc, p, "yes" if ok else "NO", _int(r["tokens_per_s"]), _pct(r["fraction_of_upper_bound"]),
                         _pct(r["mfu"], 1) if r.get("mfu") is not None else "-",
                         f"{r['tokens_per_s'] / best:.2f}x" if ok and best else "-", _shape(r),
                         r.get("gpus_used", "-"), _sim_over_objective(r), r.get("status", ""),
                         _planner_s(r)])
    out += ["", "### Scenarios: every planner", "",
            "Stages x micro-batches (v: interleaved stages per GPU group); feasible NO: the plan overflows a "
            "GPU's memory (its tokens/s are the objective's, not reachable); the ratio is to the scenario's best "
            "feasible baseline.", ""]
    out += table(["scenario", "planner", "feasible", "tokens/s", "of bound", "MFU", "x best feasible baseline",
                  "stages x micro-batches", "GPUs", "simulated / objective", "status", "planner s (wall / CPU)"], full)

    out += ["", "Runs (each scenario's rows come from one run):", ""]
    for group, p in PROVENANCE.get(name, {}).items():
        mine = [sc for sc in scenarios if sc in group]
        if mine:
            out.append(f"- {', '.join(mine)}: {_provenance_line(p)}.")
    for sc in scenarios:
        if not any(sc in group for group in PROVENANCE.get(name, {})):
            out.append(f"- {sc}: not recorded.")
    return out


# ---------------------------------------------------------------- bound gap


def verdict(rows: list[dict], target: float = 0.85) -> str:
    """What binds a scenario, from its four variants' rows (``bench/bound_gap.py`` writes
    ``verdict`` with this rule too): the first of real, ideal links, ideal memory, ideal
    both whose fraction of the upper bound reaches ``target``."""
    f = {r["variant"]: r["fraction_of_upper_bound"] for r in rows if r.get("feasible")}
    if f.get("real", 0.0) >= target:
        return f"meets {target:.0%}"
    if f.get("ideal_links", 0.0) >= target:
        return "communication-bound"
    if f.get("ideal_memory", 0.0) >= target:
        return "memory-bound"
    if f.get("ideal_both", 0.0) >= target:
        return "communication- and memory-bound"
    return f"below {target:.0%} even with ideal links and memory"


def render_bound_gap(rows: list[dict], name: str) -> list[str]:
    by = {}
    for r in rows:
        by.setdefault(r["scenario"], []).append(r)
    body = []
    for sc in _ordered(by, SCENARIO_ORDER):
        cells = []
        for v in VARIANTS:
            r = next((r for r in by[sc] if r["variant"] == v), None)
            if r is None:
                cells.append("-")
            elif not r.get("feasible"):
                cells.append("no plan")
            else:
                stop = " (safety stop)" if "safety stop" in str(r.get("status", "")) else ""
                cells.append(f"{_pct(r['fraction_of_upper_bound'])} ({r['num_stages']} st x "
                             f"{r['num_microbatches']} mb, {r['gpus_used']} GPUs){stop}")
        body.append([sc, *cells, verdict(by[sc])])
    out = ["### What bounds each scenario", "",
           "zorse_fx re-planned on the real cluster and on idealised copies (links at 1 EB/s with zero latency; "
           "1 TiB per GPU; both): fraction of the scenario's upper bound (stages x micro-batches, GPUs used). "
           "The verdict names the first variant that reaches 85%. \"(safety stop)\": a CP-SAT solve hit the "
           "100 s wall-clock safety stop, so that cell may differ on an idle machine.", ""]
    out += table(["scenario", "real", "ideal links", "ideal memory", "ideal both", "verdict"], body)
    out += ["", "Runs (the cells of one scenario may come from several runs):", ""]
    for (scs, vs), p in PROVENANCE.get(name, {}).items():
        mine = [sc for sc in scs if sc in by]
        if mine:
            out.append(f"- {', '.join(mine)}: {', '.join(v.replace('_', ' ') for v in vs)}: {_provenance_line(p)}.")
    return out


# ---------------------------------------------------------------- planner scaling


def render_scaling(rows: list[dict], name: str, before: list[dict] | None = None) -> list[str]:
    body = []
    for r in sorted(rows, key=lambda r: (r["num_gpus"], r["num_layers"])):
        stages = f"{r['num_stages']}" + (f", v = {r['interleave']}" if (r.get("interleave") or 1) > 1 else "")
        sim = r.get("simulated_step_time_s")
        old = _before_row(before, num_gpus=r["num_gpus"], num_layers=r["num_layers"])
        body.append([r["num_gpus"], r["num_layers"], r["planner"], _planner_s(old),
                     _r3(old["step_time_s"]) if old else "-", _planner_s(r), r["status"],
                     _pct(r["optimality_gap"]) if r.get("optimality_gap") is not None else "-",
                     _r3(r["step_time_s"]), _r3(sim) if sim else "-",
                     _r3(sim / r["step_time_s"]) if sim else "-", stages, r["gpus_used"]])
    out = ["### Planner scaling", "",
           "Synthetic clusters (8-GPU nodes, four GPU types round-robin); the gap is against the class-level "
           "throughput bound, which ignores communication, bubbles and memory (not a measured loss). Step times "
           "are seconds; planner s is wall / CPU seconds (CPU: the planner's process and its forked CP-SAT "
           "solves; only the runs that recorded it).", ""]
    out += table(["GPUs", "layers", "planner", "planner s before (wall / CPU)", "objective step before",
                  "planner s (wall / CPU)", "status", "gap", "objective step", "simulated step",
                  "simulated / objective", "stages", "GPUs used"], body)
    out += _source(PROVENANCE.get(name, {}))
    if before is not None:
        out += ["", BEFORE_NOTES[name].format(file=BEFORE[name]) + "."]
    return out


# ---------------------------------------------------------------- objective vs simulator


def _stats(xs: list[float]) -> list[str]:
    return [f"{_r3(min(xs))} / {_r3(statistics.median(xs))} / {_r3(max(xs))}",
            f"{sum(abs(x - 1) <= WITHIN for x in xs)}"]


def render_objective_vs_sim(rows: list[dict], name: str) -> list[str]:
    by = {}
    for r in rows:
        by.setdefault(r["family"], []).append(r)
    families = _ordered(by, FAMILY_ORDER)
    body = []
    for fam, mine in [(f, by[f]) for f in families] + [("all", rows)]:
        body.append([fam, len(mine), *_stats([r["ratio_nccl"] for r in mine]), *_stats([r["ratio"] for r in mine])])
    out = ["### Objective vs simulator", "",
           "Simulated / objective step time of every plan the planners return (> 1: the objective is "
           "optimistic and can mis-rank plans). NCCL: the simulator replays the runtime's point-to-point program "
           "under NCCL's rules (its default); buffered: Gloo's buffered sends.", ""]
    out += table(["plans", "n", "NCCL: min / median / max", "NCCL: within 5%", "buffered: min / median / max",
                  "buffered: within 5%"], body)
    miss = [r for f in families for r in by[f] if abs(r["ratio_nccl"] - 1) > WITHIN]
    if miss:
        out += ["", "Plans outside 5% under NCCL:", ""]
        out += table(["plans", "plan", "stages x micro-batches", "GPUs", "objective s", "simulated s",
                      "simulated / objective"],
                     [[r["family"], r["plan"], _shape(r), r["gpus"], _r3(r["objective_s"]),
                       _r3(r["simulated_nccl_s"]), _r3(r["ratio_nccl"])] for r in miss])
    return out + _source(PROVENANCE.get(name, {}))


# ---------------------------------------------------------------- runtime


def render_runtime(rows: list[dict], name: str) -> list[str]:
    body = []
    for r in rows:
        q = r.get("ratio_quartiles") or []
        iqr = f" ({_r3(q[0])} - {_r3(q[-1])})" if len(q) >= 2 else ""
        target = "-"
        if r.get("target_ratio") is not None:
            target = f"<= {r['target_ratio']:.2f}: {'met' if r.get('target_met') else 'missed'}"
        body.append([r["comparison"], r.get("what", ""), r.get("anchor", ""), r.get("ranks", "-"),
                     _r3(r["zorse_fx_step_s"]), _r3(r["anchor_step_s"]), _r3(r["ratio"]) + iqr, r.get("pairs", "-"),
                     _r3(r["cpu_ratio"]) if r.get("cpu_ratio") is not None else "-", target])
    out = ["### Runtime against PyTorch", "",
           "zorse_fx step / anchor step on the same model, cut, micro-batches, weights and optimizer, steps "
           "alternating in one torchrun job: the median over the counted pairs (interquartile range), and the "
           "same median over CPU seconds. Step times are seconds, the max over ranks.", ""]
    out += table(["comparison", "zorse_fx side", "anchor", "ranks", "zorse_fx step", "anchor step",
                  "ratio (IQR)", "pairs", "CPU-time ratio", "target"], body)
    runs = []
    for r in rows:
        m = r.get("machine") or {}
        machine = ", ".join(str(x) for x in (
            m.get("cpu"), f"{m['cores']} cores" if m.get("cores") else None,
            f"torch {m['torch']}" if m.get("torch") else None, f"Python {m['python']}" if m.get("python") else None,
            f"{m['backend']} on {m.get('device', '?')}" if m.get("backend") else None,
            f"{m['threads_per_rank']} thread per rank" if m.get("threads_per_rank") else None) if x)
        code = (r.get("code") or {}).get("commit")
        line = _provenance_line(dict(command=r.get("command"), code=code, machine=machine, date=r.get("date")))
        if line not in runs:
            runs.append(line)
    return out + [""] + [f"Run (recorded in {name}): {line}." for line in runs]


# ---------------------------------------------------------------- cost accuracy


def _quantity(q: str, x: float) -> str:
    if q.endswith("_bytes"):
        return f"{x / 2**20:,.0f} MiB"
    if q.endswith("_ms"):
        return f"{x:,.0f} ms"
    return f"{x:g}"


def render_cost_accuracy(rows: list[dict], name: str) -> list[str]:
    body = [[r["model"], r["plan"], r["stage"], r["samples"], r["quantity"], _quantity(r["quantity"], r["predicted"]),
             _quantity(r["quantity"], r["measured"]), _err(r["error"])] for r in rows]
    out = ["### Cost-model accuracy on CPU", "",
           "The measured-profile cost model against the real run on this CPU: each stage's fwd+bwd alone, the "
           "step of a 2-process Gloo run, and peak memory (training state + bytes autograd saves). Error = "
           "predicted / measured - 1.", ""]
    out += table(["model", "plan", "stage", "samples", "quantity", "predicted", "measured", "error"], body)
    return out + _source(PROVENANCE.get(name, {}))


def render_memory_cpu(rows: list[dict], name: str) -> list[str]:
    mib = 2**20
    body = [[r["vocab"], f"{r['parameters']:,}", _s(r["predicted_bytes"] / mib), _s(r["measured_peak_bytes"] / mib),
             _r3(r["ratio"]), ", ".join(f"{k} {v / mib:.1f}" for k, v in r["measured_at_peak_by_category"].items()
                                        if v >= mib / 10)] for r in rows]
    out = ["### Memory of one rank on this CPU", "",
           "One rank's predicted peak (`GPUShare.predicted_memory`) against the peak of live CPU tensor bytes in "
           "torch.profiler's memory timeline, and what holds it at that moment (MiB). The prediction includes "
           "the loss block's backward transient (two logits-sized gradients, the \"autograd detail\"); without "
           "it the prediction would be 0.5 / 16 / 64 MiB lower, measured / predicted 1.15 / 1.82 / 1.95.", ""]
    out += table(["vocab", "params", "predicted MiB", "measured peak MiB", "measured / predicted",
                  "at the peak, by category"], body)
    return out + _source(PROVENANCE.get(name, {}))


def _predicted_mib(r: dict) -> str:
    """A memory row's predicted peak in MiB, "+ <host> host" where it holds host memory."""
    mib = 2**20
    return _s(r["predicted_bytes"] / mib) + (f" + {r['predicted_host_bytes'] / mib:.1f} host"
                                             if r.get("predicted_host_bytes") else "")


def _at_peak(r: dict) -> str:
    """A memory row's measured bytes at the peak by category, MiB, those of at least 0.1 MiB."""
    mib = 2**20
    return ", ".join(f"{k} {v / mib:.1f}" for k, v in r["measured_at_peak_by_category"].items() if v >= mib / 10)


def render_memory_layouts(rows: list[dict], name: str) -> list[str]:
    mib = 2**20
    body = [[r["layout"], r.get("precision", "?"), r["rank"], _s(r["state_shard_bytes"] / mib), _predicted_mib(r),
             _s(r["measured_peak_bytes"] / mib), _r3(r["ratio"]), _at_peak(r)] for r in rows]
    n = rows[0]["parameters"] if rows else 0
    n16 = max((r["low_precision_parameters"] for r in rows), default=0)
    out = ["### Memory per rank and state layout on this CPU", "",
           f"One stage of {n:,} parameters ({n16:,} of them matmul weights, 16-bit working weights where the "
           "layout has them) data-parallel over two ranks, ZeRO-1 shards 3:1 (zero2: the float32 gradients "
           "sharded too, reduce-scattered every micro-batch in 512 KiB buckets; zero3: the weights too, "
           "gathered block by block; offload: the optimizer's masters, host copies and moments in host memory, "
           "and with activations the saved tensors between forward and backward); each rank's predicted peak "
           "against the peak of live CPU tensor bytes in its torch.profiler memory timeline (MiB; on this CPU "
           "host memory is the same memory, so an offloaded row's prediction is device + host). Under 16-bit "
           "working weights \"parameter\" holds the 16-bit weights, the float32 ones and the rank's float32 "
           "masters.", ""]
    out += table(["layout", "precision", "rank", "shard MiB", "predicted MiB", "measured peak MiB",
                  "measured / predicted",
                  "at the peak, by category"], body)
    return out + _source(PROVENANCE.get(name, {}))


def render_memory_recompute(rows: list[dict], name: str) -> list[str]:
    mib = 2**20
    body = [[r["policy"], _predicted_mib(r), _s(r["predicted"]["activations"] / mib),
             _s(r["measured_peak_bytes"] / mib), _r3(r["ratio"]), _at_peak(r)] for r in rows]
    out = ["### Memory per recomputation policy on this CPU", "",
           "One stage on one GPU where activations dominate (a 4-layer Llama, 64 wide, 256 tokens: 3 MB of "
           "training state): no recomputation, whole-stage recomputation (1F1B on one stage holds one micro-batch, "
           "so the same peak) and host-stashed recomputation ([C-stash]: the blocks' inputs in host memory, one "
           "block's saved tensors in the backward); the predicted peak against the peak of live CPU tensor bytes "
           "in the torch.profiler memory timeline of a fresh process (MiB; host memory is the same memory here, "
           "so the stash's prediction is device + host; its host copies read \"parameter\").", ""]
    out += table(["policy", "predicted MiB", "of it activations", "measured peak MiB", "measured / predicted",
                  "at the peak, by category"], body)
    return out + _source(PROVENANCE.get(name, {}))


def render_offload_cpu(doc: dict, name: str) -> list[str]:
    body = [[r["threads"], f"{r['parameters']:,}", _r3(r["adamw_foreach_over_copy"]), _r3(r["adamw_fused_over_copy"]),
             _r3(r["adamw_foreach_s"] / r["adamw_fused_s"])] for r in doc.get("rows", [])]
    out = ["### Optimizer offload: the CPU step", "",
           "One `torch.optim.AdamW` step on CPU tensors against streaming the same 32 B per parameter with "
           "`copy_` ([C-offload] prices the step as memory bound at the host's bandwidth): ratios of times "
           "measured side by side in one process. Ratio <= 1: the step is at least as fast as the memory-bound "
           "price on this machine; the runtime steps an offloaded optimizer with the fused kernel.", ""]
    out += table(["threads", "parameters", "foreach / copy", "fused / copy", "foreach / fused"], body)
    return out + _source(PROVENANCE.get(name, {}))


# ---------------------------------------------------------------- timings, calibration, rebalancing


def _run_of(doc: dict) -> dict:
    return dict(command=doc.get("command", "").strip(), machine=CPU_MACHINE, date=doc.get("date", ""))


def render_timings_overhead(doc: dict, name: str) -> list[str]:
    out = ["### Timings overhead", "",
           f"One plan ({doc['plan']}) trained {doc['steps']} steps with `timings.jsonl` and {doc['steps']} without "
           f"(`--no-timings`), the order alternating, {doc['rounds']} rounds; and the {doc['marks_per_step']} "
           "marks of one step timed alone, 10,000 times.", ""]
    out += table(["step with timings", "step without", "with / without (median, range)", "marks per step",
                  "marks' share of the step"],
                 [[f"{doc['step_with_timings_s'] * 1e3:.2f} ms", f"{doc['step_without_s'] * 1e3:.2f} ms",
                   f"{doc['ratio_median']:.3f} ({doc['ratio_min']:.3f}-{doc['ratio_max']:.3f})",
                   f"{doc['marks_cost_per_step_s'] * 1e6:.1f} µs", _pct(doc["marks_share_of_step"], 3)]])
    return out + _source(_run_of(doc))


def render_plan_cli(doc: dict, name: str) -> list[str]:
    runs = doc["runs"]
    out = ["### `zorse plan` from the command line: where its time goes", "",
           f"`{doc['zorse_command']}` in a fresh Python process, CPU seconds (the process and its waited-for "
           "children: forked CP-SAT solves) and wall seconds per phase; the first run with an empty capture cache "
           "(`ZORSE_CACHE_DIR`), the next ones with the cache it filled.", ""]
    # The phases of every run in the order they first ran ("zorse plan (all)" last); a phase a run did not
    # run (a warm plan made without the model loads none) is "-", one it ran twice is summed.
    names = list(dict.fromkeys(n for r in runs for n, *_ in r["phases"]))
    names.sort(key=lambda n: n == "zorse plan (all)")
    body = []
    for n in names:
        cells = []
        for r in runs:
            mine = [(c, w) for m, c, w in r["phases"] if m == n]
            cells.append(f"{sum(c for c, _ in mine):.2f} / {sum(w for _, w in mine):.2f}" if mine else "-")
        body.append([n] + cells)
    body.append(["process total"] + [f"{r['total_cpu_s']:.1f} / {r['total_wall_s']:.1f}" for r in runs])
    out += table(["phase"] + [f"run {k + 1} ({r['cache']} cache): CPU / wall s" for k, r in enumerate(runs)], body)
    return out + _source(_run_of(doc))


def render_drift_probe(doc: dict, name: str) -> list[str]:
    out = ["### This machine's speed drift, and the probe that takes it out", "",
           f"One thread for {doc['seconds']:g} s: the registry's GPT forward + backward (micro-batch 8, sequence 64) "
           "between two reference probes (float32 matmuls, and in runs since 2026-12-07 14:40 a memory-bound "
           "pass after them), thread CPU time; medians per "
           f"{doc['window_s']:g} s window. Step / probe is what drift-compensated pacing stretches ([Note: "
           "drift-compensated pacing] in zorse_fx/pacing.py); step / matmuls, the same in units of the probe's "
           "matmuls alone (the probe before 14:40).", ""]
    both = "step_over_probe_matmul" in doc["windows"][0] if doc["windows"] else False
    body = [[f"{r['start_s']:g}", r["steps"], f"{r['step_cpu_ms']:.1f}", f"{r['probe_ms']:.3f}",
             f"{r['step_over_probe']:.1f}"] + ([f"{r['step_over_probe_matmul']:.1f}"] if both else [])
            for r in doc["windows"]]
    body.append(["range (max / min)", "", f"{doc['range_step_cpu']:.3f}", f"{doc['range_probe']:.3f}",
                 f"{doc['range_step_over_probe']:.3f}"]
                + ([f"{doc['range_step_over_probe_matmul']:.3f}"] if both else []))
    out += table(["window from (s)", "steps", "step CPU ms", "probe ms", "step / probe"]
                 + (["step / matmuls"] if both else []), body)
    out += ["", f"Per step, coefficient of variation: step CPU {doc['cv_step_cpu']:.3f}, step / probe "
                f"{doc['cv_step_over_probe']:.3f}"
                + (f", step / matmuls {doc['cv_step_over_probe_matmul']:.3f}." if both else ".")]
    return out + _source(_run_of(doc))


def render_calibration(doc: dict, name: str) -> list[str]:
    out = ["### Calibration: predicted against measured steps", "",
           f"{doc['model']}; each plan trained {doc['steps']} steps. Error = predicted / measured - 1: the "
           "objective as priced (the GPUs' cost model: not this CPU), calibrated on the plan's own run (the fitted "
           "time per byte makes this ~0), and calibrated on every other plan's run (held out).", ""]
    body = [[r["plan"], r["stages"], r["gpus"], r["microbatches"], f"{r['measured_step_s'] * 1e3:.1f}",
             _err(r["objective_error"]), _err(r["self_objective_error"]), _err(r["held_out_objective_error"]),
             _err(r["held_out_simulator_error"])] for r in doc["rows"]]
    out += table(["plan", "stages", "GPUs", "micro-batches", "measured ms", "uncalibrated", "self",
                  "held out", "held out (simulator)"], body)
    out += ["", f"Held-out |error| of the calibrated objective: median {_pct(doc['held_out_objective_abs_error_median'], 1)}, "
                f"max {_pct(doc['held_out_objective_abs_error_max'], 1)}."]
    return out + _source(_run_of(doc))


def render_rebalance(doc: dict, name: str) -> list[str]:
    out = ["### Rebalancing a straggler", "",
           f"GPU 1 {doc['slow']:g}x slower (`--slow-gpu`), {doc['steps']} steps of `{doc['plan']}`.", ""]
    out += table(["", "plan", "median step"],
                 [["before (slowed)", doc["plan"], f"{doc['step_before_s'] * 1e3:.1f} ms"],
                  [f"after `--rebalance` (from step {doc['resumed_at_step']})", doc["rebalanced_plan"],
                   f"{doc['step_after_s'] * 1e3:.1f} ms"],
                  ["a plan from scratch for the slowed cluster", doc["scratch_plan"],
                   f"{doc['step_scratch_s'] * 1e3:.1f} ms"],
                  ["nothing slowed", doc["plan"], f"{doc['step_unslowed_s'] * 1e3:.1f} ms"]])
    out += ["", f"After / from scratch: {doc['after_over_scratch']:.2f} (bar: within 15%). From the last step "
                f"calibrated on ({doc['calibrated_on_steps'][-1]}) to the first resumed step: "
                f"{doc['replan_to_resume_s']:.1f} s (bar: 30 s)."]
    return out + _source(_run_of(doc))


def render_box_calibration(doc: dict, name: str) -> list[str]:
    out = ["### Calibration on the box's measured plans", "",
           "Per box case, each plan's measured step (bench/box.py, every repetition's steps after the first two) "
           "against the objective / simulator uncalibrated, calibrated on the plan's own runs (self), and "
           "calibrated on every other plan's runs of the case (held out). Error = predicted / measured - 1.", ""]
    for case in doc["cases"]:
        body = []
        for r in case["rows"]:
            m = r["measured_s"]
            body.append([r["plan"], f"{m:.3f}", _err(r["objective_s"] / m - 1), _err(r["simulated_s"] / m - 1),
                         _err(r["self_s"][0] / m - 1), _err(r["self_s"][1] / m - 1),
                         _err(r["held_out_s"][0] / m - 1), _err(r["held_out_s"][1] / m - 1)])
        out += [f"{case['case']} ({case['date']}; `{case['command'].strip()}`):", ""]
        out += table(["plan", "measured s", "objective", "simulator", "self: objective", "self: simulator",
                      "held out: objective", "held out: simulator"], body) + [""]
    return out + _source(dict(command="bench/box_calibration.py", machine=CPU_MACHINE,
                              date=max(c["date"] for c in doc["cases"])))


# ---------------------------------------------------------------- links


def render_comm(doc: dict, name: str) -> list[str]:
    body = []
    for f in doc.get("fits", []):
        sizes = [s[0] for s in f.get("samples", [])]
        span = f"{min(sizes) // 1024} KiB - {max(sizes) // 2**20} MiB" if sizes else "-"
        body.append([f["link_class"], f["op"], f["ranks"], _s(f["alpha_s"] * 1e6),
                     _s(f["bandwidth_bytes_per_s"] / 1e9, 2),
                     _s(f["r2"], 2), span])
    out = ["### Links of this machine", "",
           f"Alpha-beta fits of {doc.get('backend', '?')} over {doc.get('world_size', '?')} ranks "
           "(time = alpha + bytes / bandwidth).", ""]
    out += table(["link class", "op", "ranks", "alpha µs", "bandwidth GB/s", "R²", "sizes"], body)
    p = dict(PROVENANCE.get(name, {}))
    p["machine"] = f"{p.get('machine', 'machine not recorded')}, torch {doc.get('torch_version', '?')}"
    p.setdefault("date", doc.get("measured_at", ""))
    return out + _source(p)


# ---------------------------------------------------------------- the box


def render_box_memory(case: dict, doc: dict) -> list[str]:
    """Case (c) of bench/box.py: per plan and rank the predicted peak, the cgroup's peak (of the run
    without limits where the limited one was killed) and the limit, the runtime's own measurement, and
    whether the kernel killed a rank under the limits."""
    def mib(b):
        return "-" if b is None else f"{b / 2**20:.0f}"

    out = [f"**{case['case']}**: {case['note']} (`{case['cluster']}`, model `{case['model']}`, global batch "
           f"{case['global_batch_size']}, seq {case['seq_len']}; each rank's cgroup limited to its GPU's memory + "
           f"{case['memory_base_mib']:g} MiB)", ""]
    body = []
    for p in case["plans"]:
        for k, rk in enumerate(p["measured"]):
            body.append([p["plan"] if k == 0 else "", ("yes" if p["predicted_to_fit"] else "no") if k == 0 else "",
                         ("yes" if p["killed_in_any_run"] else "no") if k == 0 else "",
                         f"{rk['rank']} ({rk['node']})", mib(rk["predicted_bytes"]), mib(rk["usable_bytes"]),
                         mib(rk["cgroup_peak_bytes"]), mib(rk["limit_bytes"]), mib(rk["runtime_peak_bytes"]),
                         mib(None if rk["cgroup_peak_bytes"] is None else rk["cgroup_peak_bytes"] - rk["predicted_bytes"])])
    out += table(["plan", "predicted to fit", "killed under the limit", "rank (node)", "predicted MiB",
                  "usable MiB", "cgroup peak MiB", "limit MiB", "runtime MiB", "peak - predicted MiB"], body)
    out += ["", "cgroup peak: the rank's cgroup's most memory held at once (a killed plan's from a second run "
                "without limits); runtime: its own measurement ([Note: measured rank memory]); limit: GPU "
                "memory + the base."]
    out += ["", f"Every plan predicted to fit ran without a kill: "
                f"{'yes' if case['predicted_to_fit_never_killed'] else 'no'}; plans predicted not to fit that the "
                f"kernel killed: {', '.join(case['predicted_not_to_fit_killed']) or 'none'}. Run: "
                f"`{case.get('command', '?')}`, {str(case.get('date', ''))[:16]}"
                + (f"; {case['conditions']}" if case.get("conditions") else "") + ".", ""]
    return out


def render_box_node_lost(case: dict, doc: dict) -> list[str]:
    """Case (d) of bench/box.py: per repetition when (after the kill) the survivors reported, restarted under
    the re-plan and trained their first resumed step, the steps lost, the losses against the uninterrupted
    run, and the step time before and after against each plan's prediction in box time (prediction / scale)."""
    s = case["box_scale"]
    out = [f"**{case['case']}**: {case['note']} (box scale {s:.3g}; `{case['cluster']}`, global batch "
           f"{case['global_batch_size']}, seq {case['seq_len']}, `--checkpoint-every 2 --node-lost-after "
           f"{case['node_lost_after_s']:g}`)", ""]
    body = [[str(r["rep"]), f"{r['killed_after_step']} -> {r['resumed_at_step']}", _s(r["reported_s"], 1),
             _s(r["decided_s"], 1), _s(r["first_resumed_step_s"], 1), _s(r["startup_whole_s"], 1),
             f"{r['loss_max_rel_diff']:.1e}",
             f"{_s(r['step_s_whole_median'], 2)} ({_s(case['plan']['predicted_step_s'] / s, 2)})",
             f"{_s(r['step_s_replan_median'], 2)} ({_s(r['replan']['predicted_step_s'] / s, 2)})"]
            for r in case["reps"]]
    out += table(["rep", "killed after step -> resumed at", "survivors reported s", "restarted s",
                  "first resumed step s", "a fresh start's first step s", "losses vs whole run (max rel)",
                  f"step s, {case['plan']['gpus']} GPUs (predicted)",
                  f"step s after, {case['reps'][0]['replan']['gpus']} GPUs (predicted)"], body)
    out += ["", "Seconds after the kill (box time): survivors reported = the first surviving node's launcher saw "
                "its ranks stop; restarted = the first node started again under the re-plan (the lost node "
                "waited for, the re-plan made); first resumed step = the re-plan's first step done. A fresh "
                "start's first step: from starting the uninterrupted run's `zorse train` to its first step done "
                "(what any restart costs: processes, rendezvous over the box's delays, the first step). "
                "Predicted: the plan's step (real-GPU seconds) / the box's scale, which the quotas and links "
                "follow; priced from the GPU types' roofline, not from the box's own measurements as (a) and (b) "
                "are: this case times the recovery, not the time model.",
            "", f"Run: `{case.get('command', '?')}`, {str(case.get('date', ''))[:16]}"
                + (f"; {case['conditions']}" if case.get("conditions") else "") + ".", ""]
    return out


def _pairs_alike(plans: list[dict]) -> str:
    """"k of n": of the plan pairs whose measured ranges do not overlap (told apart by the measurement),
    how many the simulator orders the same way."""
    told = alike = 0
    for a, p in enumerate(plans):
        for q in plans[a + 1:]:
            lo, hi = (p, q) if p["measured_max_s"] < q["measured_min_s"] else (q, p)
            if lo["measured_max_s"] >= hi["measured_min_s"]:
                continue  # the ranges overlap: the measurement does not order them
            told += 1
            alike += lo["simulated_s"] < hi["simulated_s"]
    return f"{alike} of {told}"


def _rep_pairs(case: dict) -> str:
    """The pairs the repetitions order (bench/box.py, [Note: plans told apart by their repetitions]) and how
    many of them the simulator orders alike, with the chance level of that test."""
    if "rep_pairs_ordered" not in case:
        return "repetitions' medians not recorded"
    r = case["rep_min"]
    chance = 2 / math.comb(2 * r, r) if r else 1.0
    against = "".join(f"; against: {a} < {b} measured" for a, b in case["rep_pairs_against"])
    return (f"pairs every repetition orders ({r} per plan, chance {chance:.2g}): {case['rep_pairs_alike']} of "
            f"{case['rep_pairs_ordered']} ordered alike{against}")


def _box_speed(case: dict) -> str:
    if case.get("speed") != "pace":
        return "CPU quotas"
    if case.get("drift_probe"):
        ref = case.get("box", {}).get("pace_reference_s")
        return ("paced in units of a reference probe" + (f" of {ref * 1e3:.3g} ms" if ref else "")
                + " ([Note: drift-compensated pacing])")
    return "paced on raw CPU time"


def _box_tcp(case: dict) -> str:
    if case.get("tcp_tuning"):
        return "tuned ([Note: the box's TCP tuning]), links fitted over 4 KiB-4 MiB"
    return "the kernel's defaults (measured before 2026-12-07T06:00), links fitted over 4-256 KiB"


def render_box(doc: dict, name: str) -> list[str]:
    out = ["### Plans measured on the box", "",
           "Every planner's plan trained on an emulated cluster (`zorse box`: a network namespace per node, shaped "
           "links, each rank at its GPU type's speed; bench/box.py): measured step (median over the counted steps "
           "of every repetition, and their range) against the objective's and the simulator's prediction, both "
           "priced from the box's own measurements (`zorse bench kernels` as each rank type, `zorse bench comm` "
           "across the shaped links). Times are the box's seconds. Speed: since 2026-12-07 each rank's compute is "
           "paced (ZORSE_PACE: 1/q x its CPU time, [Note: paced compute] in zorse_fx/pacing.py), since "
           "2026-12-07T04:00 in units of a reference probe that takes out the host's speed drift ([Note: "
           "drift-compensated pacing]; each case says which); the cases "
           "measured before ran under CFS CPU quotas, which throttle a rank's communication threads too and let "
           "short compute bursts through (each case says which). Measured step = rank 0's `step_time_s`: "
           "since 2026-12-06T17:20 the whole step, the per-step all-gather included and no separate loss "
           "all-reduce ([Note: one world collective after the step] in zorse_fx/train.py; the cases run before "
           "it timed the step up to the loss all-reduce, the all-gather after it not counted). Simulated: "
           "since 2026-12-06T20:30 under Gloo's point-to-point protocol, the box's (`simulate(p2p=\"gloo\")`: "
           "a message leaves once the receiver's ready has crossed the link, measured by bench/box_p2p.py; "
           "before, an eager send), since 2026-12-07T06:40 with Gloo's collectives as rendezvous rings too (two "
           "latencies per ring step, two gradient buckets at once, ZeRO-1's all-gather as one binomial-tree "
           "broadcast per shard: bench/LOG.md \"The box's WAN: TCP windows and "
           "Gloo's rendezvous\"), since 2026-12-07T09:45 with the world's small collectives (the gradient "
           "norm's all-reduce, the per-step all-gather) replayed rank by rank as Gloo's own loops run them and "
           "the step's time the period of the steady state where each rank starts when its part of the last "
           "all-gather ended, and since 2026-12-07T10:48 each point-to-point message at most at its TCP "
           "connection's paced rate, about twice the message per round trip (bench/LOG.md \"Gloo's small "
           "collectives, rank by rank\"; since 2026-12-07T12:43 the pacing law fitted across message sizes and "
           "round trips: bench/box_pacing.py; since 2026-12-07T13:19 a send that waited for its ready and left "
           "within a round trip of its post paced with the larger window such a connection keeps: [Note: a "
           "send's notice in flight]), and since 2026-12-07T11:27 a tied parameter's all-reduce across GPU "
           "groups replayed the same way from each holder's entry, its messages paced too (bench/LOG.md \"A "
           "tied parameter's all-reduce, paced\"); a case measured before "
           "says it was re-priced (`bench/box.py --reprice`: "
           "the same plans, the measurements kept). TCP: since 2026-12-07T06:00 every node's TCP is tuned for "
           "long fat networks and the links are fitted over 4 KiB-4 MiB messages (each case says which). Pairs "
           "ordered "
           "alike: of the plan pairs whose measured ranges do not overlap, those the simulator orders the same "
           "way. Pairs every repetition orders: of the plan pairs where every repetition (run) of one has a "
           "smaller median step than every repetition of the other, those the simulator orders the same way; "
           "plans of equal speed do that by chance with the probability given (2 / C(2r, r) for r repetitions "
           "each: the exact Mann-Whitney test at U = 0), and the pairs left are measured ties ([Note: plans told "
           "apart by their repetitions] in bench/box.py).", ""]
    for case in doc.get("cases", []):
        if case.get("memory_base_mib") is not None:
            out += render_box_memory(case, doc)
            continue
        if "reps" in case:
            out += render_box_node_lost(case, doc)
            continue
        out += [f"**{case['case']}**: {case['note']} (box scale {case['box']['scale']:.3g}; "
                f"`{case['cluster']}`, global batch {case['global_batch_size']}, seq {case['seq_len']})", ""]
        body = []
        for p in sorted(case["plans"], key=lambda p: p["measured_median_s"]):
            stages = " | ".join(",".join(f"{r[0]}:{r[1].split('-')[0]}x{r[3]}" for r in st) for st in p["ranks"])
            body.append([p["plan"], _s(p["measured_median_s"], 3),
                         f"{_s(p['measured_min_s'], 3)}-{_s(p['measured_max_s'], 3)}", _s(p["objective_s"], 3),
                         _s(p["simulated_s"], 3), _r3(p["simulated_over_measured"]), stages])
        out += table(["plan", "measured s", "range s", "objective s", "simulated s", "sim / measured",
                      "stages (rank:GPU x samples per micro-batch)"], body)
        out += ["", f"zorse_fx's plan against the simulator: {case['zorse_fx_sim_error']:+.0%}; measured fastest or "
                    f"within the fastest's range: {'yes' if case['zorse_fx_fastest_or_within_spread'] else 'no'}; "
                    f"measured ranking = simulated ranking: {'yes' if case['rankings_equal'] else 'no'}; "
                    f"pairs ordered alike: {_pairs_alike(case['plans'])}; {_rep_pairs(case)}. Speed: "
                    f"{_box_speed(case)}. TCP: {_box_tcp(case)}. "
                    f"Run: `{case.get('command', doc.get('command', '?'))}` (the first two steps of each run not "
                    f"counted), {str(case.get('date', doc.get('date', '')))[:16]}"
                    + (f"; re-priced by `{case['repriced']['command']}`, {case['repriced']['date'][:16]} "
                       f"(simulator p2p {case['repriced']['sim_p2p']})" if case.get("repriced") else "") + ".", ""]
    out += [f"Machine: {CPU_MACHINE}, Python {doc.get('machine', {}).get('python', '?')}, nothing else running "
            f"unless a case says so."]
    return out


# ---------------------------------------------------------------- GPUs


def _gpu_docs(docs: dict) -> list[tuple[str, dict]]:
    return [(n, docs[n]) for n in ("gpu_h100.json", "gpu_h200.json") if n in docs]


def _gpu_name(doc: dict) -> str:
    return (doc.get("env") or {}).get("name", "?").replace("NVIDIA ", "")


def _gpu_provenance(name: str, doc: dict) -> list[str]:
    env = doc.get("env") or {}
    date = str(doc.get("started") or PROVENANCE.get(name, {}).get("date", "not recorded"))
    out = [f"- {_gpu_name(doc)} ({name}): {_gpu_machine(env)}; {date[:10]}."]
    for run, cmd in sorted((doc.get("runs") or {}).items()):
        out.append(f"  - run {run}: `{cmd}`")
    return out


def render_gpus(docs: dict) -> list[str]:
    gpus = _gpu_docs(docs)
    if not gpus:
        return []
    out = ["### One GPU measured: the measured-profile path", "",
           "Two decoder layers of Llama-2 7B's shape (bf16 autocast), whole captured graph fwd+bwd measured "
           "against the cost model's price from the shipped kernel profile (`zorse bench kernels --replay "
           "graph`: the sum of the node replays, calibrated at two points, \"fitted\"; the other four are held "
           "out).", ""]
    body = []
    for _, doc in gpus:
        pc = doc.get("profile_check") or {}
        for p in pc.get("points", []):
            body.append([_gpu_name(doc), p["seq"], p["micro_batch"], _s(p["measured_ms"], 2), _s(p["predicted_ms"], 2),
                         "fitted" if p.get("calibration_point") else _err(p["error"])])
    out += table(["GPU", "seq", "micro-batch", "measured ms", "profile path ms", "error"], body)
    cal = [f"{_gpu_name(d)}: calibration {d['profile_check']['calibration']:.4f}, node overhead "
           f"{1000 * d['profile_check']['node_overhead_ms']:.1f} µs" for _, d in gpus if d.get("profile_check")]
    if cal:
        out += ["", "Fitted: " + "; ".join(cal) + "."]
    out += ["", "Runs (the machines and commands of every table of this GPU section):", ""]
    for name, doc in gpus:
        out += _gpu_provenance(name, doc)
    same = ["", "Runs: as under the measured-profile path table above."]

    out += ["", "### One GPU measured: GEMM and decoder-layer times", "",
            "`torch.matmul` TFLOP/s (2MNK / time) at 8192³ and the best over the sweep's shapes; one decoder layer "
            "= the 2-layer minus the 1-layer eager Hugging Face Llama (sdpa, bf16 autocast, float32 weights), "
            "fwd+bwd ms.", ""]
    body = []
    for _, doc in gpus:
        g = doc.get("gemm", [])
        at = {r["mode"]: r["tflops"] for r in g if r["m"] == r["n"] == r["k"] == 8192}
        best = {}
        for r in g:
            best[r["mode"]] = max(best.get(r["mode"], 0.0), r["tflops"])
        body.append([_gpu_name(doc)] + [f"{at[m]:.0f} ({best[m]:.0f})" if m in at else "-"
                                        for m in ("bfloat16", "float16", "tf32", "float32")])
    out += table(["GPU", "bf16: 8192³ (best)", "fp16", "TF32", "fp32"], body) + same
    layers = {}
    for _, doc in gpus:
        t = {(r["shape"], r["layers"], r["seq"], r["micro_batch"]): r["fwd_bwd_ms"] for r in doc.get("layers", [])}
        for (shape, n, seq, mb), two in t.items():
            if n == 2 and (shape, 1, seq, mb) in t:
                layers.setdefault((shape, seq, mb), {})[_gpu_name(doc)] = two - t[(shape, 1, seq, mb)]
    if layers:
        names = [_gpu_name(d) for _, d in gpus]
        out += [""] + table(["shape", "seq", "micro-batch"] + [f"{n}: one layer fwd+bwd ms" for n in names],
                            [[s, q, m] + [_s(layers[(s, q, m)][n], 2) if n in layers[(s, q, m)] else "-" for n in names]
                             for (s, q, m) in sorted(layers, key=lambda k: (len(k[0]), k))]) + same

    att = [(n, d) for n, d in gpus if d.get("attention")]
    for _, doc in att:
        rows = [r for r in doc["attention"] if r["micro_batch"] == 4]
        seqs = sorted({r["seq"] for r in rows})
        variants = list(dict.fromkeys(r["variant"] for r in rows))
        cell = {(r["variant"], r["seq"]): f"{r['fwd_tflops']:.0f} / {r['bwd_tflops']:.0f}" for r in rows}
        out += ["", f"### One GPU measured: attention on the {_gpu_name(doc)}", "",
                "One Llama-2 7B layer's attention (32 heads x 128, bfloat16), TFLOP/s by the non-causal count "
                "4·B·H·T²·D (backward 2.5x that), micro-batch 4: `sdpa_mask` is "
                "`F.scaled_dot_product_attention` with an explicit boolean causal mask (what the export-captured "
                "Hugging Face Llama passes), `sdpa_causal` with `is_causal=True`, `sdpa_none` without a mask, "
                "`triton_causal` / `triton_none` the project's Triton `flash_attention`.", ""]
        out += table(["variant"] + [f"seq {s}: fwd / bwd" for s in seqs],
                     [[v] + [cell.get((v, s), "-") for s in seqs] for v in variants]) + same
    return out


def render_class_check(docs: dict) -> list[str]:
    checks = [(n, docs[n]) for n in ("gpu_class_check_h100.json", "gpu_class_check.json") if n in docs]
    if not checks:
        return []
    body = []
    for _, doc in checks:
        for s in doc.get("summary", []):
            if s["rows"] != "all":
                continue
            body.append([doc.get("device_type", "?"), s["pricing"], s["n"],
                         f"{_pct(s['layer_median_abs_err'], 1)} / {_pct(s['layer_max_abs_err'], 1)}",
                         f"{_pct(s['two_median_abs_err'], 1)} / {_pct(s['two_max_abs_err'], 1)}"])
    out = ["### GPU class model against the measured Hopper layers", "",
           "What a plan uses for a GPU type without a profile (the class model) against the measured "
           "Llama-2 7B/13B layers above (seq 512/2048/4096, micro-batch 1/4), |predicted / measured - 1|: "
           "`table` as the planner prices, `class` without the table's measured GEMM rate, `sweep` with the "
           "file's own bf16 8192³ rate, `eager` every elementwise node its own kernel.", ""]
    out += table(["GPU", "pricing", "rows", "one layer: median / max", "2-layer model: median / max"], body)
    out += ["", "Runs:", ""]
    for name, doc in checks:
        p = dict(PROVENANCE.get(name, {}))
        p["command"] = doc.get("command", "")
        meas = (doc.get("measured") or {}).get("file", "?")
        out.append(f"- {doc.get('device_type', '?')} ({name}, measurement {meas}; unfused fraction "
                   f"{doc.get('unfused_fraction', '?')}): {_provenance_line(p)}.")
    return out


def render_layer_accuracy(doc: dict, name: str) -> list[str]:
    rows = doc.get("rows", [])
    body = [[r["model"], r["gpu"], r["arch"], r["micro_batch"], _s(1000 * r["measured_step_s"]),
             f"{_s(1000 * r['class_step_s'])} ({_err(r['class_err'])})",
             f"{_s(1000 * r['table_step_s'])} ({_err(r['table_err'])})"] for r in rows]
    out = ["### GPU class model on published BERT training steps", "",
           f"One training step of BERT ({doc.get('models', '')}) per GPU type, published (Lambda's PyTorch "
           "benchmark) against the class model's price, ms: `class` the class model alone, `table` as the planner "
           f"prices (the measured GEMM rate where gpu_specs.csv has one); unfused fraction "
           f"{doc.get('unfused_fraction', '?')}.", ""]
    out += table(["model", "GPU", "class", "micro-batch", "measured ms", "class ms (error)", "table ms (error)"], body)
    summary = [[p, f"{_pct(doc[f'{p}_median_abs_err'], 1)} / {_pct(doc[f'{p}_max_abs_err'], 1)}"]
               for p in ("class", "table", "fused", "eager") if f"{p}_median_abs_err" in doc]
    out += ["", "|error| over all rows (`fused`: fully fused elementwise chains, fraction 0; `eager`: fraction 1):", ""]
    out += table(["pricing", "median / max"], summary)
    fits = doc.get("split_fits", [])
    if fits:
        out += ["", "The fitted fraction, scored on held-out rows:", ""]
        out += table(["split", "fraction", "held out", "held out: median / max", "fused: median / max"],
                     [[f["split"], f"{f['fraction']:.4f}", f["n_held"],
                       f"{_pct(f['held_median_abs_err'], 1)} / {_pct(f['held_max_abs_err'], 1)}",
                       f"{_pct(f['fused_median_abs_err'], 1)} / {_pct(f['fused_max_abs_err'], 1)}"] for f in fits])
    p = dict(PROVENANCE.get(name, {}))
    p["command"] = doc.get("command", "")
    return out + _source(p)


# ---------------------------------------------------------------- the block


def load(results: Path) -> dict:
    """The current result files found in ``results``, parsed."""
    return {n: json.loads((results / n).read_text()) for n in RESULT_FILES if (results / n).is_file()}


def render(results: Path = RESULTS) -> str:
    """The Markdown of the block between the markers (without them)."""
    docs = load(results)
    parts = [["Generated by `python bench/report.py --write` from `bench/results/*.json`; "
              "`tests/test_bench_report.py` fails when this block is stale. Absolute times hold only for the "
              "machine named under each table, ratios only within one run."]]
    single = (("scenarios.json", render_scenarios), ("bound_gap.json", render_bound_gap),
              ("scaling.json", render_scaling), ("objective_vs_sim.json", render_objective_vs_sim),
              ("runtime.json", render_runtime), ("cost_accuracy.json", render_cost_accuracy),
              ("memory_cpu.json", render_memory_cpu), ("memory_cpu_layouts.json", render_memory_layouts),
              ("memory_cpu_recompute.json", render_memory_recompute), ("offload_cpu.json", render_offload_cpu),
              ("comm_loopback.json", render_comm), ("box.json", render_box),
              ("timings_overhead.json", render_timings_overhead), ("calibration.json", render_calibration),
              ("rebalance.json", render_rebalance), ("box_calibration.json", render_box_calibration),
              ("plan_cli.json", render_plan_cli), ("drift_probe.json", render_drift_probe))
    for name, fn in single:
        if name in docs:
            old = BEFORE.get(name)
            if old is not None and (results / old).is_file():
                parts.append(fn(docs[name], name, before=json.loads((results / old).read_text())))
            else:
                parts.append(fn(docs[name], name))
    for lines in (render_gpus(docs), render_class_check(docs)):
        if lines:
            parts.append(lines)
    if "gpu_layer_accuracy.json" in docs:
        parts.append(render_layer_accuracy(docs["gpu_layer_accuracy.json"], "gpu_layer_accuracy.json"))
    present = sorted(n for n in SUPERSEDED if (results / n).exists())
    if present:
        parts.append(["Not rendered (superseded runs, reported in bench/LOG.md): "
                      + "; ".join(f"`{n}`, {SUPERSEDED[n]}" for n in present) + "."])
    return "\n\n".join("\n".join(p) for p in parts) + "\n"


def splice(text: str, block: str) -> str:
    """``text`` with the lines between its BEGIN and END markers replaced by ``block``."""
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise ValueError(f"no '{BEGIN}' ... '{END}' markers")
    return text[:i] + BEGIN + "\n" + block + text[j:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(RESULTS), help="directory of the result files (default bench/results)")
    ap.add_argument("--readme", default=str(README),
                    help="the Markdown file holding the markers (default bench/README.md)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="replace the block between the markers in --readme")
    mode.add_argument("--check", action="store_true", help="exit 1 if the block in --readme differs from the output")
    args = ap.parse_args(argv)
    block = render(Path(args.results))
    if not (args.write or args.check):
        sys.stdout.write(block)
        return 0
    readme = Path(args.readme)
    text = readme.read_text()
    try:
        new = splice(text, block)
    except ValueError as e:
        print(f"{readme}: {e}", file=sys.stderr)
        return 1 if args.check else 2
    if args.check:
        if new != text:
            print(f"{readme}: the generated results block is stale; run `python bench/report.py --write`",
                  file=sys.stderr)
            return 1
        return 0
    if new != text:
        readme.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
