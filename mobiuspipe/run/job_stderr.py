"""What `mobiuspipe train` shows of its job's stderr: each line as it comes, until a rank has left a mistake
(mobiuspipe.run.preflight) or the launcher was interrupted. From then on the lines wait; if the job then fails for
that reason, only the launcher's own lines among them (those starting "mobiuspipe: ") are shown, and the reason
comes last: what follows such a failure (the gloo errors of the ranks that lost a peer, their tracebacks, torchrun's
report of a failed job) says nothing more. A job that fails for another reason, or finishes, shows every line.
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable
from typing import IO

__all__ = ["JobStderr"]

OWN_PREFIX = b"mobiuspipe: "
"""Lines that start so are mobiuspipe's own messages, shown even after a mistake."""
GRACE_S = 0.05
"""How long the first line after a quiet spell waits for a Ctrl-C or SIGTERM that may be on its way to this process
(seconds); the lines of a burst that follows only look (a traceback is not slowed down line by line)."""
QUIET_S = 0.5
"""A line that comes this long after the one before starts a burst (seconds)."""
SIGNAL_WORDS = (b"death signal", b"got signal", b"KeyboardInterrupt", b"Fatal Python error", b"SIGINT", b"SIGTERM")
"""Words of a line that reports a signal (torchrun's "Received 2 death signal" and SignalException, an interpreter
interrupted as it imports): such a line waits for the signal's wakeup byte SIGNAL_GRACE_S even inside a burst."""
SIGNAL_GRACE_S = 1.0
"""How long a line that reports a signal waits for it (seconds): under load the launcher can run well after its
job has reacted to the same Ctrl-C."""
DRAIN_S = 5.0
"""How long to wait, once torchrun has ended, for the last lines of its ranks (seconds)."""


class JobStderr:
    """Pumps the job's stderr (a pipe) to `out`, holding lines back once `explained()` (a rank's mistake is
    there) or hold() (an interrupt) says the job is failing for a reason the launcher will print."""

    def __init__(self, pipe: IO[bytes], out: IO[bytes], explained: Callable[[], bool]):
        self._out, self._explained = out, explained
        self._held: list[bytes] = []
        self._holding = False
        self._wakeup: int | None = None
        self._signals: tuple[int, ...] = ()
        self._thread = threading.Thread(target=self._pump, args=(pipe,), name="job-stderr", daemon=True)
        self._thread.start()

    def hold(self) -> None:
        """Hold every line from now on (the launcher was interrupted)."""
        self._holding = True

    def watch(self, fd: int, signals: tuple[int, ...]) -> None:
        """Also hold from the moment one of `signals` arrives: `fd` is the read end of the pipe given to
        signal.set_wakeup_fd, which the signal's C handler writes at once. (The Python handler that calls hold()
        runs later, in the main thread: the job, which got the same Ctrl-C, may print its traceback first.)"""
        os.set_blocking(fd, False)
        self._wakeup, self._signals = fd, signals

    def _signalled(self, wait_s: float) -> bool:
        """Whether a watched signal has arrived, waiting up to wait_s for one: a Ctrl-C reaches this process and the
        job together, and the job's first lines about it can come before this process has run."""
        if self._wakeup is None:
            return False
        try:
            select.select([self._wakeup], [], [], wait_s)
            arrived = os.read(self._wakeup, 64)
        except (OSError, ValueError):  # none arrived (BlockingIOError), or finish() closed the pipe
            return False
        return any(b in self._signals for b in arrived)

    def _pump(self, pipe: IO[bytes]) -> None:
        last = 0.0
        for line in iter(pipe.readline, b""):
            now = time.monotonic()
            self._holding = self._holding or self._signalled(_grace(line, now - last)) or self._explained()
            last = now
            if self._holding:
                self._held.append(line)
            else:
                self._out.write(line)
                self._out.flush()

    def finish(self, quiet: bool) -> None:
        """Once torchrun has ended: show the held lines, all of them, or (quiet: the failure is explained) the
        launcher's own only."""
        self._thread.join(DRAIN_S)
        if self._wakeup is not None:
            os.close(self._wakeup)
            self._wakeup = None
        shown = [line for line in self._held if line.startswith(OWN_PREFIX)] if quiet else self._held
        self._out.write(b"".join(shown))
        self._out.flush()


def _grace(line: bytes, since_last_s: float) -> float:
    """How long `line` waits for a signal: SIGNAL_GRACE_S if it reports one, GRACE_S if it starts a burst, else 0."""
    if any(word in line for word in SIGNAL_WORDS):
        return SIGNAL_GRACE_S
    return GRACE_S if since_last_s > QUIET_S else 0.0
