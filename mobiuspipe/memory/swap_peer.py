"""The peer swap tier: held activations parked in a region of another gpu's memory that the plan gives
spare (MPress's D2D swap). Over NVLink or PCIe peer-to-peer the copy goes device to device; otherwise it is
staged through this rank's pinned host memory (device -> host -> peer and back).

The region is allocated by the peer's rank and shared at start-up: on CUDA through an IPC handle
(`share_region` / `open_shared`); on the CPU stand-in it is a file in shared memory (/dev/shm) that both
ranks map (`shm_region`), so the bytes really sit in the peer's memory. A first-fit allocator places each
held tensor in the region; a region too small for what is held at once is an error naming the sizes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from foundation.units import fmt_bytes
from mobiuspipe.memory.device import CopyHandle, Device
from mobiuspipe.memory.swap import BufferPool, CopySwap, Key, Window, _nbytes

__all__ = ["PeerSwap", "RegionFull", "shm_region", "share_region", "open_shared"]

ALIGN = 256
"""Byte alignment of each tensor in the region (CUDA's allocation granularity for coalesced copies)."""


class RegionFull(RuntimeError):
    """The peer region cannot hold what is parked at once."""


class _Ranges:
    """First-fit byte ranges of a region of `size` bytes."""

    def __init__(self, size: int):
        self.size = size
        self.free: list[tuple[int, int]] = [(0, size)]  # (start, length), sorted by start

    def take(self, n: int) -> int:
        n = -(-max(n, 1) // ALIGN) * ALIGN
        for k, (start, length) in enumerate(self.free):
            if length >= n:
                self.free[k : k + 1] = [(start + n, length - n)] if length > n else []
                return start
        held = self.size - sum(length for _, length in self.free)
        raise RegionFull(
            f"the peer region of {fmt_bytes(self.size)} holds {fmt_bytes(held)} already and has no free range "
            f"of {fmt_bytes(n)}: plan a larger region, or park fewer microbatches on the peer"
        )

    def give(self, start: int, n: int) -> None:
        n = -(-max(n, 1) // ALIGN) * ALIGN
        merged = sorted([*self.free, (start, n)])
        self.free = []
        for s, length in merged:
            if self.free and self.free[-1][0] + self.free[-1][1] == s:
                self.free[-1] = (self.free[-1][0], self.free[-1][1] + length)
            else:
                self.free.append((s, length))


class PeerSwap(CopySwap):
    """Held tensors parked in `region` (a uint8 tensor on gpu `peer`, or its CPU stand-in); staged: copy
    through pinned host memory (no peer-to-peer path between the two gpus). A staged copy's hop between the
    host buffer and the region runs on the peer gpu's stream (CUDA runs it there), after the hop it follows; the
    staged copies of DEPTH held sets at most are in flight per direction (swap.Window), so the pool of staging
    buffers stays within a few sets when the host runs ahead of its copies."""

    name = "peer"

    def __init__(self, device: Device, region: torch.Tensor, staged: bool, peer: int):
        super().__init__(device)
        self.region, self.staged = region, staged
        self.ranges = _Ranges(region.numel())
        self.pool = BufferPool.host(device)
        self.stream = device.peer_stream(peer)
        self._freed: list[tuple[int, int, Sequence[CopyHandle]]] = []  # ranges given back, copies still reading
        self._outs, self._ins = Window(), Window()  # the staged copies in flight, a group per held set

    def start_out(self, key: Key, tensors: list[torch.Tensor]) -> None:
        if self.staged:
            self._outs.make_room()
        super().start_out(key, tensors)
        if self.staged:
            self._outs.add(self._out[key][1])

    def start_in(self, key: Key) -> list[torch.Tensor]:
        starts = self.staged and key not in self._in
        if starts:
            self._ins.make_room()
        dev = super().start_in(key)
        if starts:
            self._ins.add(self._in[key][1])
        return dev

    def _take(self, like: torch.Tensor) -> tuple[object, torch.Tensor]:
        """A range of the region for like's bytes; where none is free, the ranges given back wait for their copies
        back in turn (the host blocks): on CUDA they go back pending those, and a pass that runs ahead of them (an
        accumulated step's next) would overflow the region the plan sized for one pass."""
        n = _nbytes(like)
        self._reap()
        while True:
            try:
                off = self.ranges.take(n)
                break
            except RegionFull:
                if not self._freed:
                    raise
                for h in self._freed[0][2]:
                    h.synchronize()
                self._reap()
        return off, self.region[off : off + n].view(like.dtype).view(like.shape)

    def _give(self, token: object, view: torch.Tensor, after: Sequence[CopyHandle] = ()) -> None:
        """The range goes back once the `after` copies (which read it) have ended: a direct copy out on the
        other copy stream is not ordered after them."""
        assert isinstance(token, int)
        self._freed.append((token, _nbytes(view), after))
        self._reap()

    def _reap(self) -> None:
        waiting = []
        for start, n, after in self._freed:
            if all(h.done() for h in after):
                self.ranges.give(start, n)
            else:
                waiting.append((start, n, after))
        self._freed = waiting

    def _copy_out(self, dst: torch.Tensor, src: torch.Tensor) -> CopyHandle:
        """dst (the region) <- src (this gpu): directly, or this gpu's copy-out stream into a host buffer and
        the peer's stream from there into the region."""
        if not self.staged:
            return self.device.copy_out(dst, src)
        buf = self.pool.take(_nbytes(src))
        view = buf.view(src.dtype).view(src.shape)
        first = self.device.copy_out(view, src)
        done = self.stream.copy(dst, view, [first])
        self.pool.give(buf, [done])
        return done

    def _copy_in(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[CopyHandle]) -> CopyHandle:
        """dst (this gpu) <- src (the region): directly, or the peer's stream into a host buffer (after the
        copy out that wrote the region) and this gpu's swap-in stream from there."""
        if not self.staged:
            return self.device.copy_back(dst, src, after)
        buf = self.pool.take(_nbytes(src))
        view = buf.view(src.dtype).view(src.shape)
        first = self.stream.copy(view, src, after)
        done = self.device.copy_back(dst, view, [first])
        self.pool.give(buf, [done])
        return done

    def close(self) -> None:
        super().close()
        self.ranges, self._freed = _Ranges(self.region.numel()), []
        self._outs, self._ins = Window(), Window()


def shm_region(path: str, nbytes: int) -> torch.Tensor:
    """The CPU stand-in of a peer region: nbytes of shared memory in the file `path` (under /dev/shm),
    mapped by the peer's rank and by the rank that parks there (created when missing)."""
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def share_region(nbytes: int, device: torch.device) -> tuple[torch.Tensor, object]:
    """On the peer's rank (CUDA): a region of nbytes and what another process needs to open it (picklable)."""
    from torch.multiprocessing.reductions import reduce_tensor

    region = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return region, reduce_tensor(region)


def open_shared(handle) -> torch.Tensor:
    """On the parking rank (CUDA): the region share_region made in another process."""
    rebuild, args = handle
    return rebuild(*args)
