"""The OR-Tools CP-SAT planner.

One CP-SAT model per (S stages, M micro-batches); the best feasible plan over
all pairs wins (ties: fewer stages, then fewer micro-batches). The model is
the "step-time model" note of objective.py, in the same integer units (1 ns,
bytes); constraints carry the same tags ([C-assign], [C-memory], ...). Every
derived quantity is defined by an equality (linear sums, max, flag ? value : 0,
one small product for the all-reduce latency), never by a one-sided bound, so
the objective value of *any* solution CP-SAT returns, optimal or not, equals
``evaluate()`` of the decision; ``solve_cpsat`` checks that on every answer.

[Note: warm start]
``hints`` (SolverResults, in practice the baselines' feasible plans, best
first; ``solve/portfolio.py``) seed the candidate with the same (S, M):
``_Model.hint`` gives CP-SAT the cuts, GPU assignment, samples, shards and
memory policy via ``AddHint``. A hint only guides the search (CP-SAT repairs
an infeasible one), so it cannot change the optimum, only how soon a good
incumbent appears under the time limit.
"""

from __future__ import annotations

from ortools.sat.python import cp_model

from ..options import PlanOptions
from .objective import (MIB_UNITS, IntTables, build_tables, inflight, max_stage_count,
                        microbatch_candidates)
from ._encoding import StageCuts
from ._encoding import any_of as _any_of
from ._encoding import blocks_of as _blocks
from ._encoding import both as _both
from ._encoding import gated as _gated
from ._encoding import pair_max
from ._search import CandidateSearch
from .decision import Decision
from .records import BlockCosts, DeviceGraph, SolverResult

__all__ = ["solve_cpsat"]


def _interchangeable(devices: DeviceGraph, tab: IntTables, g: int, h: int) -> bool:
    """GPUs g and h can be swapped in any plan without changing its cost:
    same type, node, memory, memory bandwidth and links to every other GPU."""
    nodes = devices.node_names or ("",) * devices.num_gpus
    if (devices.gpu_types[g], nodes[g], tab.cap_bytes[g], tab.gpu_mbw_class[g]) != \
            (devices.gpu_types[h], nodes[h], tab.cap_bytes[h], tab.gpu_mbw_class[h]):
        return False
    return all(tab.pair_bw_class[g][k] == tab.pair_bw_class[h][k] and tab.pair_lat[g][k] == tab.pair_lat[h][k]
               for k in range(devices.num_gpus) if k not in (g, h))


class _Model:
    """CP-SAT model of one (S, M) candidate. Times in ns units, memory in bytes.

    Encoding: block membership is linear. ge[s][k] <=> c_s <= k (monotone in k),
    so "block k is in stage s" is in_s[s][k] = ge[s][k] - ge[s+1][k] and every
    per-stage sum (work, params, activations, all-reduce, optimizer) is a
    weighted sum of in_s. z[g][k] = samples GPU g pushes through block k
    (n_g if k is in g's stage, else 0), so compute_g = sum_k w[k] z[g][k] and
    activations A_s n_g = sum_k act[k] z[g][k] are linear too; this gives the LP
    relaxation the throughput bound that product constraints do not.
    """

    def __init__(self, tab: IntTables, devices: DeviceGraph, options: PlanOptions, num_stages: int):
        self.tab, self.S = tab, num_stages
        self.m = m = cp_model.CpModel()
        n_s, n_g, nb, b = num_stages, tab.num_gpus, tab.num_blocks, tab.microbatch_size
        gpus, stages, blocks = range(n_g), range(n_s), range(nb)
        wsum = cp_model.LinearExpr.WeightedSum

        # [C-assign] x[g][s]: GPU g works in stage s; each GPU in <= 1 stage (== 1 without idling).
        self.x = x = [[m.NewBoolVar(f"x_{g}_{s}") for s in stages] for g in gpus]
        for g in gpus:
            (m.AddExactlyOne if not options.allow_idle_gpus else m.AddAtMostOne)(x[g])
        size = [sum(x[g][s] for g in gpus) for s in stages]
        for s in stages:
            m.Add(size[s] >= 1)
            m.Add(size[s] <= b)  # every GPU of the stage takes >= 1 of the b samples

        # [C-cuts] contiguous stage ranges (encoding in _encoding.py).
        cuts = StageCuts(m, nb, n_s)
        self.cut, in_s = cuts.cut, cuts.in_s
        stage_sum, at_cut = cuts.stage_sum, cuts.at_cut

        def gated(flag, value, hi, name):
            return _gated(m, flag, value, hi, name)

        # [C-shard] / [C-recompute] per-stage memory policy (absent when the mode is "never").
        self.sh, self.rc = sh, rc = _policy_vars(m, tab, size, n_s)

        def any_of(lits, name):
            return _any_of(m, lits, name)

        def both(a, c, name):
            return _both(m, a, c, name)

        # [C-samples] n[g][s] in [1, b] iff x[g][s], else 0; sum over the stage = b.
        # z[g][k] = n[g][s] for the stage s holding block k (so 0 off g's stage).
        self.n = n = [[m.NewIntVar(0, b, f"n_{g}_{s}") for s in stages] for g in gpus]
        z = [[m.NewIntVar(0, b, f"z_{g}_{k}") for k in blocks] for g in gpus]
        for g in gpus:
            for s in stages:
                m.Add(n[g][s] >= 1).OnlyEnforceIf(x[g][s])
                m.Add(n[g][s] == 0).OnlyEnforceIf(x[g][s].Not())
                for k in blocks:
                    m.Add(z[g][k] == n[g][s]).OnlyEnforceIf(in_s[s][k])
        for s in stages:
            m.Add(sum(n[g][s] for g in gpus) == b)
        # u[g][k] = 1 iff GPU g runs block k (z > 0): pays the block's fixed cost.
        u = [[m.NewBoolVar(f"u_{g}_{k}") for k in blocks] for g in gpus]
        for g in gpus:
            for k in blocks:
                m.Add(z[g][k] >= 1).OnlyEnforceIf(u[g][k])
                m.Add(z[g][k] == 0).OnlyEnforceIf(u[g][k].Not())
        for k in blocks:
            m.Add(sum(z[g][k] for g in gpus) == b)  # redundant: every block sees the b samples

        # [C-compute] compute_g = n_g * W_{s,type(g)} + F_{s,type(g)}
        #             = sum_k w[type(g)][k] * z[g][k] + sum_k f[type(g)][k] * u[g][k].
        lat_hi = max(max(r) for r in tab.pair_lat)
        work_hi = b * max(p[-1] for p in tab.work_prefix.values()) + max(p[-1] for p in tab.fixed_prefix.values())
        t_hi = work_hi + 2 * (max((max(r) for r in tab.xfer), default=0) + lat_hi)
        if rc:
            work_hi += b * max(p[-1] for p in tab.rc_work_prefix.values()) + \
                max(p[-1] for p in tab.rc_fixed_prefix.values())
            t_hi = work_hi + 2 * (max((max(r) for r in tab.xfer), default=0) + lat_hi)
        tmax = m.NewIntVar(0, t_hi, "tmax")
        comp = []
        for g in gpus:
            cg = m.NewIntVar(0, work_hi, f"comp_{g}")
            extra = 0
            if rc:  # [C-compute] the recomputed forward, on GPUs of recomputing stages
                ty = tab.gpu_types[g]
                on = m.NewBoolVar(f"rcg_{g}")
                m.Add(on == sum(both(x[g][s], rc[s], f"xrc_{g}_{s}") for s in stages))
                extra = gated(on, wsum(z[g], _blocks(tab.rc_work_prefix[ty]))
                              + wsum(u[g], _blocks(tab.rc_fixed_prefix[ty])), work_hi, f"rcw_{g}")
            m.Add(cg == wsum(z[g], _blocks(tab.work_prefix[tab.gpu_types[g]]))
                  + wsum(u[g], _blocks(tab.fixed_prefix[tab.gpu_types[g]])) + extra)
            m.Add(tmax >= cg)  # redundant (throughput bound for the LP)
            comp.append(cg)
        t = []
        for s in stages:
            cs = m.NewIntVar(0, work_hi, f"comp_{s}")
            m.AddMaxEquality(cs, [gated(x[g][s], comp[g], work_hi, f"cgs_{g}_{s}") for g in gpus])
            # [C-boundary] boundary_s = 2 * (xfer + lat) over pairs (g in s, h in s+1).
            if s < n_s - 1:
                pairs = {(g, h): both(x[g][s], x[h][s + 1], f"y_{g}_{h}_{s}")
                         for g in gpus for h in gpus if g != h}
                xm, lm = pair_max(m, tab, pairs.items(), lambda k, s=s: at_cut(tab.xfer[k], s + 1),
                                  lambda k: max(tab.xfer[k]), f"bd{s}")
                bnd = 2 * xm + 2 * lm
            else:
                bnd = 0
            # [C-stage] t_s = max compute + boundary.
            ts = m.NewIntVar(0, t_hi, f"t_{s}")
            m.Add(ts == cs + bnd)
            t.append(ts)

        # [C-allreduce] ring over the stage's pairs; [C-optim] slowest memory bandwidth of the stage.
        # zsh[g][s]: MiB of stage s's shardable state on GPU g (0 unless g in s and s sharded).
        self.zsh = zsh = None
        if sh:
            zsh = [[m.NewIntVar(0, tab.cap_bytes[g] // MIB_UNITS, f"zsh_{g}_{s}") for s in stages] for g in gpus]
            for s in stages:
                for g in gpus:
                    m.Add(zsh[g][s] == 0).OnlyEnforceIf(both(x[g][s], sh[s], f"xsh_{g}_{s}").Not())
                m.Add(MIB_UNITS * sum(zsh[g][s] for g in gpus) >= stage_sum(tab.shard_prefix, s)).OnlyEnforceIf(sh[s])
            self.zsh = zsh
        opt_hi = max(max(p[-1] for p in tab.opt_prefix),
                     max((tab.cap_bytes[g] // MIB_UNITS * tab.opt_per_mib[tab.gpu_mbw_class[g]] for g in gpus),
                         default=0) if sh else 0)
        ar_hi = max((p[-1] for p in (tab.arsh_prefix if sh else tab.ar_prefix)), default=0)
        sync_hi = ar_hi + 3 * (n_g - 1) * lat_hi + opt_hi
        sync = []
        for s in stages:
            pairs = {(g, h): both(x[g][s], x[h][s], f"w_{g}_{h}_{s}") for g in gpus for h in gpus if g < h}
            if pairs:
                arb, lw = pair_max(m, tab, pairs.items(), lambda k, s=s: stage_sum(tab.ar_prefix[k], s),
                                   lambda k: tab.ar_prefix[k][-1], f"ar{s}")
                sz1 = m.NewIntVar(0, n_g - 1, f"size1_{s}")
                m.Add(sz1 == size[s] - 1)
                lat_term = m.NewIntVar(0, (n_g - 1) * lat_hi, f"arlat_{s}")
                m.AddMultiplicationEquality(lat_term, [sz1, lw])
                if sh:  # a sharded stage also all-gathers its weights: (2 grad + param) bytes
                    arb_sh, _ = pair_max(m, tab, pairs.items(), lambda k, s=s: stage_sum(tab.arsh_prefix[k], s),
                                         lambda k: tab.arsh_prefix[k][-1], f"as{s}")
                    hi = max(p[-1] for p in tab.arsh_prefix)
                    ar = (gated(sh[s].Not(), arb, hi, f"arp_{s}") + gated(sh[s], arb_sh, hi, f"ars_{s}")
                          + 2 * lat_term + gated(sh[s], lat_term, (n_g - 1) * lat_hi, f"arl_{s}"))
                else:
                    ar = arb + 2 * lat_term
            else:
                ar = 0
            opt_terms = []
            for k in sorted(set(tab.gpu_mbw_class)):
                members = any_of([x[g][s] for g in gpus if tab.gpu_mbw_class[g] == k], f"u_{k}_{s}")
                flag = both(members, sh[s].Not(), f"un_{k}_{s}") if sh else members
                opt_terms.append(gated(flag, stage_sum(tab.opt_prefix[k], s), tab.opt_prefix[k][-1], f"oz_{k}_{s}"))
            if sh:
                opt_terms += [tab.opt_per_mib[tab.gpu_mbw_class[g]] * zsh[g][s] for g in gpus]
            opt = m.NewIntVar(0, opt_hi, f"opt_{s}")
            m.AddMaxEquality(opt, opt_terms)
            sync.append(ar + opt)

        # [C-memory] state + activations <= usable KiB of g, for g in s, per policy combination.
        act = [wsum(z[g], _blocks(tab.act_prefix)) for g in gpus]
        for s in stages:
            state = stage_sum(tab.state_prefix, s)
            fl = inflight(tab.schedule, n_s, s, tab.num_microbatches)
            xin = _stage_input_kib(m, tab, cuts, s) if rc else None
            shard = stage_sum(tab.shard_prefix, s) if sh else 0
            for g in gpus:
                _memory_limit(m, tab, x[g][s], cap=tab.cap_bytes[g], state=state, shard=shard,
                              z_mib=zsh[g][s] if sh else 0, act=act[g], fl=fl, n=n[g][s], xin=xin,
                              sh=sh[s] if sh else None, rc=rc[s] if rc else None, name=f"{g}_{s}")

        # [C-symmetry] interchangeable GPUs g < h: (stage, -samples) of g <= that of h
        # (idle counts as stage S, after every real stage).
        for g in gpus:
            h = next((h for h in range(g + 1, n_g) if _interchangeable(devices, tab, g, h)), None)
            if h is not None:
                def key(q):
                    return sum((b + 1) * s * x[q][s] - n[q][s] for s in stages) + \
                        (b + 1) * n_s * (1 - sum(x[q][s] for s in stages))
                m.Add(key(g) <= key(h))

        # [C-objective] step = sum t_s + (M-1) max t_s + max (allreduce_s + optim_s).
        m.AddMaxEquality(tmax, t)
        smax = m.NewIntVar(0, sync_hi, "syncmax")
        m.AddMaxEquality(smax, sync)
        self.objective = sum(t) + (tab.num_microbatches - 1) * tmax + smax
        m.Minimize(self.objective)

    def hint(self, decision: Decision) -> None:
        """Warm start: hint ``decision`` (same S and M), e.g. a baseline's plan."""
        m = self.m
        for s, (i, _) in enumerate(decision.stage_blocks):
            m.AddHint(self.cut[s], i)
        where = {g: (s, n) for s, (gs, ns) in enumerate(zip(decision.stage_gpus, decision.samples_per_microbatch))
                 for g, n in zip(gs, ns)}
        for g in range(self.tab.num_gpus):
            for s in range(self.S):
                on = where.get(g, (None, 0))[0] == s
                m.AddHint(self.x[g][s], on)
                m.AddHint(self.n[g][s], where[g][1] if on else 0)
        shards = decision.shard_mib or ((),) * decision.num_stages
        for s in range(self.S):
            sharded = decision.sharded[s]
            if self.sh:
                m.AddHint(self.sh[s], sharded)
                for g in range(self.tab.num_gpus):
                    pos = decision.stage_gpus[s].index(g) if g in decision.stage_gpus[s] else None
                    m.AddHint(self.zsh[g][s], shards[s][pos] if sharded and shards[s] and pos is not None else 0)
            if self.rc:
                m.AddHint(self.rc[s], decision.recompute[s])

    def decision(self, solver: cp_model.CpSolver):
        """The ``Decision`` of the solver's current solution."""
        cuts = [solver.Value(c) for c in self.cut]
        blocks = tuple((cuts[s], cuts[s + 1]) for s in range(self.S))
        gpus = tuple(tuple(g for g in range(self.tab.num_gpus) if solver.BooleanValue(self.x[g][s]))
                     for s in range(self.S))
        samples = tuple(tuple(solver.Value(self.n[g][s]) for g in gs) for s, gs in enumerate(gpus))
        sharded = tuple(bool(self.sh and solver.BooleanValue(self.sh[s])) for s in range(self.S))
        shards = tuple(tuple(solver.Value(self.zsh[g][s]) for g in gs) if sharded[s] else ()
                       for s, gs in enumerate(gpus))
        recompute = tuple(bool(self.rc and solver.BooleanValue(self.rc[s])) for s in range(self.S))
        return Decision(stage_blocks=blocks, stage_gpus=gpus, samples_per_microbatch=samples,
                        num_microbatches=self.tab.num_microbatches, sharded=sharded, shard_mib=shards,
                        recompute=recompute)


def _policy_vars(m: cp_model.CpModel, tab: IntTables, size, n_s: int):
    """Per-stage booleans sh[s] ([C-shard]: only with >= 2 GPUs) and rc[s]
    ([C-recompute]); None for a mode "never", fixed for "always"."""
    sh = rc = None
    if tab.sharding != "never":
        sh = [m.NewBoolVar(f"sh_{s}") for s in range(n_s)]
        for s in range(n_s):
            m.Add(size[s] >= 2).OnlyEnforceIf(sh[s])
            if tab.sharding == "always":
                m.Add(size[s] <= 1).OnlyEnforceIf(sh[s].Not())
    if tab.recompute != "never":
        rc = [m.NewBoolVar(f"rc_{s}") for s in range(n_s)]
        if tab.recompute == "always":
            for v in rc:
                m.Add(v == 1)
    return sh, rc


def _memory_limit(m: cp_model.CpModel, tab: IntTables, present, *, cap, state, shard, z_mib, act, fl, n, xin,
                  sh, rc, name: str) -> None:
    """[C-memory] of one GPU (or class member) on one stage, for each memory-policy
    combination: (sh ? state - shard + z MiB : state) + (rc ? fl * n * X_s + act :
    fl * act) <= cap (KiB), enforced when ``present``. ``sh`` / ``rc``: the
    stage's policy literals, None when the mode is "never"; ``xin``: X_s (None
    for stage 0); ``act`` = n * A_s."""
    states = [(state, [])] if sh is None else \
        [(state, [sh.Not()]), (state - shard + MIB_UNITS * z_mib, [sh])]
    acts = [(fl * act, [])]
    if rc is not None:
        cin = 0
        if xin is not None:
            cin = m.NewIntVar(0, tab.microbatch_size * tab.cut_kib_max, f"cin_{name}")
            m.AddMultiplicationEquality(cin, [n, xin])
        acts = [(fl * act, [rc.Not()]), (fl * cin + act, [rc])]
    for st_expr, l1 in states:
        for act_expr, l2 in acts:
            m.Add(st_expr + act_expr <= cap).OnlyEnforceIf([present, *l1, *l2])


def _stage_input_kib(m: cp_model.CpModel, tab: IntTables, cuts: StageCuts, s: int):
    """IntVar = X_s, the cut KiB per sample entering stage s (None for s = 0: nothing)."""
    if s == 0:
        return None
    v = m.NewIntVar(0, tab.cut_kib_max, f"xin_{s}")
    m.Add(v == cuts.at_cut(tab.cut_kib, s))
    return v


def matching_hint(hints, num_stages: int, num_microbatches: int):
    """The first of ``hints`` (SolverResults) whose decision has this S and M, or None."""
    return next((h for h in hints if h.decision.num_stages == num_stages
                 and h.decision.num_microbatches == num_microbatches), None)


def solve_cpsat(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions, *, hints=()) -> SolverResult:
    """Plan with CP-SAT: minimise the predicted step time (seconds) over (S, M).

    ``objective`` / ``best_bound`` are in seconds. ``status`` is "OPTIMAL" only
    when every candidate was solved to optimality (or proven infeasible) and
    ``best_bound`` is the smallest bound over all candidates, so the gap
    covers the whole (S, M) search. ``hints``: decisions (SolverResults, e.g.
    the baselines') to warm-start the candidate with the same S and M.
    Raises InfeasiblePlanError if nothing fits.
    """
    search = CandidateSearch(costs, devices, options, label="CP-SAT")
    for n_s in range(1, max_stage_count(costs, devices, options) + 1):
        for m in microbatch_candidates(options):
            tab = build_tables(costs, devices, options, m)
            model = _Model(tab, devices, options, n_s)
            h = matching_hint(hints, n_s, m)
            if h is not None:
                model.hint(h.decision)
            search.solve(model, n_s, m, **({"hint": h.status} if h is not None else {}))
    return search.result()
