"""One stage of the pipeline: its layers, its weights in the host tier, its view of the device arena.

The host tier holds the stage's fp32 master weights as ONE flat tensor (pinned on CUDA) and the
optimizer over it. LOAD copies that tensor into an arena slot; the layers then run on views of the slot
through torch.func.functional_call, so no module ever owns device memory. The gradients of all of the
stage's microbatches accumulate into a second slot, which OFFLOAD copies back to the host tier.
Buffers (masks, rotary tables, ...) are small and stay on the device for the whole run.
"""

from __future__ import annotations

from concurrent.futures import Executor, Future
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from mobiuspipe.device import CopyHandle, Device
from mobiuspipe.memory.arena import DeviceArena, Slot

__all__ = ["Stage", "ParamSlice"]


@dataclass(frozen=True)
class ParamSlice:
    """Where one parameter lives in its stage's flat weights: elements offset .. offset + numel."""

    layer: int
    name: str
    shape: torch.Size
    offset: int
    numel: int

    @property
    def key(self) -> str:
        """The parameter's name in nn.Sequential(*layers).state_dict(): "layer.name"."""
        return f"{self.layer}.{self.name}"

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """This parameter's view of a flat tensor laid out like the stage's weights."""
        return flat[self.offset : self.offset + self.numel].view(self.shape)


class Stage:
    """Stage `index`: its layers (by layer number), master weights on host, its optimizer, its arena slots."""

    def __init__(self, index: int, layers: dict[int, nn.Module], device: Device, make_optimizer):
        self.index = index
        self.order = sorted(layers)
        self.params = _param_slices(layers, self.order)
        self.numel = sum(p.numel for p in self.params)
        self.nbytes = self.numel * 4
        flat = [p.detach().reshape(-1).float() for l in self.order for _, p in layers[l].named_parameters()]
        self.master = nn.Parameter(device.pin(torch.cat(flat) if flat else torch.zeros(0)))
        self.master_grad = device.pin(torch.zeros_like(self.master.data))
        self.master.grad = self.master_grad
        self.optimizer = make_optimizer([self.master])
        self.buffers = {l: {n: b.to(device.torch_device) for n, b in layers[l].named_buffers()} for l in self.order}
        self._persistent = {l: _persistent_buffer_names(layers[l]) for l in self.order}
        self.layers = {l: layers[l].to("meta") for l in self.order}  # shapes only; weights live in the tiers
        self.weights: Slot | None = None
        self.grads: Slot | None = None
        self.loading: CopyHandle | None = None
        self.updating: Future | None = None
        self._leaves: list[torch.Tensor] = []

    # -- weights: host tier <-> arena -------------------------------------------------------------
    def load(self, arena: DeviceArena, device: Device) -> None:
        """Start copying the master weights into a free slot (after this stage's pending update)."""
        self.wait_update()
        self.weights = arena.acquire(self.nbytes, f"stage {self.index} weights")
        self.loading = device.copy_async(self.weights.view(torch.float32, self.numel), self.master.data)

    def release(self, arena: DeviceArena) -> None:
        arena.release(_held(self.weights, self.index, "weights"))
        self.weights, self._leaves = None, []

    def wait_loaded(self) -> None:
        if self.loading is not None:
            self.loading.wait()
            self.loading = None

    # -- gradients: arena -> host tier, host update ----------------------------------------------
    def begin_backward(self, arena: DeviceArena) -> None:
        """Take a gradient slot, zero it, and make the weight leaves accumulate into it."""
        self.grads = arena.acquire(self.nbytes, f"stage {self.index} gradients")
        gflat = self.grads.view(torch.float32, self.numel)
        gflat.zero_()
        wflat = _held(self.weights, self.index, "weights").view(torch.float32, self.numel)
        self._leaves = []
        for p in self.params:
            w = p.of(wflat).detach().requires_grad_(True)
            w.grad = p.of(gflat)
            self._leaves.append(w)

    def offload_and_update(self, arena: DeviceArena, updater: Executor) -> None:
        """Copy the accumulated gradients to host, free their slot, and start the host update on `updater`."""
        grads = _held(self.grads, self.index, "gradients")
        self.master_grad.copy_(grads.view(torch.float32, self.numel))
        arena.release(grads)
        self.grads, self._leaves = None, []
        self.updating = updater.submit(self.optimizer.step)

    def wait_update(self) -> None:
        if self.updating is not None:
            self.updating.result()
            self.updating = None

    # -- compute ----------------------------------------------------------------------------------
    def _tensors(self, with_grad: bool) -> dict[int, dict[str, torch.Tensor]]:
        """Per layer, its parameters (arena views, or the grad-collecting leaves) and its buffers."""
        if with_grad:
            weights = self._leaves
        else:
            wflat = _held(self.weights, self.index, "weights").view(torch.float32, self.numel)
            weights = [p.of(wflat) for p in self.params]
        out = {l: dict(self.buffers[l]) for l in self.order}
        for p, t in zip(self.params, weights):
            out[p.layer][p.name] = t
        return out

    def forward(self, x: torch.Tensor, with_grad: bool) -> torch.Tensor:
        """Run the stage's layers on x with the weights in the arena (leaves that collect grads if with_grad)."""
        tensors = self._tensors(with_grad)
        for l in self.order:
            x = functional_call(self.layers[l], tensors[l], (x,))
        return x

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Master weights and persistent buffers (host copies) named as nn.Sequential(*layers).state_dict()."""
        out = {p.key: p.of(self.master.data).clone() for p in self.params}
        for l in self.order:
            out.update(
                {
                    f"{l}.{n}": b.detach().to("cpu", copy=True)
                    for n, b in self.buffers[l].items()
                    if n in self._persistent[l]
                }
            )
        return out


def _held(slot: Slot | None, j: int, what: str) -> Slot:
    """The slot a stage holds; a missing one is a schedule bug (the checker should have refused it)."""
    if slot is None:
        raise RuntimeError(
            f"stage {j} has no {what} in the arena here: the schedule runs it before its LOAD "
            f"(or backward) action; this is a bug in the schedule builder"
        )
    return slot


def _param_slices(layers: dict[int, nn.Module], order: list[int]) -> list[ParamSlice]:
    out, offset = [], 0
    for l in order:
        for name, p in layers[l].named_parameters():
            out.append(ParamSlice(l, name, p.shape, offset, p.numel()))
            offset += p.numel()
    return out


def _persistent_buffer_names(layer: nn.Module) -> set[str]:
    """Names of the buffers that layer.state_dict() holds (non-persistent ones are left out)."""
    params = {n for n, _ in layer.named_parameters()}
    return set(layer.state_dict(keep_vars=True)) - params
