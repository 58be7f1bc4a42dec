"""Threads that serve a gpu are bound to it: a new thread's current device is 0, so on a rank of gpu 1 an unbound
thread's copies would run on gpu 0's streams, and its first wait for a copy (a CUDA event) would make a CUDA context on
gpu 0, after the start-up room check has counted gpu 0's memory. The host updates' thread waits for the gradients'
copies."""

from __future__ import annotations

import threading
from functools import partial

import pytest
import torch

from mobiuspipe import Pipeline
from mobiuspipe.config import config_from_dict
from mobiuspipe.data.dataset import open_data
from mobiuspipe.memory.device import Device
from mobiuspipe.models.gpt import layer_factories, lm_loss
from mobiuspipe.optim import CPUAdam
from mobiuspipe.standin import StandInError
from mobiuspipe.startup.config_plan import model_spec, plan_for_config


def _run(monkeypatch, local_rank: int) -> tuple[list[float], bool]:
    """Three steps of one rank on gpu `local_rank` of its host; the losses, and whether the update thread is bound
    to that gpu."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    cfg = config_from_dict(
        {
            "model": {"num_blocks": 2, "d_model": 16, "num_heads": 2, "seq_len": 11, "vocab_size": 256},
            "data": {"batch_size": 4, "num_microbatches": 2},
            "train": {"steps": 3, "lr": 0.01, "seed": 5, "precision": "fp32"},
            "plan": {"num_gpus": 1, "num_stages": 3, "device_memory_mb": 64},
        }
    )
    data = open_data(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    layers = layer_factories(model_spec(cfg), cfg.train.seed)
    with Pipeline(layers, lm_loss, plan=plan_for_config(cfg), optimizer=partial(CPUAdam, lr=0.01)) as pipe:
        assert pipe.device.index == local_rank
        losses = [pipe.train_batch(*data.batch(step, cfg.data.batch_size)).loss for step in range(3)]
        bound = pipe.engine.updater.submit(pipe.device.bound).result()
    return losses, bound


def test_a_rank_on_gpu_1_updates_from_a_thread_bound_to_gpu_1(monkeypatch):
    """Strict mode refuses a wait for a copy from a thread bound to another gpu, so the run itself is the check; it
    trains as the same rank on gpu 0 does."""
    losses, bound = _run(monkeypatch, 1)
    assert bound
    assert losses == _run(monkeypatch, 0)[0]
    assert all(torch.isfinite(torch.tensor(losses)))


def _in_new_thread(f):
    """f() on a new thread (current device 0): its result, or the exception it raised."""
    out = []

    def run():
        try:
            out.append(f())
        except Exception as e:  # noqa: BLE001 -- handed back to the test
            out.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out[0]


def test_a_thread_bound_to_another_gpu_may_neither_copy_nor_wait_for_a_copy(monkeypatch):
    monkeypatch.setenv("MOBIUSPIPE_STRICT", "1")
    device = Device(1, use_cuda=False)
    try:
        src, dst = device.to_device(torch.arange(6.0)), device.pin(torch.zeros(6))
        made = _in_new_thread(lambda: device.copy_out(dst, src))
        assert isinstance(made, StandInError) and "a copy off the device for gpu 1" in str(made)
        assert "whose current device is 0" in str(made) and "Device.executor" in str(made)
        copy = device.copy_out(dst, src)  # this thread made the Device: bound to gpu 1
        for wait in (copy.synchronize, copy.done):
            refused = _in_new_thread(wait)
            assert isinstance(refused, StandInError) and "for gpu 1" in str(refused)
        pinned = []
        device.keep_host_work_near(lambda: pinned.append(device.bound()))
        pool = device.executor("bound")
        pool.submit(copy.synchronize).result()
        assert pool.submit(copy.done).result() and pinned == [True]  # the pinning runs after the binding
        with pytest.raises(RuntimeError, match=r"after the executors \['bound'\] were made"):
            device.keep_host_work_near(lambda: None)
        pool.shutdown()
        assert dst.tolist() == list(range(6))
    finally:
        device.close()


def test_the_lax_stand_in_lets_any_thread_wait(monkeypatch):
    monkeypatch.setenv("MOBIUSPIPE_STRICT", "0")
    device = Device(1, use_cuda=False)
    try:
        copy = device.copy_out(torch.zeros(3), torch.ones(3))
        assert _in_new_thread(copy.synchronize) is None
    finally:
        device.close()
