"""bench/bound_gap.py: the idealised clusters and the verdict read from them."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from zorse_fx.solve import Decision, evaluate

from conftest import random_instance

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bound_gap  # noqa: E402


def test_ideal_links_cost_nothing_and_ideal_memory_fits_everything():
    costs, devices, opts = random_instance(1)
    decision = dict(stage_blocks=((0, 1), (1, costs.num_blocks)), stage_gpus=((0,), (1,)),
                    samples_per_microbatch=((2,), (2,)), num_microbatches=2)
    opts = dataclasses.replace(opts, global_batch_size=4)
    real = evaluate(costs, devices, opts, Decision(**decision))
    links = evaluate(costs, bound_gap.idealise(devices, "ideal_links"), opts, Decision(**decision))
    memory = evaluate(costs, bound_gap.idealise(devices, "ideal_memory"), opts, Decision(**decision))
    both = evaluate(costs, bound_gap.idealise(devices, "ideal_both"), opts, Decision(**decision))
    assert real.boundary_s[0] > 0 and links.boundary_s == (0.0, 0.0) and both.boundary_s == (0.0, 0.0)
    assert links.compute_s == real.compute_s and links.step_time_s < real.step_time_s
    assert memory.step_time_s == real.step_time_s and memory.memory_bytes == real.memory_bytes
    assert memory.feasible and both.feasible
    assert bound_gap.idealise(devices, "real") is devices


@pytest.mark.parametrize("fractions, expected", [
    ({"real": 0.87, "ideal_links": 0.9}, "meets 85%"),
    ({"real": 0.64, "ideal_links": 0.94, "ideal_memory": 0.64, "ideal_both": 0.98}, "communication-bound"),
    ({"real": 0.57, "ideal_links": 0.60, "ideal_memory": 0.86, "ideal_both": 0.9}, "memory-bound"),
    ({"real": 0.5, "ideal_links": 0.7, "ideal_memory": 0.6, "ideal_both": 0.9}, "communication- and memory-bound"),
    ({"real": 0.5, "ideal_links": 0.74, "ideal_memory": 0.5, "ideal_both": 0.74},
     "below 85% even with ideal links and memory"),
])
def test_verdict(fractions, expected):
    rows = [{"variant": v, "feasible": True, "fraction_of_upper_bound": f} for v, f in fractions.items()]
    assert bound_gap.verdict(rows) == expected


def test_an_infeasible_variant_counts_as_zero():
    rows = [{"variant": "real", "feasible": False, "fraction_of_upper_bound": 0.0},
            {"variant": "ideal_memory", "feasible": True, "fraction_of_upper_bound": 0.9}]
    assert bound_gap.verdict(rows) == "memory-bound"
