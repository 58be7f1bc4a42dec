"""The engine on one rank (every stage on gpu 0, no process group) equals plain PyTorch, step by step."""

from __future__ import annotations

import random

import pytest
import torch

from mobiuspipe.comm import Comm
from mobiuspipe.config import config_from_dict
from mobiuspipe.dataset import ByteData
from mobiuspipe.device import Device
from mobiuspipe.engine import Engine
from mobiuspipe.memory.arena import DeviceArena
from mobiuspipe.planning import plan_for_run
from mobiuspipe.schedule import build_schedule, check_schedules
from mobiuspipe.train import _build_stages
from partition.costmodel import ARENA_SLOTS


def _cfg(blocks: int, d: int, heads: int, seq: int, batch: int, m: int, stages: int, seed: int, wd: float):
    return config_from_dict({
        "model": {"num_blocks": blocks, "d_model": d, "num_heads": heads, "seq_len": seq, "vocab_size": 256},
        "data": {"batch_size": batch, "num_microbatches": m},
        "train": {"steps": 3, "lr": 0.01, "seed": seed, "weight_decay": wd},
        "plan": {"num_gpus": 1, "num_stages": stages, "device_memory_mb": 256},
    })


def _run_local(cfg) -> tuple[list[float], dict[str, torch.Tensor], int, int]:
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.runtime.threads)  # as train() does, and as the reference does
    try:
        return _engine_run(cfg)
    finally:
        torch.set_num_threads(threads)


def _engine_run(cfg) -> tuple[list[float], dict[str, torch.Tensor], int, int]:
    plan = plan_for_run(cfg)
    device = Device(use_cuda=False)
    sched = build_schedule(plan.mapping, 0, plan.num_microbatches)
    check_schedules(plan.mapping, plan.num_microbatches, [sched])
    arena = DeviceArena(plan.slot_bytes, ARENA_SLOTS, device.torch_device)
    engine = Engine(plan.mapping, 0, _build_stages(cfg, plan, 0, device), sched, device, arena, Comm(0, 10.0),
                    (cfg.microbatch_size, cfg.model.seq_len, cfg.model.d_model), plan.num_microbatches)
    data = ByteData(cfg.data.text_path, cfg.model.seq_len, cfg.train.seed)
    losses = []
    for step in range(cfg.train.steps):
        x, y = data.batch(step, cfg.data.batch_size)
        losses.append(engine.run_step(step, x, y)[0])
    engine.finish()
    weights = {k: v for s in engine.stages.values() for k, v in s.state_dict().items()}
    return losses, weights, arena.peak_bytes, arena.budget_bytes


@pytest.mark.parametrize("seed", range(8))
def test_local_pipeline_equals_plain_pytorch(seed, reference):
    rnd = random.Random(seed)
    heads = rnd.choice([1, 2, 3])
    blocks = rnd.randint(1, 4)
    m = rnd.choice([1, 2, 3])
    cfg = _cfg(blocks=blocks, d=heads * rnd.choice([5, 8, 11]), heads=heads, seq=rnd.choice([7, 16, 33]),
               batch=m * rnd.randint(1, 3), m=m, stages=rnd.randint(1, blocks + 2), seed=seed,
               wd=rnd.choice([0.0, 0.1]))
    losses, weights, peak, budget = _run_local(cfg)
    ref_losses, ref_weights = reference(cfg)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert losses == pytest.approx(reference(cfg, microbatched=False, optimizer=torch.optim.AdamW)[0], rel=1e-5)
    assert weights.keys() == ref_weights.keys()
    for k in weights:
        torch.testing.assert_close(weights[k], ref_weights[k], rtol=1e-5, atol=1e-6, msg=k)
    assert 0 < peak <= budget


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_local_pipeline_on_cuda_equals_plain_pytorch(reference, monkeypatch):
    cfg = _cfg(blocks=3, d=24, heads=3, seq=17, batch=4, m=2, stages=4, seed=5, wd=0.0)
    monkeypatch.setattr("test_engine_local.Device", lambda use_cuda: Device(use_cuda=True))
    losses, weights, peak, budget = _run_local(cfg)
    ref_losses, _ = reference(cfg, microbatched=False)
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    assert 0 < peak <= budget
