"""The multi-node path (issue 47 item 2): plans number their ranks node by
node ([Note: ranks node by node] in zorse_fx/plan.py), ``zorse train
--nnodes N --node-rank K --master-addr HOST`` starts one node's ranks under
torchrun's static rendezvous ([Note: one zorse train per node] in
zorse_fx/runtime/launch.py), and the device check names the ``--node-rank``
each node needs (zorse_fx/runtime/device_check.py).

Layers: plan numbering, launch checks and the device check's messages are
pure functions (no process); one test runs two torchrun agents on this host
(the rank numbering of nodes with unequal process counts), one the ranks of
a plan whose stages are not in rank order (the suite's fork server); the
last runs ``zorse train`` once per node of the cluster's box (zorse_fx/box:
a network namespace per node with its host name, shaped links, a CPU quota
per rank; skipped, with the reason, where this machine cannot build one). Distributed runs equal
single-process training within ``conftest.FP32`` (float32 sums in another
order, as in test_distributed.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import (CLUSTERS, FP32, ROOT, edit_plan_json, fixed_plan, gpt3x64, reference_adamw, train_and_compare,
                      with_memory_policy, with_param_sharding)
from zorse_fx.cli import main as zorse_main
from zorse_fx.plan import Plan
from zorse_fx.runtime.device_check import DeviceMismatchError, DeviceObservation, check_devices
from zorse_fx.runtime.launch import Rendezvous, check_master_addr, job_env, node_launch, torchrun_command
from zorse_fx.runtime.preflight import LaunchError

LR, WD = 1e-3, 0.1


def _issue_shape(**kw):
    """The issue's plan shape by hand on small_hetero (GPUs 0, 1: A100s of a100-node; 2, 3: T4s of t4-node):
    stage 0 on T4 GPU 2, stage 1 on the A100s, stage 2 on T4 GPU 3."""
    return fixed_plan(gpt3x64(), ((2,), (0, 1), (3,)), ((4,), (2, 2), (4,)), num_microbatches=2, global_batch_size=8,
                      **kw)


def _ranks(plan):
    return [[g.rank for g in s.gpus] for s in plan.stages]


def _nodes(plan):
    return [(n.node_rank, n.node, n.ranks, n.gpus) for n in plan.node_ranks()]


# -- ranks node by node ------------------------------------------------------------------------------

def test_issue_plan_ranks_are_contiguous_per_node():
    """The issue's shape, stage 0 on a T4: its ranks follow the GPUs' order in
    the cluster file (A100s 0-1, T4s 2-3), not the stages', so each node's
    ranks are torchrun's; the runtime's view (roles, stages) follows."""
    plan = _issue_shape()
    assert plan.rank_order == "node"
    assert _ranks(plan) == [[2], [0, 1], [3]]
    assert _nodes(plan) == [(0, "a100-node", (0, 1), (0, 1)), (1, "t4-node", (2, 3), (2, 3))]
    assert [plan.stages_of(r) for r in range(4)] == [(1,), (1,), (0,), (2,)]
    assert [(plan.role(r).position, plan.role(r).row_start) for r in (0, 1)] == [(0, 0), (1, 2)]


def test_partly_idle_node_gets_fewer_local_ranks():
    """Only the GPUs a plan uses are numbered: a node with an idle GPU brings
    fewer local ranks (a100-node 1, t4-node 2), and node 1's start at the
    lower node's count; interleaved: a GPU group's ranks as its first stage's."""
    plan = fixed_plan(gpt3x64(), ((3, 2), (1,)), ((2, 2), (4,)), num_microbatches=2, global_batch_size=8)
    assert _ranks(plan) == [[2, 1], [0]]
    assert _nodes(plan) == [(0, "a100-node", (0,), (1,)), (1, "t4-node", (1, 2), (2, 3))]
    rdv = Rendezvous(nnodes=2, node_rank=1, master_addr="a100-node", master_port=29500)
    assert node_launch(plan, rdv).ranks == (1, 2)
    cmd = torchrun_command(2, ["--options-file", "o.json"], rendezvous=rdv)
    assert "--standalone" not in cmd
    assert cmd[cmd.index("torch.distributed.run") + 1: cmd.index("-m", 3)] == [
        "--nnodes=2", "--node-rank=1", "--master-addr=a100-node", "--master-port=29500", "--nproc-per-node=2"]
    assert torchrun_command(3, [])[3:5] == ["--standalone", "--nproc-per-node=3"]  # one host: as before
    inter = fixed_plan(gpt3x64(), ((2,), (0,), (2,), (0,)), ((4,),) * 4, num_microbatches=2, global_batch_size=8,
                       interleave=2)
    assert _ranks(inter) == [[1], [0], [1], [0]]
    assert [inter.stages_of(r) for r in (0, 1)] == [(1, 3), (0, 2)]
    assert _nodes(inter) == [(0, "a100-node", (0,), (0,)), (1, "t4-node", (1,), (2,))]


def test_node_launch_refuses_counts_that_are_not_the_plans():
    plan = _issue_shape()
    rdv = Rendezvous(nnodes=3, node_rank=0, master_addr="h", master_port=29500)
    with pytest.raises(LaunchError) as e:
        node_launch(plan, rdv, plan_path="runs/x/plan")
    assert str(e.value) == (
        "--nnodes 3 does not match runs/x/plan: its ranks run on 2 nodes ('a100-node', 't4-node'; a node the plan "
        "leaves idle takes no part); pass --nnodes 2 on each of them")
    with pytest.raises(LaunchError) as e:
        node_launch(plan, Rendezvous(nnodes=2, node_rank=1, master_addr="h", master_port=29500), 4,
                    plan_path="runs/x/plan")
    assert str(e.value) == (
        "--nproc 4 does not match runs/x/plan: node 't4-node' (--node-rank 1) runs 2 of the plan's ranks (ranks "
        "2-3); leave --nproc out (or pass --nproc 2)")


def _stage_order_file(directory: Path) -> Path:
    """``directory``'s plan.json rewritten as a format-14 file: no rank_order, ranks stage by stage."""
    def old(d):
        d["version"] = 14
        del d["rank_order"]
        rank = 0
        for s in d["stages"]:
            for g in s["gpus"]:
                g["rank"], rank = rank, rank + 1
    return edit_plan_json(directory, old)


def test_stage_order_plan_refused_for_multinode_launch(lee_bytes, tmp_path, capsys):
    """A plan of format 14 keeps its numbering stage by stage (the issue's:
    t4-node holds ranks 0 and 3): on one host it still runs (--dry-run: the
    same command as before), on two nodes ``zorse train`` refuses it in one
    line saying to re-plan, and the device check's advice for it is the same."""
    plan = _issue_shape()
    plan_dir = tmp_path / "plan"
    plan.export(plan_dir)
    torch.save(gpt3x64().state(), plan_dir / "weights.pt")
    torch.save(lee_bytes[:4096], tmp_path / "tokens.pt")
    _stage_order_file(plan_dir)
    old = Plan.load(plan_dir)
    assert old.rank_order == "stage" and _ranks(old) == [[0], [1, 2], [3]]
    assert [(n.node, n.ranks, n.contiguous) for n in old.node_ranks()] == [
        ("t4-node", (0, 3), False), ("a100-node", (1, 2), True)]
    common = ["train", str(plan_dir), "--tokens", str(tmp_path / "tokens.pt"), "--out", str(tmp_path / "run"),
              "--dry-run"]
    assert zorse_main(common) == 0
    assert " --standalone --nproc-per-node=4 " in capsys.readouterr().out
    assert zorse_main([*common, "--nnodes", "2", "--node-rank", "0", "--master-addr", "t4-node"]) == 1
    assert capsys.readouterr().err == (
        f"zorse: {plan_dir} numbers its ranks stage by stage (rank_order 'stage', a plan of format 14 or older): node "
        f"'t4-node' has ranks 0, 3, but torchrun numbers the ranks of a node consecutively, so it cannot run on 2 "
        f"nodes; re-plan with `zorse plan` (ranks numbered node by node), or run it on one host without --nnodes\n")
    with pytest.raises(DeviceMismatchError) as e:
        check_devices(old, [DeviceObservation(rank=r, host=h, device_type="cpu", node_rank=r // 2)
                            for r, h in enumerate(["t4-node", "t4-node", "a100-node", "a100-node"])])
    assert str(e.value) == (
        "rank 1 (stage 1) runs on host 't4-node', but the plan assigned it GPU 0 (A100-40GB) on node 'a100-node'; "
        "host 't4-node' was started with --node-rank 0; this plan numbers its ranks stage by stage (rank_order 'stage', made before format 15): node 't4-node' has ranks 0, 3, which "
        "torchrun cannot start on one node; re-plan with `zorse plan` (ranks node by node) to run on several nodes, "
        "or run it on one host; --skip-device-check runs anyway")
    # Where its ranks belong (one host per planned node, which no torchrun start gives it) it would pass.
    hosts = ["t4-node", "a100-node", "a100-node", "t4-node"]
    assert check_devices(old, [DeviceObservation(rank=r, host=h, device_type="cpu") for r, h in enumerate(hosts)]
                         ).skipped == ("GPU name and memory: ranks 0, 1, 2, 3 run on the CPU (no GPU to compare with "
                                       "the plan's)",)


def test_device_check_names_each_nodes_node_rank():
    """The issue's shape with node names as host names, the nodes started in
    the wrong order: rank 0 lands on t4-node. The message names the rank, its
    host, the --node-rank that host was started with (torchrun's GROUP_RANK)
    and each node's --node-rank and process count; started that way every
    rank is on its planned node."""
    plan = _issue_shape()
    a100, t4 = ("NVIDIA A100-SXM4-40GB", 39.4), ("Tesla T4", 14.7)

    def gpu(rank, host, name, gib, node_rank):
        return DeviceObservation(rank=rank, host=host, node_rank=node_rank, device_type="cuda", gpu_name=name,
                                 memory_bytes=int(gib * 2**30))

    advice = ("0 on 'a100-node' (2 processes: ranks 0-1), 1 on 't4-node' (2 processes: ranks 2-3), the plan's nodes "
              "in the cluster file's order (`zorse train --nnodes 2 --node-rank K --master-addr HOST` on node K starts "
              "its processes; torchrun: --nproc-per-node)")
    swapped = [DeviceObservation(rank=r, host=h, device_type="cpu", node_rank=r // 2)
               for r, h in enumerate(["t4-node", "t4-node", "a100-node", "a100-node"])]
    with pytest.raises(DeviceMismatchError) as e:
        check_devices(plan, swapped)
    assert e.value.rank == 0
    assert str(e.value) == (
        "rank 0 (stage 1) runs on host 't4-node', but the plan assigned it GPU 0 (A100-40GB) on node 'a100-node'; "
        f"host 't4-node' was started with --node-rank 0, which is the plan's node 'a100-node'; start each node with "
        f"its --node-rank: {advice}; --skip-device-check runs anyway")
    with pytest.raises(DeviceMismatchError) as e:  # on GPUs the GPU type names it first
        check_devices(plan, [gpu(0, "t4-node", *t4, 0), gpu(1, "t4-node", *t4, 0), gpu(2, "a100-node", *a100, 1),
                             gpu(3, "a100-node", *a100, 1)])
    assert str(e.value).endswith(f"CUDA_VISIBLE_DEVICES listing the node's planned GPUs in the cluster file's "
                                 f"order: {advice}, or plan for these GPUs (`zorse plan --cluster ...`); "
                                 f"--skip-device-check runs anyway")
    right = [gpu(0, "a100-node", *a100, 0), gpu(1, "a100-node", *a100, 0), gpu(2, "t4-node", *t4, 1),
             gpu(3, "t4-node.cluster", *t4, 1)]
    assert check_devices(plan, right).skipped == ()


def test_node_host_checked_before_torchrun():
    """``check_node_host`` (``zorse train --nnodes N --node-rank K``, before torchrun starts): a host named
    after one of the plan's nodes must be started as that node; a host named after none of them (node names
    that are not host names) is left to the ranks' check."""
    from zorse_fx.runtime.device_check import check_node_host

    plan = _issue_shape()
    check_node_host(plan, 0, host="a100-node")
    check_node_host(plan, 1, host="t4-node.cluster")  # (the short name is compared)
    check_node_host(plan, 0, host="worker-17")
    with pytest.raises(DeviceMismatchError) as e:
        check_node_host(plan, 0, host="t4-node")
    assert str(e.value).startswith(
        "host 't4-node' is the plan's node 't4-node' (--node-rank 1), but it was started with --node-rank 0, which "
        "is the plan's node 'a100-node'; start each node with its --node-rank: 0 on 'a100-node' (2 processes: "
        "ranks 0-1), 1 on 't4-node' (2 processes: ranks 2-3)")


# -- the flags ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("flags", "message"), [
    (["--node-rank", "1"], "--node-rank 1 applies to a multi-node job only (--nnodes 2 or more), so it would not "
                           "take effect: add --nnodes N, or drop --node-rank"),
    (["--master-addr", "h"], "--master-addr h applies to a multi-node job only (--nnodes 2 or more), so it would not "
                             "take effect: add --nnodes N, or drop --master-addr"),
    (["--nnodes", "0"], "--nnodes must be >= 1, got 0"),
    (["--nnodes", "2", "--master-addr", "h"], "--nnodes 2 needs --node-rank K, this node's place among the plan's "
                                              "nodes in the cluster file's order, 0..1"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h"],
     "--nnodes 2 needs --node-rank K, this node's place among the plan's nodes in the cluster file's order, 0..1, "
     "got 2"),
    (["--nnodes", "2", "--node-rank", "0"], "--nnodes 2 needs --master-addr HOST: the host name or address of node 0 "
                                            "(--node-rank 0), where the nodes meet"),
    (["--nnodes", "2", "--node-rank", "0", "--master-addr", "h", "--master-port", "70000"],
     "--master-port must be a TCP port, 1..65535, got 70000"),
    (["--nnodes", "2", "--node-rank", "0", "--master-addr", "h", "--max-restarts", "1"],
     "--max-restarts 1 does not work across nodes (--nnodes 2): torchrun's static rendezvous restarts one node's "
     "workers without the others'; drop --max-restarts, or run on one node"),
])
def test_multinode_flags_refused_naming_the_flag(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        zorse_main(["train", str(tmp_path / "plan"), "--data", "x.bin", "--out", str(tmp_path / "run"), *flags])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"zorse train: error: {message}"


def test_corpus_on_several_nodes_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        zorse_main(["train", str(tmp_path / "plan"), "--corpus", "lee", "--out", str(tmp_path / "run"), "--nnodes",
                    "2", "--node-rank", "1", "--master-addr", "h"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "zorse train: error: --corpus lee does not work across nodes (--nnodes 2): every node would tokenize into "
        "the same <out>/data/tokens.bin; prepare the token file once with `zorse prepare-data` and pass --data on "
        "each node; drop --corpus, or run on one node")


def test_dry_run_starts_each_node_with_its_own_count(lee_bytes, tmp_path, capsys):
    """--dry-run on node 1 of a plan whose nodes run 1 and 2 ranks: the node's
    ranks and every node's --node-rank said, torchrun's static rendezvous
    with that node's count (not --standalone)."""
    plan = fixed_plan(gpt3x64(), ((0,), (2, 3)), ((4,), (2, 2)), num_microbatches=2, global_batch_size=8)
    plan.export(tmp_path / "plan")
    torch.save(gpt3x64().state(), tmp_path / "plan" / "weights.pt")
    torch.save(lee_bytes[:4096], tmp_path / "tokens.pt")
    assert zorse_main(["train", str(tmp_path / "plan"), "--tokens", str(tmp_path / "tokens.pt"), "--out",
                       str(tmp_path / "run"), "--nnodes", "2", "--node-rank", "1", "--master-addr", "localhost",
                       "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("[zorse] node 1 of 2 ('t4-node'): ranks 1-2 of 3; the plan's nodes: --node-rank 0 "
                        "'a100-node' (rank 0), --node-rank 1 't4-node' (ranks 1-2)")
    assert " -m torch.distributed.run --nnodes=2 --node-rank=1 --master-addr=localhost --master-port=29500 " \
           "--nproc-per-node=2 " in lines[1]


def test_master_addr_that_cannot_work_said_before_waiting():
    """torchrun's static rendezvous waits up to 10 minutes for the nodes; what
    this host can tell is said first: a --master-addr that does not resolve
    here is refused, and node 0 (which serves the rendezvous) is warned where
    it is none of its addresses."""
    def rdv(addr, k):
        return Rendezvous(nnodes=2, node_rank=k, master_addr=addr, master_port=29500)

    with pytest.raises(LaunchError, match=r"^--master-addr node0\.invalid does not resolve on this host \(.*\); give "
                                          r"the host name or address of node 0 \(--node-rank 0\) as this node reaches "
                                          r"it$"):
        check_master_addr(rdv("node0.invalid", 1))
    assert check_master_addr(rdv("127.0.0.1", 0)) is None
    assert check_master_addr(rdv("192.0.2.1", 1)) is None  # (another node's address: nothing to tell here)
    assert check_master_addr(rdv("192.0.2.1", 0)) == (  # TEST-NET-1: never this host's
        f"--master-addr 192.0.2.1 (192.0.2.1) is not an address of this host ({socket.gethostname()}), where "
        f"--node-rank 0 serves the rendezvous: the nodes meet only if it forwards here; else start --node-rank 0 on "
        f"192.0.2.1, or pass this host as --master-addr on every node")


def test_node_supervises_only_its_own_ranks(tmp_path):
    """On a shared --out a node's launcher clears and watches its own ranks'
    heartbeats and error records only: another node's beat (its pid means
    nothing on this host, here a live one) is never taken for a stall, nor
    its record removed; c10d's own log lines stay off the terminal."""
    import io

    from zorse_fx.runtime.launch import _TorchrunFilter
    from zorse_fx.runtime.rank_errors import clear_rank_errors, logs_dir
    from zorse_fx.runtime.watchdog import stalled_rank

    beats = tmp_path / ".heartbeat"
    beats.mkdir()
    for r in (0, 2):  # rank 0 (node 0) beat 100 s ago, under a pid alive here
        (beats / f"rank{r}").write_text(json.dumps({"rank": r, "pid": os.getpid(), "time": 0.0 if r == 0 else 95.0}))
    assert stalled_rank(beats, 30, now=100.0).rank == 0
    assert stalled_rank(beats, 30, now=100.0, ranks=(2, 3)) is None
    logs_dir(tmp_path).mkdir(parents=True)
    for r in range(4):
        (logs_dir(tmp_path) / f"rank{r}.error.json").write_text("{}")
    clear_rank_errors(tmp_path, ranks=(2, 3))
    assert sorted(p.name for p in logs_dir(tmp_path).iterdir()) == ["rank0.error.json", "rank1.error.json"]
    line = "[W1206 07:10:41.468072081 socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved.\n"
    sink = io.StringIO()
    _TorchrunFilter(io.StringIO(line + "[zorse] step 1\n"), tmp_path / "t.log", sink).close()
    assert sink.getvalue() == "[zorse] step 1\n" and (tmp_path / "t.log").read_text().startswith(line)


# -- torchrun's numbering and the runtime under it ----------------------------------------------------

_PRINT_RANKS = "import os; print('ranks', os.environ['GROUP_RANK'], os.environ['RANK'], os.environ['LOCAL_RANK'])"


def test_torchrun_numbers_unequal_nodes_cumulatively(tmp_path, monkeypatch):
    """Two torchrun agents on this host as nodes 0 and 1 of a static
    rendezvous, with 1 and 2 processes (zorse train's torchrun flags and
    environment): node 1's local ranks 0, 1 are global ranks 1, 2, the sum of
    the lower node's count on ([Note: ranks node by node]), even where the
    user's environment asks torchrun for node_rank x its own count
    (TORCH_ELASTIC_WORKER_IDENTICAL=1, which job_env drops)."""
    from torch.distributed import TCPStore

    script = tmp_path / "ranks.py"
    script.write_text(_PRINT_RANKS + "\n")
    port_holder = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = port_holder.port
    del port_holder  # (a free port the kernel chose; agent 0 serves its store there)
    monkeypatch.setenv("TORCH_ELASTIC_WORKER_IDENTICAL", "1")
    env = job_env()
    assert "TORCH_ELASTIC_WORKER_IDENTICAL" not in env
    procs = []
    for k, n in ((0, 1), (1, 2)):
        cmd = torchrun_command(n, [], rendezvous=Rendezvous(nnodes=2, node_rank=k, master_addr="127.0.0.1",
                                                            master_port=port))
        cmd = [*cmd[: cmd.index("-m", 3)], str(script)]  # a script printing its ranks instead of zorse_fx.train
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    seen = sorted(tuple(map(int, m)) for o in outs for m in re.findall(r"^ranks (\d+) (\d+) (\d+)$", o, re.M))
    assert seen == [(0, 0, 0), (1, 1, 0), (1, 2, 1)]  # (node, global rank, local rank)


def test_stages_out_of_rank_order_with_zero3_equal_single_process(lee_bytes, tmp_path):
    """Node-major ranks put a stage's GPUs out of rank order: stage 0 on T4 GPU
    3 (rank 2), stage 1 on GPUs 2 and 0 (ranks 1 and 0: position 0 is rank 1).
    With ZeRO-3 on stage 1 (unequal shards 3:1: its reduce-scatters and
    all-gathers address the group by rank, not by position) the run equals
    single-process training (losses, step-1 gradients, parameters after 2
    steps)."""
    captured = gpt3x64()
    plan = fixed_plan(captured, ((3,), (2, 0)), ((4,), (3, 1)), num_microbatches=2, global_batch_size=8,
                      bucket_mib=0.05)
    plan = with_param_sharding(with_memory_policy(plan, sharded={1}, shard_bytes={1: (3 * 2**20, 2**20)}))
    assert _ranks(plan) == [[2], [1, 0]] and plan.stages[1].param_sharded
    train_and_compare(plan, captured, lee_bytes, tmp_path, steps=2, lr=LR, weight_decay=WD)


# -- two nodes of a box ------------------------------------------------------------------------------
#
# [Note: the multi-node test's box]
# The last test runs `zorse train` once per node of small_hetero.yaml's box (zorse_fx/box, [Note: the
# box]): a network namespace per node with the node's host name and the box's /etc/hosts (Gloo binds to
# the address of its host name; --master-addr is a host name), each node's NIC shaped with htb, the
# inter-node latency through the delay line, the links scaled so that communication-to-compute ratios
# are the cluster's. torchrun's workers enter their ranks' host leaves (rank_enter) and, at the first
# training step, their gpu leaves: each rank trains under its GPU type's CPU quota ([Note: host and GPU
# leaves] in zorse_fx/box/cgroups.py). Skipped, with the reason, where this machine cannot build a box.

_NODES = ("a100-node", "t4-node")


@pytest.fixture
def box_machine():
    """Skip (with the reason) where this machine cannot build a box; else remove boxes of dead tests."""
    from zorse_fx.box import check_machine, gc

    reason = check_machine()
    if reason:
        pytest.skip(f"zorse box cannot run here: {reason}")
    gc()


def _zorse_on_nodes(box, starts, *, timeout_s: float = 240) -> list[tuple[int, str]]:
    """Run ``zorse train`` with each ``starts[k]`` (argv after ``train``) on node ``_NODES[k]`` of ``box``, all
    at once; returns (exit status, output) per node. On timeout every node's ``zorse train`` gets SIGINT (it
    stops its job: [Note: stopping a job]) and the test fails."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    procs = [box.spawn(node, [sys.executable, "-m", "zorse_fx.cli", "train", *argv], env=env, cwd=ROOT,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node, argv in zip(_NODES, starts)]
    try:
        outs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
                try:
                    p.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.communicate()
    return [(p.returncode, o) for p, o in zip(procs, outs)]


def _node_args(plan_dir, tokens, out, k, *, node_rank=None, steps=2, master="a100-node"):
    return [str(plan_dir), "--tokens", str(tokens), "--steps", str(steps), "--out", str(out), "--precision", "fp32",
            "--lr", str(LR), "--weight-decay", str(WD), "--nnodes", "2", "--node-rank",
            str(k if node_rank is None else node_rank), "--master-addr", master]


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _reference(plan_dir: Path, captured, tokens, steps: int) -> list[float]:
    """Single-process training of ``captured`` from the plan's weights.pt (``reference_adamw``, fp32)."""
    weights = torch.load(plan_dir / "weights.pt")
    for name, t in captured.state().items():
        t.copy_(weights[name])
    return reference_adamw(captured, tokens, Plan.load(plan_dir), steps, lr=LR, weight_decay=WD)[0]


def test_small_hetero_plan_on_its_box_refuses_a_wrong_node_rank_then_trains(box_machine, lee_bytes, tmp_path):
    """The issue's plan (`zorse plan --model gpt --cluster small_hetero.yaml
    --global-batch-size 8 --seq-len 32 --use-all-gpus`) on its own cluster:
    a100-node and t4-node as two nodes of its box ([Note: the multi-node test's box]): shaped NICs, the
    scaled inter-node latency, each rank's compute paced to its GPU type's speed (ZORSE_PACE, [Note: paced
    compute] in zorse_fx/pacing.py).

    Started with each other's --node-rank (a host list in the wrong order:
    t4-node first, so node 0 and --master-addr), both nodes' `zorse train` exit 1
    before starting torchrun, with one line naming the host, the plan's node it is,
    the --node-rank it was started with and each node's right one
    (``device_check.check_node_host``; the ranks' own check of real hosts is the
    one that passes below, its refusals are tests/test_error_lines.py's). Started as that line says
    (`zorse train --nnodes 2 --node-rank K --master-addr a100-node` in each at
    once), the device check sees every rank on its planned node (not
    skipped), and the 2 steps' losses equal single-process training (FP32);
    nothing of the box is left (test_box.py). (Unequal per-node counts:
    test_torchrun_numbers_unequal_nodes_cumulatively; one host against several:
    the same ranks and plan, so the same arithmetic.)"""
    import re

    from zorse_fx.capture import capture
    from zorse_fx.models.registry import load_model

    plan_dir = tmp_path / "plan"
    assert zorse_main(["plan", "--model", "gpt", "--cluster", str(CLUSTERS / "small_hetero.yaml"),
                       "--global-batch-size", "8", "--seq-len", "32", "--use-all-gpus", "-o", str(plan_dir)]) == 0
    plan = Plan.load(plan_dir)
    assert _nodes(plan) == [(0, "a100-node", (0, 1), (0, 1)), (1, "t4-node", (2, 3), (2, 3))]
    tokens = tmp_path / "tokens.pt"
    torch.save(lee_bytes[:20000], tokens)
    from zorse_fx.box import Box

    # scale 0.01 (25 GbE -> 31 MB/s, 20 us -> 2 ms through the delay line), not the ratio-keeping 3.8e-4 (1.2 MB/s,
    # 53 ms): every link still shaped and delayed, and the test 42 -> 33 s alone (rendezvous is round trips)
    with Box.up(CLUSTERS / "small_hetero.yaml", box_id=f"mn{os.getpid()}", scale=0.01) as box:
        wrong = _zorse_on_nodes(box, [_node_args(plan_dir, tokens, tmp_path / "bad", k, node_rank=1 - k,
                                                 master="t4-node") for k in range(2)])
        done = _zorse_on_nodes(box, [_node_args(plan_dir, tokens, tmp_path / "run", k) for k in range(2)])
        paces = [box.layout.pace_factor(node, j) for node in _NODES for j in range(2)]
        reference = box.state.pace_reference_s
    assert paces[0] < paces[2]  # (an A100 rank computes faster than a T4's)
    advice = re.escape(
        "start each node "
        "with its --node-rank: 0 on 'a100-node' (2 processes: ranks 0-1), 1 on 't4-node' (2 processes: ranks 2-3), "
        "the plan's nodes in the cluster file's order (`zorse train --nnodes 2 --node-rank K --master-addr HOST` "
        "on node K starts its processes; torchrun: --nproc-per-node); --skip-device-check runs anyway")
    for (rc, out), (host, started, planned) in zip(wrong, [("a100-node", 1, "t4-node"), ("t4-node", 0, "a100-node")]):
        # each node refuses on its own, before torchrun: no rank started, no rendezvous waited for
        assert rc == 1, out[-3000:]
        lines = [ln for ln in out.splitlines() if ln.startswith("zorse: ")]
        line = (f"zorse: host '{host}' is the plan's node '{host}' (--node-rank {1 - started}), but it was started "
                f"with --node-rank {started}, which is the plan's node '{planned}'; ")
        assert len(lines) == 1 and re.fullmatch(re.escape(line) + advice, lines[0]), out[-3000:]
        assert "torch.distributed.run" not in out, out[-3000:]
    assert [rc for rc, _ in done] == [0, 0], "\n".join(o[-3000:] for _, o in done)
    out0 = done[0][1]
    assert "[zorse] node 0 of 2 ('a100-node'): ranks 0-1 of 4" in out0
    assert "--nnodes=2 --node-rank=0 --master-addr=a100-node --master-port=29500 --nproc-per-node=2" in out0
    assert f"[zorse] box mn{os.getpid()}: ranks compute at their GPU types' speed (paced: ZORSE_PACE = " \
           f"{paces[0]:.3g} on rank 0, in units of a {reference * 1e3:.3g} ms reference probe)" in out0
    skipped = next(line for line in out0.splitlines() if line.startswith("[zorse] device check skipped"))
    assert "GPU name and memory" in skipped and "nodes:" not in skipped  # the hosts were compared
    model, _ = load_model("gpt")
    ids = torch.randint(0, 200, (2, 32))
    ref = _reference(plan_dir, capture(model, (ids, ids)), lee_bytes[:20000], 2)
    assert _losses(tmp_path / "run") == pytest.approx(ref, rel=FP32.loss_rel)
