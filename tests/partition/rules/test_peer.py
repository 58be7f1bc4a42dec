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
