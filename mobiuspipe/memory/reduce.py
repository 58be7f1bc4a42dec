"""Reductions over a stage's flat gradients on the device they are on, in working memory of a chunk or none: the
squared L2 norm clipping reads and fp16's overflow check (neither may take bytes a parameter that no plan counts), and
the host's read of such figures at once (read_scalars)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from mobiuspipe.standin.places import place_of

__all__ = ["NORM_CHUNK", "all_finite", "finite_flag", "read_scalars", "squared_norm", "sum_of_squares"]

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


def finite_flag(t: torch.Tensor) -> torch.Tensor:
    """Whether every element of t is finite, as a bool tensor of no dimension on t's device (no host
    synchronization). Its least and greatest elements tell (aminmax propagates a nan, and an inf is one of them),
    with no temporary of t's size: torch.isfinite makes an absolute value and two comparisons of it (5 bytes an fp16
    element)."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    low, high = torch.aminmax(t.reshape(-1))
    return torch.isfinite(low) & torch.isfinite(high)


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of t is finite (finite_flag, read on the host: one synchronization)."""
    return bool(finite_flag(t))


def read_scalars(values: Sequence[float | torch.Tensor]) -> list[float]:
    """values as floats: the numbers as they are, the tensors (one element each) stacked per device into one tensor
    that the host reads at once (one synchronization a device, where a read each would be one each)."""
    out = [v if not isinstance(v, torch.Tensor) else 0.0 for v in values]
    by_device: dict[tuple[torch.device, str | None], list[int]] = {}  # the stand-in's places too
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            by_device.setdefault((v.device, place_of(v)), []).append(i)
    for at in by_device.values():
        read = torch.stack([cast(torch.Tensor, values[i]).reshape(()).double() for i in at]).tolist()
        for i, x in zip(at, read):
            out[i] = x
    return [float(x) for x in out]
