"""Activation offload: what autograd saves during a micro-batch's forward is
kept in host memory until its backward ([C-act-offload] in
``solve/objective.py``).

[Note: activation offload]
A stage with ``StagePlan.offload_activations`` runs each recorded forward
inside a ``torch.autograd.graph.saved_tensors_hooks`` pair (``saving``):

* pack: a saved tensor that is a weight stays where it is (a parameter, a
  view of one, or autocast's cast of one: ``ToCopyBackward0`` of the
  parameter's ``AccumulateGrad``; autocast's cache holds that cast for the whole forward
  anyway, so moving it would cost a transfer and free nothing); every other
  saved tensor is copied into a fresh host tensor (pinned next to a GPU,
  the copy queued on the current stream, as
  ``torch.autograd.graph.save_on_cpu`` does) and the GPU's reference dropped;
* unpack: the host tensor is copied back to the device when the backward
  needs it (on the current stream; autograd frees it after the node's use).

So the GPU holds one micro-batch's saved tensors at a time, at most, as it
makes or consumes them; the micro-batches in flight wait in host memory.
The copies run on the compute stream: nothing overlaps them with compute,
and the planner prices 2 x the saved bytes over the GPU's host link per
micro-batch, half in the forward and half in the backward. ``save_on_cpu``
itself is not used because it would move the weights too (every layer's
weight, twice per micro-batch), and because a ZeRO-3 stage has its own pack
hook ([Note: sharded parameters] in ``param_shard.py``): nested hooks are not
composed by torch (the innermost pair wins), so ``saving`` composes them: a
working weight ZeRO-3 re-gathers is its, the rest is offloaded. The values
are bit-identical copies, so training equals the same run without offload.
Not with recomputation (a recomputing stage saves only its inputs), nor with
ZeRO-2/3 in the planner (the runtime composes with ZeRO-3 all the same).
"""

from __future__ import annotations

import torch

__all__ = ["ActivationOffload"]


class _Host:
    """A saved tensor in host memory and the device it came from."""

    __slots__ = ("tensor", "device")

    def __init__(self, tensor: torch.Tensor, device: torch.device):
        self.tensor, self.device = tensor, device


class ActivationOffload:
    """The pack / unpack pair of one stage (see the note). ``module``: the
    stage's module (its parameters stay put); ``inner``: another hooks pair
    to try first (ZeRO-3's), or None."""

    def __init__(self, module: torch.nn.Module, device: torch.device, inner=None):
        self.device = device
        self.pin = device.type == "cuda"
        self.inner = inner
        #: Storages of the stage's parameters (a saved view of one stays).
        self._weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
        #: Bytes copied to host memory so far, and saved tensors left in place (weights).
        self.offloaded_bytes = 0
        self.kept = 0

    def _is_weight(self, t: torch.Tensor) -> bool:
        if isinstance(t, torch.nn.Parameter) or t.untyped_storage().data_ptr() in self._weights:
            return True
        fn = t.grad_fn  # autocast's cast of a parameter: ToCopyBackward0 of the parameter's AccumulateGrad
        return fn is not None and fn.name() == "ToCopyBackward0" and any(
            isinstance(getattr(f, "variable", None), torch.nn.Parameter) for f, _ in fn.next_functions)

    def pack(self, t: torch.Tensor):
        if self.inner is not None:
            packed = self.inner[0](t)
            if packed is not t:
                return packed
        if t.device.type == "meta" or self._is_weight(t):
            self.kept += 1
            return t
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=self.pin)
        host.copy_(t, non_blocking=self.pin)
        self.offloaded_bytes += host.numel() * host.element_size()
        return _Host(host, t.device)

    def unpack(self, x):
        if isinstance(x, _Host):
            return x.tensor.to(x.device, non_blocking=self.pin)
        return self.inner[1](x) if self.inner is not None else x

    def saving(self):
        """The context a recorded forward runs in."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def summary(self) -> dict:
        """``offloaded_bytes``: bytes of saved tensors copied to host memory so far;
        ``kept_weights``: saved tensors left in place as weights (a count)."""
        return {"offloaded_bytes": self.offloaded_bytes, "kept_weights": self.kept}
