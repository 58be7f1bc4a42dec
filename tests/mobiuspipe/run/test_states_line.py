"""The start-up line that says where each stage's optimizer states and weights went."""

from __future__ import annotations

from mobiuspipe.config.memory import MemoryConfig
from mobiuspipe.config.run import RunConfig
from mobiuspipe.run.train import _states_line


def test_every_tier_is_named_the_gpus_too():
    cfg = RunConfig(memory=MemoryConfig(optimizer="device"))
    tiers = {j: ("device", "device") for j in range(3)}
    assert _states_line(cfg, tiers) == (
        "optimizer states (device): device for stages 0, 1, 2; weights (host): device for stages 0, 1, 2"
    )
    tiers = {0: ("ssd", "ssd"), 1: ("host", "host"), 2: ("ssd", "host")}
    assert _states_line(RunConfig(memory=MemoryConfig(ssd_dir="/nvme/run")), tiers) == (
        "optimizer states (host): host for stage 1; ssd for stages 0, 2; weights (host): host for stages 1, 2; "
        "ssd for stage 0 (under /nvme/run, 1024 MiB host budget per rank)"
    )
