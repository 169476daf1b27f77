"""Host-stashed recomputation in the planner ([C-stash] in ``solve/objective.py``): priced the same by the
objective and the simulator (memory and time), never negative, chosen by the stage DP where only it fits,
and read the same way by every planner through ``PlanOptions.stash`` ([Note: memory flags]).

The runtime side (equality with single-process training, the measured memory) is tests/test_block_stash.py
and tests/test_runtime_memory.py.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from conftest import make_devices
from test_sim_interleaved import INTERLEAVED_SEEDS, _interleaved_instance
from zorse_fx.errors import InfeasiblePlanError, PlanOptionsError
from zorse_fx.ir.costs import BlockCosts
from zorse_fx.ir.decision import Decision
from zorse_fx.ir.memory import StageMemory
from zorse_fx.options import PlanOptions
from zorse_fx.sim import simulate
from zorse_fx.solve.objective import evaluate
from zorse_fx.solve.stage_dp import solve_stage_dp

GIB = 2**30


def _with_host(devices, *, link=25e9):
    """``devices`` with 512 GiB of host memory per GPU and a PCIe 4.0 x16 link (25 GB/s per direction)."""
    n = devices.num_gpus
    return dataclasses.replace(devices, host_memory_bytes=(512 * GIB,) * n, host_mem_bw_bytes_per_s=(100e9,) * n,
                               host_link_bytes_per_s=(link,) * n)


def test_interleaved_memory_with_stash_equals_the_simulator_and_is_never_negative():
    """On random interleaved decisions with host-stashed recomputation on random stages (beside whole-stage
    recomputation and ZeRO-1), every GPU's simulated peak equals ``evaluate``'s memory of each of its stages,
    both > 0 (a stashing chunk holds its boundary tensors per micro-batch in flight, one block re-run in its
    backward), and a stashing stage whose blocks read inputs holds host memory."""
    stashing = 0
    for seed in INTERLEAVED_SEEDS:
        costs, devices, options, kw = _interleaved_instance(seed)
        rng = random.Random(20_000 + seed)
        kw["memory"] = tuple(StageMemory(zero=m.zero, recompute=True, stash="host") if rng.random() < 0.5 else m
                             for m in kw["memory"])
        devices = _with_host(devices)
        decision = Decision(**kw)
        ev, sim = evaluate(costs, devices, options, decision), simulate(costs, devices, options, decision)
        for gpus, mem, host, policy, (i, j) in zip(kw["stage_gpus"], ev.memory_bytes, ev.host_memory_bytes,
                                                   kw["memory"], kw["stage_blocks"]):
            assert min(mem) > 0, (seed, mem)
            assert tuple(sim.peak_memory_bytes[g] for g in gpus) == mem, seed
            if policy.stash == "host" and sum(costs.cut_bytes_per_sample[i:j]) > 0:  # (its blocks read inputs)
                assert min(host) > 0, (seed, host)
        stashing += any(m.stash == "host" for m in kw["memory"])
    assert stashing >= 40


def _big_activations():
    """4 blocks of 25M parameters (1.6 GB of fp32 training state) whose saved tensors are 4 GB per sample
    each and whose block inputs are 16 MB per sample: a stage of all four saves 16 GB per sample."""
    return BlockCosts(fwd_bwd_s_per_sample={"V100-16GB": (0.01,) * 4}, param_count=(25_000_000,) * 4,
                      act_bytes_per_sample=(4_000_000_000,) * 4, cut_bytes_per_sample=(0, *(16e6,) * 3, 0))


def test_stage_dp_stashes_where_only_that_fits():
    """One 12 GiB V100 and 16 GB of saved tensors per sample: no plan fits without recomputation, nor with
    whole-stage recomputation (it re-creates all 16 GB at once), nor with activation offload (one
    micro-batch's 16 GB on the GPU); host-stashed recomputation holds one block's 4 GB and two block inputs.
    Its compute pays the re-run forward; the 2 x 48 MB of block inputs over the host link per micro-batch hide
    behind the compute (a side stream) over PCIe, and show where the link is too slow for that; the objective's
    step and memory equal the simulator's."""
    costs = _big_activations()
    dev = _with_host(make_devices(["V100-16GB"], ["n0"], [12 * GIB], [900e9]), link=15.75e9)
    opts = PlanOptions(global_batch_size=4, planner="stage_dp", num_microbatches=(4,))
    with pytest.raises(InfeasiblePlanError):
        solve_stage_dp(costs, dev, dataclasses.replace(opts, stash="never"))
    d = solve_stage_dp(costs, dev, opts).decision
    assert d.memory == (StageMemory(recompute=True, stash="host"),)
    ev = evaluate(costs, dev, opts, d)
    assert ev.feasible
    fwd = 4 * 0.01 / 3  # the forward's part where the costs give none: 1/3
    moved = 3 * 16e6  # the blocks' inputs: the cuts into blocks 1-3 (block 0 reads the token ids)
    # (the tables round each block's bytes up to a KiB and the per-MiB time to a ns)
    assert ev.compute_s[0] == pytest.approx(4 * 0.01 + fwd, rel=1e-4)  # 6.1 ms of copies behind 13.3 + 40 ms
    assert ev.host_memory_bytes[0][0] == pytest.approx(moved, rel=1e-3)
    assert ev.memory_bytes[0][0] < 12 * GIB
    sim = simulate(costs, dev, opts, d)
    assert sim.step_time_s == pytest.approx(ev.step_time_s, rel=1e-5)
    assert sim.peak_memory_bytes[0] == ev.memory_bytes[0][0]
    slow = _with_host(make_devices(["V100-16GB"], ["n0"], [12 * GIB], [900e9]), link=0.1e9)  # 0.96 s of copies
    x = 2 * moved / 0.1e9
    ev = evaluate(costs, slow, opts, d)
    assert ev.compute_s[0] == pytest.approx(4 * 0.01 + fwd + (x / 2 - fwd) + (x / 2 - 4 * 0.01), rel=1e-4)
    assert simulate(costs, slow, opts, d).step_time_s == pytest.approx(ev.step_time_s, rel=1e-5)


def test_stash_needs_host_memory():
    """Without host memory on the GPU's node no stashing plan is priced feasible, and the stage DP finds none."""
    costs = _big_activations()
    dev = make_devices(["V100-16GB"], ["n0"], [12 * GIB], [900e9])
    opts = PlanOptions(global_batch_size=4, planner="stage_dp", num_microbatches=(4,))
    with pytest.raises(InfeasiblePlanError):
        solve_stage_dp(costs, dev, opts)
    d = solve_stage_dp(costs, _with_host(dev), opts).decision
    ev = evaluate(costs, dev, opts, d)
    assert not ev.feasible and any("host memory" in v for v in ev.violations), ev.violations


def test_the_stash_flag_and_what_it_implies():
    """[Note: memory flags]: ``stash="always"`` makes every stage recompute and rules out activation offload
    and ZeRO-2/3; it is refused beside ``recompute="never"`` or an "always" it rules out, naming both flags;
    ``recompute="never"`` makes it "never"."""
    o = PlanOptions(global_batch_size=4, stash="always")
    assert (o.recompute, o.activation_offload, o.grad_sharding, o.param_sharding) == ("always", "never", "never",
                                                                                     "never")
    assert PlanOptions(global_batch_size=4, recompute="never").stash == "never"
    with pytest.raises(PlanOptionsError, match=r"stash='always' \(zorse plan --stash always\) with "
                                               r"recompute='never'.*set one of them to 'auto'"):
        PlanOptions(global_batch_size=4, stash="always", recompute="never")
    with pytest.raises(PlanOptionsError, match=r"stash='always'.* with activation_offload='always'"):
        PlanOptions(global_batch_size=4, stash="always", activation_offload="always")
    with pytest.raises(PlanOptionsError, match=r"with grad_sharding='always'"):
        PlanOptions(global_batch_size=4, stash="always", grad_sharding="always")
