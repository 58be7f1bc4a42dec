"""Joining the job's process group: a group the caller made is used as it is, on the rank's gpu, if its backend
carries this job's tensors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mobiuspipe.errors import PipelineError
from mobiuspipe.runtime.ranks import RankInfo, join_group


def _made_by_caller(monkeypatch, backend: str, cuda: bool) -> list[int]:
    """A process group the caller made with `backend`, on a host with CUDA or not; the devices set_device got."""
    current: list[int] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    return current


def test_a_callers_group_is_kept_and_the_ranks_gpu_becomes_current(monkeypatch):
    """Object collectives (the plan's digest, the tiers) put their bytes on the current device: gpu 0 on every rank
    unless it is set."""
    current = _made_by_caller(monkeypatch, "nccl", cuda=True)
    assert join_group(RankInfo(1, 2, 1, True), 30.0) is False  # not made here: not ours to destroy
    assert current == [1]
    assert _made_by_caller(monkeypatch, "gloo", cuda=False) == [] and not join_group(RankInfo(0, 2, 0, True), 30.0)


@pytest.mark.parametrize("backend,cuda,need", [("gloo", True, "nccl"), ("nccl", False, "gloo")])
def test_a_callers_group_of_the_wrong_backend_is_refused(monkeypatch, backend, cuda, need):
    _made_by_caller(monkeypatch, backend, cuda)
    with pytest.raises(PipelineError, match=rf"uses the '{backend}' backend.*need '{need}'.*init_process_group"):
        join_group(RankInfo(0, 2, 0, True), 30.0)
