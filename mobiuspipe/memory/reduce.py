"""Reductions over a stage's flat gradients on the device they are on, in working memory of a chunk or none: the
squared L2 norm clipping reads and fp16's overflow check (neither may take bytes a parameter that no plan counts)."""

from __future__ import annotations

import torch

__all__ = ["NORM_CHUNK", "all_finite", "squared_norm", "sum_of_squares"]

NORM_CHUNK = 1 << 20
"""Elements of a flat tensor squared_norm sums at a time: vector_norm(dtype=float64) casts its whole input to float64
first (8 bytes an element), so a chunk's cast is all it makes (8 MiB)."""


def squared_norm(t: torch.Tensor) -> torch.Tensor:
    """The squared L2 norm of t summed in float64, as a float64 tensor on t's device (no host synchronization)."""
    flat = t.reshape(-1)
    total = flat.new_zeros((), dtype=torch.float64)
    for chunk in flat.split(NORM_CHUNK):
        total = total + torch.linalg.vector_norm(chunk, dtype=torch.float64).square()
    return total


def sum_of_squares(t: torch.Tensor) -> float:
    """The squared L2 norm of t, summed in float64 (squared_norm, read on the host)."""
    return float(squared_norm(t))


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of t is finite (read on the host: one synchronization). Its least and greatest elements
    tell (aminmax propagates a nan, and an inf is one of them), with no temporary of t's size: torch.isfinite makes
    an absolute value and two comparisons of it (5 bytes an fp16 element)."""
    if t.numel() == 0:
        return True
    low, high = torch.aminmax(t.reshape(-1))
    return bool(torch.isfinite(low) & torch.isfinite(high))
