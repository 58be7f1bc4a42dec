"""Gradient clipping by the global norm, as torch.nn.utils.clip_grad_norm_ does, folded into the factor the updates
divide the gradients by."""

from __future__ import annotations

import math

import torch

__all__ = ["clip_scale"]


def clip_scale(total_sumsq: float, loss_scale: float, max_norm: float) -> tuple[float, float]:
    """(the global gradient norm, what the updates divide the gradients by) from the squared norm of the scaled
    gradients summed over every stage and rank: the loss scale, times 1 / clip_grad_norm_'s coefficient
    max_norm / (norm + 1e-6) when that is below 1. The norm is rounded to float32 so that tiers whose float64 sums
    round differently still agree. An inf or nan norm leaves the loss scale alone: that step is skipped (its
    coefficient would be 0 or nan)."""
    norm = float(torch.tensor(math.sqrt(max(total_sumsq, 0.0)) / loss_scale, dtype=torch.float32))
    if not math.isfinite(norm):
        return norm, loss_scale
    coef = max_norm / (norm + 1e-6)
    return norm, loss_scale / coef if coef < 1.0 else loss_scale
