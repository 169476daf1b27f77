"""``zorse bench kernels``: measure a kernel profile on the present device.

    zorse bench kernels --model smollm2-135m --seq-len 64 --batch-sizes 1,6 \\
        --device-type cpu-x86-1thread -o profiles/cpu-x86-1thread.json --plot profiles/cpu.png

Two sweeps, both written to one profile (``profile.py``):

- the model sweep: every distinct computing node of the traced model at each
  micro-batch size, replayed with the ATen op the runtime executes
  (``replay.py``), forward and backward;
- the standard sweep: the Triton kernel registry (``kernels/zorse_kernels``)
  at its standard shapes. On a GPU both the Triton kernel and the torch
  reference are timed (``triton.testing.do_bench``); on a CPU only the torch
  reference (Triton runs only in its interpreter there), at shapes scaled down
  by ``--cpu-scale``.

On a CPU the harness uses ``--threads`` threads (default 1, as each rank does).
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import socket
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from .profile import DeviceInfo, KernelProfile, KernelTiming

__all__ = ["build_parser", "main", "run", "measure_model", "measure_standard", "device_info"]


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
    return DeviceInfo(device_type=device_type or f"cpu-{platform.machine()}-{threads}thread", name=_cpu_name(),
                      backend="cpu", torch_version=torch.__version__, triton_version=triton_version,
                      host=socket.gethostname(), threads=threads)


def measure_model(model_name: str, seq_len: int, batch_sizes: list[int], device: torch.device,
                  *, repeats: int, flush_bytes: int, progress=True) -> list[KernelTiming]:
    """Entries for every distinct node of ``model_name`` at each micro-batch size."""
    from tqdm import tqdm

    from ..api import _is_hf_causal_lm
    from ..capture import analyse, capture
    from ..models.hf import CausalLMWithLoss
    from ..models.registry import load_model
    from .replay import model_calls, time_call

    model, _ = load_model(model_name)
    if _is_hf_causal_lm(model):
        model = CausalLMWithLoss(model)
    ids = torch.randint(0, 200, (2, seq_len))
    captured = capture(model, (ids, ids))
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


def calibrate(model_name: str, seq_len: int, batch: int, device: torch.device, *, repeats: int,
              flush_bytes: int) -> tuple[float, str]:
    """Measured whole-model fwd+bwd / sum of its replayed node times (see KernelProfile.calibration)."""
    from ..api import _is_hf_causal_lm
    from ..capture import analyse, capture
    from ..models.hf import CausalLMWithLoss
    from ..models.registry import load_model
    from .replay import _timeit, model_calls, time_call

    model, _ = load_model(model_name)
    if _is_hf_causal_lm(model):
        model = CausalLMWithLoss(model)
    ids = torch.randint(0, 200, (batch, seq_len), device=device)
    captured = capture(model.to(device), (ids[:2].cpu(), ids[:2].cpu()))
    analyse(captured)
    cache: dict[str, tuple[float, float | None]] = {}
    total = 0.0
    for call in model_calls(captured, batch).values():
        if call.key not in cache:
            cache[call.key] = time_call(call, device, repeats=repeats, flush_bytes=flush_bytes)
        fwd, bwd = cache[call.key]
        total += fwd + (bwd or 0.0)
    gm = captured.graph_module.to(device)

    def step():
        gm(ids, ids).backward()

    whole = _timeit(step, device, repeats)
    return whole / total, f"{model_name} batch {batch} seq {seq_len}: whole {whole:.2f} ms / nodes {total:.2f} ms"


def measure_optimizer(device: torch.device, *, num_params: int = 32 << 20, repeats: int = 3) -> float:
    """AdamW (torch.optim.AdamW, fp32) step time per parameter, ns."""
    from .replay import _timeit

    chunks = [torch.nn.Parameter(torch.randn(1 << 20, device=device)) for _ in range(num_params >> 20)]
    for p in chunks:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(chunks, lr=1e-4)
    ms = _timeit(opt.step, device, repeats)
    return ms * 1e6 / num_params


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
    from .replay import _timeit

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
    p.add_argument("--model", action="append", default=[], help="model to sweep (repeatable); see zorse_fx.models.registry")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-sizes", default="1,8", help="micro-batch sizes, comma separated")
    p.add_argument("--no-standard", action="store_true", help="skip the standard sweep")
    p.add_argument("--device-type", help="cluster GPU type this profile describes (default: detected)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (ranks use 1)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--flush-bytes", type=int, default=4 << 20,
                   help="cache-flush buffer written before each timed run (0: off)")
    p.add_argument("--cpu-scale", type=float, default=0.25, help="scale of standard shapes on CPU")
    p.add_argument("--calibrate", default="gpt", help="model whose whole fwd+bwd calibrates node replays ('' = off)")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--plot", help="PNG of achieved throughput per op class")
    return p


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv))


def run(args) -> int:
    """Measure and write the profile ``build_parser``'s options ``args`` describe."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    info = device_info(device, args.device_type, args.threads if device.type == "cpu" else 1)
    batches = [int(b) for b in args.batch_sizes.split(",") if b]
    entries: list[KernelTiming] = []
    for name in args.model:
        entries += measure_model(name, args.seq_len, batches, device, repeats=args.repeats,
                                 flush_bytes=args.flush_bytes if device.type == "cpu" else 0)
    if not args.no_standard:
        entries += measure_standard(device, repeats=args.repeats, cpu_scale=args.cpu_scale)
    if not entries:
        raise SystemExit("zorse bench kernels: nothing measured (give --model or allow the standard sweep)")
    calibration, cal_note = 1.0, "none"
    if args.calibrate:
        calibration, cal_note = calibrate(args.calibrate, args.seq_len, max(batches), device, repeats=args.repeats,
                                          flush_bytes=args.flush_bytes if device.type == "cpu" else 0)
        print(f"[zorse] calibration {calibration:.3f} ({cal_note})")
    opt_ns = measure_optimizer(device)
    print(f"[zorse] AdamW step: {opt_ns:.2f} ns/param")
    uniq = {}
    for e in entries:
        uniq.setdefault((e.key, e.impl), e)
    profile = KernelProfile(
        device=info,
        measured_at=dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
        overhead_ms=min(e.fwd_ms for e in uniq.values()),
        entries=tuple(uniq.values()),
        notes=f"models: {', '.join(args.model) or '-'}; seq_len {args.seq_len}; batch sizes {batches}; "
              f"repeats {args.repeats}; flush {args.flush_bytes} B; calibration: {cal_note}",
        calibration=calibration,
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
