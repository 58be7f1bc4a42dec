"""The peer tier's rule: whose memory holds a gpu's parked activations, and how large a region that gpu gives
for them (the runtime's start-up handshake, the lifetime walk and the simulator use these same numbers).

Legend (units in brackets): M microbatches per step [-]; H_j bytes stage j holds per microbatch from F to B
(StagePlan.held_bytes) [bytes]; g(j) the gpu of stage j; P(g) = (g + 1) mod G, the peer of gpu g (the next
gpu by index; on a box of two root complexes the cross mapping puts it under the other one).
  R(p, g) = sum over g's stages j on the peer tier of ceil(SLACK * M * H_j) + M * PAD: the region gpu p gives
            gpu g, p = P(g) [bytes]. Under the Mobius order every microbatch of every stage of g is parked at
            the turn from forwards to backwards, so M * H_j each; SLACK and PAD cover the runtime's spans being
            a little larger than the plan's H_j (a kept graph's storages, aligned).
  C        = CONTEXT_BYTES on a gpu p that gives a region (0 on the CPU stand-in): rank g's process opens the
            region on p, which makes a CUDA context of its own there [bytes]. It lies outside every allocator, so
            the walk leaves it out (the start-up room check sees it beside the run's own context, outside what
            the run may use) and the activation choice keeps it free beside the walk.
"""

from __future__ import annotations

import math

from partition.plan import Plan

__all__ = ["SLACK", "PAD", "CONTEXT_BYTES", "peer_gpu", "region_bytes", "regions", "context_bytes"]

SLACK = 1.25
"""Headroom of a region over the plan's held bytes (the runtime's spans cover whole storages)."""
PAD = 1 << 12
"""Bytes per parked microbatch for the spans' alignment (256 bytes each: 16 spans) and small tensors."""
CONTEXT_BYTES = 640 * 2**20
"""C of the legend: the CUDA context a parking rank's process makes on its peer's gpu by opening the region there
(CUDA IPC). Measured by gpu_check's "another process's context" row: 524 MiB on an H200 (torch 2.11, CUDA 13,
driver 580; 2026-11-29), above the 300-400 MB NVIDIA's PyTorch engineers gave for CUDA 11.7 and later
(pytorch/pytorch#109888, #107667); a context grows with the gpu's SMs and the CUDA version, so a fifth more."""


def peer_gpu(gpu: int, num_gpus: int) -> int:
    """P(g) of the legend."""
    return (gpu + 1) % num_gpus


def region_bytes(m: int, held: int) -> int:
    """One parked stage's share of R(p, g): ceil(SLACK M H_j) + M PAD (0 when it holds nothing)."""
    return math.ceil(SLACK * m * held) + m * PAD if held > 0 else 0


def regions(plan: Plan) -> dict[tuple[int, int], int]:
    """{(p, g): R(p, g)} for every gpu g with stages on the peer tier (p = P(g))."""
    out: dict[tuple[int, int], int] = {}
    last = plan.num_stages - 1
    for j, s in enumerate(plan.stages):
        if s.activation_tier != "peer" or j == last or s.held_bytes <= 0:
            continue
        key = (peer_gpu(s.gpu, plan.num_gpus), s.gpu)
        out[key] = out.get(key, 0) + region_bytes(plan.num_microbatches, s.held_bytes)
    return out


def context_bytes(plan: Plan, standin: bool = False) -> list[int]:
    """C of the legend on every gpu of the plan: CONTEXT_BYTES for each rank whose process opens a region on it."""
    out = [0] * plan.num_gpus
    if not standin:
        for owner, _ in regions(plan):
            out[owner] += CONTEXT_BYTES
    return out
