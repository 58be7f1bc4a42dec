"""The simulator's CPU-run fidelity fixes against timelines worked out by hand: the last stage fused as the runtime
runs it, the recompute timed apart from the forward, and the host's cores shared by CPU stand-ins' computations.

Times are dyadic so that sums are exact (==), except where a core is shared three ways (approx).
"""

import dataclasses

import pytest

from partition.plan import Plan
from partition.rules.mapping import peer_gbps
from partition.rules.tiers import HostBudget
from partition.search import host_cores, make_plan, predict_step, sim_stages
from partition.sim.simulate import SimStage, simulate
from partition.spec.analytic import analytic_profile
from partition.spec.hardware import device_spec
from partition.spec.models import ModelSpec
from partition.spec.profile import Profile
from topology import cpu_standin
from topology.types import Measured


def _st(gpu, fwd, bwd, **kw):
    return SimStage(gpu=gpu, fwd_s=fwd, bwd_s=bwd, load_s=0.0, offload_s=0.0, update_s=0.0, comm_s=0.0, **kw)


def _ev(res, kind, j, i=-1):
    hits = [(e[4], e[5]) for e in res.events if e[0] == kind and e[2] == j and e[3] == i]
    assert len(hits) == 1, (kind, j, i, hits)
    return hits[0]


def test_fused_last_stage_takes_no_forward_and_its_backward_runs_forward_and_backward():
    # One gpu, stages 0 (F 1, B 2) and 1 (F 1, B 2, fused), M = 2, transfers free.
    # F(0,0) [0,1], F(0,1) [1,2]; stage 1's forward visit runs nothing; B(1,0) = F + B = 3: [2,5], B(1,1) [5,8];
    # B(0,0) [8,11], B(0,1) [11,14]. Unfused, F(1,*) would add 2: the step would be 16.
    stages = [_st(0, 1.0, 2.0), _st(0, 1.0, 2.0, fused=True)]
    res = simulate(stages, num_gpus=1, microbatches=2)
    assert not [e for e in res.events if e[0] == "F" and e[2] == 1]
    assert _ev(res, "B", 1, 0) == (2.0, 5.0)
    assert _ev(res, "B", 0, 1) == (11.0, 14.0)
    assert res.step_time_s == 14.0
    unfused = simulate([_st(0, 1.0, 2.0), _st(0, 1.0, 2.0)], num_gpus=1, microbatches=2)
    assert unfused.step_time_s == 16.0


def test_fused_last_stage_starts_each_backward_when_its_input_arrives():
    # Stage 0 (F 1, B 2: a backward of 3 with its recompute) on gpu 0, stage 1 (B 3, fused) on gpu 1, M = 2,
    # transfers free. B(1,0) starts when F(0,0) arrives, not after F(0,1): B(1,0) [1,4], B(1,1) [4,7] (its input
    # came at 2); B(0,0) [4,7] (gpu 0 idle since 2), B(0,1) [7,10]. Waiting for every input first, as an unfused
    # F visit would: B(1,*) [2,5] [5,8], B(0,*) [5,8] [8,11], a step of 11.
    stages = [_st(0, 1.0, 2.0), _st(1, 0.0, 3.0, fused=True)]
    res = simulate(stages, num_gpus=2, microbatches=2)
    assert _ev(res, "B", 1, 0) == (1.0, 4.0) and _ev(res, "B", 1, 1) == (4.0, 7.0)
    assert _ev(res, "B", 0, 0) == (4.0, 7.0) and _ev(res, "B", 0, 1) == (7.0, 10.0)
    assert res.step_time_s == 10.0


def test_backward_redoes_the_recompute_time_not_the_forward_time():
    # F 1 (no grad), recompute 1.5 (with grad and hooks), B 2: F(0,0) [0,1], F(0,1) [1,2], B = 3.5 each.
    res = simulate([_st(0, 1.0, 2.0, recompute_s=1.5)], num_gpus=1, microbatches=2)
    assert _ev(res, "B", 0, 0) == (2.0, 5.5)
    assert res.step_time_s == 9.0


def test_two_gpus_share_the_host_cores():
    # Two stages on two gpus, M = 1, F 1 and B 1 each (unfused), no comm; one core for both gpus.
    # F(0,0) [0,1] alone at rate 1; F(1,0) [1,2] alone; B(1,0) = 2 [2,4]; B(0,0) = 2 [4,6]: nothing overlaps.
    # With M = 2 and C = 1: F(0,1) and F(1,0) overlap from 1, each at 1/2 a core: both end at 3.
    stages = [_st(0, 1.0, 1.0), _st(1, 1.0, 1.0)]
    alone = simulate(stages, num_gpus=2, microbatches=2)
    one = simulate(stages, num_gpus=2, microbatches=2, host_cores=1.0)
    two = simulate(stages, num_gpus=2, microbatches=2, host_cores=2.0)
    assert _ev(alone, "F", 0, 1) == (1.0, 2.0) and _ev(alone, "F", 1, 0) == (1.0, 2.0)
    assert _ev(one, "F", 0, 1) == (1.0, 3.0) and _ev(one, "F", 1, 0) == (1.0, 3.0)
    assert two.step_time_s == alone.step_time_s  # two cores: each computation has a core of its own
    # one core: the total compute (2 x (2 x 1 + 2 x 2) = 12 s of a core) can never take less than 12 s
    assert one.step_time_s >= 12.0 > alone.step_time_s


def test_a_core_shared_three_ways_with_one_and_a_half_cores():
    # Three gpus, one stage each, F 1, B 1 (unfused, the recompute is the forward's 1: B = 2), no comm.
    # M = 1: each computation waits for the one before, so only one runs at a time: the cores do not matter.
    stages = [_st(g, 1.0, 1.0) for g in range(3)]
    assert simulate(stages, 3, 1, host_cores=1.5).step_time_s == simulate(stages, 3, 1).step_time_s
    # M = 3, C = 1.5: F(0,0) [0,1] alone; F(0,1) and F(1,0) together at 0.75 core each: [1, 1 + 4/3];
    # then F(0,2), F(1,1), F(2,0) together at 0.5 core each: they end 2 later, at 13/3.
    res = simulate(stages, 3, 3, host_cores=1.5)
    assert _ev(res, "F", 0, 1) == pytest.approx((1.0, 7 / 3))
    assert _ev(res, "F", 0, 2) == pytest.approx((7 / 3, 13 / 3))
    assert _ev(res, "F", 2, 0) == pytest.approx((7 / 3, 13 / 3))


def test_host_cores_must_be_positive():
    with pytest.raises(ValueError, match="host_cores"):
        simulate([_st(0, 1.0, 1.0)], 1, 1, host_cores=0.0)


def _profile():
    spec = ModelSpec("t", num_blocks=4, d_model=64, num_heads=4, seq_len=32, vocab_size=97)
    p = analytic_profile(spec, device_spec("cpu-standin"), microbatch_size=2, dtype="fp32")
    layers = tuple(dataclasses.replace(x, recompute_s=1.25 * x.fwd_s) for x in p.layers)
    return dataclasses.replace(p, layers=layers)


def test_plans_carry_the_recompute_time_and_fuse_the_last_stage():
    prof = _profile()
    plan = make_plan(prof, cpu_standin(2, 2**30), 4, num_stages=4, solver="dp", activations="recompute")
    for s in plan.stages:
        redo = sum(prof.layers[l].redo_s for l in s.layers)
        assert s.recompute_s == pytest.approx(redo)
    sims = sim_stages(plan.stages, cpu_standin(2, 2**30))
    assert [s.fused for s in sims] == [False, False, False, True]
    assert [s.recompute_s for s in sims] == [s.recompute_s for s in plan.stages]
    assert Plan.from_dict(plan.to_dict()) == plan


def test_old_plans_and_profiles_recompute_their_forward():
    prof = _profile()
    plan = make_plan(prof, cpu_standin(1, 2**30), 4, num_stages=2, solver="dp")
    old = plan.to_dict()
    for s in old["stages"]:
        del s["recompute_s"]
    back = Plan.from_dict(old)
    assert all(s.recompute_s is None for s in back.stages)
    assert [s.recompute_s for s in sim_stages(back.stages, cpu_standin(1, 2**30))] == [s.fwd_s for s in back.stages]
    d = prof.to_dict()
    for x in d["layers"]:
        del x["recompute_s"]
    layer = Profile.from_dict(d).layers[1]
    assert layer.recompute_s is None and layer.redo_s == layer.fwd_s


def test_predict_step_shares_the_measured_host_cores():
    prof = _profile()
    topo = cpu_standin(2, 2**30)
    plan = make_plan(prof, topo, 4, num_stages=4, solver="dp")
    budget = HostBudget(None, "unlimited")
    free = predict_step(plan, topo, budget).sim.step_time_s
    probed = dataclasses.replace(topo, measured=Measured(host_cores=1.0))
    assert host_cores(topo) is None and host_cores(probed) == 1.0
    shared = predict_step(plan, probed, budget).sim.step_time_s
    busy = sum(4 * s.fwd_s for s in plan.stages[:-1])  # the forwards of the unfused stages
    busy += sum(4 * ((s.recompute_s or 0.0) + s.bwd_s) for s in plan.stages)
    assert shared >= busy * (1 - 1e-9) and shared > free


def test_measured_messages_time_the_activations_between_gpus():
    # 2 gpus, 4 stages crossing at every boundary: comm = latency + output_bytes / GB/s; none on the last stage.
    prof = _profile()
    topo = cpu_standin(2, 2**30)
    plan = make_plan(prof, topo, 4, num_stages=4, solver="dp")
    measured = dataclasses.replace(topo, measured=Measured(message_latency_s=0.001, message_gbps=2.0))
    comm = [s.comm_s for s in sim_stages(plan.stages, measured)]
    want = [0.001 + s.output_bytes / 2e9 for s in plan.stages[:-1]] + [0.0]
    assert comm == pytest.approx(want)
    default = [s.comm_s for s in sim_stages(plan.stages, topo)]  # unmeasured: the pair's bandwidth, no latency
    gbps = [peer_gbps(topo, a.gpu, b.gpu) for a, b in zip(plan.stages, plan.stages[1:])]
    assert default == pytest.approx([s.output_bytes / (g * 1e9) for s, g in zip(plan.stages, gbps)] + [0.0])
