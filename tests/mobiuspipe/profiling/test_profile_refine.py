"""A profile refined by a traced run (mobiuspipe.profiling.refine), against hand-made traces: each stage's layers get
its measured / predicted F and B, the median over steps, and the plan re-timed from the refined profile
simulates the F and B the trace measured."""

from __future__ import annotations

import dataclasses
import random

import pytest

from mobiuspipe.profiling.refine import (
    loop_seconds,
    median_profile,
    recv_seconds,
    refine_profile,
    send_seconds,
    stage_scales,
)
from mobiuspipe.runtime.action_trace import TracedAction
from partition.plan import Plan
from partition.search import make_plan, sim_stages
from partition.sim.retime import retime
from partition.sim.simulate import simulate
from partition.spec.profile import LayerProfile, Profile
from topology import cpu_standin
from topology.types import Measured, Topology

M = 3


def _profile(n: int, seed: int) -> Profile:
    rng = random.Random(seed)

    def layer(k: int) -> LayerProfile:
        f = rng.uniform(0.5e-3, 3e-3)
        return LayerProfile(
            f"l{k}", 50 + k, 200 + 4 * k, 4000, 64, 0.0, 0.0, f, 2.1 * f, recompute_s=1.1 * f, kept_s=1.2 * f
        )

    return Profile("toy", "cpu-standin", "fp32", 2, 1, tuple(layer(k) for k in range(n)), input_bytes=32)


def _predict(plan, topo):
    return simulate(sim_stages(plan.stages, topo), topo.num_gpus, plan.num_microbatches, topology=topo)


def _traced(sim, scale_f, scale_b, steps, slow_step=None):
    """Ranks' records of `steps`: every F and B of the simulated step, stretched by its stage's scale (and 3x in
    slow_step, which the median over steps must ignore)."""
    per_rank: list[list[TracedAction]] = [[] for _ in range(max(e[1] for e in sim.events) + 1)]
    for step in steps:
        origin = 10.0 * step
        for kind, gpu, stage, mb, start, end in sim.events:
            if kind not in ("F", "B"):
                continue
            k = (scale_f if kind == "F" else scale_b)[stage] * (3.0 if step == slow_step else 1.0)
            per_rank[gpu].append(
                TracedAction(step, kind, stage, mb, origin + start, origin + start + k * (end - start))
            )
    return per_rank


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_stages_layers_get_its_measured_over_predicted(seed):
    rng = random.Random(100 + seed)
    profile = _profile(7 + seed, seed)
    topo = cpu_standin(2, 1 << 30)
    plan = make_plan(profile, topo, M, num_stages=4, mapping="cross", solver="dp")
    sim = _predict(plan, topo)
    sf = [rng.uniform(0.7, 1.5) for _ in plan.stages]
    sb = [rng.uniform(0.7, 1.5) for _ in plan.stages]
    per_rank = _traced(sim, sf, sb, [4, 5, 6], slow_step=5)
    got = refine_profile(profile, plan, per_rank, [4, 5, 6], sim)
    last = plan.num_stages - 1
    for j, (s, sc) in enumerate(zip(plan.stages, got.scales)):
        assert sc.stage == j
        assert sc.backward == pytest.approx(sb[j], rel=1e-9)
        assert sc.forward == (None if j == last else pytest.approx(sf[j], rel=1e-9))
        f = sb[j] if j == last else sf[j]
        for l in s.layers:
            a, b = profile.layers[l], got.profile.layers[l]
            assert (b.fwd_s, b.kept_s) == (pytest.approx(a.fwd_s * f), pytest.approx(a.keep_s * f))
            assert (b.bwd_s, b.recompute_s) == (pytest.approx(a.bwd_s * sb[j]), pytest.approx(a.redo_s * sb[j]))
            assert b.param_bytes == a.param_bytes and b.activation_bytes == a.activation_bytes
    again = _predict(retime(plan, got.profile), topo)
    durations = {(e[0], e[2], e[3]): e[5] - e[4] for e in again.events if e[0] in ("F", "B")}
    for kind, _gpu, stage, mb, start, end in sim.events:
        if kind in ("F", "B"):
            want = (sf if kind == "F" else sb)[stage] * (end - start)
            assert durations[(kind, stage, mb)] == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_a_stage_missing_from_the_trace_is_named():
    profile = _profile(7, 0)
    topo = cpu_standin(2, 1 << 30)
    plan = make_plan(profile, topo, M, num_stages=4, mapping="cross", solver="dp")
    sim = _predict(plan, topo)
    per_rank = _traced(sim, [1.0] * 4, [1.0] * 4, [4])
    per_rank[1] = [r for r in per_rank[1] if not (r.kind == "B" and r.stage == 1)]
    with pytest.raises(ValueError, match="stage 1's B is missing from the trace"):
        stage_scales(per_rank, [4], plan, sim)
    with pytest.raises(ValueError, match="needs traced steps"):
        stage_scales(per_rank, [], plan, sim)


def test_send_seconds_is_the_median_message_to_another_gpu():
    profile = _profile(7, 0)
    two = make_plan(profile, cpu_standin(2, 1 << 30), M, num_stages=4, mapping="cross", solver="dp")
    assert two.mapping == [0, 1, 0, 1]
    recs = [
        TracedAction(4, "SA", 0, 0, 1.0, 1.0003),
        TracedAction(4, "SA", 2, 1, 2.0, 2.0005),
        TracedAction(4, "SG", 1, 0, 3.0, 3.0004),
        TracedAction(4, "SG", 3, 2, 3.0, 3.0009),
        TracedAction(5, "SA", 0, 0, 9.0, 9.5),  # a step not asked for
        TracedAction(4, "F", 0, 0, 0.0, 0.9),
    ]
    assert send_seconds([recs, []], [4], two) == pytest.approx(0.00045)
    one = make_plan(profile, cpu_standin(1, 1 << 30), M, num_stages=4, solver="dp")
    assert send_seconds([recs], [4], one) is None  # every stage on one gpu: handed over, never sent


def test_recv_seconds_is_the_mean_receive_from_when_both_ends_reached_it():
    profile = _profile(7, 0)
    two = make_plan(profile, cpu_standin(2, 1 << 30), M, num_stages=4, mapping="cross", solver="dp")
    assert two.mapping == [0, 1, 0, 1]
    rank0 = [
        TracedAction(4, "SA", 0, 0, 1.0, 1.001),  # stage 0's output, microbatch 0, posted at 1.001
        TracedAction(4, "RG", 0, 0, 6.0, 6.004),  # waited from 6.0 (after SG 1.0 at 5.5): 4 ms
        TracedAction(4, "RA", 2, 1, 3.0, 3.0003),  # the message was posted at 2.5: 0.3 ms to take it
    ]
    rank1 = [
        TracedAction(4, "RA", 1, 0, 0.5, 1.003),  # posted before its send ended (1.001): 2 ms after it
        TracedAction(4, "SG", 1, 0, 5.4, 5.5),
        TracedAction(4, "SA", 1, 1, 2.4, 2.5),
        TracedAction(4, "RA", 3, 0, 7.0, 7.5),  # its send is not in the trace: left out
        TracedAction(5, "RA", 1, 0, 9.0, 9.5),  # a step not asked for
    ]
    transit = sim_stages(two.stages, _layout(two))[0].comm_s  # the simulator's delivery of stage 0's 64 bytes
    assert 0 < transit < 1e-7  # the RA of stage 1 waited from before it: only its count has the transit taken out
    assert recv_seconds([rank0, rank1], [4], two) == pytest.approx((0.004 + 0.0003 + 0.002 - transit) / 3)
    one = make_plan(profile, cpu_standin(1, 1 << 30), M, num_stages=4, solver="dp")
    assert recv_seconds([rank0 + rank1], [4], one) is None  # every stage on one gpu: handed over


def test_recv_seconds_leaves_out_the_transit_the_simulator_charges():
    """The simulator delivers a message comm_s after its send (latency + bytes at the link's rate) and charges recv_s
    after that: a receive that waited for the message counts only what it took beyond the modeled arrival, floored
    at 0 (a message that came sooner than modeled), or the transit is counted twice (on NCCL a receive event-timed
    on the stream ends when the bytes have crossed)."""
    profile = _profile(7, 0)
    slow = Measured(message_latency_s=1e-3, message_gbps=1e-3)  # 1 ms + output_bytes (64) / 1 MB/s = 1.064 ms
    two = make_plan(profile, cpu_standin(2, 1 << 30, measured=slow), M, num_stages=4, mapping="cross", solver="dp")
    transit = [s.comm_s for s in sim_stages(two.stages, _layout(two))]
    assert two.mapping == [0, 1, 0, 1] and transit[:3] == pytest.approx([1.064e-3] * 3)
    rank0 = [
        TracedAction(4, "SA", 0, 0, 1.0, 1.001),
        TracedAction(4, "RG", 0, 0, 5.0, 5.501364),  # waited from 5.0; SG at 5.5: 0.3 ms after the arrival
    ]
    rank1 = [
        TracedAction(4, "RA", 1, 0, 0.5, 1.0026),  # waited from 0.5; SA at 1.001: 0.536 ms after the arrival
        TracedAction(4, "SG", 1, 0, 5.4, 5.5),
        TracedAction(4, "SA", 1, 1, 2.4, 2.5),
    ]
    rank0.append(TracedAction(4, "RA", 2, 1, 2.5005, 2.5008))  # took 0.3 ms, sooner than the modeled arrival: 0
    assert recv_seconds([rank0, rank1], [4], two) == pytest.approx((0.3e-3 + 0.536e-3 + 0.0) / 3)


def _layout(plan: Plan) -> Topology:
    assert plan.layout is not None
    return plan.layout


def test_loop_seconds_is_the_median_gap_between_two_steps_schedules():
    """Rank 0's steps start at 0, 1.0, 2.1, 3.0 and 4.0 s; each schedule spans from its first record on any rank
    to its last (a host update included): step 0 0.9 s, step 1 0.95, step 2 0.85 (the update ends it), step 3
    1.2 (longer than its period: no gap). Gaps 0.1, 0.15, 0.05, 0: median of steps 0-3 0.075; step 4 has no
    next step traced."""

    def step(s, t0, end0, end1, update=None):
        r0 = [TracedAction(s, "step", -1, -1, t0, t0 + 0.5), TracedAction(s, "F", 0, 0, t0 + 0.01, end0)]
        r1 = [TracedAction(s, "B", 1, 0, t0 + 0.3, end1)]
        if update is not None:
            r1.append(TracedAction(s, "U", 1, -1, end1, update))
        return r0, r1

    parts = [
        step(0, 0.0, 0.5, 0.91),
        step(1, 1.0, 1.96, 1.5),
        step(2, 2.1, 2.5, 2.8, update=2.96),
        step(3, 3.0, 4.21, 3.5),
        step(4, 4.0, 4.5, 4.6),
    ]
    per_rank = [[r for a, _ in parts for r in a], [r for _, b in parts for r in b]]
    assert loop_seconds(per_rank, [0, 1, 2, 3]) == pytest.approx((0.1 + 0.05) / 2)
    assert loop_seconds(per_rank, [0, 1]) == pytest.approx((0.1 + 0.15) / 2)  # only the steps asked for
    assert loop_seconds(per_rank, [4]) is None and loop_seconds([], [0]) is None


def test_median_profile_takes_each_layers_middle_time():
    base = _profile(6, 3)
    scaled = [
        Profile(base.model, base.device, base.dtype, 2, 1, tuple(_times(x, k) for x in base.layers), input_bytes=32)
        for k in (3.0, 1.0, 2.0)
    ]
    mid = median_profile(scaled)
    for a, b in zip(base.layers, mid.layers):
        assert (b.fwd_s, b.bwd_s, b.recompute_s, b.kept_s) == pytest.approx(
            (2 * a.fwd_s, 2 * a.bwd_s, 2 * a.redo_s, 2 * a.keep_s)
        )
        assert b.param_bytes == a.param_bytes
    with pytest.raises(ValueError, match="one model"):
        median_profile([base, _profile(7, 3)])


def _times(layer: LayerProfile, k: float) -> LayerProfile:
    return dataclasses.replace(
        layer, fwd_s=k * layer.fwd_s, bwd_s=k * layer.bwd_s, recompute_s=k * layer.redo_s, kept_s=k * layer.keep_s
    )


def test_identical_layers_share_the_mean_scale_of_their_stages():
    def layer(name: str, f: float) -> LayerProfile:
        return LayerProfile(name, 100, 400, 4000, 64, 0.0, 0.0, f, 2 * f, recompute_s=f, kept_s=f)

    layers = (layer("embedding", 1e-4), *(layer("block", 2e-3) for _ in range(7)), layer("head", 5e-4))
    profile = Profile("toy", "cpu-standin", "fp32", 2, 1, layers, input_bytes=32)
    topo = cpu_standin(2, 1 << 30)
    plan = make_plan(profile, topo, M, num_stages=4, mapping="cross", solver="dp")
    sim = _predict(plan, topo)
    sb = [1.0, 2.0, 1.5, 1.2]
    got = refine_profile(profile, plan, _traced(sim, [1.0] * 4, sb, [3]), [3], sim)
    blocks = [[l for l in s.layers if layers[l].name == "block"] for s in plan.stages]
    want = sum(b * len(n) for b, n in zip(sb, blocks)) / sum(len(n) for n in blocks)
    for l, x in enumerate(got.profile.layers):
        if x.name == "block":
            assert x.bwd_s == pytest.approx(want * 4e-3, rel=1e-9), l
    assert got.profile.layers[0].bwd_s == pytest.approx(sb[0] * 2e-4)  # the embedding's own stage
