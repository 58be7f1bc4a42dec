"""Step reporting: terminal bar vs plain lines, and metrics.jsonl."""

from __future__ import annotations

import io
import json

from mobiuspipe.run.metrics import Reporter, StepMetrics


def _m(step: int) -> StepMetrics:
    return StepMetrics(step, 2.5, 1000.0, 0.25, 0.1, 0.05, 0.02, 3 * 2**20, 4 * 2**20)


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
