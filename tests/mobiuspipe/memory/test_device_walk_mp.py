"""Two ranks under torchrun (gloo on CPU): each rank's measured device peak is at most the plan's lifetime walk
for the CPU stand-in and within 10% of it, fp32 and bf16, with a plan made from a measured profile (its bytes; the
analytic times, so that the plan is the same whatever the machine's load)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from mobiuspipe.config import MemoryConfig, load_config
from mobiuspipe.data.dataset import open_data
from mobiuspipe.models.gpt import layer_factories, lm_loss
from mobiuspipe.profiling.profiler import measure_profile
from mobiuspipe.runtime.activations import stage_modes
from mobiuspipe.startup.config_plan import model_spec
from mobiuspipe.startup.swaps import plan_as_run, swap_tiers
from partition import make_plan
from partition.plan import save_plan
from partition.rules.activations import ActivationPolicy, policy_cost
from partition.rules.costmodel import LayerArrays
from partition.rules.device_peak import planned_device_bytes
from partition.spec.analytic import analytic_profile
from partition.spec.hardware import device_spec
from topology import cpu_standin

pytestmark = pytest.mark.slow


def _measured_plan(cfg, precision: str, keep_first: bool = False):
    """A 4-stage cross-mapped plan for 2 stand-ins from the model's profile measured on one microbatch; keep_first:
    stage 0 selective, keeping its first layer (the embedding), the other stages but the last recompute."""
    batch, m = cfg.data.batch_size, cfg.data.num_microbatches
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    layers = [make().to(dtype) for make in layer_factories(model_spec(cfg), cfg.train.seed)]
    x, y = open_data(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size).batch(0, batch)
    xm, ym = x[: batch // m], y[: batch // m].clone()  # the targets in storage of their own, as a run holds them
    profile = measure_profile(
        layers,
        xm,
        device=torch.device("cpu"),
        name=model_spec(cfg).name,
        device_name="cpu-standin",
        dtype_name=precision,
        microbatch_size=batch // m,
        seq_len=xm.shape[1],
        loss_fn=lambda out: lm_loss(out.float(), ym),
    )
    profile = dataclasses.replace(profile, target_bytes=ym.numel() * ym.element_size(), layers=_timed(profile, cfg))
    plan = make_plan(profile, cpu_standin(2, 256 << 20), m, num_stages=4, mapping="cross", solver="dp")
    return _keeping_first(plan, profile) if keep_first else plan


def _keeping_first(plan, profile):
    """The plan with stage 0 selective keeping its first layer and the middle stages recomputing, each with the
    figures the activation rules give it (partition.rules.activations), on the device."""
    arr, stages = LayerArrays.of(profile), list(plan.stages)
    for j, keep in ((0, (stages[0].first,)), *((j, None) for j in range(1, len(stages) - 1))):
        s = stages[j]
        policy = ActivationPolicy("selective", keep) if keep else ActivationPolicy("recompute")
        c = policy_cost(arr, s.first, s.last, plan.num_microbatches, policy, None, plan.input_bytes)
        stages[j] = dataclasses.replace(
            s,
            activations=policy.mode,
            kept_layers=policy.keep_layers,
            activation_tier="device",
            held_bytes=c.held_bytes,
            work_bytes=c.work_bytes,
            recompute_s=c.recompute_s,
            forward_s=c.forward_s,
        )
    return dataclasses.replace(plan, stages=tuple(stages))


def _timed(profile, cfg) -> tuple:
    """The measured layers with the analytic profile's times: the plan's choices (which follow the times) are the
    same on every run, where measured times made them follow the machine's load (and one plan a loaded machine chose,
    a selective stage 0, recompute 1-2 and keep 3, walks 10.2% above its measured peak: issue 23's note)."""
    analytic = analytic_profile(
        model_spec(cfg), device_spec("cpu-standin"), microbatch_size=profile.microbatch_size, dtype=profile.dtype
    )
    times = ("fwd_s", "bwd_s", "recompute_s", "kept_s")
    return tuple(
        dataclasses.replace(got, **{k: getattr(want, k) for k in times})
        for got, want in zip(profile.layers, analytic.layers)
    )


SMALL = {"num_blocks": 3, "d_model": 24, "num_heads": 3, "seq_len": 17}


@pytest.mark.parametrize(
    "precision,model,batch,microbatches,memory",
    [
        ("fp32", SMALL, 6, 3, {}),
        ("fp32", SMALL, 6, 3, {"keep_first": True}),
        ("bf16", {"num_blocks": 5, "d_model": 40, "num_heads": 5, "seq_len": 23}, 10, 5, {}),
        ("fp32", SMALL, 6, 3, {"activations": "recompute", "activation_tier": "peer"}),
    ],
)
def test_each_rank_peak_is_under_the_walk_within_10_percent(
    tmp_path, launch, precision, model, batch, microbatches, memory
):
    """The plan's policies, every stage's input parked in the other rank's memory (the peer tier: each rank's walk
    holds the region it gives), and stage 0 selective keeping the embedding (it walked 10.2% over: issue 23)."""
    write_config, torchrun = launch
    memory = dict(memory)
    keep_first = memory.pop("keep_first", False)
    run = {
        "model": model,
        "data": {"batch_size": batch, "num_microbatches": microbatches},
        "train": {"steps": 3, "seed": 5, "precision": precision, "out_dir": str(tmp_path / "out")},
        "runtime": {"comm_timeout_s": 60},
        "memory": memory,
    }
    plan = _measured_plan(load_config(write_config(tmp_path, run)), precision, keep_first)
    assert plan.mapping == [0, 1, 0, 1]
    save_plan(plan, tmp_path / "plan.yaml")
    proc = torchrun(write_config(tmp_path, {**run, "plan": {"file": str(tmp_path / "plan.yaml")}}), 2, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    measured = [max(m["ranks"][g]["device_peak_bytes"] for m in metrics) for g in range(2)]
    cfg = MemoryConfig(**memory)
    modes = stage_modes(cfg.activations, plan)
    strict = os.environ.get("MOBIUSPIPE_STRICT", "0") != "0"  # sends complete once taken, as NCCL's
    walk = planned_device_bytes(
        plan_as_run(plan, modes, swap_tiers(plan, cfg, modes)), standin=True, sends_until_flush=not strict
    )
    policies = [(s.layers, s.activations, s.activation_tier) for s in plan.stages]
    why = f"measured {measured} vs walk {walk}; stages {policies}; {proc.stdout[-1500:]}"
    assert all(0.9 * w < b <= w for b, w in zip(measured, walk)), why
    assert "measured larger" not in proc.stdout  # the end-of-run line compares with the same walk
