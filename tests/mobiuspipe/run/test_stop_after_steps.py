"""A stop signal (a scheduler's SIGTERM, Ctrl-C) that comes once every step has run, while the run writes its
final weights and export, must not kill the rank halfway: the outputs are the run's result, and with the default
checkpoint_every 0 there is no checkpoint to resume from (a --resume auto would train the whole run again)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

_RANK = """
import os, signal, sys
from mobiuspipe.run import train

save = train._save_weights

def stopped_while_saving(pipe, folder):
    os.kill(os.getpid(), signal.{sig})  # the stop comes as the final weights are written
    save(pipe, folder)

train._save_weights = stopped_while_saving
sys.exit(train.main(["--config", sys.argv[1]]))
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_stop_after_the_last_step_lets_the_final_weights_be_written(tmp_path: Path, sig: str):
    out = tmp_path / "out"
    doc = {
        "model": {"num_blocks": 2, "d_model": 32, "num_heads": 4, "seq_len": 16},
        "data": {"batch_size": 2, "num_microbatches": 2},
        "train": {"steps": 2, "precision": "fp32", "out_dir": str(out), "tensorboard": False},
        "plan": {"num_gpus": 1, "num_stages": 2},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(doc))
    script = textwrap.dedent(_RANK).replace("{sig}", sig)
    cmd = [sys.executable, "-c", script, str(tmp_path / "run.yaml")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, f"{signal.Signals[sig].name}: {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr}"
    assert sorted(p.name for p in (out / "weights").iterdir()) == ["stage0.pt", "stage1.pt"]
    assert f"mobiuspipe: {sig} came after the last step: the final weights were written first" in proc.stdout
