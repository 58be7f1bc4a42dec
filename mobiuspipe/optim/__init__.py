"""Optimizers of the host and ssd tiers: CPUAdam (SIMD AdamW kernel with a pure-PyTorch fallback) and
OutOfCoreAdam (its states in an SSDStore, streamed through a fixed host budget)."""

from mobiuspipe.optim.cpu_adam import CPUAdam
from mobiuspipe.optim.ooc_adam import OutOfCoreAdam

__all__ = ["CPUAdam", "OutOfCoreAdam"]
