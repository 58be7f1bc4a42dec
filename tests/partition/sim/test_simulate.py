"""The step simulator against timelines worked out by hand, and its invariants on random plans.

All times are dyadic (0.25, 0.5, ...) so every sum is exact and the asserts use ==. Shared links:
test_simulate_links.py.
"""

import dataclasses

import numpy as np
import pytest

from partition.sim.simulate import simulate
from tests.partition.sim_cases import _bytes, _check_invariants, _ev, _loads, _random_stages, _st
from topology import preset


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


def _two_stages():
    """s0 on gpu0: F 1, B 1, load .5, offload .25, update .5, comm .25 (its output to gpu1 and the gradient back);
    s1 on gpu1: F 2, B 1, load 1, offload .5, update .25."""
    return [_st(0, 1.0, 1.0, 0.5, 0.25, 0.5, 0.25), _st(1, 2.0, 1.0, 1.0, 0.5, 0.25, 0.0)]


def test_two_gpus_two_stages_with_comm():
    stages = _two_stages()
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


def test_the_loops_overhead_adds_to_the_step_and_moves_no_event():
    """The two-stage step above (14.75) with the loop's 0.5 s a step outside the schedule: 15.25, every event
    where it was; a negative overhead is refused."""
    plain = simulate(_two_stages(), num_gpus=2, microbatches=2)
    res = simulate(_two_stages(), num_gpus=2, microbatches=2, overhead_s=0.5)
    assert res.step_time_s == 15.25 and res.events == plain.events
    with pytest.raises(ValueError, match="overhead_s must be >= 0"):
        simulate(_two_stages(), num_gpus=2, microbatches=2, overhead_s=-0.25)


def test_a_sender_posts_each_message_on_its_compute_stream():
    # test_two_gpus_two_stages_with_comm with send_s .25 (a CPU stand-in's rank sends from its computing thread):
    # gpu0: F(0,0) [.5, 1.5], send [1.5, 1.75]; F(0,1) [1.75, 2.75], send [2.75, 3]
    # gpu1: F(1,0) after 1.75 + .25 -> [2, 4]; F(1,1) after 3.25 -> [4, 6] (the last stage sends no output);
    #       B(1,0) [6, 9], send [9, 9.25]; B(1,1) [9.25, 12.25], send [12.25, 12.5]; offload [12.5, 13]
    # gpu0: B(0,0) after 9.25 + .25 -> [9.5, 11.5]; B(0,1) after 12.75 -> [12.75, 14.75] (stage 0 sends nothing
    #       back); offload [14.75, 15]; updates s1 [13, 13.25], s0 [15, 15.5]
    stages = _two_stages()
    res = simulate([dataclasses.replace(s, send_s=0.25) for s in stages], num_gpus=2, microbatches=2)
    assert [_ev(res, "F", 0, i) for i in (0, 1)] == [(0.5, 1.5), (1.75, 2.75)]
    assert [_ev(res, "F", 1, i) for i in (0, 1)] == [(2.0, 4.0), (4.0, 6.0)]
    assert [_ev(res, "B", 1, i) for i in (0, 1)] == [(6.0, 9.0), (9.25, 12.25)]
    assert _ev(res, "offload", 1) == (12.5, 13.0)
    assert [_ev(res, "B", 0, i) for i in (0, 1)] == [(9.5, 11.5), (12.75, 14.75)]
    assert (_ev(res, "offload", 0), _ev(res, "update", 1), _ev(res, "update", 0)) == (
        (14.75, 15.0),
        (13.0, 13.25),
        (15.0, 15.5),
    )
    assert res.step_time_s == 15.5
    assert res.compute_busy_s == (2.0 + 4.0, 4.0 + 6.0)  # the sends are not computations
    same_gpu = simulate([dataclasses.replace(s, gpu=0, send_s=0.25) for s in stages], num_gpus=1, microbatches=2)
    plain = simulate([dataclasses.replace(s, gpu=0) for s in stages], num_gpus=1, microbatches=2)
    assert same_gpu.events == plain.events  # a stage handed over on its own gpu posts nothing


def test_a_receiver_takes_each_message_on_its_compute_stream():
    # test_two_gpus_two_stages_with_comm with recv_s .25 (a CPU stand-in's rank receives on its computing thread,
    # from when the message has arrived and the thread reached it):
    # gpu0: F(0,0) [.5, 1.5], F(0,1) [1.5, 2.5] (stage 0 receives no input)
    # gpu1: arrival 1.75 -> recv [1.75, 2], F(1,0) [2, 4]; arrival 2.75 but the stream is busy to 4 ->
    #       recv [4, 4.25], F(1,1) [4.25, 6.25]; B(1,0) [6.25, 9.25], B(1,1) [9.25, 12.25] (the last stage
    #       receives no gradient); offload [12.25, 12.75], update s1 [12.75, 13]
    # gpu0: arrival 9.5 -> recv [9.5, 9.75], B(0,0) [9.75, 11.75]; arrival 12.5 -> recv [12.5, 12.75],
    #       B(0,1) [12.75, 14.75]; offload [14.75, 15], update s0 [15, 15.5]
    stages = _two_stages()
    res = simulate([dataclasses.replace(s, recv_s=0.25) for s in stages], num_gpus=2, microbatches=2)
    assert [_ev(res, "F", 0, i) for i in (0, 1)] == [(0.5, 1.5), (1.5, 2.5)]
    assert [_ev(res, "F", 1, i) for i in (0, 1)] == [(2.0, 4.0), (4.25, 6.25)]
    assert [_ev(res, "B", 1, i) for i in (0, 1)] == [(6.25, 9.25), (9.25, 12.25)]
    assert (_ev(res, "offload", 1), _ev(res, "update", 1)) == ((12.25, 12.75), (12.75, 13.0))
    assert [_ev(res, "B", 0, i) for i in (0, 1)] == [(9.75, 11.75), (12.75, 14.75)]
    assert (_ev(res, "offload", 0), _ev(res, "update", 0)) == ((14.75, 15.0), (15.0, 15.5))
    assert res.step_time_s == 15.5
    assert res.compute_busy_s == (2.0 + 4.0, 4.0 + 6.0)  # the receives are not computations
    same_gpu = simulate([dataclasses.replace(s, gpu=0, recv_s=0.25) for s in stages], num_gpus=1, microbatches=2)
    plain = simulate([dataclasses.replace(s, gpu=0) for s in stages], num_gpus=1, microbatches=2)
    assert same_gpu.events == plain.events  # a stage handed over on its own gpu receives nothing


def test_receives_share_the_host_cores():
    # As above on CPU stand-ins sharing one core (host_cores 1; each F, B and receive is a flow of its seconds):
    # gpu0's F(0,1) runs alone [1.5, 1.75] (.25 done); gpu1's receive from 1.75 shares the core with it, half
    # each: the receive's .25 takes [1.75, 2.25] (F(0,1) .5 done); F(1,0) then shares it: F(0,1)'s last .5 takes
    # [2.25, 3.25] (F(1,0) .5 done); F(1,0)'s last 1.5 alone [3.25, 4.75]; the second message arrived at 3.5,
    # its receive [4.75, 5], F(1,1) [5, 7].
    stages = _two_stages()
    res = simulate([dataclasses.replace(s, recv_s=0.25) for s in stages], num_gpus=2, microbatches=2, host_cores=1.0)
    assert _ev(res, "F", 0, 1) == pytest.approx((1.5, 3.25))
    assert [_ev(res, "F", 1, i) for i in (0, 1)] == [pytest.approx((2.25, 4.75)), pytest.approx((5.0, 7.0))]


def test_two_gpus_four_stages_unhidden_load_stalls():
    # mapping [0, 1, 0, 1]; every stage F 1, B 2 (a backward visit takes 3 per microbatch), comm .5,
    # offload .5. Stage 2's load takes 4 s, longer than stage 0's forward visit (2 s): it cannot hide.
    # s3's update is 8 s, so gpu1's update queue is visible too.
    stages = [
        _st(0, 1.0, 2.0, 1.0, 0.5, 0.25, 0.5),
        _st(1, 1.0, 2.0, 1.0, 0.5, 0.25, 0.5),
        _st(0, 1.0, 2.0, 4.0, 0.5, 0.25, 0.5),
        _st(1, 1.0, 2.0, 1.0, 0.5, 8.0, 0.0),
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
    # host Adam, each rank one stage at a time in offload order, the ranks at once: gpu1's s3 [15, 23]; gpu0's s2
    # arrived 18.5 and runs beside it -> [18.5, 18.75]; gpu1's s1 arrived 22 but waits for s3 -> [23, 23.25];
    # gpu0's s0 [25.5, 25.75].
    assert _ev(res, "update", 3) == (15.0, 23.0)
    assert _ev(res, "update", 2) == (18.5, 18.75)
    assert _ev(res, "update", 1) == (23.0, 23.25)
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
    from partition.search import make_plan, sim_stages
    from partition.spec.analytic import analytic_profile
    from partition.spec.hardware import device_spec
    from partition.spec.lookup import get_model

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


def test_the_delayed_update_runs_the_step_befores_updates_under_the_pipeline():
    """The delayed update: the updates a step runs are the step before's, all ready at 0, each rank's one after the
    other (the ranks at once), so the step is max(pipeline, updates); the same plan with a host Adam longer than the
    pipeline is bound by it."""
    stages = _two_stages()
    res = simulate(stages, num_gpus=2, microbatches=2, delayed=True)
    # each on its gpu's rank, from 0
    assert _ev(res, "update", 1) == (0.0, 0.25)
    assert _ev(res, "update", 0) == (0.0, 0.5)
    assert res.step_time_s == 14.25  # gpu0's offload ends the pipeline (against 14.75 with the updates after it)
    slow = [dataclasses.replace(s, update_s=20.0) for s in stages]
    assert simulate(slow, num_gpus=2, microbatches=2, delayed=True).step_time_s == 20.0
    assert simulate(slow, num_gpus=2, microbatches=2).step_time_s == 14.25 + 20.0  # after gpu0's offload
