"""The memory tiers of a plan against byte totals worked out by hand, and the placement rule on odd sizes."""

import dataclasses

import pytest

from foundation.units import GiB
from partition.errors import PlanInfeasibleError
from partition.plan import Plan, SolverInfo, StagePlan
from partition.simulate import SsdLink
from partition.tiers import (
    SSD_READ_GBPS,
    SSD_WRITE_GBPS,
    STREAM_BYTES,
    HostBudget,
    host_budget,
    place_tiers,
    ssd_info,
)
from topology import preset
from topology.types import Measured

# Three stages on two gpus, odd parameter counts (about 1, 3 and 2 billion), fp16 (2 bytes each).
N = (1_000_000_007, 3_000_000_001, 1_999_999_999)
ACT = (100, 300, 200)
OUT = (11, 13, 17)
M = 4


def _plan(dtype: str = "fp16", counts=N) -> Plan:
    e = {"fp16": 2, "fp32": 4}[dtype]
    stages = tuple(
        StagePlan(
            first=j,
            last=j,
            gpu=(0, 1, 0)[j],
            param_count=n,
            param_bytes=e * n,
            activation_bytes=ACT[j],
            output_bytes=OUT[j],
            fwd_s=1.0,
            bwd_s=1.0,
            load_gbps=10.0,
        )
        for j, n in enumerate(counts)
    )
    slot = max(s.param_bytes for s in stages)
    return Plan(
        model="toy",
        topology="toy",
        num_layers=3,
        num_gpus=2,
        num_microbatches=M,
        microbatch_size=1,
        dtype=dtype,
        mapping_rule="cross",
        mapping_score=0.0,
        stages=stages,
        slot_bytes=slot,
        arena_bytes=3 * slot,
        activation_bytes=max(ACT),
        gpu_memory_bytes=10**12,
        predicted_step_time_s=1.0,
        solver=SolverInfo("dp", "optimal", 0.0, 0.0),
    )


UNLIMITED = HostBudget(None, "unlimited")
SAVED = M * (OUT[0] + OUT[1])  # stage 0 saves no input; stages 1 and 2 save their input per microbatch
ALL = sum(N)


def test_unlimited_keeps_everything_in_memory_and_counts_every_kind():
    mem = place_tiers(_plan(), UNLIMITED)
    assert mem.host_by_kind == {
        "weights": 2 * ALL,
        "optimizer": 12 * ALL,
        "gradients": 2 * ALL,
        "saved_inputs": SAVED,
        "streaming": 0,
    }
    assert mem.host_bytes == 16 * ALL + SAVED
    assert mem.ssd_bytes == 0 and mem.ssd_read_bytes == 0 and mem.ssd_write_bytes == 0
    slot = 2 * N[1]
    assert mem.device_bytes == (3 * slot + max(ACT[0], ACT[2])) + (3 * slot + ACT[1])
    assert [s.device_bytes for s in mem.stages] == [2 * 2 * n + a for n, a in zip(N, ACT)]
    assert [s.host_bytes for s in mem.stages] == [16 * N[0], 16 * N[1] + M * OUT[0], 16 * N[2] + M * OUT[1]]
    assert {k: mem.tier(k) for k in ("weights", "optimizer", "gradients")} == dict.fromkeys(
        ("weights", "optimizer", "gradients"), "host"
    )


def test_a_budget_that_fits_exactly_moves_nothing():
    exact = 16 * ALL + SAVED
    assert place_tiers(_plan(), HostBudget(exact, "given")).ssd_bytes == 0
    assert place_tiers(_plan(), HostBudget(exact - 1, "given")).ssd_bytes > 0


def test_the_largest_stage_moves_first_then_the_next():
    # One byte short: the largest stage (1, 3e9+1 parameters) moves its optimizer states, and the
    # streaming slots (1 GiB per gpu) come in.
    mem = place_tiers(_plan(), HostBudget(16 * ALL + SAVED - 1, "given"))
    assert [s.optimizer for s in mem.stages] == ["host", "ssd", "host"]
    assert [s.gradients for s in mem.stages] == ["host"] * 3
    assert mem.ssd_by_kind == {"optimizer": 12 * N[1], "gradients": 0}
    assert mem.host_bytes == 16 * ALL + SAVED - 12 * N[1] + 2 * STREAM_BYTES
    assert mem.stages[1].ssd_read_bytes == mem.stages[1].ssd_write_bytes == 12 * N[1]
    assert mem.tier("optimizer") == "host+ssd" and mem.on_ssd("optimizer") == 1
    # Just below what one move leaves: stage 2 (2e9-1) goes next, then stage 0.
    two = place_tiers(_plan(), HostBudget(mem.host_bytes - 1, "given"))
    assert [s.optimizer for s in two.stages] == ["host", "ssd", "ssd"]
    three = place_tiers(_plan(), HostBudget(two.host_bytes - 1, "given"))
    assert [s.optimizer for s in three.stages] == ["ssd"] * 3 and three.tier("optimizer") == "ssd"
    assert [s.gradients for s in three.stages] == ["host"] * 3


def test_gradients_follow_the_optimizer_states_largest_first():
    states_out = 4 * ALL + SAVED + 2 * STREAM_BYTES  # weights + gradients + saved inputs + streaming
    assert place_tiers(_plan(), HostBudget(states_out, "given")).tier("gradients") == "host"
    mem = place_tiers(_plan(), HostBudget(states_out - 1, "given"))
    assert [s.gradients for s in mem.stages] == ["host", "ssd", "host"]
    assert mem.host_bytes == states_out - 2 * N[1]
    assert mem.ssd_bytes == 12 * ALL + 2 * N[1]
    assert mem.stages[1].ssd_read_bytes == mem.stages[1].ssd_write_bytes == 14 * N[1]
    assert mem.ssd_read_bytes == 12 * ALL + 2 * N[1]
    assert mem.to_dict()["tiers"] == {"weights": "host", "optimizer": "ssd", "gradients": "host+ssd"}


def test_weights_alone_over_the_budget_is_infeasible_with_the_numbers():
    floor = 2 * ALL + SAVED + 2 * STREAM_BYTES  # weights, saved inputs, streaming: never on the SSD
    assert place_tiers(_plan(), HostBudget(floor, "given")).tier("gradients") == "ssd"
    with pytest.raises(PlanInfeasibleError) as e:
        place_tiers(_plan(), HostBudget(floor - 1, "--host-memory-gb"))
    msg = str(e.value)
    assert "needs 13.2 GiB of host memory" in msg and "is 13.2 GiB" in msg  # 12e9 B + 2 GiB = 13.18 GiB
    assert "--host-memory-gb 14" in msg and "weights 11.2 GiB" in msg


def test_fp32_weights_are_the_master_while_the_states_are_in_memory():
    mem = place_tiers(_plan("fp32"), UNLIMITED)
    assert mem.host_by_kind["weights"] == 0 and mem.host_bytes == 16 * ALL + SAVED  # 12 + 4 gradients
    moved = place_tiers(_plan("fp32"), HostBudget(mem.host_bytes - 1, "given"))
    assert moved.host_by_kind["weights"] == 4 * N[1]  # stage 1's states left: it needs its own fp32 copy
    assert moved.host_bytes == 16 * ALL + SAVED - 12 * N[1] + 4 * N[1] + 2 * STREAM_BYTES


def test_host_budget_sources():
    topo = preset("2+2")
    assert host_budget(topo) == HostBudget(None, "unlimited: topology 2+2 does not record its host memory")
    assert host_budget(topo, 512 * GiB) == HostBudget(512 * GiB, "--host-memory-gb")
    known = dataclasses.replace(topo, host_memory_bytes=256 * GiB)
    assert host_budget(known) == HostBudget(256 * GiB, "host memory of topology 2+2")
    assert host_budget(known, GiB).bytes == GiB


def test_ssd_bandwidth_measured_or_default_with_a_note():
    topo = preset("2+2")
    info = ssd_info(topo)
    assert info.link == SsdLink(SSD_READ_GBPS, SSD_WRITE_GBPS) and not info.measured
    assert "unprobed" in info.note and "topology --probe --ssd-dir" in info.note
    probed = dataclasses.replace(topo, measured=Measured(ssd_dir="/nvme", ssd_read_gbps=6.5, ssd_write_gbps=5.25))
    info = ssd_info(probed)
    assert info.link == SsdLink(6.5, 5.25) and info.measured and "/nvme" in info.note
    half = dataclasses.replace(topo, measured=Measured(ssd_read_gbps=6.5))
    assert ssd_info(half).link == SsdLink(6.5, SSD_WRITE_GBPS) and not ssd_info(half).measured
