"""The pass pipeline in one readable function: capture -> analyse -> cost ->
solve -> codegen -> Plan.

Order (fixed): the graph is cut into blocks first (legal cuts only), the cost
model prices blocks per GPU type, the planner chooses stages/GPUs/shares and
micro-batches, codegen splits the graph at the chosen block boundaries, and
the result is recorded as a ``Plan`` with the stage sources.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from .capture import BlockGraph, CapturedModel, analyse
from .cluster import Cluster
from .codegen import emit_source, split_stages
from .cost.roofline import block_costs, saved_activations_or_estimate
from .errors import PlanOptionsError
from .plan import GPUShare, Plan, SolverReport, StagePlan
from .precision import (GRAD_REDUCE_DTYPES, PRECISIONS, PrecisionPolicy, check_supported, default_precision,
                        precision_policy)
from .solve import solve_brute_force, solve_cpsat
from .solve.records import SolverOptions, SolverResult

__all__ = ["PlanOptions", "plan_captured", "plan_fixed", "build_plan", "resolve_precision"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanOptions:
    """What the user asks of the planner."""

    #: Samples per optimizer step, over all micro-batches and GPUs.
    global_batch_size: int
    #: Largest number of pipeline stages considered.
    max_stages: int = 4
    #: "1f1b" or "gpipe".
    schedule: str = "1f1b"
    #: Micro-batch counts to consider (None: divisors of the global batch).
    num_microbatches: tuple[int, ...] | None = None
    max_microbatches: int = 16
    #: Fraction of each GPU's memory a plan may fill.
    memory_fraction: float = 0.9
    #: CP-SAT's work budget per (stages, micro-batches) candidate, in CP-SAT
    #: deterministic seconds (``max_deterministic_time``: work units, about a
    #: second of one worker on an idle machine, the same under any load), so
    #: the same inputs give the same plan ([Note: reproducible plans] in
    #: ``solve/_search.py``). ``SolverOptions.deterministic_time``.
    solver_budget: float = 5.0
    #: Wall-clock safety stop per CP-SAT solve, seconds: when it fires before
    #: the budget is spent the status says "(wall-clock safety stop)", a warning
    #: says the plan may vary, and raising it (or lowering ``solver_budget``) fixes that.
    time_limit_s: float = 100.0
    #: "auto" (per-GPU CP-SAT up to 16 GPUs, class-level CP-SAT beyond),
    #: "cpsat", "grouped" (each checked against the heuristics, which also
    #: warm-start it), "stage_dp" (only the memory-first stage DP: seconds at
    #: 1024 GPUs, no CP-SAT, no optimality gap) or "brute_force" (tiny instances only).
    planner: str = "auto"
    #: Training precision ([Note: mixed precision] in ``zorse_fx/precision.py``):
    #: "auto" (bf16-mixed where every GPU of the cluster supports bfloat16,
    #: else fp16-mixed), "fp32", "bf16-mixed" or "fp16-mixed". It decides the
    #: bytes of training state per parameter, the activations (measured under
    #: its autocast), the dtype of tensors crossing a cut and the matmul peak.
    precision: str = "auto"
    #: dtype of the gradient all-reduce: None = the precision's default
    #: (float32), or "bfloat16" (bf16-mixed only; +2 B/param of buckets).
    grad_reduce_dtype: str | None = None
    #: Upper bound on blocks the graph is cut into.
    max_blocks: int = 32
    allow_idle_gpus: bool = True
    #: Kernel profiles (files or directories) to price nodes with; None = the
    #: profiles shipped in ``zorse_fx/profiles``; () = roofline only.
    profiles: tuple[str, ...] | None = None
    #: Two micro-batch sizes the measured cost model is evaluated at (per-sample
    #: slope + fixed part); None = (1, max(2, global_batch_size // 4)).
    profile_batches: tuple[int, int] | None = None
    #: ZeRO-1 sharding of each stage's optimizer state across its GPUs, in
    #: shares the planner picks per GPU: "auto" (per stage, where it pays),
    #: "never" or "always".
    sharding: str = "auto"
    #: Stage-level activation recomputation: "auto" (per stage, where memory
    #: needs it), "never" or "always".
    recompute: str = "auto"
    #: Largest interleave degree (stages per GPU group, interleaved 1F1B) the
    #: planner tries on its answer; 1 = one stage per group. Needs "1f1b".
    max_interleave: int = 4

    def __post_init__(self) -> None:
        if not self.solver_budget > 0:
            raise PlanOptionsError(f"PlanOptions.solver_budget={self.solver_budget!r}: use a number > 0 (CP-SAT "
                                   f"deterministic seconds per candidate, e.g. 5; zorse plan --solver-budget)")
        if not self.time_limit_s > 0:
            raise PlanOptionsError(f"PlanOptions.time_limit_s={self.time_limit_s!r}: use a number of seconds > 0 "
                                   f"(the wall-clock safety stop per CP-SAT solve, e.g. 100; zorse plan --time-limit)")
        if self.precision not in ("auto", *PRECISIONS):
            raise PlanOptionsError(f"PlanOptions.precision={self.precision!r}: use 'auto' or one of "
                                   f"{', '.join(map(repr, PRECISIONS))}")
        if self.grad_reduce_dtype is not None and self.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
            raise PlanOptionsError(f"PlanOptions.grad_reduce_dtype={self.grad_reduce_dtype!r}: use None (the "
                                   f"precision's default) or one of {', '.join(map(repr, GRAD_REDUCE_DTYPES))}")
        if self.precision != "auto":
            _policy(self.precision, self.grad_reduce_dtype, why="")


def _policy(name: str, grad_reduce_dtype: str | None, *, why: str) -> PrecisionPolicy:
    try:
        return precision_policy(name, grad_reduce_dtype)
    except ValueError as exc:
        raise PlanOptionsError(f"PlanOptions.grad_reduce_dtype={grad_reduce_dtype!r}: {exc}{why}; leave "
                               f"grad_reduce_dtype unset (float32) or ask for precision 'bf16-mixed'") from None


def resolve_precision(options: PlanOptions, cluster: Cluster) -> tuple[PrecisionPolicy, str]:
    """The plan's precision policy on ``cluster`` and why it is that one
    ("auto: every GPU supports bf16", "auto: T4, V100-16GB have no bf16",
    "asked for").

    Raises:
        PlanOptionsError: bf16-mixed asked for on a cluster with a GPU without
            bfloat16 (the message names the GPU types and the alternatives),
            or a gradient-reduction dtype the precision does not allow.
    """
    specs = [g.spec for g in cluster.gpus]
    if options.precision == "auto":
        name = default_precision(specs)
        missing = sorted({s.type for s in specs if not s.bf16_supported})
        reason = ("every GPU supports bf16" if not missing
                  else f"{', '.join(missing)} {'has' if len(missing) == 1 else 'have'} no bf16")
        return (_policy(name, options.grad_reduce_dtype, why=f" (precision 'auto' chose {name}: {reason})"),
                f"auto: {reason}")
    try:
        check_supported(options.precision, specs)
    except ValueError as exc:
        raise PlanOptionsError(f"PlanOptions.precision on cluster {cluster.name!r}: {exc}") from None
    return _policy(options.precision, options.grad_reduce_dtype, why=""), "asked for"


def plan_captured(
    captured: CapturedModel,
    cluster: Cluster,
    options: PlanOptions,
    *,
    model_name: str,
    label_mode: str,
    progress=None,
) -> tuple[Plan, BlockGraph]:
    """Plan ``captured`` for ``cluster``. Returns the plan (with stage sources)
    and the block graph it was made from.

    The answer is simulated before it becomes a plan (``sim.check_result``):
    the simulated step, bubble and peak memory go into ``plan.solver``.

    Raises:
        InfeasiblePlanError: no plan fits (the message names the constraint).
        PlanCheckError: the simulator finds a GPU over memory (a zorse_fx bug).
    """
    say = progress or (lambda msg: log.info(msg))
    t0 = time.perf_counter()
    bg, costs, policy = _analyse_and_price(captured, cluster, options, say)
    say(f"analysed graph: {len(bg.act_order)} activation nodes, {bg.num_blocks} blocks at legal cut points")
    sopts = _solver_options(options)
    from .solve.grouped import solve_grouped
    from .solve.stage_dp import solve_stage_dp

    planner = options.planner
    if planner == "auto":
        planner = "cpsat" if len(cluster) <= 16 else "grouped"
    solve = {"cpsat": solve_cpsat, "grouped": solve_grouped, "brute_force": solve_brute_force,
             "stage_dp": solve_stage_dp}.get(planner)
    if solve is None:
        raise PlanOptionsError(f"unknown planner {options.planner!r}; use 'auto', 'cpsat', 'grouped', 'stage_dp' "
                               f"or 'brute_force'")
    from .solve.portfolio import solve_portfolio

    devices = _device_graph(cluster, options)
    if planner == "brute_force":  # the exhaustive oracle of one stage per group, on its own
        result = solve(costs, devices, sopts)
    elif planner == "stage_dp":  # on its own, without the portfolio
        from .solve.interleave import with_interleaving

        result = solve(costs, devices, sopts)
        if result.status != "STAGE_DP_INFEASIBLE":
            result = with_interleaving(costs, devices, sopts, result)
    else:
        result = solve_portfolio(costs, devices, sopts, solve)
    if result.status == "STAGE_DP_INFEASIBLE":
        from .errors import InfeasiblePlanError

        raise InfeasiblePlanError(f"planner 'stage_dp': its best plan does not fit: "
                                  f"{next(c['violations'] for c in result.candidates if c.get('chosen'))}")
    say(f"solved: {result.num_stages} stages, {result.num_microbatches} micro-batches, "
        f"status {result.status}, gap {result.optimality_gap:.2%}, {result.wall_s:.2f} s")
    if result.wall_clock_stops:  # [Note: reproducible plans]
        msg = (f"the wall-clock safety stop (time_limit_s={options.time_limit_s:g} s) ended "
               f"{result.wall_clock_stops} CP-SAT solve(s) before their budget (solver_budget="
               f"{options.solver_budget:g} deterministic s): this plan may differ on another run or machine; "
               f"raise time_limit_s (zorse plan --time-limit) or lower solver_budget (--solver-budget)")
        log.warning(msg)
        say(f"warning: {msg}")
    from .sim.check import check_result

    check = check_result(costs, devices, sopts, result)  # raises PlanCheckError on a memory breach
    say(check.summary())
    for w in check.warnings:
        log.warning(w)
        say(f"warning: {w}")
    plan = build_plan(bg, cluster, result, options, model_name=model_name, label_mode=label_mode,
                      precision=policy, planner=planner, check=check)
    say(f"codegen: {plan.num_stages} stage modules ({time.perf_counter() - t0:.1f} s total)")
    return plan, bg


def _analyse_and_price(captured: CapturedModel, cluster: Cluster, options: PlanOptions, say=None):
    """(block graph, per-block costs on the cluster's GPU types, precision policy).

    The precision is ``resolve_precision``'s. Activations are measured under
    its autocast, and the returned block graph's tensor specs (so the stages'
    ``recv``/``send`` and the cut bytes) are in the dtypes autocast gives them
    ([Note: saved activations] in ``cost/roofline.py``). Types with a
    measured kernel profile are priced from it; the others by the roofline
    with efficiencies learned from the measured GPU profiles
    (``cost/measured.py``). Without any profile for the cluster's types, the
    plain roofline (``cost/roofline.py``)."""
    from .cost.measured import ProfileSet, measured_block_costs

    policy, why = resolve_precision(options, cluster)
    if say:
        say(f"precision {policy.describe()} ({why})")
    bg = analyse(captured, max_blocks=options.max_blocks)
    acts = saved_activations_or_estimate(bg, policy)
    cast = bg.with_dtypes(acts.output_dtypes)
    if say and cast is not bg:
        changed = sorted({f"{t.name} {b.dtype}->{t.dtype}" for ts, bs in zip(cast.cut_tensors, bg.cut_tensors)
                          for t, b in zip(ts, bs) if t.dtype != b.dtype})
        if changed:
            say(f"under {policy.name} autocast these cut tensors change dtype: {', '.join(changed)}")
    bg = cast
    specs = {g.type: g.spec for g in cluster.gpus}
    costs = block_costs(bg, specs, precision=policy, activations=acts)
    profiles = ProfileSet.load(options.profiles) if options.profiles != () else ProfileSet([])
    if not any(t in profiles for t in specs):
        if say:
            say(f"cost model: roofline on {', '.join(specs)} ({policy.compute_dtype_name} matmuls; "
                "no measured profile for these types)")
        return bg, costs, policy
    measured = [profiles.by_type[t].batch_sizes for t in specs if t in profiles and profiles.by_type[t].batch_sizes]
    batches = options.profile_batches or (
        (min(measured[0]), max(measured[0])) if measured and len(set(measured[0])) > 1
        else (1, max(2, options.global_batch_size // 4)))
    costs, sources = measured_block_costs(bg, specs, profiles, batches=batches, base=costs,
                                          compute_dtype=policy.compute_dtype)
    if say:
        for t, count in sources.items():
            total = sum(count.values()) or 1
            say(f"cost model for {t}: " + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(count.items()))
                + f" of node times (micro-batches {batches[0]} and {batches[1]})")
    return bg, costs, policy


def _device_graph(cluster: Cluster, options: PlanOptions):
    """The cluster's device graph; where a GPU type's profile measured the
    optimizer step, its optimizer time comes from that measurement (expressed
    as the memory bandwidth at which the solver's [C-optim] term,
    ``2 * optimizer_bytes_per_param`` per parameter, takes the measured time)."""
    from .cost.measured import ProfileSet

    dg = cluster.device_graph()
    step_bytes = resolve_precision(options, cluster)[0].optimizer_step_bytes_per_param
    profiles = ProfileSet.load(options.profiles) if options.profiles != () else ProfileSet([])
    bw = list(dg.mem_bw_bytes_per_s)
    for g, t in enumerate(dg.gpu_types):
        prof = profiles.by_type.get(t)
        if prof is not None and prof.optimizer_ns_per_param > 0:
            bw[g] = 2 * step_bytes / (prof.optimizer_ns_per_param * 1e-9)  # [C-optim]: 2 * optim B/param / bw
    return dataclasses.replace(dg, mem_bw_bytes_per_s=tuple(bw))


def _solver_options(options: PlanOptions, **overrides) -> SolverOptions:
    fields = dict(
        global_batch_size=options.global_batch_size,
        max_stages=options.max_stages,
        num_microbatches=options.num_microbatches,
        max_microbatches=options.max_microbatches,
        schedule=options.schedule,
        memory_fraction=options.memory_fraction,
        time_limit_s=options.time_limit_s,
        deterministic_time=options.solver_budget,
        allow_idle_gpus=options.allow_idle_gpus,
        sharding=options.sharding,
        recompute=options.recompute,
        max_interleave=options.max_interleave,
    )
    return SolverOptions(**{**fields, **overrides})


def build_plan(
    bg: BlockGraph,
    cluster: Cluster,
    result: SolverResult,
    options: PlanOptions,
    *,
    model_name: str,
    label_mode: str,
    precision: PrecisionPolicy,
    planner: str,
    check=None,
) -> Plan:
    """Turn a planner decision into a ``Plan`` with generated stage sources;
    ``precision`` is the policy ``bg`` was priced under (``bg``'s tensor specs
    in its autocast dtypes, as ``_analyse_and_price`` returns it); ``check``
    (a ``sim.check.SimulationCheck``) fills ``plan.solver.simulated_*``."""
    programs = split_stages(bg, result.stage_blocks)
    state = bg.captured.state()
    stages, sources, rank = [], [], 0
    groups = result.num_stages // result.interleave
    for s, prog in enumerate(programs):
        gpus = []
        sharded = bool(result.stage_sharded and result.stage_sharded[s])
        if s >= groups:  # interleaved: the GPUs (and ranks) of its group, stage s mod P
            rank = stages[s % groups].gpus[0].rank
        for i, (g, n) in enumerate(zip(result.stage_gpus[s], result.samples_per_microbatch[s])):
            mem = result.predicted_memory_bytes[s][i] if result.predicted_memory_bytes else 0
            gpu = cluster.gpus[g]
            gpus.append(GPUShare(
                rank=rank, gpu=g, node=gpu.node, gpu_type=gpu.type, samples_per_microbatch=n,
                predicted_memory_bytes=int(mem), memory_capacity_bytes=int(gpu.memory_bytes),
                state_shard_bytes=int(result.state_shard_bytes[s][i]) if sharded else 0,
            ))
            rank += 1
        label = bg.describe_blocks(*prog.blocks)
        stages.append(StagePlan(
            index=s,
            blocks=prog.blocks,
            label=label,
            gpus=tuple(gpus),
            input_names=prog.input_names,
            recv=prog.recv,
            send=prog.send,
            params=dict(prog.params),
            consts=dict(prog.consts),
            num_parameters=sum(state[c].numel() for c in prog.params.values()),
            source_file=f"stage_{s}.py",
            predicted_time_s=result.predicted_stage_time_s[s] if result.predicted_stage_time_s else 0.0,
            predicted_allreduce_s=result.predicted_allreduce_s[s] if result.predicted_allreduce_s else 0.0,
            sharded=sharded,
            recompute=bool(result.stage_recompute and result.stage_recompute[s]),
        ))
        gpu_list = ", ".join(f"{gs.gpu_type}@{gs.node} x{gs.samples_per_microbatch}" for gs in gpus)
        sources.append(emit_source(prog, header=f"Plan: {model_name} on {cluster.name}; GPUs: {gpu_list}"))
    seq_len = int(bg.captured.example_inputs[0].shape[1]) if bg.captured.example_inputs[0].dim() > 1 else 1
    return Plan(
        cluster_name=cluster.name,
        model_name=model_name,
        input_names=bg.captured.input_names,
        seq_len=seq_len,
        label_mode=label_mode,
        global_batch_size=options.global_batch_size,
        microbatch_size=result.microbatch_size,
        num_microbatches=result.num_microbatches,
        schedule=result.schedule,
        interleave=result.interleave,
        stages=tuple(stages),
        predicted_step_time_s=result.predicted_step_time_s,
        precision=precision.name,
        grad_reduce_dtype=precision.grad_reduce_dtype,
        solver=SolverReport(
            planner=planner,
            status=result.status,
            objective_s=result.objective,
            best_bound_s=result.best_bound,
            optimality_gap=result.optimality_gap,
            wall_s=result.wall_s,
            time_limit_s=options.time_limit_s,
            solver_budget=options.solver_budget,
            wall_clock_stops=result.wall_clock_stops,
            candidates=tuple(result.candidates),
            **({} if check is None else dict(
                simulated_step_time_s=check.simulated_step_time_s,
                simulated_max_memory_fraction=check.max_memory_fraction,
                simulated_bubble_fraction=check.bubble_fraction)),
        ),
        sources=tuple(sources),
    )


def plan_fixed(
    captured: CapturedModel,
    cluster: Cluster,
    options: PlanOptions,
    *,
    stage_blocks: tuple[tuple[int, int], ...],
    stage_gpus: tuple[tuple[int, ...], ...],
    samples_per_microbatch: tuple[tuple[int, ...], ...],
    num_microbatches: int,
    model_name: str = "model",
    label_mode: str = "shifted",
    stage_sharded: tuple[bool, ...] | None = None,
    state_shard_mib: tuple[tuple[int, ...], ...] | None = None,
    stage_recompute: tuple[bool, ...] | None = None,
    interleave: int = 1,
) -> tuple[Plan, BlockGraph]:
    """A plan for a decision made by hand (what-if studies, tests), priced by
    the same cost model and objective as the solver's plans. ``stage_sharded``
    / ``state_shard_mib`` / ``stage_recompute``: the memory policy, as in
    ``zorse_fx.solve.evaluate`` (None: nothing sharded or recomputed).
    ``interleave`` = v > 1: stage s runs on the GPUs of stage s mod (S / v),
    which ``stage_gpus`` lists again (interleaved 1F1B).

    Raises:
        ValueError: the decision is malformed (see ``zorse_fx.solve.evaluate``).
    """
    from .solve import evaluate

    bg, costs, policy = _analyse_and_price(captured, cluster, options)
    sopts = _solver_options(options, max_stages=max(options.max_stages, len(stage_blocks)), max_interleave=interleave,
                            num_microbatches=None, max_microbatches=options.global_batch_size,
                            allow_idle_gpus=True, sharding="auto", recompute="auto")
    ev = evaluate(costs, _device_graph(cluster, options), sopts, stage_blocks=stage_blocks, stage_gpus=stage_gpus,
                  samples_per_microbatch=samples_per_microbatch, num_microbatches=num_microbatches,
                  stage_sharded=stage_sharded, state_shard_mib=state_shard_mib, stage_recompute=stage_recompute,
                  interleave=interleave)
    result = SolverResult.from_evaluation(
        ev, stage_blocks=stage_blocks, stage_gpus=stage_gpus, samples_per_microbatch=samples_per_microbatch,
        num_microbatches=num_microbatches, options=sopts, status="FIXED", best_bound=ev.step_time_s)
    plan = build_plan(bg, cluster, result, options, model_name=model_name, label_mode=label_mode,
                      precision=policy, planner="fixed")
    return plan, bg
