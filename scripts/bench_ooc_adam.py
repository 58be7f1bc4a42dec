"""Out-of-core AdamW on SSD-resident states against its floor: max(fio moving the same bytes at once, in-memory Adam).

Usage: .venv/bin/python scripts/bench_ooc_adam.py [--dir .] [--numel 100000000] [--budget-mb 256] [--rounds 5]
                                                  [--queue-depth 32] [--pages huge|4k]

One step reads and writes 12 bytes per parameter (fp32 master weight, exp_avg, exp_avg_sq), with bf16
gradients in memory and bf16 weights out (as the GPU will load them). The floor is a true lower bound on
the step: it can be no faster than the disk moving its bytes, nor than the update alone. The I/O part is
fio reading those bytes while it writes as many (two jobs at once, each at the store's queue depth, 1 MiB
blocks, O_DIRECT, overwriting a file laid out before, no fsync, as the step does), with the same kind of
buffer pages as the optimizer's slots (fio --iomem=mmaphuge with hugetlb pages reserved for the run, or
malloc for 4 KiB pages; the output says where huge pages cannot be reserved), the better of plain and
--fixedbufs (the slots are io_uring registered buffers). The compute part is the in-memory CPUAdam step on
the same parameters. Contestants alternate round by round: the pipelined step (read ahead, update,
delayed write-back), the serial step (read, update, write back, one group at a time), the in-memory step,
and fio. Figures are medians. --pages 4k gives the slots 4 KiB pages (MOBIUSPIPE_HUGE_PAGES=0).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
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
from mobiuspipe.memory.aio import round_up
from mobiuspipe.memory.store.ssd_store import SSDStore
from mobiuspipe.optim import CPUAdam
from mobiuspipe.optim.ooc_adam import OutOfCoreAdam

FIO_VARIANTS = {"plain": (), "fixedbufs": ("--fixedbufs",)}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--dir", default=".")
    ap.add_argument("--numel", type=int, default=100_000_000)
    ap.add_argument("--budget-mb", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--queue-depth", type=int, default=32, help="the store's I/O queue depth (and fio's per job)")
    ap.add_argument("--pages", choices=("huge", "4k"), default="huge", help="the slots' pages (default: huge)")
    args = ap.parse_args()
    if not _ext.HAVE_C or not shutil.which("fio"):
        raise SystemExit("needs the C++ extension (scripts/setup.sh) and fio (apt-get install fio)")
    torch.set_num_threads(args.threads)
    os.environ["MOBIUSPIPE_HUGE_PAGES"] = "1" if args.pages == "huge" else "0"
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
    qd = args.queue_depth
    store = SSDStore(work / "store", queue_depth=qd)
    opt = OutOfCoreAdam.create(store, params, host_budget_bytes=args.budget_mb * MiB)
    mem_p = torch.nn.Parameter(params["w"].clone())
    mem = CPUAdam([mem_p])
    fio_bytes = round_up(12 * n, MiB)  # each way; 12 bytes per parameter, whole fio blocks
    fio_file = work / "fio.bin"
    times: dict[str, list[float]] = {"pipelined": [], "serial": [], "in-memory": []}
    times |= {f"fio at once ({v})": [] for v in FIO_VARIANTS}

    def timed(key, fn):
        with Stopwatch() as watch:
            fn()
        times[key].append(watch.s)

    opt.step(grads, outs)  # warm-up: every group file written once by a step, every slot touched
    mem.step_fused({mem_p: outs["w"]}, grads={mem_p: grads["w"]})
    slot = opt.slots[0]
    nslot = slot.numel() * slot.element_size()
    runs = physical_runs(slot.data_ptr(), nslot, MiB)
    slots = buffer_kind(slot.data_ptr(), nslot) + ("" if runs is None else f", {runs:.1f} physical runs per 1 MiB")
    with fio_buffers(args.pages, 2 * qd * MiB) as fio:
        fio_rw(fio_file, 2 * fio_bytes, MiB, qd, fio.iomem, "write")  # lays the file out; later passes overwrite
        mark = cpu_mark()
        for _ in range(args.rounds):
            timed("pipelined", lambda: opt.step(grads, outs, pipelined=True))
            timed("serial", lambda: opt.step(grads, outs, pipelined=False))
            timed("in-memory", lambda: mem.step_fused({mem_p: outs["w"]}, grads={mem_p: grads["w"]}))
            for v, extra in FIO_VARIANTS.items():
                times[f"fio at once ({v})"].append(
                    fio_rw(fio_file, fio_bytes, MiB, qd, fio.iomem, "readwrite-at-once", extra=extra)
                )
        other, wall = other_share(mark)
    store.close()
    report(args, opt, qd, slots, fio, times, other, wall)


def report(args, opt: OutOfCoreAdam, qd: int, slots: str, fio: FioBuffers, times: dict, other, wall) -> None:
    nbytes = 12 * sum(opt.numels.values())  # read, and again written, per step
    med = {k: statistics.median(v) for k, v in times.items()}
    io_floor = min(med[f"fio at once ({v})"] for v in FIO_VARIANTS)
    floor = max(io_floor, med["in-memory"])
    print(
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; machine: {cpu_model()}, "
        f"{os.cpu_count()} cores; torch {torch.__version__}; {args.threads} threads; THP {thp_mode()}"
    )
    print(
        f"{args.numel / 1e6:.0f}M params: {nbytes / 1e9:.2f} GB read + {nbytes / 1e9:.2f} GB written per step; "
        f"{len(opt.groups)} groups of {opt.group_elems} elements, {len(opt.slots)} slots in "
        f"{args.budget_mb} MiB; store backend {opt.store.engine.backend}, queue depth {qd}, direct="
        f"{opt.store.direct}, slots registered: {opt.io_note or 'yes'}"
    )
    print(f"slots' pages: {args.pages} asked, {slots} measured; {fio.note}")
    print(
        f"floor {floor:.3f} s = max(fio reading and writing {nbytes / 1e9:.2f} GB at once, best of plain / "
        f"fixedbufs, {io_floor:.3f} s; in-memory Adam {med['in-memory']:.3f} s)"
    )
    print(f"other processes kept {other:.1%} of the cores busy over {wall:.0f} s")
    for k, v in times.items():
        print(f"  {k}: {' '.join(f'{t:.3f}' for t in v)} s")
    rows = [[k, f"{med[k]:.3f}", f"{med[k] / floor:.2f}", f"{2 * nbytes / med[k] / 1e9:.2f}"] for k in times]
    rows.append(["floor", f"{floor:.3f}", "1.00", f"{2 * nbytes / floor / 1e9:.2f}"])
    print(markdown_table(["step", "s (median)", "x floor", "GB/s moved (read + write)"], rows))


if __name__ == "__main__":
    main()
