"""V, the layers' buffers (a causal mask), which each stage's gpu keeps the whole run: profiled, held apart from the
memory every rule and walk is held to (at least the most any gpu's stages keep), recorded in the plan, and added to
both paths' planned figures (the stand-in's ledger holds them too)."""

import pytest
import torch
from torch import nn

from partition import make_plan
from partition.errors import PlanFileError
from partition.plan import Plan, load_plan, save_plan
from partition.rules.device_peak import planned_device_bytes
from partition.spec.profile import LayerProfile, Profile, load_profile, save_profile
from topology import cpu_standin


def _profile(buffers: tuple[int, ...] = (0, 0, 0, 0)) -> Profile:
    def layer(name, n, out, act, v):
        return LayerProfile(name, n, 4 * n, act, out, 0.0, 0.0, 1e-3, 2e-3, buffer_bytes=v)

    ls = tuple(layer(f"l{i}", 40 - 3 * i, 16, 64, v) for i, v in enumerate(buffers))
    return Profile("mlp", "cpu-standin", "fp32", 2, 1, ls, input_bytes=32, target_bytes=24)


def _plan(profile: Profile, gpus: int = 1, memory: int = 1 << 20, stages: int = 4) -> Plan:
    topo = cpu_standin(gpus, memory)
    return make_plan(profile, topo, 3, num_stages=stages, solver="dp", activations="recompute")


def test_one_gpu_holds_every_buffer_apart_and_both_figures_add_them():
    base, kept = _plan(_profile()), _plan(_profile((0, 100, 7, 300)))
    assert [s.buffer_bytes for s in kept.stages] == [0, 100, 7, 300]
    assert (base.buffer_bytes, kept.buffer_bytes) == (0, 407)
    assert kept.gpu_memory_bytes == base.gpu_memory_bytes - 407
    assert kept.gpu_share_bytes == base.gpu_share_bytes
    for standin in (False, True):  # the stand-in's ledger holds the buffers too
        assert planned_device_bytes(kept, standin) == [b + 407 for b in planned_device_bytes(base, standin)]


def test_two_gpus_hold_apart_the_most_either_keeps():
    """An even share first (250 of 500); the plan's gpu 0 keeps stages 0 and 2 (460), so the plan is made again with
    460 held apart, which its gpus' shares then fit."""
    plan = _plan(_profile((400, 0, 60, 40)), gpus=2)
    assert plan.mapping == [0, 1, 0, 1]
    assert [plan.buffers_on(g) for g in (0, 1)] == [460, 40]
    assert plan.buffer_bytes == 460
    base = _plan(_profile(), gpus=2)
    assert plan.gpu_memory_bytes == base.gpu_memory_bytes - 460
    assert planned_device_bytes(plan) == [b + v for b, v in zip(planned_device_bytes(base), (460, 40))]


def test_an_even_share_that_fits_is_kept():
    plan = _plan(_profile((30, 30, 30, 30)), gpus=2)
    assert [plan.buffers_on(g) for g in (0, 1)] == [60, 60] and plan.buffer_bytes == 60


def test_the_memory_rule_holds_the_buffers_apart():
    plan = _plan(_profile(), stages=4)
    need = plan.arena_bytes + max(s.activation_bytes for s in plan.stages)  # the rule: S W + A_j <= G
    assert _plan(_profile((0, 0, 0, 10)), memory=need + 10).buffer_bytes == 10
    with pytest.raises(Exception, match=r"net of .*the layers' buffers \(a causal mask\) a gpu keeps"):
        _plan(_profile((0, 0, 5, 6)), memory=need + 10)


def test_files_keep_the_buffers_and_older_files_read_as_zero(tmp_path):
    profile = _profile((5, 0, 9, 0))
    save_profile(profile, tmp_path / "p.yaml")
    assert load_profile(tmp_path / "p.yaml") == profile
    plan = _plan(profile)
    save_plan(plan, tmp_path / "plan.yaml")
    assert load_plan(tmp_path / "plan.yaml") == plan
    d = plan.to_dict()
    for stage in d["stages"]:
        del stage["buffer_bytes"]  # a plan written before plans had V
    del d["buffer_bytes"]
    assert Plan.from_dict(d).buffers_on(0) == 0
    old = _profile()
    d = old.to_dict()
    for layer in d["layers"]:
        del layer["buffer_bytes"]
    assert Profile.from_dict(d) == old


def test_a_plan_holding_apart_less_than_a_gpu_keeps_is_refused():
    d = _plan(_profile((5, 0, 9, 0))).to_dict()
    d["buffer_bytes"] = 13
    with pytest.raises(PlanFileError, match=r"buffer_bytes.*at least the most buffers one gpu's stages keep \(14"):
        Plan.from_dict(d)


def test_negative_buffers_are_refused():
    with pytest.raises(Exception, match="buffer_bytes"):
        _profile((0, -1, 0, 0))


class _Masked(nn.Module):
    """A linear layer with a causal-mask-like bool buffer and a float table, fp32 whatever the layer's dtype (the stage
    casts floating buffers to the training dtype)."""

    table: torch.Tensor

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.fc = nn.Linear(8, 8, dtype=dtype)
        self.register_buffer("mask", torch.ones(16, 16, dtype=torch.bool))
        self.register_buffer("table", torch.zeros(3, 8))
        self.register_buffer("alias", self.table)  # the same tensor under a second name: kept once

    def forward(self, x):
        return self.fc(x) + self.table[0].to(x.dtype)


@pytest.mark.parametrize(("dtype_name", "width"), [("fp32", 4), ("bf16", 2)])
def test_the_profiler_measures_the_buffers_as_a_stage_keeps_them(dtype_name, width):
    from mobiuspipe.profiling.profiler import measure_layers

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    layers = [_Masked(dtype), nn.Linear(8, 8, dtype=dtype)]
    m = measure_layers(
        layers,
        torch.randn(2, 8, dtype=dtype),
        device="cpu",
        name="masked",
        device_name="cpu",
        dtype_name=dtype_name,
        microbatch_size=2,
        seq_len=1,
        min_repeats=1,
        max_repeats=1,
        warmup=0,
    )
    assert [x.buffer_bytes for x in m.profile.layers] == [16 * 16 + 3 * 8 * width, 0]
