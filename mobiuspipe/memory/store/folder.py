"""The SSD store's folder: the lock that keeps a second process out, the probe for O_DIRECT, and the removal
of data files a crash left unnamed by the index."""

from __future__ import annotations

import errno
import fcntl
import os

from mobiuspipe.errors import SwapIOError
from mobiuspipe.memory.aio import ALIGN, IOEngine, aligned_empty

__all__ = ["direct_refused", "lock_folder", "remove_orphans"]


def direct_refused(folder: str, engine: IOEngine) -> str:
    """Why folder's filesystem refuses an aligned O_DIRECT write ('' when it accepts it)."""
    path = os.path.join(folder, ".direct-probe")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return f"open with O_DIRECT: {exc.strerror}, as on tmpfs"
        raise
    try:
        engine.wait(engine.submit(fd, aligned_empty(ALIGN), 0, True, True, path))
        return ""
    except SwapIOError as exc:
        if exc.errno == errno.EINVAL:
            return "an aligned O_DIRECT write failed with EINVAL"
        raise
    finally:
        os.close(fd)
        os.unlink(path)


def lock_folder(folder: str) -> int:
    """Lock folder/lock for this process (its pid written in it); SwapIOError naming the holder if taken."""
    fd = os.open(os.path.join(folder, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise SwapIOError(_in_use(folder, holder), folder, errno=errno.EBUSY) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _in_use(folder: str, holder: str) -> str:
    """Why folder cannot be locked: held by holder (a pid), which may be this process."""
    if holder == str(os.getpid()):
        return (
            f"the SSD store folder {folder} is open already in this process (pid {holder}): an SSDStore holds its "
            f"folder until close(); close the first one (or use it) before opening the folder again"
        )
    return f"the SSD store folder {folder} is in use by another process (pid {holder}); give each job its own folder"


def remove_orphans(folder: str, named: set[str]) -> None:
    """Unlink the data files (*.bin) of folder that the index does not name: a run that crashed before its
    index was written left them. A new file must never take over such a file, which a checkpoint may have
    linked (unlinking keeps the checkpoint's name)."""
    for name in os.listdir(folder):
        if name.endswith(".bin") and name not in named:
            os.unlink(os.path.join(folder, name))
