"""`zorse bench comm`: the alpha-beta fit, the profile file, and one real 2-rank Gloo run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from zorse_fx.errors import FileFormatError
from zorse_fx.profiling.comm import CommProfile, CommProfileError, LinkFit, classify_pair, fit_alpha_beta
from zorse_fx.profiling.comm_launch import run_comm_bench
from zorse_fx.profiling.comm_main import parse_sizes

SIZES = [2**k for k in range(10, 25)]  # 1 KiB .. 16 MiB


@pytest.mark.parametrize("alpha,bw", [(25e-6, 12.5e9), (50e-3, 125e6), (0.0, 3.0e9), (2e-6, 300e9)])
def test_fit_recovers_exact_linear_data(alpha, bw):
    a, b, r2 = fit_alpha_beta([(s, alpha + s / bw) for s in SIZES])
    assert a == pytest.approx(alpha, rel=1e-9, abs=1e-15)
    assert b == pytest.approx(bw, rel=1e-9)
    assert r2 == pytest.approx(1.0, abs=1e-12)


def test_fit_with_noise_is_close():
    rng = np.random.default_rng(0)
    alpha, bw = 30e-6, 10e9
    samples = [(s, (alpha + s / bw) * (1 + 0.03 * rng.standard_normal())) for s in SIZES for _ in range(3)]
    a, b, r2 = fit_alpha_beta(samples)
    assert a == pytest.approx(alpha, rel=0.05)
    assert b == pytest.approx(bw, rel=0.05)
    assert 0.95 < r2 <= 1.0


def test_fit_negative_intercept_is_clipped_to_zero():
    # Small messages faster than the line through the large ones: alpha clipped, beta refitted through 0.
    # Times grow faster than linearly: the unconstrained intercept is negative.
    samples = [(1024, 1e-7), (2048, 2.2e-7), (4096, 4.6e-7)]
    a, b, r2 = fit_alpha_beta(samples)
    assert a == 0.0
    w = np.array([1 / t for _, t in samples])
    x, y = np.array([s for s, _ in samples], float), np.array([t for _, t in samples])
    assert b == pytest.approx(1 / (np.sum(w * w * x * y) / np.sum(w * w * x * x)), rel=1e-12)
    assert 0.9 < r2 <= 1.0


@pytest.mark.parametrize("samples,match", [
    ([], "at least 2"),
    ([(1024, 1e-5)], "at least 2"),
    ([(1024, 1e-5), (1024, 2e-5)], "2 distinct message sizes"),
    ([(0, 1e-5), (1024, 2e-5)], "positive integer number of bytes, got 0"),
    ([(-8, 1e-5), (1024, 2e-5)], "got -8"),
    ([(1024, 0.0), (2048, 2e-5)], "seconds > 0, got 0.0"),
    ([(1024, float("nan")), (2048, 2e-5)], "got nan"),
    ([(1024, 2e-5), (2**20, 1e-5)], "do not grow with message size"),
])
def test_fit_rejects_bad_samples(samples, match):
    with pytest.raises(ValueError, match=match):
        fit_alpha_beta(samples)


def _profile() -> CommProfile:
    p2p = LinkFit(link_class="intra_node", op="p2p", alpha_s=40e-6, bandwidth_bytes_per_s=4.5e9, r2=0.99,
                  samples=((1024, 4.1e-5), (2**20, 2.7e-4)))
    ar = LinkFit(link_class="inter_node", op="allreduce", alpha_s=3e-4, bandwidth_bytes_per_s=2e9, r2=0.95,
                 samples=((1024, 3e-4), (2**20, 8e-4)), ranks=4)
    return CommProfile(harness_version="1", backend="gloo", world_size=4, hosts=("a", "a", "b", "b"),
                       datacenters=("", "", "", ""), device="cpu", torch_version="2.13.0",
                       measured_at="2026-01-01T00:00:00Z", fits=(p2p, ar))


def test_profile_round_trip_and_link_yaml(tmp_path):
    prof = _profile()
    path = prof.save(tmp_path / "sub" / "comm.json")
    assert CommProfile.load(path) == prof
    d = json.loads(path.read_text())
    assert (d["format"], d["version"]) == ("zorse_fx.comm_profile", 1)
    assert d["fits"][1]["bus_bandwidth_bytes_per_s"] == pytest.approx(2e9 * 2 * 3 / 4)  # nccl-tests busbw
    assert prof.fits[0].bus_bandwidth_bytes_per_s == 4.5e9
    assert prof.link_yaml("intra_node") == {"bandwidth_GBps": 4.5, "latency_us": 40.0}
    with pytest.raises(ValueError, match="no p2p measurement for link class 'inter_node'"):
        prof.link_yaml("inter_node")


def test_link_yaml_is_accepted_by_the_cluster_parser():
    from zorse_fx.cluster import Cluster

    cluster = Cluster.from_dict({"name": "t", "nodes": [{"name": "n0", "gpus": [{"type": "T4", "count": 2}]}],
                                 "links": {"intra_node": _profile().link_yaml("intra_node")}})
    assert cluster.intra_node_link.bandwidth_bytes_per_s == pytest.approx(4.5e9)
    assert cluster.intra_node_link.latency_s == pytest.approx(40e-6)


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.update(format="zorse_fx.plan"), (r"not a zorse_fx communication profile \(field 'format' is "
                                                  r"'zorse_fx.plan', expected 'zorse_fx.comm_profile'\)")),
    (lambda d: d.update(version=7), (r"communication profile format version 7 is not supported by this zorse_fx "
                                     r"\(reads version 1\); re-run `zorse bench comm`")),
    (lambda d: d.pop("backend"), r"missing field 'backend'; re-run `zorse bench comm`"),
    (lambda d: d.update(hosts=["a"]), r"field 'hosts' is \['a'\]: expected a list of 4 host names"),
    (lambda d: d["fits"][0].update(alpha_s=-1.0), r"field fits\[0\].alpha_s is -1.0: expected `float` >= 0.0"),
    (lambda d: d["fits"][0].update(alpha_s=float("inf")), r"field fits\[0\].alpha_s is inf: expected a finite number"),
    (lambda d: d["fits"][1].update(op="broadcast"), r"field fits\[1\].op is 'broadcast'; allowed: 'p2p', 'allreduce'"),
    (lambda d: d["fits"][0].update(bandwidth_bytes_per_s=0), (r"field fits\[0\].bandwidth_bytes_per_s is 0: "
                                                              r"expected `float` > 0.0")),
    (lambda d: d["fits"][0].update(samples=[[1024]]), (r"field fits\[0\].samples\[0\] is \[1024\]: expected "
                                                       r"`array` of length 2, got 1 \(a list of \[bytes > 0, "
                                                       r"seconds > 0\] pairs\)")),
    (lambda d: d["fits"][0].update(link_class="rack"), (r"field fits\[0\].link_class is 'rack'; allowed: "
                                                        r"'intra_node', 'inter_node', 'cross_datacenter'")),
])
def test_bad_profile_files_name_file_field_and_value(tmp_path, mutate, match):
    d = _profile().to_dict()
    mutate(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(CommProfileError, match=match) as e:
        CommProfile.load(path)
    assert str(e.value).startswith(f"{path}: ")
    # the fix (an enum's error lists the allowed values instead)
    assert str(e.value).endswith("re-run `zorse bench comm`") or "not a zorse_fx" in str(e.value) \
        or "; allowed: " in str(e.value)
    assert isinstance(e.value, ValueError) and isinstance(e.value, FileFormatError)


@pytest.mark.parametrize("mutate,field,value", [
    (lambda d: d.update(world_size="4"), "'world_size'", "4"),  # wrong type
    (lambda d: d["fits"][1].update(ranks=1), "fits[1].ranks", 1),  # out of range
    (lambda d: d["fits"][0].update(latency=3e-5), "fits[0].latency", 3e-5),  # unknown field
])
def test_bad_profile_fields_set_file_field_and_value(tmp_path, mutate, field, value):
    d = _profile().to_dict()
    mutate(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(FileFormatError) as e:
        CommProfile.load(path)
    assert isinstance(e.value, CommProfileError)
    assert (e.value.path, e.value.field, e.value.value) == (str(path), field, value)
    assert str(e.value).startswith(f"{path}: ") and field in str(e.value) and repr(value) in str(e.value)


def test_not_json_names_the_file(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("{nope")
    with pytest.raises(ValueError, match="x.json: invalid JSON at line 1: .*; re-run `zorse bench comm`"):
        CommProfile.load(path)
    with pytest.raises(CommProfileError, match="y.json: no such communication profile file; create one with "
                                               "`zorse bench comm`"):
        CommProfile.load(tmp_path / "y.json")


def test_classify_pair_and_parse_sizes():
    assert classify_pair("h0", "h0") == "intra_node"
    assert classify_pair("h0", "h1") == "inter_node"
    assert classify_pair("h0", "h1", "eu", "eu") == "inter_node"
    assert classify_pair("h0", "h1", "eu", "us") == "cross_datacenter"
    assert classify_pair("h0", "h1", "eu", "") == "inter_node"  # unknown datacenter: not assumed remote
    assert parse_sizes(["1K:8K", "1M,64"]) == [64, 1024, 2048, 4096, 8192, 2**20]
    with pytest.raises(ValueError, match="multiples of 4"):
        parse_sizes(["1K", "6"])
    with pytest.raises(ValueError, match="not a size"):
        parse_sizes(["1K", "3X"])
    with pytest.raises(ValueError, match="at least 2 distinct"):
        parse_sizes(["4K", "4096"])


def test_launcher_needs_two_ranks(tmp_path):
    with pytest.raises(ValueError, match="at least 2 ranks"):
        run_comm_bench(1, tmp_path / "c.json", [])


def test_real_two_rank_gloo_run(tmp_path):
    out = tmp_path / "comm.json"
    proc = run_comm_bench(2, out, ["--iters", "5", "--sizes", "4K", "256K", "4M", "--plot", str(tmp_path / "c.png")])
    assert "intra_node" in proc.stdout and "latency_us" in proc.stdout
    prof = CommProfile.load(out)
    assert prof.world_size == 2 and prof.backend == "gloo" and len(prof.hosts) == 2
    assert {(f.link_class, f.op) for f in prof.fits} == {("intra_node", "p2p"), ("intra_node", "allreduce")}
    for f in prof.fits:
        assert f.bandwidth_bytes_per_s > 0 and f.alpha_s >= 0
        assert [s for s, _ in f.samples] == [4096, 256 * 1024, 4 * 2**20]
        assert all(t > 0 for _, t in f.samples)
    assert (tmp_path / "c.png").stat().st_size > 0
    yaml = prof.link_yaml("intra_node")
    assert yaml["bandwidth_GBps"] > 0 and yaml["latency_us"] >= 0


def test_noisy_samples_fall_back_instead_of_failing():
    """Times that shrink with size (noise on a busy host) must not crash a run: the
    strict fit refuses, fit_or_bound keeps a bounded estimate flagged by r2 = 0."""
    from zorse_fx.profiling.comm import fit_or_bound

    pts = [(4096, 3e-4), (65536, 2e-4), (1 << 20, 1e-4)]
    with pytest.raises(ValueError, match="times do not grow with message size"):
        fit_alpha_beta(pts)
    assert fit_or_bound(pts) == (1e-4, (1 << 20) / 1e-4, 0.0)


@pytest.mark.parametrize("what,options", [("comm", ["--out", "--sizes", "--iters", "--plot", "--nproc"]),
                                          ("kernels", ["--model", "--batch-sizes", "--output", "--plot"])])
def test_cli_bench_help_lists_the_options(capsys, what, options):
    from zorse_fx.cli import main as zorse_main

    with pytest.raises(SystemExit) as e:
        zorse_main(["bench", what, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: zorse bench {what}")
    assert all(o in text for o in options), text


def test_cli_bench_comm_options_reach_the_ranks_unchanged():
    """`zorse bench comm` parses with comm_main's own parser (parents=) and hands
    the checked values to the ranks (sweep_argv); parsing those gives the same."""
    from zorse_fx.cli import build_parser
    from zorse_fx.profiling.comm_main import parse_args, sweep_argv

    cli = build_parser()
    a = cli.parse_args(["bench", "comm", "--nproc", "3", "--out", "c.json", "--sizes", "1K:4K", "1M", "--iters", "2",
                        "--all-pairs", "--datacenter", "eu", "--plot", "c.png"])
    a = a.check(a)
    assert a.nproc == 3 and a.sizes == [1024, 2048, 4096, 2**20]
    ranks = parse_args(["--out", "c.json", *sweep_argv(a)])
    for k in ("sizes", "iters", "warmup", "all_pairs", "datacenter", "plot", "backend"):
        assert getattr(ranks, k) == getattr(a, k), k
    with pytest.raises(SystemExit):
        cli.parse_args(["bench", "comm", "--nproc", "1", "--out", "c.json"])


def test_cli_bench_comm_needs_a_gpu_per_nccl_rank(monkeypatch, capsys, tmp_path):
    import torch

    from zorse_fx.cli import main as zorse_main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert zorse_main(["bench", "comm", "--nproc", "2", "--out", str(tmp_path / "c.json")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("zorse: --nproc 2: NCCL ranks need a GPU each and this machine has 1;")
    assert "--backend gloo" in err and not (tmp_path / "c.json").exists()
