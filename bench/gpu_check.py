"""``make gpu-check``: the prepared check that runs first whenever a GPU is at hand.

Two phases, because the GPU machine has torch and Triton but no OR-Tools:

``prepare`` (here, ``make gpu-check-prepare``): for each GPU type (H100-80GB,
H200) a one-GPU cluster, the model captured and a one-stage plan made with
``plan_fixed`` at bf16-mixed, and the token file, all under ``.gpu_check/``
(ignored by git; carried to the GPU machine), with the wheels the GPU image
lacks (``.gpu_check/wheels``: msgspec, tyro and its needs).

``run`` (there, ``make gpu-check``), world size 1, in this order:

(a) ``kernels``: ``pytest tests/test_kernels.py``, the Triton kernels compiled.
(b) ``train``: the model under the plan over NCCL (world size 1: one GPU
    cannot hold two NCCL ranks, so the point-to-point program is empty; the
    gradient path, autocast, the optimizer, the collectives of the step
    loop and the checkpoint run on the GPU), ``--steps`` steps at bf16-mixed;
    step-1 loss against the single-process Hugging Face model on the same
    batch under the same autocast (relative tolerance 2e-3: bfloat16 keeps 8
    bits, 2^-8 = 3.9e-3 per rounding, and both sides round the same ops), and
    the loss falling (mean of the last 5 steps below the first step's).
(c) ``memory``: ``torch.cuda.max_memory_allocated`` over the run against the
    plan's predicted peak of the GPU (ratio; the layout is the replicated one
    until sharded layouts exist).
(d) ``step_time``: the median measured step (steps 3..) against the plan's
    predicted step from the shipped profile of that GPU (ratio).
(e) ``resume``: the run's checkpoint at step ``steps/2`` resumed on CUDA; the
    resumed steps' losses against the first run's (relative tolerance 1e-2:
    bfloat16 rounding of ``steps/2`` steps, and atomics in the embedding
    backward that sum in another order).
(f) ``offload``: the same one-stage plan with the optimizer and the
    activations offloaded (``prepare`` plans it on a cluster whose node gives
    ``host_memory_GiB``: [C-offload], [C-act-offload]), ``OFFLOAD_STEPS``
    steps: the losses against the first run's (relative 2e-3 at step 1, the
    same arithmetic before any update; 1e-2 after, the CPU's fused AdamW
    summing in another order than the GPU's), ``max_memory_allocated``
    against the offloaded plan's predicted device peak, the median step
    against its predicted step (the PCIe copies and the CPU step priced
    from the cluster file's defaults: ``cluster/host.py``). One GPU cannot
    shard a stage, so ZeRO-3 + offload needs two.
(i) ``stash``: the same one-stage plan recomputing with its blocks' inputs
    in host memory ([C-stash]; [Note: host-stashed recomputation] in
    ``runtime/block_stash.py``), checked as (f): the losses against the first
    run's, ``max_memory_allocated`` against the predicted device peak, the
    median step against the predicted step (the copies on a side stream,
    priced behind the compute: this is their first measurement on a GPU).
(g) ``hf``: the same model, batches and precision trained by Hugging Face
    eager and by ``torch.compile``d Hugging Face (gradient accumulation over
    the plan's micro-batches, torch's AdamW), ``HF_STEPS`` steps each: the
    median step (steps 3..) and tokens/s beside zorse_fx's one-GPU plan's
    (issue 49 item 5). The dry run compiles with the ``aot_eager`` backend
    (no C++ toolchain needed on a CPU; the GPU run uses inductor).
(h) ``calibration``: the run's own timings (``timings.jsonl``) against the
    plan's prices (``zorse calibrate``'s fit, [Note: calibration] in
    ``cost/calibration.py``), written as ``<out>/calibration_<type>.json``
    beside the report: the measured forward and backward against the shipped
    profile's prices and against the GPU-class model's (priced with no
    profile), the whole model being the one stage (issue 49 item 5). The
    model is captured again on the GPU machine (no OR-Tools is needed to
    price).

It writes ``<out>/gpu_check_<type>.json`` (one object: the environment and
each part's numbers and verdict) and exits 1 if a part failed.

The model is SmolLM2-135M's architecture (``SMOLLM2_135M``: Llama, 30 layers,
576 wide, vocabulary 49152; HuggingFaceTB/SmolLM2-135M ``config.json``) with
seeded random weights: the real weights ship as a 98 MB GGUF, above the
64 MiB a GPU call can carry. The tokens are the Lee corpus, byte-tokenized.

``--dry-run`` (``tests/test_gpu_check.py``, part of ``make test``): the same
command on this CPU with a 2-layer model of the same family, Gloo, a few
steps, and a subset of the kernel tests under ``TRITON_INTERPRET=1``, so the
script cannot rot while no GPU is at hand.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: HuggingFaceTB/SmolLM2-135M config.json (https://huggingface.co/HuggingFaceTB/SmolLM2-135M/blob/main/config.json).
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)
#: The dry run's model: the same family, 2 layers, 64 wide, byte vocabulary.
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=100000.0,
            tie_word_embeddings=True)
#: GPU type of the cluster table -> substrings of ``torch.cuda.get_device_name``.
GPU_TYPES = {"H100-80GB": ("H100",), "H200": ("H200",)}
#: (model, seq_len, microbatch size, micro-batches, steps) of the GPU run and of the dry run.
SHAPES = {"gpu": ("smollm2-135m", 512, 8, 2, 20), "dry": ("tiny", 32, 2, 2, 4)}
#: Steps of (f), the offloaded run (its first ones are compared with the first run's).
OFFLOAD_STEPS = 6
#: Steps of each Hugging Face run of (g) (the first two, compilation's included, not timed), on a GPU and on
#: the dry run (which only keeps the code from rotting: its times mean nothing).
HF_STEPS = {"gpu": 8, "dry": 3}
#: Host memory the offload plan's node declares, GiB (the GPU machines have 128 GiB).
OFFLOAD_HOST_GIB = 64
#: The wheels ``prepare`` downloads for the GPU image (Python 3.12): what zorse_fx imports that it lacks.
WHEELS = ("msgspec==0.19.0", "tyro==1.0.17", "docstring-parser==0.17.0", "typeguard==4.4.4")


def build_model(name: str):
    """SmolLM2-135M's architecture (``"smollm2-135m"``) or the dry run's
    (``"tiny"``): a float32 ``LlamaForCausalLM``, weights seeded with 0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**(SMOLLM2_135M if name == "smollm2-135m" else TINY))
    return LlamaForCausalLM(config).float().eval()


class _Loss(torch.nn.Module):
    """``model(input_ids, labels=labels).loss`` (Hugging Face shifts the labels): what the plan's stages compute."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


def _captured(name: str, seq_len: int):
    from zorse_fx.capture import capture

    ids = torch.randint(0, 256, (2, seq_len), generator=torch.Generator().manual_seed(1))
    return capture(_Loss(build_model(name)), (ids, ids))


# -- prepare (here) ---------------------------------------------------------------------------------

def one_gpu_cluster(gpu_type: str):
    """The cluster of one ``gpu_type`` GPU the check plans for (and (h) prices on)."""
    from zorse_fx.cluster import Cluster

    return Cluster.from_dict({"name": f"one-{gpu_type}", "nodes": [{"name": "gpu-node", "gpus": [
        {"type": gpu_type, "count": 1}]}], "links": {"intra_node": {"bandwidth_GBps": 900, "latency_us": 5}}})


def prepare(out: Path, *, shape: str, types: list[str], wheels: bool) -> None:
    """Plans, token file and wheels for ``run``, under ``out`` (see the module docstring)."""
    from zorse_fx.capture import analyse
    from zorse_fx.cluster import Cluster
    from zorse_fx.planner import PlanOptions, plan_fixed
    from zorse_fx.pricing import price
    from zorse_fx.solve import Decision, StageMemory
    from zorse_fx.token_data import prepare_data

    name, seq, mb, m, steps = SHAPES[shape]
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    captured = _captured(name, seq)
    nb = analyse(captured).num_blocks
    print(f"[gpu-check] captured {name} ({nb} blocks) in {time.perf_counter() - t0:.0f} s", flush=True)
    for gpu_type in types:
        cluster = one_gpu_cluster(gpu_type)
        options = PlanOptions(global_batch_size=mb * m, precision="bf16-mixed")
        blocks = price(captured, cluster, options).costs.num_blocks  # after merging to max_blocks
        plan, _ = plan_fixed(captured, cluster, options,
                             Decision(stage_blocks=((0, blocks),), stage_gpus=((0,),), samples_per_microbatch=((mb,),),
                                      num_microbatches=m), model_name=name, label_mode="same")
        plan.export(out / gpu_type)
        print(f"[gpu-check] {gpu_type}: predicted step {plan.predicted_step_time_s * 1e3:.1f} ms, peak "
              f"{plan.stages[0].gpus[0].predicted_memory_bytes / 2**30:.2f} GiB -> {out / gpu_type}", flush=True)
        # (f): the same stage with the optimizer and the activations in host memory.
        hosted = Cluster.from_dict({**cluster.to_dict(), "nodes": [
            {**n, "host_memory_GiB": OFFLOAD_HOST_GIB} for n in cluster.to_dict()["nodes"]]})
        plan, _ = plan_fixed(captured, hosted, options,
                             Decision(stage_blocks=((0, blocks),), stage_gpus=((0,),), samples_per_microbatch=((mb,),),
                                      num_microbatches=m,
                                      memory=(StageMemory(optimizer="host", activations="host"),)),
                             model_name=name, label_mode="same")
        plan.export(out / f"{gpu_type}_offload")
        print(f"[gpu-check] {gpu_type} offloaded: predicted step {plan.predicted_step_time_s * 1e3:.1f} ms, peak "
              f"{plan.stages[0].gpus[0].predicted_memory_bytes / 2**30:.2f} GiB + "
              f"{plan.stages[0].gpus[0].predicted_host_memory_bytes / 2**30:.2f} GiB host", flush=True)
        # (i): the same stage recomputing from its blocks' inputs kept in host memory ([C-stash]).
        plan, _ = plan_fixed(captured, hosted, options,
                             Decision(stage_blocks=((0, blocks),), stage_gpus=((0,),), samples_per_microbatch=((mb,),),
                                      num_microbatches=m, memory=(StageMemory(recompute=True, stash="host"),)),
                             model_name=name, label_mode="same")
        plan.export(out / f"{gpu_type}_stash")
        print(f"[gpu-check] {gpu_type} stashed: predicted step {plan.predicted_step_time_s * 1e3:.1f} ms, peak "
              f"{plan.stages[0].gpus[0].predicted_memory_bytes / 2**30:.2f} GiB + "
              f"{plan.stages[0].gpus[0].predicted_host_memory_bytes / 2**30:.2f} GiB host", flush=True)
    tokens = (2 * steps + 2) * mb * m * (seq + 1)
    prepare_data("lee", out / "tokens", tokenizer="bytes", max_tokens=tokens, progress=False)
    (out / "prepared.json").write_text(json.dumps({"model": name, "seq_len": seq, "microbatch_size": mb,
                                                   "num_microbatches": m, "steps": steps, "types": types}) + "\n")
    if wheels:
        (out / "wheels").mkdir(exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_17_x86_64",
                        "--platform", "manylinux2014_x86_64", "-d", str(out / "wheels"), *WHEELS], check=True)


# -- run (there) --------------------------------------------------------------------------------------

def _device_type() -> str:
    """The prepared GPU type of CUDA device 0, from its name (``GPU_TYPES``)."""
    name = torch.cuda.get_device_name(0)
    for gpu_type, marks in GPU_TYPES.items():
        if any(mark in name for mark in marks):
            return gpu_type
    raise SystemExit(f"gpu-check: no prepared plan for {name!r} (prepared: {', '.join(GPU_TYPES)}); pass "
                     f"--device-type with one of them")


def _kernels(dry: bool, k: str | None) -> dict:
    """(a): the kernel tests, compiled on the GPU (interpreted on the dry run)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_kernels.py")]
    if k:
        cmd += ["-k", k]
    env = {**os.environ, **({"TRITON_INTERPRET": "1"} if dry else {})}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    last = (r.stdout.strip().splitlines() or [""])[-1]
    return {"command": " ".join(cmd[2:]), "summary": last, "seconds": round(time.perf_counter() - t0, 1),
            "ok": r.returncode == 0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(options) -> list[dict]:
    """``python -m zorse_fx.train`` in this process as a world of one (torchrun's environment
    set by hand), ``options`` a ``TrainingOptions``; its metrics rows."""
    from zorse_fx.train import main as train_main
    from zorse_fx.train_options import OPTIONS_FILE, write_options_file

    out = Path(options.job.out)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    code = train_main(["--options-file", str(write_options_file(options, out / OPTIONS_FILE))])
    if code:
        raise RuntimeError(f"zorse_fx.train exited with {code}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def run(prepared: Path, out: Path, *, shape: str, device_type: str | None, kernels_k: str | None) -> int:
    """The check (see the module docstring); writes ``out/gpu_check_<type>.json``; 1 if a part failed."""
    from zorse_fx.plan import Plan
    from zorse_fx.token_data import TokenData
    from zorse_fx.train_options import (CheckpointOptions, DataOptions, JobOptions, LoopOptions, TestingOptions,
                                        TrainingOptions)

    dry = shape == "dry"
    meta = json.loads((prepared / "prepared.json").read_text())
    gpu_type = device_type or ("H200" if dry else _device_type())
    work = out / f"gpu_check_{gpu_type}_run"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    plan_dir = work / "plan"
    shutil.copytree(prepared / gpu_type, plan_dir)
    plan = Plan.load(plan_dir)
    cuda = torch.cuda.is_available() and not dry
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    report: dict = {"gpu_type": gpu_type, "dry_run": dry, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "env": {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
                            "python": sys.version.split()[0]},
                    "model": meta["model"], "seq_len": meta["seq_len"], "global_batch_size": plan.global_batch_size}
    try:
        import triton

        report["env"]["triton"] = triton.__version__
    except ImportError:
        pass
    report["kernels"] = _kernels(dry, kernels_k)
    print(f"[gpu-check] (a) kernels: {report['kernels']['summary']}", flush=True)

    # (b) the weights by the plan's canonical names: the model rebuilt with the same seed; its canonical names are
    # its parameters' and buffers' (tied weights under their first name), so it need not be captured again here.
    model = _Loss(build_model(meta["model"]))
    state = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    wanted = {c for st in plan.stages for c in (*st.params.values(), *st.consts.values())}
    if wanted - state.keys():
        raise SystemExit(f"gpu-check: the plan needs tensors the model lacks: {sorted(wanted - state.keys())[:5]}")
    torch.save({k: state[k].detach().contiguous() for k in sorted(wanted)}, plan_dir / "weights.pt")
    data = TokenData.open(prepared / "tokens.bin")
    first = data.global_batch(0, global_batch_size=plan.global_batch_size, seq_len=plan.seq_len,
                              input_names=plan.input_names, label_mode=plan.label_mode)
    policy = plan.precision_policy()
    model = model.to(device)
    with torch.no_grad(), policy.autocast(device.type):
        ref = float(model(first["input_ids"].to(device), first["labels"].to(device)))
    del model
    steps = meta["steps"]
    options = TrainingOptions(
        data=DataOptions(plan=str(plan_dir), data=str(prepared / "tokens.bin")),
        loop=LoopOptions(steps=steps), checkpoint=CheckpointOptions(checkpoint_every=steps // 2, keep_checkpoints=3),
        job=JobOptions(out=str(work / "a"), backend="nccl" if cuda else "gloo", precision=plan.precision,
                       heartbeat_s=0.0),
        testing=TestingOptions())
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    rows = _train(options)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    losses = [r["loss"] for r in rows]
    rel = abs(losses[0] - ref) / abs(ref)
    report["train"] = {"steps": steps, "losses": losses, "step1_loss": losses[0], "hf_step1_loss": ref,
                       "relative_difference": rel, "tolerance": 2e-3, "precision": rows[0]["precision"],
                       "ok": rel <= 2e-3 and statistics.mean(losses[-5:]) < losses[0]}
    print(f"[gpu-check] (b) train: step-1 loss {losses[0]:.5f} vs Hugging Face {ref:.5f} (relative {rel:.1e}); "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)

    predicted = plan.stages[0].gpus[0].predicted_memory_bytes
    report["memory"] = {"layout": "replicated", "measured_peak_bytes": peak, "predicted_peak_bytes": predicted,
                        "ratio": peak / predicted if peak and predicted else None,
                        "note": None if cuda else "not measured on a CPU"}
    times = [r["step_time_s"] for r in rows[2:]] or [r["step_time_s"] for r in rows]
    measured = statistics.median(times)
    report["step_time"] = {"measured_median_s": measured, "predicted_s": plan.predicted_step_time_s,
                           "ratio": measured / plan.predicted_step_time_s if plan.predicted_step_time_s else None,
                           "tokens_per_s": plan.tokens_per_step / measured}
    if cuda:
        print(f"[gpu-check] (c) memory: peak {peak / 2**30:.2f} GiB measured vs {predicted / 2**30:.2f} GiB "
              f"predicted (ratio {report['memory']['ratio']:.2f})", flush=True)
    print(f"[gpu-check] (d) step time: {measured * 1e3:.1f} ms measured vs {plan.predicted_step_time_s * 1e3:.1f} "
          f"ms predicted (ratio {report['step_time']['ratio']:.2f})", flush=True)

    # (e) resume from the middle checkpoint: the later steps again, equal to the first run's
    second = work / "b"
    shutil.copytree(work / "a", second)
    for ckpt in (second / "checkpoints").glob("step_*"):
        if int(ckpt.name.split("_")[1]) > steps // 2:
            shutil.rmtree(ckpt)
    again = _train(TrainingOptions(
        data=options.data, loop=options.loop, checkpoint=CheckpointOptions(resume=True),
        job=JobOptions(out=str(second), backend=options.job.backend, precision=plan.precision, heartbeat_s=0.0)))
    resumed = {r["step"]: r["loss"] for r in again if r["step"] > steps // 2}
    worst = max(abs(resumed[s] - losses[s - 1]) / abs(losses[s - 1]) for s in resumed)
    report["resume"] = {"from_step": steps // 2, "steps": sorted(resumed), "max_relative_difference": worst,
                        "tolerance": 1e-2, "ok": len(resumed) == steps - steps // 2 and worst <= 1e-2}
    print(f"[gpu-check] (e) resume at step {steps // 2}: {len(resumed)} steps again, largest relative loss "
          f"difference {worst:.1e}", flush=True)
    report["offload"] = _offload(prepared / f"{gpu_type}_offload", work, plan_dir, prepared, losses, cuda, device)
    report["stash"] = _offload(prepared / f"{gpu_type}_stash", work, plan_dir, prepared, losses, cuda, device,
                               part="(i) stash")
    report["hf"] = _hf_baselines(meta["model"], data, plan, device, dry, report["step_time"]["tokens_per_s"])
    report["calibration"] = _calibration(meta, gpu_type, plan, work / "a", out, dry)
    report["ok"] = all(report[k]["ok"] for k in ("kernels", "train", "resume", "offload", "stash", "hf", "calibration"))
    path = out / f"gpu_check_{gpu_type}{'_dry' if dry else ''}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"[gpu-check] {'passed' if report['ok'] else 'FAILED'}: wrote {path}", flush=True)
    return 0 if report["ok"] else 1


def _offload(prepared_plan: Path, work: Path, plan_dir: Path, prepared: Path, losses: list[float], cuda: bool,
             device, part: str = "(f) offload") -> dict:
    """(f): the offloaded plan (or (i), ``part``: the stashing plan) trained ``OFFLOAD_STEPS`` steps from the
    same weights and batches."""
    from zorse_fx.plan import Plan
    from zorse_fx.train_options import DataOptions, JobOptions, LoopOptions, TrainingOptions

    if not prepared_plan.exists():  # prepared before (f) existed
        print(f"[gpu-check] {part}: not prepared (run make gpu-check-prepare again)", flush=True)
        return {"ok": True, "note": "not prepared"}
    off_dir = work / f"plan_{prepared_plan.name.rsplit('_', 1)[-1]}"
    shutil.copytree(prepared_plan, off_dir)
    shutil.copy(plan_dir / "weights.pt", off_dir / "weights.pt")
    plan = Plan.load(off_dir)
    steps = min(OFFLOAD_STEPS, len(losses))
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    rows = _train(TrainingOptions(
        data=DataOptions(plan=str(off_dir), data=str(prepared / "tokens.bin")), loop=LoopOptions(steps=steps),
        job=JobOptions(out=str(work / off_dir.name), backend="nccl" if cuda else "gloo", precision=plan.precision,
                       heartbeat_s=0.0)))
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    got = [r["loss"] for r in rows]
    rel = [abs(a - b) / abs(b) for a, b in zip(got, losses)]
    g = plan.stages[0].gpus[0]
    times = [r["step_time_s"] for r in rows[2:]] or [r["step_time_s"] for r in rows]
    measured = statistics.median(times)
    out = {"steps": steps, "losses": got, "relative_difference": rel, "tolerance": [2e-3, 1e-2],
           "measured_peak_bytes": peak, "predicted_peak_bytes": g.predicted_memory_bytes,
           "predicted_host_bytes": g.predicted_host_memory_bytes,
           "memory_ratio": peak / g.predicted_memory_bytes if peak else None,
           "measured_median_step_s": measured, "predicted_step_s": plan.predicted_step_time_s,
           "step_ratio": measured / plan.predicted_step_time_s if plan.predicted_step_time_s else None,
           "ok": len(got) == steps and rel[0] <= 2e-3 and max(rel) <= 1e-2}
    print(f"[gpu-check] {part}: losses within {max(rel):.1e} of the first run's; "
          + (f"peak {peak / 2**30:.2f} GiB measured vs {g.predicted_memory_bytes / 2**30:.2f} GiB predicted "
             f"(ratio {out['memory_ratio']:.2f}); " if peak else "")
          + f"step {measured * 1e3:.1f} ms vs {plan.predicted_step_time_s * 1e3:.1f} ms predicted "
            f"(ratio {out['step_ratio']:.2f})", flush=True)
    return out


def _hf_baselines(name: str, data, plan, device, dry: bool, zorse_tokens_per_s: float) -> dict:
    """(g): Hugging Face eager and ``torch.compile``d, the plan's batches, micro-batches and precision."""
    policy = plan.precision_policy()
    mb, m = plan.microbatch_size, plan.num_microbatches
    steps = HF_STEPS["dry" if dry else "gpu"]
    out: dict = {"steps": steps, "zorse_fx_tokens_per_s": zorse_tokens_per_s}
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for label in ("eager", "compiled"):
        model = _Loss(build_model(name)).to(device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda" or None)
        backend = "aot_eager" if dry else "inductor"
        step_fn = model if label == "eager" else torch.compile(model, backend=backend)
        times, losses = [], []
        for step in range(steps):
            batch = data.global_batch(step, global_batch_size=plan.global_batch_size, seq_len=plan.seq_len,
                                      input_names=plan.input_names, label_mode=plan.label_mode)
            ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
            sync()
            t0 = time.perf_counter()
            total = 0.0
            for k in range(m):
                with policy.autocast(device.type):
                    loss = step_fn(ids[k * mb:(k + 1) * mb], labels[k * mb:(k + 1) * mb]) / m
                loss.backward()
                total += float(loss.detach())
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            times.append(time.perf_counter() - t0)
            losses.append(total)
        step_s = statistics.median(times[2:])
        out[label] = {"median_step_s": step_s, "tokens_per_s": plan.tokens_per_step / step_s,
                      "first_step_s": times[0], "losses": losses,
                      **({"backend": backend} if label == "compiled" else {})}
        del model, opt, step_fn
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["ok"] = all(math.isfinite(x) for k in ("eager", "compiled") for x in out[k]["losses"])
    print(f"[gpu-check] (g) tokens/s: zorse_fx {zorse_tokens_per_s:,.0f}, Hugging Face eager "
          f"{out['eager']['tokens_per_s']:,.0f}, torch.compile ({out['compiled']['backend']}) "
          f"{out['compiled']['tokens_per_s']:,.0f}", flush=True)
    return out


def _calibration(meta: dict, gpu_type: str, plan, run_dir: Path, out: Path, dry: bool) -> dict:
    """(h): the run's timings against the shipped profile's and the class model's prices; the calibration from
    the shipped profile's written beside the report."""
    from zorse_fx.cost.calibration import write_calibration
    from zorse_fx.pricing import options_for_plan, price
    from zorse_fx.profiling.calibrate import calibrate_run

    t0 = time.perf_counter()
    captured = _captured(meta["model"], meta["seq_len"])
    cluster = one_gpu_cluster(gpu_type)
    res: dict = {"captured_s": round(time.perf_counter() - t0, 1), "run": str(run_dir)}
    for label, overrides in (("shipped_profile", {}), ("class_model", {"profiles": ()})):
        priced = price(captured, cluster, options_for_plan(plan, **overrides))
        cal = calibrate_run(run_dir, plan, priced)
        g = cal.gpus[0]
        res[label] = {"sources": {t: dict(v) for t, v in priced.cost_sources.items()},
                      "forward_measured_s": g.forward_measured_s, "forward_priced_s": g.forward_priced_s,
                      "backward_measured_s": g.backward_measured_s, "backward_priced_s": g.backward_priced_s,
                      "optimizer_measured_s": g.optimizer_measured_s, "optimizer_priced_s": g.optimizer_priced_s,
                      "step_measured_s": cal.runs[0].measured_step_s,
                      "step_objective_s": cal.runs[0].objective_step_s,
                      "step_calibrated_objective_s": cal.runs[0].calibrated_objective_step_s}
        if label == "shipped_profile":
            path = write_calibration(cal, out / f"calibration_{gpu_type}{'_dry' if dry else ''}.json")
            res["file"] = str(path)
    sp = res["shipped_profile"]
    res["calibrated_self_error"] = sp["step_calibrated_objective_s"] / sp["step_measured_s"] - 1
    # issue 49's bar (a run's calibration re-predicts its step within 5%) is reported, not a verdict: like (d)'s
    # step ratio it is a measurement of the model, and the check's verdict is about correctness
    res["within_5_percent"] = abs(res["calibrated_self_error"]) <= 0.05
    res["ok"] = Path(res["file"]).is_file() and all(
        math.isfinite(v) for r in (res["shipped_profile"], res["class_model"]) for k, v in r.items()
        if k.endswith("_s"))
    for label in ("shipped_profile", "class_model"):
        r = res[label]
        print(f"[gpu-check] (h) {label.replace('_', ' ')}: forward {r['forward_measured_s'] * 1e3:.1f} ms measured "
              f"vs {r['forward_priced_s'] * 1e3:.1f} priced, backward {r['backward_measured_s'] * 1e3:.1f} vs "
              f"{r['backward_priced_s'] * 1e3:.1f}, step {r['step_measured_s'] * 1e3:.1f} vs objective "
              f"{r['step_objective_s'] * 1e3:.1f} ms", flush=True)
    print(f"[gpu-check] (h) calibrated objective re-predicts the step within {res['calibrated_self_error']:+.1%}; "
          f"wrote {res['file']}", flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="make the plans, token file and wheels (here: needs OR-Tools)")
    pp.add_argument("--out", default=str(ROOT / ".gpu_check"))
    pp.add_argument("--dry-run", action="store_true", help="the dry run's model and shapes")
    pp.add_argument("--types", default=",".join(GPU_TYPES))
    pp.add_argument("--no-wheels", action="store_true")
    pr = sub.add_parser("run", help="run the check (on the GPU machine; --dry-run here)")
    pr.add_argument("--prepared", default=str(ROOT / ".gpu_check"))
    pr.add_argument("--out", default=str(ROOT / "bench" / "results"))
    pr.add_argument("--dry-run", action="store_true", help="on this CPU: Gloo, the small model, a few steps")
    pr.add_argument("--device-type", default=None, help="the GPU type (default: from the device's name)")
    pr.add_argument("--kernels-k", default=None, help="pytest -k for the kernel tests (dry run: a small subset)")
    args = ap.parse_args(argv)
    shape = "dry" if args.dry_run else "gpu"
    if args.cmd == "prepare":
        prepare(Path(args.out), shape=shape, types=args.types.split(","), wheels=not args.no_wheels)
        return 0
    return run(Path(args.prepared), Path(args.out), shape=shape, device_type=args.device_type,
               kernels_k=args.kernels_k)


if __name__ == "__main__":
    sys.exit(main())
