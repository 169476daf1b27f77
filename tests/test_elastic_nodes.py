"""``zorse train --elastic`` across nodes ([Note: losing a node] in zorse_fx/elastic_nodes.py).

The agreement is files in the shared run directory read on a clock the test
holds (``Agreement``'s ``clock``/``sleep``): a node is lost only after its
beat stood still for ``lost_after_s`` of the reader's own time, a node that
still beats is waited for up to ``wait_s``, the first decision published is
everyone's. ``decide`` is read off a plan of small_hetero and torchrun's own
failure-report text. The end-to-end run (three nodes of a box, node 0 killed
mid-run, the two left re-plan, meet at a new rendezvous and finish equal to
single-process training) is the last test; it needs root (skipped, with the
reason, elsewhere).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import FP32, ROOT, fixed_plan, gpt3x64
from test_elastic import _torchrun_report
from zorse_fx.cli import main as zorse_main
from zorse_fx.elastic import ElasticError
from zorse_fx.elastic_nodes import ELASTIC_DIRNAME, Agreement, Decision, NodeReport, decide
from zorse_fx.runtime.launch import JobFailedError, JobStalledError

NODES = ("a100-node", "t4-node", "spare")


class Clock:
    """A clock the test moves: ``sleep`` advances it and runs ``on_sleep`` (what the other nodes do meanwhile)."""

    def __init__(self, on_sleep=None):
        self.now, self.on_sleep = 0.0, on_sleep

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s
        if self.on_sleep:
            self.on_sleep(self.now)


def _beat(out: Path, node: str, time_s: float) -> None:
    """``node``'s launcher beat as ``runtime.watchdog.start_beat`` writes it, at its clock's ``time_s``."""
    d = out / ELASTIC_DIRNAME
    d.mkdir(parents=True, exist_ok=True)
    (d / f"beat-{node}").write_text(json.dumps({"node": node, "pid": 1, "time": time_s}))


def _report(node: str, failures=(), error: str = "") -> NodeReport:
    return NodeReport(node=node, host=f"{node}.example", failures=tuple(failures), error=error)


def _reported(out: Path, job: str, report: NodeReport) -> None:
    """Node ``report.node`` writes its report for attempt 0 of ``job`` (a gather over no other node)."""
    assert Agreement(out, job, report.node).gather(0, (), report) == ({}, [])


def test_silent_node_lost_after_its_beat_stood_still(tmp_path):
    """Node 'spare' beat once and then nothing: lost once its beat stood still for lost_after_s (10 s of the
    reader's clock, not the file's time); 'a100-node' reports at 3 s and is waited for."""
    _beat(tmp_path, "spare", 7)

    def others(now):
        if now == 3:
            _reported(tmp_path, "j1", _report("a100-node"))
    clock = Clock(others)
    ag = Agreement(tmp_path, "j1", "t4-node", lost_after_s=10, wait_s=100, poll_s=0.5, clock=clock, sleep=clock.sleep)
    reports, lost = ag.gather(0, NODES, _report("t4-node"))
    assert sorted(reports) == ["a100-node", "t4-node"] and lost == ["spare"]
    assert 10 <= clock.now <= 10.5 and reports["a100-node"].host == "a100-node.example"


def test_beating_node_waited_for_until_wait_s(tmp_path):
    """A node whose zorse train still beats but never reports (its torchrun slow to stop) is waited for, and
    lost only when the whole wait is over."""
    count = iter(range(10**6))
    clock = Clock(lambda now: _beat(tmp_path, "spare", next(count)))
    ag = Agreement(tmp_path, "j2", "t4-node", lost_after_s=5, wait_s=30, poll_s=1, clock=clock, sleep=clock.sleep)
    _reported(tmp_path, "j2", _report("a100-node"))
    reports, lost = ag.gather(0, NODES, _report("t4-node"))
    assert lost == ["spare"] and sorted(reports) == ["a100-node", "t4-node"] and clock.now == pytest.approx(30)


def test_an_earlier_jobs_reports_are_not_this_jobs(tmp_path):
    """Reports live under the job id node 0 wrote before torchrun started: a new job in the same --out starts
    with none."""
    old = Agreement.start_job(tmp_path)
    _reported(tmp_path, old, _report("a100-node"))
    new = Agreement.start_job(tmp_path)
    assert new != old and Agreement.current_job(tmp_path) == new
    clock = Clock()
    reports, lost = Agreement(tmp_path, new, "t4-node", lost_after_s=2, poll_s=1, clock=clock,
                              sleep=clock.sleep).gather(0, NODES[:2], _report("t4-node"))
    assert list(reports) == ["t4-node"] and lost == ["a100-node"]


def test_first_decision_published_is_everyones(tmp_path):
    a, b = (Agreement(tmp_path, "j3", n) for n in NODES[:2])
    a.attempt_dir(0).mkdir(parents=True)
    first = Decision(action="replan", reason="node 'spare' lost", decided_by="a100-node", plan="/p1",
                     nodes=("a100-node", "t4-node"), master_addr="a100-node", master_port=29500)
    assert a.publish(0, first) == first
    assert b.publish(0, Decision(action="stop", reason="x", decided_by="t4-node")) == first
    assert not list(a.attempt_dir(0).glob(".decision*"))  # no temporary left


def test_no_decision_one_line(tmp_path):
    clock = Clock()
    ag = Agreement(tmp_path, "j4", "t4-node", decide_wait_s=60, poll_s=5, clock=clock, sleep=clock.sleep)
    ag.attempt_dir(0).mkdir(parents=True)
    with pytest.raises(ElasticError) as e:
        ag.wait_decision(0, leader="a100-node")
    assert str(e.value) == (
        f"--elastic: node 't4-node' waited 60 s for node 'a100-node' to re-plan (its decision "
        f"{ag.attempt_dir(0) / 'decision.json'}) and none came: that node may be lost too; resume with `zorse train "
        f"... --resume` under a plan for the nodes that work")


def test_decision_not_written_by_zorse_refused_naming_file_and_field(tmp_path):
    ag = Agreement(tmp_path, "j5", "t4-node")
    ag.attempt_dir(0).mkdir(parents=True)
    path = ag.attempt_dir(0) / "decision.json"

    def refusal(doc: dict) -> str:
        path.write_text(json.dumps(doc))
        with pytest.raises(ElasticError) as e:
            ag.wait_decision(0, leader="a100-node")
        return str(e.value)
    assert refusal({"action": "replan", "reason": "r", "decided_by": "a100-node", "master_port": "x"}) == (
        f"--elastic: {path} is not a Decision that `zorse train --elastic` writes (Expected `int`, got `str` - at "
        f"`$.master_port`); something else wrote into {path.parent}: stop every node's zorse train and resume the "
        f"run with `zorse train ... --resume`")
    assert "(Invalid enum value 'restart' - at `$.action`)" in refusal(
        {"action": "restart", "reason": "r", "decided_by": "a100-node"})


@pytest.fixture(scope="module")
def hetero_plan():
    """small_hetero by hand: stage 0 on the A100s (GPUs 0, 1 of a100-node), stage 1 on the T4s (2, 3 of t4-node)."""
    return fixed_plan(gpt3x64(), ((0, 1), (2, 3)), ((4, 4), (4, 4)), num_microbatches=1, global_batch_size=8)


def _failed(report: str) -> JobFailedError:
    return JobFailedError("zorse: rank 2 ...", 1, None, report)


def test_lost_node_loses_all_its_gpus(hetero_plan):
    reports = {"a100-node": NodeReport.from_error("a100-node", _failed(_torchrun_report((0, 1), (1, 1))))}
    gpus, what = decide(hetero_plan, reports, ["t4-node"])
    assert gpus == {2, 3}
    assert what == "node 't4-node' (ranks 2, 3) was lost: no report from its zorse train"


def test_rank_killed_by_signal_lost_over_the_resets_it_caused(hetero_plan):
    """Every node reported: the rank a signal ended (rank 3, SIGKILL) is lost, not the ranks of the other node
    that failed on the connection it reset (exit status 1, reported first)."""
    reports = {"a100-node": NodeReport.from_error("a100-node", _failed(_torchrun_report((0, 1), (1, 1)))),
               "t4-node": NodeReport.from_error("t4-node", _failed(_torchrun_report((2, 1), (3, -9))))}
    assert decide(hetero_plan, reports, []) == (
        {3}, "rank 3 (GPU 3, T4 on node 't4-node') failed for good (killed by SIGKILL)")
    stalled = {"a100-node": NodeReport.from_error("a100-node", JobStalledError("rank 1 stalled", rank=1))}
    assert decide(hetero_plan, stalled | {"t4-node": reports["t4-node"]}, [])[0] == {1}


def test_verdict_on_any_node_stops_every_node(hetero_plan):
    """A non-finite step (exit 3) is the run stopping itself: no GPU lost, every node ends with it."""
    reports = {"a100-node": NodeReport.from_error("a100-node", _failed(_torchrun_report((0, 1)))),
               "t4-node": NodeReport.from_error("t4-node", _failed(_torchrun_report((2, 3), (3, 1))))}
    gpus, what = decide(hetero_plan, reports, [])
    assert gpus is None and what == "node 't4-node': zorse: rank 2 ..."


def test_node_lost_after_refused_where_it_cannot_take_effect(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        zorse_main(["train", str(tmp_path / "plan"), "--data", "x.bin", "--out", str(tmp_path / "run"), "--elastic",
                    "--node-lost-after", "5"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "zorse train: error: --node-lost-after 5.0 applies to --elastic on several nodes only (--elastic --nnodes "
        "N): add them, or drop --node-lost-after")


# -- three nodes of a box, node 0 lost ----------------------------------------------------------------

_BOX_NODES = ("a100-a", "a100-b", "t4-node")


def test_box_node_zero_lost_survivors_replan_at_a_new_rendezvous(lee_bytes, tmp_path):
    """bench/clusters/box_d_node_lost.yaml (three nodes of one GPU each) as a box (zorse_fx/box), `zorse train
    --elastic --nnodes 3 --checkpoint-every 1` on each; at step 2 node 0 (a100-a, the rendezvous) is killed
    whole (Box.kill_node: its zorse train, torchrun, rank). The other two report, wait --node-lost-after 5 s for
    a100-a, a100-b decides (the first that reported), re-plans for its and t4-node's GPU, and both restart as
    nodes 0 and 1 of 2 with the rendezvous moved to a100-b; they resume from the newest checkpoint and
    finish. The 5 steps' losses equal single-process training (FP32: resuming under another plan is exact
    up to float32 sums in another order). Nothing of the box is left (test_box.py)."""
    from zorse_fx.box import Box, check_machine, gc
    from zorse_fx.capture import capture
    from zorse_fx.models.registry import load_model

    from test_multinode import _losses, _reference

    reason = check_machine()
    if reason:
        pytest.skip(f"zorse box cannot run here: {reason}")
    gc()
    cluster = ROOT / "bench" / "clusters" / "box_d_node_lost.yaml"
    plan_dir, out, tokens = tmp_path / "plan", tmp_path / "run", tmp_path / "tokens.pt"
    assert zorse_main(["plan", "--model", "gpt", "--cluster", str(cluster), "--global-batch-size", "8",
                       "--seq-len", "32", "--use-all-gpus", "-o", str(plan_dir)]) == 0
    torch.save(lee_bytes[:20000], tokens)
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    with Box.up(cluster, box_id=f"en{os.getpid()}", scale=0.01) as box:
        procs = [box.spawn(node, [sys.executable, "-m", "zorse_fx.cli", "train", str(plan_dir), "--tokens",
                                  str(tokens), "--steps", "5", "--out", str(out), "--precision", "fp32", "--lr", "1e-3",
                                  "--weight-decay", "0.1", "--checkpoint-every", "1", "--elastic", "--nnodes", "3",
                                  "--node-rank", str(k), "--master-addr", "a100-a", "--node-lost-after", "5"],
                           env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for k, node in enumerate(_BOX_NODES)]
        try:
            end = time.monotonic() + 120
            while not ((out / "metrics.jsonl").exists() and len(_losses(out)) >= 2):
                assert time.monotonic() < end and all(p.poll() is None for p in procs), "no step 2 in 120 s"
                time.sleep(0.1)
            assert box.kill_node("a100-a")
            outs = [p.communicate(timeout=240)[0] for p in procs[1:]]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)
                    p.communicate(timeout=60)
    assert [p.returncode for p in procs] == [-signal.SIGKILL, 0, 0], "\n".join(o[-3000:] for o in outs)
    b, t4 = outs
    assert "[zorse] elastic: node 't4-node': reports in (lost: 'a100-a'); node 'a100-b' decides" in t4
    for text, k in ((b, 0), (t4, 1)):
        assert ("[zorse] elastic: node 'a100-a' (rank 0) was lost: no report from its zorse train (decided by node "
                "'a100-b')") in text
        assert f"[zorse] elastic: node '{'a100-b' if k == 0 else 't4-node'}' restarts as --node-rank {k} of 2 " \
               f"(rendezvous a100-b:29500), resuming from {out / 'checkpoints'}" in text
    model, _ = load_model("gpt")
    ids = torch.randint(0, 200, (2, 32))
    ref = _reference(plan_dir, capture(model, (ids, ids)), lee_bytes[:20000], 5)
    # (a resumed run cuts metrics.jsonl back to its checkpoint's step: one line per step)
    assert _losses(out) == pytest.approx(ref, rel=FP32.loss_rel)
    assert sorted(p.name for p in out.glob("plan.elastic*")) == ["plan.elastic1"]
