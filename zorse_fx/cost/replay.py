"""Replay a captured model's own nodes, one at a time, to time them.

For a micro-batch of ``n`` samples, every computing node of the captured
graph (views excluded) becomes a :class:`NodeCall`: its ATen target and the
shapes/dtypes of its arguments, from a fake-tensor run (no real forward pass,
so a model of any size can be swept). Nodes with one signature (the 30 layers
of a Llama share a handful) are timed once: forward, and backward with
``torch.autograd.grad`` for the inputs that carry gradients in training
(activations and parameters).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..capture.analysis import _propagate
from ..capture.trace import META_KEY, CapturedModel, fetch_attr
from ..pacing import Pacer
from .opclass import flops_bytes, op_class, signature, tensors_in

__all__ = ["NodeCall", "model_calls", "time_call", "timing_window"]

# [Note: timing windows]
# A timed sample is one call by default: the median of `repeats` single calls, robust to a busy
# host. It is biased where the processor is rationed in time slices: under a CFS CPU quota (the
# box's ranks, zorse_fx/box; a container's CPU limit; a burstable cloud VM) a call shorter than the
# quota left in its period runs at full speed, and only longer ones wait for the next period, so
# the median of short calls is the unthrottled speed. Measured on the box (bench/LOG.md, "The box
# measures"): a V100 rank at 0.273 cores came out faster per sample than an A100 rank at 0.727.
# `timing_window(ms)` makes every sample the mean over the back-to-back calls made until `ms` of
# wall time has passed (so a sample takes about `ms` however rationed the CPU, not `ms` / quota):
# over a window of k quota periods the rank receives its quota within +-1 period,
# so the mean is the rationed rate within ~1/k (zorse bench kernels --min-window-ms; bench/box.py
# gives 200 ms = 20 periods of the box's 10 ms). The cache flush then runs once per window, not
# per call: the calls after the first find their inputs cache-warm.
_WINDOW_MS = [0.0]


@contextlib.contextmanager
def timing_window(ms: float) -> Iterator[None]:
    """Inside the block every timed sample is the mean of back-to-back calls filling >= ``ms`` of wall
    time (0: one call per sample) ([Note: timing windows])."""
    if not (ms >= 0 and math.isfinite(ms)):
        raise ValueError(f"timing window {ms!r} ms: give a number >= 0")
    old, _WINDOW_MS[0] = _WINDOW_MS[0], float(ms)
    try:
        yield
    finally:
        _WINDOW_MS[0] = old


@dataclass(frozen=True, slots=True)
class _T:
    """A tensor argument to materialise: shape, dtype, needs-grad."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    grad: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeCall:
    key: str
    op_class: str
    target: object
    args: tuple
    kwargs: dict
    flops: float
    bytes: float


def model_calls(captured: CapturedModel, batch: int) -> dict[str, NodeCall]:
    """``{node name: NodeCall}`` of every computing act node at micro-batch ``batch``."""
    gm = captured.graph_module
    if not any(META_KEY in n.meta for n in gm.graph.nodes):
        from ..capture.analysis import analyse

        analyse(captured)  # classifies nodes
    values = _propagate(gm, captured.example_inputs, batch)
    for n in gm.graph.find_nodes(op="get_attr"):
        values[n.name] = fetch_attr(gm, n.target)
    out: dict[str, NodeCall] = {}
    for node in gm.graph.nodes:
        if node.meta.get(META_KEY, {}).get("kind") != "act":
            continue
        cls = op_class(node)
        if cls is None:
            continue

        def spec(a):
            if isinstance(a, fx.Node):
                v = values[a.name]
                if isinstance(v, torch.Tensor):
                    kind = a.meta.get(META_KEY, {}).get("kind")
                    return _T(tuple(int(d) for d in v.shape), v.dtype, kind in ("act", "param") and v.is_floating_point())
                return v
            if isinstance(a, (list, tuple)):
                return type(a)(spec(x) for x in a)
            return a

        ins = [t for a in node.all_input_nodes for t in tensors_in(values[a.name])]
        outs = list(tensors_in(values[node.name]))
        flops, nbytes = flops_bytes(cls, ins, outs)
        kwargs = {k: spec(v) for k, v in node.kwargs.items()}
        if "device" in kwargs:
            kwargs["device"] = None
        out[node.name] = NodeCall(
            key=signature(node, values), op_class=cls,
            target=(node.target if node.op == "call_function" else ("method", node.target)),
            args=tuple(spec(a) for a in node.args), kwargs=kwargs, flops=flops, bytes=nbytes,
        )
    return out


def _materialise(call: NodeCall, device: torch.device):
    gen = torch.Generator(device="cpu").manual_seed(0)
    leaves: list[torch.Tensor] = []
    args_flat = [a for a in call.args]
    bound = None  # index bound for integer arguments (embedding ids, CE targets)
    if call.op_class == "embedding" and isinstance(args_flat[0], _T):
        bound = args_flat[0].shape[0]
    elif call.op_class == "cross_entropy" and isinstance(args_flat[0], _T):
        bound = args_flat[0].shape[-1]

    def make(a):
        if isinstance(a, _T):
            if a.dtype.is_floating_point:
                t = torch.randn(a.shape, generator=gen, dtype=torch.float32).to(dtype=a.dtype, device=device)
                if a.grad:
                    t.requires_grad_(True)
                    leaves.append(t)
                return t
            if a.dtype == torch.bool:
                return torch.ones(a.shape, dtype=torch.bool, device=device)
            hi = bound or 1
            return torch.randint(0, hi, a.shape, generator=gen).to(dtype=a.dtype, device=device)
        if isinstance(a, (list, tuple)):
            return type(a)(make(x) for x in a)
        return a

    args = tuple(make(a) for a in call.args)
    kwargs = {k: make(v) for k, v in call.kwargs.items()}
    return args, kwargs, leaves


def _run(call: NodeCall, args, kwargs):
    if isinstance(call.target, tuple):  # ("method", name)
        return getattr(args[0], call.target[1])(*args[1:], **kwargs)
    return call.target(*args, **kwargs)


def _timeit(fn, device: torch.device, repeats: int, flush: torch.Tensor | None = None) -> float:
    """Median wall time of ``fn`` in ms (CUDA: synchronised) over ``repeats`` samples: one call each, or
    inside ``timing_window`` the mean of the calls made until the window has passed ([Note: timing
    windows]: each sample then takes about the window, however rationed the CPU). On a CPU under
    ``ZORSE_PACE=F`` (the box) a sample is what the calls take on the emulated GPU, max(wall, F x the
    thread's CPU time) ([Note: paced compute] in zorse_fx/pacing.py)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    pacer = Pacer.from_environment() if device.type == "cpu" else Pacer(1.0)  # the box's emulated GPU speed
    fn()
    sync()
    window_s = _WINDOW_MS[0] / 1e3
    samples = []
    for _ in range(repeats):
        if flush is not None:
            flush.add_(1.0)  # evict caches: a model's ops do not find their inputs cache-hot
        sync()
        t0 = time.perf_counter()
        paced = pacer.start()
        calls = 0
        while True:  # one call, or calls until the window has passed (the wall time a rationed CPU takes)
            fn()
            sync()
            calls += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= window_s:
                break
        if pacer.active:  # what the calls take on the emulated GPU ([Note: paced compute] in zorse_fx/pacing.py)
            elapsed = pacer.emulated_s(paced)
        samples.append(elapsed * 1e3 / calls)
    return statistics.median(samples)


def time_call(call: NodeCall, device: torch.device, *, repeats: int = 5,
              flush_bytes: int = 0) -> tuple[float, float | None]:
    """(forward ms, backward ms or None) of one node call on ``device``.

    ``flush_bytes`` > 0 writes a buffer of that size before every timed run so
    the call starts with cold caches, as inside a whole model's step."""
    flush = torch.empty(flush_bytes // 4, device=device) if flush_bytes else None
    args, kwargs, leaves = _materialise(call, device)
    with torch.no_grad():
        fwd = _timeit(lambda: _run(call, args, kwargs), device, repeats, flush)
    if not leaves:
        return fwd, None
    out = _run(call, args, kwargs)
    outs = [o for o in tensors_in(out) if o.requires_grad]
    if not outs:
        return fwd, None
    grads = [torch.randn_like(o) for o in outs]
    bwd = _timeit(lambda: torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True),
                  device, repeats, flush)
    return fwd, bwd


def time_gpu_ms(fn, device: torch.device, *, min_ms: float = 2.0, samples: int = 3) -> float:
    """The device's time for one call of ``fn`` in ms, without the host's.

    On CUDA a ``torch.cuda._sleep`` kernel holds the GPU while the host queues
    the timed calls, so the host's dispatch cost (Python, autocast, the launch
    itself) is not in the figure: the kernels run back to back, as in a model
    whose host runs ahead of its GPU. Median over ``samples`` runs of the mean
    of ``n`` calls (``n`` up to 40, enough for ``min_ms``; few enough that the
    queued launches fit CUDA's launch queue). On a CPU: wall time
    (:func:`_timeit`, median of ``samples``).
    """
    if device.type != "cuda":
        return _timeit(fn, device, samples)
    fn()
    torch.cuda.synchronize(device)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    n = max(1, min(40, int(min_ms / max(a.elapsed_time(b), 1e-3))))
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize(device)
    out = []
    for _ in range(samples):
        torch.cuda._sleep(int(max(5.0, 3 * host_ms) * 1e6))  # cycles (>= 1 GHz): >= 3x the host's queueing time
        a.record()
        for _ in range(n):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / n)
    return statistics.median(out)


def graph_node_times(gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...], device: torch.device, *,
                     autocast_dtype: torch.dtype | None = None, timer=None,
                     on_node=None) -> dict[str, tuple[float, float | None, str]]:
    """``{node name: (forward ms, backward ms or None, output dtype)}`` of every computing
    node of an analysed graph (``op_class`` not None, kind ``act``), each re-run
    alone on the very tensors one run of ``gm(*inputs)`` gave it.

    Unlike :func:`time_call` (random tensors of the fake-propagated shapes and
    dtypes), the node sees the run's own dtypes, strides and values: under
    ``autocast_dtype`` (the runtime's autocast of a mixed-precision plan) each
    node runs the casts and kernels it runs in training. Inputs that carry a
    gradient in training (kinds ``act`` and ``param``) are aliases of the run's
    tensors with ``requires_grad``; the backward is ``torch.autograd.grad`` of
    the node's outputs, which returns gradients and accumulates none (the
    runtime's accumulation into ``.grad`` is priced apart:
    ``cost.measured.grad_accumulate_ms``). ``timer(fn) -> ms``: default
    :func:`time_gpu_ms`. ``on_node(name, fwd_fn, bwd_fn or None)`` is called
    for each node (to profile it). The run holds every value of the graph at
    once: about a training forward's activation memory.
    """
    timer = timer or (lambda f: time_gpu_ms(f, device))
    values: dict[str, object] = {}

    class _Keep(fx.Interpreter):
        def run_node(self, n):
            v = super().run_node(n)
            values[n.name] = v
            return v

    amp = (lambda: torch.autocast(device.type, dtype=autocast_dtype)) if autocast_dtype is not None else (
        lambda: torch.autocast(device.type, enabled=False))
    with torch.no_grad(), amp():
        _Keep(gm).run(*inputs)
    out: dict[str, tuple[float, float | None, str]] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method") or node.meta.get(META_KEY, {}).get("kind") != "act":
            continue
        if op_class(node) is None:
            continue
        carries = {a.name for a in node.all_input_nodes if a.meta.get(META_KEY, {}).get("kind") in ("act", "param")}
        leaves: list[torch.Tensor] = []

        def load(a):
            if isinstance(a, fx.Node):
                v = values[a.name]
                if isinstance(v, torch.Tensor):
                    v = v.detach()  # an alias: the run's own strides and layout
                    if a.name in carries and v.is_floating_point():
                        v.requires_grad_(True)
                        leaves.append(v)
                return v
            if isinstance(a, (list, tuple)):
                return type(a)(load(x) for x in a)
            if isinstance(a, dict):
                return {k: load(x) for k, x in a.items()}
            return a

        args, kwargs = load(node.args), load(node.kwargs)
        call = NodeCall(key="", op_class="", target=(node.target if node.op == "call_function" else ("method", node.target)),
                        args=args, kwargs=kwargs, flops=0.0, bytes=0.0)

        def fwd(call=call):
            with amp():
                return _run(call, call.args, call.kwargs)

        with torch.no_grad():
            f = timer(fwd)
        res = fwd()
        outs = [o for o in tensors_in(res) if o.requires_grad]
        bwd = None
        if leaves and outs:
            grads = [torch.randn_like(o) for o in outs]

            def bwd(outs=outs, leaves=leaves, grads=grads):
                return torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True)

        dts = [str(o.dtype).removeprefix("torch.") for o in tensors_in(res)]
        out[node.name] = (f, timer(bwd) if bwd is not None else None, dts[0] if dts else "")
        if on_node is not None:
            on_node(node.name, fwd, bwd)
        del res, outs
    values.clear()
    return out
