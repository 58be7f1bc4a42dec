"""The Python stand-in of the C++ AsyncIO engine (same submit/wait/done API): buffered pread/pwrite of
block-sized pieces on a thread pool, short transfers resubmitted, the failure nearest the start kept per
request; checksums are zlib's crc32 (the C++ engine's are CRC-32C)."""

from __future__ import annotations

import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

SHORT_READ = -1  # status: the file ended before the requested bytes (as in csrc/io/async_io.h)
SHORT_WRITE = -2  # status: a write made no progress


class _Request:
    def __init__(self, buf: memoryview, pieces: int, checksum: bool):
        self.buf = buf  # the tensor's bytes (keeps the tensor alive)
        self.checksum = checksum
        self.left = pieces
        self.status = 0
        self.fail_offset = -1
        self.done_bytes = 0
        self.event = threading.Event()


class PyAsyncIO:
    """queue_depth worker threads, each moving one block_bytes piece at a time (the GIL is released in
    the system calls). Files are used as opened: no O_DIRECT, so no alignment rules."""

    backend = "python"

    def __init__(self, queue_depth: int = 32, block_bytes: int = 1 << 20):
        if queue_depth < 1 or block_bytes < 1:
            raise ValueError(f"queue_depth and block_bytes must be >= 1, not {queue_depth}, {block_bytes}")
        self.queue_depth = queue_depth
        self.block_bytes = block_bytes
        self._pool = ThreadPoolExecutor(max_workers=queue_depth, thread_name_prefix="mobiuspipe-io")
        self._lock = threading.Lock()
        self._requests: dict[int, _Request] = {}
        self._next = 1
        self._fault: tuple[int, int, int] | None = None

    def submit(self, fd: int, t: torch.Tensor, offset: int, write: bool, direct: bool, checksum: bool = False) -> int:
        if direct:
            raise ValueError("the Python I/O engine does not do O_DIRECT")
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("the tensor must be a contiguous CPU tensor")
        buf = t.view(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"")
        n = len(buf)
        starts = range(0, n, self.block_bytes)
        req = _Request(buf, len(starts), checksum)
        with self._lock:
            ticket, self._next = self._next, self._next + 1
            self._requests[ticket] = req
        if not starts:
            req.event.set()
        for at in starts:
            piece = buf[at : at + self.block_bytes]
            self._pool.submit(self._run, req, fd, piece, offset + at, write)
        return ticket

    def _apply_fault(self, res: int) -> int:
        with self._lock:
            if self._fault is None:
                return res
            nth, err, short = self._fault
            self._fault = (nth - 1, err, short) if nth > 0 else None
        if nth != 0:
            return res
        return -err if err > 0 else min(res, short)

    def _move(self, fd: int, piece: memoryview, off: int, write: bool) -> int:
        try:
            return os.pwrite(fd, piece, off) if write else os.preadv(fd, [piece], off)
        except OSError as exc:
            return -(exc.errno or 5)

    def _run(self, req: _Request, fd: int, piece: memoryview, off: int, write: bool) -> None:
        done, status = 0, 0
        while done < len(piece) and not (req.status and req.fail_offset < off):  # skip past a failure
            res = self._apply_fault(self._move(fd, piece[done:], off + done, write))
            if res <= 0:
                status = -res if res < 0 else (SHORT_WRITE if write else SHORT_READ)
                break
            done += res
        with self._lock:
            if status and (req.status == 0 or off + done < req.fail_offset):  # the lowest offset wins
                req.status, req.fail_offset = status, off + done
            req.done_bytes += done if not status else 0
            req.left -= 1
            if req.left == 0:
                req.event.set()

    def wait(self, ticket: int) -> tuple[int, int, int, int]:
        """(status, fail_offset, bytes moved, zlib crc32 of the bytes when asked for, else 0)."""
        with self._lock:
            req = self._requests.pop(ticket, None)
        if req is None:
            raise RuntimeError(f"unknown or already waited-for ticket {ticket}")
        req.event.wait()
        crc = zlib.crc32(req.buf) if req.checksum and req.status == 0 else 0
        return req.status, req.fail_offset, req.done_bytes, crc

    def done(self, ticket: int) -> bool:
        with self._lock:
            req = self._requests.get(ticket)
        if req is None:
            raise RuntimeError(f"unknown or already waited-for ticket {ticket}")
        return req.event.is_set()

    def pending(self) -> int:
        with self._lock:
            return sum(not r.event.is_set() for r in self._requests.values())

    def inject_fault(self, nth: int, err: int = 0, short_bytes: int = 0) -> None:
        with self._lock:
            self._fault = (nth, err, short_bytes)
