"""The SSD in the simulated step against timelines worked out by hand, and which resource bounds a step."""

import dataclasses

import pytest

from partition.rules.tiers import HostBudget
from partition.search import make_plan, predict_step, sim_stages
from partition.sim.bounds import step_bound
from partition.sim.simulate import SimStage, SsdLink, simulate
from partition.spec.analytic import analytic_profile
from partition.spec.hardware import device_spec
from partition.spec.lookup import get_model
from topology import preset

SSD = SsdLink(read_gbps=3.0, write_gbps=2.0)


def _st(gpu, read=0, write=0, update=1.0, fwd=1.0, bwd=1.0):
    return SimStage(
        gpu=gpu,
        fwd_s=fwd,
        bwd_s=bwd,
        load_s=0.5,
        offload_s=0.5,
        update_s=update,
        comm_s=0.0,
        ssd_read_bytes=read,
        ssd_write_bytes=write,
    )


def _ev(res, kind, j, i=-1):
    hits = [(e[4], e[5]) for e in res.events if e[0] == kind and e[2] == j and e[3] == i]
    assert len(hits) == 1, (kind, j, i, hits)
    return hits[0]


def test_ssd_link_adds_read_and_write_times():
    assert SSD.seconds(6 * 10**9, 0) == 2.0
    assert SSD.seconds(0, 4 * 10**9) == 2.0
    assert SSD.seconds(6 * 10**9, 4 * 10**9) == 4.0


def test_one_stage_update_streams_its_states():
    # load [0, .5]; F [.5, 1.5]; resident into B (F + B = 2) [1.5, 3.5]; offload [3.5, 4];
    # update: Adam 1 s, SSD 6e9 B / 3 GB/s + 4e9 B / 2 GB/s = 4 s -> [4, 8].
    res = simulate([_st(0, 6 * 10**9, 4 * 10**9)], 1, 1, ssd=SSD)
    assert _ev(res, "offload", 0) == (3.5, 4.0)
    assert _ev(res, "update", 0) == (4.0, 8.0)
    assert res.step_time_s == 8.0
    assert ("ssd", "read", 6 * 10**9) in res.link_bytes and ("ssd", "write", 4 * 10**9) in res.link_bytes
    plain = simulate([_st(0)], 1, 1, ssd=SSD)  # no SSD bytes: the Adam alone, no ssd rows
    assert _ev(plain, "update", 0) == (4.0, 5.0) and not [r for r in plain.link_bytes if r[0] == "ssd"]


def test_adam_slower_than_the_ssd_keeps_its_time():
    res = simulate([_st(0, 3 * 10**9, 0, update=2.5)], 1, 1, ssd=SSD)  # SSD 1 s < Adam 2.5 s
    assert _ev(res, "update", 0) == (4.0, 6.5)


def test_two_stages_ssd_updates_queue_and_bound_the_step():
    # s0 on gpu0, s1 on gpu1, one microbatch, comm 0. gpu0: load [0, .5], F0 [.5, 1.5]. gpu1: load [0, .5],
    # F1 [1.5, 2.5], B1 [2.5, 4.5], offload1 [4.5, 5]. gpu0: B0 [4.5, 6.5], offload0 [6.5, 7].
    # Each update streams 4 s of SSD: s1 [5, 9], s0 (its own rank's thread is free) waits for the drive [9, 13].
    # Step 13 s.
    st = [_st(0, 6 * 10**9, 4 * 10**9), _st(1, 6 * 10**9, 4 * 10**9)]
    res = simulate(st, 2, 1, ssd=SSD)
    assert _ev(res, "B", 0, 0) == (4.5, 6.5) and _ev(res, "offload", 0) == (6.5, 7.0)
    assert _ev(res, "update", 1) == (5.0, 9.0)
    assert _ev(res, "update", 0) == (9.0, 13.0)
    assert res.step_time_s == 13.0
    bound = step_bound(res, st, None, SSD)
    assert bound.busy_s == {"compute": 3.0, "pcie": 0.5, "ssd": 8.0, "host_adam": 1.0}  # each rank's 1 s
    assert bound.bound_by == "ssd" and bound.share == 8.0 / 13.0
    assert bound.to_dict()["bound_link"] == "ssd"


def test_compute_and_pcie_bounds_without_ssd():
    st = [_st(0, fwd=2.0, bwd=4.0, update=0.25)]
    res = simulate(st, 1, 2)
    bound = step_bound(res, st, None, None)
    assert bound.bound_by == "compute" and bound.bound_link == "gpu 0"
    assert bound.busy_s["compute"] == 2 * 2.0 + 2 * 6.0 and bound.busy_s["ssd"] == 0.0
    slow = [dataclasses.replace(st[0], load_s=40.0, fwd_s=0.25, bwd_s=0.25)]
    b = step_bound(simulate(slow, 1, 2), slow, None, None)
    assert b.bound_by == "pcie" and b.bound_link == "gpu0 h2d" and b.busy_s["pcie"] == 40.0


def test_weights_on_the_ssd_stream_each_load_and_offload():
    # one stage, 3e9 bytes of weights and gradients on the SSD: the load takes max(.5, 3e9 / 3 GB/s) [0, 1];
    # F [1, 2], B [2, 4]; the offload max(.5, 3e9 / 2 GB/s) [4, 5.5]; the update (no SSD bytes of its own here)
    st = [dataclasses.replace(_st(0), param_bytes=3 * 10**9, grad_bytes=3 * 10**9, ssd_weights=True)]
    res = simulate(st, 1, 1, ssd=SSD)
    assert _ev(res, "load", 0) == (0.0, 1.0) and _ev(res, "offload", 0) == (4.0, 5.5)
    assert _ev(res, "update", 0) == (5.5, 6.5) and res.step_time_s == 6.5
    assert ("ssd", "read", 3 * 10**9) in res.link_bytes and ("ssd", "write", 3 * 10**9) in res.link_bytes
    assert step_bound(res, st, None, SSD).busy_s["ssd"] == 2.5  # 1 s of reads + 1.5 s of writes


def test_the_step_lasts_at_least_the_drives_busy_seconds():
    # two gpus each load a stage of 3e9 bytes from the SSD at once [0, 1] (the static model does not share the
    # drive between them); F0 [1, 1.25], F1 [1.25, 1.5], B1 [1.5, 2], offload1 [2, 3.5], B0 [2, 2.5], offload0
    # [2.5, 4], updates [3.5, 3.75] and [4, 4.25]. The drive reads 6e9 (2 s) and writes 6e9 (3 s): 5 s > 4.25.
    one = dataclasses.replace(
        _st(0, fwd=0.25, bwd=0.25, update=0.25), param_bytes=3 * 10**9, grad_bytes=3 * 10**9, ssd_weights=True
    )
    res = simulate([one, dataclasses.replace(one, gpu=1)], 2, 1, ssd=SSD)
    assert _ev(res, "offload", 0) == (2.5, 4.0) and _ev(res, "update", 0) == (4.0, 4.25)
    assert res.step_time_s == 5.0


def test_ssd_bytes_need_a_link():
    with pytest.raises(ValueError, match="ssd=SsdLink"):
        simulate([_st(0, 1, 1)], 1, 1)


def _need_per_gpu(memory) -> list[int]:
    """Host bytes each gpu's stages need (all in memory)."""
    return [sum(s.host_bytes for s in memory.stages if s.gpu == g) for g in range(len(memory.gpus))]


def test_predict_streams_the_placed_states_on_a_topology():
    topo = preset("2+2")
    plan = make_plan(analytic_profile(get_model("gpt3-1.3b"), device_spec(topo.gpus[0].name)), topo, 4, solver="dp")
    free = predict_step(plan, topo, HostBudget(None, "unlimited"))
    assert free.memory.ssd_bytes == 0 and free.plan.predicted_step_time_s == plan.predicted_step_time_s
    need = _need_per_gpu(free.memory)  # each gpu's share is a quarter of the server's budget
    tight = predict_step(plan, topo, HostBudget(4 * max(need) - 1, "given"))
    # gpu 0 needs the most and moves the optimizer states of its largest stages: one stage's 12 N (1.3e9) is less
    # than the quarter of gpu 0's budget a stage on SSD streams through (1.6e9), so two move
    assert tight.memory.tier("optimizer") == "host+ssd" and tight.memory.on_ssd("optimizer") == 2
    st = sim_stages(plan.stages, topo, tight.memory)
    j = next(k for k, s in enumerate(tight.memory.stages) if s.optimizer == "ssd")
    assert plan.stages[j].gpu == need.index(max(need)) == 0 and not st[j].ssd_weights
    assert st[j].ssd_read_bytes == st[j].ssd_write_bytes == 12 * plan.stages[j].param_count
    updates = {e[2]: e[5] - e[4] for e in tight.sim.events if e[0] == "update"}
    assert updates[j] == pytest.approx(SsdLink(3.0, 2.0).seconds(st[j].ssd_read_bytes, st[j].ssd_write_bytes))
    assert tight.plan.predicted_step_time_s > free.plan.predicted_step_time_s
    # a share that holds the saved inputs and little else: every state of every stage on the SSD
    saved = max(g.saved_inputs_bytes for g in tight.memory.gpus)
    out = predict_step(plan, topo, HostBudget(4 * (saved + 2**20), "given"))
    mem = out.memory
    assert mem.tier("optimizer") == mem.tier("weights") == "ssd"
    st = sim_stages(plan.stages, topo, mem)
    loads = [e for e in out.sim.events if e[0] == "load"]
    assert len(loads) == sum(s.loads for s in mem.stages)
    for e in loads:  # each load streams its stage's weights from the drive
        assert e[5] - e[4] >= plan.stages[e[2]].param_bytes / 3e9 * (1 - 1e-9)
    drive = dict((d, b) for n, d, b in out.sim.link_bytes if n == "ssd")
    assert drive == {"read": mem.ssd_read_bytes, "write": mem.ssd_write_bytes}
    params, b = sum(s.param_count for s in plan.stages), 2
    assert mem.ssd_write_bytes == (12 + 2 * b) * params
    assert mem.ssd_read_bytes == (12 + b) * params + sum(
        s.loads * p.param_bytes for s, p in zip(mem.stages, plan.stages)
    )
    assert out.bound.bound_by == "ssd"
    assert out.bound.busy_s["ssd"] == pytest.approx(mem.ssd_read_bytes / 3e9 + mem.ssd_write_bytes / 2e9)
    assert out.plan.predicted_step_time_s >= out.bound.busy_s["ssd"]
