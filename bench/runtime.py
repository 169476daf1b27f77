"""The zorse_fx runtime against standard PyTorch training, side by side in one run (issue 11).

    .venv/bin/python bench/runtime.py [--pairs 20] [--warmup 2] [--only pipelining_1f1b,ddp] [--out FILE]

Model (``BenchConfig``): a nanoGPT-style GPT (``zorse_fx/models/gpt.py``; 4
layers, width 256, 8 heads, byte vocabulary, tied input/output embedding,
3.3M parameters) on gensim's Lee news corpus as UTF-8 bytes, sequence 128,
global batch 16 in 4 micro-batches.
It is captured once (``zorse_fx.capture.capture``) and planned by hand
(``plan_fixed`` on ``examples/clusters/small_hetero.yaml``: the cluster only
names the GPUs; every rank here is a CPU process, Gloo, one thread).

The comparisons (``COMPARISONS``), each ``zorse_fx / anchor``:

- ``pipelining_1f1b``: a 2-stage x 1-rank 1F1B plan against
  ``torch.distributed.pipelining`` (``PipelineStage`` + ``Schedule1F1B``)
  running the *same generated stage modules* (the plan's ``stage_<i>.py``,
  same weights, same cut, same micro-batches), so only the runtime differs.
  The generated last stage computes the loss from a labels input, which
  pipelining does not pass to a non-first stage: ``LabelledLastStage`` feeds
  it the labels of forward chunk ``i`` (1F1B runs forward chunks in order
  ``0 .. M-1``) and the schedule's ``loss_fn`` returns the stage output.
  ``scale_grads=True`` divides every stage's gradients by ``M`` after the
  backward, zorse_fx back-propagates ``loss * n / N`` (= ``loss / M``): both
  get the mean-loss gradient. The tied embedding lives in both stages; the
  anchor all-reduces its gradient over the two ranks by hand (pipelining
  does not know about tied weights), as the zorse_fx runtime does.
- ``ddp``: one stage on 2 ranks, equal shares, against
  ``DistributedDataParallel`` (default buckets) on the same generated module
  and the same rows per rank, ``no_sync()`` on all but the last micro-batch.
- ``eager``: a 1-stage 1-rank plan against a plain loop over the micro-batches
  on the same generated module (``stage_0.py``).
- ``eager_original_model``: the same 1-rank plan against the same loop on the
  original ``GPT`` module (what capture + codegen cost, not the runtime).
- ``bf16_vs_fp32``: zorse_fx with ``precision_policy("bf16-mixed")`` against
  zorse_fx in fp32 (the anchor), 1 rank; fewer pairs (``--bf16-pairs``):
  bf16 autocast on a CPU without bf16 instructions is ~20x slower.

Every side does forward + backward of all micro-batches and an AdamW step
(``OptimizerConfig`` defaults, the same ``lr`` / ``weight_decay``). Each
comparison runs in one set of processes (torchrun, ``--worker``) that hold
both sides, each with its own copy of the weights, and alternate: zorse_fx
step, anchor step, zorse_fx step, ... on the same global batch of each pair.
Each step is timed on every rank between two barriers; a step's time is the
max over ranks. The first ``--warmup`` pairs are not counted; ``ratio`` is the
median over the counted pairs of (zorse_fx step / anchor step). Each row
also has ``cpu_ratio``, the same median over the steps' CPU seconds summed
over ranks (``time.process_time``): the work each side does, far less
disturbed by other processes on a shared machine than wall time, but blind
to waiting (pipeline bubbles, messages). Step 1's losses must agree
(relative 1e-5; bf16 is only reported): asserted.

The sides (``ZorseSide`` and the anchors) are in ``bench/_runtime_sides.py``;
this script pairs them per comparison, launches the workers, times the steps
and writes the rows.

Writes ``bench/results/runtime.json`` (a list of rows; with ``--only``, the
other comparisons' rows already in the file are kept) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _runtime_sides import (  # noqa: E402 (bench/, the script's directory, is on sys.path)
    DDPSide,
    EagerSide,
    PipeliningSide,
    ZorseSide,
    gpt_config,
    load_stage_module,
    original_model,
    runtime_takes_precision,
)

CLUSTER = ROOT / "examples" / "clusters" / "small_hetero.yaml"
#: Step-1 loss agreement asserted between the two sides of an fp32 comparison (relative).
LOSS_RTOL = 1e-5


@dataclass(frozen=True, slots=True, kw_only=True)
class Comparison:
    """One row of the benchmark: zorse_fx against one anchor."""

    #: The row's ``comparison`` (``--only`` takes these names).
    name: str
    #: What zorse_fx is compared with.
    anchor: str
    #: Processes (ranks) of the run.
    ranks: int
    #: Issue 11's target for ``ratio`` (zorse_fx / anchor), None where there is none.
    target_ratio: float | None
    #: What the comparison shows, one line.
    what: str


COMPARISONS = {c.name: c for c in (
    Comparison(name="pipelining_1f1b", anchor="torch.distributed.pipelining.Schedule1F1B", ranks=2,
               target_ratio=1.00,
               what="2 stages x 1 rank, 1F1B; both run the plan's generated stage modules"),
    Comparison(name="ddp", anchor="torch.nn.parallel.DistributedDataParallel", ranks=2, target_ratio=1.00,
               what="1 stage x 2 ranks, equal shares; both run the generated stage module; DDP with no_sync() "
                    "on all but the last micro-batch"),
    Comparison(name="eager", anchor="eager loop on the generated stage module", ranks=1, target_ratio=1.02,
               what="1 stage x 1 rank against a plain micro-batch loop on the same generated module"),
    Comparison(name="eager_original_model", anchor="eager loop on the original GPT nn.Module", ranks=1,
               target_ratio=None,
               what="1 stage x 1 rank against a plain micro-batch loop on the model zorse_fx captured"),
    Comparison(name="bf16_vs_fp32", anchor="zorse_fx fp32", ranks=1, target_ratio=None,
               what="zorse_fx bf16-mixed (autocast) against zorse_fx fp32, 1 stage x 1 rank"),
)}


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """What every comparison runs; written to the work directory for the workers."""

    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 8
    #: T, tokens per sample.
    seq_len: int = 128
    #: Samples per optimizer step.
    global_batch_size: int = 16
    #: M, micro-batches per step (all comparisons).
    microbatches: int = 4
    lr: float = 1e-4
    weight_decay: float = 0.1
    #: Counted pairs (zorse_fx step, anchor step) per comparison.
    pairs: int = 20
    #: Pairs run first and not counted.
    warmup: int = 2
    #: Counted / warm-up pairs of ``bf16_vs_fp32`` (a bf16 step takes ~15 s here).
    bf16_pairs: int = 3
    bf16_warmup: int = 1

    def pairs_of(self, comparison: str) -> tuple[int, int]:
        """(warm-up pairs, counted pairs) of ``comparison``."""
        if comparison == "bf16_vs_fp32":
            return self.bf16_warmup, self.bf16_pairs
        return self.warmup, self.pairs


# -- inside a worker: the two sides of a comparison (bench/_runtime_sides.py), timed -----


def _sides(name: str, plan, plan_dir: Path, weights, rank: int, cfg: BenchConfig):
    """(zorse_fx side, anchor side) of comparison ``name`` on this rank."""
    if name == "pipelining_1f1b":
        return ZorseSide(plan, plan_dir, weights, rank, cfg), PipeliningSide(plan, plan_dir, weights, rank, cfg)
    if name == "ddp":
        return ZorseSide(plan, plan_dir, weights, rank, cfg), DDPSide(plan, plan_dir, weights, rank, cfg)
    if name == "eager":
        module = load_stage_module(plan, plan_dir, 0, weights)
        return (ZorseSide(plan, plan_dir, weights, rank, cfg),
                EagerSide(module, plan.stages[0].input_names, plan, cfg))
    if name == "eager_original_model":
        return (ZorseSide(plan, plan_dir, weights, rank, cfg),
                EagerSide(original_model(cfg, weights), plan.input_names, plan, cfg))
    if name == "bf16_vs_fp32":
        return (ZorseSide(plan, plan_dir, weights, rank, cfg, precision="bf16-mixed"),
                ZorseSide(plan, plan_dir, weights, rank, cfg))
    raise ValueError(f"unknown comparison {name!r}; one of {', '.join(COMPARISONS)}")


def worker(name: str, workdir: Path) -> int:
    """One rank of comparison ``name`` (started by torchrun): alternate the two
    sides' steps, time each between barriers; rank 0 writes ``result.json``."""
    from zorse_fx.data import global_batch
    from zorse_fx.plan import Plan

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = BenchConfig(**json.loads((workdir / "config.json").read_text()))
    plan_dir = workdir / name / "plan"
    plan = Plan.load(plan_dir)
    weights = torch.load(workdir / "weights.pt", weights_only=True)
    tokens = torch.load(workdir / "tokens.pt", weights_only=True)
    zorse, anchor = _sides(name, plan, plan_dir, weights, rank, cfg)
    warmup, pairs = cfg.pairs_of(name)
    rec = {"rank": rank, "zorse_s": [], "anchor_s": [], "zorse_cpu_s": [], "anchor_cpu_s": [], "zorse_loss": [],
           "anchor_loss": [], "zorse_breakdown": [], "anchor_breakdown": []}
    for k in range(warmup + pairs):
        batch = global_batch(tokens, k, global_batch_size=plan.global_batch_size, seq_len=plan.seq_len,
                             input_names=plan.input_names, label_mode=plan.label_mode)
        for side, key in ((zorse, "zorse"), (anchor, "anchor")):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = side.step(batch)
            rec[f"{key}_s"].append(time.perf_counter() - t0)
            rec[f"{key}_cpu_s"].append(time.process_time() - c0)
            dist.barrier()
            rec[f"{key}_loss"].append(loss)
            rec[f"{key}_breakdown"].append(side.breakdown())
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, rec)
    if rank == 0:
        (workdir / name / "result.json").write_text(json.dumps(parts) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


# -- the parent: capture, plans, launches, rows ------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class _Prepared:
    """What the parent made in the work directory for the workers."""

    #: Comparison name -> its plan (exported to ``<workdir>/<name>/plan``).
    plans: dict
    #: Trainable parameters of the GPT (the tied embedding counted once).
    num_parameters: int


def _make_plans(names, cfg: BenchConfig, workdir: Path) -> _Prepared:
    """Capture the GPT once, export each comparison's plan, save weights and tokens."""
    from zorse_fx.capture import analyse, capture
    from zorse_fx.cluster import Cluster
    from zorse_fx.data import read_corpus, tokenize
    from zorse_fx.models.gpt import GPT
    from zorse_fx.planner import PlanOptions, plan_fixed
    from zorse_fx.solve import Decision

    torch.manual_seed(0)
    model = GPT(gpt_config(cfg))
    ids = torch.randint(0, 256, (2, cfg.seq_len))
    captured = capture(model, (ids, ids))
    bg = analyse(captured)
    nb = bg.num_blocks
    # 2-stage cut: before the first block of layer n_layer // 2 (layers split evenly).
    half = f"h.{cfg.n_layer // 2}."
    cut = next(b for b in range(nb) if any(a.startswith(half) for a in bg.block_attrs[b]))
    gb, m = cfg.global_batch_size, cfg.microbatches
    mb = gb // m
    if gb % m or mb % 2:
        raise ValueError(f"global batch {gb} must split into {m} micro-batches of an even size (2 DP ranks)")
    layouts = {  # (stage_blocks, stage_gpus, samples per micro-batch); GPUs 0, 1: the A100s (equal)
        "pipelining_1f1b": (((0, cut), (cut, nb)), ((0,), (1,)), ((mb,), (mb,))),
        "ddp": (((0, nb),), ((0, 1),), ((mb // 2, mb // 2),)),
        "eager": (((0, nb),), ((0,),), ((mb,),)),
    }
    layouts["eager_original_model"] = layouts["bf16_vs_fp32"] = layouts["eager"]
    cluster = Cluster.from_yaml(CLUSTER)
    plans = {}
    for name in names:
        blocks, gpus, samples = layouts[name]
        plan, _ = plan_fixed(captured, cluster, PlanOptions(global_batch_size=gb),
                             Decision(stage_blocks=blocks, stage_gpus=gpus, samples_per_microbatch=samples,
                                      num_microbatches=m),
                             model_name=f"gpt-{cfg.n_layer}x{cfg.n_embd}")
        plan.export(workdir / name / "plan")
        plans[name] = plan
    torch.save(captured.state(), workdir / "weights.pt")
    torch.save(tokenize(read_corpus("lee")), workdir / "tokens.pt")
    (workdir / "config.json").write_text(json.dumps(asdict(cfg)) + "\n")
    return _Prepared(plans=plans, num_parameters=sum(p.numel() for p in model.parameters()))


def _launch(name: str, ranks: int, workdir: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("TORCHELASTIC_RUN_ID", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           str(Path(__file__).resolve()), "--worker", name, "--workdir", str(workdir)]
    subprocess.run(cmd, env=env, check=True, timeout=1800)
    return json.loads((workdir / name / "result.json").read_text())


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "unknown")
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "backend": "gloo", "device": "cpu", "threads_per_rank": 1}


def code_version() -> dict:
    """The zorse_fx runtime measured: sha256 of ``zorse_fx/runtime/*.py`` (exact even
    for uncommitted code) and, in a git checkout, the commit and whether
    ``zorse_fx/`` differs from it."""
    import hashlib

    files = sorted((ROOT / "zorse_fx" / "runtime").glob("*.py"))
    digest = hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in files)).hexdigest()
    out = {"runtime_sha256": digest[:16], "commit": None, "zorse_fx_modified": None}
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True, check=True).stdout.strip()
        out["zorse_fx_modified"] = bool(subprocess.run(["git", "status", "--porcelain", "zorse_fx"], cwd=ROOT,
                                                       capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: the digest identifies the code
        pass
    return out


def _median_breakdowns(parts, key: str, counted: slice) -> list[dict[str, float]]:
    """Per rank, the median of each component over the counted steps."""
    out = []
    for p in parts:
        steps = p[key][counted]
        out.append({"rank": p["rank"], **{c: statistics.median(s[c] for s in steps) for c in steps[0]}})
    return out


def _row(comp: Comparison, plan, parts, cfg: BenchConfig, num_parameters: int, load: dict) -> dict:
    warmup, pairs = cfg.pairs_of(comp.name)
    counted = slice(warmup, warmup + pairs)
    steps = warmup + pairs
    z = [max(p["zorse_s"][k] for p in parts) for k in range(steps)]
    a = [max(p["anchor_s"][k] for p in parts) for k in range(steps)]
    zl = [sum(p["zorse_loss"][k] for p in parts) for k in range(steps)]
    al = [sum(p["anchor_loss"][k] for p in parts) for k in range(steps)]
    ratios = [zk / ak for zk, ak in zip(z[counted], a[counted])]
    # CPU seconds of the step, summed over ranks: the work done, much less disturbed than the
    # wall time by other processes on the machine (but blind to waiting: bubbles, messages).
    zc = [sum(p["zorse_cpu_s"][k] for p in parts) for k in range(steps)]
    ac = [sum(p["anchor_cpu_s"][k] for p in parts) for k in range(steps)]
    cpu_ratios = [zk / ak for zk, ak in zip(zc[counted], ac[counted])]
    rel = [abs(x - y) / abs(y) for x, y in zip(zl, al)]
    ratio = statistics.median(ratios)
    return {
        "comparison": comp.name, "anchor": comp.anchor, "what": comp.what,
        "zorse_fx_step_s": statistics.median(z[counted]), "anchor_step_s": statistics.median(a[counted]),
        "ratio": ratio, "ratio_min": min(ratios), "ratio_max": max(ratios),
        "ratio_quartiles": statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3,
        "pair_ratios": ratios,
        "target_ratio": comp.target_ratio,
        "target_met": None if comp.target_ratio is None else ratio <= comp.target_ratio,
        "pairs": pairs, "warmup_pairs": warmup,
        "zorse_fx_steps_s": z, "anchor_steps_s": a,
        "zorse_fx_cpu_s": statistics.median(zc[counted]), "anchor_cpu_s": statistics.median(ac[counted]),
        "cpu_ratio": statistics.median(cpu_ratios), "cpu_ratio_min": min(cpu_ratios),
        "cpu_ratio_max": max(cpu_ratios), "load_average_1min": load,
        "step1_loss": {"zorse_fx": zl[0], "anchor": al[0], "rel_diff": rel[0]},
        "max_loss_rel_diff": max(rel), "last_loss": {"zorse_fx": zl[-1], "anchor": al[-1]},
        "zorse_fx_breakdown_s": _median_breakdowns(parts, "zorse_breakdown", counted),
        "anchor_breakdown_s": _median_breakdowns(parts, "anchor_breakdown", counted),
        "model": {"name": "zorse_fx.models.gpt.GPT", "n_layer": cfg.n_layer, "n_embd": cfg.n_embd,
                  "n_head": cfg.n_head, "vocab_size": 256, "tied_embedding": True, "parameters": num_parameters},
        "data": "gensim Lee corpus, UTF-8 bytes", "seq_len": cfg.seq_len,
        "global_batch": plan.global_batch_size, "microbatches": plan.num_microbatches,
        "microbatch_size": plan.microbatch_size, "ranks": plan.world_size,
        "stages": [{"blocks": list(s.blocks), "ranks": list(s.ranks), "samples_per_microbatch":
                    [g.samples_per_microbatch for g in s.gpus], "parameters": s.num_parameters}
                   for s in plan.stages],
        "optimizer": {"name": "AdamW", "lr": cfg.lr, "weight_decay": cfg.weight_decay},
        "machine": machine(), "date": date.today().isoformat(), "code": code_version(),
        "command": "python bench/runtime.py " + " ".join(sys.argv[1:]),
    }


def _skipped_row(comp: Comparison, reason: str) -> dict:
    return {"comparison": comp.name, "anchor": comp.anchor, "what": comp.what, "skipped": reason,
            "zorse_fx_step_s": None, "anchor_step_s": None, "ratio": None, "pairs": 0,
            "machine": machine(), "date": date.today().isoformat()}


def _check_step1(comp: Comparison, row: dict) -> None:
    """Both sides start from the same weights and train on the same batch: step 1's losses agree."""
    s = row["step1_loss"]
    if comp.name != "bf16_vs_fp32" and s["rel_diff"] > LOSS_RTOL:
        raise AssertionError(f"{comp.name}: step-1 loss zorse_fx {s['zorse_fx']:.7f} vs anchor {s['anchor']:.7f} "
                             f"(relative {s['rel_diff']:.1e} > {LOSS_RTOL:g}): the two sides do not train the "
                             "same model on the same batch")


def main() -> int:
    defaults = BenchConfig()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=defaults.pairs, help="counted pairs per comparison")
    ap.add_argument("--warmup", type=int, default=defaults.warmup, help="uncounted pairs first")
    ap.add_argument("--bf16-pairs", type=int, default=defaults.bf16_pairs)
    ap.add_argument("--bf16-warmup", type=int, default=defaults.bf16_warmup)
    ap.add_argument("--only", help=f"comma-separated subset of {','.join(COMPARISONS)}")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "runtime.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, Path(args.workdir))
    names = args.only.split(",") if args.only else list(COMPARISONS)
    unknown = [n for n in names if n not in COMPARISONS]
    if unknown:
        ap.error(f"unknown comparison(s) {unknown}; choose from {', '.join(COMPARISONS)}")
    cfg = BenchConfig(pairs=args.pairs, warmup=args.warmup, bf16_pairs=args.bf16_pairs,
                      bf16_warmup=args.bf16_warmup)
    out = Path(args.out)
    rows = {r["comparison"]: r for r in json.loads(out.read_text())} if args.only and out.exists() else {}
    skipped = {}
    if "bf16_vs_fp32" in names and not runtime_takes_precision():
        skipped["bf16_vs_fp32"] = ("StageWorker has no precision= argument yet (the runtime rewrite adds it); "
                                   "bf16_vs_fp32 not run")
    with tempfile.TemporaryDirectory(prefix="zorse_bench_runtime_") as tmp:
        workdir = Path(tmp)
        prepared = _make_plans([n for n in names if n not in skipped], cfg, workdir)
        for name in names:
            comp = COMPARISONS[name]
            if name in skipped:
                print(f"[runtime] {name}: skipped: {skipped[name]}", flush=True)
                rows[name] = _skipped_row(comp, skipped[name])
                continue
            print(f"[runtime] {name}: {comp.what} ({comp.ranks} rank(s))", flush=True)
            load_before = os.getloadavg()[0]
            parts = _launch(name, comp.ranks, workdir)
            load = {"before": load_before, "after": os.getloadavg()[0]}
            row = _row(comp, prepared.plans[name], parts, cfg, prepared.num_parameters, load)
            _check_step1(comp, row)
            rows[name] = row
            print(f"[runtime] {name}: zorse_fx {row['zorse_fx_step_s']:.3f} s, anchor {row['anchor_step_s']:.3f} s, "
                  f"ratio {row['ratio']:.3f} [{row['ratio_min']:.3f}, {row['ratio_max']:.3f}], CPU-time ratio "
                  f"{row['cpu_ratio']:.3f}; load average {load['before']:.1f} -> {load['after']:.1f}", flush=True)
    ordered = [rows[n] for n in COMPARISONS if n in rows]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(ordered, indent=1) + "\n")
    print("| comparison | anchor | zorse_fx step | anchor step | ratio (median) | min - max | CPU-time ratio | target "
          "| pairs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in ordered:
        if r.get("skipped"):
            print(f"| {r['comparison']} | {r['anchor']} | - | - | skipped | - | - | - | 0 |")
            continue
        target = ("-" if r["target_ratio"] is None
                  else f"<= {r['target_ratio']:.2f} ({'met' if r['target_met'] else 'missed'})")
        print(f"| {r['comparison']} | {r['anchor']} | {r['zorse_fx_step_s']:.3f} s | {r['anchor_step_s']:.3f} s | "
              f"{r['ratio']:.3f} | {r['ratio_min']:.3f} - {r['ratio_max']:.3f} | {r['cpu_ratio']:.3f} | {target} "
              f"| {r['pairs']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
