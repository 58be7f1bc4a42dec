"""What every benchmark script records beside its table: the machine, and how busy other processes kept it."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

from foundation.timing import Stopwatch
from foundation.units import MiB

__all__ = ["cpu_model", "markdown_table", "cpu_mark", "other_share", "fio_gbps"]


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() where it is missing)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """The rows as a Markdown table, to paste into BENCHMARKS.md."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _busy_cpu_s() -> float:
    """CPU-seconds the whole machine has spent busy since boot (/proc/stat; 0 where it is missing)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU-seconds used by this process and every child it has waited for."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def cpu_mark() -> tuple[Stopwatch, float, float]:
    """(a started stopwatch, machine busy CPU-s, own CPU-s) now: the start of a stretch other_share measures."""
    return Stopwatch(), _busy_cpu_s(), _own_cpu_s()


def other_share(mark: tuple[Stopwatch, float, float]) -> tuple[float, float]:
    """(share of all cores that processes other than ours kept busy since `mark`, wall seconds). Kernel work
    done for our own I/O counts as other, so an idle machine shows a few percent."""
    watch, busy0, own0 = mark
    wall = watch.s
    other = max(0.0, _busy_cpu_s() - busy0 - (_own_cpu_s() - own0))
    return other / (wall * (os.cpu_count() or 1)), wall


def fio_gbps(path: Path, rw: str, size_mb: int, options: list[str]) -> float:
    """GB/s (1e9 B/s) that fio itself reports (bw_bytes) for one sequential `rw` pass ('read'/'write') of
    size_mb MiB over path in 1 MiB blocks with O_DIRECT and one job; options add the engine, queue depth,
    fsync and so on. Raises RuntimeError if fio fails or moves any other byte count."""
    cmd = [
        "fio",
        f"--name={rw}",
        f"--filename={path}",
        f"--rw={rw}",
        "--bs=1M",
        f"--size={size_mb}M",
        "--direct=1",
        "--numjobs=1",
        "--output-format=json",
        *options,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0 or "{" not in out.stdout:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {out.returncode}): {out.stderr.strip()[-500:]}")
    job = json.loads(out.stdout[out.stdout.index("{") :])["jobs"][0]
    if job["error"] or job[rw]["io_bytes"] != size_mb * MiB:
        raise RuntimeError(
            f"fio {rw}: expected {size_mb * MiB} bytes moved without error, found "
            f"{job[rw]['io_bytes']} bytes, error {job['error']}"
        )
    return job[rw]["bw_bytes"] / 1e9
