"""Checkpoints of a Pipeline: each rank's stages' states, random state and loop position in a step-N folder.

Layout of CHECKPOINT_DIR/step-N (N = optimizer steps done; the run resumes at step index N):
  rank{r}.safetensors   rank r's tensors: "stage{j}/master" (fp32 master weights, flat), "stage{j}/opt/KEY"
                        (optimizer states: AdamW's step, exp_avg, exp_avg_sq), "rng/torch" (the CPU generator),
                        "rng/cuda" (the rank's gpu generator, on CUDA); the header's metadata "state" is JSON:
                        {"step", "scaler", "stages": {j: extra}} (extra: the optimizer's param_groups, a record
                        a resume does not read back, or for states in the SSD store the description of their
                        records and "dir")
  rank{r}/stage{j}/     states in the SSD store: hard links to the store's record files (no bytes copied; the
                        store writes a linked record to a new file), each checked by the crc32c in the metadata.
                        Where the filesystem cannot link them (another device), they are copied, file by file.
  plan.yaml, config.yaml the plan the run followed and its resolved config (rank 0)
  complete              JSON written last, by rank 0 once every rank reported its files written and fsynced:
                        {"step", "world_size", "plan": the plan's identity, "run": the run's identity,
                        "files": {name: [bytes, "crc32c:HEX"]}}
A folder counts only with its `complete`. The ranks write into CHECKPOINT_DIR/.partial-step-N; rank 0 writes
`complete` (temporary name, fsync, rename), renames the folder to step-N and fsyncs CHECKPOINT_DIR, so a crash
at any point leaves the previous checkpoints as they were.
"""

from __future__ import annotations

import json
import shutil
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from foundation.errors import UserError
from mobiuspipe import _ext
from mobiuspipe.memory.device import Device
from mobiuspipe.memory.store.index import fsync_path
from mobiuspipe.optim.loss_scale import LossScaler
from mobiuspipe.optim.ooc_links import RecordError
from mobiuspipe.runtime.peers.ranks import RankInfo, gather_all
from mobiuspipe.runtime.stage import Stage
from partition.plan import Plan, save_plan

__all__ = [
    "CheckpointError",
    "CheckpointDamaged",
    "Snapshot",
    "save_checkpoint",
    "begin_checkpoint",
    "write_snapshot",
    "commit_checkpoint",
    "partial_file",
    "prune",
    "complete_steps",
    "load_checkpoint",
    "latest_checkpoint",
    "plan_identity",
]

PREFIX = "step-"
COMPLETE = "complete"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint could not be written or read: names the file or rank and the fix."""


class CheckpointDamaged(CheckpointError):
    """A complete checkpoint whose bytes are not what its commit wrote (a file missing, cut short or of another
    checksum, an unreadable marker, damaged SSD records): an older one may still resume the run."""

    def __init__(self, folder: Path, damage: str):
        self.damage = f"checkpoint {folder}: {damage}"
        """What is damaged, without the advice (a search that passes over it says what it does instead)."""
        super().__init__(
            f"checkpoint {folder}: {damage}; --resume auto passes over it for the newest whole one before it (or "
            f"remove {folder} and resume from that one)"
        )


class Checkpointed(Protocol):
    """What a checkpoint reads and restores, through its owner's methods (mobiuspipe.Pipeline is one)."""

    @property
    def plan(self) -> Plan: ...
    @property
    def info(self) -> RankInfo: ...
    @property
    def rank(self) -> int: ...
    @property
    def step(self) -> int: ...
    @property
    def stages(self) -> dict[int, Stage]: ...
    @property
    def device(self) -> Device: ...
    @property
    def scaler(self) -> LossScaler | None: ...
    def resume_at(self, step: int, scaler: dict | None = None) -> None: ...


def plan_identity(pipe: Checkpointed) -> dict[str, Any]:
    """What a checkpoint must agree on with the run resuming it: the model, the stages and where they run."""
    p = pipe.plan
    return {
        "model": p.model,
        "num_layers": p.num_layers,
        "stages": [[s.first, s.last] for s in p.stages],
        "mapping": list(p.mapping),
        "num_gpus": p.num_gpus,
        "dtype": p.dtype,
    }


@dataclass
class Snapshot:
    """One rank's part of a checkpoint, copied out of the live states (the training may go on meanwhile)."""

    step: int
    tensors: dict[str, torch.Tensor]
    state: dict[str, Any]
    linked: list[Path] = field(default_factory=list)
    """Files hard-linked into the checkpoint (SSD records): fsynced with the rank's file."""
    failed: str | None = None
    """Why the snapshot could not be taken (linking or copying SSD records into the folder): write_snapshot says it."""


def save_checkpoint(
    pipe: Checkpointed, root: Path, keep: int, config_yaml: str | None = None, run: dict | None = None
) -> Path:
    """Write this rank's part of the checkpoint of pipe's current step (every rank calls it at the same step,
    after train_batch); rank 0 adds the plan (plan.yaml) and the run's resolved config (config.yaml, when
    given), commits it and keeps the newest `keep`. Returns the committed folder."""
    snap = begin_checkpoint(pipe, root)
    written = write_snapshot(snap, partial_file(root, snap.step, pipe.rank))
    return commit_checkpoint(pipe, root, snap.step, gather_all(pipe.info, written), keep, config_yaml, run)


def begin_checkpoint(pipe: Checkpointed, root: Path) -> Snapshot:
    """Rank 0 makes the step's folder (every rank waits for it); this rank's snapshot of its states."""
    partial = root / f".partial-{PREFIX}{pipe.step}"
    made = None
    if pipe.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # an earlier attempt's remains
        try:
            partial.mkdir(parents=True)
        except OSError as e:
            made = _failed(partial, e)
    why = gather_all(pipe.info, made)[0]  # the folder exists before any rank writes into it
    if why is not None:
        raise CheckpointError(f"checkpoint of step {pipe.step}: rank 0 could not make its folder {why}")
    try:
        return snapshot(pipe, partial)
    except OSError as e:  # its SSD records linked or copied into the folder: told as its file's failure would be
        shutil.rmtree(partial / f"rank{pipe.rank}", ignore_errors=True)
        return Snapshot(pipe.step, {}, {}, failed=_failed(e.filename or partial, e))


def _failed(path, e: OSError | SafetensorError) -> str:
    """Why a checkpoint's file or folder could not be written, and what to do."""
    why = f"{e.strerror or e} (errno {e.errno})" if isinstance(e, OSError) else str(e)
    return f"{path}: {why}; free space or fix the folder, then resume"


def partial_file(root: Path, step: int, rank: int) -> Path:
    """Where rank's file of the checkpoint of `step` is written before the commit."""
    return root / f".partial-{PREFIX}{step}" / f"rank{rank}.safetensors"


def commit_checkpoint(
    pipe: Checkpointed,
    root: Path,
    step: int,
    every: list,
    keep: int | None,
    config_yaml: str | None = None,
    run: dict | None = None,
) -> Path:
    """With every rank's write_snapshot result (gathered): rank 0 commits the checkpoint of `step` and keeps
    the newest `keep` (None: prune() is called later); CheckpointError on every rank when a rank failed (the
    unfinished folder is removed).
    `run`: what else a resumed run must share with this one (its data and batches), kept in `complete`."""
    partial, final = root / f".partial-{PREFIX}{step}", root / f"{PREFIX}{step}"
    failed = [(r, w) for r, w in enumerate(every) if isinstance(w, str)]
    if failed:
        if pipe.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        r, why = failed[0]
        raise CheckpointError(f"checkpoint of step {step}: rank {r} could not write its file: {why}")
    if pipe.rank == 0:
        files = {f"rank{r}.safetensors": w for r, w in enumerate(every)}
        head = {"step": step, "world_size": pipe.info.world_size, "plan": plan_identity(pipe), "run": run}
        try:
            with _naming(partial / "plan.yaml"):
                save_plan(pipe.plan, partial / "plan.yaml")
            if config_yaml is not None:
                with _naming(partial / "config.yaml"):
                    (partial / "config.yaml").write_text(config_yaml)
                    fsync_path(partial / "config.yaml")  # on the disk before `complete` says the folder is
            _write_complete(partial, head, files)
        except OSError as e:  # rank 0's own files, as a rank's file's failure is told (write_snapshot)
            shutil.rmtree(partial, ignore_errors=True)
            raise CheckpointError(
                f"checkpoint of step {step}: rank 0 could not write {e.filename or partial}: {e.strerror or e} "
                f"(errno {e.errno}); free space or fix the folder, then resume"
            ) from e
        _move_into_place(partial, final)
        if keep is not None:
            prune(root, keep)
    gather_all(pipe.info, None)  # no rank goes on (or reads it) before it is committed
    return final


def snapshot(pipe: Checkpointed, folder: Path) -> Snapshot:
    """Copies of this rank's stages' states (after their pending updates; states on SSD linked into folder
    where it can), random state, scaler and step."""
    tensors, stages, linked = {}, {}, []
    for j, stage in pipe.stages.items():
        stage.wait_update()
        rel = f"rank{pipe.rank}/stage{j}"
        t, extra = stage.states.export_state(folder / rel)
        lagging = stage.lagging_weights()  # the delayed update: what the next (delayed) step loads
        if lagging is not None:
            t["lagging"], extra["last_update"] = lagging[0].clone(), lagging[1]
        tensors.update({f"stage{j}/{k}": v.contiguous() for k, v in t.items()})
        if "records" in extra:
            extra["dir"] = rel
            linked += [folder / rel / r["file"] for r in extra["records"]["records"].values()]
        stages[str(j)] = extra
    tensors["rng/torch"] = torch.get_rng_state()
    if pipe.device.is_cuda:
        tensors["rng/cuda"] = torch.cuda.get_rng_state(pipe.device.torch_device)
    scaler = pipe.scaler.state() if pipe.scaler is not None else None
    return Snapshot(pipe.step, tensors, {"step": pipe.step, "scaler": scaler, "stages": stages}, linked)


def write_snapshot(snap: Snapshot, path: Path) -> tuple[int, str] | str:
    """Write a snapshot to path and fsync it and the files linked (safe in a thread of its own); (bytes,
    checksum), or why it failed."""
    if snap.failed is not None:
        return snap.failed
    try:
        save_file(snap.tensors, str(path), metadata={"state": json.dumps(snap.state)})
        folders = sorted({d for f in snap.linked for d in (f.parent, f.parent.parent)})  # rank{r}/stage{j}, rank{r}
        for f in [*snap.linked, *folders, path]:
            fsync_path(f)
        return path.stat().st_size, _digest(path)
    except OSError as e:
        return _failed(path, e)
    except SafetensorError as e:  # safetensors' own report of a failed write (a full disk, a file size limit)
        return _failed(path, e)


@contextmanager
def _naming(path: Path) -> Iterator[None]:
    """An OSError inside as one that names path (a failed write's own names no file)."""
    try:
        yield
    except OSError as e:
        if e.filename:
            raise
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e


def _write_complete(partial: Path, head: dict, files: dict[str, tuple[int, str]]) -> None:
    """Write `complete` last (tmp, fsync, rename) and fsync the folder."""
    tmp = partial / f".{COMPLETE}.tmp"
    with _naming(tmp):
        tmp.write_text(json.dumps({**head, "files": files}, indent=1))
        fsync_path(tmp)
    tmp.replace(partial / COMPLETE)
    fsync_path(partial)


def _move_into_place(partial: Path, final: Path) -> None:
    """Move the complete folder to its name (an earlier one of that name aside first) and fsync its parent."""
    aside = final.with_name(f".replaced-{final.name}")
    if final.exists():  # a checkpoint of this step from an earlier attempt: moved aside whole, then removed
        if aside.exists():  # a crash's, while it removed one before
            shutil.rmtree(aside, ignore_errors=True)
        final.replace(aside)
    partial.replace(final)
    fsync_path(final.parent)
    if aside.exists():
        shutil.rmtree(aside, ignore_errors=True)  # what a crash leaves of it, prune removes


def prune(root: Path, keep: int) -> None:
    """Remove all but the newest `keep` complete checkpoints (keep 0: none), and what crashes left of steps up to the
    newest: unfinished writes, replaced checkpoints and checkpoints half-removed (a later one may be in flight). A
    checkpoint is renamed .pruning-step-N before its files go, so a kill meanwhile leaves a name this collects. A run
    never starts behind the newest (mobiuspipe.run.resume.refuse_later_checkpoints), so the newest are its own."""
    done = complete_steps(root)
    for step in done[:-keep] if keep > 0 else []:
        gone = root / f".pruning-{PREFIX}{step}"
        try:
            (root / f"{PREFIX}{step}").replace(gone)  # one atomic step: no step-N is ever left without its files
        except FileNotFoundError:  # gone already
            continue
        shutil.rmtree(gone, ignore_errors=True)
    for kind in (".partial-", ".replaced-", ".pruning-"):
        for stale in root.glob(f"{kind}{PREFIX}*"):
            tail = stale.name[len(f"{kind}{PREFIX}") :]
            if done and tail.isdigit() and int(tail) <= done[-1]:
                shutil.rmtree(stale, ignore_errors=True)


def complete_steps(root: Path) -> list[int]:
    """The steps of the complete checkpoints under root, in order."""
    return sorted(_steps(root, complete_only=True))


def _steps(root: Path, complete_only: bool) -> list[int]:
    out = []
    for d in root.glob(f"{PREFIX}*") if root.is_dir() else []:
        tail = d.name[len(PREFIX) :]
        if tail.isdigit() and (not complete_only or (d / COMPLETE).is_file()):
            out.append(int(tail))
    return out


def latest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint of the most steps under root; None when there is none."""
    steps = _steps(root, complete_only=True)
    return root / f"{PREFIX}{max(steps)}" if steps else None


def load_checkpoint(pipe: Checkpointed, folder: Path, run: dict | None = None) -> int:
    """Restore this rank's stages, scaler and random state from folder (checked against the run's plan and,
    when both have one, its `run` identity); the step the run resumes at."""
    head = _read_complete(folder)
    _check_fits(head, pipe, folder)
    _check_run(head.get("run"), run, folder)
    try:
        state, tensors = _read_rank_file(folder, head, pipe.rank)
    except OSError as e:  # a failing disk
        raise CheckpointDamaged(folder, f"reading rank {pipe.rank}'s file failed ({e})") from e
    for j, stage in pipe.stages.items():
        stage.wait_update()
        own = {k[len(f"stage{j}/") :]: v for k, v in tensors.items() if k.startswith(f"stage{j}/")}
        extra = state["stages"][str(j)]
        try:
            lagging = own.pop("lagging", None)
            stage.states.import_state(own, extra, folder / extra["dir"] if "dir" in extra else None)
            if stage.versions > 1:
                stage.resume_lagging(lagging, extra.get("last_update", -1))
        except RecordError as e:
            raise CheckpointDamaged(folder, f"stage {j}'s states are damaged: {e}") from e
    torch.set_rng_state(tensors["rng/torch"])
    if "rng/cuda" in tensors and pipe.device.is_cuda:
        torch.cuda.set_rng_state(tensors["rng/cuda"], pipe.device.torch_device)
    pipe.resume_at(state["step"], state["scaler"])
    return state["step"]


def _read_rank_file(folder: Path, head: dict, rank: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the state, the tensors) of rank's file, checked against the size and checksum the marker (head) holds."""
    name = f"rank{rank}.safetensors"
    path = folder / name
    if not isinstance(head["files"], dict) or name not in head["files"]:
        raise CheckpointDamaged(folder, f"its `{COMPLETE}` marker names no file of rank {rank} ({name})")
    size, digest = head["files"][name]
    if not path.is_file():
        raise CheckpointDamaged(folder, f"{name} is missing")
    if path.stat().st_size != size or _digest(path, digest.split(":")[0]) != digest:
        raise CheckpointDamaged(
            folder,
            f"{path} is corrupted (expected {size} bytes with {digest}, found {path.stat().st_size} bytes"
            f"{'' if path.stat().st_size != size else ' with another checksum'})",
        )
    with safe_open(str(path), "pt") as f:  # one open for the tensors and the state in the header
        state = json.loads((f.metadata() or {})["state"])
        return state, {k: f.get_tensor(k) for k in f.keys()}


def _read_complete(folder: Path) -> dict:
    marker = folder / COMPLETE
    if not marker.is_file():
        raise CheckpointError(
            f"checkpoint {folder}: no `{COMPLETE}` marker, so it was never finished (a crash while writing); "
            "resume from another checkpoint (--resume auto takes the newest complete one)"
        )
    try:
        head = json.loads(marker.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointDamaged(folder, f"{marker} is unreadable ({e})") from e
    missing = [k for k in HEAD_KEYS if not isinstance(head, dict) or k not in head]
    if missing:
        raise CheckpointDamaged(
            folder,
            f"{marker} lacks {', '.join(missing)} (expected the keys {', '.join(HEAD_KEYS)} that a checkpoint's "
            "commit writes)",
        )
    return head


HEAD_KEYS = ("step", "world_size", "plan", "files")
"""What every `complete` marker holds (besides `run`, absent from older checkpoints)."""


def _check_fits(head: dict, pipe: Checkpointed, folder: Path) -> None:
    """The checkpoint's world size and plan must be this run's."""
    if head["world_size"] != pipe.info.world_size:
        raise CheckpointError(
            f"checkpoint {folder} was written by {head['world_size']} ranks, this run has {pipe.info.world_size}; "
            f"launch {head['world_size']} ranks (its plan.yaml) or start a new run in another folder"
        )
    mine = plan_identity(pipe)
    differs = [k for k in mine if head["plan"].get(k) != mine[k]]
    if differs:
        what = "; ".join(f"{k}: checkpoint {head['plan'].get(k)!r}, this run {mine[k]!r}" for k in differs)
        raise CheckpointError(
            f"checkpoint {folder} is of another model or plan ({what}); resume with the plan it was made with "
            "(set plan.file to the run's plan.yaml) or start a new run in another folder"
        )


def _check_run(theirs: dict | None, mine: dict | None, folder: Path) -> None:
    """The checkpoint's data and batches must be this run's: else its steps would go on with other data."""
    if theirs is None or mine is None:
        return
    differs = [k for k in mine if k in theirs and theirs[k] != mine[k]]  # an older checkpoint records fewer
    if differs:
        what = "; ".join(f"{k}: checkpoint {theirs.get(k)!r}, this run {mine[k]!r}" for k in differs)
        raise CheckpointError(
            f"checkpoint {folder} was made with other data or batches ({what}); resume with the settings of its "
            "config.yaml, or start a new run in another folder"
        )


def _digest(path: Path, algo: str | None = None) -> str:
    """ "ALGO:HEX" of the file's bytes: crc32c (the C++ extension's; zlib's crc32 without it) by default."""
    algo = algo or ("crc32c" if _ext.HAVE_C else "crc32")
    if algo == "crc32c" and not _ext.HAVE_C:
        raise CheckpointError(
            f"{path} was checked with crc32c, which needs the C++ extension ({_ext.WHY_NOT}): build it with "
            "`python -m mobiuspipe._build`"
        )
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(1 << 24):
            t = torch.frombuffer(bytearray(chunk), dtype=torch.uint8)
            crc = int(_ext.C.crc32c(t, crc)) if algo == "crc32c" else zlib.crc32(chunk, crc)
    return f"{algo}:{crc:08x}"
