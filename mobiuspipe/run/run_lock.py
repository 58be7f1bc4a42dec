"""A run folder belongs to one run: an flock on FOLDER/.mobiuspipe.lock, held for the holder's life, says who holds it.

`mobiuspipe train` takes the locks of a run's folders (train.out_dir, and train.checkpoint_dir and memory.ssd_dir
where they lie elsewhere) before it launches anything and holds them until torchrun ends; its ranks get its token
(TOKEN_ENV) and find the locks theirs. Under a user's own torchrun, rank 0 takes them at start-up. A second run on a
held folder stops before it writes anything (RunFolderError, exit 2), naming the holder's pid and host. The kernel
drops a lock when its process dies, whatever the signal: a lock file left by a dead run is taken over, with a line
saying so (a run that ends releases its lock emptied: the next one takes it over silently). Taking a lock makes the
folder if it is missing and writes the lock file only; the holder's file is read, never changed, by a run that finds
it held.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

from mobiuspipe.errors import UserError

__all__ = ["LOCK_FILE", "TOKEN_ENV", "Holder", "RunFolderError", "RunLocks", "new_token", "refuse_held", "run_folders"]

LOCK_FILE = ".mobiuspipe.lock"
TOKEN_ENV = "MOBIUSPIPE_RUN_TOKEN"
"""The token of the `mobiuspipe train` that holds the run's locks, in its ranks' environment."""


class RunFolderError(UserError):
    """A folder of this run is held by another run that is still alive, or cannot hold a lock, or holds an earlier
    run's results that this one would write over (mobiuspipe.run.resume.refuse_writing_over)."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: what its file says."""

    pid: int
    host: str
    started: str
    token: str

    def text(self) -> str:
        return f"the run of pid {self.pid} on host {self.host} (started {self.started})"


def new_token() -> str:
    """A token naming one run (its launcher and ranks share it)."""
    return uuid.uuid4().hex


def run_folders(out_dir: str | None, checkpoint_root: str | None, ssd_dir: str | None = None) -> dict[str, Path]:
    """The folders a run writes that a lock guards, by the config key that names them: out_dir, the checkpoint
    folder and memory.ssd_dir, each unless it is one before it (RunLocks.take locks one that lies inside another
    through that one, and checks that no other run holds it)."""
    folders: dict[str, Path] = {}
    for key, path in (
        ("train.out_dir", out_dir),
        ("train.checkpoint_dir", checkpoint_root),
        ("memory.ssd_dir", ssd_dir),
    ):
        if path and not any(Path(path).resolve() == held.resolve() for held in folders.values()):
            folders[key] = Path(path)
    return folders


def _within(path: Path, folder: Path) -> bool:
    return path.resolve() == folder.resolve() or folder.resolve() in path.resolve().parents


class RunLocks:
    """The locks of a run's folders, held until release() or the end of the process."""

    def __init__(self) -> None:
        self._fds: list[int] = []

    @classmethod
    def take(
        cls, folders: dict[str, Path], token: str, inherited: str | None = None, out: TextIO | None = sys.stderr
    ) -> RunLocks:
        """Lock each folder (key: the config key naming it, for the messages), making it if missing; one inside a
        folder locked before it is that one's already. A folder held by the run whose token is `inherited` (this
        rank's launcher) is this run's already. RunFolderError, with every lock taken so far given back, if another
        live run holds one, a folder it lies in, or a folder inside it that this run writes."""
        locks = cls()
        taken: list[Path] = []
        try:
            for key, folder in folders.items():
                if any(_within(folder, held) for held in taken):  # under this run's own lock: only itself to check
                    _refuse_held(key, folder, folder, inherited)
                    continue
                refuse_held({key: folder}, inherited)
                locks._take(key, folder, token, inherited, out)
                taken.append(folder)
        except BaseException:
            locks.release()
            raise
        return locks

    def _take(self, key: str, folder: Path, token: str, inherited: str | None, out: TextIO | None) -> None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunFolderError(
                f"{key} {folder}: cannot make its lock file ({e.strerror}); expected a folder this user can write "
                f"to: give {key} such a folder"
            ) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            if holder is not None and inherited is not None and holder.token == inherited:
                return  # this rank's launcher holds it for the run
            who = holder.text() if holder is not None else "another run"
            raise RunFolderError(
                f"{key} {folder} is in use by {who}: a folder belongs to one run; wait for that run to end, or give "
                f"this one another {key}"
            ) from None
        left = _read(fd)
        if left is not None and out is not None:
            print(
                f"mobiuspipe: {key} {folder}: taking over the lock that {left.text()} left (no process holds it)",
                file=out,
                flush=True,
            )
        me = Holder(os.getpid(), socket.gethostname(), time.strftime("%Y-%m-%d %H:%M:%S %Z"), token)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(asdict(me)) + "\n").encode(), 0)
        self._fds.append(fd)

    def release(self) -> None:
        """Give every lock back, emptied: the lock files stay and the next run takes them over without a word (a
        run that ended without releasing, killed or crashed, leaves its record: the next run names it). Idempotent."""
        for fd in self._fds:
            with contextlib.suppress(OSError):  # a folder gone or read-only by now: the flock drops all the same
                os.ftruncate(fd, 0)
            os.close(fd)  # closing the last descriptor drops the flock
        self._fds = []

    def __enter__(self) -> RunLocks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def refuse_held(folders: dict[str, Path], inherited: str | None = None) -> None:
    """RunFolderError if another live run (not the one whose token is `inherited`) holds one of the folders or a
    folder one lies in; nothing is made or taken. RunLocks.take checks it before each lock; a launcher first, so that
    a live run's folder is named in use before anything is said of what it holds."""
    for key, folder in folders.items():
        for at in (folder, *folder.resolve().parents):
            _refuse_held(key, folder, at, inherited)


def _refuse_held(key: str, folder: Path, at: Path, inherited: str | None) -> None:
    """RunFolderError if another live run holds `at` (folder itself, or a folder it lies in); its lock file is read
    and tried, never made or changed."""
    try:
        fd = os.open(at / LOCK_FILE, os.O_RDONLY)
    except OSError:  # no lock file (or none this user may read): no run holds it
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read(fd)
        if holder is not None and inherited is not None and holder.token == inherited:
            return  # this rank's launcher holds it for the run
        where = "is" if at == folder else f"lies inside {at}, which is"
        who = holder.text() if holder is not None else "another run"
        raise RunFolderError(
            f"{key} {folder} {where} in use by {who}: a folder belongs to one run; wait for that run to end, or give "
            f"this one another {key}"
        ) from None
    finally:
        os.close(fd)  # a lock this took is dropped with it


def _read(fd: int) -> Holder | None:
    """The holder a lock file names, or None (empty, or not a holder record)."""
    try:
        d = json.loads(os.pread(fd, 4096, 0).decode() or "null")
        return Holder(int(d["pid"]), str(d["host"]), str(d["started"]), str(d["token"]))
    except (ValueError, TypeError, KeyError, UnicodeDecodeError):
        return None
