"""The training loop's checkpoints: periodic ones and the ones a stop signal asks for (SIGTERM, SIGINT), agreed on
by every rank (where a run starts from them: mobiuspipe.run.resume)."""

from __future__ import annotations

import signal
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from foundation.timing import Stopwatch
from mobiuspipe.checkpoint import begin_checkpoint, commit_checkpoint, partial_file, prune, write_snapshot
from mobiuspipe.config import TrainConfig
from mobiuspipe.pipeline import Pipeline
from mobiuspipe.runtime.peers.ranks import gather_all

__all__ = ["StopSignals", "Checkpointer"]


class StopSignals:
    """Catches SIGTERM and SIGINT: the first one only asks the loop to checkpoint and stop after the step
    under way (a second SIGINT interrupts at once). Restores the previous handlers on close()."""

    def __init__(self):
        self.received: str | None = None
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def close(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)

    def __enter__(self) -> StopSignals:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Checkpointer:
    """The loop's checkpoints: at a due step every rank snapshots its states (the loop waits for that copy
    only), a thread of its own writes and fsyncs the file while training goes on, and the ranks' results
    ride on the loop's per-step gather (`status`); once every rank has written, rank 0 commits. A new
    checkpoint, a stop and the end of the run first finish the one in flight."""

    def __init__(self, t: TrainConfig, pipe: Pipeline, config_yaml: str, run: dict | None = None):
        self.t, self.pipe, self.config_yaml, self.run = t, pipe, config_yaml, run
        self.root = Path(t.checkpoint_root) if t.checkpoint_root else None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="mobiuspipe-checkpoint")
        self.pending: tuple[int, Future] | None = None
        """(step, the write's future) of the checkpoint in flight."""

    def status(self) -> tuple[int, object] | None:
        """This rank's news for the per-step gather: (step, its write's result) once written, else None."""
        if self.pending is None or not self.pending[1].done():
            return None
        return self.pending[0], self.pending[1].result()

    def after_step(self, statuses: list, stop: bool) -> float | None:
        """After a step's gather (`statuses`: every rank's status()): commit the checkpoint in flight when every
        rank wrote it; start one when due (every checkpoint_every steps, or `stop`, which also waits for it).
        The seconds the loop waited, None when no checkpoint started."""
        if self.pending is not None and all(s is not None for s in statuses):
            self._commit([s[1] for s in statuses])
        due = self.t.checkpoint_every > 0 and self.pipe.step % self.t.checkpoint_every == 0
        if self.root is None or not (stop or due):
            return None
        sw = Stopwatch()
        self.finish()
        snap = begin_checkpoint(self.pipe, self.root)
        path = partial_file(self.root, snap.step, self.pipe.rank)
        self.pending = (snap.step, self.pool.submit(write_snapshot, snap, path))
        waited = sw.s
        if stop:
            folder = self.finish()
            if self.pipe.rank == 0:
                print(f"mobiuspipe: checkpoint {folder} written; continue with --resume auto", flush=True)
        return waited

    def finish(self) -> Path | None:
        """Wait for the checkpoint in flight and commit it (a collective); its folder, None without one."""
        if self.pending is None:
            return None
        return self._commit(gather_all(self.pipe.info, self.pending[1].result()))

    def _commit(self, every: list) -> Path:
        assert self.pending is not None and self.root is not None
        step, self.pending = self.pending[0], None
        folder = commit_checkpoint(self.pipe, self.root, step, every, None, self.config_yaml, self.run)
        if self.pipe.rank == 0:  # off the loop: removing a big checkpoint takes a while
            self.pool.submit(prune, self.root, self.t.keep_checkpoints)
        return folder

    def close(self) -> None:
        """Stop the writer thread (a write in flight finishes; an uncommitted one stays unfinished on disk)."""
        self.pool.shutdown(wait=True)
