"""What one optimizer step of a Pipeline reports."""

from __future__ import annotations

from dataclasses import dataclass, field

from mobiuspipe.runtime.engine import StepTimes

__all__ = ["StepResult"]


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """One optimizer step: the batch's loss (every rank gets it), the largest time of each part over ranks
    (summed over the step's passes), the largest device arena peak over ranks against the arena's budget, the
    largest measured device peak over ranks, and this rank's own times and device peak."""

    step: int
    loss: float
    times: StepTimes
    arena_peak_bytes: int
    arena_budget_bytes: int
    loss_scale: float | None = None
    """fp16: the scale the loss was multiplied by in this step; None without loss scaling."""
    skipped: bool = False
    """fp16: a gradient overflowed on some rank, so no weight changed in this step."""
    device_peak_bytes: int = 0
    """The most bytes a rank held on its device during the step (arena in use, activations, buffers, messages;
    the largest over ranks), as measured by mobiuspipe.memory.measure.DevicePeak: the ledger on the CPU
    stand-in, CUDA's max_memory_allocated on a gpu."""
    grad_norm: float | None = None
    """With max_grad_norm: the global L2 norm of the step's gradients before clipping; None without."""
    own_times: StepTimes = field(default_factory=StepTimes)
    """This rank's own compute, load and comm seconds, summed over the step's pipeline passes."""
    own_device_peak_bytes: int = 0
    """This rank's measured device peak: the largest of the step's passes."""
    updates_rolled_back: int = 0
    """This rank's speculative updates of the step that were rolled back (Pipeline's speculative_update: the step
    clipped, or skipped on an overflow): each was redone, or dropped, after the backward."""
