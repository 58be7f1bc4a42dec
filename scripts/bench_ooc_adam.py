"""Out-of-core AdamW on SSD-resident states against its floor: max(I/O floor from fio, in-memory Adam time).

Usage: .venv/bin/python scripts/bench_ooc_adam.py [--dir .] [--numel 100000000] [--budget-mb 256] [--rounds 5]

One step reads and writes 12 bytes per parameter (fp32 master weight, exp_avg, exp_avg_sq), with bf16
gradients in memory and bf16 weights out (as the GPU will load them). The I/O floor is
bytes read / fio read bandwidth + bytes written / fio write bandwidth, fio measured in the same run on the
same folder (1 GiB, 1 MiB blocks, O_DIRECT, iodepth 32; the best of io_uring and io_uring with registered
buffers, overwriting an existing file as the step does). Contestants alternate round by round: the
pipelined step (read ahead, update, delayed write-back), the serial step (read, update, write back, one
group at a time), the in-memory CPUAdam step on the same parameters, and fio. Figures are medians.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
from pathlib import Path

import torch
from benchlib import cpu_mark, cpu_model, fio_gbps, markdown_table, other_share

from foundation.timing import Stopwatch
from foundation.units import MiB
from mobiuspipe import _ext
from mobiuspipe.memory.ssd_store import SSDStore
from mobiuspipe.optim import CPUAdam
from mobiuspipe.optim.ooc_adam import OutOfCoreAdam

FIO_VARIANTS = [(), ("--fixedbufs",)]


def fio_pass(path: Path, rw: str, extra: tuple[str, ...]) -> float:
    """GB/s of one fio pass of 1 GiB over the existing file at path (io_uring, iodepth 32)."""
    return fio_gbps(path, rw, 1024, ["--ioengine=io_uring", "--iodepth=32", *extra])


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--dir", default=".")
    ap.add_argument("--numel", type=int, default=100_000_000)
    ap.add_argument("--budget-mb", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not _ext.HAVE_C or not shutil.which("fio"):
        raise SystemExit("needs the C++ extension (scripts/setup.sh) and fio (apt-get install fio)")
    torch.set_num_threads(args.threads)
    work = Path(args.dir).resolve() / f".bench-ooc-{os.getpid()}"
    work.mkdir()
    try:
        run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args, work: Path) -> None:
    n = args.numel
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(n, generator=gen)}
    grads = {"w": (torch.randn(n, generator=gen) * 1e-3).bfloat16()}
    outs = {"w": torch.empty(n, dtype=torch.bfloat16)}
    store = SSDStore(work / "store")
    opt = OutOfCoreAdam.create(store, params, host_budget_bytes=args.budget_mb * MiB)
    mem_p = torch.nn.Parameter(params["w"].clone())
    mem = CPUAdam([mem_p])
    fio_file = work / "fio.bin"
    fio_pass(fio_file, "write", ())  # lays the file out; later passes overwrite it
    times: dict[str, list[float]] = {"pipelined": [], "serial": [], "in-memory": []}
    fio = {(rw, e): [] for rw in ("read", "write") for e in FIO_VARIANTS}

    def timed(key, fn):
        with Stopwatch() as watch:
            fn()
        times[key].append(watch.s)

    opt.step(grads, outs)  # warm-up: every group file written once by a step
    mem.step_fused({mem_p: outs["w"]}, grads={mem_p: grads["w"]})
    mark = cpu_mark()
    for _ in range(args.rounds):
        timed("pipelined", lambda: opt.step(grads, outs, pipelined=True))
        timed("serial", lambda: opt.step(grads, outs, pipelined=False))
        timed("in-memory", lambda: mem.step_fused({mem_p: outs["w"]}, grads={mem_p: grads["w"]}))
        for (rw, e), v in fio.items():
            v.append(fio_pass(fio_file, rw, e))
    other, wall = other_share(mark)
    store.close()
    report(args, opt, times, fio, other, wall)


def report(args, opt: OutOfCoreAdam, times: dict, fio: dict, other: float, wall: float) -> None:
    nbytes = 12 * sum(opt.numels.values())  # read, and again written, per step
    med = {k: statistics.median(v) for k, v in times.items()}
    read_bw = max(statistics.median(fio[("read", e)]) for e in FIO_VARIANTS)
    write_bw = max(statistics.median(fio[("write", e)]) for e in FIO_VARIANTS)
    io_floor = nbytes / (read_bw * 1e9) + nbytes / (write_bw * 1e9)
    floor = max(io_floor, med["in-memory"])
    print(
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; machine: {cpu_model()}, "
        f"{os.cpu_count()} cores; torch {torch.__version__}; {args.threads} threads"
    )
    print(
        f"{args.numel / 1e6:.0f}M params: {nbytes / 1e9:.2f} GB read + {nbytes / 1e9:.2f} GB written per step; "
        f"{len(opt.groups)} groups of {opt.group_elems} elements, {len(opt.slots)} slots in "
        f"{args.budget_mb} MiB; store backend {opt.store.engine.backend}, direct={opt.store.direct}"
    )
    print(
        f"fio (io_uring, iodepth 32, 1 MiB, O_DIRECT; plain / fixedbufs): read "
        f"{statistics.median(fio[('read', ())]):.2f} / {statistics.median(fio[('read', ('--fixedbufs',))]):.2f} "
        f"GB/s, write {statistics.median(fio[('write', ())]):.2f} / "
        f"{statistics.median(fio[('write', ('--fixedbufs',))]):.2f} GB/s (medians of {args.rounds})"
    )
    print(
        f"I/O floor {io_floor:.3f} s = {nbytes / 1e9:.2f} GB / {read_bw:.2f} GB/s + {nbytes / 1e9:.2f} GB / "
        f"{write_bw:.2f} GB/s; in-memory Adam {med['in-memory']:.3f} s; floor {floor:.3f} s"
    )
    print(f"other processes kept {other:.1%} of the cores busy over {wall:.0f} s")
    for k, v in times.items():
        print(f"  {k}: {' '.join(f'{t:.3f}' for t in v)} s")
    rows = [
        [k, f"{med[k]:.3f}", f"{med[k] / floor:.2f}", f"{2 * nbytes / med[k] / 1e9:.2f}"]
        for k in ("pipelined", "serial", "in-memory")
    ]
    rows.append(["floor", f"{floor:.3f}", "1.00", f"{2 * nbytes / floor / 1e9:.2f}"])
    print(markdown_table(["step", "s (median)", "x floor", "GB/s moved (read + write)"], rows))


if __name__ == "__main__":
    main()
