"""``zorse bench kernels``: measure a kernel profile on the present device.

    zorse bench kernels --model smollm2-135m --seq-len 64 --batch-sizes 1,6 \\
        --device-type cpu-x86-1thread -o profiles/cpu-x86-1thread.json --plot profiles/cpu.png

    # on a GPU: 2 decoder layers of Llama-2 7B's shape, bf16 autocast, as the H200 profile was made
    zorse bench kernels --model llama2-7b --layers 2 --seq-len 512,2048,4096 --batch-sizes 1,4 \
        --calibrate-at 4096,1 --calibrate-at 512,1 -o zorse_fx/profiles/H200.json

Two sweeps, both written to one profile (``cost/profile.py``):

- the model sweep: every distinct computing node of the traced model at each
  micro-batch size, replayed with the ATen op the runtime executes
  (``cost/replay.py``), forward and backward. Two ways:

  * ``--replay graph`` (default on a GPU): the captured graph runs once per
    (sequence length, micro-batch) under the precision's autocast (default
    ``bf16-mixed``) and every node is re-run alone on the tensors that run
    gave it (``replay.graph_node_times``): the dtypes, casts, strides and
    kernels of training; timed on the device alone (``replay.time_gpu_ms``).
    The whole graph's forward + backward is measured too; the calibration and
    the per-node overhead are fitted to it at the ``--calibrate-at`` points
    (``calibrate_graph``, against ``predict_fwd_bwd_ms``: the measured-profile
    path, gradient accumulation included), and every point's error is printed
    (the others held out). Needs the model's weights and one
    forward's activations in device memory: ``--layers`` cuts a published
    model (``zorse_fx.models.published``) to a few decoder layers.
  * ``--replay fake`` (default on a CPU): random tensors of the shapes and
    dtypes a fake-tensor run gives (any model size), host-timed; matmuls in
    the captured graph's float32, so a mixed-precision plan prices them from
    the standard sweep (``cost.measured``); calibrated on ``--calibrate``'s
    model.
- the standard sweep: the Triton kernel registry (``kernels/zorse_kernels``)
  at its standard shapes. On a GPU both the Triton kernel and the torch
  reference are timed (``triton.testing.do_bench``); on a CPU only the torch
  reference (Triton runs only in its interpreter there), at shapes scaled down
  by ``--cpu-scale``.

On a CPU the harness uses ``--threads`` threads (default 1, as each rank does).

[Note: the measured optimizer step]
The profile's ``optimizer_ns_per_param`` prices every parameter's share of a step's optimizer phase
([C-optim]: the objective and the simulator turn it into the memory bandwidth at which that phase takes the
measured time). Timed as AdamW over 32 M parameters in tensors of 1 M elements, it priced the box's 4-layer
GPT (0.86 M parameters in 52 tensors) at 0.76 ms where its ranks' optimizer phase took 2.0 ms (paced; 1.0 ms
unpaced; box case (a), bench/LOG.md 2026-12-07): the runtime's step follows a backward that has evicted the
weights, gradients and moments from the caches, its tensors are small (a per-tensor cost the 1 M tensors
amortise), and the runtime computes the gradients' global norm before AdamW, which was priced nowhere. So on
a CPU with ``--model`` the harness times that phase as the runtime runs it: the model's own parameters, each
sample right after a forward and backward of the largest swept micro-batch, the norm
(``torch._foreach_norm``) and the fused AdamW step, each paced. On a GPU, and without ``--model``, the
streaming measurement stays (a GPU's step is bandwidth-bound and its foreach kernels batch the tensors).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import platform
import socket
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from ..cost.profile import DeviceInfo, KernelProfile, KernelTiming
from ..pacing import ENV_PACE, ENV_PACE_REFERENCE, Pacer

__all__ = ["build_parser", "check_args", "main", "run", "measure_model", "measure_standard", "device_info"]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device: torch.device, device_type: str | None, threads: int) -> DeviceInfo:
    """Who measured: device type key, name, versions."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = ""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if device_type is None:
            from ..cluster import gpu_spec

            device_type = gpu_spec(name).type  # raises with the known types if unknown
        return DeviceInfo(device_type=device_type, name=name, backend="cuda", torch_version=torch.__version__,
                          triton_version=triton_version, cuda_version=torch.version.cuda or "",
                          host=socket.gethostname(), threads=threads)
    pacer = Pacer.from_environment()  # the box's emulated GPU: its factor in the name ([Note: paced compute])
    name = _cpu_name() + (f" paced x{pacer.factor:.4g} ({ENV_PACE})" if pacer.active else "") + (
        f" per {pacer.reference_s * 1e3:.4g} ms reference ({ENV_PACE_REFERENCE})" if pacer.reference_s else "")
    return DeviceInfo(device_type=device_type or f"cpu-{platform.machine()}-{threads}thread", name=name,
                      backend="cpu", torch_version=torch.__version__, triton_version=triton_version,
                      host=socket.gethostname(), threads=threads)


def measure_model(model_name: str, seq_len: int, batch_sizes: list[int], device: torch.device,
                  *, repeats: int, flush_bytes: int, progress=True) -> list[KernelTiming]:
    """Entries for every distinct node of ``model_name`` at each micro-batch size."""
    from tqdm import tqdm

    from ..capture import analyse, capture_lm
    from ..models.registry import load_model
    from ..cost.replay import model_calls, time_call

    captured, _ = capture_lm(load_model(model_name)[0], seq_len)
    analyse(captured)
    unique = {}
    for n in batch_sizes:
        for call in model_calls(captured, n).values():
            unique.setdefault(call.key, call)
    out = []
    for call in tqdm(list(unique.values()), desc=f"{model_name} nodes", disable=not progress, unit="op"):
        fwd, bwd = time_call(call, device, repeats=repeats, flush_bytes=flush_bytes)
        out.append(KernelTiming(key=call.key, op_class=call.op_class, impl="torch",
                                dtype=_dtype_of(call), shape={}, fwd_ms=max(fwd, 1e-6),
                                bwd_ms=bwd, flops=call.flops, bytes=call.bytes, source="model"))
    return out


def load_on(model_name: str, device: torch.device, *, layers: int | None = None) -> torch.nn.Module:
    """``model_name`` (a published scenario model, ``zorse_fx.models.published``,
    with ``layers`` decoder layers if given; else a ``zorse_fx.models.registry``
    name) on ``device`` as ``(input_ids, labels) -> loss``.

    Raises:
        ValueError: unknown name, or ``layers`` for a registry model.
    """
    from ..models import published
    from ..models.hf import CausalLMWithLoss, is_hf_causal_lm
    from ..models.registry import load_model

    if model_name in published.CONFIGS:
        model = published.build(model_name, device=device, num_layers=layers)
    else:
        if layers is not None:
            raise ValueError(f"--layers applies to the published models ({', '.join(sorted(published.CONFIGS))}), "
                             f"not to {model_name!r}")
        model = load_model(model_name)[0].to(device)
    return CausalLMWithLoss(model) if is_hf_causal_lm(model) else model


def whole_fwd_bwd_ms(gm, inputs, device: torch.device, autocast_dtype: torch.dtype | None, *,
                     min_ms: float = 30.0) -> float:
    """Wall time (ms) of one forward (under ``autocast_dtype``'s autocast) and
    backward of ``gm``, gradients accumulating into ``.grad`` as over a step's
    micro-batches; median of 3 runs of >= ``min_ms`` each after one warm-up (paced under ``ZORSE_PACE``,
    as ``cost.replay``'s samples)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def step():
        with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            loss = gm(*inputs)
        loss.backward()

    step()
    sync()
    t0 = time.perf_counter()
    step()
    sync()
    n = max(1, int(min_ms / max((time.perf_counter() - t0) * 1e3, 1e-3)))
    pacer = Pacer.from_environment() if device.type == "cpu" else Pacer(1.0)  # the box ([Note: paced compute])
    out = []
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        paced = pacer.start()
        for _ in range(n):
            step()
        sync()
        out.append((pacer.emulated_s(paced) if pacer.active else time.perf_counter() - t0) * 1e3 / n)
    for p in gm.parameters():
        p.grad = None
    return statistics.median(out)


def measure_model_graph(model_name: str, seq_lens: list[int], batch_sizes: list[int], device: torch.device, *,
                        precision: str, layers: int | None = None, progress=True):
    """The model sweep on the run's own tensors (``replay.graph_node_times``)
    under ``precision``'s autocast, at every (sequence length, micro-batch).

    Returns ``(entries, whole, graphs)``: one :class:`KernelTiming` per
    distinct node signature (keyed as ``cost.measured`` looks nodes up;
    ``dtype`` = the compute dtype for matmul and attention, else the node's
    output dtype); ``whole`` = ``[{"seq", "micro_batch", "fwd_bwd_ms",
    "node_sum_ms"}]``, the whole graph's measured forward + backward
    (``whole_fwd_bwd_ms``) beside the sum of its nodes; ``graphs`` =
    ``{seq: BlockGraph}`` (a capture per sequence length).
    """
    from tqdm import tqdm

    from ..capture import analyse, capture
    from ..precision import precision_policy
    from ..cost.replay import graph_node_times, model_calls

    pol = precision_policy(precision)
    amp = pol.compute_dtype if pol.mixed else None
    model = load_on(model_name, device, layers=layers)
    vocab = getattr(getattr(getattr(model, "model", None), "config", None), "vocab_size", 200)
    entries: dict[str, KernelTiming] = {}
    whole, graphs = [], {}
    for seq in seq_lens:
        ids = torch.randint(0, vocab, (2, seq), device=device)
        captured = capture(model, (ids, ids.clone()))
        graphs[seq] = analyse(captured)
        gm = captured.graph_module
        for n in tqdm(batch_sizes, desc=f"{model_name} seq {seq}", disable=not progress, unit="micro-batch"):
            x = torch.randint(0, vocab, (n, seq), device=device)
            calls = model_calls(captured, n)
            times = graph_node_times(gm, (x, x.clone()), device, autocast_dtype=amp)
            total = 0.0
            for name, (fwd, bwd, out_dtype) in times.items():
                call = calls.get(name)
                if call is None:
                    continue
                total += fwd + (bwd or 0.0)
                dtype = (str(pol.compute_dtype).removeprefix("torch.") if call.op_class in ("matmul", "attention")
                         else out_dtype or "float32")
                entries.setdefault(call.key, KernelTiming(
                    key=call.key, op_class=call.op_class, impl="torch", dtype=dtype, shape={},
                    fwd_ms=max(fwd, 1e-6), bwd_ms=bwd, flops=call.flops, bytes=call.bytes, source="model"))
            whole.append(dict(seq=seq, micro_batch=n, fwd_bwd_ms=whole_fwd_bwd_ms(gm, (x, x.clone()), device, amp),
                              node_sum_ms=total))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return list(entries.values()), whole, graphs


def _seq_batch(p: argparse.ArgumentParser, text: str) -> tuple[int, int]:
    try:
        seq, batch = (int(v) for v in text.split(","))
    except ValueError:
        p.error(f"--calibrate-at {text!r}: give SEQ,MICRO_BATCH, e.g. --calibrate-at 4096,1")
    return seq, batch


def predict_fwd_bwd_ms(profile: KernelProfile, bg, batch: int, precision: str, *,
                       weight_casts: bool = False) -> float:
    """The measured-profile path's forward + backward (ms) of the whole of
    ``bg`` at micro-batch ``batch``: ``cost.measured.measured_block_costs``
    with ``profile`` alone (its device type, its ``batch_sizes``' extremes),
    as the planner prices a stage holding every block. ``weight_casts``: add autocast's casts of the
    weights to the compute dtype, which the whole-graph measurement (``whole_fwd_bwd_ms``: one
    autocast region per forward) pays every forward, and the runtime once per step ([Note: the
    runtime's gradient work] in cost/roofline.py): what that measurement is compared with."""
    from ..cluster import gpu_spec
    from ..cost.measured import ProfileSet, grad_cast_ms, measured_block_costs
    from ..cost.roofline import block_costs, saved_activations_or_estimate
    from ..errors import ClusterConfigError
    from ..precision import precision_policy

    t = profile.device.device_type
    try:
        spec = gpu_spec(t)
    except ClusterConfigError:  # a profiled type needs no datasheet row (a CPU)
        spec = None
    pol = precision_policy(precision)
    acts = saved_activations_or_estimate(bg, pol)
    base = block_costs(bg, {}, precision=pol, activations=acts)  # sizes only: the times come from the profile
    costs, _ = measured_block_costs(bg, {t: spec}, ProfileSet([profile]),
                                    batches=(min(profile.batch_sizes), max(profile.batch_sizes)),
                                    base=base, compute_dtype=pol.compute_dtype, cast_params=acts.cast_params)
    out = sum(f + batch * s for f, s in zip(costs.fwd_bwd_s_fixed[t], costs.fwd_bwd_s_per_sample[t])) * 1e3
    if weight_casts and pol.mixed:  # 4 B read + 2 B written per element: the size of a gradient cast's bytes
        state = bg.captured.state()
        out += profile.calibration * sum(grad_cast_ms(profile, state[a].numel()) for a in acts.cast_params or ())
    return out


def calibrate_graph(profile: KernelProfile, whole: list[dict], graphs: dict, at: list[tuple[int, int]],
                    precision: str) -> tuple[float, float, str, list[dict]]:
    """Fit the profile's ``calibration`` (a) and ``node_overhead_ms`` (b) so
    that measured = a * predicted + b * nodes at the points ``at`` = [(seq,
    micro-batch), ...] of ``whole`` (predicted: ``predict_fwd_bwd_ms(weight_casts=True)`` with a
    = 1, b = 0; nodes: ``cost.measured.computing_nodes``). One point: b = 0,
    a = measured / predicted. Two or more: least squares; a negative b is set
    to 0 and a refitted. Returns ``(a, b, note, rows)``; rows = every point of
    ``whole`` with ``measured_ms``, ``raw_ms`` (a = 1, b = 0), ``predicted_ms``
    (fitted) and ``error`` = predicted / measured - 1 (``calibration_point``
    marks the fitted points; the others are held out).

    Raises:
        ValueError: a point of ``at`` was not measured.
    """
    from ..cost.measured import computing_nodes

    bare = dataclasses.replace(profile, calibration=1.0, node_overhead_ms=0.0, by_key={})
    rows = []
    for w in whole:
        bg = graphs[w["seq"]]
        rows.append(dict(seq=w["seq"], micro_batch=w["micro_batch"], measured_ms=w["fwd_bwd_ms"],
                         raw_ms=predict_fwd_bwd_ms(bare, bg, w["micro_batch"], precision, weight_casts=True),
                         nodes=computing_nodes(bg, w["micro_batch"])))
    measured_at = [(r["seq"], r["micro_batch"]) for r in rows]
    missing = [p for p in at if tuple(p) not in measured_at]
    if missing or not at:
        raise ValueError(f"--calibrate-at {missing or at}: not a measured (seq, micro-batch); measured: {measured_at}")
    fit = [r for r in rows if (r["seq"], r["micro_batch"]) in {tuple(p) for p in at}]
    a, b = _fit_scale_offset([(r["raw_ms"], r["nodes"], r["measured_ms"]) for r in fit])
    for r in rows:
        r["predicted_ms"] = a * r["raw_ms"] + b * r["nodes"]
        r["error"] = r["predicted_ms"] / r["measured_ms"] - 1
        r["calibration_point"] = r in fit
    where = ", ".join(f"seq {s} micro-batch {n}" for s, n in at)
    note = (f"calibration {a:.4f}, node overhead {1e3 * b:.2f} us x {fit[0]['nodes']} nodes: fitted to the whole "
            f"graph's measured fwd+bwd at {where}")
    return a, b, note, rows


def _fit_scale_offset(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """``(a, b)`` minimising sum (a*x + b*n - y)^2 over ``(x, n, y)``, b >= 0
    (one point, or a singular system: b = 0)."""
    if len(points) >= 2:
        sxx = sum(x * x for x, _, _ in points)
        snn = sum(n * n for _, n, _ in points)
        sxn = sum(x * n for x, n, _ in points)
        sxy = sum(x * y for x, _, y in points)
        sny = sum(n * y for _, n, y in points)
        det = sxx * snn - sxn * sxn
        if abs(det) > 1e-12 * max(sxx * snn, 1e-300):
            a = (sxy * snn - sny * sxn) / det
            b = (sxx * sny - sxn * sxy) / det
            if b >= 0 and a > 0:
                return a, b
    sxx = sum(x * x for x, _, _ in points)
    return sum(x * y for x, _, y in points) / sxx, 0.0


#: Samples of the whole model's fwd+bwd on each side of the node sweep (``calibrate``), at least.
WHOLE_REPEATS = 7


def calibrate(model_name: str, seq_len: int, batch: int, device: torch.device, *, repeats: int,
              flush_bytes: int) -> tuple[float, str]:
    """Measured whole-model fwd+bwd / sum of its replayed node times (see KernelProfile.calibration).

    The whole is timed both before and after the node sweep (each the median of ``max(repeats,
    WHOLE_REPEATS)`` samples) and the two averaged: the sweep takes a minute or more, and a machine whose
    speed drifts within it (the box's shared CPU, bench/drift_probe.py) is then measured at the same mean
    moment for the whole as for its nodes; with one short measurement at the end, the calibration of one
    emulated type came out 1.03-1.15 (T4) from box to box on one day (bench/LOG.md, 2026-12-07, "The one-GPU
    plan's forward on the box", "The calibration around the sweep")."""
    from ..capture import analyse, capture
    from ..models.hf import CausalLMWithLoss, is_hf_causal_lm
    from ..models.registry import load_model
    from ..cost.replay import _timeit, model_calls, time_call

    model, _ = load_model(model_name)
    if is_hf_causal_lm(model):
        model = CausalLMWithLoss(model)
    ids = torch.randint(0, 200, (batch, seq_len), device=device)
    captured = capture(model.to(device), (ids[:2].cpu(), ids[:2].cpu()))
    analyse(captured)
    gm = captured.graph_module.to(device)

    def step():
        gm(ids, ids).backward()

    whole_repeats = max(repeats, WHOLE_REPEATS)
    before = _timeit(step, device, whole_repeats)
    cache: dict[str, tuple[float, float | None]] = {}
    total = 0.0
    for call in model_calls(captured, batch).values():
        if call.key not in cache:
            cache[call.key] = time_call(call, device, repeats=repeats, flush_bytes=flush_bytes)
        fwd, bwd = cache[call.key]
        total += fwd + (bwd or 0.0)
    after = _timeit(step, device, whole_repeats)
    whole = (before + after) / 2
    return whole / total, (f"{model_name} batch {batch} seq {seq_len}: whole {whole:.2f} ms (before the nodes "
                           f"{before:.2f}, after {after:.2f}) / nodes {total:.2f} ms")


def measure_optimizer(device: torch.device, *, num_params: int = 32 << 20, repeats: int = 3,
                      model: torch.nn.Module | None = None, batch: tuple[torch.Tensor, torch.Tensor] | None = None,
                      samples: int = 15) -> float:
    """The optimizer phase's per-parameter time, ns: AdamW (``torch.optim.AdamW``, fp32; fused on a CPU, as the
    runtime steps there), and with ``model`` the gradient norm before it ([Note: the measured optimizer step]).

    Without ``model``: AdamW over ``num_params`` parameters in tensors of 1 M elements, median of ``repeats``
    timing windows (a streaming, bandwidth-bound step). With ``model`` (a module ``(input_ids, labels) ->
    loss`` on ``device``) and ``batch`` (its ``(input_ids, labels)``): the model's own parameters, each of
    ``samples`` steps timed right after a forward and backward of ``batch`` (untimed), as the runtime's step
    follows its backward: the gradients' global norm (``torch._foreach_norm``, as ``StageWorker`` computes it)
    and then the AdamW step, each paced under ``ZORSE_PACE`` ([Note: paced compute]); the median."""
    from ..cost.replay import _timeit

    if model is None:
        chunks = [torch.nn.Parameter(torch.randn(1 << 20, device=device)) for _ in range(num_params >> 20)]
        for p in chunks:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(chunks, lr=1e-4, fused=True if device.type == "cpu" else None)  # (the runtime's)
        ms = _timeit(opt.step, device, repeats)
        return ms * 1e6 / num_params
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True if device.type == "cpu" else None)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    pacer = Pacer.from_environment() if device.type == "cpu" else Pacer(1.0)

    def timed(fn) -> float:
        sync()
        t0, paced = time.perf_counter(), pacer.start()
        fn()
        sync()
        return pacer.emulated_s(paced) if pacer.active else time.perf_counter() - t0

    def norm() -> None:
        grads = [p.grad for p in params if p.grad is not None]
        torch.stack([n.float() for n in torch._foreach_norm(grads, 2.0)]).pow(2).sum()

    times = []
    for k in range(samples + 1):
        opt.zero_grad(set_to_none=False)  # (the runtime's gradients live on from step to step)
        model(*batch).backward()
        t = timed(norm) + timed(opt.step)
        if k:  # (the first step creates AdamW's state)
            times.append(t)
    return statistics.median(times) * 1e9 / sum(p.numel() for p in params)


def _dtype_of(call) -> str:
    for a in call.args:
        if hasattr(a, "dtype") and getattr(a.dtype, "is_floating_point", False):
            return str(a.dtype).removeprefix("torch.")
    return "float32"


def measure_standard(device: torch.device, *, repeats: int, cpu_scale: float, progress=True) -> list[KernelTiming]:
    """The kernel registry's standard sweep (Triton + torch on GPU, torch on CPU)."""
    from tqdm import tqdm

    try:
        from zorse_kernels import OPS
    except ImportError:
        return []
    from ..cost.replay import _timeit

    on_gpu = device.type == "cuda"
    jobs = []
    for op in OPS.values():
        for shape in op.standard_shapes:
            if not on_gpu:
                shape = {k: (max(1, int(v * cpu_scale)) if isinstance(v, int) and not isinstance(v, bool)
                             and k not in ("D",) else v) for k, v in shape.items()}
            for dtype in (op.dtypes if on_gpu else (torch.float32,)):
                jobs.append((op, shape, dtype))
    out = []
    for op, shape, dtype in tqdm(jobs, desc="standard sweep", disable=not progress, unit="op"):
        inputs = op.make_inputs(shape, dtype, device)
        impls = [("torch", op.reference)] + ([("triton", op.triton_forward)] if on_gpu else [])
        for impl, fn in impls:
            if on_gpu:
                import triton.testing

                ms = float(triton.testing.do_bench(lambda: fn(*inputs), rep=max(20, repeats * 5)))
            else:
                with torch.no_grad():
                    ms = _timeit(lambda: fn(*inputs), device, repeats)
            key = f"{op.name}(" + ",".join(f"{k}={v}" for k, v in sorted(shape.items())) + ")"
            out.append(KernelTiming(key=key, op_class=op.op_class, impl=impl, dtype=str(dtype).removeprefix("torch."),
                                    shape=dict(shape), fwd_ms=max(ms, 1e-6), bwd_ms=None,
                                    flops=float(op.flops(shape)), bytes=float(op.bytes_moved(shape, dtype)),
                                    source="standard"))
    return out


def summary(profile: KernelProfile) -> str:
    """Per op class: entries, median achieved TFLOP/s (compute) or GB/s (memory)."""
    import io

    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"kernel profile: {profile.device.device_type} ({profile.device.name})")
    for col in ("op class", "impl", "entries", "median fwd ms", "median achieved", "best achieved"):
        t.add_column(col, justify="left" if col in ("op class", "impl") else "right")
    groups = defaultdict(list)
    for e in profile.entries:
        groups[(e.op_class, e.impl)].append(e)
    for (cls, impl), es in sorted(groups.items()):
        compute = cls in ("matmul", "attention")
        vals = [e.achieved_tflops if compute else e.achieved_gbps for e in es]
        unit = "TFLOP/s" if compute else "GB/s"
        t.add_row(cls, impl, str(len(es)), f"{statistics.median(e.fwd_ms for e in es):.4f}",
                  f"{statistics.median(vals):.3g} {unit}", f"{max(vals):.3g} {unit}")
    buf = io.StringIO()
    Console(file=buf, width=120).print(t)
    return buf.getvalue() + f"per-op floor (smallest op): {profile.overhead_ms * 1e3:.1f} µs"


def plot(profile: KernelProfile, path: Path, peaks: dict[str, float] | None = None) -> None:
    """Achieved throughput vs size per op class; datasheet peak as a line where known."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = sorted({e.op_class for e in profile.entries})
    ncols = min(4, len(classes))
    nrows = -(-len(classes) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.4 * ncols, 3.0 * nrows), squeeze=False)
    for ax in axes.flat[len(classes):]:
        ax.set_visible(False)
    for ax, cls in zip(axes.flat, classes):
        compute = cls in ("matmul", "attention")
        for impl, marker in (("torch", "o"), ("triton", "x")):
            es = [e for e in profile.entries if e.op_class == cls and e.impl == impl]
            if es:
                xs = [e.flops if compute else e.bytes for e in es]
                ys = [e.achieved_tflops if compute else e.achieved_gbps for e in es]
                ax.scatter(xs, ys, marker=marker, s=14, label=impl)
        if peaks and (cls in peaks):
            ax.axhline(peaks[cls], color="red", lw=1, ls="--", label="datasheet peak")
        ax.set_xscale("log")
        ax.set_title(cls, fontsize=9)
        ax.set_xlabel("FLOPs" if compute else "bytes", fontsize=8)
        ax.set_ylabel("TFLOP/s" if compute else "GB/s", fontsize=8)
        ax.legend(fontsize=7)
    fig.suptitle(f"{profile.device.device_type}: achieved throughput per op class", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser(add_help: bool = True) -> argparse.ArgumentParser:
    """The options of ``zorse bench kernels`` (``add_help=False``: for the CLI's ``parents=``)."""
    p = argparse.ArgumentParser(prog="zorse bench kernels", description=__doc__.splitlines()[0], add_help=add_help)
    from ..models import published
    from ..models.registry import MODEL_HELP

    p.add_argument("--model", action="append", default=[], help=(
        f"model to sweep (repeatable): {MODEL_HELP}, or a published model ({', '.join(sorted(published.CONFIGS))})"))
    p.add_argument("--seq-len", default="64", help="sequence lengths, comma separated (`fake` replay: the first)")
    p.add_argument("--layers", type=int, help="decoder layers of a published model (zorse_fx.models.published; "
                   "default: all)")
    p.add_argument("--replay", choices=("graph", "fake"),
                   help="`graph`: re-run each node on the model's own tensors under the precision's autocast, "
                        "device time only, calibrated against the whole graph (default on a GPU); `fake`: random "
                        "tensors of the fake-propagated shapes, host-timed (default on a CPU)")
    p.add_argument("--precision", help="autocast of the `graph` replay: fp32, bf16-mixed, fp16-mixed "
                   "(default bf16-mixed on a GPU, fp32 on a CPU)")
    p.add_argument("--calibrate-at", action="append", metavar="SEQ,MICRO_BATCH",
                   help="`graph` replay: a measured point whose whole-graph fwd+bwd calibrates the profile "
                        "(repeatable; two or more also fit the per-node overhead; default: the longest and the "
                        "shortest sequence at the smallest micro-batch)")
    p.add_argument("--batch-sizes", default="1,8", help="micro-batch sizes, comma separated")
    p.add_argument("--no-standard", action="store_true", help="skip the standard sweep")
    p.add_argument("--device-type", help="cluster GPU type this profile describes (default: detected)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (ranks use 1)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--flush-bytes", type=int, default=4 << 20,
                   help="cache-flush buffer written before each timed run (0: off)")
    p.add_argument("--cpu-scale", type=float, default=0.25, help="scale of standard shapes on CPU")
    p.add_argument("--min-window-ms", type=float, default=0.0, metavar="MS",
                   help="`fake` replay and the CPU: each timed sample is the mean of back-to-back calls filling at "
                        "least MS of wall time (default 0: one call). Give ~20 CPU-quota periods where the CPU is "
                        "rationed (a container's CPU limit, zorse box ranks: 200): short calls run unthrottled")
    p.add_argument("--calibrate", default="gpt", help="`fake` replay: model whose whole fwd+bwd calibrates node "
                   "replays ('' = off)")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--report", help="`graph` replay: JSON of the calibration and each point's measured and "
                   "predicted whole-graph fwd+bwd")
    p.add_argument("--plot", help="PNG of achieved throughput per op class")
    return p


def _int_list(p: argparse.ArgumentParser, flag: str, text: str, what: str, example: str) -> list[int]:
    """``text`` ("1,4") as distinct integers >= 1, in order; ``p.error`` naming ``flag`` otherwise."""
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        p.error(f"{flag} {text!r}: give {what}, integers >= 1 separated by commas, e.g. {flag} {example}")
    if len(set(values)) != len(values):
        p.error(f"{flag} {text!r}: {what} given twice; give each once, e.g. {flag} {example}")
    return values


def _writable_file(p: argparse.ArgumentParser, flag: str, path: str | None) -> None:
    if path is not None and Path(path).is_dir():
        p.error(f"{flag} {path}: is a directory; give the file to write, e.g. {flag} {Path(path) / 'profile.json'}")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Every option's value and combination checked before anything is
    loaded or measured (a refused one is ``p.error``: one line naming the
    flag, exit status 2), ``--seq-len`` and ``--batch-sizes`` turned into
    lists of integers. A model sweep needs two micro-batch sizes: the cost
    model fits each node's fixed and per-sample time between the profile's
    smallest and largest (``cost.measured.measured_block_costs``), and the
    ``graph`` replay's calibration prices the whole graph that way."""
    from ..models import published
    from ..models.registry import MODEL_NAMES
    from ..precision import PRECISIONS

    args.seq_len = _int_list(p, "--seq-len", args.seq_len, "sequence lengths", "64,256")
    args.batch_sizes = _int_list(p, "--batch-sizes", args.batch_sizes, "micro-batch sizes", "1,4")
    known = (*MODEL_NAMES, *sorted(published.CONFIGS))
    for name in [*args.model, *([args.calibrate] if args.calibrate else [])]:
        if name not in known and ":" not in name:
            flag = "--model" if name in args.model else "--calibrate"
            p.error(f"{flag} {name!r}: unknown model; use one of {', '.join(known)} or module:function")
    if args.model and len(args.batch_sizes) < 2:
        p.error(f"--batch-sizes {','.join(map(str, args.batch_sizes))}: the model sweep needs two or more "
                f"micro-batch sizes (each node's time is fitted between the smallest and the largest), e.g. "
                f"--batch-sizes {args.batch_sizes[0]},{max(4, 2 * args.batch_sizes[0])}")
    if args.layers is not None:
        if args.layers < 1:
            p.error(f"--layers {args.layers}: give the decoder layers to keep, an integer >= 1")
        others = [m for m in args.model if m not in published.CONFIGS]
        if others or not args.model:
            p.error(f"--layers applies to the published models ({', '.join(sorted(published.CONFIGS))}), not to "
                    f"{', '.join(map(repr, others)) or 'the standard sweep alone (no --model)'}; drop --layers")
    for flag, value, low in (("--threads", args.threads, 1), ("--repeats", args.repeats, 1),
                             ("--flush-bytes", args.flush_bytes, 0)):
        if value < low:
            p.error(f"{flag} {value}: give an integer >= {low}")
    if not args.cpu_scale > 0:
        p.error(f"--cpu-scale {args.cpu_scale}: give a scale > 0 of the standard shapes (default 0.25)")
    if args.precision is not None and args.precision not in PRECISIONS:
        p.error(f"--precision {args.precision!r}: use one of {', '.join(PRECISIONS)}")
    replay = args.replay or ("graph" if torch.cuda.is_available() else "fake")
    graph_only = [f for f, v in (("--calibrate-at", args.calibrate_at), ("--report", args.report)) if v]
    if replay != "graph" and graph_only:
        p.error(f"{' and '.join(graph_only)} appl{'y' if len(graph_only) > 1 else 'ies'} to the `graph` replay "
                f"(this one is `{replay}`: the default on a CPU); add --replay graph or drop "
                f"{' and '.join(graph_only)}")
    if replay == "fake" and args.calibrate and max(args.batch_sizes) < 2:
        p.error(f"--batch-sizes {','.join(map(str, args.batch_sizes))}: the `fake` replay's calibration runs "
                f"--calibrate {args.calibrate!r} whole at the largest micro-batch size, which must be >= 2 (capture "
                f"keeps the batch dimension symbolic); e.g. --batch-sizes 1,4, or --calibrate '' to skip it")
    for text in args.calibrate_at or ():
        seq, batch = _seq_batch(p, text)
        if seq not in args.seq_len or batch not in args.batch_sizes:
            p.error(f"--calibrate-at {text}: not a measured point; give SEQ from --seq-len "
                    f"({','.join(map(str, args.seq_len))}) and MICRO_BATCH from --batch-sizes "
                    f"({','.join(map(str, args.batch_sizes))})")
    if not (args.min_window_ms >= 0 and math.isfinite(args.min_window_ms)):
        p.error(f"--min-window-ms {args.min_window_ms}: give milliseconds >= 0 (0: one call per sample)")
    if not args.model and args.no_standard:
        p.error("nothing to measure: give --model, or drop --no-standard")
    for flag, path in (("-o", args.output), ("--report", args.report), ("--plot", args.plot)):
        _writable_file(p, flag, path)
    return args


def main(argv=None) -> int:
    p = build_parser()
    return run(check_args(p, p.parse_args(argv)))


def run(args) -> int:
    """Measure and write the profile ``build_parser``'s options ``args``
    describe, checked by ``check_args``."""
    from ..cost.replay import timing_window

    with timing_window(args.min_window_ms):  # [Note: timing windows]
        return _run(args)


def _run(args) -> int:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    info = device_info(device, args.device_type, args.threads if device.type == "cpu" else 1)
    batches, seqs = list(args.batch_sizes), list(args.seq_len)
    replay = args.replay or ("graph" if device.type == "cuda" else "fake")
    precision = args.precision or ("bf16-mixed" if device.type == "cuda" else "fp32")
    entries: list[KernelTiming] = []
    calibration, node_overhead, cal_note = 1.0, 0.0, "none"
    graph_runs = []
    for name in args.model:
        if replay == "graph":
            es, whole, graphs = measure_model_graph(name, seqs, batches, device, precision=precision,
                                                    layers=args.layers)
            entries += es
            graph_runs.append((name, whole, graphs))
        else:
            entries += measure_model(name, seqs[0], batches, device, repeats=args.repeats,
                                     flush_bytes=args.flush_bytes if device.type == "cpu" else 0)
    if not args.no_standard:
        entries += measure_standard(device, repeats=args.repeats, cpu_scale=args.cpu_scale)
    if not entries:  # (the standard sweep without the zorse_kernels package, no --model)
        raise SystemExit("zorse bench kernels: nothing measured (give --model, or install kernels/ for the "
                         "standard sweep)")
    if graph_runs:
        name, whole, graphs = graph_runs[0]
        at = ([tuple(int(v) for v in text.split(",")) for text in args.calibrate_at] if args.calibrate_at
              else sorted({(max(seqs), min(batches)), (min(seqs), min(batches))}, reverse=True))
        draft = KernelProfile(device=info, measured_at="", overhead_ms=0.0, entries=tuple(entries),
                              batch_sizes=tuple(batches))
        calibration, node_overhead, note, rows = calibrate_graph(draft, whole, graphs, at, precision)
        cal_note = f"{name}: {note}"
        print(f"[zorse] calibration {cal_note}")
        if args.report:
            Path(args.report).parent.mkdir(parents=True, exist_ok=True)
            Path(args.report).write_text(json.dumps(dict(model=name, layers=args.layers, precision=precision,
                                                         calibrate_at=at, calibration=calibration,
                                                         node_overhead_ms=node_overhead, note=note,
                                                         points=rows), indent=1) + "\n")
        for r in rows:
            print(f"[zorse]   seq {r['seq']} micro-batch {r['micro_batch']}: measured {r['measured_ms']:.2f} ms, "
                  f"profile path {r['predicted_ms']:.2f} ms ({100 * r['error']:+.1f}%"
                  f"{', fitted' if r['calibration_point'] else ', held out'})")
    elif args.calibrate:
        calibration, cal_note = calibrate(args.calibrate, seqs[0], max(batches), device, repeats=args.repeats,
                                          flush_bytes=args.flush_bytes if device.type == "cpu" else 0)
        print(f"[zorse] calibration {calibration:.3f} ({cal_note})")
    if args.model and device.type == "cpu":  # [Note: the measured optimizer step]
        model = load_on(args.model[0], device, layers=args.layers)
        ids = torch.randint(0, 200, (max(batches), seqs[0]), device=device)
        opt_ns = measure_optimizer(device, model=model, batch=(ids, ids))
        del model
        opt_how = f"gradient norm + AdamW on {args.model[0]}'s parameters after its backward"
    else:
        opt_ns = measure_optimizer(device)
        opt_how = "AdamW over 32 M parameters in 1 M tensors"
    print(f"[zorse] optimizer step: {opt_ns:.2f} ns/param ({opt_how})")
    uniq = {}
    for e in entries:
        uniq.setdefault((e.key, e.impl), e)
    profile = KernelProfile(
        device=info,
        measured_at=dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
        overhead_ms=min(e.fwd_ms for e in uniq.values()),
        entries=tuple(uniq.values()),
        notes=f"models: {', '.join(args.model) or '-'}{f' ({args.layers} layers)' if args.layers else ''}; "
              f"seq_len {','.join(map(str, seqs))}; batch sizes {batches}; replay {replay}"
              + (f" under {precision} autocast, device time; " if replay == "graph" else
                 f"; repeats {args.repeats}"
                 + (f" of >= {args.min_window_ms:g} ms windows" if args.min_window_ms else "")
                 + f"; flush {args.flush_bytes} B; ")
              + f"calibration: {cal_note}; optimizer: {opt_how}",
        calibration=calibration,
        node_overhead_ms=node_overhead,
        batch_sizes=tuple(batches) if args.model else (),
        optimizer_ns_per_param=opt_ns,
    )
    path = profile.save(args.output)
    print(summary(profile))
    print(f"[zorse] wrote {path} ({len(profile.entries)} entries)")
    if args.plot:
        peaks = None
        if device.type == "cuda":
            from ..cluster import gpu_spec

            spec = gpu_spec(info.device_type)
            peaks = {"matmul": spec.peak_flops_per_s("float32") / 1e12, "attention": spec.peak_flops_per_s("float32") / 1e12}
            peaks.update({c: spec.mem_bw_bytes_per_s / 1e9 for c in ("norm", "elementwise", "copy", "softmax",
                                                                       "cross_entropy", "embedding")})
        plot(profile, Path(args.plot), peaks)
        print(f"[zorse] wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
