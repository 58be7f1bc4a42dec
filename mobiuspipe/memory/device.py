"""The gpu a rank drives, with CPU stand-ins for what CUDA provides: copy streams and pinned memory.

Copies run on streams of their own (mobiuspipe.memory.streams): loads (host -> device, each waiting only for
its slot's users) on the copy-in stream, held activations coming back (copy_back, each waiting for the compute
queued at its start) on the swap-in stream, so that no load queues behind that compute, and swap-outs and
offloads (device -> host) on the copy-out stream; a copy between host memory and a peer gpu's memory runs on a
stream of that gpu (peer_stream), since CUDA runs it there. The SSD weights' loads and
gradient offloads run as jobs off the compute thread (stream_in, stream_out) that issue their copies group by
group. A thread that does device work (issues copies, waits on their events) must first bind itself to the gpu
(bind_thread, or make it with executor): a new CUDA thread's current device is 0 whatever rank it serves. Under
MOBIUSPIPE_STRICT=1 the stand-in refuses device work from a thread bound to another gpu (or to none, on gpus
other than 0), refuses a mark of the compute queued so far (computed, or a copy waiting for that compute) from any
thread but the one that made the Device (the one that queues the compute: a mark taken elsewhere covers whatever
compute happens to be queued then), marks the tensors it places (mobiuspipe.standin.places), refuses a copy
between host memory and another gpu's memory on this gpu's streams, and refuses page-locking host memory during a
span of messages (stepping), where CUDA may synchronize the whole gpu for it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from functools import wraps

import torch

from mobiuspipe.memory.aio import aligned_empty
from mobiuspipe.memory.pinned import PinnedBlocks, Register, Unregister, cuda_registration
from mobiuspipe.memory.streams import CopyHandle, CopyStream
from mobiuspipe.standin import StandInError, strict
from mobiuspipe.standin.places import gpu_of, in_pass, is_host, on_gpu, on_host, plain

__all__ = ["Device", "CopyHandle", "CopyStream", "PIN_COPY_LIMIT", "upload_route", "on_compute_stream"]

PIN_COPY_LIMIT = 16 << 20
"""Bytes up to which Device.to_device takes a pageable host tensor that may wait (a stage's states at start-up or
from a checkpoint) through torch's pinned allocator (a block rounded up to a power of two and kept in its cache:
small ones only); a larger one is copied from pageable memory."""


def upload_route(t: torch.Tensor, may_wait: bool = False, locked: bool = False) -> str:
    """How Device.to_device copies host tensor t on CUDA: "pinned" (t is page-locked, torch's block or `locked`, a
    buffer the Device registered itself (Device.page_locked): read in place, the host does not wait), "pin" (a
    pageable t through torch's pinned allocator, the host does not wait) or "pageable" (from pageable memory, the host
    waiting until the stream has passed the copy). A copy that may wait (a stage's states at start-up
    or from a checkpoint, once) takes "pageable" over PIN_COPY_LIMIT: it would otherwise take blocks of up to twice
    its size that stay page-locked in torch's cache, counted by no budget. One that may not (what a step or an
    evaluation uploads: a microbatch's inputs and targets, whose blocks the cache hands to the next step's) takes
    "pin" at any size."""
    if locked or t.is_pinned():
        return "pinned"
    return "pageable" if may_wait and t.numel() * t.element_size() > PIN_COPY_LIMIT else "pin"


def deterministic_kernels() -> None:
    """Make this process's torch kernels deterministic (runtime.deterministic): call it before the first CUDA
    work, since cuBLAS reads its workspace setting once."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def on_compute_stream(method):
    """A method of an object with a `device` (a Device) whose kernels run on that gpu's compute stream, whatever
    stream the caller is in (Device.computing)."""

    @wraps(method)
    def on_stream(self, *args, **kwargs):
        with self.device.computing():
            return method(self, *args, **kwargs)

    return on_stream


class Device:
    """One gpu (or its CPU stand-in): where the arena lives and how copies reach it."""

    def __init__(self, local_rank: int = 0, use_cuda: bool | None = None):
        self.is_cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
        self.index = local_rank
        """The gpu's index on this host (its CUDA device index; the stand-in's, for the thread rule)."""
        self.bind_thread()
        self.torch_device = torch.device("cuda", local_rank) if self.is_cuda else torch.device("cpu")
        self.compute = torch.cuda.current_stream(self.torch_device) if self.is_cuda else None
        """The stream the rank computes on (named, not taken from the calling thread's current stream)."""
        self._owner = threading.get_ident()
        """The thread that queues the compute (the one that made the Device)."""
        self._in = CopyStream(local_rank, self.is_cuda, "copy-in", self.compute, self._check_thread)
        self._back = CopyStream(local_rank, self.is_cuda, "swap-in", self.compute, self._check_thread)
        self._out = CopyStream(local_rank, self.is_cuda, "copy-out", self.compute, self._check_thread)
        self._peers: dict[int, CopyStream] = {}
        self._loader: ThreadPoolExecutor | None = None  # CUDA: runs stream_in's jobs; made on first use
        self._offloader: ThreadPoolExecutor | None = None  # runs stream_out's jobs; made on first use
        self._finisher: ThreadPoolExecutor | None = None  # runs after_copy's work; made on first use
        self._near: Callable[[], None] | None = None
        """The set-up that pins a host-work thread to the cores near this gpu (keep_host_work_near)."""
        self._made: list[str] = []
        """The executors made so far, by name."""
        self._pinned = PinnedBlocks(*(cuda_registration() if self.is_cuda else self._standin_registration()))
        """The page-locked buffers of host_empty (and on CUDA pin), of their own size (mobiuspipe.memory.pinned;
        the stand-in registers nothing, but keeps CUDA's count and rule)."""
        self._stepping = False
        """Whether a span of messages (stepping) is on: page-locking waits for its end."""
        self._unlocked: list[torch.Tensor] = []
        """CUDA: host_empty's buffers made during the span, page-locked at its end."""
        self._unlocked_guard = threading.Lock()  # the SSD tier's I/O thread takes buffers too

    # -- threads -----------------------------------------------------------------------------------------
    def bind_thread(self) -> None:
        """Make this gpu the calling thread's current device (CUDA's set_device; the stand-in's record of it)."""
        if self.is_cuda:
            torch.cuda.set_device(self.index)
        _bound.index = self.index

    @contextmanager
    def computing(self) -> Iterator[None]:
        """Run the body's kernels on this gpu's compute stream, whatever the caller's current device and stream (a
        user's `torch.cuda.stream` context would otherwise take them off the stream every copy's wait and every
        compute mark names). The stand-in's compute is the calling thread: nothing to switch."""
        if not self.is_cuda:
            yield
            return
        with torch.cuda.device(self.index), torch.cuda.stream(self.compute):
            yield

    def keep_host_work_near(self, pin: Callable[[], None]) -> None:
        """Have every executor's thread run pin() once bound (optim.host_threads.pinned_to of the cores of this gpu's
        NUMA node): the updater, the gradients' finisher and the SSD and activation threads work on host buffers
        there. Before any executor is made."""
        if self._made:
            raise RuntimeError(f"keep_host_work_near after the executors {self._made} were made: call it first")
        self._near = pin

    def executor(self, name: str) -> ThreadPoolExecutor:
        """A one-thread executor whose thread is bound to this gpu (for work that issues copies or waits for them)
        and runs near it (keep_host_work_near)."""

        def start() -> None:
            self.bind_thread()
            if self._near is not None:
                self._near()

        self._made.append(name)
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=start)

    def bound(self) -> bool:
        """Whether the calling thread is bound to this gpu (bind_thread; on CUDA, its current device)."""
        current = torch.cuda.current_device() if self.is_cuda else getattr(_bound, "index", 0)
        return current == self.index

    def _check_thread(self, what: str) -> None:
        """The strict stand-in's rule: device work, and waits for copies, only from a thread bound to this gpu."""
        if self.is_cuda or not strict() or self.bound():
            return
        raise StandInError(
            f"{what} for gpu {self.index} from thread {threading.current_thread().name!r}, whose current device is "
            f"{getattr(_bound, 'index', 0)}: a new CUDA thread's current device is 0, so its streams and events would "
            f"be gpu 0's and its first CUDA call would make a context there; make the thread with Device.executor "
            f"(or call bind_thread in it)"
        )

    # -- where tensors live: the copy functions (the strict stand-in marks each tensor's place) ------------
    @property
    def _marks(self) -> bool:
        return not self.is_cuda and strict()

    # -- page-locked host memory: never while messages may be in flight ------------------------------------
    @contextmanager
    def stepping(self) -> Iterator[None]:
        """The span of a pass of the schedule or an evaluation, from its first message to its flush: page-locking
        host memory there (cudaHostRegister, torch's pinned allocator) may synchronize the whole gpu, which waits
        for NCCL's kernels in flight, and two ranks doing so while each has a send to the other outstanding hang
        (mobiuspipe.schedule.nccl). So host_empty's buffers made in the span are pageable until it ends, when they
        are page-locked; what a span uploads comes pinned (pinned_batch, before the span) or from those buffers.
        The strict stand-in refuses a page-locking in the span, and a host read of a gpu's tensor on the calling
        thread (mobiuspipe.standin.places.in_pass)."""
        if self._stepping:
            raise RuntimeError("Device.stepping entered twice: a span of messages is already on")
        self._stepping = True
        try:
            with in_pass() if self._marks else nullcontext():
                yield
        finally:
            self._stepping = False
        self._lock_unlocked()  # not after an error: messages may still be in flight (the next span's end locks them)

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """t in page-locked host memory where CUDA exists (fast async copies: a copy of t, kept until the Device
        closes, for buffers a run keeps; made during a span (stepping), pageable until it ends); t itself
        otherwise."""
        if self.is_cuda:
            out = self.host_empty(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
            return out.copy_(t)
        return self._host_mark(t)

    def host_empty(self, nbytes: int) -> torch.Tensor:
        """nbytes of host memory, uint8, aligned for O_DIRECT (mobiuspipe.memory.aio.aligned_empty): on CUDA
        page-locked, of that size, kept until the Device closes (mobiuspipe.memory.pinned); made during a span
        (stepping), pageable until the span ends (the copies from and into it meanwhile are correct, the host
        waiting for each copy into it)."""
        buf = aligned_empty(nbytes)
        with self._unlocked_guard:
            if self._stepping:
                self._unlocked.append(buf)
                return self._host_mark(buf)
        return self._host_mark(self._pinned.lock(buf))

    def page_locked(self, t: torch.Tensor) -> bool:
        """Whether host tensor t lies in a buffer this Device page-locked (host_empty's, pin's: torch's is_pinned()
        answers False for them) or, on CUDA, in a block of torch's pinned allocator."""
        return self._pinned.covers(t) or (self.is_cuda and t.is_pinned())

    def _host_mark(self, t: torch.Tensor) -> torch.Tensor:
        return on_host(t) if self._marks else t

    def pinned_batch(self, ts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Host tensors ts (a batch's microbatches) in torch's page-locked memory, on CUDA (a block cached for the
        next batch's): taken before a span (stepping) whose uploads read them, so that those take no page-locked
        memory in it. The stand-in's ts themselves (marked as pinned under strict mode)."""
        if self.is_cuda:
            return tuple(t.pin_memory() for t in ts)
        return tuple(self._host_mark(t) for t in ts)

    def _lock_unlocked(self) -> None:
        """Page-lock the buffers host_empty made during the span just ended."""
        with self._unlocked_guard:
            unlocked, self._unlocked = self._unlocked, []
        for buf in unlocked:
            self._pinned.lock(buf)

    def _standin_registration(self) -> tuple[Register, Unregister]:
        """The stand-in's cudaHostRegister and cudaHostUnregister: they lock nothing, under CUDA's rule."""

        def register(address: int, nbytes: int) -> int:
            self._check_page_lock(f"page-locking {nbytes} bytes of host memory (cudaHostRegister)")
            return 0

        return register, lambda address: 0

    def _check_page_lock(self, what: str) -> None:
        """The strict stand-in's rule: no page-locking during a span of messages (stepping)."""
        if self._marks and self._stepping:
            raise StandInError(
                f"{what} during a pass or an evaluation, where NCCL's messages may be in flight: page-locking host "
                f"memory may synchronize the whole gpu, which waits for them, and two ranks doing so at once hang; "
                f"pin the tensor before the span (Device.pinned_batch) or take a buffer of Device.host_empty"
            )

    @property
    def pinned_bytes(self) -> int:
        """Host bytes page-locked by host_empty (and on CUDA pin) now; the stand-in's, as CUDA would lock them."""
        return self._pinned.nbytes

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """t, which lies in this gpu's memory (the stand-in: marked as its memory under strict mode)."""
        return on_gpu(t, self.index) if self._marks else t

    def in_memory(self, t: torch.Tensor) -> bool:
        """Whether t lies in this gpu's memory: on CUDA, a tensor of this gpu; on the stand-in, one not marked as
        host memory or another gpu's (unmarked tensors count as the gpu's: the lax stand-in marks nothing)."""
        if self.is_cuda:
            return t.device.type == "cuda" and t.device.index == self.index
        return not is_host(t) and gpu_of(t) in (None, self.index)

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor in this gpu's memory."""
        return self.place(torch.empty(shape, dtype=dtype, device=self.torch_device))

    def to_device(self, t: torch.Tensor, dtype: torch.dtype | None = None, may_wait: bool = False) -> torch.Tensor:
        """A copy of host tensor t in this gpu's memory (in dtype, if given), ordered on the calling thread's stream,
        by upload_route: on CUDA a pageable t goes through torch's pinned memory (its block kept until the copy ends)
        and a pinned one is read in place after this returns (the caller must not change it until the stream has
        passed the copy), neither blocking the host; but a large pageable one that may_wait (a stage's states at
        start-up or from a checkpoint), and during a span (stepping) a pageable one (the strict stand-in refuses it but
        for a buffer of host_empty), blocks the host until the stream has passed the copy."""
        route = upload_route(t, may_wait, self.page_locked(t))  # the stand-in's copies all end before this returns
        if route == "pin" and self._stepping:  # no page-locking in a span: a buffer of host_empty not locked yet
            if not is_host(t):
                self._check_page_lock(f"an upload of a pageable {tuple(t.shape)} tensor through torch's pinned memory")
            route = "pageable"
        if self.is_cuda:
            src = t.pin_memory() if route == "pin" else t
            return src.to(self.torch_device, dtype=dtype or t.dtype, non_blocking=route != "pageable")
        return self.place(plain(t).to(dtype=dtype or t.dtype, copy=True))

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of device tensor t in pageable host memory (unmarked): a blocking copy."""
        return t.to("cpu") if self.is_cuda else plain(t).clone()

    # -- copies on the copy streams --------------------------------------------------------------------------
    def copy_in(
        self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[CopyHandle] = (), computed: bool = True
    ) -> CopyHandle:
        """dst (this gpu's memory) <- src (host memory) on the copy-in stream, once the `after` copies and (computed)
        the compute queued so far have ended: a fresh allocation may still be in use by that compute. computed
        False: `after` names every user of dst (an arena slot's release mark and the copies that read it), so a
        load into a slot freed long ago need not wait for the compute queued since."""
        self._check_copy("a copy to the device", dst, src)
        return self._in.copy(dst, src, after, self._computed() if computed else None)

    def copy_back(
        self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[CopyHandle] = (), computed: bool = True
    ) -> CopyHandle:
        """dst (this gpu's memory, freshly allocated) <- src (host memory, or a peer gpu's) on the swap-in stream: a
        held tensor coming back, once the `after` copies (which wrote src) and (computed) the compute queued so far
        have ended (dst's memory may be in use until then; computed False: a mark of it is in `after`). Its own
        stream, so that the loads issued after it do not wait for that compute too."""
        self._check_copy("a copy back to the device", dst, src)
        return self._back.copy(dst, src, after, self._computed() if computed else None)

    def copy_out(self, dst: torch.Tensor, src: torch.Tensor, after: Sequence[CopyHandle] = ()) -> CopyHandle:
        """dst (host memory) <- src (this gpu's memory) on the copy-out stream, once the compute queued so far
        (which writes src) and the `after` copies have ended."""
        self._check_copy("a copy off the device", dst, src)
        return self._out.copy(dst, src, after, self._computed())

    def peer_stream(self, peer: int) -> CopyStream:
        """The stream of gpu `peer` for copies between host memory and that gpu's memory: CUDA runs such a copy
        on the peer gpu's stream, outside this gpu's streams' order (so the caller orders it with `after`)."""
        if peer not in self._peers:
            self._peers[peer] = CopyStream(peer, self.is_cuda, f"copy-gpu{peer}", self.compute)
        return self._peers[peer]

    def stream_in(
        self,
        job: Callable[[Callable[[torch.Tensor, torch.Tensor], object]], None],
        after: Sequence[CopyHandle] = (),
        computed: bool = True,
    ) -> CopyHandle:
        """Run job(copy) off the compute thread, where copy(dst, src) moves host memory src into device
        memory dst and returns once src may be reused (a loader fills a few staging buffers in turn), after
        the `after` copies (which still read dst) and, computed, the compute queued so far (as copy_in); the
        handle's wait() orders later compute after every copy."""
        self._check_thread("a copy to the device")
        if not self.is_cuda:

            def standin() -> None:
                for h in after:
                    h.synchronize()
                job(lambda dst, src: dst.copy_(src))

            return self._in.run(standin)
        ready = self._computed() if computed else None  # dst may be in use until now

        def on_stream() -> None:
            job(lambda dst, src: self._in.copy(dst, src, after, ready).synchronize())  # src is refilled next

        if self._loader is None:
            self._loader = self.executor("ssd-loader")
        return CopyHandle(future=self._loader.submit(on_stream), check=self._check_thread)

    def stream_out(
        self, job: Callable[[Callable[[torch.Tensor, torch.Tensor], object], Callable[[], None]], object]
    ) -> tuple[CopyHandle, Future]:
        """Run job(copy, copied) off the compute thread, where copy(dst, src) moves device memory src (written by the
        compute queued so far) into host memory dst and returns once dst holds it (an offloader fills a few staging
        buffers in turn and writes them to the SSD), and copied() says the job's last copy off the device has ended.
        Returns (copies, whole): `copies` ends at copied() (or with the job): src's memory may be reused after it
        (an arena slot's release mark); `whole` is the job's future, of what it returns (what reads the job's
        output waits for it). The jobs run one at a time, in order."""
        self._check_thread("a copy off the device")
        copies: Future = Future()

        def run(copy: Callable[[torch.Tensor, torch.Tensor], object]) -> object:
            def copied() -> None:
                if not copies.done():
                    copies.set_result(None)

            try:
                out = job(copy, copied)
            except BaseException as e:
                if not copies.done():
                    copies.set_exception(e)
                raise
            copied()
            return out

        ready = self._computed()  # src is written by the compute queued until now (None on the stand-in: done)
        if self._offloader is None:  # one thread, bound to this gpu, on CUDA and on the stand-in alike
            self._offloader = self.executor("ssd-offloader")
        whole = self._offloader.submit(run, lambda dst, src: self._out.copy(dst, src, (), ready).synchronize())
        return CopyHandle(future=copies, check=self._check_thread), whole

    def after_copy(self, copy: CopyHandle, work: Callable[[], object]) -> Future:
        """Run work() off the compute thread once `copy` has ended: host work on what a copy off the device filled (a
        gradient's accumulated add, its norm), which the compute thread would otherwise wait for and then do while
        the gpu waits for its next kernels. One thread, bound to this gpu, runs them one at a time, in order; the
        future gives what work returns or raises its error."""
        if self._finisher is None:
            self._finisher = self.executor("host-finisher")

        def run() -> object:
            copy.synchronize()
            return work()

        return self._finisher.submit(run)

    def computed(self) -> CopyHandle:
        """A mark after the compute queued so far: a copy `after` it waits for that compute (a released slot's last
        users). On the stand-in, whose compute is synchronous, it has ended already."""
        ev = self._computed()
        return CopyHandle() if ev is None else CopyHandle(event=ev, compute=self.compute, check=self._check_thread)

    def _computed(self) -> torch.cuda.Event | None:
        """CUDA: an event after the compute queued so far; None on the stand-in (its compute is synchronous)."""
        if not self.is_cuda and strict() and threading.get_ident() != self._owner:
            raise StandInError(
                f"a mark of the compute queued so far on gpu {self.index} taken on thread "
                f"{threading.current_thread().name!r}, not the one that queues the compute: it covers whatever "
                f"compute happens to be queued then; take it (Device.computed) on the compute thread when the memory "
                f"is allocated, and pass it to the copy as `after` with computed=False"
            )
        if self.compute is None:
            return None
        ev = torch.cuda.Event(blocking=True)  # a host waiting for it sleeps instead of spinning a core
        ev.record(self.compute)
        return ev

    def _check_copy(self, what: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        """The strict stand-in's rules for a copy on this gpu's streams: a bound thread, and no other gpu's
        memory (a copy between host memory and a peer gpu runs on that gpu's stream: peer_stream)."""
        self._check_thread(what)
        for t in (dst, src):
            g = gpu_of(t)
            other = src if t is dst else dst
            if g is not None and g != self.index and gpu_of(other) is None:  # peer-to-peer copies may run here
                raise StandInError(
                    f"{what} touches gpu {g}'s memory on gpu {self.index}'s copy stream: CUDA runs a copy between "
                    f"host memory and gpu {g} on gpu {g}'s stream, outside this stream's order; issue it on "
                    f"Device.peer_stream({g}) after the copy it follows"
                )

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.torch_device)

    def close(self) -> None:
        for worker in (self._loader, self._offloader, self._finisher):  # their jobs issue or wait for copies
            if worker is not None:
                worker.shutdown(wait=True)
        for stream in (self._in, self._back, self._out, *self._peers.values()):
            stream.close()  # on CUDA each waits for its copies: a peer gpu's stream is not this gpu's to synchronize
        if self.is_cuda:
            torch.cuda.synchronize(self.torch_device)  # no copy reads or fills a buffer any more
        self._pinned.close()


_bound = threading.local()
"""The gpu index the current thread is bound to (absent: never bound, CUDA's device 0)."""
