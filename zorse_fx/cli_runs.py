"""The ``zorse`` commands that read plans, runs and checkpoints (``zorse show``, ``simulate``,
``calibrate``, ``export``, ``eval``, ``timings``) and the model loader every command shares; their
parsers are built in ``cli.py`` (``build_parser``), which imports these functions."""

from __future__ import annotations

from pathlib import Path

__all__ = ["cmd_show", "cmd_simulate", "cmd_calibrate", "cmd_export", "cmd_eval", "cmd_timings"]


def _load_model(name: str, *, tokenizer: bool = False):
    """``load_model(name)`` for a command; the tokenizer read only where asked for (``zorse plan``,
    ``simulate`` and ``calibrate`` need the model alone)."""
    from .models.registry import load_model

    try:
        return load_model(name, tokenizer=tokenizer)
    except ValueError as exc:
        raise SystemExit(f"zorse: {exc}") from exc



def cmd_show(args) -> int:
    from .ir.schedule import format_grid, make_schedule
    from .plan import Plan

    plan = Plan.load(args.plan)
    print(plan.table())
    print(format_grid(make_schedule(plan.schedule, plan.num_stages, plan.num_microbatches, plan.interleave)))
    return 0


def cmd_simulate(args) -> int:
    """Simulate an exported plan's step: summary, Perfetto trace and Gantt PNG,
    written to ``--out`` (default: ``<plan directory>/simulate/``, beside the
    plan it shows), on the cluster the plan was made for (``_check_plan_cluster``)."""
    from .capture import capture_lm
    from .cluster import Cluster
    from .plan import Plan
    from .pricing import options_for_plan, price, simulate_plan
    from .sim import gantt_png, stage_memory, to_perfetto

    plan = Plan.load(args.plan)
    cluster = Cluster.from_yaml(args.cluster)
    _check_plan_cluster(plan, cluster, args.plan, args.cluster, any_cluster=args.any_cluster)
    model, _ = _load_model(args.model)
    captured, _ = capture_lm(model, plan.seq_len)
    priced = price(captured, cluster, options_for_plan(plan, calibration=args.calibration),
                   progress=lambda line: print(f"[zorse] {line}") if line.startswith("calibration") else None)
    result = simulate_plan(plan, priced, p2p=args.p2p)  # with the plan's memory policy (ZeRO-1, recomputation)
    labels = [f"{g.type}@{g.node}" for g in cluster.gpus]
    plan_dir = Path(args.plan) if Path(args.plan).is_dir() else Path(args.plan).parent
    out = Path(args.out) if args.out is not None else plan_dir / "simulate"
    out.mkdir(parents=True, exist_ok=True)
    to_perfetto(result, out / "trace.json", gpu_labels=labels)
    gantt_png(result, out / "gantt.png", gpu_labels=labels)
    print(f"[zorse] simulated step {result.step_time_s * 1e3:.1f} ms with {args.p2p} sends (plan predicted "
          f"{plan.predicted_step_time_s * 1e3:.1f} ms), bubble {result.bubble_fraction:.0%}")
    for s, shards in zip(plan.stages, result.state_shard_bytes):
        policy = (" (recompute, stash)" if result.memory[s.index].stash == "host" else " (recompute)"
                  if result.memory[s.index].recompute else "")
        zero, offload = result.memory[s.index].zero, stage_memory(result, s.index).partition(", ")[2]
        for g, shard in zip(s.gpus, shards):
            state = f", ZeRO-{zero} shard {shard / 2**30:.2f} GiB" if zero else ""
            print(f"  stage {s.index}{policy} rank {g.rank} {g.gpu_type:>10}: busy {result.busy_fraction[g.gpu]:.0%}, "
                  f"peak memory {result.peak_memory_bytes[g.gpu] / 2**30:.2f} GiB{state}"
                  + (f", {offload}" if offload else ""))
    print(f"[zorse] wrote {out / 'trace.json'} (open in ui.perfetto.dev) and {out / 'gantt.png'}")
    return 0


def cmd_calibrate(args) -> int:
    """``zorse calibrate RUN [RUN ...]``: the runs' timings against their plans' prices ([Note:
    calibration] in ``cost/calibration.py``); writes the calibration file and prints what it found."""
    from .capture import capture_lm
    from .cluster import Cluster
    from .cost.calibration import write_calibration
    from .plan import Plan
    from .pricing import options_for_plan, price
    from .profiling.calibrate import calibrate_runs, calibration_table

    if args.plan and len(args.plan) != len(args.run):
        raise SystemExit(f"zorse: --plan given {len(args.plan)} time(s) for {len(args.run)} run(s): give one per "
                         f"run, in the runs' order, or none (each run's train_options.json names its plan)")
    cluster = Cluster.from_yaml(args.cluster)
    model, _ = _load_model(args.model)
    captured = None
    runs = []
    for k, run in enumerate(map(Path, args.run)):
        plan_path = args.plan[k] if args.plan else _run_plan(run)
        plan = Plan.load(plan_path)
        _check_plan_cluster(plan, cluster, str(plan_path), args.cluster, any_cluster=args.any_cluster)
        if captured is None:
            captured, _ = capture_lm(model, plan.seq_len)
        runs.append((run, plan, price(captured, cluster, options_for_plan(plan))))
    cal = calibrate_runs(runs, warmup=args.warmup)
    out = write_calibration(cal, args.output or Path(args.run[-1]) / "calibration.json")
    print(calibration_table(cal))
    print(f"[zorse] wrote {out}; plan with it: zorse plan ... --calibration {out}")
    return 0


def cmd_export(args) -> int:
    """``zorse export RUN --hf DIR``: a run's checkpoint as a Hugging Face directory ([Note: exporting a
    checkpoint] in export.py)."""
    from .export import export_run

    res = export_run(args.run, args.hf, step=args.step, dtype=args.dtype, max_shard_size=args.max_shard_size,
                     plan=args.plan)
    what = ("a Hugging Face directory (load with transformers' AutoModelForCausalLM.from_pretrained)"
            if res.kind == "hf" else "a safetensors state dict under the model's canonical parameter names (the "
            "model is not a Hugging Face one)")
    tok = f"; tokenizer {res.tokenizer}" if res.tokenizer else ("; no tokenizer (the run trained on bytes or does "
                                                               "not name one)" if res.kind == "hf" else "")
    print(f"[zorse] wrote {res.out}: {what}, step {res.step}, {res.parameters / 1e6:.2f} M parameters in {res.dtype}"
          f"{tok}; files: {', '.join(res.files)}")
    return 0


def cmd_eval(args) -> int:
    """``zorse eval TARGET --data TOKENS``: loss and perplexity on held-out tokens (``evaluate``)."""
    from .errors import DataError
    from .evaluate import evaluate_tokens, load_trained
    from .token_data import TokenData

    trained = load_trained(args.target, step=args.step, plan=args.plan)
    seq_len = args.seq_len if args.seq_len is not None else trained.seq_len
    if seq_len is None:
        raise DataError(f"eval {args.target}: give --seq-len (tokens per sequence); only a run directory has one "
                        f"of its own (its plan's)")
    data = TokenData.load(args.data)
    vocab = getattr(getattr(trained.model, "config", None), "vocab_size", None)
    if vocab is not None:
        data.check_vocab(int(vocab))
    res = evaluate_tokens(trained.model, trained.label_mode, data.tokens, seq_len=seq_len,
                          batch_size=args.batch_size, max_sequences=args.max_sequences, dtype=args.dtype)
    print(f"[zorse] eval {trained.what} on {args.data}: loss {res.loss:.4f}, perplexity {res.perplexity:.2f} over "
          f"{res.tokens:,} predicted tokens ({res.sequences} sequences of {res.seq_len}, {args.dtype})")
    return 0


def cmd_timings(args) -> int:
    """``zorse timings RUN``: where each rank's step goes (``runtime.timings.phase_table``)."""
    from .runtime.timings import TIMINGS, phase_table, read_timings

    lines = read_timings(Path(args.run) / TIMINGS)
    first = args.skip + 1
    used = [t for t in lines if t.step >= first]
    if not used:
        span = f"{lines[0].step}..{lines[-1].step}" if lines else "none"
        raise SystemExit(f"zorse: {Path(args.run) / TIMINGS} has no step from {first} on (its steps: {span}); "
                         f"pass a smaller --skip")
    hashes = {t.plan_hash for t in used}
    if len(hashes) > 1:  # a resumed run under another plan: the last plan's steps
        used = [t for t in used if t.plan_hash == used[-1].plan_hash]
        print(f"[zorse] the run trained {len(hashes)} plans: the last one's steps ({used[0].step}..{used[-1].step})")
    print(phase_table(used), end="")
    return 0


def _run_plan(run: Path) -> str:
    """The plan a run trained: ``data.plan`` of its ``train_options.json`` (``zorse train`` writes it)."""
    from .train_options import OPTIONS_FILE, read_options_file

    path = run / OPTIONS_FILE
    if not path.is_file():
        raise SystemExit(f"zorse: {run} has no {OPTIONS_FILE} (a run of `zorse train` has one): pass the plan the "
                         f"run trained with --plan")
    return read_options_file(path).data.plan


def _check_plan_cluster(plan, cluster, plan_path: str, cluster_path: str, *, any_cluster: bool = False) -> None:
    """Refuse (``ClusterConfigError``, one line) a cluster other than the plan's: another
    GPU (type, node) at a planned GPU's index, other GPUs per node or another
    fingerprint (memory, links) than plan.json records (format 13), or a plan
    that records none (an older format, or the fields removed) unless
    ``any_cluster`` (``--any-cluster``: simulate it on ``cluster`` anyway,
    which must still hold the planned GPU at every planned index)."""
    from .errors import ClusterConfigError

    if not any_cluster and not (plan.cluster_gpus and plan.cluster_sha256):
        missing = " and ".join(f for f in ("cluster_gpus", "cluster_sha256") if not getattr(plan, f))
        raise ClusterConfigError(f"plan {plan_path} does not record the cluster it was made for ({missing} missing: "
                                 f"a plan.json older than format version 13, or edited); re-plan with `zorse plan "
                                 f"--cluster {cluster_path} ...`, or pass --any-cluster to simulate it on "
                                 f"{cluster_path} as it is")
    from .elastic import recorded_cluster_file

    recorded = recorded_cluster_file(plan_path)  # zorse plan's --cluster, or an --elastic re-plan's cluster.yaml
    use = (f"--cluster {recorded} (recorded in its plan_request.json)"
           if recorded and Path(recorded).resolve() != Path(cluster_path).resolve() else
           "the cluster file the plan was made with")
    fix = f"pass {use}, or plan for this one with `zorse plan --cluster {cluster_path} ...`"
    head = f"--cluster {cluster_path} is not the cluster plan {plan_path} was made for ({plan.cluster_name!r})"
    for s in plan.stages:
        for g in s.gpus:
            got = cluster.gpus[g.gpu] if g.gpu < len(cluster.gpus) else None
            if got is None or (got.type, got.node) != (g.gpu_type, g.node):
                theirs = f"{got.type} on node {got.node!r}" if got else f"missing (it has {len(cluster.gpus)} GPUs)"
                raise ClusterConfigError(f"{head}: the plan puts rank {g.rank} on GPU {g.gpu} ({g.gpu_type} on "
                                         f"node {g.node!r}); GPU {g.gpu} of {cluster_path} is {theirs}; {fix}")
    if any_cluster:
        return
    if plan.cluster_gpus != cluster.gpu_summary():
        raise ClusterConfigError(f"{head}: the plan's has {plan.cluster_gpus}, {cluster_path} has "
                                 f"{cluster.gpu_summary()}; {fix}")
    if plan.cluster_sha256 != cluster.fingerprint():
        raise ClusterConfigError(f"{head}: the same GPUs ({plan.cluster_gpus}) but other links, host memory or "
                                 f"bandwidths (cluster sha256 {cluster.fingerprint()[:12]}..., the plan's "
                                 f"{plan.cluster_sha256[:12]}...); {fix}")
