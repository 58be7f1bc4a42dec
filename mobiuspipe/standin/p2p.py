"""NCCL's point-to-point rules on gloo: one queue per communicator and peer, a send done only when received.

NCCL runs the sends and receives one rank posts on one communicator for one peer in post order on one
stream, and matches them with the peer's by order, not by tag; a send of more than NCCL's internal
buffers hold waits until the peer's matching receive runs (NVIDIA/nccl #479, #783). gloo lets each send
through on its own, so a schedule that would hang on NCCL runs on gloo. A StrictLink replays NCCL's rule:
a thread per (communicator, peer) plays the stream and takes the posted operations in order; a send first
waits for the peer's ticket, which the peer's link sends only when the matching receive reaches the head of
its queue, then moves the bytes. Two links whose heads are both sends (or both receives) wait on each other
forever, as NCCL would: the waiting rank's receive times out. A ticket carries the receiver's tag, so a
message paired with the wrong receive (order differs from tags) is an error, not silent corruption.
NCCL also makes a pair's communicator lazily, inside the first send or receive posted on it, and that post
blocks the host until the peer joins: a StrictLink's first post meets the peer's first post on the same link
(on the posting thread) before it returns.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from mobiuspipe.standin import StandInError

__all__ = ["StrictLink", "StrictWork"]

MEET_TAG = 2**31 - 1
"""The gloo tag of the message two links exchange at first contact (the traffic's tags, 2k and 2k + 1, stay below
it for a billion messages)."""


class StrictWork:
    """An operation posted on a StrictLink, with the parts of torch's Work that Comm uses."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._waited = False

    def is_completed(self) -> bool:
        """Whether the operation has ended and been waited for. NCCL's says whether the gpu has run it, and the host
        runs ahead of the gpu by as much as its launch queue holds: the stand-in takes the worst case, that the host
        never learns it before it waits (what the schedules prove is what a rank may count on)."""
        return self._waited and self._done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        """True once the operation ended; False if it has not within timeout; its error, if it failed."""
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            return False
        self._waited = True
        if self._error is not None:
            raise RuntimeError(str(self._error).splitlines()[0]) from self._error
        return True

    def _end(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()


@dataclass
class _Op:
    send: bool
    tensor: torch.Tensor
    tag: int
    work: StrictWork


class StrictLink:
    """This rank's traffic with `peer` on `group` (None: the default group), NCCL's way (module docstring)."""

    def __init__(self, rank: int, peer: int, group=None):
        self.rank, self.peer, self.group = rank, peer, group
        self._ops: queue.Queue[_Op | None] = queue.Queue()
        self._sent = self._taken = 0  # messages this link sent to / took from the peer so far
        self._met = False  # whether the first post has met the peer's (NCCL's lazy set-up)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"strict-p2p-{rank}-{peer}", daemon=True)
        self._thread.start()

    def isend(self, t: torch.Tensor, tag: int) -> StrictWork:
        return self._post(_Op(True, t, tag, StrictWork()))

    def irecv(self, buf: torch.Tensor, tag: int) -> StrictWork:
        return self._post(_Op(False, buf, tag, StrictWork()))

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop taking operations once those posted have run, and wait (timeout_s at most) for the thread to end
        (a link stuck on a dead peer stays stuck: its thread is a daemon)."""
        self._ops.put(None)
        self._thread.join(timeout_s)

    def _post(self, op: _Op) -> StrictWork:
        if not self._met:
            self._meet()
        self._ops.put(op)
        return op.work

    def _meet(self) -> None:
        """Block until the peer posts its first operation on this link too, as NCCL's lazy set-up of the pair's
        communicator blocks the first post; the group's timeout ends a wait for a peer that never comes (an
        error, raised to the poster)."""
        sent = dist.isend(torch.zeros(1), self.peer, group=self.group, tag=MEET_TAG)
        dist.recv(torch.empty(1), self.peer, group=self.group, tag=MEET_TAG)
        if sent is not None:  # None only for a rank outside the group (Link says so at its first post)
            sent.wait()
        self._met = True

    def _run(self) -> None:
        while (op := self._ops.get()) is not None:
            if self._error is not None:  # the stream is broken: everything behind the failure fails too
                op.work._end(self._error)
                continue
            try:
                (self._send if op.send else self._recv)(op)
            except BaseException as e:  # noqa: BLE001 -- handed to whoever waits on the operation
                self._error = e
                op.work._end(e)
                continue
            op.work._end()

    def _send(self, op: _Op) -> None:
        k, self._sent = self._sent, self._sent + 1
        ticket = torch.zeros(1, dtype=torch.int64)
        dist.recv(ticket, self.peer, group=self.group, tag=2 * k + 1)  # the peer's receive k is at its head
        if int(ticket) != op.tag:
            raise StandInError(
                f"rank {self.rank}: message {k} to rank {self.peer} is sent with tag {op.tag} but received as "
                f"tag {int(ticket)}: NCCL pairs the sends and receives of a pair by order, not by tag, so the "
                f"two ranks post them in different orders (a bug in the schedule)"
            )
        dist.send(op.tensor, self.peer, group=self.group, tag=2 * k)

    def _recv(self, op: _Op) -> None:
        k, self._taken = self._taken, self._taken + 1
        dist.send(torch.tensor([op.tag], dtype=torch.int64), self.peer, group=self.group, tag=2 * k + 1)
        dist.recv(op.tensor, self.peer, group=self.group, tag=2 * k)
