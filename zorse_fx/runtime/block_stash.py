"""Recomputation with host-stashed block inputs: a recomputing stage that keeps
only each block's inputs, in host memory, between a micro-batch's forward and
its backward ([C-stash] in ``solve/objective.py``; Zorse's recomputation).

[Note: host-stashed recomputation]
A stage with ``StagePlan.stash_on_host`` (``StageMemory(recompute=True,
stash="host")``) runs its forward with autograd recording, but each of its
block methods ([Note: block methods] in ``codegen/split.py``) goes through
``_StashedBlock``, a ``torch.autograd.Function`` in the manner of
``torch.utils.checkpoint``'s reentrant form:

* forward: the block runs without recording (a Function's forward), so it
  saves nothing; its tensor inputs are copied to host memory (pinned, queued
  on a side stream after the compute stream's work on a GPU; the device
  tensor is kept from reuse until the copy ran: ``record_stream``) and the
  device's references dropped; the RNG state (CPU and the device's) and the
  autocast state are kept with them.
* backward: the inputs come back to the device (on a GPU the previous
  block's, which the engine runs next, are fetched on the side stream ahead:
  ``_Stash.prefetch``), the block is re-run with recording under the RNG
  state and autocast of its first forward, and back-propagated with the
  gradients of its outputs (``torch.autograd.backward``: the parameters'
  ``.grad`` accumulate as in any backward, their hooks fire), and the
  gradients of its inputs go on to the block before.

So between forward and backward a GPU holds, per micro-batch in flight, the
stage's received tensors and its outputs (the runtime keeps both for the
backward, [Note: stage recomputation] in ``stage.py``), and in the backward
one block's saved tensors at a time; the blocks' inputs of every micro-batch
in flight wait in host memory. Compared with whole-stage recomputation (the
stage's inputs kept on the GPU, the whole stage re-run at once) the backward
holds one block's activations instead of the stage's, at the price of the
host copies (2 x the blocks' input bytes over the host link per micro-batch,
overlapped with compute on a GPU). The recomputed values are bit-identical to
the first forward's (the same kernels on the same inputs, the same RNG), so
training equals single-process training. Not with ZeRO-2/3 nor activation
offload (``StageMemory`` refuses them): ZeRO-3's per-block gathers and
ZeRO-2's per-micro-batch reduction are not composed with the nested backward
yet.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["BlockStash"]


class _Held:
    """Bytes of block inputs in host memory now (``now``) and at most so far (``peak``)."""

    __slots__ = ("now", "peak")

    def __init__(self):
        self.now = self.peak = 0


class _Saved:
    """One block call's inputs in host memory (``host``: one entry per input, a
    host tensor or the non-tensor value itself), its RNG and autocast state,
    and the block call before it in the same forward (``prev``), whose inputs
    the backward fetches ahead. Counted in ``held`` until its backward takes
    them, or until it is freed without one (a micro-batch whose loss weighs 0)."""

    __slots__ = ("host", "grads", "rng", "autocast", "prev", "fetched", "ready", "nbytes", "held")

    def __init__(self, host, grads, rng, autocast, prev, held: _Held):
        self.host, self.grads, self.rng, self.autocast, self.prev = host, grads, rng, autocast, prev
        self.nbytes = sum(h.numel() * h.element_size() for h in host if isinstance(h, torch.Tensor))
        self.fetched = None  # the inputs back on the device, once fetched
        self.ready = None  # a CUDA event the fetch recorded on the side stream
        self.held = held
        held.now += self.nbytes
        held.peak = max(held.peak, held.now)

    def release(self) -> None:
        self.held.now -= self.nbytes
        self.host, self.nbytes = (), 0

    def __del__(self):
        self.held.now -= self.nbytes


class BlockStash:
    """Wraps the block methods of one stage's ``module`` (its class lists them
    in ``BLOCKS``) so that, while autograd records, each runs as a
    ``_StashedBlock`` (see the note). ``device``: the stage's device."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None
        #: Bytes of block inputs copied to host memory so far, and those held there (the block calls whose
        #: backward has not run: a micro-batch whose loss weighs 0 runs none, its stash is freed with its graph).
        self.stashed_bytes = 0
        self.held = _Held()
        #: Block calls recomputed so far.
        self.recomputed = 0
        self._last: _Saved | None = None  # the previous block call of the forward in progress
        #: An empty leaf that requires grad, an input of every block call: the parameters a block reads are not
        #: its inputs, so without it a block of no grad-requiring input (the first stage's) would not be
        #: recorded and its parameters would get no gradient (``torch.utils.checkpoint``'s reentrant caveat).
        self.anchor = torch.zeros(0, device=device, requires_grad=True)
        for b in module.BLOCKS:
            fn = getattr(module, f"block_{b}")
            setattr(module, f"block_{b}", self._wrapped(fn))

    def _wrapped(self, fn):
        def call(*args):
            if not torch.is_grad_enabled():
                return fn(*args)
            return _StashedBlock.apply(self, fn, self.anchor, *args)

        return call

    def start_forward(self) -> None:
        """A micro-batch's forward begins: its first block fetches nothing ahead of it."""
        self._last = None

    # -- host copies -----------------------------------------------------------
    def down(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t`` (pinned next to a GPU, copied on the side stream after the compute stream's
        work so far)."""
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=self.cuda)
        if self.cuda:
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.side):
                host.copy_(t, non_blocking=True)
            t.record_stream(self.side)
        else:
            host.copy_(t)
        self.stashed_bytes += host.numel() * host.element_size()
        return host

    def fetch(self, saved: _Saved) -> None:
        """Start bringing ``saved``'s inputs back to the device (on the side stream on a GPU)."""
        if saved.fetched is not None:
            return
        if self.cuda:
            with torch.cuda.stream(self.side):
                saved.fetched = [h.to(self.device, non_blocking=True) if isinstance(h, torch.Tensor) else h
                                 for h in saved.host]
                saved.ready = torch.cuda.Event()
                saved.ready.record(self.side)
        else:
            saved.fetched = [h.to(self.device) if isinstance(h, torch.Tensor) else h for h in saved.host]

    def take(self, saved: _Saved) -> list:
        """``saved``'s inputs on the device, ready for the compute stream; the host copies released."""
        self.fetch(saved)
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(saved.ready)
            for t in saved.fetched:
                if isinstance(t, torch.Tensor):
                    t.record_stream(current)
        out, saved.fetched = saved.fetched, None
        saved.release()
        return out

    @contextlib.contextmanager
    def replayed(self, saved: _Saved):
        """The RNG state and autocast of the block's first forward, the global RNG stream left as it was."""
        cpu, dev = saved.rng
        with torch.random.fork_rng(devices=[self.device] if dev is not None else []):
            torch.set_rng_state(cpu)
            if dev is not None:
                torch.cuda.set_rng_state(dev, self.device)
            enabled, dtype = saved.autocast
            with torch.autocast(self.device.type, enabled=enabled, dtype=dtype):
                yield

    def rng_state(self):
        return torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if self.cuda else None

    def summary(self) -> dict:
        """``stashed_bytes``: block inputs copied to host memory so far; ``peak_held_bytes``: the most held
        there at once; ``recomputed_blocks``: block calls re-run so far."""
        return {"stashed_bytes": self.stashed_bytes, "peak_held_bytes": self.held.peak,
                "recomputed_blocks": self.recomputed}


class _StashedBlock(torch.autograd.Function):
    """One block call: run without saving, inputs to host memory; re-run and back-propagated in the backward
    (see the note)."""

    @staticmethod
    def forward(ctx, stash: BlockStash, fn, anchor, *args):
        dt = stash.device.type
        grads = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        autocast = (torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt))
        rng = stash.rng_state()
        out = fn(*args)
        host = [stash.down(a) if isinstance(a, torch.Tensor) else a for a in args]
        ctx.stash, ctx.fn = stash, fn
        ctx.saved = saved = _Saved(host, grads, rng, autocast, stash._last, stash.held)
        stash._last = saved
        ctx.mark_non_differentiable(*[o for o in out if isinstance(o, torch.Tensor) and not o.is_floating_point()])
        return tuple(out)

    @staticmethod
    def backward(ctx, *grad_out):
        stash, saved = ctx.stash, ctx.saved
        args = stash.take(saved)
        if saved.prev is not None:  # the block the engine runs next: its inputs on their way meanwhile
            stash.fetch(saved.prev)
        inputs = [a.detach().requires_grad_(g) if isinstance(a, torch.Tensor) else a
                  for a, g in zip(args, saved.grads)]
        with torch.enable_grad(), stash.replayed(saved):
            out = ctx.fn(*inputs)
        stash.recomputed += 1
        pairs = [(o, g) for o, g in zip(out, grad_out)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs])
        ctx.saved = None
        return (None, None, None, *[a.grad if isinstance(a, torch.Tensor) and g else None
                              for a, g in zip(inputs, saved.grads)])
