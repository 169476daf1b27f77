"""The command line refuses only what it must, in one line with the numbers
(issue 33 item 7): the stage DP on one node of 8 A100s at global batch 4 and
its refusal message, ``zorse plan --use-all-gpus``, ``--model module:fn``
from the current directory, ``--seq-len`` against the model's positions and
``zorse simulate`` on a cluster other than the plan's."""

from __future__ import annotations

import dataclasses
import json
import re
import sys

import pytest

from conftest import CLUSTERS, GIB, make_devices, solver_options
from test_plan import _gpt_plan, exported  # noqa: F401 (exported: a fixture, of this file's plan)
from zorse_fx.cli import build_parser
from zorse_fx.cli import main as zorse_main
from zorse_fx.errors import InfeasiblePlanError
from zorse_fx.plan import Plan
from zorse_fx.solve import BlockCosts
from zorse_fx.solve.objective import evaluate_result
from zorse_fx.solve.stage_dp import solve_stage_dp


@pytest.fixture(scope="module")
def plan():
    """On small_hetero.yaml: stage 0 on GPUs 0, 1; stage 1 on GPU 2."""
    return _gpt_plan(2, (3,), ((0, 1), (2,)), ((3, 1), (4,)))


def _a100_node(memory_gib: float = 40):
    """One node of 8 A100s and a 6-block model of 100M parameters per block."""
    costs = BlockCosts(fwd_bwd_s_per_sample={"A100-40GB": (2e-3,) * 6}, param_count=(100_000_000,) * 6,
                       act_bytes_per_sample=(200_000_000,) * 6, cut_bytes_per_sample=(0, *(4_000_000,) * 5, 0),
                       state_bytes_per_param=16, shardable_bytes_per_param=12)
    devices = make_devices(["A100-40GB"] * 8, ["n0"] * 8, [int(memory_gib * GIB)] * 8, [1.5e12] * 8)
    return costs, devices


def test_stage_dp_8_a100_global_batch_4():
    """A node's 8 A100s were one unit of 8 GPUs, more than a stage of b <= 4
    samples per micro-batch can hold, so the DP refused the cluster "for
    memory"; the unit is now cut into runs of b GPUs."""
    costs, devices = _a100_node()
    options = solver_options(global_batch_size=4, sharding="auto", recompute="auto")
    res = solve_stage_dp(costs, devices, options)
    assert res.status == "STAGE_DP" and evaluate_result(costs, devices, options, res).feasible
    b = 4 // res.decision.num_microbatches
    assert all(1 <= len(gs) <= b for gs in res.decision.stage_gpus)
    # every GPU at work when asked: 8 GPUs in 2 stages of 4 (M = 1) or more stages
    busy = solve_stage_dp(costs, devices, dataclasses.replace(options, allow_idle_gpus=False))
    assert sorted(g for gs in busy.decision.stage_gpus for g in gs) == list(range(8))


def test_stage_dp_refusal_gives_the_binding_numbers():
    """4 GiB GPUs and at most 2 stages: the message gives b per micro-batch count,
    the split that binds with its GiB and the caps that would allow a plan."""
    costs, devices = _a100_node(memory_gib=4)
    options = solver_options(global_batch_size=4, max_stages=2)
    with pytest.raises(InfeasiblePlanError) as e:
        solve_stage_dp(costs, devices, options)
    msg = str(e.value)
    assert msg.startswith(
        "stage_dp: no candidate plan can be formed: no split of the 8 GPUs into <= 2 stages fits memory with at "
        "most b GPUs per stage (b = 4, 2, 1 samples per micro-batch at M = 1, 2, 4 micro-batches); allow ZeRO-1 "
        "sharding / recomputation (now 'never' / 'never'), more stages (max_stages) or more micro-batches "
        "(max_microbatches). Binding: the model's training state needs 8.9 GiB (16 B/param × 6e+08 params); with "
        "at most 2 stages the best split still needs 5.0 GiB on stage 0 (blocks 0-2: 4.5 GiB state + 572.2 MiB "
        "activations of one sample) but the largest GPU (A100-40GB) has 3.6 GiB usable (0.9 × 4.0 GiB); "), msg
    assert re.search(r"with max_stages=6 a plan exists \(the stage DP finds 6 stages x 4 micro-batches of 1 "
                     r"samples, predicted [0-9.]+ s per step\): set max_stages=6 \(zorse plan --max-stages 6\)$", msg)


def test_use_all_gpus_flag(tmp_path, capsys):
    """The 4-GPU demo cluster: with --use-all-gpus every GPU gets work; where no
    plan can do that (2 samples, 1 stage), the refusal says why, in one line."""
    args = ["plan", "--model", "gpt", "--cluster", str(CLUSTERS / "demo.yaml"), "--seq-len", "16",
            "--planner", "stage_dp", "--use-all-gpus"]
    assert build_parser().parse_args([*args, "--global-batch-size", "8", "-o", "x"]).use_all_gpus
    assert not build_parser().parse_args([*args[:-1], "--global-batch-size", "8", "-o", "x"]).use_all_gpus
    assert zorse_main([*args, "--global-batch-size", "8", "--max-interleave", "1", "-o", str(tmp_path / "p")]) == 0
    plan = Plan.load(tmp_path / "p")
    assert plan.world_size == 4 and sorted(g.gpu for s in plan.stages for g in s.gpus) == [0, 1, 2, 3]
    capsys.readouterr()
    assert zorse_main([*args, "--global-batch-size", "2", "--max-stages", "1", "-o", str(tmp_path / "q")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "zorse: stage_dp: no candidate plan can be formed: no split of the 4 GPUs into <= 1 stages gives every GPU "
        "work and fits memory")
    assert ("Binding: allow_idle_gpus=False: each of the 4 GPUs must take >= 1 sample of every micro-batch, but at "
            "most 1 stage x 2 samples = 2 GPUs can be busy; allow idle GPUs (without zorse plan --use-all-gpus)") in err


def test_model_module_fn_from_cwd(tmp_path, monkeypatch):
    from zorse_fx.models.registry import load_model

    (tmp_path / "zorse_test_mymod.py").write_text(
        "from zorse_fx.models.gpt import GPT, GPTConfig\n\n"
        "def make():\n    return GPT(GPTConfig(n_layer=1, n_embd=32, n_head=4, block_size=16))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "zorse_test_mymod", raising=False)
    model, tok = load_model("zorse_test_mymod:make")
    assert type(model).__name__ == "GPT" and tok == "bytes"
    monkeypatch.delitem(sys.modules, "zorse_test_mymod")
    with pytest.raises(ValueError, match=r"^--model 'zorse_test_nomod:make': no module 'zorse_test_nomod' in the "
                                         r"current directory \(.*\) or on sys.path; run zorse where "
                                         r"zorse_test_nomod.py is, or add its directory to PYTHONPATH$"):
        load_model("zorse_test_nomod:make")
    with pytest.raises(ValueError, match=r"module 'zorse_test_mymod' \(.*zorse_test_mymod.py\) has no function "
                                         r"'build'"):
        load_model("zorse_test_mymod:build")


def test_seq_len_beyond_positions(tmp_path, capsys):
    """zorse_fx's GPT embeds 256 positions (cfg.block_size): 300 is refused in one line, before capture."""
    args = ["plan", "--model", "gpt", "--cluster", str(CLUSTERS / "demo.yaml"), "--global-batch-size", "4",
            "-o", str(tmp_path / "p")]
    assert zorse_main([*args, "--seq-len", "300"]) == 1
    assert capsys.readouterr().err == ("zorse: --seq-len 300 is beyond the 256 positions of model 'gpt' "
                                       "(cfg.block_size = 256); use --seq-len 256 or less\n")
    assert not (tmp_path / "p").exists()


def test_simulate_other_cluster_refused(exported, tmp_path, capsys):
    """The plan of small_hetero.yaml on demo.yaml (other GPUs), and on a copy of
    small_hetero.yaml with a slower inter-node link (same GPUs, other links)."""
    base = ["simulate", str(exported), "--model", "gpt", "--out", str(tmp_path / "sim")]
    plan = Plan.load(exported)
    assert plan.cluster_gpus == "4 GPUs; a100-node: A100-40GB x2; t4-node: T4 x2" and len(plan.cluster_sha256) == 64
    demo = str(CLUSTERS / "demo.yaml")
    assert zorse_main([*base, "--cluster", demo]) == 1
    err = capsys.readouterr().err
    assert err == (f"zorse: --cluster {demo} is not the cluster plan {exported} was made for ('small_hetero'): the "
                   f"plan puts rank 0 on GPU 0 (A100-40GB on node 'a100-node'); GPU 0 of {demo} is P100-16GB on "
                   f"node 'pascal-turing'; pass the cluster file the plan was made with, or plan for this one with "
                   f"`zorse plan --cluster {demo} ...`\n")
    text = (CLUSTERS / "small_hetero.yaml").read_text()
    slower = tmp_path / "slower.yaml"
    slower.write_text(re.sub(r"(inter_node:\s*\{[^}]*bandwidth_GBps:\s*)[0-9.]+", r"\g<1>0.5", text, count=1))
    assert slower.read_text() != text
    assert zorse_main([*base, "--cluster", str(slower)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"zorse: --cluster {slower} is not the cluster plan {exported} was made for "
                          f"('small_hetero'): the same GPUs ({plan.cluster_gpus}) but other links, host memory or "
                          f"bandwidths (cluster sha256 ") and err.count("\n") == 1
    assert not (tmp_path / "sim").exists()
    json.loads((exported / "plan.json").read_text())  # untouched
