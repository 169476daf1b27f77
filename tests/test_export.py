"""`zorse export` ([Note: exporting a checkpoint] in zorse_fx/export.py): a run's checkpoint, under a
sharded pipeline plan, as a Hugging Face directory that transformers loads (ties kept) and that gives
the run's own loss; a non-Hugging Face model as a safetensors state dict; bad input refused."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from conftest import CLUSTERS, FP32, fixed_plan, gpt3x64, spawn_ranks, tiny_llama_config, tiny_llama_tied, \
    with_memory_policy, with_param_sharding
from zorse_fx.cli import main as zorse_main
from zorse_fx.data import global_batch
from zorse_fx.errors import RunDirectoryError
from zorse_fx.evaluate import evaluate_tokens, load_trained
from zorse_fx.export import export_run, model_state
from zorse_fx.models.hf import write_hf_config
from zorse_fx.plan import Plan


def _train(plan, weights, tokens, tmp_path, *, steps: int, hf_config=None):
    plan_dir = tmp_path / "plan"
    plan.export(plan_dir)
    torch.save(weights, plan_dir / "weights.pt")
    if hf_config is not None:
        from transformers import LlamaForCausalLM

        write_hf_config(LlamaForCausalLM(hf_config), plan_dir)
    torch.save(tokens, tmp_path / "tokens.pt")
    spawn_ranks(plan_dir, plan.world_size, ["--tokens", str(tmp_path / "tokens.pt"), "--steps", str(steps),
                                            "--checkpoint-every", "1", "--out", str(tmp_path / "run")])
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def _batch(plan, tokens, step):
    return global_batch(tokens, step - 1, global_batch_size=plan.global_batch_size, seq_len=plan.seq_len,
                        input_names=plan.input_names, label_mode=plan.label_mode)


def test_hf_llama_from_a_zero3_pipeline_loads_with_ties_and_gives_the_runs_loss(lee_bytes, tmp_path, capsys):
    """A tied-embedding Llama trained 2 steps on 2 stages (stage 0 ZeRO-3 over 2 GPUs: its parameters saved
    as ranges). Step 1's export, loaded by AutoModelForCausalLM.from_pretrained, computes the loss the run
    logged at step 2 on step 2's batch (the weights after step 1; FP32 tolerance); its lm_head is its
    embedding. Step 2's export in bfloat16 holds the float32 export's weights rounded once."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    captured = tiny_llama_tied()
    plan = fixed_plan(captured, ((0, 1), (2,)), ((2, 1), (3,)), num_microbatches=2, global_batch_size=6, cuts=(2,),
                      label_mode="same")
    plan = with_param_sharding(with_memory_policy(plan, sharded={0}), stages={0})
    assert plan.stages[0].param_sharded
    tokens = lee_bytes[:20000]
    rows = _train(plan, captured.state(), tokens, tmp_path, steps=2, hf_config=tiny_llama_config())
    keys = json.loads((tmp_path / "run" / "checkpoints" / "step_1" / "zorse_checkpoint.json").read_text())
    assert keys["step"] == 1
    out = tmp_path / "hf1"
    assert zorse_main(["export", str(tmp_path / "run"), "--step", "1", "--hf", str(out), "--plan",
                       str(tmp_path / "plan")]) == 0
    assert {"config.json", "model.safetensors", "zorse_export.json"} <= {p.name for p in out.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    batch = _batch(plan, tokens, 2)
    with torch.no_grad():
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    assert float(loss) == pytest.approx(rows[1]["loss"], rel=FP32.loss_rel)
    # the newest checkpoint (step 2), in float32 and bfloat16
    f32 = export_run(tmp_path / "run", tmp_path / "hf2", plan=tmp_path / "plan", progress=lambda _: None)
    b16 = export_run(tmp_path / "run", tmp_path / "hf2_bf16", dtype="bfloat16", plan=tmp_path / "plan",
                     progress=lambda _: None)
    assert (f32.step, b16.step, f32.kind) == (2, 2, "hf")
    a, b = load_file(tmp_path / "hf2" / "model.safetensors"), load_file(tmp_path / "hf2_bf16" / "model.safetensors")
    assert a.keys() == b.keys() and all(b[k].dtype == torch.bfloat16 for k in b)
    assert all(torch.equal(a[k].to(torch.bfloat16), b[k]) for k in a)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf2_bf16").dtype == torch.bfloat16
    # fine-tuning the export: `zorse plan --model <its directory>` (issue 48 item 3) plans it with its weights
    plan_out = tmp_path / "finetune"
    assert zorse_main(["plan", "--model", str(tmp_path / "hf2"), "--cluster", str(CLUSTERS / "small_hetero.yaml"),
                       "--planner", "stage_dp", "--global-batch-size", "4", "--seq-len", "32", "-o",
                       str(plan_out)]) == 0
    assert Plan.load(plan_out).model_name == str((tmp_path / "hf2").resolve())
    assert (plan_out / "hf_config.json").is_file()
    planned = torch.load(plan_out / "weights.pt")
    assert all(torch.equal(planned["model." + k], v) for k, v in a.items())
    # zorse eval (issue 48 item 4): the run's step-1 checkpoint and its export give one loss, whatever the batch
    run, exp = load_trained(tmp_path / "run", step=1, plan=tmp_path / "plan"), load_trained(out)
    assert (run.label_mode, exp.label_mode, run.seq_len, exp.seq_len) == ("same", "same", 32, None)
    held = tokens[-2000:]
    r1 = evaluate_tokens(run.model, run.label_mode, held, seq_len=32, batch_size=4)
    r2 = evaluate_tokens(exp.model, exp.label_mode, held, seq_len=32, batch_size=1)
    assert (r1.sequences, r1.tokens) == (2000 // 32, 2000 // 32 * 31)
    # (batches of 4 and of 1: a BLAS may sum each logit's 32-64 products in another order per shape, float32
    # rounding ~1e-6 of a logit at most, averaged over 1,922 tokens)
    assert r1.loss == pytest.approx(r2.loss, rel=1e-5) and r1.perplexity == pytest.approx(math.exp(r1.loss))
    capsys.readouterr()
    assert zorse_main(["eval", str(tmp_path / "run"), "--plan", str(tmp_path / "plan"), "--step", "1", "--data",
                       str(tmp_path / "tokens.pt"), "--max-sequences", "4"]) == 0
    assert re.search(r"\[zorse\] eval .*step_1 .* loss \d+\.\d{4}, perplexity \d+\.\d\d over 124 predicted tokens "
                     r"\(4 sequences of 32, float32\)", capsys.readouterr().out)


def test_eval_of_an_untrained_model_by_name(lee_bytes, tmp_path, capsys):
    """`zorse eval gpt`: the registry's GPT as initialised (weights of std 0.02: near-uniform logits), whose loss
    on bytes is within 0.1 of ln 256 = 5.545."""
    torch.save(lee_bytes[:4000], tmp_path / "tokens.pt")
    assert zorse_main(["eval", "gpt", "--data", str(tmp_path / "tokens.pt"), "--seq-len", "64",
                       "--max-sequences", "16"]) == 0
    loss = float(re.search(r"loss (\d+\.\d+)", capsys.readouterr().out).group(1))
    assert abs(loss - math.log(256)) < 0.1
    assert zorse_main(["eval", "gpt", "--data", str(tmp_path / "tokens.pt")]) == 1
    assert "give --seq-len (tokens per sequence)" in capsys.readouterr().err


def test_model_directory_that_is_no_hf_model_is_refused(tmp_path, capsys):
    """`--model DIR`: a missing directory, one without config.json, one whose weights are missing: one line
    each, naming the directory and what it needs."""
    from zorse_fx.models.registry import load_model

    with pytest.raises(ValueError, match=r"--model \./nowhere: no such directory; give a Hugging Face model "
                                         r"directory \(config.json and weights"):
        load_model("./nowhere")
    with pytest.raises(ValueError, match=r"no config.json in the directory; it is not a Hugging Face model "
                                         r"directory"):
        load_model(str(tmp_path))
    tiny_llama_config().save_pretrained(tmp_path / "cfg_only")
    with pytest.raises(ValueError, match=r"transformers cannot load it as a causal LM offline \(.*\); give a "
                                         r"directory of a decoder-only causal LM with its weights"):
        load_model(str(tmp_path / "cfg_only"))
    with pytest.raises(SystemExit, match=r"zorse: --model .*: no config.json in the directory"):
        zorse_main(["plan", "--model", str(tmp_path), "--cluster", str(CLUSTERS / "small_hetero.yaml"),
                    "--global-batch-size", "4", "--seq-len", "32", "-o", str(tmp_path / "p")])
    assert zorse_main(["eval", str(tmp_path / "cfg_only"), "--data", "x.bin", "--seq-len", "8"]) == 1
    assert "transformers cannot load it as a causal LM offline" in capsys.readouterr().err


def test_non_hf_model_exports_its_state_dict_and_bad_input_is_refused(lee_bytes, tmp_path, capsys):
    """A GPT (not a Hugging Face model) on 2 ranks: the export is model.safetensors under its canonical names,
    equal to the checkpoint's parameters, and the GPT loaded from it gives the run's step-2 loss. Refused,
    writing nothing: a step with no checkpoint (naming the steps), a directory that holds files, a run
    without checkpoints."""
    from safetensors.torch import load_file

    captured = gpt3x64()
    plan = fixed_plan(captured, ((0,), (2,)), ((4,), (4,)), num_microbatches=1, global_batch_size=4, cuts=(2,))
    tokens = lee_bytes[:20000]
    rows = _train(plan, captured.state(), tokens, tmp_path, steps=2)
    res = export_run(tmp_path / "run", tmp_path / "st", step=1, plan=tmp_path / "plan", progress=lambda _: None)
    assert res.kind == "safetensors" and "model.safetensors" in res.files
    sd = load_file(tmp_path / "st" / "model.safetensors")
    ckpt = model_state(tmp_path / "run" / "checkpoints" / "step_1", torch.load(tmp_path / "plan" / "weights.pt"))
    assert sd.keys() == ckpt.keys() and all(torch.equal(sd[k], ckpt[k]) for k in sd)
    batch = _batch(plan, tokens, 2)
    with torch.no_grad():  # the captured GPT with the exported tensors (ties kept: functional_call's default)
        loss = torch.func.functional_call(captured.graph_module, sd, tuple(batch[n] for n in plan.input_names))
    assert float(loss) == pytest.approx(rows[1]["loss"], rel=FP32.loss_rel)

    with pytest.raises(RunDirectoryError, match=re.escape("--step 7: no checkpoint of that step; its checkpoints are "
                                                          "of steps 1, 2")):
        export_run(tmp_path / "run", tmp_path / "x", step=7, plan=tmp_path / "plan", progress=lambda _: None)
    assert not (tmp_path / "x").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("keep")
    assert zorse_main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "full"), "--plan",
                       str(tmp_path / "plan")]) == 1
    assert "exists and is not an empty directory; give a new directory" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["mine.txt"]
    (tmp_path / "empty_run").mkdir()
    with pytest.raises(RunDirectoryError, match=r"no checkpoint under .*checkpoints \(`zorse train --out"):
        export_run(tmp_path / "empty_run", tmp_path / "y", plan=tmp_path / "plan", progress=lambda _: None)


@pytest.mark.parametrize("layout", ["interleaved_zero1_bf16_working_weights", "zero2_offload"])
def test_export_of_each_layout_holds_the_ranks_parameters(layout, lee_bytes, tmp_path):
    """The export of a run's last checkpoint holds exactly the parameters its ranks end with (``--dump-params``):
    interleaved stages with ZeRO-1 and 16-bit working weights (bf16-mixed: the float32 masters, saved by
    range, joined), and a ZeRO-2 stage with its optimizer offloaded (fp32). (ZeRO-3: the Llama test above.)"""
    from safetensors.torch import load_file

    from conftest import gpt4x64, run_distributed, with_grad_sharding, with_low_precision
    from test_offload import with_offload
    from test_zero2 import _two_stage_plan

    if layout == "zero2_offload":
        captured = gpt3x64()
        plan, extra = with_offload(with_grad_sharding(_two_stage_plan(captured), {1}), {1}), ()
        assert plan.stages[1].grad_sharded and plan.stages[1].offload_optimizer
    else:
        captured = gpt4x64()
        plan = fixed_plan(captured, ((0, 1), (2,), (0, 1), (2,)), ((2, 1), (3,), (2, 1), (3,)), num_microbatches=3,
                          global_batch_size=9, interleave=2)
        plan = with_low_precision(with_memory_policy(plan, sharded={0, 2}), captured)
        assert plan.stages[0].low_precision_params
        extra = ("--precision", "bf16-mixed")
    run_distributed(plan, captured.state(), lee_bytes, tmp_path, steps=2, extra=("--dump-params", *extra))
    res = export_run(tmp_path / "run", tmp_path / "out", plan=tmp_path / "plan", progress=lambda _: None)
    assert res.step == 2
    exported = load_file(tmp_path / "out" / "model.safetensors")
    params = {r: torch.load(tmp_path / "run" / "params" / f"rank{r}.pt") for r in range(plan.world_size)}
    masters = {r: torch.load(tmp_path / "run" / "params" / f"rank{r}_masters.pt") for r in range(plan.world_size)}
    trained = set()
    for canon, value in exported.items():
        ranges = sorted((a, b, t) for m in masters.values() for a, b, t in m.get(canon, ()))
        if ranges:  # a 16-bit working weight: its float32 masters are the parameter
            joined = torch.cat([t.reshape(-1).float() for _, _, t in ranges]).view(value.shape)
            assert torch.equal(value, joined), canon
            trained.add(canon)
        else:
            held = [p[canon].float() for p in params.values() if canon in p]
            if held:  # one copy exactly; a tied copy another stage updated (here on the host) within float32
                assert any(torch.equal(value, h) for h in held), canon  # rounding of its largest elements
                for h in held:
                    torch.testing.assert_close(value, h, rtol=0.0, atol=2**-22 * float(h.abs().max()), msg=canon)
                trained.add(canon)
    assert trained == {c for p in params.values() for c in p}  # every parameter a rank trains is exported
