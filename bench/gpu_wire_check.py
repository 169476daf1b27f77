"""The 16-bit boundary path (issue 31 item 4) on CUDA, a one-off check beside ``make gpu-check``.

``prepare`` (here, ``.venv/bin/python bench/gpu_wire_check.py prepare``): a 2-stage GPT plan on one GPU
group (P = 1, interleave 2: the boundary messages go to the rank itself, packed and unpacked as bfloat16),
its weights, and the losses of the same worker on this CPU under bf16-mixed for 3 batches, under
``.gpu_check/wire``. ``run`` (there, with ``.gpu_check`` carried and its wheels installed as ``make
gpu-check`` does): the worker on cuda:0; its losses within 2% of the CPU's (bf16 autocast on two devices)
and bfloat16 on the wire. Result 2026-11-27 on an H200: relative difference 3.5e-4 (bench/README.md)."""

import dataclasses
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / ".gpu_check" / "wire"  # ignored by git, carried to the GPU machine
sys.path.insert(0, str(ROOT))


def batches(plan, n=3):
    from zorse_fx.data import global_batch
    torch.manual_seed(1)
    toks = torch.randint(0, 256, (20000,))
    return [global_batch(toks, s, global_batch_size=plan.global_batch_size, seq_len=plan.seq_len,
                         input_names=plan.input_names, label_mode=plan.label_mode) for s in range(n)]


def train(plan, state, device):
    from zorse_fx.precision import precision_policy
    from zorse_fx.runtime.worker import OptimizerConfig, StageWorker
    w = StageWorker(plan, HERE / "plan", state, rank=0, device=device, precision=precision_policy("bf16-mixed"),
                    optimizer=OptimizerConfig(lr=1e-3))
    out = [float(w.train_step(b)) for b in batches(plan)]
    return out, [s.send_wire for s in w.stages], [s.recv_wire for s in w.stages]


if sys.argv[1] == "prepare":
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import fixed_plan, gpt4x64
    from zorse_fx.plan import Plan
    c = gpt4x64()
    plan = fixed_plan(c, ((0,), (1,)), ((2,), (2,)), num_microbatches=2, global_batch_size=4)
    plan = dataclasses.replace(plan, interleave=2, stages=(plan.stages[0], dataclasses.replace(plan.stages[1], gpus=plan.stages[0].gpus)))
    plan.export(HERE / "plan")
    torch.save(c.state(), HERE / "weights.pt")
    plan = Plan.load(HERE / "plan" / "plan.json")
    losses, sw, rw = train(plan, torch.load(HERE / "weights.pt"), torch.device("cpu"))
    (HERE / "cpu.json").write_text(json.dumps({"losses": losses}))
    print("cpu", losses, [t.dtype for t in sw[0]], [t.dtype for t in rw[1]])
else:
    from zorse_fx.plan import Plan
    plan = Plan.load(HERE / "plan" / "plan.json")
    losses, sw, rw = train(plan, torch.load(HERE / "weights.pt"), torch.device("cuda", 0))
    cpu = json.loads((HERE / "cpu.json").read_text())["losses"]
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, cpu))
    print(json.dumps({"cuda": losses, "cpu": cpu, "max_rel": rel, "send_wire": [t.dtype for t in sw[0]],
                      "recv_wire": [t.dtype for t in rw[1]], "device": torch.cuda.get_device_name(0)}))
    assert all(t.dtype == "bfloat16" for t in sw[0]) and rel < 2e-2, rel
    print("wire check passed")
