"""The small run the tests of the updates that leave the critical path (delayed, speculative) train: a GPT of 3 blocks
of d_model 24 in 4 stages on one stand-in, 6 steps of 4 sequences in 2 microbatches."""

from __future__ import annotations

import dataclasses

from mobiuspipe.config import MemoryConfig, RunConfig, config_from_dict

STEPS, BATCH = 6, 4


def update_config(precision: str = "fp32", memory: MemoryConfig | None = None, seed: int = 3) -> RunConfig:
    """The run's config in `precision`, with `memory` (default: every state in host memory) and `seed`."""
    cfg = config_from_dict(
        {
            "model": {"num_blocks": 3, "d_model": 24, "num_heads": 3, "seq_len": 13},
            "data": {"batch_size": BATCH, "num_microbatches": 2},
            "train": {"steps": STEPS, "lr": 0.01, "weight_decay": 0.05, "seed": seed, "precision": precision},
            "plan": {"num_gpus": 1, "num_stages": 4, "device_memory_mb": 256},
            "runtime": {"threads": 1},
        }
    )
    return dataclasses.replace(cfg, memory=memory or MemoryConfig())


def update_pipeline(cfg: RunConfig, **kwargs):
    """A Pipeline of the run's GPT and plan, CPUAdam at the config's lr; kwargs go to Pipeline (clipping, scaler...)."""
    from functools import partial

    from mobiuspipe import Pipeline
    from mobiuspipe.models.gpt import layer_factories, lm_loss
    from mobiuspipe.optim import CPUAdam
    from mobiuspipe.startup.config_plan import model_spec, plan_for_config

    t = cfg.train
    opt = partial(CPUAdam, lr=t.lr)
    return Pipeline(
        layer_factories(model_spec(cfg), t.seed),
        lm_loss,
        plan=plan_for_config(cfg),
        optimizer=opt,
        memory=cfg.memory,
        **kwargs,
    )
