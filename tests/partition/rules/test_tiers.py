"""The memory tiers of a plan against byte totals worked out by hand: the server budget split per gpu, the saved
inputs first, then the runtime's placement rule (partition.rules.placement) on each gpu's stages, at odd sizes."""

import dataclasses

import pytest

from foundation.units import GiB
from partition.errors import PlanInfeasibleError
from partition.plan import Plan, SolverInfo, StagePlan
from partition.rules.placement import LEAST_SHARE_BYTES
from partition.rules.tiers import (
    SSD_READ_GBPS,
    SSD_WRITE_GBPS,
    HostBudget,
    host_budget,
    loads_per_step,
    place_tiers,
    ssd_info,
)
from partition.sim.simulate import SimStage, SsdLink, simulate
from topology import preset
from topology.types import Measured

# Three stages on two gpus (0, 1, 0), odd parameter counts (about 1, 3 and 2 billion), fp16 (2 bytes each).
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
N0, N1, N2 = N
ALL = sum(N)  # 6,000,000,007
SAVED0, SAVED1 = M * OUT[1], M * OUT[0]  # gpu 0 keeps stage 2's input (52), gpu 1 stage 1's (44)


def _split(per_gpu: int) -> HostBudget:
    """A server budget whose even split gives each of the 2 gpus `per_gpu` bytes."""
    return HostBudget(2 * per_gpu, "given")


def _tiers(mem, kind):
    return [getattr(s, kind) for s in mem.stages]


def test_loads_per_step_follow_the_visit_order():
    # gpu 0 visits F0 F2 B2 B0: stage 2 stays resident into its backward; gpu 1 visits F1 B1
    assert loads_per_step([0, 1, 0]) == [2, 1, 1]
    assert loads_per_step([0, 1, 0, 1]) == [2, 2, 1, 1]
    st = [SimStage(gpu=g, fwd_s=1, bwd_s=1, load_s=0.5, offload_s=0.5, update_s=1, comm_s=0) for g in (0, 1, 0, 1)]
    events = simulate(st, 2, 2).events
    assert [sum(e[0] == "load" and e[2] == j for e in events) for j in range(4)] == [2, 2, 1, 1]


def test_unlimited_keeps_everything_in_memory_and_counts_every_kind():
    mem = place_tiers(_plan(), UNLIMITED)
    assert mem.host_by_kind == {
        "optimizer": 12 * ALL,
        "weights": 4 * ALL,  # fp16 weights and gradients, 2 + 2 bytes
        "frozen": 0,
        "saved_inputs": SAVED0 + SAVED1,
        "streaming": 0,
    }
    assert mem.host_bytes == 16 * ALL + 96
    assert mem.ssd_bytes == 0 and mem.ssd_read_bytes == 0 and mem.ssd_write_bytes == 0
    slot = 2 * N[1]
    assert mem.device_bytes == (3 * slot + max(ACT[0], ACT[2])) + (3 * slot + ACT[1])
    assert [s.device_bytes for s in mem.stages] == [2 * 2 * n + a for n, a in zip(N, ACT)]
    assert [s.host_bytes for s in mem.stages] == [16 * N0, 16 * N1 + M * OUT[0], 16 * N2 + M * OUT[1]]
    assert [s.loads for s in mem.stages] == [2, 1, 1] and [s.gpu for s in mem.stages] == [0, 1, 0]
    assert mem.to_dict()["tiers"] == {"optimizer": "host", "weights": "host"}
    assert [g.share_bytes for g in mem.gpus] == [None, None]


def test_a_share_that_fits_exactly_moves_nothing():
    need0 = 16 * (N0 + N2) + SAVED0  # 48,000,000,148: gpu 0 needs more than gpu 1 (48,000,000,060)
    assert place_tiers(_plan(), _split(need0)).ssd_bytes == 0
    # an odd server budget splits down: each gpu gets need0 - 1
    mem = place_tiers(_plan(), HostBudget(2 * need0 - 1, "given"))
    assert [g.share_bytes for g in mem.gpus] == [need0 - 1] * 2
    assert [g.state_budget_bytes for g in mem.gpus] == [need0 - 1 - SAVED0, need0 - 1 - SAVED1]
    # gpu 0's largest stage (2) moves its optimizer states; what stays (16 N0 + 4 N2) leaves it 12 N2 - 1 to
    # stream through (at least a quarter of the 16 (N0 + N2) - 1 bytes for states); gpu 1 still fits
    assert _tiers(mem, "optimizer") == ["host", "host", "ssd"] and _tiers(mem, "weights") == ["host"] * 3
    assert mem.gpus[0].placement.slot_bytes == 12 * N2 - 1 and mem.gpus[1].placement.slot_bytes == 0
    assert mem.host_by_kind == {
        "optimizer": 12 * (N0 + N1),
        "weights": 4 * ALL,
        "frozen": 0,
        "saved_inputs": 96,
        "streaming": 12 * N2 - 1,
    }
    assert mem.ssd_by_kind == {"optimizer": 12 * N2, "weights": 0, "frozen": 0}
    s2 = mem.stages[2]
    assert (s2.ssd_read_bytes, s2.ssd_write_bytes, s2.host_bytes) == (12 * N2, 12 * N2, 4 * N2 + SAVED0 + 12 * N2 - 1)
    assert mem.tier("optimizer") == "host+ssd" and mem.on_ssd("optimizer") == 1


def test_weights_follow_the_optimizer_states_largest_first():
    # gpu 0 has 15e9 bytes for states: both stages' optimizer states out leave (15e9 - 4 (N0 + N2)) / 2 =
    # 1,499,999,988 each, under a quarter of 15e9 over 2 (1,875,000,000): stage 2's weights move, and
    # (15e9 - 4 N0) / 2 = 5,499,999,986 each is enough. gpu 1 (15,000,000,008 for states): N1 on SSD with its
    # weights in memory leaves 3,000,000,004, under a quarter (3,750,000,002): everything of stage 1 moves.
    mem = place_tiers(_plan(), _split(15 * 10**9 + SAVED0))
    assert _tiers(mem, "optimizer") == ["ssd"] * 3 and _tiers(mem, "weights") == ["host", "ssd", "ssd"]
    assert [g.placement.slot_bytes for g in mem.gpus] == [5_499_999_986, 15 * 10**9 + SAVED0 - SAVED1]
    assert mem.to_dict()["tiers"] == {"optimizer": "ssd", "weights": "host+ssd"} and mem.on_ssd("weights") == 2
    assert mem.ssd_by_kind == {"optimizer": 12 * ALL, "weights": 4 * (N1 + N2), "frozen": 0}  # w + grad records
    # stage 0: the update's 12 N0 each way; stages 1 and 2 (one load each): + the load's 2 N, the gradients
    # written at the offload and read by the update, 2 N each, and the next weights written by the update, 2 N
    assert [(s.ssd_read_bytes, s.ssd_write_bytes) for s in mem.stages] == [
        (12 * N0, 12 * N0),
        (16 * N1, 16 * N1),
        (16 * N2, 16 * N2),
    ]
    assert [(s.load_read_bytes, s.offload_write_bytes, s.update_read_bytes) for s in mem.stages[1:]] == [
        (2 * N1, 2 * N1, 14 * N1),
        (2 * N2, 2 * N2, 14 * N2),
    ]


def test_everything_on_the_ssd_fills_each_share_with_streaming():
    # 5e9 for gpu 0's states: stage 0's weights move too; its two loads each read 2 N0
    mem = place_tiers(_plan(), _split(5 * 10**9 + SAVED0))
    assert _tiers(mem, "optimizer") == _tiers(mem, "weights") == ["ssd"] * 3
    assert mem.host_bytes == 2 * (5 * 10**9 + SAVED0)  # every byte of each share: saved inputs + streaming
    assert mem.host_by_kind == {
        "optimizer": 0,
        "weights": 0,
        "frozen": 0,
        "saved_inputs": 96,
        "streaming": mem.host_bytes - 96,
    }
    assert mem.stages[0].ssd_read_bytes == 12 * N0 + 2 * 2 * N0 + 2 * N0 and mem.ssd_write_bytes == 16 * ALL
    assert mem.ssd_read_bytes == 16 * ALL + 2 * N0


def test_a_share_below_the_saved_inputs_and_least_shares_is_infeasible_with_the_numbers():
    least = SAVED0 + 2 * LEAST_SHARE_BYTES  # gpu 0: its saved inputs and 64 KiB for each of its 2 stages
    mem = place_tiers(_plan(), _split(least))
    assert [g.placement.slot_bytes for g in mem.gpus] == [LEAST_SHARE_BYTES, least - SAVED1]
    with pytest.raises(PlanInfeasibleError) as e:
        place_tiers(_plan(), HostBudget(2 * least - 1, "--host-memory-gb"))
    msg = str(e.value)
    assert "gpu 0 needs 128.05 KiB of host memory even with every state on the SSD" in msg
    assert "saved stage inputs 52 B" in msg and "of its 2 stages 128.00 KiB" in msg
    assert "(--host-memory-gb: 256.10 KiB over 2 gpus) is 128.05 KiB" in msg and "--host-memory-gb 1)" in msg


def test_fp32_weights_are_the_master_while_the_states_are_in_memory():
    mem = place_tiers(_plan("fp32"), UNLIMITED)
    assert mem.host_by_kind["weights"] == 4 * ALL and mem.host_bytes == 16 * ALL + 96  # 12 + 4 gradients
    moved = place_tiers(_plan("fp32"), _split(16 * (N0 + N2) + SAVED0 - 1))
    assert _tiers(moved, "optimizer") == ["host", "host", "ssd"]
    assert moved.host_by_kind["weights"] == 4 * ALL + 4 * N2  # stage 2's states left: it needs its own fp32 copy
    # the stage streams what is left: 16 (N0 + N2) - 1 - (16 N0 + 8 N2)
    assert moved.gpus[0].placement.slot_bytes == 8 * N2 - 1


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
