"""The order a gpu visits its stages in one step: forwards ascending, then backwards descending.

For gpu g with stages J = [j for j, h in enumerate(mapping) if h == g] (ascending), the visits are
F(J[0]) .. F(J[-1]), B(J[-1]) .. B(J[0]); each visit runs all microbatches of one stage in one phase.
Two successive visits of the same stage (only F(J[-1]), B(J[-1])) share its weights: the gpu's last
forward stage stays resident into its backward. The model's last stage is fused (its forward runs inside its
backward, with the loss): its forward visit runs nothing, and its backward visit takes each microbatch's input
as it arrives, RA F B SG per microbatch, so that B(last, 0) starts when microbatch 0 arrives instead of after the
last one (a 1F1B of the last stage). The runtime's schedule (mobiuspipe.schedule.builders),
the aggregated timeline the MIP optimizes (partition.rules.timeline) and the simulator (partition.sim.simulate)
all take their order from here; steps_of spells out the runtime's whole action list as plain tuples
(the schedule builder turns them into typed actions, partition.rules.lifetimes walks the bytes they hold).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Visit", "Step", "visits_of", "gpu_visits", "freed_by", "steps_of"]


Step = tuple[str, int, int]
"""One action of a gpu's step as plain data: (kind, stage j, microbatch i), i = -1 for the stage-wide kinds.
Kinds (mobiuspipe.schedule.actions.Kind's values): L load, R release, O offload (stage-wide); F forward,
B backward, SA / RA send / receive the activation, SG / RG send / receive the gradient, SO / SI swap the
held activations out (their copy has ended) and in (per microbatch)."""


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


def steps_of(
    mapping: list[int], gpu: int, microbatches: int, swapped: frozenset[int] = frozenset(), prefetch: int = 1
) -> list[Step]:
    """Gpu's actions of one step in the order it runs them: at the start of each visit the next visit's stage
    is loaded (prefetch); per microbatch RA F SA (forward) or RG B SG (backward), the receive and send left
    out at the pipeline's ends, and RA F B SG in the last stage's backward visit (its forward visit is empty);
    OFFLOAD after a backward visit; RELEASE unless the next visit keeps the stage.
    A stage in `swapped` (its held activations live off the device) finishes the swap-out of microbatch i
    after the forward of i+1, so that the copy overlaps that compute (SO), and starts the swap-in of
    microbatch i `prefetch` microbatches ahead of its backward (SI); the last stage holds nothing (its
    forward is fused into its backward)."""
    last = len(mapping) - 1
    if last in swapped:
        raise ValueError(f"stage {last} is the last: its forward is fused into its backward, it holds nothing")
    visits = visits_of(mapping, gpu)
    out: list[Step] = [("L", visits[0].stage, -1)] if visits else []
    for k, (j, phase) in enumerate(visits):
        nxt = visits[k + 1].stage if k + 1 < len(visits) else None
        if nxt is not None and nxt != j:
            out.append(("L", nxt, -1))
        for i in range(microbatches):
            if j in swapped and phase == "B":
                ahead = range(i + prefetch, i + prefetch + 1) if i else range(min(prefetch + 1, microbatches))
                out += [("SI", j, x) for x in ahead if x < microbatches]
            out += _microbatch(j, i, phase, last)
            if j in swapped and phase == "F" and i > 0:
                out.append(("SO", j, i - 1))
        if j in swapped and phase == "F":
            out.append(("SO", j, microbatches - 1))
        if phase == "B":
            out.append(("O", j, -1))
        if nxt != j:
            out.append(("R", j, -1))
    return out


def _microbatch(j: int, i: int, phase: str, last: int) -> list[Step]:
    if j == last:  # fused: F only stores the input that B runs forward, loss and backward on
        if phase == "F":
            return []
        receive, send = ([("RA", j, i)], [("SG", j, i)]) if j > 0 else ([], [])
        return receive + [("F", j, i), ("B", j, i)] + send
    if phase == "F":
        return ([("RA", j, i)] if j > 0 else []) + [("F", j, i)] + ([("SA", j, i)] if j < last else [])
    return ([("RG", j, i)] if j < last else []) + [("B", j, i)] + ([("SG", j, i)] if j > 0 else [])
