"""The rank's device and where its host work runs (mobiuspipe.startup.engine.rank_device): on a gpu whose NUMA node
the topology knows, the calling thread (which makes and page-locks the stages' host buffers) and every executor
thread are pinned to the node's cores."""

import os

import torch

from mobiuspipe.config import config_from_dict
from mobiuspipe.runtime.peers.ranks import RankInfo
from mobiuspipe.startup import engine as startup_engine
from mobiuspipe.startup.config_plan import plan_for_config


def test_the_calling_thread_and_the_executors_run_on_the_gpus_node(monkeypatch):
    pinned: list[set[int]] = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: pinned.append(set(cores)))
    monkeypatch.setattr(startup_engine, "update_cores_of", lambda layout, rank, on_gpu: {0})
    plan = plan_for_config(config_from_dict({}))
    threads = torch.get_num_threads()
    device = startup_engine.rank_device(plan, RankInfo(rank=0, world_size=1, local_rank=0, under_torchrun=False))
    try:
        assert pinned == [{0}]  # the calling thread, before it makes any buffer
        device.executor("test").submit(lambda: None).result()
        assert pinned == [{0}, {0}]  # and each executor's thread once bound
    finally:
        device.close()
        torch.set_num_threads(threads)  # pinned_to lowered it to the node's one core
