"""The gpu-marked tests (pytest -m gpu) as gpu_check's row: run on a GPU, their output kept, the failed ones named."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["gpu_tests", "failed_tests"]


def gpu_tests(add: Callable[..., None], limit_s: float, cuda: bool, log: Path) -> None:
    """The gpu-marked tests: on a GPU they run (the CUDA clock, NVML, the probe) within limit_s seconds; their output
    goes to `log`, and the row names the tests that failed. add: gpu_check's Table.add (check, ok, figure, bar)."""
    if not cuda:
        add("gpu-marked tests", None, "no GPU here: they skip")
        return
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-m", "gpu", "-p", "no:cacheprovider", "tests"]
    limit = limit_s - 10
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(limit, 1), cwd=ROOT)
    except subprocess.TimeoutExpired as e:  # a hang is when its output matters most
        log.write_text(_text(e.stdout) + _text(e.stderr))
        add("gpu-marked tests", False, f"not finished in {limit:.0f} s: {_last_line(e.stdout)}"[:90], "pass")
        return
    log.write_text(proc.stdout + proc.stderr)
    failed = failed_tests(proc.stdout)
    figure = _last_line(proc.stdout)[:90] + (f"; failed: {', '.join(failed)}" if failed else "")
    add("gpu-marked tests", proc.returncode == 0, figure, "pass")


def failed_tests(out: str) -> list[str]:
    """The names of the tests pytest's short summary (-rfE) says failed or erred."""
    return [
        line.split()[1].split("::")[-1].split(" ")[0]
        for line in out.splitlines()
        if line.startswith(("FAILED ", "ERROR ")) and len(line.split()) > 1
    ]


def _text(out: str | bytes | None) -> str:
    """A subprocess's output as text (a timed-out one's comes as bytes, or None)."""
    return out.decode(errors="replace") if isinstance(out, bytes) else out or ""


def _last_line(out: str | bytes | None) -> str:
    """A subprocess's last line of output."""
    return (_text(out).strip().splitlines() or ["no output"])[-1]
