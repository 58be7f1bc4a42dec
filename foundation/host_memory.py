"""The host's memory as Linux reports it to a process that wants to know what it may still take."""

from __future__ import annotations

__all__ = ["mem_available"]


def mem_available() -> int | None:
    """This host's MemAvailable in bytes (Linux's estimate of what can be taken without swapping), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
