"""CP-SAT solves run in forked children, so an OR-Tools abort costs one
candidate, not the process ([Note: isolated solves] in zorse_fx/solve/isolated.py)."""

from __future__ import annotations

import faulthandler
import os

import pytest
from conftest import candidate_dicts, random_instance, solver_options

from zorse_fx.errors import InfeasiblePlanError
from zorse_fx.solve import _search
from zorse_fx.solve._search import SolverCrash, run_isolated
from zorse_fx.solve.cpsat import solve_cpsat

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def _abort(*_args):
    """SIGABRT, as OR-Tools' uncaught C++ exception raises (quietly: no faulthandler dump)."""
    faulthandler.disable()
    os.abort()


def test_run_isolated_returns_the_childs_value_and_reraises_its_errors():
    parent = os.getpid()
    assert run_isolated(lambda: (os.getpid() != parent, [1, 2])) == (True, [1, 2])

    def fail():
        raise ValueError("bad model")

    with pytest.raises(ValueError, match="bad model"):
        run_isolated(fail)


def test_run_isolated_reports_a_child_killed_by_abort():
    with pytest.raises(SolverCrash, match=r"SIGABRT"):
        run_isolated(_abort)


def test_a_batch_answers_each_call_and_names_the_one_its_child_died_in():
    """[Note: tries batched per child]: one child runs the calls in order; the answers before a crash
    are kept, the call it died in is a SolverCrash, the calls after it were never started (None)."""
    from zorse_fx.solve.isolated import start_isolated_batch

    parent = os.getpid()

    def fail():
        raise ValueError("bad model")

    out = start_isolated_batch([lambda: os.getpid() != parent, fail, lambda: 3, _abort, lambda: 5]).results()
    assert out[0].result() is True and out[2].result() == 3 and out[4] is None
    with pytest.raises(ValueError, match="bad model"):
        out[1].result()
    with pytest.raises(SolverCrash, match=r"SIGABRT"):
        out[3].result()
    assert [d.result() for d in start_isolated_batch([lambda: 1, lambda: (2, "x")]).results()] == [1, (2, "x")]


def test_in_process_switch(monkeypatch):
    monkeypatch.setenv("ZORSE_SOLVE_IN_PROCESS", "1")
    assert run_isolated(os.getpid) == os.getpid()


def test_a_crashing_solve_is_retried_and_the_plan_is_the_same(monkeypatch, tmp_path):
    """The first CP-SAT solve of every candidate aborts its child (a real SIGABRT,
    as OR-Tools#5288 does); the retry finds a plan as good as an undisturbed run's."""
    costs, devices, opts = random_instance(3)
    clean = solve_cpsat(costs, devices, opts)
    real_solve = _search._solve

    def abort_first(model, solver, *rest):
        # One marker file per candidate (it outlives the forked child), named by the
        # candidate's (stages, micro-batches): the first solve of each aborts, every
        # later one solves. (Named by id(model) first, which a later candidate could
        # reuse, then by a hash of the model's text: neither is the candidate itself.)
        try:
            (tmp_path / f"S{model.S}_M{model.tab.num_microbatches}").open("x").close()
        except FileExistsError:
            return real_solve(model, solver, *rest)
        _abort()

    monkeypatch.setattr(_search, "_solve", abort_first)
    res = solve_cpsat(costs, devices, opts)
    # The same optimum (the retry runs without presolve, so CP-SAT may return a symmetric
    # plan with interchangeable GPUs swapped). Both runs stop on the deterministic budget,
    # never on the machine's speed ([Note: reproducible plans]).
    assert res.predicted_step_time_s == pytest.approx(clean.predicted_step_time_s, abs=1e-9)
    got, want = res.decision, clean.decision
    assert (got.num_stages, got.num_microbatches, res.status) == (want.num_stages, want.num_microbatches, clean.status)
    solved = [c for c in candidate_dicts(res) if "num_stages" in c]
    assert len(solved) == len([c for c in candidate_dicts(clean) if "num_stages" in c])
    crashes = {(c["num_stages"], c["num_microbatches"]): c.get("crashes", []) for c in solved}
    assert all(len(v) == 1 and "SIGABRT" in v[0] for v in crashes.values()), crashes


def test_a_candidate_that_always_crashes_is_recorded_and_skipped(monkeypatch):
    """Every solve of the 2-stage candidates aborts: they are CRASHED (no plan, the
    search is not OPTIMAL) and the 1-stage plan is returned."""
    costs, devices, opts = random_instance(2)
    assert solve_cpsat(costs, devices, opts).num_stages == 2  # undisturbed, 2 stages win
    real_solve = _search._solve

    def abort_two_stages(model, solver, *rest):
        if model.S == 2:
            _abort()
        return real_solve(model, solver, *rest)

    monkeypatch.setattr(_search, "_solve", abort_two_stages)
    res = solve_cpsat(costs, devices, opts)
    crashed = [c for c in candidate_dicts(res) if c.get("status") == "CRASHED"]
    assert crashed and all(c["num_stages"] == 2 and len(c["crashes"]) >= 2 for c in crashed)
    assert res.num_stages == 1 and res.status == "FEASIBLE"


def test_when_every_candidate_crashes_the_error_says_so(monkeypatch):
    costs, devices, opts = random_instance(2)
    monkeypatch.setattr(_search, "_solve", _abort)
    with pytest.raises(InfeasiblePlanError, match=r"OR-Tools crashed on every try \(google/or-tools#5288"):
        solve_cpsat(costs, devices, opts)


def test_hinted_candidates_complete_their_hint_in_the_solve_child():
    """The portfolio hints CP-SAT with the stage DP's and the baselines' plans;
    each hinted candidate completes its hint in the same forked child as its
    solve and records it."""
    from zorse_fx.portfolio import solve_portfolio

    costs, devices, opts = random_instance(2)
    res = solve_portfolio(costs, devices, opts, solve_cpsat)
    hinted = [c for c in candidate_dicts(res) if c.get("hint")]
    assert hinted and all(c["hint_completed"] is True for c in hinted)
    assert res.predicted_step_time_s == pytest.approx(solve_cpsat(costs, devices, opts).predicted_step_time_s,
                                                      abs=1e-9)
