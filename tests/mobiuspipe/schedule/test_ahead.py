"""Receives posted ahead (mobiuspipe.schedule.ahead): the candidates, and the choice that cannot deadlock when the
device synchronizes while a posted receive waits for its sender."""

from __future__ import annotations

import numpy as np
import pytest

from mobiuspipe.schedule import Action, Kind, ScheduleError, build_schedule, build_schedules, receives_ahead
from mobiuspipe.schedule.ahead import check_receives_ahead, next_receives
from partition.rules.mapping import round_robin


def _every_candidate(mapping, schedules):
    return [
        {(acts[p].kind, acts[p].stage, acts[p].microbatch): acts[r] for p, r in next_receives(mapping, acts, g).items()}
        for g, acts in enumerate(schedules)
    ]


def _text(chain) -> dict[str, str]:
    return {f"{k[0].value}{k[1]}.{k[2]}": str(a) for k, a in chain.items()}


def test_each_receive_from_another_rank_is_a_candidate_for_the_next():
    """On gpu 0 of the cross mapping [0, 1, 0, 1], RA2.0 -> RA2.1 -> RG2.0 -> RG2.1 -> RG0.0 -> RG0.1; receives
    handed over on the same gpu take no part."""
    mapping = [0, 1, 0, 1]
    schedule = build_schedule(mapping, 0, 2)
    chain = {str(schedule[p]): str(schedule[r]) for p, r in next_receives(mapping, schedule, 0).items()}
    assert chain == {"RA2.0": "RA2.1", "RA2.1": "RG2.0", "RG2.0": "RG2.1", "RG2.1": "RG0.0", "RG0.0": "RG0.1"}
    schedule = build_schedule([0, 0, 1], 0, 2)
    assert [(schedule[p], schedule[r]) for p, r in next_receives([0, 0, 1], schedule, 0).items()] == [
        (Action(Kind.RECV_GRAD, 1, 0), Action(Kind.RECV_GRAD, 1, 1))
    ]


def test_a_post_whose_sender_waits_for_this_gpu_deadlocks_under_a_device_sync():
    """[0, 1, 1, 0], one microbatch. Gpu 1 takes RA1.0, then would post RG2.0 (stage 2's output gradient, from gpu
    0). Gpu 0 sends it after B3.0, which needs RA3.0, which gpu 1 sends after F1.0 and F2.0, the actions right after
    RA1.0. A device-wide synchronization there waits for RG2.0's kernel: a cycle. Gpu 0's RA3.0 -> RG0.0 has the same
    shape. Neither is posted ahead; nothing else was a candidate."""
    mapping = [0, 1, 1, 0]
    schedules = build_schedules(mapping, 2, 1, frozenset(), "direction")
    every = _every_candidate(mapping, schedules)
    assert [_text(c) for c in every] == [{"RA3.0": "RG0.0"}, {"RA1.0": "RG2.0"}]
    with pytest.raises(ScheduleError, match=r"gpu 1 waits at F1\.0 \(after RA1\.0, for RG2\.0 posted ahead\)"):
        check_receives_ahead(mapping, schedules, every)
    assert receives_ahead(mapping, schedules) == [{}, {}]


@pytest.mark.parametrize("mapping,m", [([0, 1, 2, 3], 4), ([0, 1, 0, 1], 2), ([0, 1, 2, 0, 1, 2], 3)])
def test_every_candidate_deadlocks_and_the_choice_does_not(mapping, m):
    schedules = build_schedules(mapping, max(mapping) + 1, m, frozenset(), "direction")
    with pytest.raises(ScheduleError, match="posted ahead"):
        check_receives_ahead(mapping, schedules, _every_candidate(mapping, schedules))
    chosen = receives_ahead(mapping, schedules)
    check_receives_ahead(mapping, schedules, chosen)
    every = _every_candidate(mapping, schedules)
    assert all(c.items() <= e.items() for c, e in zip(chosen, every))
    assert 0 < sum(map(len, chosen)) < sum(map(len, every))


@pytest.mark.parametrize("mapping,m", [([0, 1], 4), ([0, 0, 1, 1], 3), ([0, 1, 0, 1], 3), (round_robin(8, 2), 8)])
def test_where_nothing_can_deadlock_every_candidate_is_posted(mapping, m):
    schedules = build_schedules(mapping, max(mapping) + 1, m, frozenset(), "direction")
    every = _every_candidate(mapping, schedules)
    check_receives_ahead(mapping, schedules, every)
    assert receives_ahead(mapping, schedules) == every


def test_a_stream_of_one_stages_microbatches_is_kept_before_a_move_to_another():
    """[0, 1, 0, 1], 2 microbatches: gpu 0's RA2.0 -> RA2.1 and gpu 1's RA1.1 -> RA3.0 wait for each other (gpu 1
    sends SA1.1 after F1.1, gpu 0 sends SA2.0 after F2.0). The move to another stage is taken back, the stream kept."""
    mapping = [0, 1, 0, 1]
    chosen = receives_ahead(mapping, build_schedules(mapping, 2, 2, frozenset(), "direction"))
    assert _text(chosen[0])["RA2.0"] == "RA2.1"
    assert "RA1.1" not in _text(chosen[1])


@pytest.mark.parametrize("seed", range(25))
def test_the_choice_never_deadlocks_on_random_mappings(seed):
    rng = np.random.default_rng(seed)
    gpus, m = int(rng.integers(2, 5)), int(rng.integers(1, 6))
    mapping = [int(g) for g in rng.integers(0, gpus, int(rng.integers(2, 10)))]
    schedules = build_schedules(mapping, gpus, m, frozenset(), "direction")
    chosen = receives_ahead(mapping, schedules)
    check_receives_ahead(mapping, schedules, chosen)
    every = _every_candidate(mapping, schedules)
    assert all(c.items() <= e.items() for c, e in zip(chosen, every)), mapping
