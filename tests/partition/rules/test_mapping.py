"""Stage -> gpu mappings: cross mapping against round-robin and against every permutation."""

import itertools

import pytest

from partition.rules.mapping import MAPPING_RULES, cross_mapping, make_mapping, round_robin, stage_contention
from topology.presets import cpu_standin, preset


def _rc(topo, g):
    return topo.gpus[g].root_complex


def _total(topo, mapping):
    """Sum of contention(i, j) = shared / |i - j| over pairs i < j less than N apart, written out directly."""
    n = topo.num_gpus
    return sum(
        1.0 / (j - i)
        for i in range(len(mapping))
        for j in range(i + 1, min(len(mapping), i + n))
        if mapping[i] != mapping[j] and _rc(topo, mapping[i]) == _rc(topo, mapping[j])
    )


def _cyclic(topo, pi):
    """Total contention over one period of the endless mapping pi, pi, pi, ..."""
    n = len(pi)
    return sum(
        1.0 / d
        for j in range(n)
        for d in range(1, n)
        if pi[j] != pi[(j + d) % n] and _rc(topo, pi[j]) == _rc(topo, pi[(j + d) % n])
    )


def test_round_robin():
    assert round_robin(7, 3) == [0, 1, 2, 0, 1, 2, 0]
    assert round_robin(1, 1) == [0]
    assert make_mapping("round-robin", preset("2+2"), 5) == [0, 1, 2, 3, 0]


@pytest.mark.parametrize("s", [4, 5, 7, 8, 13, 98])
def test_cross_on_2_plus_2_alternates_root_complexes(s):
    topo = preset("2+2")
    m = cross_mapping(topo, s)
    assert len(m) == s and sorted(set(m)) == [0, 1, 2, 3]
    assert all(_rc(topo, a) != _rc(topo, b) for a, b in zip(m, m[1:])), m
    assert all(m[j] == m[j % 4] for j in range(s))  # cyclic
    assert _total(topo, m) < _total(topo, round_robin(s, 4))
    assert sum(stage_contention(topo, m)) < sum(stage_contention(topo, round_robin(s, 4)))
    assert make_mapping("cross", topo, s) == m


def test_cross_on_2_plus_2_cyclic_cost_by_hand():
    # pi = (0, 2, 1, 3): distance 1 and 3 pairs always cross root complexes; distance 2 pairs
    # (0,1), (2,3), (1,0), (3,2) share one -> 4 * 1/2 = 2. Round-robin (0,1,2,3): distance 1 pairs
    # (0,1) and (2,3) -> 2; distance 3 pairs (1,0) and (3,2) -> 2/3; total 8/3.
    topo = preset("2+2")
    assert tuple(cross_mapping(topo, 4)) in {(0, 2, 1, 3), (0, 3, 1, 2)}
    assert _cyclic(topo, tuple(cross_mapping(topo, 4))) == 2.0
    assert _cyclic(topo, (0, 1, 2, 3)) == pytest.approx(8 / 3, rel=1e-15)


def test_cross_on_3_plus_1_is_optimal_over_every_permutation():
    topo = preset("3+1")
    m = cross_mapping(topo, 4)
    assert sorted(m) == [0, 1, 2, 3]
    costs = {p: _cyclic(topo, p) for p in itertools.permutations(range(4))}
    assert _cyclic(topo, tuple(m)) == pytest.approx(min(costs.values()), rel=1e-12)
    # with three gpus under rc0 some adjacent pair must share; still round-robin is strictly worse
    assert _cyclic(topo, tuple(m)) < _cyclic(topo, (0, 1, 2, 3))
    # finite stage counts: cross is never worse than any cyclic extension of a permutation
    for s in (4, 8, 12):
        best = min(_total(topo, [p[j % 4] for j in range(s)]) for p in costs)
        assert _total(topo, cross_mapping(topo, s)) == pytest.approx(best, rel=1e-12)


def test_cross_single_gpu_and_one_root_complex():
    assert cross_mapping(cpu_standin(1, 1 << 30), 3) == [0, 0, 0]
    # everything shares one uplink: all permutations cost the same, the smallest (identity) is chosen
    assert cross_mapping(cpu_standin(3, 1 << 30), 5) == [0, 1, 2, 0, 1]


def test_stage_contention_by_hand():
    topo = preset("2+2")  # gpus 0, 1 under rc0; 2, 3 under rc1; N = 4 -> pairs up to 3 apart count
    m = [0, 1, 2, 3, 0]
    # j=0 (gpu0): stage 1 (gpu1) shares, 1 apart -> 1 + 1 = 2
    # j=1 (gpu1): stage 0 (gpu0) 1 apart, stage 4 (gpu0) 3 apart -> 1 + 1 + 1/3
    # j=2 (gpu2): stage 3 (gpu3) -> 2;  j=3 (gpu3): stage 2 -> 2
    # j=4 (gpu0): stage 1 (gpu1) 3 apart -> 1 + 1/3; stage 0 is the same gpu (4 apart anyway): no contention
    got = stage_contention(topo, m)
    assert got == pytest.approx([2.0, 1 + 1 + 1 / 3, 2.0, 2.0, 1 + 1 / 3], rel=1e-15)
    # cross: every sharing pair is 2 apart; stage 2 (gpu1) has gpu0 two before and two after it
    assert stage_contention(topo, [0, 2, 1, 3, 0]) == pytest.approx([1.5, 1.5, 2.0, 1.5, 1.5], rel=1e-15)
    # 3+1, three rc0 gpus in a row: 1 + 1 + 1/2, 1 + 1 + 1, 1 + 1/2 + 1
    assert stage_contention(preset("3+1"), [0, 1, 2]) == pytest.approx([2.5, 3.0, 2.5], rel=1e-15)
    assert stage_contention(cpu_standin(1, 1 << 30), [0, 0]) == [1.0, 1.0]


def test_stage_contention_matches_pairwise_total():
    for name in ("2+2", "3+1"):
        topo = preset(name)
        for s in (4, 7, 11):
            for m in (round_robin(s, 4), cross_mapping(topo, s)):
                assert (sum(stage_contention(topo, m)) - s) / 2 == pytest.approx(_total(topo, m), rel=1e-12)


def test_unknown_rule():
    with pytest.raises(ValueError, match="unknown mapping rule 'zigzag'.*cross"):
        make_mapping("zigzag", preset("2+2"), 4)
    assert set(MAPPING_RULES) == {"cross", "round-robin", "search"}


def test_mapping_score_by_hand():
    from partition.rules.mapping import mapping_score

    t = preset("2+2")
    # round-robin over 4 stages: pairs (0,1) d=1 shared, (2,3) d=1 shared, (1,2)... not; (0,3) d=3 not, (1,3) no
    assert mapping_score(t, [0, 1, 2, 3]) == pytest.approx(2.0)
    # cross: (0,2) no, (2,1) no, (1,3) no; d=2: (0,1) shared 1/2, (2,3) shared 1/2; d=3: (0,3) no
    assert mapping_score(t, [0, 2, 1, 3]) == pytest.approx(1.0)


def test_search_offers_every_cyclic_order_up_to_four_gpus():
    from partition.rules.mapping import mapping_candidates

    orders = mapping_candidates("search", preset("2+2"), 5)
    assert len(orders) == 6 and all(m[0] == 0 and sorted(m[:4]) == [0, 1, 2, 3] for m in orders)
    assert mapping_candidates("cross", preset("2+2"), 4) == [[0, 2, 1, 3]]
    with pytest.raises(ValueError, match="at most 4 gpus, found 8"):
        mapping_candidates("search", preset("8-dual-socket"), 8)
