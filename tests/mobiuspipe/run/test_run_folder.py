"""A run folder belongs to one run (mobiuspipe.run.run_lock): a second run on a held out_dir stops before launch with
exit 2 naming the holder, under `mobiuspipe train` and under a user's own torchrun alike, and leaves the holder's
files as they were; a lock a dead run left is taken over with a line; a refused resume rewrites none of the run's
records; --resume with the run folder means its newest checkpoint."""

from __future__ import annotations

import hashlib
import io
import shutil
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from mobiuspipe.run.run_lock import LOCK_FILE, RunFolderError, RunLocks, run_folders

RUN = {
    "model": {"num_blocks": 2, "d_model": 16, "num_heads": 2, "seq_len": 8},
    "data": {"batch_size": 4, "num_microbatches": 2},
    "train": {"steps": 2, "precision": "fp32", "tensorboard": False},
    "plan": {"num_gpus": 2, "num_stages": 4},
}
HOLD = (
    "import sys, time; from pathlib import Path; from mobiuspipe.run.run_lock import RunLocks; "
    "RunLocks.take({'train.out_dir': Path(sys.argv[1])}, 'holder'); print('held', flush=True); time.sleep(120)"
)


@pytest.fixture
def holder(tmp_path):
    """Another live run holding tmp_path/out, which already holds a run's files: (its pid, the folder)."""
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 0, "loss": 3.0}\n')
    (out / "config.yaml").write_text("train: {steps: 12}\n")
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        yield proc.pid, out
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _sums(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


def _config(tmp_path: Path, **train) -> Path:
    doc = {**RUN, "train": {**RUN["train"], "out_dir": str(tmp_path / "out"), **train}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_a_held_folder_is_refused_naming_its_holder_and_left_as_it_was(holder):
    pid, out = holder
    before = _sums(out)
    with pytest.raises(RunFolderError) as e:
        RunLocks.take({"train.out_dir": out}, "mine")
    assert f"train.out_dir {out} is in use by the run of pid {pid} on host {socket.gethostname()}" in str(e.value)
    assert "give this one another train.out_dir" in str(e.value) and _sums(out) == before


def test_the_launchers_ranks_find_its_folders_theirs(holder):
    _, out = holder
    with RunLocks.take({"train.out_dir": out}, "a rank's own", inherited="holder"):
        pass  # no error: the token is its launcher's


def test_a_lock_a_dead_run_left_is_taken_over_with_a_line(tmp_path):
    dead = subprocess.run([sys.executable, "-c", HOLD.replace("time.sleep(120)", "pass"), str(tmp_path)], check=True)
    assert dead.returncode == 0 and "holder" in (tmp_path / LOCK_FILE).read_text()
    said = io.StringIO()
    with RunLocks.take({"train.out_dir": tmp_path}, "mine", out=said):
        assert '"token": "mine"' in (tmp_path / LOCK_FILE).read_text()
    assert said.getvalue().startswith(f"mobiuspipe: train.out_dir {tmp_path}: taking over the lock that the run of pid")
    assert "left (no process holds it)" in said.getvalue()


def test_a_lock_a_run_released_is_taken_over_without_a_word(tmp_path):
    """A run that ended (released its locks) is not a dead run: the next run says nothing of it."""
    ended = HOLD.replace("time.sleep(120)", "locks.release()").replace("RunLocks.take(", "locks = RunLocks.take(")
    subprocess.run([sys.executable, "-c", ended, str(tmp_path)], check=True)
    assert (tmp_path / LOCK_FILE).read_text() == ""
    said = io.StringIO()
    with RunLocks.take({"train.out_dir": tmp_path}, "mine", out=said):
        assert '"token": "mine"' in (tmp_path / LOCK_FILE).read_text()
    assert said.getvalue() == ""


def test_a_second_take_in_the_same_process_is_refused_too(tmp_path):
    with RunLocks.take({"train.out_dir": tmp_path}, "one"), pytest.raises(RunFolderError, match="pid"):
        RunLocks.take({"train.out_dir": tmp_path}, "two")
    with RunLocks.take({"train.out_dir": tmp_path}, "three"):
        pass  # released: free again


def test_a_folder_inside_a_live_runs_folder_is_refused(holder, tmp_path):
    """A run whose checkpoint folder lies inside another live run's out_dir would resume from that run's checkpoints
    and write its own among them: refused, naming the holder, and nothing is written inside its folder."""
    pid, out = holder
    before = _sums(out)
    with pytest.raises(RunFolderError) as e:
        RunLocks.take(run_folders(str(tmp_path / "other"), str(out / "checkpoints")), "mine")
    assert f"train.checkpoint_dir {out / 'checkpoints'} lies inside {out}, which is in use by the run of pid {pid}" in (
        str(e.value)
    )
    assert _sums(out) == before and not (out / "checkpoints" / LOCK_FILE).exists()


def test_a_run_whose_folders_hold_a_live_runs_folder_is_refused(tmp_path):
    """The other way round: a live run holds out/checkpoints (its train.checkpoint_dir), and a run with out_dir out
    would write its checkpoints there too."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out / "checkpoints")], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        with pytest.raises(RunFolderError) as e:
            RunLocks.take(run_folders(str(out), str(out / "checkpoints")), "mine")
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert f"train.checkpoint_dir {out / 'checkpoints'} is in use by the run of pid {proc.pid}" in str(e.value)


def test_an_unwritable_folder_is_named(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunFolderError, match=r"train.out_dir .*file.*: cannot make its lock file"):
        RunLocks.take({"train.out_dir": tmp_path / "file"}, "t")


def test_the_checkpoint_and_ssd_folders_get_their_own_locks_only_outside_out_dir(tmp_path):
    out = tmp_path / "out"
    assert run_folders(str(out), str(out / "checkpoints")) == {
        "train.out_dir": out,
        "train.checkpoint_dir": out / "checkpoints",
    }
    assert run_folders(str(out), str(tmp_path / "ck")) == {
        "train.out_dir": out,
        "train.checkpoint_dir": tmp_path / "ck",
    }
    assert run_folders(None, str(tmp_path / "ck")) == {"train.checkpoint_dir": tmp_path / "ck"}
    assert run_folders(None, None) == {}
    assert run_folders(str(out), None, str(out / "ssd")) == {"train.out_dir": out, "memory.ssd_dir": out / "ssd"}
    assert run_folders(str(out), str(out)) == {"train.out_dir": out}
    with RunLocks.take(run_folders(str(out), str(out / "checkpoints"), str(out / "ssd")), "mine"):
        assert [p.relative_to(tmp_path) for p in tmp_path.rglob(LOCK_FILE)] == [Path("out") / LOCK_FILE]
    assert run_folders(str(out), None, "/nvme/x") == {"train.out_dir": out, "memory.ssd_dir": Path("/nvme/x")}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_mobiuspipe_train_on_a_held_out_dir_stops_before_launch(tmp_path, holder):
    pid, out = holder
    before = _sums(out)
    cmd = [sys.executable, "-m", "mobiuspipe", "train", "--config", str(_config(tmp_path))]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert got.returncode == 2, got.stderr[-3000:]
    assert got.stderr.startswith("mobiuspipe: error: train.out_dir") and f"pid {pid}" in got.stderr
    assert len(got.stderr.splitlines()) == 1 and "launching" not in got.stderr  # nothing started
    assert _sums(out) == before


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_live_runs_folder_with_checkpoints_is_named_in_use_not_another_runs(tmp_path, holder):
    """The live run has checkpoints by now: a second launch into its folder is told the folder is in use (by that
    pid), not that it "holds the checkpoints of another run" with the advice to resume it, which would then fail."""
    pid, out = holder
    (out / "checkpoints" / "step-3").mkdir()
    (out / "checkpoints" / "step-3" / "complete").write_text("{}")
    before = _sums(out)
    cmd = [sys.executable, "-m", "mobiuspipe", "train", "--config", str(_config(tmp_path))]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert got.returncode == 2, got.stderr[-3000:]
    assert got.stderr.startswith(f"mobiuspipe: error: train.out_dir {out} is in use by the run of pid {pid}"), (
        got.stderr
    )
    assert _sums(out) == before


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_users_own_torchrun_on_a_held_out_dir_stops_at_start_up(tmp_path, holder, launch):
    pid, out = holder
    before = _sums(out)
    _, torchrun = launch
    got = torchrun(_config(tmp_path), 2, timeout=150)
    assert got.returncode != 0
    assert f"mobiuspipe.train: error: train.out_dir {out} is in use by the run of pid {pid}" in got.stderr
    assert _sums(out) == before


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """The out_dir of a finished run of 4 steps with a checkpoint every 2 (step-2, step-4, its records and final
    weights), made once; each test works on its own copy (`used_out_dir`)."""
    tmp = tmp_path_factory.mktemp("finished")
    got = subprocess.run(TRAIN + [str(_config(tmp, checkpoint_every=2, steps=4))], capture_output=True, text=True,
                         timeout=150)  # fmt: skip
    assert got.returncode == 0, got.stderr[-3000:]
    return tmp / "out"


def used_out_dir(finished: Path, tmp_path: Path) -> Path:
    """tmp_path/out: a copy of the finished run's out_dir (the folder _config names)."""
    shutil.copytree(finished, tmp_path / "out")
    return tmp_path / "out"


TRAIN = [sys.executable, "-m", "mobiuspipe", "train", "--config"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_refused_resume_rewrites_none_of_the_runs_records(tmp_path, finished):
    out = used_out_dir(finished, tmp_path)
    records = {n: (out / n).read_bytes() for n in ("config.yaml", "plan.yaml", "metrics.jsonl")}
    bf16 = _config(tmp_path, checkpoint_every=2, precision="bf16", steps=6)
    again = subprocess.run(TRAIN + [str(bf16), "--resume", "auto"], capture_output=True, text=True, timeout=150)
    assert again.returncode == 2, again.stderr[-3000:]
    assert {n: (out / n).read_bytes() for n in records} == records


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_resume_from_past_the_runs_last_step_is_refused_and_writes_nothing(tmp_path, finished):
    """A finished run of 4 steps resumed with train.steps 2 (an old config, a typo, a requeue with another file): it
    started at step 4, ran nothing, wrote the step-4 checkpoint's weights over the final ones, cut metrics.jsonl to
    the steps before 4 and exited 0. It is refused before it writes anything, saying how to continue that run."""
    out = used_out_dir(finished, tmp_path)
    before = _sums(out)
    fewer = _config(tmp_path, checkpoint_every=2, steps=2)
    again = subprocess.run(TRAIN + [str(fewer), "--resume", "auto"], capture_output=True, text=True, timeout=150)
    assert again.returncode == 2, again.stderr[-3000:]
    assert "is past train.steps 2" in again.stderr and "raise train.steps" in again.stderr
    assert _sums(out) == before


def test_resume_reads_a_run_folder_or_a_checkpoint_root_as_auto_there(tmp_path):
    from mobiuspipe.run.resume import resume_root

    run = tmp_path / "run"
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    (run / "checkpoints" / "step-2" / "complete").write_text("{}")
    assert resume_root("auto", tmp_path / "elsewhere") == tmp_path / "elsewhere"
    assert resume_root(str(run), tmp_path) == run / "checkpoints"
    assert resume_root(str(run / "checkpoints"), tmp_path) == run / "checkpoints"
    assert resume_root(str(run / "checkpoints" / "step-2"), tmp_path) is None  # one checkpoint: itself
    assert resume_root(str(tmp_path / "missing"), tmp_path) is None  # loading it says what is wrong


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_resume_with_the_run_folder_continues_from_its_newest_checkpoint(tmp_path, finished):
    out = used_out_dir(finished, tmp_path)
    more = _config(tmp_path, checkpoint_every=2, steps=6)
    again = subprocess.run(TRAIN + [str(more), "--resume", str(out)], capture_output=True, text=True, timeout=150)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"mobiuspipe: {out} holds checkpoints: resuming from its newest complete one" in again.stdout
    assert f"resumed from {out / 'checkpoints' / 'step-4'} at step 4" in again.stdout
    assert "step 5 [6/6]" in again.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_behind_the_folders_checkpoints_is_refused_and_leaves_them(tmp_path, finished):
    """A new run in a folder that holds another run's checkpoints, and a resume from an older checkpoint than the
    folder's newest, would prune their own checkpoints as the oldest and leave a later --resume auto to take the
    other timeline's: both are refused before they write anything, naming the checkpoints and the ways out (the
    new run by `mobiuspipe train` before it plans and launches)."""
    out = used_out_dir(finished, tmp_path)
    cfg = str(_config(tmp_path, checkpoint_every=2, steps=4))
    before = _sums(out)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]
    fresh = subprocess.run(TRAIN + [cfg], capture_output=True, text=True, timeout=150)
    assert fresh.returncode == 2, fresh.stderr[-3000:]
    assert "holds the checkpoints of another run (step-2, step-4)" in fresh.stderr
    assert "--resume auto" in fresh.stderr and "another train.out_dir" in fresh.stderr
    assert "launching" not in fresh.stderr  # refused before torchrun
    back = str(out / "checkpoints" / "step-2")
    rollback = subprocess.run(TRAIN + [cfg, "--resume", back], capture_output=True, text=True, timeout=150)
    assert rollback.returncode == 2, rollback.stderr[-3000:]
    assert "holds checkpoints after step 2, where this run resumes (step-4)" in rollback.stderr
    assert "resumed from" not in rollback.stdout  # a start it refuses is not announced first
    assert _sums(out) == before
    # a user's own torchrun skips the launcher: its ranks refuse the new run with the same words
    from types import SimpleNamespace

    from mobiuspipe.checkpoint import CheckpointError
    from mobiuspipe.config import load_config
    from mobiuspipe.run.resume import refuse_later_checkpoints

    rank0 = SimpleNamespace(rank=0, info=SimpleNamespace(world_size=1))  # what the rule reads of a Pipeline
    with pytest.raises(CheckpointError) as e:
        refuse_later_checkpoints(load_config(Path(cfg)).train, rank0, 0)  # type: ignore[arg-type]
    assert str(e.value) in fresh.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_finished_runs_records_are_never_written_over_by_a_run_from_step_0(tmp_path, finished):
    """A run without checkpoints (checkpoint_every 0) finished: its metrics and final weights are all it leaves. A
    new run in its folder, and a --resume auto that finds no checkpoint to continue from, would start at step 0 and
    write over them: both are refused before they write anything (exit 2 under `mobiuspipe train`, before it
    launches the new run). A run that stopped before its end (no final weights) restarts from step 0 with
    --resume auto, as a job script's restart does."""
    from types import SimpleNamespace

    from mobiuspipe.config import load_config
    from mobiuspipe.run.resume import refuse_writing_over

    out = used_out_dir(finished, tmp_path)
    shutil.rmtree(out / "checkpoints")  # what a run with checkpoint_every 0 leaves
    cfg = _config(tmp_path, steps=4)
    before = _sums(out)
    assert (out / "metrics.jsonl").is_file() and any((out / "weights").iterdir())
    again = subprocess.run(TRAIN + [str(cfg)], capture_output=True, text=True, timeout=150)
    assert again.returncode == 2, again.stderr[-3000:]
    said = f"{out} holds the results of an earlier run (metrics.jsonl: 4 steps; weights/: 4 files): this run would"
    assert said in again.stderr and "another train.out_dir" in again.stderr and "nothing was changed" in again.stderr
    assert "launching" not in again.stderr
    assert _sums(out) == before

    t = load_config(cfg).train
    resumed = replace(t, resume="auto")
    rank0 = SimpleNamespace(rank=0, info=SimpleNamespace(world_size=1))  # what the rule reads of a Pipeline
    with pytest.raises(RunFolderError, match="weights/: 4 files\\) but no checkpoint to continue it from"):
        refuse_writing_over(resumed, rank0, 0)  # type: ignore[arg-type]
    # a resumed run keeps the records before its step and goes on
    refuse_writing_over(resumed, rank0, 1)  # type: ignore[arg-type]
    for f in (out / "weights").iterdir():  # a run that stopped before its end: no final weights
        f.unlink()
    refuse_writing_over(resumed, rank0, 0)  # type: ignore[arg-type]
    with pytest.raises(RunFolderError, match="metrics.jsonl: 4 steps\\): this run would start at step 0"):
        refuse_writing_over(t, rank0, 0)  # type: ignore[arg-type]
