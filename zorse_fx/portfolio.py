"""Portfolio: the CP-SAT planner, checked against every baseline heuristic.

CP-SAT under a time limit can stop at a poor incumbent on large clusters
(bench/LOG.md, "Planner scaling (issue 4, first results)"). The baselines (``zorse_fx/baselines``)
are fast and score decisions with the same objective, and so is zorse_fx's
own memory-first stage DP (``solve/stage_dp.py``, which finds plans where memory is
too tight for both the baselines' recipes and an objective-driven CP-SAT
search). The planner runs them first, hands their feasible plans to CP-SAT as
hints (``AddHint``: the candidate with the same stages and micro-batches
starts from the plan) and keeps the best *feasible* decision. The result says
which one won (``status`` "OPTIMAL"/"FEASIBLE" from CP-SAT, "STAGE_DP" when
the stage DP's plan beat an unproven CP-SAT incumbent, or "BASELINE:<name>"
for a baseline); the optimality gap keeps CP-SAT's bound, so it is reported
against the returned plan. Last, ``solve.interleave.with_interleaving`` re-cuts the
winner's GPU groups into interleaved stages and keeps that when the objective
scores it faster (status ``<status>+INTERLEAVED``; [Note: interleave search]).

[Note: ZeRO-2 outside CP-SAT]
Sharded gradients (ZeRO-2, [C-grad-shard] in ``solve/objective.py``) are
scored by the evaluator, chosen per stage by the stage DP and the brute-force
oracle, and tried on the winner by ``_try_grad_sharding``; the CP-SAT model
does not have them. Why: in the objective a ZeRO-2 stage's sync term is M
reduce-scatters (half an all-reduce ring each) and the all-gather, counted
as all after its last backward (the runtime spreads them over the
backwards: conservative), and its optimizer step reads the gradient shard
too; with M >= 2 that is never less than ZeRO-1's all-reduce and
all-gather, so ZeRO-2 can win only by what its memory buys (fewer stages,
more micro-batches in flight, no recomputation) -- exactly the plans the
memory-first stage DP searches. Adding the choice to CP-SAT (drafted:
per-stage literals, the shifted memory states, a third sync term) made
OR-Tools 9.15's presolve declare a worse solution OPTIMAL on a random
instance of tests/test_solver.py (the bug of [Note: presolve bug] in
``solve/_search.py``; right with presolve off), and would enlarge every
candidate's model. So the CP-SAT candidates stay ZeRO-2-free and get
ZeRO-2-free warm starts (``Selector.feasible_per_candidate(plain=True)``),
a CP-SAT optimum is proven over ZeRO-2-free plans only (a stage DP plan
with ZeRO-2 that beats it is returned, with the throughput bound as its
bound), and the winner's sharded stages are each tried with ZeRO-2 and
without recomputation. The same holds for offload. An "always" of these flags
(ZeRO-2/3 or offload on every stage, [Note: memory flags] in
``zorse_fx/options.py``) rules out every plan of the CP-SAT models with a stage
of two or more GPUs, so the portfolio does not run CP-SAT then
(``solve._search.outside_model``): the heuristics, which honour it, make the
plan, with the throughput bound as its bound.
"""

from __future__ import annotations

import dataclasses
import inspect
import time

from .errors import InfeasiblePlanError
from .ir.costs import BlockCosts
from .ir.devices import DeviceGraph
from .ir.result import Candidate, SolverResult, with_safety_stop
from .options import PlanOptions

__all__ = ["solve_portfolio", "LARGE_CLUSTER_GPUS", "CHEAP_BASELINES", "PER_GPU_MAX_GPUS", "auto_planner",
           "rerank_by_simulator", "RERANK_WINDOW", "RERANK_TOP", "SIM_RERANKED", "POLISHED", "POLISH_STARTS", "polished"]

#: ``planner="auto"``: the per-GPU CP-SAT model up to this many GPUs, the
#: class-level one (``solve/grouped.py``, GPUs of one class in one group)
#: beyond. At 16 GPUs the per-GPU model has 4,700-7,700 variables per candidate
#: and CP-SAT found nothing better than the heuristics in 2 deterministic s on
#: AMP's scenario (12 x V100 + 4 x T4, 11-17 s wall per candidate on the 2-core
#: machine), where the class-level model proved 10 of its 24 candidates in
#: 15 s for the whole search (bench/LOG.md, issue 32).
PER_GPU_MAX_GPUS = 8


def auto_planner(num_gpus: int) -> str:
    """The CP-SAT planner ``planner="auto"`` picks: "cpsat" (per GPU) up to
    ``PER_GPU_MAX_GPUS`` GPUs, "grouped" (GPU classes) beyond."""
    return "cpsat" if num_gpus <= PER_GPU_MAX_GPUS else "grouped"

#: Above this many GPUs only the baselines whose cost is linear in the GPU count
#: run: the graph-partitioning ones (Stoer-Wagner min-cut, spectral) and the
#: Metis enumeration took minutes on 512 GPUs but 0.4-3.4 s on 128; with the
#: limit at 64, the skipped FlashFlex baseline beat an unproven CP-SAT answer
#: on Zorse C (128 GPUs; bench/LOG.md, "Scenario benchmark with ZeRO-1 sharding and
#: recomputation (issue 4, second results, superseded by the third)").
LARGE_CLUSTER_GPUS = 128
CHEAP_BASELINES = ("homogeneous_all", "homogeneous_best", "cephalo")


def solve_portfolio(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions, solver,
                    progress=None) -> SolverResult:
    """Best feasible of ``solver(costs, devices, options)`` and every baseline.
    ``progress``: called with a line when the heuristics have a plan (the first
    feasible plan, within seconds), then per CP-SAT candidate (the solver's own
    lines, where it takes ``progress``).

    Raises:
        InfeasiblePlanError: neither CP-SAT nor any baseline has a feasible plan
            (CP-SAT's message, which names the binding constraint).
    """
    from .solve._search import in_model, outside_model
    from .solve.bounds import throughput_bound_s
    from .solve.interleave import with_interleaving

    t0 = time.perf_counter()
    # The heuristics first: their feasible plans warm-start the CP-SAT candidates
    # with the same (stages, micro-batches) ([Note: warm start] in model.py).
    tried, found, dp_hints, dp_why = _run_heuristics(costs, devices, options)
    hints = _warm_starts(found, dp_hints)
    params = inspect.signature(solver).parameters
    kw = {"hints": tuple(r for _, _, r in hints)} if "hints" in params else {}
    # [Note: memory flags] in options.py: an "always" outside CP-SAT's model leaves the plan to the
    # heuristics, which honour it (CP-SAT's plans would all break it).
    skip = outside_model(options)
    if progress is not None:
        took = f"{time.perf_counter() - t0:.1f} s"
        then = (f"CP-SAT not run: {' and '.join(skip)} asks for what its model does not have (ZeRO-2/3, "
                f"offload), so the heuristics' plan is the answer" if skip else
                "CP-SAT next, each candidate must beat it" if found else "CP-SAT next")
        progress(f"heuristics: best plan {found[0][0]:.4g} s ({found[0][1]}), {took}; {then}" if found else
                 f"heuristics: no plan fits ({took}); {then}")
    if progress is not None and "progress" in params:
        kw["progress"] = progress
    if found and "incumbent" in params:  # [Note: incumbent cutoff] in solve/_search.py
        step, name, res = found[0]
        kw["incumbent"] = dataclasses.replace(res, status=_label(name), candidates=tuple(res.candidates))
    if skip:
        best, error = None, InfeasiblePlanError(
            f"no plan honours {' and '.join(skip)}: the stage DP (the planner that has ZeRO-2/3 and offload) "
            f"{dp_why or 'found no plan'}")
    else:
        try:
            best = solver(costs, devices, options, **kw)
            error = None
        except InfeasiblePlanError as exc:
            best, error = None, exc
    # The other answers in hand, for the simulator's re-ranking ([Note: simulator re-rank]).
    others = ([best] if best is not None else []) + [
        dataclasses.replace(r, status=_label(name)) for _, name, r in found] + [
        dataclasses.replace(r, status="STAGE_DP") for r in dp_hints]
    if best is not None and best.status == "OPTIMAL" and not (found and found[0][0] < best.predicted_step_time_s):
        # Nothing with one stage per group beats a proven optimum (ZeRO-2 aside:
        # [Note: ZeRO-2 outside CP-SAT]); interleaving or ZeRO-2 may.
        best = with_interleaving(costs, devices, options, _try_grad_sharding(costs, devices, options, best))
        best, others = polished(costs, devices, options, best, others, progress=progress)
        return _with_all_gpus(devices, rerank_by_simulator(costs, devices, options, best, others, progress=progress),
                              others)
    if found and (best is None or found[0][0] < best.predicted_step_time_s):
        # A solver without an incumbent (or none at all) lost to a heuristic.
        step, name, res = found[0]
        bound = best.best_bound if best is not None else throughput_bound_s(costs, devices, options)
        # Keep CP-SAT's per-candidate records (statuses, bounds) after the heuristic's.
        searched = tuple(best.candidates) if best is not None else ()
        stops = best.wall_clock_stops if best is not None else 0
        best = dataclasses.replace(res, status=with_safety_stop(_label(name), stops), best_bound=bound,
                                   wall_clock_stops=stops, candidates=tuple(res.candidates) + searched)
    if best is None:
        raise error
    pre = best
    bound = best.best_bound
    if not in_model(best.decision):  # CP-SAT's bound is over plans without ZeRO-2/3 and offload
        bound = min(bound, throughput_bound_s(costs, devices, options))
    step = best.predicted_step_time_s
    best = dataclasses.replace(best, best_bound=bound, optimality_gap=(step - bound) / step if step > 0 else 0.0)
    best = with_interleaving(costs, devices, options, _try_grad_sharding(costs, devices, options, best))
    best, others = polished(costs, devices, options, best, [pre] + others, progress=progress)
    best = rerank_by_simulator(costs, devices, options, best, others, progress=progress)
    return dataclasses.replace(_with_all_gpus(devices, best, others), wall_s=time.perf_counter() - t0,
                               candidates=tuple(best.candidates) + tuple(tried))


#: The status suffix of a plan the final polish improved ([Note: the final polish] in solve/polish.py).
POLISHED = "+POLISHED"


#: The final polish starts from the answer and from up to this many other distinct plans in hand, the
#: objective's next best ([Note: the final polish] in solve/polish.py).
POLISH_STARTS = 3


def polished(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions, best: SolverResult, others,
             *, progress=None) -> tuple[SolverResult, list]:
    """``(best, others)`` after the final polish ([Note: the final polish] in solve/polish.py), run from
    ``best`` and from the next best distinct feasible plans of ``others`` (``POLISH_STARTS`` in all; a
    plan the objective prices a little slower can be one step from a faster one): where a start's polish
    finds a plan the objective prices faster than ``best``, the fastest such (status ``<its start's
    status>+POLISHED``, best's bound where it covers it, the throughput bound otherwise) with ``best`` and
    the other polished plans put first among ``others``, so the simulator's re-rank keeps a polished plan
    only where it simulates faster too; else unchanged. ``best`` records a Candidate of kind "polish" per
    start."""
    from .solve._search import in_model
    from .solve.bounds import throughput_bound_s
    from .solve.polish import polish

    starts, seen = [best], {best.decision}
    for r in sorted(others, key=lambda r: r.predicted_step_time_s):  # stable: ties in the order given
        if len(starts) >= POLISH_STARTS:
            break
        if r.decision not in seen:
            seen.add(r.decision)
            starts.append(r)
    from .solve.objective import evaluate

    to_beat = evaluate(costs, devices, options, best.decision).objective_units
    records, found = [], []
    for start in starts:
        ev, spent = polish(costs, devices, options, start.decision)
        records.append(Candidate(kind="polish", source=start.status, best_bound_s=start.predicted_step_time_s,
                                 step_time_s=None if ev is None else ev.step_time_s, evaluations=spent))
        if ev is not None and ev.objective_units < to_beat:
            found.append((ev.objective_units, len(found), ev, start))
    candidates = tuple(best.candidates) + tuple(records)
    if not found:
        return dataclasses.replace(best, candidates=candidates), list(others)
    bound = min(best.best_bound, throughput_bound_s(costs, devices, options))
    polished_plans = []
    for _, _, ev, start in sorted(found, key=lambda f: f[:2]):
        status = with_safety_stop(start.status + POLISHED, best.wall_clock_stops)
        b = best.best_bound if in_model(ev.decision) else bound
        polished_plans.append(dataclasses.replace(
            SolverResult.from_evaluation(ev, options=options, status=status, best_bound=b, candidates=candidates),
            wall_clock_stops=best.wall_clock_stops, all_gpus=best.all_gpus))
    better = polished_plans[0]
    if progress is not None:
        progress(f"polish: {best.predicted_step_time_s:.4g} s -> {better.predicted_step_time_s:.4g} s from "
                 f"{better.status.split('+POLISHED')[0]}'s plan (a cut, a sample, a stage's memory policy or the "
                 f"micro-batch count one step over; {sum(r.evaluations for r in records)} evaluations)")
    return better, [best] + polished_plans[1:] + list(others)


#: [Note: simulator re-rank]: plans the objective prices at most this fraction
#: slower than its best are simulated too. The simulator/objective ratio of the
#: planners' answers spans 0.838-1.020 (bench/README.md, "Objective vs
#: simulator", 58 plans), so a plan priced up to 1/0.838 - 1 = 19% slower can
#: simulate faster; 20% covers that span.
RERANK_WINDOW = 0.20
#: At most this many plans are simulated (the objective's best and the next
#: best distinct ones within ``RERANK_WINDOW``).
RERANK_TOP = 4
#: The status suffix of a plan the simulator preferred to the objective's best.
SIM_RERANKED = "+SIM_RERANKED"


def rerank_by_simulator(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions, best: SolverResult,
                        others, *, progress=None) -> SolverResult:
    """The plan the simulator finds fastest among ``best`` (the objective's
    answer) and the best few of ``others`` (other feasible answers in hand:
    CP-SAT's, the heuristics', the stage DP's per (stages, micro-batches)).

    [Note: simulator re-rank]
    The objective prices a step in closed form; the event-driven simulator
    (``sim/engine.py``) replays it message by message, with shared links and
    the exact 1F1B order, and differs by up to 16% on the planners' answers
    (data-parallel lanes drifting apart on a shared link, small-M 1F1B:
    bench/README.md, "Objective vs simulator"), which is enough to rank two
    close plans wrongly. So the simulator is the final judge: ``best`` and up
    to ``RERANK_TOP - 1`` other distinct decisions priced within
    ``RERANK_WINDOW`` of it (by predicted step, ties in the order given) are
    simulated, and the fastest simulated one is returned; ties (at the
    objective's 1 ns units) go to ``best``, then to the order given, so the
    same inputs give the same plan. A plan other than ``best`` gets status
    ``<its status>+SIM_RERANKED``, keeps its own (objective) predicted step,
    and its gap is against ``best``'s bound where that covers it (the
    throughput bound otherwise). Every simulated plan is recorded as a
    Candidate of kind "rerank" (both step times, ``chosen``; a plan the
    simulator refuses has None and is never chosen). Deterministic:
    the simulator has no randomness and no wall-clock input.
    """
    from .ir.p2p import ProgramError
    from .sim.engine import simulate
    from .solve._search import in_model
    from .solve.isolated import map_isolated, work_jobs
    from .solve.bounds import throughput_bound_s
    from .solve.objective import UNITS_PER_S

    limit = best.predicted_step_time_s * (1 + RERANK_WINDOW)
    finalists, seen = [best], {best.decision}
    for r in sorted(others, key=lambda r: r.predicted_step_time_s):  # stable: ties in the order given
        if len(finalists) >= RERANK_TOP or r.predicted_step_time_s > limit:
            break
        if r.decision not in seen:
            seen.add(r.decision)
            finalists.append(r)
    if len(finalists) == 1:
        return best
    t0 = time.perf_counter()
    sims = []
    jobs = work_jobs(options, devices.num_gpus)
    runs = map_isolated([lambda d=r.decision: simulate(costs, devices, options, d).step_time_s for r in finalists],
                        jobs)  # side by side in forked children (solve/isolated.py); the answers in order
    for ok, answer in runs:
        if ok:
            sims.append(answer)
        elif isinstance(answer, (ValueError, RuntimeError, ProgramError)):
            sims.append(float("inf"))  # not a plan the runtime would run: never chosen
        else:
            raise answer
    k = min(range(len(finalists)), key=lambda i: (round(sims[i] * UNITS_PER_S), i))
    records = tuple(Candidate(kind="rerank", source=r.status, num_stages=r.num_stages,
                              num_microbatches=r.decision.num_microbatches, interleave=r.decision.interleave,
                              step_time_s=r.predicted_step_time_s,
                              simulated_step_time_s=sims[i] if sims[i] < float("inf") else None, chosen=i == k)
                    for i, r in enumerate(finalists))
    if progress is not None:
        progress(f"simulator re-rank of the {len(finalists)} best plans ({time.perf_counter() - t0:.1f} s): "
                 + ("the objective's best is also the simulator's" if k == 0 else
                    f"{finalists[k].status} simulates {sims[k]:.4g} s against the objective's best's "
                    f"{sims[0]:.4g} s; taking it"))
    if k == 0:
        return dataclasses.replace(best, candidates=tuple(best.candidates) + records)
    pick = finalists[k]
    bound = best.best_bound if in_model(pick.decision) else min(best.best_bound,
                                                                 throughput_bound_s(costs, devices, options))
    step = pick.predicted_step_time_s
    return dataclasses.replace(pick, status=with_safety_stop(pick.status + SIM_RERANKED, best.wall_clock_stops),
                               best_bound=bound, optimality_gap=(step - bound) / step if step > 0 else 0.0,
                               wall_clock_stops=best.wall_clock_stops,
                               candidates=tuple(best.candidates) + records)


def _run_heuristics(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions):
    """``solve_portfolio``'s heuristics (the stage DP, then the baselines): ``(tried, found, dp_hints,
    dp_why)``, the portfolio's Candidate per heuristic with a plan, the feasible ``(step s, name, plan)``
    by step time (ties in the heuristics' fixed order), the stage DP's per-(S, M) plans and why the
    stage DP has no feasible plan ("" when it has)."""
    from .baselines import BASELINES
    from .solve.isolated import map_isolated, work_jobs
    from .solve.objective import build_tables, evaluate_result, microbatch_candidates
    from .solve.stage_dp import stage_dp_search

    tried, found, dp_hints = [], [], ()
    names = BASELINES if devices.num_gpus <= LARGE_CLUSTER_GPUS else CHEAP_BASELINES
    sources = {"stage_dp": stage_dp_search, **{name: BASELINES[name] for name in names}}

    def heuristic(name, fn):
        def call():  # (plan, the stage DP's hints, step s, fits), or why the heuristic has no plan (a str)
            try:
                out = fn(costs, devices, options)
            except (InfeasiblePlanError, ValueError) as exc:
                return str(exc)
            res, extra = out if name == "stage_dp" else (out, ())
            ev = evaluate_result(costs, devices, options, res)
            return res, extra, ev.step_time_s, ev.feasible
        return call

    # The heuristics are independent and deterministic: up to ``jobs`` run side by side in
    # forked children, their answers taken in the order of ``sources`` (solve/isolated.py).
    # The cluster's (G, G) pair tables first, here: the children inherit them (solve/tables.py).
    build_tables(costs, devices, options, microbatch_candidates(options)[0])
    jobs = work_jobs(options, devices.num_gpus)
    dp_why = ""  # why the stage DP has no feasible plan (its message, or its best plan's violations)
    for name, (ok, answer) in zip(sources, map_isolated([heuristic(n, f) for n, f in sources.items()], jobs)):
        if not ok:
            raise answer
        if isinstance(answer, str):
            dp_why = answer if name == "stage_dp" else dp_why
            continue
        res, extra, step, feasible = answer
        if name == "stage_dp":
            dp_hints = extra
            if not feasible:
                dp_why = "its best plan does not fit: " + "; ".join(
                    next((c.violations for c in res.candidates if c.chosen), ()))
        tried.append(Candidate(kind="portfolio", source=name, step_time_s=step, feasible=feasible))
        if feasible:
            found.append((step, name, res))
    # By step time, ties in the fixed order of ``sources`` (a stable sort): never by wall time.
    found.sort(key=lambda f: f[0])
    return tried, found, dp_hints, dp_why


def _warm_starts(found, dp_hints) -> list:
    """The CP-SAT warm starts of ``solve_portfolio``: ``(step s, order, plan)`` of the heuristics' feasible
    plans CP-SAT's model can express and of the stage DP's per-(S, M) plans, by step time."""
    # Every (S, M) the stage DP reached gets its plan as a hint; the first hint of an
    # (S, M) is used, so the list is sorted by step time.
    # ([Note: ZeRO-2 outside CP-SAT]: a plan with sharded gradients is no warm start for CP-SAT.)
    return sorted([(r.predicted_step_time_s, k, r) for k, (_, _, r) in enumerate(found)
                   if all(m.zero < 2 and m.optimizer == m.activations == m.stash == "device"
                          for m in r.decision.memory)]
                  + [(r.predicted_step_time_s, len(found) + k, r) for k, r in enumerate(dp_hints)])


def _with_all_gpus(devices: DeviceGraph, best: SolverResult, others) -> SolverResult:
    """``best`` with ``all_gpus`` set where its decision leaves GPUs idle: the fastest of ``others`` (feasible
    answers in hand, as ``rerank_by_simulator`` takes them) that gives every GPU work, ties in the order given
    ([Note: idle GPUs said aloud] in idle.py: no second search)."""
    def used(r: SolverResult) -> int:
        return len({g for gs in r.decision.stage_gpus for g in gs})

    if used(best) == devices.num_gpus:
        return best
    full = [r for r in others if used(r) == devices.num_gpus]
    return dataclasses.replace(best, all_gpus=min(full, key=lambda r: r.predicted_step_time_s, default=None))


def _label(name: str) -> str:
    """The status of a plan a heuristic found: "STAGE_DP" or "BASELINE:<name>"."""
    return "STAGE_DP" if name == "stage_dp" else f"BASELINE:{name}"


def _try_grad_sharding(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions,
                       best: SolverResult) -> SolverResult:
    """``best`` with sharded gradients (ZeRO-2), or sharded gradients and
    parameters (ZeRO-3), on those of its sharded stages where the objective
    scores it faster: each stage in turn, ZeRO-2 then ZeRO-3 as
    ``options.grad_sharding`` / ``param_sharding`` allow, with its
    recomputation kept or dropped ([Note: ZeRO-2 outside CP-SAT]); shards
    re-balanced (``objective.fill_policy``). ``best`` itself when nothing is
    faster."""
    from .solve.bounds import throughput_bound_s
    from .solve.objective import evaluate, fill_policy, policy_decision, prepare

    d = best.decision
    if options.grad_sharding == "never" or not any(m.zero for m in d.memory) or d.interleave != 1:
        return best
    levels = [2] + ([3] if options.param_sharding != "never" else [])
    tab, _ = prepare(costs, devices, options, d)
    memory = list(d.memory)
    cur = evaluate(costs, devices, options, d)
    improved = False
    for s in range(d.num_stages):
        if not memory[s].zero or memory[s].activations == "host":  # (activation offload goes without ZeRO-2)
            continue
        for zero in levels:
            if memory[s].zero >= zero:
                continue
            for rc_s in dict.fromkeys((False, memory[s].recompute)):
                trial = memory.copy()
                trial[s] = dataclasses.replace(memory[s], zero=zero, recompute=rc_s, stash="device")
                pol = fill_policy(tab, d.stage_blocks, d.stage_gpus, d.samples_per_microbatch, memory=trial)
                ev = evaluate(costs, devices, options, policy_decision(
                    d.stage_blocks, d.stage_gpus, d.samples_per_microbatch, d.num_microbatches, pol))
                if ev.feasible and ev.objective_units < cur.objective_units:
                    cur, memory, improved = ev, trial, True
    if not improved:
        return best
    # CP-SAT's bound is over plans without ZeRO-2: the throughput bound holds for these too.
    bound = min(best.best_bound, throughput_bound_s(costs, devices, options))
    level = max(m.zero for m in memory)
    status = with_safety_stop(f"{with_safety_stop(best.status, 0)}+ZERO{level}", best.wall_clock_stops)
    return dataclasses.replace(SolverResult.from_evaluation(cur, options=options, status=status, best_bound=bound),
                               wall_clock_stops=best.wall_clock_stops, candidates=best.candidates)
