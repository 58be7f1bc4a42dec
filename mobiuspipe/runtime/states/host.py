"""A stage's states in host memory: an optimizer over a flat fp32 master (HostStates), the device-dtype weights the
device loads and the gradients it offloads."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from mobiuspipe.memory.device import CopyHandle, Device
from mobiuspipe.optim.undo import StepUndo
from mobiuspipe.runtime.states.host_grads import HostGrads
from mobiuspipe.runtime.states.ooc import in_memory
from mobiuspipe.standin.places import plain

__all__ = ["HostStates"]


class HostStates:
    """The master weights as one flat fp32 parameter in host memory (pinned on CUDA), stepped by the
    optimizer the factory makes; the fp32 master is itself what fp32 training loads (one version). The device-dtype
    weights (bf16/fp16) and the offloaded gradients are host tensors too.

    versions 2 (the delayed update, train.delayed_update): the weights the device loads and the offloaded gradients
    are kept twice, so that a step's loads read one version of the weights while the update of the step before
    writes the other from the other gradients (mobiuspipe.runtime.stage.Stage picks them); in fp32 the loaded
    versions are then copies of the master, which that update changes in place."""

    def __init__(self, flat: torch.Tensor, dtype: torch.dtype, pin, make_optimizer, versions: int = 1):
        self.loads_master = dtype == torch.float32 and versions == 1
        """fp32 training: the device loads the master itself and master.grad is the offloaded gradient buffer."""
        self.master = nn.Parameter(pin(flat) if self.loads_master else flat)  # pinned only where copies read it
        self._host_memory(flat, dtype, pin, versions, self.master.data if self.loads_master else None)
        if self.loads_master:
            self.master.grad = self._grads.buffer(0)
        self.optimizer = make_optimizer([self.master])

    def _host_memory(
        self, flat: torch.Tensor, dtype: torch.dtype, pin, versions: int, first: torch.Tensor | None = None
    ) -> None:
        """The weights the device loads (`versions` of them, the first `first` if given) and the gradient buffers, in
        host memory, page-locked by pin; the undo of a tentative step."""
        self._weights = [first if first is not None else pin(flat.to(dtype, copy=True))]
        self._weights += [pin(flat.to(dtype, copy=True)) for _ in range(versions - 1)]
        self._grads = HostGrads(flat.numel(), dtype, pin, versions)
        self._undo = StepUndo()

    @property
    def weights(self) -> torch.Tensor:
        """The device-dtype weights of version 0 (the only one without the delayed update)."""
        return self._weights[0]

    @property
    def grads(self) -> torch.Tensor:
        """The gradients take_grads took last."""
        return self._grads.last

    def version(self, i: int) -> torch.Tensor:
        """Version i of the weights the device loads (a checkpoint saves the one a delayed step reads)."""
        return self._weights[i]

    def set_version(self, i: int, weights: torch.Tensor) -> None:
        """Copy `weights` into version i of the weights the device loads (a resumed delayed run's lagging weights)."""
        self._weights[i].copy_(weights)

    def load_into(
        self, dst: torch.Tensor, device: Device, after: Sequence[CopyHandle] = (), version: int = 0
    ) -> CopyHandle:
        """Start copying the weights the device computes with (their `version`) into dst (its arena slot, flat),
        after `after`: every user of dst (its slot's release mark and the copies that still read it)."""
        return device.copy_in(dst, self._weights[version], after, computed=False)

    def take_grads(
        self,
        src: torch.Tensor,
        device: Device,
        accumulate: bool = False,
        norm: bool = False,
        into: int = 0,
        finite: bool = False,
    ) -> CopyHandle:
        """Start copying the stage's accumulated gradients (flat, device dtype) off the device on the copy-out
        stream, into gradient buffer `into` (accumulate: added to the ones taken before); with norm, note the
        result's squared L2 norm (float64), with finite whether it is all finite: both off the compute thread, or for
        a step's only pass reduced from src on the gpu (HostGrads). Whoever reads the gradients (the update, a tied
        exchange; the overflow check and the norm when the host finished them) waits for that. Returns the copy
        (the slot src lies in is free once it has ended)."""
        return self._grads.take(src, device, accumulate, norm, finite, into)

    def make_accumulation_buffer(self) -> None:
        """Make the buffer an accumulated pass's gradients come into now (on CUDA page-locked: not mid-step)."""
        self._grads.make_accumulation_buffer()

    def grad_sumsq(self) -> float | torch.Tensor:
        """The squared L2 norm of the last offloaded gradients (0.0 when take_grads was not asked for it; a 0-d tensor
        on the gpu when reduced there: HostGrads)."""
        return self._grads.sumsq()

    def grads_finite(self) -> bool | torch.Tensor:
        """Whether the last offloaded gradients hold no inf or nan (an fp16 overflow; a 0-d tensor on the gpu when
        reduced there)."""
        return self._grads.all_finite()

    grads_on_gpu = False
    """Whether grad_slice gives, and add_grads takes, gpu memory (DeviceStates) rather than host memory."""

    def grad_slice(self, offset: int, n: int) -> torch.Tensor:
        """A copy of elements offset .. offset + n of the offloaded gradients (device dtype, host memory)."""
        return self._grads.read(offset, n)

    def add_grads(self, offset: int, t: torch.Tensor) -> None:
        """Add t (host memory) into the offloaded gradients from element offset on (a tied parameter's other half)."""
        self._grads.add(offset, t)

    speculates = True
    """Whether step(tentative=True) and settle_tentative work here (a speculative update: Pipeline's)."""

    def step(
        self, grad_scale: float, lr: float | None = None, grads: int = 0, out: int = 0, tentative: bool = False
    ) -> None:
        """One update from gradient buffer `grads` divided by grad_scale, at lr (None: the optimizer's own), the next
        weights written into version `out`. tentative: keep what it overwrites until settle_tentative (the
        gradients are never written: the norm and the overflow check may read them meanwhile). It waits for the
        offload into buffer `grads` only (the delayed update's next one, into the other, may be in flight)."""
        self._grads.settle(grads)
        if tentative:
            self._undo.save(self.optimizer, self.master, () if self.loads_master else (self._weights[out],))
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        g, weights = self._grads.buffer(grads), self._weights[out]
        if g.dtype == torch.float32:  # fp32: the update reads master.grad, the buffer itself
            if grad_scale != 1.0:
                g = g.mul(1.0 / grad_scale) if tentative else g.mul_(1.0 / grad_scale)
            self.master.grad = g
            self.optimizer.step()
            if not self.loads_master:
                weights.copy_(self.master.data)
            return
        grad = g if grad_scale == 1.0 else g.float().mul_(1.0 / grad_scale)
        step_fused = getattr(self.optimizer, "step_fused", None)
        if step_fused is not None:
            step_fused({self.master: weights}, grads={self.master: grad})
            return
        self.master.grad = grad.float()
        self.optimizer.step()
        weights.copy_(self.master.data)

    def settle_tentative(self, keep: bool) -> None:
        """The step(tentative=True) before was right (keep) or is undone: every state and weight bit as before it."""
        if keep:
            self._undo.drop()
        else:
            self._undo.restore()

    def master_weights(self) -> torch.Tensor:
        return plain(self.master.data)

    def export_state(self, link_dir: Path | None = None) -> tuple[dict[str, torch.Tensor], dict]:
        """A copy of what the next step depends on: {"master": fp32 flat, "opt/KEY": the optimizer's state
        tensors (AdamW: step, exp_avg, exp_avg_sq)} and the optimizer's param_groups (hyper-parameters: a record of
        them, which import_state does not read back: a resumed run keeps its own).
        States on SSD are hard-linked into link_dir instead where it can (see SsdStates)."""
        sd = self.optimizer.state_dict()
        own = sd["state"].get(0, {})
        tensors = {"master": self.master.data.clone()}
        tensors.update({f"opt/{k}": _tensor(v).clone() for k, v in own.items()})
        groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
        return tensors, {"param_groups": groups}

    def import_state(self, tensors: dict[str, torch.Tensor], extra: dict, link_dir: Path | None = None) -> None:
        """Set the states export_state gave (the device-dtype weights follow from the master), keeping the optimizer's
        own hyper-parameters (a resumed run's, which may differ from the saved ones); link_dir: where export_state
        linked the files of states on SSD (read from there: states that were on SSD)."""
        tensors = in_memory(tensors, extra, link_dir)
        self.master.data.copy_(tensors["master"])
        if not self.loads_master:
            for w in self._weights:
                w.copy_(self.master.data)
        state = {k[4:]: v for k, v in tensors.items() if k.startswith("opt/")}
        # the states alone: the hyper-parameters (param_groups) stay the run's own, as the other tiers keep them
        groups = self.optimizer.state_dict()["param_groups"]
        self.optimizer.load_state_dict({"state": {0: state} if state else {}, "param_groups": groups})


def _tensor(v) -> torch.Tensor:
    """An optimizer state value as a tensor (torch keeps AdamW's step as a tensor; some keep a number)."""
    return v if isinstance(v, torch.Tensor) else torch.tensor(float(v), dtype=torch.float64)
