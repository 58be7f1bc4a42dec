"""The launcher's stop signals (SIGINT, SIGTERM), passed on to torchrun, which runs in a session of its own.

Each signal is noted and passed on once, however it came (a terminal's Ctrl-C, `kill -INT PID`, a signal to the
launcher's group); one that comes before torchrun has started is passed on as soon as it has. torchrun imports torch
before it sets its own handlers, and that import now and then swallows a SIGINT's KeyboardInterrupt, after which the
job ran to its end (measured: 2 to 4 of 58 signals, torch 2.11 and 2.13). Until torchrun catches SIGTERM it is sent
SIGTERM instead, which ends it at once: it has started no rank before it catches SIGTERM.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["StopRelay", "catches"]

STOPS = (signal.SIGINT, signal.SIGTERM)


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process pid has a handler of its own for sig (Linux's /proc/PID/status, SigCgt); True where that
    cannot be read (the signal is then passed on as it came)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next((int(line.split()[1], 16) for line in f if line.startswith("SigCgt:")), None)
    except (OSError, ValueError):
        return True
    return mask is None or bool(mask >> (sig - 1) & 1)


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
                self._pass_on(self.stopped[0])
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)

    def _take(self, signum: int, frame) -> None:
        self.stopped.append(signal.Signals(signum))
        self._hold()
        if self._torchrun is not None:
            self._pass_on(signal.Signals(signum))

    def _pass_on(self, sig: signal.Signals) -> None:
        torchrun = self._torchrun
        assert torchrun is not None
        torchrun.send_signal(sig if catches(torchrun.pid, signal.SIGTERM) else signal.SIGTERM)
