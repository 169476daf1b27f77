"""Shared fixtures: small real models, real text, and a torchrun launcher."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from zorse_fx.data import global_batch, read_corpus, tokenize

ROOT = Path(__file__).resolve().parents[1]
CLUSTERS = ROOT / "examples" / "clusters"


@pytest.fixture(scope="session")
def lee_bytes() -> torch.Tensor:
    """Real English text (gensim's Lee news corpus) as byte tokens."""
    return tokenize(read_corpus("lee"))


def first_batch(tokens, plan):
    return global_batch(tokens, 0, global_batch_size=plan.global_batch_size, seq_len=plan.seq_len,
                        input_names=plan.input_names, label_mode=plan.label_mode)


def reference_step(captured, batch: dict[str, torch.Tensor]):
    """Single-process loss and gradients (by canonical name) on the whole global batch."""
    from zorse_fx.capture.trace import _fetch_attr

    gm = captured.graph_module
    gm.zero_grad(set_to_none=True)
    loss = gm(*[batch[n] for n in captured.input_names])
    loss.backward()
    grads = {}
    for canon in captured.trainable():
        grads[canon] = _fetch_attr(gm, canon).grad.detach().clone()
    gm.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def run_distributed(compiled_or_plan, weights, tokens, tmp_path: Path, *, steps: int = 1, extra=()):
    """Export, launch torchrun, return (metrics rows, {rank: grads})."""
    from zorse_fx.runtime.launch import launch

    plan = compiled_or_plan
    plan_dir = tmp_path / "plan"
    plan.export(plan_dir)
    torch.save(weights, plan_dir / "weights.pt")
    torch.save(tokens, tmp_path / "tokens.pt")
    launch(plan_dir, plan.world_size,
           ["--tokens", str(tmp_path / "tokens.pt"), "--steps", str(steps), "--out", str(tmp_path / "run"),
            "--dump-grads", "1", *extra], timeout_s=300)
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    grads = {r: torch.load(tmp_path / "run" / "grads" / f"rank{r}.pt") for r in range(plan.world_size)}
    return rows, grads


def with_memory_policy(plan, *, sharded=(), recompute=(), shard_bytes=None):
    """``plan`` with stages ``sharded`` / ``recompute`` (stage indices) turned on
    and, per stage index, the GPUs' ``state_shard_bytes`` set by hand (tests
    choose shares the planner would not, e.g. a GPU owning nothing)."""
    stages = []
    for s in plan.stages:
        gpus = s.gpus
        if shard_bytes and s.index in shard_bytes:
            gpus = tuple(dataclasses.replace(g, state_shard_bytes=b)
                         for g, b in zip(gpus, shard_bytes[s.index], strict=True))
        stages.append(dataclasses.replace(s, gpus=gpus, sharded=s.index in sharded, recompute=s.index in recompute))
    return dataclasses.replace(plan, stages=tuple(stages))
