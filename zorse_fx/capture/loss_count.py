"""What a captured loss divides by: the *loss count*, read from the end of the graph.

[Note: token-mean losses]
The training loss of a language model is usually a mean over the tokens it
counts, not over the samples: ``F.cross_entropy(logits, labels,
ignore_index=PAD)`` (a Hugging Face causal LM's loss, with labels -100 at
padding: ``ignore_index`` defaults to -100) or ``(ce * mask).sum() /
mask.sum()``. For a batch ``B`` the loss is ``S(B) / C(B)``: ``S`` the sum of
the per-token losses, ``C`` the count of counted tokens, both sums over the
samples. The loss of single-process training on the global batch ``G`` is
``S(G) / C(G)`` (Hugging Face's ``num_items_in_batch`` is ``C(G)``).

A GPU ``g`` computing micro-batch ``m`` sees only its rows ``B_{g,m}`` and
returns ``l_{g,m} = S(B_{g,m}) / d_{g,m}`` with ``d_{g,m} = C(B_{g,m})``. So
the runtime weights it by ``d_{g,m} / D`` (``D = C(G)``, the sum of every
``d_{g,m}``), not by its share of the samples: the sum over GPUs and
micro-batches of ``l_{g,m} d_{g,m} / D`` is ``S(G) / C(G)``, and so are its
gradients ([Note: share-weighted gradients] in ``runtime/stage.py``).
Weighting by samples instead gives each GPU's token mean the weight of its
sample share: wrong as soon as the samples count different numbers of tokens.

For that the runtime must compute ``C`` of any rows: ``loss_tail`` finds it
in the graph as a function of the model inputs (and constants) alone:

- the loss ends in ``cross_entropy`` / ``nll_loss`` (fx: ``torch.nn.functional``;
  export: ``aten.cross_entropy_loss``, ``aten.nll_loss*``) with reduction
  ``"mean"`` and class-index targets: ``C`` counts the targets that are not
  ``ignore_index`` (each weighted by its class weight where ``weight`` is a
  constant: PyTorch's divisor);
- or it ends in a division ``num / den`` whose ``den`` reads no parameter and
  is a full ``sum`` (or ``count_nonzero``) of a tensor: ``C`` is that sum.
  A guard ``den.clamp(min=c)`` with ``c <= 1`` around it is allowed (it only
  changes a batch without counted tokens, see below);
- the mean of a boolean selection (``ce[mask].mean()``) is that token mean
  too, but its shapes depend on the mask's values, which the planner's shape
  analysis cannot follow: refused, naming ``(ce * mask).sum() / mask.sum()``.

Casts and multiplications or divisions by a number after either are allowed.
The count is a graph from every model input to a 0-dim tensor
(``LossTail.count``); codegen emits it as the last stage's ``loss_count``
method (``codegen/split.py``), hashed with the stage source like the rest of
it. ``capture.check_mean_loss`` then checks on the example batch that the
count explains the loss: it is additive over the samples (the batch's count
is the sum of every sample's) and the batch's loss is the count-weighted mean
of its two halves' losses. What matches neither that nor the sample mean is
refused, naming the divisor where there is one (a divisor that reads a
parameter, or is not a sum over the samples).

A loss whose divisor is a shape (``loss.sum() / idx.size(0)``) or a number
is a sample mean (or a sum) and has no count; so has a mean over probability
targets. A fixed-length LM's count is the same for every sample (``T``, or
``T - 1`` after Hugging Face's shift), which makes ``d_{g,m} / D`` the
sample share ``n_g / N`` exactly: the runtime computes it from the integer
counts in float64 (a correctly rounded quotient of the same rational number),
so such a plan trains bit for bit as a sample mean.

A micro-batch slice that counts no token (``d_{g,m} = 0``: a GPU's rows all
padding) has loss ``0 / 0`` and weight 0: the runtime leaves it out (its
contribution is 0, its backward sends zero gradients), which is what the whole
batch's ``S(G) / C(G)`` gives it. A global batch without a counted token
trains on a zero loss (the ``clamp(min=1)`` guard's result).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.operator_schemas import normalize_function

__all__ = ["LossTail", "loss_tail"]

_aten = torch.ops.aten

# Ops that change only the dtype or the storage of a value (a loss tail's `.float()`, `.to(...)`).
_CAST_FUNCTIONS = {_aten._to_copy.default, _aten.to.dtype, _aten.alias.default, _aten.clone.default,
                   torch.ops.prims.convert_element_type.default}
_CAST_METHODS = {"float", "double", "half", "bfloat16", "to", "type", "clone", "contiguous"}
_DIV_FUNCTIONS = {operator.truediv, torch.div, torch.true_divide, torch.divide, _aten.div.Tensor,
                  _aten.div.Scalar}
_DIV_METHODS = {"div", "divide", "true_divide", "__truediv__"}
_MUL_FUNCTIONS = {operator.mul, torch.mul, _aten.mul.Tensor, _aten.mul.Scalar}
_MUL_METHODS = {"mul", "__mul__"}
_CLAMP_FUNCTIONS = {torch.clamp, torch.clip, torch.clamp_min, _aten.clamp.default, _aten.clamp_min.default}
_CLAMP_METHODS = {"clamp", "clip", "clamp_min"}
_MEAN_FUNCTIONS = {torch.mean, _aten.mean.default}
# Loss ops whose "mean" divides by the weight of the targets that are not ignore_index.
_LOSS_FUNCTIONS = {torch.nn.functional.cross_entropy, torch.nn.functional.nll_loss, _aten.cross_entropy_loss.default,
                   _aten.nll_loss.default, _aten.nll_loss_nd.default, _aten.nll_loss2d.default}
_LOSS_TUPLE_FUNCTIONS = {_aten.nll_loss_forward.default, _aten.nll_loss2d_forward.default}  # (output, total_weight)


@dataclass(frozen=True, slots=True, kw_only=True)
class LossTail:
    """What the end of a loss graph divides by ([Note: token-mean losses])."""

    #: inputs (every placeholder of the captured graph, in order) -> the loss count ``C`` (0-dim
    #: tensor), as a module over the captured graph's constants; None: the loss divides by no count.
    count: fx.GraphModule | None = None
    #: The divisor in words, for messages ("the targets of cross_entropy that are not its
    #: ignore_index -100", "sum_2, a value of the input labels"); "" when there is none.
    divisor: str = ""
    #: Why the divisor is not a count of the inputs, a verb phrase ("reads the parameter 'w'", "is
    #: not a sum over the samples' tokens"), for the refusal of a loss that is no sample mean either;
    #: "" when there is no reason.
    problem: str = ""
    #: What the graph shows zorse_fx cannot train, whatever the example batch shows (at
    #: initialisation such a loss can be within the check's tolerance of a sample mean): a clause
    #: after "<Model>.forward " naming it and the fix; "" when nothing is.
    refusal: str = ""


def _is_number(a) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool)


def _method_or_function(n: fx.Node, functions: set, methods: set) -> bool:
    if n.op == "call_function":
        return n.target in functions
    return n.op == "call_method" and n.target in methods


def _meta_cast(n: fx.Node) -> bool:
    """A cast whose dtype or device is read off another value: ``x.to(y.dtype)``, ``x.type_as(y)``,
    ``x.to(y)`` (fx keeps these; export resolves them). For a count it is ``x`` itself (the same
    count in another dtype), so the count does not depend on ``y``, which may be an activation."""
    return (n.op == "call_method" and n.target in ("to", "type_as", "type") and bool(n.args)
            and isinstance(n.args[0], fx.Node)
            and any(isinstance(a, fx.Node) for a in (*n.args[1:], *n.kwargs.values())))


def _deps(n: fx.Node) -> list[fx.Node]:
    """The nodes ``n``'s value depends on (a meta cast: its first argument only)."""
    return [n.args[0]] if _meta_cast(n) else n.all_input_nodes


def _ancestors(roots: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(_deps(n))
    return seen


def _parameters_read(gm: fx.GraphModule, node: fx.Node) -> list[str]:
    """The trainable parameters ``node`` depends on (``get_attr`` targets), sorted."""
    from .trace import fetch_attr

    out = set()
    for n in _ancestors([node]):
        if n.op == "get_attr":
            value = fetch_attr(gm, n.target)
            if isinstance(value, torch.nn.Parameter) and value.requires_grad:
                out.add(n.target)
    return sorted(out)


def _inputs_read(node: fx.Node) -> list[str]:
    return sorted(n.name for n in _ancestors([node]) if n.op == "placeholder")


def _extract(gm: fx.GraphModule, roots: list[fx.Node]) -> tuple[fx.Graph, dict[str, fx.Node]]:
    """A graph with a placeholder per model input (in order) and a copy of every node ``roots``
    depend on; no output yet. Returns it and the copies by original node name."""
    needed = _ancestors(roots)
    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    for n in gm.graph.find_nodes(op="placeholder"):
        env[n.name] = g.placeholder(n.name)
        env[n.name].meta = dict(n.meta)
    for n in gm.graph.nodes:
        if n in needed and n.op != "placeholder":
            env[n.name] = env[n.args[0].name] if _meta_cast(n) else g.node_copy(n, lambda a: env[a.name])
    return g, env


def _evaluate(gm: fx.GraphModule, node: fx.Node, example_inputs):
    """The value of ``node`` (which reads no parameter) on ``example_inputs``."""
    g, env = _extract(gm, [node])
    g.output(env[node.name])
    with torch.no_grad():
        return fx.GraphModule(gm, g)(*example_inputs)


def _peel(n: fx.Node) -> fx.Node:
    """The value before the casts and the scalings by a number that end a loss."""
    while isinstance(n, fx.Node):
        if _method_or_function(n, _CAST_FUNCTIONS, _CAST_METHODS):
            n = n.args[0]
        elif (_method_or_function(n, _MUL_FUNCTIONS, _MUL_METHODS) and len(n.args) == 2
              and sum(isinstance(a, fx.Node) for a in n.args) == 1 and any(_is_number(a) for a in n.args)):
            n = next(a for a in n.args if isinstance(a, fx.Node))
        elif (_method_or_function(n, _DIV_FUNCTIONS, _DIV_METHODS) and len(n.args) == 2
              and isinstance(n.args[0], fx.Node) and _is_number(n.args[1]) and not n.kwargs.get("rounding_mode")):
            n = n.args[0]
        else:
            break
    return n


def loss_tail(gm: fx.GraphModule, example_inputs: tuple[torch.Tensor, ...]) -> LossTail:
    """What the loss of ``gm`` (``forward(*inputs) -> scalar``) divides by
    ([Note: token-mean losses]): a ``LossTail`` whose ``count`` maps the
    inputs to the count of the tokens it averages over, or None (with the
    reason in ``problem`` where the loss divides by something that is not a
    count of the inputs). ``example_inputs`` decide the dtype of targets."""
    out = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    node = _peel(out)
    if not isinstance(node, fx.Node):
        return LossTail()
    if node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0 \
            and isinstance(node.args[0], fx.Node) and node.args[0].target in _LOSS_TUPLE_FUNCTIONS:
        return _loss_op_count(gm, node.args[0], example_inputs)
    if node.op == "call_function" and node.target in _LOSS_FUNCTIONS:
        return _loss_op_count(gm, node, example_inputs)
    if _method_or_function(node, _DIV_FUNCTIONS, _DIV_METHODS) and len(node.args) == 2 \
            and not node.kwargs.get("rounding_mode"):
        return _division_count(gm, node, example_inputs)
    if _method_or_function(node, _MEAN_FUNCTIONS, {"mean"}) and len(node.args) == 1 and not node.kwargs:
        return _selection_count(gm, node.args[0], example_inputs)
    return LossTail()


def _selection_count(gm: fx.GraphModule, selected, example_inputs) -> LossTail:
    """mean(y[mask]) / mean(y.masked_select(mask)) with a boolean ``mask``: a mean over the selected
    tokens, whose shapes depend on the mask's values, which the planner's shape analysis (fake
    tensors) cannot follow: refused, naming the equivalent loss it can train."""
    if not isinstance(selected, fx.Node):
        return LossTail()
    if selected.op == "call_function" and selected.target is operator.getitem:
        mask = selected.args[1]
    elif _method_or_function(selected, {torch.masked_select}, {"masked_select"}):
        mask = selected.args[1] if len(selected.args) > 1 else selected.kwargs.get("mask")
    else:
        return LossTail()
    if not isinstance(mask, fx.Node) or _parameters_read(gm, mask):
        return LossTail()
    value = _evaluate(gm, mask, example_inputs)
    if not isinstance(value, torch.Tensor) or value.dtype != torch.bool:
        return LossTail()  # an index, not a mask: a fixed selection
    return LossTail(refusal=(
        f"returns the mean of {selected.name}, the tokens a boolean mask ({mask.name}) selects: their number "
        f"depends on the mask's values, which zorse_fx's shape analysis cannot plan with; return the same token "
        f"mean as (loss * mask).sum() / mask.sum() (or cross_entropy(..., ignore_index=PAD)), which it trains "
        f"weighted by each GPU's count of tokens"))


def _learned(divisor: str, problem: str) -> str:
    return (f"divides its loss by {divisor}, which {problem}: a normaliser learned over the batch's tokens, which "
            f"no weighting of the GPUs' losses splits over GPUs and micro-batches equal to single-device training; "
            f"divide by a count computed from the inputs alone (mask.sum()), or return a mean over the samples")


def _loss_op_count(gm: fx.GraphModule, node: fx.Node, example_inputs) -> LossTail:
    """cross_entropy / nll_loss with reduction "mean": the weight of the targets that are not ignore_index."""
    kw = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs
    reduction = kw.get("reduction", "mean")
    if kw.get("size_average") is not None or kw.get("reduce") is not None:  # legacy arguments of F.*
        reduction = torch.nn._reduction.legacy_get_string(kw.get("size_average"), kw.get("reduce"))
    if reduction not in ("mean", 1):
        return LossTail()  # a sum (refused as one) or no reduction (not a scalar)
    target, weight, ignore = kw["target"], kw.get("weight"), kw.get("ignore_index", -100)
    name = getattr(node.target, "__name__", str(node.target))
    divisor = f"the weight of the targets of {name} that are not its ignore_index {ignore}"
    if not isinstance(target, fx.Node) or not isinstance(ignore, int):
        return LossTail()
    for what, arg in (("targets", target), ("class weights", weight)):
        params = _parameters_read(gm, arg) if isinstance(arg, fx.Node) else []
        if params:
            return LossTail(divisor=divisor, problem=f"has {what} that read the parameter {params[0]!r}",
                            refusal=_learned(divisor, f"has {what} that read the parameter {params[0]!r}"))
    if _evaluate(gm, target, example_inputs).is_floating_point():
        return LossTail()  # class probabilities: the mean is over the rows, a sample mean
    g, env = _extract(gm, [target] + ([weight] if isinstance(weight, fx.Node) else []))
    t = env[target.name]
    counted = g.call_function(torch.ne, (t, ignore))
    if isinstance(weight, fx.Node):
        # PyTorch's divisor: the sum of weight[target] over the counted targets.
        safe = g.call_function(torch.where, (counted, t, 0))
        per = g.call_function(operator.getitem, (env[weight.name], safe))
        counted = g.call_function(torch.mul, (per, counted))
    g.output(g.call_function(torch.sum, (counted,)))
    return LossTail(count=fx.GraphModule(gm, g), divisor=divisor)


def _division_count(gm: fx.GraphModule, node: fx.Node, example_inputs) -> LossTail:
    """num / den: den, when it reads no parameter and is a full sum (under casts and a clamp guard)."""
    den = node.args[1]
    if not isinstance(den, fx.Node):
        return LossTail()  # a number: a scaling
    summed = _summed(den)
    params = _parameters_read(gm, den)
    if params:  # learned token weights (a sum over the batch's tokens) are refused; a learned scale is not
        problem = f"reads the parameter {params[0]!r}"
        learned = summed is not None and bool(_inputs_read(summed))
        return LossTail(divisor=den.name, problem=problem, refusal=_learned(den.name, problem) if learned else "")
    value = _evaluate(gm, den, example_inputs)
    if not isinstance(value, torch.Tensor):
        return LossTail()  # a shape (the batch size): a sample mean
    inputs = _inputs_read(den)
    divisor = f"{den.name}, a value of the input{'s' if len(inputs) > 1 else ''} {', '.join(inputs) or '(none)'}"
    if not inputs:
        return LossTail()  # a constant: a scaling
    if summed is None:
        return LossTail(divisor=divisor, problem="is not a sum over the samples' tokens (like mask.sum())")
    g, env = _extract(gm, [summed])
    g.output(env[summed.name])
    return LossTail(count=fx.GraphModule(gm, g), divisor=divisor)


def _summed(den: fx.Node) -> fx.Node | None:
    """The full sum ``den`` is, under casts and a clamp guard; None if it is none."""
    n = den
    while isinstance(n, fx.Node):
        if _method_or_function(n, _CAST_FUNCTIONS, _CAST_METHODS) or _meta_cast(n):
            n = n.args[0]
        elif _method_or_function(n, _CLAMP_FUNCTIONS, _CLAMP_METHODS) and _clamp_guard(n):
            n = n.args[0]
        else:
            break
    return n if isinstance(n, fx.Node) and _full_sum(n) else None


def _clamp_guard(n: fx.Node) -> bool:
    """``x.clamp(min=c)`` with a number ``c <= 1`` and no upper bound: a guard against a batch
    without counted tokens."""
    kw = dict(n.kwargs)
    args = list(n.args[1:])
    low = kw.get("min", args[0] if args else None)
    high = kw.get("max", args[1] if len(args) > 1 else None)
    return _is_number(low) and low <= 1 and high is None


def _full_sum(n: fx.Node) -> bool:
    """Whether ``n`` sums (or counts the non-zeros of) every element of its one tensor argument."""
    rest = [a for a in n.args[1:]] + [v for k, v in n.kwargs.items() if k not in ("dtype",)]
    if n.op == "call_method" and n.target in ("sum", "count_nonzero"):
        return not rest
    if n.op == "call_function" and n.target in (torch.sum, torch.count_nonzero, _aten.sum.default,
                                                _aten.count_nonzero.default):
        return not rest
    if n.op == "call_function" and n.target is _aten.sum.dim_IntList:
        dims, val = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim"), n.args[0].meta.get("val")
        keepdim = (n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False))
        return (not keepdim and isinstance(val, torch.Tensor)
                and (dims is None or sorted(d % max(val.dim(), 1) for d in dims) == list(range(val.dim()))))
    return False
