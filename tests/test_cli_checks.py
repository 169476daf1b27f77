"""The command line refuses only what it must, in one line with the numbers
(issue 33 item 7): the stage DP on one node of 8 A100s at global batch 4 and
its refusal message, ``zorse plan --use-all-gpus``, ``--model module:fn``
from the current directory, ``--seq-len`` against the model's positions and
``zorse simulate`` on a cluster other than the plan's. Issue 46: no state
left for the next command to trip on (``zorse plan -o`` over an older plan,
``zorse simulate``'s output beside its plan, not in a shared directory), a
plan without its cluster fields refused, ZeRO-3 labelled ZeRO-3, and ``zorse
train`` saying what it trains on (no data: refused; ``--corpus``: the
model's own tokenizer; byte tokens for SmolLM2: refused)."""

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
    assert not build_parser().parse_args([*args, "--global-batch-size", "8", "-o", "x"]).parsed.planner.allow_idle_gpus
    assert build_parser().parse_args([*args[:-1], "--global-batch-size", "8", "-o", "x"]).parsed.planner.allow_idle_gpus
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


# -- issue 46: no stray state, and plans simulated only on their cluster -----------------------------

SMALL = str(CLUSTERS / "small_hetero.yaml")


@pytest.fixture(scope="module")
def replanned(plan, tmp_path_factory):
    """`zorse plan -o d` (a 1-stage ZeRO-3 plan of `--model gpt` on all 4 GPUs: alone, one A100 is faster)
    into d that held an older 2-stage plan: its plan.json, stage_0/1.py, weights, and a `zorse simulate`
    output. Returns (d, the older plan's file names)."""
    d = tmp_path_factory.mktemp("replan") / "plan"
    plan.export(d)
    (d / "weights.pt").write_bytes(b"the older plan's weights")
    (d / "simulate").mkdir()
    (d / "simulate" / "trace.json").write_text("{}")
    before = sorted(p.name for p in d.iterdir())
    assert zorse_main(["plan", "--model", "gpt", "--cluster", SMALL, "--global-batch-size", "8", "--seq-len", "32",
                       "--planner", "stage_dp", "--sharding", "always", "--grad-sharding", "always",
                       "--param-sharding", "always", "--max-stages", "1", "--use-all-gpus", "-o", str(d)]) == 0
    return d, before


def test_plan_into_existing_plan_dir_leaves_no_stale_stage_files(replanned):
    """The new plan replaced the old one whole: no stage_1.py of the 2-stage
    plan, no old weights or simulation, no temporary directory beside it."""
    d, before = replanned
    assert before == ["plan.json", "simulate", "stage_0.py", "stage_1.py", "weights.pt"]
    plan = Plan.load(d)
    assert plan.num_stages == 1 and plan.stages[0].param_sharded
    assert sorted(p.name for p in d.iterdir()) == ["plan.json", "plan_request.json", "stage_0.py", "weights.pt"]
    assert (d / "weights.pt").read_bytes()[:2] == b"PK"  # torch.save's zip, not the old bytes
    assert sorted(p.name for p in d.parent.iterdir()) == ["plan"]


def test_zero3_plan_table_labels_zero3(replanned):
    """The table of a ZeRO-3 plan with 16-bit working weights says ZeRO-3
    everywhere (its 16-bit weights line named "the ZeRO-1 shards")."""
    table = Plan.load(replanned[0]).table()
    assert "), ZeRO-3," in table and "16-bit weights" in table and "Sharded parameters (ZeRO-3) on stage 0" in table
    assert "their float32 masters in the optimizer-state shards)" in table and "ZeRO-1" not in table


def test_plan_into_a_directory_that_is_not_a_plan_refused(tmp_path, capsys):
    """`-o` naming a directory with other files (the project, a run directory):
    one line naming them, before any planning; the directory untouched."""
    d = tmp_path / "x"
    (d / "data").mkdir(parents=True)
    (d / "notes.txt").write_text("mine")
    (d / "plan.json").write_text("{}")
    assert zorse_main(["plan", "--model", "gpt", "--cluster", SMALL, "--global-batch-size", "8", "-o", str(d)]) == 1
    out = capsys.readouterr()
    assert out.err == (f"zorse: -o {d} is not a plan directory: it holds data/, notes.txt (a plan directory holds "
                       f"only plan.json, stage_<i>.py, weights.pt, hf_config.json, plan_request.json, cluster.yaml "
                       f"and simulate/), which writing a plan there would replace; give a new or empty directory for "
                       f"the plan\n")
    assert "[zorse] captured" not in out.out
    assert sorted(p.name for p in d.iterdir()) == ["data", "notes.txt", "plan.json"]
    (tmp_path / "f").write_text("")
    assert zorse_main(["plan", "--model", "gpt", "--cluster", SMALL, "--global-batch-size", "8",
                       "-o", str(tmp_path / "f")]) == 1
    assert capsys.readouterr().err == f"zorse: -o {tmp_path / 'f'} is a file, not a plan directory; give a new " \
                                      f"directory for the plan\n"


def test_interrupted_plan_write_keeps_the_old_plan(exported):
    """A `zorse plan` that fails while writing (here: an error inside the
    block) leaves the older plan as it was and no temporary directory."""
    from zorse_fx.plan import new_plan_dir

    files = {p.name: p.read_bytes() for p in exported.iterdir()}
    with pytest.raises(OSError, match="disk full"):
        with new_plan_dir(exported) as new:
            (new / "plan.json").write_text("{}")
            raise OSError("disk full")
    assert {p.name: p.read_bytes() for p in exported.iterdir()} == files
    assert sorted(p.name for p in exported.parent.iterdir()) == [exported.name]


def test_simulate_writes_beside_the_plan_not_a_shared_runs_simulate(replanned, tmp_path, monkeypatch, capsys):
    """Two plans simulated without --out: each timeline in its own
    <plan>/simulate/ (was ./runs/simulate/, one plan's files overwriting
    the other's); the ZeRO-3 stage is labelled ZeRO-3 (was "ZeRO-1 shard")."""
    import shutil

    d, other = tmp_path / "plan", tmp_path / "other"
    shutil.copytree(replanned[0], d)
    shutil.copytree(replanned[0], other)
    monkeypatch.chdir(tmp_path)
    for p in (d, other):
        assert zorse_main(["simulate", str(p), "--model", "gpt", "--cluster", SMALL]) == 0
        out = capsys.readouterr().out
        assert f"[zorse] wrote {p / 'simulate' / 'trace.json'} (open in ui.perfetto.dev) and " \
               f"{p / 'simulate' / 'gantt.png'}" in out
        rows = [ln for ln in out.splitlines() if ln.startswith("  stage 0 rank")]
        assert len(rows) == 4 and all(re.search(r", ZeRO-3 shard [0-9.]+ GiB$", r) for r in rows), out
        assert "ZeRO-1" not in out
        trace = json.loads((p / "simulate" / "trace.json").read_text())
        assert {e["args"].get("memory") for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] in "FB"} \
            == {"ZeRO-3"}
    assert not (tmp_path / "runs").exists()
    shutil.rmtree(other / "simulate")
    assert zorse_main(["simulate", str(other), "--model", "gpt", "--cluster", SMALL, "--out", "sim"]) == 0
    assert (tmp_path / "sim" / "trace.json").is_file() and not (other / "simulate").exists()


@pytest.mark.parametrize("case", ["fields removed", "format 12"])
def test_simulate_plan_without_cluster_fields_refused(replanned, tmp_path, capsys, case):
    """A plan.json that does not record its cluster (older than format 13, or
    the fields deleted) is refused in one line instead of simulated on any
    cluster; --any-cluster simulates it anyway."""
    import shutil

    d = tmp_path / "p"
    shutil.copytree(replanned[0], d)
    text = json.loads((d / "plan.json").read_text())
    del text["cluster_gpus"], text["cluster_sha256"]
    if case == "format 12":
        text["version"] = 12
    (d / "plan.json").write_text(json.dumps(text))
    assert zorse_main(["simulate", str(d), "--model", "gpt", "--cluster", SMALL]) == 1
    assert capsys.readouterr().err == (
        f"zorse: plan {d} does not record the cluster it was made for (cluster_gpus and cluster_sha256 missing: a "
        f"plan.json older than format version 13, or edited); re-plan with `zorse plan --cluster {SMALL} ...`, or "
        f"pass --any-cluster to simulate it on {SMALL} as it is\n")
    assert not (d / "simulate").exists()
    assert zorse_main(["simulate", str(d), "--model", "gpt", "--cluster", SMALL, "--any-cluster"]) == 0
    assert (d / "simulate" / "trace.json").is_file()


# -- zorse train says what it trains on (issue 46) -------------------------------------------------

def _named(exported, model_name: str):
    """``exported`` (a 2-stage GPT plan with its weights) recorded as a plan of ``model_name``."""
    from conftest import edit_plan_json

    edit_plan_json(exported, lambda d: d.update(model_name=model_name))
    return str(exported)


def _refused_usage(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        zorse_main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


def test_train_without_data_refused(exported, tmp_path, capsys):
    """README's `zorse train runs/x/plan --steps 10 --out runs/x` trained on
    gensim's Lee corpus in UTF-8 bytes without saying so, whatever the model's
    tokenizer; with no --data, --tokens or --corpus it is refused, naming them,
    before anything is read or written."""
    out = tmp_path / "run"
    assert _refused_usage(["train", str(exported), "--steps", "10", "--out", str(out)], capsys) == (
        "zorse train: error: no training data: pass --data <name>.bin (a token file written by `zorse prepare-data`) "
        "or --corpus SOURCE ('lee', a text file, a directory of *.txt, a datasets file) to tokenize one into "
        "<out>/data/tokens.bin")
    assert not out.exists()
    assert _refused_usage(["train", _named(exported, "mymod:build"), "--corpus", "lee", "--out", str(out)],
                          capsys) == (
        "zorse train: error: --corpus lee: which tokenizer? zorse_fx knows the tokenizers of smollm2-135m, gpt2-124m, "
        "gpt, not of the plan's model 'mymod:build'; pass --tokenizer with the model's own (a Hugging Face tokenizer "
        "directory or hub name)")
    assert not out.exists()


def test_train_corpus_uses_the_models_own_tokenizer(exported, tmp_path, capsys):
    """`--corpus` without `--tokenizer` tokenizes with the plan's model's own
    (bytes for `gpt`) and says so; `--dry-run` checks everything, writes the
    ranks' options and prints the torchrun command, starting nothing."""
    from zorse_fx.train_options import read_options_file

    out = tmp_path / "run"
    assert zorse_main(["train", _named(exported, "gpt"), "--corpus", "lee", "--steps", "3", "--out", str(out),
                       "--dry-run"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"[zorse] training data: --corpus lee tokenized with bytes into {out / 'data' / 'tokens.bin'}"
    assert printed[-2].startswith("[zorse] ") and printed[-2].endswith(f"-m zorse_fx.train --options-file "
                                                                      f"{out / 'train_options.json'}")
    assert printed[-1] == (f"[zorse] --dry-run: plan, weights and data checked, {out / 'train_options.json'} "
                           f"written; nothing started")
    assert json.loads((out / "data" / "tokens.json").read_text())["tokenizer"] == "bytes"
    assert read_options_file(out / "train_options.json").data.data == str(out / "data" / "tokens.bin")
    assert sorted(p.name for p in out.iterdir()) == ["data", "train_options.json"]  # no rank ran: no logs, metrics


def test_train_bytes_for_a_model_with_its_own_tokenizer_refused(exported, tmp_path, capsys):
    """SmolLM2's embeddings read its own token ids: byte tokens, asked for
    (`--tokenizer bytes`) or in a token file (`--data`, its header says
    bytes), are refused in one line naming the model's tokenizer."""
    from zorse_fx.token_data import prepare_data

    plan = _named(exported, "smollm2-135m")
    out = tmp_path / "run"
    assert zorse_main(["train", plan, "--corpus", "lee", "--tokenizer", "bytes", "--out", str(out)]) == 1
    assert capsys.readouterr().err == (
        "zorse: --corpus lee --tokenizer bytes: the tokens are UTF-8 bytes, but the plan's model smollm2-135m reads "
        "smollm2-135m token ids; tokenize with its own: --tokenizer smollm2-135m (`zorse prepare-data SOURCE "
        "--tokenizer smollm2-135m -o OUT`, or zorse train --corpus SOURCE without --tokenizer)\n")
    assert not (out / "data").exists()
    prepare_data("lee", tmp_path / "lee", tokenizer="bytes", progress=False)
    data = str(tmp_path / "lee.bin")
    assert zorse_main(["train", plan, "--data", data, "--out", str(out)]) == 1
    assert capsys.readouterr().err == (
        f"zorse: --data {data} (its header: tokenizer 'bytes'): the tokens are UTF-8 bytes, but the plan's model "
        f"smollm2-135m reads smollm2-135m token ids; tokenize with its own: --tokenizer smollm2-135m (`zorse "
        f"prepare-data SOURCE --tokenizer smollm2-135m -o OUT`, or zorse train --corpus SOURCE without --tokenizer)\n")
    assert not (out / "train_options.json").exists()


def _plan_args(*extra: str):
    return build_parser().parse_args(["plan", "--model", "gpt", "--cluster", "c.yaml", "--global-batch-size", "8",
                                      "-o", "out", *extra]).parsed


def test_zorse_plan_reaches_every_plan_options_field():
    """Issue 48 item 5: `zorse plan`'s flags are PlanOptions' fields (tyro), each named after its field, each
    once: every field is reachable and lands in the record zorse.compile takes."""
    from zorse_fx.cli import PlanCommand
    from zorse_fx.options import PlanOptions

    given = {"max_stages": ("2", 2), "schedule": ("gpipe", "gpipe"), "num_microbatches": (["2", "4"], (2, 4)),
             "max_microbatches": ("8", 8), "memory_fraction": ("0.8", 0.8), "solver_budget": ("2.5", 2.5),
             "time_limit_s": ("50", 50.0), "num_workers": ("2", 2), "jobs": ("3", 3), "seed": ("7", 7),
             "planner": ("stage_dp", "stage_dp"), "precision": ("bf16-mixed", "bf16-mixed"),
             "grad_reduce_dtype": ("bfloat16", "bfloat16"), "tf32": ([], True), "max_blocks": ("16", 16),
             "allow_idle_gpus": ([], False), "profiles": (["a.json", "b"], ("a.json", "b")),
             "profile_batches": (["1", "4"], (1, 4)), "calibration": ("cal.json", "cal.json"),
             "sharding": ("always", "always"), "grad_sharding": ("never", "never"),
             "param_sharding": ("never", "never"), "offload": ("never", "never"),
             "activation_offload": ("never", "never"), "recompute": ("always", "always"), "stash": ("never", "never"),
             "max_interleave": ("2", 2), "bucket_mib": ("4", 4.0)}
    fields = {f.name for f in dataclasses.fields(PlanOptions)} - {"global_batch_size"}
    assert set(given) == fields  # a new field gets a line here
    argv = []
    for name, (text, _) in given.items():
        flag = "--no-allow-idle-gpus" if name == "allow_idle_gpus" else f"--{name.replace('_', '-')}"
        argv += [flag, *([text] if isinstance(text, str) else text)]
    parsed = _plan_args(*argv)
    assert isinstance(parsed, PlanCommand)
    assert {name: getattr(parsed.planner, name) for name in given} == {n: v for n, (_, v) in given.items()}
    assert (parsed.plan.model, parsed.plan.cluster, parsed.plan.output, parsed.plan.seq_len) == (
        "gpt", "c.yaml", "out", 64)


def test_zorse_plan_help_comes_from_the_fields_documentation(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["plan", "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for line in ("--solver-budget FLOAT", "CP-SAT work for the whole search",  # the field's docstring
                 "--sharding {never,auto,always}", "--schedule {1f1b,gpipe}",  # its Literal type's choices
                 "-o DIR, --output DIR", "--no-cache", "--no-allow-idle-gpus", "--num-microbatches"):
        assert line in out, line
    assert out.count("--solver-budget FLOAT") == 1  # no flag defined twice


def test_zorse_plan_former_flags_still_read():
    """--use-all-gpus and --time-limit, from before the flags were the fields' names."""
    parsed = _plan_args("--use-all-gpus", "--time-limit", "30")
    assert (parsed.planner.allow_idle_gpus, parsed.planner.time_limit_s) == (False, 30.0)
    assert _plan_args("--time-limit=12").planner.time_limit_s == 12.0


@pytest.mark.parametrize("extra, message", [
    (["--sharding", "bad"], "argument --sharding: invalid choice: 'bad' (choose from 'never', 'auto', 'always')"),
    (["--solver-budget", "0"], "PlanOptions.solver_budget=0.0: use a number > 0"),  # the record's own check
    (["--bucket-mib", "x"], "argument --bucket-mib: could not convert string to float: 'x'"),
    (["--precision", "fp32", "--grad-reduce-dtype", "bfloat16"],
     "PlanOptions.grad_reduce_dtype='bfloat16': precision 'fp32' reduces gradients in float32"),
    (["--nope"], "unrecognized arguments: --nope"),
])
def test_zorse_plan_bad_flags_are_usage_errors(extra, message, capsys):
    """The one error style of the typed command lines: argparse's `zorse plan: error: ...`, exit status 2."""
    with pytest.raises(SystemExit) as exit_:
        _plan_args(*extra)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "zorse plan: error: " + message in err, err


def test_zorse_plan_required_flags_named(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "--cluster", "c.yaml"])
    assert "the following arguments are required: --model, -o/--output, --global-batch-size" in capsys.readouterr().err


def test_plan_options_value_sets_match_the_literal_types():
    """The Literal types tyro offers as choices are the value sets the rest of zorse_fx reads."""
    import typing

    from zorse_fx.ir.schedule import SCHEDULES
    from zorse_fx.options import GradReduceDtype, PrecisionChoice, Schedule
    from zorse_fx.precision import GRAD_REDUCE_DTYPES, PRECISIONS

    assert typing.get_args(Schedule) == SCHEDULES
    assert typing.get_args(PrecisionChoice) == ("auto", *PRECISIONS)
    assert typing.get_args(GradReduceDtype) == GRAD_REDUCE_DTYPES
