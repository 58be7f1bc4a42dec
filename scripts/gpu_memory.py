"""What lives on the GPU at a run's peak, from the CUDA allocator's recorded history (torch.cuda.memory._snapshot):
the allocations live at the moment their total was largest, grouped by where our code made them.

A trace is replayed event by event: 'alloc' adds a block's bytes, 'free_requested' takes them off (what
memory_allocated does); blocks allocated before the recording began are not in it, so the figures are the run's own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

OURS = ("mobiuspipe/", "partition/", "scripts/")
"""Frames from these folders name where an allocation was made; else the innermost frame does."""


def peak_live(trace: list[dict]) -> tuple[int, list[dict]]:
    """(the largest live total in bytes, the alloc events live at that moment) over one device's trace."""
    live: dict[int, dict] = {}
    total = best = 0
    best_live: list[dict] = []
    for e in trace:
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > best:
                best, best_live = total, list(live.values())
        elif action in ("free_requested", "free") and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    return best, best_live


def where(event: dict) -> str:
    """The innermost frame of our code that made the allocation (file:line function), else the innermost frame."""
    frames = event.get("frames") or []
    for f in frames:
        name = f.get("filename", "")
        for folder in OURS:
            if folder in name:
                return f"{folder}{name.split(folder, 1)[1]}:{f.get('line')} {f.get('name')}"
    return f"{frames[0].get('filename')}:{frames[0].get('line')} {frames[0].get('name')}" if frames else "unknown"


def summary(snapshot: Mapping[str, Any], top: int = 25) -> list[str]:
    """Lines: for each device with a trace, its peak and the places holding the most bytes at that moment."""
    lines = []
    for device, trace in enumerate(snapshot.get("device_traces", [])):
        if not trace:
            continue
        peak, live = peak_live(trace)
        by_place = Counter()
        counts = Counter()
        for e in live:
            by_place[where(e)] += e["size"]
            counts[where(e)] += 1
        lines.append(f"device {device}: peak {peak / 2**20:.2f} MiB live in {len(live)} blocks (the run's own)")
        for place, nbytes in by_place.most_common(top):
            lines.append(f"  {nbytes / 2**20:9.2f} MiB  {counts[place]:4} blocks  {place}")
    return lines
