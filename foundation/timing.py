"""Stopwatch: the one way the project times a region (time.perf_counter, seconds)."""

from __future__ import annotations

import time

__all__ = ["Stopwatch"]


class Stopwatch:
    """Starts when made; `.s` is the seconds since then, frozen when used as a context manager exits."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self._stopped: float | None = None

    @property
    def s(self) -> float:
        end = self._stopped if self._stopped is not None else time.perf_counter()
        return end - self._t0

    def __enter__(self) -> Stopwatch:
        return self

    def __exit__(self, *exc) -> None:
        self._stopped = time.perf_counter()
