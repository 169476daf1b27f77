"""The final polish ([Note: the final polish] in zorse_fx/solve/polish.py): a deterministic local search
around the planner's answer, accepted only where the objective prices it faster and the simulator's
re-rank agrees."""

from __future__ import annotations

import dataclasses
import random

import pytest
from conftest import random_instance

from zorse_fx.baselines import BASELINES
from zorse_fx.errors import InfeasiblePlanError
from zorse_fx.ir.decision import Decision
from zorse_fx.solve import evaluate
from zorse_fx.solve.polish import _rescaled, neighbours, polish


def _starts(seed: int):
    """(costs, devices, options, [decisions of every baseline with a plan]) of a random instance."""
    costs, devices, options = random_instance(seed)
    memory = "auto" if seed % 2 else "never"  # the memory neighbours on odd seeds
    options = dataclasses.replace(options, num_microbatches=None, max_microbatches=options.global_batch_size,
                                  sharding=memory, recompute=memory)
    out = []
    for name in sorted(BASELINES):
        try:
            out.append(BASELINES[name](costs, devices, options).decision)
        except (InfeasiblePlanError, ValueError):
            continue
    return costs, devices, options, out


@pytest.mark.parametrize("seed", range(12))
def test_neighbours_are_one_step_and_well_formed(seed):
    """Every neighbour is a valid Decision of the instance that differs from its origin in one of the four
    ways (cut, one sample, one stage's memory, the micro-batch count), with shards to be re-balanced."""
    costs, devices, options, starts = _starts(seed)
    for d in starts:
        for nb in neighbours(costs, devices, options, d):
            nb.check(num_blocks=costs.num_blocks, num_gpus=devices.num_gpus,
                     global_batch_size=options.global_batch_size, schedule=options.schedule)
            assert nb.shard_mib is None or not any(m.zero for m in nb.memory)
            assert nb.stage_gpus == d.stage_gpus and nb.interleave == d.interleave
            changed = [nb.stage_blocks != d.stage_blocks, nb.num_microbatches != d.num_microbatches,
                       nb.memory != d.memory,
                       nb.num_microbatches == d.num_microbatches
                       and nb.samples_per_microbatch != d.samples_per_microbatch]
            assert sum(changed) == 1, (d, nb)
            if changed[0]:
                assert sum(abs(a[1] - b[1]) for a, b in zip(nb.stage_blocks, d.stage_blocks)) == 1
            if changed[2]:
                assert sum(a != b for a, b in zip(nb.memory, d.memory)) == 1
            if changed[3]:  # one sample moved within one GPU group
                moved = [sum(abs(x - y) for x, y in zip(a, b))
                         for a, b in zip(nb.samples_per_microbatch, d.samples_per_microbatch)]
                assert set(moved) <= {0, 2}


@pytest.mark.parametrize("seed", range(16))
def test_polish_only_ever_improves_and_stops_at_a_local_optimum(seed):
    """From every baseline's plan: the polished plan is feasible and priced faster (1 ns units) than its
    start, or None; with the budget to spare, no neighbour of the result is faster (a local optimum); the
    same inputs give the same answer; the budget bounds the evaluations."""
    costs, devices, options, starts = _starts(seed)
    for d in starts:
        start = evaluate(costs, devices, options, d)
        ev, spent = polish(costs, devices, options, d, budget=10_000)
        again = polish(costs, devices, options, d, budget=10_000)
        assert (None if ev is None else ev.decision, spent) == (None if again[0] is None else again[0].decision,
                                                                 again[1])
        if ev is None:
            continue
        assert ev.feasible and ev.objective_units < start.objective_units
        assert start.feasible  # the polish starts only from a feasible plan
        for nb in neighbours(costs, devices, options, ev.decision):
            try:
                other = evaluate(costs, devices, options, nb)
            except ValueError:
                continue
            assert not (other.feasible and other.objective_units < ev.objective_units)
        small, used = polish(costs, devices, options, d, budget=3)
        assert used <= 3


def test_polish_moves_a_sample_to_the_faster_gpu():
    """Two GPUs of one stage, one 3x faster, an even split of 4: the polish moves samples to the fast GPU
    until a move no longer pays (3 on it, 1 on the slow one: 3 t against 3 t, then 4 t against 0)."""
    from conftest import make_devices, solver_options

    from zorse_fx.solve import BlockCosts

    devices = make_devices(["A", "B"], ["n0", "n0"], [16 * 2**30] * 2, [1e12] * 2)
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (1e-2, 1e-2), "B": (3e-2, 3e-2)}, param_count=(0, 0),
                       act_bytes_per_sample=(0, 0), cut_bytes_per_sample=(0, 0, 0))
    options = solver_options(global_batch_size=4, max_stages=1, num_microbatches=(1,), max_microbatches=1)
    d = Decision(stage_blocks=((0, 2),), stage_gpus=((0, 1),), samples_per_microbatch=((2, 2),), num_microbatches=1)
    ev, _ = polish(costs, devices, options, d)
    assert ev.decision.samples_per_microbatch == ((3, 1),)
    assert ev.step_time_s < evaluate(costs, devices, options, d).step_time_s


def test_rescaled_split_keeps_proportions():
    """A split rescaled to another micro-batch size sums to it, keeps every GPU >= 1 (else None) and moves
    each share by less than one sample from the exact proportion."""
    rng = random.Random(3)
    for _ in range(500):
        split = tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 6)))
        b = rng.randint(1, 40)
        got = _rescaled(split, b)
        if got is None:
            assert b < len(split) or any(n * b / sum(split) < 1 for n in split)
            continue
        assert sum(got) == b and min(got) >= 1
        assert all(abs(g - n * b / sum(split)) < 1 + 1e-9 for g, n in zip(got, split))


@pytest.mark.parametrize("seed", range(6))
def test_portfolio_polishes_the_best_few_and_never_returns_worse(seed):
    """The portfolio polishes its answer and the next best distinct plans in hand (POLISH_STARTS), one
    "polish" record each, the answer's first; the plan it returns is never priced slower than any plan a
    polish started from unless the simulator's re-rank chose it ([Note: simulator re-rank])."""
    from zorse_fx.portfolio import POLISH_STARTS, solve_portfolio
    from zorse_fx.solve import solve_cpsat

    costs, devices, options = random_instance(seed)
    options = dataclasses.replace(options, sharding="auto", recompute="auto")
    res = solve_portfolio(costs, devices, options, solve_cpsat)
    records = [c for c in res.candidates if c.kind == "polish"]
    assert 1 <= len(records) <= POLISH_STARTS
    if "+SIM_RERANKED" not in res.status:
        assert res.predicted_step_time_s <= min(c.best_bound_s for c in records) + 1e-9
    for c in records:
        assert c.step_time_s is None or c.step_time_s < c.best_bound_s
