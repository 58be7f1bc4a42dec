"""A recompute stage's saved input on each tier between its forward and its backward (memory.activation_tier):
device, pinned host (copy stream, SWAP_OUT / SWAP_IN in the schedule) and SSD. Losses and weights are
bit-identical across tiers (fp32 and bf16, dropout, 2 accumulation passes), and the measured device peak
drops by the saved inputs that leave the device. The same for keep and selective stages, whose kept graphs and
recomputed parts' inputs swap; the last stage cannot swap (a named error)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

from mobiuspipe import Pipeline
from mobiuspipe.config import MemoryConfig, config_from_dict
from mobiuspipe.data.dataset import open_data
from mobiuspipe.errors import PipelineError
from mobiuspipe.models.gpt import layer_factories, lm_loss
from mobiuspipe.optim import CPUAdam
from mobiuspipe.schedule import Kind
from mobiuspipe.startup.config_plan import model_spec, plan_for_config


def _cfg(precision: str):
    return config_from_dict(
        {
            "model": {"num_blocks": 4, "d_model": 40, "num_heads": 5, "seq_len": 23},
            "data": {"batch_size": 8, "num_microbatches": 4},
            "train": {"lr": 0.01, "seed": 11, "precision": precision},
            "plan": {"num_gpus": 1, "num_stages": 4, "device_memory_mb": 256},
        }
    )


def _run(precision: str, tier: str, tmp_path, activations: str = "recompute", spec=None):
    cfg = _cfg(precision)
    layers = layer_factories(model_spec(cfg), 11)
    block = layers[2]
    layers[2] = lambda: nn.Sequential(block(), nn.Dropout(0.3))
    memory = MemoryConfig(activations=activations, activation_tier=tier, ssd_dir=str(tmp_path / "ssd"))
    data = open_data(cfg.data, cfg.model.seq_len, 11, cfg.model.vocab_size)
    torch.manual_seed(3)
    with Pipeline(
        layers,
        lm_loss,
        plan=plan_for_config(cfg),
        optimizer=partial(CPUAdam, lr=0.01),
        memory=memory,
        activations=spec,
        accumulation_steps=2,
    ) as pipe:
        swaps = sum(a.kind in (Kind.SWAP_OUT, Kind.SWAP_IN) for a in pipe.engine.schedule)
        results = [pipe.train_batch(*data.batch(s, 16)) for s in range(3)]
        return [r.loss for r in results], pipe.state_dict(), max(r.device_peak_bytes for r in results), swaps


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_tier_gives_the_same_bits_and_the_device_holds_less(tmp_path, precision):
    losses, weights, peak, swaps = _run(precision, "device", tmp_path)
    assert swaps == 0
    for tier in ("host", "ssd"):
        got_losses, got_weights, got_peak, got_swaps = _run(precision, tier, tmp_path / tier)
        assert got_swaps == 2 * 3 * 4  # SO and SI of 4 microbatches for each of the 3 stages but the last
        assert got_losses == losses
        assert all(torch.equal(got_weights[k], weights[k]) for k in weights)
        assert got_peak < peak, tier  # the saved inputs left the device between F and B


SELECTIVE = {
    "selective0": {0: ("selective", [0]), 1: "keep", 2: "recompute"},
    "selective1": {0: ("selective", [1]), 1: "keep", 2: "recompute"},
}
"""Stage 0 is the embedding (layer 0) and a block (1); stage 1 the dropout block; stage 2 a block. selective0
keeps the embedding's graph and recomputes the block from its (float) input; selective1 recomputes the
embedding from the token ids and keeps the block's graph, which starts from a float input."""


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("spec", ["keep", "selective0", "selective1"])
def test_kept_graphs_swap_to_every_tier_bit_for_bit(tmp_path, precision, spec):
    activations, per_stage = ("keep", None) if spec == "keep" else ("recompute", SELECTIVE[spec])
    losses, weights, peak, _ = _run(precision, "device", tmp_path, activations, per_stage)
    for tier in ("host", "ssd"):
        got_losses, got_weights, got_peak, swaps = _run(precision, tier, tmp_path / tier, activations, per_stage)
        assert swaps == 2 * 3 * 4
        assert got_losses == losses, tier
        assert all(torch.equal(got_weights[k], weights[k]) for k in weights), tier
        assert got_peak < peak, tier  # the kept graphs left the device between SO and SI


def test_the_peer_tier_needs_another_rank(tmp_path):
    with pytest.raises(PipelineError, match="activation_tier peer parks activations in another rank's gpu, but this"):
        _run("fp32", "peer", tmp_path)


def test_the_last_stage_cannot_swap(tmp_path):
    cfg = _cfg("fp32")
    from mobiuspipe.startup.swaps import swap_tiers

    plan = plan_for_config(cfg)
    plan = plan.__class__(
        **{
            **plan.__dict__,
            "stages": tuple(
                s if j < 3 else s.__class__(**{**s.__dict__, "activation_tier": "host"})
                for j, s in enumerate(plan.stages)
            ),
        }
    )
    with pytest.raises(PipelineError, match="stage 3 is the last: its forward runs inside its backward"):
        swap_tiers(plan, MemoryConfig(activation_tier="plan"), {})


def test_the_plan_a_run_keeps_is_the_policy_it_runs():
    from mobiuspipe.runtime.activations import stage_modes
    from mobiuspipe.startup.swaps import plan_as_run
    from partition.rules.device_peak import planned_device_bytes

    plan = plan_for_config(_cfg("fp32"))  # memory to spare: the planner keeps every stage's activations
    assert [s.activations for s in plan.stages] == ["keep"] * 4
    run = plan_as_run(plan, stage_modes("recompute", plan), {0: "host", 1: "host", 2: "host"})
    assert [(s.activations, s.activation_tier) for s in run.stages[:-1]] == [("recompute", "host")] * 3
    assert run.stages[1].held_bytes == plan.stages[0].output_bytes and run.stages[-1] == plan.stages[-1]
    # times: the keep's forward ran with grad, its graphs kept (K_j); forced to recompute, F runs without grad
    # and B redoes it with grad (R_j); forced back to keep, F is K_j again
    assert all(s.forward_s == s.kept_s and s.recompute_s == 0.0 for s in plan.stages[:-1])
    assert [(s.forward_s, s.recompute_s) for s in run.stages[:-1]] == [(s.fwd_s, s.grad_s) for s in plan.stages[:-1]]
    again = plan_as_run(run, stage_modes("keep", run), {})
    assert [(s.forward_s, s.recompute_s) for s in again.stages[:-1]] == [(s.kept_s, 0.0) for s in plan.stages[:-1]]
    assert planned_device_bytes(run, standin=True) < planned_device_bytes(plan, standin=True)
    assert plan_as_run(plan, stage_modes("plan", plan), {}) == plan


def test_a_recompute_stages_input_on_the_device_tier_is_held_there_on_a_gpu_too():
    """compute.fwd keeps a recompute stage's input on the device (its saved input, for B to recompute from) on both
    paths since the first GPU run; the walk of a gpu's run held 0 for it, as if the engine still copied it to the
    host: on an H200 gpu_check's fp32 run kept 96 MiB of inputs the plan left out (peak 554 of 527 MiB planned).
    plan_as_run now takes no device: the walk is the same on a gpu and on the stand-in."""
    from mobiuspipe.runtime.activations import stage_modes
    from mobiuspipe.startup.swaps import plan_as_run

    plan = plan_for_config(_cfg("fp32"))
    inputs = [plan.input_bytes] + [s.output_bytes for s in plan.stages[:-2]]
    run = plan_as_run(plan, stage_modes("recompute", plan), {})
    assert [(s.activation_tier, s.held_bytes) for s in run.stages[:-1]] == [("device", b) for b in inputs]
