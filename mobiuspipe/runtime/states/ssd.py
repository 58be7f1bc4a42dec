"""A stage's fp32 master and moments in the rank's SSD store, its device-dtype weights and gradients in host memory
(SsdStates)."""

from __future__ import annotations

from pathlib import Path

import torch

from mobiuspipe.runtime.states.host import HostStates
from mobiuspipe.runtime.states.ooc import SsdTier, export_ooc, import_ooc, ooc_adam, settle_ooc

__all__ = ["SsdStates"]


class SsdStates(HostStates):
    """The master weights and both moments in the rank's SSD store (records `{prefix}/g...`), stepped by
    OutOfCoreAdam through the tier's host budget; the device-dtype weights and gradients stay in memory."""

    def __init__(self, flat: torch.Tensor, dtype: torch.dtype, pin, tier: SsdTier, prefix: str, versions: int = 1):
        self.loads_master = False
        self._host_memory(flat, dtype, pin, versions)
        self.optimizer = ooc_adam(flat, tier, prefix, tier.host_budget_bytes)
        self._lr = self.optimizer.lr  # before a tentative step

    def step(
        self, grad_scale: float, lr: float | None = None, grads: int = 0, out: int = 0, tentative: bool = False
    ) -> None:
        """HostStates.step; tentative: the out-of-core Adam writes its states beside the ones it read (a second set
        of records on the SSD) and the weights it overwrites are kept in memory, until settle_tentative."""
        self._grads.settle(grads)
        self._lr = self.optimizer.lr
        if tentative:
            self._undo.save(None, None, (self._weights[out],))
        if lr is not None:
            self.optimizer.lr = lr
        g = self._grads.buffer(grads)
        grad = g
        if grad_scale != 1.0:  # .float() is the buffer itself in fp32, which a tentative step must not write
            grad = (
                g.mul(1.0 / grad_scale) if tentative and g.dtype == torch.float32 else g.float().mul_(1.0 / grad_scale)
            )
        self.optimizer.step({"w": grad}, {"w": self._weights[out]}, tentative=tentative)

    def settle_tentative(self, keep: bool) -> None:
        settle_ooc(self.optimizer, keep, self._lr)
        if keep:
            self._undo.drop()
        else:
            self._undo.restore()

    def master_weights(self) -> torch.Tensor:
        return self.optimizer.read_state(("param",))["w"]["param"]

    def export_state(self, link_dir: Path | None = None) -> tuple[dict[str, torch.Tensor], dict]:
        return export_ooc(self.optimizer, link_dir)

    def import_state(self, tensors: dict[str, torch.Tensor], extra: dict, link_dir: Path | None = None) -> None:
        import_ooc(self.optimizer, tensors, extra, link_dir)
        master = self.master_weights()
        for w in self._weights:
            w.copy_(master)
