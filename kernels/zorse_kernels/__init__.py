"""Triton kernels for the operation classes of a transformer training step, with torch references.

``OPS`` maps an op name to its :class:`KernelOp` (inputs, torch reference, Triton
forward/backward, FLOP and byte formulas, test and standard shapes); see
:mod:`zorse_kernels.registry` for the conventions. Used by the profiling harness
(``triton.testing.do_bench`` on a GPU; the torch references on CPU) and tested on
CPU under the Triton interpreter (``TRITON_INTERPRET=1``, set before this package is
imported). Importing requires ``triton``.

Modules: :mod:`.matmul` (linear fwd/bwd), :mod:`.norms` (LayerNorm, RMSNorm),
:mod:`.attention` (flash attention, softmax), :mod:`.elementwise` (GELU, SiLU),
:mod:`.cross_entropy`, :mod:`.pack` (boundary-message pack/unpack).
"""

from .registry import OPS, KernelOp, triton_available

__all__ = ["OPS", "KernelOp", "triton_available"]
