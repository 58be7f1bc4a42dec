"""bf16 and fp16 training through the Pipeline equals a single-process run of the same precision recipe.

The recipe (what the pipeline promises): the model's weights in the low dtype on the device, each
microbatch's loss computed in fp32 from the upcast output and divided by the microbatch count, the
gradients accumulated over the microbatches in the low dtype, fp32 master weights stepped by CPUAdam
from those gradients (divided by the loss scale in fp16), the next low-precision weights written by
the same pass. In fp16 a step whose gradients hold an inf or nan is skipped and the scale halves.
The pipeline runs exactly these operations (its recompute repeats the same forward), so the losses and
weights must agree bit for bit: the tolerance is zero, and a difference is a bug, not rounding.
"""

from __future__ import annotations

import copy
import json
import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mobiuspipe import Pipeline
from mobiuspipe.config import config_from_dict
from mobiuspipe.data.dataset import open_data
from mobiuspipe.errors import PipelineError
from mobiuspipe.models.gpt import build_layers, layer_factories, lm_loss
from mobiuspipe.optim import CPUAdam
from mobiuspipe.optim.loss_scale import LossScaler
from mobiuspipe.startup.config_plan import model_spec, plan_for_config

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def recipe(layers, loss_fn, batches, m, dtype, make_optimizer, scaler=None):
    """Losses, skipped steps and final fp32 weights of the precision recipe in one process, no pipeline."""
    master = nn.Sequential(*layers)
    low = copy.deepcopy(master).to(dtype)
    masters, lows = list(master.parameters()), list(low.parameters())
    opt = make_optimizer(masters)
    losses, skipped = [], []
    for x, y in batches:
        for p in lows:
            p.grad = None
        scale = scaler.scale if scaler else 1.0
        total = 0.0
        for xi, yi in zip(x.chunk(m), y.chunk(m)):
            xi = xi.to(dtype) if xi.is_floating_point() else xi
            loss = loss_fn(low(xi).float(), yi) / m
            total += float(loss.detach())
            (loss * scale if scale != 1.0 else loss).backward()
        losses.append(total)
        low_grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in lows]
        overflow = scaler is not None and not all(bool(torch.isfinite(g).all()) for g in low_grads)
        skipped.append(overflow)
        if scaler is not None:
            scaler.update(overflow)
        if not overflow:
            grads = {mp: g if scale == 1.0 else g.float().mul_(1.0 / scale) for mp, g in zip(masters, low_grads)}
            opt.step_fused({mp: lp.data for mp, lp in zip(masters, lows)}, grads=grads)
    return losses, skipped, master.state_dict()


def _gpt(precision: str, stages: int = 4, steps: int = 4):
    cfg = config_from_dict(
        {
            "model": {"num_blocks": 3, "d_model": 24, "num_heads": 3, "seq_len": 17},
            "data": {"batch_size": 6, "num_microbatches": 3},
            "train": {"steps": steps, "lr": 0.01, "weight_decay": 0.05, "seed": 3, "precision": precision},
            "plan": {"num_gpus": 1, "num_stages": stages, "device_memory_mb": 256},
        }
    )
    data = open_data(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    batches = [data.batch(s, cfg.data.batch_size) for s in range(steps)]
    t = cfg.train
    opt = partial(CPUAdam, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay)
    return cfg, batches, opt


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_gpt_pipeline_equals_the_precision_recipe(precision):
    torch.set_num_threads(1)
    cfg, batches, opt = _gpt(precision)
    spec = model_spec(cfg)
    plan = plan_for_config(cfg)
    assert plan.dtype == precision and plan.slot_bytes == max(s.param_count for s in plan.stages) * 2
    with Pipeline(layer_factories(spec, cfg.train.seed), lm_loss, plan=plan, optimizer=opt) as pipe:
        results = [pipe.train_batch(x, y) for x, y in batches]
        weights = pipe.state_dict()
    layers = build_layers(spec, cfg.train.seed)
    scaler = LossScaler() if precision == "fp16" else None
    losses, skipped, ref = recipe(
        [layers[l] for l in range(spec.num_layers)], lm_loss, batches, 3, DTYPES[precision], opt, scaler
    )
    assert [r.loss for r in results] == losses
    assert [r.skipped for r in results] == skipped
    assert weights.keys() == ref.keys()
    for k in ref:
        assert torch.equal(weights[k], ref[k]), k
    assert losses[-1] < losses[0]  # and it learns


def test_fp16_overflow_skips_the_same_steps_and_backs_off():
    """A scale far too large overflows at first: those steps change no weight, the scale halves until the
    gradients fit, then grows again after growth_interval good steps."""
    torch.set_num_threads(1)
    cfg, batches, opt = _gpt("fp16", stages=3, steps=6)
    spec = model_spec(cfg)

    def scaler():
        return LossScaler(scale=2.0**40, backoff_factor=2.0**-12, growth_interval=2)

    with Pipeline(
        layer_factories(spec, 3), lm_loss, plan=plan_for_config(cfg), optimizer=opt, loss_scaler=scaler()
    ) as pipe:
        results = [pipe.train_batch(x, y) for x, y in batches]
        weights = pipe.state_dict()
    layers = build_layers(spec, 3)
    losses, skipped, ref = recipe(
        [layers[l] for l in range(spec.num_layers)], lm_loss, batches, 3, torch.float16, opt, scaler()
    )
    assert [r.skipped for r in results] == skipped
    assert skipped[0] and not all(skipped), skipped
    assert [r.loss_scale for r in results][:2] == [2.0**40, 2.0**28]
    assert [r.loss for r in results] == losses
    for k in ref:
        assert torch.equal(weights[k], ref[k]), k


def test_a_float_input_model_in_bf16_with_a_plan_from_its_profile():
    torch.set_num_threads(1)

    def layers():
        torch.manual_seed(0)
        return [nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 2)]

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)) for _ in range(3)]
    opt = partial(CPUAdam, lr=0.01)
    with Pipeline(
        layers(), F.mse_loss, optimizer=opt, sample=batches[0], num_microbatches=2, num_stages=3, precision="bf16"
    ) as pipe:
        assert pipe.plan.dtype == "bf16"
        got = [pipe.train_batch(x, y).loss for x, y in batches]
        weights = pipe.state_dict()
    losses, _, ref = recipe(layers(), F.mse_loss, batches, 2, torch.bfloat16, opt)
    assert got == losses
    for k in ref:
        assert torch.equal(weights[k], ref[k]), k


def test_precision_and_plan_must_agree():
    cfg, _, opt = _gpt("bf16")
    spec = model_spec(cfg)
    with pytest.raises(PipelineError, match="the plan is for bf16 weights but the precision asked for is fp32"):
        Pipeline(layer_factories(spec, 3), lm_loss, plan=plan_for_config(cfg), precision="fp32")
    with pytest.raises(PipelineError, match="only fp16 scales its loss"):
        Pipeline(layer_factories(spec, 3), lm_loss, plan=plan_for_config(cfg), loss_scaler=LossScaler())


@pytest.mark.slow
def test_bf16_on_two_ranks_equals_the_recipe(tmp_path, launch):
    """The torchrun entry in bf16 (the default precision): 2 ranks, 4 stages, cross mapping."""
    write_config, torchrun = launch
    d = {
        "model": {"num_blocks": 3, "d_model": 24, "num_heads": 3, "seq_len": 17},
        "data": {"batch_size": 6, "num_microbatches": 3},
        "train": {"steps": 3, "lr": 0.01, "weight_decay": 0.05, "seed": 3, "out_dir": str(tmp_path / "out")},
        "plan": {"num_gpus": 2, "num_stages": 4},
    }
    proc = torchrun(write_config(tmp_path, d), 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "bf16 weights, fp32 master" in proc.stdout

    losses = [json.loads(line)["loss"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    weights = {}
    for f in sorted((tmp_path / "out" / "weights").glob("stage*.pt")):
        weights.update(torch.load(f))
    cfg = config_from_dict(d)
    spec = model_spec(cfg)
    data = open_data(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    t = cfg.train
    opt = partial(CPUAdam, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay)
    layers = build_layers(spec, t.seed)
    torch.set_num_threads(1)
    ref_losses, _, ref = recipe(
        [layers[l] for l in range(spec.num_layers)],
        lm_loss,
        [data.batch(s, 6) for s in range(3)],
        3,
        torch.bfloat16,
        opt,
    )
    assert losses == ref_losses
    for k in ref:
        assert torch.equal(weights[k], ref[k]), k


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_an_infinite_gradient_skips_the_step_under_clipping(precision):
    """A gradient that overflows to inf without a nan (two fp16 microbatches' finite gradients summing past 65504;
    an inf in any precision) makes the global norm inf: the step is skipped, as a nan's is, where clipping's
    coefficient max_norm / (inf + 1e-6) = 0 divided the loss scale by zero (ZeroDivisionError) and left the held
    updates unsettled. The next step trains."""
    from mobiuspipe.optim.clipping import clip_scale

    assert clip_scale(float("inf"), 2.0**16, 1.0) == (float("inf"), 2.0**16)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = torch.full((4, 1), 1.5), torch.zeros(4, 1)
    scale = 2.0**16 if precision == "fp16" else 1.0
    overflow = torch.full((4, 1), 1.5 if precision == "fp16" else float("inf"))

    def loss(out, _):
        return out.float().mean()  # dL/dw of the last layer: 1.5 / 2 a microbatch, times the scale

    with Pipeline(
        [nn.Linear(1, 1), nn.Linear(1, 1)],
        loss,
        sample=(x, y),
        num_microbatches=2,
        num_stages=2,
        precision=precision,
        max_grad_norm=1.0,
        loss_scaler=LossScaler(scale=scale) if precision == "fp16" else None,
    ) as pipe:
        before = pipe.state_dict()
        first = pipe.train_batch(overflow, y)
        assert first.skipped and first.grad_norm is not None and not math.isfinite(first.grad_norm)
        assert all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items())
        after = pipe.train_batch(torch.full((4, 1), 1e-3), y)
        assert not after.skipped and after.grad_norm is not None and math.isfinite(after.grad_norm)


def test_layers_given_in_bf16_without_a_precision_are_told_to_name_it():
    """bf16 modules given to a Pipeline that plans itself, with the default precision='fp32': the profiler's error
    named its own dtype_name, which a Pipeline's user never passes."""
    layers = [nn.Linear(4, 4).to(torch.bfloat16), nn.Linear(4, 2).to(torch.bfloat16)]
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    with pytest.raises(PipelineError, match=r"layer 0 has torch.bfloat16 parameters, .*pass precision='bf16'"):
        Pipeline(layers, F.mse_loss, sample=(x, y), num_microbatches=2)
    with Pipeline(layers, F.mse_loss, sample=(x, y), num_microbatches=2, precision="bf16") as pipe:
        assert pipe.train_batch(x, y).loss > 0
