"""Every mistake before launch: `mobiuspipe train` and each rank check the plan against the config and the job,
and the folders, before any work; a start-up mistake is one line from one rank and exit 2."""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from mobiuspipe.cli import main as cli
from mobiuspipe.config import load_config
from mobiuspipe.errors import ConfigError
from mobiuspipe.run import preflight

MODEL = {"num_blocks": 2, "d_model": 16, "num_heads": 2, "seq_len": 8}


def _write(path: Path, doc: dict) -> Path:
    path.write_text(yaml.safe_dump(doc))
    return path


def _run_doc(**sections) -> dict:
    doc = {
        "model": dict(MODEL),
        "data": {"num_microbatches": 4},
        "train": {"precision": "fp32", "steps": 1},
        "plan": {"num_gpus": 2, "num_stages": 3},
    }
    for name, values in sections.items():
        doc[name] = {**doc.get(name, {}), **values}
    return doc


def _make_plan(tmp_path: Path, **sections) -> Path:
    """A plan file made by `mobiuspipe partition --config` for the run _run_doc(**sections) describes."""
    planning = _write(tmp_path / "planning.yaml", _run_doc(**sections))
    assert cli(["partition", "--config", str(planning), "-o", str(tmp_path / "plan.yaml")]) == 0
    return tmp_path / "plan.yaml"


@pytest.fixture
def no_launch(monkeypatch):
    """`mobiuspipe train` in this process, with torchrun replaced by a failure: returns (exit code, stderr)."""

    def launched(*args, **kwargs):
        raise AssertionError(f"torchrun was launched: {args}")

    monkeypatch.setattr(subprocess, "run", launched)
    monkeypatch.setattr(subprocess, "Popen", launched)

    def train(capsys, config: Path, *flags: str) -> tuple[int, str]:
        capsys.readouterr()
        code = cli(["train", "--config", str(config), *flags])
        out = capsys.readouterr()
        assert out.out == ""
        return code, out.err

    return train


def _one_error_line(err: str, prog: str = "mobiuspipe") -> str:
    assert err.count("\n") == 1 and err.startswith(f"{prog}: error: "), err
    assert "launching" not in err and "Traceback" not in err
    return err.strip()


def test_a_plan_for_other_microbatches_and_dtype_is_refused_with_every_problem(tmp_path, capsys, no_launch):
    """Made for 4 microbatches of 2 in fp32; the run asks 2 microbatches of 4 in bf16: three problems, one line."""
    plan = _make_plan(tmp_path)
    run = _write(
        tmp_path / "run.yaml",
        _run_doc(
            data={"batch_size": 8, "num_microbatches": 2}, train={"precision": "bf16"}, plan={"file": "plan.yaml"}
        ),
    )
    code, err = no_launch(capsys, run)
    line = _one_error_line(err)
    assert code == 2 and line.startswith(f"mobiuspipe: error: config {run}: 3 errors: (1) train.precision: ")
    new = plan.with_name("plan.new.yaml")  # the user's plan file is kept
    replan = f"into a new file, `mobiuspipe partition --config {run} -o {new}`, then set plan.file: {new}"
    assert f"(1) train.precision: expected fp32 (as in plan.file {plan}), found bf16; fix: re-plan" in line
    assert f"{replan}, or set train.precision: fp32 (2)" in line
    assert f"(2) data.num_microbatches: expected 4 (as in plan.file {plan}), found 2; fix: re-plan" in line
    assert "or set data.num_microbatches: 4 (3)" in line  # 4 x 2 = data.batch_size 8 already
    assert (
        f"(3) data.batch_size: expected microbatches of 2 sequences (as in plan.file {plan}: data.batch_size 8 in 4 "
        f"microbatches), found data.batch_size 8 in 2 microbatches of 4; fix: re-plan"
    ) in line
    assert line.endswith(f"{replan}, or set data.num_microbatches: 4")


def test_a_plan_for_another_microbatch_size_is_refused(tmp_path, capsys, no_launch):
    """The same microbatch count, twice the sequences each: the plan's activations would not be the run's."""
    plan = _make_plan(tmp_path)
    run = _write(tmp_path / "run.yaml", _run_doc(data={"batch_size": 16}, plan={"file": str(plan)}))
    code, err = no_launch(capsys, run)
    line = _one_error_line(err)
    assert code == 2 and line == (
        f"mobiuspipe: error: config {run}: data.batch_size: expected microbatches of 2 sequences (as in plan.file "
        f"{plan}: data.batch_size 8 in 4 microbatches), found data.batch_size 16 in 4 microbatches of 4; fix: "
        f"re-plan for this config into a new file, `mobiuspipe partition --config {run} -o "
        f"{plan.with_name('plan.new.yaml')}`, then set plan.file: {plan.with_name('plan.new.yaml')}, or set "
        f"data.batch_size: 8"
    )


def test_a_plan_for_another_model_is_refused(tmp_path, capsys, no_launch):
    plan = _make_plan(tmp_path, model={"num_blocks": 4})
    run = _write(tmp_path / "run.yaml", _run_doc(plan={"file": str(plan)}))
    code, err = no_launch(capsys, run)
    line = _one_error_line(err)
    assert code == 2 and f"config {run}: 2 errors: " in line
    assert "(1) plan.file: expected a plan for this config's model 'gpt-2x16', found a plan for 'gpt-4x16'" in line
    assert (
        "(2) plan.file: expected a plan cutting the model's 4 layers, found a plan for 6 layers; fix: re-plan" in line
    )
    assert line.endswith(
        f"then set plan.file: {plan.with_name('plan.new.yaml')}, or remove plan.file to plan at start-up"
    )


def test_nproc_must_be_the_plans_gpu_count(tmp_path, capsys, no_launch):
    run = _write(tmp_path / "run.yaml", _run_doc())
    code, err = no_launch(capsys, run, "--nproc", "3")
    assert code == 2 and _one_error_line(err) == (
        f"mobiuspipe: error: config {run}: plan.num_gpus: expected 2 ranks, one per gpu of the plan, found "
        f"--nproc 3; fix: drop --nproc (mobiuspipe train then starts 2), or set plan.num_gpus: 3"
    )


def test_nproc_and_a_plan_files_mismatches_come_together(tmp_path, capsys, no_launch):
    plan = _make_plan(tmp_path)
    run = _write(tmp_path / "run.yaml", _run_doc(train={"precision": "bf16"}, plan={"file": str(plan)}))
    code, err = no_launch(capsys, run, "--nproc", "1")
    line = _one_error_line(err)
    assert code == 2 and f"config {run}: 2 errors: (1) plan.file: expected 2 ranks, one per gpu of the plan" in line
    fix = "drop --nproc (mobiuspipe train then starts 2), or set plan.num_gpus: 1 and re-plan for 1 gpus into a new"
    assert f"found --nproc 1; fix: {fix}" in line
    assert "(2) train.precision: expected fp32" in line


def test_each_rank_checks_its_world_size(tmp_path, monkeypatch):
    """Under torchrun (WORLD_SIZE) and without it: the plan's gpu count against the ranks there are."""
    cfg = load_config(_write(tmp_path / "run.yaml", _run_doc()))
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError) as e:
        preflight.rank_checks(cfg)
    assert str(e.value).startswith(
        f"config {cfg.source}: plan.num_gpus: expected 2 ranks, one per gpu of the plan, found torchrun started 3 "
        f"(WORLD_SIZE); fix: start 2 ranks (`mobiuspipe train --config {cfg.source}` starts one per gpu; by hand, "
        f"`torchrun --nproc_per_node 2 ...` on one machine), or set plan.num_gpus: 3"
    )
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ConfigError, match=r"found 1, not started by torchrun; .* or set plan.num_gpus: 1$"):
        preflight.rank_checks(cfg)


def test_check_writable_makes_the_folder_and_leaves_nothing(tmp_path):
    folder = preflight.check_writable(tmp_path / "a" / "b", "train.out_dir")
    assert folder.is_dir() and list(folder.iterdir()) == []


def test_check_writable_names_the_key_the_path_and_the_os_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError) as e:
        preflight.check_writable(tmp_path / "file" / "out", "train.checkpoint_dir")
    assert str(e.value) == (
        f"train.checkpoint_dir: expected a folder this process can create and write, found {tmp_path}/file/out: "
        f"Not a directory; fix: set train.checkpoint_dir to a folder you can write, or make it writable "
        f"(permissions, free space, a read-write mount)"
    )


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs sysfs, where no one may create files")
def test_check_writable_refuses_a_folder_it_cannot_write():
    """Even root cannot create files in sysfs."""
    with pytest.raises(
        ConfigError, match=r"^train\.out_dir: .* found /sys/kernel: (Permission denied|Read-only file system); fix: "
    ):
        preflight.check_writable("/sys/kernel", "train.out_dir")


def test_check_writable_on_a_full_disk_removes_its_file(tmp_path, monkeypatch):
    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(preflight.os, "write", full)
    with pytest.raises(ConfigError, match=f"found {re.escape(str(tmp_path))}: No space left on device; fix: "):
        preflight.check_writable(tmp_path, "train.out_dir")
    assert list(tmp_path.iterdir()) == []


def test_train_refuses_an_unwritable_out_dir_before_launching(tmp_path, capsys, no_launch):
    (tmp_path / "file").write_text("x")
    run = _write(tmp_path / "run.yaml", _run_doc(train={"out_dir": str(tmp_path / "file" / "out")}))
    code, err = no_launch(capsys, run)
    assert code == 2 and _one_error_line(err).startswith(
        f"mobiuspipe: error: train.out_dir: expected a folder this process can create and write, found "
        f"{tmp_path}/file/out: Not a directory; fix: set train.out_dir to a folder you can write"
    )


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # @record, with pytest capturing stderr
def test_each_rank_refuses_an_unwritable_out_dir(tmp_path, capsys):
    """The torchrun entry of a 1-gpu run, in this process: it stops before the Pipeline, with exit 2."""
    from mobiuspipe.run.train import main

    (tmp_path / "file").write_text("x")
    run = _write(tmp_path / "run.yaml", _run_doc(plan={"num_gpus": 1}, train={"out_dir": str(tmp_path / "file/o")}))
    assert main(["--config", str(run)]) == 2
    err = capsys.readouterr().err
    assert _one_error_line(err, "mobiuspipe.train").startswith("mobiuspipe.train: error: train.out_dir: expected")


def _cli_subprocess(config: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mobiuspipe", "train", "--config", str(config)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=config.parent)


def test_train_refuses_ids_beyond_the_vocabulary_and_empty_data_before_launching(tmp_path):
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "big.bin")
    (tmp_path / "empty.txt").write_text("")
    vocab = _write(tmp_path / "vocab.yaml", {"model": {"vocab_size": 256}, "data": {"tokens": "big.bin"}})
    empty = _write(tmp_path / "empty.yaml", {"data": {"path": "empty.txt"}})
    for config, want in (
        (vocab, "data.tokens: expected token ids below the model's vocab_size 256, found ids up to 999 in token "),
        (empty, "data.path: expected at least batch_size * seq_len + 1 = 8 * 64 + 1 = 513 tokens (one batch), "),
    ):
        out = _cli_subprocess(config)
        assert out.returncode == 2 and out.stdout == "", out.stderr
        assert _one_error_line(out.stderr).startswith(f"mobiuspipe: error: {want}")
    assert "fix: raise model.vocab_size to at least 1000" in _cli_subprocess(vocab).stderr


def test_a_start_up_mistake_prints_once_per_host(capsys, monkeypatch):
    """Another rank than the host's first waits for it; torchrun's SIGTERM then ends it with code 2, quietly."""
    error = ConfigError("config x: plan.num_gpus: expected ...")
    with pytest.raises(ConfigError):
        with preflight.at_start_up():
            raise error
    assert preflight.report(error, "p") == 2 and capsys.readouterr().err == f"p: error: {error}\n"
    monkeypatch.setenv("LOCAL_RANK", "1")
    handler = signal.getsignal(signal.SIGTERM)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    with pytest.raises(SystemExit) as e:
        preflight.report(error, "p")
    timer.join()
    assert e.value.code == 2 and capsys.readouterr().err == ""
    assert signal.getsignal(signal.SIGTERM) is handler
    monkeypatch.setattr(preflight, "QUIET_WAIT_S", 0.1)  # no SIGTERM: the mistake is this rank's, it speaks
    assert preflight.report(error, "p") == 2 and capsys.readouterr().err == f"p: error: {error}\n"
    assert preflight.report(ConfigError("later"), "p") == 2 and capsys.readouterr().err == "p: error: later\n"


def test_plain_torchrun_of_a_bad_config_prints_one_line(tmp_path, launch):
    """Both ranks find the typo; local rank 0 prints it, rank 1 exits 2 quietly; torchrun itself still exits 1
    with its own failure summary (docs/cli.md, "Errors the ranks find")."""
    write_config, torchrun = launch
    config = write_config(tmp_path, {"train": {"stepz": 3, "out_dir": str(tmp_path / "out")}})
    proc = torchrun(config, 2, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"mobiuspipe.train: error: config {config}: train.stepz: ")
    assert errors[0].endswith("found unknown key 'stepz'; fix: did you mean 'steps'?")
    assert 'mobiuspipe/run/train.py", line' not in proc.stderr and "Traceback" in proc.stderr  # torchrun's own
    root_cause = proc.stderr.partition("Root Cause")[2]  # torchrun's summary names rank 0, which exited 2
    assert proc.returncode == 1 and re.search(r"rank +: 0 \(local_rank: 0\)\s+exitcode +: 2 ", root_cause)
    assert not (tmp_path / "out").exists()


def _ssd_doc(tmp_path: Path, **memory) -> dict:
    return _run_doc(memory={"optimizer": "ssd", "ssd_dir": str(tmp_path / "ssd"), **memory})


def test_a_host_budget_too_small_is_refused_before_launch_naming_every_rank(tmp_path, capsys, no_launch):
    run = _write(tmp_path / "run.yaml", _ssd_doc(tmp_path, host_budget_mb=0.01))
    code, err = no_launch(capsys, run)
    line = _one_error_line(err)
    assert code == 2 and "memory.host_budget_mb: expected at least" in line and "found 0.01 MiB" in line
    assert "rank 0: stages" in line and "rank 1: stages" in line
    named = re.search(r"raise memory.host_budget_mb to at least ([0-9.]+)", line)
    assert named is not None
    need = float(named.group(1))
    enough = _write(tmp_path / "enough.yaml", _ssd_doc(tmp_path, host_budget_mb=need * 1.001))  # 4 digits shown
    assert preflight.launch_checks(load_config(enough), None)[0] == 2


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # @record, with pytest capturing stderr
def test_each_rank_refuses_a_host_budget_too_small(tmp_path, capsys):
    from mobiuspipe.run.train import main

    doc = _ssd_doc(tmp_path, host_budget_mb=0.01)
    run = _write(tmp_path / "run.yaml", {**doc, "plan": {"num_gpus": 1, "num_stages": 2}})
    assert main(["--config", str(run)]) == 2
    line = _one_error_line(capsys.readouterr().err, "mobiuspipe.train")
    assert "memory.host_budget_mb: expected at least" in line and "rank 0: stages 0, 1" in line


def test_an_ssd_dir_that_is_a_file_is_refused_before_launch(tmp_path, capsys, no_launch):
    (tmp_path / "ssd").write_text("x")
    code, err = no_launch(capsys, _write(tmp_path / "run.yaml", _ssd_doc(tmp_path)))
    assert code == 2 and _one_error_line(err).startswith(
        f"mobiuspipe: error: memory.ssd_dir: expected a folder this process can create and write, found {tmp_path}/ssd"
    )


def _free(monkeypatch, free: int) -> None:
    """memory.ssd_dir's disk has `free` bytes free."""
    from mobiuspipe.run import room

    monkeypatch.setattr(room.shutil, "disk_usage", lambda path: SimpleNamespace(free=free))


def test_ssd_dir_needs_room_for_the_plans_states_and_an_earlier_runs_files_count_as_free(tmp_path, monkeypatch):
    from mobiuspipe.run import room

    cfg = load_config(_write(tmp_path / "run.yaml", _ssd_doc(tmp_path)))
    plan = preflight.plan_from_config(cfg)
    need = sum(12 * s.param_count for s in plan.stages)  # every stage's states on SSD, the weights in memory
    placed, problems = room.placements(cfg, plan)
    assert problems == [] and room.ssd_need(cfg, plan, placed, range(2)) == need
    _free(monkeypatch, need - 1)
    with pytest.raises(ConfigError, match=r"memory.ssd_dir: expected room for the .* ranks 0..1 keep there"):
        preflight.launch_checks(cfg, None)
    earlier = tmp_path / "ssd" / "rank1"
    earlier.mkdir(parents=True)
    (earlier / "old.bin").write_bytes(b"x" * 8192)  # an earlier run's store: discarded at start-up
    assert preflight.launch_checks(cfg, None)[0] == 2
    os.link(earlier / "old.bin", tmp_path / "checkpoint-link.bin")  # a checkpoint links it: it stays
    with pytest.raises(ConfigError, match="memory.ssd_dir: expected room"):
        preflight.launch_checks(cfg, None)


def test_the_speculative_updates_second_records_count_toward_the_room(tmp_path):
    """With clipping, each stage on SSD keeps a second set of its optimizer records (and with weights on SSD, of its
    weights) where the tentative updates write; without speculation it does not."""
    from mobiuspipe.run import room

    def need(**train) -> tuple[int, int]:
        doc = _ssd_doc(tmp_path, weights="ssd")
        doc["train"] = {**doc.get("train", {}), **train}
        cfg = load_config(_write(tmp_path / "run.yaml", doc))
        plan = preflight.plan_from_config(cfg)
        placed, _ = room.placements(cfg, plan)
        return room.ssd_need(cfg, plan, placed, range(2)), sum(s.param_count for s in plan.stages)

    plain, n = need()
    clipped, _ = need(max_grad_norm=1.0)
    held, _ = need(max_grad_norm=1.0, speculative_update=False)
    b = 4  # the test config's fp32
    assert plain == held == (12 + 2 * b) * n and clipped == plain + (12 + b) * n


def test_ssd_activations_count_toward_the_room(tmp_path):
    from mobiuspipe.run import room

    cfg = load_config(_write(tmp_path / "run.yaml", _run_doc(memory={"activation_tier": "ssd", "ssd_dir": "s"})))
    plan = preflight.plan_from_config(cfg)
    placed, _ = room.placements(cfg, plan)
    held = [s.held_bytes if s.held_bytes >= 0 else s.activation_bytes for s in plan.stages]
    assert room.ssd_need(cfg, plan, placed, range(2)) == plan.num_microbatches * sum(held) > 0


def test_a_frozen_base_on_ssd_counts_toward_the_room(tmp_path):
    from mobiuspipe.run import room

    doc = _run_doc(memory={"frozen": "ssd", "ssd_dir": "s"}, lora={"rank": 2})
    cfg = load_config(_write(tmp_path / "run.yaml", doc))
    plan = preflight.plan_from_config(cfg)
    placed, _ = room.placements(cfg, plan)
    assert room.ssd_need(cfg, plan, placed, range(2)) == sum(s.frozen_bytes for s in plan.stages) > 0


def test_the_host_memory_must_hold_what_the_ranks_keep_there(tmp_path, monkeypatch):
    """Before launch: the states, the frozen base and the saved activations the host's ranks hold in memory, against
    its MemAvailable; the error names each and what moves it out (here the frozen base, to the SSD)."""
    from mobiuspipe.run import room

    doc = _run_doc(lora={"rank": 2})
    cfg = load_config(_write(tmp_path / "run.yaml", doc))
    plan = preflight.plan_from_config(cfg)
    placed, _ = room.placements(cfg, plan)
    held = [room.host_bytes_of(cfg, plan, g, placed[g]) for g in range(plan.num_gpus)]
    frozen = sum(h["frozen"] for h in held)
    assert frozen == sum(s.frozen_bytes for s in plan.stages) > 0
    need = sum(sum(h.values()) for h in held)
    monkeypatch.setattr(room, "_mem_available", lambda: need)
    assert preflight.launch_checks(cfg, None)[0] == 2  # just fits
    monkeypatch.setattr(room, "_mem_available", lambda: need - 1)
    with pytest.raises(ConfigError, match=r"host memory: expected room for the .* that ranks 0..1 hold in this "
                       r"host.s memory \(states .*, frozen .*\), found .* available \(MemAvailable\); fix: "
                       r"`memory.frozen: ssd`"):  # fmt: skip
        preflight.launch_checks(cfg, None)
    ssd = _run_doc(lora={"rank": 2}, memory={"frozen": "ssd", "ssd_dir": "s"})
    cfg = load_config(_write(tmp_path / "ssd.yaml", ssd))
    monkeypatch.setattr(room, "_mem_available", lambda: 1 << 40)
    assert preflight.launch_checks(cfg, None)[0] == 2  # the base streams from the SSD through 4 MiB a stage
    streamed = sum(room.host_bytes_of(cfg, plan, g, placed[g])["frozen"] for g in range(plan.num_gpus))
    assert streamed == 4 * 2**20 * sum(1 for s in plan.stages if s.frozen_bytes)
