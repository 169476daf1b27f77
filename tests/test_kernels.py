"""Triton kernels of ``zorse_kernels`` against their torch references.

Without a GPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``,
set below before anything imports ``triton.jit`` kernels) on the small
``test_shapes`` of each op. GPU-only tests are marked and skipped here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import zorse_kernels  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))

import pytest
import torch.nn.functional as F

from zorse_kernels import OPS, KernelOp, triton_available
from zorse_kernels.attention import flash_attention, flash_attention_backward
from zorse_kernels.cross_entropy import cross_entropy, cross_entropy_backward, cross_entropy_with_grad
from zorse_kernels.elementwise import gelu, gelu_backward
from zorse_kernels.matmul import matmul
from zorse_kernels.norms import LN_EPS, norm_backward
from zorse_kernels.pack import copy_bytes, pack, pack_reference, unpack

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

# Ops whose kernels use tl.dot: the Triton 3.9 interpreter multiplies the raw uint16 bit
# patterns of bfloat16 dot operands (triton-lang/triton#11584, "we just don't support it yet").
DOT_OPS = {"matmul", "attention"}

# (rtol, atol) for ops without a long dot product (norms, softmax, elementwise, cross entropy,
# attention's short rows): float32: the kernels accumulate in float32 like torch, so only
# summation order differs, over rows of at most a few hundred elements of magnitude ~1.
# float16/bfloat16: compared with the reference run in float32 on the same (rounded) inputs; the
# kernels compute in float32 and round the result once (attention also rounds P to the input
# dtype before P@V, as FlashAttention does), so rtol is ~4 half-ulps of the dtype (2^-11 for
# fp16, 2^-8 for bf16) and atol covers results near 0.
TOL = {torch.float32: (1e-4, 1e-5), torch.float16: (2e-3, 1e-3), torch.bfloat16: (1.6e-2, 2e-3)}

#: float32's unit roundoff (IEEE 754 binary32, 24-bit significand).
U_FP32 = 2.0 ** -24
#: TF32 keeps 10 explicit significand bits of each tl.dot / cuBLAS operand: unit roundoff 2^-11.
U_TF32 = 2.0 ** -11


def dot_atol(n: int, magnitude: torch.Tensor, tf32: bool = False) -> torch.Tensor:
    """Elementwise bound on a float32 dot product's error, in any summation order.

    ``magnitude`` is ``sum_i |a_i b_i|`` for each output element (``|A| @ |B|`` in float64) and
    ``n`` the accumulation length. Higham, *Accuracy and Stability of Numerical Algorithms*
    (2nd ed., 2002), eq. (3.5): a dot product computed in floating point, with the additions in
    any order (blocked, pairwise, with FMA), is within ``gamma_n * sum |a_i b_i|`` of the exact
    value, ``gamma_n = n u / (1 - n u)``. The Triton tile loop and the machine's BLAS (its kernel
    differs between CPUs: OpenBLAS picks one per microarchitecture) sum in different orders, so a
    fixed atol that one CPU's order happens to meet fails on another; this bound holds on any.
    With TF32 operands each product's inputs are first rounded to 2^-11 (twice: ``2 u_tf32``).
    """
    gamma = n * U_FP32 / (1 - n * U_FP32)
    return (gamma + (2 * U_TF32 if tf32 else 0.0)) * magnitude


def _tf32() -> bool:
    from zorse_kernels.matmul import dot_precision

    return CUDA and dot_precision(torch.float32) == "tf32"


def _close_dot(actual, exact, atol, what=""):
    """``actual`` (float32) within ``atol`` (elementwise) of the float64 ``exact``; the float64
    oracle's own rounding (2^-53 relative) is below the bound by nine orders of magnitude."""
    err = (actual.double() - exact).abs()
    bad = err > atol
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {err.numel()} elements beyond the float32 dot-product "
                           f"bound; worst {err.max().item():.3e}, bound there {atol.flatten()[err.argmax()].item():.3e}")
def _sid(shape: dict) -> str:
    return "-".join(f"{k}{int(v)}" for k, v in shape.items())


def _cases(backward: bool):
    out = []
    for name, op in OPS.items():
        if backward and op.triton_backward is None:
            continue
        for shape in op.test_shapes:
            for dt in op.dtypes:
                marks = []
                if INTERPRETED and dt == torch.bfloat16 and name in DOT_OPS:
                    marks.append(pytest.mark.skip(reason="Triton interpreter: tl.dot on bfloat16 is unsupported "
                                                         "(triton-lang/triton#11584)"))
                out.append(pytest.param(name, shape, dt, marks=marks,
                                        id=f"{name}-{_sid(shape)}-{str(dt).split('.')[-1]}"))
    return out


def _upcast(inputs):
    """Inputs with floating tensors in float32 (the oracle's precision)."""
    return [t.float() if t.is_floating_point() else t for t in inputs]


def _close(actual, expected, dt, what=""):
    rtol, atol = TOL[dt]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def test_registry_contents():
    expected = {"matmul": "matmul", "layernorm": "norm", "rmsnorm": "norm", "attention": "attention",
                "softmax": "softmax", "gelu": "elementwise", "silu": "elementwise",
                "cross_entropy": "cross_entropy", "pack": "copy"}
    assert {n: op.op_class for n, op in OPS.items()} == expected
    for name, op in OPS.items():
        assert isinstance(op, KernelOp) and op.name == name
        assert torch.float32 in op.dtypes
        assert op.test_shapes and op.standard_shapes
        for shape in (*op.test_shapes, *op.standard_shapes):
            assert set(shape) - {"causal"} == set(op.shape_keys), (name, shape)
    assert triton_available()


@pytest.mark.parametrize("name", sorted(OPS))
def test_make_inputs_deterministic(name):
    op = OPS[name]
    a = op.make_inputs(op.test_shapes[0], torch.float32, DEVICE)
    b = op.make_inputs(op.test_shapes[0], torch.float32, DEVICE)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("name,shape,dt", _cases(backward=False))
def test_forward(name, shape, dt):
    op = OPS[name]
    inputs = op.make_inputs(shape, dt, DEVICE)
    out = op.triton_forward(*inputs)
    ref_dt = op.reference(*inputs)  # what the harness times: must run in dt
    assert out.dtype == ref_dt.dtype and out.shape == ref_dt.shape
    if name == "pack":  # a byte copy: exact
        assert torch.equal(out, ref_dt)
        return
    if name == "matmul" and dt == torch.float32:
        x, w = (t.double() for t in inputs)
        exact = op.reference(x, w)
        atol = dot_atol(shape["K"], op.reference(x.abs(), w.abs()), _tf32())
        _close_dot(out, exact, atol, f"{name} triton forward")
        _close_dot(ref_dt, exact, atol, f"{name} torch reference in {dt}")
        return
    oracle = op.reference(*_upcast(inputs))
    _close(out, oracle, dt, f"{name} triton forward")
    _close(ref_dt, oracle, dt, f"{name} torch reference in {dt}")


@pytest.mark.parametrize("name,shape,dt", _cases(backward=True))
def test_backward(name, shape, dt):
    op = OPS[name]
    inputs = op.make_inputs(shape, dt, DEVICE)
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in _upcast(inputs)]
    out = op.reference(*leaves)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    grad_out = torch.randn(out.shape, generator=gen, device=DEVICE).to(dt)
    diff = [t for t in leaves if t.requires_grad]
    expected = torch.autograd.grad(out, diff, grad_out.float())
    got = op.triton_backward(*inputs, grad_out)
    assert len(got) == len(expected)
    if name == "matmul" and dt == torch.float32:
        # dx = dy @ w sums over N, dw = dy^T @ x over M; the magnitudes |dy| @ |w| and
        # |dy|^T @ |x| are the gradients of the same linear at |x|, |w| with |dy| (float64).
        exact_leaves = [t.double().requires_grad_() for t in inputs]
        exact = torch.autograd.grad(op.reference(*exact_leaves), exact_leaves, grad_out.double())
        abs_leaves = [t.double().abs().requires_grad_() for t in inputs]
        mags = torch.autograd.grad(op.reference(*abs_leaves), abs_leaves, grad_out.double().abs())
        for i, (g, e, m, n) in enumerate(zip(got, exact, mags, (shape["N"], shape["M"]))):
            assert g.dtype == dt and g.shape == e.shape
            _close_dot(g, e, dot_atol(n, m, _tf32()), f"{name} grad of differentiable input {i}")
        return
    low = None
    if name == "attention" and dt != torch.float32:
        # FlashAttention's backward rounds P and dS to the input dtype before its matmuls, so a
        # gradient element can sit a few ulps off the float32 oracle (measured on an H100: 1 of
        # 1584 bf16 elements 0.003 off where atol is 0.002). The accepted bound there is
        # FlashAttention's own test's (Dao-AILab/flash-attention, tests/test_flash_attn.py):
        # max error <= 2 x the max error of PyTorch's attention run in the same dtype.
        low_leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        low_out = op.reference(*low_leaves)
        low = torch.autograd.grad(low_out, [t for t in low_leaves if t.requires_grad], grad_out)
    for i, (g, e, x) in enumerate(zip(got, expected, [t for t in inputs if t.is_floating_point()])):
        assert g.dtype == x.dtype and g.shape == x.shape
        what = f"{name} grad of differentiable input {i}"
        if low is None:
            _close(g, e, dt, what)
            continue
        err, ref_err = (g.float() - e).abs().max().item(), (low[i].float() - e).abs().max().item()
        assert err <= 2 * ref_err + 1e-6 or torch.allclose(g.float(), e, *TOL[dt]), (what, err, ref_err)


# ---- exact cost formulas -------------------------------------------------------------------

@pytest.mark.parametrize("name,shape,dt,flops,nbytes", [
    ("matmul", {"M": 40, "N": 48, "K": 72}, torch.float16, 2 * 40 * 48 * 72, (40 * 72 + 48 * 72 + 40 * 48) * 2),
    ("layernorm", {"rows": 6, "cols": 100}, torch.float32, 4200, (1200 + 200) * 4),
    ("rmsnorm", {"rows": 6, "cols": 100}, torch.float32, 2400, (1200 + 100) * 4),
    ("attention", {"B": 1, "H": 2, "T": 40, "D": 16, "causal": True}, torch.float16, 102400, 10240),
    ("attention", {"B": 1, "H": 2, "T": 40, "D": 16, "causal": False}, torch.float16, 204800, 10240),
    ("softmax", {"rows": 6, "cols": 100}, torch.bfloat16, 3000, 2400),
    ("gelu", {"numel": 3000}, torch.float32, 15000, 24000),
    ("silu", {"numel": 3000}, torch.float32, 12000, 24000),
    ("cross_entropy", {"rows": 6, "vocab": 1000}, torch.float32, 24000, 24072),
    ("pack", {"N": 5, "T": 7, "H": 12, "start": 1, "end": 4}, torch.float16, 0, 1386),
])
def test_cost_formulas_exact(name, shape, dt, flops, nbytes):
    op = OPS[name]
    f, b = op.flops(shape), op.bytes_moved(shape, dt)
    assert type(f) is int and type(b) is int
    assert (f, b) == (flops, nbytes)


@pytest.mark.parametrize("name", sorted(OPS))
def test_bytes_match_actual_tensors(name):
    """bytes_moved == bytes of the data inputs read + the outputs written, from the real tensors."""
    op = OPS[name]
    shape, dt = op.test_shapes[0], torch.float16
    inputs = op.make_inputs(shape, dt, DEVICE)
    out = op.reference(*inputs)
    data = [t for t in inputs if t.dim() > 0]  # drops the 0-d causal flag (pack's range is unused)
    if name == "pack":  # only rows [start, end) are read
        expected = 2 * out.numel()
    elif name == "cross_entropy":  # the kernel writes per-row float32 losses
        expected = sum(t.nbytes for t in data) + 4 * shape["rows"]
    else:
        expected = sum(t.nbytes for t in data) + out.nbytes
    assert op.bytes_moved(shape, dt) == expected


# ---- op-specific paths ---------------------------------------------------------------------

def test_matmul_strided_operands_and_edges():
    g = torch.Generator(device=DEVICE).manual_seed(3)
    a = torch.randn(37, 50, generator=g, device=DEVICE).t()  # (50, 37), column-major
    b = torch.randn(37, 21, generator=g, device=DEVICE)
    assert not a.is_contiguous()
    _close_dot(matmul(a, b), a.double() @ b.double(), dot_atol(37, a.double().abs() @ b.double().abs(), _tf32()),
               "strided matmul")
    assert torch.equal(matmul(a[:, :0], b[:0]), torch.zeros(50, 21, device=DEVICE))  # K == 0
    with pytest.raises(ValueError):
        matmul(a, b.t())


@pytest.mark.parametrize("partials", [1, 3, 6])
def test_layernorm_backward_any_partial_count(partials):
    op = OPS["layernorm"]
    x, w, b = op.make_inputs({"rows": 6, "cols": 100}, torch.float32, DEVICE)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    dy = torch.randn(6, 100, generator=torch.Generator(device=DEVICE).manual_seed(2), device=DEVICE)
    expected = torch.autograd.grad(F.layer_norm(leaves[0], (100,), leaves[1], leaves[2], LN_EPS), leaves, dy)
    got = norm_backward(x, w, b, dy, eps=LN_EPS, rms=False, partials=partials)
    for g, e in zip(got, expected):
        _close(g, e, torch.float32, f"layernorm backward, {partials} partials")


def test_attention_strided_inputs():
    """q, k, v as (B, T, H, D).transpose(1, 2): the layout after a fused QKV projection."""
    g = torch.Generator(device=DEVICE).manual_seed(4)
    q, k, v = (torch.randn(2, 20, 3, 16, generator=g, device=DEVICE).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=True)
    _close(flash_attention(q, k, v, causal=True), ref, torch.float32, "strided attention")
    do = torch.randn(ref.shape, generator=g, device=DEVICE)
    for got, exp in zip(flash_attention_backward(q, k, v, True, do), torch.autograd.grad(ref, leaves, do)):
        _close(got, exp, torch.float32, "strided attention backward")


def test_attention_forward_runs_its_kernel_on_every_call():
    """A repeated forward on the same tensors computes a new output (the benchmark times
    repeated calls; a saved output returned again would time nothing), and the backward
    after it still matches autograd."""
    op = OPS["attention"]
    q, k, v, c = op.make_inputs(op.test_shapes[0], torch.float32, DEVICE)
    first = flash_attention(q, k, v, c)
    second = flash_attention(q, k, v, c)
    assert second is not first and second.data_ptr() != first.data_ptr()
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    do = torch.randn(q.shape, generator=torch.Generator(device=DEVICE).manual_seed(11), device=DEVICE)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    for got, exp in zip(flash_attention_backward(q, k, v, c, do),
                        torch.autograd.grad(op.reference(*leaves, c), leaves, do)):
        _close(got, exp, torch.float32, "backward after two forwards")


def test_attention_backward_reuses_forward_only_while_inputs_unchanged():
    op = OPS["attention"]
    q, k, v, c = op.make_inputs(op.test_shapes[0], torch.float32, DEVICE)
    do = torch.randn(q.shape, generator=torch.Generator(device=DEVICE).manual_seed(10), device=DEVICE)

    def expected():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(op.reference(*leaves, c), leaves, do)

    flash_attention(q, k, v, c)
    for got, exp in zip(flash_attention_backward(q, k, v, c, do), expected()):
        _close(got, exp, torch.float32, "backward after forward")
    q.mul_(-0.5)  # in place: the saved forward is stale now
    for got, exp in zip(flash_attention_backward(q, k, v, c, do), expected()):
        _close(got, exp, torch.float32, "backward after an in-place change of q")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected_nc = torch.autograd.grad(F.scaled_dot_product_attention(*leaves), leaves, do)
    non_causal = flash_attention_backward(q, k, v, False, do)
    for got, exp in zip(non_causal, expected_nc):
        _close(got, exp, torch.float32, "backward with the other causal flag")


@pytest.mark.parametrize("causal", [True, False])
def test_attention_gpu_tiles(causal):
    """T >= 128 selects the GPU tiles: 128x64 forward tiles (fp16) and 64x64 backward tiles."""
    op = OPS["attention"]
    shape = {"B": 1, "H": 1, "T": 520, "D": 64, "causal": causal}
    q, k, v, c = op.make_inputs(shape, torch.float16, DEVICE)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    ref = op.reference(*leaves, c)
    _close(flash_attention(q, k, v, c), ref, torch.float16, "attention, GPU tiles")
    do = torch.randn(ref.shape, generator=torch.Generator(device=DEVICE).manual_seed(9), device=DEVICE).half()
    for got, exp in zip(flash_attention_backward(q, k, v, c, do), torch.autograd.grad(ref, leaves, do.float())):
        _close(got, exp, torch.float16, "attention backward, GPU tiles")


@pytest.mark.parametrize("dt", [torch.float32, torch.float16])
def test_gelu_tanh_and_extremes(dt):
    x = torch.cat([torch.linspace(-6, 6, 999, device=DEVICE), torch.tensor([-30.0, -12.0, 0.0, 12.0, 30.0],
                                                                            device=DEVICE)]).to(dt)
    for approx in ("tanh", "none"):
        leaf = x.float().requires_grad_()
        ref = F.gelu(leaf, approximate=approx)
        dy = torch.ones_like(ref).to(dt)
        _close(gelu(x, approximate=approx), ref, dt, f"gelu {approx}")
        (dx,) = gelu_backward(x, dy, approximate=approx)
        assert torch.isfinite(dx).all()
        _close(dx, torch.autograd.grad(ref, leaf, dy.float())[0], dt, f"gelu {approx} backward")
    with pytest.raises(ValueError):
        gelu(x, approximate="erf")


def test_cross_entropy_ignore_index_blocks_and_grad_scale():
    g = torch.Generator(device=DEVICE).manual_seed(5)
    logits = torch.randn(7, 1000, generator=g, device=DEVICE) * 3
    targets = torch.randint(0, 1000, (7,), generator=g, device=DEVICE)
    targets[[1, 4]] = -100
    leaf = logits.clone().requires_grad_()
    ref = F.cross_entropy(leaf, targets)
    (ref_grad,) = torch.autograd.grad(ref, leaf, torch.tensor(2.5, device=DEVICE))
    for block_v in (None, 128):  # one block / eight blocks with a ragged last one
        _close(cross_entropy(logits, targets, block_v=block_v), ref, torch.float32, "ce loss")
        loss, dx = cross_entropy_with_grad(logits, targets, 2.5, block_v=block_v)
        _close(loss, ref, torch.float32, "fused ce loss")
        _close(dx, ref_grad, torch.float32, "fused ce grad")
        _close(cross_entropy_backward(logits, targets, torch.tensor(2.5, device=DEVICE), block_v=block_v)[0],
               ref_grad, torch.float32, "ce grad")
    assert torch.count_nonzero(dx[[1, 4]]) == 0


# ---- pack / unpack ---------------------------------------------------------------------------

def _mixed(n: int):
    g = torch.Generator(device=DEVICE).manual_seed(6)
    dev = torch.device(DEVICE)
    return [
        torch.rand(n, 3, generator=g, device=dev) < 0.5,                      # bool, 3 bytes per row
        torch.randn(n, 5, 2, generator=g, device=dev).half(),                  # 20 bytes per row
        torch.randint(-2**40, 2**40, (n, 2), generator=g, device=dev),         # int64, 16 bytes per row
        torch.randn(n, 7, generator=g, device=dev),                            # float32, 28 bytes per row
        torch.randn(n, 1, generator=g, device=dev).bfloat16(),                 # 2 bytes per row
        torch.randint(0, 256, (n, 3, 3), generator=g, device=dev).to(torch.uint8),
    ]


@pytest.mark.parametrize("start,end", [(2, 5), (0, 6), (3, 3)])
def test_pack_unpack_round_trip_mixed_dtypes(start, end):
    ts = _mixed(6)
    buf = pack(ts, start, end)
    assert buf.dtype == torch.uint8 and buf.numel() == (end - start) * (3 + 20 + 16 + 28 + 2 + 9)
    assert torch.equal(buf, pack_reference(ts, start, end))
    try:
        from zorse_fx.runtime.comm import pack as comm_pack
    except ImportError:  # pragma: no cover - the runtime is optional for the kernels
        comm_pack = None
    if comm_pack is not None:
        assert torch.equal(buf, comm_pack(ts, start, end))
    outs = [torch.full_like(t, 7) if t.dtype != torch.bool else torch.zeros_like(t) for t in ts]
    sentinel = [o.clone() for o in outs]
    unpack(buf, outs, start, end)
    for t, o, s in zip(ts, outs, sentinel):
        assert torch.equal(o[start:end], t[start:end])
        assert torch.equal(o[:start], s[:start]) and torch.equal(o[end:], s[end:])


def test_pack_non_contiguous_and_size_errors():
    base = torch.randn(4, 6, 5, generator=torch.Generator(device=DEVICE).manual_seed(7), device=DEVICE)
    t = base.transpose(1, 2)  # (4, 5, 6): rows along dim 0, but not row-major
    assert not t.is_contiguous()
    ts = [t, torch.arange(12, device=DEVICE).reshape(4, 3)]
    assert torch.equal(pack(ts, 1, 3), pack_reference(ts, 1, 3))
    outs = [torch.zeros(4, 5, 6, device=DEVICE), torch.zeros(4, 3, dtype=torch.int64, device=DEVICE)]
    buf = pack(ts, 1, 3)
    with pytest.raises(ValueError):
        unpack(buf[:-1], outs, 1, 3)
    with pytest.raises(ValueError):
        unpack(buf, outs, 0, 3)
    with pytest.raises(ValueError):
        pack(ts, 2, 5)


@pytest.mark.parametrize("offset", [0, 1, 2, 4, 8])
def test_copy_bytes_alignments(offset):
    """Every word width (1, 2, 4, 8 bytes) and ragged tails copy exactly."""
    src = torch.randint(0, 256, (5000,), generator=torch.Generator(device=DEVICE).manual_seed(8),
                        device=DEVICE).to(torch.uint8)
    dst = torch.zeros(5000, dtype=torch.uint8, device=DEVICE)
    n = 4096 + 8 - offset
    copy_bytes(src[offset: offset + n], dst[8: 8 + n])
    assert torch.equal(dst[8: 8 + n], src[offset: offset + n])
    assert torch.count_nonzero(dst[:8]) == 0 and torch.count_nonzero(dst[8 + n:]) == 0


# ---- GPU only ----------------------------------------------------------------------------------

@needs_gpu
@pytest.mark.parametrize("name", sorted(OPS))
def test_standard_shape_on_gpu(name):
    """The first standard shape in float16: correct, and timeable with do_bench."""
    import triton.testing

    op = OPS[name]
    shape = op.standard_shapes[0]
    inputs = op.make_inputs(shape, torch.float16, "cuda")
    out = op.triton_forward(*inputs)
    if name == "pack":
        assert torch.equal(out, op.reference(*inputs))
    else:
        torch.testing.assert_close(out.float(), op.reference(*_upcast(inputs)).float(), rtol=1e-2, atol=1e-2)
    assert triton.testing.do_bench(lambda: op.triton_forward(*inputs), warmup=5, rep=20) > 0
