"""When a rank's actions ran: the host's clock on the CPU stand-in, CUDA events on a gpu.

On the stand-in the compute is synchronous, so time.perf_counter around an action is its span. On CUDA the host
only launches kernels, and its clock would measure the launches. There, an action's span lies between two
events recorded on the compute stream. They are read once the step has ended, and set on the host's clock by
an event recorded at a synchronized instant at the step's start. The step's end is the read of its loss,
which waits for the compute stream anyway. The CUDA spans cover what the compute stream did: a forward's wait
for its weights is inside its span (the stream waits, the host does not).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

__all__ = ["ActionClock", "BUCKETS"]

BUCKETS = {"F": "compute", "B": "compute", "SA": "comm", "RA": "comm", "SG": "comm", "RG": "comm"}
"""The StepTimes bucket of each action kind on CUDA (the rest: "load", the weights' and swaps' actions)."""


class ActionClock:
    """Marks on the rank's compute stream (CUDA) or the host's clock (the stand-in); seconds() reads one."""

    def __init__(self, compute: torch.cuda.Stream | None = None):
        self.compute = compute
        self._t0 = 0.0
        self._e0: torch.cuda.Event | None = None

    @property
    def on_device(self) -> bool:
        return self.compute is not None

    def start_step(self) -> None:
        """CUDA: the anchor of the step's marks on the host's clock (one synchronization, at the step's start)."""
        if self.compute is None:
            return
        self.compute.synchronize()
        self._t0 = time.perf_counter()
        self._e0 = torch.cuda.Event(enable_timing=True)
        self._e0.record(self.compute)

    def mark(self):
        """Now, on the compute stream (CUDA) or the host's clock."""
        if self.compute is None:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(self.compute)
        return ev

    def settle(self, last) -> None:
        """CUDA: wait until the compute stream has passed `last`, the latest mark, and with it every earlier one (one
        host wait for all the marks seconds() then reads)."""
        if self.compute is not None:
            last.synchronize()

    def seconds(self, mark) -> float:
        """The mark in time.perf_counter seconds (CUDA: after settle() of a mark at or after it)."""
        if self.compute is None:
            return mark
        assert self._e0 is not None, "start_step() anchors the CUDA marks"
        return self._t0 + self._e0.elapsed_time(mark) / 1e3

    def buckets(self, spans: Iterable[tuple[str, object, object]]) -> dict[str, float]:
        """Seconds per StepTimes bucket ("compute", "load", "comm") of (action kind, start mark, end mark) spans,
        in the order the marks were made."""
        spans = list(spans)
        out = {"compute": 0.0, "load": 0.0, "comm": 0.0}
        if spans:
            self.settle(spans[-1][2])
        for kind, start, end in spans:
            out[BUCKETS.get(kind, "load")] += self.seconds(end) - self.seconds(start)
        return out
