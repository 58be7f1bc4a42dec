"""What every benchmark script records beside its table (the machine, how busy other processes kept it), and
the one fio runner every I/O yardstick uses, with the same kind of buffer pages as the engine it measures."""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from foundation.timing import Stopwatch
from foundation.units import MiB

__all__ = [
    "FioBuffers",
    "buffer_kind",
    "cpu_mark",
    "cpu_model",
    "fio_buffers",
    "fio_command",
    "fio_gbps",
    "fio_seconds",
    "fio_rw",
    "markdown_table",
    "other_share",
    "physical_runs",
    "thp_mode",
    "torch_threads",
    "torchrun_metrics",
]

HUGE_PAGE = 2 * MiB  # bytes: an x86-64 huge page, transparent (the engine's) or hugetlb (fio's mmaphuge)
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() where it is missing)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to n inside the block and restored after it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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


def thp_mode() -> str:
    """The kernel's transparent huge page mode (always, madvise or never; 'unknown' where it is missing)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else "unknown"


def huge_share(addr: int, nbytes: int) -> float:
    """Share of the memory [addr, addr + nbytes) of this process that is mapped by huge pages: the
    AnonHugePages of every mapping overlapping it (/proc/self/smaps), over nbytes. Touch the memory first."""
    huge, inside = 0, False
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0.0
    for line in lines:
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) < addr + nbytes and int(head.group(2), 16) > addr
        elif inside and line.startswith("AnonHugePages:"):
            huge += int(line.split()[1]) * 1024
    return min(1.0, huge / max(nbytes, 1))


def buffer_kind(addr: int, nbytes: int) -> str:
    """'huge' when (nearly) all of the touched memory [addr, addr + nbytes) is in huge pages, '4k' when none
    of it is, else 'mixed (N% huge)'."""
    share = huge_share(addr, nbytes)
    if share >= 0.98:
        return "huge"
    return "4k" if share == 0 else f"mixed ({share:.0%} huge)"


def physical_runs(addr: int, nbytes: int, block: int, pid: int | str = "self") -> float | None:
    """Mean number of physically contiguous runs of memory in each `block` bytes of the touched memory
    [addr, addr + nbytes) (page-aligned) of process pid: 1 for huge pages, up to block / 4096 for scattered
    4 KiB pages. A direct I/O hands the device one segment per run. From /proc/PID/pagemap; None where the
    kernel hides page frame numbers (not root)."""
    page = os.sysconf("SC_PAGE_SIZE")
    pages = nbytes // page
    try:
        with open(f"/proc/{pid}/pagemap", "rb") as f:
            f.seek(addr // page * 8)
            raw = f.read(pages * 8)
    except OSError:
        return None
    runs = 0
    per = max(1, block // page)
    entries = [int.from_bytes(raw[i : i + 8], "little") for i in range(0, len(raw), 8)]
    pfns = [e & ((1 << 55) - 1) for e in entries]
    if not any(pfns):
        return None
    for i, pfn in enumerate(pfns):
        runs += i % per == 0 or pfn != pfns[i - 1] + 1
    return runs / max(1, -(-pages // per))


@dataclass(frozen=True)
class FioBuffers:
    """The buffers fio is told to use (--iomem) so that they match the engine's page size, and how."""

    kind: str  # the engine's pages this matches: 'huge' or '4k'
    iomem: str  # fio's --iomem: 'mmaphuge' (hugetlb 2 MiB pages) or 'malloc' (4 KiB pages)
    note: str  # what was done to get them, or why fio's buffers do NOT match the engine's

    @property
    def matched(self) -> bool:
        """True when fio's pages are the engine's kind (a like-with-like yardstick)."""
        return (self.kind == "huge") == (self.iomem == "mmaphuge")


def _free_huge_pages() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("HugePages_Free:"):
            return int(line.split()[1])
    return 0


@contextmanager
def fio_buffers(kind: str, buffer_bytes: int) -> Iterator[FioBuffers]:
    """fio's buffers of the engine's `kind` of pages for `buffer_bytes` of fio buffers at once (sum over
    jobs of iodepth x block size). 'huge': fio's --iomem=mmaphuge, with enough hugetlb pages reserved
    (vm.nr_hugepages raised for the duration and restored after; needs root); where they cannot be
    reserved, fio gets 4 KiB pages and `note` says the yardstick is not like with like. Anything else:
    malloc (4 KiB pages unless THP is 'always')."""
    if kind != "huge":
        note = "fio --iomem=malloc: 4 KiB pages" + (", but THP is 'always'" if thp_mode() == "always" else "")
        yield FioBuffers(kind, "malloc", note)
        return
    need = -(-buffer_bytes // HUGE_PAGE) + 4  # fio rounds each job's buffer up; a little slack
    try:
        before = int(NR_HUGEPAGES.read_text())
        short = need - _free_huge_pages()
    except (OSError, ValueError) as exc:
        yield FioBuffers(kind, "malloc", f"NOT like with like: no hugetlb pages here ({exc}); fio uses 4 KiB pages")
        return
    raised = False
    try:
        if short > 0:
            try:
                NR_HUGEPAGES.write_text(str(before + short))
                raised = True
            except OSError as exc:
                fix = f"as root: echo {before + short} > {NR_HUGEPAGES}"
                why = f"cannot reserve {need} hugetlb pages ({exc.strerror}; {fix})"
                yield FioBuffers(kind, "malloc", f"NOT like with like: {why}; fio uses 4 KiB pages")
                return
        free = _free_huge_pages()
        if free < need:
            why = f"the kernel gave only {free} of {need} free hugetlb pages (memory too fragmented)"
            yield FioBuffers(kind, "malloc", f"NOT like with like: {why}; fio uses 4 KiB pages")
            return
        how = f"raised vm.nr_hugepages {before} -> {before + short} for the run" if raised else "already reserved"
        yield FioBuffers(kind, "mmaphuge", f"fio --iomem=mmaphuge: 2 MiB hugetlb pages ({need} pages, {how})")
    finally:
        if raised:
            NR_HUGEPAGES.write_text(str(before))


FIO_MODES = ("read", "write", "readwrite-at-once")


def fio_command(
    path: Path,
    nbytes: int,
    block: int,
    qd: int,
    iomem: str,
    mode: str,
    *,
    engine: str = "io_uring",
    extra: tuple[str, ...] = (),
    fsync: bool = False,
) -> list[str]:
    """The fio command line of fio_rw (which says what the arguments mean); JSON on stdout."""
    if mode not in FIO_MODES:
        raise ValueError(f"mode must be one of {FIO_MODES}, not {mode!r}")
    cmd = ["fio", "--output-format=json", f"--filename={path}", f"--bs={block}", f"--size={nbytes}", "--direct=1"]
    cmd += [f"--ioengine={engine}", f"--iodepth={qd}", f"--iomem={iomem}", *extra]  # global: before any --name
    jobs = [("read", 0), ("write", nbytes)] if mode == "readwrite-at-once" else [(mode, 0)]
    for rw, offset in jobs:
        cmd += [f"--name={rw}", f"--rw={rw}", f"--offset={offset}"]
        cmd += ["--end_fsync=1"] if rw == "write" and fsync else []
    return cmd


def fio_seconds(cmd: list[str], returncode: int, stdout: str, stderr: str, nbytes: int) -> float:
    """The longest job's runtime (fio's own clock) in the output of fio_command's cmd; RuntimeError if fio
    failed or any job moved other than nbytes."""
    if returncode != 0 or "{" not in stdout:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {returncode}): {stderr.strip()[-500:]}")
    seconds = 0.0
    for job in json.loads(stdout[stdout.index("{") :])["jobs"]:
        rw = job["jobname"]
        if job["error"] or job[rw]["io_bytes"] != nbytes:
            raise RuntimeError(
                f"fio {rw}: expected {nbytes} bytes moved without error, found {job[rw]['io_bytes']} bytes, "
                f"error {job['error']}: {' '.join(cmd)}"
            )
        seconds = max(seconds, job["job_runtime"] / 1e3)
    return seconds


def fio_rw(
    path: Path,
    nbytes: int,
    block: int,
    qd: int,
    iomem: str,
    mode: str,
    *,
    engine: str = "io_uring",
    extra: tuple[str, ...] = (),
    fsync: bool = False,
) -> float:
    """Seconds, by fio's own clock (the longest job's runtime), to move nbytes sequentially with O_DIRECT in
    `block`-byte requests at queue depth qd, fio's buffers from --iomem=`iomem`, through `engine` (extra:
    more fio options, e.g. --fixedbufs). mode 'read' or 'write' runs one job over [0, nbytes) of path;
    'readwrite-at-once' runs two jobs at the same time, each at depth qd: one reads [0, nbytes) while the
    other writes [nbytes, 2 nbytes) of the same file (nbytes each way). fsync: the write ends with an
    fsync that fio times. Files missing or short are laid out by fio before its clock starts.
    Raises RuntimeError if fio fails or moves any other byte count."""
    cmd = fio_command(path, nbytes, block, qd, iomem, mode, engine=engine, extra=extra, fsync=fsync)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return fio_seconds(cmd, out.returncode, out.stdout, out.stderr, nbytes)


def torchrun_metrics(d: dict, nproc: int, folder: Path, timeout: float) -> list[dict]:
    """Run mobiuspipe.train under torchrun with config `d`; the per-step records of metrics.jsonl."""
    cfg_path = folder / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(d))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "-m",
        "mobiuspipe.train",
        "--config",
        str(cfg_path),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    lines = (Path(d["train"]["out_dir"]) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def stopped_rank_run(d: dict, folder: Path, timeout: float) -> tuple[int | None, float, str]:
    """Two ranks of mobiuspipe.train with config `d`, started without torchrun (whose agent would end the job
    itself); once rank 0 has logged a step, rank 1 is stopped (SIGSTOP: alive, silent). Rank 0's exit status (None
    if it ran on for `timeout` s), the seconds it took to stop, and its error line (or its last words)."""
    cfg_path = folder / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(d))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        cmd = [sys.executable, "-m", "mobiuspipe.train", "--config", str(cfg_path)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    r0, r1 = procs
    try:
        assert r0.stdout is not None  # a PIPE
        for line in r0.stdout:
            if line.startswith("step "):
                break
        r1.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        try:
            _, err = r0.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, time.monotonic() - start, "still running"
        waited = time.monotonic() - start
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()
    said = [line for line in err.splitlines() if line.startswith("mobiuspipe.train: error:")]
    return r0.returncode, waited, (said or err.strip().splitlines() or ["no output"])[-1]
