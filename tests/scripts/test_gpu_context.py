"""gpu_check's contexts rows (scripts/gpu_context.py): the child that opens a region of this process and the free
memory read around it. Without a GPU the plumbing runs on a host tensor (shared through shared memory, not CUDA IPC)
and the gpu's free memory is a script; on a GPU gpu_check runs it for real."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import gpu_context


def test_the_peer_context_is_the_fall_in_free_memory_while_the_child_holds_the_region(monkeypatch):
    free = iter([900 << 20, 500 << 20])  # before the child opens the region, and while it holds it open
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (next(free), 1 << 30))
    assert gpu_context.peer_context_bytes(torch.device("cpu")) == 400 << 20


def test_without_a_gpu_the_rows_say_so():
    rows = []
    gpu_context.contexts(lambda *row: rows.append(row), torch.device("cpu"), cuda=False)
    assert rows == [("CUDA contexts against the plan's room for them", None, "no GPU here: not measured")]
