"""The host threads a rank uses: how many torch threads it takes (runtime.threads: auto gives each rank of the host its
share of the cores it may run on), and the cores its host-update thread is pinned to (those of its gpu's NUMA node).

Threads: torch's intra-op pool runs the compute on the stand-ins and the CPU Adam's kernel (at::parallel_for) on the
update thread; with `auto` a rank takes floor(C / R) threads, C the cores this process may run on
(os.sched_getaffinity) and R the ranks torchrun started on this host (LOCAL_WORLD_SIZE), at least 1.

Pinning: the Adam update is bound by memory bandwidth, so it runs best on the cores of the NUMA node whose memory
holds the states it steps, the node of the rank's gpu, where its pinned buffers are too; so do the rank's other
host-work threads (the gradients' finisher: an accumulated pass's add and its norm; the SSD and activation threads'
staging), each a Device.executor (mobiuspipe.startup.engine.rank_device). The gpu's cpulist comes from
the topology (NVML's CPU affinity or sysfs's local_cpulist: topology.types.Gpu.cpu_affinity), kept to the cores this
process may use; where the topology does not know it, or on a CPU stand-in (whose gpus are not real), the thread is
not pinned. A pinned thread lowers torch's threads to its cores where they were more (one gpu on a two-socket host
would otherwise run a team of all the host's cores on one node's).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

__all__ = ["rank_threads", "parse_cpulist", "update_cpus", "update_cores_of", "pinned_to"]


def _allowed() -> set[int]:
    """The cores this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def rank_threads(setting: int | None, local_ranks: int | None = None) -> int:
    """The torch threads of a rank: `setting` (runtime.threads), or with None (auto) its share of the cores among the
    `local_ranks` ranks of this host (default: LOCAL_WORLD_SIZE, else 1)."""
    if setting is not None:
        return setting
    ranks = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, len(_allowed()) // max(1, ranks))


def parse_cpulist(text: str) -> set[int]:
    """The cores of a Linux cpulist ("0-11,24-35", "3", ""); ValueError for text that is not one."""
    cores: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        first, dash, last = part.partition("-")
        lo, hi = int(first), int(last if dash else first)
        if hi < lo:
            raise ValueError(f"cpulist range {part!r} runs backwards")
        cores.update(range(lo, hi + 1))
    return cores


def update_cpus(cpu_affinity: str, on_gpu: bool) -> set[int] | None:
    """The cores a rank's update thread is pinned to: its gpu's (cpu_affinity, a cpulist) that this process may use;
    None (not pinned) off a gpu, where the topology does not know them, or where none of them is allowed."""
    if not on_gpu or not cpu_affinity:
        return None
    try:
        near = parse_cpulist(cpu_affinity) & _allowed()
    except ValueError:
        return None
    return near or None


def update_cores_of(layout, rank: int, on_gpu: bool) -> set[int] | None:
    """update_cpus for `rank`'s gpu in a plan's topology (layout: a topology.Topology, or None: the plan has none)."""
    if layout is None or rank >= layout.num_gpus:
        return None
    return update_cpus(layout.gpus[rank].cpu_affinity, on_gpu)


def pinned_to(cores: set[int] | None) -> Callable[[], None]:
    """A thread initializer (ThreadPoolExecutor's) that pins the calling thread to `cores` (Linux: the affinity of
    the thread alone; its OpenMP workers, started after, inherit it) and lowers torch's threads to len(cores) where
    they were more: a team larger than the cores it may run on spins against itself (torch's thread count is the
    process's, which on a gpu computes on the gpu, not in that pool); a no-op for None."""

    def pin() -> None:
        if cores:
            os.sched_setaffinity(0, cores)
            if torch.get_num_threads() > len(cores):
                torch.set_num_threads(len(cores))

    return pin
