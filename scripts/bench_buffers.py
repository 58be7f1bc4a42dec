"""What host buffer pages are worth to direct I/O: huge-page buffers against 4 KiB-page ones, in one run.

Usage: .venv/bin/python scripts/bench_buffers.py [--dir .] [--size-mb 256] [--numel 50000000] [--rounds 5]

Part 1, reads: one O_DIRECT read (io_uring, 1 MiB pieces, qd 32) of a --size-mb file into (a) a buffer
from aligned_empty (2 MiB-aligned, MADV_HUGEPAGE), (b) a 4 KiB-page buffer (MOBIUSPIPE_HUGE_PAGES=0)
holding earlier data, (c) the same 4 KiB-page buffer zero-filled just before the read.
Part 2, the out-of-core AdamW step (--numel params, 256 MiB budget): a fresh process per variant and
round makes 5 optimizers one after another (each one's slots reuse the memory the one before freed, as
in a long job), median step of each; slots in huge pages or in 4 KiB pages. Reported: the median over
all optimizers and the worst optimizer's step. Variants alternate round by round.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from benchlib import cpu_model, markdown_table

from foundation.timing import Stopwatch
from foundation.units import MiB

STEP_CODE = """
import shutil, statistics, sys, torch
from foundation.timing import Stopwatch
from mobiuspipe.memory.store.ssd_store import SSDStore
from mobiuspipe.optim.ooc_adam import OutOfCoreAdam
torch.set_num_threads(2)
n = int(sys.argv[2])
grads, outs = {"w": torch.randn(n).bfloat16()}, {"w": torch.empty(n, dtype=torch.bfloat16)}
init = {"w": torch.randn(n)}
for c in range(5):  # each optimizer's slots reuse the memory its predecessor freed
    folder = f"{sys.argv[1]}-{c}"
    with SSDStore(folder) as store:
        opt = OutOfCoreAdam.create(store, init, host_budget_bytes=256 << 20)
        opt.step(grads, outs)
        times = []
        for _ in range(3):
            with Stopwatch() as watch:
                opt.step(grads, outs)
            times.append(watch.s)
    shutil.rmtree(folder)
    print(statistics.median(times))
"""


def read_seconds(io, fd: int, buf: torch.Tensor, path: str) -> float:
    with Stopwatch() as watch:
        io.wait(io.submit(fd, buf, 0, False, True, path))
    return watch.s


def part_reads(work: Path, nbytes: int, rounds: int) -> dict[str, float]:
    from mobiuspipe.memory.aio import IOEngine, aligned_empty

    path = work / "read.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    io = IOEngine("uring", 32, MiB)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    huge = aligned_empty(nbytes)
    os.environ["MOBIUSPIPE_HUGE_PAGES"] = "0"
    small = aligned_empty(nbytes)
    del os.environ["MOBIUSPIPE_HUGE_PAGES"]
    huge.copy_(data)
    io.wait(io.submit(fd, huge, 0, True, True, str(path)))
    os.fsync(fd)
    small.copy_(data)
    times: dict[str, list[float]] = {"huge pages": [], "4 KiB pages": [], "4 KiB pages, zero-filled": []}
    try:
        for _ in range(rounds):
            times["huge pages"].append(read_seconds(io, fd, huge, str(path)))
            times["4 KiB pages"].append(read_seconds(io, fd, small, str(path)))
            small.zero_()
            times["4 KiB pages, zero-filled"].append(read_seconds(io, fd, small, str(path)))
    finally:
        os.close(fd)
    return {k: statistics.median(v) for k, v in times.items()}


def part_steps(work: Path, numel: int, rounds: int) -> dict[str, list[float]]:
    """Every optimizer's median step, by variant."""
    times: dict[str, list[float]] = {"huge pages": [], "4 KiB pages": []}
    for r in range(rounds):
        for name, flag in (("huge pages", "1"), ("4 KiB pages", "0")):
            folder = work / f"ooc-{r}-{flag}"
            out = subprocess.run(
                [sys.executable, "-c", STEP_CODE, str(folder), str(numel)],
                capture_output=True,
                text=True,
                timeout=600,
                env={**os.environ, "MOBIUSPIPE_HUGE_PAGES": flag},
            )
            if out.returncode != 0:
                raise RuntimeError(f"step process failed: {out.stderr.strip()[-500:]}")
            times[name] += [float(x) for x in out.stdout.split()]
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--dir", default=".")
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--numel", type=int, default=50_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    work = Path(args.dir).resolve() / f".bench-buffers-{os.getpid()}"
    work.mkdir()
    try:
        reads = part_reads(work, args.size_mb * MiB, args.rounds)
        steps = part_steps(work, args.numel, args.rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; machine: {cpu_model()}, "
        f"{os.cpu_count()} cores; THP: {Path('/sys/kernel/mm/transparent_hugepage/enabled').read_text().strip()}"
    )
    nbytes = args.size_mb * MiB
    rows = [
        [
            f"O_DIRECT read of {args.size_mb} MiB",
            k,
            f"{v * 1e3:.1f} ms",
            f"{nbytes / v / 1e9:.2f} GB/s",
            f"{v / reads['huge pages']:.2f}",
        ]
        for k, v in reads.items()
    ]
    base = statistics.median(steps["huge pages"])
    for k, v in steps.items():
        for what, x in (("median optimizer", statistics.median(v)), ("worst optimizer", max(v))):
            rows.append(
                [
                    f"out-of-core step, {args.numel / 1e6:.0f}M params, {what}",
                    k,
                    f"{x * 1e3:.0f} ms",
                    "-",
                    f"{x / base:.2f}",
                ]
            )
    print(
        "out-of-core steps (s), every optimizer: "
        + "; ".join(f"{k}: {' '.join(f'{x:.2f}' for x in v)}" for k, v in steps.items())
    )
    print(markdown_table(["what", "buffers", "median time", "rate", "x huge pages (median)"], rows))


if __name__ == "__main__":
    main()
