"""place_states: the tiers of a rank's stages under a host budget, against hand-computed byte counts
(bf16: 2 bytes per weight and gradient; 12 bytes of optimizer states per parameter)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partition.rules.placement import LEAST_SHARE_BYTES, BudgetShortfall, HostCopies, host_bytes, place_states

PARAMS = {0: 1000, 2: 50_000, 4: 20_000}
LEAST = LEAST_SHARE_BYTES  # 64 KiB: the Adam's 4 slots of one 4 KiB-aligned group, and 4 staging pages


def test_host_bytes_per_choice():
    assert host_bytes(10, "host", "host", 2) == 10 * (12 + 2 + 2)
    assert host_bytes(10, "host", "host", 4) == 10 * (12 + 4)  # fp32 loads the master: no second copy
    assert host_bytes(10, "ssd", "host", 2) == 10 * 4
    assert host_bytes(10, "ssd", "ssd", 2) == 0
    # the delayed update keeps the loaded weights and the gradients twice (fp32: copies of the master, not it)
    two = HostCopies(versions=2)
    assert host_bytes(10, "host", "host", 2, two) == 10 * (12 + 2 * 2 + 2 * 2)
    assert host_bytes(10, "host", "host", 4, two) == 10 * (12 + 2 * 4 + 2 * 4)
    assert host_bytes(10, "ssd", "host", 2, two) == 10 * 8


def test_the_speculative_updates_copy_counts_what_it_overwrites_in_memory():
    """The master and moments (12) where the optimizer is in memory, and the weights it writes (b) unless they are
    the master itself (fp32, one version); nothing for stages streamed from SSD (a second set of records there)."""
    undo = HostCopies(undo=True)
    assert host_bytes(10, "host", "host", 2, undo) == 10 * (12 + 2 + 2 + 12 + 2)
    assert host_bytes(10, "host", "host", 4, undo) == 10 * (12 + 4 + 12)
    assert host_bytes(10, "host", "host", 4, HostCopies(versions=2, undo=True)) == 10 * (12 + 8 + 8 + 12 + 4)
    assert host_bytes(10, "ssd", "host", 2, undo) == 10 * (2 + 2 + 2)
    assert host_bytes(10, "ssd", "ssd", 2, undo) == 0
    assert host_bytes(10, "device", "device", 2, undo) == 0
    assert LEAST == 65536


def test_accumulation_counts_the_buffer_a_passs_gradients_arrive_in():
    """train.accumulation_steps > 1: the host tiers copy each later pass's gradients into a buffer of their own
    (b n) before adding them; it was counted by no budget. None where the gradients are not in memory."""
    acc = HostCopies(accumulates=True)
    assert host_bytes(10, "host", "host", 2, acc) == 10 * (12 + 2 + 2 + 2)
    assert host_bytes(10, "host", "host", 4, acc) == 10 * (12 + 4 + 4)
    assert host_bytes(10, "ssd", "host", 2, acc) == 10 * (2 + 2 + 2)
    assert host_bytes(10, "ssd", "ssd", 2, acc) == 0
    assert host_bytes(10, "device", "device", 2, acc) == 0


def test_a_runs_accumulation_reaches_its_copies():
    from mobiuspipe.config import RunConfig
    from mobiuspipe.startup.config_plan import run_budget, run_copies
    from partition.rules.tiers import copies_of

    one = RunConfig.from_dict({})
    two = RunConfig.from_dict({"train": {"accumulation_steps": 2}})
    assert not run_copies(one).accumulates and run_copies(two).accumulates
    assert copies_of(run_budget(two)).accumulates and not copies_of(run_budget(one)).accumulates


def test_auto_moves_optimizer_states_then_weights_largest_first():
    everything = 16 * 71_000  # 1,136,000 bytes
    p = place_states("auto", "auto", PARAMS, everything, LEAST, 2)
    assert p.on_ssd == [] and p.slot_bytes == 0
    # 900,000: stage 2's states move; 16 * 21,000 + 4 * 50,000 = 536,000 stay, 364,000 stream stage 2
    p = place_states("auto", "auto", PARAMS, 900_000, LEAST, 2)
    assert p.optimizer == {0: "host", 2: "ssd", 4: "host"} and p.slot_bytes == 364_000
    assert set(p.weights.values()) == {"host"}
    # 500,000: stages 2 and 4 move; 16,000 + 280,000 stay, (500,000 - 296,000) / 2 each
    p = place_states("auto", "auto", PARAMS, 500_000, LEAST, 2)
    assert p.on_ssd == [2, 4] and p.slot_bytes == 102_000 and set(p.weights.values()) == {"host"}
    # 300,000: every stage's states on SSD leave 16,000 / 3, too little; stage 2's weights move too
    p = place_states("auto", "auto", PARAMS, 300_000, LEAST, 2)
    assert p.on_ssd == [0, 2, 4] and p.weights == {0: "host", 2: "ssd", 4: "host"}
    assert p.slot_bytes == (300_000 - 4 * 21_000) // 3
    # the same budget with the weights pinned to host memory does not fit
    with pytest.raises(ValueError, match=r"284000 bytes stay .* at least 0.4583, or set memory.weights: auto"):
        place_states("auto", "host", PARAMS, 300_000, LEAST, 2)


def test_fixed_tiers_share_the_budget_evenly():
    p = place_states("ssd", "ssd", PARAMS, 3 * LEAST, LEAST, 2)
    assert p.on_ssd == [0, 2, 4] and p.slot_bytes == LEAST and set(p.weights.values()) == {"ssd"}
    p = place_states("ssd", "host", PARAMS, 3 * LEAST + 4 * 71_000, LEAST, 2)
    assert p.slot_bytes == LEAST and set(p.weights.values()) == {"host"}
    with pytest.raises(ValueError, match="does not hold the rank.s 3 stages"):
        place_states("ssd", "host", PARAMS, 3 * LEAST + 4 * 71_000 - 3, LEAST, 2)
    p = place_states("host", "host", PARAMS, 1, LEAST, 2)  # host: the budget is not enforced
    assert p.on_ssd == [] and p.slot_bytes == 0
    with pytest.raises(ValueError, match="at least 0.1875"):
        place_states("auto", "auto", PARAMS, 100_000, LEAST, 2)  # even everything on SSD: 33,333 each


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.integers(0, 9), st.integers(1, 3_000_000), min_size=1, max_size=5),
    st.sampled_from(
        [("host", "host"), ("ssd", "host"), ("ssd", "ssd"), ("auto", "host"), ("auto", "auto"), ("ssd", "auto")]
    ),
    st.sampled_from([2, 4]),
    st.integers(0, 80_000_000),
)
def test_a_shortfall_names_the_least_budget_that_holds(params, tiers, b, budget):
    """Whatever fails names a budget that holds the stages, and that budget does (odd sizes, every setting)."""
    optimizer, weights = tiers
    try:
        place_states(optimizer, weights, params, budget, LEAST, b)
    except BudgetShortfall as e:
        assert e.need > budget and e.fix.startswith("raise memory.host_budget_mb")
        place_states(optimizer, weights, params, e.need, LEAST, b)  # raises if the named budget does not hold them
