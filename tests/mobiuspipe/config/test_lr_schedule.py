"""Learning-rate schedules: lr_at against hand-computed rates, the config's checks, and a pipelined run with
warmup and cosine decay against plain PyTorch setting the same rates step by step."""

import math
from functools import partial

import pytest
import torch

from mobiuspipe import Pipeline
from mobiuspipe.config import MemoryConfig, config_from_dict
from mobiuspipe.config.lr_schedule import lr_at
from mobiuspipe.data.dataset import open_data
from mobiuspipe.errors import ConfigError, PipelineError
from mobiuspipe.models.gpt import layer_factories, lm_loss
from mobiuspipe.optim import CPUAdam
from mobiuspipe.optim.host_threads import rank_threads
from mobiuspipe.startup.config_plan import model_spec, plan_for_config


def test_rates_by_hand():
    # 10 steps, 3 of warmup: rates 1/3, 2/3, 1 of lr, then 7 steps of decay, f = 0, 1/6, ..., 1
    assert [lr_at(s, 0.3, "cosine", 3, 10) for s in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    cos = [lr_at(s, 0.3, "cosine", 3, 10, 0.03) for s in range(3, 10)]
    assert cos == pytest.approx([0.03 + 0.27 * (1 + math.cos(math.pi * k / 6)) / 2 for k in range(7)])
    assert cos[0] == pytest.approx(0.3) and cos[-1] == pytest.approx(0.03)
    lin = [lr_at(s, 0.3, "linear", 0, 4) for s in range(4)]
    assert lin == pytest.approx([0.3, 0.2, 0.1, 0.0])
    assert [lr_at(s, 0.3, "constant", 2, 5) for s in range(5)] == pytest.approx([0.15, 0.3, 0.3, 0.3, 0.3])
    assert lr_at(0, 0.3, "cosine", 0, 1) == 0.3  # a run of one step takes the peak
    with pytest.raises(ValueError, match="expected one of constant, linear, cosine"):
        lr_at(0, 0.3, "step")


def test_config_checks():
    cfg = config_from_dict({"train": {"steps": 8, "lr": 0.01, "lr_schedule": "linear", "warmup_steps": 2}})
    assert [cfg.train.lr_of(s) for s in (0, 1, 2, 7)] == pytest.approx([0.005, 0.01, 0.01, 0.0])
    with pytest.raises(ConfigError) as e:
        config_from_dict({"train": {"steps": 5, "lr": 0.01, "lr_schedule": "cosin", "warmup_steps": 6, "min_lr": 1.0}})
    msg = str(e.value)
    assert "train.lr_schedule: expected one of constant, linear, cosine" in msg
    assert "train.warmup_steps: expected a count in [0, steps = 5]" in msg
    assert "train.min_lr: expected a rate in [0, lr = 0.01]" in msg


def _cfg():
    return config_from_dict(
        {
            "model": {"num_blocks": 3, "d_model": 16, "num_heads": 2, "seq_len": 12},
            "data": {"batch_size": 4, "num_microbatches": 2},
            "train": {
                "steps": 5,
                "lr": 0.02,
                "lr_schedule": "cosine",
                "warmup_steps": 2,
                "min_lr": 0.002,
                "precision": "fp32",
            },
            "plan": {"num_gpus": 1, "num_stages": 3, "device_memory_mb": 256},
        }
    )


def _run(cfg, memory=None):
    t = cfg.train
    torch.set_num_threads(rank_threads(cfg.runtime.threads))  # as train() does, and as the reference does
    data = open_data(cfg.data, cfg.model.seq_len, t.seed, cfg.model.vocab_size)
    opt = partial(CPUAdam, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay)
    plan = plan_for_config(cfg)
    with Pipeline(layer_factories(model_spec(cfg), t.seed), lm_loss, plan=plan, optimizer=opt, memory=memory) as pipe:
        losses = []
        for step in range(t.steps):
            pipe.set_lr(t.lr_of(step))
            losses.append(pipe.train_batch(*data.batch(step, cfg.data.batch_size)).loss)
        weights = pipe.state_dict()
        for bad in (-1e-3, float("nan")):
            with pytest.raises(PipelineError, match="finite learning rate >= 0"):
                pipe.set_lr(bad)
        pipe.set_lr(0.0)  # a schedule decaying to min_lr 0 ends there
    return losses, weights


def test_pipelined_run_with_a_schedule_equals_plain_pytorch(reference):
    cfg = _cfg()
    losses, weights = _run(cfg)
    ref_losses, ref_weights = reference(cfg)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for k in ref_weights:
        torch.testing.assert_close(weights[k], ref_weights[k], rtol=1e-5, atol=1e-6, msg=k)


def test_states_on_ssd_follow_the_schedule_bit_for_bit(tmp_path):
    cfg = _cfg()
    memory = MemoryConfig(optimizer="ssd", weights="ssd", ssd_dir=str(tmp_path), host_budget_mb=0.25)
    (losses, weights), (host_losses, host_weights) = _run(cfg, memory), _run(cfg)
    assert losses == host_losses
    for k in host_weights:
        assert torch.equal(weights[k], host_weights[k]), k
