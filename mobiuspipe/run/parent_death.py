"""Ranks that die with their launcher: Linux's parent-death signal (prctl PR_SET_PDEATHSIG).

`mobiuspipe train` starts torchrun so that the kernel kills it when the launcher dies, by any signal, SIGKILL
included, and sets ENV for its ranks, which ask the same of torchrun. So a killed launcher leaves no rank running
and nothing is written after it: no process of the job outlives it by more than the kernel's delivery. A signal the
launcher survives (Ctrl-C, SIGTERM) it passes on to torchrun, which runs in a session of its own, and torchrun to the
ranks: they checkpoint and stop (torchrun starts with SIGINT's default even where the launcher started with it
ignored: launched_child). A
user's own torchrun keeps torchrun's rules: its ranks get no parent-death signal (docs/cli.md).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["ENV", "die_with_parent", "launched_child"]

ENV = "MOBIUSPIPE_DIE_WITH_PARENT"
"""Set (to "1") in the environment of the ranks `mobiuspipe train` starts: each dies with its torchrun."""
PR_SET_PDEATHSIG = 1
"""prctl's option number (linux/prctl.h)."""


def die_with_parent(parent: int, signum: int = signal.SIGKILL) -> bool:
    """Have the kernel send signum to this process when the thread that started it ends (Linux; False elsewhere,
    or when prctl refuses). parent: the pid that started it; if it is gone already (or is init, which adopts
    orphans), signum comes now."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        return False
    if os.getppid() != parent or parent == 1:  # it died before the request was in place
        os.kill(os.getpid(), signum)
    return True


def launched_child(parent: int) -> None:
    """The set-up of torchrun's process before its exec (subprocess's preexec_fn): it dies with `parent` (the
    launcher), and SIGINT ends it and its ranks as it ends a terminal's foreground job even where the launcher started
    with SIGINT ignored (a command a non-interactive shell runs with &): the launcher takes Ctrl-C as the job's end,
    so the job must take it too."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    die_with_parent(parent)
