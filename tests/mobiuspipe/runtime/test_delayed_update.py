"""The delayed update (train.delayed_update: N, ZeRO-Offload's DPU): from step N on, step s computes on the weights
before the update of step s - 1, which runs on the host meanwhile. Checked against plain PyTorch running the same
rule (clip each step's own gradients, delay from step N, apply the last pending update at the end), with states in
host memory and on the SSD (bit for bit the same as in memory), and across a checkpoint (a resume repeats the run
bit for bit); tiers that keep the weights off host memory are refused."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

from mobiuspipe import Pipeline
from mobiuspipe.config import MemoryConfig
from mobiuspipe.data.dataset import open_data
from mobiuspipe.errors import PipelineError
from mobiuspipe.models.gpt import build_layers, layer_factories, lm_loss
from mobiuspipe.optim import CPUAdam
from mobiuspipe.startup.config_plan import model_spec, plan_for_config
from tests.mobiuspipe.hf_fixtures import DelayedRule
from tests.mobiuspipe.runtime.update_runs import BATCH, STEPS, update_config


def _cfg(precision: str = "fp32", memory: MemoryConfig | None = None):
    return update_config(precision, memory, seed=3)


def _optimizer(cfg):
    t = cfg.train
    return partial(CPUAdam, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay)


def _pipeline(cfg, delayed: int | None, clip: float | None, **kw) -> Pipeline:
    torch.set_num_threads(1)
    return Pipeline(
        layer_factories(model_spec(cfg), cfg.train.seed),
        lm_loss,
        plan=plan_for_config(cfg),
        optimizer=_optimizer(cfg),
        memory=cfg.memory,
        max_grad_norm=clip,
        delayed_update=delayed,
        **kw,
    )


def _train(cfg, delayed: int | None, clip: float | None, steps=range(STEPS), pipe: Pipeline | None = None):
    data = open_data(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    own = pipe is None
    pipe = pipe or _pipeline(cfg, delayed, clip)
    try:
        losses = [pipe.train_batch(*data.batch(s, BATCH)).loss for s in steps]
        return losses, pipe.state_dict()
    finally:
        if own:
            pipe.close()


def _reference(cfg, delayed: int, clip: float | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch under the rule: step s's gradients (summed over its microbatches, clipped by their own norm);
    the update of step s - 1 applied after them when step s is delayed (s >= delayed), before them otherwise; the
    last pending update applied at the end."""
    torch.set_num_threads(1)
    spec = model_spec(cfg)
    layers = build_layers(spec, cfg.train.seed)
    model = nn.Sequential(*(layers[l] for l in range(spec.num_layers)))
    params = list(model.parameters())
    opt = _optimizer(cfg)(params)
    data = open_data(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    m = cfg.data.num_microbatches
    assert m is not None

    losses, rule = [], DelayedRule(params, opt, delayed)
    for s in range(STEPS):
        x, y = data.batch(s, BATCH)
        for p in params:
            p.grad = None
        total = 0.0
        for xi, yi in zip(x.chunk(m), y.chunk(m)):
            loss = lm_loss(model(xi), yi) / m
            loss.backward()
            total += loss.item()
        losses.append(total)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        rule.update(s)
    rule.finish()
    weights = {
        f"{l}.{name}": p.detach().clone() for l in range(spec.num_layers) for name, p in layers[l].named_parameters()
    }
    return losses, weights


@pytest.mark.parametrize("clip", [None, 0.05])
def test_the_delayed_update_equals_plain_pytorch_running_the_same_rule(clip):
    cfg = _cfg()
    losses, weights = _train(cfg, 2, clip)
    ref_losses, ref_weights = _reference(cfg, 2, clip)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for k in ref_weights:
        torch.testing.assert_close(weights[k], ref_weights[k], rtol=1e-5, atol=1e-6, msg=k)
    plain, _ = _train(cfg, None, clip)
    assert losses[:2] == plain[:2]  # the steps before the first delayed one: the same weights, bit for bit
    assert losses[2] != plain[2]  # step 2 computes without step 1's update


def test_a_delay_from_past_the_last_step_changes_no_bit():
    cfg = _cfg("bf16")
    (losses, weights), (plain, plain_weights) = _train(cfg, STEPS, 0.05), _train(cfg, None, 0.05)
    assert losses == plain
    assert all(torch.equal(weights[k], plain_weights[k]) for k in plain_weights)


def _ssd(folder, weights: str) -> MemoryConfig:
    """The optimizer states on the SSD, and the weights and gradients too (weights "ssd": streamed, two versions of
    their records) or in memory."""
    return MemoryConfig(optimizer="ssd", weights=weights, ssd_dir=str(folder), host_budget_mb=4)


@pytest.mark.parametrize("weights", ["host", "ssd"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_states_on_the_ssd_give_the_same_bits_as_in_memory(tmp_path, weights, precision):
    host = _train(_cfg(precision), 1, 0.05)
    ssd = _train(_cfg(precision, _ssd(tmp_path, weights)), 1, 0.05)
    assert ssd[0] == host[0]
    for k in host[1]:
        assert torch.equal(ssd[1][k], host[1][k]), k


@pytest.mark.parametrize("memory", ["host", "ssd weights"])
def test_a_resume_from_a_checkpoint_repeats_the_run_bit_for_bit(tmp_path, memory):
    """In memory and with the weights streamed from the SSD, whose lagging version the checkpoint reads back from the
    records and the resume writes into them."""
    cfg = _cfg("bf16", None if memory == "host" else _ssd(tmp_path / "ssd", "ssd"))
    straight = _train(cfg, 1, 0.05)
    with _pipeline(cfg, 1, 0.05) as first:
        _train(cfg, 1, 0.05, range(3), first)
        folder = first.save_checkpoint(tmp_path / "ckpt")
    with _pipeline(cfg, 1, 0.05) as second:
        assert second.load_checkpoint(folder) == 3
        resumed = _train(cfg, 1, 0.05, range(3, STEPS), second)
    assert resumed[0] == straight[0][3:]
    for k in straight[1]:
        assert torch.equal(resumed[1][k], straight[1][k]), k


def test_states_on_the_gpu_are_refused_and_a_negative_step_too(tmp_path):
    on_gpu = MemoryConfig(optimizer="device")
    with pytest.raises(PipelineError, match=r"delayed_update: stages \[0, 1, 2, 3\] keep their states on the gpu"):
        _pipeline(_cfg("bf16", on_gpu), 1, None)
    with pytest.raises(PipelineError, match="delayed_update -1: expected the first delayed optimizer step"):
        _pipeline(_cfg(), -1, None)


def test_fp16_skipped_steps_delay_nothing_and_the_tiers_agree(tmp_path):
    """fp16 with scales that overflow the first two steps: a skipped step starts no update, so the next step has none
    to lag behind; with the states on the SSD the same bits."""
    from mobiuspipe.optim.loss_scale import LossScaler

    def run(memory: MemoryConfig | None, delayed: int | None):
        cfg = _cfg("fp16", memory)
        scaler = LossScaler(scale=2.0**40, backoff_factor=2.0**-12, growth_interval=2)
        with _pipeline(cfg, delayed, 0.05, loss_scaler=scaler) as pipe:
            data = open_data(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
            results = [pipe.train_batch(*data.batch(s, BATCH)) for s in range(STEPS)]
            return [(r.loss, r.skipped) for r in results], pipe.state_dict()

    host, plain = run(None, 1), run(None, None)
    assert [s for _, s in host[0]] == [True, True, False, False, False, False]
    assert host[0][:3] == plain[0][:3]  # steps 1 and 2 have no update of the step before to lag behind
    assert host[0][3] != plain[0][3]
    ssd = run(MemoryConfig(optimizer="ssd", ssd_dir=str(tmp_path), host_budget_mb=4), 1)
    assert ssd[0] == host[0]
    assert all(torch.equal(ssd[1][k], host[1][k]) for k in host[1])
