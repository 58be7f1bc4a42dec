"""Swap actions in schedules: where the builder puts them (hand-written text form), that built schedules with
any swapped stages and prefetch depth pass the checker and otherwise equal today's, and that misplaced or
missing swaps are caught with the place shown."""

from __future__ import annotations

import itertools

import pytest

from mobiuspipe.schedule import Action, Kind, ScheduleError, build_schedule, check_schedules
from partition.rules.mapping import round_robin


def test_swap_text_form():
    s = build_schedule([0, 1, 0, 1], 0, 3, swapped=frozenset({0}))
    text = " ".join(map(str, s))
    assert text.startswith("L0 L2 F0.0 SA0.0 F0.1 SA0.1 SO0.0 F0.2 SA0.2 SO0.1 SO0.2 R0 ")
    assert text.endswith("O2 R2 SI0.0 SI0.1 RG0.0 B0.0 SI0.2 RG0.1 B0.1 RG0.2 B0.2 O0 R0")
    deep = " ".join(map(str, build_schedule([0, 1, 0, 1], 0, 3, swapped=frozenset({0}), prefetch=2)))
    assert deep.endswith("SI0.0 SI0.1 SI0.2 RG0.0 B0.0 RG0.1 B0.1 RG0.2 B0.2 O0 R0")


@pytest.mark.parametrize("stages,gpus,m", [(3, 1, 2), (4, 2, 4), (5, 2, 3), (7, 3, 5), (6, 2, 1)])
def test_any_swapped_stages_pass_the_checker(stages, gpus, m):
    mapping = round_robin(stages, gpus)
    for k in range(stages):
        for swapped in itertools.combinations(range(stages - 1), k):
            for prefetch in (1, 2, 3):
                scheds = [build_schedule(mapping, g, m, frozenset(swapped), prefetch) for g in range(gpus)]
                check_schedules(mapping, m, scheds)
                plain = [build_schedule(mapping, g, m) for g in range(gpus)]
                without = [[a for a in s if a.kind not in (Kind.SWAP_OUT, Kind.SWAP_IN)] for s in scheds]
                assert without == plain  # swaps only add actions
                for j in swapped:
                    assert sum(a.kind is Kind.SWAP_IN and a.stage == j for s in scheds for a in s) == m


def _swapped():
    mapping = [0, 1, 0, 1]
    return mapping, [build_schedule(mapping, g, 2, frozenset({0, 1})) for g in range(2)]


def test_swap_in_before_its_swap_out_is_caught():
    mapping, s = _swapped()
    s[0].remove(Action(Kind.SWAP_IN, 0, 1))
    s[0].insert(s[0].index(Action(Kind.SWAP_OUT, 0, 1)), Action(Kind.SWAP_IN, 0, 1))
    with pytest.raises(ScheduleError, match=r"\(SI0.1\): runs before SO0.1"):
        check_schedules(mapping, 2, s)


def test_backward_before_its_swap_in_is_caught():
    mapping, s = _swapped()
    s[1].remove(Action(Kind.SWAP_IN, 1, 1))
    s[1].append(Action(Kind.SWAP_IN, 1, 1))
    with pytest.raises(ScheduleError, match=r"\(B1.1\): runs before SI1.1"):
        check_schedules(mapping, 2, s)


def test_a_missing_swap_and_a_swapped_last_stage_are_caught():
    mapping, s = _swapped()
    s[0].remove(Action(Kind.SWAP_OUT, 0, 0))
    s[0].remove(Action(Kind.SWAP_IN, 0, 0))
    with pytest.raises(ScheduleError, match=r"\(B0.0\): runs before SI0.0"):  # every microbatch of a swapping stage
        check_schedules(mapping, 2, s)
    with pytest.raises(ValueError, match="stage 3 is the last"):
        build_schedule(mapping, 1, 2, frozenset({3}))
    mapping, s = _swapped()
    s[1].insert(0, Action(Kind.SWAP_OUT, 3, 0))
    with pytest.raises(ScheduleError, match="the last stage's forward is fused"):
        check_schedules(mapping, 2, s)
