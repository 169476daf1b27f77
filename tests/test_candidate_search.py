"""The CP-SAT candidate search of issue 32: candidates in order of their
heuristic plan and lower bound, an incumbent every candidate must beat
([Note: incumbent cutoff] in zorse_fx/solve/_search.py), one budget for the
whole search ([Note: search budget]) and its progress lines."""

from __future__ import annotations

import dataclasses
import math

import pytest
from conftest import candidate_dicts, random_instance

from zorse_fx.errors import InfeasiblePlanError
from zorse_fx.portfolio import solve_portfolio
from zorse_fx.solve import solve_brute_force, solve_cpsat
from zorse_fx.solve._search import ordered_candidates
from zorse_fx.solve.bounds import stage_count_lower_bound
from zorse_fx.solve.objective import UNITS_PER_S, evaluate_result
from zorse_fx.solve.stage_dp import stage_dp_search


def _units(seconds: float) -> int:
    return round(seconds * UNITS_PER_S)


@pytest.mark.parametrize("seed", range(0, 24, 3))
def test_an_incumbent_changes_the_work_not_the_optimum(seed):
    """With the stage DP's plan as the incumbent, the search returns the brute-force
    optimum (CP-SAT's plan, or the incumbent itself when nothing beats it), never
    worse than the incumbent, proven OPTIMAL; the candidates it proved could not
    beat the bar are NO_BETTER with a bound above the plan."""
    costs, devices, options = random_instance(seed)
    options = dataclasses.replace(options, solver_budget=30.0)
    try:
        ref = solve_brute_force(costs, devices, options)
        inc, _ = stage_dp_search(costs, devices, options)
    except InfeasiblePlanError:
        return
    if inc.status != "STAGE_DP":
        return
    inc = dataclasses.replace(inc, status="STAGE_DP")
    res = solve_cpsat(costs, devices, options, incumbent=inc)
    assert res.status == "OPTIMAL"
    assert _units(res.predicted_step_time_s) == _units(ref.predicted_step_time_s) <= _units(inc.predicted_step_time_s)
    assert evaluate_result(costs, devices, options, res).feasible
    for c in candidate_dicts(res):
        if c.get("status") == "NO_BETTER":
            assert _units(c["best_bound_s"]) > _units(res.predicted_step_time_s)


def test_the_incumbent_is_returned_and_proven_when_nothing_beats_it():
    """An incumbent that is already optimal comes back (its decision, with the
    search's candidates after its own), status OPTIMAL: no candidate beat it (a
    candidate may tie it, OPTIMAL at the same objective: ties go to the plan in
    hand), the others were NO_BETTER, PRUNED or INFEASIBLE."""
    for seed in range(40):
        costs, devices, options = random_instance(seed)
        try:
            best = solve_cpsat(costs, devices, dataclasses.replace(options, solver_budget=30.0))
        except InfeasiblePlanError:
            continue
        if best.status != "OPTIMAL":
            continue
        inc = dataclasses.replace(best, status="BASELINE:test", candidates=())
        res = solve_cpsat(costs, devices, dataclasses.replace(options, solver_budget=30.0), incumbent=inc)
        assert res.decision == best.decision and res.status == "OPTIMAL"
        for c in candidate_dicts(res):
            assert c["status"] in {"NO_BETTER", "PRUNED", "INFEASIBLE", "OPTIMAL"}, c
            if c["status"] == "OPTIMAL":
                assert _units(c["step_time_s"]) == _units(best.predicted_step_time_s), c
        return
    pytest.fail("no random instance proven optimal")


def test_candidates_come_in_order_of_their_heuristic_plan_then_their_bound():
    for seed in range(40):
        costs, devices, options = random_instance(seed)
        try:
            _, hints = stage_dp_search(costs, devices, options)
        except InfeasiblePlanError:
            continue
        if hints:
            break
    else:
        pytest.fail("the stage DP planned no random instance")
    order = ordered_candidates(costs, devices, options, hints)
    steps = {(h.num_stages, h.decision.num_microbatches): h.predicted_step_time_s for h in hints}
    keys = [(steps.get((s, m), math.inf), stage_count_lower_bound(tab, s), s, m) for s, m, tab in order]
    assert keys == sorted(keys) and len(keys) == len(set(k[2:] for k in keys))
    assert steps and all(k[0] < math.inf for k in keys[:len(steps)])


def test_the_budget_is_the_whole_searchs():
    """CP-SAT's deterministic time over all candidates stays within the budget plus
    the per-candidate floor ([Note: search budget]); a larger budget never gives a
    slower plan on these instances."""
    from zorse_fx.solve._search import MIN_CANDIDATE_BUDGET

    costs, devices, options = random_instance(7)
    for budget in (0.05, 0.5):
        res = solve_cpsat(costs, devices, dataclasses.replace(options, solver_budget=budget))
        used = [c["solver_budget_used"] for c in candidate_dicts(res) if c.get("solver_budget_used") is not None]
        # (a solve may overrun its share by what CP-SAT counts between its checks)
        assert sum(used) <= 1.1 * (budget + MIN_CANDIDATE_BUDGET * len(used)), used


def test_progress_lines_show_the_first_plan_then_each_candidate():
    costs, devices, options = random_instance(9)
    lines: list[str] = []
    res = solve_portfolio(costs, devices, options, solve_cpsat, progress=lines.append)
    assert lines[0].startswith("heuristics: best plan ") and "CP-SAT next" in lines[0]
    cands = [x for x in lines[1:] if x.startswith("CP-SAT candidate ")]
    assert cands and all("budget left" in x for x in cands)
    search = [c for c in res.candidates if c.kind == "solve"]
    assert len(cands) == sum(c.status != "PRUNED" for c in search)
    # "CP-SAT candidate k/N": N is every candidate of the search, solved or skipped
    assert {x.split()[2].split("/")[1] for x in cands} == {str(len(search))}


def _records(res):
    return [{k: v for k, v in c.items() if k != "wall_s"} for c in candidate_dicts(res)]


@pytest.mark.parametrize("seed", (1, 7, 13))
def test_jobs_buy_time_not_a_different_plan(seed):
    """[Note: candidate waves]: the candidates of a wave run side by side, and the
    plan, its status and every candidate's record are the same for 1, 2 or 4 jobs
    (and the per-GPU and class-level models alike)."""
    from zorse_fx.solve import solve_grouped

    costs, devices, options = random_instance(seed)
    for solver in (solve_cpsat, solve_grouped):
        runs = []
        for jobs in (1, 2, 4):
            try:
                res = solver(costs, devices, dataclasses.replace(options, solver_budget=0.5, jobs=jobs))
            except InfeasiblePlanError as exc:
                runs.append(str(exc))
                continue
            runs.append((res.decision, res.status, res.predicted_step_time_s, res.best_bound, _records(res)))
        assert runs[0] == runs[1] == runs[2]


@pytest.mark.parametrize("seed", (3, 7))
def test_portfolio_jobs_buy_time_not_a_different_plan(seed):
    """The portfolio's heuristics and the simulator's finalists run side by side in
    forked children (``map_isolated``): the plan, its status, bound and every record
    are those of one job, for 2 and 3 jobs."""
    costs, devices, options = random_instance(seed)
    runs = []
    for jobs in (1, 2, 3):
        try:
            res = solve_portfolio(costs, devices, dataclasses.replace(options, solver_budget=0.5, jobs=jobs),
                                  solve_cpsat)
        except InfeasiblePlanError as exc:
            runs.append(str(exc))
            continue
        runs.append((res.decision, res.status, res.predicted_step_time_s, res.best_bound, _records(res)))
    assert runs[0] == runs[1] == runs[2]


def test_map_isolated_answers_in_order_whatever_finishes_first():
    """``map_isolated``: values and exceptions in the order of the calls, for every
    ``jobs``; the first call finishing last does not reorder them."""
    import time

    from zorse_fx.solve.isolated import map_isolated

    def slow():
        time.sleep(0.3)
        return "slow"

    def bad():
        raise ValueError("no plan")

    for jobs in (1, 2, 4):
        out = map_isolated([slow, lambda: 2, bad, lambda: (3, "x")], jobs)
        assert [ok for ok, _ in out] == [True, True, False, True]
        assert [v for ok, v in out if ok] == ["slow", 2, (3, "x")]
        assert isinstance(out[2][1], ValueError) and str(out[2][1]) == "no plan"


def test_jobs_option_is_checked():
    from zorse_fx.errors import PlanOptionsError
    from zorse_fx.options import PlanOptions

    for bad in (0, -1, 1.5, True):
        with pytest.raises(PlanOptionsError, match=r"PlanOptions.jobs=.*use None \(the cores this process may use\) "
                                                   r"or an int >= 1"):
            PlanOptions(global_batch_size=8, jobs=bad)


def test_zorse_jobs_sets_the_default(monkeypatch):
    from zorse_fx.solve._search import default_jobs

    monkeypatch.setenv("ZORSE_JOBS", "3")
    assert default_jobs() == 3
    monkeypatch.setenv("ZORSE_JOBS", "many")
    with pytest.raises(ValueError, match=r"ZORSE_JOBS='many': use a whole number of processes >= 1, or unset it"):
        default_jobs()
    monkeypatch.delenv("ZORSE_JOBS")
    assert default_jobs() >= 1


def test_work_jobs_small_clusters_in_process(monkeypatch):
    """[Note: small searches in process]: the search's Python work runs in this process up to
    ``IN_PROCESS_MAX_GPUS`` GPUs unless ``PlanOptions.jobs`` or ``$ZORSE_JOBS`` ask otherwise; CP-SAT's
    own ``options_jobs`` is unchanged."""
    from zorse_fx.options import PlanOptions
    from zorse_fx.solve.isolated import IN_PROCESS_MAX_GPUS, default_jobs, options_jobs, work_jobs

    monkeypatch.delenv("ZORSE_JOBS", raising=False)
    options = PlanOptions(global_batch_size=8)
    assert work_jobs(options, 4) == work_jobs(options, IN_PROCESS_MAX_GPUS) == 1
    assert work_jobs(options, IN_PROCESS_MAX_GPUS + 1) == default_jobs() == options_jobs(options)
    assert work_jobs(dataclasses.replace(options, jobs=3), 4) == 3
    monkeypatch.setenv("ZORSE_JOBS", "2")
    assert work_jobs(options, 4) == 2
