"""Who this process is in the job (rank, world size, local rank) and its membership of the process group.

The answer comes from torch.distributed when a process group exists, else from the variables torchrun
sets (RANK, WORLD_SIZE, LOCAL_RANK), else the process is a job of one rank and needs no group. Once the
ranks have agreed on a plan, a Membership watches the others' signs of life (mobiuspipe.runtime.peers.liveness):
a peer that gives none for comm_timeout_s is lost, while the process group's deadline (hang_timeout_s)
only ends operations that live ranks wait on for longer, a hang.
"""

from __future__ import annotations

import os
import pickle
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, _abort_process_group, _get_default_store
from torch.distributed.rendezvous import rendezvous as env_rendezvous

from mobiuspipe.errors import PeerLostError, PipelineError, WorldSizeError
from mobiuspipe.runtime.peers import liveness
from mobiuspipe.runtime.peers.liveness import Liveness, await_work

__all__ = [
    "RankInfo",
    "rank_info",
    "local_world_size",
    "Membership",
    "join_group",
    "leave_group",
    "attempt_prefix",
    "abort_group",
    "gather_all",
]

BEAT_PREFIX = "mobiuspipe/beat"
"""Where in the job's store the ranks count their beats."""
MIN_STORE_TIMEOUT_S = 1.0
"""The shortest deadline of the beats' store client for its connection (s)."""


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
        rank, world = dist.get_rank(), dist.get_world_size()
        if world > 1 and "LOCAL_RANK" not in os.environ and torch.cuda.is_available():
            raise WorldSizeError(
                f"rank {rank} of a process group of {world}: LOCAL_RANK is not set, so every rank would take gpu 0 "
                f"(NCCL then stops with 'Duplicate GPU detected'): set LOCAL_RANK to this process's gpu on its host "
                f"before making the Pipeline (torchrun sets it)"
            )
        return _gpu_seen(RankInfo(rank, world, local, True))
    if "WORLD_SIZE" not in os.environ:
        return _gpu_seen(RankInfo(0, 1, 0, False))
    try:
        info = RankInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), local, True)
    except (KeyError, ValueError) as e:
        raise WorldSizeError(
            f"WORLD_SIZE is set but RANK is {os.environ.get('RANK')!r}: start training with "
            f"`torchrun --nproc_per_node N ...`, which sets both"
        ) from e
    return _gpu_seen(info)


def _gpu_seen(info: RankInfo) -> RankInfo:
    """info, once its gpu (LOCAL_RANK, the index of this host's gpus the rank takes) is one this process sees; on
    CUDA a WorldSizeError naming CUDA_VISIBLE_DEVICES otherwise (a launcher that narrows it to each rank's own gpu
    leaves every process one gpu, index 0), where CUDA would only say "invalid device ordinal"."""
    if not torch.cuda.is_available() or info.local_rank < (seen := torch.cuda.device_count()):
        return info
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    raise WorldSizeError(
        f"rank {info.rank} takes gpu {info.local_rank} of this host (LOCAL_RANK), but this process sees {seen} gpu"
        f"{'s' if seen != 1 else ''} (CUDA_VISIBLE_DEVICES is {visible!r}): leave CUDA_VISIBLE_DEVICES the same "
        "for every rank of the host (list the gpus the job may use, in the order LOCAL_RANK counts them), or unset it"
    )


def local_world_size(world_size: int) -> int:
    """The job's ranks on this host: torchrun's LOCAL_WORLD_SIZE, else all world_size of them (one host)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


class Membership:
    """This rank in the job's process group: joined (or found made by the caller), its peers watched once the ranks
    agree on a plan, and left (aborted first after an error)."""

    def __init__(self, info: RankInfo, comm_timeout_s: float, hang_timeout_s: float):
        """comm_timeout_s: a peer silent this long is lost; hang_timeout_s: the process group's deadline (s)."""
        if not 0 < comm_timeout_s <= hang_timeout_s:
            raise PipelineError(
                f"comm_timeout_s {comm_timeout_s!r} and hang_timeout_s {hang_timeout_s!r}: expected 0 < comm_timeout_s "
                f"<= hang_timeout_s (how long a rank may give no sign of life, then how long live ranks may wait)"
            )
        self.info, self.comm_timeout_s, self.hang_timeout_s = info, comm_timeout_s, hang_timeout_s
        self.owned = join_group(info, hang_timeout_s)
        self.liveness: Liveness | None = None

    def watch(self) -> None:
        """Start beating and watching the other ranks (in a job of several ranks: self.liveness)."""
        if self.info.world_size > 1 and self.liveness is None:
            store = self._beat_store()
            exit_after = 2 * self.comm_timeout_s if self.owned else None  # a process the job made is its to end
            self.liveness = Liveness(
                self.info.rank, self.info.world_size, store, self.comm_timeout_s, self._abort, exit_after_s=exit_after
            )
            liveness.watching(self.liveness.start())

    def _beat_store(self):
        """Where the beats go: where join_group met the others through MASTER_ADDR and MASTER_PORT, a client of that
        store of its own (a call stuck on a stopped store host, rank 0 when no torchrun agent hosts it, then holds no
        lock the group's own calls need; its connection gives up after half of comm_timeout_s); else the group's
        store."""
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not (self.owned and addr and port):
            return PrefixStore(BEAT_PREFIX, _get_default_store())
        timeout = timedelta(seconds=max(self.comm_timeout_s / 2, MIN_STORE_TIMEOUT_S))
        client = dist.TCPStore(addr, int(port), is_master=False, timeout=timeout)  # pyright: ignore[reportPrivateImportUsage]
        return PrefixStore(f"{attempt_prefix()}/{BEAT_PREFIX}", client)

    def _abort(self) -> None:
        """The watch's answer to a lost peer (on its own thread, bound first to the rank's gpu: a new thread's is gpu
        0, where NCCL's calls would make a context)."""
        if torch.cuda.is_available():
            torch.cuda.set_device(self.info.local_rank)
        abort_group(self.owned)

    def abort(self) -> None:
        """After an error: stop beating (the peers will find this rank lost) and abort the group (abort_group)."""
        self._unwatch(done=False)
        self._abort()

    def close(self, failed: bool = False) -> None:
        """Stop watching (done: the peers watch this rank no more, unless failed) and leave the group (leave_group)."""
        self._unwatch(done=not failed)
        leave_group(self.owned)

    def _unwatch(self, done: bool) -> None:
        if self.liveness is not None:
            liveness.watching(None)
            self.liveness.stop(done)
            self.liveness = None


NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
"""What NCCL's watchdog does with an operation that failed or outlived the group's deadline (hang_timeout_s), unless
the user set it: 2 aborts the communicator only, so the rank's next wait or post raises and the rank says what
hung. torch's default, 3, ends the process at once without a word, and would race the watch's own abort of a lost
peer's communicators (torch's note on _abort_process_group asks for the watchdog's handling off beside it)."""


def join_group(info: RankInfo, timeout_s: float) -> bool:
    """Create the process group if the job has several ranks and none exists, with timeout_s as its operations'
    deadline; True if this call made it. On CUDA the rank's gpu becomes the current device first, in a group the
    caller made too: NCCL and the object collectives work on it."""
    if info.world_size == 1:
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)  # before any collective: NCCL uses the current device
        os.environ.setdefault(*NCCL_ERROR_HANDLING)  # read as ProcessGroupNCCL is made
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
    store = PrefixStore(attempt_prefix(), store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return True


def attempt_prefix() -> str:
    """The job's keys in its store, this attempt's alone: a job torchrun restarts (--max-restarts) meets again in the
    same store, and a restarted rank could read the address its dead peer left there and wait on it forever."""
    return f"mobiuspipe/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


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


GATHER_CHUNK = 64 << 20
"""Bytes gather_all moves a collective at a time: on NCCL through the gpu, beside the arena, world_size times."""


def gather_all(info: RankInfo, obj: Any) -> list[Any]:
    """Every rank's obj (picklable), in rank order, on every rank; [obj] in a job of one rank. Under a watch
    (Membership.watch) it waits while every peer lives, however long they take to come, and moves the pickled
    objects GATHER_CHUNK bytes at a time (on NCCL gpu memory the plan does not count)."""
    if info.world_size == 1:
        return [obj]
    watch = liveness.current()
    if watch is None:
        out: list[Any] = [None] * info.world_size
        dist.all_gather_object(out, obj)
        return out
    watch.check()  # no collective begins after a peer is lost
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(info.world_size)]
    _gathered(info, dist.all_gather(sizes, size, async_op=True), watch)
    counts = [int(s) for s in sizes]
    out = [bytearray(n) for n in counts]
    for start in range(0, max(counts), GATHER_CHUNK):
        n = min(GATHER_CHUNK, max(counts) - start)
        piece = torch.zeros(n, dtype=torch.uint8, device=device)
        mine = data[start : start + n]
        piece[: mine.numel()] = mine.to(device)
        parts = [torch.empty_like(piece) for _ in range(info.world_size)]
        _gathered(info, dist.all_gather(parts, piece, async_op=True), watch)
        for whole, part, count in zip(out, parts, counts):
            if count > start:
                whole[start : min(count, start + n)] = part[: min(count, start + n) - start].cpu().numpy().tobytes()
    return [pickle.loads(whole) for whole in out]


def _gathered(info: RankInfo, work, watch: Liveness) -> None:
    """Wait for a gather's operation while the peers live; its failure as PeerLostError (the verdict if any)."""
    try:
        await_work(work, watch)
    except RuntimeError as e:
        quiet = watch.quiet_peers()  # a few beats: a killed rank's connections reset before the verdict could come
        watch.check()  # a lost peer's verdict says more than the backend's error
        who = (
            f"rank{'s' if len(quiet) > 1 else ''} {', '.join(map(str, quiet))} gave no sign of life since: "
            "probably died; look at its log"
            if quiet
            else "a rank has probably died or hangs: look at the other ranks' logs"
        )
        raise PeerLostError(
            f"rank {info.rank}: a gather of every rank's data failed ({str(e).splitlines()[0]}); {who}"
        ) from e
