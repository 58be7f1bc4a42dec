"""The SSD store's futures and checksums: StoreFuture (a pending put/get), drain, and the CRC of a tensor."""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from mobiuspipe import _ext
from mobiuspipe.errors import SwapIOError

__all__ = ["StoreFuture", "checksum", "drain"]

T_co = TypeVar("T_co", covariant=True)  # what a future's result() returns: the tensor read, or None


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def checksum(t: torch.Tensor, algo: str) -> int:
    """CRC of a contiguous CPU tensor's bytes: 'crc32c' (C++ extension) or 'crc32' (zlib)."""
    if t.numel() == 0:
        return 0
    if algo == "crc32c":
        if not _ext.HAVE_C:
            raise SwapIOError(
                "this tensor was stored with a crc32c checksum, which needs the C++ extension "
                f"({_ext.WHY_NOT}): build it with `python -m mobiuspipe._build`"
            )
        return int(_ext.C.crc32c(_bytes(t)))
    return zlib.crc32(_bytes(t).numpy().data)


class StoreFuture(Generic[T_co]):
    """The pending result of put_async/get_async: result() waits, then returns or raises SwapIOError (from any thread:
    one finishes the I/O, the others wait for its outcome)."""

    def __init__(self, finish: Callable[[], T_co], ready: Callable[[], bool]):
        self._finish, self._ready = finish, ready
        self._outcome: tuple[T_co] | BaseException | None = None  # (value,) or the error, once settled
        self._finishing = threading.Lock()

    def done(self) -> bool:
        """Whether the I/O has ended (result() then does not block)."""
        return self._outcome is not None or self._ready()

    def result(self) -> T_co:
        """The tensor read (get) or None (put); raises the I/O's SwapIOError. Safe to call twice, from any threads."""
        if self._outcome is None:
            with self._finishing:
                if self._outcome is None:
                    try:
                        self._outcome = (self._finish(),)
                    except BaseException as exc:  # noqa: BLE001  kept, and raised again on every call
                        self._outcome = exc
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome[0]


def drain(futures) -> None:
    """Wait for every future, dropping their errors: for clean-up while another error is on its way up
    (buffers must be idle before anyone reuses them, and these errors would hide the first one)."""
    for f in list(futures):
        try:
            f.result()
        except Exception:  # noqa: BLE001  see the docstring
            pass
