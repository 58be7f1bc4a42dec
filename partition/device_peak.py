"""The plan's device-memory figure per gpu: what the cost model says a gpu holds at its peak.

Legend (the cost model's symbols, partition/costmodel.py; units in brackets):
  W     plan.slot_bytes: one slot of the device arena = the largest stage's parameter bytes    [bytes]
  S     ARENA_SLOTS: slots in the arena (two weight slots, one gradient slot)                  [-]
  A_j   plan.stages[j].activation_bytes: live activations while stage j runs backward on one
        microbatch, its input and output buffers included                                     [bytes]
  D_g   = S * W + max over the stages j of gpu g of A_j: the left side of the memory rule
        (S*W + A_j <= G) at gpu g's worst stage; the plan's prediction of gpu g's device peak  [bytes]

The arena counts whole (S * W, as preallocated); the stage inputs kept for the recompute are not counted
(on a gpu they live on the host), nor are the messages waiting on the device for other microbatches. The
runtime measures the real peak (mobiuspipe.memory.measure) and the torchrun entry compares the two.
"""

from __future__ import annotations

from partition.plan import Plan

__all__ = ["planned_device_bytes"]


def planned_device_bytes(plan: Plan) -> list[int]:
    """D_g of the legend for every gpu g of the plan, in gpu order."""
    worst = [0] * plan.num_gpus
    for s in plan.stages:
        worst[s.gpu] = max(worst[s.gpu], s.activation_bytes)
    return [plan.arena_bytes + a for a in worst]
