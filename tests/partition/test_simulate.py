"""The step simulator against timelines worked out by hand, and its invariants on random plans.

All times are dyadic (0.25, 0.5, ...) so every sum is exact and the asserts use ==. The shared-link tests
use GB/s and byte counts whose quotients are dyadic too, except where a share is a third (then approx).
"""

import dataclasses

import numpy as np
import pytest

from partition.flows import FlowNet, TaskGraph
from partition.simulate import SimStage, link_paths, simulate
from topology import cpu_standin, preset
from topology.types import Gpu, RootComplex, Switch, Topology


def _st(gpu, fwd, bwd, load, offload, update, comm):
    return SimStage(gpu=gpu, fwd_s=fwd, bwd_s=bwd, load_s=load, offload_s=offload, update_s=update, comm_s=comm)


def _ev(res, kind, j, i=-1):
    """(start, end) of the single event of `kind` for stage j, microbatch i."""
    hits = [(e[4], e[5]) for e in res.events if e[0] == kind and e[2] == j and e[3] == i]
    assert len(hits) == 1, (kind, j, i, hits)
    return hits[0]


def _loads(res, j):
    return [(e[4], e[5]) for e in res.events if e[0] == "load" and e[2] == j]


def test_one_gpu_one_stage_two_microbatches():
    # load [0, .5]; F0 [.5, 1.5], F1 [1.5, 2.5]; the stage stays resident, so no second load;
    # B = F + B = 3 each: B0 [2.5, 5.5], B1 [5.5, 8.5]; offload [8.5, 8.75]; update [8.75, 8.875].
    res = simulate([_st(0, 1.0, 2.0, 0.5, 0.25, 0.125, 0.0)], num_gpus=1, microbatches=2)
    assert _loads(res, 0) == [(0.0, 0.5)]
    assert _ev(res, "F", 0, 0) == (0.5, 1.5)
    assert _ev(res, "F", 0, 1) == (1.5, 2.5)
    assert _ev(res, "B", 0, 0) == (2.5, 5.5)
    assert _ev(res, "B", 0, 1) == (5.5, 8.5)
    assert _ev(res, "offload", 0) == (8.5, 8.75)
    assert _ev(res, "update", 0) == (8.75, 8.875)
    assert res.step_time_s == 8.875
    assert res.compute_busy_s == (8.0,)
    assert len(res.events) == 1 + 2 + 2 + 1 + 1


def test_two_gpus_two_stages_with_comm():
    # s0 on gpu0: F 1, B 1, load .5, offload .25, update .5, comm .25 (its output to gpu1 and the gradient back)
    # s1 on gpu1: F 2, B 1, load 1,  offload .5,  update .25
    stages = [_st(0, 1.0, 1.0, 0.5, 0.25, 0.5, 0.25), _st(1, 2.0, 1.0, 1.0, 0.5, 0.25, 0.0)]
    res = simulate(stages, num_gpus=2, microbatches=2)
    # gpu0: load [0, .5]; F(0,0) [.5, 1.5]; F(0,1) [1.5, 2.5]
    assert _loads(res, 0) == [(0.0, 0.5)]
    assert _ev(res, "F", 0, 0) == (0.5, 1.5)
    assert _ev(res, "F", 0, 1) == (1.5, 2.5)
    # gpu1: load [0, 1]; F(1,0) waits for 1.5 + .25 -> [1.75, 3.75]; F(1,1): arrival 2.75 < 3.75 -> [3.75, 5.75]
    assert _loads(res, 1) == [(0.0, 1.0)]
    assert _ev(res, "F", 1, 0) == (1.75, 3.75)
    assert _ev(res, "F", 1, 1) == (3.75, 5.75)
    # gpu1 backward (3 s each, no wait: last stage): [5.75, 8.75], [8.75, 11.75]; offload [11.75, 12.25]
    assert _ev(res, "B", 1, 0) == (5.75, 8.75)
    assert _ev(res, "B", 1, 1) == (8.75, 11.75)
    assert _ev(res, "offload", 1) == (11.75, 12.25)
    # gpu0 backward (2 s each): gradient arrives 8.75 + .25 = 9 -> [9, 11]; then 11.75 + .25 = 12 -> [12, 14]
    assert _ev(res, "B", 0, 0) == (9.0, 11.0)
    assert _ev(res, "B", 0, 1) == (12.0, 14.0)
    assert _ev(res, "offload", 0) == (14.0, 14.25)
    # host Adam: s1 [12.25, 12.5], s0 [14.25, 14.75]
    assert _ev(res, "update", 1) == (12.25, 12.5)
    assert _ev(res, "update", 0) == (14.25, 14.75)
    assert res.step_time_s == 14.75
    assert res.compute_busy_s == (2.0 + 4.0, 4.0 + 6.0)


def test_two_gpus_four_stages_unhidden_load_stalls():
    # mapping [0, 1, 0, 1]; every stage F 1, B 2 (a backward visit takes 3 per microbatch), comm .5,
    # offload .5. Stage 2's load takes 4 s, longer than stage 0's forward visit (2 s): it cannot hide.
    # s3's update is 4 s, so the host Adam queue is visible too.
    stages = [
        _st(0, 1.0, 2.0, 1.0, 0.5, 0.25, 0.5),
        _st(1, 1.0, 2.0, 1.0, 0.5, 0.25, 0.5),
        _st(0, 1.0, 2.0, 4.0, 0.5, 0.25, 0.5),
        _st(1, 1.0, 2.0, 1.0, 0.5, 4.0, 0.0),
    ]
    res = simulate(stages, num_gpus=2, microbatches=2)
    # gpu0 visits F0 F2 B2 B0, gpu1 visits F1 F3 B3 B1 (slots alternate 0, 1, 1 (resident), 0).
    # gpu0: load s0 [0, 1] (slot 0); F(0,0) [1, 2], F(0,1) [2, 3]; slot 0 free at 3.
    #       load s2 prefetched into slot 1 as soon as the copy engine is free: [1, 5].
    assert _loads(res, 0)[0] == (0.0, 1.0)
    assert _ev(res, "F", 0, 0) == (1.0, 2.0)
    assert _ev(res, "F", 0, 1) == (2.0, 3.0)
    assert _loads(res, 2) == [(1.0, 5.0)]
    # gpu1: load s1 [0, 1]; F(1,0) waits 2 + .5 -> [2.5, 3.5]; F(1,1) 3 + .5 -> [3.5, 4.5]. load s3 [1, 2].
    assert _loads(res, 1)[0] == (0.0, 1.0)
    assert _ev(res, "F", 1, 0) == (2.5, 3.5)
    assert _ev(res, "F", 1, 1) == (3.5, 4.5)
    assert _loads(res, 3) == [(1.0, 2.0)]
    # STALL: F(2,0)'s input arrived at 3.5 + .5 = 4 and gpu0 was idle from 3, but s2's weights land at 5.
    assert _ev(res, "F", 2, 0) == (5.0, 6.0)
    assert _ev(res, "F", 2, 1) == (6.0, 7.0)  # input arrived at 4.5 + .5 = 5
    # gpu1: F(3,0) input 6 + .5 -> [6.5, 7.5]; F(3,1) 7 + .5 -> [7.5, 8.5]; s3 stays resident:
    # B(3,0) [8.5, 11.5], B(3,1) [11.5, 14.5]; offload [14.5, 15].
    assert _ev(res, "F", 3, 0) == (6.5, 7.5)
    assert _ev(res, "F", 3, 1) == (7.5, 8.5)
    assert _ev(res, "B", 3, 0) == (8.5, 11.5)
    assert _ev(res, "B", 3, 1) == (11.5, 14.5)
    assert _ev(res, "offload", 3) == (14.5, 15.0)
    # gpu1 reloads s1 into slot 0 (free since 4.5), engine free since 2: [4.5, 5.5].
    assert _loads(res, 1)[1] == (4.5, 5.5)
    # gpu0: B(2,0) gradient 11.5 + .5 -> [12, 15]; B(2,1) 14.5 + .5 -> [15, 18]; offload [18, 18.5].
    assert _ev(res, "B", 2, 0) == (12.0, 15.0)
    assert _ev(res, "B", 2, 1) == (15.0, 18.0)
    assert _ev(res, "offload", 2) == (18.0, 18.5)
    # gpu0 reloads s0 into slot 0 (free since 3), engine free since 5: [5, 6].
    assert _loads(res, 0)[1] == (5.0, 6.0)
    # gpu1: B(1,0) 15 + .5 -> [15.5, 18.5]; B(1,1) 18 + .5 -> [18.5, 21.5]; offload [21.5, 22].
    assert _ev(res, "B", 1, 0) == (15.5, 18.5)
    assert _ev(res, "B", 1, 1) == (18.5, 21.5)
    assert _ev(res, "offload", 1) == (21.5, 22.0)
    # gpu0: B(0,0) 18.5 + .5 -> [19, 22]; B(0,1) 21.5 + .5 -> [22, 25]; offload [25, 25.5].
    assert _ev(res, "B", 0, 0) == (19.0, 22.0)
    assert _ev(res, "B", 0, 1) == (22.0, 25.0)
    assert _ev(res, "offload", 0) == (25.0, 25.5)
    # host Adam, one stage at a time in offload order: s3 [15, 19]; s2 arrived 18.5 but waits -> [19, 19.25];
    # s1 [22, 22.25]; s0 [25.5, 25.75].
    assert _ev(res, "update", 3) == (15.0, 19.0)
    assert _ev(res, "update", 2) == (19.0, 19.25)
    assert _ev(res, "update", 1) == (22.0, 22.25)
    assert _ev(res, "update", 0) == (25.5, 25.75)
    assert res.step_time_s == 25.75
    assert res.compute_busy_s == (16.0, 16.0)


def test_load_hidden_when_shorter_than_previous_visit():
    """The same plan with stage 2's load at 1 s: it hides under stage 0's forward, F(2,0) starts on arrival."""
    stages = [
        _st(0, 1.0, 2.0, 1.0, 0.5, 0.25, 0.5),
        _st(1, 1.0, 2.0, 1.0, 0.5, 0.25, 0.5),
        _st(0, 1.0, 2.0, 1.0, 0.5, 0.25, 0.5),
        _st(1, 1.0, 2.0, 1.0, 0.5, 0.25, 0.0),
    ]
    res = simulate(stages, num_gpus=2, microbatches=2)
    assert _loads(res, 2) == [(1.0, 2.0)]
    assert _ev(res, "F", 2, 0) == (4.0, 5.0)  # input arrival 3.5 + .5, weights there since 2


def test_prefetch_waits_for_slot_release():
    """Three stages on one gpu: the third load needs the first stage's slot, freed when its visit ends."""
    stages = [
        _st(0, 2.0, 1.0, 0.5, 0.0, 0.0, 0.0),
        _st(0, 2.0, 1.0, 0.5, 0.0, 0.0, 0.0),
        _st(0, 2.0, 1.0, 0.5, 0.0, 0.0, 0.0),
    ]
    res = simulate(stages, num_gpus=1, microbatches=1)
    # visits F0 F1 F2 B2 B1 B0 use slots 0 1 0 0(resident) 1 0.
    # load s0 [0, .5] (slot 0), s1 [.5, 1] (slot 1); F0 [.5, 2.5] frees slot 0 -> load s2 [2.5, 3];
    # F1 [2.5, 4.5] frees slot 1; F2 [4.5, 6.5]; B2 resident [6.5, 9.5]; s1 again into slot 1 (free at
    # 4.5, engine free since 3): [4.5, 5]; B1 [9.5, 12.5]; s0 into slot 0, freed by B2 at 9.5: [9.5, 10];
    # B0 [12.5, 15.5]; offloads and updates take 0.
    assert _loads(res, 0) == [(0.0, 0.5), (9.5, 10.0)]
    assert _loads(res, 1) == [(0.5, 1.0), (4.5, 5.0)]
    assert _loads(res, 2) == [(2.5, 3.0)]
    assert _ev(res, "F", 2, 0) == (4.5, 6.5)
    assert _ev(res, "B", 0, 0) == (12.5, 15.5)
    assert res.step_time_s == 15.5


def _random_stages(rng, num_gpus, mapping):
    def q():
        return float(rng.integers(1, 16)) / 4  # dyadic

    return [_st(g, q(), q(), q(), q() / 2, q() / 4, q() / 2) for g in mapping]


@pytest.mark.parametrize("seed", [0, 5, 13, 29, 97])
def test_invariants_on_random_plans(seed):
    rng = np.random.default_rng(seed)
    for _ in range(15):
        n = int(rng.integers(1, 5))
        s = int(rng.integers(n, 3 * n + 2))
        if rng.random() < 0.5:
            mapping = [j % n for j in range(s)]
        else:  # any assignment is a valid plan, not only cyclic ones
            mapping = list(range(n)) + [int(x) for x in rng.integers(0, n, s - n)]
            rng.shuffle(mapping)
        m = int(rng.choice([1, 2, 3, 5]))
        stages = _random_stages(rng, n, mapping)
        res = simulate(stages, n, m)  # never a deadlock on a valid plan
        _check_invariants(res, stages, n, m)


def _check_invariants(res, stages, n, m):
    S = len(stages)
    ev = {}
    for e in res.events:
        ev.setdefault((e[0], e[2], e[3]), []).append(e)
        assert e[4] <= e[5]
    for j, st in enumerate(stages):
        for i in range(m):
            (f,), (b,) = ev[("F", j, i)], ev[("B", j, i)]
            assert f[1] == b[1] == st.gpu
            assert f[5] - f[4] == st.fwd_s and b[5] - b[4] == st.fwd_s + st.bwd_s
            if j > 0:
                assert f[4] >= ev[("F", j - 1, i)][0][5] + stages[j - 1].comm_s
            if j < S - 1:
                assert b[4] >= ev[("B", j + 1, i)][0][5] + st.comm_s
        (off,), (upd,) = ev[("offload", j, -1)], ev[("update", j, -1)]
        assert off[4] >= ev[("B", j, m - 1)][0][5] and upd[4] >= off[5]
    for g in range(n):
        mine = [j for j in range(S) if stages[j].gpu == g]
        if not mine:
            continue
        # one load per visit, except the gpu's last forward stage, which stays for its backward
        for j in mine:
            assert len(ev[("load", j, -1)]) == (1 if j == mine[-1] else 2), (g, j, mine)
        for kind in ("load", "compute", "offload"):
            kinds = ("F", "B") if kind == "compute" else (kind,)
            spans = sorted((e[4], e[5]) for e in res.events if e[1] == g and e[0] in kinds)
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), (g, kind)  # one engine each
        busy = sum(m * (2 * stages[j].fwd_s + stages[j].bwd_s) for j in mine)
        assert res.compute_busy_s[g] == busy
    upd = sorted((e[4], e[5]) for e in res.events if e[0] == "update")
    assert all(a[1] <= b[0] for a, b in zip(upd, upd[1:]))  # the host runs one Adam at a time
    assert res.step_time_s == max(e[5] for e in res.events)


def test_compute_waits_for_its_weights():
    """Every computation of a visit starts after that visit's weights arrived."""
    rng = np.random.default_rng(11)
    mapping = [0, 1, 2, 0, 1, 2, 0]
    stages = _random_stages(rng, 3, mapping)
    res = simulate(stages, 3, 3)
    for j in range(len(stages)):
        loads = _loads(res, j)
        fs = [e[4] for e in res.events if e[0] == "F" and e[2] == j]
        bs = [e[4] for e in res.events if e[0] == "B" and e[2] == j]
        assert min(fs) >= loads[0][1]
        assert min(bs) >= loads[-1][1]


def test_gpu_without_stage_and_empty():
    res = simulate([_st(0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0)], num_gpus=2, microbatches=1)
    assert res.compute_busy_s == (3.0, 0.0)
    assert simulate([], num_gpus=1, microbatches=1).step_time_s == 0.0


def test_deadlock_is_reported_not_hung():
    """A stage on a gpu that does not exist never runs: its neighbours wait forever, simulate() says so."""
    stages = [_st(0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0), _st(5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0)]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(stages, num_gpus=2, microbatches=2)


def test_next_backward_waits_for_the_gradient_slot():
    # One gpu, stages 0 and 1, one microbatch; fwd 1, bwd 1, load 0.5, offload 4, no update, no comm.
    #   load0 0-0.5, F0 0.5-1.5, load1 0.5-1.0, F1 1.5-2.5, B1 (resident) 2.5-4.5, offload1 4.5-8.5,
    #   load0 (slot of F0, free at 1.5) 1.5-2.0, B0 waits for the one gradient slot: 8.5-10.5,
    #   offload0 10.5-14.5 -> step 14.5
    st = [_st(0, 1.0, 1.0, 0.5, 4.0, 0.0, 0.0), _st(0, 1.0, 1.0, 0.5, 4.0, 0.0, 0.0)]
    res = simulate(st, 1, 1)
    assert _ev(res, "B", 0, 0) == (8.5, 10.5)
    assert res.step_time_s == 14.5


# ---- shared links (topology given) ----


def _box(rcs, link=16.0, switches=()):
    """gpus per root complex: rcs = {"rc0": (uplink GB/s, [gpu, ...])}; switches = (name, rc, GB/s, [gpus])."""
    on_switch = {g: name for name, _, _, gs in switches for g in gs}
    gpus = sorted((g, rc) for rc, (_, gs) in rcs.items() for g in gs)
    roots = tuple(RootComplex(r, 0, up) for r, (up, _) in rcs.items())
    return Topology(
        name="box",
        source="test",
        root_complexes=roots,
        switches=tuple(Switch(n, rc, up) for n, rc, up, _ in switches),
        gpus=tuple(
            Gpu(
                index=g,
                name="t",
                memory_bytes=2**30,
                pci_bus_id=f"0000:{g:02x}:00.0",
                root_complex=rc,
                numa_node=0,
                link_gbps=link,
                switch=on_switch.get(g, ""),
            )
            for g, rc in gpus
        ),
    )


def _fst(gpu, param, grad=0, fwd=1.0, bwd=1.0, load=0.0, offload=0.0, act=0, out=0):
    return SimStage(
        gpu=gpu,
        fwd_s=fwd,
        bwd_s=bwd,
        load_s=load,
        offload_s=offload,
        update_s=0.0,
        comm_s=0.0,
        param_bytes=param,
        grad_bytes=grad,
        activation_bytes=act,
        output_bytes=out,
    )


def _bytes(res):
    return {(n, d): b for n, d, b in res.link_bytes}


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


def test_busy_fraction_and_peak_memory_one_stage():
    # test_one_gpu_one_stage_two_microbatches: the weight slot is held [0, 8.5], the gradient slot from B(0,0)
    # at 2.5 to the offload's end at 8.75: two slots of 100 bytes at once, plus 7 bytes of activations.
    st = dataclasses.replace(
        _st(0, 1.0, 2.0, 0.5, 0.25, 0.125, 0.0), param_bytes=100, grad_bytes=100, activation_bytes=7
    )
    res = simulate([st], num_gpus=1, microbatches=2)
    assert res.busy_fraction == (8.0 / 8.875,)
    assert res.peak_arena_bytes == (200,) and res.activation_bytes == (7,) and res.peak_memory_bytes == (207,)
    assert res.link_bytes == (("gpu0", "h2d", 100), ("gpu0", "d2h", 100))
    assert res.stage_bytes == ((100, 100),) and res.link_model == "static"
    d = res.to_dict()
    assert d["busy_fraction"] == [8.0 / 8.875] and d["link_bytes"][0] == {
        "link": "gpu0",
        "direction": "h2d",
        "bytes": 100,
    }


def test_peak_arena_reaches_three_slots():
    # test_next_backward_waits_for_the_gradient_slot: s0 in slot 0 from 0, s1 in slot 1 from 0.5; F0 ends at 1.5
    # and frees slot 0; s0 is reloaded into it at 1.5; at 2.5 B1 takes the gradient slot: three slots (the
    # slot size is the larger stage, 300 bytes). Activations: the larger of the gpu's stages.
    st = [
        dataclasses.replace(_st(0, 1.0, 1.0, 0.5, 4.0, 0.0, 0.0), param_bytes=300, grad_bytes=300, activation_bytes=5),
        dataclasses.replace(_st(0, 1.0, 1.0, 0.5, 4.0, 0.0, 0.0), param_bytes=200, grad_bytes=200, activation_bytes=9),
    ]
    res = simulate(st, 1, 1)
    assert res.peak_arena_bytes == (900,) and res.activation_bytes == (9,)
    two = simulate([dataclasses.replace(s, gpu=g) for g, s in enumerate(st)], 2, 1)
    assert two.peak_arena_bytes == (600, 600) and two.activation_bytes == (5, 9)


def test_sim_stages_carry_the_plans_bytes():
    from partition.analytic import analytic_profile
    from partition.hardware import device_spec
    from partition.models import get_model
    from partition.search import make_plan, sim_stages

    topo = preset("2+2")
    plan = make_plan(
        analytic_profile(get_model("gpt3-125m"), device_spec(topo.gpus[0].name)),
        topo,
        4,
        reserve_bytes=2**30,
        solver="dp",
    )
    st = sim_stages(plan.stages, topo)
    assert [(s.param_bytes, s.grad_bytes, s.activation_bytes, s.output_bytes) for s in st] == [
        (p.param_bytes, p.param_bytes, p.activation_bytes, p.output_bytes) for p in plan.stages
    ]
    res = simulate(st, 4, 4, topology=topo)
    assert max(res.peak_arena_bytes) <= plan.arena_bytes and max(res.activation_bytes) <= plan.activation_bytes
    assert all(0 < f <= 1 for f in res.busy_fraction)
    b = _bytes(res)
    loads = sum(st[e[2]].param_bytes for e in res.events if e[0] == "load")
    acts = sum(2 * 4 * s.output_bytes for j, s in enumerate(st[:-1]) if s.gpu != st[j + 1].gpu)
    assert b[("rc0", "h2d")] + b[("rc1", "h2d")] == loads + acts  # weights down, activations up and down
