"""What one rank measured in a step (its own times, host RSS, device peak, SSD bytes), to be gathered by rank 0."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["RankStep", "host_rss_bytes", "folder_bytes"]


@dataclass(frozen=True)
class RankStep:
    """One rank's own figures of one step; the parts add up to at most step_s (the rest is the loop's own
    work: the batch, waiting for the loss and the step's reductions). Each part is summed over the step's
    pipeline passes (train.accumulation_steps)."""

    step_s: float
    """Wall time of the step on this rank: the batch, set_lr and train_batch."""
    compute_s: float
    """Seconds in the stages' forward and backward."""
    load_s: float
    """Seconds waiting for weights to reach the arena (and gradients to leave it, and host updates)."""
    comm_s: float
    """Seconds blocked in send/recv."""
    device_peak_bytes: int
    """The most bytes this rank held on its device in the step (StepResult.own_device_peak_bytes)."""
    host_rss_bytes: int
    """Resident memory of this rank's process at the end of the step (Linux /proc; 0 where unreadable)."""
    ssd_bytes: int | None
    """Bytes on disk of this rank's SSD store (memory.ssd_dir/rank{r}); None when the rank has no store."""


def host_rss_bytes() -> int:
    """Resident set size of this process in bytes (Linux: /proc/self/statm), 0 where that file is absent."""
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
    except FileNotFoundError:  # not Linux: no cheap current RSS; the report shows 0
        return 0
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def folder_bytes(folder: str) -> int:
    """Bytes the files directly in `folder` occupy on disk (allocated blocks, as `du` counts them)."""
    total = 0
    with os.scandir(folder) as entries:
        for e in entries:
            try:
                if e.is_file(follow_symlinks=False):
                    total += e.stat(follow_symlinks=False).st_blocks * 512
            except FileNotFoundError:  # the store replaced or deleted it meanwhile: it holds no bytes now
                continue
    return total
