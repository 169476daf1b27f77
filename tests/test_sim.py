"""Tests of the event-driven simulator (zorse_fx.sim): hand-checked steps,
link sharing, agreement with the planners' objective, trace / chart output."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics

import pytest

from zorse_fx.solve.objective import MEMORY_UNIT_BYTES

from zorse_fx.errors import InfeasiblePlanError
from zorse_fx.sim import gantt_png, simulate, to_perfetto
from zorse_fx.solve import BlockCosts, DeviceGraph, SolverOptions, evaluate, solve_cpsat

from conftest import CLUSTERS, make_devices, random_costs, random_instance

GIB = 1 << 30
KIB = MEMORY_UNIT_BYTES
MIB = 1 << 20


def _decision(res):
    return dict(stage_blocks=res.stage_blocks, stage_gpus=res.stage_gpus,
                samples_per_microbatch=res.samples_per_microbatch, num_microbatches=res.num_microbatches)


def _policy_kw(res):
    """The memory policy of a SolverResult as simulate / evaluate keyword arguments."""
    return dict(stage_sharded=res.stage_sharded,
                state_shard_mib=tuple(tuple(b // MIB for b in row) if sh else ()
                                      for sh, row in zip(res.stage_sharded, res.state_shard_bytes)),
                stage_recompute=res.stage_recompute)


def _assert_same_memory(res, ev, sim):
    for gpus, mem in zip(res.stage_gpus, ev.memory_bytes):
        assert tuple(sim.peak_memory_bytes[g] for g in gpus) == mem


def _compute_only(costs, devices):
    """The same instance without boundary bytes, link latency and parameters:
    only the F/B compute of the pipeline is left."""
    nb, g = costs.num_blocks, devices.num_gpus
    return (dataclasses.replace(costs, cut_bytes_per_sample=(0,) * (nb + 1), param_count=(0,) * nb),
            dataclasses.replace(devices, link_latency_s=((0.0,) * g,) * g))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_single_gpu(schedule):
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (2e-3, 1e-3)}, fwd_bwd_s_fixed={"A": (5e-4, 5e-4)},
                       param_count=(10_000_000, 5_000_000), act_bytes_per_sample=(1000, 500),
                       cut_bytes_per_sample=(0, 7, 0))
    devices = make_devices(["A"], ["n0"], [16 * GIB], [1e12])
    options = SolverOptions(global_batch_size=12, schedule=schedule)
    sim = simulate(costs, devices, options, stage_blocks=((0, 2),), stage_gpus=((0,),),
                   samples_per_microbatch=((4,),), num_microbatches=3)
    mb = 4 * 3e-3 + 1e-3  # n W + F per micro-batch
    optim = 2 * 16 * 15e6 / 1e12
    assert sim.step_time_s == pytest.approx(3 * mb + optim, rel=1e-12)
    fb = [e for e in sim.events if e.kind in ("F", "B")]
    order = "F0 B0 F1 B1 F2 B2" if schedule == "1f1b" else "F0 F1 F2 B0 B1 B2"
    assert [f"{e.kind}{e.microbatch}" for e in fb] == order.split()
    assert all(a.end_s == b.start_s for a, b in zip(fb, fb[1:]))  # no bubble on one GPU
    assert all(e.end_s - e.start_s == pytest.approx(mb / 3 if e.kind == "F" else 2 * mb / 3) for e in fb)
    assert sim.busy_fraction == (pytest.approx(3 * mb / (3 * mb + optim)),)
    assert sim.bubble_fraction == pytest.approx(optim / (3 * mb + optim))
    # Memory in the objective's KiB units: 1000 and 500 activation bytes round up to 1 KiB each.
    assert sim.peak_memory_bytes == (16 * 15e6 + 2 * KIB * 4 * (1 if schedule == "1f1b" else 3),)
    assert not [e for e in sim.events if e.kind in ("send", "allreduce")]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("num_stages", [2, 3])
def test_pipeline_with_free_links_takes_m_plus_s_minus_1_stage_times(schedule, num_stages):
    t, m = 6e-3, 4  # every stage: 1 sample x 6 ms per micro-batch
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (t,) * num_stages}, param_count=(0,) * num_stages,
                       act_bytes_per_sample=(100,) * num_stages, cut_bytes_per_sample=(0,) * (num_stages + 1))
    devices = dataclasses.replace(make_devices(["A"] * num_stages, ["n0"] * num_stages, [GIB] * num_stages,
                                                [1e12] * num_stages),
                                  link_latency_s=((0.0,) * num_stages,) * num_stages)
    options = SolverOptions(global_batch_size=m, schedule=schedule)
    kw = dict(stage_blocks=tuple((s, s + 1) for s in range(num_stages)),
              stage_gpus=tuple((s,) for s in range(num_stages)),
              samples_per_microbatch=((1,),) * num_stages, num_microbatches=m)
    sim = simulate(costs, devices, options, **kw)
    assert sim.step_time_s == pytest.approx((m + num_stages - 1) * t, rel=1e-12)
    assert sim.step_time_s == pytest.approx(evaluate(costs, devices, options, **kw).step_time_s, rel=1e-9)
    assert sim.bubble_fraction == pytest.approx((num_stages - 1) / (m + num_stages - 1))
    live = [min(num_stages - s, m) if schedule == "1f1b" else m for s in range(num_stages)]
    assert sim.peak_memory_bytes == tuple(KIB * n for n in live)  # 100 bytes round up to 1 KiB


def test_heterogeneous_dp_pair_with_allreduce():
    """GPU 0 is 3x faster than GPU 1 and takes 3 of the 4 samples (test_solver's _fast_slow)."""
    costs = BlockCosts(fwd_bwd_s_per_sample={"fast": (1e-3,), "slow": (3e-3,)}, param_count=(1_000_000,),
                       act_bytes_per_sample=(1_000_000,), cut_bytes_per_sample=(0, 0))
    devices = DeviceGraph(gpu_types=("fast", "slow"), memory_bytes=(16 * GIB, 16 * GIB),
                          mem_bw_bytes_per_s=(1e12, 5e11), link_bw_bytes_per_s=((0, 1e10), (1e10, 0)),
                          link_latency_s=((0, 1e-5), (1e-5, 0)), node_names=("n0", "n0"))
    kw = dict(stage_blocks=((0, 1),), stage_gpus=((0, 1),), samples_per_microbatch=((3, 1),), num_microbatches=1)
    options = SolverOptions(global_batch_size=4)
    sim = simulate(costs, devices, options, **kw)
    allreduce = 2 * 4 * 1e6 / 1e10 + 2 * (2 - 1) * 1e-5  # ring: 2 x grad bytes / bw + 2 (k-1) latency
    ar = [e for e in sim.events if e.kind == "allreduce"]
    assert [(e.gpu, e.start_s, e.nbytes) for e in ar] == [(0, pytest.approx(3e-3), 4_000_000),
                                                          (1, pytest.approx(3e-3), 4_000_000)]
    opt = {e.gpu: e for e in sim.events if e.kind == "optim"}
    assert opt[0].end_s - opt[0].start_s == pytest.approx(2 * 16e6 / 1e12)
    assert opt[1].start_s == pytest.approx(3e-3 + allreduce)
    assert sim.step_time_s == pytest.approx(3e-3 + allreduce + 2 * 16e6 / 5e11, rel=1e-12)
    assert sim.step_time_s == pytest.approx(evaluate(costs, devices, options, **kw).step_time_s, rel=1e-9)
    act = 977 * KIB  # 1e6 activation bytes per sample, rounded up to KiB as in the objective
    assert sim.peak_memory_bytes == (16_000_000 + 3 * act, 16_000_000 + act)


@pytest.mark.parametrize("nodes, shared", [(("n0", "n1", "n1"), True), (("n0", "n1", "n2"), False),
                                           (("n0", "n0", "n0"), False)])
def test_messages_share_link_bandwidth(nodes, shared):
    """GPU 0 (stage 0) sends half a micro-batch to each of GPUs 1 and 2 (stage 1).
    Both messages cross the same node pair only for nodes (n0, n1, n1): then
    each takes twice as long as alone. Inside a node every GPU pair is its own
    link; across distinct node pairs the messages do not meet."""
    bw, lat, cut = 10e9, 2e-5, 100_000_000
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (1e-3, 1e-3)}, param_count=(0, 0),
                       act_bytes_per_sample=(0, 0), cut_bytes_per_sample=(0, cut, 0))
    devices = make_devices(["A"] * 3, nodes, [GIB] * 3, [1e12] * 3, intra=(bw, lat), inter=(bw, lat))
    sim = simulate(costs, devices, SolverOptions(global_batch_size=2), stage_blocks=((0, 1), (1, 2)),
                   stage_gpus=((0,), (1, 2)), samples_per_microbatch=((2,), (1, 1)), num_microbatches=1)
    fwd = [e for e in sim.events if e.kind == "send" and e.gpu == 0]
    assert [(e.peer, e.nbytes) for e in fwd] == [(1, cut), (2, cut)]
    alone = cut / bw
    for e in fwd:
        assert e.start_s == pytest.approx(2e-3 / 3)
        assert e.end_s - e.start_s == pytest.approx(lat + (2 * alone if shared else alone), rel=1e-12)
    # Gradients back: both stage-1 GPUs finish B at the same time, so they share the same way.
    bwd = [e for e in sim.events if e.kind == "send" and e.gpu in (1, 2)]
    assert [e.end_s - e.start_s for e in bwd] == [pytest.approx(lat + (2 if shared else 1) * alone)] * 2
    assert sim.step_time_s == pytest.approx(3e-3 + 2 * (lat + (2 if shared else 1) * alone), rel=1e-12)


def test_unequal_shares_route_rows():
    """Stage 0 shares (3, 1), stage 1 shares (2, 2): rows [0,2) 0->2, [2,3) 0->3, [3,4) 1->3."""
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (1e-3, 1e-3)}, param_count=(10, 10),
                       act_bytes_per_sample=(0, 0), cut_bytes_per_sample=(0, 1000, 0))
    devices = make_devices(["A"] * 4, ["n0"] * 4, [GIB] * 4, [1e12] * 4)
    sim = simulate(costs, devices, SolverOptions(global_batch_size=8), stage_blocks=((0, 1), (1, 2)),
                   stage_gpus=((0, 1), (2, 3)), samples_per_microbatch=((3, 1), (2, 2)), num_microbatches=2)
    sends = {(e.gpu, e.peer, e.microbatch): e.nbytes for e in sim.events if e.kind == "send"}
    assert sends == {**{(0, 2, m): 2000 for m in (0, 1)}, **{(0, 3, m): 1000 for m in (0, 1)},
                     **{(1, 3, m): 1000 for m in (0, 1)}, **{(2, 0, m): 2000 for m in (0, 1)},
                     **{(3, 0, m): 1000 for m in (0, 1)}, **{(3, 1, m): 1000 for m in (0, 1)}}
    # GPU 3 cannot start F0 before both of its messages arrived.
    f3 = next(e for e in sim.events if e.kind == "F" and e.gpu == 3)
    assert f3.start_s >= max(e.end_s for e in sim.events if e.kind == "send" and e.peer == 3 and e.microbatch == 0)
    with pytest.raises(ValueError, match="sum to 3"):
        simulate(costs, devices, SolverOptions(global_batch_size=8), stage_blocks=((0, 2),), stage_gpus=((0,),),
                 samples_per_microbatch=((3,),), num_microbatches=2)


AGREEMENT_SEEDS = range(17)  # 15 feasible instances (seeds 8 and 11 are infeasible)
TOL = 0.15


def test_agreement_with_objective():
    """On the plans CP-SAT picks, simulator and objective agree as follows.

    Model differences (objective.py vs engine.py), all making the objective
    the pessimistic one:
      (a) boundary comm: charged in full inside every stage time t_s, i.e.
          once per micro-batch on the critical path; the simulator overlaps
          messages with the compute of other micro-batches;
      (b) gradient sync: max_s(allreduce_s + optim_s) after the whole
          pipeline drains; the simulator starts stage s's all-reduce once its
          own last backward ends (later stages overlap the drain of earlier ones);
      (c) fill/drain: sum_s t_s + (M-1) max_s t_s with t_s = F + B; the
          simulator's dependency graph with F = t/3, B = 2t/3 hides part of
          the non-bottleneck stages' fill (exact for equal stages, see
          test_pipeline_with_free_links...).
    Hence: sim <= obj (1 + TOL) (it may only exceed the objective where two
    boundaries share one link, which the objective does not model), and on the
    compute-only instance (a) and (b) vanish so |sim/obj - 1| <= TOL; with
    comm, the remaining gap is bounded below by that compute-only step.
    Measured on these 15 plans: the simulator is never slower (+0.0%), at most
    24.6% faster (seed 4: boundary comm is 48% of the objective); compute-only
    |deviation| <= 8.6%."""
    rows = []
    for seed in AGREEMENT_SEEDS:
        costs, devices, options = random_instance(seed, time_limit_s=5.0)
        try:
            res = solve_cpsat(costs, devices, options)
        except InfeasiblePlanError:
            continue
        kw = _decision(res)
        ev, sim = evaluate(costs, devices, options, **kw), simulate(costs, devices, options, **kw)
        c0, d0 = _compute_only(costs, devices)
        ev0, sim0 = evaluate(c0, d0, options, **kw), simulate(c0, d0, options, **kw)
        rows.append((seed, res.num_stages, res.num_microbatches, sim.step_time_s / ev.step_time_s - 1,
                     sim0.step_time_s / ev0.step_time_s - 1, sim.step_time_s / ev0.step_time_s - 1))
        # Peaks: the simulator's tracked in-flight count equals the model's inflight_s and both
        # count in the objective's KiB units, so the peaks are equal.
        _assert_same_memory(res, ev, sim)
        assert sim.step_time_s <= ev.step_time_s * (1 + TOL), rows[-1]
        assert abs(rows[-1][4]) <= TOL, rows[-1]
        assert sim.step_time_s >= ev0.step_time_s * (1 - TOL), rows[-1]
    assert len(rows) == 15 and sum(r[1] > 1 for r in rows) >= 8  # pipelines, not only single stages
    worst = min(rows, key=lambda r: r[3])
    print(f"\nsim vs objective over {len(rows)} plans: max |deviation| {abs(worst[3]):.1%} (seed {worst[0]}, "
          f"S={worst[1]}, M={worst[2]}), largest excess {max(r[3] for r in rows):+.1%}; compute-only "
          f"max |deviation| {max(abs(r[4]) for r in rows):.1%}")


def test_perfetto_trace_and_gantt_png(tmp_path):
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (2e-3, 1e-3, 1e-3), "B": (4e-3, 2e-3, 2e-3)},
                       param_count=(10_000_000,) * 3, act_bytes_per_sample=(1000,) * 3,
                       cut_bytes_per_sample=(0, 5_000_000, 5_000_000, 0))
    devices = make_devices(["A", "B", "A", "A"], ["n0", "n0", "n1", "n1"], [GIB] * 4, [1e12, 5e11, 1e12, 1e12])
    sim = simulate(costs, devices, SolverOptions(global_batch_size=12), stage_blocks=((0, 1), (1, 2), (2, 3)),
                   stage_gpus=((0, 1), (2,), (3,)), samples_per_microbatch=((2, 1), (3,), (3,)),
                   num_microbatches=4)
    labels = [f"gpu-{g}" for g in range(4)]
    doc = json.loads(to_perfetto(sim, tmp_path / "t" / "step.json", gpu_labels=labels).read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    compute = [e for e in xs if e["cat"] in ("F", "B")]
    assert len(compute) == sum(e.kind in ("F", "B") for e in sim.events) == 4 * 2 * 4
    assert len(xs) == len(sim.events)
    assert all(isinstance(e["ts"], float) and e["dur"] >= 0 and {"name", "pid", "tid", "args"} <= e.keys()
               for e in xs)
    assert max(e["ts"] + e["dur"] for e in xs) == pytest.approx(sim.step_time_s * 1e6)
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"node n0", "node n1"}
    for tid in {(e["pid"], e["tid"]) for e in xs}:  # slices on one thread never overlap
        lane = sorted((e["ts"], e["ts"] + e["dur"]) for e in xs if (e["pid"], e["tid"]) == tid)
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(lane, lane[1:]))
    png = gantt_png(sim, tmp_path / "step.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


# -- memory policy: ZeRO-1 sharding and stage recomputation ------------------

POLICY_SEEDS = range(24)  # 14 feasible with halved memory (seeds 0, 3, 4, 8, 9, 11, 14, 16, 17, 21 are not)


def test_agreement_with_objective_under_memory_policy():
    """As test_agreement_with_objective, on memory-tight instances (the random family
    with every GPU's memory halved) planned with sharding="auto", recompute="auto":
    the simulator replays the plan's policy and meets the same bounds; peak memory
    is equal. Sharded stages add all-reduce + optimizer + all-gather in both models
    (the same total), recomputing stages a third to every backward in both models, so
    no new model difference appears beyond (a)-(c) of that test; (c) applies with
    F = 1/4 and B = 3/4 of a recomputing stage's t_s.
    Measured on these 14 plans (8 use the policy: 4 shard, 4 recompute), never slower
    (+0.0%); at most 46.7% faster (seed 20, no policy: boundary comm is 21% of the
    objective); with a policy at most 31.6% faster (seed 19, two sharded stages:
    boundary comm 22%, and stage 1's sync overlaps stage 0's drain, (b));
    compute-only |deviation| <= 10.3% (seed 20)."""
    rows, n_sh, n_rc = [], 0, 0
    for seed in POLICY_SEEDS:
        costs, devices, options = random_instance(seed, time_limit_s=5.0)
        devices = dataclasses.replace(devices, memory_bytes=tuple(m // 2 for m in devices.memory_bytes))
        options = dataclasses.replace(options, sharding="auto", recompute="auto")
        try:
            res = solve_cpsat(costs, devices, options)
        except InfeasiblePlanError:
            continue
        kw, pol = _decision(res), _policy_kw(res)
        n_sh, n_rc = n_sh + any(res.stage_sharded), n_rc + any(res.stage_recompute)
        ev, sim = evaluate(costs, devices, options, **kw, **pol), simulate(costs, devices, options, **kw, **pol)
        assert ev.feasible, ev.violations
        assert sim.stage_sharded == ev.stage_sharded == res.stage_sharded
        assert sim.stage_recompute == ev.stage_recompute == res.stage_recompute
        assert sim.state_shard_bytes == ev.state_shard_bytes
        _assert_same_memory(res, ev, sim)
        # Compute-only: no parameters, so no shardable state: shards default to 0 MiB.
        c0, d0 = _compute_only(costs, devices)
        pol0 = dict(pol, state_shard_mib=None)
        ev0, sim0 = evaluate(c0, d0, options, **kw, **pol0), simulate(c0, d0, options, **kw, **pol0)
        rows.append((seed, res.num_stages, res.num_microbatches, sim.step_time_s / ev.step_time_s - 1,
                     sim0.step_time_s / ev0.step_time_s - 1))
        assert sim.step_time_s <= ev.step_time_s * (1 + TOL), rows[-1]
        assert abs(rows[-1][4]) <= TOL, rows[-1]
        assert sim.step_time_s >= ev0.step_time_s * (1 - TOL), rows[-1]
    assert len(rows) == 14 and n_sh >= 3 and n_rc >= 3, (len(rows), n_sh, n_rc)  # the policy is used
    worst = min(rows, key=lambda r: r[3])
    print(f"\nsim vs objective with memory policy over {len(rows)} plans ({n_sh} shard, {n_rc} recompute): "
          f"max |deviation| "
          f"{abs(worst[3]):.1%} (seed {worst[0]}), largest excess {max(r[3] for r in rows):+.1%}; "
          f"compute-only max |deviation| {max(abs(r[4]) for r in rows):.1%}")


def _sharded_instance():
    """One stage on three GPUs (one fast-memory, two slow), 4 Mi params: Q = 8 B/param = 32 MiB."""
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (3e-3,)}, param_count=(4 * MIB,),
                       act_bytes_per_sample=(10 * KIB,), cut_bytes_per_sample=(0, 0))
    devices = make_devices(["A"] * 3, ["n0"] * 3, [GIB] * 3, [1e12, 5e11, 5e11], intra=(50e9, 1e-5))
    kw = dict(stage_blocks=((0, 1),), stage_gpus=((0, 1, 2),), samples_per_microbatch=((2, 1, 1),),
              num_microbatches=1)
    return costs, devices, SolverOptions(global_batch_size=4, sharding="auto"), kw


def test_sharded_stage_allreduce_optim_allgather():
    costs, devices, options, kw = _sharded_instance()
    p, bw, lat = 4 * MIB, 50e9, 1e-5
    shards = (16, 4, 12)  # MiB; covers the 32 MiB of moments
    sim = simulate(costs, devices, options, **kw, stage_sharded=(True,), state_shard_mib=(shards,))
    ends_b = 2 * 3e-3  # GPU 0: 2 samples x 3 ms, the slowest compute
    ar = [e for e in sim.events if e.kind == "allreduce"]
    assert {(e.gpu, e.nbytes) for e in ar} == {(0, 4 * p), (1, 4 * p), (2, 4 * p)}  # ring all-reduce unchanged
    assert all(e.start_s == pytest.approx(ends_b) and e.end_s - e.start_s == pytest.approx(2 * 4 * p / bw + 2 * 2 * lat)
               for e in ar)
    opt = {e.gpu: e for e in sim.events if e.kind == "optim"}
    # Each GPU updates z_g MiB / 8 B params: 2 x 16 B/param of state read + written.
    for g, z in zip((0, 1, 2), shards):
        assert opt[g].start_s == pytest.approx(ar[0].end_s)
        assert opt[g].nbytes == 2 * 16 * z * MIB // 8
        assert opt[g].end_s - opt[g].start_s == pytest.approx(2 * 16 * (z * MIB / 8) / devices.mem_bw_bytes_per_s[g])
    # time x memory bandwidth is proportional to the shard
    work = [(opt[g].end_s - opt[g].start_s) * devices.mem_bw_bytes_per_s[g] / z for g, z in zip((0, 1, 2), shards)]
    assert work == [pytest.approx(work[0])] * 3
    last_opt = max(e.end_s for e in opt.values())
    assert last_opt == opt[2].end_s  # 12 MiB at half the bandwidth is the slowest shard
    ag = [e for e in sim.events if e.kind == "allgather"]
    assert {(e.gpu, e.nbytes) for e in ag} == {(0, 4 * p), (1, 4 * p), (2, 4 * p)}
    for e in ag:  # weights (4 B/param) over the slowest link + (k - 1) latencies, after the last shard
        assert e.start_s == pytest.approx(last_opt)
        assert e.end_s - e.start_s == pytest.approx(4 * p / bw + 2 * lat)
    assert sim.step_time_s == pytest.approx(ag[0].end_s, rel=1e-12)
    ev = evaluate(costs, devices, options, **kw, stage_sharded=(True,), state_shard_mib=(shards,))
    # The objective rounds the optimizer time per MiB to the ns (<= 0.5 ns x 12 MiB here).
    assert sim.step_time_s == pytest.approx(ev.step_time_s, abs=2e-8)
    # Memory: weights + grads replicated (8 B/param) + the shard + n_g x 10 KiB activations.
    assert sim.peak_memory_bytes == tuple(8 * p + z * MIB + n * 10 * KIB for z, n in zip(shards, (2, 1, 1)))
    assert sim.peak_memory_bytes == ev.memory_bytes[0]
    assert sim.state_shard_bytes == ((16 * MIB, 4 * MIB, 12 * MIB),) == ev.state_shard_bytes
    # Default shards are the evaluator's (balance_shards): 1 : 2 : 2 of the time ~ 16 : 8 : 8 MiB.
    dflt = simulate(costs, devices, options, **kw, stage_sharded=(True,))
    ev_d = evaluate(costs, devices, options, **kw, stage_sharded=(True,))
    assert dflt.state_shard_bytes == ev_d.state_shard_bytes == ((16 * MIB, 8 * MIB, 8 * MIB),)
    assert dflt.step_time_s == pytest.approx(ev_d.step_time_s, abs=2e-8)
    # Not sharded: no all-gather, the full state per GPU.
    plain = simulate(costs, devices, options, **kw)
    assert not [e for e in plain.events if e.kind == "allgather"]
    assert plain.peak_memory_bytes == tuple(16 * p + n * 10 * KIB for n in (2, 1, 1))
    with pytest.raises(ValueError, match="one int >= 0 per GPU"):
        simulate(costs, devices, options, **kw, stage_sharded=(True,), state_shard_mib=((16, 16),))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_recompute_backward_and_memory(schedule):
    """Three equal stages, stages 0 and 1 recompute, free links: each B re-runs its
    forward (+1/3), and a recomputing stage keeps only its inputs per micro-batch
    in flight plus the activations of the one being recomputed."""
    t, m, n = 6e-3, 4, 2
    act, cut = 100 * KIB, 3 * KIB  # per sample
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (t / n,) * 3}, param_count=(64,) * 3,
                       act_bytes_per_sample=(act,) * 3, cut_bytes_per_sample=(0, cut, cut, 0))
    devices = dataclasses.replace(make_devices(["A"] * 3, ["n0"] * 3, [GIB] * 3, [1e12] * 3),
                                  link_latency_s=((0.0,) * 3,) * 3)
    devices = dataclasses.replace(devices, link_bw_bytes_per_s=tuple(tuple(0.0 if a == b else math.inf
                                                                            for b in range(3)) for a in range(3)))
    options = SolverOptions(global_batch_size=m * n, schedule=schedule, recompute="auto")
    kw = dict(stage_blocks=((0, 1), (1, 2), (2, 3)), stage_gpus=((0,), (1,), (2,)),
              samples_per_microbatch=((n,),) * 3, num_microbatches=m, stage_recompute=(True, True, False))
    sim = simulate(costs, devices, options, **kw)
    ev = evaluate(costs, devices, options, **kw)
    for e in sim.events:
        if e.kind == "F":
            assert e.end_s - e.start_s == pytest.approx(t / 3) and e.recompute_s == 0
        elif e.kind == "B" and e.stage < 2:  # 2/3 backward + 1/3 forward re-run
            assert e.end_s - e.start_s == pytest.approx(2 * t / 3 + t / 3) and e.recompute_s == pytest.approx(t / 3)
        elif e.kind == "B":
            assert e.end_s - e.start_s == pytest.approx(2 * t / 3) and e.recompute_s == 0
    optim = 2 * 16 * 64 / 1e12
    if schedule == "gpipe":  # M + 2 forwards of t/3 fill the pipe; stage 2's B0 (2t/3), then
        # stage 1's M backwards of t each are the bottleneck, then stage 0's last B (t).
        fb = (m + 2) * t / 3 + 2 * t / 3 + m * t + t
        assert sim.step_time_s == pytest.approx(fb + optim, rel=1e-9)
        assert sim.step_time_s == pytest.approx(ev.step_time_s, abs=1e-8)  # = sum t_s + (M-1) max t_s
    else:  # stage 0: 3 warm-up F, B0 at 8t/3 (after stages 1, 2), then F3 / B1..B3 back to back but
        # B2 waits for stage 1's B2 (ends 16t/3): 16t/3 + 2t
        assert sim.step_time_s == pytest.approx(22 * t / 3 + optim, rel=1e-9)
        assert sim.step_time_s < ev.step_time_s  # (c): the light last stage hides part of the drain
    assert sim.stage_recompute == (True, True, False)
    state = -(-16 * 64 // KIB) * KIB  # 1 KiB
    live = [min(3 - s, m) if schedule == "1f1b" else m for s in range(3)]
    expect = (state + n * (live[0] * 0 + act),  # stage 0: no inputs to keep (X_0 = 0)
              state + n * (live[1] * cut + act),
              state + n * live[2] * act)
    assert sim.peak_memory_bytes == expect
    assert tuple(r[0] for r in ev.memory_bytes) == expect
    plain = simulate(costs, devices, options, **dict(kw, stage_recompute=None))
    assert plain.peak_memory_bytes == tuple(state + n * k * act for k in live)
    assert sum(e.end_s - e.start_s for e in sim.events if e.kind == "B") == pytest.approx(
        sum(e.end_s - e.start_s for e in plain.events if e.kind == "B") + 2 * m * t / 3)


def test_trace_shows_allgather_and_recompute(tmp_path):
    costs, devices, options, kw = _sharded_instance()
    costs = dataclasses.replace(costs, fwd_bwd_s_per_sample={"A": (1e-3, 2e-3)}, param_count=(2 * MIB, 2 * MIB),
                                act_bytes_per_sample=(KIB, KIB), cut_bytes_per_sample=(0, 4 * MIB, 0))
    dec = dict(stage_blocks=((0, 1), (1, 2)), stage_gpus=((0, 1), (2,)), samples_per_microbatch=((1, 1), (2,)),
               num_microbatches=2)
    sim = simulate(costs, devices, options, **dec, stage_sharded=(True, False), stage_recompute=(False, True))
    doc = json.loads(to_perfetto(sim, tmp_path / "step.json").read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    ag = [e for e in xs if e["cat"] == "allgather"]
    assert len(ag) == 2 and all(e["name"] == "all-gather (ZeRO-1)" and e["args"]["bytes"] == 4 * 2 * MIB for e in ag)
    rc_b = [e for e in xs if e["cat"] == "B" and e["args"].get("recompute")]
    rerun = [e for e in xs if e["cat"] == "recompute"]
    assert sorted(e["name"] for e in rc_b) == ["B0 (recompute)", "B1 (recompute)"]
    assert not [e for e in xs if e["cat"] == "B" and e not in rc_b and "recompute" in e["name"]]
    assert len(rerun) == 2
    for b, r in zip(sorted(rc_b, key=lambda e: e["ts"]), sorted(rerun, key=lambda e: e["ts"])):
        # the re-run forward nests inside its backward: a third of it (B = 2/3 + 1/3 of fwd+bwd)
        assert (r["pid"], r["tid"], r["ts"]) == (b["pid"], b["tid"], b["ts"])
        assert r["name"] == f"re-run F{b['args']['microbatch']}"
        assert r["dur"] == pytest.approx(b["dur"] / 3)
    assert len(xs) == len(sim.events) + len(rerun)
    png = gantt_png(sim, tmp_path / "step.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_decision_reads_the_plans_memory_policy():
    """``zorse simulate`` / the demo pass a Plan's policy; plans from before the policy
    (no ``sharded`` / ``recompute`` / ``state_shard_bytes`` attributes) get none."""
    from types import SimpleNamespace as NS

    from zorse_fx.sim.engine import plan_decision

    costs, devices, options, kw = _sharded_instance()
    gpus = [NS(gpu=g, samples_per_microbatch=n, state_shard_bytes=z * MIB) for g, n, z in
            zip((0, 1, 2), (2, 1, 1), (16, 4, 12))]
    plan = NS(num_microbatches=1, stages=(NS(index=0, blocks=(0, 1), gpus=tuple(gpus), sharded=True, recompute=True),))
    dec = plan_decision(plan, costs)
    assert dec == dict(kw, stage_sharded=(True,), state_shard_mib=((16, 4, 12),), stage_recompute=(True,))
    sim = simulate(costs, devices, options, **dec)
    assert sim.state_shard_bytes == ((16 * MIB, 4 * MIB, 12 * MIB),) and sim.stage_recompute == (True,)
    assert [e.kind for e in sim.events].count("allgather") == 3
    # All shards 0: the runtime splits equally, so does the simulator (32 MiB / 3 -> 11 MiB each).
    zero = NS(num_microbatches=1, stages=(NS(index=0, blocks=(0, 1), sharded=True, recompute=False,
                                             gpus=tuple(NS(gpu=g.gpu, samples_per_microbatch=g.samples_per_microbatch,
                                                           state_shard_bytes=0) for g in gpus)),))
    assert plan_decision(zero, costs)["state_shard_mib"] == ((11, 11, 11),)
    with pytest.raises(ValueError, match="pass the BlockCosts"):
        plan_decision(zero)
    old = NS(num_microbatches=1, stages=(NS(index=0, blocks=(0, 1), gpus=tuple(
        NS(gpu=g.gpu, samples_per_microbatch=g.samples_per_microbatch) for g in gpus)),))
    assert plan_decision(old) == dict(kw, stage_sharded=(False,), state_shard_mib=None, stage_recompute=(False,))


# -- interleaved 1F1B: S = P v stages on P GPU groups ------------------------

def _split(rng, total, k):
    """k positive ints summing to ``total`` (uniform random cut points)."""
    cuts = sorted(rng.sample(range(1, total), k - 1))
    return tuple(b - a for a, b in zip((0, *cuts), (*cuts, total)))


def _interleaved_instance(seed, *, policy=True):
    """(costs, devices, options, decision) of a random interleaved decision: P = 2-4
    GPU groups of 1-4 GPUs (types A / B on nodes n0-n2), v = 2-3 chunks, S = P v
    stages cut at random from S..2S blocks (so a group's chunks are unequal),
    M in {P, 2P, 3P}, random sample shares; with ``policy``, random recompute
    flags and some sharded multi-GPU stages (``balance_shards``' shards)."""
    rng = random.Random(seed)
    n_p, v = rng.randint(2, 4), rng.randint(2, 3)
    n_s = n_p * v
    nb = n_s + rng.randint(0, n_s)
    sizes = [1] * n_p
    for _ in range(rng.randint(0, 3)):
        sizes[rng.randrange(n_p)] += 1
    n_g = sum(sizes)
    types = [rng.choice("AB") for _ in range(n_g)]
    nodes = [rng.choice(["n0", "n1", "n2"]) for _ in range(n_g)]
    mem_bw = [rng.choice([900e9, 1.2e12]) if t == "A" else 300e9 for t in types]
    devices = make_devices(types, nodes, [16 * GIB] * n_g, mem_bw)
    costs = random_costs(rng, nb, "AB", fixed=rng.random() < 0.5)
    m = n_p * rng.randint(1, 3)
    b = max(sizes) + rng.randint(0, 3)
    order = list(range(n_g))
    rng.shuffle(order)
    groups = [tuple(order[sum(sizes[:p]):sum(sizes[:p + 1])]) for p in range(n_p)]
    shares = [_split(rng, b, len(g)) if len(g) > 1 else (b,) for g in groups]
    lengths = _split(rng, nb, n_s)
    ends = tuple(sum(lengths[:s + 1]) for s in range(n_s))
    kw = dict(stage_blocks=tuple(zip((0, *ends[:-1]), ends)), stage_gpus=tuple(groups) * v,
              samples_per_microbatch=tuple(shares) * v, num_microbatches=m, interleave=v)
    if policy:
        kw["stage_recompute"] = tuple(rng.random() < 0.3 for _ in range(n_s))
        kw["stage_sharded"] = tuple(len(groups[s % n_p]) > 1 and rng.random() < 0.4 for s in range(n_s))
    options = SolverOptions(global_batch_size=m * b, max_stages=n_p, max_interleave=v, sharding="auto",
                            recompute="auto")
    return costs, devices, options, kw


INTERLEAVED_SEEDS = range(50)


def _ends(sim, kind, **match):
    return [e for e in sim.events if e.kind == kind and all(getattr(e, k) == x for k, x in match.items())]


def test_interleaved_memory_equals_objective_and_schedule_is_followed():
    """(a) On random interleaved decisions (recomputing and sharded stages
    included) every GPU's simulated peak EQUALS ``evaluate``'s memory of each of
    its stages (sum of its stages' state + the schedule's exact activation
    peak), and the simulator ran each stage's F and B once per micro-batch on
    the stage's GPUs, each after the messages it needs (the wrap-around from
    group P-1 to group 0 included)."""
    seen = dict(recompute=0, sharded=0, multi_gpu=0)
    for seed in INTERLEAVED_SEEDS:
        costs, devices, options, kw = _interleaved_instance(seed)
        ev, sim = evaluate(costs, devices, options, **kw), simulate(costs, devices, options, **kw)
        v, n_s, m = kw["interleave"], len(kw["stage_blocks"]), kw["num_microbatches"]
        n_p = n_s // v
        assert sim.interleave == ev.interleave == v
        for gpus, mem in zip(kw["stage_gpus"], ev.memory_bytes):
            assert tuple(sim.peak_memory_bytes[g] for g in gpus) == mem, seed
        assert sim.state_shard_bytes == ev.state_shard_bytes and sim.stage_sharded == ev.stage_sharded
        assert sim.stage_recompute == ev.stage_recompute
        seen["recompute"] += any(kw["stage_recompute"])
        seen["sharded"] += any(kw["stage_sharded"])
        seen["multi_gpu"] += any(len(g) > 1 for g in kw["stage_gpus"])
        ran = {}
        for e in sim.events:
            if e.kind in ("F", "B"):
                assert e.gpu in kw["stage_gpus"][e.stage]
                assert (e.kind, e.stage, e.microbatch, e.gpu) not in ran
                ran[e.kind, e.stage, e.microbatch, e.gpu] = e
        assert len(ran) == 2 * m * sum(len(g) for g in kw["stage_gpus"])
        for (kind, s, mb, g), e in ran.items():
            if kind == "F":
                sends = _ends(sim, "send", peer=g, microbatch=mb, stage=s - 1, peer_stage=s)
                assert (len(sends) > 0) == (s > 0)
            else:
                sends = _ends(sim, "send", peer=g, microbatch=mb, stage=s + 1, peer_stage=s)
                assert (len(sends) > 0) == (s < n_s - 1)
                assert e.start_s >= ran["F", s, mb, g].end_s
            assert all(x.end_s <= e.start_s + 1e-12 for x in sends), (seed, kind, s, mb, g)
        wrap = _ends(sim, "send", stage=n_p - 1, peer_stage=n_p)
        assert wrap and {x.peer for x in wrap} <= set(kw["stage_gpus"][0])
    assert min(seen.values()) >= 10, seen


def _longest_path(costs, devices, options, kw):
    """Step of the schedule's task graph with free links and no sync: each stage's
    F = t/3 and B = 2t/3 (+ t/3 re-run when recomputing) of its slowest GPU's
    fwd+bwd time t; a task starts when its group's previous task and the task it
    depends on (F of the stage before, B of the stage after) have ended. An
    independent reference for the simulator on compute-only instances."""
    from zorse_fx.runtime.schedule import make_schedule

    v, n_s, m = kw["interleave"], len(kw["stage_blocks"]), kw["num_microbatches"]
    n_p = n_s // v
    dur = []
    for s, ((i, j), gpus, ns) in enumerate(zip(kw["stage_blocks"], kw["stage_gpus"], kw["samples_per_microbatch"])):
        t = max(n * sum(costs.fwd_bwd_s_per_sample[typ][i:j])
                + sum(costs.fwd_bwd_s_fixed.get(typ, (0.0,) * costs.num_blocks)[i:j])
                for g, n in zip(gpus, ns) for typ in [devices.gpu_types[g]])
        rc = t / 3 if (kw.get("stage_recompute") or (False,) * n_s)[s] else 0.0
        dur.append((t / 3, 2 * t / 3 + rc))
    sched = make_schedule(options.schedule, n_s, m, v)
    end, pc, free = {}, [0] * n_p, [0.0] * n_p
    while any(pc[p] < len(sched[p]) for p in range(n_p)):
        moved = False
        for p in range(n_p):
            while pc[p] < len(sched[p]):
                a = sched[p][pc[p]]
                s = p + a.chunk * n_p
                dep = (("F", s - 1) if a.kind == "F" else ("B", s + 1)) + (a.microbatch,)
                if 0 <= dep[1] < n_s and dep not in end:
                    break
                start = max(free[p], end.get(dep, 0.0))
                free[p] = end[a.kind, s, a.microbatch] = start + dur[s][a.kind == "B"]
                pc[p], moved = pc[p] + 1, True
        assert moved, "schedule deadlocked"
    return max(free)


#: Interleaved decisions, with communication: the simulator may be this much
#: slower than the objective (links shared by two boundaries, see below).
INTERLEAVED_TOL = 0.20


def test_interleaved_agreement_with_objective(capsys):
    """(b) Simulator vs the objective's [Note: interleaved stages] step on the random
    interleaved decisions of (a).

    Compute-only (no boundary bytes, latency or parameters), the simulator
    equals the schedule's task-graph longest path (``_longest_path``, an
    independent reference) on single-GPU groups and is at most that on
    multi-GPU groups (each GPU runs its own rows); the objective's step is
    that longest path computed in integer ns (``pipeline_terms.pipeline_makespan``).
    Measured on these 50 decisions, compute-only sim / objective: min 0.994,
    median 1.000, max 1.000. (A first objective, the closed form M max_p T_p +
    (sum_p T_p - max_p T_p) / v, is exact for equal chunks but was OPTIMISTIC
    where a group's chunks are unequal: min 0.931, median 1.008, max 1.249 on
    the same decisions, seed 17: P=4, v=3, M=8, group 3's chunks 138 / 189 /
    597 ms; chunks of different groups stall each other.) With communication
    and the memory policy: min 0.531, median 0.839, max 1.166 (seed 20: the
    boundaries of groups 0->1 and 1->2 share the n0-n1 node pair, which the
    objective does not model; elsewhere the objective is pessimistic as for
    v = 1, it charges the boundary on the task). Hence compute-only the
    objective is the longest path to rounding and at least the simulator,
    and with communication sim <= obj (1 + INTERLEAVED_TOL)."""
    rows = []
    for seed in INTERLEAVED_SEEDS:
        costs, devices, options, kw = _interleaved_instance(seed)
        ev, sim = evaluate(costs, devices, options, **kw), simulate(costs, devices, options, **kw)
        c0, d0 = _compute_only(costs, devices)
        kw0 = dict(kw, stage_sharded=None)  # no parameters, no shardable state
        ev0, sim0 = evaluate(c0, d0, options, **kw0), simulate(c0, d0, options, **kw0)
        path = _longest_path(c0, d0, options, kw0)
        if all(len(g) == 1 for g in kw["stage_gpus"]):
            assert sim0.step_time_s == pytest.approx(path, rel=1e-9), seed
        else:
            assert sim0.step_time_s <= path * (1 + 1e-9), seed
        rows.append((seed, sim.step_time_s / ev.step_time_s, sim0.step_time_s / ev0.step_time_s))
        assert sim.step_time_s <= ev.step_time_s * (1 + INTERLEAVED_TOL), rows[-1]
        # Compute-only the objective is the longest path (ns rounding) + the groups' sync.
        sync0 = max(ev0.allreduce_s[s] + ev0.optim_s[s] for s in range(len(kw["stage_blocks"]))) * kw["interleave"]
        assert path * (1 - 1e-6) <= ev0.step_time_s <= (path + sync0) * (1 + 1e-6), rows[-1]
        assert sim0.step_time_s <= ev0.step_time_s * (1 + 1e-6), rows[-1]
        assert rows[-1][2] >= 0.99, rows[-1]
    with capsys.disabled():
        for k, name in ((1, "sim/objective"), (2, "compute-only sim/objective")):
            xs = sorted(r[k] for r in rows)
            worst = max(rows, key=lambda r: r[k])
            print(f"\ninterleaved {name} over {len(rows)} decisions: min {xs[0]:.3f}, median "
                  f"{statistics.median(xs):.3f}, max {xs[-1]:.3f} (seed {worst[0]})", end="")
        print()


@pytest.mark.parametrize("groups, v, m, gpus_per_group", [(2, 2, 2, 1), (2, 3, 4, 2), (3, 2, 6, 1),
                                                          (4, 2, 4, 2), (4, 3, 8, 1), (3, 3, 3, 2)])
def test_interleaved_uniform_pipeline_takes_mv_plus_p_minus_1_stage_times(groups, v, m, gpus_per_group):
    """(c) Equal groups and chunks, free boundaries: the step is (M v + P - 1) stage
    times plus each group's sync, its stages' all-reduce + optimizer one after the
    other in stage order; the objective says the same to its ns rounding."""
    t, n_s, k = 6e-3, groups * v, gpus_per_group
    n_g, params, bw = groups * k, 1_000_000, 20e9
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (t,) * n_s}, param_count=(params,) * n_s,
                       act_bytes_per_sample=(100,) * n_s, cut_bytes_per_sample=(0,) * (n_s + 1))
    devices = make_devices(["A"] * n_g, ["n0"] * n_g, [GIB] * n_g, [1e12] * n_g, intra=(bw, 0.0))
    kw = dict(stage_blocks=tuple((s, s + 1) for s in range(n_s)),
              stage_gpus=tuple(tuple(range(p * k, p * k + k)) for p in range(groups)) * v,
              samples_per_microbatch=((1,) * k,) * n_s, num_microbatches=m, interleave=v)
    options = SolverOptions(global_batch_size=m * k, max_interleave=v)
    sim = simulate(costs, devices, options, **kw)
    ev = evaluate(costs, devices, options, **kw)
    allreduce = 2 * 4 * params / bw if k > 1 else 0.0
    optim = 2 * 16 * params / 1e12
    expect = (m * v + groups - 1) * t + v * (allreduce + optim)
    assert sim.step_time_s == pytest.approx(expect, rel=1e-12)
    assert sim.step_time_s == pytest.approx(ev.step_time_s, abs=1e-8)
    fb = [e for e in sim.events if e.kind in ("F", "B")]
    assert max(e.end_s for e in fb) == pytest.approx((m * v + groups - 1) * t, rel=1e-12)
    for g in range(n_g):  # every GPU computes M v chunk-micro-batches of t
        assert sum(e.end_s - e.start_s for e in fb if e.gpu == g) == pytest.approx(m * v * t)
        assert {e.stage for e in fb if e.gpu == g} == set(range(g // k, n_s, groups))
    for p in range(groups):  # sync: the group's stages one after the other, in stage order
        prev = max(e.end_s for e in fb if e.gpu // k == p)
        for s in range(p, n_s, groups):
            sync = [e for e in sim.events if e.stage == s and e.kind in ("allreduce", "optim")]
            assert len(sync) == k * (2 if k > 1 else 1)
            assert min(e.start_s for e in sync) == pytest.approx(prev, rel=1e-12)
            prev = max(e.end_s for e in sync)
            assert prev - min(e.start_s for e in sync) == pytest.approx(allreduce + optim, rel=1e-9)
    # Memory: v stages' state; peak activations = the schedule's largest sum over chunks of live x held.
    from zorse_fx.runtime.schedule import make_schedule

    state = v * 16 * params  # 16 MB per stage: a whole number of KiB (15625)
    for p in range(groups):
        live, peak = [0] * v, 0
        for a in make_schedule("1f1b", n_s, m, v)[p]:
            live[a.chunk] += 1 if a.kind == "F" else -1
            peak = max(peak, sum(live))
        assert all(sim.peak_memory_bytes[g] == state + KIB * peak for g in kw["stage_gpus"][p])
        assert ev.memory_bytes[p] == (state + KIB * peak,) * k


def test_interleave_one_is_the_default():
    """(d) interleave=1 is the one-stage-per-GPU simulation: the same result as
    leaving it out, every GPU's tasks on its one stage, sends to the next / previous stage."""
    for seed in range(6):
        costs, devices, options = random_instance(seed)
        n_g, nb = devices.num_gpus, costs.num_blocks
        n_s = min(n_g, nb)
        kw = dict(stage_blocks=tuple((s, s + 1) for s in range(n_s - 1)) + ((n_s - 1, nb),),
                  stage_gpus=tuple((s,) for s in range(n_s)), samples_per_microbatch=((1,),) * n_s,
                  num_microbatches=options.global_batch_size)
        plain, one = simulate(costs, devices, options, **kw), simulate(costs, devices, options, **kw, interleave=1)
        assert plain == one and one.interleave == 1
        assert one.peak_memory_bytes[:n_s] == tuple(r[0] for r in evaluate(costs, devices, options, **kw).memory_bytes)
        for e in one.events:
            if e.kind != "send":
                assert e.stage == e.gpu and e.peer_stage is None
            else:
                assert e.peer == e.peer_stage and abs(e.peer_stage - e.stage) == 1
    with pytest.raises(ValueError, match="multiple of 2"):
        simulate(costs, devices, SolverOptions(global_batch_size=3), stage_blocks=((0, 1), (1, 2), (2, nb)),
                 stage_gpus=((0,), (1,), (0,)), samples_per_microbatch=((1,),) * 3, num_microbatches=3,
                 interleave=2)


def _two_group_instance():
    """P = 2 single-GPU groups on two nodes, v = 2: stages 0, 2 on GPU 0 and 1, 3 on GPU 1."""
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (3e-3, 1e-3, 2e-3, 3e-3)}, param_count=(MIB,) * 4,
                       act_bytes_per_sample=(10 * KIB, 20 * KIB, 30 * KIB, 40 * KIB),
                       cut_bytes_per_sample=(0, MIB, 2 * MIB, 3 * MIB, 0))
    devices = make_devices(["A", "A"], ["n0", "n1"], [GIB] * 2, [1e12] * 2)
    kw = dict(stage_blocks=((0, 1), (1, 2), (2, 3), (3, 4)), stage_gpus=((0,), (1,), (0,), (1,)),
              samples_per_microbatch=((2,),) * 4, num_microbatches=2, interleave=2)
    return costs, devices, SolverOptions(global_batch_size=4, max_interleave=2), kw


def test_interleaved_wraparound_messages_and_memory():
    """Both GPUs exchange the messages of all three cuts (0->1, 1->2 the
    wrap-around, 2->3) in both directions, each once per micro-batch with its
    cut's bytes; recomputing stage 2 keeps its inputs per micro-batch."""
    costs, devices, options, kw = _two_group_instance()
    kw = dict(kw, stage_recompute=(False, False, True, False))
    sim = simulate(costs, devices, options, **kw)
    sends = sorted((e.gpu, e.peer, e.stage, e.peer_stage, e.microbatch, e.nbytes)
                   for e in sim.events if e.kind == "send")
    expect = []
    for m in range(2):
        for s in range(3):
            nbytes = 2 * (s + 1) * MIB  # 2 samples x the cut's bytes
            expect += [(s % 2, (s + 1) % 2, s, s + 1, m, nbytes), ((s + 1) % 2, s % 2, s + 1, s, m, nbytes)]
    assert sends == sorted(expect)
    f2 = _ends(sim, "F", stage=2)
    for e in f2:  # the wrap-around activations of the same micro-batch arrived first
        assert e.start_s >= _ends(sim, "send", stage=1, peer_stage=2, microbatch=e.microbatch)[0].end_s
    ev = evaluate(costs, devices, options, **kw)
    assert (sim.peak_memory_bytes[0],) == ev.memory_bytes[0] == ev.memory_bytes[2]
    assert (sim.peak_memory_bytes[1],) == ev.memory_bytes[1] == ev.memory_bytes[3]
    b2 = _ends(sim, "B", stage=2)
    assert all(e.recompute_s == pytest.approx(2 * 2e-3 / 3) for e in b2)
    assert not any(e.recompute_s for e in sim.events if e.kind == "B" and e.stage != 2)
    # GPU 1: state of stages 1 and 3 (16 B/param) + activations of both, M = P = 2: all forwards first.
    assert sim.peak_memory_bytes[1] == 2 * 16 * MIB + 2 * 2 * (20 + 40) * KIB


def test_interleaved_trace_labels_stages(tmp_path):
    costs, devices, options, kw = _two_group_instance()
    sim = simulate(costs, devices, options, **kw, stage_recompute=(False, False, True, False))
    doc = json.loads(to_perfetto(sim, tmp_path / "step.json").read_text())
    assert doc["otherData"]["interleave"] == 2
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    names = {(e["pid"], e["name"]) for e in xs if e["cat"] in ("F", "B")}
    assert {n for _, n in names} == {f"{k}{m} s{s}" + (" (recompute)" if (k, s) == ("B", 2) else "")
                                     for k in "FB" for m in range(2) for s in range(4)}
    for e in xs:
        if e["cat"] in ("F", "B"):
            assert e["name"].split()[1] == f"s{e['args']['stage']}"
    assert sorted(e["name"] for e in xs if e["cat"] == "recompute") == ["re-run F0 s2", "re-run F1 s2"]
    sends = {e["name"] for e in xs if e["cat"] == "send"}
    assert "send mb0 s1->s2 to GPU 0" in sends and "send mb1 s2->s1 to GPU 1" in sends
    assert all(e["args"]["peer_stage"] in (e["args"]["stage"] - 1, e["args"]["stage"] + 1)
               for e in xs if e["cat"] == "send")
    assert len(xs) == len(sim.events) + 2
    tasks = [e for e in xs if e["cat"] != "recompute"]  # re-runs nest in their backward
    for tid in {(e["pid"], e["tid"]) for e in tasks}:  # one task at a time per thread
        lane = sorted((e["ts"], e["ts"] + e["dur"]) for e in tasks if (e["pid"], e["tid"]) == tid)
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(lane, lane[1:]))
    png = gantt_png(sim, tmp_path / "step.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_plan_decision_round_trips_an_interleaved_plan(tmp_path, capsys):
    """(e) ``plan_decision`` of an interleaved Plan (``plan_fixed(..., interleave=2)``)
    gives back the decision and the degree, before and after export; simulating
    it meets the plan's predicted memory; ``zorse simulate`` runs on the export."""
    import torch

    from zorse_fx.capture import analyse, capture
    from zorse_fx.cli import main as zorse_main
    from zorse_fx.cluster import Cluster
    from zorse_fx.models.registry import load_model
    from zorse_fx.plan import Plan
    from zorse_fx.planner import PlanOptions, _analyse_and_price, _device_graph, plan_fixed
    from zorse_fx.sim.engine import plan_decision

    model, _ = load_model("gpt")  # the model `zorse simulate --model gpt` captures
    ids = torch.randint(0, 200, (2, 32))
    captured = capture(model, (ids, ids))
    nb = analyse(captured).num_blocks
    cluster = Cluster.from_yaml(CLUSTERS / "small_hetero.yaml")
    options = PlanOptions(global_batch_size=8)
    dec = dict(stage_blocks=((0, 2), (2, 3), (3, 4), (4, nb)), stage_gpus=((0, 1), (2,), (0, 1), (2,)),
               samples_per_microbatch=((3, 1), (4,), (3, 1), (4,)), num_microbatches=2)
    plan, _ = plan_fixed(captured, cluster, options, **dec, interleave=2, model_name="gpt",
                         stage_recompute=(False, False, True, False))
    want = dict(dec, interleave=2, stage_sharded=(False,) * 4, state_shard_mib=None,
                stage_recompute=(False, False, True, False))
    assert plan_decision(plan) == want
    loaded = Plan.load(plan.export(tmp_path / "plan"))
    assert plan_decision(loaded) == want
    _, costs, _ = _analyse_and_price(captured, cluster, options)
    sopts = SolverOptions(global_batch_size=8, max_interleave=2)
    sim = simulate(costs, _device_graph(cluster, options), sopts, **plan_decision(loaded))
    assert sim.interleave == 2
    for st in loaded.stages:
        for g in st.gpus:
            assert sim.peak_memory_bytes[g.gpu] == g.predicted_memory_bytes
    assert {e.stage for e in sim.events if e.gpu == 2 and e.kind == "F"} == {1, 3}
    assert zorse_main(["simulate", str(tmp_path / "plan"), "--model", "gpt", "--cluster",
                       str(CLUSTERS / "small_hetero.yaml"), "--out", str(tmp_path / "sim")]) == 0
    trace = json.loads((tmp_path / "sim" / "trace.json").read_text())
    assert {"F0 s0", "F0 s2", "B1 s2 (recompute)"} <= {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert "simulated step" in capsys.readouterr().out
