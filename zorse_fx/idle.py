"""Idle GPUs said aloud: which GPUs a plan leaves idle, the best plan scored
that uses them, and what makes that plan slower (``Plan.idle_gpus``).

[Note: idle GPUs said aloud]
With ``allow_idle_gpus`` (the default) the planner may leave GPUs without
work where that is faster: a slow GPU, or one behind a slow link. The plan
says so: ``idle_gpus`` names them and gives the predicted step of the best
plan that gives every GPU work, with one line on what makes it slower. No
second search is run for it: the portfolio keeps the fastest feasible plan
that uses every GPU among the answers it has scored anyway (CP-SAT's, the
baselines' -- ``homogeneous_all`` uses every GPU by construction -- and the
stage DP's per (stages, micro-batches); ``SolverResult.all_gpus``, set by
``portfolio._with_all_gpus``). Only where none of them uses every GPU and
fits (or the planner was not the portfolio: ``planner="stage_dp"``,
``"brute_force"``) does ``idle_gpus`` plan with every GPU in use
(``allow_idle_gpus=False``): the baselines whose cost is linear in the GPU
count (``FALLBACK_BASELINES``), and only where neither fits the stage DP
(a second search: 100 s on the synthetic 1,024-GPU instance of
``bench/planner_scaling.py`` on the 2-core machine, seconds below 128 GPUs),
whose answer is a plan the portfolio could return under ``--use-all-gpus``,
or whose binding constraint says why none fits. All are deterministic (no
wall-clock input), so the same inputs give the same line.
The step is the objective's, as the plan's own ``predicted_step_time_s``;
``zorse plan --use-all-gpus`` searches for the best such plan, which can be
faster than the one reported.

"What makes it slower" compares the two plans' objective terms
(``solve.objective.Evaluation``), each as the seconds of a step it accounts
for: the slowest stage's compute per micro-batch times the micro-batches
(the pipeline's steady state), the largest stage boundary's transfer
likewise, the pipeline's fill and drain (every stage time but the
slowest's), the slowest stage's gradient sync and optimizer step, and the
step's world control collectives. The term that grew most names the
reason, with its stage, GPU or link and both plans' figures. The terms
overlap (a period holds a compute and its boundaries): they point at the
cause, they do not add up to the difference.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .cluster import Cluster
from .errors import InfeasiblePlanError
from .ir.costs import BlockCosts
from .ir.devices import DeviceGraph
from .ir.result import SolverResult
from .options import PlanOptions
from .plan import IdleGPU, IdleGPUs, fmt_seconds

__all__ = ["idle_gpus", "slower_because", "ALL_GPUS_FALLBACK", "FALLBACK_BASELINES"]

#: ``IdleGPUs.all_gpus_source`` of the stage DP's plan run with every GPU in use (no scored plan used them all).
ALL_GPUS_FALLBACK = "STAGE_DP (every GPU)"
#: The baselines run with every GPU in use where no scored plan used them all: linear in the GPU count
#: (``portfolio.CHEAP_BASELINES`` less ``homogeneous_best``, which leaves the slower types out).
FALLBACK_BASELINES = ("homogeneous_all", "cephalo")


def idle_gpus(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions, result: SolverResult,
              cluster: Cluster) -> IdleGPUs | None:
    """The GPUs of ``cluster`` (priced as ``costs`` on ``devices``) that
    ``result``'s decision leaves idle, the predicted step (s) of the best plan
    scored that uses every GPU (``result.all_gpus``, else one planned with
    every GPU in use: ``FALLBACK_BASELINES``, then the stage DP) and what makes
    it slower; None where the decision uses every GPU. Deterministic ([Note:
    idle GPUs said aloud])."""
    from .solve.objective import evaluate

    used = {g for gs in result.decision.stage_gpus for g in gs}
    idle = tuple(IdleGPU(gpu=g, node=cluster.gpus[g].node, gpu_type=cluster.gpus[g].type)
                 for g in range(devices.num_gpus) if g not in used)
    if not idle:
        return None
    alt, why_none = result.all_gpus, ""
    if alt is None:
        alt, why_none = _every_gpu_plan(costs, devices, options)
    if alt is None:
        return IdleGPUs(gpus=idle, all_gpus_step_time_s=None, all_gpus_source="", reason=why_none)
    ev_alt = evaluate(costs, devices, options, alt.decision)
    ev_chosen = evaluate(costs, devices, options, result.decision)
    if ev_alt.objective_units < ev_chosen.objective_units:  # the simulator's pick ([Note: simulator re-rank])
        why = (f"the objective prices it faster, but the simulator ranks this plan ahead ({result.status}: of the "
               f"objective's best few plans, the one it simulates fastest)")
    else:
        why = slower_because(ev_alt, ev_chosen, costs, devices)
    return IdleGPUs(gpus=idle, all_gpus_step_time_s=ev_alt.step_time_s, all_gpus_source=alt.status, reason=why)


def _every_gpu_plan(costs: BlockCosts, devices: DeviceGraph,
                    options: PlanOptions) -> tuple[SolverResult | None, str]:
    """(the fastest feasible plan of ``FALLBACK_BASELINES`` run with every GPU in use, else the stage DP's, "")
    or (None, why no plan using every GPU fits: the stage DP's binding constraint)."""
    from .baselines import BASELINES
    from .solve.objective import evaluate_result
    from .solve.stage_dp import solve_stage_dp

    every = dataclasses.replace(options, allow_idle_gpus=False)
    found = []
    for name in FALLBACK_BASELINES:
        try:
            res = BASELINES[name](costs, devices, every)
        except (InfeasiblePlanError, ValueError):
            continue
        ev = evaluate_result(costs, devices, every, res)
        if ev.feasible:
            found.append(dataclasses.replace(res, status=f"BASELINE:{name}"))
    if found:
        return min(found, key=lambda r: r.predicted_step_time_s), ""  # (ties: the first of FALLBACK_BASELINES)
    try:
        res = solve_stage_dp(costs, devices, every)
    except InfeasiblePlanError as exc:
        # Its binding constraint where it names one, its first clause (the search's advice is for the chosen plan).
        return None, "no plan using every GPU fits: " + str(exc).split("Binding: ", 1)[-1].split("; ")[0]
    if res.status == "STAGE_DP_INFEASIBLE":
        bad = next((c.violations for c in res.candidates if c.chosen), ())
        return None, "no plan using every GPU fits: the stage DP's best one breaks " + "; ".join(bad)
    return dataclasses.replace(res, status=ALL_GPUS_FALLBACK), ""


def slower_because(alt, chosen, costs: BlockCosts, devices: DeviceGraph) -> str:
    """One line on what makes plan ``alt`` slower than ``chosen`` (both
    ``objective.Evaluation``s of ``costs`` on ``devices``): the objective term that grew
    most, as the seconds of a step it accounts for ([Note: idle GPUs said
    aloud]), named with its stage, GPU or link and both plans' figures."""
    from .solve.network_terms import effective_pair_bandwidth

    bw = np.asarray(effective_pair_bandwidth(devices), dtype=np.float64)
    terms = []  # (seconds more than chosen's, order, line)
    m_a, m_c = alt.decision.num_microbatches, chosen.decision.num_microbatches

    s, c_s = _argmax(alt.compute_s)
    sc, cc_s = _argmax(chosen.compute_s)
    g = _slowest_gpu(costs, devices, alt, s)
    rc = (" (recomputing its activations, its blocks' inputs in host memory)" if alt.decision.memory[s].stash == "host"
          else " (recomputing its activations)" if alt.decision.memory[s].recompute else "")
    terms.append((m_a * c_s - m_c * cc_s, 0,
                  f"its slowest stage, stage {s} ({len(alt.decision.stage_gpus[s])} GPU"
                  f"{'s' if len(alt.decision.stage_gpus[s]) > 1 else ''}), computes {fmt_seconds(c_s)} per "
                  f"micro-batch on {_where(devices, g)}{rc} x {_count(m_a, 'micro-batch')}, against "
                  f"{fmt_seconds(cc_s)} x {m_c} on this plan's stage {sc}"))

    b, b_s = _argmax(alt.boundary_s)
    if b_s > 0:
        here, there = alt.decision.stage_gpus[b], alt.decision.stage_gpus[b + 1]
        x, y = _slowest_pair(bw, here, there)
        bc = max(chosen.boundary_s, default=0.0)
        terms.append((m_a * b_s - m_c * bc, 1,
                      f"stage {b} -> {b + 1} sends {fmt_seconds(b_s)} per micro-batch (activations and gradients) "
                      f"x {m_a} over {_link(devices, bw, x, y)}, against {fmt_seconds(bc)} x {m_c} on this plan's "
                      f"slowest boundary"))

    fill_a = sum(alt.stage_time_s) - max(alt.stage_time_s)
    fill_c = sum(chosen.stage_time_s) - max(chosen.stage_time_s)
    n_a, n_c = len(alt.stage_time_s), len(chosen.stage_time_s)
    sends = ""
    if b_s > 0:
        k = _argmax(alt.stage_time_s)[0]
        sends = (f" ({fmt_seconds(sum(alt.boundary_s) - alt.boundary_s[k])} of it stage boundaries, the slowest "
                 f"{b} -> {b + 1} over {_link(devices, bw, x, y)})")
    terms.append((fill_a - fill_c, 2,
                  f"its {n_a} stages fill and drain the pipeline in {fmt_seconds(fill_a)} per step{sends}, against "
                  f"{fmt_seconds(fill_c)} for this plan's {_count(n_c, 'stage')}"))

    sync_a = [a + o for a, o in zip(alt.allreduce_s, alt.optim_s)]
    sync_c = max((a + o for a, o in zip(chosen.allreduce_s, chosen.optim_s)), default=0.0)
    y, y_s = _argmax(sync_a)
    gpus = alt.decision.stage_gpus[y]
    over = ""
    if len(gpus) > 1:
        x, z = _slowest_pair(bw, gpus, gpus)
        over = f" over its {len(gpus)} GPUs (slowest link {_link(devices, bw, x, z)})"
    terms.append((y_s - sync_c, 3,
                  f"stage {y}'s gradient sync and optimizer step take {fmt_seconds(y_s)} per step{over}, against "
                  f"{fmt_seconds(sync_c)} in this plan"))

    world = sorted({g for gs in alt.decision.stage_gpus for g in gs})
    lat = np.asarray(devices.link_latency_s, dtype=np.float64)[np.ix_(world, world)]
    np.fill_diagonal(lat, -1.0)
    x, z = (world[int(k)] for k in np.unravel_index(int(np.argmax(lat)), lat.shape))
    terms.append((alt.control_s - chosen.control_s, 4,
                  f"the step's world collectives over its {len(world)} GPUs take {fmt_seconds(alt.control_s)} "
                  f"(latency-bound rings, the slowest pair {_link(devices, bw, x, z, latency=True)}), against "
                  f"{fmt_seconds(chosen.control_s)} in this plan"))
    return max(terms, key=lambda t: (t[0], -t[1]))[2]


def _count(n: int, what: str) -> str:
    """``"1 micro-batch"``, ``"4 micro-batches"``."""
    return f"{n} {what}{'' if n == 1 else 'es' if what.endswith('ch') else 's'}"


def _argmax(values) -> tuple[int, float]:
    """(index, value) of the largest of ``values``, the first on ties."""
    i = max(range(len(values)), key=lambda k: (values[k], -k))
    return i, values[i]


def _slowest_gpu(costs: BlockCosts, devices: DeviceGraph, ev, s: int) -> int:
    """The GPU of stage ``s`` of evaluation ``ev`` whose forward and backward of its samples takes longest
    ([C-compute] without recomputation or offload; the first on ties): the name of the stage's compute term."""
    d = ev.decision
    i, j = d.stage_blocks[s]

    def seconds(pair) -> float:
        g, n = pair
        q = devices.gpu_types[g]
        fixed = costs.fwd_bwd_s_fixed.get(q)
        return n * sum(costs.fwd_bwd_s_per_sample[q][i:j]) + (sum(fixed[i:j]) if fixed else 0.0)

    pairs = list(zip(d.stage_gpus[s], d.samples_per_microbatch[s]))
    k = max(range(len(pairs)), key=lambda k: (seconds(pairs[k]), -k))
    return pairs[k][0]


def _slowest_pair(bw: np.ndarray, a, b) -> tuple[int, int]:
    """The pair (g in ``a``, h in ``b``, g != h) of least bandwidth ``bw`` (G, G), the first in ``a`` x ``b``
    order on ties."""
    sub = bw[np.ix_(a, b)].copy()
    sub[np.equal.outer(np.asarray(a), np.asarray(b))] = np.inf  # a GPU and itself: no link
    i, j = np.unravel_index(int(np.argmin(sub)), sub.shape)
    return a[int(i)], b[int(j)]


def _where(devices: DeviceGraph, g: int) -> str:
    node = devices.node_names[g] if devices.node_names else f"GPU {g}"
    return f"{devices.gpu_types[g]} @ {node}"


def _link(devices: DeviceGraph, bw, g: int, h: int, *, latency: bool = False) -> str:
    """``"pascal-turing <-> volta-turing (1.25 GB/s)"`` for GPUs ``g``, ``h``: their nodes and the pair's bandwidth
    as the objective prices it (shared links included; ``bw``: ``effective_pair_bandwidth``), or with
    ``latency`` its latency."""
    def name(k: int) -> str:
        return devices.node_names[k] if devices.node_names else f"GPU {k}"

    where = f"{name(g)} <-> {name(h)}" if name(g) != name(h) else f"within {name(g)}"
    return f"{where} ({fmt_seconds(devices.link_latency_s[g][h]) if latency else f'{bw[g][h] / 1e9:.3g} GB/s'})"
