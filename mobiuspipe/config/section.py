"""The base of every run-config section (a checked frozen dataclass whose problems raise InvalidConfig) and the
value rules several sections share."""

from __future__ import annotations

from typing import Any

from foundation.loader import Checked, Problem, found_text, rule
from mobiuspipe.errors import InvalidConfig

__all__ = ["Section", "divisible", "mebibytes", "WRITTEN_PATH", "AUTO_COUNT", "auto_or_count"]

WRITTEN_PATH = {"out_path": True}
"""Field metadata of a path the run writes (out_dir, export_dir, ssd_dir): relative to the config file's folder,
made absolute when the config is loaded, and it need not exist yet (the rule: mobiuspipe/config/run.py)."""


def auto_or_count(raw: Any) -> Any:
    """A count as written, or None for "auto" (foundation.loader's "convert": the planner chooses it)."""
    if raw == "auto":
        return None
    if isinstance(raw, str):
        raise ValueError("a count (an integer), or auto for the planner's choice")
    return raw


AUTO_COUNT = {"convert": auto_or_count, "example": "auto"}
"""Field metadata of a count the planner chooses when the config says auto (the field holds None; the reference
shows `auto`)."""


class Section(Checked):
    """A config section: its problems raise InvalidConfig, a ConfigError."""

    invalid = InvalidConfig


def divisor_at_most(n: int, cap: int) -> int:
    """The largest divisor of `n` that is <= `cap` (at least 1)."""
    return max(d for d in range(1, max(1, min(n, cap)) + 1) if n % d == 0)


def divisible(a_name: str, a: int, b_name: str, b: int) -> list[Problem]:
    """`a` must be a multiple of `b` (both >= 1 or no problem is reported here)."""
    if a < 1 or b < 1 or a % b == 0:
        return []
    return [
        Problem(
            a_name,
            f"{a_name} divisible by {b_name}",
            f"{a_name} {a} with {b_name} {b} ({a} % {b} = {a % b})",
            f"use {a_name} {-(-a // b) * b} (a multiple of {b}) or {b_name} {divisor_at_most(a, b)} (divides {a})",
        )
    ]


MAX_MIB = 2.0**40
"""The largest memory figure a config may give, in MiB (1 EiB): its bytes must fit a 64-bit integer."""


def mebibytes(obj: object, name: str, fix: str) -> list[Problem]:
    """Field `name` of `obj` is a memory figure in MiB: > 0 and at most MAX_MIB (its bytes fit 64 bits)."""
    value = getattr(obj, name)
    return rule(0 < value <= MAX_MIB, name, "a number of MiB > 0 and at most 2**40 (1 EiB)", found_text(value), fix)
