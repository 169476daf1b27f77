"""The box (issue 47 item 1): a cluster file emulated on this machine with network namespaces,
bridges, htb, a delay line and CPU-quota cgroups, and removed on every way out.

The layout (scale factor, quotas, rates, delays) and the refusals need nothing; building a box needs
root, CAP_NET_ADMIN and a writable cgroup hierarchy, which ``check_machine`` tries: where any is
missing those tests are skipped with its reason. Measured checks assert only what load cannot
break: a round trip is never shorter than the two configured delays, a quota-limited busy loop never
gets more CPU than its quota, bytes counters count at least what was sent.
"""

from __future__ import annotations

import functools
import json
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import CLUSTERS
from zorse_fx.box import Box, BoxOptions, check_machine, plan_box
from zorse_fx.box import net as box_net
from zorse_fx.box.cgroups import Cgroups
from zorse_fx.box.layout import (DEFAULT_CPU_PROFILE, MAX_DELAY_S, MIN_PERIOD_US, MIN_QUOTA_US, cpu_rate_flops_per_s,
                                 gpu_rate_flops_per_s)
from zorse_fx.box.state import STATE_DIR, STATE_FILE, BoxState, BoxStateDoc, process_start_ticks
from zorse_fx.cli import main as zorse_main
from zorse_fx.cluster import Cluster
from zorse_fx.errors import BoxConfigError, BoxSetupError, BoxStateFileError
from zorse_fx.file_schema import to_builtins
from zorse_fx.pacing import PACE_HEADROOM

SMALL_HETERO = CLUSTERS / "small_hetero.yaml"
#: Two regions joined by a shared WAN, NICs on every node, a node with two GPUs.
TWO_REGIONS = {
    "name": "two_regions",
    "datacenters": [{"name": "east"}, {"name": "west"}],
    "nodes": [
        {"name": "fast", "datacenter": "east", "gpus": [{"type": "A100-40GB", "count": 2}],
         "intra_node": {"bandwidth_GBps": 300, "latency_us": 5}},
        {"name": "slow", "datacenter": "east", "gpus": [{"type": "T4", "count": 1}]},
        {"name": "far", "datacenter": "west", "gpus": [{"type": "V100-16GB", "count": 1}],
         "nic": {"bandwidth_Gbps": 10}},
    ],
    "links": {"inter_node": {"bandwidth_GBps": 3.125, "latency_us": 20},
              "cross_datacenter": {"bandwidth_Gbps": 10, "latency_us": 100},
              "nic": {"bandwidth_Gbps": 25}},
    "shared_links": [{"name": "wan", "between": [{"datacenter": "east"}, {"datacenter": "west"}],
                      "bandwidth_Gbps": 5},
                     # far's cap on its traffic with the other region (a cloud's per-instance cap): shaped on
                     # far's eth0 (far -> east) and on the router's port to far (east -> far), besides the WAN
                     {"name": "far-cap", "between": [{"nodes": ["far"]}, {"datacenter": "east"}],
                      "bandwidth_Gbps": 2}],
}


@functools.cache
def _why_no_box() -> str | None:
    return check_machine()


@pytest.fixture
def box_machine():
    """Skip (with the reason) where this machine cannot build a box: each capability is tried."""
    reason = _why_no_box()
    if reason:
        pytest.skip(f"zorse box cannot run here: {reason}")


def _box_id(tag: str) -> str:
    return f"t{os.getpid()}_{tag}"


def _leftovers(box_id: str) -> dict[str, list[str]]:
    """Everything named after box ``box_id`` on this machine: namespaces, cgroup dirs, files."""
    roots = Cgroups.detect().roots()
    return {
        "netns": [n for n in box_net.list_namespaces() if n == f"zbox-{box_id}" or n.startswith(f"zbox-{box_id}-")],
        "cgroups": [str(p) for r in roots for p in Path(r).glob(f"zbox-{box_id}")],
        "files": [str(p) for p in STATE_DIR.glob(f"{box_id}.*")] if STATE_DIR.is_dir() else [],
    }


def _root_links() -> set[str]:
    return {line.split(":")[1].strip().split("@")[0]
            for line in box_net.run(["ip", "-o", "link"]).stdout.splitlines()}


def _alive(pid: int) -> bool:
    return process_start_ticks(pid) is not None


_ECHO = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 4747))
s.listen(); print("listening", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(5):
    c.sendall(c.recv(1))
n = 0
while (b := c.recv(1 << 16)):
    n += len(b)
print(n, flush=True)
"""


def _exchange(box: Box, src: str, dst: str, n_bytes: int) -> tuple[list[float], int]:
    """One TCP connection from ``src`` to ``dst`` by its hostname: five 1-byte round trips (seconds each), then
    ``n_bytes``; what ``dst`` received."""
    server = box.spawn(dst, [sys.executable, "-I", "-S", "-c", _ECHO], stdout=subprocess.PIPE, text=True)
    assert select.select([server.stdout], [], [], 60)[0] and server.stdout.readline().strip() == "listening"
    rtt = json.loads(_run_on(box, src, f"""
        import json, socket, time
        c = socket.create_connection(({dst!r}, 4747), timeout=60)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(5):
            t = time.perf_counter(); c.sendall(b"p"); c.recv(1); rtts.append(time.perf_counter() - t)
        c.sendall(b"x" * {n_bytes}); c.close()
        print(json.dumps(rtts))"""))
    return rtt, int(server.communicate(timeout=60)[0])


def _run_on(box: Box, node: str, code: str, *, rank: int | None = None, timeout: float = 60) -> str:
    """Run a Python snippet on ``node`` (stdlib only) and return its stdout; fails with its stderr."""
    p = box.spawn(node, [sys.executable, "-I", "-S", "-c", textwrap.dedent(code)], rank=rank,
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, f"on {node}: {err}"
    return out


# -- the layout: no root needed -----------------------------------------------------------------------


def test_small_hetero_scale_factor_and_quotas_follow_the_cost_model():
    """[Note: the box's scale factor]: quotas in proportion to the GPU types' sustained matmul rates, the
    fastest at q_max = cores / sum of relative speeds, s = q_max x R_cpu / R_max; links x s, delays / s."""
    cluster = Cluster.from_yaml(SMALL_HETERO)
    layout = plan_box(cluster, BoxOptions(box_id="x", cores=2.0), cores_available=2.0)
    a100 = gpu_rate_flops_per_s(cluster.gpus[0].spec, "auto")
    t4 = gpu_rate_flops_per_s(cluster.gpus[2].spec, "auto")
    assert t4 < a100
    ranks = {r.gpu_type: r for n in layout.nodes for r in n.ranks}
    q_max = 2.0 / (2 + 2 * t4 / a100)
    assert ranks["A100-40GB"].cpu_quota_cores == pytest.approx(q_max, rel=1e-12)
    assert ranks["T4"].cpu_quota_cores / ranks["A100-40GB"].cpu_quota_cores == pytest.approx(t4 / a100, rel=1e-12)
    assert sum(r.cpu_quota_cores for n in layout.nodes for r in n.ranks) == pytest.approx(2.0, rel=1e-12)
    cpu, _ = cpu_rate_flops_per_s(DEFAULT_CPU_PROFILE)
    s = layout.scale.factor  # (paced with the drift probe: on a nominal host PACE_HEADROOM slower)
    assert s == pytest.approx(q_max * cpu / PACE_HEADROOM / a100, rel=1e-12) and not layout.scale.explicit
    assert layout.scale.drift_headroom == PACE_HEADROOM
    for options in (BoxOptions(box_id="x", cores=2.0, drift_probe=False), BoxOptions(box_id="x", cores=2.0,
                                                                                      speed="quota")):
        assert plan_box(cluster, options, cores_available=2.0).scale.factor == pytest.approx(q_max * cpu / a100,
                                                                                              rel=1e-12)
    link = cluster.link(0, 2)
    for p in layout.pairs:
        assert p.bytes_per_s == pytest.approx(link.bandwidth_bytes_per_s * s, rel=1e-12)
        assert p.delay_s == pytest.approx(link.latency_s / s, rel=1e-12)
    # the period: the shortest from 10 ms in which the T4's quota is at least the kernel's 1 ms
    period = layout.cpu_period_us
    assert ranks["T4"].cpu_quota_cores * period >= MIN_QUOTA_US > ranks["T4"].cpu_quota_cores * (period - 1000)
    assert period >= MIN_PERIOD_US
    # fp32: the GPUs compared by their FP32 rates, a smaller gap
    fp32 = plan_box(cluster, BoxOptions(box_id="x", cores=2.0, precision="fp32"), cores_available=2.0)
    r32 = {r.gpu_type: r.relative_speed for n in fp32.nodes for r in n.ranks}
    assert r32["T4"] == pytest.approx(gpu_rate_flops_per_s(cluster.gpus[2].spec, "fp32")
                                      / gpu_rate_flops_per_s(cluster.gpus[0].spec, "fp32"), rel=1e-12)
    assert r32["T4"] > ranks["T4"].relative_speed
    text = layout.table()
    for word in ("a100-node", "t4-node", "10.1.0.2", "10.1.0.3", "scale s =", "not emulated: intra-node links"):
        assert word in text


def test_tcp_tuned_for_the_largest_bandwidth_delay_product():
    """[Note: the box's TCP tuning]: socket buffers up to 2 x the largest bandwidth x round trip of the box's
    pairs (a power of two, at least 8 MiB), no slow start after idle; --no-tcp-tuning: the kernel's defaults,
    and the table says which."""
    cluster = Cluster.from_dict(TWO_REGIONS)
    layout = plan_box(cluster, BoxOptions(box_id="x", cores=2.0, scale=0.01), cores_available=2.0)
    delay = {(p.src, p.dst): p.delay_s for p in layout.pairs}
    bdp = max(p.bytes_per_s * (p.delay_s + delay[p.dst, p.src]) for p in layout.pairs)
    got = dict(layout.tcp_sysctls)
    buf = int(got["net.ipv4.tcp_wmem"].split()[2])
    assert got["net.ipv4.tcp_rmem"].split()[2] == str(buf) and buf & (buf - 1) == 0
    assert max(2 * bdp, 8 << 20) <= buf < max(4 * bdp, 16 << 20)
    assert got["net.ipv4.tcp_slow_start_after_idle"] == "0"
    assert "tcp_slow_start_after_idle = 0" in layout.table()
    wide = plan_box(cluster, BoxOptions(box_id="x", cores=2.0, scale=1.0), cores_available=2.0)
    assert int(dict(wide.tcp_sysctls)["net.ipv4.tcp_wmem"].split()[2]) >= buf  # faster links, larger windows
    plain = plan_box(cluster, BoxOptions(box_id="x", cores=2.0, scale=0.01, tcp_tuning=False), cores_available=2.0)
    assert plain.tcp_sysctls == () and "the kernel's defaults (--no-tcp-tuning)" in plain.table()


def test_explicit_scale_reported_as_breaking_the_ratio():
    layout = plan_box(Cluster.from_yaml(SMALL_HETERO), BoxOptions(box_id="x", scale=0.01), cores_available=2.0)
    assert layout.scale.explicit and layout.scale.factor == 0.01
    assert any("--scale 0.01 makes links" in line for line in layout.limits)


def _many_p100s() -> Cluster:
    """1,024 P100s beside one H100."""
    return Cluster.from_dict({"name": "many", "nodes": [
        {"name": "h", "gpus": [{"type": "H100-80GB", "count": 1}]},
        {"name": "t", "gpus": [{"type": "P100-16GB", "count": 1024}]}],
        "links": {"intra_node": {"bandwidth_GBps": 16, "latency_us": 10},
                  "inter_node": {"bandwidth_GBps": 3, "latency_us": 20}}})


def test_quota_below_kernel_minimum_refused():
    """1,024 P100s beside one H100 on one core: a P100 rank's share is below 1 ms per 1 s."""
    cluster = _many_p100s()
    with pytest.raises(BoxConfigError, match=r"a P100-16GB rank would get .* below the kernel's smallest CPU quota "
                                             r"\(1 ms per 1 s\); give more --cores"):
        plan_box(cluster, BoxOptions(box_id="x", cores=1.0, speed="quota"), cores_available=2.0)


def test_pace_beyond_its_limit_refused_and_pace_is_one_over_cores():
    """A paced box ([Note: paced compute]): a rank's ZORSE_PACE is 1 / its cores; 1,024 P100s beside one H100 on
    one core would need a pace above 1000, refused with the fix."""
    cluster = _many_p100s()
    with pytest.raises(BoxConfigError, match=r"a P100-16GB rank would compute .*x slower than a CPU thread .* beyond "
                                             r"ZORSE_PACE's 1000; give more --cores"):
        plan_box(cluster, BoxOptions(box_id="x", cores=1.0), cores_available=2.0)
    layout = plan_box(Cluster.from_yaml(SMALL_HETERO), BoxOptions(box_id="x"), cores_available=2.0)
    assert layout.speed == "pace" and "ranks paced" in layout.table()
    for n in layout.nodes:
        for r in n.ranks:
            assert layout.pace_factor(n.name, r.local_rank) == 1.0 / r.cpu_quota_cores
    quota = plan_box(Cluster.from_yaml(SMALL_HETERO), BoxOptions(box_id="x", speed="quota"), cores_available=2.0)
    assert quota.pace_factor("t4-node", 0) is None and "CPU quotas, period" in quota.table()


def test_more_cores_than_the_machine_refused():
    with pytest.raises(BoxConfigError, match=r"--cores 3: this machine gives this process 2 CPUs"):
        plan_box(Cluster.from_yaml(SMALL_HETERO), BoxOptions(box_id="x", cores=3.0), cores_available=2.0)


def test_scaled_latency_beyond_tcp_refused_with_the_scale_to_give():
    """Zorse C's 50 ms WAN at the ratio-preserving scale would be minutes one way."""
    with pytest.raises(BoxConfigError, match=r"cross_datacenter link r1-a10g-0 -> r2-v100-0 \(50 ms\) would take "
                                             r".* s one way .* give --scale 0.01 or more"):
        plan_box(Cluster.from_yaml(CLUSTERS / "zorse_c_two_regions.yaml"), cores_available=2.0)
    assert MAX_DELAY_S == 5.0  # (the 0.01 above: 50 ms / 5 s)


def test_node_name_that_is_no_hostname_refused():
    cluster = Cluster.from_dict({"name": "dots", "nodes": [{"name": "a.b", "gpus": [{"type": "T4", "count": 1}]}]})
    with pytest.raises(BoxConfigError, match=r"node 'a.b' cannot be a hostname in the box"):
        plan_box(cluster, cores_available=2.0)


def test_shared_links_shaped_where_their_one_node_side_is():
    """The WAN on the router's IFB; far's cap, whose flows cross the WAN too, where its one-node side is: far ->
    east on far's eth0, east -> far on the router's port to far (a flow crosses one link at each place)."""
    layout = plan_box(Cluster.from_dict(TWO_REGIONS), BoxOptions(box_id="x", scale=0.01), cores_available=2.0)
    assert [(d.name, d.src, d.dst, d.at) for d in layout.shared] == [
        ("wan", ("fast", "slow"), ("far",), "ifb"), ("wan", ("far",), ("fast", "slow"), "ifb"),
        ("far-cap", ("far",), ("fast", "slow"), "egress:far"), ("far-cap", ("fast", "slow"), ("far",), "ingress:far")]


def test_flows_across_two_shared_links_at_one_place_refused():
    data = json.loads(json.dumps(TWO_REGIONS))
    data["shared_links"].append({"name": "uplink", "between": [{"nodes": ["fast"]}, {"nodes": ["far"]}],
                                 "bandwidth_Gbps": 1})
    data["shared_links"].append({"name": "fast-cap", "between": [{"nodes": ["fast"]}, {"datacenter": "west"}],
                                 "bandwidth_Gbps": 1})
    with pytest.raises(BoxConfigError, match=re.escape(
            "flows fast -> far cross the shared links 'wan', 'far-cap', 'uplink' and 'fast-cap'; the box shapes a "
            "flow at one shared link per place (the router's IFB; the sending node's eth0 and the router's port to "
            "the receiving node, for a link whose side there is one node): declare fewer")):
        plan_box(Cluster.from_dict(data), cores_available=2.0)


def test_box_id_with_dash_refused(capsys):
    assert zorse_main(["box", "up", str(SMALL_HETERO), "--id", "a-b"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("zorse: box id 'a-b': use 1 to 24 letters, digits or '_' (no '-'") and "\n" not in err


def test_box_scale_not_a_positive_number_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        zorse_main(["box", "up", str(SMALL_HETERO), "--scale", "-1"])
    assert exc.value.code == 2 and "argument --scale: '-1': give a number > 0" in capsys.readouterr().err


def test_box_down_unknown_id_names_the_boxes(capsys):
    assert zorse_main(["box", "down", "no_such_box_47"]) == 1
    assert capsys.readouterr().err.startswith("zorse: no box 'no_such_box_47' (no /run/zorse_box/no_such_box_47.json)")


def test_cgroup_hierarchies_found_in_mountinfo_v1_and_v2(tmp_path):
    """v2 where the unified hierarchy offers the cpu controller (its cgroup.controllers), else v1's cpu and
    memory hierarchies (this project's machines: a hybrid mount whose unified part has no controllers)."""
    unified = tmp_path / "unified"
    unified.mkdir()
    (unified / "cgroup.controllers").write_text("\n")
    mountinfo = ("32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
                 "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
                 f"41 31 0:38 / {unified} rw,relatime - cgroup2 cgroup2 rw\n")
    found = Cgroups.detect(mountinfo)
    assert (found.version, found.cpu_root, found.memory_root) == (1, "/sys/fs/cgroup/cpu", "/sys/fs/cgroup/memory")
    (unified / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    found = Cgroups.detect(mountinfo)
    assert (found.version, found.cpu_root, found.memory_root) == (2, str(unified), str(unified))
    with pytest.raises(BoxSetupError, match="no cgroup hierarchy with the cpu controller"):
        Cgroups.detect(mountinfo.splitlines()[1])


def test_netem_leaves_carry_each_pairs_delay():
    """Where the kernel has netem (not this one: the command is checked, not run), every per-peer class gets
    a netem leaf with that pair's one-way delay and nothing routes through the delay line."""
    layout = plan_box(Cluster.from_dict(TWO_REGIONS), BoxOptions(box_id="x", scale=0.01), latency="netem",
                      cores_available=2.0)
    fast = layout.node("fast")
    lines = box_net._node_egress(layout, fast, netem=True)
    want = {p.dst: round(p.delay_s * 1e6) for p in layout.pairs if p.src == "fast"}
    assert want == {"slow": 2000, "far": 10000}
    netem = [line for line in lines if " netem " in line]
    assert len(netem) == 2 and all(f"netem delay {us}us" in "".join(netem) for us in want.values())
    assert not any(" netem " in line for line in box_net._node_egress(layout, fast, netem=False))


def test_state_file_round_trip_and_damaged_field_named():
    layout = plan_box(Cluster.from_dict(TWO_REGIONS), BoxOptions(box_id="x", scale=0.01), cores_available=2.0)
    state = BoxState(box_id="x", created_at="2026-12-07T00:00:00+00:00", holder_pid=1, holder_start=5,
                     cgroups=Cgroups(version=1, cpu_root="/c", memory_root=None), cgroup_dirs=("/c/zbox-x",),
                     netns=("zbox-x",), delay_line_pid=None, layout=layout)
    d = json.loads(json.dumps(to_builtins(state, BoxStateDoc, lambda r: {"format": "zorse_fx.box", "version": 1}
                                          if isinstance(r, BoxState) else {})))
    from zorse_fx.file_schema import from_doc

    assert from_doc(STATE_FILE.decode(d, "s.json"), BoxState) == state
    d["layout"]["nodes"][1]["ranks"][0]["cpu_quota_cores"] = "fast"
    with pytest.raises(BoxStateFileError, match=r"s.json: field layout.nodes\[1\].ranks\[0\].cpu_quota_cores is "
                                                r"'fast'"):
        STATE_FILE.decode(d, "s.json")


# -- a box on this machine ---------------------------------------------------------------------------


def test_two_regions_box_hostnames_links_quotas_and_nothing_left(box_machine):
    """One box of the two-region cluster: each node's hostname and name resolution, TCP across a region's
    bridge and the WAN, every rate read back from the kernel and its bytes counters, the delay line's delay
    as a lower bound on the round trip, each rank's quota read back and enforced; then nothing left."""
    box_id = _box_id("regions")
    links_before = _root_links()
    assert not any(_leftovers(box_id).values())
    with Box.up(Cluster.from_dict(TWO_REGIONS), box_id=box_id, scale=0.01, memory_scale=1 / 64,
                speed="quota") as box:
        layout = box.layout
        during = _leftovers(box_id)
        assert sorted(during["netns"]) == sorted([f"zbox-{box_id}"] + [f"zbox-{box_id}-{n}" for n in
                                                                      ("fast", "slow", "far")])
        assert during["cgroups"] and during["files"]
        address = {n.name: n.address for n in layout.nodes}
        for node, other in (("fast", "far"), ("far", "slow")):
            assert _run_on(box, node, f"""
                import socket
                print(socket.gethostname(), socket.gethostbyname({other!r}))""").split() == [node, address[other]]
        # TCP fast -> slow across east's bridge and fast -> far over the WAN: round trips, then bytes
        n_bytes = 300_000
        one_way = {(p.src, p.dst): p.delay_s for p in layout.pairs}
        assert (one_way[("fast", "slow")], one_way[("fast", "far")]) == pytest.approx((20e-6 / 0.01, 100e-6 / 0.01))
        for dst, n in (("slow", 0), ("far", n_bytes)):
            rtt, received = _exchange(box, "fast", dst, n)
            assert received == n
            assert min(rtt) >= one_way[("fast", dst)] + one_way[(dst, "fast")]  # the delay line never releases early
        # rates as the kernel has them, and what crossed them
        s = layout.scale.factor
        fast = {c.classid: c for c in box.node_shaping("fast")}
        nic = 25e9 / 8 * s
        assert abs(fast["1:1"].rate_bits - nic * 8) <= fast["1:1"].resolution_bits
        to_far = fast["1:11"]  # peers in node order: slow (1:10), far (1:11)
        assert abs(to_far.ceil_bits - 10e9 * s) <= to_far.resolution_bits  # the cross-datacenter pair link
        to_slow = fast["1:10"]  # guaranteed half the NIC (two peers), up to the NIC (= its pair link here)
        assert abs(to_slow.rate_bits - nic * 8 / 2) <= to_slow.resolution_bits
        assert abs(to_slow.ceil_bits - nic * 8) <= to_slow.resolution_bits
        assert to_far.rate_bits == to_far.ceil_bits  # (its pair link is below half the NIC)
        assert to_far.sent_bytes >= n_bytes and to_slow.sent_bytes < n_bytes
        to_far_port = {c.classid: c for c in box.router_shaping("n2")}
        far_in = to_far_port["1:1"]  # far's NIC, incoming
        assert abs(far_in.rate_bits - 10e9 * s) <= far_in.resolution_bits and far_in.sent_bytes >= n_bytes
        cap_in = to_far_port["1:103"]  # far-cap east -> far (shared direction 3), under the NIC: carried it
        assert cap_in.parent == "1:1" and abs(cap_in.ceil_bits - 2e9 * s) <= cap_in.resolution_bits
        assert cap_in.sent_bytes >= n_bytes
        far_out = {c.classid: c for c in box.node_shaping("far")}
        assert far_out["1:102"].parent == "1:1" and abs(far_out["1:102"].ceil_bits - 2e9 * s) <= \
            far_out["1:102"].resolution_bits  # far-cap far -> east (direction 2) on far's eth0
        assert [far_out[m].parent for m in ("1:10", "1:11")] == ["1:102", "1:102"]  # far's peers fast, slow under it
        wan = [c for c in box.router_shaping(box_net.IFB) if c.classid in ("1:10", "1:11")]
        assert [abs(c.rate_bits - 5e9 * s) <= c.resolution_bits for c in wan] == [True, True]
        assert max(c.sent_bytes for c in wan) >= n_bytes  # east -> west carried the transfer
        stats = box.delay_line_stats()
        assert stats["packets"] >= n_bytes // 1500 and stats["dropped"] == 0
        # quotas and memory limits as the kernel has them; a rank process is in its cgroup
        for n in layout.nodes:
            for r in n.ranks:
                assert box.cpu_quota(n.name, r.local_rank) == (round(r.cpu_quota_cores * layout.cpu_period_us),
                                                               layout.cpu_period_us)
                assert box.memory_limit_bytes(n.name, r.local_rank) == r.memory_limit_bytes
        cgroup = _run_on(box, "fast", "print(open('/proc/self/cgroup').read())", rank=1)
        assert f"zbox-{box_id}/fast/rank1" in cgroup
        # the slow rank's quota holds: a busy loop gets at most its quota per period (plus one period's worth)
        q = layout.node("slow").ranks[0].cpu_quota_cores
        used = json.loads(_run_on(box, "slow", """
            import json, time
            t0, c0 = time.monotonic(), time.process_time()
            while time.monotonic() - t0 < 1.0:
                pass
            print(json.dumps([time.monotonic() - t0, time.process_time() - c0]))""", rank=0))
        assert used[1] <= q * used[0] + 2 * q * layout.cpu_period_us * 1e-6 + 0.01  # (+ a scheduler tick)
        assert box.memory_peak_bytes("slow", 0) > 0
        for key, value in layout.tcp_sysctls:  # [Note: the box's TCP tuning], in every node's namespace only
            path = "/proc/sys/" + key.replace(".", "/")
            assert _run_on(box, "far", f"print(open({path!r}).read())").split() == value.split()
        delay_line = box.state.delay_line_pid
        assert _alive(delay_line)
    assert not any(_leftovers(box_id).values()), _leftovers(box_id)
    assert not _alive(delay_line)
    assert _root_links() <= links_before  # the root namespace never held a box interface


def test_exception_inside_with_removes_box(box_machine):
    box_id = _box_id("exc")
    with pytest.raises(RuntimeError, match="inside the box"):
        with Box.up(SMALL_HETERO, box_id=box_id) as box:
            sleeper = box.spawn("t4-node", ["sleep", "600"], rank=1)
            assert any(_leftovers(box_id).values()) and _alive(sleeper.pid)
            raise RuntimeError("inside the box")
    assert not any(_leftovers(box_id).values()), _leftovers(box_id)
    assert sleeper.poll() is not None


_HOLDER = """
import sys, time
from zorse_fx.box import Box
with Box.up(sys.argv[1], box_id=sys.argv[2]) as box:
    sleeper = box.spawn("t4-node", ["sleep", "600"], rank=0)
    print(box.state.delay_line_pid, sleeper.pid, flush=True)
    time.sleep(600)
"""


def _start_holder(tmp_path: Path, box_id: str) -> tuple[subprocess.Popen, list[int]]:
    """A process holding a small_hetero box with a process on t4-node; its pids (delay line, sleeper)."""
    script = tmp_path / "holder.py"
    script.write_text(_HOLDER)
    holder = subprocess.Popen([sys.executable, str(script), str(SMALL_HETERO), box_id], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    ready = select.select([holder.stdout], [], [], 120)[0]
    line = holder.stdout.readline() if ready else ""
    assert line, f"holder did not report its box: {holder.stderr.read() if holder.poll() is not None else 'timeout'}"
    pids = [int(p) for p in line.split()]
    assert all(_alive(p) for p in pids) and any(_leftovers(box_id).values())
    return holder, pids


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, None), (signal.SIGTERM, 143)])
def test_signal_to_holder_removes_box(box_machine, tmp_path, sig, status):
    """Ctrl-C (KeyboardInterrupt through the `with`) and SIGTERM (SystemExit(143)) remove the box, its
    delay line and the processes started in it."""
    box_id = _box_id(f"sig{sig}")
    holder, pids = _start_holder(tmp_path, box_id)
    holder.send_signal(sig)
    _, err = holder.communicate(timeout=60)
    if status is not None:
        assert holder.returncode == status, err
    else:
        assert "KeyboardInterrupt" in err
    assert not any(_leftovers(box_id).values()), _leftovers(box_id)
    assert not any(_alive(p) for p in pids)


# One worker runs both: `zorse box gc` removes every box whose holder is dead, so run beside [down]
# it can remove [down]'s box first (CI, stop 51: "no box 't13445_kill_down'").
@pytest.mark.xdist_group("box_gc")
@pytest.mark.parametrize("how", ["down", "gc"])
def test_sigkill_holder_then_cli_removes_box(box_machine, tmp_path, how):
    """SIGKILL leaves the box (nothing can catch it); `zorse box down <id>` or `zorse box gc` removes it."""
    box_id = _box_id(f"kill_{how}")
    holder, pids = _start_holder(tmp_path, box_id)
    holder.kill()
    holder.wait(timeout=60)  # (not communicate: the box's processes hold its pipes)
    assert any(_leftovers(box_id).values()) and all(_alive(p) for p in pids)  # outlived its holder
    argv = ["down", box_id] if how == "down" else ["gc"]
    r = subprocess.run([sys.executable, "-m", "zorse_fx.cli", "box", *argv], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert (f"box {box_id!r} removed" if how == "down" else box_id) in r.stdout
    assert not any(_leftovers(box_id).values()), _leftovers(box_id)
    assert not any(_alive(p) for p in pids)


def test_cli_box_torchrun_workers_enter_their_rank_cgroups(box_machine):
    """`zorse box up` (detached), `zorse box run` of torchrun on a100-node with each worker entering its
    local rank's cgroup through rank_enter, `zorse box down`."""
    box_id = _box_id("cli")
    zorse = [sys.executable, "-m", "zorse_fx.cli", "box"]
    try:
        up = subprocess.run([*zorse, "up", str(SMALL_HETERO), "--id", box_id], capture_output=True, text=True,
                            timeout=120)
        assert up.returncode == 0, up.stderr
        assert "a100-node" in up.stdout and "10.1.0.2" in up.stdout and f"box {box_id!r} is up" in up.stdout
        code = ("import os, socket; from zorse_fx.box.rank_enter import enter_rank_leaf; r = os.environ['LOCAL_RANK']; "
                "cg = lambda: [l for l in open('/proc/self/cgroup') if ':cpu,' in l or ':cpu:' in l or '::' in l][0]; "
                "host = cg().strip(); entered = enter_rank_leaf('gpu'); pace = os.environ.get('ZORSE_PACE'); "
                "ref = os.environ.get('ZORSE_PACE_REFERENCE'); "
                "os.write(1, f'rank {r} {socket.gethostname()} {host} {entered} {cg().strip()} {pace} {ref}\\n'"
                ".encode())")
        # (one write of one line: the two workers share torchrun's stdout, and print() under
        # PYTHONUNBUFFERED writes its pieces separately, which interleaved "rankrank 1 ..." once)
        run = subprocess.run([*zorse, "run", box_id, "--node", "a100-node", "--", sys.executable, "-m",
                              "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                              "zorse_fx.box.rank_enter", "-c", code], capture_output=True, text=True, timeout=180)
        assert run.returncode == 0, run.stderr
        lines = sorted(line.split() for line in run.stdout.splitlines() if line.startswith("rank "))
        assert [(w[1], w[2]) for w in lines] == [("0", "a100-node"), ("1", "a100-node")], run.stdout
        # each worker starts in its rank's host leaf, enter_rank_leaf (train.py's first step) moves it under its quota
        assert [(w[3].endswith(f"/zbox-{box_id}/a100-node/rank{w[1]}/host"), w[4],
                 w[5].endswith(f"/zbox-{box_id}/a100-node/rank{w[1]}/gpu")) for w in lines] == [(True, "True", True)] * 2, \
            lines
        # a paced box (the default): each worker has its rank's ZORSE_PACE, its gpu leaf no CPU quota
        box = Box.find(box_id)
        assert [float(w[6]) for w in lines] == [box.layout.pace_factor("a100-node", j) for j in (0, 1)], lines
        # ... and the box's reference probe ([Note: drift-compensated pacing]), measured when it came up
        assert box.state.pace_reference_s is not None and 0 < box.state.pace_reference_s < 1
        assert [float(w[7]) for w in lines] == [box.state.pace_reference_s] * 2, lines
        assert f"reference probe of {box.state.pace_reference_s * 1e3:.3g} ms CPU" in up.stdout
        assert box.cpu_quota("a100-node", 1)[0] is None
        # rank_enter --gpu: a benchmark under the rank's quota from its start (bench/box.py's `bench comm`)
        gpu = subprocess.run([*zorse, "run", box_id, "--node", "a100-node", "--", "env", "LOCAL_RANK=1", sys.executable,
                              "-m", "zorse_fx.box.rank_enter", "--gpu", "-c",
                              "print([l for l in open('/proc/self/cgroup') if ':cpu:' in l or ':cpu,' in l "
                              "or '::' in l][0].strip())"], capture_output=True, text=True, timeout=120)
        assert gpu.returncode == 0 and gpu.stdout.strip().endswith(f"/zbox-{box_id}/a100-node/rank1/gpu"), \
            gpu.stdout + gpu.stderr
        # `zorse box run --rank 1`: the rank's pace; without --rank none (the node's agent, e.g. torchrun)
        show = "import os; print(os.environ.get('ZORSE_PACE'), os.environ.get('ZORSE_PACE_REFERENCE'))"
        paces = [subprocess.run([*zorse, "run", box_id, "--node", "a100-node", *rank, "--", sys.executable, "-c",
                                 show], capture_output=True, text=True, timeout=120).stdout.strip()
                 for rank in (["--rank", "1"], [])]
        pace = box.layout.pace_factor("a100-node", 1)
        assert paces == [f"{pace!r} {box.state.pace_reference_s!r}", "None None"], paces
        assert _leftovers(box_id)["netns"]
    finally:
        down = subprocess.run([*zorse, "down", box_id], capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    assert not any(_leftovers(box_id).values()), _leftovers(box_id)


def test_memory_limit_option_sets_each_ranks_limit():
    layout = plan_box(Cluster.from_yaml(SMALL_HETERO), BoxOptions(box_id="x", memory_scale=0.5,
                                                                   memory_base_bytes=1 << 28), cores_available=2.0)
    limits = {r.gpu_type: r.memory_limit_bytes for n in layout.nodes for r in n.ranks}
    assert limits == {"A100-40GB": 20 * 2**30 + 2**28, "T4": 8 * 2**30 + 2**28}


def test_rank_past_its_memory_limit_is_killed_and_counted(box_machine):
    """A rank's cgroup memory limit is enforced (a process in its ``gpu`` leaf that touches 600 MiB under a
    240 MiB limit is SIGKILLed by the kernel), the kill is counted for that rank (``Box.oom_kills``: on v1 the
    kill is counted in the leaf, summed here over the rank's directory) and not for its neighbour, and the
    rank's peak is its limit (bench/box.py case (c) reads these)."""
    box_id = _box_id("oom")
    with Box.up(SMALL_HETERO, box_id=box_id, memory_scale=0.001, memory_base_bytes=200 << 20) as box:
        node = box.layout.nodes[0].name
        limit = box.memory_limit_bytes(node, 0)
        if limit is None:
            pytest.skip("no cgroup memory controller on this machine: memory limits are not enforced")
        want = round(0.001 * 40 * 2**30) + (200 << 20)  # A100-40GB: 0.001 x its memory + the base
        assert abs(limit - want) < 4096, (limit, want)  # (v1 rounds the limit to whole pages)
        p = box.spawn(node, [sys.executable, "-c", "a = bytearray(600 << 20); print('survived')"], rank=0,
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, _ = p.communicate(timeout=60)
        assert p.returncode == -signal.SIGKILL and "survived" not in out, (p.returncode, out)
        assert box.oom_kills(node, 0) == 1 and box.oom_kills(node, 1) == 0
        peak = box.memory_peak_bytes(node, 0)
        assert peak is None or peak <= limit
    assert not any(_leftovers(box_id).values()), _leftovers(box_id)
