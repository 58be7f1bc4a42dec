"""A mistake only the ranks find at start-up (here: the checkpoint --resume auto picks, which `mobiuspipe train`
does not read) makes `mobiuspipe train` exit 2 with the mistake as its one error line, printed after torchrun has
stopped; with --max-restarts it stops torchrun instead of letting it fail the same way again. Other failures keep
torchrun's exit code."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from mobiuspipe.checkpoint import CheckpointError
from mobiuspipe.cli import main as cli
from mobiuspipe.cli import train as cli_train
from mobiuspipe.errors import ConfigError, PeerLostError
from mobiuspipe.run import preflight

RUN = {
    "model": {"num_blocks": 2, "d_model": 16, "num_heads": 2, "seq_len": 8},
    "data": {"batch_size": 4, "num_microbatches": 2},
    "train": {"steps": 2, "precision": "fp32", "tensorboard": False},
    "plan": {"num_gpus": 2, "num_stages": 4},
}


def _run(tmp_path: Path) -> Path:
    """A valid run config, out_dir tmp_path/out, whose newest checkpoint is of a 3-rank run."""
    doc = {**RUN, "train": {**RUN["train"], "out_dir": str(tmp_path / "out")}}
    step = tmp_path / "out" / "checkpoints" / "step-4"
    step.mkdir(parents=True)
    (step / "complete").write_text(json.dumps({"step": 4, "world_size": 3, "plan": {}, "files": {}}))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(doc))
    return tmp_path / "run.yaml"


def test_report_leaves_every_mistake_for_the_launcher_by_kind(tmp_path, monkeypatch, capsys):
    """Under `mobiuspipe train` (ERRORS_ENV) every rank writes its mistake and exits 2 at once, without a word;
    the launcher reads a start-up mistake first, then one found while the job ran, then a lost peer, each the
    lowest rank's. A restart stops only for a start-up mistake."""
    monkeypatch.setenv(preflight.ERRORS_ENV, str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "1")  # would wait QUIET_WAIT_S for torchrun's SIGTERM without the folder
    monkeypatch.setenv("RANK", "0")
    lost = PeerLostError("rank 1 stopped answering")  # while resuming: not a mistake of the checkpoint's
    with pytest.raises(PeerLostError), preflight.at_start_up(CheckpointError):
        raise lost
    assert preflight.report(lost, "p") == 2
    assert preflight.lost_peer(tmp_path) == str(lost) and preflight.rank_mistake(tmp_path) is None
    monkeypatch.setenv("RANK", "2")
    assert preflight.report(ConfigError("later"), "p") == 2  # found while the job ran
    assert preflight.rank_mistake(tmp_path) == "later" and preflight.start_up_error(tmp_path) is None
    for rank, what in ((3, "x: three"), (1, "x: one")):
        monkeypatch.setenv("RANK", str(rank))
        error = ConfigError(what)
        with pytest.raises(ConfigError), preflight.at_start_up():
            raise error
        t0 = time.monotonic()
        assert preflight.report(error, "p") == 2 and time.monotonic() - t0 < 1
    assert capsys.readouterr().err == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.peer", "rank1", "rank2.run", "rank3"]
    assert preflight.start_up_error(tmp_path) == preflight.rank_mistake(tmp_path) == "x: one"
    assert preflight.start_up_error(tmp_path / "none") is None
    monkeypatch.delenv(preflight.ERRORS_ENV)  # plain torchrun: the rank prints it
    assert preflight.report(ConfigError("later"), "p") == 2 and capsys.readouterr().err == "p: error: later\n"


@pytest.mark.parametrize(
    "script,restarts,code,line",
    [
        ("sys.exit(1)", 0, 1, ""),  # a failure that is not a start-up mistake: torchrun's code, no line
        ("leave(); sys.exit(1)", 0, 2, "mobiuspipe: error: x: the mistake\n"),
        ("leave(); time.sleep(60)", 2, 2, "mobiuspipe: error: x: the mistake\n"),  # restarting: stopped at once
    ],
)
def test_the_launcher_turns_a_ranks_start_up_mistake_into_exit_2(
    tmp_path, monkeypatch, capfd, script, restarts, code, line
):
    """torchrun replaced by a script: it fails, with or without leaving a mistake as a rank does."""
    leave = f"open(os.path.join(os.environ[{preflight.ERRORS_ENV!r}], 'rank0'), 'w').write('x: the mistake')"
    body = f"import os, sys, time; leave = lambda: {leave}; {script}"  # one line, as the launch line shows it
    monkeypatch.setattr(cli_train, "torchrun_command", lambda *args, **kw: [sys.executable, "-c", body])
    config = _run(tmp_path)
    args = ["train", "--config", str(config), "--resume", "auto"]  # which checkpoint: the ranks' to find
    args += ["--max-restarts", str(restarts)] if restarts else []
    t0 = time.monotonic()
    assert cli(args) == code
    assert time.monotonic() - t0 < 20
    err = capfd.readouterr().err
    assert err.startswith("mobiuspipe: launching ") and err.partition("\n")[2] == line, err


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("restarts", [0, 2])
def test_train_exits_2_on_a_mistake_only_the_ranks_find(tmp_path, restarts):
    cmd = [sys.executable, "-m", "mobiuspipe", "train", "--config", str(_run(tmp_path)), "--resume", "auto"]
    cmd += ["--max-restarts", str(restarts)] if restarts else []
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    folder = tmp_path / "out" / "checkpoints" / "step-4"
    want = f"mobiuspipe: error: checkpoint {folder} was written by 3 ranks, this run has 2; launch 3 ranks (its "
    assert len(errors) == 1 and errors[0].startswith(want) and out.stderr.endswith(errors[0] + "\n"), out.stderr
    assert out.stdout.count("mobiuspipe: gpt-") == 1  # the ranks' banner: one attempt, no restart
