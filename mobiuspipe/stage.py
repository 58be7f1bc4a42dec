"""One stage of the pipeline: its layers, its weights in the host tier, its view of the device arena.

The host tier holds the stage's fp32 master weights as ONE flat tensor (pinned on CUDA) and the
optimizer over it. LOAD copies that tensor into an arena slot; the layers then run on views of the slot
through torch.func.functional_call, so no module ever owns device memory. The gradients of all of the
stage's microbatches accumulate into a second slot, which OFFLOAD copies back to the host tier.
"""

from __future__ import annotations

from concurrent.futures import Executor, Future

import torch
from torch import nn
from torch.func import functional_call

from mobiuspipe.device import CopyHandle, Device
from mobiuspipe.memory.arena import DeviceArena, Slot

__all__ = ["Stage"]


class Stage:
    """Stage j: layers first..last, its master weights on host and its optimizer."""

    def __init__(self, j: int, layers: dict[int, nn.Module], device: Device, make_optimizer):
        self.j = j
        self.order = sorted(layers)
        self.layout: list[tuple[int, str, torch.Size, int, int]] = []  # (layer, param name, shape, offset, numel)
        flats, off = [], 0
        for l in self.order:
            for name, p in layers[l].named_parameters():
                self.layout.append((l, name, p.shape, off, p.numel()))
                flats.append(p.detach().reshape(-1).float())
                off += p.numel()
        self.numel = off
        self.nbytes = off * 4
        self.master = nn.Parameter(device.pin(torch.cat(flats)))
        self.master.grad = device.pin(torch.zeros_like(self.master.data))
        self.optimizer = make_optimizer([self.master])
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
        self.weights = arena.acquire(self.nbytes, f"stage {self.j} weights")
        self.loading = device.copy_async(self.weights.view(torch.float32, self.numel), self.master.data)

    def release(self, arena: DeviceArena) -> None:
        arena.release(self.weights)
        self.weights, self._leaves = None, []

    def wait_loaded(self) -> None:
        if self.loading is not None:
            self.loading.wait()
            self.loading = None

    # -- gradients: arena -> host tier, host update ----------------------------------------------
    def begin_backward(self, arena: DeviceArena) -> None:
        """Take a gradient slot, zero it, and make the weight leaves accumulate into it."""
        self.grads = arena.acquire(self.nbytes, f"stage {self.j} gradients")
        gflat = self.grads.view(torch.float32, self.numel)
        gflat.zero_()
        wflat = self.weights.view(torch.float32, self.numel)
        self._leaves = []
        for _, _, shape, off, n in self.layout:
            w = wflat[off:off + n].view(shape).detach().requires_grad_(True)
            w.grad = gflat[off:off + n].view(shape)
            self._leaves.append(w)

    def offload_and_update(self, arena: DeviceArena, host: Executor) -> None:
        """Copy the accumulated gradients to host, free their slot, and start the host update."""
        self.master.grad.copy_(self.grads.view(torch.float32, self.numel))
        arena.release(self.grads)
        self.grads, self._leaves = None, []
        self.updating = host.submit(self.optimizer.step)

    def wait_update(self) -> None:
        if self.updating is not None:
            self.updating.result()
            self.updating = None

    # -- compute ----------------------------------------------------------------------------------
    def _params(self, with_grad: bool) -> dict[int, dict[str, torch.Tensor]]:
        if with_grad:
            tensors = self._leaves
        else:
            wflat = self.weights.view(torch.float32, self.numel)
            tensors = [wflat[off:off + n].view(shape) for _, _, shape, off, n in self.layout]
        out: dict[int, dict[str, torch.Tensor]] = {l: {} for l in self.order}
        for (l, name, *_), t in zip(self.layout, tensors):
            out[l][name] = t
        return out

    def forward(self, x: torch.Tensor, with_grad: bool) -> torch.Tensor:
        """Run the stage's layers on x with the weights in the arena (leaves that collect grads if with_grad)."""
        params = self._params(with_grad)
        for l in self.order:
            x = functional_call(self.layers[l], params[l], (x,))
        return x

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The master weights by "layer.param" name (host tensors), e.g. for saving or comparing."""
        return {f"{l}.{name}": self.master.data[off:off + n].view(shape).clone()
                for l, name, shape, off, n in self.layout}
