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
from mobiuspipe.startup.room import Room, check_room, out_of_memory, room_problem


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


def test_the_layers_buffers_beyond_the_plans_count_count_beside_its_peak():
    """A stage keeps its layers' buffers (a causal mask per block) on the gpu all run; a plan counts them only as its
    profile measured them (a plan file from the analytic profile counts none): what the run holds beyond that count
    is in the allocator's reserved bytes when the check runs, so without it the check would pass a run that cannot
    fit its peak."""
    room = Room(free=20 * GiB, total=24 * GiB, reserved=1 * GiB)
    assert room_problem(20 * GiB, room, 0, 23 * GiB, unplanned=1 * GiB) is None
    said = room_problem(20 * GiB, room, 0, 23 * GiB, unplanned=1 * GiB + 5 * MiB)
    assert said is not None and "its peak is 20.00 GiB, and 1.00 GiB of the layers' buffers (the stages keep" in said
    assert "beyond the plan's count" in said and "leaving 5 MiB more" in said


def test_the_check_adds_only_the_buffers_the_plan_did_not_count(monkeypatch):
    one = RankInfo(rank=0, world_size=1, local_rank=0, under_torchrun=False)
    plan = replace(plan_for_config(config_from_dict({})), gpu_memory_bytes=6 * GiB, workspace_bytes=0)
    stages = (replace(plan.stages[0], buffer_bytes=1 * GiB), *plan.stages[1:])
    counted = replace(plan, stages=stages, buffer_bytes=1 * GiB, gpu_memory_bytes=5 * GiB)
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (4 * GiB, 8 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 1 * GiB)
    peak = 4 * GiB + 512 * MiB  # of the 5 GiB the run can have
    check_room(one, peak, gpu, counted, buffers=1 * GiB)  # the peak has them in it already
    with pytest.raises(PipelineError, match=r"its peak is 4.50 GiB, and 1.00 GiB of the layers' buffers"):
        check_room(one, peak, gpu, plan, buffers=1 * GiB)  # a plan that counted none
    with pytest.raises(PipelineError, match=r"and 1.00 GiB of the layers' buffers .* \(the plan assumed 6.00 GiB"):
        check_room(one, peak, gpu, counted, buffers=2 * GiB)


def test_a_stages_buffer_bytes_count_each_storage_once():
    from torch import nn

    from mobiuspipe import Pipeline

    class Masked(nn.Module):
        mask: torch.Tensor

        def __init__(self, table: torch.Tensor):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("mask", table)
            self.register_buffer("same", table)  # one storage, two names

        def forward(self, x):
            return self.fc(x) * self.mask[0, :4]

    table = torch.ones(8, 8)
    layers = [Masked(table), Masked(table.clone()), nn.Linear(4, 2)]
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    with Pipeline(layers, torch.nn.functional.mse_loss, sample=(x, y), num_microbatches=2, num_stages=3) as pipe:
        assert pipe.engine.buffer_bytes == 2 * 8 * 8 * 4  # fp32, one storage a layer
        assert [s.buffer_bytes for s in pipe.plan.stages] == [8 * 8 * 4, 8 * 8 * 4, 0]  # the plan counts them


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


def test_running_out_of_memory_while_setting_up_names_the_room(monkeypatch):
    """The arena, the states and the peer regions are made before check_room compares: an out-of-memory error there
    (a shared gpu, a context larger than the reserve) says what is held and how much more to leave, as the check
    does; other errors, and the stand-in's, pass through."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * GiB, 24 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 1 * GiB)
    plan = replace(plan_for_config(config_from_dict({})), gpu_memory_bytes=22 * GiB, workspace_bytes=0)
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    gpu = torch.device("cuda", 1)
    said = out_of_memory(oom, 1, gpu, plan)
    assert isinstance(said, PipelineError)
    text = str(said)
    assert text.startswith("rank 1 ran out of gpu memory while setting up (CUDA out of memory. Tried to allocate")
    assert "21.00 GiB is held outside this process's allocator" in text and "leaving 19456 MiB more" in text
    unplanned = out_of_memory(oom, 1, gpu, None)  # before the plan was agreed (profiling on the gpu)
    assert unplanned is not None and "plan.reserve_mb" in str(unplanned)
    assert out_of_memory(RuntimeError("other"), 1, gpu, plan) is None
    assert out_of_memory(oom, 1, torch.device("cpu"), plan) is None
