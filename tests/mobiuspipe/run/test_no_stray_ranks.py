"""No stray ranks (mobiuspipe.run.parent_death): a `mobiuspipe train` killed with SIGKILL mid-run takes torchrun and
every rank with it; nothing of the job is alive 10 s later and nothing in out_dir changes after that, so a restart
finds the folder free and unwritten-to."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

RUN = {
    "model": {"num_blocks": 2, "d_model": 16, "num_heads": 2, "seq_len": 8},
    "data": {"batch_size": 4, "num_microbatches": 2},
    "train": {"steps": 100000, "precision": "fp32", "tensorboard": False, "log_every": 1},
    "plan": {"num_gpus": 2, "num_stages": 4},
}


def _alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state != "Z":  # a zombie has ended; it only waits for its parent to read its status
            out.add(pid)
    return out


def _descendants(pid: int) -> set[int]:
    """Every process under pid (from /proc: children files list each thread's children)."""
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            kids = (task / "children").read_text().split() if (task / "children").exists() else []
            for k in map(int, kids):
                if k not in found:
                    found.add(k)
                    todo.append(k)
    return found


def _sums(folder: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_sigkilled_launcher_leaves_no_rank_and_no_more_writes(tmp_path):
    out = tmp_path / "out"
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({**RUN, "train": {**RUN["train"], "out_dir": str(out)}}))
    cmd = [sys.executable, "-m", "mobiuspipe", "train", "--config", str(cfg)]
    launcher = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    job: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 3):
            assert time.monotonic() < deadline and launcher.poll() is None, "the run did not start"
            time.sleep(0.2)
        job = _descendants(launcher.pid)
        assert len(job) >= 3  # torchrun and its two ranks
        launcher.kill()  # SIGKILL to the launcher alone: torchrun and the ranks are not signalled by anyone
        launcher.wait(timeout=10)
        time.sleep(10)
        assert _alive(job) == set()
        before = _sums(out)
        time.sleep(3)
        assert _sums(out) == before
    finally:
        for pid in _alive(job):
            os.kill(pid, signal.SIGKILL)
        os.killpg(launcher.pid, signal.SIGKILL) if launcher.poll() is None else None


def test_the_parent_death_signal_is_in_place_for_a_child(tmp_path):
    """A child that asks for it dies when its parent does (a grandchild outliving a killed middle process)."""
    code = (
        "import os, subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import os, time, sys; "
        "from mobiuspipe.run.parent_death import die_with_parent; "
        "die_with_parent(os.getppid()); print(os.getpid(), flush=True); time.sleep(60)'], stdout=subprocess.PIPE, "
        "text=True)\n"
        "print(p.stdout.readline().strip(), flush=True)\n"
        "time.sleep(60)\n"
    )
    middle = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert middle.stdout is not None
    child = int(middle.stdout.readline())
    middle.kill()
    middle.wait(timeout=10)
    deadline = time.monotonic() + 10
    while _alive({child}) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _alive({child}) == set()
