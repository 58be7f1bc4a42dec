"""The SSD swap tier: held activations go device -> host staging -> SSD store after the forward, and come
back SSD -> host staging -> device before the backward, pipelined on an I/O thread of their own, so that
neither device nor host memory holds them in between (the staging buffers are a pool reused by every key).

CUDA's timing: the host runs ahead of its copies, so the writes in flight (each holding its staging buffers until
its SSD write ends) and the fetches' copies back are each bounded to swap.DEPTH held sets; a fetch's copy back
waits for a mark of the compute queued when its device tensors were allocated (taken at start_in, on the compute
thread), and gives its staging buffers back at once with its copies (the pool reuses them once those have ended),
so finish_in waits for the read, never for a copy."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, wait

import torch

from mobiuspipe.memory.device import CopyHandle, Device
from mobiuspipe.memory.store.future import StoreFuture
from mobiuspipe.memory.store.ssd_store import SSDStore
from mobiuspipe.memory.swap import DEPTH, BufferPool, CopySwap, Key, Window, _nbytes

__all__ = ["SsdSwap"]

Staged = list[tuple[torch.Tensor, torch.Tensor]]  # (staging buffer, its typed view)


class SsdSwap(CopySwap):
    """Held tensors in an SSD store under `act/{stage}.{microbatch}.{n}` (the files are rewritten in place
    every step); errors of the store (SwapIOError) come out of finish_in."""

    name = "ssd"

    def __init__(self, device: Device, store: SSDStore, owns_store: bool = False):
        super().__init__(device)
        self.store, self.owns_store = store, owns_store
        self._pool = BufferPool.host(device)  # aligned for O_DIRECT; on CUDA page-locked at each buffer's size
        self._lock = threading.Lock()  # the pool is shared by the compute and I/O threads
        self._io = device.executor("activation-ssd")  # it issues copies: bound to the gpu
        self._written: dict[Key, Future] = {}  # -> the held tensors' (dtype, shape)s once on SSD
        self._writing: deque[Future] = deque()  # the writes that may be in flight, oldest first
        self._read: dict[Key, tuple[list[torch.Tensor], Future]] = {}  # the device tensors, their fetch
        self._reads = Window()  # the fetches' copies back in flight (the I/O thread's)
        self._metas: dict[Key, list[tuple[torch.dtype, tuple[int, ...]]]] = {}  # held tensors' dtypes, shapes

    def start_out(self, key: Key, tensors: list[torch.Tensor]) -> None:
        if key in self._written:
            raise RuntimeError(f"activations {key} are already swapped out")
        self._make_write_room()
        self._metas[key] = [(t.dtype, tuple(t.shape)) for t in tensors]
        staged = [self._take(t) for t in tensors]
        handles = [self.device.copy_out(v, t) for (_, v), t in zip(staged, tensors)]
        self._out[key] = (tensors, handles)
        self._written[key] = self._io.submit(self._write, key, staged, handles)
        self._writing.append(self._written[key])

    def _make_write_room(self) -> None:
        """Block until fewer than DEPTH writes are in flight (their errors come out of finish_in)."""
        while self._writing and (len(self._writing) >= DEPTH or self._writing[0].done()):
            wait([self._writing.popleft()])

    def start_in(self, key: Key) -> list[torch.Tensor]:
        if key in self._read:
            return self._read[key][0]
        if key in self._out:
            self.finish_out(key)
        dev = [self.device.empty(shape, dtype) for dtype, shape in self._metas.pop(key)]
        ready = self.device.computed()  # dev's memory may be in use by the compute queued until now
        self._read[key] = (dev, self._io.submit(self._fetch, key, self._written.pop(key), dev, ready))
        return dev

    def finish_in(self, key: Key) -> list[torch.Tensor]:
        if key not in self._read:
            self.start_in(key)
        dev, fetched = self._read.pop(key)
        for h in fetched.result():
            h.wait()
        return dev

    def bytes_held(self) -> int:
        return 0  # on SSD: neither device nor host memory

    def close(self) -> None:
        for key in list(self._out):
            self.finish_out(key)
        self._io.shutdown(wait=True)  # the fetches gave their staging buffers back
        self._written.clear()
        self._writing.clear()
        self._read.clear()
        self._reads = Window()
        self._metas.clear()
        if self.owns_store:
            self.store.close()

    def _take(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A staging buffer for like: (buffer, its typed view)."""
        with self._lock:
            buf = self._pool.take(_nbytes(like))
        return buf, buf.view(like.dtype).view(like.shape)

    def _give(self, token: object, view: torch.Tensor, after: Sequence[CopyHandle] = ()) -> None:
        assert isinstance(token, torch.Tensor)
        with self._lock:
            self._pool.give(token, after)

    def _unstage(self, staged: Staged) -> None:
        for buf, view in staged:
            self._give(buf, view)

    def _write(self, key: Key, staged: Staged, handles: list[CopyHandle]) -> list[tuple[torch.dtype, list[int]]]:
        for h in handles:
            h.synchronize()
        try:
            futures = [self.store.put_async(_name(key, n), v) for n, (_, v) in enumerate(staged)]
            for f in futures:
                f.result()
        finally:
            self._unstage(staged)
        return [(v.dtype, list(v.shape)) for _, v in staged]

    def _fetch(self, key: Key, written: Future, dev: list[torch.Tensor], ready: CopyHandle) -> list[CopyHandle]:
        """Read key's files into staging buffers, then copy them into dev on the swap-in stream after `ready`; the
        buffers go back to the pool with those copies. The copies' handles."""
        metas = written.result()
        self._reads.make_room()
        staged = [self._take(torch.empty(shape, dtype=dtype, device="meta")) for dtype, shape in metas]
        reads: list[StoreFuture] = []
        try:
            for n, (_, v) in enumerate(staged):
                reads.append(self.store.get_async(_name(key, n), out=v))
            for f in reads:
                f.result()
        except BaseException:
            for f in reads:  # no read still fills a buffer given back
                _settle(f)
            self._unstage(staged)
            raise
        handles = [self.device.copy_back(d, v, [ready], computed=False) for d, (_, v) in zip(dev, staged)]
        for buf, view in staged:
            self._give(buf, view, handles)
        self._reads.add(handles)
        return handles


def _settle(f: StoreFuture) -> None:
    """Wait for a read whose error, if any, another read's has been raised in place of."""
    try:
        f.result()
    except BaseException:  # noqa: BLE001  the first error is the one raised
        pass


def _name(key: Key, n: int) -> str:
    return f"act/{key[0]}.{key[1]}.{n}"
