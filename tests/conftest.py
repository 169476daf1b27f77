"""Shared fixtures: small real models, real text, a torchrun launcher, and the
random planning instances of the planner / simulator tests."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch

from zorse_fx.data import global_batch, read_corpus, tokenize
from zorse_fx.errors import InfeasiblePlanError
from zorse_fx.solve import BlockCosts, DeviceGraph, SolverOptions

ROOT = Path(__file__).resolve().parents[1]
CLUSTERS = ROOT / "examples" / "clusters"
GIB = 1 << 30


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


# -- random planning instances (tests/test_solver.py, test_grouped.py, test_sim.py) --

def make_devices(types, nodes, memory, mem_bw, *, intra=(100e9, 5e-6), inter=(10e9, 2e-5), odd_links=None):
    """GPUs with NVLink-like links inside a node and slower links across nodes.
    ``odd_links``: {(g, h): (bw, latency)} overrides for single pairs (symmetric)."""
    g = len(types)
    link = {(a, b): (intra if nodes[a] == nodes[b] else inter) for a in range(g) for b in range(g)}
    for (a, b), v in (odd_links or {}).items():
        link[a, b] = link[b, a] = v
    bw = tuple(tuple(0.0 if a == b else link[a, b][0] for b in range(g)) for a in range(g))
    lat = tuple(tuple(0.0 if a == b else link[a, b][1] for b in range(g)) for a in range(g))
    return DeviceGraph(gpu_types=tuple(types), memory_bytes=tuple(memory), mem_bw_bytes_per_s=tuple(mem_bw),
                       link_bw_bytes_per_s=bw, link_latency_s=lat, node_names=tuple(nodes))


def random_costs(rng, nb, types, *, fixed=False):
    """Block costs of ``nb`` blocks for GPU ``types``, each type 1-3x slower than a
    common base; ``fixed``: with a fixed per-micro-batch cost (kernel launches)."""
    base = [rng.uniform(4e-3, 20e-3) for _ in range(nb)]
    slow = {t: rng.choice([1.0, 1.5, 2.0, 3.0]) for t in types}
    return BlockCosts(
        fwd_bwd_s_per_sample={t: tuple(x * slow[t] * rng.uniform(0.8, 1.2) for x in base) for t in types},
        param_count=tuple(rng.randint(20, 200) * 1_000_000 for _ in range(nb)),
        act_bytes_per_sample=tuple(rng.randint(20, 600) * 1_000_000 for _ in range(nb)),
        cut_bytes_per_sample=(0, *(rng.randint(1, 200) * 1_000_000 for _ in range(nb - 1)), 0),
        fwd_bwd_s_fixed=({t: tuple(rng.uniform(0, 5e-3) for _ in range(nb)) for t in types} if fixed else {}),
    )


def random_instance(seed, *, singleton_classes=False, time_limit_s=20.0):
    """(costs, devices, options) of a small random planning problem: 2-4 GPUs of
    types A / B, 2-6 blocks; the same seed gives the same instance.

    Default: the family of tests/test_solver.py and test_sim.py (the latter with
    ``time_limit_s=5.0``): type B 1.5-4x slower than A, GPUs on nodes n0 / n1
    with 4-16 GiB, a fixed per-micro-batch cost on odd seeds.
    ``singleton_classes``: the family of tests/test_grouped.py: ``random_costs``,
    every GPU on its own node or on n0, and distinct memory sizes, so no two
    GPUs are interchangeable (every GPU class has one GPU)."""
    rng = random.Random(seed)
    n_g, nb = rng.randint(2, 4), rng.randint(2, 6)
    if singleton_classes:
        costs = random_costs(rng, nb, "AB", fixed=seed % 2 == 1)
    else:
        slow = rng.choice([1.5, 2.0, 3.0, 4.0])
        base = [rng.uniform(4e-3, 20e-3) for _ in range(nb)]
        costs = BlockCosts(
            fwd_bwd_s_per_sample={"A": tuple(base), "B": tuple(t * slow * rng.uniform(0.8, 1.2) for t in base)},
            param_count=tuple(rng.randint(20, 200) * 1_000_000 for _ in range(nb)),
            act_bytes_per_sample=tuple(rng.randint(20, 600) * 1_000_000 for _ in range(nb)),
            cut_bytes_per_sample=(0, *(rng.randint(1, 200) * 1_000_000 for _ in range(nb - 1)), 0),
            # Half the seeds have a fixed per-micro-batch cost (kernel launches).
            fwd_bwd_s_fixed=({"A": tuple(rng.uniform(0, 5e-3) for _ in range(nb)),
                              "B": tuple(rng.uniform(0, 8e-3) for _ in range(nb))} if seed % 2 else {}),
        )
    types = [rng.choice("AB") for _ in range(n_g)]
    if singleton_classes:
        nodes = [f"n{g}" if rng.random() < 0.5 else "n0" for g in range(n_g)]
        memory = [(4 + 2 * g) * GIB for g in range(n_g)]  # distinct: no two GPUs interchangeable
    else:
        nodes = [rng.choice(["n0", "n1"]) for _ in range(n_g)]
        memory = [rng.choice([4, 6, 8, 12, 16]) * GIB for _ in range(n_g)]
    mem_bw = [rng.choice([900e9, 1.2e12]) if t == "A" else 300e9 for t in types]
    odd = {(a, b): (rng.choice([2e9, 25e9, 50e9]), rng.choice([1e-6, 5e-5]))
           for a in range(n_g) for b in range(a + 1, n_g) if rng.random() < 0.2}
    options = SolverOptions(global_batch_size=rng.randint(2, 6), max_stages=rng.randint(1, 3),
                            schedule=rng.choice(["1f1b", "gpipe"]), time_limit_s=time_limit_s,
                            num_workers=2, seed=seed, allow_idle_gpus=rng.random() < 0.8)
    return costs, make_devices(types, nodes, memory, mem_bw, odd_links=odd), options


def reference_or_same_error(reference, solve, costs, devices, options):
    """``reference(costs, devices, options)``; where that raises InfeasiblePlanError,
    assert that ``solve`` raises one with the same message and return None."""
    try:
        return reference(costs, devices, options)
    except InfeasiblePlanError as exc:
        with pytest.raises(InfeasiblePlanError) as got:
            solve(costs, devices, options)
        assert str(got.value) == str(exc)
        return None


def reference_adamw(captured, tokens, plan, steps, *, lr, weight_decay):
    """Single-process AdamW on the whole global batch, as train.py configures it
    (betas, eps: OptimizerConfig defaults; ``lr``, ``weight_decay`` as given).
    Returns per-step losses, step-1 gradients and the final parameters, by
    canonical name: the reference the distributed runs must equal."""
    from zorse_fx.capture.trace import _fetch_attr
    from zorse_fx.runtime.worker import OptimizerConfig

    gm = captured.graph_module
    params = {c: _fetch_attr(gm, c) for c in sorted(captured.trainable())}
    cfg = OptimizerConfig()
    opt = torch.optim.AdamW(list(params.values()), lr=lr, betas=cfg.betas, eps=cfg.eps, weight_decay=weight_decay)
    losses, grads1 = [], None
    for step in range(steps):
        batch = global_batch(tokens, step, global_batch_size=plan.global_batch_size, seq_len=plan.seq_len,
                             input_names=plan.input_names, label_mode=plan.label_mode)
        opt.zero_grad(set_to_none=True)
        loss = gm(*[batch[n] for n in captured.input_names])
        loss.backward()
        losses.append(float(loss.detach()))
        if step == 0:
            grads1 = {c: p.grad.detach().clone() for c, p in params.items()}
        opt.step()
    return losses, grads1, {c: p.detach().clone() for c, p in params.items()}


def assert_params_match(params_by_rank, ref_params, initial, steps, lr):
    """Parameters after ``steps`` AdamW steps on every rank ({rank: {name: tensor}})
    equal single-process training's ``ref_params``; each moved from ``initial``
    (else a lost update would go unseen); every rank holding a parameter (DP
    replicas, tied copies in two stages) has the same values."""
    seen: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for rank, params in params_by_rank.items():
        for name, value in params.items():
            ref = ref_params[name]
            assert (ref - initial[name]).abs().max() > 1e-4, (
                f"{name} barely moved: the test would not see a lost update")
            torch.testing.assert_close(value, ref, rtol=1e-4, atol=1e-6 * ref.abs().max().item() + 5e-2 * lr,
                                       msg=lambda m: f"rank {rank} param {name} after {steps} steps: {m}")
            seen.setdefault(name, []).append((rank, value))
    assert set(seen) == set(ref_params)
    for name, copies in seen.items():
        for rank, value in copies[1:]:
            torch.testing.assert_close(value, copies[0][1], rtol=1e-6, atol=1e-9,
                                       msg=lambda m: f"{name}: rank {rank} vs rank {copies[0][0]}: {m}")


def assert_grads_match(grads_by_rank, ref_grads):
    """Every rank's gradients ({rank: {name: tensor}}) equal single-process
    ``ref_grads`` (atol 1e-6 + 1e-4 x the largest reference entry), and every
    parameter has a gradient on some rank."""
    seen = set()
    for rank, g in grads_by_rank.items():
        for name, value in g.items():
            ref = ref_grads[name]
            tol = 1e-6 + 1e-4 * ref.abs().max().item()
            torch.testing.assert_close(value, ref, atol=tol, rtol=0, msg=lambda m: f"rank {rank} grad {name}: {m}")
            seen.add(name)
    assert seen == set(ref_grads), f"parameters without a gradient: {set(ref_grads) - seen}"


def train_and_compare(plan, captured, tokens, tmp_path: Path, *, steps: int, lr: float, weight_decay: float):
    """Run ``plan`` with torchrun for ``steps`` AdamW steps and compare with
    single-process training (``reference_adamw``): the step numbers and losses
    (rel 1e-5), each rank's logged stages and all-gather time, its step-1
    gradients (``assert_grads_match``) and its final parameters
    (``assert_params_match``).
    Returns {rank: optimizer-state summary} (the ranks' ``--dump-params`` JSON)."""
    initial = {k: v.clone() for k, v in captured.state().items()}
    rows, grads = run_distributed(plan, captured.state(), tokens, tmp_path, steps=steps,
                                  extra=("--dump-params", "--lr", str(lr), "--weight-decay", str(weight_decay)))
    ref_losses, ref_grads, ref_params = reference_adamw(captured, tokens, plan, steps, lr=lr,
                                                          weight_decay=weight_decay)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)
    for r in rows:
        assert [part["stages"] for part in r["ranks"]] == [list(plan.stages_of(k)) for k in range(plan.world_size)]
        assert all("allgather_s" in part for part in r["ranks"])
    assert_grads_match(grads, ref_grads)
    out = tmp_path / "run" / "params"
    assert_params_match({r: torch.load(out / f"rank{r}.pt") for r in range(plan.world_size)}, ref_params, initial,
                        steps, lr)
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(plan.world_size)}


def compute_only(costs, devices):
    """The same instance without boundary bytes, link latency and parameters:
    only the F/B compute of the pipeline is left."""
    nb, g = costs.num_blocks, devices.num_gpus
    return (dataclasses.replace(costs, cut_bytes_per_sample=(0,) * (nb + 1), param_count=(0,) * nb),
            dataclasses.replace(devices, link_latency_s=((0.0,) * g,) * g))
