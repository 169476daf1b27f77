"""Capture pass: an explicit causal attention mask becomes ``is_causal=True``.

[Note: causal masks]
Hugging Face decoders build their causal mask in the graph (``arange``
comparisons, packed-sequence checks, ``expand`` over the batch) and hand it to
``scaled_dot_product_attention`` as ``attn_mask``. With an explicit mask SDPA
cannot take the kernels that skip the masked half: on Hopper cuDNN attention
with a mask runs at about half its unmasked rate (``cost/gpu_model.py``,
[Note: attention rate]), and FlashAttention-style kernels need ``is_causal``.
``causal_masks_to_is_causal`` rewrites such a node to ``attn_mask=None,
is_causal=True`` where the graph shows the two equal:

* the mask is a function of constants and of the inputs' *shapes* only: every
  path from it back to a placeholder goes through ``aten.sym_size.int`` (the
  dynamic batch size), never through an input's values (a padding mask from
  an ``attention_mask`` input is left alone);
* evaluated at two batch sizes (1 and 3), every batch row and head of the mask
  is exactly SDPA's own causal mask for the query and key lengths (the lower
  triangle, top-left aligned, as ``is_causal`` applies it): a boolean mask
  True on and below the diagonal and False above, or an additive float mask 0
  on and below and ``-inf`` or at most ``torch.finfo(dtype).min`` above (what
  softmax turns into exactly 0 there either way, the diagonal never masked);
* the node has no dropout and is not already causal, and the query and key
  lengths are static and equal (no KV cache in a training graph).

This is a check at two batch sizes, not a symbolic proof for every size: a
mask computed from the batch size other than by broadcasting it (``expand``,
``arange`` over the batch, as Hugging Face's) could in principle agree at 1
and 3 and differ elsewhere; no mask we know is built that way. The mask's nodes
left unused are removed, so they no longer cross
stage cuts (nothing else is removed). ``tests/test_causal_mask_pass.py`` checks the loss and gradients
of the rewritten graph against the original's.
"""

from __future__ import annotations

import logging

import torch
from torch import fx

__all__ = ["causal_masks_to_is_causal"]

log = logging.getLogger(__name__)

_SDPA = (torch.ops.aten.scaled_dot_product_attention.default, torch.nn.functional.scaled_dot_product_attention)
_SYM_SIZE = torch.ops.aten.sym_size.int
#: Batch sizes the mask is evaluated at (see the note).
CHECK_BATCHES = (1, 3)


def _arg(node: fx.Node, i: int, name: str, default=None):
    return node.kwargs.get(name, node.args[i] if len(node.args) > i else default)


def _static_len(node) -> int | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if val is None or val.dim() < 2 or not isinstance(val.shape[-2], int):
        return None
    return int(val.shape[-2])


def _ancestors(mask: fx.Node) -> list[fx.Node] | None:
    """The nodes ``mask`` is computed from, in graph order, or None when it reads an
    input's values (a placeholder used other than by ``sym_size``) or a module call."""
    seen: set[fx.Node] = set()
    stack = [mask]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" or n.op in ("call_module", "output"):
            return None
        if n.op == "call_function" and n.target is _SYM_SIZE:
            continue  # only the input's shape: its placeholder is not followed
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _evaluate(gm: fx.GraphModule, nodes: list[fx.Node], batch: int):
    """The last of ``nodes`` (a mask's subgraph) with every batch size ``batch``, computed
    on the CPU (tensor factories' ``device`` set to it: a graph captured on the meta
    device has no values)."""
    env: dict[fx.Node, object] = {}

    def load(a):
        return fx.node.map_arg(a, lambda n: env[n])

    for n in nodes:
        if n.op == "call_function" and n.target is _SYM_SIZE:
            if n.args[1] != 0:
                return None  # only the batch dimension is symbolic
            env[n] = batch
        elif n.op == "get_attr":
            obj = gm
            for part in n.target.split("."):
                obj = getattr(obj, part)
            env[n] = obj
        elif n.op == "call_function":
            kwargs = dict(load(n.kwargs))
            if "device" in kwargs:  # a model captured on the meta device: the mask's values, on the CPU
                kwargs["device"] = torch.device("cpu")
            env[n] = n.target(*load(n.args), **kwargs)
        elif n.op == "call_method":
            self_, *rest = load(n.args)
            env[n] = getattr(self_, n.target)(*rest, **load(n.kwargs))
        else:
            return None
    return env[nodes[-1]]


def _is_causal_mask(mask, length: int) -> bool:
    """Whether ``mask`` (broadcastable to (N, H, L, L)) equals SDPA's causal mask everywhere."""
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or tuple(mask.shape[-2:]) != (length, length):
        return False
    keep = torch.ones(length, length, dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        return bool((mask == keep).all())
    if not mask.is_floating_point():
        return False
    blocked = mask <= torch.finfo(mask.dtype).min
    return bool(((mask == 0) == keep).all() and (blocked == ~keep).all())


def causal_masks_to_is_causal(gm: fx.GraphModule) -> int:
    """Rewrite every SDPA node of ``gm`` whose explicit ``attn_mask`` is the causal
    mask to ``is_causal=True`` without a mask (see [Note: causal masks]), in place;
    returns how many were rewritten. The graph is recompiled when any was."""
    done, dead = 0, []
    checked: dict[tuple[fx.Node, int], bool] = {}  # per mask and length: a mask most layers share, checked once
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _SDPA:
            continue
        mask = _arg(node, 3, "attn_mask")
        if not isinstance(mask, fx.Node) or _arg(node, 4, "dropout_p", 0.0) or _arg(node, 5, "is_causal", False):
            continue
        q_len, k_len = _static_len(node.args[0]), _static_len(node.args[1])
        if q_len is None or q_len != k_len:
            continue
        nodes = _ancestors(mask)
        if nodes is None:
            continue
        ok = checked.get((mask, q_len))
        if ok is None:
            try:
                with torch.no_grad():
                    ok = all(_is_causal_mask(_evaluate(gm, nodes, b), q_len) for b in CHECK_BATCHES)
            except Exception as exc:  # noqa: BLE001 -- an op that cannot run here: keep the mask
                log.info("causal mask check of %s failed (%s): mask kept", node.name, exc)
                ok = False
            checked[mask, q_len] = ok
        if not ok:
            continue
        q, k, v = node.args[:3]
        node.args = (q, k, v, None, 0.0, True)
        node.kwargs = {key: val for key, val in node.kwargs.items()
                       if key not in ("attn_mask", "dropout_p", "is_causal")}
        done += 1
        dead.extend(nodes)
    if done:
        # Only the masks' own nodes that nothing reads any more: the rest of the graph,
        # unused get_attr nodes included (they name tied parameters), stays as captured.
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        for n in sorted(set(dead), key=order.__getitem__, reverse=True):
            if not n.users and n.op == "call_function":
                gm.graph.erase_node(n)
        gm.graph.lint()
        gm.recompile()
    return done
