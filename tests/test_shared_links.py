"""Tests of shared links in cluster files (``shared_links:``, ``nic:``) and on the
device graph (``DeviceGraph.shared_links``): parsing, round trip, errors."""

from __future__ import annotations

import copy

import pytest
from test_cluster import EXAMPLES, expect_error, write

from zorse_fx.cluster import Cluster
from zorse_fx.cluster.cluster import SharedLinkSide, SharedLinkSpec
from zorse_fx.ir.devices import DeviceGraph, SharedLink

# Three nodes in two datacenters: us (n0: 2 GPUs, n1: 1 GPU), eu (n2: 2 GPUs).
TWO_DC = {
    "name": "two-dc",
    "datacenters": [{"name": "us"}, {"name": "eu"}],
    "nodes": [
        {"name": "n0", "datacenter": "us", "gpus": [{"type": "T4", "count": 2}], "nic": {"bandwidth_Gbps": 100}},
        {"name": "n1", "datacenter": "us", "gpus": [{"type": "T4", "count": 1}]},
        {"name": "n2", "datacenter": "eu", "gpus": [{"type": "T4", "count": 2}]},
    ],
    "links": {
        "intra_node": {"bandwidth_GBps": 16, "latency_us": 10},
        "inter_node": {"bandwidth_GBps": 3.125, "latency_us": 20},
        "cross_datacenter": {"bandwidth_Gbps": 1, "latency_ms": 50},
        "nic": {"bandwidth_Gbps": 25},
    },
    "shared_links": [
        {"name": "wan", "between": [{"datacenter": "us"}, {"datacenter": "eu"}], "bandwidth_Gbps": 2},
        {"name": "rack", "between": [{"nodes": ["n1"]}, {"nodes": ["n2", "n0"]}], "bandwidth_GBps": 5},
    ],
}


def _broken(edit) -> dict:
    data = copy.deepcopy(TWO_DC)
    edit(data)
    return data


def test_shared_links_and_nics_parse_round_trip_and_reach_the_device_graph():
    cluster = Cluster.from_dict(TWO_DC)
    assert cluster.shared_links == (
        SharedLinkSpec(name="wan", sides=(SharedLinkSide(datacenter="us", nodes=("n0", "n1")),
                                           SharedLinkSide(datacenter="eu", nodes=("n2",))),
                       bandwidth_bytes_per_s=2e9 / 8),
        SharedLinkSpec(name="rack", sides=(SharedLinkSide(nodes=("n1",)), SharedLinkSide(nodes=("n0", "n2"))),
                       bandwidth_bytes_per_s=5e9))
    assert cluster.node_nic_bandwidths == (100e9 / 8, None, None)
    assert [cluster.nic_bandwidth(n) for n in cluster.nodes] == [12.5e9, 3.125e9, 3.125e9]
    assert Cluster.from_dict(cluster.to_dict()) == cluster
    dg = cluster.device_graph()
    # GPUs: n0 = 0, 1; n1 = 2; n2 = 3, 4.
    assert dg.shared_links == (
        SharedLink(name="wan", gpus_a=(0, 1, 2), gpus_b=(3, 4), bandwidth_bytes_per_s=2.5e8),
        SharedLink(name="rack", gpus_a=(2,), gpus_b=(0, 1, 3, 4), bandwidth_bytes_per_s=5e9),
        SharedLink(name="nic:n0", gpus_a=(0, 1), gpus_b=(2, 3, 4), bandwidth_bytes_per_s=12.5e9),
        SharedLink(name="nic:n1", gpus_a=(2,), gpus_b=(0, 1, 3, 4), bandwidth_bytes_per_s=3.125e9),
        SharedLink(name="nic:n2", gpus_a=(3, 4), gpus_b=(0, 1, 2), bandwidth_bytes_per_s=3.125e9))
    wan, nic0 = dg.shared_links[0], dg.shared_links[2]
    assert (wan.direction(0, 3), wan.direction(4, 2), wan.direction(0, 2), wan.direction(3, 4)) == (0, 1, None, None)
    # a NIC: out of the node is direction 0, into it 1, inside the node it is not crossed
    assert (nic0.direction(1, 2), nic0.direction(3, 0), nic0.direction(0, 1)) == (0, 1, None)
    # the pairs' own links are unchanged
    assert dg.link_bw_bytes_per_s[0][3] == 1e9 / 8 and dg.link_latency_s[0][3] == 0.05
    table = cluster.summary_table()
    assert "shared wan" in table and "us <-> eu" in table and "nic" in table


def test_old_files_have_no_shared_links_and_one_node_no_nic():
    for name in ("small_hetero.yaml", "demo.yaml", "amp.yaml"):
        assert Cluster.from_yaml(EXAMPLES / name).device_graph().shared_links == ()
    one = Cluster.from_dict({"nodes": [{"name": "a", "gpus": [{"type": "T4", "count": 2}], "nic": {"bandwidth_GBps": 1}}],
                             "links": {"intra_node": {"bandwidth_GBps": 16, "latency_us": 10}}})
    assert one.device_graph().shared_links == ()  # no other node: no flow crosses the NIC


def test_zorse_c_caps_each_nodes_wan_traffic_and_has_25gbe_nics():
    """Issue 50: the measured 1 Gb/s is one instance pair's, so each node's traffic to the other region shares
    a 1 Gb/s cap of its own (a cloud's per-instance cap), not one path for every flow between the regions."""
    cluster = Cluster.from_yaml(EXAMPLES / "zorse_c_two_regions.yaml")
    dg = cluster.device_graph()
    caps = dg.shared_links[:len(cluster.nodes)]
    r1 = tuple(g.index for g in cluster.gpus if g.datacenter == "region-1")
    r2 = tuple(g.index for g in cluster.gpus if g.datacenter == "region-2")
    for cap, node in zip(caps, cluster.nodes):
        mine = tuple(g.index for g in cluster.gpus if g.node == node)
        assert cap == SharedLink(name=f"wan:{node}", gpus_a=mine, gpus_b=r2 if mine[0] in r1 else r1,
                                 bandwidth_bytes_per_s=125e6)
    nics = dg.shared_links[len(cluster.nodes):]
    assert [n.name for n in nics] == [f"nic:{node}" for node in cluster.nodes]
    assert {n.bandwidth_bytes_per_s for n in nics} == {25e9 / 8}
    assert dg.link_bw_bytes_per_s[0][127] == 125e6  # each pair's own figure is kept


@pytest.mark.parametrize("edit, fragments", [
    (lambda d: d["shared_links"][0]["between"][1].update(datacenter="asia"),
     ("shared_links[0].between[1].datacenter: no such datacenter", "'asia'", "datacenters: us, eu")),
    (lambda d: d["shared_links"][1]["between"][0].update(nodes=["n1", "n9"]),
     ("shared_links[1].between[0].nodes[1]: no such node", "'n9'", "nodes: n0, n1, n2")),
    (lambda d: d["shared_links"][0]["between"].__setitem__(1, {"datacenter": "us"}),
     ("shared_links[0].between: node(s) n0, n1 on both sides", "disjoint")),
    (lambda d: d["shared_links"][1]["between"].__setitem__(1, {"nodes": ["n0", "n1"]}),
     ("shared_links[1].between: node(s) n1 on both sides",)),
    (lambda d: d["shared_links"][0].pop("bandwidth_Gbps"),
     ("shared_links[0]: no bandwidth", "give exactly one of bandwidth_GBps")),
    (lambda d: d["shared_links"][0].update(bandwidth_GBps=1),
     ("shared_links[0]: bandwidth given twice",)),
    (lambda d: d["shared_links"][0].update(bandwidth_Gbps=0),
     ("shared_links[0].bandwidth_Gbps: must be a positive number", "(got 0)")),
    (lambda d: d["shared_links"][0].update(latency_ms=50),
     ("shared_links[0].latency_ms: a shared link, NIC or host link has no latency of its own", "node pair's link")),
    (lambda d: d["shared_links"][1].update(name="wan"), ("shared_links[1].name: already used", "'wan'")),
    (lambda d: d["shared_links"][1].update(name="nic:n0"), ("shared_links[1].name: names 'nic:<node>'",)),
    (lambda d: d["shared_links"][0].pop("between"), ("shared_links[0].between: missing",)),
    (lambda d: d["shared_links"][0].update(between=[{"datacenter": "us"}]),
     ("shared_links[0].between: must list the two sides",)),
    (lambda d: d["shared_links"][0]["between"].__setitem__(0, {"datacenter": "us", "nodes": ["n0"]}),
     ("shared_links[0].between[0]: give exactly one of datacenter, nodes",)),
    (lambda d: d["shared_links"][0]["between"].__setitem__(0, {"node": "n0"}),
     ("shared_links[0].between[0].node: unknown key", "did you mean 'nodes'")),
    (lambda d: d["shared_links"][1]["between"].__setitem__(0, {"nodes": ["n1", "n1"]}),
     ("shared_links[1].between[0].nodes[1]: listed twice",)),
    (lambda d: d["shared_links"][1]["between"].__setitem__(0, {"nodes": []}),
     ("shared_links[1].between[0].nodes: must be a non-empty list",)),
    (lambda d: d.update(shared_links={"name": "wan"}), ("shared_links: must be a list",)),
    (lambda d: d["nodes"][0].update(nic={"bandwidth_Gbps": 100, "latency_us": 5}),
     ("nodes[0].nic.latency_us: a shared link, NIC or host link has no latency",)),
    (lambda d: d["nodes"][0].update(nic={}), ("nodes[0].nic: no bandwidth",)),
    (lambda d: d["links"].update(nic={"bandwidth_Gbps": -25}),
     ("links.nic.bandwidth_Gbps: must be a positive number",)),
])
def test_shared_link_errors_name_field_value_and_fix(tmp_path, edit, fragments):
    expect_error(write(tmp_path, _broken(edit)), *fragments)


def test_device_graph_validates_shared_links():
    kw = dict(gpu_types=("A",) * 3, memory_bytes=(1,) * 3, mem_bw_bytes_per_s=(1.0,) * 3,
              link_bw_bytes_per_s=((1.0,) * 3,) * 3, link_latency_s=((0.0,) * 3,) * 3)
    with pytest.raises(ValueError, match="has 3 GPUs"):
        DeviceGraph(**kw, shared_links=(SharedLink(name="x", gpus_a=(0,), gpus_b=(3,), bandwidth_bytes_per_s=1.0),))
    link = SharedLink(name="x", gpus_a=(0,), gpus_b=(1,), bandwidth_bytes_per_s=1.0)
    with pytest.raises(ValueError, match="names must be unique"):
        DeviceGraph(**kw, shared_links=(link, link))
    with pytest.raises(ValueError, match=r"GPUs \[1\] are on both sides"):
        SharedLink(name="x", gpus_a=(0, 1), gpus_b=(1, 2), bandwidth_bytes_per_s=1.0)
    with pytest.raises(ValueError, match="ascending order, at least one"):
        SharedLink(name="x", gpus_a=(), gpus_b=(1,), bandwidth_bytes_per_s=1.0)
    with pytest.raises(ValueError, match="ascending order"):
        SharedLink(name="x", gpus_a=(2, 0), gpus_b=(1,), bandwidth_bytes_per_s=1.0)
    with pytest.raises(ValueError, match="bytes/s per direction"):
        SharedLink(name="x", gpus_a=(0,), gpus_b=(1,), bandwidth_bytes_per_s=float("inf"))
