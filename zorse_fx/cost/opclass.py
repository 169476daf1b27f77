"""Operation classes of fx nodes, and node signatures for measured profiles.

Classes: ``matmul``, ``attention``, ``norm``, ``softmax``, ``cross_entropy``,
``embedding``, ``copy``, ``elementwise`` (everything else that computes), and
``None`` for views (no kernel). The *signature* of a node is its ATen target
with the dtypes and shapes of its tensor arguments and its other arguments,
e.g. ``aten.linear.default(f32[6,64,576], f32[1536,576])``: two nodes with one
signature run the same kernel.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

__all__ = ["op_class", "signature", "DTYPE_SHORT", "size_metric"]

_aten = torch.ops.aten
MATMUL = {
    _aten.linear.default, _aten.mm.default, _aten.bmm.default, _aten.addmm.default,
    _aten.matmul.default, torch._C._nn.linear, torch.matmul, torch.mm, torch.bmm,
    torch.nn.functional.linear,
}
ATTENTION = {_aten.scaled_dot_product_attention.default, torch.nn.functional.scaled_dot_product_attention}
NORM = {_aten.layer_norm.default, _aten.native_layer_norm.default, torch.nn.functional.layer_norm,
        _aten.rms_norm.default, getattr(torch.nn.functional, "rms_norm", None)}
SOFTMAX = {_aten._softmax.default, _aten.softmax.int, torch.nn.functional.softmax}
CROSS_ENTROPY = {_aten.cross_entropy_loss.default, torch.nn.functional.cross_entropy}
EMBEDDING = {_aten.embedding.default, torch.nn.functional.embedding}
COPY = {_aten._to_copy.default, _aten.to.dtype, _aten.to.dtype_layout, _aten.clone.default,
        _aten.contiguous.default, _aten.cat.default, torch.cat, _aten.pad.default}
VIEWS = {
    _aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten.transpose.int,
    _aten.expand.default, _aten.slice.Tensor, _aten.unsqueeze.default, _aten.squeeze.dim,
    _aten.alias.default, _aten.permute.default, _aten.t.default, _aten.split.Tensor,
    _aten.sym_size.int, _aten.select.int, operator.getitem, getattr,
}
VIEW_METHODS = {"view", "reshape", "transpose", "permute", "expand", "unsqueeze", "squeeze", "split", "size"}
COPY_METHODS = {"contiguous", "to", "float", "clone"}
DTYPE_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
               torch.int64: "i64", torch.int32: "i32", torch.bool: "b1", torch.uint8: "u8"}


def op_class(node: fx.Node) -> str | None:
    """The operation class of ``node`` (None: a view, or no tensor result)."""
    val = node.meta.get("zorse", {}).get("val_batch1", torch.empty(0))
    if not any(True for _ in tensors_in(val)):
        return None  # Python int arithmetic on shapes: no kernel
    if node.op == "call_method":
        if node.target in VIEW_METHODS:
            return None
        return "copy" if node.target in COPY_METHODS else "elementwise"
    if node.op != "call_function":
        return None
    t = node.target
    for cls, members in (("matmul", MATMUL), ("attention", ATTENTION), ("norm", NORM), ("softmax", SOFTMAX),
                         ("cross_entropy", CROSS_ENTROPY), ("embedding", EMBEDDING), ("copy", COPY)):
        if t in members:
            return cls
    if t in VIEWS:
        return None
    return "elementwise"


def _target_name(node: fx.Node) -> str:
    t = node.target
    if node.op == "call_method":
        return f"Tensor.{t}"
    if isinstance(t, torch._ops.OpOverload):
        return f"aten.{t._schema.name.split('::')[-1]}.{t._overloadname}"
    return f"{getattr(t, '__module__', '')}.{getattr(t, '__name__', str(t))}".lstrip(".")


def _arg_sig(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"{DTYPE_SHORT.get(v.dtype, str(v.dtype))}[{','.join(str(int(d)) for d in v.shape)}]"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_arg_sig(x) for x in v) + "]"
    if isinstance(v, torch.dtype):
        return DTYPE_SHORT.get(v, str(v))
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def signature(node: fx.Node, values: dict[str, object]) -> str:
    """``target(arg sigs; kwarg sigs)`` with concrete values from ``values`` (node name -> value)."""

    def val(a):
        if isinstance(a, fx.Node):
            return values[a.name]
        if isinstance(a, (list, tuple)):
            return type(a)(val(x) for x in a)
        return a

    args = ",".join(_arg_sig(val(a)) for a in node.args)
    kwargs = ",".join(f"{k}={_arg_sig(val(v))}" for k, v in sorted(node.kwargs.items()) if k not in ("device", "pin_memory", "layout"))
    return f"{_target_name(node)}({args}{';' + kwargs if kwargs else ''})"


def size_metric(op_cls: str, flops: float, nbytes: float) -> float:
    """The size a class's time scales with: FLOPs for matmul/attention, else bytes."""
    return flops if op_cls in ("matmul", "attention") else nbytes


def tensors_in(x):
    """Every tensor in a nested value."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from tensors_in(y)


def flops_bytes(op_cls: str | None, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> tuple[float, float]:
    """Forward FLOPs and bytes read + written of one node.

    - matmul: ``2 * numel(out) * K`` (K = last dim of the first input of
      at least 2 dims);
    - attention, q ``(N, H, T, D)``, k ``(N, H, S, D)``: ``4 * N * H * T * S * D``
      (``QK^T`` and ``PV``; FlashAttention, Dao et al. 2022);
    - embedding: no FLOPs, reads and writes the gathered rows;
    - everything else: ``numel(out)`` FLOPs.
    """
    if op_cls is None:
        return 0.0, 0.0
    moved = float(sum(t.numel() * t.element_size() for t in inputs) + sum(t.numel() * t.element_size() for t in outputs))
    if op_cls == "matmul" and outputs:
        # K = the contracted dim: last dim of the first operand with >= 2 dims
        # (``addmm(bias, a, b)`` lists the 1-D bias first).
        mat = next((t for t in inputs if t.dim() >= 2), None)
        if mat is not None:
            return 2.0 * outputs[0].numel() * mat.shape[-1], moved
    if op_cls == "attention" and len(inputs) >= 3:
        q, k = inputs[0], inputs[1]
        return 4.0 * q.shape[0] * q.shape[1] * q.shape[-2] * k.shape[-2] * q.shape[-1], moved
    if op_cls == "embedding":
        out = float(sum(t.numel() * t.element_size() for t in outputs))
        return 0.0, 2 * out
    return float(sum(t.numel() for t in outputs)), moved
