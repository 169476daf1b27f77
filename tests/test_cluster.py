"""Tests of zorse_fx.cluster: the GPU table, cluster files, links, errors."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from zorse_fx.cluster import GPU, Cluster, GPUSpec, Link, gpu_spec, known_gpu_types
from zorse_fx.errors import ClusterConfigError
from zorse_fx.ir.devices import DeviceGraph

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "clusters"
GiB = 2**30

# A valid two-node cluster; error tests break one field of a deep copy.
BASE = {
    "name": "base",
    "nodes": [
        {"name": "node0", "gpus": [{"type": "A100-40GB", "count": 2}, {"type": "T4", "count": 1}]},
        {"name": "node1", "gpus": [{"type": "T4", "count": 4}]},
    ],
    "links": {
        "intra_node": {"bandwidth_GBps": 16, "latency_us": 10},
        "inter_node": {"bandwidth_GBps": 3.125, "latency_us": 20},
    },
}


def write(tmp_path: Path, data: dict | str, name: str = "cluster.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def expect_error(path: Path, *fragments: str) -> str:
    """Load ``path``, expect a ClusterConfigError naming the file and every fragment."""
    with pytest.raises(ClusterConfigError, match=re.escape(fragments[0])) as info:
        Cluster.from_yaml(path)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments[1:]:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def broken(edit) -> dict:
    data = copy.deepcopy(BASE)
    edit(data)
    return data


# -- GPU table -------------------------------------------------------------
def test_gpu_table_exact_values():
    t4 = gpu_spec("T4")
    assert t4.memory_bytes == 17179869184
    assert t4.fp16_flops_per_s == 65e12 and t4.fp32_flops_per_s == 8.1e12
    assert t4.mem_bw_bytes_per_s == 320e9 and t4.bf16_supported is False
    a100 = gpu_spec("A100-40GB")
    assert a100.fp16_flops_per_s == 312e12 and a100.fp32_flops_per_s == 19.5e12
    assert a100.memory_bytes == 40 * GiB and a100.mem_bw_bytes_per_s == 1555e9 and a100.bf16_supported
    assert gpu_spec("V100-32GB").memory_bytes == 32 * GiB and gpu_spec("V100-16GB").memory_bytes == 16 * GiB
    assert gpu_spec("H100-80GB").fp16_flops_per_s == 989.5e12
    assert gpu_spec("P100-16GB").fp16_flops_per_s == 21.2e12  # no tensor cores: 2x FP32 (source_note)
    assert gpu_spec("A10G").fp16_flops_per_s == 70e12  # measured, no datasheet (source_note)
    assert "MEASURED" in gpu_spec("A10G").source
    v100p, p40 = gpu_spec("V100-PCIE-16GB"), gpu_spec("P40")  # ../shared/reference/gpu_specs.csv; P40: source_url
    assert (v100p.fp32_flops_per_s, v100p.fp16_flops_per_s, v100p.tdp_w, v100p.arch) == (14e12, 112e12, 250, "volta")
    assert (p40.memory_bytes, p40.mem_bw_bytes_per_s, p40.fp32_flops_per_s, p40.arch) == (24 * GiB, 346e9, 11.76e12,
                                                                                          "pascal")


def test_known_gpu_types_are_complete_and_sourced():
    types = known_gpu_types()
    for t in ("P100-16GB", "V100-16GB", "V100-32GB", "T4", "A10", "A10G", "A30", "A40", "A100-40GB",
              "A100-80GB", "A100-PCIE-40GB", "A100-PCIE-80GB", "RTX-A6000", "RTX-3090", "RTX-4090", "L4",
              "L40", "L40S", "H100-80GB", "H100-PCIE", "H200", "B200", "MI250X", "MI300X",
              "V100-PCIE-16GB", "V100-PCIE-32GB", "P40"):
        assert t in types
    assert len(types) == len(set(types)) == 27
    for t in types:
        spec = gpu_spec(t)
        assert spec.type == t and spec.source.startswith("http")


@pytest.mark.parametrize(
    "alias, canonical",
    [("H100", "H100-80GB"), ("h100-sxm", "H100-80GB"), ("H100 SXM5 80GB", "H100-80GB"),
     ("h100_sxm5_80gb", "H100-80GB"), ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("tesla t4", "T4"),
     ("a100_pcie_80gb", "A100-PCIE-80GB"), ("NVIDIA A100 80GB PCIe", "A100-PCIE-80GB"),
     ("GeForce RTX 4090", "RTX-4090"), ("AMD Instinct MI300X", "MI300X"), ("v100-sxm2-32gb", "V100-32GB"),
     ("Tesla V100-PCIE-32GB", "V100-PCIE-32GB"), ("Tesla P40", "P40")],
)
def test_alias_resolution(alias, canonical):
    assert gpu_spec(alias).type == canonical


def test_unknown_gpu_type_is_an_error_not_a_guess():
    with pytest.raises(ClusterConfigError, match=r"unknown GPU type 'A100'; did you mean A100-40GB") as info:
        gpu_spec("A100")  # ambiguous (40/80 GB, SXM/PCIe): never silently picked
    assert "known types: P100-16GB" in str(info.value) and "gpu_types:" in str(info.value)
    with pytest.raises(ClusterConfigError, match="unknown GPU type 'GTX-1080'"):
        gpu_spec("GTX-1080")


def test_peak_flops_per_dtype():
    torch = pytest.importorskip("torch")
    a100, v100 = gpu_spec("A100-40GB"), gpu_spec("V100-16GB")
    assert a100.peak_flops_per_s(torch.float32) == 19.5e12
    assert a100.peak_flops_per_s(torch.float16) == 312e12
    assert a100.peak_flops_per_s(torch.bfloat16) == 312e12
    assert a100.peak_flops_per_s("bf16") == a100.peak_flops_per_s("fp16") == 312e12
    assert v100.peak_flops_per_s(torch.float16) == 125e12
    with pytest.raises(ValueError, match="V100-16GB does not support bfloat16"):
        v100.peak_flops_per_s(torch.bfloat16)
    with pytest.raises(ValueError, match="no peak FLOP/s for dtype"):
        a100.peak_flops_per_s(torch.float64)


# -- example clusters ------------------------------------------------------
@pytest.mark.parametrize(
    "file, counts, num_nodes, datacenters",
    [
        ("zorse_a.yaml", {"H100-80GB": 4, "A100-40GB": 16}, 3, 1),
        ("zorse_b.yaml", {"A100-40GB": 8, "A10G": 16, "V100-16GB": 16, "T4": 24}, 13, 1),
        ("zorse_c_two_regions.yaml", {"A10G": 16, "T4": 96, "V100-16GB": 16}, 30, 2),
        ("metis.yaml", {"A100-40GB": 4, "T4": 4}, 2, 1),
        ("small_hetero.yaml", {"A100-40GB": 2, "T4": 2}, 2, 1),
    ],
)
def test_example_clusters(file, counts, num_nodes, datacenters):
    cluster = Cluster.from_yaml(EXAMPLES / file)
    assert len(cluster) == sum(counts.values())
    assert {t: sum(g.type == t for g in cluster.gpus) for t in cluster.gpu_types()} == counts
    assert len(cluster.nodes) == num_nodes and len(cluster.datacenters) == datacenters
    assert [g.index for g in cluster.gpus] == list(range(len(cluster)))
    assert cluster.source == str(EXAMPLES / file) and cluster.name == file.removesuffix(".yaml")
    assert Cluster.from_dict(cluster.to_dict()) == cluster


def test_zorse_c_regions():
    cluster = Cluster.from_yaml(EXAMPLES / "zorse_c_two_regions.yaml")
    by_dc = {dc: [g.type for g in cluster.gpus if g.datacenter == dc] for dc in cluster.datacenters}
    assert by_dc["region-1"].count("A10G") == 16 and by_dc["region-1"].count("T4") == 48
    assert by_dc["region-2"].count("V100-16GB") == 16 and by_dc["region-2"].count("T4") == 48
    wan = cluster.link(0, len(cluster) - 1)
    assert wan == Link(kind="cross_datacenter", bandwidth_bytes_per_s=125e6, latency_s=0.05)
    assert wan.time_s(125_000_000) == pytest.approx(1.05, rel=1e-12)


def test_gpu_records():
    cluster = Cluster.from_dict(BASE)
    assert cluster.gpus[2] == GPU(index=2, node="node0", datacenter="dc0", local_index=2, type="T4",
                                  spec=gpu_spec("T4"), memory_bytes=16 * GiB)
    assert [g.local_index for g in cluster.gpus] == [0, 1, 2, 0, 1, 2, 3]
    assert cluster.nodes == ("node0", "node1") and cluster.gpu_types() == ("A100-40GB", "T4")
    assert cluster.source == "<dict>" and cluster.name == "base"


# -- links -----------------------------------------------------------------
def test_link_kinds_and_alpha_beta_time():
    cluster = Cluster.from_yaml(EXAMPLES / "small_hetero.yaml")  # GPUs 0,1: A100 node; 2,3: T4 node
    assert cluster.link(1, 1).kind == "same_gpu" and cluster.link(1, 1).time_s(10**9) == pytest.approx(1e-6)
    assert cluster.link(0, 1) == Link(kind="intra_node", bandwidth_bytes_per_s=300e9, latency_s=5e-6)
    assert cluster.link(2, 3) == Link(kind="intra_node", bandwidth_bytes_per_s=16e9, latency_s=10e-6)
    inter = cluster.link(0, 3)
    assert inter == cluster.link(3, 0) == Link(kind="inter_node", bandwidth_bytes_per_s=3.125e9, latency_s=20e-6)
    assert inter.time_s(0) == 20e-6
    assert inter.time_s(3_125_000_000) == pytest.approx(1.00002, rel=1e-12)
    with pytest.raises(IndexError):
        cluster.link(0, 4)


def test_link_overrides_units_and_custom_gpu_types():
    data = {
        "name": "custom",
        "datacenters": [{"name": "us"}, {"name": "eu"}],
        "nodes": [
            {"name": "a", "datacenter": "us", "gpus": [{"type": "t4", "count": 2, "memory_GiB": 15}],
             "intra_node": {"bandwidth_GBps": 300, "latency_us": 5}},
            {"name": "b", "datacenter": "us", "gpus": [{"type": "MyGPU", "count": 1}]},
            {"name": "c", "datacenter": "eu", "gpus": [{"type": "mygpu", "count": 1}]},
        ],
        "links": {
            "inter_node": {"bandwidth_Gbps": 100, "latency_ms": 0.02},
            "cross_datacenter": {"bandwidth_Gbps": 1.0, "latency_ms": 50},
            "overrides": [{"between": ["a", "c"], "bandwidth_bytes_per_s": 5e8, "latency_s": 0.011}],
        },
        "gpu_types": {"MyGPU": {"memory_GiB": 32, "mem_bw_GBps": 900, "fp32_tflops": 15,
                                "fp16_tensor_tflops": 120, "bf16_supported": False, "source": "vendor sheet"}},
    }
    cluster = Cluster.from_dict(data)
    assert [g.type for g in cluster.gpus] == ["T4", "T4", "MyGPU", "MyGPU"]
    assert cluster.gpus[0].memory_bytes == 15 * GiB and cluster.gpus[0].spec.memory_bytes == 16 * GiB
    assert cluster.gpus[2].spec == GPUSpec(type="MyGPU", memory_bytes=32 * GiB, mem_bw_bytes_per_s=900e9,
                                           fp32_flops_per_s=15e12, fp16_flops_per_s=120e12,
                                           bf16_supported=False, source="vendor sheet")
    assert cluster.link(0, 1) == Link(kind="intra_node", bandwidth_bytes_per_s=300e9, latency_s=5e-6)
    assert cluster.link(0, 2) == Link(kind="inter_node", bandwidth_bytes_per_s=12.5e9, latency_s=2e-5)
    assert cluster.link(2, 3) == Link(kind="cross_datacenter", bandwidth_bytes_per_s=125e6, latency_s=0.05)
    assert cluster.link(3, 1) == Link(kind="cross_datacenter", bandwidth_bytes_per_s=5e8, latency_s=0.011)
    assert Cluster.from_dict(cluster.to_dict()) == cluster
    summary = cluster.summary_table()
    assert "a <-> c" in summary and "MyGPU x1" in summary and "T4 x2" in summary


def test_device_graph_shape_and_symmetry():
    cluster = Cluster.from_yaml(EXAMPLES / "zorse_b.yaml")
    graph = cluster.device_graph()
    assert isinstance(graph, DeviceGraph) and graph.num_gpus == 64
    assert len(graph.link_bw_bytes_per_s) == 64 and all(len(r) == 64 for r in graph.link_bw_bytes_per_s)
    for g in range(64):
        assert graph.link_bw_bytes_per_s[g][g] == 1e15 and graph.link_latency_s[g][g] == 0.0
        for h in range(64):
            assert graph.link_bw_bytes_per_s[g][h] == graph.link_bw_bytes_per_s[h][g]
            assert graph.link_latency_s[g][h] == graph.link_latency_s[h][g]
    assert graph.gpu_types[:9] == ("A100-40GB",) * 8 + ("A10G",)
    assert graph.memory_bytes[0] == 40 * GiB and graph.memory_bytes[-1] == 16 * GiB
    assert graph.mem_bw_bytes_per_s[0] == 1555e9
    assert graph.node_names[0] == "a100-0" and graph.node_names[-1] == "t4-5"
    assert graph.link_bw_bytes_per_s[0][1] == 300e9 and graph.link_bw_bytes_per_s[0][8] == 3.125e9


# -- round trip and readable form ------------------------------------------
def test_round_trip_through_yaml_text(tmp_path):
    for file in sorted(EXAMPLES.glob("*.yaml")):
        cluster = Cluster.from_yaml(file)
        again = Cluster.from_yaml(write(tmp_path, cluster.to_dict(), name=file.name))
        assert again == cluster and again.to_dict() == cluster.to_dict()


def test_summary_table_names_nodes_and_types():
    cluster = Cluster.from_yaml(EXAMPLES / "zorse_a.yaml")
    text = cluster.summary_table()
    for node in cluster.nodes:
        assert node in text
    assert "H100-80GB x4" in text and "A100-40GB x8" in text and "zorse_a.yaml" in text
    assert "450 GB/s, 5 us" in text and "25 GB/s, 5 us" in text


# -- errors: each names the file, the field path and the value -------------
def test_error_unknown_gpu_type(tmp_path):
    path = write(tmp_path, broken(lambda d: d["nodes"][1]["gpus"][0].update(type="A100")))
    expect_error(path, "nodes[1].gpus[0].type: unknown GPU type 'A100'", "did you mean A100-40GB", "gpu_types:")


@pytest.mark.parametrize("value", [-2, 0, "four", 2.5, True, 10**9])
def test_error_bad_count(tmp_path, value):
    path = write(tmp_path, broken(lambda d: d["nodes"][1]["gpus"][0].update(count=value)))
    expect_error(path, "nodes[1].gpus[0].count: must be a positive integer", f"(got {value!r})")


def test_error_missing_count(tmp_path):
    path = write(tmp_path, broken(lambda d: d["nodes"][0]["gpus"][1].pop("count")))
    expect_error(path, "nodes[0].gpus[1].count: missing")


@pytest.mark.parametrize("value", [-3.125, 0, "fast", None])
def test_error_bad_bandwidth(tmp_path, value):
    path = write(tmp_path, broken(lambda d: d["links"]["inter_node"].update(bandwidth_GBps=value)))
    expect_error(path, f"links.inter_node.bandwidth_GBps: must be a positive number (got {value!r})")


def test_error_missing_or_doubled_bandwidth(tmp_path):
    path = write(tmp_path, broken(lambda d: d["links"]["inter_node"].pop("bandwidth_GBps")))
    expect_error(path, "links.inter_node: no bandwidth", "bandwidth_GBps, bandwidth_Gbps, bandwidth_bytes_per_s")
    path = write(tmp_path, broken(lambda d: d["links"]["inter_node"].update(bandwidth_Gbps=25)))
    expect_error(path, "links.inter_node: bandwidth given twice (bandwidth_GBps and bandwidth_Gbps)")


@pytest.mark.parametrize("value", [-1, "10us", float("nan")])
def test_error_bad_latency(tmp_path, value):
    path = write(tmp_path, broken(lambda d: d["links"]["intra_node"].update(latency_us=value)))
    expect_error(path, "links.intra_node.latency_us: must be a number >= 0", f"(got {value!r})")


def test_latency_zero_allowed_and_missing_latency_rejected(tmp_path):
    cluster = Cluster.from_yaml(write(tmp_path, broken(lambda d: d["links"]["intra_node"].update(latency_us=0))))
    assert cluster.link(0, 1).latency_s == 0.0
    path = write(tmp_path, broken(lambda d: d["links"]["intra_node"].pop("latency_us")))
    expect_error(path, "links.intra_node: no latency", "latency_us, latency_ms, latency_s")


@pytest.mark.parametrize("value, problem", [(-1, "must be a positive number"), (0, "must be a positive number"),
                                            ("lots", "must be a positive number"), (17, "must be in (0, 16] GiB for T4")])
def test_error_bad_memory(tmp_path, value, problem):
    path = write(tmp_path, broken(lambda d: d["nodes"][1]["gpus"][0].update(memory_GiB=value)))
    expect_error(path, f"nodes[1].gpus[0].memory_GiB: {problem}", f"(got {value!r})")


def test_error_duplicate_node_name(tmp_path):
    path = write(tmp_path, broken(lambda d: d["nodes"][1].update(name="node0")))
    expect_error(path, "nodes[1].name: duplicate node name (got 'node0')", "already used by nodes[0]")


def test_error_undeclared_datacenter(tmp_path):
    path = write(tmp_path, broken(lambda d: d["nodes"][1].update(datacenter="eu-west")))
    expect_error(path, "nodes[1].datacenter: datacenter not declared (got 'eu-west')", "declared: dc0")


def test_error_missing_datacenter_with_several(tmp_path):
    def edit(d):
        d["datacenters"] = [{"name": "us"}, {"name": "eu"}]
        d["nodes"][0]["datacenter"] = "us"
    path = write(tmp_path, broken(edit))
    expect_error(path, "nodes[1].datacenter: missing", "2 datacenters (us, eu)")


def test_error_override_names_unknown_node(tmp_path):
    path = write(tmp_path, broken(lambda d: d["links"].update(
        overrides=[{"between": ["node0", "node7"], "bandwidth_GBps": 12.5, "latency_us": 8}])))
    expect_error(path, "links.overrides[0].between[1]: no such node (got 'node7')", "nodes: node0, node1")
    path = write(tmp_path, broken(lambda d: d["links"].update(
        overrides=[{"between": ["node0", ["node1"]], "bandwidth_GBps": 12.5, "latency_us": 8}])))
    expect_error(path, "links.overrides[0].between[1]: no such node (got ['node1'])")
    path = write(tmp_path, broken(lambda d: d["links"].update(
        overrides=[{"between": ["node0", "node0"], "bandwidth_GBps": 12.5, "latency_us": 8}])))
    expect_error(path, "links.overrides[0].between: must list two different node names (got ['node0', 'node0'])")


def test_error_missing_nodes(tmp_path):
    path = write(tmp_path, {"name": "empty", "links": BASE["links"]})
    expect_error(path, "nodes: missing")
    path = write(tmp_path, {"nodes": []})
    expect_error(path, "nodes: must be a non-empty list of nodes (got [])")


def test_error_unknown_keys(tmp_path):
    path = write(tmp_path, broken(lambda d: d["nodes"][0].update(gpu=d["nodes"][0].pop("gpus"))))
    expect_error(path, "nodes[0].gpu: unknown key 'gpu'", "did you mean 'gpus'?", "allowed keys: name, datacenter, gpus")
    path = write(tmp_path, broken(lambda d: d.update(link=d.pop("links"))))
    expect_error(path, "link: unknown key 'link'", "did you mean 'links'?")
    path = write(tmp_path, broken(lambda d: d["links"]["inter_node"].update(bandwidth_gbps=3)))
    expect_error(path, "links.inter_node.bandwidth_gbps: unknown key 'bandwidth_gbps'", "bandwidth_Gbps")


def test_error_yaml_syntax(tmp_path):
    path = write(tmp_path, "name: bad\nnodes:\n  - name: node0\n    gpus: [{type: T4, count: 1}\n")
    expect_error(path, "YAML syntax error at line 5")
    path = write(tmp_path, "nodes: []\nnodes: []\n")
    expect_error(path, "YAML syntax error at line 2", "duplicate key 'nodes'")


def test_error_file_not_found(tmp_path):
    expect_error(tmp_path / "nope.yaml", "nope.yaml: cluster file not found")


def test_error_missing_default_links(tmp_path):
    path = write(tmp_path, broken(lambda d: d["links"].pop("inter_node")))
    expect_error(path, "links.inter_node: missing, and nodes 'node0' and 'node1'")
    path = write(tmp_path, broken(lambda d: d["links"].pop("intra_node")))
    expect_error(path, "links.intra_node: missing, and node 'node0' has 3 GPUs")

    def two_regions(d):
        d["datacenters"] = [{"name": "us"}, {"name": "eu"}]
        d["nodes"][0]["datacenter"], d["nodes"][1]["datacenter"] = "us", "eu"
    path = write(tmp_path, broken(two_regions))
    expect_error(path, "links.cross_datacenter: missing", "datacenters 'us' and 'eu'")

    def own_intra_links(d):  # a node's own intra_node link stands in for the default
        d["links"].pop("intra_node")
        for node in d["nodes"]:
            node["intra_node"] = {"bandwidth_GBps": 32, "latency_us": 10}
    assert Cluster.from_yaml(write(tmp_path, broken(own_intra_links))).link(0, 1).bandwidth_bytes_per_s == 32e9


def test_error_bad_gpu_types(tmp_path):
    entry = {"memory_GiB": 32, "mem_bw_GBps": 900, "fp32_tflops": 15, "fp16_tensor_tflops": 120,
             "bf16_supported": False, "source": "sheet"}
    path = write(tmp_path, broken(lambda d: d.update(gpu_types={"T4": entry})))
    expect_error(path, "gpu_types.T4: 'T4' is already the built-in type T4")
    path = write(tmp_path, broken(lambda d: d.update(gpu_types={"X1": {**entry, "fp32_tflops": -1}})))
    expect_error(path, "gpu_types.X1.fp32_tflops: must be a positive number (got -1)")
    path = write(tmp_path, broken(lambda d: d.update(gpu_types={"X1": {k: v for k, v in entry.items() if k != "source"}})))
    expect_error(path, "gpu_types.X1.source: missing")


def test_from_dict_errors_name_dict_source():
    with pytest.raises(ClusterConfigError, match=re.escape("<dict>: nodes[0].gpus[0].count: must be a positive")):
        Cluster.from_dict(broken(lambda d: d["nodes"][0]["gpus"][0].update(count=0)))
    with pytest.raises(ClusterConfigError, match="my-source: <top level>: must be a mapping"):
        Cluster.from_dict(["not", "a", "mapping"], source="my-source")  # type: ignore[arg-type]


def test_declared_gpu_type_with_an_arch_is_priced_by_its_class_model(tmp_path):
    """A declared type with ``arch``, ``tdp_w`` and ``tf32_tensor_tflops`` (here the
    V100 PCIe's datasheet figures under another name) is priced by the volta class
    model exactly as the table's V100-PCIE-16GB row; without ``arch`` it falls back
    to the plain roofline; the keys round-trip; an unknown class is named with the
    closest one."""
    import torch

    from zorse_fx.cluster import gpu_spec
    from zorse_fx.cost import gpu_model
    from zorse_fx.cost.roofline import MATMUL_EFFICIENCY

    base = {"memory_GiB": 16, "mem_bw_GBps": 900, "fp32_tflops": 14, "fp16_tensor_tflops": 112,
            "bf16_supported": False, "source": "V100 PCIe datasheet"}
    data = {"name": "declared", "nodes": [{"name": "a", "gpus": [{"type": "MyVolta", "count": 1},
                                                                 {"type": "MyPlain", "count": 1}]}],
            "links": {"intra_node": {"bandwidth_GBps": 10, "latency_us": 5}},
            "gpu_types": {"MyVolta": {**base, "arch": "volta", "tdp_w": 250},
                          "MyPlain": dict(base)}}
    cluster = Cluster.from_yaml(write(tmp_path, data))
    mine, plain, table = cluster.gpus[0].spec, cluster.gpus[1].spec, gpu_spec("V100-PCIE-16GB")
    assert (mine.arch, mine.tdp_w, plain.arch) == ("volta", 250, None)
    assert gpu_model.has_class_model(mine) and not gpu_model.has_class_model(plain)
    rate = gpu_model.sustained_matmul_flops_per_s(mine, torch.float16, MATMUL_EFFICIENCY)
    assert rate == gpu_model.sustained_matmul_flops_per_s(table, torch.float16, MATMUL_EFFICIENCY)
    assert rate == gpu_model.predicted_sustained_fp16("volta", 112e12, 250)  # the class's rate, not 0.6 x peak
    assert gpu_model.sustained_matmul_flops_per_s(plain, torch.float16, MATMUL_EFFICIENCY) == \
        112e12 * MATMUL_EFFICIENCY
    assert Cluster.from_dict(cluster.to_dict()) == cluster

    data["gpu_types"]["MyVolta"] = {**base, "arch": "volt", "tf32_tensor_tflops": 62.5}
    expect_error(write(tmp_path, data), "gpu_types.MyVolta.arch: unknown architecture class", "did you mean 'volta'?",
                 "pascal")


# -- numbers YAML 1.1 reads as strings (issue 46) ----------------------------
EVERY_NUMBER = """\
name: numbers
datacenters: [{name: us}, {name: eu}]
nodes:
  - {name: a, datacenter: us, gpus: [{type: T4, count: 2, memory_GiB: 15}], host_memory_GiB: 512,
     host_memory_bandwidth_GBps: 204.8, host_link: {bandwidth_GBps: 15.75},
     intra_node: {bandwidth_GBps: 300, latency_us: 5}, nic: {bandwidth_Gbps: 25}}
  - {name: b, datacenter: eu, gpus: [{type: MyGPU, count: 1}]}
links:
  intra_node: {bandwidth_GBps: 16, latency_us: 10}
  inter_node: {bandwidth_Gbps: 100, latency_ms: 0.02}
  cross_datacenter: {bandwidth_Gbps: 1000, latency_ms: 50}
  overrides: [{between: [a, b], bandwidth_bytes_per_s: 500000000, latency_s: 0.011}]
shared_links:
  - {name: wan, between: [{datacenter: us}, {datacenter: eu}], bandwidth_Gbps: 1}
gpu_types:
  MyGPU: {memory_GiB: 32, mem_bw_GBps: 900, fp32_tflops: 15, fp16_tensor_tflops: 120, bf16_supported: false,
          source: vendor sheet, arch: volta, tdp_w: 300, tf32_tensor_tflops: 60}
"""


def _exponent(match: re.Match) -> str:
    """A number of EVERY_NUMBER written as YAML 1.1 reads a string: no dot or no exponent sign (2e2, 1.5e1)."""
    value = float(match.group(2))
    mantissa, exp = f"{value:e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{match.group(1)}{mantissa}e{int(exp)}"


def test_yaml_exponent_numbers_accepted(tmp_path):
    """`host_memory_GiB: 1e9`, `1.5e3`: YAML 1.1 (PyYAML) reads them as strings;
    every numeric field of a cluster file reads them as the numbers they are
    (YAML 1.2), so the file equals the one with the plain numbers."""
    rewritten = re.sub(r"(\b(?!count)\w+: )([0-9][0-9.]*)\b", _exponent, EVERY_NUMBER)
    assert "host_memory_GiB: 5.12e2" in rewritten and "latency_ms: 2e-2" in rewritten
    assert "fp32_tflops: 1.5e1" in rewritten and "count: 2," in rewritten
    assert not re.search(r"\b(?!count)\w+: [0-9.]+[,}\n]", rewritten), "a number left unrewritten"
    plain = Cluster.from_yaml(write(tmp_path, EVERY_NUMBER, "plain.yaml"))
    assert Cluster.from_yaml(write(tmp_path, rewritten, "exponents.yaml")) == plain
    assert plain.node_host_memory_bytes[0] == 512 * GiB
    path = write(tmp_path, EVERY_NUMBER.replace("host_memory_GiB: 512", "host_memory_GiB: 1e9"), "big.yaml")
    assert Cluster.from_yaml(path).node_host_memory_bytes[0] == 10**9 * GiB


def test_yaml_quoted_number_named_as_a_string(tmp_path):
    """A quoted number stays a string (as in every YAML version): the message says
    YAML read it as a string and how to write it."""
    path = write(tmp_path, EVERY_NUMBER.replace("host_memory_GiB: 512", "host_memory_GiB: '1e9'"))
    assert expect_error(path, "nodes[0].host_memory_GiB") == (
        f"{path}: nodes[0].host_memory_GiB: must be a positive number; YAML read '1e9' as a string because it is "
        f"quoted; write it without quotes: host_memory_GiB: 1e9")
    path = write(tmp_path, EVERY_NUMBER.replace("latency_us: 10}", 'latency_us: "10"}'))
    expect_error(path, "links.intra_node.latency_us: must be a number >= 0; YAML read '10' as a string because it "
                       "is quoted; write it without quotes: latency_us: 10")
