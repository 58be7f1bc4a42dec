"""Test helper: whether work handed to another thread ends while something it must not wait for is held."""

from __future__ import annotations

from concurrent.futures import Future


def ended_within(future: Future, seconds: float) -> bool:
    """Whether `future` ends within `seconds` (its error, if it ends with one, is raised)."""
    try:
        future.result(timeout=seconds)
    except TimeoutError:
        return False
    return True
