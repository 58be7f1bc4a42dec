"""Build the per-gpu Mobius schedule of a plan: forwards of its stages in order, then backwards in reverse.

The visit order is partition.order's: for gpu g with stages J, F(J[0]) .. F(J[-1]), B(J[-1]) .. B(J[0]).
At the start of each visit the next visit's stage is prefetched (LOAD), so its copy overlaps this visit's
compute; at the end the visit's stage is released unless the next visit uses it (the last forward stage
stays resident into its backward).

A stage in `swapped` (its held activations live off the device: host, SSD or a peer gpu) finishes the copy
out of microbatch i after the forward of microbatch i+1, so that the copy overlaps that compute (SO), and
starts the copy back of microbatch i `prefetch` microbatches ahead of its backward (SI). The last stage has
no held activations (its forward is fused into its backward).
"""

from __future__ import annotations

from mobiuspipe.schedule.actions import Action, Kind
from partition.order import visits_of

__all__ = ["build_schedule"]


def build_schedule(
    mapping: list[int], gpu: int, microbatches: int, swapped: frozenset[int] = frozenset(), prefetch: int = 1
) -> list[Action]:
    """The ordered actions gpu runs in one step, given stage -> gpu mapping (swapped, prefetch: above)."""
    last = len(mapping) - 1
    if last in swapped:
        raise ValueError(f"stage {last} is the last: its forward is fused into its backward, it holds nothing")
    visits = [(j, Kind(phase)) for j, phase in visits_of(mapping, gpu)]  # Kind("F") is FWD, Kind("B") BWD
    out: list[Action] = [Action(Kind.LOAD, visits[0][0])] if visits else []
    for k, (j, phase) in enumerate(visits):
        nxt = visits[k + 1][0] if k + 1 < len(visits) else None
        if nxt is not None and nxt != j:
            out.append(Action(Kind.LOAD, nxt))
        for i in range(microbatches):
            if j in swapped and phase is Kind.BWD:
                ahead = range(i + prefetch, i + prefetch + 1) if i else range(min(prefetch + 1, microbatches))
                out += [Action(Kind.SWAP_IN, j, x) for x in ahead if x < microbatches]
            out += _microbatch(j, i, phase, last)
            if j in swapped and phase is Kind.FWD and i > 0:
                out.append(Action(Kind.SWAP_OUT, j, i - 1))
        if j in swapped and phase is Kind.FWD:
            out.append(Action(Kind.SWAP_OUT, j, microbatches - 1))
        if phase is Kind.BWD:
            out.append(Action(Kind.OFFLOAD, j))
        if nxt != j:
            out.append(Action(Kind.RELEASE, j))
    return out


def _microbatch(j: int, i: int, phase: Kind, last: int) -> list[Action]:
    if phase is Kind.FWD:
        pre = [Action(Kind.RECV_ACT, j, i)] if j > 0 else []
        post = [Action(Kind.SEND_ACT, j, i)] if j < last else []
        return pre + [Action(Kind.FWD, j, i)] + post
    pre = [Action(Kind.RECV_GRAD, j, i)] if j < last else []
    post = [Action(Kind.SEND_GRAD, j, i)] if j > 0 else []
    return pre + [Action(Kind.BWD, j, i)] + post
