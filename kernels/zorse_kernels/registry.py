"""The kernel registry: one :class:`KernelOp` per operation class of a training step.

Conventions shared by every record (the profiling harness and the tests rely on them):

* ``shape`` is a ``dict`` with one ``int`` per name in ``shape_keys`` (plus an
  optional ``bool`` ``"causal"`` for attention).
* ``make_inputs(shape, dtype, device)`` returns a tuple of tensors, drawn from a
  ``torch.Generator`` seeded with 0 on ``device`` (so deterministic per device type).
  Parameters that are not data (the row range of ``pack``, the ``causal`` flag of
  ``attention``) are small **CPU** tensors at the end/start of the tuple, so that
  reading them never synchronises a GPU.
* The *differentiable inputs* of an op are its floating-point inputs, in order;
  ``triton_backward(*inputs, grad_output)`` returns one gradient per
  differentiable input, in that order (or the op has ``triton_backward=None``).
* ``reference`` is pure torch and autograd-capable: the oracle of the tests and
  what the harness times on CPU.
* ``flops(shape)`` counts forward floating-point operations (a multiply-add is 2);
  ``bytes_moved(shape, dtype)`` counts the minimum forward traffic to and from
  memory in bytes (every input read once, every output written once). Each op's
  module documents its formulas.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["KernelOp", "OPS", "triton_available", "generator", "randn"]


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelOp:
    """One operation: how to make its inputs, its torch reference, its Triton kernels and its cost."""

    name: str
    op_class: str  # "matmul" | "norm" | "attention" | "softmax" | "elementwise" | "cross_entropy" | "copy"
    shape_keys: tuple[str, ...]
    make_inputs: Callable
    reference: Callable
    triton_forward: Callable
    triton_backward: Callable | None
    flops: Callable
    bytes_moved: Callable
    dtypes: tuple[torch.dtype, ...]
    test_shapes: tuple[dict, ...]
    standard_shapes: tuple[dict, ...]


def triton_available() -> bool:
    """True if Triton imports and can run here: a CUDA GPU, or the interpreter (``TRITON_INTERPRET=1``)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1"


def generator(device) -> torch.Generator:
    """A generator on ``device`` seeded with 0 (deterministic inputs for a given device type)."""
    return torch.Generator(device=torch.device(device)).manual_seed(0)


def randn(gen: torch.Generator, *size: int, dtype: torch.dtype, device, scale: float = 1.0) -> torch.Tensor:
    """Standard normal numbers (times ``scale``) drawn in float32, then cast to ``dtype``."""
    x = torch.randn(*size, generator=gen, device=torch.device(device), dtype=torch.float32)
    if scale != 1.0:
        x.mul_(scale)
    return x.to(dtype)


def _build() -> dict[str, KernelOp]:
    from . import attention, cross_entropy, elementwise, matmul, norms, pack

    ops = (*matmul.OPS, *norms.OPS, *attention.OPS, *elementwise.OPS, *cross_entropy.OPS, *pack.OPS)
    return {op.name: op for op in ops}


#: Every registered op by name.
OPS: dict[str, KernelOp] = _build()
