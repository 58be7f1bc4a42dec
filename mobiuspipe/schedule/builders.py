"""Build the per-gpu Mobius schedule of a plan: forwards of its stages in order, then backwards in reverse.

The visit order is partition.rules.order's: for gpu g with stages J, F(J[0]) .. F(J[-1]), B(J[-1]) .. B(J[0]).
At the start of each visit the next visit's stage is prefetched (LOAD), so its copy overlaps this visit's
compute; at the end the visit's stage is released unless the next visit uses it (the last forward stage
stays resident into its backward).

A stage in `swapped` (its held activations live off the device: host, SSD or a peer gpu) finishes the copy
out of microbatch i after the forward of microbatch i+1, so that the copy overlaps that compute (SO), and
starts the copy back of microbatch i `prefetch` microbatches ahead of its backward (SI). The last stage has
no held activations: its forward is fused into its backward, which takes each microbatch as it arrives.
"""

from __future__ import annotations

from mobiuspipe.schedule.actions import Action, Kind
from mobiuspipe.schedule.check import check_schedules
from partition.rules.order import steps_of

__all__ = ["build_schedule", "build_schedules"]


def build_schedule(
    mapping: list[int], gpu: int, microbatches: int, swapped: frozenset[int] = frozenset(), prefetch: int = 1
) -> list[Action]:
    """The ordered actions gpu runs in one step, given stage -> gpu mapping (partition.rules.order.steps_of, typed;
    swapped, prefetch: above)."""
    return [Action(Kind(kind), j, i) for kind, j, i in steps_of(mapping, gpu, microbatches, swapped, prefetch)]


def build_schedules(
    mapping: list[int], gpus: int, microbatches: int, swapped: frozenset[int], channels: str
) -> list[list[Action]]:
    """The lists of gpus 0 .. gpus-1, checked to run together on the channel layout (check_schedules)."""
    schedules = [build_schedule(mapping, g, microbatches, swapped) for g in range(gpus)]
    check_schedules(mapping, microbatches, schedules, channels)
    return schedules
