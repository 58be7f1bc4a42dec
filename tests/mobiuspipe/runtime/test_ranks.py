"""Joining the job's process group: a group the caller made is used as it is, on the rank's gpu, if its backend
carries this job's tensors."""

from __future__ import annotations

import os
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist

from mobiuspipe.errors import PipelineError, WorldSizeError
from mobiuspipe.runtime.peers import ranks
from mobiuspipe.runtime.peers.ranks import RankInfo, join_group, rank_info


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


def test_a_callers_group_without_local_rank_is_refused_on_cuda(monkeypatch):
    """A process group made by the caller (mp.spawn, say) with no LOCAL_RANK: on CUDA every rank would take gpu 0 and
    NCCL would fail with "Duplicate GPU detected"; the error says what to set. The stand-in has nothing to collide."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ranks.rank_info() == RankInfo(1, 2, 0, True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(WorldSizeError, match=r"LOCAL_RANK is not set.*gpu 0.*set LOCAL_RANK"):
        ranks.rank_info()
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert ranks.rank_info() == RankInfo(1, 2, 1, True)


@pytest.mark.parametrize("preset", [None, "1"])
def test_on_nccl_the_watchdog_aborts_communicators_without_ending_the_process(monkeypatch, preset):
    """TORCH_NCCL_ASYNC_ERROR_HANDLING 2 (abort the communicator only) unless the user chose; the channels' groups,
    made after join_group, read it; nothing on gloo."""
    if preset is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", preset)
    _made_by_caller(monkeypatch, "gloo", cuda=False)
    join_group(RankInfo(0, 2, 0, True), 30.0)
    assert os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == preset
    _made_by_caller(monkeypatch, "nccl", cuda=True)
    join_group(RankInfo(0, 2, 0, True), 30.0)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == (preset or "2")


@pytest.mark.parametrize("backend,cuda,need", [("gloo", True, "nccl"), ("nccl", False, "gloo")])
def test_a_callers_group_of_the_wrong_backend_is_refused(monkeypatch, backend, cuda, need):
    _made_by_caller(monkeypatch, backend, cuda)
    with pytest.raises(PipelineError, match=rf"uses the '{backend}' backend.*need '{need}'.*init_process_group"):
        join_group(RankInfo(0, 2, 0, True), 30.0)


def test_after_an_error_on_nccl_the_communicators_are_aborted(monkeypatch, capsys):
    """A graceful destroy waits for NCCL kernels no peer will match; abort_group does not (gloo: nothing to do)."""
    import mobiuspipe.runtime.peers.ranks as ranks

    aborted = []
    monkeypatch.setattr(ranks, "_abort_process_group", lambda: aborted.append(1))
    _made_by_caller(monkeypatch, "nccl", cuda=True)
    ranks.abort_group(False)  # a group the caller made is the caller's
    assert aborted == []
    ranks.abort_group(True)
    assert aborted == [1]
    _made_by_caller(monkeypatch, "gloo", cuda=False)
    ranks.abort_group(True)
    assert aborted == [1]

    def refuses():
        raise RuntimeError("abort is not supported")

    _made_by_caller(monkeypatch, "nccl", cuda=True)
    monkeypatch.setattr(ranks, "_abort_process_group", refuses)
    ranks.abort_group(True)  # the graceful leave follows: one line says why
    assert "did not abort (abort is not supported): leaving the group gracefully" in capsys.readouterr().err


def test_a_pipeline_left_by_an_error_aborts_before_it_waits(monkeypatch):
    """Pipeline.__exit__ with an exception aborts the group it joined before waiting for the host updates."""
    from mobiuspipe import Pipeline

    order = []
    monkeypatch.setattr(ranks, "abort_group", lambda owned: order.append(("abort", owned)))
    sample = (torch.randn(4, 4), torch.randn(4, 4))
    loss = torch.nn.functional.mse_loss
    for failed in (False, True):
        layers = [torch.nn.Linear(4, 4) for _ in range(2)]
        with pytest.raises(KeyError) if failed else nullcontext():
            with Pipeline(layers, loss, sample=sample, num_microbatches=2, num_stages=2) as pipe:
                monkeypatch.setattr(pipe.group, "owned", True)  # as if it had made the job's group
                finish = pipe.engine.finish
                spy = lambda failed, f=finish: (order.append(("finish", failed)), f(failed))  # noqa: E731
                monkeypatch.setattr(pipe.engine, "finish", spy)
                pipe.train_batch(*sample)
                if failed:
                    raise KeyError("a failure mid-run")
    assert order == [("finish", False), ("abort", True), ("finish", True)]


def test_a_rank_whose_gpu_this_process_does_not_see_is_told_why(monkeypatch):
    """A launcher that narrows CUDA_VISIBLE_DEVICES to each rank's own gpu leaves rank 1 no gpu 1: said at once,
    naming the variable (CUDA would say only "invalid device ordinal", later)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(name, value)
    with pytest.raises(WorldSizeError, match=r"rank 1 takes gpu 1 .* sees 1 gpu \(CUDA_VISIBLE_DEVICES is '1'\)"):
        rank_info()
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert rank_info().local_rank == 0
