"""Tests of the event-driven simulator (zorse_fx.sim): hand-checked steps,
link sharing, agreement with the planners' objective, trace / chart output."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from conftest import compute_only, make_devices, random_instance, solver_options

from zorse_fx.errors import InfeasiblePlanError
from zorse_fx.sim import gantt_png, simulate, to_perfetto
from zorse_fx.sim.trace import stage_memory
from zorse_fx.solve import BlockCosts, Decision, DeviceGraph, StageMemory, evaluate, solve_cpsat
from zorse_fx.solve.objective import MEMORY_UNIT_BYTES

GIB = 1 << 30
KIB = MEMORY_UNIT_BYTES
MIB = 1 << 20
PLAIN, ZERO1, RECOMPUTE = StageMemory(), StageMemory(zero=1), StageMemory(recompute=True)


def _decision(res):
    d = res.decision
    return dict(stage_blocks=d.stage_blocks, stage_gpus=d.stage_gpus, samples_per_microbatch=d.samples_per_microbatch,
                num_microbatches=d.num_microbatches)


def _policy_kw(res):
    """The memory policy of a SolverResult's decision as ``Decision`` fields."""
    d = res.decision
    return dict(memory=d.memory, shard_mib=d.shard_mib)


def _assert_same_memory(res, ev, sim):
    for gpus, mem in zip(res.decision.stage_gpus, ev.memory_bytes):
        assert tuple(sim.peak_memory_bytes[g] for g in gpus) == mem


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_single_gpu(schedule):
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (2e-3, 1e-3)}, fwd_bwd_s_fixed={"A": (5e-4, 5e-4)},
                       param_count=(10_000_000, 5_000_000), act_bytes_per_sample=(1000, 500),
                       cut_bytes_per_sample=(0, 7, 0))
    devices = make_devices(["A"], ["n0"], [16 * GIB], [1e12])
    options = solver_options(global_batch_size=12, schedule=schedule)
    sim = simulate(costs, devices, options, Decision(stage_blocks=((0, 2),), stage_gpus=((0,),),
                                                     samples_per_microbatch=((4,),), num_microbatches=3))
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
    options = solver_options(global_batch_size=m, schedule=schedule)
    kw = dict(stage_blocks=tuple((s, s + 1) for s in range(num_stages)),
              stage_gpus=tuple((s,) for s in range(num_stages)),
              samples_per_microbatch=((1,),) * num_stages, num_microbatches=m)
    sim = simulate(costs, devices, options, Decision(**kw))
    assert sim.step_time_s == pytest.approx((m + num_stages - 1) * t, rel=1e-12)
    assert sim.step_time_s == pytest.approx(evaluate(costs, devices, options, Decision(**kw)).step_time_s, rel=1e-9)
    assert sim.bubble_fraction == pytest.approx((num_stages - 1) / (m + num_stages - 1))
    live = [min(num_stages - s, m) if schedule == "1f1b" else m for s in range(num_stages)]
    assert sim.peak_memory_bytes == tuple(KIB * n for n in live)  # 100 bytes round up to 1 KiB


def _buckets(grad_bytes: int) -> int:
    """Gradient buckets of one block's ``grad_bytes`` of float32 gradients (the
    runtime's: a 1 MiB first bucket, then 25 MiB; grad_sync.bucket_caps)."""
    from zorse_fx.ir.buckets import BUCKET_BYTES, bucket_caps

    first, cap = bucket_caps(BUCKET_BYTES)
    return 1 if grad_bytes <= first else 1 + -(-(grad_bytes - first) // cap)


def test_heterogeneous_dp_pair_with_allreduce():
    """GPU 0 is 3x faster than GPU 1 and takes 3 of the 4 samples (test_solver's _fast_slow)."""
    costs = BlockCosts(fwd_bwd_s_per_sample={"fast": (1e-3,), "slow": (3e-3,)}, param_count=(1_000_000,),
                       act_bytes_per_sample=(1_000_000,), cut_bytes_per_sample=(0, 0))
    devices = DeviceGraph(gpu_types=("fast", "slow"), memory_bytes=(16 * GIB, 16 * GIB),
                          mem_bw_bytes_per_s=(1e12, 5e11), link_bw_bytes_per_s=((0, 1e10), (1e10, 0)),
                          link_latency_s=((0, 1e-5), (1e-5, 0)), node_names=("n0", "n0"))
    kw = dict(stage_blocks=((0, 1),), stage_gpus=((0, 1),), samples_per_microbatch=((3, 1),), num_microbatches=1)
    options = solver_options(global_batch_size=4)
    sim = simulate(costs, devices, options, Decision(**kw))
    # Ring of k = 2: 2 (k-1)/k x grad bytes / bw + 2 (k-1) latency per bucket; one block, so
    # every bucket (a 1 MiB one, then the other 3 MB) is ready when the backward ends.
    nb = _buckets(4_000_000)
    assert nb == 2
    allreduce = 2 * (1 / 2) * 4 * 1e6 / 1e10 + nb * 2 * (2 - 1) * 1e-5
    ar = [e for e in sim.events if e.kind == "allreduce"]
    assert [(e.gpu, e.start_s, e.nbytes) for e in ar] == [(0, pytest.approx(3e-3), 4_000_000),
                                                          (1, pytest.approx(3e-3), 4_000_000)]
    opt = {e.gpu: e for e in sim.events if e.kind == "optim"}
    assert opt[0].end_s - opt[0].start_s == pytest.approx(2 * 16e6 / 1e12)
    assert opt[1].start_s == pytest.approx(3e-3 + allreduce)
    assert sim.step_time_s == pytest.approx(3e-3 + allreduce + 2 * 16e6 / 5e11, rel=1e-12)
    # The objective charges the ring's bandwidth term (with its (k-1)/k = 1/2) and the
    # 2 (k-1) latencies once per bucket ([C-allreduce]'s nb = 2), as the simulator does.
    ev = evaluate(costs, devices, options, Decision(**kw))
    assert ev.allreduce_s[0] == pytest.approx(allreduce, rel=1e-9)
    # [C-objective] overlaps the buckets with the backward of the stage's blocks but its last
    # (the first to run): with one block, none, like the simulator, which makes a block's
    # gradients ready when its backward ends: both expose the whole ring.
    assert ev.step_time_s == pytest.approx(sim.step_time_s, abs=1e-9)
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
    sim = simulate(costs, devices, solver_options(global_batch_size=2), Decision(
        stage_blocks=((0, 1), (1, 2)), stage_gpus=((0,), (1, 2)), samples_per_microbatch=((2,), (1, 1)),
        num_microbatches=1))
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
    sim = simulate(costs, devices, solver_options(global_batch_size=8), Decision(
        stage_blocks=((0, 1), (1, 2)), stage_gpus=((0, 1), (2, 3)), samples_per_microbatch=((3, 1), (2, 2)),
        num_microbatches=2))
    sends = {(e.gpu, e.peer, e.microbatch): e.nbytes for e in sim.events if e.kind == "send"}
    assert sends == {**{(0, 2, m): 2000 for m in (0, 1)}, **{(0, 3, m): 1000 for m in (0, 1)},
                     **{(1, 3, m): 1000 for m in (0, 1)}, **{(2, 0, m): 2000 for m in (0, 1)},
                     **{(3, 0, m): 1000 for m in (0, 1)}, **{(3, 1, m): 1000 for m in (0, 1)}}
    # GPU 3 cannot start F0 before both of its messages arrived.
    f3 = next(e for e in sim.events if e.kind == "F" and e.gpu == 3)
    assert f3.start_s >= max(e.end_s for e in sim.events if e.kind == "send" and e.peer == 3 and e.microbatch == 0)
    with pytest.raises(ValueError, match="sum to 3"):
        simulate(costs, devices, solver_options(global_batch_size=8), Decision(
            stage_blocks=((0, 2),), stage_gpus=((0,),), samples_per_microbatch=((3,),), num_microbatches=2))


AGREEMENT_SEEDS = range(17)  # 15 feasible instances (seeds 8 and 11 are infeasible)
TOL = 0.15


def test_agreement_with_objective():
    """On the plans CP-SAT picks, simulator (the runtime's NCCL program, its
    default) and objective agree as follows.

    Model differences (objective.py vs engine.py):
      (a) boundary comm: sum_s t_s charges each boundary (both directions) in
          the fill and drain and the period charges each exchange once per
          micro-batch on its two stages' cycles (GPipe: once per phase); the
          simulator replays every message, per lane of a data-parallel stage
          where the objective takes the slowest GPU and pair of each stage;
      (b) gradient sync: stage s's all-reduce starts D_s before the drain
          ends (a lower bound of the drain after stage s's last backward,
          [C-objective]); the simulator starts its buckets during that last
          backward and the drain may be longer;
      (c) fill/drain: sum_s t_s + (M-1) T; the simulator's dependency graph
          with F = t/3, B = 2t/3 hides part of the non-bottleneck stages'
          fill (exact for equal stages, see test_pipeline_with_free_links...).
    Hence: sim <= obj (1 + TOL) (it may exceed the objective where messages
    share one link, which the objective does not model), and on the
    compute-only instance (a) and (b) vanish so |sim/obj - 1| <= TOL; with
    comm, the remaining gap is bounded below by that compute-only step.
    Both price the ring all-reduce with its (k-1)/k (issue 13 item 6).
    Measured on these 15 plans (2026-11-26, the NCCL program and the
    objective's NCCL period): max |deviation| 8.1% (seed 12, S=2, M=3: two
    data-parallel lanes, (a)), largest excess +0.5%; compute-only max
    |deviation| 9.2%."""
    rows = []
    for seed in AGREEMENT_SEEDS:
        costs, devices, options = random_instance(seed)
        try:
            res = solve_cpsat(costs, devices, options)
        except InfeasiblePlanError:
            continue
        kw = _decision(res)
        ev, sim = evaluate(costs, devices, options, Decision(**kw)), simulate(costs, devices, options, Decision(**kw))
        c0, d0 = compute_only(costs, devices)
        ev0, sim0 = evaluate(c0, d0, options, Decision(**kw)), simulate(c0, d0, options, Decision(**kw))
        rows.append((seed, res.num_stages, res.decision.num_microbatches, sim.step_time_s / ev.step_time_s - 1,
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
    sim = simulate(costs, devices, solver_options(global_batch_size=12), Decision(
        stage_blocks=((0, 1), (1, 2), (2, 3)), stage_gpus=((0, 1), (2,), (3,)),
        samples_per_microbatch=((2, 1), (3,), (3,)), num_microbatches=4))
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
    Measured on these 14 plans (7 with sharding, 4 with recomputation;
    2026-11-26, the runtime's NCCL program and the objective's NCCL period):
    at most 11.7% faster (seed 19), at most 0.7% slower; compute-only
    |deviation| <= 10.3%. (With buffered sends and the window period, before:
    at most 37.6% faster, 1.4% slower.)"""
    rows, n_sh, n_rc = [], 0, 0
    for seed in POLICY_SEEDS:
        costs, devices, options = random_instance(seed)
        devices = dataclasses.replace(devices, memory_bytes=tuple(m // 2 for m in devices.memory_bytes))
        options = dataclasses.replace(options, sharding="auto", recompute="auto")
        try:
            res = solve_cpsat(costs, devices, options)
        except InfeasiblePlanError:
            continue
        kw, pol = _decision(res), _policy_kw(res)
        n_sh = n_sh + any(m.zero for m in res.decision.memory)
        n_rc = n_rc + any(m.recompute for m in res.decision.memory)
        dec = Decision(**kw, **pol)
        ev, sim = evaluate(costs, devices, options, dec), simulate(costs, devices, options, dec)
        assert ev.feasible, ev.violations
        assert sim.memory == ev.decision.memory == res.decision.memory
        assert sim.state_shard_bytes == ev.decision.shard_bytes()
        _assert_same_memory(res, ev, sim)
        # Compute-only: no parameters, so no shardable state: shards default to 0 MiB.
        c0, d0 = compute_only(costs, devices)
        pol0 = dict(pol, shard_mib=None)
        ev0, sim0 = evaluate(c0, d0, options, Decision(**kw, **pol0)), simulate(c0, d0, options, Decision(**kw, **pol0))
        rows.append((seed, res.num_stages, res.decision.num_microbatches, sim.step_time_s / ev.step_time_s - 1,
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
    return costs, devices, solver_options(global_batch_size=4, sharding="auto"), kw


def test_sharded_stage_allreduce_optim_allgather():
    costs, devices, options, kw = _sharded_instance()
    p, bw, lat = 4 * MIB, 50e9, 1e-5
    shards = (16, 4, 12)  # MiB; covers the 32 MiB of moments
    sim = simulate(costs, devices, options, Decision(**kw, memory=(ZERO1,), shard_mib=(shards,)))
    ends_b = 2 * 3e-3  # GPU 0: 2 samples x 3 ms, the slowest compute
    ar = [e for e in sim.events if e.kind == "allreduce"]
    assert {(e.gpu, e.nbytes) for e in ar} == {(0, 4 * p), (1, 4 * p), (2, 4 * p)}  # ring all-reduce unchanged
    nb = _buckets(4 * p)  # 16 MiB of gradients: a 1 MiB bucket and a 15 MiB one, both ready at the end
    assert nb == 2
    assert all(e.start_s == pytest.approx(ends_b)
               and e.end_s - e.start_s == pytest.approx(2 * (2 / 3) * 4 * p / bw + nb * 2 * 2 * lat) for e in ar)
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
    for e in ag:  # ring: (k-1)/k of the weights (4 B/param) per hop + (k - 1) latencies, after the last shard
        assert e.start_s == pytest.approx(last_opt)
        assert e.end_s - e.start_s == pytest.approx((2 / 3) * 4 * p / bw + 2 * lat)
    assert sim.step_time_s == pytest.approx(ag[0].end_s, rel=1e-12)
    ev = evaluate(costs, devices, options, Decision(**kw, memory=(ZERO1,), shard_mib=(shards,)))
    # The objective rounds the optimizer time per MiB to the ns (<= 0.5 ns x 12 MiB here) and
    # charges 2 (k-1) latencies per bucket (nb = 2) + (k-1) for the all-gather; its bandwidth
    # terms are the ring's, (k-1)/k = 2/3 of 2 x 4p / bw (all-reduce) + 4p / bw (all-gather).
    assert ev.allreduce_s[0] == pytest.approx(2 / 3 * (2 * 4 + 4) * p / bw + (2 * nb + 1) * 2 * lat, abs=1e-9)
    # [C-objective]: one block, so no bucket overlaps the backward (its gradients are ready when
    # it ends): the objective charges the whole all-reduce and all-gather after it, as the
    # simulator does (which runs the all-gather after the optimizer: the same sum).
    assert ev.step_time_s == pytest.approx(sim.step_time_s, abs=1e-8)
    # Memory: weights + grads replicated (8 B/param) + the shard + n_g x 10 KiB activations.
    assert sim.peak_memory_bytes == tuple(8 * p + z * MIB + n * 10 * KIB for z, n in zip(shards, (2, 1, 1)))
    assert sim.peak_memory_bytes == ev.memory_bytes[0]
    assert sim.state_shard_bytes == ((16 * MIB, 4 * MIB, 12 * MIB),) == ev.decision.shard_bytes()
    # Default shards are the evaluator's (balance_shards): 1 : 2 : 2 of the time ~ 16 : 8 : 8 MiB.
    dflt = simulate(costs, devices, options, Decision(**kw, memory=(ZERO1,)))
    ev_d = evaluate(costs, devices, options, Decision(**kw, memory=(ZERO1,)))
    assert dflt.state_shard_bytes == ev_d.decision.shard_bytes() == ((16 * MIB, 8 * MIB, 8 * MIB),)
    assert dflt.step_time_s - ev_d.step_time_s == pytest.approx(sim.step_time_s - ev.step_time_s, abs=2e-8)
    # Not sharded: no all-gather, the full state per GPU.
    plain = simulate(costs, devices, options, Decision(**kw))
    assert not [e for e in plain.events if e.kind == "allgather"]
    assert plain.peak_memory_bytes == tuple(16 * p + n * 10 * KIB for n in (2, 1, 1))
    with pytest.raises(ValueError, match="one int >= 0 per GPU"):
        simulate(costs, devices, options, Decision(**kw, memory=(ZERO1,), shard_mib=((16, 16),)))


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
    options = solver_options(global_batch_size=m * n, schedule=schedule, recompute="auto")
    kw = dict(stage_blocks=((0, 1), (1, 2), (2, 3)), stage_gpus=((0,), (1,), (2,)),
              samples_per_microbatch=((n,),) * 3, num_microbatches=m, memory=(RECOMPUTE, RECOMPUTE, PLAIN))
    sim = simulate(costs, devices, options, Decision(**kw))
    ev = evaluate(costs, devices, options, Decision(**kw))
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
    assert sim.memory == (RECOMPUTE, RECOMPUTE, PLAIN)
    state = -(-16 * 64 // KIB) * KIB  # 1 KiB
    live = [min(3 - s, m) if schedule == "1f1b" else m for s in range(3)]
    expect = (state + n * (live[0] * 0 + act),  # stage 0: no inputs to keep (X_0 = 0)
              state + n * (live[1] * cut + act),
              state + n * live[2] * act)
    assert sim.peak_memory_bytes == expect
    assert tuple(r[0] for r in ev.memory_bytes) == expect
    plain = simulate(costs, devices, options, Decision(**dict(kw, memory=())))
    assert plain.peak_memory_bytes == tuple(state + n * k * act for k in live)
    assert sum(e.end_s - e.start_s for e in sim.events if e.kind == "B") == pytest.approx(
        sum(e.end_s - e.start_s for e in plain.events if e.kind == "B") + 2 * m * t / 3)


def test_trace_shows_allgather_and_recompute(tmp_path):
    costs, devices, options, kw = _sharded_instance()
    costs = dataclasses.replace(costs, fwd_bwd_s_per_sample={"A": (1e-3, 2e-3)}, param_count=(2 * MIB, 2 * MIB),
                                act_bytes_per_sample=(KIB, KIB), cut_bytes_per_sample=(0, 4 * MIB, 0))
    dec = dict(stage_blocks=((0, 1), (1, 2)), stage_gpus=((0, 1), (2,)), samples_per_microbatch=((1, 1), (2,)),
               num_microbatches=2)
    sim = simulate(costs, devices, options, Decision(**dec, memory=(ZERO1, RECOMPUTE)))
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


def test_simulate_labels_zero3_and_offload(tmp_path):
    """Every slice and legend entry names the layout of its stage (issue 46:
    `zorse simulate` labelled ZeRO-3 stages "ZeRO-1 shard"): stage 0 ZeRO-2
    with its optimizer offloaded gathers "all-gather (ZeRO-2)" and steps
    "optimizer (offloaded: host CPU)"; stage 1 ZeRO-3 gathers inside F and B
    (no all-gather slice); each slice carries ``args.memory``."""
    costs, devices, options, _ = _sharded_instance()
    costs = dataclasses.replace(costs, fwd_bwd_s_per_sample={"A": (1e-3, 2e-3)}, param_count=(2 * MIB, 2 * MIB),
                                act_bytes_per_sample=(KIB, KIB), cut_bytes_per_sample=(0, 4 * MIB, 0))
    devices = dataclasses.replace(devices, host_memory_bytes=(64 * GIB,) * 3, host_mem_bw_bytes_per_s=(100e9,) * 3,
                                  host_link_bytes_per_s=(15.75e9,) * 3)
    dec = Decision(stage_blocks=((0, 1), (1, 2)), stage_gpus=((0, 1), (2,)), samples_per_microbatch=((1, 1), (2,)),
                   num_microbatches=2, memory=(StageMemory(zero=2, optimizer="host"), PLAIN))
    sim = simulate(costs, devices, options, dec)
    assert sim.memory == (StageMemory(zero=2, optimizer="host"), PLAIN)
    assert (stage_memory(sim, 0), stage_memory(sim, 1), stage_memory(sim, -1)) == (
        "ZeRO-2, optimizer offloaded", "replicated", "")
    xs = [e for e in json.loads(to_perfetto(sim, tmp_path / "a.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["name"] for e in xs if e["cat"] == "allgather"} == {"all-gather (ZeRO-2)"}
    assert {(e["args"]["stage"], e["name"]) for e in xs if e["cat"] == "optim"} == {
        (0, "optimizer (offloaded: host CPU)"), (1, "optimizer")}
    assert {e["args"]["memory"] for e in xs if e["args"]["stage"] == 0} == {"ZeRO-2, optimizer offloaded"}
    gantt_png(sim, tmp_path / "a.png")
    # stage 1 on GPUs 1, 2 in ZeRO-3 (stage 0 alone on GPU 0)
    dec3 = Decision(stage_blocks=((0, 1), (1, 2)), stage_gpus=((0,), (1, 2)), samples_per_microbatch=((2,), (1, 1)),
                    num_microbatches=2, memory=(PLAIN, StageMemory(zero=3)))
    sim3 = simulate(costs, devices, options, dec3)
    assert sim3.memory == (PLAIN, StageMemory(zero=3)) and stage_memory(sim3, 1) == "ZeRO-3"
    xs = [e for e in json.loads(to_perfetto(sim3, tmp_path / "b.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert not [e for e in xs if e["cat"] == "allgather"]
    assert {e["args"]["memory"] for e in xs if e["args"]["stage"] == 1} == {"ZeRO-3"}


def test_plan_decision_reads_the_plans_memory_policy():
    """``zorse simulate`` / the demo pass a Plan's policy; plans from before the policy
    (no ``sharded`` / ``recompute`` / ``state_shard_bytes`` attributes) get none
    (``Plan.decision`` of objects with a plan's fields)."""
    from types import SimpleNamespace as NS

    from zorse_fx.plan import Plan

    costs, devices, options, kw = _sharded_instance()
    gpus = [NS(gpu=g, samples_per_microbatch=n, state_shard_bytes=z * MIB) for g, n, z in
            zip((0, 1, 2), (2, 1, 1), (16, 4, 12))]
    plan = NS(num_microbatches=1, stages=(NS(index=0, blocks=(0, 1), gpus=tuple(gpus), sharded=True, recompute=True),))
    dec = Plan.decision(plan, costs)
    assert dec == Decision(**kw, memory=(StageMemory(zero=1, recompute=True),), shard_mib=((16, 4, 12),))
    sim = simulate(costs, devices, options, dec)
    assert sim.state_shard_bytes == ((16 * MIB, 4 * MIB, 12 * MIB),) and sim.memory == (StageMemory(zero=1, recompute=True),)
    assert [e.kind for e in sim.events].count("allgather") == 3
    # All shards 0: the runtime splits equally, so does the simulator (32 MiB / 3 -> 11 MiB each).
    zero = NS(num_microbatches=1, stages=(NS(index=0, blocks=(0, 1), sharded=True, recompute=False,
                                             gpus=tuple(NS(gpu=g.gpu, samples_per_microbatch=g.samples_per_microbatch,
                                                           state_shard_bytes=0) for g in gpus)),))
    assert Plan.decision(zero, costs).shard_mib == ((11, 11, 11),)
    with pytest.raises(ValueError, match="pass the BlockCosts"):
        Plan.decision(zero)
    old = NS(num_microbatches=1, stages=(NS(index=0, blocks=(0, 1), gpus=tuple(
        NS(gpu=g.gpu, samples_per_microbatch=g.samples_per_microbatch) for g in gpus)),))
    assert Plan.decision(old) == Decision(**kw)
    assert Plan.decision(old).shard_mib == ((),) and Plan.decision(old).memory == (PLAIN,)


@pytest.mark.parametrize("bw", [1e15, 1e9])
def test_gradient_buckets_overlap_the_last_backward(bw):
    """[Note: overlapped gradient reduction]: one stage on 2 GPUs, 4 blocks of
    12.5M parameters (50 MB of float32 gradients each, two 25 MiB buckets per
    block). The buckets of the last block are reduced while the backward of
    the earlier blocks still runs; the last bucket (of block 0) only once the
    backward has ended. Fast links: only that last bucket is exposed. Slow
    links: the reduction is bound by its own bytes, started at the first
    bucket's readiness (block 3's backward, the first quarter of it). The
    objective, which lets the buckets start any time in the backward, is
    below the simulator by that block granularity."""
    from zorse_fx.ir.buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES

    t, params = 8e-3, 12_500_000
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (t,) * 4}, param_count=(params,) * 4,
                       act_bytes_per_sample=(100,) * 4, cut_bytes_per_sample=(0,) * 5)
    devices = make_devices(["A", "A"], ["n0", "n0"], [64 * GIB] * 2, [1e12] * 2, intra=(bw, 0.0))
    options = solver_options(global_batch_size=2)
    sim = simulate(costs, devices, options, Decision(stage_blocks=((0, 4),), stage_gpus=((0, 1),),
                                                     samples_per_microbatch=((1, 1),), num_microbatches=1))
    b = max((e for e in sim.events if e.kind == "B"), key=lambda e: e.end_s)
    red = [e for e in sim.events if e.kind == "allreduce"]
    assert len(red) == 2 and red[0].nbytes == 4 * 4 * params
    start, end = red[0].start_s, red[0].end_s
    total_ar = 2 * (1 / 2) * 4 * 4 * params / bw  # ring of k = 2: 2 (k-1)/k x bytes / bw
    quarter = (b.end_s - b.start_s) / 4
    assert start == pytest.approx(b.start_s + quarter, rel=1e-9)  # the first bucket: block 3, a quarter in
    # Buckets fill in reverse order: block 3's bytes first, 1 MiB, then 25 MiB each; those
    # holding any byte of block 0 (from the bucket boundary at or below 150 MB on) wait for
    # the whole backward.
    total_bytes = 4 * 4 * params
    first_of_block0 = FIRST_BUCKET_BYTES + ((3 * 4 * params - FIRST_BUCKET_BYTES) // BUCKET_BYTES) * BUCKET_BYTES
    exposed = 2 * (1 / 2) * (total_bytes - first_of_block0) / bw
    if bw > 1e12:  # fast: everything before those buckets is hidden in the backward
        assert end == pytest.approx(b.end_s + exposed, rel=1e-9)
        hidden = total_ar - exposed
    else:  # slow: bound by the bytes, from the first bucket on
        assert total_ar > 3 * quarter
        assert end == pytest.approx(start + total_ar, rel=1e-9)
        hidden = 3 * quarter
    # [C-objective] hides floor(4 cmax- / 6) = the backward of blocks 0-2 (2/3 of their
    # compute, cmax- = 3/4 of cmax) when the reduction (the same ring, (k-1)/k = 1/2)
    # outlasts it, exactly what the simulator hides (slow links); else it charges after the
    # backward the ring of the larger of its last bucket (4 x 48829 KiB - 1 MiB - 7 x 25 MiB
    # = 15092 KiB) and block 0's gradients (48829 KiB, 256 parameters each), while the
    # simulator waits for every bucket holding a byte of block 0 (a little more).
    ev = evaluate(costs, devices, options, Decision(stage_blocks=((0, 4),), stage_gpus=((0, 1),),
                                                    samples_per_microbatch=((1, 1),), num_microbatches=1))
    if bw > 1e12:
        want = 48829 * 256 * 2 * 4 / 2 / bw - exposed
        assert want < 0
    else:
        want = hidden - (4 * (3 * round(ev.compute_s[0] * 1e9) // 4) // 6) * 1e-9
    assert ev.step_time_s - sim.step_time_s == pytest.approx(want, rel=1e-6, abs=3e-9)
