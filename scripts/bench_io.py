"""SSD tier I/O benchmark: mobiuspipe's async engine and store against fio and DeepSpeed's AIO, in one run.

Usage: .venv/bin/python scripts/bench_io.py [--dir .] [--size-mb 1024] [--rounds 5] [--queue-depth 32]

Every contestant writes a fresh file of --size-mb (1 MiB blocks, O_DIRECT, the file's blocks allocated
before the clock starts), fsyncs it inside the timing, then reads it back; contestants alternate
(A B C ... A B C ...) and each figure is the median over the rounds. Read buffers hold the same earlier
bytes before every read, so every contestant reads into pages already mapped.
Yardsticks: fio 3.x at the same queue depth with io_uring, io_uring with registered buffers (--fixedbufs)
and libaio (its best median in each direction is "the fio ceiling"), and DeepSpeed's AIO handle when
deepspeed is installed, tuned (qd 32, overlap_events) and at its defaults (qd 128); "DeepSpeed best" is
the better of the two in each direction. GB/s = 1e9 bytes per second.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
from pathlib import Path

import torch
from benchlib import cpu_mark, cpu_model, fio_gbps, markdown_table, other_share

from foundation.timing import Stopwatch
from foundation.units import MiB
from mobiuspipe import _ext
from mobiuspipe.memory.aio import IOEngine, aligned_empty
from mobiuspipe.memory.ssd_store import SSDStore


def _fresh(path: Path, nbytes: int) -> int:
    """Create path anew with its blocks allocated; returns an O_DIRECT fd."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    os.posix_fallocate(fd, 0, nbytes)
    return fd


def engine_contestant(backend: str, qd: int, register: list[torch.Tensor] | None = None):
    """(write_s, read_s) of one round of IOEngine(backend): one request of the whole buffer each way;
    with `register`, those buffers are io_uring registered buffers (as the out-of-core optimizer's slots)."""
    io = IOEngine(backend, qd, MiB)
    fixed = ""
    if register is not None:
        why = io.register(register)
        if why:
            raise SystemExit(f"cannot register buffers: {why}")
        fixed = ", registered buffers"

    def run(path: Path, buf: torch.Tensor, back: torch.Tensor) -> tuple[float, float]:
        fd = _fresh(path, buf.numel())
        try:
            with Stopwatch() as write:
                io.wait(io.submit(fd, buf, 0, True, True, str(path)))
                os.fsync(fd)
            with Stopwatch() as read:
                io.wait(io.submit(fd, back, 0, False, True, str(path)))
        finally:
            os.close(fd)
        return write.s, read.s

    return f"mobiuspipe IOEngine ({io.backend}, qd {qd}{fixed})", run


def store_contestant(folder: Path, qd: int):
    """(write_s, read_s) of SSDStore.put (CRC-32C, allocation, fsync by flush) and SSDStore.get (CRC check)."""
    store = SSDStore(folder / "store", queue_depth=qd, block_bytes=MiB)

    def run(path: Path, buf: torch.Tensor, back: torch.Tensor) -> tuple[float, float]:
        if "t" in store:
            store.delete("t")
        with Stopwatch() as write:
            store.put("t", buf)
            store.flush()
        with Stopwatch() as read:
            store.get("t", out=back)
        return write.s, read.s

    return f"mobiuspipe SSDStore put+flush / get ({store.engine.backend}, checksummed)", run


def deepspeed_contestant(qd: int, overlap: bool):
    """DeepSpeed's aio_handle (async_pwrite/async_pread + wait) on its own pinned buffers, or None."""
    try:
        # deepspeed is an optional peer, not installed in the dev venv: pyright cannot resolve it
        import deepspeed  # pyright: ignore[reportMissingImports]
        from deepspeed.ops.op_builder import AsyncIOBuilder  # pyright: ignore[reportMissingImports]

        aio = AsyncIOBuilder().load(verbose=False)
    except Exception as exc:  # noqa: BLE001 - not installed, or its op does not build here
        print(f"# DeepSpeed AIO not measured: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    h = aio.aio_handle(MiB, qd, False, overlap, 1)
    bufs: dict[int, torch.Tensor] = {}

    def run(path: Path, buf: torch.Tensor, back: torch.Tensor) -> tuple[float, float]:
        if not bufs:
            for i in (0, 1):
                bufs[i] = h.new_cpu_locked_tensor(buf.numel(), torch.empty(0, dtype=torch.uint8))
            bufs[0].copy_(buf)
        os.close(_fresh(path, buf.numel()))
        bufs[1].copy_(back)  # the same prior contents as every contestant's read buffer
        with Stopwatch() as write:
            h.async_pwrite(bufs[0], str(path), 0)
            h.wait()
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        with Stopwatch() as read:
            h.async_pread(bufs[1], str(path), 0)
            h.wait()
        back.copy_(bufs[1])
        return write.s, read.s

    return f"DeepSpeed {deepspeed.__version__} aio_handle (qd {qd}, overlap_events={overlap})", run


def fio_contestant(engine: str, qd: int, extra: tuple[str, ...] = ()):
    """fio's own bandwidth figures (bw_bytes) for a sequential write (end_fsync) then read."""

    def one(path: Path, size_mb: int, rw: str) -> float:  # seconds, from fio's own rate
        options = [f"--ioengine={engine}", f"--iodepth={qd}", *extra] + (["--end_fsync=1"] if rw == "write" else [])
        return size_mb * MiB / (fio_gbps(path, rw, size_mb, options) * 1e9)

    def run(path: Path, buf: torch.Tensor, back: torch.Tensor) -> tuple[float, float]:
        path.unlink(missing_ok=True)
        size_mb = buf.numel() // MiB
        return one(path, size_mb, "write"), one(path, size_mb, "read")

    return f"fio ({engine}, iodepth {qd}{''.join(' ' + e for e in extra)})", run


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--dir", default=".", help="folder on the disk to measure (default: the current one)")
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--queue-depth", type=int, default=32)
    args = ap.parse_args()
    if not _ext.HAVE_C:
        raise SystemExit(f"the C++ extension is not built ({_ext.WHY_NOT}); run scripts/setup.sh")
    work = Path(args.dir).resolve() / f".bench-io-{os.getpid()}"
    work.mkdir()
    qd, nbytes = args.queue_depth, args.size_mb * MiB
    buf = aligned_empty(nbytes)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    back = aligned_empty(nbytes)
    noise = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)  # what read buffers hold before a read
    contestants = [
        engine_contestant("uring", qd),
        engine_contestant("uring", qd, [buf, back]),
        engine_contestant("threads", qd),
        store_contestant(work, qd),
    ]
    contestants += [c for c in [deepspeed_contestant(qd, True), deepspeed_contestant(128, False)] if c]
    if shutil.which("fio"):  # the ceiling: fio's best; registered buffers (fixedbufs) skip per-I/O page pinning
        contestants += [
            fio_contestant("io_uring", qd),
            fio_contestant("io_uring", qd, ("--fixedbufs",)),
            fio_contestant("libaio", qd),
        ]
    else:
        print("# fio not measured: not installed (apt-get install fio)", file=sys.stderr)
    times = {name: ([], []) for name, _ in contestants}
    mark = cpu_mark()
    try:
        for _ in range(args.rounds):
            for name, run in contestants:
                back.copy_(noise)  # the same prior contents for everyone
                w, r = run(work / "f.bin", buf, back)
                times[name][0].append(w)
                times[name][1].append(r)
                if not name.startswith("fio") and not torch.equal(back, buf):
                    raise SystemExit(f"{name}: the data read back differs from the data written")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    other, wall = other_share(mark)
    report(args, times, nbytes, other, wall)


def report(args, times: dict, nbytes: int, other: float, wall: float) -> None:
    gb = {k: (nbytes / statistics.median(w) / 1e9, nbytes / statistics.median(r) / 1e9) for k, (w, r) in times.items()}
    fio = [v for k, v in gb.items() if k.startswith("fio")]
    ds = [v for k, v in gb.items() if k.startswith("DeepSpeed")]
    ds = [(max(v[0] for v in ds), max(v[1] for v in ds))] if ds else []  # DeepSpeed's best config
    ceil = (max(v[0] for v in fio), max(v[1] for v in fio)) if fio else None
    print(
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; machine: {cpu_model()}, "
        f"{os.cpu_count()} cores; torch {torch.__version__}"
    )
    print(
        f"{args.size_mb} MiB per file, 1 MiB blocks, O_DIRECT, queue depth {args.queue_depth}, median of "
        f"{args.rounds} alternating rounds; other processes kept {other:.1%} of the cores busy over {wall:.0f} s"
    )
    for k, (w, r) in times.items():
        print(
            f"  {k}: write {' '.join(f'{nbytes / s / 1e9:.2f}' for s in w)}; "
            f"read {' '.join(f'{nbytes / s / 1e9:.2f}' for s in r)}"
        )
    rows = []
    for k, (w, r) in gb.items():
        row = [k, f"{w:.2f}", f"{r:.2f}"]
        row += [f"{w / ceil[0]:.2f}", f"{r / ceil[1]:.2f}"] if ceil else ["-", "-"]
        row += [f"{w / ds[0][0]:.2f}", f"{r / ds[0][1]:.2f}"] if ds else ["-", "-"]
        rows.append(row)
    print(
        markdown_table(
            [
                "contestant",
                "write GB/s",
                "read GB/s",
                "write / fio ceiling",
                "read / fio ceiling",
                "write / DeepSpeed best",
                "read / DeepSpeed best",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
