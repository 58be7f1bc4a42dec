"""Step reporting: terminal bar vs plain lines, and metrics.jsonl."""

from __future__ import annotations

import io
import json
import subprocess
import sys

from mobiuspipe.run.metrics import Reporter, StepMetrics
from mobiuspipe.runtime.compute import StepTimes
from mobiuspipe.step_result import StepResult


def _m(step: int) -> StepMetrics:
    times = StepTimes(compute_s=0.1, load_s=0.05, comm_s=0.02)
    r = StepResult(step=step, loss=2.5, times=times, arena_peak_bytes=3 * 2**20, arena_budget_bytes=4 * 2**20)
    return StepMetrics(r, tokens_per_s=1000.0, step_s=0.25)


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_when_not_a_terminal(tmp_path):
    out = io.StringIO()
    r = Reporter(steps=4, log_every=2, out_dir=str(tmp_path), stream=out)
    for s in range(4):
        r(_m(s))
    r.close()
    lines = out.getvalue().splitlines()
    assert [x.split()[:3] for x in lines] == [["step", "1", "[2/4]"], ["step", "3", "[4/4]"]]  # record step, count
    assert "loss 2.5000" in lines[0] and "tok/s" in lines[0] and "arena peak 3.00 of 4.00 MiB" in lines[0]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[0]["compute_s"] == 0.1
    assert rows[0]["device_peak_bytes"] == 0  # a field of its own (the default when not measured)


def test_bar_on_a_terminal():
    out = _Tty()
    r = Reporter(steps=2, log_every=1, out_dir=None, stream=out)
    r(_m(0))
    r(_m(1))
    text = out.getvalue()
    assert text.startswith("\r[###############...............] step 0 [1/2]")
    assert text.endswith("\n") and text.count("\n") == 1


def test_a_record_has_the_step_results_figures_then_the_runs(tmp_path):
    """metrics.jsonl's keys (docs/worked-example.md shows a record): StepMetrics derives them from StepResult."""
    with Reporter(steps=1, log_every=1, out_dir=str(tmp_path), stream=None) as r:
        r(_m(0))
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert list(row) == [
        "kind", "step", "loss", "tokens_per_s", "step_s", "compute_s", "load_s", "comm_s", "arena_peak_bytes",
        "arena_budget_bytes", "loss_scale", "skipped", "device_peak_bytes", "lr", "ranks", "flops_per_step",
        "tflops", "mfu", "host_rss_bytes", "ssd_bytes", "grad_norm", "updates_rolled_back", "checkpoint_s", "eta_s",
    ]  # fmt: skip
    assert (row["loss"], row["comm_s"], row["arena_budget_bytes"]) == (2.5, 0.02, 4 * 2**20)


def test_a_resume_that_cannot_write_keeps_the_records(tmp_path):
    """A resumed run rewrites metrics.jsonl without its later steps' records. Where that write fails (the disk full,
    here a file-size limit the rewrite passes), the earlier records are all still there, and the run stops with the
    error: the file is replaced whole or not at all."""
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"kind": "train", "step": s, "loss": 1.0 + s, "pad": "x" * 200}) + "\n" for s in range(400)]
    path.write_text("".join(lines))
    limit = len("".join(lines[:300])) // 2  # the rewrite keeps 300 records: it stops halfway
    child = (
        "import resource, signal, sys\n"
        "from pathlib import Path\n"
        "from mobiuspipe.run.metrics import _open_records\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
        "try:\n"
        f"    _open_records(Path({str(path)!r}), 300)\n"
        "except OSError as e:\n"
        "    sys.exit(f'refused: {e}')\n"
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "refused" in done.stderr, done.stderr
    assert path.read_text() == "".join(lines)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # nothing half-written left beside it
