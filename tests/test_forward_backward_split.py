"""Forward and backward priced apart (issue 32 item 5): ``BlockCosts``' forward
part sets the F and B tasks of the simulator, GPipe's period in the objective
and in CP-SAT, the interleaved replay, the re-run forward of a recomputing
stage and the drain bounds; the cost models fill it from their own split."""

from __future__ import annotations

import dataclasses
import random

import pytest

from zorse_fx.ir.costs import FORWARD_SHARE
from zorse_fx.sim import simulate
from zorse_fx.solve import BlockCosts, Decision, StageMemory, evaluate
from zorse_fx.solve.objective import evaluate_result
from zorse_fx.solve.tables import build_tables, drain_coefficients

from conftest import assert_cpsat_equals_brute_force, make_devices, random_instance, solver_options

GIB = 1 << 30
MS = 1e-3


def test_a_forward_longer_than_its_block_is_refused():
    with pytest.raises(ValueError, match=r"fwd_s_per_sample\['A'\] must have 2 entries, each between 0 and"):
        BlockCosts(fwd_bwd_s_per_sample={"A": (1e-3, 1e-3)}, fwd_s_per_sample={"A": (5e-4, 2e-3)},
                   param_count=(1, 1), act_bytes_per_sample=(1, 1), cut_bytes_per_sample=(0, 1, 0))
    with pytest.raises(ValueError, match=r"fwd_s_fixed\['A'\] must have 2 entries"):
        BlockCosts(fwd_bwd_s_per_sample={"A": (1e-3, 1e-3)}, fwd_s_fixed={"A": (1e-4,)},
                   param_count=(1, 1), act_bytes_per_sample=(1, 1), cut_bytes_per_sample=(0, 1, 0))


def test_a_type_without_a_split_takes_a_third():
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (3e-3, 6e-3), "B": (3e-3, 6e-3)},
                       fwd_bwd_s_fixed={"A": (3e-4, 0.0)}, fwd_s_per_sample={"B": (2e-3, 1e-3)},
                       param_count=(1, 1), act_bytes_per_sample=(1, 1), cut_bytes_per_sample=(0, 1, 0))
    assert costs.forward_s_per_sample("A") == pytest.approx((1e-3, 2e-3))
    assert costs.forward_s_fixed("A") == pytest.approx((1e-4, 0.0))
    assert costs.forward_s_per_sample("B") == (2e-3, 1e-3)
    assert costs.forward_s_fixed("B") == (0.0, 0.0)
    assert costs.forward_share_max() == pytest.approx(2 / 3)


def test_drain_coefficients():
    """(k_E, k_B, k_Brc) in sixths: the 1:2 split's (4, 4, 3); a larger forward
    share lowers them (a lower bound of the backward), a smaller one keeps them."""
    assert drain_coefficients(FORWARD_SHARE) == (4, 4, 3)
    assert drain_coefficients(0.2) == (4, 4, 3)
    assert drain_coefficients(0.5) == (3, 3, 2)
    assert drain_coefficients(2 / 3) == (2, 2, 1)
    assert drain_coefficients(1.0) == (0, 0, 0)


def _gpipe_two_stages(fwd_ms):
    """Two 1-GPU stages of 6 ms per micro-batch of one sample, free links, M = 4."""
    m = 4
    kw = dict(fwd_s_per_sample={"A": tuple(f * MS for f in fwd_ms)}) if fwd_ms else {}
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (6 * MS, 6 * MS)}, param_count=(0, 0),
                       act_bytes_per_sample=(100, 100), cut_bytes_per_sample=(0, 0, 0), **kw)
    devices = dataclasses.replace(make_devices(["A", "A"], ["n0", "n1"], [GIB] * 2, [1e12] * 2),
                                  link_latency_s=((0.0, 0.0), (0.0, 0.0)))
    dec = Decision(stage_blocks=((0, 1), (1, 2)), stage_gpus=((0,), (1,)), samples_per_microbatch=((1,), (1,)),
                   num_microbatches=m)
    return costs, devices, solver_options(global_batch_size=m, schedule="gpipe"), dec


def test_gpipe_by_hand_with_the_forward_split():
    """GPipe, 2 stages, M = 4, free links. Stage 0: F 3, B 3; stage 1: F 1, B 5
    (ms). Stage 0 forwards 0-12, stage 1's last forward ends at 13; its four
    backwards 13-33; stage 0's last backward 33-36: step 36 = sum t_s + (M - 1)
    (max F + max B) = 12 + 3 x 8. With the 1:2 split (F 2, B 4 on both) it is
    12 + 3 x 6 = 30: the split alone moves the step by 20%."""
    costs, devices, opts, dec = _gpipe_two_stages((3, 1))
    for p2p in ("nccl", "gloo", "buffered"):
        sim = simulate(costs, devices, opts, dec, p2p=p2p)
        assert sim.step_time_s == pytest.approx(36 * MS, rel=1e-9)
        spans = {(e.gpu, e.kind): e.end_s - e.start_s for e in sim.events if e.kind in "FB"}
        assert spans == {(0, "F"): pytest.approx(3 * MS), (0, "B"): pytest.approx(3 * MS),
                         (1, "F"): pytest.approx(1 * MS), (1, "B"): pytest.approx(5 * MS)}
    assert evaluate(costs, devices, opts, dec).step_time_s == pytest.approx(36 * MS, rel=1e-9)
    plain = _gpipe_two_stages(None)
    assert simulate(*plain).step_time_s == pytest.approx(30 * MS, rel=1e-9)
    assert evaluate(*plain).step_time_s == pytest.approx(30 * MS, rel=1e-9)


def test_recomputation_re_runs_the_cost_models_forward():
    """A recomputing stage's B task is its backward + its forward, not 1/3 of fwd+bwd."""
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (6 * MS,)}, fwd_bwd_s_fixed={"A": (1 * MS,)},
                       fwd_s_per_sample={"A": (3 * MS,)}, fwd_s_fixed={"A": (0.5 * MS,)},
                       param_count=(0,), act_bytes_per_sample=(100,), cut_bytes_per_sample=(0, 0))
    devices = make_devices(["A"], ["n0"], [GIB], [1e12])
    dec = Decision(stage_blocks=((0, 1),), stage_gpus=((0,),), samples_per_microbatch=((2,),), num_microbatches=1,
                   memory=(StageMemory(recompute=True),))
    opts = solver_options(global_batch_size=2, recompute="always")
    sim = simulate(costs, devices, opts, dec)
    (f,) = [e for e in sim.events if e.kind == "F"]
    (b,) = [e for e in sim.events if e.kind == "B"]
    assert f.end_s - f.start_s == pytest.approx(6.5 * MS)  # 2 x 3 + 0.5
    assert b.recompute_s == pytest.approx(6.5 * MS)
    assert b.end_s - b.start_s == pytest.approx(13 * MS - 6.5 * MS + 6.5 * MS)  # backward 6.5, re-run 6.5
    ev = evaluate(costs, devices, opts, dec)
    assert ev.compute_s[0] == pytest.approx(19.5 * MS, abs=1e-9)
    assert ev.step_time_s == pytest.approx(sim.step_time_s, abs=1e-9)


def _with_split(costs, rng):
    """``costs`` with a random forward share in [0.2, 0.6] per type and block."""
    share = {t: [rng.uniform(0.2, 0.6) for _ in v] for t, v in costs.fwd_bwd_s_per_sample.items()}
    return dataclasses.replace(
        costs, fwd_s_per_sample={t: tuple(x * f for x, f in zip(v, share[t]))
                                 for t, v in costs.fwd_bwd_s_per_sample.items()},
        fwd_s_fixed={t: tuple(x * f for x, f in zip(v, share[t])) for t, v in costs.fwd_bwd_s_fixed.items()})


@pytest.mark.parametrize("seed", range(12))
def test_cpsat_matches_brute_force_with_a_forward_split(seed):
    """CP-SAT's GPipe period, recomputation and drain terms read the same forward
    tables as the evaluator: its optimum equals brute force's to the ns."""
    costs, devices, options = random_instance(seed)
    costs = _with_split(costs, random.Random(100 + seed))
    options = dataclasses.replace(options, schedule=("gpipe", "1f1b")[seed % 2] if seed < 8 else options.schedule,
                                  recompute=("auto", "never", "always")[seed % 3], sharding="auto",
                                  grad_sharding="never")
    assert build_tables(costs, devices, options, 1).drain_coefs != (4, 4, 3)
    got = assert_cpsat_equals_brute_force(costs, devices, options)
    if got is not None:
        ref, _, ev = got
        assert evaluate_result(costs, devices, options, ref).objective_units == ev.objective_units


@pytest.mark.parametrize("share", [0.2, 0.5])
def test_interleaved_replay_takes_the_forward_split(share):
    """v = 2 on 2 groups, free links: the objective's replay of the runtime's
    program and the simulator agree to the ns rounding with a forward share
    other than 1/3."""
    t, groups, v, m = 6e-3, 2, 2, 4
    n_s = groups * v
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (t, 2 * t, t, 1.5 * t)},
                       fwd_s_per_sample={"A": (share * t, share * 2 * t, 0.3 * t, share * 1.5 * t)},
                       param_count=(0,) * n_s, act_bytes_per_sample=(100,) * n_s,
                       cut_bytes_per_sample=(0,) * (n_s + 1))
    devices = make_devices(["A"] * groups, ["n0"] * groups, [GIB] * groups, [1e12] * groups, intra=(20e9, 0.0))
    dec = Decision(stage_blocks=tuple((s, s + 1) for s in range(n_s)), stage_gpus=((0,), (1,)) * v,
                   samples_per_microbatch=((1,),) * n_s, num_microbatches=m, interleave=v)
    options = solver_options(global_batch_size=m, max_interleave=v)
    sim = simulate(costs, devices, options, dec)
    assert evaluate(costs, devices, options, dec).step_time_s == pytest.approx(sim.step_time_s, abs=1e-8)
    f = [e for e in sim.events if e.kind == "F" and e.stage == 1]
    assert all(e.end_s - e.start_s == pytest.approx(share * 2 * t) for e in f)
