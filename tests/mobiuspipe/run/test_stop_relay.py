"""The launcher's stop relay: a signal that comes before torchrun runs is passed on once it does, and the first goes
on as SIGTERM (a rank still starting up, with no handler yet, dies of it at once; a SIGINT's KeyboardInterrupt waits
for the C call it is in), a later one as it came."""

from __future__ import annotations

import os
import signal


class _Torchrun:
    pid = 0

    def __init__(self) -> None:
        self.got: list[int] = []

    def send_signal(self, sig: int) -> None:
        self.got.append(sig)


def test_the_first_stop_goes_on_as_sigterm_once_torchrun_runs_and_a_later_one_as_it_came():
    from mobiuspipe.run.stop_relay import StopRelay

    relay, torchrun, held = StopRelay(), _Torchrun(), []
    before = signal.getsignal(signal.SIGINT)
    with relay.installed():
        os.kill(os.getpid(), signal.SIGINT)  # before torchrun has started: noted only
        assert relay.stopped == [signal.SIGINT] and torchrun.got == []
        relay.started(torchrun, lambda: held.append(1))  # type: ignore[arg-type]
        assert torchrun.got == [signal.SIGTERM] and held == [1]
        os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C
        assert torchrun.got == [signal.SIGTERM, signal.SIGINT] and held == [1, 1]
    assert signal.getsignal(signal.SIGINT) is before
