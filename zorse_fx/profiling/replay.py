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

import statistics
import time
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..capture.analysis import _propagate
from ..capture.trace import META_KEY, CapturedModel, _fetch_attr
from ..cost.opclass import flops_bytes, op_class, signature, tensors_in

__all__ = ["NodeCall", "model_calls", "time_call"]


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
        values[n.name] = _fetch_attr(gm, n.target)
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
    """Median wall time of ``fn`` in ms (CUDA: synchronised)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        if flush is not None:
            flush.add_(1.0)  # evict caches: a model's ops do not find their inputs cache-hot
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
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
