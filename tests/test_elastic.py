"""``zorse train --elastic`` (zorse_fx/elastic.py): a rank lost for good makes
the launcher re-plan for the GPUs that remain and resume on them.

The end-to-end test runs the real CLI, torchrun and Gloo ranks: 4 ranks, one
of which SIGKILLs itself from step 3 on (``--fail-rank``, in every attempt:
after a torchrun restart too), after the step-2 checkpoint; the job then
finishes on a 3-GPU plan, and the 4 steps equal single-process training to
``conftest.FP32`` (fp32 sums in another order: the same tolerance as every
distributed-vs-single-process test, test_distributed.py). The other tests
need no torchrun job.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import FP32, ROOT, assert_params_match, reference_adamw
from zorse_fx.cli import main as zorse_main
from zorse_fx.cluster import Cluster
from zorse_fx.elastic import PLAN_REQUEST, PlanRequest, RankFailure, failed_ranks, lost_rank, reduced_cluster
from zorse_fx.plan import Plan
from zorse_fx.runtime.lr_schedule import LRSchedule
from zorse_fx.runtime.rank_errors import stopped_pids

LR, WD = 1e-3, 0.1

FOUR = """name: four
nodes:
  - name: n0
    gpus: [{type: T4, count: 2}]
  - name: n1
    gpus: [{type: T4, count: 1}]
  - name: n2
    gpus: [{type: T4, count: 1}]
links:
  intra_node: {bandwidth_GBps: 16, latency_us: 10}
  inter_node: {bandwidth_GBps: 3.125, latency_us: 20}
"""


def _plan(tmp_path: Path, cluster_text: str, batch: int, *extra: str, precision: str = "fp32") -> Path:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(cluster_text)
    assert zorse_main(["plan", "--model", "gpt", "--cluster", str(cluster), "--global-batch-size", str(batch),
                       "--seq-len", "32", "--planner", "stage_dp", "--precision", precision, *extra,
                       "-o", str(tmp_path / "plan")]) == 0
    return tmp_path / "plan"


def _torchrun_report(root: tuple[int, int], *others: tuple[int, int]) -> str:
    """torchrun's ChildFailedError text (torch 2.13) naming ``root`` (rank, exit code) and ``others``."""
    def entry(i, rank, code):
        sig = f"  ({'SIGKILL' if code == -9 else 'SIGTERM'})" if code < 0 else ""
        return (f"[{i}]:\n  time      : 2026-12-02_03:09:40\n  host      : localhost\n  rank      : {rank} "
                f"(local_rank: {rank})\n  exitcode  : {code} (pid: {1000 + rank}){sig}\n  error_file: <N/A>\n"
                f"  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n")
    failures = "".join(entry(i + 1, r, c) for i, (r, c) in enumerate(others)) or "  <NO_OTHER_FAILURES>\n"
    return ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n" + "=" * 55 + "\n"
            "zorse_fx.train FAILED\n" + "-" * 55 + f"\nFailures:\n{failures}" + "-" * 55 + "\n"
            f"Root Cause (first observed failure):\n{entry(0, *root)}" + "=" * 55 + "\n")


@pytest.mark.xdist_group("elastic")
def test_elastic_4_ranks_lose_one_finish_on_3_equal_to_single_process(lee_bytes, tmp_path):
    """4-GPU plan (stage_dp, every GPU used); the rank alone on its node fails
    from step 3 on (checkpoint at step 2); --elastic
    drops that node, writes <out>/plan.elastic1 for the 3 GPUs left, resumes from
    step_2 on 3 ranks and finishes: steps 1-4 (2 on 4 ranks, 2 on 3) equal
    single-process AdamW from the same weights, losses and final parameters."""
    plan_dir = _plan(tmp_path, FOUR, 12, "--use-all-gpus")
    plan = Plan.load(plan_dir)
    assert plan.world_size == 4
    lost = next(g for s in plan.stages for g in s.gpus if g.node in ("n1", "n2"))  # its node's only GPU
    torch.save(lee_bytes, tmp_path / "tokens.pt")
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "zorse_fx.cli", "train", str(plan_dir), "--tokens", str(tmp_path / "tokens.pt"),
         "--steps", "4", "--out", str(run), "--lr", str(LR), "--weight-decay", str(WD), "--warmup-steps", "2",
         "--checkpoint-every", "2", "--fail-rank", f"{lost.rank}:3", "--elastic",
         "--dump-params"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert (f"[zorse] elastic: rank {lost.rank} (GPU {lost.gpu}, T4 on node {lost.node!r}) failed for good "
            f"(killed by SIGKILL)") in out
    assert f"dropped node {lost.node!r} (its only GPU: GPU {lost.gpu} T4)" in out
    assert "[zorse] elastic: GPUs 4 GPUs; " in out and "stages 2 stages on 4 GPUs" in out
    assert "predicted step time" in out
    assert f"resumed from {run / 'checkpoints' / 'step_2'} (step 2, written on 4 ranks, now 3)" in out
    new_dir = run / "plan.elastic1"  # [Note: where re-plans go]: under the run directory
    new = Plan.load(new_dir)
    assert new.world_size == 3 and lost.node not in {g.node for s in new.stages for g in s.gpus}
    request = PlanRequest.read(new_dir)
    assert [n["name"] for n in request.cluster["nodes"]] == [n for n in ("n0", "n1", "n2") if n != lost.node]
    assert (request.model, request.global_batch_size, request.seq_len) == ("gpt", 12, 32)
    assert Plan.load(plan_dir).world_size == 4  # the old plan stays as it was

    from zorse_fx.capture import capture
    from zorse_fx.models.registry import load_model

    model, _ = load_model("gpt")
    captured = capture(model, (torch.zeros(2, 32, dtype=torch.long),) * 2)
    weights = torch.load(plan_dir / "weights.pt")
    assert captured.state().keys() == weights.keys()
    assert all(torch.equal(v, weights[k]) for k, v in captured.state().items())  # the plan's initial weights
    initial = {k: v.clone() for k, v in weights.items()}
    sched = LRSchedule(name="constant", lr=LR, warmup_steps=2, total_steps=4)
    ref_losses, _, ref_params = reference_adamw(captured, lee_bytes, plan, 4, lr=LR, weight_decay=WD, lr_at=sched)
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [len(r["ranks"]) for r in rows] == [4, 4, 3, 3]
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=FP32.loss_rel)
    params = {r: torch.load(run / "params" / f"rank{r}.pt") for r in range(3)}
    assert_params_match(params, ref_params, initial, 4, LR, FP32)


@pytest.fixture(scope="module")
def two_small(tmp_path_factory):
    """A plan of the registry GPT on two T4s of 12 MiB each: its training state
    (16 B x 0.86M parameters, 13.7 MB) fits in two, not in one (0.9 x 12.9 MB)."""
    d = tmp_path_factory.mktemp("two_small")
    plan_dir = _plan(d, "name: two-small\nnodes:\n"
                        "  - name: n0\n    gpus: [{type: T4, count: 1, memory_GiB: 0.012}]\n"
                        "  - name: n1\n    gpus: [{type: T4, count: 1, memory_GiB: 0.012}]\n"
                        "links:\n  inter_node: {bandwidth_GBps: 3.125, latency_us: 20}\n", 4)
    assert Plan.load(plan_dir).world_size == 2
    torch.save(torch.randint(0, 256, (4000,)), d / "tokens.pt")
    return plan_dir, d / "tokens.pt"


def _fail_job(report: str):
    from zorse_fx.runtime.launch import JobFailedError

    def launch(nproc, train_argv, **kw):
        assert kw["stderr_tail_chars"] > 0
        raise JobFailedError("torchrun exited with status 1", 1, None, report)
    return launch


def _two_small_text(host_memory_gib: float | None) -> str:
    host = f"    host_memory_GiB: {host_memory_gib}\n" if host_memory_gib is not None else ""
    return ("name: two-small\nnodes:\n"
            f"  - name: n0\n{host}    gpus: [{{type: T4, count: 1, memory_GiB: 0.012}}]\n"
            f"  - name: n1\n{host}    gpus: [{{type: T4, count: 1, memory_GiB: 0.012}}]\n"
            "links:\n  inter_node: {bandwidth_GBps: 3.125, latency_us: 20}\n")


@pytest.fixture(scope="module")
def two_small_host(tmp_path_factory):
    """two_small's cluster with 1 GiB of host memory per node, planned in the
    default precision (fp16-mixed on T4s): the one GPU left after losing the
    other holds the model only with its optimizer in host memory (offload)."""
    d = tmp_path_factory.mktemp("two_small_host")
    plan_dir = _plan(d, _two_small_text(1), 4, precision="auto")
    plan = Plan.load(plan_dir)
    assert plan.world_size == 2 and plan.precision == "fp16-mixed"
    torch.save(torch.randint(0, 256, (4000,)), d / "tokens.pt")
    return plan_dir, d / "tokens.pt"


def _fail_once(report: str, launched: list):
    """A fake ``launch``: the first job fails with torchrun's ``report``, the next ones finish."""
    from zorse_fx.runtime.launch import JobFailedError
    from zorse_fx.train_options import read_options_file

    def launch(nproc, train_argv, **kw):
        launched.append((nproc, read_options_file(train_argv[1])))
        if len(launched) == 1:
            raise JobFailedError("torchrun exited with status 1", 1, None, report)
    return launch


@pytest.mark.parametrize("host_memory_gib", [None, 0.001])
def test_elastic_no_plan_for_remaining_gpus_one_line(tmp_path, monkeypatch, capsys, host_memory_gib):
    """Rank 1 of the 2-GPU plan lost (torchrun's report, the job faked): no
    plan fits the one T4 left, without host memory or with too little to
    offload its optimizer to; zorse train --elastic exits 1 with one line
    naming the lost rank and GPU, the GPUs left, the planner's binding
    constraint (never a plan-format error of a plan it could not build) and
    what to do; no re-plan directory is left behind."""
    plan_dir = _plan(tmp_path, _two_small_text(host_memory_gib), 4)
    tokens = tmp_path / "tokens.pt"
    torch.save(torch.randint(0, 256, (4000,)), tokens)
    monkeypatch.setattr("zorse_fx.runtime.launch.launch", _fail_job(_torchrun_report((1, -9), (0, -15))))
    out = tmp_path / "r"
    code = zorse_main(["train", str(plan_dir), "--tokens", str(tokens), "--steps", "4", "--out", str(out),
                       "--elastic"])
    err = capsys.readouterr().err
    assert code == 1
    (line,) = err.strip().splitlines()
    assert line.startswith("zorse: --elastic: no plan of gpt (global batch 4, seq len 32) fits the 1 GPU that "
                           "remains (1 GPU; n0: T4 ") and (" after rank 1 (GPU 1, T4 on node 'n1') failed for good "
                                                            "(killed by SIGKILL): ") in line, line
    assert "fits memory" in line and "predicted_memory" not in line and "plan:" not in line, line
    assert line.endswith(f"; make a plan for GPUs that fit (`zorse plan --cluster FILE ...`) and start anew (no "
                         f"intact checkpoint in {out / 'checkpoints'}): `zorse train <that plan> --overwrite --out "
                         f"{out} ...`"), line
    assert not list(out.glob("plan.elastic*")) and not plan_dir.with_name("plan.elastic1").exists()


def test_elastic_replan_offloads_instead_of_a_plan_format_error(two_small_host, tmp_path, monkeypatch, capsys):
    """Issue 46 case: losing a GPU of a cluster with host memory ended in
    "zorse: --elastic: no plan ... fits ...: plan: field
    stages[0].gpus[0].predicted_memory sums to ... but predicted_memory_bytes
    is ...": the planner had priced the replicated offloaded stage's matmul
    weights as 16-bit working weights with their float32 masters in host
    memory, which only a sharded stage of two or more GPUs has, so its
    prediction was less than the float32 weights and gradients the runtime
    keeps on the GPU ([Note: optimizer offload] in runtime/optimizer.py) and
    the plan's memory breakdown could not add up. Now the re-plan is the
    planner's answer: the GPU left, its optimizer offloaded, its prediction
    holding those 10 B per parameter (fp16-mixed: float32 weight, its 16-bit
    autocast copy, float32 gradient) and the activations; the run goes on."""
    plan_dir, tokens = two_small_host
    launched = []
    monkeypatch.setattr("zorse_fx.runtime.launch.launch", _fail_once(_torchrun_report((1, -9), (0, -15)), launched))
    out = tmp_path / "r"
    assert zorse_main(["train", str(plan_dir), "--tokens", str(tokens), "--steps", "4", "--out", str(out),
                       "--elastic"]) == 0, capsys.readouterr().err
    assert [n for n, _ in launched] == [2, 1]
    new = Plan.load(out / "plan.elastic1")
    (stage,) = new.stages
    (gpu,) = stage.gpus
    assert stage.offload_optimizer and not stage.sharded and new.precision == "fp16-mixed"
    n, mem = stage.num_parameters, gpu.predicted_memory
    assert (mem.weights_bytes, mem.gradients_bytes, mem.optimizer_bytes) == (6 * n, 4 * n, 0)
    assert mem.total_bytes == gpu.predicted_memory_bytes and mem.activations_bytes > 0
    assert gpu.predicted_memory_bytes <= 0.9 * gpu.memory_capacity_bytes
    assert gpu.predicted_host_memory_bytes >= 12 * n  # AdamW's moments and a float32 copy per parameter


def _elastic_run(plan_dir: Path, tokens: Path, out: Path, monkeypatch) -> list:
    """`zorse train --elastic` of ``plan_dir`` into ``out`` whose first job loses rank 1 (SIGKILL, torchrun's
    report; the jobs faked, the re-plan real); returns the launches' (nproc, options)."""
    launched = []
    with monkeypatch.context() as m:
        m.setattr("zorse_fx.runtime.launch.launch", _fail_once(_torchrun_report((1, -9), (0, -15)), launched))
        assert zorse_main(["train", str(plan_dir), "--tokens", str(tokens), "--steps", "4", "--out", str(out),
                           "--elastic"]) == 0
    return launched


def test_elastic_replans_do_not_clobber_an_earlier_runs(two_small_host, tmp_path, monkeypatch, capsys):
    """Issue 46 case: each elastic run overwrote <plan>.elastic1, the re-plan
    an earlier run resumes on. A re-plan goes under its run's --out, numbered
    after those there ([Note: where re-plans go]): a second run into the same
    directory writes plan.elastic2, a run into another its own plan.elastic1;
    the first stays byte for byte, nothing is written beside the plan, and
    each records the plan it came from, why and its run."""
    plan_dir, tokens = two_small_host
    first, other = tmp_path / "r", tmp_path / "r2"
    _elastic_run(plan_dir, tokens, first, monkeypatch)
    kept = {p.name: p.read_bytes() for p in (first / "plan.elastic1").iterdir()}
    assert {"plan.json", "plan_request.json", "cluster.yaml", "weights.pt"} <= set(kept)
    launched = _elastic_run(plan_dir, tokens, first, monkeypatch)
    assert launched[1][1].data.plan == str(first / "plan.elastic2")
    _elastic_run(plan_dir, tokens, other, monkeypatch)
    assert {p.name: p.read_bytes() for p in (first / "plan.elastic1").iterdir()} == kept
    assert sorted(p.name for p in first.glob("plan.elastic*")) == ["plan.elastic1", "plan.elastic2"]
    assert [p.name for p in other.glob("plan.elastic*")] == ["plan.elastic1"]
    assert not list(plan_dir.parent.glob("*.elastic*"))
    for run, k in ((first, 1), (first, 2), (other, 1)):
        request = PlanRequest.read(run / f"plan.elastic{k}")
        assert (request.replanned_from, request.run) == (str(plan_dir.resolve()), str(run.resolve()))
        assert request.replan_reason == "rank 1 (GPU 1, T4 on node 'n1') failed for good (killed by SIGKILL)"
    out = capsys.readouterr().out
    second = first / "plan.elastic2"
    assert f"[zorse] elastic: wrote {second} (its cluster: {second / 'cluster.yaml'}); " in out


def test_simulate_elastic_replan_with_its_cluster_file(two_small_host, tmp_path, monkeypatch, capsys):
    """Issue 46 case: `zorse simulate` of a re-plan asked for the cluster file
    the plan was made with, which did not exist (the reduced cluster was only
    inside plan_request.json). The re-plan writes it as cluster.yaml beside
    plan.json, plan_request.json names it, `zorse simulate` runs with it, and
    refuses the original cluster file in one line naming it."""
    plan_dir, tokens = two_small_host
    out = tmp_path / "r"
    _elastic_run(plan_dir, tokens, out, monkeypatch)
    new_dir = out / "plan.elastic1"
    cluster_file = new_dir / "cluster.yaml"
    plan = Plan.load(new_dir)
    assert PlanRequest.read(new_dir).cluster_file == str(cluster_file.resolve())
    cluster = Cluster.from_yaml(cluster_file)
    assert cluster.fingerprint() == plan.cluster_sha256 and cluster.gpu_summary() == plan.cluster_gpus
    assert zorse_main(["simulate", str(new_dir), "--model", "gpt", "--cluster", str(cluster_file),
                       "--out", str(tmp_path / "sim")]) == 0
    assert (tmp_path / "sim" / "trace.json").exists()
    capsys.readouterr()
    original = plan_dir.parent / "cluster.yaml"
    assert zorse_main(["simulate", str(new_dir), "--model", "gpt", "--cluster", str(original),
                       "--out", str(tmp_path / "sim2")]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"zorse: --cluster {original} is not the cluster plan {new_dir} was made for"), line
    assert f"; pass --cluster {cluster_file.resolve()} (recorded in its plan_request.json), or plan for this " in line


def test_elastic_refused_before_start_without_plan_request(two_small, tmp_path, monkeypatch, capsys):
    """A plan without plan_request.json (the Python API's export) cannot be
    re-planned: --elastic refuses it in one line before any rank starts."""
    plan_dir, tokens = two_small
    bare = tmp_path / "plan"
    shutil.copytree(plan_dir, bare)
    (bare / PLAN_REQUEST).unlink()
    monkeypatch.setattr("zorse_fx.runtime.launch.launch", _fail_job("not started"))
    assert zorse_main(["train", str(bare), "--tokens", str(tokens), "--out", str(tmp_path / "r"), "--elastic"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (f"zorse: --elastic: {bare} has no plan_request.json (how the plan was made, which a re-plan "
                    f"repeats); export the plan again with `zorse plan`, which writes it")
    assert not (tmp_path / "r").exists()


def test_reduced_cluster_drops_lost_node():
    """A GPU whose node has others leaves alone (the node keeps the rest,
    renumbered); a node's last GPU takes the node with it, with its link
    override and its shared-link side: the result equals the cluster file
    written without them (same fingerprint)."""
    base = {"name": "c", "datacenters": [{"name": "east"}, {"name": "west"}],
            "nodes": [{"name": "a", "datacenter": "east", "gpus": [{"type": "A100-40GB", "count": 2}]},
                      {"name": "b", "datacenter": "east", "gpus": [{"type": "T4", "count": 1}]},
                      {"name": "c", "datacenter": "west", "gpus": [{"type": "T4", "count": 1, "memory_GiB": 8}]}],
            "links": {"intra_node": {"bandwidth_GBps": 300, "latency_us": 5},
                      "inter_node": {"bandwidth_GBps": 3.125, "latency_us": 20},
                      "cross_datacenter": {"bandwidth_GBps": 1, "latency_us": 500},
                      "overrides": [{"between": ["a", "b"], "bandwidth_GBps": 12.5, "latency_us": 10}]},
            "shared_links": [{"name": "wan", "between": [{"nodes": ["a", "b"]}, {"datacenter": "west"}],
                              "bandwidth_GBps": 2}]}
    cluster = Cluster.from_dict(base)

    smaller, what = reduced_cluster(cluster, {2})
    assert what == "node 'b' (its only GPU: GPU 2 T4)"
    want = {**base, "nodes": [base["nodes"][0], base["nodes"][2]],
            "links": {k: v for k, v in base["links"].items() if k != "overrides"},
            "shared_links": [{**base["shared_links"][0], "between": [{"nodes": ["a"]}, {"datacenter": "west"}]}]}
    assert smaller.fingerprint() == Cluster.from_dict(want).fingerprint()
    assert [(g.index, g.node, g.local_index) for g in smaller.gpus] == [(0, "a", 0), (1, "a", 1), (2, "c", 0)]
    assert smaller.gpus[2].memory_bytes == 8 * 2**30

    smaller, what = reduced_cluster(cluster, {0})
    assert what == "GPU 0 (A100-40GB on node 'a', which keeps 1)"
    want = {**base, "nodes": [{**base["nodes"][0], "gpus": [{"type": "A100-40GB", "count": 1}]}, *base["nodes"][1:]]}
    assert smaller.fingerprint() == Cluster.from_dict(want).fingerprint()

    smaller, what = reduced_cluster(cluster, {3})  # the last node of datacenter west: its shared link goes too
    assert what == "node 'c' (its only GPU: GPU 3 T4)"
    assert smaller.datacenters == ("east",) and smaller.shared_links == () and len(smaller.gpus) == 3
    assert Cluster.from_dict(smaller.to_dict()).fingerprint() == smaller.fingerprint()


def test_lost_rank_is_the_one_torchrun_reports_dead_not_the_ones_it_stopped():
    """torchrun's report: the ranks it stopped (SIGTERM) are no lost GPU; a
    rank killed by a signal is preferred to one that exited with an error (a
    peer's broken connection); a root cause that is zorse's own verdict (a
    non-finite step, exit 3) is no lost GPU at all."""
    report = _torchrun_report((0, 1), (1, -9), (2, -15), (3, -15))
    assert failed_ranks(report) == [RankFailure(rank=0, exitcode=1, pid=1000),
                                    RankFailure(rank=1, exitcode=-9, pid=1001),
                                    RankFailure(rank=2, exitcode=-15, pid=1002),
                                    RankFailure(rank=3, exitcode=-15, pid=1003)]
    assert lost_rank(failed_ranks(report)) == RankFailure(rank=1, exitcode=-9, pid=1001)
    assert lost_rank(failed_ranks(_torchrun_report((2, 1), (0, -15)))) == RankFailure(rank=2, exitcode=1, pid=1002)
    assert lost_rank(failed_ranks(_torchrun_report((1, 3), (0, 3)))) is None
    assert failed_ranks("Traceback ...\nRuntimeError: something else\n") == []
    # A peer torchrun itself SIGKILLed (it ignored the SIGTERM of its "closing signal" line past
    # --shutdown-timeout) is no lost GPU: the rank whose error ended the job is.
    stuck = "W1202 api.py:1028] Sending process 1003 closing signal SIGTERM\n" + _torchrun_report((2, 1), (3, -9))
    assert lost_rank(failed_ranks(stuck), stopped=stopped_pids(stuck)) == RankFailure(rank=2, exitcode=1, pid=1002)


def test_elastic_stalled_rank_replans_and_relaunches_on_the_new_plan(tmp_path, monkeypatch, capsys):
    """A rank stopped for making no progress (--stall-timeout: a frozen host)
    is lost too: its node goes, the 2-GPU plan is made again for the GPU
    left, and the job is relaunched on 1 process with the new plan, started
    anew (no checkpoint yet: --overwrite) and without the fault injection
    (the job itself faked: the options each launch was given are read back)."""
    from zorse_fx.runtime.launch import JobStalledError
    from zorse_fx.train_options import read_options_file

    plan_dir = _plan(tmp_path, "name: two\nnodes:\n  - name: n0\n    gpus: [{type: T4, count: 1}]\n"
                               "  - name: n1\n    gpus: [{type: T4, count: 1}]\n"
                               "links:\n  inter_node: {bandwidth_GBps: 3.125, latency_us: 20}\n", 4, "--use-all-gpus")
    plan = Plan.load(plan_dir)
    stalled = next(g for s in plan.stages for g in s.gpus if g.node == "n1")
    torch.save(torch.randint(0, 256, (4000,)), tmp_path / "tokens.pt")
    launched = []

    def launch(nproc, train_argv, **kw):
        launched.append((nproc, read_options_file(train_argv[1]), kw["max_restarts"]))
        if len(launched) == 1:
            raise JobStalledError(f"rank {stalled.rank} (pid 1) made no progress for 301 s", stalled.rank)

    monkeypatch.setattr("zorse_fx.runtime.launch.launch", launch)
    assert zorse_main(["train", str(plan_dir), "--tokens", str(tmp_path / "tokens.pt"), "--out", str(tmp_path / "r"),
                       "--fail-rank", "1:3", "--max-restarts", "2", "--elastic"]) == 0
    out = capsys.readouterr().out
    assert (f"[zorse] elastic: rank {stalled.rank} (GPU {stalled.gpu}, T4 on node 'n1') failed for good (no "
            f"progress for --stall-timeout)") in out
    assert "dropped node 'n1' (its only GPU: GPU 1 T4); re-planning for the 1 GPU left" in out
    assert "GPUs 2 GPUs; n0: T4 x1; n1: T4 x1 -> 1 GPU; n0: T4 x1" in out
    assert f"no intact checkpoint in {tmp_path / 'r' / 'checkpoints'}: starting anew on 1 rank " in out
    (n0, first, r0), (n1, second, r1) = launched
    assert (n0, n1, r0, r1) == (2, 1, 2, 2)
    assert first.testing.fail_rank == (1, 3) and second.testing.fail_rank is None
    assert second.data.plan == str(tmp_path / "r" / "plan.elastic1") and second.data.weights is None
    assert (second.checkpoint.resume, second.checkpoint.overwrite) == (False, True)
    assert all(getattr(first, f.name) == getattr(second, f.name) for f in dataclasses.fields(first)
               if f.name not in ("data", "checkpoint", "testing"))  # the rest as given
    assert Plan.load(tmp_path / "r" / "plan.elastic1").world_size == 1



def test_max_replans_without_elastic_refused():
    """--max-replans means nothing without --elastic or --rebalance: refused, naming the flags; so are
    --rebalance's thresholds without it, and --rebalance with --elastic."""
    from zorse_fx.cli import LaunchOptions
    from zorse_fx.train_options import OptionValueError

    with pytest.raises(OptionValueError, match=r"^--max-replans 3 applies to --elastic and --rebalance only: add "
                                               r"one, or drop --max-replans$"):
        LaunchOptions(max_replans=3)
    assert LaunchOptions(elastic=True, max_replans=3).max_replans == 3
    assert LaunchOptions(rebalance=True, max_replans=3).max_replans == 3
    with pytest.raises(OptionValueError, match=r"^--straggler-factor 2.0 applies to --rebalance only: add "
                                               r"--rebalance, or drop it$"):
        LaunchOptions(straggler_factor=2.0)
    with pytest.raises(OptionValueError, match=r"^--rebalance runs on one node without --elastic"):
        LaunchOptions(rebalance=True, elastic=True)
