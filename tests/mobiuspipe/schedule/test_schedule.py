"""Schedules: built for many shapes, checked; broken ones are caught with the place shown; one visit order."""

from __future__ import annotations

import numpy as np
import pytest

from mobiuspipe.schedule import Action, Kind, ScheduleError, build_schedule, check_schedules
from partition.rules.mapping import round_robin
from partition.rules.order import Visit, visits_of
from partition.rules.timeline import StageTimes, aggregate_times
from partition.sim.simulate import SimStage, simulate


@pytest.mark.parametrize("stages,gpus,m", [(1, 1, 1), (3, 1, 2), (4, 2, 4), (5, 2, 3), (7, 3, 5), (8, 4, 1)])
def test_built_schedules_pass_the_checker(stages, gpus, m):
    mapping = round_robin(stages, gpus)
    scheds = [build_schedule(mapping, g, m) for g in range(gpus)]
    check_schedules(mapping, m, scheds)
    for g, s in enumerate(scheds):
        mine = [j for j in range(stages) if mapping[j] == g]
        assert sum(a.kind is Kind.FWD for a in s) == len(mine) * m
        loads = [a.stage for a in s if a.kind is Kind.LOAD]
        assert loads == mine + mine[-2::-1]  # the last forward stage stays for its backward


def test_gpu_schedule_text_form():
    s = build_schedule([0, 1, 0, 1], 0, 2)
    assert " ".join(map(str, s)) == (
        "L0 L2 F0.0 SA0.0 F0.1 SA0.1 R0 RA2.0 F2.0 SA2.0 RA2.1 F2.1 SA2.1 L0 RG2.0 B2.0 SG2.0 RG2.1 B2.1 SG2.1 "
        "O2 R2 RG0.0 B0.0 RG0.1 B0.1 O0 R0"
    )


def _scheds():
    mapping = [0, 1, 0, 1]
    return mapping, [build_schedule(mapping, g, 2) for g in range(2)]


def test_use_before_load_is_caught():
    mapping, s = _scheds()
    s[0].remove(Action(Kind.LOAD, 2))
    with pytest.raises(ScheduleError, match=r"gpu 0, action \d+ \(F2.0\): stage used before it is loaded"):
        check_schedules(mapping, 2, s)


def test_third_weight_slot_is_caught():
    mapping, s = _scheds()
    s[0].remove(Action(Kind.RELEASE, 0))
    with pytest.raises(ScheduleError, match="no free weight slot"):
        check_schedules(mapping, 2, s)


def test_backward_before_its_gradient_arrives_is_caught():
    mapping, s = _scheds()
    k = s[1].index(Action(Kind.RECV_GRAD, 1, 0))
    s[1].insert(k + 2, s[1].pop(k))
    with pytest.raises(ScheduleError, match="runs before RG1.0"):
        check_schedules(mapping, 2, s)


def test_deadlock_is_caught():
    mapping = [0, 1]
    s = [build_schedule(mapping, g, 1) for g in range(2)]
    # gpu 0 waits for a gradient before it sends its activation: each waits on the other
    s[0] = [
        Action(Kind.LOAD, 0),
        Action(Kind.FWD, 0, 0),
        Action(Kind.RECV_GRAD, 0, 0),
        Action(Kind.SEND_ACT, 0, 0),
        Action(Kind.BWD, 0, 0),
        Action(Kind.OFFLOAD, 0),
        Action(Kind.RELEASE, 0),
    ]
    with pytest.raises(ScheduleError, match="deadlock"):
        check_schedules(mapping, 1, s)


def test_receives_out_of_send_order_are_caught():
    mapping = [0, 1, 0, 1]
    s = [build_schedule(mapping, g, 2) for g in range(2)]
    a = s[1].index(Action(Kind.RECV_ACT, 1, 0))
    s[1][a : a + 6] = s[1][a + 3 : a + 6] + s[1][a : a + 3]  # rank 1 runs microbatch 1 of stage 1 before 0: fine by
    assert [str(x) for x in s[1][a : a + 6]] == ["RA1.1", "F1.1", "SA1.1", "RA1.0", "F1.0", "SA1.0"]  # tag only
    with pytest.raises(ScheduleError, match="NCCL would pair them wrongly"):
        check_schedules(mapping, 2, s)


def _runs(seq) -> list[tuple[int, str]]:
    """Consecutive repeats collapsed: the visits of a sequence of (stage, phase) computations."""
    return [v for k, v in enumerate(seq) if k == 0 or seq[k - 1] != v]


def _builder_visits(mapping, gpus, m):
    last = len(mapping) - 1  # its F only stores the input its B runs on, microbatch by microbatch: not a visit
    return {
        g: _runs([(a.stage, a.kind.value) for a in build_schedule(mapping, g, m) if _visits_in(a, last)])
        for g in range(gpus)
    }


def _visits_in(a, last: int) -> bool:
    return a.kind is Kind.BWD or (a.kind is Kind.FWD and a.stage != last)


def _timeline_visits(mapping, gpus, m, rng):
    """Visits per gpu ordered by their start in the aggregated timeline (times > 0: starts strictly rise)."""
    st = [StageTimes(*rng.uniform(0.1, 1.0, 5)) for _ in mapping]
    _, t = aggregate_times(st, mapping, m)
    starts = [(t["T" + ph][j], (j, ph)) for j in range(len(mapping)) for ph in "FB"]
    return {g: [v for _, v in sorted(starts) if mapping[v[0]] == g] for g in range(gpus)}


def _simulator_visits(mapping, gpus, m, rng):
    stages = [SimStage(g, *rng.uniform(0.1, 1.0, 6)) for g in mapping]
    res = simulate(stages, gpus, m)
    return {g: _runs([(e[2], e[0]) for e in res.events if e[1] == g and e[0] in ("F", "B")]) for g in range(gpus)}


@pytest.mark.parametrize("seed", range(20))
def test_builder_timeline_and_simulator_visit_stages_in_one_order(seed):
    rng = np.random.default_rng(seed)
    gpus, m = int(rng.integers(1, 5)), int(rng.integers(1, 4))
    mapping = [int(g) for g in rng.integers(0, gpus, int(rng.integers(1, 9)))]
    want = {g: visits_of(mapping, g) for g in range(gpus)}
    fused = Visit(len(mapping) - 1, "F")  # the last stage's forward visit runs nothing in the runtime
    assert _builder_visits(mapping, gpus, m) == {g: [v for v in vs if v != fused] for g, vs in want.items()}, mapping
    assert _timeline_visits(mapping, gpus, m, rng) == want, mapping
    assert _simulator_visits(mapping, gpus, m, rng) == want, mapping
