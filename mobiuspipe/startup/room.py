"""The gpu memory a run's plan needs against what the gpu can give it at start-up (torch.cuda.mem_get_info): a gpu
shared with another process, or a CUDA context larger than the plan's reserve, fails before the first step with the
figures and the fix, not with an out-of-memory error in the middle of one. It runs after the channels' warm-up
(mobiuspipe.runtime.peers.channels), so NCCL's communicators and point-to-point buffers are already in the figures."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from foundation.units import MiB, fmt_bytes
from mobiuspipe.errors import PipelineError
from mobiuspipe.runtime.peers.ranks import RankInfo, gather_all
from partition.plan import Plan

__all__ = ["Room", "check_room", "room_problem", "out_of_memory"]


@dataclass(frozen=True)
class Room:
    """A gpu's memory as CUDA reports it to this process (bytes)."""

    free: int
    """mem_get_info's free bytes: what no process, context or library holds."""
    total: int
    reserved: int
    """What this process's caching allocator holds (memory_reserved), in use or cached: the run's own."""

    @property
    def usable(self) -> int:
        """What the run can hold at its peak: the free bytes and its allocator's."""
        return self.free + self.reserved

    @property
    def outside(self) -> int:
        """What is held outside this process's allocator: the CUDA context, NCCL's buffers, other processes."""
        return self.total - self.free - self.reserved


HELD_OUTSIDE = "is held outside this process's allocator (the CUDA context, NCCL, other processes on the gpu)"
"""What Room.outside holds, as the messages say it."""
REPLAN = "(a run's plan.reserve_mb; for a plan file, or a Pipeline given one, `mobiuspipe partition --reserve-gib`)"
"""Where the gpu memory a plan leaves alone is set, as the messages say it."""


def room_now(device: torch.device) -> Room:
    """The rank's gpu as CUDA reports it now (mem_get_info, and this process's allocator)."""
    free, total = torch.cuda.mem_get_info(device)
    return Room(free, total, torch.cuda.memory_reserved(device))


def room_problem(planned: int, room: Room, gpu: int, assumed: int, unplanned: int = 0) -> str | None:
    """What is wrong when the plan's peak on `gpu` (planned: its walk, transients, workspaces and the buffers the plan
    counts) and the layers' buffers beyond the plan's count (`unplanned`: a plan made from a profile that did not
    measure them) exceed what the gpu can give the run; assumed: the bytes of the gpu the plan was made to use (its
    gpu_memory_bytes, workspaces and buffers). None if it fits."""
    if planned + unplanned <= room.usable:
        return None
    short = planned + unplanned - room.usable
    held = (
        f", and {fmt_bytes(unplanned)} of the layers' buffers (the stages keep them on the gpu) beyond the plan's count"
        if unplanned
        else ""
    )
    return (
        f"gpu {gpu} has too little free memory for the plan: its peak is {fmt_bytes(planned)}{held} (the plan assumed "
        f"{fmt_bytes(assumed)} of the gpu's {fmt_bytes(room.total)}), but the run can have {fmt_bytes(room.usable)}: "
        f"{fmt_bytes(room.outside)} {HELD_OUTSIDE}. Free the gpu, or plan again leaving {math.ceil(short / MiB)} MiB "
        f"more of it {REPLAN}"
    )


def check_room(info: RankInfo, planned: int, device: torch.device, plan: Plan, buffers: int = 0) -> None:
    """Every rank raises PipelineError (the first failing rank's room_problem) if the plan's peak on some rank's gpu
    does not fit it now; nothing on the stand-in, whose budget is the plan's own. planned: the plan's peak on this
    rank's gpu (Pipeline.planned_device_bytes, its stages' buffers as the plan counts them); buffers: the bytes of its
    stages' buffers as the run holds them (Engine.buffer_bytes), what is more than the plan's count is added."""
    if device.type != "cuda":
        return
    room = room_now(device)
    unplanned = max(0, buffers - plan.buffers_on(info.rank))
    every = gather_all(info, room_problem(planned, room, info.rank, plan.gpu_share_bytes, unplanned))
    failed = [(r, why) for r, why in enumerate(every) if why is not None]
    if failed:
        r, why = failed[0]
        raise PipelineError(f"rank {r}: {why}")


def out_of_memory(e: BaseException, gpu: int, device: torch.device, plan: Plan | None) -> PipelineError | None:
    """What to tell the user when the run ran out of gpu memory while it set up (the arena, the stages' states, the
    peer regions are made before check_room can compare): the figures and the fix, as check_room gives them, for
    the plan's whole assumed share of the gpu (its gpu_memory_bytes and workspaces); None for another error, or off
    CUDA."""
    if not isinstance(e, torch.OutOfMemoryError) or device.type != "cuda":
        return None
    room = room_now(device)
    cause = str(e).splitlines()[0] if str(e) else type(e).__name__
    if plan is not None:
        assumed = plan.gpu_share_bytes
        if (why := room_problem(assumed, room, gpu, assumed)) is not None:
            return PipelineError(f"rank {gpu} ran out of gpu memory while setting up ({cause}); {why}")
    return PipelineError(
        f"rank {gpu} ran out of gpu memory while setting up ({cause}): {fmt_bytes(room.outside)} of the gpu's "
        f"{fmt_bytes(room.total)} {HELD_OUTSIDE}. Free the gpu, or plan again leaving more of it {REPLAN}"
    )
