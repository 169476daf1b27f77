"""Learning-rate schedules: the rate of each training step as a pure function
of the step, so every rank, and a run resumed from a checkpoint, computes the
same rate without any scheduler state.

``constant``: ``lr`` after the warm-up.
``cosine``: half a cosine from ``lr`` down to ``min_lr`` over the steps after
the warm-up (nanoGPT's ``get_lr``; Loshchilov & Hutter, "SGDR", ICLR 2017).
``linear``: a straight line from ``lr`` down to ``min_lr`` (Hugging Face's
``get_linear_schedule_with_warmup`` with a floor).
Every schedule warms up linearly over the first ``warmup_steps`` steps, step
``k`` (1-based) using ``lr * k / warmup_steps``, as nanoGPT and Hugging Face
do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..train_options import LR_SCHEDULES, OptimizerOptions, check_lr_schedule

__all__ = ["LR_SCHEDULES", "LRSchedule"]

_DEFAULTS = OptimizerOptions()  # the defaults are written once, in train_options.py


@dataclass(frozen=True, slots=True, kw_only=True)
class LRSchedule:
    """The learning rate of step ``k`` (1-based) of a run of ``total_steps``.

    Raises:
        ValueError: an unknown schedule, a negative rate, ``min_lr > lr``,
            negative warm-up or ``total_steps < 1``; the message names the
            option to change.
    """

    name: str = _DEFAULTS.lr_schedule
    lr: float = _DEFAULTS.lr
    min_lr: float = _DEFAULTS.min_lr
    warmup_steps: int = _DEFAULTS.warmup_steps
    total_steps: int = 1

    def __post_init__(self) -> None:
        check_lr_schedule(self.name, self.lr, self.min_lr, self.warmup_steps)
        if self.total_steps < 1:
            raise ValueError(f"--steps {self.total_steps}: must be >= 1")

    @classmethod
    def from_options(cls, options: OptimizerOptions, total_steps: int) -> LRSchedule:
        """The schedule ``options`` (``--lr-schedule``, ``--lr``, ``--min-lr``,
        ``--warmup-steps``) describe, over a run of ``total_steps``."""
        return cls(name=options.lr_schedule, lr=options.lr, min_lr=options.min_lr, warmup_steps=options.warmup_steps,
                   total_steps=total_steps)

    def __call__(self, step: int) -> float:
        if step < 1:
            raise ValueError(f"steps count from 1, got {step}")
        if step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.name == "constant":
            return self.lr
        decay_steps = self.total_steps - self.warmup_steps
        if decay_steps <= 0:
            return self.lr
        frac = min(1.0, (step - self.warmup_steps) / decay_steps)
        if self.name == "cosine":
            coeff = 0.5 * (1.0 + math.cos(math.pi * frac))
        else:
            coeff = 1.0 - frac
        return self.min_lr + coeff * (self.lr - self.min_lr)
