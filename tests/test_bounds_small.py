"""The search's lower bounds per candidate, ``bounds.stage_count_lower_bound`` and
``bounds.structure_lower_bound`` ([Note: bounds of small clusters]): never above the exhaustive optimum
of their (S, M), and the candidates they let the CP-SAT search skip change nothing of the answer."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import random_instance
from zorse_fx.errors import InfeasiblePlanError
from zorse_fx.ir.costs import TiedParam
from zorse_fx.solve import solve_brute_force, solve_cpsat
from zorse_fx.solve.bounds import STRUCTURE_MAX_GPUS, stage_count_lower_bound, structure_lower_bound
from zorse_fx.solve.objective import UNITS_PER_S, build_tables, microbatch_candidates


def _instance(seed):
    """``random_instance(seed)`` with ZeRO-1 and recomputation allowed (the CP-SAT model's memory policies);
    on seeds 2, 5, 8, ... a parameter tied between the first and the last block (an input/output embedding,
    [C-tied]: the ring over its holders' GPUs is the bound's communication term)."""
    costs, devices, options = random_instance(seed)
    options = dataclasses.replace(options, sharding="auto", recompute="auto")
    if seed % 3 == 2 and costs.num_blocks >= 2:
        last = costs.num_blocks - 1
        numel = min(costs.param_count[0], costs.param_count[last]) // 2
        costs = dataclasses.replace(costs, tied_params=(TiedParam(name="emb", blocks=(0, last), numel=numel),))
    return costs, devices, options


def _holds_for_every_candidate(bound, costs, devices, options) -> None:
    """``bound(tab, S)`` is at most the brute-force optimum of every (S, M) that has a plan, and CP-SAT's
    answer (the bound skipping candidates) is the brute-force optimum; nothing to check without a plan."""
    try:
        brute = solve_brute_force(costs, devices, options)
    except InfeasiblePlanError:
        return
    checked = 0
    for c in brute.candidates:
        if c.step_time_s is None:
            continue
        tab = build_tables(costs, devices, options, c.num_microbatches)
        assert bound(tab, c.num_stages) <= round(c.step_time_s * UNITS_PER_S), c
        checked += 1
    assert checked
    res = solve_cpsat(costs, devices, options)
    assert res.predicted_step_time_s == pytest.approx(brute.predicted_step_time_s, rel=1e-9)


@pytest.mark.parametrize("seed", range(24))
def test_structure_bound_holds_for_every_candidate(seed):
    """The bound of every (S, M) is at most the brute-force optimum of that (S, M) (ZeRO-1 and recomputation
    allowed, none of ZeRO-2/3 or offload: the CP-SAT candidates' plans), and CP-SAT's answer with the bound
    skipping candidates is the brute-force optimum."""
    costs, devices, options = _instance(seed)
    assert devices.num_gpus <= STRUCTURE_MAX_GPUS
    _holds_for_every_candidate(structure_lower_bound, costs, devices, options)


@pytest.mark.parametrize("seed", range(1, 24, 2))
def test_stage_count_bound_holds_for_every_candidate(seed):
    """``bounds.stage_count_lower_bound`` never exceeds the exhaustive optimum of
    its (S, M) (odd seeds: a fixed per-micro-batch cost, what makes the bound
    grow as S shrinks), with every memory policy allowed; and where it prunes,
    CP-SAT's answer is the brute-force optimum all the same."""
    costs, devices, options = random_instance(seed)
    options = dataclasses.replace(options, sharding="auto", recompute="auto")
    _holds_for_every_candidate(stage_count_lower_bound, costs, devices, options)


def test_structure_bound_is_above_the_stage_count_bound_somewhere():
    """On these instances the bound adds something: above ``stage_count_lower_bound`` for some (S, M)
    (the link terms and the per-stage fixed times it counts)."""
    above = 0
    for seed in range(12):
        costs, devices, options = _instance(seed)
        for m in microbatch_candidates(options):
            tab = build_tables(costs, devices, options, m)
            for s in range(1, min(devices.num_gpus, costs.num_blocks, options.max_stages) + 1):
                above += structure_lower_bound(tab, s) > stage_count_lower_bound(tab, s)
    assert above > 0


def test_structure_bound_is_zero_beyond_its_gpu_limit():
    """Above ``STRUCTURE_MAX_GPUS`` GPUs the bound is not computed (0: no enumeration)."""
    from conftest import make_devices, solver_options

    costs, _, _ = _instance(1)
    n = STRUCTURE_MAX_GPUS + 1
    devices = make_devices(["A"] * n, ["n0"] * n, [16 * 2**30] * n, [900e9] * n)
    tab = build_tables(costs, devices, solver_options(global_batch_size=n), 1)
    assert structure_lower_bound(tab, 1) == 0
