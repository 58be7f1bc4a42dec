"""The peer tier's regions, set up when the Pipeline starts: each rank allocates, in its device's memory, the
region that partition.rules.peer sizes for the rank whose stages park activations there, and each rank opens the
region it parks in (mobiuspipe.memory.swap_peer). Every rank of the job takes part (collectives), also one
that neither gives nor parks.

On CUDA the region is shared through a CUDA IPC handle; the copies go device to device where the two gpus
can access each other's memory (torch.cuda.can_device_access_peer: NVLink or PCIe peer-to-peer), and are
staged through pinned host memory otherwise. On the CPU stand-in the region is a file in shared memory that
both processes map (the bytes really live outside the parking rank), removed by its owner once both have it
mapped, so a crash leaves nothing behind; copies are staged.
"""

from __future__ import annotations

import os
import socket
import tempfile
import uuid

import torch

from foundation.shm import SHM_DIR, shm_fix, shm_space
from foundation.units import fmt_bytes
from mobiuspipe.errors import PipelineError
from mobiuspipe.memory.device import Device
from mobiuspipe.memory.ledger import DeviceLedger
from mobiuspipe.memory.swap import Swap
from mobiuspipe.memory.swap_peer import PeerSwap, open_shared, share_region, shm_region
from mobiuspipe.runtime.peers.ranks import RankInfo, gather_all
from mobiuspipe.standin.places import gpu_buffer
from partition.plan import Plan
from partition.rules.peer import regions

__all__ = ["GivenRegions", "open_regions"]


class GivenRegions(Swap):
    """The regions this rank gives its peers (held in its ledger as ("peer", parking rank)): no stage of this
    rank swaps into them; close() lets them go."""

    name = "given"

    def __init__(self, given: list[torch.Tensor]):
        super().__init__()
        self.given = given

    def close(self) -> None:
        super().close()
        self.given.clear()


def open_regions(plan: Plan, info: RankInfo, device: Device, ledger: DeviceLedger) -> tuple[PeerSwap | None, Swap]:
    """(the PeerSwap of this rank's parked stages, or None; the regions it gives others). PipelineError when
    the plan parks on a peer but the job has one rank, or ranks on several hosts."""
    need = regions(plan)
    if not need:
        return None, GivenRegions([])
    if info.world_size < 2:
        raise PipelineError(
            "activation_tier peer parks activations in another rank's gpu, but this job has one rank: "
            "use activation_tier host (or ssd), or run on several gpus"
        )
    ids = gather_all(info, (socket.gethostname(), info.local_rank, uuid.uuid4().hex))
    if len({host for host, _, _ in ids}) > 1:
        raise PipelineError(
            "activation_tier peer needs every rank on one host (a region in another process's gpu memory), "
            f"but the ranks run on {sorted({h for h, _, _ in ids})}: use activation_tier host"
        )
    token = ids[0][2]
    given, offers, files = [], {}, []
    for (owner, parker), nbytes in sorted(need.items()):
        if owner != info.rank:
            continue
        region, handle = _give(nbytes, device, f"mobiuspipe-{token}-{owner}-{parker}")
        region = device.place(region)
        ledger.hold(("peer", parker), region)
        given.append(region)
        offers[parker] = handle
        files += [handle] if isinstance(handle, str) else []
    handles = gather_all(info, offers)
    swap = None
    for (owner, parker), nbytes in need.items():
        if parker == info.rank:
            region = gpu_buffer(_open(handles[owner][parker], nbytes), ids[owner][1])
            swap = PeerSwap(device, region, staged=not _direct(device, ids[owner][1]), peer=ids[owner][1])
    gather_all(info, None)  # every region is open where it is used: the files may go
    for path in files:
        os.unlink(path)
    return swap, GivenRegions(given)


def _give(nbytes: int, device: Device, name: str) -> tuple[torch.Tensor, object]:
    """A region of nbytes on this rank's device and what the parking rank opens it with."""
    if device.is_cuda:
        return share_region(nbytes, device.torch_device)
    folder = SHM_DIR if os.path.isdir(SHM_DIR) else tempfile.gettempdir()
    space = shm_space(folder)
    if space is not None and nbytes > space.free:  # a mapped file that outgrows its folder kills the process (SIGBUS)
        raise PipelineError(
            f"activation_tier peer: the CPU stand-in's region of {fmt_bytes(nbytes)} is a file in {folder}, which has "
            f"too little room ({shm_fix(space)}), or park activations in host memory (memory.activation_tier: host)"
        )
    path = os.path.join(folder, name)
    return shm_region(path, nbytes), path


def _open(handle: object, nbytes: int) -> torch.Tensor:
    if isinstance(handle, str):
        return shm_region(handle, nbytes)
    try:
        return open_shared(handle)
    except RuntimeError as e:
        raise PipelineError(_refused(str(e).splitlines()[0] if str(e) else type(e).__name__)) from e


def _refused(cause: str) -> str:
    """Why this rank could not open a peer's region (CUDA IPC), and what to do."""
    expandable = "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
    why = (
        "under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torch shares the region as a file descriptor that "
        "the opening process takes with pidfd_getfd, which a container without ptrace rights refuses (pytorch "
        "#165685): leave expandable_segments out of PYTORCH_CUDA_ALLOC_CONF for this job, or give the container "
        "--cap-add SYS_PTRACE; "
        if expandable
        else "CUDA IPC needs both ranks' processes on one host and able to open each other's memory; "
    )
    return (
        f"activation_tier peer: this rank could not open the region another rank's gpu gives it ({cause}); {why}"
        "or park activations in host memory (memory.activation_tier: host)"
    )


PEER_STAGED_ENV = "MOBIUSPIPE_PEER_STAGED"
"""Set to 1 to stage the peer tier's copies through host memory even where the gpus have peer access (the path
of a consumer PCIe box, checked on a server that has P2P: scripts/gpu_check.sh sets it)."""


def _direct(device: Device, peer_local_rank: int) -> bool:
    """Whether copies may go device to device (CUDA with peer access to the peer's gpu, unless PEER_STAGED_ENV)."""
    if not device.is_cuda or os.environ.get(PEER_STAGED_ENV, "0") == "1":
        return False
    return bool(torch.cuda.can_device_access_peer(device.torch_device.index or 0, peer_local_rank))
