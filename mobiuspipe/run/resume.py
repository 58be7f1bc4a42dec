"""Where a run starts: the checkpoint train.resume names (a damaged one passed over for the one before it), and the
refusals of a start that would lose what a run folder holds, agreed on by every rank (rank 0 decides)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import yaml

from foundation.errors import UserError
from mobiuspipe.checkpoint import COMPLETE, PREFIX, CheckpointDamaged, CheckpointError, complete_steps, load_checkpoint
from mobiuspipe.config import RunConfig, TrainConfig
from mobiuspipe.pipeline import Pipeline
from mobiuspipe.run.metrics import recorded_steps
from mobiuspipe.run.run_lock import RunFolderError
from mobiuspipe.runtime.peers.ranks import gather_all

__all__ = [
    "DAMAGED",
    "run_identity",
    "resume_run",
    "resume_root",
    "refuse_before_launch",
    "refuse_later_checkpoints",
    "refuse_writing_over",
]

DAMAGED = ".damaged-"
"""The prefix of a damaged checkpoint's folder once a resume has set it aside (.damaged-step-N)."""


def run_identity(cfg: RunConfig) -> dict:
    """What a resumed run must share with the checkpoint besides the plan: the seed, the data (by file name and
    size, a folder's by its files' names and sizes, so that a moved folder still resumes; how it is read: format,
    field, split, token dtype) and how they are cut into sequences and steps."""
    d = cfg.data
    source = Path(d.tokens or d.text_path)
    return {
        "seed": cfg.train.seed,
        "data": source.name,
        "data_bytes": source.stat().st_size if source.is_file() else None,
        "data_files": _files_of(source) if source.is_dir() else None,
        "format": d.format,
        "field": d.field,
        "split": d.split,
        "token_dtype": d.token_dtype,
        "tokenizer": Path(d.tokenizer).name if d.tokenizer else None,
        "shuffle": d.shuffle,
        "seq_len": cfg.model.seq_len,
        "batch_size": d.batch_size,
        "accumulation_steps": cfg.train.accumulation_steps,
    }


def _files_of(folder: Path) -> str:
    """A datasets folder's files by relative name and size, as one digest (a re-export differs in some size)."""
    listing = sorted((str(p.relative_to(folder)), p.stat().st_size) for p in folder.rglob("*") if p.is_file())
    return hashlib.sha256(repr(listing).encode()).hexdigest()[:16]


Say = Callable[[str], None]
"""Where rank 0's word on the resume goes (a line without "mobiuspipe: ")."""


def _print(line: str) -> None:
    print(f"mobiuspipe: {line}", flush=True)


def resume_run(t: TrainConfig, pipe: Pipeline, run: dict | None = None, say: Say | None = None) -> int:
    """Restore the checkpoint train.resume names (rank 0 chooses, every rank loads its own part); the step
    the loop starts at (0 without one). Resuming from the newest under a folder (auto), a damaged one
    (CheckpointDamaged on any rank) is passed over for the newest whole one before it (_Search). Every rank raises
    the first failing rank's error otherwise (one that is not damage first). Rank 0 tells where the run starts
    through `say` (a line without its "mobiuspipe: "; None: printed now), which a caller that may still refuse
    the start holds until it does not."""
    if t.resume is None:
        return 0
    tell = say or _print
    root = Path(t.checkpoint_root or ".")
    where = resume_root(t.resume, root)
    if pipe.rank == 0 and where is not None and t.resume != "auto":
        tell(f"{t.resume} holds checkpoints: resuming from its newest complete one")
    search = _Search(where, root) if where is not None else None
    while True:
        choice: tuple[Path | None, str | None] = (None, None)  # rank 0's: (the checkpoint to try, a refusal)
        if pipe.rank == 0:
            choice = search.next() if search is not None else (Path(t.resume), None)
        folder, refusal = gather_all(pipe.info, choice)[0]
        if refusal is not None:
            raise CheckpointError(refusal)
        if folder is None:
            if pipe.rank == 0:
                tell(f"no complete checkpoint under {where}: starting at step 0")
            return 0
        every = gather_all(pipe.info, _load(pipe, folder, run))
        failed = sorted(((o[0], r, o[1:]) for r, o in enumerate(every) if not isinstance(o, int)), key=lambda f: f[0])
        if not failed:
            if pipe.rank == 0:
                tell(f"resumed from {folder} at step {every[0]}")
                if (changed := changed_settings(folder, t)) is not None:
                    tell(changed)
            return every[0]
        damaged, r, (why, damage) = failed[0]
        who = "" if r == 0 else f"rank {r}: "
        if search is None or not damaged:
            raise CheckpointError(who + why)
        if pipe.rank == 0:
            search.pass_over(folder, who + damage)


SETTINGS = ("steps", "lr", "lr_schedule", "warmup_steps", "min_lr", "betas", "eps", "weight_decay", "max_grad_norm")
"""The train settings a resume may change (the optimizer's and the schedule's), which changed_settings names."""


def changed_settings(folder: Path, t: TrainConfig) -> str | None:
    """The line naming the SETTINGS whose values differ from those of the run that wrote the checkpoint in `folder`
    (its config.yaml; None without one, or when none differs): the resumed steps take the run's own."""
    try:
        theirs = (yaml.safe_load((folder / "config.yaml").read_text()) or {}).get("train", {})
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    now = {k: list(v) if isinstance(v, tuple) else v for k, v in ((k, getattr(t, k)) for k in SETTINGS)}
    differs = [f"{k} {theirs[k]} -> {v}" for k, v in now.items() if k in theirs and v != theirs[k]]
    if not differs:
        return None
    return f"settings changed since the checkpoint's run: {', '.join(differs)}; the resumed steps take the new values"


def _load(pipe: Pipeline, folder: Path, run: dict | None) -> int | tuple[bool, str, str]:
    """The step this rank's part of the checkpoint resumes at, or (whether it is damaged, why it failed, and the
    damage alone: what a search that passes over it says)."""
    try:
        return load_checkpoint(pipe, folder, run)
    except CheckpointDamaged as e:
        return True, str(e), e.damage
    except UserError as e:
        return False, str(e), str(e)


class _Search:
    """Rank 0's walk back through the complete checkpoints under `where`, newest first, as damaged ones are passed
    over: under the run's own checkpoint folder (root) each is set aside as .damaged-step-N, its bytes kept (no
    resume, prune or later-checkpoint check takes it); under another it is left where it is."""

    def __init__(self, where: Path, root: Path):
        self.where = where
        self.own = where.resolve() == root.resolve()
        self.passed: list[Path] = []
        """The damaged ones passed over, where they are now."""
        self.refusal: str | None = None
        """Why the search cannot go on (a damaged one that could not be set aside)."""

    def next(self) -> tuple[Path | None, str | None]:
        """(the checkpoint to try, None) or (None, why the resume cannot start: every one is damaged, set aside now or
        by an earlier resume); (None, None) when there is none (a new run)."""
        steps = [s for s in complete_steps(self.where) if self.where / f"{PREFIX}{s}" not in self.passed]
        if self.refusal is not None or steps:
            return (None, self.refusal) if self.refusal is not None else (self.where / f"{PREFIX}{steps[-1]}", None)
        aside = sorted(d.name for d in self.where.glob(f"{DAMAGED}{PREFIX}*")) if self.own else []
        if not aside and not self.passed:
            return None, None
        names = f"set aside as {', '.join(aside)}" if self.own else f"left as they are: {self._names()}"
        return None, (
            f"every complete checkpoint under {self.where} is damaged ({names}): a resume has none to start from, "
            f"and a run from step 0 would write over this run's results. Resume from a copy of its checkpoints that "
            f"you trust (--resume PATH), or start the run anew with another train.out_dir; nothing was deleted"
        )

    def _names(self) -> str:
        return ", ".join(sorted(p.name for p in self.passed))

    def pass_over(self, folder: Path, why: str) -> None:
        """Set the damaged checkpoint aside (own folder) and say so."""
        aside = folder
        if self.own:
            aside = folder.with_name(f"{DAMAGED}{folder.name}")
            n = 1
            while aside.exists():  # one of the same step set aside before
                aside, n = folder.with_name(f"{DAMAGED}{folder.name}.{n}"), n + 1
            try:
                folder.rename(aside)
            except OSError as e:
                self.refusal = (
                    f"checkpoint {folder} is damaged and could not be set aside as {aside} ({e}): move it out of "
                    f"{self.where}, then resume again. {why}"
                )
                return
        kept = f"set aside as {aside} (nothing in it deleted)" if self.own else "left where it is"
        self.passed.append(aside)
        left = [s for s in complete_steps(self.where) if self.where / f"{PREFIX}{s}" not in self.passed]
        then = "trying the one before it" if left else "no complete checkpoint is left before it"
        print(f"mobiuspipe: checkpoint {folder} is damaged, {kept}; {then}. {why}", flush=True)


def refuse_later_checkpoints(t: TrainConfig, pipe: Pipeline, start: int) -> None:
    """Every rank raises CheckpointError, before the run writes anything, when its checkpoint root holds complete
    checkpoints of steps after `start`, where the run begins (later_checkpoints)."""
    _refuse_on_every_rank(pipe, later_checkpoints(t, start) if pipe.rank == 0 else None, CheckpointError)


def refuse_past_end(t: TrainConfig, pipe: Pipeline, start: int) -> None:
    """Every rank raises CheckpointError, before the run writes anything, when it resumes after its last step
    (past_end)."""
    _refuse_on_every_rank(pipe, past_end(t, start) if pipe.rank == 0 else None, CheckpointError)


def refuse_writing_over(t: TrainConfig, pipe: Pipeline, start: int) -> None:
    """Every rank raises RunFolderError, before the run writes anything, when it starts at step 0 in an out_dir that
    holds an earlier run's results it would write over (writing_over)."""
    _refuse_on_every_rank(pipe, writing_over(t, start) if pipe.rank == 0 else None, RunFolderError)


def refuse_before_launch(t: TrainConfig) -> None:
    """What `mobiuspipe train` refuses before it plans and starts torchrun: a run without train.resume, which
    begins at step 0, in folders that hold another run's checkpoints or results (CheckpointError, RunFolderError).
    Where the step a run begins at depends on the checkpoints it loads, its ranks decide (resume_run)."""
    if t.resume is not None:
        return
    why = later_checkpoints(t, 0)
    if why is not None:
        raise CheckpointError(why)
    why = writing_over(t, 0)
    if why is not None:
        raise RunFolderError(why)


def later_checkpoints(t: TrainConfig, start: int) -> str | None:
    """Why a run that begins at step `start` must not, when its checkpoint root holds complete checkpoints of steps
    after it: another run's (a new run in an old folder) or the steps a resume from an older checkpoint leaves
    behind. Pruning keeps the newest, so it would remove the run's own checkpoints, and a --resume auto after a
    crash would take the other timeline's. None when it may."""
    root = Path(t.checkpoint_root) if t.checkpoint_root else None
    later = [f"{PREFIX}{s}" for s in complete_steps(root) if s > start] if root is not None else []
    if later and start == 0:
        return (
            f"{root} holds the checkpoints of another run ({', '.join(later)}): this run would start at step 0, "
            f"prune them as it saves its own and leave a later --resume auto theirs. Continue that run "
            f"(--resume auto), give this run another train.out_dir (or train.checkpoint_dir), or move them "
            f"out of {root}; nothing was changed"
        )
    if later:
        return (
            f"{root} holds checkpoints after step {start}, where this run resumes ({', '.join(later)}): it "
            f"would prune its own checkpoints as older than them, and a later --resume auto would go back to "
            f"theirs. Move them out of {root} to keep them (or delete them), then resume again; nothing was "
            f"changed"
        )
    return None


def past_end(t: TrainConfig, start: int) -> str | None:
    """Why a run must not resume at step `start` past train.steps: it would run no step, write the checkpoint's
    weights over the run's final ones and cut metrics.jsonl to the steps before `start`. None when it may."""
    if start <= t.steps:
        return None
    return (
        f"the checkpoint this run resumes from is of step {start}, which is past train.steps {t.steps}: raise "
        f"train.steps to more than {start} to continue that run, or start a new run in another train.out_dir; "
        f"nothing was changed"
    )


def writing_over(t: TrainConfig, start: int) -> str | None:
    """Why a run must not start at step `start` in its out_dir, when that is 0 and the folder holds an earlier
    run's results it would write over: final weights (a finished run), or without train.resume its step records
    too. A restart with train.resume that finds no checkpoint (of a run stopped before its first, and before its
    end) redoes those steps from the same seed and goes on. None when it may."""
    out = Path(t.out_dir) if t.out_dir else None
    if out is None or start != 0:
        return None
    steps = recorded_steps(out / "metrics.jsonl")
    weights = [p for p in (out / "weights").iterdir() if p.is_file()] if (out / "weights").is_dir() else []
    if not (weights or (steps and t.resume is None)):
        return None
    found = [f"metrics.jsonl: {steps} steps"] if steps else []
    found += [f"weights/: {len(weights)} files"] if weights else []
    none = " but no checkpoint to continue it from" if t.resume is not None else ""
    return (
        f"{out} holds the results of an earlier run ({'; '.join(found)}){none}: this run would start at "
        f"step 0 and write over them. Give this run another train.out_dir, or move them out of {out} (to "
        f"keep them) or delete them; nothing was changed"
    )


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
