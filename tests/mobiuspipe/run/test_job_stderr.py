"""What `mobiuspipe train` shows of its job's stderr: every line until a rank's mistake (or an interrupt) explains
the failure, then only its own lines and the mistake last; a failure nothing explains shows every line."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from mobiuspipe.run.job_stderr import JobStderr


def _pump(lines: list[bytes], explained_after: int | None) -> tuple[JobStderr, io.BytesIO]:
    """A JobStderr over a pipe carrying `lines`; a mistake 'appears' once explained_after lines have been read."""
    read, write = os.pipe()
    seen = []
    out = io.BytesIO()
    pump = JobStderr(os.fdopen(read, "rb"), out, lambda: explained_after is not None and len(seen) > explained_after)
    with os.fdopen(write, "wb") as w:
        for line in lines:
            seen.append(line)
            w.write(line)
            w.flush()
            time.sleep(0.01)
    return pump, out


LINES = [b"step 0\n", b"mobiuspipe: a note\n", b"Traceback (most recent call last):\n", b"RuntimeError: gloo\n"]


def test_lines_after_an_explained_failure_are_dropped_but_mobiuspipes_own():
    pump, out = _pump(LINES, explained_after=1)
    pump.finish(quiet=True)
    assert out.getvalue() == b"step 0\nmobiuspipe: a note\n"


def test_a_failure_nothing_explains_shows_every_line():
    pump, out = _pump(LINES, explained_after=1)
    pump.finish(quiet=False)
    assert out.getvalue() == b"".join(LINES)
    pump, out = _pump(LINES, explained_after=None)
    pump.finish(quiet=True)  # nothing was held
    assert out.getvalue() == b"".join(LINES)


def test_a_long_traceback_watched_for_signals_reaches_the_terminal_whole():
    """With a signal pipe watched (as `mobiuspipe train` does), a burst of 400 lines with no signal comes out whole
    once the job ends: only the burst's first line waits for a signal, not each line."""
    read, write = os.pipe()
    wake_read, wake_write = os.pipe()
    out = io.BytesIO()
    pump = JobStderr(os.fdopen(read, "rb"), out, lambda: False)
    pump.watch(wake_read, (signal.SIGINT,))
    lines = [f"  File x.py, line {i}\n".encode() for i in range(400)]
    with os.fdopen(write, "wb") as w:
        w.write(b"".join(lines))
    pump.finish(quiet=False)
    os.close(wake_write)
    assert out.getvalue() == b"".join(lines)


def test_a_line_that_reports_a_signal_waits_for_it_within_a_burst():
    """Under load the launcher can run after its job has reacted to the same Ctrl-C: a rank's "Fatal Python error"
    (interrupted while importing), torchrun's "Received 2 death signal", a KeyboardInterrupt. Such a line waits for
    the signal (its wakeup byte here 0.2 s late) even inside a burst, so it and what follows are held."""
    read, write = os.pipe()
    wake_read, wake_write = os.pipe()
    out = io.BytesIO()
    pump = JobStderr(os.fdopen(read, "rb"), out, lambda: False)
    pump.watch(wake_read, (signal.SIGINT,))
    late = threading.Timer(0.3, lambda: os.write(wake_write, bytes([signal.SIGINT])))
    with os.fdopen(write, "wb") as w:
        w.write(b"step 0\n")  # after a quiet spell: waits GRACE_S, nothing comes
        w.flush()
        time.sleep(0.1)  # the lines below are a burst
        late.start()
        w.write(b"Fatal Python error: init_import_site: Failed to import the site module\nKeyboardInterrupt\n")
    late.join()
    pump.finish(quiet=True)
    os.close(wake_write)
    assert out.getvalue() == b"step 0\n"


RUN = {
    "model": {"num_blocks": 2, "d_model": 16, "num_heads": 2, "seq_len": 8},
    "data": {"batch_size": 4, "num_microbatches": 2},
    "train": {"steps": 400, "precision": "fp32", "tensorboard": False},
    "plan": {"num_gpus": 2, "num_stages": 4},
}
FAILING_RANK = """
import os
if os.environ.get("RANK") == "1":
    import mobiuspipe.run.train as t
    from mobiuspipe.errors import SwapIOError

    def full(*args, **kwargs):
        raise SwapIOError("the SSD store is full: free space there")

    t._training_loop = full
"""


def _launch(tmp_path: Path, **popen) -> subprocess.Popen:
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(RUN))
    cmd = [sys.executable, "-m", "mobiuspipe", "train", "--config", str(tmp_path / "run.yaml")]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_mistake_one_rank_finds_while_running_is_the_last_line_and_exit_2(tmp_path):
    """Rank 1 fails after the group exists (as a full disk would); rank 0 loses its peer: one line says why."""
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(FAILING_RANK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "inject"), *sys.path])}
    job = _launch(tmp_path, env=env)
    out, err = job.communicate(timeout=120)
    assert job.returncode == 2, err[-3000:]
    assert err.endswith("mobiuspipe: error: the SSD store is full: free space there\n"), err[-3000:]
    assert "Traceback" not in err and "gloo" not in err and "FAILED" not in err, err[-3000:]
    assert len(err.splitlines()) < 10, err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_ctrl_c_at_any_moment_of_torchruns_start_stops_the_job(tmp_path):
    """A SIGINT that reaches torchrun while it imports torch (its first second or so) was now and then swallowed by
    the import, and the job ran to its end (measured: 2 to 4 of 58 signals lost, on torch 2.11 and 2.13): the
    launcher sends torchrun a SIGTERM until torchrun has its own handlers in place."""
    lost = []
    for delay in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 1.0, 1.2):
        job = _launch(tmp_path)
        assert job.stderr is not None
        assert job.stderr.readline().startswith("mobiuspipe: launching")
        time.sleep(delay)
        os.kill(job.pid, signal.SIGINT)
        _, err = job.communicate(timeout=120)
        if job.returncode != 128 + signal.SIGINT or not err.endswith("torchrun and the ranks have ended\n"):
            lost.append((delay, job.returncode, err[-120:]))
    assert [(d, code) for d, code, _ in lost] == [], lost


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_torchruns_process_takes_sigint_where_the_launcher_ignored_it():
    """What the Ctrl-C test's ignored case needs, without its timing: the process the launcher starts for torchrun
    (launched_child, before its exec) has SIGINT's default, as a terminal's foreground job."""
    from mobiuspipe.run.parent_death import launched_child

    me = os.getpid()
    look = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"

    def child(setup) -> str:
        return subprocess.run([sys.executable, "-c", look], preexec_fn=setup, capture_output=True, text=True).stdout

    assert child(_ignore_sigint) == "False\n"  # what a command run with & inherits
    assert child(lambda: (_ignore_sigint(), launched_child(me))) == "True\n"


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "ignored, to, signum",
    [
        (False, "group", signal.SIGINT),
        (True, "group", signal.SIGINT),
        (True, "launcher", signal.SIGINT),
        (False, "launcher", signal.SIGTERM),
    ],
)
def test_ctrl_c_during_start_up_ends_the_job_with_one_line(tmp_path, ignored, to, signum):
    """Also when `mobiuspipe train` starts with SIGINT ignored, as a non-interactive shell starts a command run with
    `&`: the launcher takes Ctrl-C, so its job must too. `to`: the signal goes to the launcher's process group, as a
    terminal's Ctrl-C does, or to the launcher alone (`kill -INT PID`, a script's way); a SIGTERM ends the job the
    same way, exit 143."""
    popen = {"preexec_fn": _ignore_sigint} if ignored else {}
    job = _launch(tmp_path, start_new_session=True, **popen)  # its own group, as a terminal's foreground job
    assert job.stderr is not None
    assert job.stderr.readline().startswith("mobiuspipe: launching")
    # torchrun and the ranks are starting: importing torch, building the plan (not in torchrun's first 0.3 s, when
    # now and then its import swallows a SIGINT's KeyboardInterrupt and the job runs on: measured here)
    time.sleep(1.5)
    if to == "group":
        os.killpg(job.pid, signum)
    else:
        os.kill(job.pid, signum)
    out, err = job.communicate(timeout=120)
    assert job.returncode == 128 + signum, err[-3000:]
    name = "Ctrl-C (SIGINT)" if signum == signal.SIGINT else "SIGTERM"
    assert err.endswith(f"mobiuspipe: stopped by {name}; torchrun and the ranks have ended\n"), err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
