"""Optimizers of the host tier: CPUAdam (SIMD AdamW kernel with a pure-PyTorch fallback)."""

from mobiuspipe.optim.cpu_adam import CPUAdam

__all__ = ["CPUAdam"]
