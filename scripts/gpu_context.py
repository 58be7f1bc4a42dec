"""What CUDA contexts hold on a gpu outside every allocator, for gpu_check's contexts rows (CUDA only).

outside_bytes: what this process holds there beyond its caching allocator (its context, the libraries' modules
loaded so far), against the plan's reserve. peer_context_bytes: what another process's context takes on the gpu
when that process opens a region of it through CUDA IPC, as a peer-tier parking rank does (partition.rules.peer's
CONTEXT_BYTES): a child opens a tensor of this process and the gpu's free memory is read before and after.
"""

from __future__ import annotations

import queue
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

from partition.rules.peer import CONTEXT_BYTES
from topology.presets import DEFAULT_RESERVE_BYTES

__all__ = ["contexts", "outside_bytes", "peer_context_bytes"]

WAIT_S = 120
"""Seconds the child may take to start, import torch and open the region."""


def outside_bytes(device: torch.device) -> int:
    """Bytes of `device` this process and others hold outside this process's caching allocator now."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def _open_and_wait(regions, opened) -> None:
    """The child: take the tensor (torch rebuilds it through CUDA IPC on its gpu), say so, wait to be let go."""
    region = regions.get(timeout=WAIT_S)
    opened.put(int(region.numel()))
    regions.get(timeout=WAIT_S)


def peer_context_bytes(device: torch.device, wait_s: float = WAIT_S) -> int:
    """The fall in `device`'s free memory while a child process holds one of its tensors open through CUDA IPC
    (RuntimeError if the child has not opened it within wait_s)."""
    spawn = mp.get_context("spawn")  # torch's: its queues send a CUDA tensor as an IPC handle
    regions, opened = spawn.Queue(), spawn.Queue()
    region = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)
    before = torch.cuda.mem_get_info(device)[0]  # before the child exists: all it makes on the gpu is counted
    child = spawn.Process(target=_open_and_wait, args=(regions, opened), daemon=True)
    child.start()
    try:
        regions.put(region)
        try:
            opened.get(timeout=wait_s)
        except queue.Empty:
            raise RuntimeError(f"the child did not open the region within {wait_s:.0f} s") from None
        after = torch.cuda.mem_get_info(device)[0]
        regions.put(None)
        return before - after
    finally:
        child.join(timeout=min(wait_s, 10))
        if child.is_alive():
            child.kill()


def contexts(add: Callable[..., None], device: torch.device, cuda: bool, wait_s: float = WAIT_S) -> None:
    """What the plan leaves for CUDA contexts, against what they hold: this process's beyond its allocator (its
    context, the libraries loaded by the checks before) within the default reserve, and another process's context
    on this gpu, made by opening a region through CUDA IPC as a peer-tier rank does, within CONTEXT_BYTES. add:
    gpu_check's Table.add (check, ok, figure, bar); wait_s: how long the child may take to open the region."""
    if not cuda:
        add("CUDA contexts against the plan's room for them", None, "no GPU here: not measured")
        return
    mib = 2**20
    own = outside_bytes(device)
    reserve = DEFAULT_RESERVE_BYTES
    add(
        "held outside the allocator, within the reserve",
        own <= reserve,
        f"{own / mib:.0f} MiB",
        f"<= {reserve / mib:.0f}",
    )
    peer = peer_context_bytes(device, wait_s)
    add(
        "another process's context (CUDA IPC)",
        peer <= CONTEXT_BYTES,
        f"{peer / mib:.0f} MiB",
        f"<= {CONTEXT_BYTES / mib:.0f}",
    )
