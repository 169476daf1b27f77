"""[C-objective]'s gradient sync overlaps the pipeline drain (issue 13 item 6):
stage s's own all-reduce starts when its last backward ends, D_s = floor(sum_{j<s}
(4 cmax_j + 3 boundary_j) / 6) ns before stage 0's, not after the whole drain.
The step equals that formula, recomputed here from the evaluation's per-stage
fields; it stays at or above the simulator (which starts a stage's buckets during
its last backward) within the stated tolerance; CP-SAT and brute force equal
``evaluate`` on it to the ns."""

from __future__ import annotations

import dataclasses

import pytest

from zorse_fx.sim import simulate
from zorse_fx.solve import BlockCosts, Decision, evaluate
from zorse_fx.solve.objective import UNIT_S

from conftest import assert_cpsat_equals_brute_force, make_devices, random_instance, solver_options

GIB = 1 << 30


def _ns(values):
    return [round(x / UNIT_S) for x in values]


def _old_and_new(ev, m):
    """(after-drain form, overlapped form) of the step in ns, from ``ev``'s per-stage
    fields (no tied parameters: ``allreduce_s`` is the stage's own all-reduce)."""
    t, c, b = _ns(ev.stage_time_s), _ns(ev.compute_s), _ns(ev.boundary_s)
    ar, opt = _ns(ev.allreduce_s), _ns(ev.optim_s)
    pipe = sum(t) + (m - 1) * max(t)
    drain = [sum(4 * c[j] + 3 * b[j] for j in range(s)) // 6 for s in range(len(t))]
    old = pipe + max(a + o for a, o in zip(ar, opt))
    new = pipe + max(a - d + o for a, d, o in zip(ar, drain, opt))
    return old, new, drain


def test_last_stage_sync_overlaps_the_drain():
    """3 stages: GPU 0, GPU 1, and GPUs 2-3 data-parallel on the last, largest
    block (400M parameters: a 3.2 GB ring on 10 GB/s links, 0.16 s); stages 0 and
    1 have no all-reduce. The last stage's sync starts D_2 = 2/3 (c_0 + c_1) +
    (boundary_0 + boundary_1) / 2 before the drain ends, so the step is that much
    below the after-drain form (its optimizer, 0.4 ms, is below the offset)."""
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (30e-3, 30e-3, 30e-3)},
                       param_count=(1_000_000, 1_000_000, 400_000_000),
                       act_bytes_per_sample=(1_000_000,) * 3, cut_bytes_per_sample=(0, 50_000_000, 50_000_000, 0))
    devices = make_devices(["A"] * 4, ["n0", "n1", "n2", "n2"], [80 * GIB] * 4, [2e12] * 4,
                           intra=(10e9, 1e-5), inter=(25e9, 2e-5))
    options = solver_options(global_batch_size=8, max_stages=3, num_microbatches=(4,))
    d = Decision(stage_blocks=((0, 1), (1, 2), (2, 3)), stage_gpus=((0,), (1,), (2, 3)),
                 samples_per_microbatch=((2,), (2,), (1, 1)), num_microbatches=4)
    ev = evaluate(costs, devices, options, d)
    assert ev.feasible, ev.violations
    ar = _ns(ev.allreduce_s)
    assert ar[0] == ar[1] == 0 and ar[2] > 100_000_000  # only the last stage reduces
    old, new, drain = _old_and_new(ev, 4)
    assert ev.objective_units == new
    assert drain[0] == 0 and drain[2] > drain[1] > 0
    assert new == old - drain[2]  # the whole offset: the last stage's sync decides the step
    # The simulator starts that ring during the last backward: at most the objective.
    sim = simulate(costs, devices, options, d)
    assert sim.step_time_s <= ev.step_time_s * (1 + 1e-9)
    ring = [e for e in sim.events if e.kind == "allreduce" and e.stage == 2]
    fb_end = max(e.end_s for e in sim.events if e.kind in ("F", "B"))
    assert ring and min(e.start_s for e in ring) < fb_end - drain[2] * UNIT_S


#: The simulator may exceed the objective by this much on these plans: messages
#: sharing one link, which the objective does not model (tests/test_sim.py's
#: test_agreement_with_objective). Measured over the 14 plans: sim / objective
#: min 0.364, max 0.987 (never above 1).
OVERLAP_TOL = 0.05


def _dp_last_stage(costs, devices, options):
    """Two stages: GPU 0 on the first half of the blocks, the other GPUs
    data-parallel on the rest (2 micro-batches of b = 2 (GPUs - 1) samples)."""
    n_g, nb = devices.num_gpus, costs.num_blocks
    k = n_g - 1
    opts = dataclasses.replace(options, global_batch_size=4 * k, max_stages=2, num_microbatches=(2,),
                               allow_idle_gpus=True)
    d = Decision(stage_blocks=((0, nb // 2), (nb // 2, nb)), stage_gpus=((0,), tuple(range(1, n_g))),
                 samples_per_microbatch=((2 * k,), (2,) * k), num_microbatches=2)
    return opts, d


def test_objective_stays_above_the_simulator_with_overlap():
    """On the random instances with >= 3 GPUs and >= 2 blocks: a plan whose last
    stage is data-parallel (so its sync can overlap stage 0's drain). The
    objective is within OVERLAP_TOL of the simulator from above (never more than
    that below it), at most the after-drain form, and strictly below it on some."""
    rows = []
    for seed in range(24):
        costs, devices, options = random_instance(seed)
        if devices.num_gpus < 3 or costs.num_blocks < 2:
            continue
        opts, d = _dp_last_stage(costs, devices, options)
        ev, sim = evaluate(costs, devices, opts, d), simulate(costs, devices, opts, d)
        old, new, _ = _old_and_new(ev, 2)
        assert ev.objective_units == new
        rows.append((seed, sim.step_time_s / ev.step_time_s, new < old))
        assert sim.step_time_s <= ev.step_time_s * (1 + OVERLAP_TOL), rows[-1]
    assert len(rows) >= 8 and sum(r[2] for r in rows) >= 3, rows
    print(f"\nsync overlap: sim / objective over {len(rows)} plans: min {min(r[1] for r in rows):.3f}, "
          f"max {max(r[1] for r in rows):.3f}; {sum(r[2] for r in rows)} below the after-drain form")


@pytest.mark.parametrize("seed", range(6))
def test_cpsat_equals_evaluate_and_brute_force_with_overlap(seed):
    """The random family with every link 10x slower (the all-reduce is worth
    overlapping): CP-SAT's optimum is brute force's, and both equal ``evaluate``
    to the ns (the search checks every answer)."""
    costs, devices, options = random_instance(seed)
    slow = tuple(tuple(bw / 10 for bw in row) for row in devices.link_bw_bytes_per_s)
    devices = dataclasses.replace(devices, link_bw_bytes_per_s=slow)
    options = dataclasses.replace(options, max_stages=3)
    assert_cpsat_equals_brute_force(costs, devices, options)
