"""``StageMemory``: the memory policy of one pipeline stage, the one record the
options' searches produce and the decision, the objective, the simulator, the
stage DP, the interleave pass and the plan read.

Its terms are the field's standard ones:

- ``zero``: the state layout over the stage's data-parallel GPUs. 0 =
  replicated; 1 = ZeRO-1, the optimizer state (AdamW moments, float32
  masters) sharded ([C-shard] in ``solve/objective.py``); 2 = ZeRO-2, the
  float32 gradients sharded too, reduce-scattered every micro-batch
  ([C-grad-shard]); 3 = ZeRO-3, the working weights sharded too, each
  block's gathered for its forward and again for its backward
  ([C-param-shard]). Each level needs the one below; any level >= 1 needs
  two GPUs in the stage (checked by ``Decision``, which knows them).
- ``recompute``: activation recomputation (GPipe's re-materialisation): the
  stage keeps only its inputs per micro-batch in flight and re-runs its
  forward before the backward ([C-recompute]).
- ``optimizer``: where the optimizer state lives and steps: "device" or
  "host" (optimizer offload: AdamW moments and float32 masters in host
  memory, stepped on the CPU, [C-offload]).
- ``activations``: where the tensors autograd saves between a micro-batch's
  forward and its backward live: "device" or "host" (activation offload,
  [C-act-offload]). "host" goes without recomputation and without ZeRO-2/3.
- ``stash``: where a recomputing stage keeps what it needs between a
  micro-batch's forward and its backward: "device" = the stage's inputs, on
  the GPU, the whole stage re-run at once ([C-recompute]); "host" = each
  block's inputs, in host memory, each block re-run on its own in the
  backward (Zorse's recomputation, [C-stash]; [Note: host-stashed
  recomputation] in ``runtime/block_stash.py``). "host" needs
  ``recompute``, and goes without ZeRO-2/3 and activation offload.

The working weights' dtype is plan-wide, not per stage: ``Decision.precision``
and ``Plan.precision`` (``zorse_fx/precision.py``); nothing chooses it per
stage, so this record has no field for it.

The plan file keeps its own per-stage field names (``StagePlan.sharded``,
``grad_sharded``, ``param_sharded``, ``offload_optimizer``,
``offload_activations``, ``recompute``, ``stash_on_host``); ``StagePlan.memory`` reads them into
this record and ``plan_build.build_plan`` writes them from it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Literal, get_args

__all__ = ["StageMemory", "Placement", "PLACEMENTS"]

#: Where a stage's optimizer state or saved activations live.
Placement = Literal["device", "host"]
PLACEMENTS: tuple[str, ...] = get_args(Placement)


@dataclass(frozen=True, slots=True, kw_only=True)
class StageMemory:
    """One stage's memory policy (see the module note); the default is plain:
    replicated, no recomputation, optimizer and activations on the GPU.

    Raises ValueError naming the field and the value: ``zero`` not an int in
    0..3, ``recompute`` not a bool, a placement not "device" / "host",
    ``activations="host"`` with recomputation or with ``zero`` >= 2, ``stash="host"`` without
    recomputation or with ``zero`` >= 2 or ``activations="host"``."""

    #: 0 replicated, 1 ZeRO-1 (optimizer state sharded), 2 ZeRO-2 (+ gradients), 3 ZeRO-3 (+ working weights).
    zero: int = 0
    #: Activation recomputation.
    recompute: bool = False
    #: "device", or "host" = optimizer offload.
    optimizer: Placement = "device"
    #: "device", or "host" = activation offload.
    activations: Placement = "device"
    #: A recomputing stage's stash: "device" (its inputs), or "host" (each block's inputs, in host memory).
    stash: Placement = "device"

    def __post_init__(self) -> None:
        zero = self.zero
        try:
            if isinstance(zero, bool):
                raise TypeError
            zero = operator.index(zero)
        except TypeError:
            raise ValueError(f"StageMemory.zero={self.zero!r}: use an int in 0..3 (0 replicated, 1 ZeRO-1, "
                             f"2 ZeRO-2, 3 ZeRO-3)") from None
        if not 0 <= zero <= 3:
            raise ValueError(f"StageMemory.zero={zero}: use an int in 0..3 (0 replicated, 1 ZeRO-1, 2 ZeRO-2, "
                             f"3 ZeRO-3)")
        object.__setattr__(self, "zero", zero)
        if self.recompute not in (True, False):
            raise ValueError(f"StageMemory.recompute={self.recompute!r}: use True or False")
        object.__setattr__(self, "recompute", bool(self.recompute))
        for name in ("optimizer", "activations", "stash"):
            if getattr(self, name) not in PLACEMENTS:
                raise ValueError(f"StageMemory.{name}={getattr(self, name)!r}: use 'device' or 'host'")
        if self.activations == "host" and (self.recompute or zero >= 2):
            other = "recompute=True" if self.recompute else f"zero={zero}"
            raise ValueError(f"StageMemory(activations='host', {other}): activation offload goes without "
                             f"recomputation and ZeRO-2/3")
        if self.stash == "host" and not (self.recompute and zero <= 1 and self.activations == "device"):
            other = ("recompute=False" if not self.recompute else f"zero={zero}" if zero > 1
                     else "activations='host'")
            raise ValueError(f"StageMemory(stash='host', {other}): host-stashed block inputs need recompute=True, "
                             f"and go without ZeRO-2/3 and activation offload")
