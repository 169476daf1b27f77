"""Predicted vs measured peak memory of one rank on this CPU, by what holds it.

A one-stage, one-GPU plan of a 2-layer HF Llama (64 wide, tied embeddings,
sequence 64, 2 micro-batches of 4) for each vocabulary size, trained
in-process (``StageWorker``, fp32, world size 1) for two steps; the second
step runs under ``torch.profiler`` with ``profile_memory=True`` and its
memory timeline (``torch.profiler._memory_profiler``, what
``export_memory_timeline`` draws) gives the peak of live CPU tensor bytes and,
at that moment, the bytes per category (parameter, gradient, optimizer state,
activation, autograd detail, temporary). The plan's ``GPUShare.predicted_memory``
is the prediction.

Proves: how far the plan's per-rank prediction is from what the runtime
allocates on a CPU, and which category the difference is in (the vocabulary
sweep isolates the loss block). Cannot: measure a GPU (allocator caching,
fused kernels; ``make gpu-check`` does that), several ranks, or layouts other
than the replicated one.

Run: ``.venv/bin/python bench/memory_cpu.py`` (about a minute); writes
``bench/results/memory_cpu.json``.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def measure(vocab: int) -> dict:
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import fixed_plan
    from zorse_fx.capture import capture
    from zorse_fx.models.hf import CausalLMWithLoss
    from zorse_fx.runtime.worker import StageWorker

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    ids = torch.randint(0, vocab, (4, 64))
    captured = capture(CausalLMWithLoss(LlamaForCausalLM(cfg)), (ids, ids))
    # Planned in fp32, the precision this CPU run trains in.
    plan = fixed_plan(captured, ((0,),), ((4,),), num_microbatches=2, global_batch_size=8, label_mode="same",
                      precision="fp32")
    g = plan.stages[0].gpus[0]
    with tempfile.TemporaryDirectory() as d:
        plan.export(d)
        worker = StageWorker(plan, d, captured.state(), rank=0, device=torch.device("cpu"))
        tokens = torch.randint(0, vocab, (8, 64))
        batch = {n: tokens for n in plan.input_names}
        worker.train_step(batch)  # the optimizer's state exists from here on
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                     with_stack=True) as prof:
            worker.train_step(batch)
    mp = prof._memory_profile()
    live: dict = {}
    cur = peak = 0
    at_peak: dict = {}
    for _, action, (key, version), size in mp.timeline:
        if key.device.type != "cpu":
            continue
        if action in (Action.PREEXISTING, Action.CREATE):
            live[key] = [size, version]
            cur += size
        elif action == Action.DESTROY and key in live:
            cur -= live.pop(key)[0]
        elif action == Action.INCREMENT_VERSION and key in live:
            live[key][1] = version
        if cur > peak:
            peak = cur
            at_peak = {k: tuple(v) for k, v in live.items()}
    by: dict[str, int] = {}
    for key, (size, version) in at_peak.items():
        cat = mp._categories.get(key, version)
        name = cat.name.lower() if cat is not None else "unknown"
        by[name] = by.get(name, 0) + size
    m = g.predicted_memory
    return {"vocab": vocab, "parameters": plan.stages[0].num_parameters,
            "predicted_bytes": g.predicted_memory_bytes,
            "predicted": {"weights": m.weights_bytes, "gradients": m.gradients_bytes,
                          "optimizer": m.optimizer_bytes, "activations": m.activations_bytes},
            "measured_peak_bytes": peak, "ratio": peak / g.predicted_memory_bytes,
            "measured_at_peak_by_category": dict(sorted(by.items(), key=lambda kv: -kv[1]))}


def main() -> int:
    torch.set_num_threads(1)
    rows = [measure(v) for v in (256, 8192, 32768)]
    out = ROOT / "bench" / "results" / "memory_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    from report import render_memory_cpu  # bench/report.py: the table bench/README.md shows

    print("\n".join(render_memory_cpu(rows, out.name)))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
