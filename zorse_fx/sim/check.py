"""The planner's answer, checked by the simulator before it becomes a Plan.

The planners optimise the objective (``solve/objective.py``); the
event-driven simulator (``engine.py``) replays the same decision message by
message, with links shared by concurrent messages. ``check_result`` runs it
on the final answer, whatever planner produced it (CP-SAT, the class-level
model, the stage DP, a baseline, the interleave pass):

* memory: every GPU's simulated peak must fit its usable memory
  (``memory_fraction`` x capacity). The objective and the simulator count
  memory identically (tests/test_sim.py), so a breach is a zorse_fx bug and
  raises ``PlanCheckError`` rather than handing out a plan that would run
  out of memory;
* time: the simulated step is reported next to the predicted one. The
  objective is mostly conservative (on 58 returned plans the simulator is at
  most 2% slower and up to 16% faster: "Objective vs simulator" in
  bench/README.md); where the
  simulator is slower by more than ``tolerance`` (what the objective prices
  optimistically: two boundaries sharing one link or one shared link in the
  same direction, a ring crossing a shared link several times per direction:
  [Note: shared links in the objective]), the check warns: the plan may not
  be the best one and the prediction is optimistic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..errors import ZorseError
from ..ir.costs import BlockCosts
from ..ir.devices import DeviceGraph
from ..ir.result import SolverResult
from ..options import PlanOptions
from .engine import simulate

__all__ = ["SimulationCheck", "PlanCheckError", "check_result", "SLOWER_TOLERANCE"]

#: Simulated step may exceed the predicted one by this fraction before the check warns.
SLOWER_TOLERANCE = 0.20


class PlanCheckError(ZorseError, RuntimeError):
    """The simulator found a GPU over its usable memory in the planner's answer."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulationCheck:
    """The simulator's verdict on a planner answer (seconds, bytes)."""

    predicted_step_time_s: float
    simulated_step_time_s: float
    #: Largest simulated peak / usable memory over the GPUs (<= 1 when the check passed).
    max_memory_fraction: float
    #: 1 - mean busy fraction of the GPUs in use (simulated).
    bubble_fraction: float
    #: Seconds the simulation took.
    wall_s: float
    warnings: tuple[str, ...] = ()

    @property
    def ratio(self) -> float:
        """Simulated / predicted step time."""
        return self.simulated_step_time_s / self.predicted_step_time_s if self.predicted_step_time_s else 1.0

    def summary(self) -> str:
        return (f"simulator check: step {self.simulated_step_time_s:.3f} s vs predicted "
                f"{self.predicted_step_time_s:.3f} s ({self.ratio:.2f}x), bubble {self.bubble_fraction:.0%}, "
                f"peak memory {self.max_memory_fraction:.0%} of usable, {self.wall_s:.1f} s")


def check_result(costs: BlockCosts, devices: DeviceGraph, options: PlanOptions, result: SolverResult, *,
                 tolerance: float = SLOWER_TOLERANCE) -> SimulationCheck:
    """Simulate ``result``'s decision and check it (see the module note).

    Raises:
        PlanCheckError: a GPU's simulated peak memory exceeds
            ``options.memory_fraction`` x its memory (names the GPU, its stage,
            both sizes).
    """
    t0 = time.perf_counter()
    sim = simulate(costs, devices, options, result.decision)
    wall = time.perf_counter() - t0
    stage_of = {g: s for s, gs in enumerate(result.decision.stage_gpus) for g in gs}
    worst, over = 0.0, []
    for g, peak in enumerate(sim.peak_memory_bytes):
        if g not in stage_of:
            continue
        usable = options.memory_fraction * devices.memory_bytes[g]
        worst = max(worst, peak / usable)
        if peak > usable:
            over.append(f"GPU {g} ({devices.gpu_types[g]}, stage {stage_of[g]}) peaks at {peak / 2**30:.2f} GiB "
                        f"> {usable / 2**30:.2f} GiB usable ({options.memory_fraction:g} x "
                        f"{devices.memory_bytes[g] / 2**30:.1f} GiB)")
    if over:
        raise PlanCheckError(
            "the simulator finds the planner's answer over memory, which the planner's own memory model "
            "should have excluded (a zorse_fx bug: please report it with the plan): " + "; ".join(over[:4])
            + (f"; and {len(over) - 4} more" if len(over) > 4 else "")
            + ". Meanwhile lower memory_fraction or max_interleave to plan around it.")
    pred = result.predicted_step_time_s
    warnings = []
    if pred > 0 and sim.step_time_s > pred * (1 + tolerance):
        warnings.append(f"the simulated step ({sim.step_time_s:.3f} s) is {sim.step_time_s / pred - 1:.0%} slower "
                        f"than predicted ({pred:.3f} s): the objective does not model links shared by "
                        f"several stage boundaries or gradient syncs, so this plan may not be the fastest; "
                        f"`zorse simulate` shows where the time goes")
    return SimulationCheck(predicted_step_time_s=pred, simulated_step_time_s=sim.step_time_s,
                           max_memory_fraction=worst, bubble_fraction=sim.bubble_fraction, wall_s=wall,
                           warnings=tuple(warnings))
