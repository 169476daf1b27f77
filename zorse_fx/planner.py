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

from .capture import BlockGraph, CapturedModel
from .cluster import Cluster
from .errors import InfeasiblePlanError, PlanOptionsError
from .idle import idle_gpus
from .ir.decision import Decision
from .ir.result import SolverResult
from .options import PlanOptions
from .plan import Plan, fmt_seconds
from .plan_build import build_plan
from .pricing import price, resolve_precision
from .solve import solve_brute_force, solve_cpsat

__all__ = ["PlanOptions", "plan_captured", "plan_fixed", "solve_plan", "build_plan", "resolve_precision",
           "check_host_memory"]

log = logging.getLogger(__name__)


#: What an offload flag keeps in host memory (``check_host_memory``'s message).
_HELD = {"offload": "optimizer state", "activation_offload": "saved activations", "stash": "blocks' inputs"}


def check_host_memory(cluster: Cluster, options: PlanOptions) -> None:
    """Refuse an offload "always" (``offload``, ``activation_offload``: every stage
    keeps state in host memory, [Note: memory flags] in ``options.py``) that
    ``cluster`` cannot host: no node gives ``host_memory_GiB``, or some node gives
    none while every GPU must take work (``allow_idle_gpus=False``).

    Raises:
        PlanOptionsError: one line naming the cluster file, the flag, the missing
            field and what to change.
    """
    asks = [name for name in ("offload", "activation_offload", "stash") if getattr(options, name) == "always"]
    if not asks:
        return
    where = cluster.source if cluster.source != "<dict>" else f"cluster {cluster.name!r}"
    flags = " and ".join(f"{name}='always' (zorse plan --{name.replace('_', '-')} always)" for name in asks)
    lacking = [n for n, b in zip(cluster.nodes, cluster.node_host_memory_bytes) if not b]
    if len(lacking) == len(cluster.nodes):
        raise PlanOptionsError(
            f"{where}: {flags} keeps every stage's {' and '.join(_HELD[a] for a in asks)} in host memory, but no "
            f"node gives host_memory_GiB: add host_memory_GiB (the GiB of RAM training may use on that node, e.g. "
            f"host_memory_GiB: 512) to the nodes, or set {' and '.join(asks)} to 'auto'")
    if lacking and not options.allow_idle_gpus:
        raise PlanOptionsError(
            f"{where}: {flags} with every GPU in use (allow_idle_gpus=False, zorse plan --use-all-gpus): node"
            f"{'s' if len(lacking) > 1 else ''} {', '.join(lacking)} give{'' if len(lacking) > 1 else 's'} no "
            f"host_memory_GiB, so {'their' if len(lacking) > 1 else 'its'} GPUs cannot host an offloading stage; "
            f"add host_memory_GiB there, or allow idle GPUs")


def solve_plan(costs, devices, options: PlanOptions, *, progress=None) -> SolverResult:
    """The decision ``options.planner`` makes for priced blocks ``costs`` on
    ``devices`` (``plan_captured``'s solve step): "brute_force" and "stage_dp" on
    their own (the stage DP's answer then tried interleaved), the others as the
    portfolio (``portfolio.solve_portfolio``: the heuristics, then CP-SAT per GPU
    ("cpsat"; "auto" up to ``portfolio.PER_GPU_MAX_GPUS`` GPUs) or per GPU class
    ("grouped"), then ZeRO-2/3 and interleaving tried on the winner).
    ``progress``: called with a line at each stage of the search.

    Raises:
        InfeasiblePlanError: no plan fits (the message names the constraint).
    """
    from .portfolio import auto_planner, solve_portfolio
    from .solve.grouped import solve_grouped
    from .solve.interleave import with_interleaving
    from .solve.stage_dp import solve_stage_dp

    planner = options.planner if options.planner != "auto" else auto_planner(devices.num_gpus)
    if planner == "brute_force":  # the exhaustive oracle of one stage per group, on its own
        return solve_brute_force(costs, devices, options)
    if planner == "stage_dp":  # on its own, without the portfolio
        result = solve_stage_dp(costs, devices, options, progress=progress)
        if result.status == "STAGE_DP_INFEASIBLE":
            raise InfeasiblePlanError(f"planner 'stage_dp': its best plan does not fit: "
                                      f"{list(next(c.violations for c in result.candidates if c.chosen))}")
        return with_interleaving(costs, devices, options, result)
    solve = {"cpsat": solve_cpsat, "grouped": solve_grouped}[planner]  # PlanOptions checked the name
    return solve_portfolio(costs, devices, options, solve, progress=progress)


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
    the simulated step, bubble and peak memory go into ``plan.solver``. Where
    it leaves GPUs idle, ``plan.idle_gpus`` names them with the best plan
    scored that uses them (``idle.idle_gpus``).

    Raises:
        PlanOptionsError: an offload "always" the cluster has no host memory for
            (``check_host_memory``).
        InfeasiblePlanError: no plan fits (the message names the constraint).
        PlanCheckError: the simulator finds a GPU over memory (a zorse_fx bug).
    """
    say = progress or (lambda msg: log.info(msg))
    t0 = time.perf_counter()
    check_host_memory(cluster, options)
    priced = price(captured, cluster, options, progress=say)
    bg, costs, policy = priced.blocks, priced.costs, priced.precision
    say(f"analysed graph: {len(bg.act_order)} activation nodes, {bg.num_blocks} blocks at legal cut points")
    devices = priced.devices
    result = solve_plan(costs, devices, options, progress=say)
    from .portfolio import auto_planner

    planner = options.planner if options.planner != "auto" else auto_planner(devices.num_gpus)
    result = dataclasses.replace(result, decision=dataclasses.replace(result.decision, precision=policy.name))
    from .solve.bounds import throughput_bound_s

    bound = throughput_bound_s(costs, devices, options)  # valid for every plan of these options
    say(f"solved: {result.num_stages} stages, {result.decision.num_microbatches} micro-batches, "
        f"status {result.status}, {result.predicted_step_time_s / bound - 1:.0%} slower than the throughput "
        f"bound {fmt_seconds(bound)}, {result.wall_s:.2f} s" if bound > 0 else
        f"solved: {result.num_stages} stages, status {result.status}, {result.wall_s:.2f} s")
    if result.wall_clock_stops:  # [Note: reproducible plans]
        msg = (f"the wall-clock safety stop (time_limit_s={options.time_limit_s:g} s) ended "
               f"{result.wall_clock_stops} CP-SAT solve(s) before their budget (solver_budget="
               f"{options.solver_budget:g} deterministic s): this plan may differ on another run or machine; "
               f"raise time_limit_s (zorse plan --time-limit) or lower solver_budget (--solver-budget)")
        log.warning(msg)
        say(f"warning: {msg}")
    from .sim.check import check_result

    check = check_result(costs, devices, options, result)  # raises PlanCheckError on a memory breach
    say(check.summary())
    for w in check.warnings:
        log.warning(w)
        say(f"warning: {w}")
    idle = idle_gpus(costs, devices, options, result, cluster)  # [Note: idle GPUs said aloud] in idle.py
    plan = build_plan(bg, cluster, result, options, model_name=model_name, label_mode=label_mode,
                      precision=policy, planner=planner, check=check, throughput_bound_s=bound, idle_gpus=idle)
    say(f"codegen: {plan.num_stages} stage modules ({time.perf_counter() - t0:.1f} s total)")
    return plan, bg


def plan_fixed(
    captured: CapturedModel,
    cluster: Cluster,
    options: PlanOptions,
    decision: Decision,
    *,
    model_name: str = "model",
    label_mode: str = "shifted",
) -> tuple[Plan, BlockGraph]:
    """A plan for a decision made by hand (what-if studies, tests), priced by
    the same cost model and objective as the solver's plans. The decision's
    memory policy and interleave degree are taken as given (a sharded stage
    whose ``shard_mib`` is None gets the shards ``balance_shards`` picks);
    ``options`` are relaxed so that any well-formed decision is scored
    (stages, micro-batch counts, idle GPUs, sharding and recomputation all
    allowed).

    Raises:
        ValueError: the decision does not fit the model or cluster (see
            ``zorse_fx.solve.Decision.check``), or its ``precision`` is not the
            one ``options`` resolve to on ``cluster``.
    """
    from .solve import evaluate

    priced = price(captured, cluster, options)
    bg, costs, policy = priced.blocks, priced.costs, priced.precision
    if decision.precision and decision.precision != policy.name:
        raise ValueError(f"Decision.precision={decision.precision!r} but the options price {policy.name!r} on "
                         f"cluster {cluster.name!r}: pass PlanOptions(precision={decision.precision!r}) or leave "
                         f"Decision.precision empty")
    relaxed = dataclasses.replace(options, max_stages=max(options.max_stages, decision.num_groups),
                                  max_interleave=max(options.max_interleave, decision.interleave),
                                  num_microbatches=None, max_microbatches=options.global_batch_size,
                                  allow_idle_gpus=True, sharding="auto", recompute="auto")
    ev = evaluate(costs, priced.devices, relaxed,
                  dataclasses.replace(decision, precision=policy.name))
    result = SolverResult.from_evaluation(ev, options=relaxed, status="FIXED", best_bound=ev.step_time_s)
    plan = build_plan(bg, cluster, result, options, model_name=model_name, label_mode=label_mode,
                      precision=policy, planner="fixed")
    return plan, bg
