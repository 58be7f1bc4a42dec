"""AdamW's hyper-parameters read off an optimizer factory: what the tiers that step the states themselves (on the SSD,
on the gpu) need, where the host tier takes the factory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from mobiuspipe.errors import PipelineError
from mobiuspipe.optim.cpu_adam import CPUAdam

__all__ = ["AdamHyper", "GPU_TIER", "SSD_TIER"]

SSD_TIER = "on the SSD (memory.optimizer: ssd)"
GPU_TIER = "on the gpu (memory.optimizer: device)"
"""Where the tiers that step the states themselves keep them, as AdamHyper.of's errors say."""


@dataclass(frozen=True)
class AdamHyper:
    """AdamW's hyper-parameters, as the ssd tier needs them (the host tier takes an optimizer factory)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float

    @classmethod
    def of(cls, make_optimizer: Callable, where: str = SSD_TIER) -> AdamHyper:
        """Read them off the optimizer the factory makes, which must be plain AdamW (CPUAdam or torch's): the tier
        that keeps the states `where` steps them by AdamW itself (PipelineError naming what the factory makes)."""
        probe = make_optimizer([nn.Parameter(torch.zeros(1))])
        d = probe.defaults
        variants = [k for k in VARIANTS if d.get(k)]
        if type(probe) not in (CPUAdam, torch.optim.AdamW) or variants:
            made = type(probe).__name__ + (f" with {' and '.join(variants)}" if variants else "")
            raise PipelineError(
                f"optimizer states {where} are stepped by plain AdamW with the factory's hyper-parameters, but the "
                f"optimizer factory makes {'an' if made[0] in 'AEIOU' else 'a'} {made}; give CPUAdam or "
                f"torch.optim.AdamW, or keep the states in host memory (memory.optimizer: host), where the factory's "
                f"optimizer steps them"
            )
        return cls(
            float(d["lr"]), (float(d["betas"][0]), float(d["betas"][1])), float(d["eps"]), float(d["weight_decay"])
        )


VARIANTS = ("amsgrad", "maximize")
"""AdamW's options the tiers' own AdamW does not run."""
