"""Training precision: what is computed in which dtype, and what it costs per parameter.

A plan carries one precision (``Plan.precision``); the planner prices it and
the runtime trains with it. The policies:

============== ============================================================
``fp32``       everything in float32 (what a CPU run uses unless asked).
``bf16-mixed`` bfloat16 compute under ``torch.autocast``; float32 master
               weights, gradients and AdamW state; gradients all-reduced in
               ``Plan.grad_reduce_dtype`` (float32 by default, or bfloat16).
``fp16-mixed`` float16 compute under ``torch.autocast`` for GPUs without
               bfloat16 (P100, V100, T4); as bf16-mixed plus dynamic loss
               scaling (``torch.amp.GradScaler`` semantics, the found-inf
               decision agreed over every rank); gradients reduced in float32.
============== ============================================================

``PrecisionPolicy.tf32`` (``Plan.tf32``, ``PlanOptions.tf32``, ``zorse plan
--tf32``): float32 matmuls and convolutions on TF32 tensor cores (Ampere and
later; 10-bit mantissa products, float32 accumulation). PyTorch leaves it off
for matmuls by default; the runtime sets both
``torch.backends.cuda.matmul.allow_tf32`` and
``torch.backends.cudnn.allow_tf32`` to the plan's value on every rank
(``apply_matmul_precision``), so a plan priced with TF32 runs with it and one
priced without runs without, whatever the process set before. It only
changes float32 matmuls: all of them in fp32, none under a mixed policy
(autocast runs them in 16 bits); GPUs without TF32 (pre-Ampere) ignore it.

[Note: mixed precision]
The stage modules are ATen graphs captured in float32, with the dtypes of
their explicit casts baked in (an RMSNorm's ``.to(float32)``), so the runtime
does not turn parameters into 16-bit tensors: the module's parameters stay
float32 and *are* the master weights, and ``torch.autocast`` casts the inputs
of the matmul-class ops (``mm``, ``addmm``, ``bmm``, attention, ...) to the
compute dtype as they run, as AMP does in eager PyTorch. One autocast region
spans the whole pipeline schedule of a step, so autocast's cache holds *one*
low-precision copy of each weight for the step (made at its first forward,
freed when the step's schedule ends) instead of one per micro-batch in
flight; the backward of a matmul reads that copy. Gradients are float32
(autocast's cast is differentiable: the 16-bit weight gradient is cast back),
accumulated over the micro-batches in float32, and AdamW updates float32
weights with float32 moments, so small updates are not lost.

What the runtime keeps per trainable parameter, which is exactly what the
planner's memory model charges (``state_bytes_per_param``):

- 4 B float32 weight (master), 4 B float32 gradient, 8 B AdamW ``exp_avg``
  and ``exp_avg_sq`` (float32): 16 B, as in fp32 training;
- mixed precision: + 2 B, the step's 16-bit weight copy in autocast's cache;
- a gradient reduction in a 16-bit dtype: + 2 B, the 16-bit copies of the
  gradient buckets in flight (all of a stage's buckets may be in flight at
  once while the reduction overlaps the backward).

So fp32: 16 B; bf16-mixed and fp16-mixed: 18 B (20 B with bfloat16
reduction). Megatron-LM's mixed-precision layout is also 18 B per parameter
(16-bit weight 2 + float32 main gradient 4 + float32 main weight 4 + Adam
moments 8; Megatron-LM, ``docs/source/api-guide/dist_optimizer.md``); it keeps
16-bit weights and float32 master copies, which needs dtype-generic modules.
ZeRO-1 (``StagePlan.sharded``) shards the AdamW moments (8 B); the float32
weights of parameters autocast does not cast (embeddings, norms, tied
weights) stay replicated and are all-gathered in float32 after a sharded step
(4 B per element moved). The matmul weights of a sharded stage of two or more
GPUs become 16-bit working weights ([Note: 16-bit working weights]).

[Note: 16-bit working weights]
Under a mixed policy a sharded stage (ZeRO-1, k >= 2 GPUs) holds the
parameters that autocast casts anyway (``StagePlan.low_precision_params``:
``capture.low_precision_params``, the weights read only by linear, matmul
and convolution ops, through exact views, and by one block) in the compute
dtype on the GPU; their float32 master weights live in the optimizer shard
beside the AdamW moments. Megatron-LM's distributed optimizer keeps this
layout (``docs/source/api-guide/dist_optimizer.md``). Per such parameter:

- replicated: the 16-bit weight (2 B) and a float32 *main gradient* (4 B,
  a view into the gradient bucket; + 2 B with a 16-bit reduction, as for
  every parameter): 6 B instead of 10 B (float32 weight 4 + gradient 4 +
  autocast's copy 2);
- sharded: float32 master 4 B + AdamW moments 8 B = 12 B instead of 8 B;
  so a stage of k GPUs holds 6 + 12/k B per parameter instead of 10 + 8/k
  (fewer from k = 2 on, 18 B at k = 1 either way);
- the all-gather after the step moves the 16-bit weights (2 B per element
  instead of 4).

The values are the same as with float32 weights: autocast would cast the
weight to the compute dtype at its first use (and its cache would hold that
copy for the step), so the matmuls read the same 16-bit numbers, and the
gradient the matmul's backward makes is a 16-bit tensor that autocast's cast
turns into float32 before it is accumulated; here a ``post_accumulate_grad``
hook adds the 16-bit gradient of each micro-batch into the float32 main
gradient and frees it, the same float32 sums in the same order (the
micro-batches' backwards in schedule order). AdamW steps the float32
masters of the rank's range with the main gradients, then writes their
16-bit rounding into the working weights and all-gathers those: what
autocast's cast of the float32 weight would give at the next step.
Checkpoints save the float32 masters (``runtime/checkpoint.py``). A CPU run
of a mixed plan trains in fp32 and keeps every weight in float32.

Activations are what autograd saves under the policy's autocast (16-bit
inputs of the matmuls, float32 where the graph or autocast keeps float32:
norms, softmax statistics, the loss), measured by running the captured graph
under autocast (``cost/activations.py``, [Note: saved activations]). Tensors
crossing a pipeline cut are computed in the dtype autocast gives them (the
residual stream of a pre-norm transformer stays float32: float32 + bfloat16
is float32) and sent in 16 bits ([Note: 16-bit boundary tensors]).

[Note: 16-bit boundary tensors]
Under a mixed policy a float32 tensor crossing a stage boundary (the
residual stream) travels in the compute dtype, and so does its gradient on
the way back (``wire_dtype_name``): the sender casts it after its forward,
the receiver casts it back to float32 before its stage reads it; in the
backward the receiver sends the float32 gradient of that input cast to the
compute dtype and the sender casts it back before back-propagating. The
planner prices the boundary at those bytes (``BlockCosts.cut_bytes_per_sample``)
and the runtime sends exactly them (``ir.tensor.on_wire``, used by
``runtime.stage.StageRuntime`` and ``runtime.p2p.build_programs``). Each cut
thus rounds the activation and its gradient once to 16 bits (8 significant
bits in bfloat16, 11 in float16): the next stage's matmuls see 16-bit inputs
under autocast anyway, its float32 residual adds and norms do not, so a
distributed run equals single-process training with the same rounding at
the same cuts (``tests/test_mixed_precision.py``), not the unrounded one.
A CPU run of a mixed plan trains in fp32 and sends float32.

fp16-mixed: the last stage back-propagates ``loss * scale``; the boundary
gradients between stages are scaled too (what keeps them representable in
float16). After the gradient reduction every rank unscales its gradients and
checks them for inf/NaN; one all-reduce (MAX) of that flag over the world
makes the decision global, so every stage skips the same step and every rank
halves the scale (backoff 0.5), or, after ``growth_interval`` clean steps,
doubles it: ``torch.amp.GradScaler``'s defaults (init 2**16, growth 2.0,
backoff 0.5, interval 2000).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the cluster parser imports this module without torch
    import torch

    from .cluster.specs import GPUSpec

__all__ = ["PRECISIONS", "REDUCE_DTYPES", "GRAD_REDUCE_DTYPES", "PrecisionPolicy", "precision_policy",
           "default_precision",
           "check_supported"]

#: Precision names a plan may carry.
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
#: Gradient-reduction dtypes each precision allows (the first is its default).
REDUCE_DTYPES = {
    "fp32": ("float32",),
    "bf16-mixed": ("float32", "bfloat16"),
    # Scaled float16 gradients summed over many ranks overflow easily: float32 only.
    "fp16-mixed": ("float32",),
}
#: Every gradient-reduction dtype some precision allows.
GRAD_REDUCE_DTYPES = tuple(dict.fromkeys(d for ds in REDUCE_DTYPES.values() for d in ds))
_COMPUTE = {"fp32": "float32", "bf16-mixed": "bfloat16", "fp16-mixed": "float16"}
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True, kw_only=True)
class PrecisionPolicy:
    """One precision and its gradient-reduction dtype (see [Note: mixed precision])."""

    #: One of ``PRECISIONS``.
    name: str
    #: dtype name of the gradient all-reduce (one of ``REDUCE_DTYPES[name]``).
    grad_reduce_dtype: str = "float32"
    #: fp16-mixed loss scaler (``torch.amp.GradScaler`` defaults).
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    #: float32 matmuls on TF32 tensor cores (see the module docstring).
    tf32: bool = False

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ValueError(f"precision {self.name!r} is not one of {', '.join(PRECISIONS)}")
        allowed = REDUCE_DTYPES[self.name]
        if self.grad_reduce_dtype not in allowed:
            raise ValueError(f"precision {self.name!r} reduces gradients in {' or '.join(allowed)}, not "
                             f"{self.grad_reduce_dtype!r}")

    # -- dtypes ---------------------------------------------------------------
    @property
    def mixed(self) -> bool:
        """Autocast to a 16-bit compute dtype (bf16-mixed, fp16-mixed)."""
        return self.name != "fp32"

    @property
    def compute_dtype_name(self) -> str:
        """``"float32"``, ``"bfloat16"`` or ``"float16"``: the matmuls' dtype."""
        return _COMPUTE[self.name]

    @property
    def compute_dtype(self) -> "torch.dtype":
        import torch

        return getattr(torch, self.compute_dtype_name)

    @property
    def reduce_dtype(self) -> "torch.dtype":
        import torch

        return getattr(torch, self.grad_reduce_dtype)

    @property
    def loss_scaling(self) -> bool:
        """Dynamic loss scaling (fp16-mixed)."""
        return self.name == "fp16-mixed"

    @property
    def step_control_rounds(self) -> int:
        """Ring latencies per (GPUs used - 1) of the step's world collectives of a few bytes each, whose
        time is their ring's latency whatever the link's bandwidth: 2 per all-reduce (the gradient norm's in
        ``Worker.train_step``; under fp16-mixed also the loss scaler's inf/NaN agreement) + 1 for the
        all-gather of the per-rank table after the step ([Note: one world collective after the step] in
        ``zorse_fx/train.py``). ``BlockCosts.step_control_rounds``; measured on the box, bench/LOG.md
        "The step's world control collectives" (``bench/box_collectives.py``)."""
        return 2 * (1 + self.loss_scaling) + 1

    def autocast(self, device_type: str):
        """The autocast region of one step's schedule on ``device_type`` ("cuda", "cpu")."""
        import torch

        return torch.autocast(device_type, dtype=self.compute_dtype, enabled=self.mixed)

    def apply_matmul_precision(self, device_type: str) -> None:
        """On ``device_type`` "cuda", set ``torch.backends.cuda.matmul.allow_tf32``
        and ``torch.backends.cudnn.allow_tf32`` to ``tf32`` (both ways: a plan
        priced without TF32 runs without it). Process-wide. Other devices are
        left alone (the CUDA flag also moves ``torch.get_float32_matmul_precision``,
        which CPU backends may read)."""
        import torch

        if device_type != "cuda":
            return
        torch.backends.cuda.matmul.allow_tf32 = self.tf32
        torch.backends.cudnn.allow_tf32 = self.tf32

    def wire_dtype_name(self, dtype_name: str) -> str:
        """The dtype a stage-boundary tensor of ``dtype_name`` travels in, and
        its gradient back: float32 in the compute dtype under a mixed policy
        (half the bytes on the links between stages, as Megatron-LM and Zorse
        send them; see [Note: 16-bit boundary tensors]), anything else as it is."""
        return self.compute_dtype_name if self.mixed and dtype_name == "float32" else dtype_name

    def run_dtype_name(self, dtype_name: str, planned: str) -> str:
        """The dtype a stage computes, under this policy, for a boundary tensor
        a plan priced under precision ``planned`` recorded as ``dtype_name``
        (the planner records autocast's output dtypes): where ``planned`` is
        mixed, its compute dtype is an autocast output and becomes this policy's
        compute dtype (float32 without autocast: a mixed plan trained in fp32);
        anything else as recorded."""
        if planned != self.name and planned != "fp32" and dtype_name == _COMPUTE[planned]:
            return self.compute_dtype_name
        return dtype_name

    # -- bytes per trainable parameter (what the runtime keeps) -------------
    #: float32 master weight, float32 gradient, AdamW moments (float32 x 2).
    weight_bytes_per_param: int = 4
    grad_bytes_per_param: int = 4
    optimizer_bytes_per_param: int = 8

    @property
    def cast_bytes_per_param(self) -> int:
        """The step's 16-bit weight copy in autocast's cache (0 in fp32)."""
        return 2 if self.mixed else 0

    @property
    def step_cast_bytes_per_param(self) -> int:
        """Bytes autocast's weight cast moves once per step per weight: 4 read + 2 written under a mixed
        policy (its cache keeps it for the step's micro-batches: [Note: the runtime's gradient work] in
        cost/roofline.py), 0 in fp32."""
        return self.weight_bytes_per_param + _ITEMSIZE[self.compute_dtype_name] if self.mixed else 0

    @property
    def reduce_copy_bytes_per_param(self) -> int:
        """16-bit copies of the gradient buckets in flight (0 when reducing in float32)."""
        return 0 if self.grad_reduce_dtype == "float32" else _ITEMSIZE[self.grad_reduce_dtype]

    @property
    def state_bytes_per_param(self) -> int:
        """Everything the runtime keeps per parameter: 16 (fp32), 18 (mixed), 20 (mixed, 16-bit reduction)."""
        return (self.weight_bytes_per_param + self.grad_bytes_per_param + self.optimizer_bytes_per_param
                + self.cast_bytes_per_param + self.reduce_copy_bytes_per_param)

    @property
    def optimizer_step_bytes_per_param(self) -> int:
        """Bytes per parameter the AdamW step reads and writes: the float32
        weight, gradient and moments (16 B; it never touches the 16-bit copies)."""
        return self.weight_bytes_per_param + self.grad_bytes_per_param + self.optimizer_bytes_per_param

    @property
    def shardable_bytes_per_param(self) -> int:
        """What ZeRO-1 shards: the AdamW moments (8 B)."""
        return self.optimizer_bytes_per_param

    @property
    def allreduce_bytes_per_param(self) -> int:
        """Bytes per gradient element in the data-parallel all-reduce."""
        return _ITEMSIZE[self.grad_reduce_dtype]

    @property
    def shardable_bytes_per_param16(self) -> int:
        """What a sharded stage shards of a 16-bit working weight: float32
        master 4 B + AdamW moments 8 B ([Note: 16-bit working weights])."""
        return self.weight_bytes_per_param + self.optimizer_bytes_per_param

    @property
    def allgather_bytes_per_param16(self) -> int:
        """Bytes per element in the all-gather of 16-bit working weights (the compute dtype's)."""
        return _ITEMSIZE[self.compute_dtype_name]

    @property
    def allgather_bytes_per_param(self) -> int:
        """Bytes per weight element in a ZeRO-1 stage's all-gather (float32 masters)."""
        return self.weight_bytes_per_param

    def describe(self) -> str:
        """One line for the plan table and the logs, e.g. ``bf16-mixed: bfloat16
        autocast compute; float32 weights, gradients and AdamW state (16
        B/param) + bfloat16 weight copies (2 B/param) = 18 B/param; gradients
        all-reduced in float32; stage-boundary activations and gradients sent
        in bfloat16``."""
        if not self.mixed:
            return (f"fp32: float32 compute ({'TF32 tensor-core matmuls where the GPU has them' if self.tf32 else 'TF32 off'}), "
                    f"weights, gradients and AdamW state = {self.state_bytes_per_param} "
                    f"B/param; gradients all-reduced in {self.grad_reduce_dtype}")
        base = self.weight_bytes_per_param + self.grad_bytes_per_param + self.optimizer_bytes_per_param
        cd = self.compute_dtype_name
        buckets = (f" + {self.grad_reduce_dtype} gradient buckets ({self.reduce_copy_bytes_per_param} B/param)"
                   if self.reduce_copy_bytes_per_param else "")
        return (f"{self.name}: {cd} autocast compute; float32 weights, gradients and AdamW state ({base} B/param) "
                f"+ {cd} weight copies ({self.cast_bytes_per_param} B/param){buckets} = "
                f"{self.state_bytes_per_param} B/param; gradients all-reduced in {self.grad_reduce_dtype}"
                + f"; stage-boundary activations and gradients sent in {cd}"
                + ("; dynamic loss scaling" if self.loss_scaling else ""))


def precision_policy(name: str, grad_reduce_dtype: str | None = None, *, tf32: bool = False) -> PrecisionPolicy:
    """The policy ``name`` with ``grad_reduce_dtype`` (None: the precision's
    default) and float32 matmuls in TF32 or not (``tf32``).

    Raises:
        ValueError: unknown precision, or a reduction dtype it does not allow;
            the message lists what is allowed.
    """
    if name not in PRECISIONS:
        raise ValueError(f"precision {name!r} is not one of {', '.join(PRECISIONS)}")
    return PrecisionPolicy(name=name, grad_reduce_dtype=grad_reduce_dtype or REDUCE_DTYPES[name][0], tf32=bool(tf32))


def default_precision(specs: Iterable["GPUSpec"]) -> str:
    """``bf16-mixed`` when every GPU computes in bfloat16 (Ampere and later:
    ``GPUSpec.bf16_supported``, from the datasheet table), else ``fp16-mixed``."""
    return "bf16-mixed" if all(s.bf16_supported for s in specs) else "fp16-mixed"


def check_supported(name: str, specs: Iterable["GPUSpec"]) -> None:
    """Raise ``ValueError`` if ``name`` is bf16-mixed and a GPU has no bfloat16,
    naming the GPU types and what to choose instead."""
    if name != "bf16-mixed":
        return
    missing = sorted({s.type for s in specs if not s.bf16_supported})
    if missing:
        raise ValueError(f"precision 'bf16-mixed' needs bfloat16 on every GPU of the plan, but "
                         f"{', '.join(missing)} {'has' if len(missing) == 1 else 'have'} none (pre-Ampere); "
                         f"use precision 'fp16-mixed' (loss scaling) or 'fp32'")
