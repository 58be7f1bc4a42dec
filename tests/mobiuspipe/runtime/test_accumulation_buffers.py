"""Gradient accumulation's host buffer for a later pass's gradients is made with the stage's states, not at the first
accumulated OFFLOAD: on CUDA that is a stage-sized cudaHostRegister (page-locking gigabytes, which may synchronize the
device) in the middle of a step, on the compute thread. No step asks the gpu's Device for host memory."""

from __future__ import annotations

from functools import partial

import pytest

from mobiuspipe import Pipeline
from mobiuspipe.config import MemoryConfig, config_from_dict
from mobiuspipe.data.dataset import open_data
from mobiuspipe.memory.device import Device
from mobiuspipe.models.gpt import layer_factories, lm_loss
from mobiuspipe.optim import CPUAdam
from mobiuspipe.startup.config_plan import model_spec, plan_for_config

CFG = config_from_dict(
    {
        "model": {"num_blocks": 3, "d_model": 40, "num_heads": 5, "seq_len": 13},
        "data": {"batch_size": 6, "num_microbatches": 3},
        "train": {"lr": 0.01, "seed": 3, "precision": "bf16"},
        "plan": {"num_gpus": 1, "num_stages": 4, "device_memory_mb": 256},
    }
)


@pytest.mark.parametrize("tier", ["host", "ssd states", "ssd weights"])
def test_no_step_asks_for_host_memory_with_accumulation(tier, tmp_path, monkeypatch):
    ssd = {"optimizer": "ssd", "ssd_dir": str(tmp_path / "ssd"), "host_budget_mb": 1.0}
    memory = {
        "host": MemoryConfig(),
        "ssd states": MemoryConfig(**ssd),
        "ssd weights": MemoryConfig(**ssd, weights="ssd"),
    }[tier]
    data = open_data(CFG.data, CFG.model.seq_len, 3, CFG.model.vocab_size)
    asked, stepping = [], []
    for name in ("pin", "host_empty"):
        real = getattr(Device, name)

        def recorded(self, t, real=real, name=name):
            if stepping:
                asked.append((name, t if isinstance(t, int) else t.numel()))
            return real(self, t)

        monkeypatch.setattr(Device, name, recorded)
    with Pipeline(
        layer_factories(model_spec(CFG), 3),
        lm_loss,
        plan=plan_for_config(CFG),
        optimizer=partial(CPUAdam, lr=0.01),
        memory=memory,
        accumulation_steps=2,
    ) as pipe:
        stepping.append(True)
        for step in range(2):
            pipe.train_batch(*data.batch(step, 12))
        assert asked == []
