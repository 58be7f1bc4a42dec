"""Page-locked host memory of the size asked for, for the buffers a run keeps from start to end (the host tiers'
master weights, gradients and staging, the SSD tiers' staging buffers, the activation pools).

torch's pinned allocator (`pin_memory()`, `torch.empty(pin_memory=True)`) rounds each block up to a power of two
and keeps freed blocks cached: a stage's 2.2 GiB of bf16 weights gets a 4 GiB block that can never be swapped out, which
no host budget counts. These buffers are ordinary page-aligned memory registered with CUDA instead
(cudaHostRegister: copies from them are asynchronous DMA as from torch's pinned blocks), unregistered when the gpu's
Device closes. Small buffers made and dropped as a run goes (a microbatch's tokens) stay with torch's allocator,
whose cache suits them."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

import torch

from mobiuspipe.memory.aio import ALIGN, aligned_empty, round_up

__all__ = ["PinnedBlocks", "PinnedMemoryError", "Register", "Unregister", "cuda_registration"]

Register = Callable[[int, int], int]
"""(address, bytes) -> CUDA's error code (0: registered)."""
Unregister = Callable[[int], int]
"""address -> CUDA's error code."""


class PinnedMemoryError(RuntimeError):
    """CUDA refused to page-lock a buffer."""


class PinnedBlocks:
    """The page-locked buffers of one gpu's Device: empty(nbytes) makes one; close() unregisters them all (each
    stays valid, pageable, memory while a tensor refers to it)."""

    def __init__(self, register: Register, unregister: Unregister):
        self._register, self._unregister = register, unregister
        self._blocks: list[tuple[torch.Tensor, int]] = []  # (the buffer, its address), registered
        self._spans: list[tuple[int, int]] = []  # (address, end) of each buffer's bytes, by address

    def empty(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of nbytes in page-locked host memory, aligned to ALIGN (O_DIRECT may use it too), of
        nbytes rounded up to ALIGN."""
        return self.lock(aligned_empty(nbytes))

    def lock(self, buf: torch.Tensor) -> torch.Tensor:
        """Page-lock buf, a uint8 buffer of aligned_empty (which rounds its memory up to ALIGN), in place; buf."""
        size = round_up(max(buf.numel(), 1), ALIGN)
        code = self._register(buf.data_ptr(), size)
        if code != 0:
            raise PinnedMemoryError(
                f"CUDA could not page-lock {size / 2**20:.1f} MiB of host memory (cudaHostRegister error {code}), "
                f"{self.nbytes / 2**30:.2f} GiB being locked already: the host is short of memory; lower "
                f"memory.host_budget_mb or leave more of the host's memory free"
            )
        self._blocks.append((buf, buf.data_ptr()))
        bisect.insort(self._spans, (buf.data_ptr(), buf.data_ptr() + buf.numel()))
        return buf

    def covers(self, t: torch.Tensor) -> bool:
        """Whether t's bytes lie in one buffer registered now (torch's is_pinned() cannot tell: it asks CUDA about
        the start of t's storage, which aligned_empty takes larger than the aligned bytes registered)."""
        start = t.data_ptr()
        end = start + max(t.numel(), 1) * t.element_size()
        i = bisect.bisect_right(self._spans, (start, math.inf)) - 1  # the last buffer starting at or before t
        return i >= 0 and end <= self._spans[i][1]

    @property
    def nbytes(self) -> int:
        """Bytes registered now (each buffer's size rounded up to ALIGN)."""
        return sum(round_up(max(buf.numel(), 1), ALIGN) for buf, _ in self._blocks)

    def close(self) -> None:
        """Unregister every buffer (the gpu's copies from and into them have ended)."""
        blocks, self._blocks, self._spans = self._blocks, [], []
        for _, address in blocks:
            self._unregister(address)


def cuda_registration() -> tuple[Register, Unregister]:
    """CUDA's cudaHostRegister (default flags) and cudaHostUnregister, through torch's bindings."""
    cudart = torch.cuda.cudart()
    assert cudart is not None, "torch's CUDA runtime bindings, on a build with CUDA"

    def register(address: int, nbytes: int) -> int:
        return int(cudart.cudaHostRegister(address, nbytes, 0))

    def unregister(address: int) -> int:
        return int(cudart.cudaHostUnregister(address))

    return register, unregister
