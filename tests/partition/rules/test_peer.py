"""The peer tier's rule (partition.rules.peer): each gpu parks on the next one, in a region of SLACK x M x H_j + M x PAD
per parked stage, which the lifetime walk holds on the peer for the whole run."""

from __future__ import annotations

import dataclasses
import math

from partition.rules.device_peak import planned_device_bytes
from partition.rules.peer import PAD, SLACK, peer_gpu, regions
from tests.partition.rules.test_activation_choice import _plan


def test_each_gpu_parks_on_the_next_and_the_walk_holds_the_region_there():
    plan = _plan(gpus=2, stages=4)  # stages 0, 2 on gpu 0; 1, 3 on gpu 1 (cross); 3 is the last
    assert [peer_gpu(g, 3) for g in range(3)] == [1, 2, 0] and peer_gpu(0, 1) == 0
    held = [1001, 333, 77, 5]
    stages = tuple(
        dataclasses.replace(s, activations="recompute", activation_tier="peer" if j < 3 else "device", held_bytes=h)
        for j, (s, h) in enumerate(zip(plan.stages, held))
    )
    parked = dataclasses.replace(plan, stages=stages)
    m = plan.num_microbatches
    size = lambda h: math.ceil(SLACK * m * h) + m * PAD  # noqa: E731
    gpu = {j: s.gpu for j, s in enumerate(plan.stages)}
    want: dict[tuple[int, int], int] = {}
    for j in range(3):  # the last stage parks nothing
        key = (peer_gpu(gpu[j], 2), gpu[j])
        want[key] = want.get(key, 0) + size(held[j])
    assert regions(parked) == want
    on_host = dataclasses.replace(
        parked,
        stages=tuple(
            dataclasses.replace(s, activation_tier="host" if j < 3 else "device") for j, s in enumerate(stages)
        ),
    )
    assert regions(on_host) == {}
    base = planned_device_bytes(on_host, standin=True)
    got = planned_device_bytes(parked, standin=True)
    assert [g - b for g, b in zip(got, base)] == [want.get((0, 1), 0), want.get((1, 0), 0)]


def test_a_gpu_that_gives_a_region_keeps_room_for_the_parking_process_context():
    """On a gpu (not the stand-in) the parking rank's process opens its region on the peer, which makes a CUDA context
    there (C): the activation choice keeps D_g + C within the budget, the walk leaves C out (it lies outside every
    allocator, where the start-up room check sees it), and the stand-in has no context."""
    from partition.rules.activation_choice import _Walker, choose_activations
    from partition.rules.activations import Link
    from partition.rules.peer import CONTEXT_BYTES, context_bytes
    from tests.partition.rules.test_activation_choice import _options, _profile

    plan, profile = _plan(gpus=2, stages=4), _profile()
    links = {"device": None, "host": Link(10.0, 10.0), "peer": Link(10.0, 10.0)}
    opts = _options(plan, profile, links)
    costs = [next(c for c in o if c.policy.tier == "peer") if j == 0 else o[0] for j, o in enumerate(opts)]
    p = peer_gpu(plan.stages[0].gpu, 2)
    on_gpu, standin = _Walker(plan, standin=False), _Walker(plan, standin=True)
    assert [on_gpu.need(costs, g) - on_gpu.peak(costs, g) for g in (p, 1 - p)] == [CONTEXT_BYTES, 0]
    assert standin.needs(costs) == standin.peaks(costs)
    parked = dataclasses.replace(
        plan,
        stages=tuple(
            dataclasses.replace(s, activation_tier=c.policy.tier, held_bytes=c.held_bytes)
            for s, c in zip(plan.stages, costs)
        ),
    )
    assert context_bytes(parked)[p] == CONTEXT_BYTES and context_bytes(parked, standin=True) == [0, 0]
    modes = {"device": ("recompute",), "host": ("recompute",), "peer": ("recompute", "selective", "keep")}

    def choose(budget: int) -> tuple[list[int], list[bool]]:
        """The choice's needs (D_g + C where g gives a region) under budget, and which gpus give one."""
        choice = choose_activations(plan, profile, budget, links, standin=False, modes=modes, host_caps=[0, 0])
        gives = [
            any(c.policy.tier == "peer" and peer_gpu(s.gpu, 2) == g for s, c in zip(plan.stages, choice.costs))
            for g in (0, 1)
        ]
        return [peak + CONTEXT_BYTES * give for peak, give in zip(choice.peaks, gives)], gives

    needs, gives = choose(10**12)
    assert all(gives)  # plenty of memory: both gpus park on each other
    for budget, parks in ((max(needs), True), (CONTEXT_BYTES - 1, False)):  # below one context: nothing parks
        needs, gives = choose(budget)
        assert max(needs) <= budget and any(gives) == parks


def test_the_timeline_of_each_gpu_peaks_at_its_planned_figure():
    """planned_timeline (gpu_check holds each action's measured peak to it) tops out at planned_device_bytes on both
    paths: the regions a gpu gives, its stages' states on the gpu tier and, on a gpu, X."""
    from partition.rules.device_peak import planned_timeline

    plan = _plan(gpus=2, stages=4)
    stages = tuple(
        dataclasses.replace(s, activations="recompute", activation_tier="peer" if j < 3 else "device", held_bytes=h)
        for j, (s, h) in enumerate(zip(plan.stages, [1001, 333, 77, 5]))
    )
    parked = dataclasses.replace(plan, stages=stages, workspace_bytes=4096)
    for standin in (False, True):
        for on_device in ((), (1,)):
            want = planned_device_bytes(parked, standin, on_device=on_device)
            got = [max(b for _, b in planned_timeline(parked, g, standin, on_device=on_device)) for g in (0, 1)]
            assert got == want
    assert {j for (_, j, _), _ in planned_timeline(parked, 1)} == {1, 3}  # gpu 1's stages' actions only
