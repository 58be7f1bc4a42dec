"""scripts/gpu_check.sh on a CPU-only machine: every check runs on the strict stand-ins and passes, so the script
that proves the CUDA paths on a GPU stays working."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_passes_on_the_strict_stand_ins(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh"), "--out", str(out)], capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    checks = {r["check"]: r for r in report["rows"]}
    assert report["failed"] == [] and not [r for r in report["rows"] if r["ok"] is False]
    for precision in ("fp32", "bf16"):
        assert checks[f"{precision} pipeline vs plain PyTorch"]["figure"] == "bit-identical"
        for policy in ("recompute", "keep"):
            for tier in ("device", "host", "ssd"):
                if (policy, tier) != ("recompute", "device"):
                    assert checks[f"{precision} {policy} on {tier}"]["ok"] is True
    assert checks["fp32 accumulation 2 vs plain PyTorch"]["ok"] and checks["fp16 skipped step leaves the weights"]["ok"]
    assert checks["peak at or below the plan"]["ok"] and checks["2 ranks [0,1,0,1], peer tier, P2P off"]["ok"]
    assert checks["each action within the plan at it"]["ok"] is True
    assert checks["a stopped rank is named"]["ok"] is True
    assert checks["LoRA, int8 base, vs plain PyTorch"]["ok"] and checks["LoRA, nf4 base, vs plain PyTorch"]["ok"]
    assert checks["LoRA, nf4 base, states on the gpu, vs plain PyTorch"]["ok"]
    assert all(checks[f"HF {m} {p}: kept within the count"]["ok"] for m in ("gpt2", "llama") for p in ("bf16", "fp32"))
    assert (
        checks["fp32 clipped: speculated updates = waiting ones"]["ok"]
        and checks["fp32 clipped vs plain PyTorch"]["figure"] == "bit-identical"
    )
    for precision in ("fp32", "bf16"):
        assert checks[f"{precision} delayed update vs plain PyTorch"]["figure"] == "bit-identical"
        assert checks[f"{precision} delayed update, on SSD"]["ok"]
    assert "checks pass" in proc.stdout.splitlines()[-1]


def _script(name: str):
    """scripts/NAME.py as a module (the scripts import each other from their folder)."""
    import importlib
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    return importlib.import_module(name)


def test_a_gpu_this_torch_cannot_use_fails_the_check_instead_of_running_the_stand_ins(monkeypatch):
    gc = _script("gpu_check")
    driver = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06"
    assert gc.unusable_gpu(None, False) is None  # no GPU here: the stand-ins
    assert gc.unusable_gpu(driver, True) is None  # a GPU torch can use
    monkeypatch.setattr(gc.torch.version, "cuda", None)
    assert "is a CPU build: install the CUDA build" in str(gc.unusable_gpu(driver, False))
    monkeypatch.setattr(gc.torch.version, "cuda", "13.0")
    assert "finds no usable GPU: a driver older than its CUDA needs" in str(gc.unusable_gpu(driver, False))


def test_the_gpu_tests_row_names_the_tests_that_failed():
    out = (
        "....F.\n=========================== short test summary info ============================\n"
        "FAILED tests/mobiuspipe/memory/test_pinned.py::test_cuda_pins_a_buffer - assert (False)\n"
        "ERROR tests/topology/test_probe.py::test_probe_rate[bf16]\n2 failed, 12 passed in 17.54s\n"
    )
    assert _script("gpu_tests").failed_tests(out) == ["test_cuda_pins_a_buffer", "test_probe_rate[bf16]"]
    assert _script("gpu_tests").failed_tests("14 passed in 17.54s") == []


def test_the_count_leaves_the_information_rows_out():
    rows = [{"ok": True}, {"ok": True}, {"ok": False}, {"ok": None}]
    assert _script("gpu_table").tally(rows) == "2 of 3 checks pass, 1 row information only"


def test_a_section_past_the_time_limit_is_skipped_with_a_row(tmp_path, monkeypatch):
    """A GPU is lent for minutes: a section that would start past gpu_check's time limit says it was skipped (the
    run's table and JSON then show what did not run), and what a section may wait is what is left."""
    gpu_table = _script("gpu_table")
    clock = [100.0]
    monkeypatch.setattr(gpu_table.time, "monotonic", lambda: clock[0])
    t = gpu_table.Table(tmp_path / "g.json", {}, time_limit_s=60)
    assert t.left() == 60 and t.left(45) == 45
    assert t.guarded("first", lambda: 7) == 7
    clock[0] += 45  # 15 s left: less than a section needs to start
    ran = []
    assert t.guarded("second", ran.append, 1) is None and ran == []
    assert t.rows[-1] == {"check": "second", "ok": None, "figure": "skipped: 15 s of the time limit left", "bar": ""}
    assert json.loads((tmp_path / "g.json").read_text())["rows"][-1]["check"] == "second"
    clock[0] += 100
    assert t.left() == 0
