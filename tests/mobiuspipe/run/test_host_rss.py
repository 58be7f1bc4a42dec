"""Host memory stays within the budget: a run whose fp32 states are six times a rank's host budget trains with
its states on SSD, and its largest rank's peak RSS exceeds the budget and the stand-in's device (the plan's walk:
the arena and the activations beside it, host memory on a CPU stand-in) by no more than a run of a model of a
few thousand parameters takes in all (the interpreter, torch, gloo), plus room for one stage's build-time copies
(scripts/check_rss.py measures both)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
MiB = 1 << 20


@pytest.mark.slow
def test_peak_rss_is_the_budget_plus_a_fixed_overhead(tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts" / "check_rss.py"), "--d-model", "256", "--blocks", "8"]
    cmd += ["--budget-mb", "8", "--stages", "8", "--device-mb", "64", "--steps", "2", "--baseline", "--json"]
    cmd += ["--ssd-root", str(tmp_path), "--timeout", "240"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads(out.stdout.splitlines()[-1])
    run, base = r["run"], r["baseline"]
    assert run["fp32_state_bytes"] / 2 > 6 * run["budget_bytes"]  # each rank's states: over 6x its budget
    assert "weights (auto): ssd for stages" in run["placement"]
    stage_build = 3 * 4 * run["params"] / 8  # a stage's fp32 layers, flat copy and device-dtype copy
    fixed = base["peak_rss_bytes"] - base["device_bytes"]  # its states: a few KiB
    # the stand-in's device (the plan's walk: the arena, and the activations the plan keeps beside it) is host memory
    assert run["peak_rss_bytes"] <= run["budget_bytes"] + run["device_bytes"] + fixed + stage_build + 8 * MiB
