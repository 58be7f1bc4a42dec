"""The step simulator with shared links (a topology given): flows share each link's GB/s, against timelines
worked out by hand. GB/s and byte counts give dyadic quotients, so the asserts use ==, except where a share is a
third (then approx)."""

import dataclasses

import numpy as np
import pytest

from partition.sim.flows import FlowNet, TaskGraph
from partition.sim.simulate import link_paths, simulate
from tests.partition.sim_cases import _box, _bytes, _check_invariants, _ev, _fst, _loads, _random_stages, _st
from topology import cpu_standin, preset


def test_two_gpus_under_one_uplink_each_get_half():
    # gpus 0 and 1 share rc0 (16 GB/s; their own links 16). Stage 0 on gpu 0, stage 1 on gpu 1, one microbatch,
    # 8 GB of weights, 4 GB of gradients each. Both loads start at 0 and share the uplink: 8 GB/s each, [0, 1].
    # F(0,0) [1, 2]; F(1,0) [2, 3]; B(1,0) resident [3, 5]; offload s1 alone on the d2h side: 4e9 / 16e9 -> [5, 5.25];
    # B(0,0) [5, 7]; offload s0 [7, 7.25]. Static load_s = 0.5 (the link alone) gives 6.75 instead.
    topo = _box({"rc0": (16.0, [0, 1])})
    stages = [
        _fst(0, 8_000_000_000, 4_000_000_000, load=0.5, offload=0.25),
        _fst(1, 8_000_000_000, 4_000_000_000, load=0.5, offload=0.25),
    ]
    res = simulate(stages, 2, 1, topology=topo)
    assert _loads(res, 0) == [(0.0, 1.0)] and _loads(res, 1) == [(0.0, 1.0)]
    assert _ev(res, "F", 0, 0) == (1.0, 2.0) and _ev(res, "F", 1, 0) == (2.0, 3.0)
    assert _ev(res, "B", 1, 0) == (3.0, 5.0) and _ev(res, "offload", 1) == (5.0, 5.25)
    assert _ev(res, "B", 0, 0) == (5.0, 7.0) and _ev(res, "offload", 0) == (7.0, 7.25)
    assert res.step_time_s == 7.25 and res.link_model == "flows:box"
    assert simulate(stages, 2, 1).step_time_s == 6.75  # the static model: each load alone, 0.5 s
    b = _bytes(res)
    assert b[("gpu0", "h2d")] == b[("gpu1", "h2d")] == 8e9 and b[("rc0", "h2d")] == 16e9
    assert b[("gpu0", "d2h")] == 4e9 and b[("rc0", "d2h")] == 8e9


def test_a_flow_alone_and_separate_root_complexes():
    """The same two stages with gpu 1 under its own root complex: no sharing, each load 8e9 / 16e9 = 0.5 s."""
    topo = _box({"rc0": (16.0, [0]), "rc1": (16.0, [1])})
    stages = [_fst(0, 8_000_000_000, 4_000_000_000), _fst(1, 8_000_000_000, 4_000_000_000)]
    res = simulate(stages, 2, 1, topology=topo)
    assert _loads(res, 0) == [(0.0, 0.5)] and _loads(res, 1) == [(0.0, 0.5)]
    assert res.step_time_s == 6.75
    b = _bytes(res)
    assert b[("rc0", "h2d")] == b[("rc1", "h2d")] == 8e9


def test_a_flow_that_ends_hands_its_share_to_the_next_load():
    # rc0 12 GB/s, three gpus (links 12). Mapping [0, 1, 0, 2]: at 0 three loads share the uplink, 4 GB/s each:
    # s0 (2 GB) ends at 0.5; gpu 0's copy engine then loads s2 (5 GB), still three flows at 4 GB/s. s1 and s3
    # (6 GB each) had 4 GB left at 0.5: they end at 0.5 + 4/4 = 1.5, when s2 has 1 GB left; alone on the
    # uplink it gets its whole 12 GB/s link: 1.5 + 1/12.
    topo = _box({"rc0": (12.0, [0, 1, 2])}, link=12.0)
    stages = [
        _fst(0, 2_000_000_000, fwd=4.0),
        _fst(1, 6_000_000_000, fwd=4.0),
        _fst(0, 5_000_000_000, fwd=4.0),
        _fst(2, 6_000_000_000, fwd=4.0),
    ]
    res = simulate(stages, 3, 1, topology=topo)
    assert _loads(res, 0)[0] == (0.0, 0.5)
    assert _loads(res, 1)[0] == (0.0, 1.5) and _loads(res, 3) == [(0.0, 1.5)]
    ((start, end),) = _loads(res, 2)
    assert start == 0.5 and end == pytest.approx(1.5 + 1 / 12, rel=1e-12)


def test_third_flow_starting_mid_way():
    # Flows A and B (6 GB each) on a 12 GB/s uplink from 0: 6 GB/s each, 3 GB left at 0.5. Then C (3 GB) starts:
    # three flows at 4 GB/s, all end at 0.5 + 3/4 = 1.25. With C of 1 GB: C ends at 0.75; A and B have
    # 3 - 1 = 2 GB left and get 6 GB/s again: 0.75 + 1/3.
    caps = {("rc", "h2d"): 12.0, ("a", "h2d"): 12.0, ("b", "h2d"): 12.0, ("c", "h2d"): 12.0}
    for c_bytes, a_end, c_end in ((3e9, 1.25, 1.25), (1e9, 0.75 + 1 / 3, 0.75)):
        g = TaskGraph(FlowNet(caps))
        g.add("A", flows=[(6e9, (("a", "h2d"), ("rc", "h2d")))])
        g.add("B", flows=[(6e9, (("b", "h2d"), ("rc", "h2d")))])
        g.add("wait", dur=0.5)
        g.add("C", ["wait"], flows=[(c_bytes, (("c", "h2d"), ("rc", "h2d")))])
        t = g.run()
        assert t["C"].start == 0.5 and t["C"].end == pytest.approx(c_end, rel=1e-12)
        assert t["A"].end == pytest.approx(a_end, rel=1e-12) and t["B"].end == t["A"].end


def test_rate_is_the_least_share_along_the_path():
    # gpus 0 and 1 behind switch sw0 (16 GB/s), gpu 2 directly on rc0 (32 GB/s), 8 GB each. sw0 splits in two
    # (8 GB/s), rc0 in three (32/3): gpus 0, 1 move at 8, gpu 2 at 32/3 and ends at 0.75. Then rc0 splits in two
    # (16) but sw0 still gives 8: gpus 0 and 1 end at 0.75 + 2/8 = 1.0. (No max-min refill: rc0 is not full.)
    topo = _box({"rc0": (32.0, [0, 1, 2])}, switches=(("sw0", "rc0", 16.0, [0, 1]),))
    caps, paths = link_paths(topo)
    assert paths[(0, "h2d")] == (("gpu0", "h2d"), ("sw0", "h2d"), ("rc0", "h2d"))
    assert paths[(2, "d2h")] == (("gpu2", "d2h"), ("rc0", "d2h"))
    res = simulate([_fst(g, 8_000_000_000) for g in range(3)], 3, 1, topology=topo)
    assert _loads(res, 2)[0] == pytest.approx((0.0, 0.75), rel=1e-12)
    assert _loads(res, 0)[0] == pytest.approx((0.0, 1.0), rel=1e-12) and _loads(res, 1)[0] == _loads(res, 0)[0]


def test_directions_do_not_contend():
    net = FlowNet({("rc0", "h2d"): 16.0, ("rc0", "d2h"): 16.0})
    net.start("in", 8e9, (("rc0", "h2d"),))
    net.start("out", 8e9, (("rc0", "d2h"),))
    assert net.rate_gbps("in") == net.rate_gbps("out") == 16.0
    assert net.next_end() == 0.5 and sorted(map(str, net.advance(0.5))) == ["in", "out"]


def test_flows_equal_static_when_nothing_is_shared():
    """CPU stand-ins never contend (uplink = N x link): flows of load_s * link bytes give the static timeline."""
    rng = np.random.default_rng(3)
    for n, mapping in ((1, [0, 0, 0]), (2, [0, 1, 0, 1, 1]), (3, [2, 0, 1, 0, 2, 1, 0])):
        topo = cpu_standin(n, 2**30, link_gbps=10.0)
        stages = [
            dataclasses.replace(s, param_bytes=int(s.load_s * 1e10), grad_bytes=int(s.offload_s * 1e10))
            for s in _random_stages(rng, n, mapping)
        ]
        flows, static = simulate(stages, n, 3, topology=topo), simulate(stages, n, 3)
        assert [e[:4] for e in flows.events] == [e[:4] for e in static.events]
        times = lambda r: [t for e in r.events for t in e[4:]]  # noqa: E731
        assert times(flows) == pytest.approx(times(static), rel=1e-12)


@pytest.mark.parametrize("seed", [1, 8])
def test_invariants_with_shared_links(seed):
    rng = np.random.default_rng(seed)
    topo = preset("2+2")
    for _ in range(10):
        s = int(rng.integers(4, 12))
        mapping = [j % 4 for j in range(s)]
        stages = [
            dataclasses.replace(
                x,
                param_bytes=int(rng.integers(1, 8)) * 2_000_000_000,
                grad_bytes=int(rng.integers(1, 8)) * 1_000_000_000,
            )
            for x in _random_stages(rng, 4, mapping)
        ]
        m = int(rng.choice([1, 2, 4]))
        res = simulate(stages, 4, m, topology=topo)
        _check_invariants(res, stages, 4, m)
        for kind, g, j, _, start, end in res.events:  # no transfer beats its own link
            if kind in ("load", "offload"):
                nbytes = stages[j].param_bytes if kind == "load" else stages[j].grad_bytes
                assert end - start >= nbytes / (topo.gpus[g].link_gbps * 1e9) * (1 - 1e-12)
        b = _bytes(res)
        for d in ("h2d", "d2h"):
            assert b[("rc0", d)] == b[("gpu0", d)] + b[("gpu1", d)] and b[("sw1", d)] == b[("rc1", d)]
        loads = sum(stages[e[2]].param_bytes for e in res.events if e[0] == "load")
        assert sum(b[(f"gpu{g}", "h2d")] for g in range(4)) == loads


def test_activation_bytes_are_counted_on_both_paths():
    """Stage 0's 1 GB output goes gpu0 -> host -> gpu1 and its gradient back: up and down on each side."""
    topo = _box({"rc0": (16.0, [0]), "rc1": (16.0, [1])})
    stages = [_fst(0, 8_000_000_000, 4_000_000_000, out=1_000_000_000), _fst(1, 8_000_000_000, 4_000_000_000)]
    b = _bytes(simulate(stages, 2, 2, topology=topo))
    assert b[("gpu0", "h2d")] == 8e9 + 2e9 and b[("gpu0", "d2h")] == 4e9 + 2e9
    assert b[("rc1", "h2d")] == 8e9 + 2e9 and b[("rc1", "d2h")] == 4e9 + 2e9


def test_bytes_are_needed_with_a_topology():
    with pytest.raises(ValueError, match="param_bytes"):
        simulate([_st(0, 1.0, 1.0, 0.5, 0.25, 0.0, 0.0)], 1, 1, topology=cpu_standin(1, 2**30))
    with pytest.raises(ValueError, match="has 2 gpus"):
        simulate([], 1, 1, topology=cpu_standin(2, 2**30))


# ---- what the result reports ----
