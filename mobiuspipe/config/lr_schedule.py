"""Learning-rate schedules: the rate of each optimizer step from the base rate, a linear warmup and a decay.

Step s (0-based) of a run of `total` steps with `warmup` warmup steps, base rate lr and floor min_lr:
  s < warmup:  lr * (s + 1) / warmup                        (linear warmup, reaching lr at s = warmup - 1)
  otherwise, with f = (s - warmup) / max(1, total - warmup - 1) in [0, 1]:
    constant:  lr
    linear:    min_lr + (lr - min_lr) * (1 - f)              (lr at the first step after warmup, min_lr at the last)
    cosine:    min_lr + (lr - min_lr) * (1 + cos(pi f)) / 2
"""

from __future__ import annotations

import math

__all__ = ["SCHEDULES", "lr_at"]

SCHEDULES = ("constant", "linear", "cosine")


def lr_at(
    step: int, lr: float, schedule: str = "constant", warmup: int = 0, total: int = 1, min_lr: float = 0.0
) -> float:
    """The learning rate of optimizer step `step` (see the module docstring); ValueError on an unknown schedule."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    f = min(1.0, (step - warmup) / max(1, total - warmup - 1))
    if schedule == "linear":
        return min_lr + (lr - min_lr) * (1.0 - f)
    return min_lr + (lr - min_lr) * (1.0 + math.cos(math.pi * f)) / 2.0
