"""The training loop's checkpoints: resuming (train.resume), periodic checkpoints and the ones a stop signal
asks for (SIGTERM, SIGINT), agreed on by every rank."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from foundation.errors import UserError
from foundation.timing import Stopwatch
from mobiuspipe.checkpoint import (
    COMPLETE,
    PREFIX,
    CheckpointDamaged,
    CheckpointError,
    begin_checkpoint,
    commit_checkpoint,
    complete_steps,
    load_checkpoint,
    partial_file,
    prune,
    write_snapshot,
)
from mobiuspipe.config import RunConfig, TrainConfig
from mobiuspipe.pipeline import Pipeline
from mobiuspipe.run.metrics import recorded_steps
from mobiuspipe.run.run_lock import RunFolderError
from mobiuspipe.runtime.peers.ranks import gather_all

DAMAGED = ".damaged-"
"""The prefix of a damaged checkpoint's folder once a resume has set it aside (.damaged-step-N)."""

__all__ = [
    "StopSignals",
    "resume_run",
    "refuse_later_checkpoints",
    "refuse_writing_over",
    "run_identity",
    "Checkpointer",
]


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


def run_identity(cfg: RunConfig) -> dict:
    """What a resumed run must share with the checkpoint besides the plan: the seed, the data (by file name and
    size, so that a moved folder still resumes) and how they are cut into sequences and steps."""
    d = cfg.data
    source = Path(d.tokens or d.text_path)
    return {
        "seed": cfg.train.seed,
        "data": source.name,
        "data_bytes": source.stat().st_size if source.is_file() else None,
        "tokenizer": Path(d.tokenizer).name if d.tokenizer else None,
        "shuffle": d.shuffle,
        "seq_len": cfg.model.seq_len,
        "batch_size": d.batch_size,
        "accumulation_steps": cfg.train.accumulation_steps,
    }


def resume_run(t: TrainConfig, pipe: Pipeline, run: dict | None = None) -> int:
    """Restore the checkpoint train.resume names (rank 0 chooses, every rank loads its own part); the step
    the loop starts at (0 without one). Resuming from the newest under a folder (auto), a damaged one
    (CheckpointDamaged on any rank) is passed over for the newest whole one before it: set aside as
    .damaged-step-N under the run's own checkpoint folder (kept as found; no resume, prune or later-checkpoint check
    takes it), left where it is under another. Every rank raises the first failing rank's error otherwise."""
    if t.resume is None:
        return 0
    root = Path(t.checkpoint_root or ".")
    where = resume_root(t.resume, root)
    if pipe.rank == 0 and where is not None and t.resume != "auto":
        print(f"mobiuspipe: {t.resume} holds checkpoints: resuming from its newest complete one", flush=True)
    passed: list[Path] = []  # rank 0's: the damaged ones passed over, where they are now
    while True:
        folder = None
        if pipe.rank == 0:
            folder = _newest(where, passed) if where is not None else Path(t.resume)
        folder = gather_all(pipe.info, folder)[0]
        if folder is None:
            return _none_left(pipe, where, passed)
        every = gather_all(pipe.info, _load(pipe, folder, run))
        failed = [(r, o) for r, o in enumerate(every) if not isinstance(o, int)]
        if not failed:
            if pipe.rank == 0:
                print(f"mobiuspipe: resumed from {folder} at step {every[0]}", flush=True)
            return every[0]
        r, (_, why) = failed[0]
        if where is None or not all(damaged for _, (damaged, _) in failed):
            raise CheckpointError(why if r == 0 else f"rank {r}: {why}")
        if pipe.rank == 0:
            own = where.resolve() == root.resolve()
            passed.append(_pass_over(folder, own, why if r == 0 else f"rank {r}: {why}"))


def _load(pipe: Pipeline, folder: Path, run: dict | None) -> int | tuple[bool, str]:
    """The step this rank's part of the checkpoint resumes at, or (whether it is damaged, why it failed)."""
    try:
        return load_checkpoint(pipe, folder, run)
    except CheckpointDamaged as e:
        return True, str(e)
    except UserError as e:
        return False, str(e)


def _newest(where: Path, passed: Sequence[Path]) -> Path | None:
    """The newest complete checkpoint under where that was not passed over."""
    steps = [s for s in complete_steps(where) if where / f"{PREFIX}{s}" not in passed]
    return where / f"{PREFIX}{steps[-1]}" if steps else None


def _pass_over(folder: Path, own: bool, why: str) -> Path:
    """Set a damaged checkpoint aside (own: under the run's checkpoint folder, renamed .damaged-step-N, its bytes
    kept) and say so; where it is now."""
    aside = folder
    if own:
        aside = folder.with_name(f"{DAMAGED}{folder.name}")
        n = 1
        while aside.exists():  # one of the same step set aside before
            aside, n = folder.with_name(f"{DAMAGED}{folder.name}.{n}"), n + 1
        folder.rename(aside)
    kept = f"set aside as {aside} (nothing in it deleted)" if own else "left where it is"
    print(f"mobiuspipe: checkpoint {folder} is damaged, {kept}; trying the one before it. {why}", flush=True)
    return aside if own else folder


def _none_left(pipe: Pipeline, where: Path | None, passed: Sequence[Path]) -> int:
    """No checkpoint to resume from: step 0 when there was none, an error (every rank's) when all were damaged."""
    why = None
    if pipe.rank == 0 and passed:
        names = ", ".join(sorted(p.name for p in passed))
        why = (
            f"every complete checkpoint under {where} is damaged (set aside as {names}; each named above): start "
            f"the run anew without --resume (train.resume), or resume from a copy of its checkpoints; nothing was "
            f"deleted"
        )
    elif pipe.rank == 0:
        print(f"mobiuspipe: no complete checkpoint under {where}: starting at step 0", flush=True)
    _refuse_on_every_rank(pipe, why, CheckpointError)
    return 0


def refuse_later_checkpoints(t: TrainConfig, pipe: Pipeline, start: int) -> None:
    """Every rank raises CheckpointError, before the run writes anything, when its checkpoint root holds complete
    checkpoints of steps after `start`, where the run begins: another run's (a new run in an old folder) or the
    steps a resume from an older checkpoint leaves behind. Pruning keeps the newest, so it would remove the run's
    own checkpoints, and a --resume auto after a crash would take the other timeline's."""
    why = None
    root = Path(t.checkpoint_root) if t.checkpoint_root else None
    if pipe.rank == 0 and root is not None:
        later = [f"{PREFIX}{s}" for s in complete_steps(root) if s > start]
        if later and start == 0:
            why = (
                f"{root} holds the checkpoints of another run ({', '.join(later)}): this run would start at step 0, "
                f"prune them as it saves its own and leave a later --resume auto theirs. Continue that run "
                f"(--resume auto), give this run another train.out_dir (or train.checkpoint_dir), or move them "
                f"out of {root}; nothing was changed"
            )
        elif later:
            why = (
                f"{root} holds checkpoints after step {start}, where this run resumes ({', '.join(later)}): it "
                f"would prune its own checkpoints as older than them, and a later --resume auto would go back to "
                f"theirs. Move them out of {root} to keep them (or delete them), then resume again; nothing was "
                f"changed"
            )
    _refuse_on_every_rank(pipe, why, CheckpointError)


def refuse_writing_over(t: TrainConfig, pipe: Pipeline, start: int) -> None:
    """Every rank raises RunFolderError, before the run writes anything, when it starts at step 0 in an out_dir that
    holds an earlier run's results it would write over: final weights (a finished run), or without train.resume its
    step records too. A restart with train.resume that finds no checkpoint (of a run stopped before its first, and
    before its end) redoes those steps from the same seed and goes on."""
    why = None
    out = Path(t.out_dir) if t.out_dir else None
    if pipe.rank == 0 and out is not None and start == 0:
        steps = recorded_steps(out / "metrics.jsonl")
        weights = [p for p in (out / "weights").iterdir() if p.is_file()] if (out / "weights").is_dir() else []
        if weights or (steps and t.resume is None):
            found = [f"metrics.jsonl: {steps} steps"] if steps else []
            found += [f"weights/: {len(weights)} files"] if weights else []
            none = " but no checkpoint to continue it from" if t.resume is not None else ""
            why = (
                f"{out} holds the results of an earlier run ({'; '.join(found)}){none}: this run would start at "
                f"step 0 and write over them. Give this run another train.out_dir, or move them out of {out} (to "
                f"keep them) or delete them; nothing was changed"
            )
    _refuse_on_every_rank(pipe, why, RunFolderError)


def _refuse_on_every_rank(pipe: Pipeline, why: str | None, error: type[UserError]) -> None:
    """Raise rank 0's refusal (why; None: none, and on the other ranks) as `error` on every rank."""
    why = gather_all(pipe.info, why)[0]
    if why is not None:
        raise error(why)


def resume_root(resume: str, root: Path) -> Path | None:
    """Where train.resume takes the newest complete checkpoint from: root for "auto"; a run folder's checkpoints/
    or a folder of step-N folders, when it names one of those (it then means auto, there); None when it names one
    checkpoint (a step-N folder, or any other path: loading it says what is wrong)."""
    if resume == "auto":
        return root
    path = Path(resume)
    if (path / COMPLETE).exists():
        return None
    held = (under for under in (path / "checkpoints", path) if under.is_dir() and any(under.glob(f"{PREFIX}*")))
    return next(held, None)


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
