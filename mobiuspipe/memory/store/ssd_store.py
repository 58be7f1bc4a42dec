"""The SSD tier: a folder of tensors (one file each, O_DIRECT where the filesystem allows), put/get with
async variants returning futures, a checksum per tensor verified on every read, an atomically written index.

One store per job folder (a lock keeps a second process out). Threads may use one store for different
keys at once (the index is changed under a lock); operations on one key must be ordered by the caller.
The index on disk is the state at the last flush() or close(); a crash after it leaves tensors whose
files changed since then failing their checksum on read (an error), never silently wrong data. A file with a
second name (a checkpoint's hard link, link_to/adopt) is never written in place.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import warnings
from dataclasses import replace
from typing import TypeVar

import torch

from foundation.units import fmt_bytes
from mobiuspipe.errors import SwapIOError
from mobiuspipe.memory.aio import IOEngine, aligned_empty, round_up, swap_error
from mobiuspipe.memory.store import index as store_index
from mobiuspipe.memory.store.folder import direct_refused, lock_folder, remove_orphans
from mobiuspipe.memory.store.future import StoreFuture, checksum, drain
from mobiuspipe.memory.store.index import Entry

__all__ = ["SSDStore", "StoreFuture", "checksum", "drain", "NEXT"]

_T = TypeVar("_T", bound="torch.Tensor | None")  # what one tracked future returns: the tensor read, or None


NEXT = ".next"
"""The suffix of the key a speculative write goes to beside the key it replaces once it stands (SSDStore.swap)."""


class SSDStore:
    """Tensors by key in `folder` (created if missing).

    backend/queue_depth/block_bytes configure the I/O engine (see IOEngine); direct=None uses O_DIRECT
    when the folder's filesystem accepts it (env MOBIUSPIPE_IO_DIRECT=0 turns it off), else buffered I/O
    with a note (self.note). Checksums are CRC-32C from the C++ engine, zlib crc32 from the Python one;
    a tensor is verified with the algorithm it was stored with.
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        *,
        backend: str | None = None,
        queue_depth: int = 32,
        block_bytes: int = 1 << 20,
        direct: bool | None = None,
    ):
        self.folder = os.path.abspath(folder)
        os.makedirs(self.folder, exist_ok=True)
        self._lock_fd = lock_folder(self.folder)
        try:
            self.engine = IOEngine(backend, queue_depth, block_bytes)
            self.index = store_index.load(self.folder)
            remove_orphans(self.folder, {e.file for e in self.index.entries.values()})
            self.direct, self.note = self._choose_direct(direct)
        except BaseException:
            os.close(self._lock_fd)  # releases the folder
            raise
        self.algo = self.engine.checksum_algo  # computed by the I/O threads, overlapped with the transfer
        if self.note:
            warnings.warn(f"SSD store {self.folder}: {self.note}", RuntimeWarning, stacklevel=2)
        self._inflight: dict[str, StoreFuture[torch.Tensor | None]] = {}
        self._dirty: set[str] = set()
        self._retired: list[str] = []  # files no entry names any more, unlinked once the index says so
        self._mutex = threading.Lock()
        """Held while the index, the in-flight table or the dirty set change (never during I/O)."""
        self._closed = False

    def keys(self) -> list[str]:
        """Keys stored or being written."""
        return sorted(set(self.index.entries) | set(self._inflight))

    def __contains__(self, key: str) -> bool:
        return key in self.index.entries or key in self._inflight

    def __len__(self) -> int:
        return len(self.keys())

    def info(self, key: str) -> Entry:
        """The index entry of key (file, dtype, shape, nbytes, checksum)."""
        self._settle(key)
        return self._entry(key)

    @property
    def meta(self) -> dict:
        """Small JSON-serializable metadata saved with the index (e.g. an optimizer's layout and step)."""
        return self.index.meta

    def check_space(self, nbytes: int, what: str) -> None:
        """Raise SwapIOError(ENOSPC) now if the folder's disk has less than nbytes free for `what`."""
        free = shutil.disk_usage(self.folder).free
        if free < nbytes:
            raise SwapIOError(
                f"{what} needs {fmt_bytes(nbytes)} in {self.folder}, but its disk has only "
                f"{fmt_bytes(free)} free: free space there or use a folder on a bigger disk",
                self.folder,
                errno=errno.ENOSPC,
            )

    # ------------------------------------------------------------------ writes
    def put(self, key: str, t: torch.Tensor) -> None:
        """Store t (any dtype and shape) under key, replacing what was there; returns when it is written."""
        self.put_async(key, t).result()

    def put_async(self, key: str, t: torch.Tensor) -> StoreFuture[None]:
        """Start storing t under key. t must not change until the future's result() returns."""
        self._check_open()
        t = _host_tensor(t, key)
        self._settle(key)
        with self._mutex:
            old = self.index.entries.get(key)
            shared = old is not None and _links(os.path.join(self.folder, old.file)) > 1  # a checkpoint's too
            name = old.file if old and not shared else self.index.new_file()  # a shared file stays as it is
        path = os.path.join(self.folder, name)
        nbytes = t.numel() * t.element_size()
        fd = self._open(path, write=True)
        try:
            self._allocate(fd, path, round_up(nbytes) if self.direct else nbytes)
            ticket = self.engine.submit(fd, t, 0, True, self.direct, path, checksum=True)
        except BaseException:
            os.close(fd)
            raise
        entry = Entry(name, _dtype_name(t.dtype), list(t.shape), nbytes, 0, self.algo)
        moved = old.file if old and shared else None  # the old file (a checkpoint's) leaves once the key moves

        def finish() -> None:
            try:
                entry.crc = self.engine.wait_checked(ticket)[1]
            except SwapIOError as exc:
                entry.damaged = f"its last write failed: {exc}"
                raise
            finally:
                os.close(fd)
                with self._mutex:
                    self.index.entries[key] = entry
                    self._dirty.add(name)
                    if moved is not None:
                        self._retired.append(moved)

        return self._track(key, StoreFuture(finish, lambda: self.engine.done(ticket)))

    def swap(self, a: str, b: str) -> None:
        """Exchange the tensors of keys a and b (their index entries: no byte moves); flush() makes it durable. A
        speculative write goes to key + NEXT and swap commits it."""
        self._check_open()
        self._settle(a)
        self._settle(b)
        with self._mutex:
            ea, eb = self._entry(a), self._entry(b)
            self.index.entries[a], self.index.entries[b] = eb, ea

    def delete(self, key: str) -> None:
        """Remove key and its file."""
        self._check_open()
        self._settle(key)
        entry = self._entry(key)
        del self.index.entries[key]
        self._dirty.discard(entry.file)
        _unlink(os.path.join(self.folder, entry.file))

    def clear(self) -> None:
        """Remove every tensor and the metadata, and write the (empty) index."""
        for key in self.keys():
            self.delete(key)
        self.index.meta.clear()
        self.flush()

    # ------------------------------------------------------------------ links (checkpoints)
    def link_to(self, key: str, path: str) -> Entry:
        """Hard-link key's file at path (a checkpoint's copy that costs no bytes); while a second link exists,
        the file is never written in place: the next put of key goes to a new file. OSError when path's
        filesystem cannot link it (another device: EXDEV). Call flush() first (the bytes durable)."""
        entry = self._finished(key)
        os.link(os.path.join(self.folder, entry.file), path)
        return replace(entry)

    def copy_to(self, key: str, path: str) -> Entry:
        """Copy key's file to path, as link_to where path's filesystem cannot link it (the copy streams: no more
        host memory than a buffer's); path's file is a checkpoint's own."""
        entry = self._finished(key)
        shutil.copyfile(os.path.join(self.folder, entry.file), path)
        return replace(entry)

    def release_replaced(self) -> None:
        """flush() when files replaced since the last one wait for removal (a checkpoint linked them, a later put
        wrote their key anew): a checkpoint calls it before linking, so that the store's names for them go once
        the index no longer needs them, not at close."""
        with self._mutex:
            waiting = bool(self._retired)
        if waiting:
            self.flush()

    def _finished(self, key: str) -> Entry:
        """key's entry once its I/O has ended; SwapIOError when it cannot be trusted."""
        self._check_open()
        self._settle(key)
        entry = self._entry(key)
        if entry.damaged:
            raise SwapIOError(f"tensor {key!r} cannot be trusted: {entry.damaged}", entry.file)
        return entry

    def adopt(self, key: str, path: str, entry: Entry) -> None:
        """Make the file at path (described by entry: dtype, shape, nbytes, checksum) key's tensor: linked in
        when path's filesystem allows, else copied; the file at path is never written. flush() after."""
        self._check_open()
        self._settle(key)
        with self._mutex:
            name = self.index.new_file()
        dst = os.path.join(self.folder, name)
        try:
            os.link(path, dst)
        except OSError:  # another filesystem, or one without hard links
            shutil.copyfile(path, dst)
        with self._mutex:
            old = self.index.entries.get(key)
            if old is not None:
                self._retired.append(old.file)
            self.index.entries[key] = replace(entry, file=name, damaged="")
            self._dirty.add(name)

    # ------------------------------------------------------------------ reads
    def get(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor stored under key, read into out (same dtype and element count) or a new tensor."""
        return self.get_async(key, out).result()

    def get_async(self, key: str, out: torch.Tensor | None = None) -> StoreFuture[torch.Tensor]:
        """Start reading key; the future's result() verifies the checksum and returns the tensor."""
        self._check_open()
        self._settle(key)
        entry = self._entry(key)
        path = os.path.join(self.folder, entry.file)
        if entry.damaged:
            raise SwapIOError(f"tensor {key!r} ({path}) cannot be trusted: {entry.damaged}; write it again", path)
        out = self._target(key, entry, out)
        fd = self._open(path, write=False)
        try:
            size = os.fstat(fd).st_size
            if size < entry.nbytes:
                raise SwapIOError(
                    f"read of tensor {key!r} failed: {path} is {size} bytes, but it holds "
                    f"{entry.nbytes} bytes of data: the file was truncated; restore it or "
                    "write the tensor again",
                    path,
                    size,
                )
            by_engine = entry.algo == self.engine.checksum_algo  # else verified here, with the stored algorithm
            ticket = self.engine.submit(fd, out, 0, False, self.direct, path, checksum=by_engine)
        except BaseException:
            os.close(fd)
            raise

        def finish() -> torch.Tensor:
            try:
                _, got = self.engine.wait_checked(ticket)
            finally:
                os.close(fd)
            if not by_engine:
                got = checksum(out, entry.algo)
            if got != entry.crc:
                raise SwapIOError(
                    f"checksum mismatch reading tensor {key!r} from {path}: stored {entry.algo} "
                    f"{entry.crc:#010x}, read {got:#010x}; the file was changed or damaged on "
                    "disk (or written after the last flush by a run that crashed): the tensor "
                    "cannot be trusted; restore it or write it again",
                    path,
                    0,
                )
            return out

        return self._track(key, StoreFuture(finish, lambda: self.engine.done(ticket)))

    # ------------------------------------------------------------------ durability
    def wait_all(self) -> None:
        """Wait for every pending put/get (their errors stay with their futures)."""
        with self._mutex:
            keys = list(self._inflight)
        for key in keys:
            self._settle(key)

    def flush(self) -> None:
        """Wait for pending I/O, make the written files durable (fsync) and write the index atomically."""
        self._check_open()
        self.wait_all()
        with self._mutex:  # a put that ends meanwhile (another thread's) waits: the index saved is what was fsynced
            for name in sorted(self._dirty):
                self._fsync(name)
            self._dirty.clear()
            store_index.save(self.folder, self.index)
            retired, self._retired = self._retired, []
        for name in retired:
            _unlink(os.path.join(self.folder, name))

    def _fsync(self, name: str) -> None:
        """Make the store's file `name` durable (a file gone since it was written is skipped)."""
        path = os.path.join(self.folder, name)
        try:
            store_index.fsync_path(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise swap_error("fsync", path, 0, 0, exc.errno or errno.EIO) from exc

    def close(self) -> None:
        """flush(), then release the folder."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            os.close(self._lock_fd)

    def __enter__(self) -> SSDStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the SSD store {self.folder} is closed")

    def _entry(self, key: str) -> Entry:
        entry = self.index.entries.get(key)
        if entry is None:
            raise KeyError(
                f"no tensor {key!r} in the SSD store {self.folder} (it holds {len(self.index.entries)} tensors)"
            )
        return entry

    def _track(self, key: str, fut: StoreFuture[_T]) -> StoreFuture[_T]:
        with self._mutex:
            self._inflight[key] = fut
        return fut

    def _settle(self, key: str) -> None:
        """Let the previous operation on key end first (its error stays with its future)."""
        with self._mutex:
            fut = self._inflight.pop(key, None)
        if fut is not None:
            try:
                fut.result()
            except SwapIOError:
                pass

    def _target(self, key: str, entry: Entry, out: torch.Tensor | None) -> torch.Tensor:
        dtype = getattr(torch, entry.dtype)
        if out is None:
            return aligned_empty(entry.nbytes).view(dtype).view(entry.shape)
        n = out.numel() * out.element_size()
        if out.dtype != dtype or n != entry.nbytes or out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(
                f"out for tensor {key!r} must be a contiguous CPU {entry.dtype} tensor of "
                f"{entry.nbytes} bytes; got {_dtype_name(out.dtype)} of {n} bytes on "
                f"{out.device} (contiguous={out.is_contiguous()})"
            )
        return out

    def _open(self, path: str, write: bool) -> int:
        flags = (os.O_RDWR | os.O_CREAT) if write else os.O_RDONLY
        try:
            return os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o600)
        except FileNotFoundError as exc:
            raise SwapIOError(
                f"{path} is missing: the store's index names it, but the file was deleted or "
                "moved; restore it or write the tensor again",
                path,
                errno=exc.errno or errno.ENOENT,
            ) from exc
        except OSError as exc:
            raise swap_error(
                "open for write" if write else "open for read", path, 0, 0, exc.errno or errno.EIO
            ) from exc

    def _allocate(self, fd: int, path: str, nbytes: int) -> None:
        """Reserve the file's blocks now, so a full disk fails here and not halfway through a write."""
        if nbytes and os.fstat(fd).st_size < nbytes:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                raise swap_error("allocation", path, 0, nbytes, exc.errno or errno.EIO) from exc

    def _choose_direct(self, direct: bool | None) -> tuple[bool, str]:
        if direct is None:
            direct = os.environ.get("MOBIUSPIPE_IO_DIRECT", "1") != "0"
        if not direct:
            return False, ""
        if not self.engine.supports_direct:
            if self.engine.requested == "python":
                return False, ""
            return False, (
                f"buffered I/O: the {self.engine.backend!r} I/O engine does not do O_DIRECT "
                f"({self.engine.fallback_reason})"
            )
        why = direct_refused(self.folder, self.engine)
        if why:
            return False, f"O_DIRECT refused ({why}): using buffered I/O (the page cache keeps a copy)"
        return True, ""


def _links(path: str) -> int:
    """How many names the file has (0 when it does not exist)."""
    try:
        return os.stat(path).st_nlink
    except FileNotFoundError:
        return 0


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _host_tensor(t: torch.Tensor, key: str) -> torch.Tensor:
    if t.device.type != "cpu":
        raise ValueError(
            f"tensor {key!r} is on {t.device}: the SSD store takes CPU tensors (copy it to host memory first)"
        )
    return t.detach().contiguous()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
