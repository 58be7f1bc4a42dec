"""The host's shared memory (/dev/shm): its size, and the advice when it is too small for a job of several ranks.

NCCL between gpus of one host without peer-to-peer (every consumer PCIe box) carries its messages through segments
in /dev/shm, about 9 MiB per channel and peer (NVIDIA/nccl #290, #342); a Docker container has 64 MiB there unless
started with --shm-size or --ipc=host, and NCCL then fails at its first message with "unhandled system error". The
CPU stand-ins' peer regions are files there too, and a file there that outgrows it kills the process (SIGBUS)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from foundation.units import MiB, fmt_bytes

__all__ = ["SHM_DIR", "SHM_ADVISED_BYTES", "ShmSpace", "shm_space", "shm_fix"]

SHM_DIR = "/dev/shm"
SHM_ADVISED_BYTES = 512 * MiB
"""The /dev/shm size below which a job of several ranks on one host is warned (DeepSpeed's ds_report warns below
the same; NCCL's segments for a few communicators of two ranks fill 64 MiB)."""


@dataclass(frozen=True)
class ShmSpace:
    """The size of a shared-memory folder (bytes)."""

    path: str
    total: int
    free: int

    @property
    def small(self) -> bool:
        """Below SHM_ADVISED_BYTES."""
        return self.total < SHM_ADVISED_BYTES

    def describe(self) -> str:
        """e.g. "/dev/shm: 64.00 MiB, 60.00 MiB free"."""
        return f"{self.path}: {fmt_bytes(self.total)}, {fmt_bytes(self.free)} free"


def shm_space(path: str = SHM_DIR) -> ShmSpace | None:
    """The size of `path` (statvfs), or None where it does not exist (not Linux)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return ShmSpace(path, st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)


def shm_fix(space: ShmSpace) -> str:
    """How to give a job more shared memory."""
    return (
        f"{space.describe()}; give the host's shared memory more room: start the container with --shm-size=1g (or "
        f"--ipc=host; in Kubernetes, an emptyDir of medium Memory at /dev/shm), or on a host `mount -o remount,size=1G "
        f"{space.path}`"
    )
