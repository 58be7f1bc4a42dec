"""A stage's trainable states on the gpu itself (memory.optimizer: device; LoRA's adapters, whose states are small):
DeviceStates, stepped by torch's AdamW on the device; and the rule of the tiers that keep one version of their
weights and gradients (one_version)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from torch.optim.adamw import adamw

from mobiuspipe.memory.device import CopyHandle, Device
from mobiuspipe.memory.reduce import finite_flag, squared_norm
from mobiuspipe.optim.hyper import AdamHyper
from mobiuspipe.runtime.states.ooc import in_memory
from partition.rules.placement import UPDATE_CHUNK

__all__ = ["DeviceStates", "one_version"]


class DeviceStates:
    """The trainable weights' states on the gpu itself (memory.optimizer: device; what a LoRA plan chooses when its
    adapters' states fit beside the arena): the fp32 master, AdamW's moments, the accumulated gradients and (bf16,
    fp16) the device-dtype weights are device tensors, stepped by torch's AdamW on the device. No gradient leaves
    the gpu and no host update runs: step() only notes the update, and the compute thread applies it on its stream
    before the stage's next LOAD copies the weights into the arena, or before anyone reads the states. Every device
    operation thus runs on the compute thread, in stream order; the update thread does no device work."""

    speculates = True
    """A tentative update is only noted, like any (HostStates.speculates): undoing it forgets the note."""

    def __init__(self, flat: torch.Tensor, dtype: torch.dtype, device: Device, hyper: AdamHyper):
        self._device = device
        self.loads_master = dtype == torch.float32
        self.master = nn.Parameter(device.to_device(flat, may_wait=True))
        self.weights = self.master.data if self.loads_master else device.to_device(flat, dtype, may_wait=True)
        self.grads = device.empty(flat.shape, dtype)
        self.grads.zero_()
        self.optimizer = torch.optim.AdamW(
            [self.master], lr=hyper.lr, betas=hyper.betas, eps=hyper.eps, weight_decay=hyper.weight_decay
        )
        self.optimizer.state[self.master] = {  # made now, as AdamW would at its first step: the ledger sees them
            "step": torch.tensor(0.0),
            "exp_avg": torch.zeros_like(self.master.data),
            "exp_avg_sq": torch.zeros_like(self.master.data),
        }
        self._pending: tuple[float, float | None] | None = None
        self._sumsq: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """What it holds on the gpu, by name (the ledger counts them)."""
        state = self.optimizer.state[self.master]
        out = {"master": self.master.data, "grads": self.grads, "exp_avg": state["exp_avg"]}
        out["exp_avg_sq"] = state["exp_avg_sq"]
        return out if self.loads_master else {**out, "weights": self.weights}

    def load_into(
        self, dst: torch.Tensor, device: Device, after: Sequence[CopyHandle] = (), version: int = 0
    ) -> CopyHandle:
        """Copy the weights into dst (their arena slot) on the compute stream, after the noted update and the
        `after` copies; returns a handle that has ended (the copy is ordered on the stream that computes). One
        version (no delayed update)."""
        one_version(version)
        self._apply()
        for copy in after:
            copy.wait()
        dst.copy_(self.weights)
        return CopyHandle()

    def make_accumulation_buffer(self) -> None:
        """Nothing: the passes add into the gradients on the gpu."""

    def take_grads(
        self,
        src: torch.Tensor,
        device: Device,
        accumulate: bool = False,
        norm: bool = False,
        into: int = 0,
        finite: bool = False,
    ) -> CopyHandle:
        """Copy (accumulate: add) the stage's gradients from its slot into the resident ones on the compute stream;
        with norm, their squared norm stays on the gpu, where grad_sumsq gives it (finite: nothing here, grads_finite
        reduces the resident gradients on the gpu). The handle marks the end of that
        work (Device.computed): the slot may be refilled after it, by a copy stream too."""
        one_version(into)
        if accumulate:
            self.grads.add_(src)
        else:
            self.grads.copy_(src)
        self._sumsq = squared_norm(self.grads) if norm else None
        return device.computed()

    def grad_sumsq(self) -> float | torch.Tensor:
        """The squared norm take_grads noted, a float64 tensor on the gpu (0.0 when it was not asked for it): the
        engine reads every stage's at once (read_scalars)."""
        return 0.0 if self._sumsq is None else self._sumsq

    def grads_finite(self) -> bool | torch.Tensor:
        """Whether the gradients (a tied half's add included) hold no inf or nan, a bool tensor on the gpu (read as
        grad_sumsq's)."""
        return finite_flag(self.grads)

    grads_on_gpu = True
    """grad_slice gives, and add_grads takes, gpu memory (HostStates.grads_on_gpu)."""

    def grad_slice(self, offset: int, n: int) -> torch.Tensor:
        """A copy of elements offset .. offset + n of the gradients, on the gpu (ordered on the compute stream)."""
        return self.grads[offset : offset + n].clone()

    def add_grads(self, offset: int, t: torch.Tensor) -> None:
        """Add t (gpu memory) into the gradients from element offset on (a tied parameter's other half)."""
        self.grads[offset : offset + t.numel()].add_(t)

    def step(
        self, grad_scale: float, lr: float | None = None, grads: int = 0, out: int = 0, tentative: bool = False
    ) -> None:
        """Note one update from the gradients divided by grad_scale, at lr (the compute thread applies it at the
        stage's next LOAD; a tentative one stays a note until settle_tentative)."""
        one_version(grads, out)
        if self._pending is not None:
            raise RuntimeError("a gpu-resident update was noted twice with no LOAD of the stage between them")
        self._pending = (grad_scale, lr)

    def settle_tentative(self, keep: bool) -> None:
        """Keep the noted tentative update, or forget it (nothing was applied)."""
        if not keep:
            self._pending = None

    def _apply(self) -> None:
        """The noted update, on the calling (compute) thread's stream: AdamW over the master, then the weights. It
        steps UPDATE_CHUNK parameters at a time with torch's AdamW (the functional form the optimizer runs, each
        element's arithmetic unchanged), so that its temporaries are a chunk's, which the plan counts
        (partition.rules.placement.gpu_state_bytes), not the stage's."""
        if self._pending is None:
            return
        (grad_scale, lr), self._pending = self._pending, None
        group = self.optimizer.param_groups[0]
        if lr is not None:
            group["lr"] = lr
        state = self.optimizer.state[self.master]
        master, grads = self.master.data, self.grads
        for a in range(0, master.numel(), UPDATE_CHUNK):
            b = min(a + UPDATE_CHUNK, master.numel())
            grad = grads[a:b].float()  # fp32: the gradients themselves, which AdamW only reads
            if grad_scale != 1.0:
                grad = grad.mul(1.0 / grad_scale)
            adamw(
                [master[a:b]],
                [grad],
                [state["exp_avg"][a:b]],
                [state["exp_avg_sq"][a:b]],
                [],
                [state["step"].clone()],  # AdamW counts each list's step itself: the state's goes up once below
                amsgrad=False,
                beta1=group["betas"][0],
                beta2=group["betas"][1],
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )
        state["step"] += 1
        if not self.loads_master:
            self.weights.copy_(master)

    def master_weights(self) -> torch.Tensor:
        self._apply()
        return self._device.to_host(self.master.data)

    def export_state(self, link_dir: Path | None = None) -> tuple[dict[str, torch.Tensor], dict]:
        """As HostStates.export_state, copied to the host."""
        self._apply()
        state = self.optimizer.state[self.master]
        tensors = {"master": self._device.to_host(self.master.data), "opt/step": state["step"].clone()}
        tensors.update({f"opt/{k}": self._device.to_host(state[k]) for k in ("exp_avg", "exp_avg_sq")})
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return tensors, {"param_groups": groups}

    def import_state(self, tensors: dict[str, torch.Tensor], extra: dict, link_dir: Path | None = None) -> None:
        """Set the states export_state gave (as HostStates.import_state: the hyper-parameters stay the optimizer's
        own), copied into the gpu's."""
        tensors = in_memory(tensors, extra, link_dir)
        self._pending = None
        self.master.data.copy_(tensors["master"])  # from host memory into place: no stage-sized gpu temporary
        if not self.loads_master:
            self.weights.copy_(self.master.data)
        state = self.optimizer.state[self.master]
        for k in ("exp_avg", "exp_avg_sq"):
            state[k].copy_(tensors[f"opt/{k}"])
        state["step"] = tensors["opt/step"].to(torch.float32).reshape(())


def one_version(*indices: int) -> None:
    """A tier that keeps one version of its weights and gradients is asked for version 0 only (a Pipeline refuses
    the delayed update over it first)."""
    if any(indices):
        raise RuntimeError(f"versions {indices} of a tier that keeps one: a bug in the Stage's choice of versions")
