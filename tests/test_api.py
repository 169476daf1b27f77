"""Public surface: zorse.compile (instance, decorator, HF model), errors users
see, and the `zorse` command line."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

import zorse_fx as zorse
from conftest import CLUSTERS
from zorse_fx.cli import main as zorse_main
from zorse_fx.plan import fmt_seconds
from zorse_fx.models.gpt import GPT, GPTConfig

T = 16


def test_compile_hf_llama_plan_and_pipeline_forward(lee_bytes):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    hf = LlamaForCausalLM(cfg)
    ids = lee_bytes[: 2 * T].view(2, T)
    model = zorse.compile(hf, cluster=CLUSTERS / "small_hetero.yaml", example_inputs=(ids,),
                          global_batch_size=8, solver_budget=2.0)
    plan = model.plan
    assert plan.input_names == ("input_ids", "labels") and plan.label_mode == "same"
    assert plan.microbatch_size * plan.num_microbatches == 8
    assert plan.solver.status == "OPTIMAL"
    for s in plan.stages:
        assert sum(g.samples_per_microbatch for g in s.gpus) == plan.microbatch_size
    ref = hf(input_ids=ids, labels=ids, use_cache=False).loss
    torch.testing.assert_close(model.pipeline_forward(ids, ids), ref, rtol=0, atol=1e-6)


def test_decorator_on_module_class():
    ids = torch.randint(0, 256, (2, T))

    @zorse.compile(cluster=CLUSTERS / "small_hetero.yaml", example_inputs=(ids, ids), global_batch_size=4,
                   solver_budget=2.0)
    class TinyGPT(GPT):
        """A user's model class."""

    model = TinyGPT(GPTConfig(n_layer=2, n_embd=32, block_size=T))
    assert isinstance(model, zorse.CompiledModel)
    assert model.plan.world_size >= 1
    assert TinyGPT.__doc__ == "A user's model class."
    torch.testing.assert_close(model.pipeline_forward(ids, ids), model(ids, ids))


def test_infeasible_plan_names_the_binding_constraint(tmp_path):
    """A model whose training state cannot fit on the cluster's GPUs."""
    cluster = tmp_path / "tiny.yaml"
    cluster.write_text(
        "name: tiny\n"
        "gpu_types:\n"
        "  Tiny1G: {memory_GiB: 0.0005, mem_bw_GBps: 100, fp32_tflops: 1, fp16_tensor_tflops: 2,"
        " bf16_supported: false, source: 'test: a made-up GPU'}\n"
        "nodes:\n  - name: n0\n    gpus: [{type: Tiny1G, count: 2}]\n"
        "links:\n  intra_node: {bandwidth_GBps: 10, latency_us: 5}\n"
    )
    ids = torch.randint(0, 256, (2, T))
    # (sizes below a GiB in KiB / MiB, not "0.0 GiB": issue 46)
    with pytest.raises(zorse.InfeasiblePlanError, match=r"needs 2\.0 MiB .* the largest GPU \(Tiny1G\) has "
                                                        r"471\.9 KiB usable") as e:
        zorse.compile(GPT(GPTConfig(n_layer=2, n_embd=64, block_size=T)), cluster=cluster,
                      example_inputs=(ids, ids), global_batch_size=4, max_stages=2, solver_budget=2.0)
    assert "18 B/param" in str(e.value)  # fp16-mixed (Tiny1G has no bf16): 16 B + the float16 weight copy


def test_bad_cluster_path_is_reported(tmp_path):
    ids = torch.randint(0, 256, (2, T))
    with pytest.raises(zorse.ClusterConfigError, match="nope.yaml"):
        zorse.compile(GPT(GPTConfig(n_layer=1, n_embd=32, block_size=T)), cluster=tmp_path / "nope.yaml",
                      example_inputs=(ids, ids), global_batch_size=4)


@pytest.fixture(scope="module")
def cli_plan(tmp_path_factory):
    """`zorse plan` of a tiny GPT on small_hetero (batch 8): the plan directory
    and what the command printed on stdout (its progress). The plan and show
    test and the simulate test read this one plan."""
    out = tmp_path_factory.mktemp("cli") / "plan"
    progress = io.StringIO()
    with contextlib.redirect_stdout(progress):
        assert zorse_main(["plan", "--model", "gpt", "--cluster", str(CLUSTERS / "small_hetero.yaml"),
                           "--global-batch-size", "8", "--seq-len", "32", "--solver-budget", "2", "-o", str(out)]) == 0
    return out, progress.getvalue()


@pytest.mark.xdist_group("cli_plan")  # one worker computes the module fixture once
def test_cli_plan_and_show(cli_plan, capsys):
    out, progress = cli_plan
    d = json.loads((out / "plan.json").read_text())
    assert d["format"] == "zorse_fx.plan" and d["version"] == zorse.plan.PLAN_FORMAT_VERSION
    # --precision auto (the default) on A100 + T4: fp16-mixed, said in the progress output.
    assert (d["precision"], d["grad_reduce_dtype"], d["compute_dtype"]) == ("fp16-mixed", "float32", "float16")
    assert (out / "weights.pt").exists() and (out / "stage_0.py").exists()
    # The answer was simulated before it became a plan (sim.check_result).
    sv = d["solver"]
    # The CP-SAT budget (deterministic seconds) and the safety stop are recorded; the stop never fired.
    assert (sv["solver_budget"], sv["time_limit_s"], sv["wall_clock_stops"]) == (2.0, 100.0, 0)
    assert sv["simulated_step_time_s"] > 0 and 0 < sv["simulated_max_memory_fraction"] <= 1
    assert 0.5 < sv["simulated_step_time_s"] / d["predicted_step_time_s"] <= 1.2
    assert "simulator check: step" in progress
    assert "[zorse] precision fp16-mixed: float16 autocast compute; " in progress
    assert ("= 18 B/param; gradients all-reduced in float32; stage-boundary activations and gradients sent in "
            "float16; dynamic loss scaling (auto: T4 has no bf16)") in progress
    assert zorse_main(["show", str(out)]) == 0
    text = capsys.readouterr().out
    assert "predicted step time" in text and "stage |" in text
    assert f"simulated step time {fmt_seconds(sv['simulated_step_time_s'])}" in text


def test_stage_dp_planner_alone_and_in_the_portfolio(tmp_path):
    """planner="stage_dp" returns the DP's plan without CP-SAT (status STAGE_DP);
    the default planner, which is warm-started by it, is never slower. The CLI
    passes --planner (and --precision) through."""
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, T))
    kw = dict(cluster=CLUSTERS / "small_hetero.yaml", example_inputs=(ids, ids), global_batch_size=8,
              solver_budget=2.0)
    fast = zorse.compile(GPT(GPTConfig(n_layer=2, n_embd=64, block_size=T)), planner="stage_dp", **kw).plan
    best = zorse.compile(GPT(GPTConfig(n_layer=2, n_embd=64, block_size=T)), **kw).plan
    assert fast.solver.status == "STAGE_DP" and fast.solver.planner == "stage_dp"
    assert best.predicted_step_time_s <= fast.predicted_step_time_s
    out = tmp_path / "plan"
    assert zorse_main(["plan", "--model", "gpt", "--cluster", str(CLUSTERS / "small_hetero.yaml"),
                       "--global-batch-size", "8", "--seq-len", "32", "--planner", "stage_dp", "--precision", "fp32",
                       "--tf32", "-o", str(out)]) == 0
    d = json.loads((out / "plan.json").read_text())
    assert d["solver"]["status"] == "STAGE_DP"
    assert (d["precision"], d["grad_reduce_dtype"], d["compute_dtype"], d["tf32"]) == ("fp32", "float32", "float32",
                                                                                       True)


def test_cli_train_runs_plan_on_real_text(tmp_path, capfd):
    """`zorse train` tokenises the Lee corpus and runs the plan under torchrun; its last line sets each
    rank's measured memory peak (metrics.jsonl's last ``memory_peak_bytes``) beside the plan's prediction."""
    out = tmp_path / "plan"
    assert zorse_main(["plan", "--model", "gpt", "--cluster", str(CLUSTERS / "small_hetero.yaml"),
                       "--global-batch-size", "4", "--seq-len", "32", "--solver-budget", "2", "-o", str(out)]) == 0
    capfd.readouterr()
    assert zorse_main(["train", str(out), "--corpus", "lee", "--tokenizer", "bytes", "--steps", "2",
                       "--out", str(tmp_path / "run")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["loss"] > 0 and r["step_time_s"] > 0 for r in rows)
    (line,) = [ln for ln in capfd.readouterr().out.splitlines() if ln.startswith("[zorse] memory peak per rank")]
    plan = zorse.Plan.load(out)
    planned = dict.fromkeys(range(plan.world_size), 0)
    for g in (g for s in plan.stages for g in s.gpus):  # (a rank hosting several stages: their sum)
        planned[g.rank] += g.predicted_memory_bytes + g.predicted_host_memory_bytes
    want = ", ".join(f"{p['rank']}: {p['memory_peak_bytes'] / 2**20:.4g} ({planned[p['rank']] / 2**20:.4g})"
                     for p in rows[-1]["ranks"])
    assert line == f"[zorse] memory peak per rank, MiB resident-set growth (planned): {want}", line


@pytest.mark.xdist_group("cli_plan")  # one worker computes the module fixture once
def test_cli_simulate_writes_trace_and_gantt(cli_plan, tmp_path, capsys):
    out, _ = cli_plan
    cluster = str(CLUSTERS / "small_hetero.yaml")
    assert zorse_main(["simulate", str(out), "--model", "gpt", "--cluster", cluster, "--out", str(tmp_path / "sim")]) == 0
    trace = json.loads((tmp_path / "sim" / "trace.json").read_text())
    assert any(e.get("ph") == "X" and e.get("name", "").startswith("F") for e in trace["traceEvents"])
    assert (tmp_path / "sim" / "gantt.png").stat().st_size > 1000
    assert "simulated step" in capsys.readouterr().out


def test_cli_version_and_one_line_errors(tmp_path, capsys):
    """`zorse --version`; a bad input is one line `zorse: <message>` on stderr
    and exit status 1; `zorse --debug` raises it with its traceback."""
    with pytest.raises(SystemExit) as e:
        zorse_main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"zorse_fx {zorse.__version__} (torch {torch.__version__})"
    argv = ["plan", "--model", "gpt", "--cluster", str(tmp_path / "nope.yaml"), "--global-batch-size", "8",
            "-o", str(tmp_path / "plan")]
    assert zorse_main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("zorse: ") and "nope.yaml" in err and "Traceback" not in err
    with pytest.raises(zorse.ClusterConfigError, match="nope.yaml"):
        zorse_main(["--debug", *argv])
    assert not (tmp_path / "plan").exists()


def test_cli_cuts_long_messages():
    from zorse_fx.cli import MAX_ERROR_CHARS, _one_line

    msg = _one_line(ValueError("x" * (MAX_ERROR_CHARS + 123)))
    assert msg.startswith("x" * MAX_ERROR_CHARS + "... (123 characters more; --debug shows all)")
    assert _one_line(ValueError("short")) == "short"
