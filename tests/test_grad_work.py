"""The runtime's gradient work per micro-batch, counted on the runtime itself ([Note: the runtime's
gradient work] in zorse_fx/cost/roofline.py; issue 50 item 7).

A real ``StageWorker`` (one stage on one GPU of a plan: no torch.distributed) trains a step of a tied
GPT at 2 and 4 micro-batches, fp32 and bf16-mixed, under a ``TorchDispatchMode`` that adds up the bytes
of the ``aten`` ops the cost model names: inside the backward (autograd's graph task), gradient casts
to float32 of a parameter's shape and adds of a parameter's shape (``AccumulateGrad`` into ``.grad``,
autograd's sum of the tied embedding's two contributions); outside it, casts whose input is a
parameter (autocast's weight casts). The difference between the two micro-batch counts, per
micro-batch, must equal ``grad_work_bytes`` exactly (bytes are integers: no tolerance), and the weight
casts must be one per cast parameter per step, whatever the micro-batch count.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import first_batch, fixed_plan
from zorse_fx.capture import analyse, capture
from zorse_fx.cost.roofline import grad_work_bytes, measure_saved_activations
from zorse_fx.models.gpt import GPT, GPTConfig
from zorse_fx.precision import precision_policy
from zorse_fx.runtime.worker import StageWorker

T = 16
ROWS = 2  # samples per micro-batch: activation rows (ROWS * T = 32) match no parameter's shape


class _Bytes(TorchDispatchMode):
    """Bytes of the gradient work's ops, by kind (see the module docstring)."""

    def __init__(self, params: list[torch.nn.Parameter]):
        super().__init__()
        self.params = {id(p) for p in params}
        self.shapes = {tuple(p.shape) for p in params}
        self.bytes = {"weight cast": 0, "gradient cast": 0, "accumulation": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        backward = torch._C._current_graph_task_id() != -1
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None or tuple(x.shape) not in self.shapes:
            return out
        if func is torch.ops.aten._to_copy.default:
            if not backward and id(x) in self.params:
                self.bytes["weight cast"] += x.nbytes + out.nbytes
            elif backward and out.dtype == torch.float32 and x.dtype != torch.float32:
                self.bytes["gradient cast"] += x.nbytes + out.nbytes
        elif backward and func in (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor):
            self.bytes["accumulation"] += x.nbytes + args[1].nbytes + x.nbytes
        return out


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (ROWS, T))
    return capture(GPT(GPTConfig(n_layer=2, n_embd=24, block_size=T)), (ids, ids))


def _counted(captured, lee_bytes, tmp_path, num_microbatches: int, precision: str) -> dict[str, int]:
    plan = fixed_plan(captured, ((0,),), ((ROWS,),), num_microbatches=num_microbatches,
                      global_batch_size=ROWS * num_microbatches, precision="fp32")
    plan.export(tmp_path)
    worker = StageWorker(plan, tmp_path, captured.state(), rank=0, device=torch.device("cpu"),
                         precision=precision_policy(precision))
    batch = first_batch(lee_bytes, plan)
    worker.train_step(batch)  # a step before: the one counted is a steady one
    count = _Bytes(list(worker.module.parameters()))
    with count:
        worker.train_step(batch)
    return count.bytes


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_grad_work_bytes_are_what_the_runtime_moves(gpt, lee_bytes, tmp_path, precision):
    policy = precision_policy(precision)
    bg = analyse(gpt)
    cast = measure_saved_activations(bg, policy).cast_params
    accumulate, casts = grad_work_bytes(bg, policy, cast)
    two = _counted(gpt, lee_bytes, tmp_path / "m2", 2, precision)
    four = _counted(gpt, lee_bytes, tmp_path / "m4", 4, precision)
    per_microbatch = {k: (four[k] - two[k]) / 2 for k in two}
    assert per_microbatch["accumulation"] == sum(accumulate)
    assert per_microbatch["gradient cast"] == pytest.approx(sum(casts), rel=1e-12)
    state, trainable = gpt.state(), gpt.trainable()
    if policy.mixed:
        # Every matmul weight and bias is cast (the tied embedding through the LM head); the norms are not.
        assert cast and all(".ln" not in n and not n.startswith("ln_") for n in cast)
        assert any(n.startswith(("h.0.ln", "ln_f")) for n in trainable - cast)
        assert sum(casts) > 0
        # Autocast's weight casts: once per step, whatever the micro-batch count.
        step_cast = policy.step_cast_bytes_per_param * sum(state[n].numel() for n in cast)
        assert two["weight cast"] == four["weight cast"] == step_cast
    else:
        assert cast == frozenset() and sum(casts) == 0
        assert two["weight cast"] == four["weight cast"] == 0 and two["gradient cast"] == 0
