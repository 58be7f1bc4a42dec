"""Check schedules before they run: slots, order within a gpu (swaps included), matched sends and receives,
no deadlock."""

from __future__ import annotations

from mobiuspipe.schedule.actions import Action, Kind
from mobiuspipe.schedule.nccl import PEER, NcclRun, is_receive, sender
from partition.rules.costmodel import WEIGHT_SLOTS

__all__ = ["ScheduleError", "check_schedules"]

_SWAPS = (Kind.SWAP_OUT, Kind.SWAP_IN)


class ScheduleError(RuntimeError):
    """A schedule breaks an invariant (a bug in a builder); the message shows where."""


def check_schedules(
    mapping: list[int], microbatches: int, schedules: list[list[Action]], channels: str = "direction"
) -> None:
    """Raise ScheduleError unless every gpu's list is valid on its own and all lists run together under NCCL's
    rules on the runtime's channel layout (mobiuspipe.runtime.peers.channels)."""
    for g, acts in enumerate(schedules):
        _check_local(mapping, g, microbatches, acts)
    _check_pair_order(mapping, schedules)
    _check_runs(mapping, schedules, channels)


def _fail(g: int, k: int, acts: list[Action], why: str) -> ScheduleError:
    window = " ".join(
        ("[" + str(a) + "]") if n == k else str(a)
        for n, a in enumerate(acts[max(0, k - 6) : k + 4], start=max(0, k - 6))
    )
    return ScheduleError(f"gpu {g}, action {k} ({acts[k]}): {why}\n  ... {window} ...")


def _check_local(mapping: list[int], g: int, m: int, acts: list[Action]) -> None:
    resident: set[int] = set()
    seen: set[tuple[Kind, int, int]] = set()
    swapped = {a.stage for a in acts if a.kind in _SWAPS}
    for k, a in enumerate(acts):
        if mapping[a.stage] != g:
            raise _fail(g, k, acts, f"stage {a.stage} belongs to gpu {mapping[a.stage]}")
        if a.kind in _SWAPS and a.stage == len(mapping) - 1:
            raise _fail(g, k, acts, "the last stage's forward is fused into its backward: it holds nothing to swap")
        if a.kind is Kind.LOAD:
            if a.stage in resident or len(resident) >= WEIGHT_SLOTS:
                raise _fail(g, k, acts, f"no free weight slot (resident: {sorted(resident)})")
            resident.add(a.stage)
        elif a.kind is Kind.RELEASE:
            resident.discard(a.stage)
        elif a.kind in (Kind.FWD, Kind.BWD) and a.stage not in resident:
            raise _fail(g, k, acts, "stage used before it is loaded")
        for need in _needs(a, len(mapping), m) + _swap_needs(a, swapped):
            if need not in seen:
                raise _fail(g, k, acts, f"runs before {need[0].value}{need[1]}.{need[2]}")
        key = (a.kind, a.stage, a.microbatch)
        if key in seen and a.kind not in (Kind.LOAD, Kind.RELEASE):
            raise _fail(g, k, acts, "appears twice")
        seen.add(key)
    for j in (j for j, h in enumerate(mapping) if h == g):
        missing = [i for i in range(m) if (Kind.FWD, j, i) not in seen or (Kind.BWD, j, i) not in seen]
        if missing or (Kind.OFFLOAD, j, -1) not in seen:
            raise ScheduleError(f"gpu {g}: stage {j} misses microbatches {missing} or its offload")


def _swap_needs(a: Action, swapped: set[int]) -> list[tuple[Kind, int, int]]:
    """What a swap needs before it, and what the backward of a swapped stage needs (so every microbatch of a
    stage that swaps has its swap out and in, in order)."""
    j, i = a.stage, a.microbatch
    if a.kind is Kind.SWAP_OUT:
        return [(Kind.FWD, j, i)]
    if a.kind is Kind.SWAP_IN:
        return [(Kind.SWAP_OUT, j, i)]
    return [(Kind.SWAP_IN, j, i)] if a.kind is Kind.BWD and j in swapped else []


def _needs(a: Action, num_stages: int, m: int) -> list[tuple[Kind, int, int]]:
    j, i = a.stage, a.microbatch
    if a.kind is Kind.FWD and j > 0:
        return [(Kind.RECV_ACT, j, i)]
    if a.kind is Kind.SEND_ACT:
        return [(Kind.FWD, j, i)]
    if a.kind is Kind.BWD:
        return [(Kind.FWD, j, i)] + ([(Kind.RECV_GRAD, j, i)] if j < num_stages - 1 else [])
    if a.kind is Kind.SEND_GRAD:
        return [(Kind.BWD, j, i)]
    if a.kind is Kind.OFFLOAD:
        return [(Kind.BWD, j, x) for x in range(m)]
    return []


def _check_runs(mapping: list[int], schedules: list[list[Action]], channels: str) -> None:
    """Run all lists together under NCCL's rules (mobiuspipe.schedule.nccl) and fail on a deadlock."""
    run = NcclRun(mapping, schedules, channels)
    while run.post() | run.match():
        pass
    if not run.finished:
        raise ScheduleError(f"deadlock under NCCL's rules (channels {channels!r}): {run.stuck()}")


def _check_pair_order(mapping: list[int], schedules: list[list[Action]]) -> None:
    """NCCL matches the messages between two ranks by order, not by tag: between every pair of gpus the
    receiver must post its receives in the order the sender posts its sends."""
    for g, acts in enumerate(schedules):
        for h in range(len(schedules)):
            if h == g:
                continue
            sent = [
                (a.kind, a.stage, a.microbatch)
                for a in acts
                if a.kind in PEER and mapping[a.stage + PEER[a.kind][1]] == h
            ]
            taken = [sender(a) for a in schedules[h] if is_receive(a) and mapping[sender(a)[1]] == g]
            if sent != taken:
                k = next(i for i, (x, y) in enumerate(zip(sent + [None], taken + [None])) if x != y)
                raise ScheduleError(
                    f"gpu {g} -> gpu {h}: message {k} is sent as {sent[k : k + 1]} but received as "
                    f"{taken[k : k + 1]}; NCCL would pair them wrongly"
                )
