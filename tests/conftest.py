"""Shared fixtures: small real models, real text, a torchrun launcher, and the
random planning instances of the planner / simulator tests."""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path

import pytest
import torch

from zorse_fx.data import global_batch, read_corpus, tokenize
from zorse_fx.errors import InfeasiblePlanError
from zorse_fx.options import PlanOptions
from zorse_fx.solve import BlockCosts, DeviceGraph

ROOT = Path(__file__).resolve().parents[1]
CLUSTERS = ROOT / "examples" / "clusters"
GIB = 1 << 30

# One CP-SAT solve at a time per planning call: the suite's workers already fill the cores
# (the plans do not depend on it: [Note: candidate waves] in zorse_fx/solve/_search.py;
# tests/test_candidate_search.py passes jobs explicitly).
os.environ.setdefault("ZORSE_JOBS", "1")


# [Note: long test files first]
# pytest-xdist hands tests to its workers in collection order, so a long file collected last can
# run alone on one worker while the other has finished: the suite's wall time is its makespan.
# The files whose tests take longest in all (`make test`'s --durations summed per file,
# 2026-12-06: 40-90 s each, multi-process launches mostly) are collected first, longest first, the
# others after them in their usual order (each file stays whole: module fixtures are set up once).
_LONG_FILES_FIRST = ("test_job_control.py", "test_readme_commands.py", "test_multinode.py", "test_solver.py",
                     "test_grouped.py", "test_runtime_memory.py", "test_elastic.py", "test_training_loop.py",
                     "test_error_lines.py", "test_baselines.py", "test_mixed_precision.py", "test_memory_flags.py",
                     "test_box.py", "test_capture_cache.py", "test_stage_dp.py", "test_offload.py", "test_sim.py",
                     "test_gpu_check.py")


def pytest_collection_modifyitems(config, items):
    first = {name: k for k, name in enumerate(_LONG_FILES_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # (stable: the rest keep their order)


@pytest.fixture(scope="session", autouse=True)
def _subprocess_tmpdir(tmp_path_factory):
    """Processes the tests start (torchrun and its ranks) make their temporary
    files (torchrun's ``torchelastic_*`` log directories) under this session's
    pytest directory, which pytest removes with its old runs, instead of /tmp."""
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))
    yield
    if old is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old


@pytest.fixture(scope="session")
def lee_bytes() -> torch.Tensor:
    """Real English text (gensim's Lee news corpus) as byte tokens."""
    return tokenize(read_corpus("lee"))


_CAPTURED: dict[str, object] = {}


def cached_capture(key: str, build):
    """``build()`` (a function returning a CapturedModel) run once per test
    session for ``key``; every call returns a deep copy, so a test may train
    or annotate its model without touching another's. torch.export of a small
    HF model takes seconds here, and several test files capture the same one."""
    import copy

    if key not in _CAPTURED:
        _CAPTURED[key] = build()
    return copy.deepcopy(_CAPTURED[key])


# -- small captured models and hand-made plans (the runtime, plan and simulator tests) --

def small_gpt(n_layer: int = 2, seq: int = 16):
    """A captured GPT of ``n_layer`` layers, 32 wide (``GPTConfig``'s 4 heads),
    ``seq`` tokens: seed 0, example input ids (2 x ``seq``) drawn before the
    weights. Captured anew on every call (not cached)."""
    from zorse_fx.capture import capture
    from zorse_fx.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, seq))
    return capture(GPT(GPTConfig(n_layer=n_layer, n_embd=32, block_size=seq)), (ids, ids))


def gpt3x64():
    """The GPT of the distributed tests: 3 layers, 64 wide, 4 heads, 32 tokens,
    seed 0 (weights drawn before the example ids); captured once per session
    (``cached_capture``, key "gpt3x64")."""
    from zorse_fx.capture import capture
    from zorse_fx.models.gpt import GPT, GPTConfig

    def build():
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=3, n_embd=64, n_head=4, block_size=32))
        ids = torch.randint(0, 256, (4, 32))
        return capture(model, (ids, ids))

    return cached_capture("gpt3x64", build)


def gpt4x64():
    """The GPT of the interleaved tests: 4 layers (enough blocks for 4 stages),
    64 wide, 4 heads, 32 tokens, seed 0 (weights drawn before the example ids).
    Captured anew on every call (not cached)."""
    from zorse_fx.capture import capture
    from zorse_fx.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=64, n_head=4, block_size=32))
    ids = torch.randint(0, 256, (4, 32))
    return capture(model, (ids, ids))


def tiny_llama_config():
    """The configuration of ``tiny_llama_tied``'s model."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                       tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def tiny_llama_tied():
    """A 2-layer HF Llama with tied input/output embeddings (vocabulary 256,
    32 tokens, seed 0; ``tiny_llama_config``), captured with torch.export once per session
    (``cached_capture``); its plans use ``label_mode="same"``."""
    from transformers import LlamaForCausalLM

    from zorse_fx.capture import capture
    from zorse_fx.models.hf import CausalLMWithLoss

    def build():
        torch.manual_seed(0)
        cfg = tiny_llama_config()
        ids = torch.randint(0, 256, (4, 32))
        return capture(CausalLMWithLoss(LlamaForCausalLM(cfg)), (ids, ids))

    return cached_capture("tiny_llama_tied", build)


def fixed_decision(captured, stage_gpus, samples, *, num_microbatches: int, cuts=None, interleave: int = 1):
    """The ``Decision`` of ``fixed_plan`` (arguments as there), for a test that
    prices or simulates it itself."""
    from zorse_fx.capture import analyse
    from zorse_fx.solve import Decision

    nb = analyse(captured).num_blocks
    ns = len(stage_gpus)
    if cuts is None:
        bounds = [round(i * nb / ns) for i in range(ns + 1)]
    else:
        assert len(cuts) == ns - 1, f"{ns} stages need {ns - 1} cuts, got {cuts}"
        bounds = [0, *cuts, nb]
    return Decision(stage_blocks=tuple(zip(bounds, bounds[1:])), stage_gpus=stage_gpus,
                    samples_per_microbatch=samples, num_microbatches=num_microbatches, interleave=interleave)


def fixed_plan(captured, stage_gpus, samples, *, num_microbatches: int, global_batch_size: int, cuts=None,
               interleave: int = 1, schedule: str = "1f1b", bucket_mib: float = 25.0,
               cluster: str | Path = "small_hetero.yaml", label_mode: str | None = None, precision: str = "auto"):
    """A ``planner.plan_fixed`` Plan of ``captured`` for a decision made by hand:
    stage s on the GPUs ``stage_gpus[s]``, which take ``samples[s]`` samples of
    each of the ``num_microbatches`` micro-batches; ``interleave`` v > 1: the S
    stages run on S / v GPU groups, stage s on group s mod (S / v), and
    ``stage_gpus`` / ``samples`` list every stage, as ``Decision`` does.

    Stage blocks: ``cuts`` None cuts the model's ``nb`` blocks (``capture.analyse``)
    evenly, stage s = blocks ``[round(s * nb / S), round((s + 1) * nb / S))`` of
    S stages; else ``cuts`` are the S - 1 explicit stage boundaries, the blocks
    where stages 1..S-1 begin (stage 0 begins at block 0, the last stage ends
    at block nb).

    Options: ``PlanOptions(global_batch_size, schedule, bucket_mib, precision)``, every
    other field its default; ``cluster``: a file of examples/clusters (or a
    path); ``label_mode``: None = ``plan_fixed``'s default ("shifted"), "same"
    for HF models that shift labels themselves. Memory policy (sharding,
    recomputation): none; tests add it with ``with_memory_policy``."""
    from zorse_fx.cluster import Cluster
    from zorse_fx.planner import plan_fixed

    decision = fixed_decision(captured, stage_gpus, samples, num_microbatches=num_microbatches, cuts=cuts,
                              interleave=interleave)
    options = PlanOptions(global_batch_size=global_batch_size, schedule=schedule, bucket_mib=bucket_mib,
                          precision=precision)
    kw = {} if label_mode is None else {"label_mode": label_mode}
    plan, _ = plan_fixed(captured, Cluster.from_yaml(CLUSTERS / cluster), options, decision, **kw)
    return plan


def first_batch(tokens, plan):
    return global_batch(tokens, 0, global_batch_size=plan.global_batch_size, seq_len=plan.seq_len,
                        input_names=plan.input_names, label_mode=plan.label_mode)


@dataclasses.dataclass(frozen=True)
class Tolerances:
    """How close a distributed run must be to single-process training under
    the same precision policy (see test_distributed.py / test_mixed_precision.py
    for where the numbers come from)."""

    #: Relative tolerance of every step's loss.
    loss_rel: float
    #: Gradient tolerance, as a fraction of the largest reference entry (+ 1e-6).
    grad_rel_to_max: float
    #: Parameters after several AdamW steps: (rtol, atol in units of lr).
    param_rtol: float
    param_atol_lr: float
    #: Mixed precision: instead of an elementwise bound, at most this fraction
    #: of a parameter's elements may differ by more than ``param_atol_lr * lr``
    #: (see test_mixed_precision.py); None = elementwise.
    param_outlier_fraction: float | None = None


#: fp32: rounding of sums in another order only.
FP32 = Tolerances(loss_rel=1e-5, grad_rel_to_max=1e-4, param_rtol=1e-4, param_atol_lr=5e-2)
#: bf16-mixed: micro-batches round their 16-bit matmul gradients separately
#: (bfloat16 has 8 bits of mantissa: 2**-8 = 0.39% per rounding).
BF16 = Tolerances(loss_rel=1e-4, grad_rel_to_max=1e-2, param_rtol=0.0, param_atol_lr=0.5, param_outlier_fraction=0.05)
#: fp16-mixed: 11 bits of mantissa (2**-11 = 0.05%).
FP16 = Tolerances(loss_rel=1e-4, grad_rel_to_max=2e-3, param_rtol=0.0, param_atol_lr=0.5, param_outlier_fraction=0.05)
TOLERANCES = {None: FP32, "fp32": FP32, "bf16-mixed": BF16, "fp16-mixed": FP16}


def _autocast(precision):
    from zorse_fx.precision import precision_policy

    return precision_policy(precision or "fp32").autocast("cpu")


class _WireRound(torch.autograd.Function):
    """A stage boundary under a mixed policy: the value rounded to the wire
    dtype and back, and its gradient likewise ([Note: 16-bit boundary tensors]
    in ``zorse_fx/precision.py``)."""

    @staticmethod
    def forward(x, dtype):
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.wire).to(g.dtype), None

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.wire = inputs[1]


def with_plan_cuts(captured, plan, precision: str | None):
    """The captured graph as a callable that rounds every tensor crossing one
    of ``plan``'s stage boundaries to its wire dtype under ``precision`` (and
    its gradient on the way back), for the consumers in later stages only:
    single-process training under the policy the ranks train with. Without a
    mixed policy the captured graph module itself."""
    from zorse_fx.capture import analyse
    from zorse_fx.precision import precision_policy

    policy = precision_policy(precision or "fp32")
    gm = captured.graph_module
    if not policy.mixed or plan.num_stages == 1:
        return gm
    bg = analyse(captured)
    stage_of = {n: s for s, st in enumerate(plan.stages) for n in bg.stage_nodes(*st.blocks)}

    class Rounding(torch.fx.Interpreter):
        def run_node(self, n):
            t = stage_of.get(n.name)
            swapped = {}
            for a in n.all_input_nodes if t is not None else ():
                v = self.env[a]
                if stage_of.get(a.name, t) < t and isinstance(v, torch.Tensor) and v.is_floating_point():
                    dtype = getattr(torch, policy.wire_dtype_name(str(v.dtype).removeprefix("torch.")))
                    swapped[a] = v
                    self.env[a] = _WireRound.apply(v, dtype)
            try:
                return super().run_node(n)
            finally:
                self.env.update(swapped)

    return lambda *inputs: Rounding(gm).run(*inputs)


def reference_step(captured, batch: dict[str, torch.Tensor], precision: str | None = None):
    """Single-process loss and gradients (by canonical name) on the whole
    global batch; ``precision`` "bf16-mixed"/"fp16-mixed": the forward under
    that autocast, as eager AMP trains (fp16: gradients of the scaled loss,
    unscaled, as ``torch.amp.GradScaler`` computes them)."""
    from zorse_fx.capture.trace import fetch_attr

    gm = captured.graph_module
    gm.zero_grad(set_to_none=True)
    with _autocast(precision):
        loss = gm(*[batch[n] for n in captured.input_names])
    scale = 2.0**16 if precision == "fp16-mixed" else 1.0
    (loss.float() * scale).backward()
    if scale != 1.0:
        for canon in captured.trainable():
            fetch_attr(gm, canon).grad.div_(scale)
    grads = {}
    for canon in captured.trainable():
        grads[canon] = fetch_attr(gm, canon).grad.detach().clone()
    gm.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def _rank_main(env: dict[str, str], argv: list[str], log: str) -> None:
    """One rank, in a process forked from the launcher's fork server: the
    environment torchrun gives its workers, stdout and stderr to ``log``."""
    import os
    import sys

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    from zorse_fx.train import main

    sys.exit(main(argv))


_LAUNCHER = None


def _launcher():
    """A multiprocessing context whose fork server has imported
    ``zorse_fx.train`` (torch, the runtime) once for the whole session: a rank
    starts in milliseconds instead of re-importing torch (about 6 s of CPU per
    rank on the 2-core test machine, most of a small test's launch)."""
    global _LAUNCHER
    if _LAUNCHER is None:
        import multiprocessing

        _LAUNCHER = multiprocessing.get_context("forkserver")
        # torch._dynamo (imported by torch.optim's constructor) and torch._refs
        # (by Module.to_empty) are imported lazily, another ~2.7 s per rank.
        _LAUNCHER.set_forkserver_preload(["zorse_fx.train", "torch._dynamo", "torch._refs", "conftest"])
    return _LAUNCHER


def spawn_ranks(plan_dir: Path, world: int, train_args: list[str], *, timeout_s: float = 300) -> list[str]:
    """Run ``zorse_fx.train.main`` once per rank, each in its own process, with
    the environment torchrun gives its workers (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` for the ``env://``
    rendezvous, whose store this process serves on a port the kernel chose).
    The processes are forked from a fork server that imported the runtime
    once (``_launcher``) instead of started by torchrun's agent; ``zorse
    train`` (tests/test_api.py) covers torchrun itself.
    Returns every rank's output (stdout and stderr), by rank. Raises
    AssertionError with every rank's output if one fails or runs past
    ``timeout_s``."""
    import tempfile

    from torch.distributed import TCPStore

    # The rendezvous store is served from this process, as torchrun's agent
    # serves it (TORCHELASTIC_USE_AGENT_STORE: every rank connects as a
    # client). Its port is bound once, by the kernel (port 0), and held until
    # the ranks are done: no other process (a second pytest-xdist worker, say)
    # can take it between choosing it and rank 0 listening on it.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True",
               WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    ctx = _launcher()
    with tempfile.TemporaryDirectory(prefix="zorse-ranks-") as logs:
        log = [f"{logs}/rank{r}.log" for r in range(world)]
        procs = [ctx.Process(target=_rank_main, args=({**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                                      [str(plan_dir), *train_args], log[r]))
                 for r in range(world)]
        for p in procs:
            p.start()
        failed = False
        for p in procs:
            p.join(timeout_s)
            if p.exitcode is None:  # still running: kill every rank
                for q in procs:
                    q.kill()
                    q.join()
                failed = True
                break
        failed |= any(p.exitcode != 0 for p in procs)
        outputs = [Path(f).read_text(errors="replace") if Path(f).exists() else "" for f in log]
    del store  # the last reference: the server stops and its port is freed
    if failed:
        raise AssertionError("a rank failed:\n" + "\n".join(
            f"--- rank {r} (exit code {p.exitcode}) ---\n{o[-4000:]}" for r, (p, o) in enumerate(zip(procs, outputs))))
    print(outputs[0])
    return outputs


def run_distributed(compiled_or_plan, weights, tokens, tmp_path: Path, *, steps: int = 1, extra=()):
    """Export, start one process per rank (``spawn_ranks``), return (metrics
    rows, {rank: grads})."""
    plan = compiled_or_plan
    plan_dir = tmp_path / "plan"
    plan.export(plan_dir)
    torch.save(weights, plan_dir / "weights.pt")
    torch.save(tokens, tmp_path / "tokens.pt")
    spawn_ranks(plan_dir, plan.world_size,
                ["--tokens", str(tmp_path / "tokens.pt"), "--steps", str(steps), "--out", str(tmp_path / "run"),
                 "--dump-grads", "1", *extra])
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    grads = {r: torch.load(tmp_path / "run" / "grads" / f"rank{r}.pt") for r in range(plan.world_size)}
    # ZeRO-2 stages: each rank holds its owned ranges of those gradients; joined whole, on the lowest owner.
    pieces = {r: torch.load(tmp_path / "run" / "grads" / f"rank{r}_pieces.pt") for r in range(plan.world_size)}
    for canon in sorted({c for ps in pieces.values() for c in ps}):
        n = max(b for ps in pieces.values() for a, b, _ in ps.get(canon, ()))
        flat = torch.full((n,), float("nan"))
        for ps in pieces.values():
            for a, b, t in ps.get(canon, ()):
                assert flat[a:b].isnan().all(), f"two ranks hold elements [{a}, {b}) of the gradient of {canon!r}"
                flat[a:b] = t
        assert not flat.isnan().any(), f"the ranks' gradient shards of {canon!r} do not cover it"
        owner = min(r for r, ps in pieces.items() if canon in ps)
        assert all(canon not in g for g in grads.values()), f"{canon!r}: a whole gradient beside its shards"
        grads[owner][canon] = flat.view(weights[canon].shape)
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


def with_grad_sharding(plan, stages=None):
    """``plan`` with sharded gradients (ZeRO-2, ``StagePlan.grad_sharded``) on
    ``stages`` (indices; default every sharded stage of two or more GPUs)."""
    chosen = {s.index for s in plan.stages if s.sharded and len(s.gpus) > 1} if stages is None else set(stages)
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, grad_sharded=s.index in chosen)
                                                  for s in plan.stages))


def with_param_sharding(plan, stages=None):
    """``plan`` with sharded parameters (ZeRO-3, ``StagePlan.param_sharded``,
    with ZeRO-2 under it) on ``stages`` (default every sharded stage of two or
    more GPUs)."""
    chosen = {s.index for s in plan.stages if s.sharded and len(s.gpus) > 1} if stages is None else set(stages)
    plan = with_grad_sharding(plan, chosen)
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, param_sharded=s.index in chosen)
                                                  for s in plan.stages))


def with_low_precision(plan, captured):
    """``plan`` with 16-bit working weights on every sharded stage of two or
    more GPUs (``StagePlan.low_precision_params``: the stage's parameters
    ``capture.low_precision_params`` finds), as ``build_plan`` sets them for
    a mixed plan; the other stages unchanged."""
    from zorse_fx.capture import analyse, low_precision_params

    eligible = low_precision_params(analyse(captured))
    stages = [dataclasses.replace(s, low_precision_params=tuple(f for f, c in s.params.items() if c in eligible))
              if s.sharded and len(s.gpus) > 1 else s for s in plan.stages]
    return dataclasses.replace(plan, stages=tuple(stages))


# -- random planning instances (tests/test_solver.py, test_grouped.py, test_sim.py) --

#: The solver tests' wall-clock safety stop per CP-SAT solve (s): far above anything a
#: loaded 2-core machine needs (the slowest solve seen, a presolve of test_solver.py's
#: memory-policy instance 1, 80 s with four busy loops), so a test's outcome depends
#: on the deterministic budget alone ([Note: safety stop] in zorse_fx/solve/_search.py).
TEST_TIME_LIMIT_S = 3600.0


def solver_options(**fields) -> PlanOptions:
    """``PlanOptions`` for the solver tests: ``sharding``, ``recompute`` and
    ``grad_sharding``, ``param_sharding`` and ``offload`` default to "never" (the models without the memory-policy
    variables, so the solves stay small and the expected results stay those of
    the plain model; ZeRO-2 is not in the CP-SAT model, so a CP-SAT optimum is
    the oracle's without it); a test that wants them passes "auto" / "always".
    The wall-clock safety stop is ``TEST_TIME_LIMIT_S`` unless given."""
    return PlanOptions(**{"sharding": "never", "recompute": "never", "grad_sharding": "never", "param_sharding": "never",
                          "offload": "never", "time_limit_s": TEST_TIME_LIMIT_S, **fields})


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


def random_instance(seed, *, singleton_classes=False):
    """(costs, devices, options) of a small random planning problem: 2-4 GPUs of
    types A / B, 2-6 blocks; the same seed gives the same instance. CP-SAT gets
    the default deterministic budget and the tests' wall-clock safety stop
    ``TEST_TIME_LIMIT_S`` ([Note: reproducible plans] in zorse_fx/solve/_search.py).

    Default: the family of tests/test_solver.py and test_sim.py: type B 1.5-4x slower than A, GPUs on nodes n0 / n1
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
    options = solver_options(global_batch_size=rng.randint(2, 6), max_stages=rng.randint(1, 3),
                            schedule=rng.choice(["1f1b", "gpipe"]),
                            seed=seed, allow_idle_gpus=rng.random() < 0.8)
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


def assert_candidates_agree(res, ref):
    """Every (S, M) candidate CP-SAT (``res``) solved has the optimum ``ref`` (brute
    force, or a CP-SAT run of the same model) found for it; one it proved could
    not beat its bar (NO_BETTER, PRUNED: [Note: incumbent cutoff] in
    solve/_search.py) has no ``ref`` plan below that bar's bound; an INFEASIBLE
    one has none. (S, M) pairs ``ref`` itself did not solve are not compared."""
    from zorse_fx.solve.objective import UNITS_PER_S

    brute = {(b["num_stages"], b["num_microbatches"]): b["step_time_s"] for b in candidate_dicts(ref)
             if b.get("status") not in ("NO_BETTER", "PRUNED")}
    solved = 0
    for a in candidate_dicts(res):
        key = (a["num_stages"], a["num_microbatches"])
        if key not in brute:
            continue
        want = brute[key]
        if a["status"] == "OPTIMAL":
            assert want is not None and round(a["step_time_s"] * UNITS_PER_S) == round(want * UNITS_PER_S), a
            solved += 1
        elif a["status"] in ("NO_BETTER", "PRUNED"):
            assert want is None or round(want * UNITS_PER_S) >= round(a["best_bound_s"] * UNITS_PER_S), (a, want)
        else:
            assert a["status"] == "INFEASIBLE" and want is None, (a, want)
    assert solved >= 1


def assert_cpsat_equals_brute_force(costs, devices, options, *, optimal: bool = True):
    """CP-SAT's optimum is brute force's and both equal ``evaluate`` to the ns:
    ``solve_cpsat``'s answer (status OPTIMAL where ``optimal``) is feasible under
    ``evaluate_result`` with ``objective_units`` equal to both solvers' objectives.
    Where brute force finds no plan, CP-SAT must raise the same error (returns
    None). Returns ``(ref, res, ev)``: brute force's result, CP-SAT's, and the
    evaluation of CP-SAT's."""
    from zorse_fx.solve import solve_brute_force, solve_cpsat
    from zorse_fx.solve.objective import UNITS_PER_S, evaluate_result

    ref = reference_or_same_error(solve_brute_force, solve_cpsat, costs, devices, options)
    if ref is None:
        return None
    res = solve_cpsat(costs, devices, options)
    if optimal:
        assert res.status == "OPTIMAL"
    ev = evaluate_result(costs, devices, options, res)
    assert ev.feasible, ev.violations
    assert ev.objective_units == round(res.objective * UNITS_PER_S) == round(ref.objective * UNITS_PER_S)
    return ref, res, ev


def assert_grouped_within_cpsat_gap(costs, devices, options):
    """The class-level model (``solve_grouped``) on an instance with idle GPUs
    allowed or classes of several GPUs: ``evaluate`` of its decision equals its
    objective to the ns, and it is no better than CP-SAT's proven bound (CP-SAT's
    objective less its optimality gap, 1 ns of rounding). Returns ``(ref, res)``."""
    from zorse_fx.solve import evaluate, solve_cpsat, solve_grouped
    from zorse_fx.solve.objective import UNITS_PER_S

    ref = solve_cpsat(costs, devices, options)
    res = solve_grouped(costs, devices, options)
    ev = evaluate(costs, devices, options, res.decision)
    assert ev.objective_units == round(res.objective * UNITS_PER_S)
    assert round(res.objective * UNITS_PER_S) >= round(ref.objective * UNITS_PER_S) - round(
        ref.optimality_gap * ref.objective * UNITS_PER_S) - 1
    return ref, res


def reference_adamw(captured, tokens, plan, steps, *, lr, weight_decay, precision=None, inject_inf_step=None,
                    lr_at=None, clip=None, norms=None):
    """Single-process AdamW on the whole global batch, as train.py configures it
    (betas, eps: OptimizerConfig defaults; ``lr``, ``weight_decay`` as given,
    weight decay on matrices only, as nanoGPT's ``configure_optimizers``;
    ``lr_at(step)``: the rate of step 1.., else ``lr``; ``clip``:
    ``torch.nn.utils.clip_grad_norm_`` to it; ``norms``: a list that receives
    each step's total gradient norm before clipping).
    ``precision``: forward under that policy's autocast, with the rounding of
    the tensors crossing ``plan``'s stage boundaries (``with_plan_cuts``); fp16-mixed through
    ``torch.amp.GradScaler`` (the semantics the runtime's scaler follows);
    ``inject_inf_step``: write an inf into a gradient before that step's
    (1-based) ``scaler.step``, which must then skip it.
    Returns per-step losses, step-1 gradients (unscaled) and the final
    parameters, by canonical name: the reference the distributed runs must equal."""
    from zorse_fx.capture.trace import fetch_attr
    from zorse_fx.runtime.worker import OptimizerConfig

    gm = captured.graph_module
    params = {c: fetch_attr(gm, c) for c in sorted(captured.trainable())}
    cfg = OptimizerConfig()
    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=cfg.betas, eps=cfg.eps)
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16-mixed" else None
    model = with_plan_cuts(captured, plan, precision)
    losses, grads1 = [], None
    for step in range(steps):
        batch = global_batch(tokens, step, global_batch_size=plan.global_batch_size, seq_len=plan.seq_len,
                             input_names=plan.input_names, label_mode=plan.label_mode)
        opt.zero_grad(set_to_none=True)
        with _autocast(precision):
            loss = model(*[batch[n] for n in captured.input_names])
        (scaler.scale(loss.float()) if scaler else loss.float()).backward()
        losses.append(float(loss.detach()))
        if step + 1 == inject_inf_step:
            next(iter(params.values())).grad.view(-1)[0] = float("inf")
        if scaler:
            scaler.unscale_(opt)
        if norms is not None or clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(list(params.values()), clip if clip is not None else float("inf"))
            if norms is not None:
                norms.append(float(norm))
        if step == 0:  # the gradients the optimizer uses (clipped), as the ranks dump them
            grads1 = {c: p.grad.detach().clone() for c, p in params.items()}
        if lr_at is not None:
            for g in opt.param_groups:
                g["lr"] = lr_at(step + 1)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return losses, grads1, {c: p.detach().clone() for c, p in params.items()}


def assert_params_match(params_by_rank, ref_params, initial, steps, lr, tol: Tolerances = FP32, ref_grads=None):
    """Parameters after ``steps`` AdamW steps on every rank ({rank: {name: tensor}})
    equal single-process training's ``ref_params`` (``tol``); each moved from
    ``initial`` (else a lost update would go unseen); every rank holding a
    parameter (DP replicas, tied copies in two stages) has the same values.

    Mixed precision (``tol.param_outlier_fraction``): elements whose step-1
    reference gradient (``ref_grads``) is not zero but below twice the
    gradient tolerance are rounding noise in both runs, and Adam follows their
    sign, so they are left out; of the others at most that fraction may be
    off by more than ``param_atol_lr * lr``."""
    seen: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for rank, params in params_by_rank.items():
        for name, value in params.items():
            ref = ref_params[name]
            assert (ref - initial[name]).abs().max() > 1e-4, (
                f"{name} barely moved: the test would not see a lost update")
            atol = 1e-6 * ref.abs().max().item() + tol.param_atol_lr * lr
            if tol.param_outlier_fraction is None:
                torch.testing.assert_close(value, ref, rtol=tol.param_rtol, atol=atol,
                                           msg=lambda m: f"rank {rank} param {name} after {steps} steps: {m}")
            else:
                g = ref_grads[name].abs()
                kept = (g == 0) | (g > 2 * tol.grad_rel_to_max * g.max())  # zero: weight decay only, exact
                off = ((value - ref).abs() > atol)[kept].float().mean().item()
                assert off <= tol.param_outlier_fraction, (
                    f"rank {rank} param {name} after {steps} steps: {off:.1%} of its elements differ from "
                    f"single-process training by more than {atol:.2e} (allowed {tol.param_outlier_fraction:.0%})")
            seen.setdefault(name, []).append((rank, value))
    assert set(seen) == set(ref_params)
    for name, copies in seen.items():
        for rank, value in copies[1:]:
            torch.testing.assert_close(value, copies[0][1], rtol=1e-6, atol=1e-9,
                                       msg=lambda m: f"{name}: rank {rank} vs rank {copies[0][0]}: {m}")


def assert_grads_match(grads_by_rank, ref_grads, tol: Tolerances = FP32):
    """Every rank's gradients ({rank: {name: tensor}}) equal single-process
    ``ref_grads`` (atol 1e-6 + ``tol.grad_rel_to_max`` x the largest reference
    entry), and every parameter has a gradient on some rank."""
    seen = set()
    for rank, g in grads_by_rank.items():
        for name, value in g.items():
            ref = ref_grads[name]
            tol_abs = 1e-6 + tol.grad_rel_to_max * ref.abs().max().item()
            torch.testing.assert_close(value, ref, atol=tol_abs, rtol=0, msg=lambda m: f"rank {rank} grad {name}: {m}")
            seen.add(name)
    assert seen == set(ref_grads), f"parameters without a gradient: {set(ref_grads) - seen}"


def train_and_compare(plan, captured, tokens, tmp_path: Path, *, steps: int, lr: float, weight_decay: float,
                      precision: str | None = None, extra=(), inject_inf=None, ref_kwargs=None):
    """Run ``plan`` with torchrun for ``steps`` AdamW steps and compare with
    single-process training under the same precision policy
    (``reference_adamw``): the step numbers and losses, each rank's logged
    stages and all-gather time, its step-1 gradients (``assert_grads_match``)
    and its final parameters (``assert_params_match``), with the policy's
    ``TOLERANCES``. ``inject_inf`` = (rank, step): that rank writes an inf
    into a gradient at that step; the reference does the same.
    ``ref_kwargs``: more ``reference_adamw`` options (schedule, clipping).
    Returns ({rank: optimizer-state summary} (the ranks' ``--dump-params``
    JSON), the metrics rows)."""
    tol = TOLERANCES[precision]
    initial = {k: v.clone() for k, v in captured.state().items()}
    args = ["--dump-params", "--lr", str(lr), "--weight-decay", str(weight_decay), *extra]
    if precision:
        args += ["--precision", precision]
    if inject_inf:
        args += ["--inject-inf", f"{inject_inf[0]}:{inject_inf[1]}"]
    rows, grads = run_distributed(plan, captured.state(), tokens, tmp_path, steps=steps, extra=tuple(args))
    ref_losses, ref_grads, ref_params = reference_adamw(captured, tokens, plan, steps, lr=lr,
                                                          weight_decay=weight_decay, precision=precision,
                                                          inject_inf_step=inject_inf[1] if inject_inf else None,
                                                          **(ref_kwargs or {}))
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=tol.loss_rel)
    for r in rows:
        assert [part["stages"] for part in r["ranks"]] == [list(plan.stages_of(k)) for k in range(plan.world_size)]
        assert all("allgather_s" in part for part in r["ranks"])
        assert all(isinstance(part["start_unix_s"], float) and part["start_unix_s"] > 1.7e9 for part in r["ranks"])
    for k in range(plan.world_size):  # each rank's steps start on the wall clock one after the other
        starts = [r["ranks"][k]["start_unix_s"] for r in rows]
        assert starts == sorted(starts) and len(set(starts)) == len(starts), (k, starts)
        assert r["precision"] == (precision or "fp32")
    # Each rank's memory peak ([Note: measured rank memory]): bytes, a peak, so never lower a step later.
    for k in range(plan.world_size):
        peaks = [r["ranks"][k]["memory_peak_bytes"] for r in rows]
        assert all(isinstance(b, int) and b >= 0 for b in peaks) and peaks == sorted(peaks), (k, peaks)
    assert_grads_match(grads, ref_grads, tol)
    out = tmp_path / "run" / "params"
    params = {r: torch.load(out / f"rank{r}.pt") for r in range(plan.world_size)}
    masters = {r: torch.load(out / f"rank{r}_masters.pt") for r in range(plan.world_size)}
    # 16-bit working weights: the float32 masters (by range) are the parameters; the 16-bit values are their rounding.
    for r, pieces in masters.items():
        for canon, ranges in pieces.items():
            assert params[r][canon].dtype == torch.bfloat16 or params[r][canon].dtype == torch.float16, canon
            assert sum(b - a for a, b, _ in ranges) <= params[r][canon].numel()
    whole = {}
    for canon in {c for pieces in masters.values() for c in pieces}:
        n = ref_params[canon].numel()
        flat = torch.full((n,), float("nan"))
        for pieces in masters.values():
            for a, b, t in pieces.get(canon, ()):
                flat[a:b] = t
        assert not flat.isnan().any(), f"the ranks' float32 masters of {canon!r} do not cover it"
        whole[canon] = flat.view_as(ref_params[canon])
        holder = next(r for r in params if canon in params[r])
        assert torch.equal(params[holder][canon], whole[canon].to(params[holder][canon].dtype)), (
            f"{canon!r}: the 16-bit working weight is not the rounding of its float32 master")
    params = {r: {c: (whole[c] if c in whole else t) for c, t in ps.items()} for r, ps in params.items()}
    assert_params_match(params, ref_params, initial, steps, lr, tol, ref_grads)
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(plan.world_size)}, rows


def compute_only(costs, devices):
    """The same instance without boundary bytes, link latency and parameters:
    only the F/B compute of the pipeline is left."""
    nb, g = costs.num_blocks, devices.num_gpus
    return (dataclasses.replace(costs, cut_bytes_per_sample=(0,) * (nb + 1), param_count=(0,) * nb),
            dataclasses.replace(devices, link_latency_s=((0.0,) * g,) * g))


def candidate_dicts(result) -> list[dict]:
    """A ``SolverResult``'s candidates as plan.json records them (``Candidate.to_dict``)."""
    return [c.to_dict() for c in result.candidates]


def assert_resume_across_layouts(captured, tokens, tmp_path: Path, base, other) -> Path:
    """Checkpoints move between two layouts of one plan (ZeRO-1 and ZeRO-2/3,
    on-device and offloaded): ``base`` trains 4 uninterrupted steps; a second
    run trains steps 1-2 under ``other``, step 3 resumed under ``base`` and
    step 4 under ``other`` again. Its losses and final parameters equal the
    first run's within fp32 tolerance (``FP32``: the layouts sum in other
    orders; Adam amplifies the rounding of near-zero gradient entries up to
    ~lr). Returns the second run's directory."""
    from test_training_loop import LR as LR_A, _export, _params, _rows

    c_base, c_other = (_export(p, captured, tokens, tmp_path / name) for p, name in ((base, "base"), (other, "other")))
    full, run, w = tmp_path / "full", tmp_path / "run", base.world_size
    spawn_ranks(tmp_path / "base" / "plan", w, [*c_base[1:], "--steps", "4", "--out", str(full), "--dump-params"])
    for common, plan_dir, steps, more in ((c_other, "other", 2, ("--checkpoint-every", "2")),
                                          (c_base, "base", 3, ("--resume", "--checkpoint-every", "3")),
                                          (c_other, "other", 4, ("--resume", "--dump-params"))):
        spawn_ranks(tmp_path / plan_dir / "plan", w, [*common[1:], "--steps", str(steps), "--out", str(run), *more])
    assert [r["step"] for r in _rows(run)] == [1, 2, 3, 4]
    assert [r["loss"] for r in _rows(run)] == pytest.approx([r["loss"] for r in _rows(full)], rel=FP32.loss_rel)
    want, got = _params(full, w), _params(run, w)
    for r in range(w):
        for name, value in got[r].items():
            torch.testing.assert_close(value, want[r][name], rtol=FP32.param_rtol, atol=FP32.param_atol_lr * LR_A)
    return run


def edit_plan_json(directory, edit):
    """plan.json in ``directory`` after ``edit(d)`` (d: the parsed JSON, edited in place); its path."""
    import json

    path = directory / "plan.json"
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))
    return path


def plan_load_error(path) -> str:
    """The message of the PlanFileError that ``Plan.load(path)`` raises (fails if it loads)."""
    from zorse_fx.errors import PlanFileError
    from zorse_fx.plan import Plan

    with pytest.raises(PlanFileError) as e:
        Plan.load(path)
    return str(e.value)
