"""Tests of the event-driven simulator (zorse_fx.sim): hand-checked steps,
link sharing, agreement with the planners' objective, trace / chart output."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from zorse_fx.solve.objective import MEMORY_UNIT_BYTES

from zorse_fx.errors import InfeasiblePlanError
from zorse_fx.sim import gantt_png, simulate, to_perfetto
from zorse_fx.solve import BlockCosts, DeviceGraph, SolverOptions, evaluate, solve_cpsat

GIB = 1 << 30


def _devices(types, nodes, memory, mem_bw, *, intra=(100e9, 5e-6), inter=(10e9, 2e-5), odd_links=None):
    """GPUs with NVLink-like links inside a node and slower links across nodes
    (copied from tests/test_solver.py). ``odd_links``: {(g, h): (bw, latency)}."""
    g = len(types)
    link = {(a, b): (intra if nodes[a] == nodes[b] else inter) for a in range(g) for b in range(g)}
    for (a, b), v in (odd_links or {}).items():
        link[a, b] = link[b, a] = v
    bw = tuple(tuple(0.0 if a == b else link[a, b][0] for b in range(g)) for a in range(g))
    lat = tuple(tuple(0.0 if a == b else link[a, b][1] for b in range(g)) for a in range(g))
    return DeviceGraph(gpu_types=tuple(types), memory_bytes=tuple(memory), mem_bw_bytes_per_s=tuple(mem_bw),
                       link_bw_bytes_per_s=bw, link_latency_s=lat, node_names=tuple(nodes))


def _random_instance(seed):
    """The random family of tests/test_solver.py (copied verbatim, shorter time limit)."""
    rng = random.Random(seed)
    n_g, nb = rng.randint(2, 4), rng.randint(2, 6)
    slow = rng.choice([1.5, 2.0, 3.0, 4.0])
    base = [rng.uniform(4e-3, 20e-3) for _ in range(nb)]
    costs = BlockCosts(
        fwd_bwd_s_per_sample={"A": tuple(base), "B": tuple(t * slow * rng.uniform(0.8, 1.2) for t in base)},
        param_count=tuple(rng.randint(20, 200) * 1_000_000 for _ in range(nb)),
        act_bytes_per_sample=tuple(rng.randint(20, 600) * 1_000_000 for _ in range(nb)),
        cut_bytes_per_sample=(0, *(rng.randint(1, 200) * 1_000_000 for _ in range(nb - 1)), 0),
        fwd_bwd_s_fixed=({"A": tuple(rng.uniform(0, 5e-3) for _ in range(nb)),
                          "B": tuple(rng.uniform(0, 8e-3) for _ in range(nb))} if seed % 2 else {}),
    )
    types = [rng.choice("AB") for _ in range(n_g)]
    nodes = [rng.choice(["n0", "n1"]) for _ in range(n_g)]
    memory = [rng.choice([4, 6, 8, 12, 16]) * GIB for _ in range(n_g)]
    mem_bw = [rng.choice([900e9, 1.2e12]) if t == "A" else 300e9 for t in types]
    odd = {(a, b): (rng.choice([2e9, 25e9, 50e9]), rng.choice([1e-6, 5e-5]))
           for a in range(n_g) for b in range(a + 1, n_g) if rng.random() < 0.2}
    options = SolverOptions(global_batch_size=rng.randint(2, 6), max_stages=rng.randint(1, 3),
                            schedule=rng.choice(["1f1b", "gpipe"]), time_limit_s=5.0,
                            num_workers=2, seed=seed, allow_idle_gpus=rng.random() < 0.8)
    return costs, _devices(types, nodes, memory, mem_bw, odd_links=odd), options


def _decision(res):
    return dict(stage_blocks=res.stage_blocks, stage_gpus=res.stage_gpus,
                samples_per_microbatch=res.samples_per_microbatch, num_microbatches=res.num_microbatches)


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
    devices = _devices(["A"], ["n0"], [16 * GIB], [1e12])
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
    assert sim.peak_memory_bytes == (16 * 15e6 + 1500 * 4 * (1 if schedule == "1f1b" else 3),)
    assert not [e for e in sim.events if e.kind in ("send", "allreduce")]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("num_stages", [2, 3])
def test_pipeline_with_free_links_takes_m_plus_s_minus_1_stage_times(schedule, num_stages):
    t, m = 6e-3, 4  # every stage: 1 sample x 6 ms per micro-batch
    costs = BlockCosts(fwd_bwd_s_per_sample={"A": (t,) * num_stages}, param_count=(0,) * num_stages,
                       act_bytes_per_sample=(100,) * num_stages, cut_bytes_per_sample=(0,) * (num_stages + 1))
    devices = dataclasses.replace(_devices(["A"] * num_stages, ["n0"] * num_stages, [GIB] * num_stages,
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
    assert sim.peak_memory_bytes == tuple(100 * n for n in live)


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
    assert sim.peak_memory_bytes == (16_000_000 + 3_000_000, 16_000_000 + 1_000_000)


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
    devices = _devices(["A"] * 3, nodes, [GIB] * 3, [1e12] * 3, intra=(bw, lat), inter=(bw, lat))
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
    devices = _devices(["A"] * 4, ["n0"] * 4, [GIB] * 4, [1e12] * 4)
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
        costs, devices, options = _random_instance(seed)
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
        # Activation peaks: the simulator's tracked in-flight count equals the model's.
        # The objective counts memory in KiB rounded up per block (objective.py note), so it
        # may exceed the simulator's exact bytes by < 1 KiB per block, for state and per sample.
        for gpus, mem, ns in zip(res.stage_gpus, ev.memory_bytes, res.samples_per_microbatch):
            for g, m_obj, n in zip(gpus, mem, ns):
                slack = MEMORY_UNIT_BYTES * costs.num_blocks * (1 + n * res.num_microbatches)
                assert 0 <= m_obj - sim.peak_memory_bytes[g] < slack
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
    devices = _devices(["A", "B", "A", "A"], ["n0", "n0", "n1", "n1"], [GIB] * 4, [1e12, 5e11, 1e12, 1e12])
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
