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

Then, per state layout (``measure_layouts``: replicated, ZeRO-1 with float32
weights, ZeRO-1 with 16-bit working weights), one stage data-parallel over
two torch.distributed ranks (Gloo) with unequal shards, each rank profiled
the same way against its own prediction.

Proves: how far the plan's per-rank prediction is from what the runtime
allocates on a CPU, per layout, and which category the difference is in
(the vocabulary sweep isolates the loss block). Cannot: measure a GPU
(allocator caching, fused kernels, NCCL buffers; ``make gpu-check`` does
that).

Then, per recomputation policy (``measure_recompute``: none, whole-stage,
host-stashed block inputs), one stage on one GPU where activations dominate.

Run: ``.venv/bin/python bench/memory_cpu.py`` (about two minutes); writes
``bench/results/memory_cpu.json``, ``memory_cpu_layouts.json`` and
``memory_cpu_recompute.json``.
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
        peak, by = _profiled_step(worker, torch.randint(0, vocab, (8, 64)))
    m = g.predicted_memory
    return {"vocab": vocab, "parameters": plan.stages[0].num_parameters,
            "predicted_bytes": g.predicted_memory_bytes,
            "predicted": {"weights": m.weights_bytes, "gradients": m.gradients_bytes,
                          "optimizer": m.optimizer_bytes, "activations": m.activations_bytes},
            "measured_peak_bytes": peak, "ratio": peak / g.predicted_memory_bytes,
            "measured_at_peak_by_category": by}


def _profiled_step(worker, tokens: torch.Tensor) -> tuple[int, dict[str, int]]:
    """Two training steps of ``worker`` on ``tokens`` (every input), the second
    under ``torch.profiler`` with memory: its peak and bytes by category."""
    from torch.profiler import ProfilerActivity, profile

    batch = {n: tokens for n in worker.plan.input_names}
    worker.train_step(batch)  # the optimizer's state exists from here on
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        worker.train_step(batch)
    return _peak_by_category(prof)


def _memory_profile(prof):
    """``prof``'s ``MemoryProfile``. torch 2.13's memory profiler now and then
    rejects its own data-flow graph of a step with many asynchronous Gloo
    reduce-scatters (ZeRO-2: "duplicate outputs", an ``AssertionError`` of
    ``DataFlowGraph.validate``, on about one run in three); the profile is
    then built without that check. Measured: the same peaks and categories
    with and without it on the runs where it passes (bench/README.md)."""
    from torch.profiler import _memory_profiler as mpf

    try:
        return prof._memory_profile()
    except AssertionError:
        check = mpf.DataFlowGraph.validate
        mpf.DataFlowGraph.validate = lambda self: None
        try:
            return prof._memory_profile()
        finally:
            mpf.DataFlowGraph.validate = check


def _peak_by_category(prof) -> tuple[int, dict[str, int]]:
    """The peak of live CPU tensor bytes in ``prof``'s memory timeline and,
    at that moment, the bytes per category (largest first)."""
    from torch.profiler._memory_profiler import Action

    mp = _memory_profile(prof)
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
    return peak, dict(sorted(by.items(), key=lambda kv: -kv[1]))


# -- a sharded stage over two ranks, per state layout --------------------------------
#: Two A100-40GB on one node (bfloat16): the plan's GPUs; only their pricing matters here.
_TWO_GPUS = """name: two_a100
nodes:
  - name: n0
    gpus: [{type: A100-40GB, count: 2}]
    intra_node: {bandwidth_GBps: 300, latency_us: 5}
links:
  intra_node: {bandwidth_GBps: 300, latency_us: 5}
  inter_node: {bandwidth_GBps: 300, latency_us: 5}
"""
#: The layouts of ``measure_layouts``: (name, precision, sharded). Sharded under bf16-mixed is
#: ZeRO-1 with 16-bit working weights (the planner's choice for a sharded stage of >= 2 GPUs);
#: sharded in fp32 is ZeRO-1 with float32 weights.
#: (name, precision, sharded[, gradients sharded too: ZeRO-2[, weights sharded too: ZeRO-3[, optimizer
#: offloaded[, activations offloaded]]]]). On this CPU host memory is the same memory: an offloaded
#: row's measured peak is against its predicted device + host bytes.
LAYOUTS = (("replicated", "bf16-mixed", False), ("zero1_fp32", "fp32", True),
           ("zero1_16bit_weights", "bf16-mixed", True), ("zero2_fp32", "fp32", True, True),
           ("zero2_16bit_weights", "bf16-mixed", True, True), ("zero3_fp32", "fp32", True, True, True),
           ("zero3_16bit_weights", "bf16-mixed", True, True, True),
           ("offload_fp32", "fp32", True, False, False, True),
           ("offload_16bit_weights_and_activations", "bf16-mixed", True, False, False, True, True))


def _rank(rank: int, world: int, port: int, runs: list[tuple[str, str]]) -> None:
    """One rank of ``measure_layouts``, every layout in turn: ``runs`` is ``(plan directory, precision)``
    per layout; per layout two steps, the second profiled; writes ``rank<r>.json`` into the layout's
    directory. One process group for all of them: one spawn, not one per layout (torch, transformers and
    Gloo start once). Each layout's worker is gone (``gc``) before the next one's is built, so the next
    profile sees none of its tensors."""
    import gc

    import torch.distributed as dist

    from zorse_fx.plan import Plan
    from zorse_fx.precision import precision_policy
    from zorse_fx.runtime.worker import StageWorker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for plan_dir, precision in runs:
        plan = Plan.load(Path(plan_dir) / "plan.json")
        worker = StageWorker(plan, plan_dir, torch.load(Path(plan_dir) / "weights.pt"), rank=rank,
                             device=torch.device("cpu"), precision=precision_policy(precision))
        peak, by = _profiled_step(worker, torch.load(Path(plan_dir) / "tokens.pt"))
        summary = worker.optimizer_state_summary()
        Path(plan_dir, f"rank{rank}.json").write_text(json.dumps({"peak": peak, "by": by, "summary": summary}))
        del worker
        gc.collect()
        dist.barrier()
    dist.destroy_process_group()


def measure_layouts(layouts=LAYOUTS) -> list[dict]:
    """Per state layout (``LAYOUTS``), each rank's measured peak against its
    prediction: a 2-layer HF Llama (256 wide, 1024 MLP, vocabulary 256: its
    matmul weights are 97% of its 1.6M parameters) as one stage
    data-parallel over two ranks (samples 2:2, ZeRO-1 shards 3:1 where
    sharded), bf16-mixed on this CPU (CPU autocast), two torch.distributed
    ranks over Gloo, the second step profiled on each."""
    import dataclasses
    import socket

    import torch.multiprocessing as mp
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import fixed_decision
    from zorse_fx.capture import capture
    from zorse_fx.cluster import Cluster
    from zorse_fx.ir.memory import StageMemory
    from zorse_fx.models.hf import CausalLMWithLoss
    from zorse_fx.options import PlanOptions
    from zorse_fx.planner import plan_fixed
    from zorse_fx.pricing import price
    from zorse_fx.solve.objective import build_tables, sharded_state_kib

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    ids = torch.randint(0, 256, (4, 32))
    captured = capture(CausalLMWithLoss(LlamaForCausalLM(cfg)), (ids, ids))
    rows, built = [], []
    with tempfile.TemporaryDirectory() as tmp:
        cluster_file = Path(tmp, "two.yaml")
        cluster_file.write_text(_TWO_GPUS.replace("    gpus: [", "    host_memory_GiB: 64\n    gpus: ["))
        cluster = Cluster.from_yaml(cluster_file)
        for name, precision, sharded, *more in layouts:
            grads = bool(more and more[0])
            params = bool(len(more) > 1 and more[1])
            offload, acts = bool(len(more) > 2 and more[2]), bool(len(more) > 3 and more[3])
            # ZeRO-2: 512 KiB buckets, a dozen per stage (as 25 MiB ones are on a GPU-sized stage), so its
            # reduction buffers (6 buckets at most: state_terms.grad_shard_kib) are not the stage's gradients.
            options = PlanOptions(global_batch_size=8, precision=precision, **({"bucket_mib": 0.5} if grads else {}))
            decision = fixed_decision(captured, ((0, 1),), ((2, 2),), num_microbatches=2)
            if sharded:  # whole-MiB shards 3:1 covering the stage's shardable state as the planner counts it
                priced = price(captured, cluster, options)
                tab = build_tables(priced.costs, priced.devices, options, 2)
                zero = 3 if params else 2 if grads else 1
                q_kib = sharded_state_kib(tab, 0, priced.costs.num_blocks, zero)[1]
                q_mib = -(-q_kib // 1024)
                first = -(-3 * q_mib // 4)
                decision = dataclasses.replace(decision, shard_mib=((first, q_mib - first),), memory=(StageMemory(
                    zero=zero, optimizer="host" if offload else "device", activations="host" if acts else "device"),))
            plan, _ = plan_fixed(captured, cluster, options, decision, label_mode="same")
            assert bool(plan.stages[0].low_precision_params) == (sharded and precision != "fp32"), name
            d = Path(tmp, name)
            plan.export(d)
            torch.save(captured.state(), d / "weights.pt")
            torch.save(torch.randint(0, 256, (8, 32)), d / "tokens.pt")
            built.append((name, precision, grads, params, offload, acts, plan, d))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(_rank, args=(2, port, [(str(d), precision) for _, precision, *_, d in built]), nprocs=2, join=True)
        for name, precision, grads, params, offload, acts, plan, d in built:
            for g in plan.stages[0].gpus:
                got = json.loads(Path(d, f"rank{g.rank}.json").read_text())
                m = g.predicted_memory
                rows.append({"layout": name, "precision": precision, "rank": g.rank, "grad_sharded": grads,
                             "param_sharded": params, "zero3": got["summary"].get("zero3"),
                             "parameters": plan.stages[0].num_parameters,
                             "low_precision_parameters": sum(captured.state()[plan.stages[0].params[f]].numel()
                                                             for f in plan.stages[0].low_precision_params),
                             "state_shard_bytes": g.state_shard_bytes,
                             "predicted_bytes": g.predicted_memory_bytes,
                             "predicted_host_bytes": g.predicted_host_memory_bytes,
                             "offload": offload, "act_offload": acts,
                             "host_copy_bytes": got["summary"]["host_copy_bytes"],
                             "activation_offload": got["summary"]["activation_offload"],
                             "predicted": {"weights": m.weights_bytes, "gradients": m.gradients_bytes,
                                           "optimizer": m.optimizer_bytes, "activations": m.activations_bytes,
                                           "communication": m.communication_bytes},
                             "measured_peak_bytes": got["peak"],
                             "ratio": got["peak"] / (g.predicted_memory_bytes + g.predicted_host_memory_bytes),
                             "measured_at_peak_by_category": got["by"],
                             "optimizer_state_bytes": got["summary"]["optimizer_state_bytes"],
                             "master_bytes": got["summary"]["master_bytes"],
                             "owned_elements": got["summary"]["owned_elements"]})
    return rows


#: One A100-40GB with host memory (the stash's host bytes are checked against it; on this CPU host memory is the
#: same memory, so a row's measured peak is against its predicted device + host bytes).
_ONE_GPU_HOST = """name: one_a100_host
nodes:
  - name: n0
    host_memory_GiB: 64
    gpus: [{type: A100-40GB, count: 1}]
links:
  intra_node: {bandwidth_GBps: 300, latency_us: 5}
  inter_node: {bandwidth_GBps: 300, latency_us: 5}
"""
#: The recomputation policies of ``measure_recompute``: (name, recompute, stash on host).
RECOMPUTE_POLICIES = (("no_recompute", False, False), ("recompute_stage", True, False),
                      ("recompute_host_stash", True, True))


def _recompute_child(rank: int, plan_dirs: list[str], precision: str = "fp32") -> None:
    """``measure_recompute``'s process: per plan directory two steps of its one-GPU plan, the second
    profiled; writes ``rank0.json`` (peak, bytes by category, the optimizer-state summary) there."""
    import gc

    from zorse_fx.plan import Plan
    from zorse_fx.precision import precision_policy
    from zorse_fx.runtime.worker import StageWorker

    torch.set_num_threads(1)
    for plan_dir in plan_dirs:
        plan = Plan.load(Path(plan_dir) / "plan.json")
        worker = StageWorker(plan, plan_dir, torch.load(Path(plan_dir) / "weights.pt"), rank=0,
                             device=torch.device("cpu"), precision=precision_policy(precision))
        peak, by = _profiled_step(worker, torch.load(Path(plan_dir) / "tokens.pt"))
        summary = worker.optimizer_state_summary()
        Path(plan_dir, "rank0.json").write_text(json.dumps({"peak": peak, "by": by, "summary": summary}))
        del worker
        gc.collect()


def measure_recompute(policies=RECOMPUTE_POLICIES, *, seq: int = 256, precision: str = "fp32") -> list[dict]:
    """Per recomputation policy, one rank's measured peak against its prediction where activations
    dominate: a 4-layer HF Llama (64 wide, 128 MLP, vocabulary 256, 0.2M parameters: 3 MB of fp32 training
    state) at ``seq`` tokens, one stage on one GPU, 2 micro-batches of 4, fp32, trained in-process; no
    recomputation (every saved tensor of a micro-batch), whole-stage recomputation (the stage's inputs, then
    the whole stage's saved tensors in the backward) and host-stashed recomputation ([C-stash]: the blocks'
    inputs in host memory, one block's saved tensors in the backward)."""
    import dataclasses

    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import fixed_decision
    from zorse_fx.capture import capture
    from zorse_fx.cluster import Cluster
    from zorse_fx.ir.memory import StageMemory
    from zorse_fx.models.hf import CausalLMWithLoss
    from zorse_fx.options import PlanOptions
    from zorse_fx.planner import plan_fixed

    import torch.multiprocessing as mp

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    ids = torch.randint(0, 256, (4, seq))
    captured = capture(CausalLMWithLoss(LlamaForCausalLM(cfg)), (ids, ids))
    rows, built = [], []
    with tempfile.TemporaryDirectory() as tmp:
        cluster_file = Path(tmp, "one.yaml")
        cluster_file.write_text(_ONE_GPU_HOST)
        cluster = Cluster.from_yaml(cluster_file)
        options = PlanOptions(global_batch_size=8, precision=precision)
        for name, recompute, stash in policies:
            decision = dataclasses.replace(
                fixed_decision(captured, ((0,),), ((4,),), num_microbatches=2),
                memory=(StageMemory(recompute=recompute, stash="host" if stash else "device"),))
            plan, _ = plan_fixed(captured, cluster, options, decision, label_mode="same")
            d = Path(tmp, name)
            plan.export(d)
            torch.save(captured.state(), d / "weights.pt")
            torch.save(torch.randint(0, 256, (8, seq)), d / "tokens.pt")
            built.append((name, plan, d))
        # In a fresh process, as measure_layouts: the timeline counts every tensor alive when the profiler
        # starts, and a caller's (a test worker's fixtures) would be the policies' own.
        mp.spawn(_recompute_child, args=([str(d) for *_, d in built], precision), nprocs=1, join=True)
        for name, plan, d in built:
            g = plan.stages[0].gpus[0]
            got = json.loads(Path(d, "rank0.json").read_text())
            peak, by, summary = got["peak"], got["by"], got["summary"]
            m = g.predicted_memory
            rows.append({"policy": name, "precision": precision, "seq": seq,
                         "parameters": plan.stages[0].num_parameters,
                         "predicted_bytes": g.predicted_memory_bytes,
                         "predicted_host_bytes": g.predicted_host_memory_bytes,
                         "predicted": {"weights": m.weights_bytes, "gradients": m.gradients_bytes,
                                       "optimizer": m.optimizer_bytes, "activations": m.activations_bytes},
                         "block_stash": summary["block_stash"],
                         "measured_peak_bytes": peak,
                         "ratio": peak / (g.predicted_memory_bytes + g.predicted_host_memory_bytes),
                         "measured_at_peak_by_category": by})
    return rows


def main() -> int:
    torch.set_num_threads(1)
    rows = [measure(v) for v in (256, 8192, 32768)]
    out = ROOT / "bench" / "results" / "memory_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    layouts = measure_layouts()
    out_layouts = ROOT / "bench" / "results" / "memory_cpu_layouts.json"
    out_layouts.write_text(json.dumps(layouts, indent=1) + "\n")
    recompute = measure_recompute()
    out_recompute = ROOT / "bench" / "results" / "memory_cpu_recompute.json"
    out_recompute.write_text(json.dumps(recompute, indent=1) + "\n")
    from report import (render_memory_cpu, render_memory_layouts,  # bench/report.py: the tables bench/README.md shows
                        render_memory_recompute)

    print("\n".join(render_memory_cpu(rows, out.name)))
    print("\n".join(render_memory_layouts(layouts, out_layouts.name)))
    print("\n".join(render_memory_recompute(recompute, out_recompute.name)))
    print(f"wrote {out}, {out_layouts} and {out_recompute}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
