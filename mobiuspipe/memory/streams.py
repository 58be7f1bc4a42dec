"""Copy streams: one queue of copies on one gpu, CUDA's side stream or the CPU stand-in's worker thread.

Copies on one stream run in issue order. A copy that must follow work on another queue names it: `after`
(the handles of earlier copies, on any gpu's stream) and, on CUDA, the compute stream whose queued work the
copy's memory may still be in use by. The stand-in's stream is one worker thread (torch's copy kernels
release the GIL, so its copies really overlap compute); it waits for the `after` copies before its own.
Both follow the same rule: issue the copy, then wait() (the compute stream waits) or synchronize() (the host
waits) before the memory is used or refilled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

__all__ = ["CopyHandle", "CopyStream"]


class CopyHandle:
    """A copy in flight: wait() orders the compute stream after it, synchronize() blocks the host until it
    ended, done() asks whether it has."""

    def __init__(
        self,
        future: Future | None = None,
        event: torch.cuda.Event | None = None,
        compute: torch.cuda.Stream | None = None,
        check: Callable[[str], None] | None = None,
    ):
        """check(what): raises if the calling thread may not wait for the copy (Device._check_thread: CUDA's
        event waits from a thread whose current device is another gpu's would set up a context there)."""
        self._future, self._event, self._compute, self._check = future, event, compute, check

    def wait(self) -> None:
        if self._future is not None:
            self._future.result()
        if self._event is not None:
            assert self._compute is not None, "a CUDA copy's handle names the compute stream that waits for it"
            self._compute.wait_event(self._event)

    def synchronize(self) -> None:
        """Block this thread until the copy has ended (its source may then be refilled by the host)."""
        if self._check is not None:
            self._check("waiting for a copy to end")
        if self._future is not None:
            self._future.result()
        if self._event is not None:
            self._event.synchronize()

    def done(self) -> bool:
        """Whether the copy has ended (a failed stand-in copy counts as ended: its error comes out of wait)."""
        if self._check is not None:
            self._check("asking whether a copy has ended")
        if self._future is not None and not self._future.done():
            return False
        return self._event is None or self._event.query()

    def _follow(self, stream: torch.cuda.Stream) -> None:
        """Make a CUDA stream wait for this copy: a job's (Device.stream_in, stream_out) by waiting on the host for
        the job, whose copies have ended when it has (as the stand-in's copies wait for it)."""
        if self._future is not None:
            self._future.result()
        if self._event is not None:
            stream.wait_event(self._event)


class CopyStream:
    """The copies of one queue of gpu `index` (module docstring); compute: the stream that waits for them (CUDA:
    the rank's compute stream, on whatever gpu; None on the stand-in); check: given to each copy's handle
    (CopyHandle)."""

    def __init__(
        self,
        index: int,
        cuda: bool,
        name: str,
        compute: torch.cuda.Stream | None = None,
        check: Callable[[str], None] | None = None,
    ):
        self.index, self.name = index, name
        self._compute, self._check = compute, check
        self._stream = torch.cuda.Stream(torch.device("cuda", index)) if cuda else None
        self._thread = None if cuda else ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def copy(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        after: Sequence[CopyHandle] = (),
        ready: torch.cuda.Event | None = None,
    ) -> CopyHandle:
        """dst.copy_(src) on this stream once the `after` copies (and, on CUDA, the compute work recorded in
        `ready`) have ended."""
        if self._stream is None:
            assert self._thread is not None
            future = self._thread.submit(_copy_after, [h._future for h in after], dst, src)
            return CopyHandle(future=future, check=self._check)
        stream = self._stream
        if ready is not None:
            stream.wait_event(ready)
        for h in after:
            h._follow(stream)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event(blocking=True)  # a host waiting for it sleeps instead of spinning a core
            done.record(stream)
        return CopyHandle(event=done, compute=self._compute, check=self._check)

    def run(self, job: Callable[[], None]) -> CopyHandle:
        """The stand-in only: job() on the stream's thread, in order with its copies."""
        assert self._thread is not None, "a CUDA stream runs no host jobs"
        return CopyHandle(future=self._thread.submit(job), check=self._check)

    def close(self) -> None:
        """Return once every copy issued on the stream has ended (their buffers may be freed next)."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        if self._stream is not None:
            self._stream.synchronize()


def _copy_after(waits: list[Future | None], dst: torch.Tensor, src: torch.Tensor) -> None:
    for f in waits:
        if f is not None:
            f.result()
    dst.copy_(src)
