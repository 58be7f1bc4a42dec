"""The visit order of a gpu: forwards of its stages ascending, then backwards descending."""

from partition.rules.costmodel import ARENA_SLOTS, GRAD_SLOTS, WEIGHT_SLOTS
from partition.rules.order import Visit, freed_by, gpu_visits, visits_of


def test_forwards_ascending_then_backwards_descending():
    mapping = [0, 1, 0, 1, 0]
    assert visits_of(mapping, 0) == [(0, "F"), (2, "F"), (4, "F"), (4, "B"), (2, "B"), (0, "B")]
    assert visits_of(mapping, 1) == [Visit(1, "F"), Visit(3, "F"), Visit(3, "B"), Visit(1, "B")]
    assert visits_of(mapping, 2) == []


def test_gpu_visits_lists_the_gpus_that_hold_a_stage():
    assert gpu_visits([2, 0, 2]) == {0: [(1, "F"), (1, "B")], 2: [(0, "F"), (2, "F"), (2, "B"), (0, "B")]}
    assert gpu_visits([]) == {}
    v = gpu_visits([0])[0][0]
    assert (v.stage, v.phase) == (0, "F")


def test_arena_slots_are_weight_slots_plus_the_gradient_slot():
    assert (WEIGHT_SLOTS, GRAD_SLOTS, ARENA_SLOTS) == (2, 1, 3)


def test_a_load_takes_the_slot_of_the_load_before_the_previous_one():
    """gpu 0 of [0, 1, 0, 1, 0]: F0 F2 F4 B4 B2 B0; B4 is resident, so B2's load takes F2's slot (freed when
    F2 ends), and B0's the slot of F4's load, which B4 used last."""
    visits = visits_of([0, 1, 0, 1, 0], 0)
    loaded = [0, 1, 2, 4, 5]  # visit 3 (B4) loads nothing
    assert [freed_by(visits, k) for k in loaded] == [None, None, 0, 1, 3]
