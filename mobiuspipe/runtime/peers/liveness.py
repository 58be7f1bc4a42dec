"""Each rank's sign of life in the job's store, and its watch on the other ranks' (one thread per rank).

Every beat_s a rank adds 1 to its counter in the store and reads the others'. A peer whose counter has not
moved for lost_after_s (runtime.comm_timeout_s) is lost: its process died or is stopped. A live peer may be
busy as long as it needs (writing a checkpoint, setting up SSD states, a long stage): its thread beats
meanwhile. The waits that would outlive a lost peer ask check() as they wait (Comm's, ranks.gather_all's);
on NCCL, where the host blocks at a synchronization instead, the watch also calls on_lost (the
communicators' abort), which ends the kernels waiting for the lost peer; should a wait outlast even that (an abort
that hangs in the driver), a rank whose process is the job's own (exit_after_s) ends itself that long after the
verdict, printing it, where it would otherwise wait out the process group's deadline. A rank that ends its run well
marks itself done: it is watched no more. The calls to the store run on a thread of their own (a store whose
host is stopped answers no call, and TCPStore's timeout does not end an add): the watch gives each a beat,
and a store that has not answered for lost_after_s is lost too. The threads need the GIL for a moment each
beat: a rank whose main thread holds it longer than lost_after_s in one call looks lost.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as NoAnswer
from typing import Protocol

from mobiuspipe.errors import PeerLostError

__all__ = ["Liveness", "Watch", "KeyStore", "Waiter", "beat_interval", "await_work", "watching", "current"]

MAX_BEAT_S = 5.0
"""The longest interval between two beats (s)."""
BEATS_PER_TIMEOUT = 8
"""Beats a rank makes within lost_after_s: a late beat or two is not a loss."""
QUIET_BEATS = 3
"""Beats Liveness.quiet_peers waits before it names the peers that gave none."""
EXIT_LOST = 2
"""The exit code of a rank that ended its own process after a lost peer (Liveness's exit_after_s): a lost peer's, as
a rank that raised PeerLostError exits (mobiuspipe.run.preflight.report)."""
POLL_S = (2e-4, 0.05)
"""The first and the longest pause (s) between two looks at an operation a watched wait waits for."""


class KeyStore(Protocol):
    """The part of torch.distributed's Store the watch uses: add(key, n) adds n to a counter, returns its value."""

    def add(self, key: str, value: int) -> int: ...


class Watch(Protocol):
    """What a wait asks while it waits: check() raises PeerLostError once a peer is lost (Liveness)."""

    def check(self) -> None: ...


def await_work(work, watch: Watch) -> None:
    """Wait until work (an operation whose is_completed() reports its end) has ended, asking watch whether every
    peer lives as it waits (PeerLostError if not); its error, if it failed."""
    pause = POLL_S[0]
    while not work.is_completed():
        watch.check()
        time.sleep(pause)
        pause = min(2 * pause, POLL_S[1])
    work.wait()


class Waiter:
    """A daemon thread that runs the blocking waits nothing can poll or slice (gloo's point-to-point ones: their
    is_completed() stays False, and a wait that times out closes the pair) while the caller asks the watch. After a
    verdict the thread may stay blocked until its process group's deadline: being a daemon, it never holds up the
    process's exit."""

    def __init__(self, bind: Callable[[], None] | None = None):
        """bind: run first on the thread (binding it to the rank's gpu, for posts that make NCCL communicators)."""
        self._bind = bind
        self._jobs: queue.SimpleQueue | None = None
        """The waits for the thread (None: no thread yet, or closed); one caller at a time, as a Comm is used."""

    def wait(self, wait: Callable[[], object], watch: Watch) -> object:
        """What wait() returns (or its error), waited for on the thread while watch.check() is asked."""
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            args = (self._jobs, self._bind)
            threading.Thread(target=self._run, args=args, name="mobiuspipe-waiter", daemon=True).start()
        done, answer = threading.Event(), []
        self._jobs.put((wait, answer, done))
        pause = POLL_S[0]
        while not done.wait(pause):
            watch.check()
            pause = min(2 * pause, POLL_S[1])
        value, error = answer[0]
        if error is not None:
            raise error
        return value

    @staticmethod
    def _run(jobs: queue.SimpleQueue, bind: Callable[[], None] | None) -> None:
        if bind is not None:
            bind()
        while (job := jobs.get()) is not None:
            wait, answer, done = job
            try:
                answer.append((wait(), None))
            except BaseException as e:  # noqa: BLE001 - handed to the caller, who raises it
                answer.append((None, e))
            done.set()

    def close(self) -> None:
        """Let the thread end once its wait, if any, has (never waited for: it may be blocked on a lost peer)."""
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None


def beat_interval(lost_after_s: float) -> float:
    """Seconds between two beats of a rank watched with lost_after_s (s)."""
    return min(lost_after_s / BEATS_PER_TIMEOUT, MAX_BEAT_S)


class Liveness:
    """This rank's beats and its watch on the other ranks (module docstring)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: KeyStore,
        lost_after_s: float,
        on_lost: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        exit_after_s: float | None = None,
    ):
        """store: the job's store, under a prefix of its own (keys: the rank, "done" + the rank); exit_after_s: how
        long after a verdict a rank still running (not stopped: its main thread did not get out of a wait) ends its
        process, exit code EXIT_LOST, the verdict on stderr (None: never; a process that is not the job's own)."""
        self._exit_after_s = exit_after_s
        self.rank, self.lost_after_s, self.beat_s = rank, lost_after_s, beat_interval(lost_after_s)
        self._peers = [p for p in range(world_size) if p != rank]
        self._store, self._on_lost, self._clock = store, on_lost, clock
        now = clock()
        self._seen = {p: (-1, now) for p in self._peers}  # peer -> (its count, when it last moved)
        self._store_down_since: float | None = None
        self._verdict: str | None = None
        self._calls = _Calls(f"liveness-store-{rank}")
        self._call: Future | None = None  # the look at the store under way
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"liveness-{rank}", daemon=True)

    @property
    def verdict(self) -> str | None:
        """Why a peer counts as lost (a PeerLostError's message), or None while every peer lives."""
        return self._verdict

    def check(self) -> None:
        """Raise PeerLostError if a peer is lost."""
        if self._verdict is not None:
            raise PeerLostError(self._verdict)

    def quiet_peers(self, beats: int = QUIET_BEATS) -> list[int]:
        """The peers whose count has not moved since now, after waiting `beats` beats (less once a verdict comes): the
        likely dead, to name when a collective failed before the watch's verdict (a killed rank resets its
        connections at once, comm_timeout_s before the watch would lose it)."""
        if not self._thread.is_alive():  # no watch: nothing is known of the peers
            return []
        since = self._clock()
        deadline = time.monotonic() + min(beats * self.beat_s, self.lost_after_s)
        while self._verdict is None and time.monotonic() < deadline:
            time.sleep(min(0.05, self.beat_s))
        return [p for p, (_, moved) in self._seen.items() if moved <= since]

    def start(self) -> Liveness:
        self.look()  # the first beat before any wait
        self._thread.start()
        return self

    def stop(self, done: bool) -> None:
        """Stop beating; done: this rank ended its run well (its peers watch it no more), else it just stops."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()  # a look waits a beat at most
        if done:
            try:
                self._calls.submit(lambda: self._store.add(f"done{self.rank}", 1)).result(self.lost_after_s)
            except (RuntimeError, NoAnswer) as e:  # the store's host has gone: nobody is left to tell
                print(f"mobiuspipe: rank {self.rank} could not mark its run done in the store ({e!r})", file=sys.stderr)
        self._calls.close()

    def _run(self) -> None:
        while self._verdict is None and not self._stop.wait(self.beat_s):
            self.look()

    def look(self) -> None:
        """One beat, and one look at every peer's count (the thread's step; tests call it with a fake clock)."""
        now = self._clock()
        if self._call is None:
            self._call = self._calls.submit(self._read)
        try:
            counts, done = self._call.result(self.beat_s)
        except NoAnswer:
            self._store_down(now, f"no answer within {self.beat_s:g} s")
            return
        except RuntimeError as e:
            self._call = None
            self._store_down(now, str(e).splitlines()[0] if str(e) else type(e).__name__)
            return
        self._call, self._store_down_since = None, None
        for p, count in counts.items():
            last, since = self._seen[p]
            if count != last:
                self._seen[p] = (count, now)
            elif p not in done and now - since >= self.lost_after_s:
                self._lost(
                    f"rank {p} has given no sign of life for {now - since:.0f} s (runtime.comm_timeout_s is "
                    f"{self.lost_after_s:g}): its process died or is stopped; look at its log. Raise "
                    f"runtime.comm_timeout_s if rank {p} can pause that long (a debugger, a host swapping)"
                )
                return

    def _read(self) -> tuple[dict[int, int], set[int]]:
        """This rank's beat, then every peer's count and which peers ended their run (calls to the store)."""
        self._store.add(str(self.rank), 1)
        counts = {p: self._store.add(str(p), 0) for p in self._peers}
        return counts, {p for p in self._peers if self._store.add(f"done{p}", 0)}

    def _store_down(self, now: float, cause: str) -> None:
        """The store did not answer: lost once it has not answered for lost_after_s."""
        if self._store_down_since is None:
            self._store_down_since = now
        elif now - self._store_down_since >= self.lost_after_s:
            self._lost(
                f"the job's store has not answered for {now - self._store_down_since:.0f} s ({cause}): the "
                f"process that hosts it (torchrun's agent, or rank 0 when the job was started without torchrun) "
                f"has probably died; look at its log"
            )

    def _lost(self, why: str) -> None:
        self._verdict = f"rank {self.rank}: {why}"
        if self._exit_after_s is not None:
            threading.Thread(target=self._exit_if_stuck, args=(self._exit_after_s,), daemon=True).start()
        try:
            self._on_lost()
        except Exception as e:  # noqa: BLE001 -- the verdict stands; the waits raise it
            print(f"mobiuspipe: rank {self.rank}: after a lost peer, {e!r}", file=sys.stderr)

    def _exit_if_stuck(self, after_s: float) -> None:
        """End the process if the rank has not stopped (stop()) within after_s of the verdict."""
        if not self._stop.wait(after_s):
            print(
                f"mobiuspipe: {self._verdict}; this rank did not stop within {after_s:g} s of it (a wait on the gpu "
                "the communicators' abort did not end): ending its process",
                file=sys.stderr,
                flush=True,
            )
            os._exit(EXIT_LOST)


class _Calls:
    """Calls run one after another on a daemon thread of their own: a call that never returns holds that thread
    only (and no exit of the process waits for it)."""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, call: Callable[[], object]) -> Future:
        future: Future = Future()
        self._queue.put((call, future))
        return future

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            call, future = item
            try:
                future.set_result(call())
            except BaseException as e:  # noqa: BLE001 -- handed to whoever waits on the future
                future.set_exception(e)


_current: Liveness | None = None


def watching(liveness: Liveness | None) -> None:
    """Make liveness this process's watch (None: no watch), which ranks.gather_all's waits ask."""
    global _current
    _current = liveness


def current() -> Liveness | None:
    """This process's watch on its peers, if it runs one."""
    return _current
