"""The device arena: one preallocated buffer of the plan's byte budget, cut into fixed slots.

A slot holds one stage's weights (or its gradients). Fixed slots of the plan's slot size mean no
fragmentation: any stage fits any free slot. With a gradient slot of its own size (the plan's: under LoRA the
adapters' gradients alone), gradients take that slot and weights the others. The arena counts the bytes actually
placed and refuses anything beyond a slot or beyond the budget, so "never above budget" is checked, not assumed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from mobiuspipe.errors import ArenaError
from mobiuspipe.memory.ledger import DeviceLedger
from mobiuspipe.memory.streams import CopyHandle

__all__ = ["DeviceArena", "Slot", "SLOT_ALIGN"]

SLOT_ALIGN = 256
"""Bytes every slot's size is rounded up to, so every slot starts at the same alignment within the arena (which
CUDA allocates 512-byte aligned): cuBLAS picks its kernels by its pointers' alignment (up to 256 bytes), so a stage's
tensors round alike whichever slot it takes (a resumed run takes its slots in another order)."""


@dataclass
class Slot:
    """One slot: a uint8 view of slot_bytes, and how many of those bytes hold live data."""

    index: int
    data: torch.Tensor
    used: int = 0
    busy: list[CopyHandle] = field(default_factory=list)
    """What may still use the slot's bytes since its release (the copies that read it, the mark after the compute that
    used it: Device.computed): whoever fills it next orders after them."""
    grads: bool = False
    """The arena's gradient slot (only gradients take it)."""

    def take_busy(self) -> list[CopyHandle]:
        """The copies the new holder must order its first write after (they are its to wait for now)."""
        busy, self.busy = self.busy, []
        return busy

    def view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The first numel elements of the slot, typed."""
        return self.data.view(dtype)[:numel]


class DeviceArena:
    """num_slots slots of slot_bytes each, on `device` (device memory on CUDA, a CPU buffer otherwise), and with
    grad_slot_bytes one more slot of that size that only gradients take (acquire(..., grads=True)); without it
    gradients take any slot. A ledger, if given, counts the bytes in use of each slot (("arena", slot index))."""

    def __init__(
        self,
        slot_bytes: int,
        num_slots: int,
        device: torch.device,
        ledger: DeviceLedger | None = None,
        place: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
        grad_slot_bytes: int | None = None,
    ):
        """place: marks a tensor as the gpu's memory (Device.place; the strict stand-in's rule)."""
        self.slot_bytes = _round_up(slot_bytes, SLOT_ALIGN)
        self.grad_slot_bytes = None if grad_slot_bytes is None else _round_up(grad_slot_bytes, SLOT_ALIGN)
        self.budget_bytes = self.slot_bytes * num_slots + (self.grad_slot_bytes or 0)
        self._place = place
        self.buffer = place(torch.empty(self.budget_bytes, dtype=torch.uint8, device=device))
        self._free = deque(Slot(i, self._slot_tensor(i * self.slot_bytes, self.slot_bytes)) for i in range(num_slots))
        """Free slots, the longest free first: a slot released just now may still be read by its offload or used by
        queued compute, so the next holder takes the one most likely idle and need not wait (CUDA: no stall)."""
        self._free_grads = deque()
        """The free gradient slot, when the arena has one."""
        if self.grad_slot_bytes is not None:
            start = num_slots * self.slot_bytes
            self._free_grads.append(Slot(num_slots, self._slot_tensor(start, self.grad_slot_bytes), grads=True))
        self.num_slots = num_slots + (self.grad_slot_bytes is not None)
        self.in_use_bytes = 0
        self.peak_bytes = 0
        self.ledger = ledger

    def _slot_tensor(self, start: int, nbytes: int) -> torch.Tensor:
        """Bytes start .. start + nbytes of the buffer as their own tensor: same memory, but its own autograd
        version counter, so a copy into one slot does not look like an in-place change of the weights another slot
        holds."""
        t = torch.empty(0, dtype=torch.uint8, device=self.buffer.device)
        storage = self.buffer.untyped_storage()
        # torch's stubs list set_(Storage, offset, size) but not the UntypedStorage overload it accepts
        t = t.set_(storage, start, (nbytes,))  # pyright: ignore[reportCallIssue]
        return self._place(t)

    def acquire(self, nbytes: int, what: str, grads: bool = False) -> Slot:
        """A free slot holding nbytes of `what` (grads: gradients, which take the gradient slot if the arena has
        one); ArenaError if it cannot (with the numbers)."""
        own = grads and self.grad_slot_bytes is not None
        size, free = (self.grad_slot_bytes, self._free_grads) if own else (self.slot_bytes, self._free)
        kind = "the gradient slot" if own else "an arena slot"
        if nbytes > (size or 0):
            raise ArenaError(
                f"{what} needs {nbytes} bytes but {kind} has {size}: the plan does not "
                f"match the model; re-plan with `mobiuspipe partition` for this model"
            )
        if not free:
            raise ArenaError(
                f"{what}: all {self.num_slots} arena slots are in use "
                f"({self.in_use_bytes} of {self.budget_bytes} bytes); a stage was not released"
            )
        slot = free.popleft()
        slot.used = nbytes
        self.in_use_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.in_use_bytes)
        if self.in_use_bytes > self.budget_bytes:  # cannot happen with fixed slots; checked anyway
            raise ArenaError(f"arena over budget: {self.in_use_bytes} > {self.budget_bytes} bytes")
        if self.ledger is not None:
            self.ledger.hold(("arena", slot.index), slot.data[:nbytes])
        return slot

    def release(self, slot: Slot, after: Sequence[CopyHandle] = ()) -> None:
        """Free slot; after: what may still use it (an offload on the copy stream, the compute's mark)."""
        slot.busy = list(after)
        if self.ledger is not None:
            self.ledger.drop(("arena", slot.index))
        self.in_use_bytes -= slot.used
        slot.used = 0
        (self._free_grads if slot.grads else self._free).append(slot)

    def reset_peak(self) -> None:
        self.peak_bytes = self.in_use_bytes


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k
