"""The caching allocator's retries on a gpu (each frees its cache and synchronizes the whole gpu, which with NCCL
messages in flight on two ranks at once can hang the job): DevicePeak reads them after each step, and a job of
several ranks is told once they start."""

from __future__ import annotations

import torch

from mobiuspipe.memory.ledger import DeviceLedger
from mobiuspipe.memory.measure import DevicePeak, retry_warning


def test_device_peak_reads_the_allocators_retries_after_each_step_on_cuda(monkeypatch):
    """CUDA's readings faked: the retries come from memory_stats' num_alloc_retries; the stand-in has none."""
    stats = {"num_alloc_retries": 0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 123)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: dict(stats))
    peak = DevicePeak(torch.device("cuda", 1), DeviceLedger())
    for retries in (0, 0, 2, 5):
        stats["num_alloc_retries"] = retries
        peak.start_step()
        assert peak.end_step() == 123 and peak.alloc_retries == retries
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    standin = DevicePeak(torch.device("cpu"), DeviceLedger())
    standin.start_step()
    standin.end_step()
    assert standin.alloc_retries == 0


def test_the_warning_comes_once_when_retries_start_in_a_job_of_several_ranks():
    assert retry_warning(1, 0, 0, 2) is None  # none yet
    assert retry_warning(1, 5, 3, 2) is None  # more, but told already when the first came
    assert retry_warning(0, 4, 0, 1) is None  # one rank: no NCCL message in flight, the sync costs only time
    why = retry_warning(1, 3, 0, 4)
    assert why is not None and why.startswith("gpu 1: the caching allocator freed its cache to find memory (3 times")
    assert "can hang the job" in why and "plan.reserve_mb" in why and "--reserve-gib" in why
