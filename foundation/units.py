"""Byte units: the one KiB/MiB/GiB/TiB, sizes as text (fmt_bytes) and memory strings read back (as_bytes); numbered
things as runs of numbers (fmt_spans: stages, CPUs)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from decimal import Decimal
from typing import Any

__all__ = ["KiB", "MiB", "GiB", "TiB", "fmt_bytes", "fmt_spans", "as_bytes", "MEMORY_UNITS"]

KiB = 2**10
MiB = 2**20
GiB = 2**30
TiB = 2**40

MEMORY_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": KiB,
    "MIB": MiB,
    "GIB": GiB,
    "TIB": TiB,
}
"""Units a memory string may end in (any case): powers of 1000 (KB, ..., TB) or of 1024 (KiB, ..., TiB)."""

_MEMORY_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]+)\s*$")
_MEMORY_EXPECTED = (
    'bytes: an integer >= 0 or a string like "24GiB" (24 * 2**30) or "24GB" (24 * 10**9); '
    "units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
)


def fmt_bytes(nbytes: float, digits: int = 2) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1: "3.38 GiB", "412.00 KiB", "7 B"."""
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale:
            return f"{nbytes / scale:.{digits}f} {unit}"
    return f"{int(nbytes)} B"


def fmt_spans(ids: Iterable[int], sep: str = ", ") -> str:
    """Integers as runs, in order: [0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8" (sep between runs: "," for a cpulist)."""
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        elif not runs or i != runs[-1][1]:
            runs.append([i, i])
    return sep.join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def as_bytes(value: Any) -> int:
    """Bytes from an int >= 0 or a memory string ("24GiB", "24 GB", "1.5TiB"); ValueError saying what was
    expected otherwise (a converter for the loader: foundation.loader field metadata "convert")."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(_MEMORY_EXPECTED)
        return value
    match = _MEMORY_RE.match(value) if isinstance(value, str) else None
    if match is None or match.group(2).upper() not in MEMORY_UNITS:
        raise ValueError(_MEMORY_EXPECTED)
    unit = MEMORY_UNITS[match.group(2).upper()]
    exact = Decimal(match.group(1)) * unit
    if exact != exact.to_integral_value():
        raise ValueError(f"a whole number of bytes ({str(value).strip()} is {exact.normalize():f} bytes)")
    return int(exact)
