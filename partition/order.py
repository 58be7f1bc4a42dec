"""The order a gpu visits its stages in one step: forwards ascending, then backwards descending.

For gpu g with stages J = [j for j, h in enumerate(mapping) if h == g] (ascending), the visits are
F(J[0]) .. F(J[-1]), B(J[-1]) .. B(J[0]); each visit runs all microbatches of one stage in one phase.
Two successive visits of the same stage (only F(J[-1]), B(J[-1])) share its weights: the gpu's last
forward stage stays resident into its backward. The runtime's schedule (mobiuspipe.schedule.builders),
the aggregated timeline the MIP optimizes (partition.timeline) and the simulator (partition.simulate)
all take their order from here.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Visit", "visits_of", "gpu_visits", "freed_by"]


class Visit(NamedTuple):
    """One visit: stage j in phase "F" (forward) or "B" (backward); equal to the plain tuple (j, phase)."""

    stage: int
    phase: str


def visits_of(mapping: list[int], gpu: int) -> list[Visit]:
    """Gpu's visits in order (empty when no stage maps to it)."""
    mine = [j for j, g in enumerate(mapping) if g == gpu]
    return [Visit(j, "F") for j in mine] + [Visit(j, "B") for j in reversed(mine)]


def gpu_visits(mapping: list[int]) -> dict[int, list[Visit]]:
    """Per gpu that holds a stage (ascending), its visits in order."""
    return {g: visits_of(mapping, g) for g in sorted(set(mapping))}


def freed_by(visits: list[Visit], k: int) -> int | None:
    """The visit whose end frees the weight slot the load of visit k takes (two weight slots: the slot of the
    load before the previous one), or None when a slot is still free. The previous load is visit k-1's, or
    visit k-2's when k-1 is the resident backward visit; its slot was last used by the visit just before it."""
    prev_load = k - 2 if k >= 2 and visits[k - 1].stage == visits[k - 2].stage else k - 1
    return prev_load - 1 if prev_load >= 1 else None
