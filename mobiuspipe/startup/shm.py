"""NCCL and the host's shared memory: a warning at start-up when /dev/shm is small for a job whose gpus share a host,
and NCCL's failure there ("unhandled system error", a segment it could not create) told with its cause and the fix
(foundation.shm)."""

from __future__ import annotations

from foundation.shm import ShmSpace, shm_fix
from mobiuspipe.errors import PipelineError
from mobiuspipe.runtime.peers.ranks import RankInfo, local_world_size

__all__ = ["shm_warning", "shm_error"]

_SEGMENT_WORDS = ("shared memory", "/dev/shm", "shm_open", "posix_fallocate")
"""What NCCL's last error says when it could not make a segment in /dev/shm (NVIDIA/nccl #290, #328, #342)."""


def shm_warning(info: RankInfo, cuda: bool, space: ShmSpace | None) -> str | None:
    """What the first rank of a host warns of when its gpus talk through a /dev/shm below foundation.shm's advised
    size; None where nothing is wrong (one rank on the host, no gpu: gloo's messages go by socket)."""
    local = local_world_size(info.world_size)
    if not cuda or space is None or not space.small or local < 2 or info.local_rank != 0:
        return None
    return (
        f"{local} ranks share this host's gpus, and NCCL between gpus without peer-to-peer keeps about "
        f"9 MiB per channel and peer in {space.path}: it may fail at its first message with 'unhandled system error'. "
        + shm_fix(space)
    )


def shm_error(e: BaseException, space: ShmSpace | None) -> PipelineError | None:
    """The error to raise instead of `e` when it is NCCL's failure to make a shared-memory segment (its text says
    so, or it is a bare system error while /dev/shm is small); None otherwise."""
    text = str(e)
    if "NCCL" not in text or space is None:
        return None
    segment = any(w in text for w in _SEGMENT_WORDS)
    if not segment and not ("unhandled system error" in text and space.small):
        return None
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return PipelineError(
        f"NCCL could not set up its messages between this host's gpus ({first}): without peer-to-peer it keeps them "
        f"in shared memory, and {space.path} has too little room. " + shm_fix(space)
    )
