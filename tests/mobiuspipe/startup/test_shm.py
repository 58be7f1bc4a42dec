"""A small /dev/shm on a host whose gpus share it is warned of at start-up, and NCCL's failure to make a segment
there is an error that names it and the fix; the CPU stand-in's peer region refuses a folder it would outgrow."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mobiuspipe.pipeline as pipeline_module
from foundation.shm import ShmSpace
from foundation.units import GiB, MiB
from mobiuspipe import Pipeline
from mobiuspipe.errors import PipelineError
from mobiuspipe.memory.device import Device
from mobiuspipe.runtime.peers.ranks import RankInfo
from mobiuspipe.startup import peer_regions
from mobiuspipe.startup.shm import shm_error, shm_warning

SMALL = ShmSpace("/dev/shm", 64 * MiB, 60 * MiB)
LARGE = ShmSpace("/dev/shm", 16 * GiB, 16 * GiB)
SEGMENT = (
    "NCCL error in: ProcessGroupNCCL.cpp:3356, unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL "
    "version 2.27.5\nncclSystemError: System call (e.g. socket, malloc) or external library call failed or device "
    "error.\nLast error:\nError while creating shared memory segment /dev/shm/nccl-pZafXL (size 7340384)"
)
BARE = "NCCL error in: ProcessGroupNCCL.cpp:3356, unhandled system error (run with NCCL_DEBUG=INFO for details)"


def _info(local_rank=0, world=2):
    return RankInfo(local_rank, world, local_rank, True)


def test_the_first_rank_of_a_host_warns_of_a_small_shm(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    why = shm_warning(_info(), True, SMALL)
    assert why is not None and why.startswith("2 ranks share this host's gpus")
    assert "/dev/shm: 64.00 MiB, 60.00 MiB free" in why and "--shm-size=1g" in why


def test_no_warning_where_nothing_is_wrong(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert shm_warning(_info(), True, LARGE) is None
    assert shm_warning(_info(), False, SMALL) is None  # gloo's messages go by socket
    assert shm_warning(_info(), True, None) is None
    assert shm_warning(_info(local_rank=1), True, SMALL) is None  # one warning a host
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one rank on each host: NCCL goes by network
    assert shm_warning(_info(), True, SMALL) is None
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert shm_warning(_info(world=1), True, SMALL) is None


@pytest.mark.parametrize("space", [SMALL, LARGE])
def test_a_segment_nccl_could_not_make_names_the_shm_and_the_fix(space):
    told = shm_error(RuntimeError(SEGMENT), space)
    assert isinstance(told, PipelineError)
    text = str(told)
    assert text.startswith("NCCL could not set up its messages between this host's gpus (NCCL error in: ")
    assert "unhandled system error" in text and space.describe() in text and "--shm-size=1g" in text


def test_a_bare_system_error_is_the_shms_only_when_it_is_small():
    assert isinstance(shm_error(RuntimeError(BARE), SMALL), PipelineError)
    assert shm_error(RuntimeError(BARE), LARGE) is None


@pytest.mark.parametrize("text", ["CUDA out of memory", "Error while creating shared memory segment"])
def test_other_errors_stay_as_they_are(text):
    assert shm_error(RuntimeError(text), SMALL) is None  # no NCCL in it
    assert shm_error(RuntimeError(SEGMENT), None) is None  # no /dev/shm to speak of


def test_a_pipeline_whose_nccl_fails_in_shm_says_so(monkeypatch):
    def fail(*args):
        raise RuntimeError(SEGMENT)

    monkeypatch.setattr(pipeline_module, "check_room", fail)
    monkeypatch.setattr(pipeline_module, "shm_space", lambda: SMALL)
    sample = (torch.randn(4, 8), torch.randn(4, 8))
    with pytest.raises(PipelineError, match="NCCL could not set up its messages") as e:
        Pipeline([nn.Linear(8, 8) for _ in range(2)], nn.functional.mse_loss, sample=sample, num_microbatches=2)
    assert isinstance(e.value.__cause__, RuntimeError) and str(e.value.__cause__) == SEGMENT


def test_the_stand_ins_region_refuses_a_folder_it_would_outgrow(monkeypatch):
    monkeypatch.setattr(peer_regions, "shm_space", lambda folder: ShmSpace(folder, 64 * MiB, 1 * MiB))
    with pytest.raises(PipelineError, match=r"region of 2.00 MiB is a file in .*, which has too little room") as e:
        peer_regions._give(2 * MiB, Device(0), "mobiuspipe-test-region")
    assert "--shm-size=1g" in str(e.value) and str(e.value).endswith("(memory.activation_tier: host)")
