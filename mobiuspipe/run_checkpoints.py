"""The training loop's checkpoints: resuming (train.resume), periodic checkpoints and the ones a stop signal
asks for (SIGTERM, SIGINT), agreed on by every rank."""

from __future__ import annotations

import signal
from pathlib import Path

from foundation.errors import UserError
from foundation.timing import Stopwatch
from mobiuspipe.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from mobiuspipe.config import TrainConfig
from mobiuspipe.pipeline import Pipeline
from mobiuspipe.ranks import gather_all

__all__ = ["StopSignals", "resume_run", "checkpoint_if_due"]


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


def resume_run(t: TrainConfig, pipe: Pipeline) -> int:
    """Restore the checkpoint train.resume names (rank 0 chooses, every rank loads its own part); the step
    the loop starts at (0 without one). Every rank raises the first failing rank's error."""
    if t.resume is None:
        return 0
    root = Path(t.checkpoint_root or ".")
    folder = (latest_checkpoint(root) if t.resume == "auto" else Path(t.resume)) if pipe.rank == 0 else None
    folder = gather_all(pipe.info, folder)[0]
    if folder is None:
        if pipe.rank == 0:
            print(f"mobiuspipe: no complete checkpoint under {root}: starting at step 0", flush=True)
        return 0
    try:
        outcome: int | str = load_checkpoint(pipe, folder)
    except UserError as e:
        outcome = str(e)
    every = gather_all(pipe.info, outcome)
    failed = [(r, o) for r, o in enumerate(every) if isinstance(o, str)]
    if failed:
        r, why = failed[0]
        raise CheckpointError(why if r == 0 else f"rank {r}: {why}")
    if pipe.rank == 0:
        print(f"mobiuspipe: resumed from {folder} at step {every[0]}", flush=True)
    return every[0]


def checkpoint_if_due(t: TrainConfig, pipe: Pipeline, stop: bool, config_yaml: str) -> float | None:
    """After a step: write a checkpoint when one is due (every checkpoint_every steps, or `stop`, every rank
    agreeing on it); the seconds it took, None when none was written."""
    every, root = t.checkpoint_every, t.checkpoint_root
    if root is None or not (stop or (every > 0 and pipe.step % every == 0)):
        return None
    sw = Stopwatch()
    folder = save_checkpoint(pipe, Path(root), t.keep_checkpoints, config_yaml)
    if stop and pipe.rank == 0:
        print(f"mobiuspipe: checkpoint {folder} written; continue with --resume auto", flush=True)
    return sw.s
