"""The launcher's stop relay: whether torchrun has its own SIGTERM handler yet is read from /proc (a process that
has none dies of SIGTERM at once, where its import of torch could swallow a SIGINT)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from mobiuspipe.run.stop_relay import catches

HANDLES = (
    "import signal, time; signal.signal(signal.SIGTERM, lambda *a: None); print('ready', flush=True); time.sleep(60)"
)


def test_catches_tells_a_process_with_its_own_handler_from_one_without():
    assert catches(os.getpid(), signal.SIGINT)  # Python's own: KeyboardInterrupt
    handles = subprocess.Popen([sys.executable, "-c", HANDLES], stdout=subprocess.PIPE, text=True)
    bare = subprocess.Popen(["sleep", "60"])
    try:
        assert handles.stdout is not None and handles.stdout.readline() == "ready\n"
        assert catches(handles.pid, signal.SIGTERM) and not catches(bare.pid, signal.SIGTERM)
        assert not catches(handles.pid, signal.SIGUSR1)
    finally:
        handles.kill()
        bare.kill()
        handles.wait()
        bare.wait()
    assert catches(2**22 + 7, signal.SIGTERM)  # no such process: unknown, the signal goes as it came
