"""Which receives a gpu posts ahead: once a receive from another gpu has arrived, the runtime posts the next one
(mobiuspipe.runtime.engine), so that its bytes move while the gpu computes. On NCCL that receive is a kernel that
waits for its sender, and any call that synchronizes the whole device waits for it (mobiuspipe.schedule.nccl): a
receive is posted ahead only where that cannot deadlock, in the worst case of a synchronization right after the post
on every gpu at once."""

from __future__ import annotations

from mobiuspipe.schedule.actions import Action, Kind
from mobiuspipe.schedule.check import ScheduleError
from mobiuspipe.schedule.nccl import NcclRun, is_receive, sender

__all__ = ["receives_ahead", "check_receives_ahead", "next_receives", "ActionKey"]

ActionKey = tuple[Kind, int, int]
"""An action by (kind, stage, microbatch)."""

CHANNELS = "direction"
"""Receives go ahead only where each direction of a pair has its own queue (mobiuspipe.runtime.peers.channels): on a
shared one, a receive posted early could get ahead of a send."""


def next_receives(mapping: list[int], schedule: list[Action], gpu: int) -> dict[int, int]:
    """The candidates of one gpu's list: the index of each receive from another gpu -> the index of the next one
    (the step's last has none)."""
    remote = [k for k, a in enumerate(schedule) if is_receive(a) and mapping[sender(a)[1]] != gpu]
    return dict(zip(remote, remote[1:]))


def receives_ahead(mapping: list[int], schedules: list[list[Action]]) -> list[dict[ActionKey, Action]]:
    """Per gpu: each receive from another gpu -> the next receive to post once it has arrived, for the pairs
    (next_receives) whose post cannot deadlock under a device-wide synchronization. The model runs the lists with
    every candidate posted and waited for at once; where they deadlock, it takes back the post the lowest stuck gpu
    waits for and goes on, so the posts it keeps are deadlock-free together. Schedules that deadlock without any
    post ahead raise ScheduleError (check_schedules proves they do not)."""
    early = [next_receives(mapping, acts, g) for g, acts in enumerate(schedules)]
    run = NcclRun(mapping, schedules, CHANNELS, early)
    while (run.post() | run.match()) or run.drop_early():
        pass
    if not run.finished:
        raise ScheduleError(f"deadlock under NCCL's rules without receives posted ahead: {run.stuck()}")
    return [
        {_key(acts[first]): acts[ahead] for first, ahead in sorted(run.early[g].items())}
        for g, acts in enumerate(schedules)
    ]


def check_receives_ahead(
    mapping: list[int], schedules: list[list[Action]], ahead: list[dict[ActionKey, Action]]
) -> None:
    """Raise ScheduleError if posting `ahead`'s receives can deadlock under a device-wide synchronization right
    after each post (the worst case receives_ahead guards against)."""
    early = []
    for g, acts in enumerate(schedules):
        index = {_key(a): k for k, a in enumerate(acts)}
        early.append({index[first]: index[_key(b)] for first, b in ahead[g].items()})
    run = NcclRun(mapping, schedules, CHANNELS, early)
    while run.post() | run.match():
        pass
    if not run.finished:
        raise ScheduleError(
            f"deadlock under NCCL's rules when the device synchronizes after a receive posted ahead: {run.stuck()}"
        )


def _key(a: Action) -> ActionKey:
    return (a.kind, a.stage, a.microbatch)
