"""One stage of the pipeline: its layers, its states in the host or SSD tier, its view of the device arena.

The stage's trainable weights are ONE flat tensor: the fp32 master, the optimizer over it and, in bf16/fp16
training, the low-precision copy live in host memory (pinned on CUDA) or in the SSD store (runtime.states). Frozen
parameters (requires_grad False: LoRA's base weights) are a second flat, of bytes, in host memory (FrozenWeights)
or in the SSD store (SsdFrozenWeights):
each in the training dtype if it is floating, else in its own (an NF4 base's codes and scales:
mobiuspipe.lora.quant), the widest items first so that each lies at an offset of its item size with no padding;
loaded into the same slot after the trainable ones and never offloaded or updated.
LOAD copies the weights in the training dtype into an arena slot; the layers (on the meta device) then run on views
of the slot, bound to them once per visit and way of running (mobiuspipe.models.bind) and unbound at RELEASE, so no
module owns device memory beyond the visit. The gradients of all of the stage's
microbatches accumulate (in the training dtype) into a second slot, which OFFLOAD hands to the states
tier. The host update steps the fp32 master weights and writes the next low-precision copy in the same
pass where the optimizer can (CPUAdam.step_fused). Buffers (masks, rotary tables, ...) are small and
stay on the device for the whole run, floating ones in the training dtype.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from mobiuspipe.memory.arena import DeviceArena, Slot
from mobiuspipe.memory.device import CopyHandle, Device
from mobiuspipe.memory.store.ssd_store import SSDStore
from mobiuspipe.models.bind import bind, members, unbind
from mobiuspipe.optim.hyper import AdamHyper
from mobiuspipe.runtime.frozen import Frozen, FrozenWeights, SsdFrozenWeights
from mobiuspipe.runtime.states import (
    DeviceStates,
    HostStates,
    SsdStates,
    SsdStreamStates,
    SsdTier,
    StageStates,
)
from partition.rules.costmodel import frozen_start, slot_weight_bytes

__all__ = ["Stage", "ParamSlice", "FrozenSlice"]


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


@dataclass(frozen=True)
class FrozenSlice:
    """Where one frozen parameter lives in its stage's frozen bytes: bytes offset .. offset + nbytes, of `dtype`."""

    layer: int
    name: str
    shape: torch.Size
    dtype: torch.dtype
    offset: int
    nbytes: int

    @property
    def key(self) -> str:
        return f"{self.layer}.{self.name}"

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """This parameter's view of a uint8 tensor laid out like the stage's frozen bytes."""
        return flat[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


class _Tentative(NamedTuple):
    """A speculative update in flight (Stage.start_update(tentative=True)): what it assumed and wrote."""

    newest: int
    """The version of the weights the update before it wrote (restored if the step is skipped)."""
    last_update: int
    grad_scale: float
    """What it divided the gradients by (the loss scale: no clipping assumed)."""
    lr: float | None
    note: Callable | None
    grads: int
    """The gradient buffer it read."""
    out: int
    """The version of the weights it wrote."""


class Stage:
    """Stage `index`: its layers (by layer number), master weights on host, its optimizer, its arena slots."""

    def __init__(
        self,
        index: int,
        layers: dict[int, nn.Module],
        device: Device,
        make_optimizer,
        dtype=torch.float32,
        ssd: SsdTier | None = None,
        weights_on_ssd: bool = False,
        frozen_store: SSDStore | None = None,
        on_device: AdamHyper | None = None,
        versions: int = 1,
        accumulates: bool = False,
    ):
        """ssd: the SSD tier of the optimizer states (None: host), weights_on_ssd: of the weights and gradients too;
        frozen_store: the store that keeps the frozen weights (None: host memory); on_device: keep the states on the
        gpu, stepped by AdamW with these hyper-parameters (DeviceStates); versions: 2 for the delayed update (the
        loaded weights and the gradients kept twice: HostStates and SsdStates only); accumulates: gradient accumulation
        (the host buffer a later pass's gradients come into is made now, not mid-step)."""
        self.index, self.dtype = index, dtype
        self.order = sorted(layers)
        self.params = _param_slices(layers, self.order, trainable=True)
        """The trainable parameters: offsets in the trainable flat, which opens the weight slot."""
        self.numel = sum(p.numel for p in self.params)
        self.nbytes = self.numel * dtype.itemsize
        """Bytes of the trainable weights (and of their gradients)."""
        self.frozen = _frozen_slices(layers, self.order, dtype)
        """The frozen parameters: offsets in the frozen bytes, which follow the trainable ones in the weight slot."""
        frozen_nbytes = sum(f.nbytes for f in self.frozen)
        self.frozen_start = frozen_start(self.nbytes, frozen_nbytes)
        """Where the frozen bytes start in the weight slot (bytes): aligned for the widest frozen item."""
        self.weight_nbytes = slot_weight_bytes(self.nbytes, frozen_nbytes)  # the plan's P_j of these layers
        """Bytes of the weight slot the stage fills: its trainable weights, then its frozen ones."""
        flat = _flat(layers, self.order, trainable=True, dtype=torch.float32)
        self.frozen_weights = _frozen_tier(
            _frozen_bytes(layers, self.order, self.frozen, dtype), device, frozen_store, index
        )
        self.states: StageStates
        """Where the master weights, moments, device-dtype weights and offloaded gradients live."""
        if on_device is not None:
            self.states = DeviceStates(flat, dtype, device, on_device)
        elif ssd is None:
            self.states = HostStates(flat, dtype, device.pin, make_optimizer, versions)
        elif not weights_on_ssd:
            self.states = SsdStates(flat, dtype, device.pin, ssd, f"stage{index}", versions)
        else:
            self.states = SsdStreamStates(flat, dtype, ssd, f"stage{index}", device.host_empty, versions)
        if accumulates:
            self.states.make_accumulation_buffer()
        self.device = device
        """The gpu the stage's slots and buffers are on, and whose copy streams move its weights and gradients."""
        self.buffers = {l: {n: _buffer_on(b, device, dtype) for n, b in layers[l].named_buffers()} for l in self.order}
        self._persistent = {l: _persistent_buffer_names(layers[l]) for l in self.order}
        self.layers = {l: layers[l].to("meta") for l in self.order}  # shapes only; weights live in the tiers
        self._members = {l: members(self.layers[l]) for l in self.order}
        self._views: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        """Per way of running ("kept", "grad", "plain"), the tensors each layer runs on in this visit."""
        self._bound: dict[int, str] = {}
        """Layer -> the way of running its modules are bound to now (none: unbound)."""
        self.weights: Slot | None = None
        self.grads: Slot | None = None
        self._unzeroed: list[CopyHandle] | None = None
        """While the gradient slot is not yet zeroed this visit: the offloads still reading it (zero_grads)."""
        self.loading: list[CopyHandle] = []
        self.versions = versions
        self._updates: list[Future] = []
        """The host updates started and not yet waited for, oldest first."""
        self._newest = 0
        """The version of the weights the last update started writes (the initial weights: 0)."""
        self._last_update = -1
        """The optimizer step whose update started last (-1: none)."""
        self._tentative: _Tentative | None = None
        """The tentative update started last, until validate_update settles it."""
        self._leaves: list[torch.Tensor] = []
        self._forward_leaves: list[torch.Tensor] = []
        """Weight leaves of the graphs a keep or selective forward visit keeps until the backward (views of that
        visit's slot, whose bytes are never read again: their .grad is all the backward touches)."""

    # -- weights: host tier <-> arena -------------------------------------------------------------
    def load(self, arena: DeviceArena, lag_of: int | None = None) -> None:
        """Start copying the weights into a free slot: the trainable ones from their tier, then the frozen ones. The
        weights after every update started (waited for); lag_of (a delayed step of the delayed update: its optimizer
        step): the weights before the update of step lag_of - 1, which may still run while this step computes."""
        version = self._newest
        if lag_of is not None and self._last_update == lag_of - 1 and self.versions > 1:
            self._wait_updates(leave=1)  # every update but the step before's, which writes the other version
            version = 1 - self._newest
        else:
            self.wait_update()
        self.weights = arena.acquire(self.weight_nbytes, f"stage {self.index} weights")
        self._rebind()
        after = self.weights.take_busy()
        dst = self.weights.view(self.dtype, self.numel)
        self.loading = [self.states.load_into(dst, self.device, after, version)]
        if self.frozen_weights is not None:
            frozen = self.weights.data[self.frozen_start : self.weight_nbytes]
            self.loading.append(self.frozen_weights.load_into(frozen, self.device, after))

    def release(self, arena: DeviceArena) -> None:
        """Give the weights' slot back, marked after the compute queued so far: the next load into it waits for
        that compute only, not for what is queued by the time it is issued."""
        arena.release(_held(self.weights, self.index, "weights"), [self.device.computed()])
        self.weights, self._leaves = None, []
        self._rebind()
        for l in self.order:
            unbind(self._members[l])

    def wait_loaded(self) -> None:
        for copy in self.loading:
            copy.wait()
        self.loading = []

    # -- gradients: arena -> host tier, host update ----------------------------------------------
    def begin_backward(self, arena: DeviceArena) -> None:
        """Take a gradient slot and make the weight leaves accumulate into it; zero_grads clears it before the visit's
        first backward (a recompute forward need not wait for the offload still reading the slot)."""
        self.grads = arena.acquire(self.nbytes, f"stage {self.index} gradients", grads=True)
        self._unzeroed = self.grads.take_busy()  # the offloads still reading the slot
        gflat = self.grads.view(self.dtype, self.numel)
        wflat = _held(self.weights, self.index, "weights").view(self.dtype, self.numel)
        self._leaves = _leaves_of(self.params, wflat)
        for leaves in (self._leaves, self._forward_leaves):
            for p, w in zip(self.params, leaves):
                w.grad = p.of(gflat)
        self._rebind()

    def zero_grads(self) -> None:
        """Before the first backward of a visit: wait for the offloads still reading the gradient slot, then zero it."""
        if self._unzeroed is None:
            return
        for copy in self._unzeroed:
            copy.wait()
        _held(self.grads, self.index, "gradients").view(self.dtype, self.numel).zero_()
        self._unzeroed = None

    def offload(
        self, arena: DeviceArena, accumulate: bool = False, norm: bool = False, step: int = 0, finite: bool = False
    ) -> None:
        """Start copying the accumulated gradients to the host tier (which adds them to its gradients: accumulate)
        on the copy-out stream, and free their slot for whoever orders after that copy; with norm the tier notes
        the squared norm of its gradients (states.grad_sumsq), with finite whether they are all finite
        (states.grads_finite). `step`: the optimizer step, whose parity picks the
        gradient buffer with two versions (the update of the step before may still read the other)."""
        self.zero_grads()  # a visit with no backward offloads zeros
        grads = _held(self.grads, self.index, "gradients")
        into = step % self.versions
        copy = self.states.take_grads(grads.view(self.dtype, self.numel), self.device, accumulate, norm, into, finite)
        arena.release(grads, [copy] if copy is not None else [])
        self.grads, self._leaves, self._forward_leaves = None, [], []
        self._rebind()

    def grads_finite(self) -> bool | torch.Tensor:
        """Whether the offloaded gradients hold no inf or nan (an fp16 overflow); a bool tensor on the gpu where the
        states reduced them there (DeviceStates; HostGrads for a step's only pass), for the engine to read with the
        others."""
        return self.states.grads_finite()

    def start_update(
        self,
        updater: Executor,
        grad_scale: float = 1.0,
        lr: float | None = None,
        note: Callable | None = None,
        step: int = 0,
        tentative: bool = False,
    ) -> None:
        """Start the host update of optimizer step `step`'s offloaded gradients (divided by grad_scale) on
        `updater`, at learning rate lr (None: the optimizer's own); note(start), if given, is called when it ends (a
        trace's record). With two versions it writes the one the last update did not (which a delayed step may be
        loading), from the gradient buffer of its step. tentative (where states.speculates): a speculative update,
        kept until validate_update says whether it stands."""
        out = 1 - self._newest if self.versions > 1 else 0
        grads = step % self.versions
        if tentative:
            self._tentative = _Tentative(self._newest, self._last_update, grad_scale, lr, note, grads, out)
        self._updates.append(updater.submit(self._update, grad_scale, lr, note, grads, out, tentative))
        self._newest, self._last_update = out, step

    def _update(
        self, grad_scale: float, lr: float | None, note: Callable | None, grads: int, out: int, tentative: bool = False
    ) -> None:
        start = time.perf_counter()
        self.states.step(grad_scale, lr, grads, out, tentative)
        if note is not None:
            note(start)

    def validate_update(self, updater: Executor, apply: bool, grad_scale: float) -> bool:
        """Settle the tentative update, once the step knows whether to apply it (no overflow) and what to divide the
        gradients by (the loss scale, over the clipping coefficient when that is below 1): it stands when it assumed
        both; otherwise it is rolled back and, when the step applies, redone with grad_scale, all on `updater` after
        it. Returns whether it was rolled back."""
        t, self._tentative = self._tentative, None
        if t is None:
            raise RuntimeError(f"stage {self.index}: validate_update without a tentative update started")
        keep = apply and grad_scale == t.grad_scale
        self._updates.append(updater.submit(self._settle_update, keep, apply, grad_scale, t.lr, t.note, t.grads, t.out))
        if not apply:  # the step is skipped: no update wrote a version
            self._newest, self._last_update = t.newest, t.last_update
        return not keep

    def _settle_update(
        self, keep: bool, apply: bool, grad_scale: float, lr: float | None, note: Callable | None, grads: int, out: int
    ) -> None:
        self.states.settle_tentative(keep)
        if apply and not keep:
            self._update(grad_scale, lr, note, grads, out)

    @property
    def speculates(self) -> bool:
        """Whether this stage's updates may start tentatively (its states' tier keeps what they overwrite)."""
        return self.states.speculates

    def wait_update(self) -> None:
        """Wait for every update started (after it, the states hold every step's)."""
        self._wait_updates(leave=0)

    def _wait_updates(self, leave: int) -> None:
        """Wait for the updates started but the last `leave` of them."""
        while len(self._updates) > leave:
            self._updates.pop(0).result()

    def lagging_weights(self) -> tuple[torch.Tensor, int] | None:
        """With two versions, after wait_update: (the weights a delayed step after the last update loads, that
        update's step), what a checkpoint keeps beside the states; None with one version or before any update."""
        if self.versions == 1 or self._last_update < 0:
            return None
        assert not isinstance(self.states, DeviceStates)  # the gpu tier keeps one version
        return self.states.version(1 - self._newest), self._last_update

    def resume_lagging(self, weights: torch.Tensor | None, last_update: int) -> None:
        """After the states are restored (every version their newest weights): the weights a delayed step loads (None:
        the newest) and the step whose update the checkpoint holds the last of (a checkpoint's lagging_weights)."""
        self._updates, self._newest, self._last_update = [], 0, last_update
        if weights is not None:
            assert not isinstance(self.states, DeviceStates)  # the gpu tier keeps one version
            self.states.set_version(1, weights)

    # -- compute ----------------------------------------------------------------------------------
    def trainable_keys(self) -> list[str]:
        """The names ("layer.name") of the parameters the stage trains (all but the frozen ones)."""
        return [p.key for p in self.params]

    def weight_bytes(self) -> torch.Tensor:
        """The arena slot that holds the stage's weights now (uint8)."""
        return _held(self.weights, self.index, "weights").data

    def buffer_bytes(self) -> dict[int, int]:
        """The bytes of the stage's buffers' storages by data pointer (they live on the device for the whole run)."""
        bufs = (b for layer in self.buffers.values() for b in layer.values())
        return {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in bufs}

    def _tensors(self, with_grad: bool, kept: bool) -> dict[int, dict[str, torch.Tensor]]:
        """Per layer, its parameters (arena views, or the grad-collecting leaves) and its buffers."""
        slot = _held(self.weights, self.index, "weights")
        wflat = slot.view(self.dtype, self.numel)
        if kept:
            if not self._forward_leaves:  # the first kept forward of the visit
                self._forward_leaves = _leaves_of(self.params, wflat)
            weights = self._forward_leaves
        elif with_grad:
            weights = self._leaves
        else:
            weights = [p.of(wflat) for p in self.params]
        out = {l: dict(self.buffers[l]) for l in self.order}
        for p, t in zip(self.params, weights):
            out[p.layer][p.name] = t
        frozen = slot.data[self.frozen_start : self.weight_nbytes]
        for f in self.frozen:
            out[f.layer][f.name] = f.of(frozen)
        return out

    def forward(
        self, x: torch.Tensor, with_grad: bool, layers: Sequence[int] | None = None, kept: bool = False
    ) -> torch.Tensor:
        """Run the stage's layers (or some of them, in order) on x with the weights in the arena: leaves that
        collect grads if with_grad; kept: the leaves of a forward whose graph is kept until the backward."""
        how = "kept" if kept else "grad" if with_grad else "plain"
        for l in self.order if layers is None else layers:
            if self._bound.get(l) != how:
                if how not in self._views:
                    self._views[how] = self._tensors(with_grad, kept)
                bind(self._members[l], self._views[how][l])
                self._bound[l] = how
            x = self.layers[l](x)
        return x

    def _rebind(self) -> None:
        """The tensors the layers run on change (a new slot, new leaves): each layer binds again at its next call."""
        self._views.clear()
        self._bound.clear()

    def state_dict(self, frozen: bool = True) -> dict[str, torch.Tensor]:
        """Master weights and persistent buffers (host copies) named as nn.Sequential(*layers).state_dict();
        without the frozen weights (LoRA's base) when `frozen` is false."""
        master = self.states.master_weights()
        out = {p.key: p.of(master).clone() for p in self.params}
        if frozen and self.frozen_weights is not None:
            frozen_bytes = self.frozen_weights.read()
            out.update({f.key: f.of(frozen_bytes).clone() for f in self.frozen})
        for l in self.order:
            out.update(
                {
                    f"{l}.{n}": self.device.to_host(b.detach())
                    for n, b in self.buffers[l].items()
                    if n in self._persistent[l]
                }
            )
        return out


def _buffer_on(b: torch.Tensor, device: Device, dtype: torch.dtype) -> torch.Tensor:
    """A layer's buffer on the device (once, at start-up: it may wait); floating ones in the training dtype, as
    module.to(dtype) would."""
    return device.to_device(b, dtype if b.is_floating_point() else b.dtype, may_wait=True)


def _held(slot: Slot | None, j: int, what: str) -> Slot:
    """The slot a stage holds; a missing one is a schedule bug (the checker should have refused it)."""
    if slot is None:
        raise RuntimeError(
            f"stage {j} has no {what} in the arena here: the schedule runs it before its LOAD "
            f"(or backward) action; this is a bug in the schedule builder"
        )
    return slot


def _leaves_of(params: list[ParamSlice], wflat: torch.Tensor) -> list[torch.Tensor]:
    """A grad-collecting leaf per parameter, viewing the weights in wflat."""
    return [p.of(wflat).detach().requires_grad_(True) for p in params]


def _param_slices(layers: dict[int, nn.Module], order: list[int], trainable: bool, offset: int = 0) -> list[ParamSlice]:
    """The slices of the trainable (or the frozen) parameters, laid out one after the other from `offset`."""
    out = []
    for l in order:
        for name, p in layers[l].named_parameters():
            if p.requires_grad == trainable:
                out.append(ParamSlice(l, name, p.shape, offset, p.numel()))
                offset += p.numel()
    return out


def _frozen_tier(flat: torch.Tensor, device: Device, store: SSDStore | None, index: int) -> Frozen | None:
    """Where the stage keeps its frozen bytes: nowhere (none), the SSD store, or host memory (pinned on CUDA)."""
    if not flat.numel():
        return None
    if store is None:
        return FrozenWeights(flat, device.pin)
    return SsdFrozenWeights(flat, store, f"stage{index}", device.host_empty)


def _frozen_dtype(p: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """A frozen parameter's dtype in the stage: the training dtype if it is floating, else its own."""
    return dtype if p.is_floating_point() else p.dtype


def _frozen_slices(layers: dict[int, nn.Module], order: list[int], dtype: torch.dtype) -> list[FrozenSlice]:
    """The slices of the frozen parameters in the frozen bytes: the widest dtypes first, so that every offset is a
    multiple of its item size with no padding (the bytes are exactly the parameters')."""
    frozen = [(l, n, p, _frozen_dtype(p, dtype)) for l in order for n, p in layers[l].named_parameters()]
    out, offset = [], 0
    for l, name, p, d in sorted((x for x in frozen if not x[2].requires_grad), key=lambda x: -x[3].itemsize):
        out.append(FrozenSlice(l, name, p.shape, d, offset, p.numel() * d.itemsize))
        offset += p.numel() * d.itemsize
    return out


def _frozen_bytes(layers: dict[int, nn.Module], order: list[int], slices: list[FrozenSlice], dtype) -> torch.Tensor:
    """The frozen parameters as the stage keeps them: one uint8 tensor laid out as `slices`."""
    flat = torch.zeros(sum(f.nbytes for f in slices), dtype=torch.uint8)
    params = {f"{l}.{n}": p for l in order for n, p in layers[l].named_parameters() if not p.requires_grad}
    for f in slices:
        f.of(flat).copy_(params[f.key].detach().to(f.dtype))
    return flat


def _flat(layers: dict[int, nn.Module], order: list[int], trainable: bool, dtype: torch.dtype) -> torch.Tensor:
    """The trainable (or the frozen) parameters, one flat tensor in `dtype`, in _param_slices' order."""
    parts = [
        p.detach().reshape(-1).to(dtype)
        for l in order
        for _, p in layers[l].named_parameters()
        if p.requires_grad == trainable
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)


def _persistent_buffer_names(layer: nn.Module) -> set[str]:
    """Names of the buffers that layer.state_dict() holds (non-persistent ones are left out)."""
    params = {n for n, _ in layer.named_parameters()}
    return set(layer.state_dict(keep_vars=True)) - params
