"""Tests of the simulator's network ([Note: network resources] in sim/network.py):
shared links (a region's WAN path, a node's NIC) in the cluster file and the
simulated step, max-min fair sharing, ring collectives with their (k-1)/k, and
the all-reduce of a tied embedding over the union of its holders."""

from __future__ import annotations

import dataclasses

import pytest

from zorse_fx.cluster import Cluster
from zorse_fx.sim import simulate
from zorse_fx.sim.network import broadcast_tree, gloo_unequal_allgather_s, max_min_rates, ring
from zorse_fx.solve import BlockCosts, Decision

from conftest import CLUSTERS, small_gpt, solver_options


def _one_gpu_nodes(names_by_dc: dict[str, list[str]], **extra) -> dict:
    """A cluster file (dict) of one-T4 nodes, datacenters in order; links 1 GB/s, 1 ms
    across datacenters, 4 GB/s, 10 us inside one."""
    return {"datacenters": [{"name": dc} for dc in names_by_dc],
            "nodes": [{"name": n, "datacenter": dc, "gpus": [{"type": "T4", "count": 1}]}
                      for dc, names in names_by_dc.items() for n in names],
            "links": {"inter_node": {"bandwidth_GBps": 4, "latency_us": 10},
                      "cross_datacenter": {"bandwidth_GBps": 1, "latency_ms": 1}}, **extra}


def _two_stage_costs(t: float, cut: int, params: int = 0) -> BlockCosts:
    return BlockCosts(fwd_bwd_s_per_sample={"T4": (t, t)}, param_count=(params, params),
                      act_bytes_per_sample=(0, 0), cut_bytes_per_sample=(0, cut, 0))


@pytest.mark.parametrize("n_pairs", [1, 2, 4])
def test_node_pairs_share_one_wan_link(n_pairs):
    """Region us holds stage 0 (N one-GPU nodes), region eu stage 1 (N more): GPU i sends its
    sample to GPU N + i, N node pairs, each with its own 1 GB/s cross-datacenter link. With
    the regions' one WAN path of 1 GB/s declared, the N messages share it: each takes N
    times as long as one alone, and the boundary moves at most 1 GB/s in all."""
    t, cut, lat, bw = 3e-3, 50_000_000, 1e-3, 1e9
    us, eu = [f"us{i}" for i in range(n_pairs)], [f"eu{i}" for i in range(n_pairs)]
    wan = [{"name": "wan", "between": [{"datacenter": "us"}, {"datacenter": "eu"}], "bandwidth_GBps": 1}]
    kw = dict(stage_blocks=((0, 1), (1, 2)), stage_gpus=(tuple(range(n_pairs)), tuple(range(n_pairs, 2 * n_pairs))),
              samples_per_microbatch=((1,) * n_pairs,) * 2, num_microbatches=1)
    costs, options = _two_stage_costs(t, cut), solver_options(global_batch_size=n_pairs)
    steps = {}
    for shared in (False, True):
        cluster = Cluster.from_dict(_one_gpu_nodes({"us": us, "eu": eu}, **({"shared_links": wan} if shared else {})))
        sim = simulate(costs, cluster.device_graph(), options, Decision(**kw))
        sends = [e for e in sim.events if e.kind == "send"]
        assert len(sends) == 2 * n_pairs  # forward and back on every pair
        alone = lat + cut / bw
        each = lat + (n_pairs if shared else 1) * cut / bw
        for e in sends:
            assert e.end_s - e.start_s == pytest.approx(each, rel=1e-12)
        fwd = [e for e in sends if e.gpu < n_pairs]
        # the WAN carries the whole boundary at no more than its capacity
        assert max(e.end_s for e in fwd) - min(e.start_s for e in fwd) >= (
            lat + n_pairs * cut / bw if shared else alone) * (1 - 1e-12)
        steps[shared] = sim.step_time_s
        assert sim.step_time_s == pytest.approx(2 * t + 2 * each, rel=1e-12)  # F, send, F B, send back, B
    assert steps[True] - steps[False] == pytest.approx(2 * (n_pairs - 1) * cut / bw, rel=1e-9)


def test_max_min_fair_rates_over_two_resources():
    """R1 (10) carries flows 0 and 1, R2 (4) flows 1 and 2. R2's fair share 2 is the
    smallest (R1's: 5): flows 1 and 2 get 2; flow 0 then gets the 8 left on R1."""
    assert max_min_rates([["R1"], ["R1", "R2"], ["R2"]], {"R1": 10.0, "R2": 4.0}) == [8.0, 2.0, 2.0]
    # a flow limited by its own link (P, 1) leaves the shared link (S) to the others
    assert max_min_rates([["P", "S"], ["S"], ["S"]], {"P": 1.0, "S": 9.0}) == [1.0, 4.0, 4.0]
    # one resource: equal shares
    assert max_min_rates([["S"]] * 3, {"S": 9.0}) == [3.0, 3.0, 3.0]
    with pytest.raises(ValueError, match="flow 0 uses no resource"):
        max_min_rates([[]], {})


def test_max_min_rates_are_feasible_and_every_flow_has_a_bottleneck():
    """The defining property on 2000 seeded random instances: no resource carries more than
    its capacity, and every flow crosses a saturated resource on which no flow is faster
    (so no flow can speed up without slowing one that is not faster)."""
    import random

    rng = random.Random(0)
    for _ in range(2000):
        cap = {r: rng.choice([1.0, 2.0, rng.uniform(0.5, 5.0)]) for r in range(rng.randint(1, 6))}
        flows = [rng.sample(sorted(cap), rng.randint(1, min(3, len(cap)))) for _ in range(rng.randint(1, 8))]
        rate = max_min_rates(flows, cap)
        load = {r: sum(x for x, res in zip(rate, flows) if r in res) for r in cap}
        assert all(load[r] <= cap[r] * (1 + 1e-9) for r in cap), (flows, cap, rate)
        for x, res in zip(rate, flows):
            assert any(load[r] >= cap[r] * (1 - 1e-9) and all(x >= y * (1 - 1e-9) for y, o in zip(rate, flows) if r in o)
                       for r in res), (flows, cap, rate)


@pytest.mark.parametrize("nic_GBps, share", [(None, 1.0), (4, 0.5), (6, 0.75), (16, 1.0)])
def test_a_nic_is_shared_by_the_nodes_flows(nic_GBps, share):
    """Node a (stage 0) sends half a micro-batch to each of nodes b and c (stage 1): two node
    pairs, each with its own 4 GB/s link. a's NIC carries both: at 4 GB/s each message gets
    half of it, at 6 GB/s 3 GB/s each, at 16 GB/s the pair links bind. The gradients back
    come in through the same NIC (its other direction) and share it the same way."""
    t, cut, lat, bw = 3e-3, 40_000_000, 10e-6, 4e9
    data = _one_gpu_nodes({"dc": ["a", "b", "c"]})
    if nic_GBps is not None:
        data["nodes"][0]["nic"] = {"bandwidth_GBps": nic_GBps}
    devices = Cluster.from_dict(data).device_graph()
    assert [sl.name for sl in devices.shared_links] == (["nic:a"] if nic_GBps else [])
    sim = simulate(_two_stage_costs(t, cut), devices, solver_options(global_batch_size=2),
                   Decision(stage_blocks=((0, 1), (1, 2)), stage_gpus=((0,), (1, 2)),
                            samples_per_microbatch=((2,), (1, 1)), num_microbatches=1))
    sends = [e for e in sim.events if e.kind == "send"]
    assert len(sends) == 4
    for e in sends:
        assert e.end_s - e.start_s == pytest.approx(lat + cut / (share * bw), rel=1e-12)


def test_ring_allreduce_k_minus_1_over_k_and_shared_wan_hops():
    """Four one-GPU nodes, two per region, one 1 GB/s WAN path. A ring in the order
    (us0, eu0, us1, eu1) crosses the WAN four times, twice each way: each of those hops
    gets half of it. In the order (us0, us1, eu0, eu1) it crosses once each way: the
    whole 1 GB/s. A data-parallel stage on the four GPUs all-reduces its gradients on
    its ring: 2 (k-1)/k x bytes / bw + 2 (k-1) x the largest hop latency."""
    wan = [{"name": "wan", "between": [{"datacenter": "us"}, {"datacenter": "eu"}], "bandwidth_GBps": 1}]
    cluster = Cluster.from_dict(_one_gpu_nodes({"us": ["us0", "us1"], "eu": ["eu0", "eu1"]}, shared_links=wan))
    devices = cluster.device_graph()
    zigzag, grouped = ring(devices, (0, 2, 1, 3)), ring(devices, (0, 1, 2, 3))
    assert (zigzag.bandwidth_bytes_per_s, zigzag.latency_s) == (0.5e9, 1e-3)
    assert (grouped.bandwidth_bytes_per_s, grouped.latency_s) == (1e9, 1e-3)
    nbytes = 4_000_000
    assert grouped.allreduce_s(nbytes) == pytest.approx(2 * 3 / 4 * nbytes / 1e9 + 2 * 3 * 1e-3, rel=1e-12)
    assert zigzag.allgather_s(nbytes) == pytest.approx(3 / 4 * nbytes / 0.5e9 + 3 * 1e-3, rel=1e-12)
    assert ring(devices, (2,)).allreduce_s(nbytes) == 0.0
    params, t = 200_000, 4e-3  # 800 kB of float32 gradients: one bucket (< 1 MiB)
    costs = BlockCosts(fwd_bwd_s_per_sample={"T4": (t,)}, param_count=(params,), act_bytes_per_sample=(0,),
                       cut_bytes_per_sample=(0, 0))
    for order, bw in (((0, 2, 1, 3), 0.5e9), ((0, 1, 2, 3), 1e9)):
        sim = simulate(costs, devices, solver_options(global_batch_size=4), Decision(stage_blocks=((0, 1),),
                       stage_gpus=(order,), samples_per_microbatch=((1, 1, 1, 1),), num_microbatches=1))
        ar = [e for e in sim.events if e.kind == "allreduce"]
        assert len(ar) == 4 and all(e.nbytes == 4 * params for e in ar)
        expect = 2 * 3 / 4 * 4 * params / bw + 2 * 3 * 1e-3
        assert all(e.start_s == pytest.approx(t) and e.end_s - e.start_s == pytest.approx(expect, rel=1e-12)
                   for e in ar)


def test_gloo_ring_steps_pay_the_rendezvous():
    """Under Gloo (``simulate(p2p="gloo")``) a ring step's send waits for its receiver's "ready to receive",
    so each of an all-reduce's 2 (k-1) steps pays the hop latency twice (measured on the box: bench/LOG.md
    "The box's WAN: TCP windows and Gloo's rendezvous"); the bandwidth term is the same. NCCL's ring keeps one
    latency per step."""
    wan = [{"name": "wan", "between": [{"datacenter": "us"}, {"datacenter": "eu"}], "bandwidth_GBps": 1}]
    devices = Cluster.from_dict(_one_gpu_nodes({"us": ["us0", "us1"], "eu": ["eu0", "eu1"]},
                                               shared_links=wan)).device_graph()
    eager, rdv = ring(devices, (0, 1, 2, 3)), ring(devices, (0, 1, 2, 3), rendezvous=True)
    assert (rdv.bandwidth_bytes_per_s, rdv.latency_s) == (eager.bandwidth_bytes_per_s, 2 * eager.latency_s)
    nbytes = 4_000_000
    assert rdv.allreduce_s(nbytes) - eager.allreduce_s(nbytes) == pytest.approx(2 * 3 * eager.latency_s, rel=1e-12)
    params, t = 200_000, 4e-3
    costs = BlockCosts(fwd_bwd_s_per_sample={"T4": (t,)}, param_count=(params,), act_bytes_per_sample=(0,),
                       cut_bytes_per_sample=(0, 0))
    decision = Decision(stage_blocks=((0, 1),), stage_gpus=((0, 1, 2, 3),), samples_per_microbatch=((1, 1, 1, 1),),
                        num_microbatches=1)
    took = {}
    for p2p in ("nccl", "gloo"):
        sim = simulate(costs, devices, solver_options(global_batch_size=4), decision, p2p=p2p)
        took[p2p] = {round(e.end_s - e.start_s, 12) for e in sim.events if e.kind == "allreduce"}
    bw_part = 2 * 3 / 4 * 4 * params / 1e9
    assert took == {"nccl": {round(bw_part + 2 * 3 * 1e-3, 12)}, "gloo": {round(bw_part + 2 * 3 * 2e-3, 12)}}
    # Two buckets (the first holds 1 MiB of gradients): NCCL reduces them one after the other on its stream;
    # Gloo's process group both at once on its two worker threads, their latencies overlapped, their transfers
    # one after the other on the links they share.
    params = 600_000
    costs = dataclasses.replace(costs, param_count=(params,))
    first = (1 << 20) // 4
    transfers = sum(2 * 3 / 4 * 4 * n / 1e9 for n in (first, params - first))
    for p2p, latencies in (("nccl", 2 * (2 * 3 * 1e-3)), ("gloo", 2 * 3 * 2e-3)):
        sim = simulate(costs, devices, solver_options(global_batch_size=4), decision, p2p=p2p)
        (span,) = {round(e.end_s - e.start_s, 12) for e in sim.events if e.kind == "allreduce"}
        assert span == pytest.approx(latencies + transfers, rel=1e-9)


def test_gloo_unequal_allgather_is_binomial_tree_broadcasts():
    """On Gloo the runtime's ZeRO-1 all-gather of unequal parts is one broadcast per part, each a binomial tree
    (gloo/broadcast.cc): priced at its busiest link, here the WAN from us, which the two large parts of us cross
    twice each (13/8 of the bytes where a ring all-gather moves 3/4), plus two rounds' rendezvous per pair of
    broadcasts."""
    assert broadcast_tree(4, 0) == [(0, 0, 1), (1, 0, 2), (1, 1, 3)]
    assert broadcast_tree(4, 3) == [(0, 3, 0), (1, 3, 1), (1, 0, 2)]
    assert broadcast_tree(3, 1) == [(0, 1, 2), (1, 1, 0)]
    assert broadcast_tree(1, 0) == []
    wan = [{"name": "wan", "between": [{"datacenter": "us"}, {"datacenter": "eu"}], "bandwidth_GBps": 1}]
    devices = Cluster.from_dict(_one_gpu_nodes({"us": ["us0", "us1"], "eu": ["eu0", "eu1"]},
                                               shared_links=wan)).device_graph()
    n = 8_000_000
    parts = [3 * n / 8, 3 * n / 8, n / 8, n / 8]
    assert gloo_unequal_allgather_s(devices, (0, 1, 2, 3), parts) == pytest.approx(13 / 8 * n / 1e9 + 2 * 2 * 2e-3,
                                                                                    rel=1e-12)
    # the parts follow their GPUs, whatever the order the stage lists them in
    assert gloo_unequal_allgather_s(devices, (2, 3, 0, 1), parts[2:] + parts[:2]) == pytest.approx(
        gloo_unequal_allgather_s(devices, (0, 1, 2, 3), parts), rel=1e-12)
    assert gloo_unequal_allgather_s(devices, (1,), [n]) == 0.0
    with pytest.raises(ValueError, match="one part per GPU"):
        gloo_unequal_allgather_s(devices, (0, 1), [n])


def _gpt_costs():
    """Block costs of a 2-layer GPT (tied input / output embedding) on small_hetero's GPU types."""
    from zorse_fx.capture.analysis import analyse
    from zorse_fx.cost.roofline import block_costs
    from zorse_fx.precision import precision_policy

    cluster = Cluster.from_yaml(CLUSTERS / "small_hetero.yaml")
    bg = analyse(small_gpt())
    specs = {g.type: g.spec for g in cluster.gpus}
    return block_costs(bg, specs, precision=precision_policy("fp32")), cluster.device_graph()


def test_tied_embedding_is_reduced_over_the_union_of_its_holders():
    """GPT-2's token embedding is read by the first block (embedding) and the last (LM
    head). Stage 0 (GPUs 0, 1: the A100 pair) holds the first, stage 1 (GPU 2, a T4) the
    last: its gradient is all-reduced once over GPUs (0, 1, 2), a ring with hops
    0 -> 1 (NVLink, 300 GB/s, 5 us), 1 -> 2 and 2 -> 0 (25 GbE, 3.125 GB/s, 20 us), after
    stage 0's last backward, and the holders' optimizer steps wait for it. Stage 0's own
    buckets leave it out."""
    costs, devices = _gpt_costs()
    (tied,) = costs.tied_params
    assert tied.name == "wte.weight" and tied.blocks == (0, costs.num_blocks - 1) and tied.numel == 256 * 32
    assert costs.param_count[0] >= tied.numel and costs.param_count[-1] >= tied.numel
    kw = dict(stage_blocks=((0, 3), (3, costs.num_blocks)), stage_gpus=((0, 1), (2,)),
              samples_per_microbatch=((3, 1), (4,)), num_microbatches=2)
    options = solver_options(global_batch_size=8)
    sim = simulate(costs, devices, options, Decision(**kw))
    tr = [e for e in sim.events if e.kind == "tiedreduce"]
    assert sorted(e.gpu for e in tr) == [0, 1, 2] and all(e.nbytes == 4 * tied.numel for e in tr)
    last_b0 = max(e.end_s for e in sim.events if e.kind == "B" and e.stage == 0)
    ring_s = 2 * (2 / 3) * 4 * tied.numel / 3.125e9 + 2 * 2 * 20e-6  # k = 3, slowest hop 25 GbE
    for e in tr:
        assert e.start_s == pytest.approx(last_b0, rel=1e-12)  # block 0's copy is final last
        assert e.end_s - e.start_s == pytest.approx(ring_s, rel=1e-12)
    ar = [e for e in sim.events if e.kind == "allreduce"]  # stage 0's group, without the embedding
    p0, p1 = sum(costs.param_count[0:3]), sum(costs.param_count[3:])
    assert {e.nbytes for e in ar} == {4 * (p0 - tied.numel)}
    opt = {e.gpu: e for e in sim.events if e.kind == "optim"}
    tied_end = tr[0].end_s
    assert tied_end > max(e.end_s for e in ar)  # the slow ring binds on GPUs 0 and 1
    # [C-control]: every optimizer waits for the gradient norm's all-reduce over the 3 GPUs used, which
    # starts once the last sync (the tied ring) ends: 2 (k - 1) latencies of the slowest hop (20 us).
    assert costs.step_control_rounds == 3
    norm_end = tied_end + 2 * 2 * 20e-6
    ctrl = sorted((e for e in sim.events if e.kind == "control"), key=lambda e: (e.start_s, e.gpu))
    assert [e.gpu for e in ctrl] == [0, 1, 2, 0, 1, 2]
    assert all(e.end_s == pytest.approx(norm_end, rel=1e-12) for e in ctrl[:3])
    for g, p in ((0, p0), (1, p0), (2, p1)):
        assert opt[g].start_s == pytest.approx(norm_end, rel=1e-12)
        assert opt[g].end_s - opt[g].start_s == pytest.approx(2 * 16 * p / devices.mem_bw_bytes_per_s[g])
    # ... and the step ends with the per-step table's all-gather: (k - 1) latencies after the optimizers.
    assert sim.step_time_s == pytest.approx(max(e.end_s for e in opt.values()) + 2 * 20e-6, rel=1e-12)
    assert all(e.start_s == pytest.approx(max(o.end_s for o in opt.values()), rel=1e-12) for e in ctrl[3:])
    # Without the record the embedding is reduced with stage 0's buckets and not across stages:
    # the step ends earlier, at stage 0's own all-reduce + optimizer.
    plain = simulate(dataclasses.replace(costs, tied_params=()), devices, options, Decision(**kw))
    assert not [e for e in plain.events if e.kind == "tiedreduce"]
    assert plain.step_time_s < sim.step_time_s
    # Both holding stages on one GPU group (one stage): the group's buckets reduce it once.
    one = simulate(costs, devices, options, Decision(stage_blocks=((0, costs.num_blocks),), stage_gpus=((0, 1),),
                   samples_per_microbatch=((2, 2),), num_microbatches=2))
    assert not [e for e in one.events if e.kind == "tiedreduce"]
    assert {e.nbytes for e in one.events if e.kind == "allreduce"} == {4 * (sum(costs.param_count) - tied.numel)}
