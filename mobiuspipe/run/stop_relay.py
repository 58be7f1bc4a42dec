"""The launcher's stop signals (SIGINT, SIGTERM), passed on to torchrun, which runs in a session of its own.

Each signal is noted and passed on once, however it came (a terminal's Ctrl-C, `kill -INT PID`, a signal to the
launcher's group); one that comes before torchrun has started is passed on as soon as it has. The first goes on as
SIGTERM, whichever it was, and torchrun passes it to the ranks: a rank that trains takes either as its stop
(checkpoint, then stop), but a rank still starting up has no handler of its own yet, and a SIGINT's KeyboardInterrupt
waits there for the call it is in to return (a wait for a peer that died of the same signal: up to
runtime.hang_timeout_s, seen once), where SIGTERM ends it at once. torchrun itself, while it imports torch, now and
then swallowed a SIGINT's KeyboardInterrupt, after which the job ran to its end (2 to 4 of 58 signals, torch 2.11 and
2.13). A later signal goes on as it came (a second Ctrl-C stops the ranks at once).
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["StopRelay"]

STOPS = (signal.SIGINT, signal.SIGTERM)


class StopRelay:
    """The stop signals of this process while it runs torchrun: `stopped` in the order they came, each passed on to
    torchrun once it runs (started())."""

    def __init__(self) -> None:
        self.stopped: list[signal.Signals] = []
        self._torchrun: subprocess.Popen | None = None
        self._hold: Callable[[], None] = lambda: None

    @contextmanager
    def installed(self) -> Iterator[StopRelay]:
        """This relay as the handler of SIGINT and SIGTERM inside the block (the previous handlers after it)."""
        old = {s: signal.signal(s, self._take) for s in STOPS}
        try:
            yield self
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)

    def started(self, torchrun: subprocess.Popen, hold: Callable[[], None]) -> None:
        """torchrun runs: a signal that came before is passed on now, each later one as it comes; hold() is called
        at each (the job's stderr is held from then on)."""
        held = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)  # no signal comes between the lines below
        try:
            self._torchrun, self._hold = torchrun, hold
            if self.stopped:
                hold()
                torchrun.send_signal(signal.SIGTERM)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)

    def _take(self, signum: int, frame) -> None:
        self.stopped.append(signal.Signals(signum))
        self._hold()
        if self._torchrun is not None:
            self._torchrun.send_signal(signal.SIGTERM if len(self.stopped) == 1 else signum)
