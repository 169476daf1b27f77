"""The simulator's check of a planner answer (zorse_fx/sim/check.py)."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import random_instance

from zorse_fx.ir.result import SolverResult
from zorse_fx.sim import PlanCheckError, check_result, simulate
from zorse_fx.solve import Decision, evaluate, solve_cpsat


@pytest.mark.parametrize("seed", [0, 1, 2, 5])
def test_check_of_solver_answers_matches_the_simulator(seed):
    costs, devices, opts = random_instance(seed)
    res = solve_cpsat(costs, devices, opts)
    check = check_result(costs, devices, opts, res)
    sim = simulate(costs, devices, opts, res.decision)
    assert check.simulated_step_time_s == sim.step_time_s
    assert check.predicted_step_time_s == res.predicted_step_time_s
    assert 0 < check.max_memory_fraction <= 1.0
    assert check.bubble_fraction == sim.bubble_fraction
    assert "simulator check: step" in check.summary()


def test_a_memory_breach_is_refused_with_the_gpu_named():
    """A decision over memory (scored, not solved: the planners never return one)
    handed to the check as if a planner had: PlanCheckError names GPU, stage, sizes."""
    costs, devices, opts = random_instance(1)
    tight = dataclasses.replace(devices, memory_bytes=(1 << 30,) * devices.num_gpus)
    nb = costs.num_blocks
    decision = dict(stage_blocks=((0, nb),), stage_gpus=((0,),), samples_per_microbatch=((opts.global_batch_size,),),
                    num_microbatches=1)
    ev = evaluate(costs, tight, opts, Decision(**decision))
    assert not ev.feasible
    res = SolverResult.from_evaluation(ev, options=opts, status="TEST", best_bound=0.0)
    with pytest.raises(PlanCheckError, match=r"GPU 0 \(\w+, stage 0\) peaks at [\d.]+ GiB > 0\.90 GiB usable "
                                             r"\(0\.9 x 1\.0 GiB\)"):
        check_result(costs, tight, opts, res)


def test_a_slower_simulation_warns():
    costs, devices, opts = random_instance(0)
    res = solve_cpsat(costs, devices, opts)
    assert check_result(costs, devices, opts, res).warnings == ()
    # The simulator is never more than 2x faster than the objective here, so
    # a tolerance of -50% makes the (real) simulated step "too slow".
    check = check_result(costs, devices, opts, res, tolerance=-0.5)
    assert len(check.warnings) == 1 and "slower than predicted" in check.warnings[0]
