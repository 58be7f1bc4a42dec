"""The communicators that carry messages between ranks, and the link to each peer on them.

NCCL runs the sends and receives of one communicator with one peer in post order on one stream, and a
send may wait until the peer's matching receive runs. Layouts:
- "pair": every message of a pair of ranks, both ways, on the default group (one queue per pair);
- "direction": one two-rank communicator for each direction of each pair that exchanges messages, so a
  queue holds only sends on one end and only receives on the other, posted in the same order (the schedule
  checker proves it): a send then waits only for a receive its peer posts in turn.
Under MOBIUSPIPE_STRICT=1 on the CPU each link is a StrictLink (mobiuspipe.standin.p2p), which runs gloo
to NCCL's rule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

from mobiuspipe.standin import strict
from mobiuspipe.standin.p2p import StrictLink, StrictWork

__all__ = ["Link", "Channels", "LAYOUTS", "LAYOUT", "neighbour_pairs"]

LAYOUTS = ("pair", "direction")
LAYOUT = "direction"
"""The layout runs use (the schedule checker proves their schedules under it)."""
Work = dist.Work | StrictWork
"""A posted operation's request: the backend's, or a StrictLink's."""
WARM_UP_TAG = 0
"""The tag of the message warm_up sends on each channel before any of the run's."""


def neighbour_pairs(mapping: list[int]) -> set[tuple[int, int]]:
    """Both directions of each pair of ranks that hold adjacent stages (activations one way, gradients back)."""
    return {p for a, b in zip(mapping, mapping[1:]) if a != b for p in ((a, b), (b, a))}


class Link:
    """This rank's traffic with `peer` on `group` (None: the default group), as the backend runs it."""

    def __init__(self, rank: int, peer: int, group=None):
        self.rank, self.peer, self.group = rank, peer, group

    def isend(self, t: torch.Tensor, tag: int) -> dist.Work:
        return self._posted(dist.isend(t, self.peer, group=self.group, tag=tag), "isend")

    def irecv(self, buf: torch.Tensor, tag: int) -> dist.Work:
        return self._posted(dist.irecv(buf, self.peer, group=self.group, tag=tag), "irecv")

    def _posted(self, work: dist.Work | None, what: str) -> dist.Work:
        if work is None:  # this rank is not in the group: a bug in the launch, not in the data
            raise RuntimeError(f"rank {self.rank}: {what} with rank {self.peer} returned no request")
        return work

    def close(self, timeout_s: float = 10.0) -> None:
        """Nothing to stop: the backend runs the operations (the signature is StrictLink's)."""


class Channels:
    """The link this rank sends to each peer on (to) and receives from each peer on (frm)."""

    def __init__(
        self, rank: int, layout: str = "pair", pairs: Iterable[tuple[int, int]] = (), timeout_s: float | None = None
    ):
        """pairs: the (sender, receiver) ranks that exchange messages ("direction" makes a communicator for each,
        on every rank, in one order: call it on every rank with the same pairs); timeout_s: their deadline."""
        if layout not in LAYOUTS:
            raise ValueError(f"channel layout {layout!r}: expected one of {LAYOUTS}")
        self.rank, self.layout = rank, layout
        self._strict = strict() and not torch.cuda.is_available()
        self._links: dict[tuple[object, int], Link | StrictLink] = {}
        self._groups: dict[tuple[int, int], object] = {}
        if layout == "direction":
            for a, b in sorted(set(pairs)):
                timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
                group = dist.new_group(sorted((a, b)), timeout=timeout)  # every rank makes every group, in one order
                if rank in (a, b):
                    self._groups[(a, b)] = group

    @property
    def strict(self) -> bool:
        """Whether the links follow NCCL's rules on the CPU stand-in (StrictLink, MOBIUSPIPE_STRICT=1)."""
        return self._strict

    @property
    def reports_completion(self) -> bool:
        """Whether a send reports completion once its receiver took it (NCCL, the strict stand-in), rather than
        only once waited on (gloo's send requests: Comm then holds every send until its flush)."""
        return torch.cuda.is_available() or self.strict

    @property
    def receives_apart(self) -> bool:
        """Whether the receives from each peer have a queue of their own ("direction"), so that a receive posted
        early runs after the receives posted before it and cannot get ahead of a send."""
        return self.layout == "direction"

    def warm_up(self, device: torch.device, run: Callable[[int, Callable[[], Work]], None] | None = None) -> None:
        """Set up every channel of this rank now, in one order on every rank, by a one-element message in the
        direction it carries: NCCL makes a group's point-to-point communicator and connection lazily at first
        contact otherwise (lazy set-ups in different orders can deadlock), and its buffers then exist before the
        start-up room check reads the gpu's free memory. No collective runs on a channel's group: ProcessGroupNCCL
        gives collectives a communicator of their own, which would hold memory and carry nothing. The message goes
        first on both ends of its channel (it pairs by order). run(peer, post): posts a message (post() returns its
        request) and waits for it (Comm.warm_up's, under the watch); None: here, by the backend's own wait."""
        for (src, dst), _ in sorted(self._groups.items()):
            if self.rank == src:
                peer, post = dst, partial(self._warm_up_message, True, dst, device)
            else:
                peer, post = src, partial(self._warm_up_message, False, src, device)
            if run is None:
                post().wait()
            else:
                run(peer, post)

    def _warm_up_message(self, send: bool, peer: int, device: torch.device) -> Work:
        if send:
            return self.to(peer).isend(torch.zeros(1, device=device), tag=WARM_UP_TAG)
        return self.frm(peer).irecv(torch.empty(1, device=device), tag=WARM_UP_TAG)

    def to(self, dst: int) -> Link | StrictLink:
        """The link messages to rank dst go on."""
        return self._link(self._group(self.rank, dst), dst)

    def frm(self, src: int) -> Link | StrictLink:
        """The link messages from rank src come on."""
        return self._link(self._group(src, self.rank), src)

    def _group(self, src: int, dst: int):
        if self.layout == "pair":
            return None
        if (src, dst) not in self._groups:
            raise RuntimeError(
                f"rank {self.rank}: no channel from rank {src} to rank {dst}: the pairs given to Channels miss "
                f"a pair the run exchanges messages on (a bug in the pipeline's set-up)"
            )
        return self._groups[(src, dst)]

    def _link(self, group, peer: int) -> Link | StrictLink:
        key = (id(group) if group is not None else None, peer)
        if key not in self._links:
            self._links[key] = (StrictLink if self._strict else Link)(self.rank, peer, group)
        return self._links[key]

    def close(self, failed: bool = False) -> None:
        """Stop every link; failed: without waiting for operations a lost peer will never match."""
        for link in self._links.values():
            if failed:
                link.close(timeout_s=0.0)
            else:
                link.close()
        self._links.clear()
