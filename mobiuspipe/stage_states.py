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

__all__ = ["HostStates", "SsdStates", "SsdTier", "AdamHyper", "Placement", "place_states", "HOST_STATE_BYTES"]


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


HOST_STATE_BYTES = 12
"""Host bytes per parameter of a stage whose states live in memory: fp32 master + exp_avg + exp_avg_sq."""


@dataclass(frozen=True)
class Placement:
    """Where each of a rank's stages keeps its states, and the host bytes each ssd stage streams through."""

    tiers: dict[int, str]
    """Stage j -> "host" or "ssd"."""
    slot_bytes: int
    """Host budget of each ssd stage's out-of-core Adam (0 when no stage is on ssd)."""

    @property
    def on_ssd(self) -> list[int]:
        return sorted(j for j, t in self.tiers.items() if t == "ssd")


def place_states(mode: str, params: dict[int, int], budget_bytes: int, least_slot_bytes: int) -> Placement:
    """Tiers of stages {j: parameter count} under a host budget. "host": all in memory; "ssd": all on SSD,
    sharing the budget; "auto": all in memory if their 12 bytes per parameter fit the budget, else the
    largest move to SSD, one by one, until the ssd stages' share of what the rest leave (their streaming
    slots) is at least a quarter of the budget and least_slot_bytes each. ValueError when even all on SSD
    do not fit."""
    if mode == "host" or not params:
        return Placement({j: "host" for j in params}, 0)
    if mode == "auto" and sum(HOST_STATE_BYTES * n for n in params.values()) <= budget_bytes:
        return Placement({j: "host" for j in params}, 0)
    largest = sorted(params, key=lambda j: (-params[j], j))
    first = len(largest) if mode == "ssd" else 1
    for k in range(first, len(largest) + 1):
        host = sum(HOST_STATE_BYTES * params[j] for j in largest[k:])
        slot = (budget_bytes - host) // k
        if slot >= max(least_slot_bytes, budget_bytes // 4 // k):
            return Placement({j: "ssd" if j in largest[:k] else "host" for j in params}, slot)
    n = len(params)
    raise ValueError(
        f"a host budget of {budget_bytes} bytes gives each of {n} stages on SSD {budget_bytes // n} bytes, below "
        f"the {least_slot_bytes} the out-of-core Adam needs: raise memory.host_budget_mb to at least "
        f"{least_slot_bytes * n / 2**20:g}"
    )
