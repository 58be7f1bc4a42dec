"""Swap tiers of held activations: what moves a microbatch's held tensors off the device after its forward
(SWAP_OUT) and back before its backward (SWAP_IN): kept on the device, pinned host memory, SSD (swap_ssd) or
a peer gpu's region (swap_peer).

Every tier follows CUDA's rules, also on the CPU stand-in (where each move is a real copy into separate
memory, so the ledger's device bytes really go): start_out issues the copies on the copy stream; finish_out
returns once the device tensors may be freed (the compute stream is ordered after the copies); start_in
issues the copies back into fresh device tensors (allocated then, and returned); finish_in orders the compute
stream after them and returns those tensors (contiguous, of the held tensors' dtypes, shapes and values). Keys
are (stage, microbatch); one key is out at most once at a time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict, deque
from collections.abc import Sequence

import torch

from mobiuspipe.memory.device import CopyHandle, Device

__all__ = ["Swap", "DeviceSwap", "CopySwap", "HostSwap", "BufferPool", "Window", "DEPTH"]

Key = tuple[int, int]

DEPTH = 2
"""Held sets whose staging copies (SSD, staged peer) may be in flight at once per direction: one moving while the
next is issued. On CUDA the host runs ahead of its copies (a wait orders the compute stream, not the host), so
without a bound a staging pool would take a page-locked buffer per held tensor of every microbatch."""


class Swap:
    """The interface of a tier (DeviceSwap keeps the tensors where they are)."""

    name = "device"

    def __init__(self) -> None:
        self._kept: dict[Key, list[torch.Tensor]] = {}

    def start_out(self, key: Key, tensors: list[torch.Tensor]) -> None:
        """Begin moving tensors (the held set of key) to the tier."""
        if key in self._kept:
            raise RuntimeError(f"activations {key} are already swapped out")
        self._kept[key] = tensors

    def finish_out(self, key: Key) -> None:
        """Return once key's device tensors may be freed."""

    def start_in(self, key: Key) -> list[torch.Tensor]:
        """Begin moving key's tensors back to the device; the device tensors they land in (allocated now)."""
        return self._kept[key]

    def finish_in(self, key: Key) -> list[torch.Tensor]:
        """key's tensors on the device, usable by the compute stream."""
        return self._kept.pop(key)

    def bytes_held(self) -> int:
        """Bytes the tier holds now (host, SSD or peer memory; the device's for DeviceSwap)."""
        return sum(_nbytes(t) for ts in self._kept.values() for t in ts)

    def close(self) -> None:
        """Drop whatever the tier holds."""
        self._kept.clear()


DeviceSwap = Swap


class BufferPool:
    """Host buffers, reused: a request takes the smallest free buffer that holds it (its first nbytes), else a new
    one of its size. The held sets of a stage have the same sizes every microbatch, so each takes a buffer of its
    own size back; sizes that vary (a batch padded to its longest sequence) reuse the buffers of the larger ones
    instead of adding buffers for every size seen."""

    def __init__(self, allocate):
        self._allocate = allocate  # nbytes -> a uint8 host tensor
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._pending: list[tuple[torch.Tensor, Sequence[CopyHandle]]] = []  # given back, copies still reading
        self._lent: dict[int, torch.Tensor] = {}  # id of a lent view (alive until given back) -> its whole buffer

    @classmethod
    def host(cls, device: Device) -> BufferPool:
        """Host buffers, page-locked where CUDA copies from them."""
        return cls(device.host_empty)

    def take(self, nbytes: int, bounded: bool = False) -> torch.Tensor:
        """A uint8 host tensor of nbytes (the start of a pooled buffer, or a new one). bounded: where none is free
        but one given back still waits for its copies, wait for them (the host blocks) and reuse it rather than make
        another: on CUDA a held set's buffers go back pending their copies back, and a pass that runs ahead of
        them would otherwise double the host memory the plan counts (an accumulated step's next pass)."""
        self._reap()
        fits = [size for size, bufs in self._free.items() if size >= nbytes and bufs]
        if not fits and bounded and (waiting := self._oldest_pending(nbytes)) is not None:
            for h in waiting[1]:
                h.synchronize()
            self._reap()
            fits = [size for size, bufs in self._free.items() if size >= nbytes and bufs]
        whole = self._free[min(fits)].pop() if fits else self._allocate(nbytes)
        view = whole[:nbytes]
        self._lent[id(view)] = whole
        return view

    def give(self, buf: torch.Tensor, after: Sequence[CopyHandle] = ()) -> None:
        """Take buf (from take) back; it is reused once the `after` copies (which still read or write it) have
        ended."""
        whole = self._lent.pop(id(buf))
        if all(h.done() for h in after):
            self._free[whole.numel()].append(whole)
        else:
            self._pending.append((whole, after))

    @property
    def buffers(self) -> int:
        """Buffers the pool has made (lent, free or waiting for their copies)."""
        return len(self._lent) + len(self._pending) + sum(len(b) for b in self._free.values())

    def _oldest_pending(self, nbytes: int) -> tuple[torch.Tensor, Sequence[CopyHandle]] | None:
        """The buffer given back first that holds nbytes and still waits for its copies."""
        return next(((buf, after) for buf, after in self._pending if buf.numel() >= nbytes), None)

    def _reap(self) -> None:
        waiting = []
        for buf, after in self._pending:
            if all(h.done() for h in after):
                self._free[buf.numel()].append(buf)
            else:
                waiting.append((buf, after))
        self._pending = waiting


class Window:
    """At most `depth` groups of copies in flight: make_room() blocks the calling thread until fewer are (the oldest
    have ended, so the staging buffers they used may be taken again); add(handles) a group just issued."""

    def __init__(self, depth: int = DEPTH):
        self.depth = depth
        self._groups: deque[Sequence[CopyHandle]] = deque()

    def make_room(self) -> None:
        while self._groups and (len(self._groups) >= self.depth or all(h.done() for h in self._groups[0])):
            for h in self._groups.popleft():
                h.synchronize()

    def add(self, handles: Sequence[CopyHandle]) -> None:
        self._groups.append(handles)


class CopySwap(Swap, ABC):
    """A tier whose held tensors are copies in memory off the device: _take(t) gives (token, a view of t's
    dtype and shape where the copy goes), _give(token, view, after) frees it once the `after` copies have
    ended, _copy_out(dst, src) and _copy_in(dst, src, after) copy on the copy streams (the copy-out and the swap-in
    streams, so a copy back names the copy out it reads)."""

    def __init__(self, device: Device):
        super().__init__()
        self.device = device
        self._out: dict[Key, tuple[list[torch.Tensor], list[CopyHandle]]] = {}
        self._held: dict[Key, list[tuple[object, torch.Tensor]]] = {}  # (token, typed view)
        self._wrote: dict[Key, list[CopyHandle]] = {}  # the copies out that wrote the held views
        self._in: dict[Key, tuple[list[torch.Tensor], list[CopyHandle]]] = {}

    def start_out(self, key: Key, tensors: list[torch.Tensor]) -> None:
        if key in self._held:
            raise RuntimeError(f"activations {key} are already swapped out")
        held: list[tuple[object, torch.Tensor]] = []
        try:
            for t in tensors:
                held.append(self._take(t))
        except BaseException:
            for token, view in held:  # a failed swap-out takes nothing
                self._give(token, view)
            raise
        self._held[key] = held
        handles = [self._copy_out(v, t) for (_, v), t in zip(held, tensors)]
        self._out[key], self._wrote[key] = (tensors, handles), handles  # the device tensors live until they end

    def finish_out(self, key: Key) -> None:
        _, handles = self._out.pop(key)
        for h in handles:
            h.wait()

    def start_in(self, key: Key) -> list[torch.Tensor]:
        if key in self._in:
            return self._in[key][0]
        if key in self._out:
            self.finish_out(key)
        dev = [self.device.empty(v.shape, v.dtype) for _, v in self._held[key]]
        wrote = self._wrote.pop(key)
        self._in[key] = (dev, [self._copy_in(d, v, wrote) for d, (_, v) in zip(dev, self._held[key])])
        return dev

    def finish_in(self, key: Key) -> list[torch.Tensor]:
        if key not in self._in:
            self.start_in(key)
        dev, handles = self._in.pop(key)
        for h in handles:
            h.wait()
        for token, view in self._held.pop(key):
            self._give(token, view, handles)  # free once the copies back, which read it, have ended
        return dev

    def bytes_held(self) -> int:
        return sum(_nbytes(v) for held in self._held.values() for _, v in held)

    def close(self) -> None:
        for key in list(self._out):
            self.finish_out(key)
        self._held.clear()
        self._in.clear()
        self._wrote.clear()

    @abstractmethod
    def _take(self, like: torch.Tensor) -> tuple[object, torch.Tensor]: ...

    @abstractmethod
    def _give(self, token: object, view: torch.Tensor, after: Sequence[CopyHandle] = ()) -> None: ...

    def _copy_out(self, dst: torch.Tensor, src: torch.Tensor) -> CopyHandle:
        return self.device.copy_out(dst, src)

    def _copy_in(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[CopyHandle]) -> CopyHandle:
        return self.device.copy_back(dst, src, after)


class HostSwap(CopySwap):
    """Held tensors in (pinned) host memory: copied out on the copy stream, prefetched back before B."""

    name = "host"

    def __init__(self, device: Device):
        super().__init__(device)
        self.pool = BufferPool.host(device)

    def _take(self, like: torch.Tensor) -> tuple[object, torch.Tensor]:
        buf = self.pool.take(_nbytes(like), bounded=True)
        return buf, buf.view(like.dtype).view(like.shape)

    def _give(self, token: object, view: torch.Tensor, after: Sequence[CopyHandle] = ()) -> None:
        assert isinstance(token, torch.Tensor)
        self.pool.give(token, after)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
