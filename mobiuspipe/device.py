"""The gpu a rank drives, with CPU stand-ins for what CUDA provides: a copy stream and pinned memory.

A thread that does device work (issues copies, waits on their events) must first bind itself to the gpu
(bind_thread, or make it with executor): a new CUDA thread's current device is 0 whatever rank it serves,
so its "current stream" is gpu 0's. The strict stand-in (MOBIUSPIPE_STRICT=1) refuses device work from a
thread bound to another gpu, or to none on a gpu other than 0.

On CUDA, a load is a non_blocking host->device copy from pinned memory on a side stream, and the compute
stream waits on the copy's event before using the weights. On the CPU stand-in, a single worker thread
plays the copy stream (torch's copy kernels release the GIL, so the copy really overlaps compute), and
its future plays the event. Both follow the same rule: issue the copy, then wait() before use.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from mobiuspipe.standin import StandInError, strict
from mobiuspipe.standin.places import on_gpu, on_host, plain

__all__ = ["Device", "CopyHandle"]


class CopyHandle:
    """A copy in flight; wait() blocks until its result may be used by the compute stream."""

    def __init__(
        self,
        future: Future | None = None,
        event: torch.cuda.Event | None = None,
        compute: torch.cuda.Stream | None = None,
    ):
        self._future, self._event, self._compute = future, event, compute

    def wait(self) -> None:
        if self._future is not None:
            self._future.result()
        if self._event is not None:
            assert self._compute is not None, "a CUDA copy's handle names the compute stream that waits for it"
            self._compute.wait_event(self._event)

    def synchronize(self) -> None:
        """Block this thread until the copy has ended (its source may then be refilled by the host)."""
        if self._future is not None:
            self._future.result()
        if self._event is not None:
            self._event.synchronize()


class Device:
    """One gpu (or its CPU stand-in): where the arena lives and how copies reach it."""

    def __init__(self, local_rank: int = 0, use_cuda: bool | None = None):
        self.is_cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
        self.index = local_rank
        """The gpu's index on this host (its CUDA device index; the stand-in's, for the thread rule)."""
        self.bind_thread()
        if self.is_cuda:
            self.torch_device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.torch_device)
            self._stream = torch.cuda.Stream(self.torch_device)
            self.compute = torch.cuda.current_stream(self.torch_device)
            """The stream the rank computes on (named, not taken from the calling thread's current stream)."""
            self._pool = None
            self._loader: ThreadPoolExecutor | None = None  # runs stream_in's jobs; made on first use
        else:
            self.torch_device = torch.device("cpu")
            self._stream = None
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="copy-stream")
            self._loader = None

    def bind_thread(self) -> None:
        """Make this gpu the calling thread's current device (CUDA's set_device; the stand-in's record of it)."""
        if self.is_cuda:
            torch.cuda.set_device(self.index)
        _bound.index = self.index

    def executor(self, name: str) -> ThreadPoolExecutor:
        """A one-thread executor whose thread is bound to this gpu (for work that issues copies)."""
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=self.bind_thread)

    def _check_thread(self, what: str) -> None:
        """The strict stand-in's rule: device work only from a thread bound to this gpu."""
        if self.is_cuda or not strict():
            return
        current = getattr(_bound, "index", 0)
        if current != self.index:
            raise StandInError(
                f"{what} for gpu {self.index} from thread {threading.current_thread().name!r}, whose current "
                f"device is {current}: a new CUDA thread's current device is 0, so its streams and events would be "
                f"gpu {current}'s; make the thread with Device.executor (or call bind_thread in it)"
            )

    # -- where tensors live: the copy functions (the strict stand-in marks each tensor's place) ------------
    @property
    def _marks(self) -> bool:
        return not self.is_cuda and strict()

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """Page-locked host memory where CUDA exists (fast async copies); a plain CPU tensor otherwise."""
        if self.is_cuda:
            return t.pin_memory()
        return on_host(t) if self._marks else t

    def host_empty(self, nbytes: int) -> torch.Tensor:
        """nbytes of (pinned, on CUDA) host memory, uint8."""
        if self.is_cuda:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self.pin(torch.empty(nbytes, dtype=torch.uint8))

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """t, which lies in this gpu's memory (the stand-in: marked as its memory under strict mode)."""
        return on_gpu(t, self.index) if self._marks else t

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor in this gpu's memory."""
        return self.place(torch.empty(shape, dtype=dtype, device=self.torch_device))

    def to_device(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A copy of host tensor t in this gpu's memory (in dtype, if given): a blocking copy."""
        if self.is_cuda:
            return t.to(self.torch_device, dtype=dtype or t.dtype)
        return self.place(plain(t).to(dtype=dtype or t.dtype, copy=True))

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of device tensor t in pageable host memory (unmarked): a blocking copy."""
        return t.to("cpu") if self.is_cuda else plain(t).clone()

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> CopyHandle:
        """dst.copy_(src) on the copy stream; the returned handle's wait() orders later compute after it."""
        self._check_thread("a copy")
        if self._stream is not None:
            self._stream.wait_stream(self.compute)  # dst may have been in use until now
            with torch.cuda.stream(self._stream):
                dst.copy_(src, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self._stream)
            return CopyHandle(event=ev, compute=self.compute)
        if self._pool is None:
            raise RuntimeError("Device has neither a CUDA copy stream nor a copy thread")
        return CopyHandle(future=self._pool.submit(dst.copy_, src))

    def stream_in(self, job: Callable[[Callable[[torch.Tensor, torch.Tensor], object]], None]) -> CopyHandle:
        """Run job(copy) off the compute thread, where copy(dst, src) moves host memory src into device
        memory dst and returns once src may be reused (a loader fills a few staging buffers in turn); the
        handle's wait() orders later compute after every copy."""
        self._check_thread("a copy")
        if self._stream is None:
            if self._pool is None:
                raise RuntimeError("Device has neither a CUDA copy stream nor a copy thread")
            return CopyHandle(future=self._pool.submit(job, lambda dst, src: dst.copy_(src)))
        stream = self._stream
        ready = torch.cuda.Event()
        ready.record(self.compute)  # dst may be in use until now

        def on_stream() -> None:
            stream.wait_event(ready)

            def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(stream)
                done.synchronize()  # src is a staging buffer the job refills next

            job(copy)

        if self._loader is None:
            self._loader = self.executor("ssd-loader")
        return CopyHandle(future=self._loader.submit(on_stream))

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.torch_device)

    def close(self) -> None:
        for pool in (self._pool, self._loader):
            if pool is not None:
                pool.shutdown(wait=True)


_bound = threading.local()
"""The gpu index the current thread is bound to (absent: never bound, CUDA's device 0)."""
