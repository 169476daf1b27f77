"""Measure one GPU for the cost model (issue 13 item 2), in one short run.

Run on a machine with one NVIDIA GPU (about 3 minutes on an H200)::

    PYTHONPATH=. python bench/gpu_measure.py --out DIR --device-type H200

What it measures, in priority order (each part is written to
``DIR/gpu_measure.json`` as soon as it ends, so a run cut short keeps what it
finished; ``--budget-s`` skips the parts that would start after it):

1. ``env``: device name, multiprocessors, torch / Triton / CUDA versions,
   ``nvidia-smi`` clocks and power limit.
2. ``gemm``: ``torch.matmul`` of square shapes and of the Llama-2 7B/13B
   layer's GEMMs (tokens x out x in) in bfloat16, float16, TF32 (float32
   with ``allow_tf32``) and float32; ms per product and TFLOP/s
   (2*M*N*K / time). CUDA-event timing, mean over a run of >= 20 ms after a
   warm-up.
3. ``layers``: eager Hugging Face ``LlamaForCausalLM`` (``attn_implementation
   ="sdpa"``) of the Llama-2 7B and 13B shapes with 1 and 2 decoder layers,
   under bfloat16 autocast with float32 weights (the runtime's
   ``bf16-mixed``): forward, and forward + backward, per (sequence length,
   micro-batch). One decoder layer's time is the 2-layer minus the 1-layer
   model's (embedding, final norm, LM head and loss cancel).
4. ``diagnose``: at ``--diagnose-at`` points, where the node replays and
   the whole graph differ: wall and kernel time of the whole captured graph,
   node replays timed with and without the host, and both sides' GPU kernels
   by name (torch.profiler).
5. ``attention``: one Llama-2 7B layer's attention (32 heads x 128, bfloat16)
   at each (``--seqs``, ``--batches``): ``F.scaled_dot_product_attention``
   with an explicit boolean causal mask (what the export-captured Hugging
   Face model passes), with ``is_causal=True``, and without a mask, and the
   project's Triton ``flash_attention`` (causal and not); forward and
   forward + backward ms, TFLOP/s by the non-causal count 4*B*H*T*T*D
   (forward; backward 2.5x), and the kernels each SDPA variant runs.
6. ``profile``: ``zorse bench kernels --model llama2-7b --layers 2
   --replay graph --precision bf16-mixed`` at every (``--seqs``,
   ``--batches``), calibrated at ``--calibrate-at``
   (``zorse_fx/profiling/kernels_main.py``): the kernel profile
   ``DIR/<type>.json`` (model sweep, Triton standard sweep, AdamW step),
   ``DIR/<type>.png``, and ``DIR/profile_check.json``: the measured-profile
   path against the whole graph's measured forward + backward at each point.

On a CPU (``--device cpu``, tiny shapes) it runs the same code, to test it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))

#: Llama-2 shapes (Touvron et al. 2023, Table/HF configs meta-llama/Llama-2-{7b,13b}-hf).
LLAMA2 = {
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32),
    "13b": dict(hidden_size=5120, intermediate_size=13824, num_attention_heads=40, num_key_value_heads=40),
    "tiny": dict(hidden_size=64, intermediate_size=172, num_attention_heads=4, num_key_value_heads=4),
}
VOCAB = 32000


class Recorder:
    """Accumulates results and rewrites the JSON after every part."""

    def __init__(self, out: Path):
        self.out = out
        self.data: dict = {"started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}

    def put(self, key: str, value) -> None:
        self.data[key] = value
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_measure.json").write_text(json.dumps(self.data, indent=1, default=str))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, *, min_ms: float = 20.0, warmup: int = 2, samples: int = 3) -> float:
    """Median over ``samples`` runs of the mean time of ``fn`` (ms), each run >= ``min_ms``."""
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    once = max((time.perf_counter() - t0) * 1e3, 1e-3)
    iters = max(1, min(200, int(min_ms / once)))
    out = []
    for _ in range(samples):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            out.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(out)


def kernel_table(fn, device: torch.device) -> dict:
    """GPU kernels one call of ``fn`` runs: ``{"total_ms", "count", "by_name": {name: [ms, count]}}``
    (torch.profiler, CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    on_gpu = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        fn()
        sync(device)
    by: dict[str, list] = {}
    for e in prof.events():
        if on_gpu and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if on_gpu:
            us = getattr(e, "device_time", None)
            if us is None:
                us = getattr(e, "cuda_time", 0.0)
        else:  # a CPU run (to test this code): ops' own time
            us = e.self_cpu_time_total
        r = by.setdefault(e.name[:120], [0.0, 0])
        r[0] += us / 1e3
        r[1] += 1
    return {"total_ms": sum(v[0] for v in by.values()), "count": sum(v[1] for v in by.values()), "by_name": by}


def env_info(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "host": socket.gethostname()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(name=p.name, sms=p.multi_processor_count, memory_gib=p.total_memory / 2**30,
                    cuda=torch.version.cuda, capability=f"{p.major}.{p.minor}")
        try:
            q = "name,driver_version,clocks.max.sm,clocks.max.mem,clocks.sm,power.limit,power.max_limit"
            info["nvidia_smi"] = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv"],
                                                capture_output=True, text=True, timeout=20).stdout
        except Exception as e:  # noqa: BLE001 - a fact we can do without
            info["nvidia_smi"] = f"failed: {e}"
    else:
        info["name"] = platform.processor() or platform.machine()
    return info


def gemm_sweep(device: torch.device, tiny: bool) -> list[dict]:
    if tiny:
        shapes = [(64, 64, 64), (128, 96, 64)]
    else:
        shapes = [(n, n, n) for n in (1024, 2048, 4096, 8192)]
        for tokens in (512, 2048, 8192, 16384):  # Llama-2 7B and 13B layer GEMMs: (tokens, out, in)
            shapes += [(tokens, 4096, 4096), (tokens, 11008, 4096), (tokens, 4096, 11008),
                       (tokens, 5120, 5120), (tokens, 13824, 5120)]
    modes = [("bfloat16", torch.bfloat16, False), ("float16", torch.float16, False),
             ("tf32", torch.float32, True), ("float32", torch.float32, False)]
    rows = []
    for m, n, k in shapes:
        for name, dtype, tf32 in modes:
            if name == "float32" and m * n * k > 2 * 8192**3 and device.type == "cuda":
                continue  # slow and not what training uses; the square 8192 covers it
            torch.backends.cuda.matmul.allow_tf32 = tf32
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            ms = time_ms(lambda: torch.matmul(a, b), device, min_ms=10.0 if device.type == "cuda" else 1.0)
            rows.append(dict(m=m, n=n, k=k, mode=name, ms=ms, tflops=2 * m * n * k / (ms * 1e-3) / 1e12))
            del a, b
    torch.backends.cuda.matmul.allow_tf32 = False
    return rows


def llama(shape: str, layers: int, device):
    """Hugging Face ``LlamaForCausalLM`` of a Llama-2 shape (``LLAMA2``) with
    ``layers`` decoder layers on ``device``: the published config
    (``zorse_fx.models.published``) with sdpa attention named and Llama-2's
    ``rms_norm_eps`` 1e-5; what runs A and 1-3 measured."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB if shape != "tiny" else 256, num_hidden_layers=layers,
                      max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
                      attn_implementation="sdpa", **LLAMA2[shape])
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model


def fwd_bwd_times(loss_fn, params, device) -> tuple[float, float]:
    """(forward ms with grad, forward + backward ms) of ``loss_fn``."""

    def fwd():
        return loss_fn()

    def step():
        loss_fn().backward()

    f = time_ms(fwd, device, min_ms=30.0, samples=3)
    s = time_ms(step, device, min_ms=30.0, samples=3)
    for p in params:
        p.grad = None
    return f, s


def layer_times(device, shapes, seqs, batches, tiny: bool, deadline: float) -> list[dict]:
    from zorse_fx.models.hf import CausalLMWithLoss

    rows = []
    for shape in shapes:
        for layers in (1, 2):
            model = CausalLMWithLoss(llama(shape, layers, device))
            params = list(model.parameters())
            for seq in seqs:
                for mb in batches:
                    if time.monotonic() > deadline:
                        return rows
                    ids = torch.randint(0, 256 if tiny else VOCAB, (mb, seq), device=device)

                    def loss_fn():
                        with torch.autocast(device.type, dtype=torch.bfloat16):
                            return model(ids, ids)

                    f, s = fwd_bwd_times(loss_fn, params, device)
                    rows.append(dict(shape=shape, layers=layers, seq=seq, micro_batch=mb, fwd_ms=f, fwd_bwd_ms=s))
            del model, params
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def diagnose_part(device, shape, layers, points, rec: Recorder, deadline: float, tiny: bool) -> list[dict]:
    """Where node replays and the whole graph differ: per (seq, micro-batch), the
    whole graph's forward + backward (host wall time and GPU kernel time), the
    node replays (``replay.graph_node_times``) timed with the host in the figure
    (``time_ms``) and without it (``replay.time_gpu_ms``), and both sides' GPU
    kernels by name (torch.profiler)."""
    from zorse_fx.capture import analyse, capture
    from zorse_fx.models.hf import CausalLMWithLoss
    from zorse_fx.cost.replay import graph_node_times, model_calls

    def node_replays(gm, inputs, device, dtype, *, gpu_only=False, on_node=None):
        timer = None if gpu_only else (lambda f: time_ms(f, device, min_ms=2.0, warmup=1, samples=3))
        return graph_node_times(gm, inputs, device, autocast_dtype=dtype, timer=timer, on_node=on_node)

    model = CausalLMWithLoss(llama(shape, layers, device))
    rows = []
    for seq, mb in points:
        if time.monotonic() > deadline:
            break
        ids = torch.randint(0, 256 if tiny else VOCAB, (2, seq), device=device)
        captured = capture(model, (ids, ids.clone()), method="export")
        analyse(captured)
        gm = captured.graph_module
        x = torch.randint(0, 256 if tiny else VOCAB, (mb, seq), device=device)

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = gm(x, x)
            loss.backward()

        wall = time_ms(step, device, min_ms=30.0)
        whole_k = kernel_table(step, device)
        for p_ in gm.parameters():
            p_.grad = None
        host = node_replays(gm, (x, x.clone()), device, torch.bfloat16)
        gpu = node_replays(gm, (x, x.clone()), device, torch.bfloat16, gpu_only=True)
        node_k: dict = {"total_ms": 0.0, "count": 0, "by_name": {}}

        def on_node(name, fwd, bwd):
            for fn in (fwd, bwd):
                if fn is None:
                    continue
                t = kernel_table(fn, device)
                node_k["total_ms"] += t["total_ms"]
                node_k["count"] += t["count"]
                for k, (ms, c) in t["by_name"].items():
                    r = node_k["by_name"].setdefault(k, [0.0, 0])
                    r[0] += ms
                    r[1] += c

        node_replays(gm, (x, x.clone()), device, torch.bfloat16, on_node=on_node)
        names = set(whole_k["by_name"]) | set(node_k["by_name"])
        diff = sorted(((k, whole_k["by_name"].get(k, [0, 0]), node_k["by_name"].get(k, [0, 0])) for k in names),
                      key=lambda r: -abs(r[1][0] - r[2][0]))
        row = dict(seq=seq, micro_batch=mb, whole_wall_ms=wall, whole_kernel_ms=whole_k["total_ms"],
                   whole_kernels=whole_k["count"],
                   nodes_host_ms=sum(f + (b or 0) for f, b, _ in host.values()),
                   nodes_gpu_ms=sum(f + (b or 0) for f, b, _ in gpu.values()),
                   nodes_kernel_ms=node_k["total_ms"], nodes_kernels=node_k["count"],
                   per_node_gpu={k: [f, b] for k, (f, b, _) in gpu.items()},
                   calls={k: [c.key, c.op_class, c.flops, c.bytes] for k, c in model_calls(captured, mb).items()},
                   per_node_host={k: [f, b] for k, (f, b, _) in host.items()},
                   top_diff=[dict(kernel=k, whole_ms=w[0], whole_n=w[1], nodes_ms=n[0], nodes_n=n[1])
                             for k, w, n in diff[:40]])
        rows.append(row)
        print(f"[gpu_measure] diagnose seq {seq} mb {mb}: wall {wall:.2f}, kernels {whole_k['total_ms']:.2f} ms; "
              f"nodes host {row['nodes_host_ms']:.2f}, gpu {row['nodes_gpu_ms']:.2f}, kernels "
              f"{node_k['total_ms']:.2f} ms", flush=True)
        rec.put("diagnose", rows)
        del gm, captured
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def attention_part(device, seqs, batches, tiny: bool, deadline: float) -> list[dict]:
    """SDPA masked / causal / unmasked and the Triton kernel, per (seq, micro-batch)."""
    import torch.nn.functional as F

    heads, dim = (4, 16) if tiny else (32, 128)
    dtype = torch.float32 if tiny else torch.bfloat16
    variants = {"sdpa_mask": None, "sdpa_causal": None, "sdpa_none": None}
    try:
        from zorse_kernels.attention import flash_attention, flash_attention_backward

        if device.type == "cuda":
            variants.update(triton_causal=None, triton_none=None)
    except Exception:  # noqa: BLE001 - no Triton: SDPA only
        flash_attention = flash_attention_backward = None
    rows = []
    for seq in seqs:
        mask = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
        for mb in batches:
            if time.monotonic() > deadline:
                return rows
            q, k, v = (torch.randn(mb, heads, seq, dim, device=device, dtype=dtype, requires_grad=True)
                       for _ in range(3))
            calls = {
                "sdpa_mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                "sdpa_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                "sdpa_none": lambda: F.scaled_dot_product_attention(q, k, v),
                "triton_causal": lambda: flash_attention(q, k, v, causal=True),
                "triton_none": lambda: flash_attention(q, k, v, causal=False),
            }
            flops = 4 * mb * heads * seq * seq * dim
            for name in variants:
                fn = calls[name]
                g = torch.randn(mb, heads, seq, dim, device=device, dtype=dtype)

                def fwd_bwd(fn=fn, g=g, name=name):
                    if name.startswith("triton"):  # no autograd: its backward kernels, as the runtime calls them
                        fn()
                        flash_attention_backward(q, k, v, name == "triton_causal", g)
                    else:
                        fn().backward(g)

                try:
                    with torch.no_grad():
                        f = time_ms(fn, device, min_ms=10.0)
                    fb = time_ms(fwd_bwd, device, min_ms=10.0)
                    kern = kernel_table(fwd_bwd, device) if name.startswith("sdpa") else None
                except Exception as e:  # noqa: BLE001 - one variant failing keeps the others
                    rows.append(dict(variant=name, seq=seq, micro_batch=mb, error=repr(e)[:300]))
                    continue
                for t in (q, k, v):
                    t.grad = None
                row = dict(variant=name, seq=seq, micro_batch=mb, fwd_ms=f, fwd_bwd_ms=fb,
                           fwd_tflops=flops / (f * 1e-3) / 1e12,
                           bwd_tflops=2.5 * flops / (max(fb - f, 1e-6) * 1e-3) / 1e12)
                if kern is not None:
                    top = sorted(kern["by_name"].items(), key=lambda kv: -kv[1][0])[:4]
                    row["kernels"] = [[k_, round(v_[0], 4), v_[1]] for k_, v_ in top]
                rows.append(row)
                print(f"[gpu_measure] attention {name} seq {seq} mb {mb}: fwd {f:.3f} ms "
                      f"({row['fwd_tflops']:.0f} TFLOP/s), fwd+bwd {fb:.3f} ms", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--device-type", default=None, help="cluster GPU type (default: detected)")
    p.add_argument("--seqs", default="512,2048,4096")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--layer-shapes", default="7b,13b")
    p.add_argument("--profile-shape", default="7b", help="Llama-2 shape of the `diagnose` part")
    p.add_argument("--calibrate-at", default="4096,1;512,1", help="seq,micro-batch points (';'-separated) whose "
                   "whole-graph fwd+bwd calibrates the profile (`zorse bench kernels --calibrate-at`, each)")
    p.add_argument("--budget-s", type=float, default=330.0, help="parts that would start after this are skipped")
    p.add_argument("--skip", default="", help="comma list of parts to skip")
    p.add_argument("--only", default="", help="comma list of parts to run (default: all)")
    p.add_argument("--diagnose-at", default="512,1;2048,4;4096,4", help="seq,micro-batch points for `diagnose`")
    args = p.parse_args(argv)
    t_start = time.monotonic()
    deadline = t_start + args.budget_s
    device = torch.device(args.device)
    tiny = device.type == "cpu"
    if tiny:
        torch.set_num_threads(1)
    out = Path(args.out)
    rec = Recorder(out)
    seqs = [int(s) for s in args.seqs.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    only = set(filter(None, args.only.split(",")))
    dev_type = args.device_type
    if dev_type is None:
        from zorse_fx.cluster import gpu_spec

        dev_type = gpu_spec(torch.cuda.get_device_name(device)).type if device.type == "cuda" else "cpu"

    def part(name, fn):
        if name in skip or (only and name not in only):
            return None
        if time.monotonic() > deadline:
            rec.put(f"{name}_skipped", "budget")
            return None
        t0 = time.monotonic()
        print(f"[gpu_measure] {name} ...", flush=True)
        try:
            res = fn()
        except Exception:  # noqa: BLE001 - keep the other parts' results
            rec.put(f"{name}_error", traceback.format_exc())
            print(traceback.format_exc(), flush=True)
            return None
        rec.put(f"{name}_s", round(time.monotonic() - t0, 1))
        print(f"[gpu_measure] {name} done in {time.monotonic() - t0:.1f} s", flush=True)
        return res

    rec.put("args", vars(args))
    rec.put("device_type", dev_type)
    rec.put("env", part("env", lambda: env_info(device)))
    rec.put("gemm", part("gemm", lambda: gemm_sweep(device, tiny)))
    shapes = ["tiny"] if tiny else args.layer_shapes.split(",")
    rec.put("layers", part("layers", lambda: layer_times(device, shapes, seqs, batches, tiny, deadline)))
    diag_points = [tuple(int(v) for v in p_.split(",")) for p_ in args.diagnose_at.split(";") if p_]
    part("diagnose", lambda: diagnose_part(device, "tiny" if tiny else args.profile_shape, 2, diag_points, rec,
                                           deadline, tiny))
    rec.put("attention", part("attention", lambda: attention_part(device, seqs, batches, tiny, deadline)))
    from zorse_fx.profiling import kernels_main

    cal_args = [a for p_ in args.calibrate_at.split(";") if p_ for a in ("--calibrate-at", p_)]

    def profile():
        argv = ["--model", "llama2-7b", "--layers", "2", "--seq-len", args.seqs, "--batch-sizes", args.batches,
                *cal_args, "--replay", "graph", "--precision", "bf16-mixed",
                "--device-type", dev_type, "-o", str(out / f"{dev_type}.json"), "--report",
                str(out / "profile_check.json"), "--repeats", "3"]
        if tiny:
            argv = ["--model", "gpt", "--seq-len", args.seqs, "--batch-sizes", args.batches, *cal_args,
                    "--replay", "graph", "--precision", "bf16-mixed", "--device-type", dev_type,
                    "-o", str(out / f"{dev_type}.json"), "--report", str(out / "profile_check.json"),
                    "--repeats", "1", "--cpu-scale", "0.1"]
        else:
            argv += ["--plot", str(out / f"{dev_type}.png")]
        kernels_main.main(argv)
        return json.loads((out / "profile_check.json").read_text())

    rec.put("profile_check", part("profile", profile))
    rec.put("total_s", round(time.monotonic() - t_start, 1))
    print(f"[gpu_measure] wrote {out} in {time.monotonic() - t_start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
