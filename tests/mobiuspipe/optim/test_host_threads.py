"""A rank's host threads: runtime.threads auto gives each rank of the host its share of the cores, and the host
update thread is pinned to its gpu's cores (topology.types.Gpu.cpu_affinity) where it runs on a gpu."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from mobiuspipe.config import config_from_dict
from mobiuspipe.errors import ConfigError
from mobiuspipe.optim.host_threads import parse_cpulist, pinned_to, rank_threads, update_cpus

ALLOWED = sorted(os.sched_getaffinity(0))


def test_auto_threads_are_the_ranks_share_of_the_allowed_cores(monkeypatch):
    assert rank_threads(3) == 3  # a number is kept
    assert rank_threads(None, 1) == len(ALLOWED)
    assert rank_threads(None, len(ALLOWED) + 5) == 1  # at least one
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert rank_threads(None) == max(1, len(ALLOWED) // 2)


def test_runtime_threads_is_auto_unless_a_count_is_given():
    assert config_from_dict({}).runtime.threads is None
    assert config_from_dict({"runtime": {"threads": "auto"}}).runtime.threads is None
    assert config_from_dict({"runtime": {"threads": 4}}).runtime.threads == 4
    with pytest.raises(ConfigError, match="runtime.threads"):
        config_from_dict({"runtime": {"threads": 0}})
    with pytest.raises(ConfigError, match="runtime.threads: expected a count"):
        config_from_dict({"runtime": {"threads": "many"}})


def test_cpulists_parse_as_linux_writes_them():
    assert parse_cpulist("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("5") == {5} and parse_cpulist("") == set()
    for bad in ("3-1", "x", "1-"):
        with pytest.raises(ValueError):
            parse_cpulist(bad)


def test_the_update_cores_are_the_gpus_that_this_process_may_use():
    mine = ",".join(map(str, ALLOWED))
    assert update_cpus(mine, on_gpu=True) == set(ALLOWED)
    assert update_cpus(f"{mine},{max(ALLOWED) + 1000}", on_gpu=True) == set(ALLOWED)  # a core not ours is left out
    assert update_cpus(mine, on_gpu=False) is None  # a stand-in's gpus are not real
    assert update_cpus("", on_gpu=True) is None  # the topology does not know them
    assert update_cpus(str(max(ALLOWED) + 1000), on_gpu=True) is None  # none of them is ours
    assert update_cpus("garbage", on_gpu=True) is None


def test_a_pinned_thread_runs_on_its_cores_and_leaves_the_processs_cores_alone():
    core = {ALLOWED[-1]}
    with ThreadPoolExecutor(1, initializer=pinned_to(core)) as pool:
        assert pool.submit(os.sched_getaffinity, 0).result() == core
    assert sorted(os.sched_getaffinity(0)) == ALLOWED
    with ThreadPoolExecutor(1, initializer=pinned_to(None)) as pool:
        assert sorted(pool.submit(os.sched_getaffinity, 0).result()) == ALLOWED


def test_pinning_lowers_torchs_threads_to_the_pinned_cores_and_never_raises_them():
    """CPU Adam's OpenMP team comes from the pinned thread: more threads than its cores would spin on each other."""
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(len(ALLOWED) + 3)
        with ThreadPoolExecutor(1, initializer=pinned_to({ALLOWED[-1]})) as pool:
            assert pool.submit(torch.get_num_threads).result() == 1
        torch.set_num_threads(1)
        with ThreadPoolExecutor(1, initializer=pinned_to(set(ALLOWED))) as pool:
            assert pool.submit(torch.get_num_threads).result() == 1
        with ThreadPoolExecutor(1, initializer=pinned_to(None)) as pool:
            assert pool.submit(torch.get_num_threads).result() == 1
    finally:
        torch.set_num_threads(before)


def test_a_pipeline_on_a_gpu_pins_its_update_thread_to_the_gpus_cores(monkeypatch):
    """On a gpu the Pipeline reads its gpu's cores off the plan's topology and the updater runs on them (the stand-in
    is told it is on a gpu whose cores are this process's last one)."""
    import torch
    import torch.nn.functional as F

    import mobiuspipe.optim.host_threads
    from mobiuspipe import Pipeline

    core = {ALLOWED[-1]}
    asked = []

    def on_a_gpu(cpu_affinity: str, on_gpu: bool) -> set[int]:
        asked.append(cpu_affinity)
        return core

    monkeypatch.setattr(mobiuspipe.optim.host_threads, "update_cpus", on_a_gpu)
    layers = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)]
    with Pipeline(layers, F.mse_loss, sample=(torch.randn(4, 4), torch.randn(4, 1)), num_microbatches=2) as pipe:
        assert pipe.engine.updater.submit(os.sched_getaffinity, 0).result() == core
        layout = pipe.plan.layout
        assert layout is not None and asked == [layout.gpus[0].cpu_affinity]  # the plan's topology knows the cores


def test_a_pipeline_on_a_gpu_keeps_its_host_work_threads_near_the_gpu(monkeypatch):
    """The threads that work on the host buffers of the gpu's NUMA node beside the updater (the gradients' finishing:
    an accumulated pass's add and its norm; the SSD offloader's staging) run on the same cores as the updater."""
    import torch
    import torch.nn.functional as F

    import mobiuspipe.optim.host_threads
    from mobiuspipe import Pipeline

    core = {ALLOWED[-1]}
    monkeypatch.setattr(mobiuspipe.optim.host_threads, "update_cpus", lambda cpu_affinity, on_gpu: core)
    layers = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)]
    with Pipeline(layers, F.mse_loss, sample=(torch.randn(4, 4), torch.randn(4, 1)), num_microbatches=2) as pipe:
        device = pipe.engine.device
        finished = device.after_copy(device.computed(), lambda: os.sched_getaffinity(0))
        assert finished.result() == core
        _, offloaded = device.stream_out(lambda copy, copied: os.sched_getaffinity(0))
        assert offloaded.result() == core
