"""SSD sequential write/read bandwidth from mobiuspipe's --probe against fio and dd, measured in one run."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchlib import cpu_mark, cpu_model, fio_gbps, markdown_table, other_share

from foundation.units import MiB
from topology import load_topology
from topology.probe import NO_CUDA_NOTE, probe

REPO = Path(__file__).resolve().parents[1]
TOOLS = ("mobiuspipe", "fio", "dd")
WHAT = {
    "mobiuspipe": "topology.probe.probe(size_mb=N, repeats=1): O_DIRECT 1 MiB os.write then fsync; "
    "O_DIRECT 1 MiB os.readv",
    "fio": "fio --rw=write|read --bs=1M --direct=1 --ioengine=psync --numjobs=1 --iodepth=1 "
    "--end_fsync=1 (write) --fallocate=none; bw_bytes",
    "dd": "dd bs=1M oflag=direct conv=fsync (write, from /dev/zero); dd bs=1M iflag=direct (read, to /dev/null)",
}
"""What each tool runs once per repeat: a write of a new N MiB file, then a read of that file."""


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def run_probe(folder: Path, size_mb: int, notes: set[str]) -> tuple[float, float]:
    """(write, read) GB/s of one mobiuspipe SSD probe (repeats=1) in `folder`; its notes other than no-CUDA."""
    m = probe(load_topology("2+2"), folder, size_mb=size_mb, repeats=1).measured
    if m is None:
        raise RuntimeError("topology.probe.probe returned a topology without its measurements")
    notes.update(n for n in m.notes if n != NO_CUDA_NOTE)
    return m.ssd_write_gbps, m.ssd_read_gbps


def probe_fio_gbps(path: Path, size_mb: int, rw: str) -> float:
    """fio with the probe's access pattern: psync, queue depth 1, unallocated blocks, fsync at the end."""
    options = ["--ioengine=psync", "--iodepth=1", "--fallocate=none"] + (["--end_fsync=1"] if rw == "write" else [])
    return fio_gbps(path, rw, size_mb, options)


def run_fio(folder: Path, size_mb: int, notes: set[str]) -> tuple[float, float]:
    """(write, read) GB/s of one fio write of a new file in `folder`, then one fio read of it."""
    path = folder / "fio.bin"
    try:
        return probe_fio_gbps(path, size_mb, "write"), probe_fio_gbps(path, size_mb, "read")
    finally:
        path.unlink(missing_ok=True)


def dd_gbps(args: list[str], size_mb: int) -> float:
    """GB/s of one dd copy of `size_mb` 1 MiB blocks, from the bytes and seconds dd itself reports."""
    cmd = ["dd", "bs=1M", f"count={size_mb}", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"})
    found = re.search(r"^(\d+) bytes .* copied, ([0-9.e+-]+) s", out.stderr, re.M)
    if out.returncode != 0 or not found or int(found[1]) != size_mb * MiB:
        raise RuntimeError(
            f"{' '.join(cmd)}: expected {size_mb * MiB} bytes copied, found exit "
            f"{out.returncode}: {out.stderr.strip()[-500:]}"
        )
    return gbps(int(found[1]), float(found[2]))


def run_dd(folder: Path, size_mb: int, notes: set[str]) -> tuple[float, float]:
    """(write, read) GB/s of one dd write of a new file in `folder`, then one dd read of it."""
    path = folder / "dd.bin"
    try:
        write = dd_gbps(["if=/dev/zero", f"of={path}", "oflag=direct", "conv=fsync"], size_mb)
        return write, dd_gbps([f"if={path}", "of=/dev/null", "iflag=direct"], size_mb)
    finally:
        path.unlink(missing_ok=True)


RUNNERS = {"mobiuspipe": run_probe, "fio": run_fio, "dd": run_dd}


def bench(folder: Path, tools: list[str], size_mb: int, repeats: int) -> tuple[dict, set[str]]:
    """{tool: (write GB/s per repeat, read GB/s per repeat)} and the probe's notes. Every file lives in a
    temporary folder inside `folder`, removed at the end (also on error or SIGTERM). The order of the
    tools rotates each repeat, so none always runs first."""
    runs = {t: ([], []) for t in tools}
    notes: set[str] = set()
    work = Path(tempfile.mkdtemp(prefix=".bench-probe-", dir=folder))
    try:
        for r in range(repeats):
            for tool in tools[r % len(tools) :] + tools[: r % len(tools)]:
                write, read = RUNNERS[tool](work, size_mb, notes)
                runs[tool][0].append(write)
                runs[tool][1].append(read)
                print(f"repeat {r + 1}/{repeats} {tool}: write {write:.3f} GB/s, read {read:.3f} GB/s", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return runs, notes


HEADER = [
    "tool",
    "write GB/s best",
    "write median",
    "read GB/s best",
    "read median",
    "mobiuspipe/tool write, best (median)",
    "mobiuspipe/tool read, best (median)",
]


def cells(tool: str, runs: dict) -> list[str]:
    """One table row: best and median GB/s of `tool`, and mobiuspipe's figures divided by them."""
    stats = [(max(v), statistics.median(v)) for v in runs[tool]]
    mine = [(max(v), statistics.median(v)) for v in runs["mobiuspipe"]] if "mobiuspipe" in runs else None
    row = [tool]
    for best, median in stats:
        row += [f"{best:.3f}", f"{median:.3f}"]
    for k, (best, median) in enumerate(stats):
        row.append(f"{mine[k][0] / best:.2f} ({mine[k][1] / median:.2f})" if mine else "-")
    return row


def text_table(rows: list[list[str]]) -> str:
    """Columns padded to their widest cell."""
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([fmt(HEADER), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)])


def block_queue(device: str) -> str:
    """'rotational R, write cache W' of the block device `device` (/dev/NAME), from sysfs; '' if unknown."""
    base = Path("/sys/class/block") / Path(device).name
    for queue in (base / "queue", base.resolve().parent / "queue"):  # a partition's queue is its disk's
        try:
            rota = (queue / "rotational").read_text().strip()
            return f", rotational {rota}, write cache '{(queue / 'write_cache').read_text().strip()}'"
        except OSError:
            continue
    return ""


def disk(folder: Path) -> str:
    """Device, filesystem type, size, free space and mount point of `folder` (df -T), and its queue flags."""
    out = subprocess.run(["df", "-T", "-B1", str(folder)], capture_output=True, text=True, check=True)
    dev, fstype, size, _used, free, _pct, mount = out.stdout.splitlines()[-1].split(None, 6)
    return (
        f"disk: {folder} is on {dev} ({fstype}, {int(size) / 1e9:.0f} GB, {int(free) / 1e9:.0f} GB free, "
        f"mounted on {mount}){block_queue(dev)}"
    )


def tool_version(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True)
    return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout else "unknown"


def machine(folder: Path, tools: list[str]) -> list[str]:
    """Date, CPU, kernel, the disk under `folder` and the tool versions: where and when the figures were taken."""
    versions = [
        tool_version(["fio", "--version"]) if "fio" in tools else "fio not installed",
        tool_version(["dd", "--version"]),
    ]
    return [
        f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"machine: {cpu_model()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        disk(folder),
        f"yardsticks: {', '.join(versions)}",
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dir", type=Path, default=REPO, help=f"folder whose disk is measured (default {REPO})")
    p.add_argument("--size-mb", type=int, default=512, help="MiB each write and read moves (default 512)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each tool (default 3)")
    p.add_argument("--markdown", action="store_true", help="also print the table as Markdown for BENCHMARKS.md")
    args = p.parse_args(argv)
    if args.size_mb < 1 or args.repeats < 1:
        p.error(f"--size-mb and --repeats must be >= 1, found {args.size_mb} and {args.repeats}")
    if not args.dir.is_dir():
        p.error(f"--dir {args.dir}: expected an existing folder")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every tool `repeats` times on the same folder and size, then print the machine and the table."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # so cleanup runs
    tools = [t for t in TOOLS if t != "fio" or shutil.which("fio")]
    if "fio" not in tools:
        print(
            "fio not found on PATH: measuring against dd only (install fio, e.g. apt-get install fio, for the "
            "main yardstick)",
            file=sys.stderr,
        )
    info = machine(args.dir.resolve(), tools)
    mark = cpu_mark()
    runs, notes = bench(args.dir.resolve(), tools, args.size_mb, args.repeats)
    share, wall = other_share(mark)
    print(
        "\n".join(
            info
            + [
                f"other processes kept {100 * share:.1f}% of the {os.cpu_count()} cores busy during the "
                f"{wall:.0f} s run (near 0% = a quiet machine)"
            ]
        )
    )
    print(
        f"{args.size_mb} MiB per write and read, 1 MiB blocks, direct I/O, 1 job, queue depth 1; "
        f"{args.repeats} repeats per tool, order rotated; GB/s = 1e9 B/s"
    )
    for tool in tools:
        print(
            f"{tool}: {WHAT[tool]}\n  write runs {' '.join(f'{v:.3f}' for v in runs[tool][0])}, "
            f"read runs {' '.join(f'{v:.3f}' for v in runs[tool][1])}"
        )
    print("".join(f"note: {n}\n" for n in sorted(notes)))
    table = [cells(t, runs) for t in tools]
    print(text_table(table))
    if args.markdown:
        print("\n" + markdown_table(HEADER, table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
