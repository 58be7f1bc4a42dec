"""The measured device peak of one rank's step, and the hook that counts what autograd keeps for backward.

On the CPU stand-in the measured figure is the DeviceLedger's: every tensor the engine holds on the device
(arena bytes in use, buffers, received and waiting activations and gradients, the stage inputs kept for
recompute, what is in flight to a peer) plus, during a stage's forward-with-grad and backward, the tensors
autograd saves for backward (through torch.autograd.graph.saved_tensors_hooks: unique storage bytes) and
the stage's output. Temporaries that live inside one operator, or inside backward (gradients of the
intermediate activations), are not seen. On CUDA the measured figure is the caching allocator's
max_memory_allocated over the step (reset at its start), which sees everything, the whole preallocated
arena included; the ledger stays beside it as the explanation (DevicePeak.parts).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from mobiuspipe.memory.ledger import DeviceLedger

__all__ = ["DevicePeak", "counting_saved", "retry_warning"]


@contextmanager
def counting_saved(ledger: DeviceLedger) -> Iterator[None]:
    """Hold every tensor autograd saves for backward in the ledger, as ("autograd", n); values unchanged.
    The caller drops them (ledger.drop_kind("autograd")) once backward has run."""
    n = itertools.count()

    def pack(t: torch.Tensor) -> torch.Tensor:
        ledger.hold(("autograd", next(n)), t)
        return t.detach()  # the same storage; a detached tensor avoids a reference cycle through grad_fn

    with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
        yield


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class DevicePeak:
    """Per step (start_step .. end_step) and over the run: the most bytes this rank held on its device."""

    def __init__(self, device: torch.device, ledger: DeviceLedger):
        self.device, self.ledger = device, ledger
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.source = "cuda allocator" if self.cuda else "ledger"
        """Where the measured figure comes from: "cuda allocator" (max_memory_allocated) or "ledger"."""
        self.step_bytes = 0
        """The measured peak of the last step."""
        self.run_bytes = 0
        """The largest step peak so far."""
        self.parts: dict[str, int] = {}
        """The ledger's bytes by kind at its peak of the last step."""
        self.run_parts: dict[str, int] = {}
        """The ledger's bytes by kind at the peak of the step with the largest measured peak."""
        self.alloc_retries = 0
        """CUDA: the times so far the caching allocator freed its cache to retry an allocation (num_alloc_retries);
        each synchronizes the whole gpu. 0 on the stand-in."""

    def start_step(self) -> None:
        self.ledger.reset_peak()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def end_step(self) -> int:
        """Close the step; its measured peak (also kept in step_bytes, and in run_bytes if the largest)."""
        self.step_bytes = torch.cuda.max_memory_allocated(self.device) if self.cuda else self.ledger.peak_bytes
        self.parts = dict(self.ledger.peak_parts)
        if self.step_bytes > self.run_bytes:
            self.run_bytes, self.run_parts = self.step_bytes, self.parts
        if self.cuda:
            self.alloc_retries = int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))
        return self.step_bytes


def retry_warning(gpu: int, retries: int, before: int, ranks: int) -> str | None:
    """What to tell the user, once a run, when gpu's caching allocator starts retrying allocations (retries so far,
    `before` at the last look) in a job of several ranks: freeing its cache synchronizes the whole gpu, which waits
    for NCCL's send and receive kernels in flight, and two ranks doing so at once while each has a send to the other
    outstanding hang (mobiuspipe.schedule.nccl's rules). None unless these are the run's first retries, or with one
    rank."""
    if before > 0 or retries == 0 or ranks < 2:
        return None
    return (
        f"gpu {gpu}: the caching allocator freed its cache to find memory ({retries} times so far); each time "
        f"synchronizes the whole gpu, which with NCCL messages in flight on two ranks at once can hang the job: plan "
        f"again leaving more of the gpu to the runtime (plan.reserve_mb, `mobiuspipe partition --reserve-gib`)"
    )
