"""The start-up check of a gpu's memory (mobiuspipe.startup.room): a plan whose peak exceeds what CUDA reports the
gpu can give the run fails before the first step, naming the figures and the fix; on the stand-in nothing is read."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from foundation.units import GiB, MiB
from mobiuspipe.config import config_from_dict
from mobiuspipe.errors import PipelineError
from mobiuspipe.runtime.peers.ranks import RankInfo
from mobiuspipe.startup.config_plan import plan_for_config
from mobiuspipe.startup.room import Room, check_room, room_problem


def test_a_plan_within_the_free_memory_and_the_allocators_own_fits():
    room = Room(free=20 * GiB, total=24 * GiB, reserved=1 * GiB)  # 3 GiB outside: a context and another process
    assert room.usable == 21 * GiB and room.outside == 3 * GiB
    assert room_problem(21 * GiB, room, 0, 23 * GiB) is None


def test_a_plan_past_it_names_the_figures_and_how_much_more_to_leave():
    room = Room(free=20 * GiB, total=24 * GiB, reserved=1 * GiB)
    said = room_problem(21 * GiB + 300 * MiB + 1, room, 2, 23 * GiB)
    assert said is not None and said.startswith("gpu 2 has too little free memory for the plan")
    assert "the plan assumed 23.00 GiB of the gpu's 24.00 GiB" in said and "3.00 GiB is held outside" in said
    assert "leaving 301 MiB more of it (a run's plan.reserve_mb; for a plan file" in said


def test_the_check_reads_cuda_on_a_gpu_and_nothing_on_the_stand_in(monkeypatch):
    def never(*_):
        raise AssertionError("the stand-in has no CUDA memory to read")

    monkeypatch.setattr(torch.cuda, "mem_get_info", never)
    one = RankInfo(rank=0, world_size=1, local_rank=0, under_torchrun=False)
    plan = replace(plan_for_config(config_from_dict({})), gpu_memory_bytes=6 * GiB, workspace_bytes=1 * GiB)
    check_room(one, 1 << 50, torch.device("cpu"), plan)
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (4 * GiB, 8 * GiB) if d == gpu else never())
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 1 * GiB if d == gpu else never())
    check_room(one, 5 * GiB, gpu, plan)
    with pytest.raises(PipelineError, match=r"rank 0: gpu 0 .* \(the plan assumed 7.00 GiB of the gpu's 8.00 GiB\)"):
        check_room(one, 5 * GiB + 1, gpu, plan)
