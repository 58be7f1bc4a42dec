"""Stopwatch: seconds since a start (perf_counter), also as a context manager that freezes at exit."""

from __future__ import annotations

import time

__all__ = ["Stopwatch"]


class Stopwatch:
    """`sw = Stopwatch()` starts it and `sw.s` is the seconds since; `with Stopwatch() as sw:` restarts it
    on entry and freezes `sw.s` when the block ends."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._stop: float | None = None

    @property
    def s(self) -> float:
        """Seconds from the start to now, or to the end of the `with` block once it has ended."""
        end = time.perf_counter() if self._stop is None else self._stop
        return end - self._start

    def __enter__(self) -> Stopwatch:
        self._start, self._stop = time.perf_counter(), None
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop = time.perf_counter()
