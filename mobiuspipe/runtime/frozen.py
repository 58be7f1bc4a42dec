"""A stage's frozen weights (LoRA's base): read-only bytes in host memory (FrozenWeights) or in the rank's SSD
store (SsdFrozenWeights), copied into the stage's weight slot beside the trainable weights at each LOAD and never
written back: no gradient slot, no offload, no optimizer state. Their layout: mobiuspipe.runtime.stage.FrozenSlice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mobiuspipe.memory.device import CopyHandle, Device
from mobiuspipe.memory.store.ssd_store import SSDStore
from mobiuspipe.memory.weight_stream import BUFFERS, HostEmpty, SsdRecords
from partition.rules.placement import FROZEN_STREAM_BYTES

__all__ = ["FrozenWeights", "SsdFrozenWeights", "Frozen"]


class FrozenWeights:
    """The frozen part of a stage (LoRA's base weights): one flat uint8 tensor of their bytes in host memory (pinned
    on CUDA; the layout: mobiuspipe.runtime.stage.FrozenSlice), copied into the stage's weight slot beside the
    trainable weights at each LOAD and never written back: no gradient slot, no offload, no optimizer state."""

    def __init__(self, flat: torch.Tensor, pin):
        self.weights = pin(flat)

    @property
    def nbytes(self) -> int:
        return self.weights.numel()

    def load_into(self, dst: torch.Tensor, device: Device, after: Sequence[CopyHandle] = ()) -> CopyHandle:
        """Start copying the frozen weights into dst (their part of the arena slot), after `after` (as
        HostStates.load_into)."""
        return device.copy_in(dst, self.weights, after, computed=False)

    def read(self) -> torch.Tensor:
        """The frozen bytes (the flat itself: read-only)."""
        return self.weights


class SsdFrozenWeights:
    """The frozen part of a stage in the rank's SSD store instead (memory.frozen: ssd): written once, as records of
    FROZEN_STREAM_BYTES / BUFFERS bytes, and read at each LOAD through BUFFERS staging buffers of that size (the
    only host memory it takes), straight into the arena slot; never written back."""

    def __init__(self, flat: torch.Tensor, store: SSDStore, prefix: str, host_empty: HostEmpty):
        """Write flat (the frozen bytes) as records; the staging buffers come from host_empty (Device.host_empty)."""
        self.records = SsdRecords(store, f"{prefix}/frozen", flat, FROZEN_STREAM_BYTES // BUFFERS, host_empty)
        self.nbytes = flat.numel()

    def load_into(self, dst: torch.Tensor, device: Device, after: Sequence[CopyHandle] = ()) -> CopyHandle:
        """Start streaming the frozen weights from the SSD into dst, after `after` (as SsdStreamStates.load_into)."""
        return device.stream_in(lambda copy: self.records.load_into(dst, copy), after, computed=False)

    def read(self) -> torch.Tensor:
        """A host copy of the frozen bytes, read from the SSD."""
        return self.records.read()


Frozen = FrozenWeights | SsdFrozenWeights
