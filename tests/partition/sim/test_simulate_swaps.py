"""Swaps of held activations in the simulator (partition.sim.swaps) against hand-computed timelines: where
the schedule's SO and SI put them, what they expose, their bytes on the links and the drive, and the plan's
stages as the simulator sees them (sim_stages)."""

from __future__ import annotations

import dataclasses

import pytest

from partition.rules.tiers import HostBudget
from partition.search import make_plan, predict_step, sim_stages
from partition.sim.simulate import simulate
from partition.sim.types import SimStage, SsdLink
from tests.partition.rules.test_activation_choice import _profile
from topology import cpu_standin


def _stages(tier: str, held: int = 1, out_s: float = 1.0, in_s: float = 1.0) -> list[SimStage]:
    """Stage 0 (F 2 s, B 3 + 2 s recompute) holds `held` bytes on `tier`; stage 1 is the fused last (B 2 s)."""
    last = SimStage(gpu=0, fwd_s=1.0, bwd_s=1.0, load_s=0.0, offload_s=0.0, update_s=0.0, comm_s=0.0, fused=True)
    first = dataclasses.replace(last, fwd_s=2.0, bwd_s=3.0, recompute_s=2.0, fused=False, swap_tier=tier)
    return [dataclasses.replace(first, held_bytes=held, swap_out_s=out_s, swap_in_s=in_s), last]


def _times(res, kind: str) -> list[tuple[int, int, float, float]]:
    return [(e[2], e[3], e[4], e[5]) for e in res.events if e[0] == kind]


def test_a_swap_exposes_the_last_swap_out_and_the_first_swap_in():
    """F0: 0-2, 2-4, 4-6 (F0(2) waits for out(0), which ended at 3); SO(0,1) and SO(0,2) stand after F0(2),
    so the fused F1 waits for out(2): 6-7. B1: 7-9, 9-11, 11-13. SI(0,0) and SI(0,1) stand before B0(0):
    13-14, 14-15; B0(0) 14-19; SI(0,2) after B0(0): 19-20; B0(1) 19-24, B0(2) 24-29. On the device: 27."""
    device = simulate(_stages("device"), 1, 3)
    host = simulate(_stages("host"), 1, 3)
    assert device.step_time_s == pytest.approx(27.0)
    assert host.step_time_s == pytest.approx(29.0)
    assert _times(host, "F")[:3] == [(0, 0, 0.0, 2.0), (0, 1, 2.0, 4.0), (0, 2, 4.0, 6.0)]
    assert [(j, i, s, e) for j, i, s, e in _times(host, "B") if j == 0] == [
        (0, 0, 14.0, 19.0),
        (0, 1, 19.0, 24.0),
        (0, 2, 24.0, 29.0),
    ]


def test_a_slow_swap_out_holds_back_the_forward_two_microbatches_later():
    """out takes 3 s: out(0) 2-5, out(1) 5-8 (in turn), out(2) 8-11; F0(2) waits for out(0): 5-7; F1 waits for
    out(2): 11. B1 11-17; in(0) 17-18, in(1) 18-19; B0 18-23, 23-28, 28-33 (in(2) 23-24)."""
    res = simulate(_stages("host", out_s=3.0), 1, 3)
    assert _times(res, "F")[2] == (0, 2, 5.0, 7.0)
    assert res.step_time_s == pytest.approx(33.0)


def test_with_a_topology_a_swap_is_a_flow_over_the_gpus_link():
    """The same timeline with 1e9 held bytes over a 1 GB/s link (1 s each way), and the bytes on the gpu's
    link: M x H each way."""
    topo = cpu_standin(1, 1 << 30, link_gbps=1.0)
    res = simulate(_stages("host", held=10**9, out_s=99.0, in_s=99.0), 1, 3, topology=topo)
    assert res.step_time_s == pytest.approx(29.0)
    links = {(n, d): b for n, d, b in res.link_bytes}
    assert links[("gpu0", "d2h")] == links[("gpu0", "h2d")] == 3 * 10**9


def test_the_ssd_tier_crosses_the_drive():
    """ssd: each swap also crosses the drive (0.5 GB/s write, 0.25 read: 2 s out, 4 s in for 1e9 bytes), and
    the drive's traffic counts them; a stage on the SSD tier needs an SsdLink."""
    topo = cpu_standin(1, 1 << 30, link_gbps=1.0)
    stages = _stages("ssd", held=10**9)
    with pytest.raises(ValueError, match="no ssd=SsdLink"):
        simulate(stages, 1, 3, topology=topo)
    res = simulate(stages, 1, 3, topology=topo, ssd=SsdLink(0.25, 0.5))
    links = {(n, d): b for n, d, b in res.link_bytes}
    assert links[("ssd", "write")] == links[("ssd", "read")] == 3 * 10**9
    assert res.step_time_s > simulate(_stages("host", held=10**9), 1, 3, topology=topo).step_time_s
    assert res.step_time_s >= 3 * 10**9 / 0.5e9 + 3 * 10**9 / 0.25e9  # the drive's floor D


def test_sim_stages_time_a_plans_swaps_and_the_prediction_grows_on_a_slow_link():
    topo = cpu_standin(1, 1 << 30, link_gbps=1e-4)  # 100 kB/s: the swaps cannot hide
    plan = make_plan(_profile(), topo, 3, num_stages=3, solver="dp", activations="recompute")
    held = plan.stages[0].output_bytes
    swapped = dataclasses.replace(
        plan,
        stages=(
            plan.stages[0],
            dataclasses.replace(plan.stages[1], activation_tier="host", held_bytes=held),
            plan.stages[2],
        ),
    )
    sims = sim_stages(swapped.stages, topo)
    assert (sims[1].swap_tier, sims[1].held_bytes) == ("host", held)
    assert sims[1].swap_out_s == pytest.approx(held / 1e5) and sims[0].swap_tier == "device"
    budget = HostBudget(None, "unlimited")
    slow = predict_step(swapped, topo, budget).sim.step_time_s
    assert slow >= predict_step(plan, topo, budget).sim.step_time_s + held / 1e5 - 1e-12  # one swap exposed


def test_a_peer_swap_over_an_nvlink_is_a_flow_on_it():
    """2x2-nvlink: stage 0 on gpu 0 parks its held bytes on gpu 1 over their NVLink (it had no capacity, and the
    simulation raised KeyError). As many bytes held as the NVLink moves in 1 s, M = 3: 2 x 3 of them on the link,
    none on the gpus' PCIe links; the step is the host tier's with 1 s swaps (29 s, as above)."""
    from topology import preset

    topo = preset("2x2-nvlink")
    nvlink = topo.nvlink(0, 1)
    assert nvlink is not None
    held = int(nvlink.gbps * 1e9)  # 1 s each way
    stages = _stages("peer", held=held, out_s=99.0, in_s=99.0)
    stages = [dataclasses.replace(s, swap_peer=1) if s.swap_tier == "peer" else s for s in stages]
    res = simulate(stages, 4, 3, topology=topo)
    assert res.step_time_s == pytest.approx(29.0)
    links = {(n, d): b for n, d, b in res.link_bytes}
    assert links[("nvlink 0-1", "p2p")] == 2 * 3 * held
    assert links[("gpu0", "d2h")] == links[("gpu0", "h2d")] == 0
