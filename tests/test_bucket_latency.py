"""The gradient-bucket count of [C-allreduce] (solve/objective.py): a stage's
all-reduce pays the ring's 2 (k-1) link latencies once per gradient bucket of
the runtime (a 1 MiB first bucket, then 25 MiB: ``runtime/grad_sync.bucket_caps``),
as ``sim/sync.py`` does; the CP-SAT model equals ``evaluate`` to the ns on it,
and interleaved groups count the buckets of all their stages together."""

from __future__ import annotations

import pytest
from conftest import make_devices, solver_options

from zorse_fx.ir.buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES
from zorse_fx.sim import simulate
from zorse_fx.solve import BlockCosts, Decision, StageMemory, evaluate, solve_cpsat
from zorse_fx.solve.objective import UNIT_S, evaluate_units, prepare, ring_units, to_units
from zorse_fx.solve.pipeline_terms import forward_units, program_ends

GIB = 1 << 30
LAT = 2e-3  # a WAN-like 2 ms between the nodes: the bucket latencies dominate the all-reduce
BW = 1e10


def _costs(params, **kw) -> BlockCosts:
    nb = len(params)
    return BlockCosts(fwd_bwd_s_per_sample={"A": (1e-3,) * nb}, param_count=tuple(params),
                      act_bytes_per_sample=(1_000_000,) * nb, cut_bytes_per_sample=(0, *(1_000_000,) * (nb - 1), 0),
                      **kw)


def _devices(n):
    return make_devices(["A"] * n, [f"n{g}" for g in range(n)], [80 * GIB] * n, [2e12] * n, inter=(BW, LAT))


@pytest.mark.parametrize("sharded", [False, True])
def test_single_stage_pays_the_latency_per_bucket(sharded):
    """One block of 60M parameters on k = 4 GPUs (one per node): 240 MB of
    float32 gradients = 1 MiB + 9.12 x 25 MiB, so 11 buckets. Objective:
    ring bandwidth term + (2 nb + sh) (k-1) lat; the simulator's all-reduce
    (all buckets ready when the only block's backward ends, so they run back
    to back) lasts 2 (k-1)/k bytes / bw + nb 2 (k-1) lat."""
    params, k = 60_000_000, 4
    fp32 = 4 * params
    nb = 1 + -(-(fp32 - FIRST_BUCKET_BYTES) // BUCKET_BYTES)  # 1 + ceil(238951424 / 26214400)
    assert nb == 11
    costs = _costs([params], state_bytes_per_param=16, grad_bytes_per_param=4, param_bytes_per_param=4,
                   shardable_bytes_per_param=8)
    devices = _devices(k)
    options = solver_options(global_batch_size=4, sharding="auto")
    d = Decision(stage_blocks=((0, 1),), stage_gpus=(tuple(range(k)),), samples_per_microbatch=((1,) * k,),
                 num_microbatches=1, memory=(StageMemory(zero=int(sharded)),))
    ev = evaluate(costs, devices, options, d)
    assert ev.feasible, ev.violations
    # [C-allreduce] by hand: per-block units 2 grad params / bw (+ param bytes when sharded),
    # the ring's (k-1)/k on them, then (2 nb + sh) (k-1) latencies.
    per_param = 2 * 4 + (4 if sharded else 0)
    want = ring_units(to_units(per_param * params / BW), k) + (2 * nb + sharded) * (k - 1) * to_units(LAT)
    assert round(ev.allreduce_s[0] / UNIT_S) == want
    sim = simulate(costs, devices, options, d)
    ar = [e for e in sim.events if e.kind == "allreduce" and e.gpu == 0]
    assert len(ar) == 1 and ar[0].nbytes == fp32
    span = ar[0].end_s - ar[0].start_s
    sim_buckets = (span - 2 * (k - 1) / k * fp32 / BW) / (2 * (k - 1) * LAT)
    assert sim_buckets == pytest.approx(nb, abs=1e-6)
    if sharded:  # the all-gather stays one collective in both models
        ag = [e for e in sim.events if e.kind == "allgather" and e.gpu == 0]
        assert ag[0].end_s - ag[0].start_s == pytest.approx((k - 1) / k * 4 * params / BW + (k - 1) * LAT)


def test_tied_copies_leave_the_bucket_count():
    """A tied parameter read by both blocks of one stage is reduced once: the
    stage's buckets hold its gradient once (P'_s = P_s less one copy)."""
    from zorse_fx.ir.costs import TiedParam

    tied = 20_000_000
    params = (30_000_000, 30_000_000)  # each block counts the 20M tied elements
    costs = _costs(params, tied_params=(TiedParam(name="emb", numel=tied, blocks=(0, 1)),))
    devices = _devices(2)
    options = solver_options(global_batch_size=2)
    d = Decision(stage_blocks=((0, 2),), stage_gpus=((0, 1),), samples_per_microbatch=((1, 1),), num_microbatches=1)
    ev = evaluate(costs, devices, options, d)
    own = 4 * (sum(params) - tied)  # 160 MB of float32 gradients
    nb = 1 + -(-(own - FIRST_BUCKET_BYTES) // BUCKET_BYTES)  # 1 + ceil(158951424 / 26214400) = 8
    assert nb == 8
    bw_units = to_units(2 * 4 * params[0] / BW) * 2 - to_units(2 * 4 * tied / BW)
    assert round(ev.allreduce_s[0] / UNIT_S) == ring_units(bw_units, 2) + 2 * nb * 1 * to_units(LAT)
    sim = simulate(costs, devices, options, d)
    ar = [e for e in sim.events if e.kind == "allreduce" and e.gpu == 0]
    assert ar[0].nbytes == own
    assert (ar[0].end_s - ar[0].start_s - own / BW) / (2 * LAT) == pytest.approx(nb, abs=1e-6)


@pytest.mark.parametrize("lat", [LAT, 5e-5])
def test_cpsat_equals_evaluate_and_brute_force_with_many_buckets(lat):
    """CP-SAT prices the bucket count exactly: on 2 nodes of 2 GPUs whose
    blocks span many buckets (5-70M parameters each) its answer equals
    ``evaluate`` to the ns (the search checks every answer) and its optimum is
    brute force's (which enumerates ``evaluate``); a data-parallel stage of
    several buckets is priced, in the plan or among those it beat."""
    from zorse_fx.solve import solve_brute_force

    params = (40_000_000, 10_000_000, 70_000_000, 25_000_000, 5_000_000)
    costs = _costs(params)
    devices = make_devices(["A"] * 4, ["n0", "n0", "n1", "n1"], [80 * GIB] * 4, [2e12] * 4, inter=(BW, lat))
    options = solver_options(global_batch_size=8, max_stages=3, num_microbatches=(2, 4), sharding="auto")
    ref = solve_brute_force(costs, devices, options)
    res = solve_cpsat(costs, devices, options)
    assert res.status == "OPTIMAL"
    assert round(res.objective / UNIT_S) == round(ref.objective / UNIT_S)
    ev = evaluate(costs, devices, options, res.decision)
    assert ev.feasible and ev.objective_units == round(res.objective / UNIT_S)
    # The one-stage plan on all 4 GPUs: 600 MB of gradients, 1 + ceil((600e6 - 1 MiB) / 25 MiB) = 24 buckets.
    one = Decision(stage_blocks=((0, 5),), stage_gpus=((0, 1, 2, 3),), samples_per_microbatch=((1,) * 4,),
                   num_microbatches=2)
    ev1 = evaluate(costs, devices, options, one)
    nb = 1 + -(-(4 * sum(params) - FIRST_BUCKET_BYTES) // BUCKET_BYTES)
    assert nb == 24
    ring = ring_units(to_units(2 * 4 * sum(params) / BW), 4)
    assert round(ev1.allreduce_s[0] / UNIT_S) == ring + 2 * nb * 3 * to_units(lat)
    assert ev1.objective_units >= round(res.objective / UNIT_S)


def test_interleaved_group_counts_its_buckets_together():
    """v = 2 on 2 groups of 2 GPUs: group 0 holds stages 0 and 2 (blocks 0 and
    2, 2.5M and 3M parameters: 10 MB and 12 MB of gradients, 2 buckets each
    alone (1 MiB + the rest), 22 MB = 1 MiB + 0.8 x 25 MiB together: 2
    buckets, not 4), group 1 stages 1 and 3 alike. The group's sync runs its
    2 buckets in the runtime's order: the first (1 MiB of the later stage's
    gradients) from that stage's last backward, the second (the rest of it
    and all of the earlier stage's) once the earlier stage's last backward
    has ended too; each bucket a ring of its KiB's share of the stages'
    bandwidth terms + 2 (k - 1) lat."""
    params = (2_500_000, 2_500_000, 3_000_000, 3_000_000)
    costs = _costs(params)
    devices = _devices(4)
    options = solver_options(global_batch_size=4, max_interleave=2)
    d = Decision(stage_blocks=((0, 1), (1, 2), (2, 3), (3, 4)), stage_gpus=((0, 1), (2, 3), (0, 1), (2, 3)),
                 samples_per_microbatch=((1, 1),) * 4, num_microbatches=2, interleave=2)
    ev = evaluate(costs, devices, options, d)
    tab, pol = prepare(costs, devices, options, d)
    u = evaluate_units(tab, d.stage_blocks, d.stage_gpus, d.samples_per_microbatch, pol, 2)
    # The replay the objective prices (``program_ends``): forward f_s = floor(c_s / 3), backward
    # c_s - f_s, a message h_s = boundary_s / 2 each way.
    fwd = [f - b // 2 for f, b in zip(
        forward_units(tab, d.stage_blocks, d.stage_gpus, d.samples_per_microbatch, u.boundary), u.boundary)]
    assert fwd == [c // 3 for c in u.compute]
    free, last_b = program_ends(options.schedule, 2, 2, fwd, [c - f for c, f in zip(u.compute, fwd)],
                                [b // 2 for b in u.boundary])
    # The interleaved cooldown: each group's later stage ends its last backward first. Group 0's last
    # task is stage 0's last backward (nothing to send after it); group 1's ends before its gradient
    # message to group 0 arrives, which free[1] includes.
    h = u.boundary[0] // 2
    assert last_b[0] == free[0] and last_b[1] + h == free[1] and last_b[2] < free[0] and last_b[3] < free[1]
    assert 4 * (params[0] + params[2]) < FIRST_BUCKET_BYTES + BUCKET_BYTES  # 2 buckets together
    lat = to_units(LAT)
    kib = [-(-4 * n // 1024) for n in params]
    first = FIRST_BUCKET_BYTES // 1024
    ring = [ring_units(to_units(2 * 4 * params[s] / BW), 2) for s in range(4)]
    ends, before = [], []
    for p in range(2):
        late, early = p + 2, p
        w1 = -(-ring[late] * first // kib[late])
        w2 = ring[late] - w1 + ring[early]  # the later stage's shares add up to its term
        chain = max(last_b[late] + w1 + 2 * lat, last_b[early]) + w2 + 2 * lat
        opt = sum(to_units(2 * 16 * params[s] / 2e12) for s in (p, p + 2))
        ends.append(max(free[p], chain) + opt)
        before.append(free[p] + ring[p] + ring[p + 2] + 2 * 2 * lat + opt)  # the whole sync after the last task
    assert ev.objective_units == max(ends) < max(before)
    # Each stage reports its own all-reduce alone: 2 buckets.
    assert [round(a / UNIT_S) for a in ev.allreduce_s] == [
        ring_units(to_units(2 * 4 * params[s] / BW), 2) + 2 * 2 * (2 - 1) * lat for s in range(4)]


def test_group_sync_with_every_stage_ready_is_the_summed_terms_with_the_groups_bucket_count():
    """``group_sync_units`` with every last backward at 0: the stages' ring terms
    add up (the telescoping KiB shares lose nothing to rounding) and the
    latency is counted per bucket of the group's summed gradients; with one
    stage it is that stage's last backward + its own term."""
    import random

    from zorse_fx.solve.objective import bucket_count
    from zorse_fx.solve.pipeline_terms import group_sync_units

    rng = random.Random(0)
    caps = (1024, 25600)
    for _ in range(200):
        stages = list(range(rng.randint(1, 4)))
        kib = [rng.choice([0, rng.randint(1, 3000), rng.randint(1, 200_000)]) for _ in stages]
        lat = rng.randint(0, 50_000)
        sh = [rng.random() < 0.3 for _ in stages]
        bw = [rng.randint(0, 10**9) if g else 0 for g in kib]
        ar = [w + (2 * bucket_count(g, caps) + h) * lat for w, g, h in zip(bw, kib, sh)]
        got = group_sync_units(stages, [0] * len(stages), ar, kib, [lat] * len(stages), sh, caps)
        assert got == sum(bw) + (2 * bucket_count(sum(kib), caps) + sum(sh)) * lat
        last = [rng.randint(0, 10**9) for _ in stages]
        one = group_sync_units([0], last[:1], ar[:1], kib[:1], [lat], sh[:1], caps)
        assert one == last[0] + ar[0]
        # Later last backwards never make the sync end earlier; it waits for every stage with gradients
        # (interleaved_units takes the max with the group's last task for the others).
        base = group_sync_units(stages, last, ar, kib, [lat] * len(stages), sh, caps)
        later = group_sync_units(stages, [x + 1 for x in last], ar, kib, [lat] * len(stages), sh, caps)
        assert later >= base >= max([x for x, g in zip(last, kib) if g] or [0])
