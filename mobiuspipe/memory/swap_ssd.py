"""The SSD swap tier: held activations go device -> host staging -> SSD store after the forward, and come
back SSD -> host staging -> device before the backward, pipelined on an I/O thread of their own, so that
neither device nor host memory holds them in between (the staging buffers are a pool reused by every key)."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from mobiuspipe.device import CopyHandle, Device
from mobiuspipe.memory.aio import aligned_empty
from mobiuspipe.memory.ssd_store import SSDStore
from mobiuspipe.memory.swap import BufferPool, CopySwap, Key, _nbytes

__all__ = ["SsdSwap"]

Staged = list[tuple[torch.Tensor, torch.Tensor]]  # (staging buffer, its typed view)


class SsdSwap(CopySwap):
    """Held tensors in an SSD store under `act/{stage}.{microbatch}.{n}` (the files are rewritten in place
    every step); errors of the store (SwapIOError) come out of finish_in."""

    name = "ssd"

    def __init__(self, device: Device, store: SSDStore, owns_store: bool = False):
        super().__init__(device)
        self.store, self.owns_store = store, owns_store
        self._pool = BufferPool(aligned_empty)
        self._lock = threading.Lock()  # the pool is shared by the compute and I/O threads
        self._io = ThreadPoolExecutor(1, thread_name_prefix="activation-ssd")
        self._written: dict[Key, Future] = {}  # -> the held tensors' (dtype, shape)s once on SSD
        self._read: dict[Key, Future] = {}

    def start_out(self, key: Key, tensors: list[torch.Tensor]) -> None:
        if key in self._written:
            raise RuntimeError(f"activations {key} are already swapped out")
        staged = [self._take(t) for t in tensors]
        handles = [self.device.copy_async(v, t) for (_, v), t in zip(staged, tensors)]
        self._out[key] = (tensors, handles)
        self._written[key] = self._io.submit(self._write, key, staged, handles)

    def start_in(self, key: Key) -> None:
        if key in self._out:
            self.finish_out(key)
        written = self._written.pop(key)
        self._read[key] = self._io.submit(self._fetch, key, written)

    def finish_in(self, key: Key) -> list[torch.Tensor]:
        if key not in self._read:
            self.start_in(key)
        dev, staged, handles = self._read.pop(key).result()
        for h in handles:
            h.wait()
            h.synchronize()  # the staging buffers are refilled by the host next
        self._unstage(staged)
        return dev

    def bytes_held(self) -> int:
        return 0  # on SSD: neither device nor host memory

    def close(self) -> None:
        for key in list(self._out):
            self.finish_out(key)
        self._io.shutdown(wait=True)
        for fut in [*self._written.values(), *self._read.values()]:
            if fut.exception() is None and isinstance(fut.result(), tuple):
                self._unstage(fut.result()[1])
        self._written.clear()
        self._read.clear()
        if self.owns_store:
            self.store.close()

    def _take(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A staging buffer for like: (buffer, its typed view)."""
        with self._lock:
            buf = self._pool.take(_nbytes(like))
        return buf, buf.view(like.dtype).view(like.shape)

    def _give(self, token: object, view: torch.Tensor) -> None:
        assert isinstance(token, torch.Tensor)
        with self._lock:
            self._pool.give(token)

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

    def _fetch(self, key: Key, written: Future) -> tuple[list[torch.Tensor], Staged, list[CopyHandle]]:
        staged = [self._take(torch.empty(shape, dtype=dtype, device="meta")) for dtype, shape in written.result()]
        for f in [self.store.get_async(_name(key, n), out=v) for n, (_, v) in enumerate(staged)]:
            f.result()
        dev = [torch.empty_like(v, device=self.device.torch_device) for _, v in staged]
        return dev, staged, [self.device.copy_async(d, v) for d, (_, v) in zip(dev, staged)]


def _name(key: Key, n: int) -> str:
    return f"act/{key[0]}.{key[1]}.{n}"
