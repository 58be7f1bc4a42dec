"""Faults around checkpoints: a full disk or an I/O error while a checkpoint is written, and an I/O error of
the SSD tier during training, are named errors (the file, the rank, the fix); the unfinished checkpoint is
removed and the previous one still resumes the run bit-identically."""

from __future__ import annotations

import errno
import os
from functools import partial
from pathlib import Path

import pytest
import torch

import mobiuspipe.checkpoint as checkpoint
from mobiuspipe import Pipeline
from mobiuspipe.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from mobiuspipe.config import MemoryConfig, config_from_dict
from mobiuspipe.data.dataset import open_data
from mobiuspipe.errors import SwapIOError
from mobiuspipe.models.gpt import layer_factories, lm_loss
from mobiuspipe.optim import CPUAdam
from mobiuspipe.startup.config_plan import model_spec, plan_for_config

CFG = config_from_dict(
    {
        "model": {"num_blocks": 3, "d_model": 24, "num_heads": 3, "seq_len": 17},
        "data": {"batch_size": 6, "num_microbatches": 3},
        "train": {"lr": 0.01, "seed": 5, "precision": "bf16"},
        "plan": {"num_gpus": 1, "num_stages": 4, "device_memory_mb": 256},
    }
)
DATA = open_data(CFG.data, CFG.model.seq_len, 5, CFG.model.vocab_size)


def _pipe(memory=None) -> Pipeline:
    opt = partial(CPUAdam, lr=0.01, weight_decay=0.05)
    return Pipeline(
        layer_factories(model_spec(CFG), 5), lm_loss, plan=plan_for_config(CFG), optimizer=opt, memory=memory
    )


def _train(pipe, steps) -> list[float]:
    return [pipe.train_batch(*DATA.batch(s, 6)).loss for s in steps]


def _reference(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    with _pipe() as pipe:
        return _train(pipe, range(steps)), pipe.state_dict()


@pytest.mark.parametrize("code,where", [(errno.ENOSPC, "save_file"), (errno.EIO, "fsync_path")])
def test_a_failed_checkpoint_write_is_named_and_the_previous_one_resumes(tmp_path, monkeypatch, code, where):
    want_losses, want = _reference(4)
    root = tmp_path / "ckpt"
    with _pipe() as pipe:
        _train(pipe, range(2))
        good = save_checkpoint(pipe, root, keep=3)
        _train(pipe, [2])
        real = getattr(checkpoint, where)

        def failing(*args, **kw):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(checkpoint, where, failing)
        with pytest.raises(CheckpointError) as e:
            save_checkpoint(pipe, root, keep=3)
        monkeypatch.setattr(checkpoint, where, real)
    message = str(e.value)
    assert message.startswith("checkpoint of step 3: rank 0 could not write its file: ")
    assert str(root / ".partial-step-3" / "rank0.safetensors") in message and f"(errno {code})" in message
    assert "free space or fix the folder, then resume" in message
    assert sorted(p.name for p in root.iterdir()) == ["step-2"] and latest_checkpoint(root) == good
    with _pipe() as pipe:
        assert load_checkpoint(pipe, good) == 2
        assert _train(pipe, range(2, 4)) == want_losses[2:]
        got = pipe.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_full_disk_at_rank_0s_commit_is_named_and_the_previous_one_resumes(tmp_path, monkeypatch):
    """Rank 0's own files of a checkpoint (plan.yaml, config.yaml, complete), written once every rank's file is:
    a full disk there is the same named error as under a rank's file, the unfinished folder removed."""
    root = tmp_path / "ckpt"
    with _pipe() as pipe:
        _train(pipe, range(2))
        good = save_checkpoint(pipe, root, keep=3)
        _train(pipe, [2])

        def full(plan, path, *args, **kw):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

        monkeypatch.setattr(checkpoint, "save_plan", full)
        with pytest.raises(CheckpointError) as e:
            save_checkpoint(pipe, root, keep=3)
    message = str(e.value)
    assert message.startswith(f"checkpoint of step 3: rank 0 could not write {root / '.partial-step-3' / 'plan.yaml'}")
    assert "No space left on device (errno 28); free space or fix the folder, then resume" in message
    assert sorted(p.name for p in root.iterdir()) == ["step-2"] and latest_checkpoint(root) == good


@pytest.mark.parametrize("where", ["folder", "states"])
def test_a_full_disk_before_the_ranks_file_is_named_and_the_previous_one_resumes(tmp_path, monkeypatch, where):
    """Making the step's folder (rank 0) and the snapshot's links or copies of SSD records (each rank) come before a
    rank writes its file: a full disk there (an ext4 without a free block or inode) was a bare OSError and a
    traceback on that rank alone, not the named error every rank raises for a rank's file."""
    root = tmp_path / "ckpt"
    memory = MemoryConfig(optimizer="ssd", ssd_dir=str(tmp_path / "ssd"), host_budget_mb=1.0)
    with _pipe(memory) as pipe:
        _train(pipe, range(2))
        good = save_checkpoint(pipe, root, keep=3)
        _train(pipe, [2])

        def full(*args, **kw):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        if where == "folder":
            real = Path.mkdir
            monkeypatch.setattr(
                Path, "mkdir", lambda p, *a, **k: full() if "partial-step-3" in str(p) else real(p, *a, **k)
            )
        else:
            stage = next(iter(pipe.stages.values()))
            monkeypatch.setattr(stage.states, "export_state", full)
        with pytest.raises(CheckpointError) as e:
            save_checkpoint(pipe, root, keep=3)
        monkeypatch.undo()
    message = str(e.value)
    assert message.startswith("checkpoint of step 3: rank 0 could not "), message
    assert "No space left on device (errno 28); free space or fix the folder, then resume" in message
    assert sorted(p.name for p in root.iterdir()) == ["step-2"] and latest_checkpoint(root) == good


def test_a_full_disk_under_safetensors_is_named_not_raised(tmp_path):
    """safetensors reports a failed write (ENOSPC, EFBIG) as its own SafetensorError, not an OSError: the file cap
    of RLIMIT_FSIZE makes one for real in a child process; write_snapshot returns why, as for an OSError."""
    import subprocess
    import sys

    script = (
        "import resource, signal, sys, torch; from pathlib import Path; "
        "from mobiuspipe.checkpoint import Snapshot, write_snapshot; "
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "snap = Snapshot(3, {'w': torch.zeros(1 << 20)}, {'step': 3, 'scaler': None, 'stages': {}}); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20)); "
        "print(repr(write_snapshot(snap, Path(sys.argv[1]))))"
    )
    path = tmp_path / "rank0.safetensors"
    got = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.startswith(f"'{path}: ") and "free space or fix the folder, then resume" in got.stdout


def test_a_checkpoint_replaced_by_one_of_its_step_is_never_half_there(tmp_path, monkeypatch):
    """Saving a step that has a checkpoint already (an earlier attempt's) replaces it whole: the old one is moved
    aside before the new one takes its name, so a crash while the old one is removed leaves the new one, complete."""
    import shutil

    root = tmp_path / "ckpt"
    with _pipe() as pipe:
        _train(pipe, range(2))
        save_checkpoint(pipe, root, keep=3)
        first = (root / "step-2" / "rank0.safetensors").read_bytes()
        _train(pipe, [2])
        pipe.step = 2  # a second attempt at the checkpoint of step 2, with other states
        real = shutil.rmtree

        def crash(path, *a, **k):  # the removal of a committed checkpoint dies after one file
            if not (Path(path) / "complete").is_file():
                return real(path, *a, **k)
            next(p for p in sorted(Path(path).rglob("*")) if p.is_file()).unlink()
            raise OSError(errno.EIO, "killed while removing")

        monkeypatch.setattr(checkpoint.shutil, "rmtree", crash)
        with pytest.raises(OSError):
            save_checkpoint(pipe, root, keep=3)
        monkeypatch.setattr(checkpoint.shutil, "rmtree", real)
    assert latest_checkpoint(root) == root / "step-2"
    assert (root / "step-2" / "rank0.safetensors").read_bytes() != first
    with _pipe() as pipe:
        assert load_checkpoint(pipe, root / "step-2") == 2


def test_an_ssd_tier_error_stops_the_run_and_the_last_checkpoint_resumes(tmp_path):
    """The SSD tier's EIO mid-run is a SwapIOError; a new run on a fresh store resumes the checkpoint."""
    want_losses, want = _reference(4)
    memory = MemoryConfig(optimizer="ssd", weights="ssd", ssd_dir=str(tmp_path / "ssd"), host_budget_mb=0.25)
    root = tmp_path / "ckpt"
    pipe = _pipe(memory)
    _train(pipe, range(2))
    good = save_checkpoint(pipe, root, keep=3)
    assert pipe.store is not None
    pipe.store.engine.inject_fault(3, errno.EIO)
    with pytest.raises(SwapIOError):
        _train(pipe, range(2, 4))
        pipe.engine.wait_updates()
    pipe.close()
    again = MemoryConfig(optimizer="ssd", weights="ssd", ssd_dir=str(tmp_path / "ssd2"), host_budget_mb=0.25)
    with _pipe(again) as pipe:
        assert load_checkpoint(pipe, good) == 2
        assert _train(pipe, range(2, 4)) == want_losses[2:]
        got = pipe.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def _train_config(out: Path, resume: str = "auto"):
    return config_from_dict({"train": {"out_dir": str(out), "resume": resume}}).train


@pytest.mark.parametrize("damage", ["truncated", "missing", "marker", "records"])
def test_resume_auto_sets_a_damaged_newest_checkpoint_aside_and_resumes_from_the_one_before(tmp_path, capsys, damage):
    """A week's run restarted by a job script with --resume auto: the newest checkpoint's bytes are not what its
    commit wrote (a file cut short or gone, an unreadable marker, damaged SSD records). The run resumes from the
    newest whole one, bit-identically, and the damaged one is kept beside the others under a name no resume, prune
    or later-checkpoint check takes."""
    from mobiuspipe.run.resume import refuse_later_checkpoints, resume_run

    ssd = MemoryConfig(optimizer="ssd", ssd_dir=str(tmp_path / "store")) if damage == "records" else None
    want, _ = _reference(4)
    root = tmp_path / "out" / "checkpoints"
    with _pipe(ssd) as pipe:
        _train(pipe, [0])
        save_checkpoint(pipe, root, keep=3)
        _train(pipe, [1])
        newest = save_checkpoint(pipe, root, keep=3)
    f = newest / "rank0.safetensors"
    if damage == "truncated":
        f.write_bytes(f.read_bytes()[:-5])
    elif damage == "missing":
        f.unlink()
    elif damage == "marker":
        (newest / "complete").write_text("{not json")
    else:
        records = sorted(p for p in newest.rglob("*") if p.is_file() and p.parent != newest)
        assert records, "the SSD states' records are in the checkpoint"
        records[0].write_bytes(records[0].read_bytes()[:-3])
    t = _train_config(tmp_path / "out")
    with _pipe(ssd) as pipe:
        start = resume_run(t, pipe)
        refuse_later_checkpoints(t, pipe, start)  # the damaged one is not a later checkpoint of another timeline
        assert start == 1 and _train(pipe, [1, 2, 3]) == want[1:]
    aside = root / ".damaged-step-2"
    assert sorted(p.name for p in root.iterdir()) == [".damaged-step-2", "step-1"]
    assert aside.is_dir() and any(aside.iterdir())  # kept as it was found: nothing deleted
    said = capsys.readouterr().out
    assert f"checkpoint {newest} is damaged" in said and f"set aside as {aside}" in said
    assert f"resumed from {root / 'step-1'} at step 1" in said
    assert "and resume from that one" not in said  # the advice of a resume naming it, not of one that set it aside


def test_resume_auto_with_every_checkpoint_damaged_is_an_error_not_a_fresh_start(tmp_path):
    """Also the next --resume auto (a job script's restart), when the damaged ones are set aside already: starting at
    step 0 would write over the run's records. The advice is one the run then takes: another out_dir."""
    from mobiuspipe.run.resume import resume_run

    root = tmp_path / "out" / "checkpoints"
    with _pipe() as pipe:
        for s in range(2):
            _train(pipe, [s])
            f = save_checkpoint(pipe, root, keep=3) / "rank0.safetensors"
            f.write_bytes(f.read_bytes()[:-1])
    for _ in range(2):
        with _pipe() as pipe, pytest.raises(CheckpointError) as e:
            resume_run(_train_config(tmp_path / "out"), pipe)
        assert f"every complete checkpoint under {root} is damaged" in str(e.value)
        assert "set aside as .damaged-step-1, .damaged-step-2" in str(e.value)
        assert "another train.out_dir" in str(e.value) and "--resume PATH" in str(e.value)
    assert sorted(p.name for p in root.iterdir()) == [".damaged-step-1", ".damaged-step-2"]


@pytest.mark.parametrize("damage", ["read error", "marker without the file"])
def test_a_checkpoint_that_cannot_be_read_is_damaged_too(tmp_path, monkeypatch, damage):
    """An I/O error while a rank reads its file (a failing disk), or a marker that names no file for the rank: the
    rank reports damage, not an exception of its own, and the resume goes back one checkpoint."""
    import json

    from mobiuspipe.run.resume import resume_run

    want, _ = _reference(3)
    root = tmp_path / "out" / "checkpoints"
    with _pipe() as pipe:
        _train(pipe, [0])
        save_checkpoint(pipe, root, keep=3)
        _train(pipe, [1])
        newest = save_checkpoint(pipe, root, keep=3)
    if damage == "read error":
        digest = checkpoint._digest

        def failing(path, algo=None):
            if Path(path).parent == newest:
                raise OSError(errno.EIO, "Input/output error", str(path))
            return digest(path, algo)

        monkeypatch.setattr(checkpoint, "_digest", failing)
    else:
        head = json.loads((newest / "complete").read_text())
        head["files"] = {}
        (newest / "complete").write_text(json.dumps(head))
    with _pipe() as pipe:
        assert resume_run(_train_config(tmp_path / "out"), pipe) == 1
        assert _train(pipe, [1, 2]) == want[1:]
    assert (root / ".damaged-step-2").is_dir()


def test_a_checkpoint_of_another_plan_is_an_error_and_no_older_one_is_tried(tmp_path):
    """Only damage falls back: a checkpoint of another model or plan says so, and nothing is set aside."""
    from mobiuspipe.run.resume import resume_run

    root = tmp_path / "out" / "checkpoints"
    with _pipe() as pipe:
        for s in range(2):
            _train(pipe, [s])
            save_checkpoint(pipe, root, keep=3)
    other = config_from_dict({**CFG.to_dict(), "model": {**CFG.to_dict()["model"], "num_blocks": 4}})
    with Pipeline(
        layer_factories(model_spec(other), 5), lm_loss, plan=plan_for_config(other), optimizer=partial(CPUAdam)
    ) as pipe:
        with pytest.raises(CheckpointError, match="is of another model or plan"):
            resume_run(_train_config(tmp_path / "out"), pipe)
    assert sorted(p.name for p in root.iterdir()) == ["step-1", "step-2"]


def test_a_checkpoint_pruned_halfway_by_a_kill_is_removed_by_the_next_prune(tmp_path, monkeypatch):
    """A kill while prune removes an old checkpoint (an SSD checkpoint links hundreds of record files) leaves part of
    it, its `complete` perhaps gone first; the next prune removes the rest, or a week of such kills fills the disk."""
    import shutil

    root = tmp_path / "ckpt"
    for step in (1, 2, 3):
        (root / f"step-{step}").mkdir(parents=True)
        (root / f"step-{step}" / "rank0.safetensors").write_bytes(bytes(100))
        (root / f"step-{step}" / "complete").write_text("{}")
    real = shutil.rmtree

    def killed(path, *a, **k):  # the process dies once `complete` is gone, the rest still there
        (Path(path) / "complete").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.prune(root, 2)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real)
    checkpoint.prune(root, 2)  # the next checkpoint's
    assert sorted(p.name for p in root.iterdir()) == ["step-2", "step-3"]
    assert latest_checkpoint(root) == root / "step-3"
