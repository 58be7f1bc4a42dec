"""The baselines a user would pick instead of mobiuspipe, on timelines worked out by hand, and the paper's case."""

import re

import pytest

from foundation.units import GiB
from partition.report.baselines import (
    BaselineResult,
    gpipe,
    gpipe_stage_bytes,
    predict,
    sequential_mapping,
    zero_gpu_bytes,
    zero_offload,
)
from partition.rules.costmodel import LayerArrays
from partition.search import HOST_ADAM_PARAMS_PER_S, make_plan
from partition.spec.analytic import analytic_profile
from partition.spec.hardware import device_spec
from partition.spec.lookup import get_model
from partition.spec.profile import LayerProfile, Profile
from topology import cpu_standin, preset
from topology.types import Gpu, RootComplex, Topology


def _profile(*layers):
    """layers: (param_count, activation_bytes, output_bytes, fwd_s, bwd_s); fp16, so 2 bytes per parameter."""
    return Profile(
        "hand",
        "dev",
        "fp16",
        1,
        1,
        tuple(LayerProfile(f"l{i}", n, 2 * n, a, o, 0.0, 0.0, f, b) for i, (n, a, o, f, b) in enumerate(layers)),
    )


def _box(groups, memory=32 * GiB, gbps=16.0):
    """One root complex per group of gpus, every link and uplink `gbps`."""
    gpus, rcs = [], []
    for r, count in enumerate(groups):
        rcs.append(RootComplex(f"rc{r}", r, gbps))
        for _ in range(count):
            i = len(gpus)
            gpus.append(
                Gpu(
                    index=i,
                    name="t",
                    memory_bytes=memory,
                    pci_bus_id=f"0000:{i:02x}:00.0",
                    root_complex=f"rc{r}",
                    numa_node=r,
                    link_gbps=gbps,
                )
            )
    return Topology(name="box", gpus=tuple(gpus), root_complexes=tuple(rcs), source="test")


# ---- GPipe ----


def test_gpipe_step_is_the_pipeline_formula():
    # 4 layers of F 1, B 2 on 2 gpus: stages of 2 layers, F_j = 2, a backward visit F_j + B_j = 6 per microbatch.
    # M = 2: (M + N - 1) * F_j + (M + N - 1) * (F_j + B_j) = 3 * 2 + 3 * 6 = 24 (nothing moves: no output bytes).
    prof = _profile(*[(10, 0, 0, 1.0, 2.0)] * 4)
    res = gpipe(prof, cpu_standin(2, 2**20), 2)
    assert res.step_time_s == 24.0 and res.reason == ""
    assert "stages [(0, 1), (2, 3)]" in res.notes[0]


def test_gpipe_balances_compute_among_cuts_that_fit():
    prof = _profile((10, 0, 0, 1.0, 2.0), (10, 0, 0, 1.0, 2.0), (10, 0, 0, 1.0, 2.0), (10, 0, 0, 3.0, 6.0))
    assert "stages [(0, 2), (3, 3)]" in gpipe(prof, cpu_standin(2, 2**20), 1).notes[0]
    # memory for 3 layers of 16 B/param (480 B) is not there: the cut has to be 2 + 2
    tight = gpipe(prof, cpu_standin(2, 16 * 20 + 100), 1)
    assert "stages [(0, 1), (2, 3)]" in tight.notes[0]


def test_gpipe_stage_memory():
    # 16 B/param x 20 params + 4 microbatches' stashed input (O_0 = 5) + one microbatch live (A_1 + A_2 + O_0 + O_2)
    arr = LayerArrays.of(_profile(*[(10, 3, 5, 1.0, 1.0)] * 4))
    assert gpipe_stage_bytes(arr, 1, 2, 4) == 16 * 20 + 4 * 5 + (3 + 3 + 5 + 5)
    assert gpipe_stage_bytes(arr, 0, 0, 4) == 16 * 10 + 0 + (3 + 5)


def test_gpipe_out_of_memory_says_how_much():
    prof = _profile(*[(10, 3, 5, 1.0, 1.0)] * 4)
    need = gpipe_stage_bytes(LayerArrays.of(prof), 2, 3, 2)  # the fuller of the two equal halves
    res = gpipe(prof, cpu_standin(2, need - 1), 2)
    assert res.step_time_s is None and res.reason.startswith("out of memory")
    assert gpipe(prof, cpu_standin(2, need), 2).step_time_s is not None


@pytest.fixture(scope="module")
def gpt3_175b():
    return analytic_profile(get_model("gpt3-175b"), device_spec("NVIDIA GeForce RTX 3090 Ti"))


def test_gpipe_175b_does_not_fit_on_2_plus_2(gpt3_175b):
    res = gpipe(gpt3_175b, preset("2+2"), 4, reserve_bytes=GiB)
    assert res.step_time_s is None
    m = re.search(r"needs ([\d.]+) GiB", res.reason)
    assert m is not None, res.reason
    need = float(m.group(1))
    assert need > 16 * 174e9 / 4 / GiB  # a quarter of the model states at least
    assert "23.0 GiB usable" in res.reason and "16 B/param" in res.reason


# ---- ZeRO-3 offload ----


def test_zero_offload_one_gpu_by_hand():
    # Two layers of 4e9 parameters (8 GB fp16), F 1, B 1; one gpu on a 16 GB/s link: a fetch takes 0.5 s.
    # gather F0 [0, .5], F1 [.5, 1] (one layer ahead); compute F0 [.5, 1.5], F1 [1.5, 2.5]; B1 uses the resident
    # layer: [2.5, 4.5]; its gradients 8 GB to host [4.5, 5]; gather B0 waits for F0 to free its buffer: [1.5, 2];
    # B0 [4.5, 6.5]; gradients [6.5, 7]; then Adam over 8e9 parameters.
    prof = _profile((4_000_000_000, 0, 0, 1.0, 1.0), (4_000_000_000, 0, 0, 1.0, 1.0))
    res = zero_offload(prof, _box([1]), 1)
    assert res.step_time_s == 7.0 + 8e9 / HOST_ADAM_PARAMS_PER_S
    assert "last backward 6.50 s, last gradients on host 7.00 s" in res.notes[1]


@pytest.mark.parametrize("groups,before_adam", [([2], 5.0), ([1, 1], 4.0)])
def test_zero_offload_gpus_share_their_uplink(groups, before_adam):
    # One layer of 4e9 parameters, 2 gpus, 2 microbatches (one each). Gather: each gpu receives 8 GB and sends
    # 4 GB. Under one 16 GB/s uplink both receive at 8 GB/s: [0, 1]; F [1, 2]; B (resident) [2, 4]; reduce-scatter:
    # 8 GB up, 4 GB down each: [4, 5]. On two root complexes every flow runs at 16: gather [0, .5], F [.5, 1.5],
    # B [1.5, 3.5], reduce [3.5, 4]. Then each rank's Adam over its half of the 4e9 parameters, the ranks at once.
    prof = _profile((4_000_000_000, 0, 0, 1.0, 1.0))
    res = zero_offload(prof, _box(groups), 2)
    assert res.step_time_s == before_adam + 4e9 / 2 / HOST_ADAM_PARAMS_PER_S


def test_zero_offload_memory_accumulates_gradients_when_a_big_microstep_does_not_fit():
    prof = _profile(*[(10**9, 3 * 10**9, 10**9, 0.01, 0.01)] * 3)  # 2 GB of parameters per layer, fast compute
    arr = LayerArrays.of(prof)
    assert zero_gpu_bytes(arr, 2) == 3 * 2 * 10**9 + 2 * 3 * 10**9 + 2 * (3 + 1 + 1) * 10**9
    one, two = zero_gpu_bytes(arr, 1), zero_gpu_bytes(arr, 2)
    big = zero_offload(prof, _box([2], memory=two), 4)
    small = zero_offload(prof, _box([2], memory=one), 4)
    assert "1 micro-step(s) of 2" in big.notes[0] and "2 micro-step(s) of 1" in small.notes[0]
    assert small.step_time_s is not None and big.step_time_s is not None
    assert small.step_time_s > big.step_time_s  # each micro-step fetches every layer again, and fetches dominate
    oom = zero_offload(prof, _box([2], memory=one - 1), 4)
    assert oom.step_time_s is None and "out of memory" in oom.reason


# ---- sequential mapping and the paper's case ----


def test_sequential_mapping_is_the_planner_with_round_robin():
    prof = analytic_profile(get_model("gpt3-125m"), device_spec("NVIDIA GeForce RTX 3090 Ti"))
    topo = preset("3+1")
    res = sequential_mapping(prof, topo, 2, num_stages=6, solver="dp")
    plan = make_plan(prof, topo, 2, num_stages=6, mapping="round-robin", solver="dp")
    assert plan.mapping == [0, 1, 2, 3, 0, 1]
    assert res.step_time_s == predict(plan, topo).step_time_s
    bad = sequential_mapping(prof, topo, 2, num_stages=1000)
    assert bad.step_time_s is None and "no plan" in bad.reason


def test_gpt3_175b_on_2_plus_2_mobiuspipe_vs_baselines(gpt3_175b):
    """The Mobius paper's server and model: print what the model predicts for each system (see the report)."""
    topo = preset("2+2")
    plan = make_plan(gpt3_175b, topo, 4, reserve_bytes=GiB)
    mine = predict(plan, topo).step_time_s
    seq = sequential_mapping(gpt3_175b, topo, 4, num_stages=plan.num_stages, reserve_bytes=GiB)
    zero = zero_offload(gpt3_175b, topo, 4, reserve_bytes=GiB)
    assert seq.step_time_s is not None and zero.step_time_s is not None, (seq.reason, zero.reason)
    print(
        f"\ngpt3-175b on 2+2, M=4: mobiuspipe {mine:.1f} s, sequential {seq.step_time_s:.1f} s, "
        f"ZeRO-3 offload {zero.step_time_s:.1f} s ({zero.step_time_s / mine:.2f}x), GPipe: "
        f"{gpipe(gpt3_175b, topo, 4, GiB).reason}"
    )
    assert isinstance(zero, BaselineResult) and zero.step_time_s > mine
    assert seq.step_time_s >= mine * (1 - 1e-3)
    adam = max(sum(s.param_count for s in plan.stages if s.gpu == g) for g in range(4)) / HOST_ADAM_PARAMS_PER_S
    assert mine > adam and zero.step_time_s > adam  # the busiest rank's host Adam bounds both from below
