"""Activations and their gradients between ranks: torch.distributed send/recv, waited for while the peers live.

gloo carries CPU tensors (the stand-in); NCCL carries device tensors on CUDA. Without GPU peer-to-peer,
NCCL stages the bytes through host memory itself. A wait that fails raises PeerLostError naming this rank,
the peer and what was awaited. Under a watch on the peers' signs of life (mobiuspipe.runtime.peers.liveness) a
wait lasts while its peer lives and fails once the watch finds a peer lost; a hang among live ranks ends
at the process group's deadline. On NCCL a wait only orders the compute stream after the receive (the
host blocks later, at a synchronization, which the watch's abort ends). gloo's own point-to-point waits (the lax
stand-in's) can be neither polled nor sliced: they run on a thread of their own (liveness.Waiter) while this one
asks the watch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from mobiuspipe.errors import PeerLostError, PipelineError
from mobiuspipe.memory.ledger import DeviceLedger
from mobiuspipe.runtime.peers.channels import Channels
from mobiuspipe.runtime.peers.liveness import POLL_S, Waiter, Watch, await_work
from mobiuspipe.standin import StandInError
from mobiuspipe.standin.p2p import StrictWork
from mobiuspipe.standin.places import is_host, read_waiting

__all__ = ["Comm", "Posted", "TensorSpec"]

_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
"""The dtypes a tensor between stages may have, by their code in a TensorSpec header."""


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a tensor sent between ranks; sent ahead of it as a small int64 header until the
    receiver knows it (the first step of each batch shape)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    MAX_DIMS = 8
    """Dimensions a header has room for."""

    @classmethod
    def of(cls, t: torch.Tensor, what: str) -> TensorSpec:
        if t.dim() > cls.MAX_DIMS or t.dtype not in _DTYPES:
            raise PipelineError(
                f"{what} is a {t.dim()}-d {t.dtype} tensor; tensors between stages need at most "
                f"{cls.MAX_DIMS} dimensions and one of the dtypes {[str(d) for d in _DTYPES]}"
            )
        return cls(tuple(t.shape), t.dtype)

    def encode(self, device: torch.device) -> torch.Tensor:
        """[dtype code, ndim, dims..., 0 padding] as int64 of length MAX_DIMS + 2."""
        dims = list(self.shape) + [0] * (self.MAX_DIMS - len(self.shape))
        return torch.tensor([_DTYPES.index(self.dtype), len(self.shape), *dims], dtype=torch.int64, device=device)

    @classmethod
    def decode(cls, header: torch.Tensor) -> TensorSpec:
        """The spec a received header names: read on the host (a wait for the stream, once a message at a batch
        shape's first step)."""
        code, ndim, *dims = read_waiting(header)
        return cls(tuple(dims[:ndim]), _DTYPES[code])


@dataclass(frozen=True)
class Posted:
    """A receive posted and not yet taken: its request, the buffer it fills, and who and what it awaits."""

    work: dist.Work | StrictWork
    buf: torch.Tensor
    peer: str
    doing: str


class Comm:
    """Point-to-point traffic of one rank. Sends are asynchronous: a sent tensor is held until its send has
    completed, and dropped then (at the next send or receive, or where the engine's schedule proves it taken:
    release()), so the device does not keep a stage's outputs until the end of the step; flush() waits for the rest.
    A ledger, if given, counts each tensor in flight (("sending", n)) until its send has completed."""

    def __init__(
        self,
        rank: int,
        timeout_s: float,
        ledger: DeviceLedger | None = None,
        channels: Channels | None = None,
        place: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
        watch: Watch | None = None,
        bind: Callable[[], None] | None = None,
    ):
        """place: marks a received tensor as the gpu's memory (Device.place); watch: the rank's watch on its
        peers (None: every wait has the deadline timeout_s); bind: binds a thread to the rank's gpu
        (Device.bind_thread), for the waiter's thread."""
        self.rank, self.watch = rank, watch
        self._place = place
        self._stream_waits = torch.cuda.is_available()  # NCCL: waits order the compute stream only
        self.channels = channels or Channels(rank)
        self.timeout = timedelta(seconds=timeout_s)
        self.ledger = ledger
        self._sends: list[tuple[dist.Work | StrictWork, torch.Tensor, int, str, tuple | None]] = []
        self._waiter = Waiter(bind)  # gloo's point-to-point waits under a watch, and the warm-up's posts

    def warm_up(self, device: torch.device) -> None:
        """Set up every channel of this rank (Channels.warm_up), before the run's first message. On NCCL a channel's
        first post makes its communicator and blocks the host until the peer joins (so does the strict stand-in's):
        under a watch each warm-up message, posted and waited for, runs on the waiter's thread while this one asks
        the watch, so a peer lost before or during the warm-up is named once the watch finds it (after the verdict
        that thread may stay blocked: a daemon)."""
        if self.watch is None:
            self.channels.warm_up(device)
            return
        watch = self.watch

        def run(peer: int, post: Callable[[], dist.Work | StrictWork]) -> None:
            what = f"setting up the channel with rank {peer} (its first message)"
            try:
                self._waiter.wait(lambda: post().wait(), watch)
            except RuntimeError as e:
                raise self._failed(e, f"rank {peer}", what) from e

        self.channels.warm_up(device, run)

    def send(self, t: torch.Tensor, dst: int, tag: int, what: str, key: tuple | None = None) -> None:
        """Start sending t to rank dst; key: the action that sends it, for release()."""
        self._release_sent()
        if is_host(t):
            raise StandInError(f"rank {self.rank}: {what} is in host memory; NCCL sends device memory: copy it first")
        t = t.contiguous()
        work = self._start(lambda: self.channels.to(dst).isend(t, tag), f"rank {dst}", f"sending {what} to rank {dst}")
        if self.ledger is not None:
            self.ledger.hold(("sending", id(work)), t)
        self._sends.append((work, t, dst, what, key))

    def recv(self, spec: TensorSpec, device: torch.device, src: int, tag: int, what: str) -> torch.Tensor:
        return self.take(self.post_recv(spec, device, src, tag, what))

    def post_recv(
        self, spec: TensorSpec, device: torch.device, src: int, tag: int, what: str, early: bool = False
    ) -> Posted:
        """Start a receive into a new buffer and return at once; take() waits for it. Receives from one rank are
        matched in the order they are posted. early: posted ahead of the action that takes it. On CUDA a call that
        synchronizes the whole device (cudaFree when the caching allocator retries, a pinned allocation) waits for
        NCCL's receive kernel, so until it arrives the rank may be stuck at any call; the strict stand-in takes that
        worst case and waits for it here (mobiuspipe.schedule.ahead chooses the posts that survive it)."""
        self._release_sent()
        buf = self._place(torch.empty(spec.shape, dtype=spec.dtype, device=device))
        peer, doing = f"rank {src}", f"receiving {what} from rank {src}"
        posted = Posted(self._start(lambda: self.channels.frm(src).irecv(buf, tag), peer, doing), buf, peer, doing)
        if early and self.channels.strict:
            self._wait(posted.work, peer, doing)
        return posted

    def take(self, posted: Posted) -> torch.Tensor:
        """The buffer of a posted receive, once it has arrived (on NCCL: once the compute stream waits for it)."""
        self._wait(posted.work, posted.peer, posted.doing)
        return posted.buf

    def _release_sent(self) -> None:
        """Drop the tensors whose sends have completed (their errors, if any, raise here)."""
        self._drop_sends(lambda work, key: work.is_completed())

    def release(self, keys) -> None:
        """Drop the tensors of the sends of these actions (send's key), which the schedules prove taken: on NCCL the
        wait only orders the compute stream after the send (done by then on the gpu), so their memory goes back at
        once, where is_completed() would say so only once the gpu has caught up with the host."""
        if keys:
            self._drop_sends(lambda work, key: key in keys)

    def flush(self) -> None:
        """Wait until every send of this rank has been taken by its receiver."""
        self._drop_sends(lambda work, key: True)

    def _drop_sends(self, done) -> None:
        """Wait for each send that done(work, key) picks (no wait for one that has completed; on NCCL a stream's) and
        drop its tensor; keep the others."""
        sends, self._sends = self._sends, []
        for n, (work, t, dst, what, key) in enumerate(sends):
            if not done(work, key):
                self._sends.append((work, t, dst, what, key))
                continue
            try:
                self._wait(work, f"rank {dst}", f"sending {what} to rank {dst}")
            except BaseException:  # this one and the rest stay held (in flight, as far as this rank knows)
                self._sends += sends[n:]
                raise
            self._forget(work)

    def close(self, failed: bool = False) -> None:
        """Stop this rank's links (call after flush); failed: at once, not waiting for what they still carry."""
        self.channels.close(failed)
        self._waiter.close()

    def _forget(self, work) -> None:
        if self.ledger is not None:
            self.ledger.drop(("sending", id(work)))

    def send_spec(self, spec: TensorSpec, device: torch.device, dst: int, tag: int, what: str) -> None:
        """Send the header that tells the receiver the shape and dtype of the next tensor."""
        self.send(spec.encode(device), dst, tag, f"the shape of {what}")

    def recv_spec(self, device: torch.device, src: int, tag: int, what: str) -> TensorSpec:
        header = TensorSpec((TensorSpec.MAX_DIMS + 2,), torch.int64)
        return TensorSpec.decode(self.recv(header, device, src, tag, f"the shape of {what}"))

    def all_reduce(self, t: torch.Tensor, op, what: str) -> torch.Tensor:
        """In-place all-reduce of t over every rank, waited for as receives are."""
        work = self._start(lambda: dist.all_reduce(t, op=op, async_op=True), "another rank", what)
        self._wait(work, "another rank", f"all-reduce of {what}", collective=True)
        return t

    def reduce_values(self, values: list[float], op, what: str, device: torch.device) -> list[float]:
        """values all-reduced over every rank (as float64 on device), read on the host. On NCCL the read is where the
        host waits; a watch that found a peer lost meanwhile has aborted the reduction: its verdict, not the values."""
        t = self.all_reduce(torch.tensor(values, dtype=torch.float64, device=device), op, what).tolist()
        self._check_peers()
        return t

    def _start(self, post, peer: str, what: str):
        """post() (an isend, irecv or collective), once the watch has found no peer lost; the backend's error on
        posting it (gloo reports a peer that closed its connection here, not at the wait) as PeerLostError. After
        the watch's abort (on NCCL) the groups are gone and torch refuses the post with a ValueError: the verdict
        is raised instead."""
        self._check_peers()
        try:
            return post()
        except ValueError:  # the groups are gone: after the watch's abort its verdict says why
            self._check_peers()
            raise
        except RuntimeError as e:
            raise self._failed(e, peer, what) from e

    def _wait(self, work, peer: str, what: str, collective: bool = False) -> None:
        """Wait for work: on NCCL for the compute stream's order only; under a watch while the peers live (gloo's
        point-to-point waits on the waiter's thread, until the process group's deadline); otherwise for timeout at
        most."""
        try:
            if self._stream_waits:
                self._check_peers()
                ok = work.wait()
            elif self.watch is not None and isinstance(work, StrictWork):
                while not work.wait(timedelta(seconds=POLL_S[1])):
                    self.watch.check()
                ok = True
            elif self.watch is not None and collective:
                await_work(work, self.watch)
                ok = True
            elif self.watch is not None:
                ok = self._waiter.wait(work.wait, self.watch)
            else:
                ok = work.wait(self.timeout)
        except RuntimeError as e:
            raise self._failed(e, peer, what) from e
        if ok is False:
            raise PeerLostError(self._message(peer, what, f"no answer within {self.timeout.total_seconds():g} s"))

    def _failed(self, e: BaseException, peer: str, what: str) -> PeerLostError:
        """The backend's error e as PeerLostError; a lost peer's verdict, if the watch has one, is raised instead (it
        says more than the backend's error)."""
        self._check_peers()
        return PeerLostError(self._message(peer, what, str(e).splitlines()[0]))

    def _check_peers(self) -> None:
        if self.watch is not None:
            self.watch.check()

    def _message(self, peer: str, what: str, cause: str) -> str:
        if self.watch is None:  # a deadline per wait
            return (
                f"rank {self.rank}: {what} failed ({cause}); {peer} has probably died or hangs: look at its log "
                f"above. Raise runtime.comm_timeout_s if {peer} is only slow"
            )
        return (  # the peer gave signs of life until now: it died just now, or the ranks wait on each other
            f"rank {self.rank}: {what} failed ({cause}); {peer} has died, or it lives and the ranks wait on each "
            f"other (a hang, which runtime.hang_timeout_s ends): look at its log above. Raise runtime.hang_timeout_s "
            f"if {peer} only takes that long"
        )
