"""Who this process is in the job (rank, world size, local rank) and its membership of the process group.

The answer comes from torch.distributed when a process group exists, else from the variables torchrun
sets (RANK, WORLD_SIZE, LOCAL_RANK), else the process is a job of one rank and needs no group.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, _abort_process_group
from torch.distributed.rendezvous import rendezvous as env_rendezvous

from mobiuspipe.errors import PipelineError, WorldSizeError

__all__ = ["RankInfo", "rank_info", "join_group", "leave_group", "abort_group", "gather_all"]


@dataclass(frozen=True)
class RankInfo:
    """This process: its rank (= its gpu in the plan), how many ranks the job has, its gpu on this host."""

    rank: int
    world_size: int
    local_rank: int
    under_torchrun: bool
    """True when torchrun (or another launcher) started this process as part of a job."""


def rank_info() -> RankInfo:
    """This process's place in the job (see the module docstring)."""
    local = int(os.environ.get("LOCAL_RANK", 0))
    if dist.is_available() and dist.is_initialized():
        return RankInfo(dist.get_rank(), dist.get_world_size(), local, True)
    if "WORLD_SIZE" not in os.environ:
        return RankInfo(0, 1, 0, False)
    try:
        return RankInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), local, True)
    except (KeyError, ValueError) as e:
        raise WorldSizeError(
            f"WORLD_SIZE is set but RANK is {os.environ.get('RANK')!r}: start training with "
            f"`torchrun --nproc_per_node N ...`, which sets both"
        ) from e


def join_group(info: RankInfo, timeout_s: float) -> bool:
    """Create the process group if the job has several ranks and none exists; True if this call made it. On CUDA
    the rank's gpu becomes the current device first, in a group the caller made too: NCCL and the object
    collectives work on it."""
    if info.world_size == 1:
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)  # before any collective: NCCL uses the current device
    if dist.is_initialized():
        found = dist.get_backend()
        if found != backend:
            raise PipelineError(
                f"the process group uses the {found!r} backend, but this job's messages are "
                f"{'gpu' if backend == 'nccl' else 'host'} tensors, which need {backend!r}: make it with "
                f"dist.init_process_group({backend!r}), or let the Pipeline make it (torchrun's variables suffice)"
            )
        return False
    timeout = timedelta(seconds=timeout_s)
    store, rank, world = next(env_rendezvous("env://", timeout=timeout))
    # A job torchrun restarts (--max-restarts) meets again in the same store: without a prefix of its own,
    # a restarted rank can read the address its dead peer left there and wait on it forever.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = PrefixStore(f"mobiuspipe/attempt{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return True


def leave_group(owned: bool) -> None:
    """Destroy the process group if join_group made it (and abort_group has not)."""
    if owned and dist.is_initialized():
        dist.destroy_process_group()


def abort_group(owned: bool) -> None:
    """After an error, on NCCL: abort the communicators of the group join_group made. The rank may have sends and
    receives no peer will ever match, and a graceful destroy (or a wait for copies queued behind those kernels) would
    wait for them until NCCL's watchdog ends the rank, its error unsaid. Nothing on gloo, whose operations do not
    hold the teardown (leave_group follows)."""
    if not owned or not dist.is_initialized() or dist.get_backend() != "nccl":
        return
    try:
        _abort_process_group()  # every group of the job (torch marks the call experimental)
    except (RuntimeError, ValueError) as e:
        print(f"mobiuspipe: NCCL's communicators did not abort ({e}): leaving the group gracefully", file=sys.stderr)


def gather_all(info: RankInfo, obj: Any) -> list[Any]:
    """Every rank's obj (picklable), in rank order, on every rank; [obj] in a job of one rank."""
    if info.world_size == 1:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out
