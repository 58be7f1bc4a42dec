"""SSD tier I/O benchmark: mobiuspipe's async engine and store against fio (and DeepSpeed's AIO), like with like.

Usage: .venv/bin/python scripts/bench_io.py [--dir .] [--size-mb 1024] [--rounds 5] [--queue-depth 32]
                                            [--pages both|huge|4k]

Every contestant writes a fresh file of --size-mb (1 MiB blocks, O_DIRECT, the file's blocks allocated
before the clock starts), fsyncs it inside the timing, then reads it back; contestants alternate
(A B C ... A B C ...) and each figure is the median over the rounds. Read buffers hold the same earlier
bytes before every read, so every contestant reads into pages already mapped.

Buffer pages are part of the yardstick: the kernel pins every page of a direct I/O, so 2 MiB pages cost
512x fewer pins than 4 KiB ones. The engine's buffers are measured (huge pages from aligned_empty, or 4 KiB
pages with MOBIUSPIPE_HUGE_PAGES=0; --pages both runs the two side by side), and fio is given the same kind:
--iomem=mmaphuge with hugetlb pages reserved for the run (the output says so where the machine cannot),
or --iomem=malloc. fio runs at the same block size, queue depth, O_DIRECT and file size, with io_uring,
io_uring with registered buffers (--fixedbufs) and libaio. "fio same" is the fio row doing what the engine
row does (io_uring; --fixedbufs for the row with registered buffers) on the same pages; "fio ceiling" is
fio's best median in each direction on the same pages. DeepSpeed's AIO handle (when deepspeed is
installed) uses its own mlocked 4 KiB-page buffers and sits with the 4 KiB rows. GB/s = 1e9 bytes per second.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch
from benchlib import (
    FioBuffers,
    buffer_kind,
    cpu_mark,
    cpu_model,
    fio_buffers,
    fio_rw,
    markdown_table,
    other_share,
    physical_runs,
    thp_mode,
)

from foundation.timing import Stopwatch
from foundation.units import MiB
from mobiuspipe import _ext
from mobiuspipe.memory.aio import IOEngine, aligned_empty
from mobiuspipe.memory.store.ssd_store import SSDStore


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


def fio_contestant(path_kind: str, iomem: str, qd: int, engine: str, extra: tuple[str, ...] = ()):
    """fio's own timing (benchlib.fio_rw) of a sequential write (fsync timed) then read, its buffers from
    --iomem=iomem (the same pages as the engine rows of path_kind)."""

    def run(path: Path, buf: torch.Tensor, back: torch.Tensor) -> tuple[float, float]:
        path.unlink(missing_ok=True)
        n = buf.numel()
        write = fio_rw(path, n, MiB, qd, iomem, "write", engine=engine, extra=extra, fsync=True)
        return write, fio_rw(path, n, MiB, qd, iomem, "read", engine=engine, extra=extra)

    return f"fio ({engine}, iodepth {qd}{''.join(' ' + e for e in extra)}, --iomem={iomem})", run


@dataclass
class Side:
    """One kind of buffer pages: the engine's buffers of that kind, fio's matching buffers, the contestants."""

    kind: str  # 'huge' or '4k', as asked of aligned_empty
    got: str  # what the buffers measured (benchlib.buffer_kind)
    buf: torch.Tensor
    back: torch.Tensor
    fio: FioBuffers | None
    contestants: list = field(default_factory=list)


def engine_buffers(kind: str, nbytes: int, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(write buffer holding data, read buffer, measured kind) from aligned_empty with huge pages on or off."""
    old = os.environ.get("MOBIUSPIPE_HUGE_PAGES")
    os.environ["MOBIUSPIPE_HUGE_PAGES"] = "1" if kind == "huge" else "0"
    try:
        buf, back = aligned_empty(nbytes), aligned_empty(nbytes)
    finally:
        if old is None:
            del os.environ["MOBIUSPIPE_HUGE_PAGES"]
        else:
            os.environ["MOBIUSPIPE_HUGE_PAGES"] = old
    buf.copy_(data)
    back.copy_(data)  # touched: the pages exist before any read, as in every round
    got = " / ".join(sorted({buffer_kind(t.data_ptr(), nbytes) for t in (buf, back)}))
    runs = [physical_runs(t.data_ptr(), nbytes, MiB) for t in (buf, back)]
    if None not in runs:
        got += f" ({' / '.join(f'{r:.1f}' for r in runs if r is not None)} physical runs per 1 MiB)"
    return buf, back, got


def make_side(kind: str, args, work: Path, data: torch.Tensor, fio: FioBuffers | None) -> Side:
    qd = args.queue_depth
    buf, back, got = engine_buffers(kind, data.numel(), data)
    side = Side(kind, got, buf, back, fio)
    side.contestants = [
        engine_contestant("uring", qd),
        engine_contestant("uring", qd, [buf, back]),
        engine_contestant("threads", qd),
        store_contestant(work / kind, qd),
    ]
    if kind == "4k":  # DeepSpeed reads and writes its own mlocked 4 KiB-page buffers
        side.contestants += [c for c in [deepspeed_contestant(qd, True), deepspeed_contestant(128, False)] if c]
    if fio:
        side.contestants += [
            fio_contestant(kind, fio.iomem, qd, "io_uring"),
            fio_contestant(kind, fio.iomem, qd, "io_uring", ("--fixedbufs",)),
            fio_contestant(kind, fio.iomem, qd, "libaio"),
        ]
    return side


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--dir", default=".", help="folder on the disk to measure (default: the current one)")
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--pages", choices=("both", "huge", "4k"), default="both", help="the engine's buffer pages")
    args = ap.parse_args()
    if not _ext.HAVE_C:
        raise SystemExit(f"the C++ extension is not built ({_ext.WHY_NOT}); run scripts/setup.sh")
    have_fio = shutil.which("fio") is not None
    if not have_fio:
        print("# fio not measured: not installed (apt-get install fio)", file=sys.stderr)
    work = Path(args.dir).resolve() / f".bench-io-{os.getpid()}"
    work.mkdir()
    nbytes = args.size_mb * MiB
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    noise = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)  # what read buffers hold before a read
    kinds = ("huge", "4k") if args.pages == "both" else (args.pages,)
    try:
        with ExitStack() as stack:
            fio = {k: stack.enter_context(fio_buffers(k, args.queue_depth * MiB)) if have_fio else None for k in kinds}
            sides = [make_side(k, args, work, data, fio[k]) for k in kinds]
            times, other, wall = run_rounds(args, work, sides, noise)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(args, sides, times, nbytes, other, wall)


def run_rounds(args, work: Path, sides: list[Side], noise: torch.Tensor):
    """Every contestant of every side once per round, in turn; ({(kind, name): (writes, reads)}, other, wall)."""
    times = {(s.kind, name): ([], []) for s in sides for name, _ in s.contestants}
    mark = cpu_mark()
    for _ in range(args.rounds):
        for side in sides:
            for name, run in side.contestants:
                side.back.copy_(noise)  # the same prior contents for everyone
                w, r = run(work / "f.bin", side.buf, side.back)
                times[(side.kind, name)][0].append(w)
                times[(side.kind, name)][1].append(r)
                if not name.startswith("fio") and not torch.equal(side.back, side.buf):
                    raise SystemExit(f"{name}: the data read back differs from the data written")
    other, wall = other_share(mark)
    return times, other, wall


def matched_fio(name: str) -> str:
    """The fio row that does what an engine row does: io_uring, with --fixedbufs when it registers buffers."""
    return "fixedbufs" if "registered" in name else "plain"


def report(args, sides: list[Side], times: dict, nbytes: int, other: float, wall: float) -> None:
    gb = {k: (nbytes / statistics.median(w) / 1e9, nbytes / statistics.median(r) / 1e9) for k, (w, r) in times.items()}
    print(
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; machine: {cpu_model()}, "
        f"{os.cpu_count()} cores; torch {torch.__version__}; THP {thp_mode()}"
    )
    print(
        f"{args.size_mb} MiB per file, 1 MiB blocks, O_DIRECT, queue depth {args.queue_depth}, median of "
        f"{args.rounds} alternating rounds; other processes kept {other:.1%} of the cores busy over {wall:.0f} s"
    )
    for s in sides:
        fio = s.fio.note if s.fio else "fio not installed"
        print(f"{s.kind} pages: engine buffers measured {s.got}; {fio}")
    for (kind, k), (w, r) in times.items():
        print(
            f"  [{kind}] {k}: write {' '.join(f'{nbytes / s / 1e9:.2f}' for s in w)}; "
            f"read {' '.join(f'{nbytes / s / 1e9:.2f}' for s in r)}"
        )
    ds = [v for (_, k), v in gb.items() if k.startswith("DeepSpeed")]
    ds_best = (max(v[0] for v in ds), max(v[1] for v in ds)) if ds else None
    rows = []
    for s in sides:
        fio = {k: v for (kind, k), v in gb.items() if kind == s.kind and k.startswith("fio")}
        ceil = (max(v[0] for v in fio.values()), max(v[1] for v in fio.values())) if fio else None
        by_options = {("fixedbufs" if "fixedbufs" in k else "plain"): v for k, v in fio.items() if "io_uring" in k}
        pages = s.kind + ("" if not s.fio or s.fio.matched else " (fio: 4k, NOT matched)")
        for (kind, k), (w, r) in gb.items():
            if kind != s.kind:
                continue
            same = by_options.get(matched_fio(k)) if not k.startswith(("fio", "DeepSpeed")) else None
            row = [k, pages, f"{w:.2f}", f"{r:.2f}"]
            row += [f"{w / same[0]:.2f}", f"{r / same[1]:.2f}"] if same else ["-", "-"]
            row += [f"{w / ceil[0]:.2f}", f"{r / ceil[1]:.2f}"] if ceil else ["-", "-"]
            row += [f"{w / ds_best[0]:.2f}", f"{r / ds_best[1]:.2f}"] if ds_best else []
            rows.append(row)
    header = ["contestant", "pages", "write GB/s", "read GB/s", "write / fio same", "read / fio same"]
    header += ["write / fio ceiling", "read / fio ceiling"] + (["write / DeepSpeed", "read / DeepSpeed"] if ds else [])
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
