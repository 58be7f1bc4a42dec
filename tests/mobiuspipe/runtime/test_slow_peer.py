"""A live rank that is busy longer than runtime.comm_timeout_s (a checkpoint's write, SSD states' set-up, a long
stage) is slow, not lost: its peers wait for it; only a rank that gives no sign of life for that long is lost
(test_rank_death.py). On the strict stand-in and on the lax one (MOBIUSPIPE_STRICT=0, a CPU user's), whose
receives are gloo's own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("slow_peer_worker.py")


def _ranks(by_hand, stall_s: float, comm_timeout_s: float) -> list[subprocess.CompletedProcess]:
    free_port, spawn_rank = by_hand
    port = free_port()
    cmd = [sys.executable, str(WORKER), str(stall_s), str(comm_timeout_s)]
    procs = [spawn_rank(cmd, rank, 2, port) for rank in (0, 1)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [subprocess.CompletedProcess(p.args, p.returncode, o, e) for p, (o, e) in zip(procs, outs)]


@pytest.mark.parametrize("strict", ["1", "0"])
def test_a_busy_peer_is_waited_for(by_hand, monkeypatch, strict):
    monkeypatch.setenv("MOBIUSPIPE_STRICT", strict)  # the ranks inherit it
    stall_s, timeout_s = 6.0, 2.0
    ranks = _ranks(by_hand, stall_s, timeout_s)
    for r in ranks:
        assert r.returncode == 0, r.stderr[-3000:]
    lines = [r.stdout.splitlines() for r in ranks]
    assert [len(x) for x in lines] == [3, 3]
    losses = [[line.split(" took ")[0].split(" loss ")[1] for line in x] for x in lines]
    assert losses[0] == losses[1]  # every rank reports the step's loss
    took = [float(x[1].split(" took ")[1].split()[0]) for x in lines]
    assert min(took) >= stall_s - 1  # step 1 waited for the stalled rank
