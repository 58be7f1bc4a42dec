"""The lifetime walk (partition.rules.lifetimes) against hand-computed bytes on tiny schedules, and the plan's figure
built on it (partition.rules.device_peak)."""

from __future__ import annotations

from partition.rules.device_peak import planned_device_bytes, stage_bytes
from partition.rules.lifetimes import HEADER_BYTES, StageBytes, device_peak, device_timeline
from partition.rules.order import steps_of
from partition.search import make_plan
from partition.spec.profile import LayerProfile, Profile
from topology import cpu_standin

# I_j, O_j, A_j, H_j, P_j of three stages on one gpu (the last stage's output stays inside its backward)
THREE = [StageBytes(8, 100, 1000, 8, 50), StageBytes(100, 100, 2000, 100, 70), StageBytes(100, 0, 500, 100, 30)]


def test_one_gpu_three_stages_two_microbatches():
    """Peak in B1.0. The arena whole (10000); held for the recompute: (0,0), (0,1) and (1,1), 8 + 8 + 100
    ((1,0) is let go as its backward starts); both gradients from stage 2 queued for stage 1 (handed over on
    the gpu at SG2.0 and SG2.1), 2 x 100; and stage 1's work bytes, 2000."""
    timeline = dict(device_timeline([0, 0, 0], 0, 2, THREE, arena=10000))
    assert timeline[("B", 1, 0)] == 10000 + 16 + 100 + 200 + 2000 == 12316
    assert device_peak([0, 0, 0], 0, 2, THREE, arena=10000) == 12316
    # F1.1: held (0,0), (0,1), (1,0) = 116; inputs queued from stage 0, (1,1) computing: 100 (and (1,0)'s
    # activation waiting for stage 2: 100); its output 100
    assert timeline[("F", 1, 1)] == 10000 + 116 + 100 + 100 + 100
    # F2.0 computes nothing (fused into B2.0): its input becomes the held one
    assert timeline[("F", 2, 0)] == timeline[("SA", 1, 1)] == 10000 + 16 + 200 + 200


def test_slots_in_use_instead_of_the_whole_arena():
    """At B1.0 the arena holds stage 1's weights (since L1 at the start of F0) and gradients (since B1.0)
    and stage 0's weights (prefetched at the start of B1's visit): 70 + 70 + 50; stage 2's gradients went
    at O2 and its weights at R2."""
    timeline = dict(device_timeline([0, 0, 0], 0, 2, THREE))
    assert timeline[("B", 1, 0)] == 190 + 16 + 100 + 200 + 2000
    # the first action: stage 0's weights, and both microbatches' inputs (copied in at the step's start), 2 x 8
    assert device_timeline([0, 0, 0], 0, 2, THREE)[0] == (("L", 0, -1), 50 + 16)


def test_without_held_inputs_only_queues_and_work_remain():
    no_held = [StageBytes(s.input, s.output, s.work, 0, s.params) for s in THREE]
    assert device_peak([0, 0, 0], 0, 2, no_held, arena=10000) == 10000 + 200 + 2000  # B1.0, two gradients queued


FOUR = [
    StageBytes(8, 100, 1000, 8, 50),
    StageBytes(100, 100, 2000, 100, 60),
    StageBytes(100, 100, 3000, 100, 70),
    StageBytes(100, 0, 4000, 100, 80),
]


def test_two_gpus_cross_mapping_sends_released_when_the_schedules_prove_them_taken():
    """Stages 0, 2 on gpu 0 and 1, 3 on gpu 1, two microbatches; a message to the other gpu holds its bytes
    and a header, 100 + E. On gpu 0 at B2.0: the arena (weights of 2 and of 0, prefetched, gradients of 2:
    70 + 50 + 70); held (0,0), (0,1), (2,1): 8 + 8 + 100; the gradients for (2,0) and for (2,1), whose
    receive is posted at RG2.0, one ahead: 2 x 100; in flight SA2.0 and
    SA2.1 (gpu 1 took SA2.0 at RA3.0, which gpu 0 learns at RG2.0: the next call, SG2.0, drops it; it takes
    SA2.1 at RA3.1, after it sent SG3.0: SG2.1 drops it); SA0.0 and SA0.1 were dropped at SA2.0 and SA2.1
    (known taken once RA2.0 and RA2.1 arrived); work 3000."""
    msg = 100 + HEADER_BYTES
    timeline = dict(device_timeline([0, 1, 0, 1], 0, 2, FOUR))
    assert timeline[("B", 2, 0)] == 190 + 116 + 200 + 2 * msg + 3000
    # SA2.1 and SG2.0 in flight; the gradients for (2,1) and (0,0) (posted at RG2.1)
    assert timeline[("B", 2, 1)] == 190 + 16 + 200 + 2 * msg + 3000
    # SA2.0: stage 2's weights; held (0,*), (2,0); the input of (2,1), posted at RA2.0; SA0.0 dropped as SA2.0
    # starts, SA0.1 not yet; SA2.0 itself
    assert timeline[("SA", 2, 0)] == 70 + 16 + 100 + 100 + 2 * msg
    assert device_peak([0, 1, 0, 1], 0, 2, FOUR) == 190 + 116 + 200 + 2 * msg + 3000


def test_two_gpus_sends_held_until_the_flush():
    """gloo (the CPU stand-in): every send stays until the step's end. At B2.1 gpu 0 has sent SA0.0, SA0.1,
    SA2.0, SA2.1 and SG2.0 (the rest as in the test above)."""
    msg = 100 + HEADER_BYTES
    timeline = dict(device_timeline([0, 1, 0, 1], 0, 2, FOUR, sends_until_flush=True))
    assert timeline[("B", 2, 0)] == 190 + 116 + 200 + 4 * msg + 3000
    assert timeline[("B", 2, 1)] == 190 + 16 + 200 + 5 * msg + 3000
    assert device_peak([0, 1, 0, 1], 0, 2, FOUR, sends_until_flush=True) == timeline[("B", 2, 1)]
    # gpu 1 at B3.0: weights of 3 and (prefetched) 1, gradients of 3; held (1,*), and not (3,1): the last
    # stage takes each input as it arrives, RA3.1 comes after B3.0, but its receive is posted at RA3.0 (100);
    # its sends so far, SA1.0 and SA1.1 (the last stage sends no activation). At B3.1 SG3.0 has joined them,
    # and the receive of RG1.0 is posted (100).
    gpu1 = dict(device_timeline([0, 1, 0, 1], 1, 2, FOUR, sends_until_flush=True))
    assert gpu1[("B", 3, 0)] == 80 + 80 + 60 + 200 + 100 + 2 * msg + 4000
    assert gpu1[("B", 3, 1)] == 80 + 80 + 60 + 200 + 100 + 3 * msg + 4000


def test_the_walk_follows_the_runtime_order():
    assert [f"{k}{j}" + (f".{i}" if i >= 0 else "") for k, j, i in steps_of([0, 1, 0], 0, 2)] == (
        "L0 L2 F0.0 SA0.0 F0.1 SA0.1 R0 L0 RA2.0 F2.0 B2.0 SG2.0 RA2.1 F2.1 B2.1 SG2.1 O2 R2 "
        "RG0.0 B0.0 RG0.1 B0.1 O0 R0"
    ).split()


def _profile() -> Profile:
    def layer(name, n, out, act):
        return LayerProfile(name, n, 4 * n, act, out, 0.0, 0.0, 1e-3, 2e-3)

    ls = (layer("a", 40, 16, 64), layer("b", 0, 16, 64), layer("c", 27, 6, 24))
    return Profile("mlp", "cpu-standin", "fp32", 2, 1, ls, input_bytes=32, target_bytes=24)


def test_plan_figure_on_a_gpu_and_on_the_stand_in():
    plan = make_plan(_profile(), cpu_standin(1, 1 << 20), 3, num_stages=3, solver="dp", activations="recompute")
    assert (plan.input_bytes, plan.target_bytes, plan.mapping) == (32, 24, [0, 0, 0])
    sb = stage_bytes(plan)
    assert [(s.input, s.output, s.held) for s in sb] == [(32, 16, 32), (16, 16, 16), (16, 0, 16)]
    assert sb[0].work == plan.stages[0].activation_bytes + 32 and sb[2].work == plan.stages[2].activation_bytes + 24
    arena = plan.arena_bytes
    gpu = device_peak(plan.mapping, 0, 3, sb, arena)  # the recompute inputs stay on the gpu too
    assert planned_device_bytes(plan) == [gpu] and gpu >= arena + max(s.activation_bytes for s in plan.stages)
    assert gpu > device_peak(plan.mapping, 0, 3, stage_bytes(plan, [0, 0, 0]), arena)
    standin = device_peak(plan.mapping, 0, 3, sb, None, sends_until_flush=True)
    assert planned_device_bytes(plan, standin=True) == [standin]
    held = device_peak(plan.mapping, 0, 3, stage_bytes(plan, [5] * 3), arena)
    assert planned_device_bytes(plan, held=[5, 5, 5]) == [held]


def test_a_swapped_stage_holds_its_input_only_until_the_swap_out_and_from_the_swap_in():
    # 1 gpu, stages 0 and 1 (the last), M = 2; stage 0 holds 100 bytes per microbatch, works 1000
    stages = [StageBytes(input=8, output=10, work=1000, held=100), StageBytes(input=10, output=0, work=500, held=0)]
    kept = dict(device_timeline([0, 0], 0, 2, stages, arena=0, sends_until_flush=True))
    swapped = dict(device_timeline([0, 0], 0, 2, stages, arena=0, sends_until_flush=True, swapped=frozenset({0})))
    # while the last stage runs, both microbatches of stage 0 are held on the device unless swapped
    assert kept[("B", 1, 0)] - swapped[("B", 1, 0)] == 2 * 100
    # B(0, 0) runs with microbatches 0 and 1 swapped back in (prefetch 1): as much as without swaps
    assert swapped[("B", 0, 0)] == kept[("B", 0, 0)]
    assert [s for s in swapped if s[0] in ("SO", "SI")] == [("SO", 0, 0), ("SO", 0, 1), ("SI", 0, 0), ("SI", 0, 1)]


def test_a_graph_holding_its_stages_output_shares_it_with_the_message():
    """Stage 0 keeps its graph (H = 1000, its output's 100 among them) and sends that output to gpu 1: the
    bytes count once while the graph or the message holds them; a swap-in is a copy of its own."""
    stages = [StageBytes(8, 100, 1000, 1000, 0, held_output=100), StageBytes(100, 0, 500, 0, 0)]
    kept = dict(device_timeline([0, 1], 0, 1, stages, sends_until_flush=True))
    # F: input 8 + the graph beyond input and output 892 + the output 100; SA adds only the header
    assert (kept[("F", 0, 0)], kept[("SA", 0, 0)]) == (1000, 1000 + HEADER_BYTES)
    # B: the gradient received (100) beside the graph at work (1000, its output the message's), the header
    assert kept[("B", 0, 0)] == 1000 + HEADER_BYTES + 100
    assert kept[("O", 0, -1)] == 100 + HEADER_BYTES  # the message, held until the step ends, keeps the output
    swapped = dict(device_timeline([0, 1], 0, 1, stages, sends_until_flush=True, swapped=frozenset({0})))
    assert swapped[("SO", 0, 0)] == 100 + HEADER_BYTES  # the graph left; the message's output stays
    assert swapped[("B", 0, 0)] == 1000 + 100 + HEADER_BYTES + 100  # the swapped-in copy, the message, gradient
    unshared = [StageBytes(8, 100, 1000, 1000, 0), stages[1]]
    assert dict(device_timeline([0, 1], 0, 1, unshared, sends_until_flush=True))[("F", 0, 0)] == 1100
