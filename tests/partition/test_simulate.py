"""The step simulator against timelines worked out by hand, and its invariants on random plans.

All times are dyadic (0.25, 0.5, ...) so every sum is exact and the asserts use ==.
"""

import numpy as np
import pytest

from partition.simulate import SimStage, simulate


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
    stages = [_st(0, 1.0, 2.0, 1.0, 0.5, 0.25, 0.5), _st(1, 1.0, 2.0, 1.0, 0.5, 0.25, 0.5),
              _st(0, 1.0, 2.0, 4.0, 0.5, 0.25, 0.5), _st(1, 1.0, 2.0, 1.0, 0.5, 4.0, 0.0)]
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
    stages = [_st(0, 1.0, 2.0, 1.0, 0.5, 0.25, 0.5), _st(1, 1.0, 2.0, 1.0, 0.5, 0.25, 0.5),
              _st(0, 1.0, 2.0, 1.0, 0.5, 0.25, 0.5), _st(1, 1.0, 2.0, 1.0, 0.5, 0.25, 0.0)]
    res = simulate(stages, num_gpus=2, microbatches=2)
    assert _loads(res, 2) == [(1.0, 2.0)]
    assert _ev(res, "F", 2, 0) == (4.0, 5.0)  # input arrival 3.5 + .5, weights there since 2


def test_prefetch_waits_for_slot_release():
    """Three stages on one gpu: the third load needs the first stage's slot, freed when its visit ends."""
    stages = [_st(0, 2.0, 1.0, 0.5, 0.0, 0.0, 0.0), _st(0, 2.0, 1.0, 0.5, 0.0, 0.0, 0.0),
              _st(0, 2.0, 1.0, 0.5, 0.0, 0.0, 0.0)]
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
    q = lambda: float(rng.integers(1, 16)) / 4  # dyadic
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
