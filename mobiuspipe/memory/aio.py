"""Asynchronous tensor reads and writes at file offsets: the C++ engine (io_uring or a thread pool, O_DIRECT)
or, without the extension, a Python thread pool over buffered pread/pwrite. Failures become SwapIOError."""

from __future__ import annotations

import ctypes
import errno as errno_mod
import os
from dataclasses import dataclass

import torch

from mobiuspipe import _ext
from mobiuspipe.errors import SwapIOError
from mobiuspipe.memory.pyio import SHORT_READ, SHORT_WRITE, PyAsyncIO

__all__ = ["ALIGN", "IOEngine", "Ticket", "aligned_empty", "round_up", "swap_error"]

ALIGN = 4096  # bytes: O_DIRECT alignment of memory, file offsets and lengths used everywhere here
HUGE_PAGE = 2 << 20  # bytes: a transparent huge page on x86-64 and most arm64 kernels
_MADV_HUGEPAGE = 14
_LIBC: ctypes.CDLL | bool | None = None
BACKENDS = ("auto", "uring", "threads", "python")

_HINTS = {
    errno_mod.ENOSPC: "the disk is full: free space there (df -h) or move the swap folder to a bigger disk",
    errno_mod.EDQUOT: "the disk quota is exhausted: raise it or move the swap folder",
    errno_mod.EIO: "the device reported an I/O error: check `dmesg` and the drive's health (smartctl -a)",
    errno_mod.EFBIG: "the file exceeds a size limit: check `ulimit -f` and the filesystem's maximum file size",
    errno_mod.EINVAL: "the filesystem refused this direct I/O (alignment or O_DIRECT support): "
    "set MOBIUSPIPE_IO_DIRECT=0 or use a folder on ext4/xfs",
    errno_mod.EBADF: "the file was closed while I/O was in flight (a bug: please report it)",
}


def round_up(n: int, align: int = ALIGN) -> int:
    """n rounded up to a multiple of align."""
    return -(-n // align) * align


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of nbytes whose memory starts on an ALIGN boundary and is padded to a multiple of
    ALIGN (so O_DIRECT can use it without bounce buffers), in pageable memory: a buffer a gpu copies from or into
    is page-locked by its Device (Device.host_empty, mobiuspipe.memory.pinned), at its own size.

    Buffers of 2 MiB or more are 2 MiB-aligned and advised into transparent huge pages before
    their first touch (env MOBIUSPIPE_HUGE_PAGES=0 turns this off): the kernel then pins 512x fewer pages
    per direct I/O. scripts/bench_buffers.py measures what it is worth (BENCHMARKS.md)."""
    huge = nbytes >= HUGE_PAGE and os.environ.get("MOBIUSPIPE_HUGE_PAGES", "1") != "0"
    align = HUGE_PAGE if huge else ALIGN
    padded = round_up(max(nbytes, 1), align)
    raw = torch.empty(padded + align, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % align
    buf = raw[skip : skip + padded]
    if align == HUGE_PAGE:
        _advise_huge_pages(buf)
    return buf[:nbytes]


def _advise_huge_pages(t: torch.Tensor) -> None:
    """madvise(MADV_HUGEPAGE) over t's memory; a no-op where the call or THP is unavailable."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(None, use_errno=True)
        except OSError:
            _LIBC = False
    if isinstance(_LIBC, ctypes.CDLL) and hasattr(_LIBC, "madvise"):
        _LIBC.madvise(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(t.numel()), _MADV_HUGEPAGE)


def swap_error(
    op: str, path: str, offset: int, nbytes: int, status: int, done: int = 0, at: int | None = None
) -> SwapIOError:
    """The SwapIOError for a failed `op` ('read', 'write', ...) of nbytes at offset of path, which failed
    at file offset `at` (default: offset) with an errno or the engine's SHORT_READ/SHORT_WRITE status."""
    at = offset if at is None else at
    where = f"{op} of {nbytes} bytes at offset {offset} of {path} failed"
    if at != offset:
        where += f" at offset {at}"
    if status == SHORT_READ:
        return SwapIOError(
            f"{where}: the file ends at offset {at} ({done} of {nbytes} bytes read); it was "
            "truncated or never fully written: restore it or start the job's swap folder afresh",
            path,
            at,
            0,
        )
    if status == SHORT_WRITE:
        return SwapIOError(
            f"{where}: the write made no progress ({done} of {nbytes} bytes written); the disk "
            "is probably full: free space there or move the swap folder",
            path,
            at,
            errno_mod.ENOSPC,
        )
    name = errno_mod.errorcode.get(status, f"errno {status}")
    hint = _HINTS.get(status, "check the disk and the file's permissions")
    return SwapIOError(f"{where} with {name} ({os.strerror(status)}): {hint}", path, at, status)


@dataclass(frozen=True)
class Ticket:
    """One submitted read or write: what the engine needs to wait for it and to name it in an error."""

    id: int
    op: str
    path: str
    offset: int
    nbytes: int


class IOEngine:
    """Submits tensor reads/writes at file offsets and waits for them; wait() raises SwapIOError.

    backend: "auto" (the C++ engine: io_uring, else its thread pool), "uring", "threads" (C++ thread pool)
    or "python" (buffered, no extension; also what "auto" means when the extension is missing).
    Environment MOBIUSPIPE_IO_BACKEND sets the default. queue_depth pieces of block_bytes are in flight.
    """

    def __init__(self, backend: str | None = None, queue_depth: int = 32, block_bytes: int = 1 << 20):
        backend = backend or os.environ.get("MOBIUSPIPE_IO_BACKEND", "auto")
        if backend not in BACKENDS:
            raise ValueError(f"I/O backend must be one of {BACKENDS}, not {backend!r}")
        if backend in ("uring", "threads") and not _ext.HAVE_C:
            raise RuntimeError(
                f"I/O backend {backend!r} needs the C++ extension, which is missing "
                f"({_ext.WHY_NOT}): build it with `python -m mobiuspipe._build`"
            )
        if backend == "python" or not _ext.HAVE_C:
            self._io = PyAsyncIO(queue_depth, block_bytes)
            why = "asked for" if backend == "python" else f"the C++ extension is missing: {_ext.WHY_NOT}"
        else:
            self._io = _ext.C.AsyncIO(backend, queue_depth, block_bytes)
            why = self._io.fallback_reason
        self.requested = backend
        self.backend = self._io.backend
        self.fallback_reason = why  # why this backend and not io_uring ('' when io_uring runs)
        self.supports_direct = self.backend != "python"
        self.checksum_algo = "crc32" if self.backend == "python" else "crc32c"  # what wait_checked returns

    def submit(
        self, fd: int, t: torch.Tensor, offset: int, write: bool, direct: bool, path: str, checksum: bool = False
    ) -> Ticket:
        """Queue the read (into t) or write (of t) of t's bytes at offset of fd; path names it in errors.
        checksum: also compute the bytes' checksum (self.checksum_algo) in the I/O threads."""
        if direct and not self.supports_direct:
            raise ValueError(f"the {self.backend!r} I/O backend does not do O_DIRECT")
        nbytes = t.numel() * t.element_size()
        tid = self._io.submit(fd, t, offset, write, direct, checksum)
        return Ticket(tid, "write" if write else "read", path, offset, nbytes)

    def wait(self, ticket: Ticket) -> int:
        """Block until the ticket's I/O ends; returns its byte count or raises SwapIOError."""
        return self.wait_checked(ticket)[0]

    def wait_checked(self, ticket: Ticket) -> tuple[int, int]:
        """wait(), returning (byte count, checksum of the bytes; 0 unless submitted with checksum=True)."""
        status, fail_offset, done, crc = self._io.wait(ticket.id)
        if status != 0:
            raise swap_error(
                ticket.op,
                ticket.path,
                ticket.offset,
                ticket.nbytes,
                status,
                done,
                at=fail_offset if fail_offset >= 0 else None,
            )
        return done, crc

    def done(self, ticket: Ticket) -> bool:
        """Whether the ticket's I/O has ended (wait() then returns at once)."""
        return self._io.done(ticket.id)

    def register(self, buffers: list[torch.Tensor]) -> str:
        """Register long-lived buffers (e.g. an optimizer's slots) with io_uring, so the kernel pins their
        pages once instead of on every I/O; returns "" or why not (they then work as ordinary memory).
        Once per engine, while no I/O is in flight."""
        if self.backend != "uring" or isinstance(self._io, PyAsyncIO):
            return f"the {self.backend!r} backend does not register buffers"
        if self._io.registered:
            return "this engine's registered buffers are already taken"
        return self._io.register_buffers(list(buffers))

    def pending(self) -> int:
        """Submitted requests not yet ended."""
        return self._io.pending()

    def inject_fault(self, nth: int, err: int = 0, short_bytes: int = 0) -> None:
        """Test hook: the nth piece completing from now fails with err, or transfers at most short_bytes."""
        self._io.inject_fault(nth, err, short_bytes)
