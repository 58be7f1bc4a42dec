"""The start-up line: where each stage's optimizer states, weights and held activations went."""

from __future__ import annotations

from mobiuspipe.config.memory import MemoryConfig
from mobiuspipe.config.run import RunConfig
from mobiuspipe.run.banner import activations_line
from mobiuspipe.run.banner import states_line as _states_line


def test_every_tier_is_named_the_gpus_too():
    cfg = RunConfig(memory=MemoryConfig(optimizer="device"))
    tiers = {j: ("device", "device") for j in range(3)}
    assert _states_line(cfg, tiers) == (
        "optimizer states (device): device for stages 0-2; weights (host): device for stages 0-2"
    )
    tiers = {0: ("ssd", "ssd"), 1: ("host", "host"), 2: ("ssd", "host")}
    assert _states_line(RunConfig(memory=MemoryConfig(ssd_dir="/nvme/run")), tiers) == (
        "optimizer states (host): host for stage 1; ssd for stages 0, 2; weights (host): host for stages 1-2; "
        "ssd for stage 0 (under /nvme/run, 1024 MiB host budget per rank)"
    )


def test_the_activations_each_stage_holds_and_where():
    import dataclasses

    from partition.plan import Plan

    def stage(s, mode, tier, kept=()):
        return dataclasses.replace(s, activations=mode, activation_tier=tier, kept_layers=kept)

    plan = _a_plan()
    modes = [("keep", "device"), ("recompute", "host"), ("recompute", "host"), ("recompute", "auto")]
    modes += [("selective", "ssd", (4,)), ("recompute", "peer"), ("keep", "device")]
    stages = tuple(stage(s, *m) for s, m in zip(plan.stages, modes, strict=True))
    line = activations_line(dataclasses.replace(plan, stages=stages))
    assert isinstance(plan, Plan) and line == (
        "activations: keep on device for stages 0, 6; recompute, inputs on host for stages 1-3; "
        "selective (layer 4 kept), on ssd for stage 4; recompute, inputs on a peer gpu for stage 5"
    )


def _a_plan():
    """A plan of 7 stages of a small GPT on one CPU stand-in (the exact DP: quick)."""
    from partition.search import make_plan
    from partition.spec.analytic import analytic_profile
    from partition.spec.hardware import device_spec
    from partition.spec.models import ModelSpec
    from topology import cpu_standin

    spec = ModelSpec("tiny", num_blocks=5, d_model=32, num_heads=2, seq_len=16, vocab_size=64)
    profile = analytic_profile(spec, device_spec("cpu-standin"))
    return make_plan(profile, cpu_standin(1, 1 << 30), 2, num_stages=7, solver="dp")
