"""AdamW's hyper-parameters read off an optimizer factory: what the tiers that step the states themselves (on the SSD,
on the gpu) need, where the host tier takes the factory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["AdamHyper"]


@dataclass(frozen=True)
class AdamHyper:
    """AdamW's hyper-parameters, as the ssd tier needs them (the host tier takes an optimizer factory)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float

    @classmethod
    def of(cls, make_optimizer: Callable) -> AdamHyper:
        """Read them off the optimizer the factory makes (it must be an AdamW: CPUAdam or torch's)."""
        probe = make_optimizer([nn.Parameter(torch.zeros(1))])
        d = probe.defaults
        if not {"lr", "betas", "eps", "weight_decay"} <= set(d) or type(probe) is torch.optim.Adam:
            raise ValueError(
                f"optimizer states on SSD are stepped by AdamW, but the optimizer factory makes a "
                f"{type(probe).__name__}; give CPUAdam or torch.optim.AdamW, or keep the states on the host"
            )
        return cls(
            float(d["lr"]), (float(d["betas"][0]), float(d["betas"][1])), float(d["eps"]), float(d["weight_decay"])
        )
