"""Re-balancing a running job: ``zorse train --rebalance``.

While the ranks train, the launcher reads ``<out>/timings.jsonl`` as it grows
([Note: step timings] in ``runtime/timings.py``) and, once ``warm-up +
window`` steps of the current plan are in, and again after every ``window``
new steps, holds the last ``window`` steps against the plan's prices (the
per-GPU factors only: no link fit, a fraction of a second) (``profiling/calibrate.py``): the prices the plan
was made with (its ``plan_request.json``'s calibration, if any, else the
cost model's). It re-plans when

- one GPU is a **straggler**: its forward or backward measures more than
  ``straggler_factor`` x what its GPU type's fit over the run predicts for it
  (``GPUCalibration.forward`` / ``backward``: relative to the other GPUs of its
  type, so a cluster slower than priced as a whole is not a straggler, and a
  straggler the plan's calibration already knows is not one again); or
- the plan was made with a calibration and the measured step is more than
  ``slow_step_factor`` x the step it predicts (without a calibration the
  prediction is a GPU cost model's, not this cluster's: not a trigger).

Re-planning: a calibration of the window's steps against the uncalibrated
prices (``<out>/calibration.rebalance<k>.json``), then the plan's request
planned again with it, on the same cluster, into ``<out>/plan.rebalance<k>/``
(``elastic.replan``; [Note: where re-plans go]). The re-plan is taken only if
its predicted step is at least ``MIN_GAIN`` below the current plan's under
the same calibration; else the launcher says so and stops watching this
launch.

[Note: stopping to rebalance]
The launcher asks the ranks to stop by writing ``<out>/rebalance.request``
(``run_dir.REBALANCE_REQUEST``). Rank 0 looks for it after every step and,
finding it, puts ``REBALANCE_STOP`` where a received signal goes in the
step's one all-gather; every rank then sees the same table, writes the
step's checkpoint (as a SIGTERM would) and exits 0. The launcher removes the
request, and where the job stopped before its last step, starts it again on
the re-plan with ``--resume`` (a checkpoint loads under another plan:
``runtime/checkpoint.py``); the losses go on as a resume under another plan
does. At most ``--max-replans`` re-plans per ``zorse train``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from .elastic import PlanRequest, replan
from .errors import TimingsFileError, ZorseError

__all__ = ["RebalanceSettings", "MIN_GAIN", "REBALANCE_PREFIX", "run_rebalance", "check_once"]

#: A re-plan is taken only if predicted this much faster than the current plan (same calibration).
MIN_GAIN = 0.05
#: Re-plans under the run directory: ``<out>/plan.rebalance<k>``, calibrations ``calibration.rebalance<k>.json``.
REBALANCE_PREFIX = "plan.rebalance"


@dataclass(frozen=True, kw_only=True)
class RebalanceSettings:
    """``zorse train --rebalance``'s thresholds (see the module note)."""

    warmup: int = 1
    window: int = 3
    straggler_factor: float = 1.5
    slow_step_factor: float = 1.25
    poll_s: float = 0.5


@dataclass(frozen=True)
class Decision:
    """What one check found: ``reason`` (None: nothing to do), and where a re-plan was made, its
    directory, plan and the lines to print."""

    reason: str | None
    plan_dir: Path | None = None
    plan: object = None
    lines: tuple[str, ...] = ()


class _Pricer:
    """The request's model captured once; plans priced on the request's cluster."""

    def __init__(self, request: PlanRequest):
        from .capture import capture_lm
        from .cluster import Cluster
        from .models.registry import load_model

        self.captured, self.label_mode = capture_lm(load_model(request.model)[0], request.seq_len)
        self.cluster = Cluster.from_dict(request.cluster)
        self._priced: dict = {}

    def price(self, plan, calibration: str | None = None):
        """``plan``'s model priced (seconds on this machine: kept per plan options and calibration file)."""
        from .pricing import options_for_plan, price

        options = options_for_plan(plan, calibration=calibration)
        key = repr(options)
        if key not in self._priced:
            self._priced[key] = price(self.captured, self.cluster, options)
        return self._priced[key]


def _replan_index(out: Path) -> int:
    taken = [int(p.name[len(REBALANCE_PREFIX):]) for p in out.glob(f"{REBALANCE_PREFIX}*")
             if p.name[len(REBALANCE_PREFIX):].isdigit()]
    return max(taken, default=0) + 1


def _shares(plan) -> str:
    """``"stage 0: GPU 0 x4, GPU 1 x4 | stage 1: GPU 2 x2"`` (samples of each micro-batch)."""
    return " | ".join(f"stage {s.index} [{s.blocks[0]}, {s.blocks[1]}): "
                      + ", ".join(f"GPU {g.gpu} x{g.samples_per_microbatch}" for g in s.gpus)
                      for s in plan.stages[:plan.num_groups])


def check_once(out: Path, plan_dir: Path, request: PlanRequest, settings: RebalanceSettings, pricer: _Pricer,
               ) -> Decision:
    """One look at ``out``'s timings of the plan in ``plan_dir`` (module note). Returns what it found;
    where it re-planned, the re-plan is written (not yet asked for)."""
    from .cost.calibration import apply_calibration, write_calibration
    from .plan import Plan, fmt_seconds
    from .pricing import evaluate_plan
    from .profiling.calibrate import calibrate_runs
    from .runtime.run_dir import plan_hash
    from .runtime.timings import TIMINGS, read_timings

    plan = Plan.load(plan_dir)
    try:
        lines = [t for t in read_timings(out / TIMINGS) if t.plan_hash == plan_hash(plan)]
    except TimingsFileError:
        return Decision(None)  # not written yet
    if len(lines) < settings.warmup + settings.window:
        return Decision(None)
    ref = request.options.get("calibration")
    steps = [t.step for t in lines[settings.warmup:]][-settings.window:]  # the same steps for both calibrations
    held = calibrate_runs([(out, plan, pricer.price(plan, ref))], steps=steps, fit_links=False)
    run = held.runs[0]
    slow = [g for g in held.gpus if max(g.forward, g.backward) > settings.straggler_factor]
    rank_of = {s.gpu: s.rank for st in plan.stages for s in st.gpus}
    reasons = [f"GPU {g.gpu} ({g.gpu_type}, rank {rank_of[g.gpu]}) computes {max(g.forward, g.backward):.2f}x what "
               f"its type's fit predicts (straggler: > {settings.straggler_factor:g}x)" for g in slow]
    if ref and run.measured_step_s > settings.slow_step_factor * run.objective_step_s:
        reasons.append(f"the measured step {fmt_seconds(run.measured_step_s)} is "
                       f"{run.measured_step_s / run.objective_step_s:.2f}x the {fmt_seconds(run.objective_step_s)} its "
                       f"calibrated plan predicts (> {settings.slow_step_factor:g}x)")
    if not reasons:
        return Decision(None)
    k = _replan_index(out)
    raw = pricer.price(plan)
    cal = calibrate_runs([(out, plan, raw)], steps=steps)
    cal_path = write_calibration(cal, out / f"calibration.rebalance{k}.json")
    costs, devices, _ = apply_calibration(raw.costs, raw.devices, cal, precision=raw.precision.name)
    current = evaluate_plan(plan, dataclasses.replace(raw, costs=costs, devices=devices, calibration=cal)).step_time_s
    new_dir = out / f"{REBALANCE_PREFIX}{k}"
    again = dataclasses.replace(request, options={**request.options, "calibration": str(cal_path.resolve())})
    new = replan(again, pricer.cluster, new_dir, lost="; ".join(reasons), replanned_from=plan_dir, run=out,
                 fix="train on under the current plan", captured=pricer.captured, label_mode=pricer.label_mode)
    said = [f"[zorse] rebalance: {r}" for r in reasons] + [
        f"[zorse] rebalance: calibrated on steps {run.steps[0]}..{run.steps[-1]}: {cal_path}",
        f"[zorse] rebalance: step measured {fmt_seconds(run.measured_step_s)}; the current plan is predicted "
        f"{fmt_seconds(current)} and the re-plan {fmt_seconds(new.predicted_step_time_s)} with it",
        f"[zorse] rebalance: shares {_shares(plan)} -> {_shares(new)}"]
    if new.predicted_step_time_s > (1 - MIN_GAIN) * current:
        return Decision("kept", lines=(*said, f"[zorse] rebalance: keeping the current plan: the re-plan ({new_dir}) "
                                              f"is not predicted {MIN_GAIN:.0%} faster"))
    return Decision("; ".join(reasons), new_dir, new, tuple(said))


def _count_lines(path: Path) -> int:
    """Complete lines of ``path`` (0 where it does not exist yet)."""
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


class _Watcher(threading.Thread):
    """Checks the run after each window of new timings lines until it decides (``decision``) or is stopped."""

    def __init__(self, out: Path, plan_dir: Path, request: PlanRequest, settings: RebalanceSettings, pricer: _Pricer):
        super().__init__(name="zorse-rebalance", daemon=True)
        self.out, self.plan_dir, self.request, self.settings = out, plan_dir, request, settings
        self.pricer = pricer
        self.decision: Decision | None = None
        self.error: str | None = None
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        from .runtime.run_dir import REBALANCE_REQUEST
        from .runtime.timings import TIMINGS

        try:
            pricer, checked = self.pricer, 0
            from .plan import Plan

            plan = Plan.load(self.plan_dir)  # priced while torchrun starts the ranks: the first check is not late
            pricer.price(plan, self.request.options.get("calibration"))
            pricer.price(plan)
            while not self._halt.wait(self.settings.poll_s):
                path = self.out / TIMINGS
                steps = _count_lines(path)
                if steps < checked + self.settings.window:  # one check per window of new steps
                    continue
                checked = steps
                found = check_once(self.out, self.plan_dir, self.request, self.settings, pricer)
                if found.reason is None:
                    continue
                for line in found.lines:
                    print(line, flush=True)
                self.decision = found
                if found.plan_dir is not None:
                    (self.out / REBALANCE_REQUEST).write_text(str(found.plan_dir) + "\n")
                return
        except (ZorseError, ValueError, OSError) as exc:  # the job goes on under its plan
            self.error = f"{type(exc).__name__}: {exc}"
            print(f"[zorse] rebalance: stopped watching ({self.error}); the job goes on under its plan", flush=True)
        except Exception:  # noqa: BLE001 -- a bug here must not stop the training
            self.error = traceback.format_exc()
            print(f"[zorse] rebalance: stopped watching after an internal error; the job goes on under its "
                  f"plan:\n{self.error}", flush=True)


def run_rebalance(options, *, nproc: int, max_replans: int, launch_kw: dict,
                  settings: RebalanceSettings = RebalanceSettings()) -> int:
    """``zorse train --rebalance``: train ``options`` (a ``TrainingOptions``) on ``nproc`` local processes
    while watching its timings (module note); re-plan and resume at most ``max_replans`` times. Returns 0
    once the run finished.

    Raises:
        ElasticError: the plan has no ``plan_request.json`` (how it was made, which a re-plan repeats).
        JobFailedError, JobStalledError, JobInterrupted: as ``zorse train`` without it.
    """
    from .runtime.checkpoint import newest_intact_checkpoint
    from .runtime.launch import launch
    from .runtime.run_dir import CHECKPOINTS, REBALANCE_REQUEST
    from .train_options import OPTIONS_FILE, write_options_file

    first = Path(options.data.plan)
    plan_dir = first if first.is_dir() else first.parent
    request = PlanRequest.read(plan_dir)
    out = Path(options.job.out)
    replans = 0
    pricer = _Pricer(request)  # the model captured once, before the ranks start: the first check is not late
    while True:
        (out / REBALANCE_REQUEST).unlink(missing_ok=True)
        options_file = write_options_file(options, out / OPTIONS_FILE)
        watcher = _Watcher(out, plan_dir, request, settings, pricer) if replans < max_replans else None
        if watcher is not None:
            watcher.start()
        started = time.perf_counter()
        try:
            launch(nproc, ["--options-file", str(options_file)], **launch_kw)
        finally:
            if watcher is not None:
                watcher.stop()
                watcher.join()
        requested = (out / REBALANCE_REQUEST).exists()
        (out / REBALANCE_REQUEST).unlink(missing_ok=True)
        decision = watcher.decision if watcher is not None else None
        if not requested or decision is None or decision.plan_dir is None:
            return 0
        latest, _ = newest_intact_checkpoint(out / CHECKPOINTS, resumable=True)
        step = int(latest.name.split("_")[1]) if latest is not None else 0
        if step >= options.loop.steps:
            print(f"[zorse] rebalance: the run finished (step {step}) before it stopped for the re-plan", flush=True)
            return 0
        replans += 1
        new = decision.plan
        print(f"[zorse] rebalance: resuming from {latest} on {decision.plan_dir} ({new.world_size} ranks; re-plan "
              f"{replans} of --max-replans {max_replans}; {time.perf_counter() - started:.1f} s since this launch)",
              flush=True)
        d = options.data
        weights = None if d.weights is None or Path(d.weights).parent == plan_dir else d.weights
        options = dataclasses.replace(
            options, data=dataclasses.replace(d, plan=str(decision.plan_dir), weights=weights),
            checkpoint=dataclasses.replace(options.checkpoint, resume=True, overwrite=False),
            testing=dataclasses.replace(options.testing, fail_rank=None, kill_at_step=None, inject_inf=None))
        plan_dir, request, nproc = decision.plan_dir, PlanRequest.read(decision.plan_dir), new.world_size
