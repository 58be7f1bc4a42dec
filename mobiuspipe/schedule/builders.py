"""Build the per-gpu Mobius schedule of a plan: forwards of its stages in order, then backwards in reverse.

The visit order is partition.order's: for gpu g with stages J, F(J[0]) .. F(J[-1]), B(J[-1]) .. B(J[0]).
At the start of each visit the next visit's stage is prefetched (LOAD), so its copy overlaps this visit's
compute; at the end the visit's stage is released unless the next visit uses it (the last forward stage
stays resident into its backward).
"""

from __future__ import annotations

from mobiuspipe.schedule.actions import Action, Kind
from partition.order import steps_of

__all__ = ["build_schedule"]


def build_schedule(mapping: list[int], gpu: int, microbatches: int) -> list[Action]:
    """The ordered actions gpu runs in one step, given stage -> gpu mapping (partition.order.steps_of, typed)."""
    return [Action(Kind(kind), j, i) for kind, j, i in steps_of(mapping, gpu, microbatches)]
