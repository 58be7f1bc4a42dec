"""The Pipeline on one rank (every stage on gpu 0, no process group) equals plain PyTorch, step by step."""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch

from mobiuspipe import Pipeline
from mobiuspipe.config import config_from_dict
from mobiuspipe.data.dataset import open_data
from mobiuspipe.models.gpt import layer_factories, lm_loss
from mobiuspipe.optim import CPUAdam
from mobiuspipe.optim.host_threads import rank_threads
from mobiuspipe.startup.config_plan import model_spec, plan_for_config


def _cfg(blocks: int, d: int, heads: int, seq: int, batch: int, m: int, stages: int, seed: int, wd: float):
    return config_from_dict(
        {
            "model": {"num_blocks": blocks, "d_model": d, "num_heads": heads, "seq_len": seq, "vocab_size": 256},
            "data": {"batch_size": batch, "num_microbatches": m},
            "train": {"steps": 3, "lr": 0.01, "seed": seed, "weight_decay": wd, "precision": "fp32"},
            "plan": {"num_gpus": 1, "num_stages": stages, "device_memory_mb": 256},
        }
    )


def _run_local(cfg) -> tuple[list[float], dict[str, torch.Tensor], int, int]:
    threads = torch.get_num_threads()
    torch.set_num_threads(rank_threads(cfg.runtime.threads))  # as train() does, and as the reference does
    try:
        return _engine_run(cfg)
    finally:
        torch.set_num_threads(threads)


def _engine_run(cfg) -> tuple[list[float], dict[str, torch.Tensor], int, int]:
    t = cfg.train
    optimizer = partial(CPUAdam, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay)
    data = open_data(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    losses, peak = [], 0
    with Pipeline(
        layer_factories(model_spec(cfg), t.seed), lm_loss, plan=plan_for_config(cfg), optimizer=optimizer
    ) as pipe:
        for step in range(cfg.train.steps):
            r = pipe.train_batch(*data.batch(step, cfg.data.batch_size))
            losses.append(r.loss)
            peak = max(peak, r.arena_peak_bytes)
        weights = pipe.state_dict()
    return losses, weights, peak, r.arena_budget_bytes


@pytest.mark.parametrize("seed", range(8))
def test_local_pipeline_equals_plain_pytorch(seed, reference):
    rnd = random.Random(seed)
    heads = rnd.choice([1, 2, 3])
    blocks = rnd.randint(1, 4)
    m = rnd.choice([1, 2, 3])
    cfg = _cfg(
        blocks=blocks,
        d=heads * rnd.choice([5, 8, 11]),
        heads=heads,
        seq=rnd.choice([7, 16, 33]),
        batch=m * rnd.randint(1, 3),
        m=m,
        stages=rnd.randint(1, blocks + 2),
        seed=seed,
        wd=rnd.choice([0.0, 0.1]),
    )
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
def test_local_pipeline_on_cuda_equals_plain_pytorch(reference):
    cfg = _cfg(blocks=3, d=24, heads=3, seq=17, batch=4, m=2, stages=4, seed=5, wd=0.0)
    losses, weights, peak, budget = _run_local(cfg)
    ref_losses, _ = reference(cfg, microbatched=False)
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    assert 0 < peak <= budget
