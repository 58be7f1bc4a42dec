"""Where a stage's fp32 master weights and optimizer states live: the host tier (an optimizer over a flat fp32
parameter in memory) or the ssd tier (OutOfCoreAdam over a per-rank SSDStore, streamed through a fixed host
budget). Both step from the gradients the stage offloaded and write the weights the next LOAD copies to the
device (bf16/fp16, or fp32) in the same pass; both give the same bits (the same AdamW kernel).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from mobiuspipe.memory.ssd_store import SSDStore
from mobiuspipe.optim.ooc_adam import OutOfCoreAdam

__all__ = ["HostStates", "SsdStates", "SsdTier", "AdamHyper"]


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


@dataclass(frozen=True)
class SsdTier:
    """One rank's store and the host memory each of its stages' out-of-core optimizers may use."""

    store: SSDStore
    host_budget_bytes: int
    hyper: AdamHyper


class HostStates:
    """The master weights as one flat fp32 parameter in host memory (pinned on CUDA), stepped by the
    optimizer the factory makes; the fp32 master is itself what fp32 training loads."""

    def __init__(self, flat: torch.Tensor, pin, make_optimizer, weights: torch.Tensor | None, grads: torch.Tensor):
        self.master = nn.Parameter(pin(flat))
        self.loads_master = weights is None
        """fp32 training: the device loads the master itself and master.grad is the offloaded gradient buffer."""
        self.weights = self.master.data if weights is None else weights
        self.grads = grads
        if weights is None:
            self.master.grad = grads
        self.optimizer = make_optimizer([self.master])

    def step(self, grad_scale: float) -> None:
        if self.loads_master:
            self.optimizer.step()
            return
        grad = self.grads if grad_scale == 1.0 else self.grads.float().mul_(1.0 / grad_scale)
        step_fused = getattr(self.optimizer, "step_fused", None)
        if step_fused is not None:
            step_fused({self.master: self.weights}, grads={self.master: grad})
            return
        self.master.grad = grad.float()
        self.optimizer.step()
        self.weights.copy_(self.master.data)

    def master_weights(self) -> torch.Tensor:
        return self.master.data


class SsdStates:
    """The master weights and both moments in the rank's SSD store (records `{prefix}/g...`), stepped by
    OutOfCoreAdam through the tier's host budget; only the loaded weights and the gradients stay in memory."""

    def __init__(self, flat: torch.Tensor, tier: SsdTier, prefix: str, weights: torch.Tensor, grads: torch.Tensor):
        h = tier.hyper
        self.optimizer = OutOfCoreAdam.create(
            tier.store,
            {"w": flat},
            lr=h.lr,
            betas=h.betas,
            eps=h.eps,
            weight_decay=h.weight_decay,
            host_budget_bytes=tier.host_budget_bytes,
            prefix=prefix,
        )
        self.weights, self.grads = weights, grads

    def step(self, grad_scale: float) -> None:
        grad = self.grads if grad_scale == 1.0 else self.grads.float().mul_(1.0 / grad_scale)
        self.optimizer.step({"w": grad}, {"w": self.weights})

    def master_weights(self) -> torch.Tensor:
        return self.optimizer.read_state()["w"]["param"]
