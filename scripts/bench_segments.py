"""Why 4 KiB-page direct I/O figures wander: read speed against the physical layout of the buffer, in one run.

Usage (as root, which /proc/PID/pagemap needs): .venv/bin/python scripts/bench_segments.py [--dir .]
       [--size-mb 512] [--rounds 3]

A direct read hands the device one segment per physically contiguous run of the buffer. The engine
(io_uring, qd 32, 1 MiB pieces) reads a --size-mb file into buffers of the same size whose layout is set
by the order their pages are first touched: 4 KiB pages touched in shuffled chunks of 1, 8, 64 or 256
pages, and 2 MiB huge pages; buffers alternate round by round (medians). Then fio (io_uring, qd 32,
--iomem=malloc, 4 KiB pages) reads the same file --rounds x 3 times, each time with the physical runs of
its own buffer read from its /proc/PID/pagemap while it runs. Runs per MiB: 1 = contiguous, 256 = every
4 KiB page apart.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import time
from pathlib import Path

import torch
from benchlib import cpu_model, fio_command, fio_rw, fio_seconds, markdown_table, physical_runs, thp_mode

from foundation.timing import Stopwatch
from foundation.units import MiB
from mobiuspipe.memory.aio import IOEngine, aligned_empty

PAGE = 4096


def laid_out(nbytes: int, chunk_pages: int | None) -> torch.Tensor:
    """A buffer of 4 KiB pages first touched in shuffled chunks of chunk_pages pages; None: huge pages."""
    os.environ["MOBIUSPIPE_HUGE_PAGES"] = "0" if chunk_pages else "1"
    buf = aligned_empty(nbytes)
    if chunk_pages:
        pages = buf.view(-1, PAGE)
        order = list(range(0, pages.shape[0], chunk_pages))
        random.Random(0).shuffle(order)
        for first in order:
            pages[first : first + chunk_pages, 0] = 1
    buf.fill_(1)
    return buf


def fio_with_runs(path: Path, nbytes: int, qd: int) -> tuple[float, float | None]:
    """(GB/s, physical runs per MiB of fio's buffer) of one fio read (--thread: the buffer is in its process)."""
    cmd = fio_command(path, nbytes, MiB, qd, "malloc", "read", extra=("--thread",))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    runs, size = None, qd * MiB
    while runs is None and proc.poll() is None:
        time.sleep(0.01)
        try:
            maps = Path(f"/proc/{proc.pid}/maps").read_text().splitlines()
        except OSError:
            break
        for line in maps:  # fio's I/O buffer: an anonymous mapping of iodepth x bs and a little
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) rw-p 00000000 00:00 0\s*$", line)
            if m and size <= int(m.group(2), 16) - int(m.group(1), 16) <= size + 4 * MiB:
                runs = physical_runs(int(m.group(1), 16), size, MiB, proc.pid)
    out, err = proc.communicate()
    return nbytes / fio_seconds(cmd, proc.returncode, out, err, nbytes) / 1e9, runs


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--dir", default=".")
    ap.add_argument("--size-mb", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    nbytes, path = args.size_mb * MiB, Path(args.dir).resolve() / f".bench-seg-{os.getpid()}"
    try:
        fio_rw(path, nbytes, MiB, 32, "malloc", "write")
        bufs = {f"4 KiB pages, touched in shuffled runs of {k}": laid_out(nbytes, k) for k in (1, 8, 64, 256)}
        bufs["2 MiB huge pages"] = laid_out(nbytes, None)
        io = IOEngine("uring", 32, MiB)
        rates: dict[str, list[float]] = {k: [] for k in bufs}
        for _ in range(args.rounds):
            for name, buf in bufs.items():
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                with Stopwatch() as watch:
                    io.wait(io.submit(fd, buf, 0, False, True, str(path)))
                os.close(fd)
                rates[name].append(nbytes / watch.s / 1e9)
        fio = sorted((fio_with_runs(path, nbytes, 32) for _ in range(3 * args.rounds)), key=lambda x: x[1] or 0)
    finally:
        path.unlink(missing_ok=True)
    print(f"{cpu_model()}, {os.cpu_count()} cores, THP {thp_mode()}; {args.size_mb} MiB O_DIRECT reads, 1 MiB, qd 32")
    rows = []
    for name, buf in bufs.items():
        runs = physical_runs(buf.data_ptr(), nbytes, MiB)
        rows.append(
            [f"engine, {name}", "-" if runs is None else f"{runs:.1f}", f"{statistics.median(rates[name]):.2f}"]
        )
    rows += [["fio --iomem=malloc", "-" if r is None else f"{r:.1f}", f"{g:.2f}"] for g, r in fio]
    print(markdown_table(["reader, buffer", "physical runs per MiB", "read GB/s"], rows))


if __name__ == "__main__":
    main()
