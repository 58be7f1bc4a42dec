"""One rank of the point-to-point tests (run by torchrun): a scenario on Channels, its outcome to a JSON file."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _abort_process_group

from mobiuspipe.errors import PeerLostError
from mobiuspipe.runtime.peers.channels import Channels, Link
from mobiuspipe.runtime.peers.comm import Comm, TensorSpec
from mobiuspipe.runtime.peers.ranks import Membership, RankInfo
from mobiuspipe.standin.p2p import StrictLink

WAIT = timedelta(seconds=3)
WARM_UP_BOUND_S = 15.0


def _warm_up(ch: Channels, rank: int, peer: int) -> str | None:
    """Warm the channels up, spying on their links: with a communicator per direction, each carries one message
    first, in the order of the pairs (0, 1) then (1, 0) on both ranks, and no collective runs. What went wrong, or
    None."""
    seen: list[tuple[str, int]] = []
    spied = {}
    for kind in (Link, StrictLink):
        for op in ("isend", "irecv"):
            spied[kind, op] = getattr(kind, op)
            setattr(kind, op, _spy(spied[kind, op], op, seen))
    collectives = []
    all_reduce, dist.all_reduce = dist.all_reduce, lambda *a, **k: collectives.append(a)
    try:
        ch.warm_up(torch.device("cpu"))
    finally:
        dist.all_reduce = all_reduce
        for (kind, op), f in spied.items():
            setattr(kind, op, f)
    if collectives:
        return f"warm-up ran {len(collectives)} collectives on the channels' groups"
    if ch.layout == "pair":
        return None if not seen else f"warm-up sent {seen} on the default group"
    want = [("isend", 0), ("irecv", 0)] if rank == 0 else [("irecv", 0), ("isend", 0)]
    return None if seen == want else f"warm-up posted {seen}, expected {want}"


def _spy(f, op: str, seen: list):
    def spied(self, t, tag):
        seen.append((op, tag))
        return f(self, t, tag)

    return spied


def _cross(layout: str, rank: int, peer: int) -> str:
    """Both ranks send 1 MiB to each other first, then receive: NCCL's 'both send, then both receive' hang."""
    ch = Channels(rank, layout, [(0, 1), (1, 0)], timeout_s=30)
    wrong = _warm_up(ch, rank, peer)
    if wrong is not None:
        return wrong
    sent = ch.to(peer).isend(torch.full((1 << 18,), float(rank)), tag=7)
    got = torch.empty(1 << 18)
    done = ch.frm(peer).irecv(got, tag=7).wait(WAIT)
    if not done:
        return "timeout"
    sent.wait(WAIT)
    return "ok" if bool((got == peer).all()) else "wrong data"


def _order(rank: int) -> str:
    """Rank 0 sends tags 5 then 6; rank 1 receives 6 then 5 (NCCL would pair them by order)."""
    ch = Channels(rank, "direction", [(0, 1)], timeout_s=30)
    try:
        if rank == 0:
            a, b = ch.to(1).isend(torch.ones(4), tag=5), ch.to(1).isend(torch.ones(4), tag=6)
            return "ok" if a.wait(WAIT) and b.wait(WAIT) else "timeout"
        works = [ch.frm(0).irecv(torch.empty(4), tag=t) for t in (6, 5)]
        return "ok" if all(w.wait(WAIT) for w in works) else "timeout"
    except RuntimeError as e:
        return f"error: {e}"


def _hang(rank: int) -> str:
    """Both ranks, alive and beating, wait for a message the other never sends (a schedule's bug): the wait outlives
    comm_timeout_s (1 s: nobody is lost) and ends at the channels' deadline (hang_timeout_s, 4 s)."""
    group = Membership(RankInfo(rank, 2, rank, True), comm_timeout_s=1.0, hang_timeout_s=4.0)
    group.watch()
    comm = Comm(rank, 1.0, channels=Channels(rank, "direction", [(0, 1), (1, 0)], 4.0), watch=group.liveness)
    start = time.monotonic()
    try:
        comm.recv(TensorSpec((4,), torch.float32), torch.device("cpu"), 1 - rank, 3, "a message never sent")
        return "received"
    except PeerLostError as e:
        return f"after {time.monotonic() - start:.1f} s: {e}"


def _warm_up_lost(rank: int, out: Path) -> str:
    """Rank 1 stops beating before the channels' warm-up and never takes part (as if stopped there); rank 0's
    warm-up message waits for it: the watch should end that wait once rank 1 has given no sign of life for
    comm_timeout_s (1.5 s), long before the channels' deadline (hang_timeout_s, 60 s). Rank 0 gives the warm-up
    WARM_UP_BOUND_S, then reports it hung; rank 1 stays until rank 0 has written its outcome."""
    group = Membership(RankInfo(rank, 2, rank, True), comm_timeout_s=1.5, hang_timeout_s=60.0)
    group.watch()
    channels = Channels(rank, "direction", [(0, 1), (1, 0)], 60.0)
    if rank == 1:
        assert group.liveness is not None
        group.liveness.stop(done=False)
        deadline = time.monotonic() + 2 * WARM_UP_BOUND_S
        while not (out / "rank0.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        return "stopped"
    comm = Comm(rank, 1.5, channels=channels, watch=group.liveness)
    outcome: list[str] = []
    start = time.monotonic()

    def warm_up() -> None:
        try:
            comm.warm_up(torch.device("cpu"))
            outcome.append("warmed up")
        except PeerLostError as e:
            outcome.append(f"after {time.monotonic() - start:.1f} s: {e}")

    thread = threading.Thread(target=warm_up, daemon=True)
    thread.start()
    thread.join(WARM_UP_BOUND_S)
    return outcome[0] if outcome else f"hung for {WARM_UP_BOUND_S:g} s"


def _after_abort(rank: int, out: Path) -> list[str] | str:
    """On NCCL the watch answers a lost peer by aborting every group of the job (torch's _abort_process_group, which
    also unregisters them), and the host, blocked behind the aborted kernels, goes on to its next message. Here the
    watch runs that abort (it works on gloo too) while rank 0 is busy outside any wait; its next send and its next
    reduction should each name the lost rank 1. Rank 1 stops beating after the warm-up and stays until rank 0 is
    done."""
    Membership._abort = lambda self: _abort_process_group()  # what it does on NCCL
    group = Membership(RankInfo(rank, 2, rank, True), comm_timeout_s=1.5, hang_timeout_s=60.0)
    group.watch()
    assert group.liveness is not None
    comm = Comm(rank, 1.5, channels=Channels(rank, "direction", [(0, 1), (1, 0)], 60.0), watch=group.liveness)
    comm.warm_up(torch.device("cpu"))
    if rank == 1:
        group.liveness.stop(done=False)
        deadline = time.monotonic() + 2 * WARM_UP_BOUND_S
        while not (out / "rank0.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        return "stopped"
    deadline = time.monotonic() + WARM_UP_BOUND_S
    while group.liveness.verdict is None and time.monotonic() < deadline:
        time.sleep(0.1)  # busy outside any wait while the watch finds rank 1 lost and aborts
    calls = (
        lambda: comm.send(torch.ones(4), 1, 3, "a message after the abort"),
        lambda: comm.reduce_values([1.0], dist.ReduceOp.SUM, "a sum after the abort", torch.device("cpu")),
    )
    outcomes = []
    for call in calls:
        try:
            call()
            outcomes.append("no error")
        except Exception as e:  # noqa: BLE001 - the outcome is what the test checks
            outcomes.append(f"{type(e).__name__}: {e}")
    return outcomes


def main(scenario: str, out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    if scenario == "hang":
        result = _hang(rank)
    elif scenario == "warm_up_lost":
        result = _warm_up_lost(rank, out)
    elif scenario == "after_abort":
        result = _after_abort(rank, out)
    else:
        result = _order(rank) if scenario == "order" else _cross(scenario, rank, 1 - rank)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # a link stuck on purpose would hold the process group's teardown


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
