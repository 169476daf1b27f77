"""The (stages, micro-batches) candidate loop shared by the CP-SAT planners.

Each candidate is one CP-SAT model (any object with ``.m``, ``.objective`` and
``.decision(solver)``). Every answer is re-checked with ``evaluate``: the
model's objective at the returned solution must equal the evaluator's integer
objective (ns). ``status`` is "OPTIMAL" only when every candidate was solved to
optimality or proven infeasible, or when no candidate's bound is below the plan's
step time (a budget-limited candidate whose bound already exceeds the plan cannot
beat it: gap 0); ``best_bound`` is the smallest bound over all
candidates, so the reported gap covers the whole search. A candidate's bound
is the larger of CP-SAT's and ``bounds.throughput_lower_bound`` (valid for
every decision with its M; without it, a time-limited UNKNOWN candidate
would report 0 and pin every gap at 100%).

[Note: presolve bug]
OR-Tools 9.15.6755 (the newest release on PyPI) has a presolve bug that
declares some feasible models INFEASIBLE (google/or-tools#5274: "INFEASIBLE
with presolve enabled but OPTIMAL with presolve disabled", fixed after the
release). On Zorse B the class-level model of (7 stages, 64
micro-batches) was "INFEASIBLE" in 0.2 s although the stage DP's plan for it
satisfies every constraint (checked by solving with that plan fixed through
assumptions). Turning off presolve's inclusion step
(``presolve_inclusion_work_limit = 0``) gives the right answer there, but the
same setting crashes OR-Tools 9.15 now and then (``std::out_of_range:
absl::btree_map::at``, an abort of the whole process: once within the first
~75 ``solve_cpsat`` runs on the tests' random instances, where the default
setting ran 510 clean; seen twice in ~12 full test runs), so it is not used. Instead: a candidate whose warm start
(``hint``, a feasible plan) is declared infeasible cannot be infeasible, and
is solved again with presolve off (recorded as ``"presolve_retry": True`` in
its entry); ``complete_hint`` does the same for its copy. A candidate without
a hint that presolve wrongly declares infeasible is still lost (and may let
the search report OPTIMAL): the portfolio hints every (stages, micro-batches)
the stage DP reaches, which narrows this to the candidates no heuristic fits.
With an incumbent cutoff ([Note: incumbent cutoff]) the wrong answer became
common: on the Metis scenario (4 stages, 32 micro-batches) under the cutoff
3.4835 s presolve said INFEASIBLE although the model holds a 3.4037 s plan
(found with presolve off, or with the inclusion step off), and the search
called a worse plan OPTIMAL. So every solve under a cutoff runs with
``presolve_inclusion_work_limit = 0``; the abort that setting can cause
costs one retry of that candidate (next note), not the process.

[Note: reproducible plans]
The same inputs give the same plan, status and predicted step time on any
machine and under any load (a wall-clock limit with several workers would
make them depend on load). Every solve (each candidate, each hint
completion) stops on CP-SAT's *deterministic* time,
``max_deterministic_time = PlanOptions.solver_budget`` (work units
CP-SAT counts, "as close as possible to a second" of one worker, but the
same on a loaded machine), with a fixed ``random_seed``. Several workers stay
deterministic with ``interleave_search``: sat_parameters.proto (OR-Tools
9.15, field 136): "If this is true, then we interleave all our major search
strategy and distribute the work amongst num_workers. The search is
deterministic (independently of num_workers!), and we schedule and wait for
interleave_batch_size task to be completed before synchronizing" (with one
worker the search is sequential, deterministic anyway). The wall-clock
limit ``PlanOptions.time_limit_s`` is only a safety stop ([Note: safety
stop]): a solve it ends without a proof is recorded as
``"wall_clock_stop": True`` in its candidate, counted in
``SolverResult.wall_clock_stops``, marked in the status (``(wall-clock safety
stop)``) and warned about, since that answer may differ on another run. The
candidates are tried in a fixed order and the best is chosen by objective,
ties to the first: nothing else depends on wall time (``wall_s`` is only
reported).

[Note: safety stop]
The safety stop is a timer of this process (``timed_solve``): after
``time_limit_s`` wall seconds it calls ``CpSolver.stop_search()``, and a solve
counts as stopped by it exactly when the timer fired and the solve ended
without a proof. CP-SAT's own ``max_time_in_seconds`` is not set, because it
stops early and cannot be told apart from other stops: OR-Tools' ``TimeLimit``
(``util/time_limit.h``) "returns true ... when current_time + max(T, eps) >=
limit_time, where T is the maximum measured time interval between two
consecutive calls to LimitReached()", and presolve can go tens of seconds
between two calls while counting no deterministic time (the (1 stage, 5
micro-batches) candidate of tests/test_solver.py's memory-policy instance 1,
b = 1: ``PresolveToFixPoint`` spends 18 s in ``Domain::AdditionWith`` on the
subset-sum domains of sums of 0/1 sample counts, 0.0000003 deterministic s;
36-80 s on the 2-core machine with four busy loops), so under load the limit
fired at 80 s of 100, which the earlier test ("no proof and less deterministic
time than the budget") could only attribute to the wall clock by elimination.
The timer's stop is exact: the candidate's record says whether the timer ended
it, and a solve the deterministic budget ends is never counted.

[Note: search budget]
``PlanOptions.solver_budget`` is the whole search's CP-SAT budget in
deterministic seconds, not each candidate's: a per-candidate budget made
planning time grow with the candidate count (AMP's 24 candidates, 13 of
which spent all 5 deterministic s finding nothing better than the incumbent:
400 s). Candidates are tried in bound order ([Note: incumbent cutoff]) and
each gets an equal share of what is left (``CandidateSearch.share``), so a
candidate proven quickly passes its unspent share on to the later ones
(the share is over at most the next ``SHARE_WINDOW`` candidates, so the
first, most promising ones get the most: with every candidate spending its
share, the k-th gets (3/4)^k of a quarter of the budget);
a candidate gets at least ``MIN_CANDIDATE_BUDGET``, and once the budget is
spent the candidates left are not solved: recorded "BUDGET_SPENT" with the
bound valid without a solve (``CandidateSearch._budget_spent``). They used to
get ``MIN_CANDIDATE_BUDGET`` each, which on 128 GPUs cost about a CPU second
per candidate (building the model, presolve) and found nothing: Zorse C's 52
such solves, 49 UNKNOWN and 3 one-stage NO_BETTER (bench/LOG.md). What a
solve spent is CP-SAT's own count (``deterministic_time``, hint completion
included), so the shares, like the plan, depend only on the inputs. A
candidate stopped by its share keeps the larger of CP-SAT's bound, the
throughput bound and ``stage_count_lower_bound`` as its bound.

[Note: incumbent cutoff]
Most of a candidate's CP-SAT time went into proving that its optimum is what
it found (the demo, 21 candidates, all OPTIMAL: 35 s of 39 s). A candidate
only matters if it can beat the plan in hand, so ``CandidateSearch`` keeps an
incumbent -- the best heuristic plan the portfolio found (``incumbent=``),
then the best candidate solved -- and (1) tries the candidates in order of
``bounds.stage_count_lower_bound`` (ties: fewer stages, then fewer
micro-batches; candidates a heuristic reached come first, by its plan's step
time), (2) skips those whose bound is above the incumbent
("PRUNED"), and (3) adds ``objective <= incumbent`` to every other model, so
CP-SAT searches only for plans at least as good and proves "nothing here is"
in a fraction of the time (the demo's (3 stages, 8 micro-batches): OPTIMAL
in 2.1 s without, INFEASIBLE in 0.6 s with it). Such a candidate is
recorded as "NO_BETTER" with the incumbent + 1 ns as its bound, which is a
proof like OPTIMAL's, so the search can still say OPTIMAL. A heuristic's
plan hints its candidate only where it is within the cutoff (any other is
infeasible under it). The order, the incumbent and every cutoff depend only
on the inputs, so this stays reproducible ([Note: reproducible plans]).
When no candidate beats the incumbent, the search returns the incumbent
(its status kept, or OPTIMAL when every candidate was proven and the
incumbent is a plan of the model, see ``result``).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
import warnings
from dataclasses import dataclass

from ortools.sat.python import cp_model

from ..errors import InfeasiblePlanError, PlanOptionsError
from ..ir.costs import BlockCosts
from ..ir.devices import DeviceGraph
from ..ir.result import Candidate, SolverResult, with_safety_stop
from ..options import PlanOptions
from .bounds import explain_infeasible, stage_count_lower_bound, structure_lower_bound, throughput_lower_bound
from .isolated import (  # noqa: F401 (re-exported)
    SolverCrash, _Isolated, default_jobs, options_jobs, run_isolated, start_isolated, start_isolated_batch)
from .objective import UNIT_S, IntTables, build_tables, evaluate, max_stage_count, microbatch_candidates

__all__ = ["CandidateSearch", "SolverCrash", "run_isolated", "ordered_candidates", "in_model", "outside_model"]


def ordered_candidates(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions,
                       hints=()) -> list[tuple[int, int, IntTables]]:
    """Every (S stages, M micro-batches) candidate as (S, M, its tables), in the
    order the search tries them ([Note: incumbent cutoff]): those a heuristic
    plan of ``hints`` (SolverResults) reaches first, by that plan's step time
    (an upper bound on the candidate's optimum), then the others; within each,
    ascending ``bounds.stage_count_lower_bound``, ties to fewer stages, then
    fewer micro-batches."""
    from .model import matching_hint

    tabs = {m: build_tables(costs, devices, options, m) for m in microbatch_candidates(options)}
    cands = []
    for m, tab in tabs.items():
        for s in range(1, max_stage_count(costs, devices, options) + 1):
            h = matching_hint(hints, s, m)
            cands.append((h.predicted_step_time_s if h is not None else math.inf,
                          stage_count_lower_bound(tab, s), s, m, tab))
    cands.sort(key=lambda c: c[:4])
    return [(s, m, tab) for _, _, s, m, tab in cands]


def outside_model(options: PlanOptions) -> tuple[str, ...]:
    """The "always" of ``options`` that no plan of the CP-SAT candidate models
    honours (they have ZeRO-1 and recomputation only: [Note: ZeRO-2 outside
    CP-SAT] in portfolio.py), as ``name='always'``; () when CP-SAT can plan them.
    ([Note: memory flags] in zorse_fx/options.py: ``grad_sharding="always"`` asks for
    ZeRO-2 on every stage of two or more GPUs, ``offload="always"`` for offload on
    every stage.)"""
    return tuple(f"{name}='always'" for name in ("grad_sharding", "param_sharding", "offload", "activation_offload",
                                                 "stash") if getattr(options, name) == "always")


def in_model(decision) -> bool:
    """Whether the CP-SAT candidate models can express ``decision``'s memory
    policy: no ZeRO-2/3, no offload and no host-stashed recomputation ([Note:
    ZeRO-2 outside CP-SAT] in portfolio.py), one stage per GPU group."""
    return decision.interleave == 1 and all(m.zero < 2 and m.optimizer == m.activations == m.stash == "device"
                                            for m in decision.memory)


@dataclass(frozen=True, slots=True)
class _OwnSolution:
    """A candidate's own first-round solution as the warm start of its second-round solve."""

    decision: object
    status: str = "FIRST_ROUND"


@dataclass(frozen=True, slots=True)
class _Answer:
    """What one CP-SAT solve returned, read off the solver (picklable)."""

    code: int
    status: str
    bound: float
    objective: int | None = None
    decision: object = None
    #: The partial hint was completed first (``complete_hint``).
    hint_completed: bool = False
    #: CP-SAT's deterministic time of the solve and its hint completion (its work
    #: units, not seconds): the part of ``PlanOptions.solver_budget`` it spent.
    budget_used: float = 0.0
    #: The wall-clock safety stop ended this solve or its hint completion
    #: before the deterministic budget ([Note: reproducible plans]).
    wall_clock_stop: bool = False


def timed_solve(solver: cp_model.CpSolver, m: cp_model.CpModel, limit_s: float) -> tuple[int, bool]:
    """``solver.solve(m)`` under the wall-clock safety stop ([Note: safety stop]): a
    timer calls ``solver.stop_search()`` after ``limit_s`` seconds. Returns (status,
    stopped): stopped is True exactly when the timer fired and the solve ended
    without a proof (neither OPTIMAL, INFEASIBLE nor MODEL_INVALID)."""
    fired = threading.Event()

    def stop() -> None:
        fired.set()
        solver.stop_search()

    timer = threading.Timer(limit_s, stop)
    timer.daemon = True
    timer.start()
    try:
        code = solver.solve(m)
    finally:
        timer.cancel()
    return code, fired.is_set() and code not in (cp_model.OPTIMAL, cp_model.INFEASIBLE, cp_model.MODEL_INVALID)


def _solve(model, solver: cp_model.CpSolver, limit_s: float, completer: cp_model.CpSolver | None = None) -> _Answer:
    """Solve ``model`` (after completing its hint with ``completer``, if given) and
    read the answer off the solver; each solve under the safety stop ``limit_s``
    (``timed_solve``). Runs in the forked child: one fork per try."""
    completed, stopped = complete_hint(model.m, completer, limit_s) if completer is not None else (False, False)
    dtime = completer.response_proto.deterministic_time if completer is not None else 0.0
    code, stop = timed_solve(solver, model.m, limit_s)
    stopped = stopped or stop
    dtime += solver.response_proto.deterministic_time
    if code in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        # The objective at the returned solution (OR-Tools 9.15's ObjectiveValue() can
        # differ from it by a few ms on budget-limited FEASIBLE answers).
        return _Answer(code, solver.status_name(code), solver.best_objective_bound, int(solver.value(model.objective)),
                       model.decision(solver), completed, dtime, stopped)
    return _Answer(code, solver.status_name(code), solver.best_objective_bound, hint_completed=completed,
                   budget_used=dtime, wall_clock_stop=stopped)


def complete_hint(m: cp_model.CpModel, solver: cp_model.CpSolver, limit_s: float) -> tuple[bool, bool]:
    """Extend ``m``'s partial solution hint to every variable, in place.

    The models hint only the decisions (cuts, GPUs per stage, samples, shards,
    policy); every other variable follows from them by equalities. CP-SAT
    treats an incomplete hint as a search preference and can spend the whole
    time limit without reaching it (Zorse B, 7 stages: UNKNOWN after 3 s
    with the stage DP's plan hinted). So the hinted variables are fixed on a
    copy, the copy is solved for a feasible point (propagation does nearly
    all of it), and its values become a complete hint, which CP-SAT checks
    and keeps as its first incumbent. The copy gets at most
    ``HINT_COMPLETION_DTIME`` deterministic seconds (and the wall-clock safety
    stop ``limit_s``), so whether a hint is completed does not depend on load.
    Returns (completed, wall_clock_stop): completed False (hint left as it
    was) when the copy finds nothing, e.g. a hint the model cannot express;
    wall_clock_stop True when the safety stop ended the copy's solve first.
    Runs in this process: ``CandidateSearch`` calls it inside the forked child
    of the candidate's solve ([Note: isolated solves] in isolated.py)."""
    proto = m.proto
    hinted = list(zip(proto.solution_hint.vars, proto.solution_hint.values))
    if not hinted:
        return False, False
    fixed = m.clone()
    fixed.clear_hints()
    fixed.clear_objective()
    for v, val in hinted:
        fixed.add(fixed.get_int_var_from_proto_index(v) == val)
    solver.parameters.max_deterministic_time = min(solver.parameters.max_deterministic_time, HINT_COMPLETION_DTIME)
    code, stopped = timed_solve(solver, fixed, limit_s)
    if code == cp_model.INFEASIBLE:  # [Note: presolve bug]
        solver.parameters.cp_model_presolve = False
        code, stopped = timed_solve(solver, fixed, limit_s)
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return False, stopped
    vals = [solver.value(fixed.get_int_var_from_proto_index(v)) for v in range(len(proto.variables))]
    m.clear_hints()
    for v, val in enumerate(vals):
        m.add_hint(m.get_int_var_from_proto_index(v), val)
    # A feasible point found before the safety stop is as good a hint as any other.
    return True, False


#: CP-SAT deterministic seconds (work units, not seconds) at most to complete a
#: hint (``complete_hint``).
HINT_COMPLETION_DTIME = 2.0

#: The smallest deterministic budget a candidate gets once the search budget is
#: spent ([Note: search budget]): enough for presolve to prove the easy ones.
MIN_CANDIDATE_BUDGET = 0.02

#: A candidate's share is what is left over at most this many candidates
#: ([Note: search budget]): the first, most promising candidates get more.
SHARE_WINDOW = 4

#: [Note: candidate waves]
#: Candidates are solved in waves of ``WAVE``: the next ``WAVE`` candidates not
#: pruned by the bar in hand (the best plan so far: the incumbent's or a solved
#: candidate's) are each cut off at that bar and given an equal share of the
#: budget left (``share``, over at most ``SHARE_WINDOW`` = ``WAVE``
#: candidates), solved side by side in forked children, up to ``jobs`` at a
#: time (``PlanOptions.jobs``, ``zorse plan --jobs``; default: the cores this
#: process may use), and recorded in candidate order; the bar moves between
#: waves only. Every solve is deterministic (fixed seed, one worker,
#: deterministic budget) and sees only the wave's bar and budget, so the plan,
#: its status and every record are the same for every ``jobs`` and every
#: completion order; ``jobs`` buys wall-clock time only (on the 2-core machine
#: up to 2x on the CP-SAT part). Compared with one candidate at a time, a
#: candidate no longer sees the bar its wave-mates set, so a wave may solve one
#: or two candidates the sequential search would have pruned or cut off sooner.
WAVE = SHARE_WINDOW

#: [Note: tries batched per child]
#: A wave's first tries run ``jobs`` forked children, each solving its share of the
#: wave's candidates one after another (item i in child i mod jobs) and sending each
#: answer as it is found (``isolated.start_isolated_batch``), instead of one fork per
#: try: a fork of the planner after capture costs ~27 ms and copy-on-write faults
#: (~4,000 per try in the README's plan; bench/plan_cli.py, 2026-12-07). A child that
#: dies (OR-Tools' abort, [Note: isolated solves]) has answered the tries before the
#: one it died in; that one is the crashed try and goes on to its retries as before,
#: and those after it start on their own. Every solve is deterministic and sees only
#: its own model, so the answers and records are those of one child per try.


#: One worker, a model with fewer variables than ``SMALL_MODEL_VARS``: CP-SAT's
#: ``linearization_level`` ``SMALL_MODEL_LINEARIZATION`` instead of its default 1.
#: At level 1 the sequential search can raise the objective bound one unit (1 ns)
#: per step for seconds of LP work that count almost no deterministic time
#: (random_instance(7) of tests/conftest.py, sharding "always", 1 stage: 0.03
#: deterministic s in 10 s), a budget that does not bound the work. At level 2
#: (the "max_lp" worker's) every candidate of tests/test_solver.py's memory-policy
#: family (at most 338 variables) was proven optimal, the slowest in 1.3 s; at
#: level 1 three, at level 0 two, ran into a 3 s wall-clock limit. On large models
#: level 2's LP is the cost: the 64-GPU instance of tests/test_grouped.py (2641
#: variables at 3 stages), 3 deterministic s per candidate: step 1.196 s in 206 s
#: at level 2, 1.058 s in 47 s at level 1 (2 shared cores, loaded).
SMALL_MODEL_VARS = 1000
SMALL_MODEL_LINEARIZATION = 2
#: ... and with an incumbent cutoff ([Note: incumbent cutoff]) level 0, no LP:
#: the cutoff prunes by propagation, and the LP's work was most of the time.
#: The demo's (3 stages, M = 1..4) under the cutoff 0.08799 s, no hint, one
#: worker: level 2 0.8-1.7 s wall (0.14-0.53 deterministic s), level 0
#: 0.19-0.35 s (0.04 deterministic s), every one proven (OPTIMAL or
#: INFEASIBLE) with the same optimum.
CUTOFF_LINEARIZATION = 0


class CandidateSearch:
    """Solve candidates one by one; ``result()`` returns the best as a SolverResult."""

    def __init__(self, costs: BlockCosts, devices: DeviceGraph, options: PlanOptions, *, label: str,
                 incumbent: SolverResult | None = None, progress=None, total: int = 0):
        """``incumbent``: a feasible plan found without CP-SAT (the portfolio's best
        heuristic plan), which every candidate must beat ([Note: incumbent cutoff]);
        ``progress``: called with one line per candidate solved (candidates done of
        ``total``, its status, the best step time so far and the bound)."""
        if outside_model(options):
            raise PlanOptionsError(
                f"{label} alone cannot plan {' and '.join(outside_model(options))}: its model has ZeRO-1 and "
                f"recomputation only ([Note: ZeRO-2 outside CP-SAT] in zorse_fx/portfolio.py); plan with the "
                f"portfolio (planner 'auto', 'cpsat' or 'grouped' of zorse plan / solve_portfolio: the stage DP and "
                f"the baselines plan them) or the stage DP (planner 'stage_dp')")
        self.costs, self.devices, self.options, self.label = costs, devices, options, label
        self.progress, self.total = progress, total
        #: Solves run side by side ([Note: candidate waves]); the records do not depend on it.
        self.jobs = options_jobs(options)
        self.t0 = time.perf_counter()
        self.cands: list[dict] = []
        self.bounds: list[int] = []
        #: index of a solved candidate's record -> index of its bound in ``bounds``
        self._bound_of: dict[int, int] = {}
        #: index of a FEASIBLE (budget-limited) candidate's record -> its solution
        self._solutions: dict[int, object] = {}
        #: (record index, S, M, tables) of every candidate solved, for the second round
        self._solved: list[tuple[int, int, int, object]] = []
        self.best = None  # (objective units, microbatches, decision, Evaluation)
        self.wall_clock_stops = 0
        self._tlb: dict[int, int] = {}
        #: (S, M) -> ``_stage_bound``
        self._sb: dict[tuple[int, int], int] = {}
        #: CP-SAT deterministic seconds left of ``options.solver_budget`` ([Note: search budget]).
        self.budget_left = float(options.solver_budget)
        self.incumbent, self._inc_ev = None, None
        if incumbent is not None:
            ev = evaluate(costs, devices, options, incumbent.decision)
            if ev.feasible:
                self.incumbent, self._inc_ev = incumbent, ev

    @property
    def all_optimal(self) -> bool:
        """Every candidate tried so far is proven: OPTIMAL, NO_BETTER, INFEASIBLE or PRUNED."""
        return all(c.status in ("OPTIMAL", "NO_BETTER", "INFEASIBLE", "PRUNED") for c in self.cands)

    @property
    def bar(self) -> int | None:
        """The objective (units) a candidate must reach to matter: the best solved
        candidate's or the incumbent's, whichever is smaller (None: neither yet)."""
        objs = [x for x in (self.best and self.best[0], self._inc_ev and self._inc_ev.objective_units)
                if x is not None]
        return min(objs) if objs else None

    def _throughput_bound(self, model, m: int) -> int:
        """``bounds.throughput_lower_bound`` of the candidate's tables (valid for
        every decision with M micro-batches): the bound a candidate reports when
        CP-SAT's own is weaker, e.g. 0 after a time-limited UNKNOWN."""
        if m not in self._tlb:
            self._tlb[m] = throughput_lower_bound(model.tab)
        return self._tlb[m]

    def _stage_bound(self, tab, num_stages: int) -> int:
        """A lower bound (units) valid for every decision of the candidate (S = ``num_stages``,
        M = ``tab.num_microbatches``) without a solve: the larger of ``bounds.stage_count_lower_bound``
        and, on a cluster of at most ``bounds.STRUCTURE_MAX_GPUS`` GPUs, ``bounds.structure_lower_bound``
        ([Note: bounds of small clusters] in bounds.py)."""
        key = (num_stages, tab.num_microbatches)
        if key not in self._sb:
            self._sb[key] = max(stage_count_lower_bound(tab, num_stages), structure_lower_bound(tab, num_stages))
        return self._sb[key]

    def pruned(self, tab, num_stages: int) -> bool:
        """Skip the candidate (S = ``num_stages``, M = ``tab.num_microbatches``) when its
        lower bound (``_stage_bound``) is above the best objective a
        candidate solved so far reached: it cannot hold a better plan, nor an equal one
        (ties go to the earlier candidate anyway). Recorded as status "PRUNED" with that
        bound, which the result's bound and OPTIMAL test then include. Deterministic:
        the candidates are tried in a fixed order and only solved ones
        plus the incumbent set the bar ([Note: incumbent cutoff])."""
        if self.bar is None:
            return False
        lb = self._stage_bound(tab, num_stages)
        if lb <= self.bar:
            return False
        self.bounds.append(lb)
        self.cands.append(Candidate(kind="solve", num_stages=num_stages, num_microbatches=tab.num_microbatches,
                                    status="PRUNED", best_bound_s=lb * UNIT_S, wall_s=0.0))
        return True

    def _budget_spent(self, rest) -> None:
        """Record the candidates ``rest`` ((S, M, tables)) left when the budget is spent
        ([Note: search budget]): "PRUNED" where the bar prunes them, else "BUDGET_SPENT"
        with the bound valid without a solve (the larger of ``throughput_lower_bound`` and
        ``stage_count_lower_bound``), which the result's bound includes; one progress line."""
        spent = 0
        for n_s, m, tab in rest:
            if self.pruned(tab, n_s):
                continue
            if m not in self._tlb:
                self._tlb[m] = throughput_lower_bound(tab)
            lb = max(self._tlb[m], self._stage_bound(tab, n_s))
            self._bound_of[len(self.cands)] = len(self.bounds)
            self.bounds.append(lb)
            self.cands.append(Candidate(kind="solve", num_stages=n_s, num_microbatches=m, status="BUDGET_SPENT",
                                        best_bound_s=lb * UNIT_S, wall_s=0.0))
            spent += 1
        if self.progress is not None and spent:
            self.progress(f"{self.label}: the solver budget ({self.options.solver_budget:g} deterministic s, "
                          f"--solver-budget) is spent; {spent} of {self.total or len(self.cands)} candidates "
                          f"not searched (their lower bounds kept)")

    def _solver(self, budget: float) -> cp_model.CpSolver:
        """A CP-SAT solver with ``budget`` deterministic seconds ([Note: reproducible plans])."""
        opts = self.options
        solver = cp_model.CpSolver()
        p = solver.parameters
        p.max_deterministic_time = budget
        # No max_time_in_seconds: the wall-clock safety stop is ``timed_solve``'s ([Note: safety stop]).
        p.num_workers = opts.num_workers
        # sat_parameters.proto: with interleave_search "the search is deterministic
        # (independently of num_workers!)"; without it, workers race on wall time.
        p.interleave_search = opts.num_workers > 1
        if opts.num_workers > 1:
            # OR-Tools 9.15 under interleave_search: the "core" subsolver's task runs on
            # after the problem is solved, until the wall-clock limit, its deterministic
            # time growing with it (tests/test_isolated_solve.py's instance: OPTIMAL at
            # 0.02 s, returned at the limit): load-dependent and slow, so it is left out.
            p.ignore_subsolvers.append("core")
        p.random_seed = opts.seed
        return solver

    def _tune(self, solver: cp_model.CpSolver, model, cutoff: bool = False) -> None:
        """Per-model settings that depend only on the model (so stay deterministic):
        for one worker on a model with fewer than ``SMALL_MODEL_VARS`` variables,
        ``SMALL_MODEL_LINEARIZATION``, or with an incumbent cutoff ``CUTOFF_LINEARIZATION``."""
        if self.options.num_workers == 1 and len(model.m.proto.variables) < SMALL_MODEL_VARS:
            solver.parameters.linearization_level = CUTOFF_LINEARIZATION if cutoff else SMALL_MODEL_LINEARIZATION
        if cutoff:  # [Note: presolve bug]: the cutoff makes the wrong INFEASIBLE common
            solver.parameters.presolve_inclusion_work_limit = 0

    def _try(self, model, *, presolve: bool, budget: float, cutoff: bool, complete: bool):
        """One try of ``model``, to be called in a forked child: its solve, after completing its hint
        when ``complete``."""
        solver = self._solver(budget)
        self._tune(solver, model, cutoff)
        solver.parameters.cp_model_presolve = presolve
        completer = self._solver(budget) if complete else None
        return lambda: _solve(model, solver, self.options.time_limit_s, completer)

    def _start_try(self, model, *, presolve: bool, budget: float, cutoff: bool, complete: bool) -> _Isolated:
        """Start one try of ``model`` in a forked child ([Note: isolated solves] in isolated.py),
        completing its hint first when ``complete``."""
        return start_isolated(self._try(model, presolve=presolve, budget=budget, cutoff=cutoff, complete=complete))

    def _solve_robustly(self, model, *, presolve: bool, budget: float, cutoff: bool = False,
                        first: _Isolated | None = None) -> tuple[_Answer | None, list[str]]:
        """Solve ``model`` in a forked child ([Note: isolated solves] in isolated.py), a hinted
        model with its hint completed first in the same child; after a crash,
        again without the hint, then without presolve. ``first``: the first try,
        already started (``_start_try`` with ``presolve``, the hint completed when
        the model has one). Returns (the answer or None if every try crashed, the
        crash messages)."""
        crashes: list[str] = []
        had_hint = bool(model.m.proto.solution_hint.vars)
        tries = [presolve] + ([presolve] if had_hint else []) + ([False] if presolve else [])
        for k, pre in enumerate(tries):
            if k == 1 and had_hint:
                model.m.clear_hints()
            started = first if k == 0 and first is not None else self._start_try(
                model, presolve=pre, budget=budget, cutoff=cutoff, complete=k == 0 and had_hint)
            try:
                return started.result(), crashes
            except SolverCrash as exc:
                crashes.append(str(exc))
        return None, crashes

    def share(self, left: int) -> float:
        """This candidate's deterministic budget when ``left`` candidates (it
        included) remain: an equal share of what is left among at most the next
        ``SHARE_WINDOW``, at least ``MIN_CANDIDATE_BUDGET`` ([Note: search budget])."""
        return max(self.budget_left / min(max(left, 1), SHARE_WINDOW), MIN_CANDIDATE_BUDGET)

    def run(self, cands, make_model, *, hints=(), num_groups=None) -> None:
        """Solve the candidates ``cands`` ((S, M, tables), in ``ordered_candidates``'
        order) in waves ([Note: candidate waves]): each wave takes the next ``WAVE``
        candidates not pruned by the bar in hand, solves them against that bar with
        equal shares of the budget left, up to ``jobs`` at a time, and records them in
        order. ``make_model(S, tables)``: the candidate's CP-SAT model;
        ``num_groups``: a callable giving the GPU-class count recorded per candidate
        (class-level models), or None."""
        from .model import matching_hint

        k = 0
        while k < len(cands):
            if self._solved and self.budget_left < MIN_CANDIDATE_BUDGET:  # [Note: search budget]
                self._budget_spent(cands[k:])
                break
            first, wave = k, []
            while k < len(cands) and len(wave) < WAVE:
                n_s, m, tab = cands[k]
                k += 1
                if not self.pruned(tab, n_s):  # its lower bound is above a plan in hand
                    wave.append((n_s, m, tab))
            if not wave:
                continue
            share = self.share(len(cands) - first)
            self.solve_wave([(make_model(n_s, tab), n_s, m, matching_hint(hints, n_s, m)) for n_s, m, tab in wave],
                            budget=share, num_groups=num_groups() if num_groups is not None else None)
        # The second round: what the waves left of the budget goes to the candidates it
        # stopped (FEASIBLE or UNKNOWN) whose bound is below the bar, re-solved from their
        # own solution where they have one ([Note: candidate waves]).
        while self.budget_left >= MIN_CANDIDATE_BUDGET:
            again = [(i, n_s, m, tab) for i, n_s, m, tab in self._solved
                     if self.cands[i].status in ("FEASIBLE", "UNKNOWN") and not self.cands[i].second_round
                     and not self.cands[i].wall_clock_stop
                     and (self.bar is None or self.bounds[self._bound_of[i]] < self.bar)][:WAVE]
            if not again:
                break
            share = self.budget_left / len(again)
            items = []
            for i, n_s, m, tab in again:
                own = self._solutions.get(i)
                hint = (_OwnSolution(own) if own is not None else matching_hint(hints, n_s, m))
                items.append((make_model(n_s, tab), n_s, m, hint))
            self.solve_wave(items, budget=share, num_groups=num_groups() if num_groups is not None else None,
                            again=[i for i, *_ in again])

    def solve(self, model, num_stages: int, num_microbatches: int, *, hint: SolverResult | None = None,
              num_groups: int | None = None, left: int = 1) -> None:
        """Solve one candidate model and record it as a ``Candidate`` (a wave of one,
        its budget ``share(left)``; ``left``: the candidates not yet tried, this one
        included). See ``solve_wave``."""
        self.solve_wave([(model, num_stages, num_microbatches, hint)], budget=self.share(left),
                        num_groups=num_groups)

    def solve_wave(self, items, *, budget: float, num_groups: int | None = None, again=None) -> None:
        """Solve the candidates ``items`` ((model, S, M, hint)) against the bar in hand,
        each with ``budget`` deterministic seconds, up to ``self.jobs`` side by side,
        and record each as a ``Candidate``, in order. ``hint``: a heuristic plan with
        that S and M to warm-start it (``model.hint``), used only where it is within
        the cutoff; ``num_groups``: GPU classes of a class-level model. With a bar
        (``bar``), each model gets ``objective <= bar`` first ([Note: incumbent cutoff]).
        The records do not depend on ``jobs``: every solve is deterministic and sees
        only the bar of the wave's start ([Note: candidate waves]). ``again``: per item,
        the index of its first-round record (the second round), else None."""
        cutoff = self.bar
        opts = dataclasses.replace(self.options, solver_budget=budget)
        jobs = max(1, self.jobs)
        prepared = []
        for model, num_stages, m, hint in items:
            if hint is not None and cutoff is not None and \
                    evaluate(self.costs, self.devices, opts, hint.decision).objective_units > cutoff:
                hint = None  # infeasible under the cutoff: no warm start
            if hint is not None:
                model.hint(hint.decision)
            if cutoff is not None:
                model.m.add(model.objective <= cutoff)
            prepared.append((model, num_stages, m, hint.status if hint is not None else None))
        # [Note: tries batched per child]: the first tries of items g, g + jobs, g + 2 jobs, ... one after
        # another in child g; a try the child never reached (it died in an earlier one) starts on its own.
        t1 = time.perf_counter()
        batches = [start_isolated_batch([
            self._try(prepared[i][0], presolve=True, budget=budget, cutoff=cutoff is not None,
                      complete=bool(prepared[i][0].m.proto.solution_hint.vars))
            for i in range(g, len(prepared), jobs)]) for g in range(min(jobs, len(prepared)))]
        for i, (model, num_stages, m, hint) in enumerate(prepared):
            first = batches[i % jobs].results()[i // jobs]
            ans, attempts = self._solve_robustly(model, presolve=True, budget=budget, cutoff=cutoff is not None,
                                                 first=first)
            idx = again[i] if again is not None else None
            if idx is None:
                self._solved.append((len(self.cands), num_stages, m, model.tab))
            self._record(model, num_stages, m, hint, ans, attempts, opts, cutoff, num_groups, t1, again=idx)

    def _record(self, model, num_stages: int, m: int, hint: str | None, ans, attempts, opts, cutoff,
                num_groups, t1: float, again: int | None = None) -> None:
        """Record one solved candidate (see ``solve_wave``): its Candidate, bound, budget used
        and, if it beats the best so far, the best plan; its progress line. ``again``: the
        index of the candidate's first-round record, which a second-round solve updates."""
        new_bound = None
        hint_completed = bool(ans is not None and ans.hint_completed) if hint else None
        code = ans.code if ans is not None else None
        retried = False
        if code == cp_model.INFEASIBLE and hint:  # [Note: presolve bug]
            ans, more = self._solve_robustly(model, presolve=False, budget=opts.solver_budget,
                                             cutoff=cutoff is not None)
            attempts += more
            code, retried = (ans.code if ans is not None else None), True
        rec = dict(kind="solve", num_stages=num_stages, num_microbatches=m,
                   status=ans.status if ans is not None else "CRASHED", num_groups=num_groups, hint=hint,
                   hint_completed=hint_completed, presolve_retry=retried, crashes=attempts,
                   solver_budget_used=round(ans.budget_used, 6) if ans is not None else None,
                   wall_clock_stop=bool(ans is not None and ans.wall_clock_stop))
        self.budget_left -= ans.budget_used if ans is not None else opts.solver_budget
        if rec["wall_clock_stop"]:
            self.wall_clock_stops += 1
        if code in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            obj = ans.objective
            tlb = self._throughput_bound(model, m)
            if tlb > obj:
                raise AssertionError(f"{self.label}: throughput lower bound {tlb} > objective {obj} "
                                     f"for S={num_stages}, M={m}")
            bound = min(obj, max(int(round(ans.bound)), tlb))
            dec = ans.decision
            ev = evaluate(self.costs, self.devices, opts, dec)
            if ev.objective_units != obj or not ev.feasible:
                raise AssertionError(f"{self.label} objective {obj} != evaluate() {ev.objective_units} "
                                     f"(violations {ev.violations}) for S={num_stages}, M={m}: {dec}")
            rec.update(step_time_s=obj * UNIT_S)
            new_bound = bound
            if self.best is None or obj < self.best[0]:
                self.best = (obj, m, dec, ev)
            if code == cp_model.FEASIBLE:
                self._solutions[len(self.cands) if again is None else again] = dec
        elif code == cp_model.MODEL_INVALID:
            raise AssertionError(f"invalid CP-SAT model for S={num_stages}, M={m}: {model.m.validate()}")
        elif code == cp_model.INFEASIBLE and cutoff is not None:  # proven: nothing at or below the bar
            rec["status"] = "NO_BETTER"
            new_bound = cutoff + 1
        elif code != cp_model.INFEASIBLE:  # UNKNOWN (budget or safety stop without a solution) or CRASHED
            lb = ans.bound if ans is not None else 0.0
            new_bound = max(int(lb) if math.isfinite(lb) else 0, self._throughput_bound(model, m),
                            self._stage_bound(model.tab, num_stages))
        rec["wall_s"] = time.perf_counter() - t1
        if again is None:
            if new_bound is not None:
                self._bound_of[len(self.cands)] = len(self.bounds)
                self.bounds.append(new_bound)
                rec["best_bound_s"] = new_bound * UNIT_S
            self.cands.append(Candidate(**rec))
        else:  # the second round ([Note: candidate waves]): both solves' findings, merged
            old, b = self.cands[again], self._bound_of[again]
            if new_bound is not None:
                self.bounds[b] = max(self.bounds[b], new_bound)
            steps = [x for x in (old.step_time_s, rec.get("step_time_s")) if x is not None]
            self.cands[again] = dataclasses.replace(
                old, status=rec["status"], step_time_s=min(steps, default=None), best_bound_s=self.bounds[b] * UNIT_S,
                wall_s=old.wall_s + rec["wall_s"], crashes=old.crashes + attempts,
                presolve_retry=old.presolve_retry or retried, wall_clock_stop=old.wall_clock_stop or rec["wall_clock_stop"],
                solver_budget_used=round((old.solver_budget_used or 0.0) + (rec["solver_budget_used"] or 0.0), 6),
                second_round=True)
        if self.progress is not None:
            bar = self.bar
            best = f"best {bar * UNIT_S:.4g} s" if bar is not None else "no plan yet"
            pruned = sum(c.status == "PRUNED" for c in self.cands)
            self.progress(f"{self.label} candidate {len(self.cands)}/{self.total or '?'} (S={num_stages} stages, "
                          f"M={m} micro-batches): {rec['status']} in {rec['wall_s']:.1f} s; {best}, "
                          f"{self.budget_left:.2f} of {self.options.solver_budget:g} budget left"
                          + (f", {pruned} skipped by their bound" if pruned else ""))

    def result(self) -> SolverResult:
        """The best candidate, or the incumbent when no candidate beat it; raises
        InfeasiblePlanError naming the binding constraint when there is neither.

        Status OPTIMAL when every candidate was proven (OPTIMAL, NO_BETTER,
        INFEASIBLE, PRUNED) or no candidate's bound is below the plan, and the plan
        is one of the model's (an incumbent with ZeRO-2/3 or offload keeps its
        own status: other such plans were not searched); FEASIBLE for a
        candidate's plan otherwise, the incumbent's own status for the
        incumbent. ``best_bound``: the smallest candidate bound, at most the plan's."""
        stops = self.wall_clock_stops
        if stops:
            warnings.warn(
                f"{self.label}: the wall-clock safety stop (time_limit_s={self.options.time_limit_s:g} s) ended "
                f"{stops} of {len(self.cands)} CP-SAT solves before their deterministic budget "
                f"(solver_budget={self.options.solver_budget:g}): the plan may differ on another run "
                f"or machine; raise time_limit_s (zorse plan --time-limit) or lower the budget "
                f"(--solver-budget)", RuntimeWarning, stacklevel=3)
        wall = time.perf_counter() - self.t0
        if self.best is None and self.incumbent is None:
            raise InfeasiblePlanError(explain_infeasible(self.costs, self.devices, self.options, self.cands))
        if self.best is not None and (self._inc_ev is None or self.best[0] < self._inc_ev.objective_units):
            obj, _, _, ev = self.best
            own, inc = "FEASIBLE", None
        else:
            ev, inc = self._inc_ev, self.incumbent
            obj, own = ev.objective_units, with_safety_stop(inc.status, 0)
        assert ev.objective_units == obj
        # Proven optimal when every candidate was solved, or when no candidate's bound is below
        # the plan (gap 0: a candidate stopped by its budget cannot hold a better plan).
        proven = (self.all_optimal or min(self.bounds, default=obj) >= obj) and in_model(ev.decision)
        bound = min(min(self.bounds, default=obj), obj)
        res = SolverResult.from_evaluation(
            ev, options=self.options, status=with_safety_stop("OPTIMAL" if proven else own, stops),
            best_bound=bound * UNIT_S, wall_s=wall,
            candidates=(tuple(inc.candidates) if inc is not None else ()) + tuple(self.cands))
        return dataclasses.replace(res, wall_clock_stops=stops)
