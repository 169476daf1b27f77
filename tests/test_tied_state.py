"""A tied parameter held by one stage counts once in its training state,
shardable state and optimizer time ([C-tied] in solve/objective.py,
solve/state_terms.py): the evaluator, the CP-SAT model, the stage DP and the
simulator price one copy per holding stage, as the runtime holds one
``nn.Parameter`` per stage."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import assert_cpsat_equals_brute_force, make_devices, random_instance, solver_options

from zorse_fx.errors import InfeasiblePlanError
from zorse_fx.ir.costs import TiedParam
from zorse_fx.sim import simulate
from zorse_fx.solve import BlockCosts, Decision, StageMemory, evaluate, solve_brute_force, solve_cpsat
from zorse_fx.solve.objective import UNITS_PER_S, build_tables, evaluate_result, to_units
from zorse_fx.solve.stage_dp import solve_stage_dp

KIB = 1024
#: Elements of the tied parameter: 16 * NUMEL and 8 * NUMEL are not whole KiB.
NUMEL = 40_000_001
MEM_BW = 1.2e12


def _costs(tied: bool = True) -> BlockCosts:
    """Three blocks; the first and the last read one tied parameter of NUMEL elements
    (counted in both blocks' param_count), the middle one does not."""
    return BlockCosts(fwd_bwd_s_per_sample={"A": (0.01, 0.02, 0.01)},
                      param_count=(NUMEL + 3_000_001, 50_000_003, NUMEL + 7),
                      act_bytes_per_sample=(3_000_001, 5_000_001, 2_000_001),
                      cut_bytes_per_sample=(0, 1_000_001, 1_000_001, 0),
                      tied_params=(TiedParam(name="emb", blocks=(0, 2), numel=NUMEL),) if tied else ())


def _kib_up(nbytes: int) -> int:
    return -(-nbytes // KIB)


def _by_hand(costs: BlockCosts, i: int, j: int):
    """(state KiB, shardable KiB, optimizer ns on MEM_BW) of a stage over blocks [i, j)
    holding both blocks of the tied parameter: the per-block tables less one copy,
    rounded DOWN to KiB (and to the nearest ns for the optimizer)."""
    state = sum(_kib_up(16 * p) for p in costs.param_count[i:j]) - 16 * NUMEL // KIB
    shard = sum(_kib_up(8 * p) for p in costs.param_count[i:j]) - 8 * NUMEL // KIB
    optim = sum(to_units(2 * 16 * p / MEM_BW) for p in costs.param_count[i:j]) - to_units(2 * 16 * NUMEL / MEM_BW)
    return state, shard, optim


def _transient(costs: BlockCosts, n: int) -> int:
    """KiB of [Note: gradient transients] (solve/state_terms.py) of a GPU with ``n`` samples on the one
    stage holding both blocks of the tied parameter: three of its float32 gradients, less the stage's
    activations of one micro-batch (no other parameter's size is known to these costs)."""
    return max(0, 3 * _kib_up(4 * NUMEL) - n * sum(_kib_up(a) for a in costs.act_bytes_per_sample))


def _one_gpu(memory_bytes: int):
    return make_devices(["A"], ["n0"], [memory_bytes], [MEM_BW])


def _one_stage(gpus=(0,), samples=((2,),), **kw) -> Decision:
    return Decision(stage_blocks=((0, 3),), stage_gpus=(tuple(gpus),), samples_per_microbatch=samples,
                    num_microbatches=1, **kw)


def test_one_stage_counts_a_tied_parameter_once_in_memory_and_optimizer():
    costs, untied = _costs(), _costs(tied=False)
    devices = _one_gpu(64 << 30)
    options = solver_options(global_batch_size=2, max_stages=1)
    ev, ev_untied = (evaluate(c, devices, options, _one_stage()) for c in (costs, untied))
    state, _, optim = _by_hand(costs, 0, 3)
    act = 2 * sum(_kib_up(a) for a in costs.act_bytes_per_sample)  # 1 micro-batch in flight, 2 samples
    tr = _transient(costs, 2)
    assert tr > 0  # (three 160 MB gradients against 20 MB of activations)
    assert ev.memory_bytes == ((KIB * (state + act + tr),),)
    assert round(ev.optim_s[0] * UNITS_PER_S) == optim
    # Exactly one copy's state and optimizer time below the count per block (the untied model, which
    # uses no weight twice: no transient).
    copy_kib, copy_ns = 16 * NUMEL // KIB, to_units(2 * 16 * NUMEL / MEM_BW)
    assert ev_untied.memory_bytes[0][0] - (ev.memory_bytes[0][0] - KIB * tr) == KIB * copy_kib
    assert round((ev_untied.optim_s[0] - ev.optim_s[0]) * UNITS_PER_S) == copy_ns
    # The simulator holds the same state and moves the parameters once in the optimizer step.
    sim = simulate(costs, devices, options, _one_stage())
    assert sim.peak_memory_bytes == (KIB * (state + act + tr),)
    (opt,) = [e for e in sim.events if e.kind == "optim"]
    assert opt.nbytes == 2 * 16 * (sum(costs.param_count) - NUMEL)


def test_tied_parameter_on_two_stages_keeps_a_copy_per_stage():
    """Blocks 0 and 2 on different stages: each stage holds its own copy, so the
    state per GPU is that of the untied model."""
    costs, untied = _costs(), _costs(tied=False)
    devices = make_devices(["A", "A"], ["n0", "n0"], [64 << 30] * 2, [MEM_BW] * 2)
    options = solver_options(global_batch_size=2, max_stages=2)
    d = Decision(stage_blocks=((0, 2), (2, 3)), stage_gpus=((0,), (1,)), samples_per_microbatch=((2,), (2,)),
                 num_microbatches=1)
    ev, ev_untied = (evaluate(c, devices, options, d) for c in (costs, untied))
    assert ev.memory_bytes == ev_untied.memory_bytes
    assert ev.optim_s == ev_untied.optim_s
    assert simulate(costs, devices, options, d).peak_memory_bytes == tuple(r[0] for r in ev.memory_bytes)


def test_sharded_stage_shards_the_tied_parameter_once():
    """ZeRO-1 over two GPUs: the shards cover Q_s less one copy (whole MiB), each
    GPU holds R_s (less one copy) + its shard; the simulator agrees to the KiB and
    its sharded optimizer steps move the shards' parameters."""
    costs = _costs()
    devices = make_devices(["A", "A"], ["n0", "n0"], [64 << 30] * 2, [MEM_BW] * 2)
    options = solver_options(global_batch_size=2, max_stages=1, sharding="always")
    d = _one_stage(gpus=(0, 1), samples=((1, 1),), memory=(StageMemory(zero=1),))
    ev = evaluate(costs, devices, options, d)
    assert ev.feasible, ev.violations
    state, shard, _ = _by_hand(costs, 0, 3)
    z = ev.decision.shard_mib[0]
    assert sum(z) == -(-shard // KIB)  # whole MiB covering the KiB of one copy less
    act = sum(_kib_up(a) for a in costs.act_bytes_per_sample)
    tr = _transient(costs, 1)
    assert ev.memory_bytes == (tuple(KIB * (state - shard + KIB * zg + act + tr) for zg in z),)
    sim = simulate(costs, devices, options, ev.decision)
    assert sim.peak_memory_bytes == ev.memory_bytes[0]
    assert sorted(e.nbytes for e in sim.events if e.kind == "optim") == sorted(2 * 16 * zg * KIB * KIB // 8
                                                                               for zg in z)
    ag = {e.nbytes for e in sim.events if e.kind == "allgather"}
    assert ag == {4 * (sum(costs.param_count) - NUMEL)}


def test_counting_the_tied_parameter_once_makes_a_plan_fit():
    """Usable memory exactly the one-copy need: evaluate, CP-SAT, brute force and
    the stage DP find the plan; one KiB less, or the parameter counted per block
    (the untied model), and nothing fits. Its objective is CP-SAT's to the ns."""
    costs = _costs()
    state, _, _ = _by_hand(costs, 0, 3)
    need = state + 2 * sum(_kib_up(a) for a in costs.act_bytes_per_sample) + _transient(costs, 2)
    options = solver_options(global_batch_size=2, max_stages=1, num_microbatches=(1,), memory_fraction=1.0)
    fits = _one_gpu(KIB * need)
    assert build_tables(costs, fits, options, 1).cap_bytes == (need,)
    ev = evaluate(costs, fits, options, _one_stage())
    assert ev.feasible and ev.memory_bytes == ((KIB * need,),)
    assert not evaluate(_costs(tied=False), fits, options, _one_stage()).feasible
    res = solve_cpsat(costs, fits, options)
    assert evaluate_result(costs, fits, options, res).objective_units == round(res.objective * UNITS_PER_S)
    assert round(solve_brute_force(costs, fits, options).objective * UNITS_PER_S) == round(res.objective * UNITS_PER_S)
    assert solve_stage_dp(costs, fits, options).decision.stage_blocks == ((0, 3),)
    short = _one_gpu(KIB * (need - 1))
    assert not evaluate(costs, short, options, _one_stage()).feasible
    for c, dev in ((costs, short), (_costs(tied=False), fits)):
        with pytest.raises(InfeasiblePlanError):
            solve_cpsat(c, dev, options)


def test_sharded_plan_fits_only_with_the_tied_parameter_once():
    """Two GPUs, one sharded stage, memory per GPU = R_s + half the shards + the
    activations with the copy counted once: CP-SAT's coverage and memory rows take
    it (objective = evaluate's), as does the stage DP; the untied count does not fit."""
    costs = _costs()
    state, shard, _ = _by_hand(costs, 0, 3)
    half = -(-(-(-shard // KIB)) // 2)  # MiB per GPU
    need = state - shard + KIB * half + sum(_kib_up(a) for a in costs.act_bytes_per_sample) + _transient(costs, 1)
    devices = make_devices(["A", "A"], ["n0", "n0"], [KIB * need] * 2, [MEM_BW] * 2)
    options = solver_options(global_batch_size=2, max_stages=1, num_microbatches=(1,), memory_fraction=1.0,
                             sharding="always", allow_idle_gpus=False)
    res = solve_cpsat(costs, devices, options)
    ev = evaluate_result(costs, devices, options, res)
    assert ev.feasible and ev.objective_units == round(res.objective * UNITS_PER_S)
    assert max(max(r) for r in ev.memory_bytes) <= KIB * need
    dp = solve_stage_dp(costs, devices, options)  # its exact memory check takes it too
    assert evaluate_result(costs, devices, options, dp).feasible
    for solve in (solve_cpsat, solve_stage_dp):
        with pytest.raises(InfeasiblePlanError):
            solve(_costs(tied=False), devices, options)


@pytest.mark.parametrize("seed", range(6))
def test_cpsat_matches_brute_force_with_tied_params_and_memory_policy(seed):
    """Random instances with a tied first / last block, sharding and recomputation
    decided per stage: CP-SAT's optimum equals the oracle's and ``evaluate``'s."""
    costs, devices, options = random_instance(seed)
    nb = costs.num_blocks
    numel = min(costs.param_count[0], costs.param_count[-1]) // 2 + 1
    costs = dataclasses.replace(costs, tied_params=(TiedParam(name="emb", blocks=(0, nb - 1), numel=numel),))
    options = dataclasses.replace(options, sharding=("auto", "always")[seed % 2],
                                  recompute=("auto", "never")[seed % 2])
    assert_cpsat_equals_brute_force(costs, devices, options, optimal=False)


def test_shardable_kib_from_costs_equals_the_tables():
    """``ir.costs.shardable_kib`` (what ``Plan.decision`` uses to
    split an old plan's sharded state equally) rounds as ``build_tables`` does:
    equal to the tables' Q_s of every block range, and to the hand count where
    the stage holds both tied blocks."""
    from zorse_fx.ir.costs import shardable_kib
    from zorse_fx.solve.objective import MEMORY_UNIT_BYTES
    from zorse_fx.solve.state_terms import stage_state_kib
    costs = _costs()
    tab = build_tables(costs, _one_gpu(80 * 2**30), solver_options(global_batch_size=2), 1)
    for i in range(3):
        for j in range(i + 1, 4):
            assert shardable_kib(costs, i, j, MEMORY_UNIT_BYTES) == stage_state_kib(tab, i, j)[1], (i, j)
    assert shardable_kib(costs, 0, 3, MEMORY_UNIT_BYTES) == _by_hand(costs, 0, 3)[1]
