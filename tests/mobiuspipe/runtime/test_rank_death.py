"""A rank that dies mid-run, or hangs (stopped, alive): the survivor stops within the communication timeout,
naming the lost rank, instead of hanging. Rank 0 hosts the job's store when no torchrun agent does: stopped, it
answers no beat, and rank 1 names the store."""

from __future__ import annotations

import signal
import sys
import time

import pytest

pytestmark = pytest.mark.slow


def _train(config) -> list[str]:
    return [sys.executable, "-m", "mobiuspipe.train", "--config", str(config)]


@pytest.mark.parametrize(
    "how,timeout,lost,strict",
    [
        (signal.SIGKILL, 20, 1, "1"),
        (signal.SIGSTOP, 5, 1, "1"),
        (signal.SIGSTOP, 5, 0, "1"),
        (signal.SIGSTOP, 5, 1, "0"),
    ],
)
def test_survivor_names_the_dead_or_hung_rank(tmp_path, launch, by_hand, monkeypatch, how, timeout, lost, strict):
    monkeypatch.setenv("MOBIUSPIPE_STRICT", strict)  # "0": the lax stand-in, whose receives are gloo's own
    write_config, _ = launch
    free_port, spawn_rank = by_hand
    cfg = write_config(tmp_path, {"train": {"steps": 100000}, "runtime": {"comm_timeout_s": timeout}})
    port = free_port()
    r0, r1 = spawn_rank(_train(cfg), 0, 2, port), spawn_rank(_train(cfg), 1, 2, port)
    try:
        stdout0, stderr0 = r0.stdout, r0.stderr
        assert stdout0 is not None and stderr0 is not None  # both are PIPEs
        banner = stdout0.readline()
        assert banner.startswith("mobiuspipe: gpt-6x64"), banner + stderr0.read()
        first = stdout0.readline()  # rank 0 has finished one step: both ranks are mid-run
        assert first.startswith("step 0 [1/"), first + stderr0.read()
        (r0, r1)[lost].send_signal(how)
        t0 = time.monotonic()
        survivor = (r0, r1)[1 - lost]
        _, err = survivor.communicate(timeout=60)
        waited = time.monotonic() - t0
    finally:
        for p in (r0, r1):
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()
    assert survivor.returncode == 2, err[-2000:]
    assert waited < timeout + 10, err[-3000:]
    line = [x for x in err.splitlines() if x.startswith("mobiuspipe.train: error:")]
    assert line and line[0].startswith(f"mobiuspipe.train: error: rank {1 - lost}: "), err[-2000:]
    names = ("the job's store has not answered", "rank 0 has") if lost == 0 else ("rank 1", "another rank")
    assert any(n in line[0] for n in names), line[0]


def test_ranks_with_different_plans_stop_before_work(tmp_path, by_hand):
    free_port, spawn_rank = by_hand
    port = free_port()
    procs = []
    for rank, stages in ((0, 4), (1, 3)):
        cfg = tmp_path / f"r{rank}.yaml"
        cfg.write_text(f"plan: {{num_stages: {stages}}}\ntrain: {{steps: 1, out_dir: {tmp_path / 'out'}}}\n")
        procs.append(spawn_rank(_train(cfg), rank, 2, port))
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 2 and "follow a different plan than rank 0" in err, err[-2000:]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
