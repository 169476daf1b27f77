"""The OR-Tools CP-SAT planner.

One CP-SAT model per (S stages, M micro-batches); the best feasible plan over
all pairs wins (ties: fewer stages, then fewer micro-batches). The model is
the "step-time model" note of objective.py, in the same integer units (1 ns,
bytes); constraints carry the same tags ([C-assign], [C-memory], ...). Every
derived quantity is defined by an equality (max / element / product), so the
objective value of *any* solution CP-SAT returns equals ``evaluate()`` of the
decision, which ``solve_cpsat`` checks.
"""

from __future__ import annotations

import time
from collections import defaultdict

from ortools.sat.python import cp_model

from ..errors import InfeasiblePlanError
from .objective import (UNIT_S, IntTables, build_tables, evaluate, explain_infeasible,
                        inflight, max_stage_count, microbatch_candidates)
from .records import BlockCosts, DeviceGraph, SolverOptions, SolverResult

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
    """CP-SAT model of one (S, M) candidate. Times in ns units, memory in bytes."""

    def __init__(self, tab: IntTables, devices: DeviceGraph, options: SolverOptions, num_stages: int):
        self.tab, self.S = tab, num_stages
        self.m = m = cp_model.CpModel()
        n_s, n_g, nb, b = num_stages, tab.num_gpus, tab.num_blocks, tab.microbatch_size
        gpus, stages = range(n_g), range(n_s)

        # [C-assign] x[g][s]: GPU g works in stage s; each GPU in <= 1 stage (== 1 without idling).
        self.x = x = [[m.NewBoolVar(f"x_{g}_{s}") for s in stages] for g in gpus]
        for g in gpus:
            (m.AddExactlyOne if not options.allow_idle_gpus else m.AddAtMostOne)(x[g])
        size = []
        for s in stages:
            m.Add(sum(x[g][s] for g in gpus) >= 1)
            m.Add(sum(x[g][s] for g in gpus) <= b)  # every GPU takes >= 1 of the b samples
            size.append(sum(x[g][s] for g in gpus))

        # [C-cuts] c_0 = 0 < c_1 < ... < c_S = B; stage s runs blocks [c_s, c_{s+1}).
        self.cut = cut = ([m.NewConstant(0)] + [m.NewIntVar(s, nb - n_s + s, f"c_{s}") for s in range(1, n_s)]
                          + [m.NewConstant(nb)])
        for s in stages:
            m.Add(cut[s + 1] >= cut[s] + 1)

        def ranged(prefix, name, s):
            """Sum over the blocks of stage s of a prefix-summed table (AddElement on the cuts)."""
            ends = []
            for c in (cut[s], cut[s + 1]):
                v = m.NewIntVar(0, prefix[-1], f"{name}_e")
                m.AddElement(c, list(prefix), v)
                ends.append(v)
            d = m.NewIntVar(0, prefix[-1], f"{name}_{s}")
            m.Add(d == ends[1] - ends[0])
            return d

        def gated(flag, value, hi, name):
            """flag ? value : 0."""
            z = m.NewIntVar(0, hi, name)
            m.Add(z == value).OnlyEnforceIf(flag)
            m.Add(z == 0).OnlyEnforceIf(flag.Not())
            return z

        def any_of(lits, name):
            """A boolean equal to OR(lits)."""
            p = m.NewBoolVar(name)
            m.AddMaxEquality(p, lits)
            return p

        def both(a, c, name):
            """A boolean equal to a AND c."""
            y = m.NewBoolVar(name)
            m.AddImplication(y, a)
            m.AddImplication(y, c)
            m.AddBoolOr([a.Not(), c.Not(), y])
            return y

        # [C-samples] n[g][s] in [1, b] iff x[g][s], else 0; sum over the stage = b.
        self.n = n = [[m.NewIntVar(0, b, f"n_{g}_{s}") for s in stages] for g in gpus]
        for g in gpus:
            for s in stages:
                m.Add(n[g][s] >= 1).OnlyEnforceIf(x[g][s])
                m.Add(n[g][s] == 0).OnlyEnforceIf(x[g][s].Not())
        for s in stages:
            m.Add(sum(n[g][s] for g in gpus) == b)

        # [C-compute] compute[g][s] = n[g][s] * W[s][type(g)]; comp_s = max over the stage.
        types = sorted(set(tab.gpu_types))
        comp = []
        for s in stages:
            work = {t: ranged(tab.work_prefix[t], f"W_{t}", s) for t in types}
            prods = []
            for g in gpus:
                hi = b * tab.work_prefix[tab.gpu_types[g]][-1]
                p = m.NewIntVar(0, hi, f"comp_{g}_{s}")
                m.AddMultiplicationEquality(p, [n[g][s], work[tab.gpu_types[g]]])
                prods.append(p)
            cs = m.NewIntVar(0, b * max(tab.work_prefix[t][-1] for t in types), f"comp_{s}")
            m.AddMaxEquality(cs, prods)
            comp.append(cs)

        def pair_max(pairs, s_end, xfer_tables, name):
            """(max over present pairs of xfer_tables[bw class][c], max latency), c = s_end.
            ``pairs``: {(g, h): presence bool}. Classes group pairs by bandwidth / latency."""
            by_bw, by_lat = defaultdict(list), defaultdict(list)
            for (g, h), y in pairs.items():
                by_bw[tab.pair_bw_class[g][h]].append(y)
                by_lat[tab.pair_lat[g][h]].append(y)
            terms = []
            for k, ys in by_bw.items():
                table = xfer_tables[k]
                hi = max(table)
                v = m.NewIntVar(0, hi, f"{name}_bw{k}")
                s_end(table, v)
                terms.append(gated(any_of(ys, f"{name}_p{k}"), v, hi, f"{name}_z{k}"))
            # (no IntVar.Proto(): it corrupts memory in ortools 9.15, google/or-tools#5134)
            xm = m.NewIntVar(0, max(max(xfer_tables[k]) for k in by_bw), f"{name}_x")
            m.AddMaxEquality(xm, terms)
            lm = m.NewIntVar(0, max(by_lat), f"{name}_l")
            m.AddMaxEquality(lm, [lat * any_of(ys, f"{name}_q{lat}") for lat, ys in by_lat.items()])
            return xm, lm

        # [C-boundary] boundary_s = 2 * (xfer + lat) over pairs (g in s, h in s+1); [C-stage] t_s.
        t = []
        for s in stages:
            if s < n_s - 1:
                pairs = {(g, h): both(x[g][s], x[h][s + 1], f"y_{g}_{h}_{s}")
                         for g in gpus for h in gpus if g != h}
                xm, lm = pair_max(pairs, lambda table, v, s=s: m.AddElement(cut[s + 1], list(table), v),
                                  tab.xfer, f"bd{s}")
                bnd = 2 * xm + 2 * lm
            else:
                bnd = 0
            ts = m.NewIntVar(0, 10**15, f"t_{s}")
            m.Add(ts == comp[s] + bnd)
            t.append(ts)

        # [C-allreduce] ring over the stage's pairs; [C-optim] slowest memory bandwidth of the stage.
        sync = []
        for s in stages:
            pairs = {(g, h): both(x[g][s], x[h][s], f"w_{g}_{h}_{s}")
                     for g in gpus for h in gpus if g < h}
            if pairs:
                def ar_sum(table, v, s=s):
                    m.Add(v == ranged(table, "ar", s))
                arb, lw = pair_max(pairs, ar_sum, tab.ar_prefix, f"ar{s}")
                sz1 = m.NewIntVar(0, n_g - 1, f"size1_{s}")
                m.Add(sz1 == size[s] - 1)
                lat_term = m.NewIntVar(0, (n_g - 1) * max(max(r) for r in tab.pair_lat), f"arlat_{s}")
                m.AddMultiplicationEquality(lat_term, [sz1, lw])
                ar = arb + 2 * lat_term
            else:
                ar = 0
            opt_terms = []
            for k in sorted(set(tab.gpu_mbw_class)):
                members = [x[g][s] for g in gpus if tab.gpu_mbw_class[g] == k]
                ok = ranged(tab.opt_prefix[k], f"opt{k}", s)
                opt_terms.append(gated(any_of(members, f"u_{k}_{s}"), ok, tab.opt_prefix[k][-1], f"oz_{k}_{s}"))
            opt = m.NewIntVar(0, max(p[-1] for p in tab.opt_prefix), f"opt_{s}")
            m.AddMaxEquality(opt, opt_terms)
            sync.append(ar + opt)

        # [C-memory] state_s + act_s * n_g * inflight_s <= usable bytes of g, for g in s.
        for s in stages:
            state = ranged(tab.state_prefix, "state", s)
            act = ranged(tab.act_prefix, "act", s)
            fl = inflight(tab.schedule, n_s, s, tab.num_microbatches)
            for g in gpus:
                a = m.NewIntVar(0, b * tab.act_prefix[-1], f"act_{g}_{s}")
                m.AddMultiplicationEquality(a, [n[g][s], act])
                m.Add(state + fl * a <= tab.cap_bytes[g]).OnlyEnforceIf(x[g][s])

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
        tmax = m.NewIntVar(0, 10**15, "tmax")
        m.AddMaxEquality(tmax, t)
        smax = m.NewIntVar(0, 10**15, "syncmax")
        m.AddMaxEquality(smax, sync)
        self.obj = sum(t) + (tab.num_microbatches - 1) * tmax + smax
        m.Minimize(self.obj)

    def decision(self, solver: cp_model.CpSolver):
        """(stage_blocks, stage_gpus, samples) of the solver's current solution."""
        cuts = [solver.Value(c) for c in self.cut]
        blocks = tuple((cuts[s], cuts[s + 1]) for s in range(self.S))
        gpus = tuple(tuple(g for g in range(self.tab.num_gpus) if solver.BooleanValue(self.x[g][s]))
                     for s in range(self.S))
        samples = tuple(tuple(solver.Value(self.n[g][s]) for g in gs) for s, gs in enumerate(gpus))
        return blocks, gpus, samples


def solve_cpsat(costs: BlockCosts, devices: DeviceGraph, options: SolverOptions) -> SolverResult:
    """Plan with CP-SAT: minimise the predicted step time (seconds) over (S, M).

    ``objective`` / ``best_bound`` are in seconds. ``status`` is "OPTIMAL" only
    when every candidate was solved to optimality (or proven infeasible) and
    ``best_bound`` is the smallest bound over all candidates, so the gap
    covers the whole (S, M) search. Raises InfeasiblePlanError if nothing fits.
    """
    t0 = time.perf_counter()
    ms = microbatch_candidates(options)
    k_max = max_stage_count(costs, devices, options)
    cands, best, bounds, all_optimal = [], None, [], True
    for n_s in range(1, k_max + 1):
        for m in ms:
            t1 = time.perf_counter()
            tab = build_tables(costs, devices, options, m)
            model = _Model(tab, devices, options, n_s)
            solver = cp_model.CpSolver()
            solver.parameters.max_time_in_seconds = options.time_limit_s
            solver.parameters.num_workers = options.num_workers
            solver.parameters.random_seed = options.seed
            code = solver.Solve(model.m)
            status = solver.StatusName(code)
            rec = {"num_stages": n_s, "num_microbatches": m, "status": status, "step_time_s": None,
                   "best_bound_s": None, "wall_s": 0.0}
            if code in (cp_model.OPTIMAL, cp_model.FEASIBLE):
                obj = int(round(solver.ObjectiveValue()))
                bound = int(round(solver.BestObjectiveBound()))
                dec = model.decision(solver)
                ev = evaluate(costs, devices, options, stage_blocks=dec[0], stage_gpus=dec[1],
                              samples_per_microbatch=dec[2], num_microbatches=m)
                if ev.objective_units != obj or not ev.feasible:
                    raise AssertionError(f"CP-SAT objective {obj} != evaluate() {ev.objective_units} "
                                         f"(violations {ev.violations}) for S={n_s}, M={m}: {dec}")
                rec.update(step_time_s=obj * UNIT_S, best_bound_s=bound * UNIT_S)
                bounds.append(bound)
                all_optimal &= code == cp_model.OPTIMAL
                if best is None or obj < best[0]:
                    best = (obj, bound, status, m, dec, ev)
            elif code != cp_model.INFEASIBLE:
                all_optimal = False
                bounds.append(max(0, int(solver.BestObjectiveBound())))
            rec["wall_s"] = time.perf_counter() - t1
            cands.append(rec)
    if best is None:
        raise InfeasiblePlanError(explain_infeasible(costs, devices, options, cands))
    obj, _, _, m, (blocks, gpus, samples), ev = best
    bound = min(bounds)
    return SolverResult(
        stage_blocks=blocks, stage_gpus=gpus, samples_per_microbatch=samples, num_microbatches=m,
        microbatch_size=options.global_batch_size // m, schedule=options.schedule,
        predicted_step_time_s=ev.step_time_s, predicted_stage_time_s=ev.stage_time_s,
        predicted_allreduce_s=ev.allreduce_s, predicted_memory_bytes=ev.memory_bytes,
        status="OPTIMAL" if all_optimal else "FEASIBLE", objective=obj * UNIT_S, best_bound=bound * UNIT_S,
        optimality_gap=(obj - bound) / obj if obj > 0 else 0.0, wall_s=time.perf_counter() - t0,
        candidates=tuple(cands))
