"""A rank SIGKILLed in the middle of a run under torchrun --max-restarts 1 restarts the job, which resumes from
the newest checkpoint (train.resume auto): the losses of every step and the final weights equal those of the
uninterrupted run bit for bit, in fp32 and in bf16; SIGTERM checkpoints and stops a run that --resume
finishes the same way."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

STEPS = 10


def _config(tmp_path: Path, name: str, precision: str, write_config, ssd: bool = False) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    # ssd: every state in each rank's SSD store, whose files the checkpoints hard-link; a restarted job finds
    # the killed attempt's store and starts it afresh from the checkpoint
    memory = {"optimizer": "ssd", "weights": "ssd", "ssd_dir": str(folder / "ssd"), "host_budget_mb": 1.0}
    return write_config(
        folder,
        {
            **({"memory": memory} if ssd else {}),
            "model": {"num_blocks": 4, "d_model": 32, "num_heads": 4, "seq_len": 32},
            "data": {"batch_size": 4, "num_microbatches": 2},
            "train": {
                "steps": STEPS,
                "lr": 0.01,
                "lr_schedule": "cosine",
                "seed": 3,
                "precision": precision,
                "out_dir": str(folder / "out"),
                "checkpoint_every": 3,
                "tensorboard": False,
            },
            "plan": {"num_gpus": 2, "num_stages": 4},
        },
    )


def _launch(cfg: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *extra]
    cmd += ["-m", "mobiuspipe.train", "--config", str(cfg), "--resume", "auto"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def _worker(agent: int, local_rank: int) -> int:
    """The pid of the agent's worker of that local rank (its child with LOCAL_RANK in its environment)."""
    for pid in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if pid.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == agent:
            if f"LOCAL_RANK={local_rank}".encode() in environ:
                return int(pid)
    raise AssertionError(f"no worker of local rank {local_rank} under torchrun {agent}")


def _wait_for(proc: subprocess.Popen, out: Path, records: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len([r for r in _records(out) if r["kind"] == "train"]) < records:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.05)


def _result(out: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses = [r["loss"] for r in _records(out) if r["kind"] == "train"]
    weights = {}
    for f in sorted((out / "weights").glob("stage*.pt")):
        weights.update(torch.load(f))
    return losses, weights


def _same(a, b) -> None:
    assert a[0] == b[0] and len(a[0]) == STEPS
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k


@pytest.fixture(scope="module")
def whole(tmp_path_factory, launch) -> Path:
    """The config of the uninterrupted fp32 run in host memory, run once: the reference of the tests below."""
    write_config, torchrun = launch
    cfg = _config(tmp_path_factory.mktemp("whole"), "whole", "fp32", write_config)
    proc = torchrun(cfg, 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return cfg


@pytest.mark.parametrize("precision,ssd", [("fp32", False), ("bf16", True)])
def test_a_killed_rank_restarts_and_resumes_bit_identically(tmp_path, launch, whole, precision, ssd):
    write_config, torchrun = launch
    if (precision, ssd) != ("fp32", False):
        whole = _config(tmp_path, "whole", precision, write_config, ssd)
        proc = torchrun(whole, 2)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    cut = _config(tmp_path, "cut", precision, write_config, ssd)
    out = cut.parent / "out"
    job = _launch(cut, "--max-restarts", "1")
    try:
        _wait_for(job, out, 5)  # past the checkpoint of step 3
        os.kill(_worker(job.pid, 1), signal.SIGKILL)
        log = job.communicate(timeout=240)[0]
    finally:
        job.kill()
    assert job.returncode == 0, log[-3000:]
    assert "resumed from" in log and "checkpoints/step-" in log, log[-3000:]
    assert "torchrun started the ranks again after a rank failed (restart 1 of at most 1" in log, log[-3000:]
    _same(_result(out), _result(whole.parent / "out"))


def test_sigterm_checkpoints_and_stops_then_resume_finishes(tmp_path, launch, whole):
    write_config, _ = launch
    cut = _config(tmp_path, "cut", "fp32", write_config)
    out = cut.parent / "out"
    job = _launch(cut)
    try:
        _wait_for(job, out, 4)
        for rank in (0, 1):  # as a scheduler's preemption does: every process gets SIGTERM
            os.kill(_worker(job.pid, rank), signal.SIGTERM)
        log = job.communicate(timeout=120)[0]
    finally:
        job.kill()
    assert "mobiuspipe: stopped by SIGTERM after step" in log and "continue with --resume auto" in log, log[-3000:]
    done = len(_records(out))
    assert 4 <= done < STEPS and (out / "checkpoints" / f"step-{done}" / "complete").is_file()
    assert not (out / "weights").exists()  # a stopped run writes no final weights
    again = _launch(cut)
    log = again.communicate(timeout=120)[0]
    assert again.returncode == 0 and f"resumed from {out / 'checkpoints' / f'step-{done}'} at step {done}" in log
    _same(_result(out), _result(whole.parent / "out"))


def test_a_damaged_checkpoint_of_one_rank_is_passed_over_by_every_rank(tmp_path, launch, whole):
    """Rank 1's file of the newest checkpoint cut short: both ranks agree to resume from the one before it, rank 0
    sets the damaged one aside, and the run ends as the uninterrupted one did, bit for bit."""
    write_config, _ = launch
    cut = _config(tmp_path, "cut", "fp32", write_config)
    shutil.copytree(whole.parent / "out", cut.parent / "out")  # the run, finished with its checkpoints
    root = cut.parent / "out" / "checkpoints"
    newest = max((p for p in root.iterdir() if p.name.startswith("step-")), key=lambda p: int(p.name[5:]))
    f = newest / "rank1.safetensors"
    f.write_bytes(f.read_bytes()[:-9])
    job = _launch(cut)
    try:
        log = job.communicate(timeout=240)[0]
    finally:
        job.kill()
    assert job.returncode == 0, log[-3000:]
    assert f"checkpoint {newest} is damaged, set aside as {root / ('.damaged-' + newest.name)}" in log, log[-3000:]
    assert "rank 1: checkpoint" in log and "rank1.safetensors is corrupted" in log
    assert (root / f".damaged-{newest.name}" / "rank1.safetensors").is_file()
    _same(_result(cut.parent / "out"), _result(whole.parent / "out"))
