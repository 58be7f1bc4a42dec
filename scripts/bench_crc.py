"""CRC-32C of the SSD tier against zlib's crc32 and a plain read of the same bytes, one core, in one run.

Usage: .venv/bin/python scripts/bench_crc.py [--rounds 7]

Sizes: 1 MiB (one I/O piece, the size the engine checksums) and 256 MiB. Contestants: mobiuspipe._C.crc32c
(SSE4.2 over three interleaved streams), its byte-table reference, zlib.crc32 (CPython's), and the read
floor: torch summing the same bytes as int64 words on one thread. Alternating rounds, medians.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import zlib

import torch
from benchlib import cpu_model, markdown_table

from foundation.timing import Stopwatch
from foundation.units import MiB
from mobiuspipe import _ext


def contestants(t: torch.Tensor) -> dict:
    words = t.view(torch.int64)
    view = t.numpy().data  # the same memoryview as memoryview(ndarray), which numpy types as a buffer only on 3.12+
    return {
        "crc32c (mobiuspipe, 3 streams)": lambda: _ext.C.crc32c(t),
        "zlib.crc32": lambda: zlib.crc32(view),
        "read floor (int64 sum)": lambda: words.sum(),
        "crc32c table reference": lambda: _ext.C.crc32c(t, reference=True),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if not _ext.HAVE_C:
        raise SystemExit(f"the C++ extension is not built ({_ext.WHY_NOT}); run scripts/setup.sh")
    torch.set_num_threads(1)
    rows = []
    for size in (MiB, 256 * MiB):
        t = torch.randint(0, 256, (size,), dtype=torch.uint8)
        fns = contestants(t)
        reps = max(1, (64 * MiB) // size)  # a 1 MiB pass is timed 64 times in a row
        times = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, fn in fns.items():
                n = 1 if "table" in k else reps
                with Stopwatch() as watch:
                    for _ in range(n):
                        fn()
                times[k].append(watch.s / n)
        med = {k: statistics.median(v) for k, v in times.items()}
        ours = med["crc32c (mobiuspipe, 3 streams)"]
        rows += [[f"{size // MiB} MiB", k, f"{size / v / 1e9:.2f}", f"{v / ours:.2f}"] for k, v in med.items()]
    print(
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; machine: {cpu_model()}, "
        f"{os.cpu_count()} cores, 1 thread; SSE4.2 crc32: {_ext.C.crc32c_has_hw()}; median of {args.rounds}"
    )
    print(markdown_table(["size", "contestant", "GB/s", "time x crc32c"], rows))


if __name__ == "__main__":
    main()
