"""``zorse calibrate``: a run's measured steps against what the cost model priced for its plan.

Reads ``<run>/timings.jsonl`` ([Note: step timings] in
``runtime/timings.py``) and ``metrics.jsonl``, prices the run's plan as
``zorse simulate`` does, and fits the corrections of [Note: calibration]
(``cost/calibration.py``): per GPU type, factors on its forward and backward
times, per-sample and fixed parts (least squares over the type's GPUs and
runs); per GPU, its own factor over its type's fit and its optimizer factor
(measured over priced, directly); one latency scale (the gradient norm's
world all-reduce, directly); the loop's overhead per step as latency rounds
of the world and a constant (measured); one bandwidth scale (fitted: the
only number chosen so that the calibrated objective meets the measured
step). Every measured quantity is the median over the steps used (the first
``warmup`` steps left out: the allocator, Gloo's connections and the
kernels' first calls).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import statistics
from pathlib import Path

from ..cost.calibration import Calibration, GPUCalibration, RunCalibration, TypeCalibration, apply_calibration
from ..errors import TimingsFileError
from ..ir.costs import FORWARD_SHARE
from ..solve.tables import control_pass_s
from ..pricing import PricedModel, evaluate_plan, simulate_plan
from ..runtime.run_dir import METRICS, plan_hash
from ..runtime.timings import TIMINGS, read_timings

__all__ = ["calibrate_run", "calibrate_runs", "calibration_table", "BANDWIDTH_RANGE"]

#: The bandwidth scales searched (time per byte x this); outside it the scale is clamped, and said.
BANDWIDTH_RANGE = (1e-4, 1e5)
_BISECTIONS = 60


def _factor(measured: float, priced: float) -> float:
    """measured / priced, 1 where either is 0 (nothing to correct), within the file's range."""
    if measured <= 0 or priced <= 0:
        return 1.0
    return min(max(measured / priced, 1e-5), 9.9e5)


def calibrate_run(run_dir: str | Path, plan, priced: PricedModel, *, warmup: int = 1,
                  progress=None) -> Calibration:
    """The calibration of one run (``calibrate_runs`` of one)."""
    return calibrate_runs([(run_dir, plan, priced)], warmup=warmup, progress=progress)


class _Run:
    """One run's measured medians and its plan's uncalibrated prices."""

    def __init__(self, run_dir, plan, priced: PricedModel, warmup: int, window: int | None = None,
                 steps=None):
        self.dir, self.plan, self.priced = Path(run_dir), plan, priced
        path = self.dir / TIMINGS
        lines = read_timings(path)
        self.hash = plan_hash(plan)
        of_plan = [t for t in lines if t.plan_hash == self.hash]
        if not of_plan:
            hashes = sorted({t.plan_hash for t in lines})
            raise TimingsFileError(f"{path}: no step of plan {self.hash} (the steps are of plan"
                                   f"{'s' if len(hashes) > 1 else ''} {', '.join(hashes) or 'none'}): pass the plan "
                                   f"the run trained (its <out>/train_options.json names it)", path=str(path))
        used = of_plan[warmup:][-window:] if window else of_plan[warmup:]
        if steps is not None:
            used = [t for t in of_plan if t.step in set(steps)]
        self.used = used
        if not used:
            raise TimingsFileError(f"{path}: {len(of_plan)} step(s) of the plan, all within the first {warmup} "
                                   f"left out as warm-up: train at least {warmup + 1} steps, or pass --warmup 0",
                                   path=str(path))
        self.steps = [t.step for t in used]
        precision = _run_precision(self.dir, self.steps)
        if precision is not None and precision != plan.precision:
            raise TimingsFileError(
                f"{self.dir / METRICS}: the run trained in {precision} but the plan is for {plan.precision} (a CPU "
                f"run of a mixed-precision plan trains in float32): its timings do not price the plan's kernels; "
                f"calibrate a run that trains in the plan's precision (on a CPU: a plan made with --precision fp32)",
                path=str(self.dir / METRICS), field="precision", value=precision)
        med = statistics.median
        self.clock = used[0].clock
        self.mode = "gloo" if self.clock == "perf_counter" else "nccl"  # a CPU run's ranks talk over Gloo
        self.sim = simulate_plan(plan, priced, p2p=self.mode)
        self.objective = evaluate_plan(plan, priced).step_time_s
        self.gpu_of = {g.rank: g for st in plan.stages for g in st.gpus}
        self.parts = {r: _priced_parts(plan, priced.costs, priced.devices, r) for r in range(plan.world_size)}
        self.meas = {r: (med(t.ranks[r].compute_s("F") for t in used), med(t.ranks[r].compute_s("B") for t in used))
                     for r in range(plan.world_size)}
        self.opt = {r: (med(t.ranks[r].adamw_s for t in used),
                        sum(e.end_s - e.start_s for e in self.sim.events
                            if e.gpu == self.gpu_of[r].gpu and e.kind == "optim"))
                    for r in range(plan.world_size)}
        world = sorted(g.gpu for g in self.gpu_of.values())
        one_pass = control_pass_s(priced.devices, world)  # [C-control]'s pass of the world's ring
        rounds = priced.costs.step_control_rounds
        self.before = max(rounds - 1, 0) * one_pass  # the norm's (and fp16's inf/NaN) rounds
        self.after = min(rounds, 1) * one_pass  # the per-step all-gather's one round
        self.control = med(min(r.grad_norm_s + r.unscale_s for r in t.ranks) for t in used)
        # The loop after the step: rank 0's end (through the all-gather) past the latest rank's last phase;
        # and a token-mean plan's count of its loss tokens before the schedule (one all-reduce over the last
        # stage's GPUs: the fastest rank's, as the norm's), which the objective does not price.
        self.loop = med(t.ranks[0].start_unix_s + t.step_time_s - max(r.start_unix_s + r.total_s for r in t.ranks)
                        + min(r.count_s for r in t.ranks) for t in used)
        self.measured = med(t.step_time_s for t in used)


def calibrate_runs(runs, *, warmup: int = 1, window: int | None = None, steps=None, fit_links: bool = True,
                   progress=None) -> Calibration:
    """The calibration of ``runs`` = [(run directory, its plan, the model
    priced for that plan: ``pricing.price(..., options_for_plan(plan))``,
    uncalibrated)], all of one model on one cluster in one precision
    ([Note: calibration]). Runs of different micro-batch sizes tell a GPU
    type's per-sample cost from its fixed cost; one run alone often cannot.
    ``window``: each run's last ``window`` steps only (None: every step after
    the first ``warmup``): what ``--rebalance`` holds against the plan.
    ``steps``: exactly these steps of every run (``warmup`` and ``window``
    then do not apply). ``fit_links`` False: no bandwidth fit (scale 1) and
    no calibrated re-prediction (the runs' ``calibrated_*`` steps are 0): the
    per-GPU factors alone, in a fraction of the time (``--rebalance``'s check).

    Raises:
        TimingsFileError: a run without timings, none of its plan (another
            plan's run, or a run re-planned since: its hashes named), fewer than
            ``warmup`` + 1 steps, trained in another precision than its plan's
            (a CPU run of a mixed-precision plan times float32 kernels), or runs
            of different clusters, precisions or clocks; each naming the file
            and what to do.
    """
    say = progress or (lambda msg: None)
    rs = [_Run(d, plan, priced, warmup, window, steps) for d, plan, priced in runs]
    first = rs[0]
    for r in rs[1:]:
        for what, a, b in (("cluster", first.priced.cluster.name, r.priced.cluster.name),
                           ("precision", first.plan.precision, r.plan.precision), ("clock", first.clock, r.clock)):
            if a != b:
                raise TimingsFileError(f"{r.dir}: its {what} is {b!r} but {first.dir}'s is {a!r}: calibrate runs of "
                                       f"one cluster, precision and device kind together", path=str(r.dir))
    types, resid = _fit_types(rs)
    gpus = []
    for i, r in enumerate(rs):
        for rank in range(r.plan.world_size):
            g = r.gpu_of[rank]
            (fp, fq), (bp, bq), _ = r.parts[rank]
            o_meas, o_pred = r.opt[rank]
            gpus.append(GPUCalibration(
                run=i, gpu=g.gpu, node=g.node, gpu_type=g.gpu_type, samples=g.samples_per_microbatch,
                forward=resid[i, rank][0], backward=resid[i, rank][1], optimizer=_factor(o_meas, o_pred),
                forward_measured_s=r.meas[rank][0], forward_priced_s=fp + fq, backward_measured_s=r.meas[rank][1],
                backward_priced_s=bp + bq, optimizer_measured_s=o_meas, optimizer_priced_s=o_pred))
    med = statistics.median
    scales = [r.control / r.before for r in rs if r.before > 0 and r.control > 0]
    latency_scale = _clip(med(scales)) if scales else 1.0
    rounds, overhead = _loop_overhead(rs, latency_scale)

    def record(bw: float, how: str, results=None) -> Calibration:
        results = results or [(0.0, 0.0)] * len(rs)
        return Calibration(
            format="zorse_fx.calibration", version=1, cluster=first.priced.cluster.name,
            precision=first.plan.precision, clock=first.clock,
            runs=[RunCalibration(run_dir=str(r.dir), run_id=r.used[0].run_id, plan_hash=r.hash, steps=r.steps,
                                 num_microbatches=r.plan.num_microbatches, measured_step_s=r.measured,
                                 objective_step_s=r.objective, calibrated_objective_step_s=obj,
                                 simulated_step_s=r.sim.step_time_s, calibrated_simulated_step_s=sim)
                  for r, (obj, sim) in zip(rs, results)],
            types=types, gpus=gpus, latency_scale=latency_scale, bandwidth_scale=bw, bandwidth_fit=how,
            step_overhead_s=overhead, step_overhead_rounds=rounds)

    def calibrated(r: _Run, cal: Calibration) -> PricedModel:
        costs, devices, _ = apply_calibration(r.priced.costs, r.priced.devices, cal,
                                              precision=r.priced.precision.name)
        return dataclasses.replace(r.priced, costs=costs, devices=devices, calibration=cal)

    def ratio(bw: float) -> float:
        """The median over the runs of calibrated objective / measured step."""
        cal = record(bw, "")
        return med(evaluate_plan(r.plan, calibrated(r, cal)).step_time_s / r.measured for r in rs)

    if not fit_links:
        return record(1.0, "not fitted (fit_links=False)")
    lo, hi = BANDWIDTH_RANGE
    at_lo, at_hi = ratio(lo), ratio(hi)
    if math.isclose(at_lo, at_hi, rel_tol=1e-9, abs_tol=1e-12):
        bw, how = 1.0, "the steps do not depend on the links' bandwidth: left at 1"
    elif at_lo >= 1:
        bw, how = lo, (f"clamped at {lo:g}: even with links {1 / lo:g}x faster than priced the objective is "
                       f"{at_lo:.3g}x the measured step (compute, latency and overhead alone)")
    elif at_hi <= 1:
        bw, how = hi, f"clamped at {hi:g}: even with links {hi:g}x slower than priced the objective is {at_hi:.3g}x"
    else:
        a, b = math.log(lo), math.log(hi)
        for _ in range(_BISECTIONS):  # deterministic: a fixed number of halvings of a fixed range
            mid = (a + b) / 2
            if ratio(math.exp(mid)) < 1:
                a = mid
            else:
                b = mid
        bw = math.exp((a + b) / 2)
        how = (f"bisection over {lo:g}..{hi:g} ({_BISECTIONS} halvings): the objective meets the measured step"
               + (f" (the median over {len(rs)} runs)" if len(rs) > 1 else ""))
    draft = record(bw, how)
    results = []
    for r in rs:
        final = calibrated(r, draft)
        results.append((evaluate_plan(r.plan, final).step_time_s, simulate_plan(r.plan, final, p2p=r.mode).step_time_s))
    cal = record(bw, how, results)
    for r, run in zip(rs, cal.runs):
        say(f"{r.dir}: measured step {r.measured:.4g} s (median of steps {r.steps[0]}..{r.steps[-1]}); objective "
            f"{r.objective:.4g} s -> calibrated {run.calibrated_objective_step_s:.4g} s; simulator "
            f"{r.sim.step_time_s:.4g} s -> {run.calibrated_simulated_step_s:.4g} s")
    return cal


def _loop_overhead(rs: list[_Run], latency_scale: float) -> tuple[int, float]:
    """(latency rounds, seconds): the loop's measured time after each run's step, beyond the one
    round [C-control] prices, as whole rounds of its world's calibrated control latency (one pass of
    its ring, ``solve.tables.control_pass``, x ``latency_scale``) and a constant ([Note: calibration]).
    The rounds are the median over the runs of round(loop / round), the constant the median of what
    is left (>= 0): a loop that takes several of its world's latencies is latency-bound, and a plan
    on other links pays its own (on one node a few ms, across a 66 ms WAN hundreds)."""
    med = statistics.median
    per_run = []
    for r in rs:
        one = r.after * latency_scale
        extra = max(0.0, r.loop - one)
        k = int(round(extra / one)) if one > 0 else 0
        per_run.append((k, one))
    rounds = int(med(k for k, _ in per_run))
    left = med(max(0.0, r.loop - one * (1 + rounds)) for r, (_, one) in zip(rs, per_run))
    return rounds, left


def _priced_parts(plan, costs, devices, rank: int):
    """Rank ``rank``'s priced seconds per step, uncalibrated: ((forward per-sample part, forward fixed
    part), (backward per-sample, backward fixed), recomputed forward (per-sample, fixed)): every
    micro-batch of every stage it hosts, its samples of each (a recomputing stage's backward re-runs its
    forward: counted apart)."""
    g = next(g for st in plan.stages for g in st.gpus if g.rank == rank)
    # (the priced model's key: a GPU a calibration priced on its own has its own, cost/calibration.py)
    t, n, m = devices.gpu_types[g.gpu], g.samples_per_microbatch, plan.num_microbatches
    fb_ps, fb_fx = costs.fwd_bwd_s_per_sample[t], costs.fwd_bwd_s_fixed.get(t) or (0.0,) * len(costs.param_count)
    f_ps = costs.fwd_s_per_sample.get(t) or tuple(FORWARD_SHARE * x for x in fb_ps)
    f_fx = costs.fwd_s_fixed.get(t) or tuple(FORWARD_SHARE * x for x in fb_fx)
    fp = fq = bp = bq = rp = rq = 0.0
    for s in plan.stages_of(rank):
        st = plan.stages[s]
        blocks = range(*st.blocks)
        a, b = m * n * sum(f_ps[i] for i in blocks), m * sum(f_fx[i] for i in blocks)
        fp, fq = fp + a, fq + b
        bp += m * n * sum(fb_ps[i] - f_ps[i] for i in blocks)
        bq += m * sum(fb_fx[i] - f_fx[i] for i in blocks)
        if st.memory.recompute:
            rp, rq = rp + a, rq + b
    return (fp, fq), (bp, bq), (rp, rq)


def _fit_pair(points: list[tuple[float, float, float]]) -> tuple[float, float, str]:
    """(per-sample factor, fixed factor, how) minimising the squared relative error of
    ``alpha P + gamma Q`` against ``y`` over ``points`` = [(P, Q, y)]: both where the GPUs' (P, Q)
    are not proportional and the least-squares answer is positive, else one factor for both."""
    pts = [(p, q, y) for p, q, y in points if y > 0 and p + q > 0]
    if not pts:
        return 1.0, 1.0, "nothing measured: as priced"
    w = [1 / y**2 for _, _, y in pts]
    a11 = sum(wi * p * p for wi, (p, _, _) in zip(w, pts))
    a12 = sum(wi * p * q for wi, (p, q, _) in zip(w, pts))
    a22 = sum(wi * q * q for wi, (_, q, _) in zip(w, pts))
    b1 = sum(wi * p * y for wi, (p, _, y) in zip(w, pts))
    b2 = sum(wi * q * y for wi, (_, q, y) in zip(w, pts))
    det = a11 * a22 - a12 * a12
    if len(pts) > 1 and det > 1e-9 * a11 * a22:
        alpha, gamma = (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
        if alpha > 0 and gamma > 0:
            return _clip(alpha), _clip(gamma), f"per sample and fixed fitted over {len(pts)} GPUs"
    k = (b1 + b2) / (a11 + 2 * a12 + a22)
    why = "one GPU" if len(pts) == 1 else ("their priced parts are proportional" if det <= 1e-9 * a11 * a22
                                          else "a separate fit was not positive")
    return _clip(k), _clip(k), f"one factor ({why})"


def _clip(x: float) -> float:
    return min(max(x, 1e-5), 9.9e5)


def _fit_types(rs: list[_Run]):
    """Per GPU type its ``TypeCalibration`` over every run's GPUs of the type; per (run, rank) its own
    (forward, backward) factor over the type's fit."""
    by_type: dict[str, list[tuple[int, int]]] = {}
    for i, r in enumerate(rs):
        for rank in range(r.plan.world_size):
            by_type.setdefault(r.gpu_of[rank].gpu_type, []).append((i, rank))
    types, resid = [], {}
    for t, members in sorted(by_type.items()):
        fa, fg, f_how = _fit_pair([(*rs[i].parts[k][0], rs[i].meas[k][0]) for i, k in members])
        # A recomputing stage's backward re-runs its forward: take the calibrated forward out first.
        bwd = [(*rs[i].parts[k][1], rs[i].meas[k][1] - fa * rs[i].parts[k][2][0] - fg * rs[i].parts[k][2][1])
               for i, k in members]
        ba, bg, b_how = _fit_pair(bwd)
        types.append(TypeCalibration(gpu_type=t, forward_per_sample=fa, forward_fixed=fg, backward_per_sample=ba,
                                     backward_fixed=bg, fit=f"forward: {f_how}; backward: {b_how}"))
        for (i, k), (_, _, yb) in zip(members, bwd):
            (fp, fq), (bp, bq), _ = rs[i].parts[k]
            resid[i, k] = (_factor(rs[i].meas[k][0], fa * fp + fg * fq), _factor(yb, ba * bp + bg * bq))
    return types, resid


def _run_precision(run: Path, steps: list[int]) -> str | None:
    """The precision metrics.jsonl records for the first of ``steps`` (None: no such record)."""
    path = run / METRICS
    if not path.is_file():
        return None
    for ln in path.read_text().splitlines():
        try:
            rec = json.loads(ln)
        except ValueError:
            continue
        if rec.get("step") == steps[0] and isinstance(rec.get("precision"), str):
            return rec["precision"]
    return None


def calibration_table(cal: Calibration) -> str:
    """What ``zorse calibrate`` prints: per GPU and run its measured and priced seconds per step, per
    type its factors, the links, and each run's step before and after (rich tables, plain text)."""
    from rich.console import Console
    from rich.table import Table

    def ms(x: float) -> str:
        return f"{x * 1e3:.3g}"

    several = len(cal.runs) > 1
    gpus = Table(title="Measured / priced per step, ms (medians of the steps used)")
    for col in (*(("run",) if several else ()), "GPU", "type", "samples", "forward", "backward", "optimizer",
                "own factor F / B"):
        gpus.add_column(col, justify="left" if col == "type" else "right")
    for g in cal.gpus:
        gpus.add_row(*((str(g.run),) if several else ()), str(g.gpu), g.gpu_type, str(g.samples),
                     f"{ms(g.forward_measured_s)} / {ms(g.forward_priced_s)}",
                     f"{ms(g.backward_measured_s)} / {ms(g.backward_priced_s)}",
                     f"{ms(g.optimizer_measured_s)} / {ms(g.optimizer_priced_s)}",
                     f"{g.forward:.2f} / {g.backward:.2f}")
    types = Table(title="Per GPU type: priced block times x")
    for col in ("type", "forward per sample", "forward fixed", "backward per sample", "backward fixed", "fit"):
        types.add_column(col, justify="left" if col in ("type", "fit") else "right")
    for t in cal.types:
        types.add_row(t.gpu_type, f"{t.forward_per_sample:.3g}", f"{t.forward_fixed:.3g}",
                      f"{t.backward_per_sample:.3g}", f"{t.backward_fixed:.3g}", t.fit)
    steps = Table(title="Step, ms: measured, and predicted before / after calibration")
    for col in ("run", "steps", "micro-batches", "measured", "objective", "calibrated", "simulator", "calibrated "):
        steps.add_column(col, justify="left" if col == "run" else "right")
    for r in cal.runs:
        obj, sim = r.calibrated_objective_step_s, r.calibrated_simulated_step_s
        steps.add_row(r.run_dir, f"{r.steps[0]}..{r.steps[-1]}", str(r.num_microbatches), ms(r.measured_step_s),
                      ms(r.objective_step_s), f"{ms(obj)} ({obj / r.measured_step_s - 1:+.1%})",
                      ms(r.simulated_step_s), f"{ms(sim)} ({sim / r.measured_step_s - 1:+.1%})")
    buf = io.StringIO()
    console = Console(file=buf, width=140)
    for t in (gpus, types, steps):
        console.print(t)
    return (buf.getvalue() + f"links: latency x{cal.latency_scale:.3g} (the gradient norm's all-reduce), time per "
            f"byte x{cal.bandwidth_scale:.3g} ({cal.bandwidth_fit}); loop overhead {cal.step_overhead_rounds} latency "
            f"round(s) of the world + {ms(cal.step_overhead_s)} ms per step")
