"""Bandwidths in GB/s (1e9 B/s) measured into a Topology: SSD by timed O_DIRECT 1 MiB I/O, GPUs by CUDA-event copies;
each GPU's bf16 matmul rate in TFLOPS."""

from __future__ import annotations

import dataclasses
import errno
import mmap
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from foundation.timing import Stopwatch
from foundation.units import GiB, MiB
from topology.errors import TopologyError
from topology.probe_cpu import probe_host_adam
from topology.types import Measured, Topology

__all__ = ["probe", "matmul_tflops", "NO_CUDA_NOTE"]

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_SPACE_MARGIN = 1.1
"""The SSD probe needs size_mb * this much free space in its folder."""
_BARRIER_TIMEOUT_S = 120.0
NO_CUDA_NOTE = "no CUDA GPU: host<->GPU and GPU<->GPU bandwidths not measured"
BUFFERED_NOTE = (
    "{folder}: the filesystem refused O_DIRECT, so the SSD probe used buffered I/O (fsync after "
    "writing, POSIX_FADV_DONTNEED before reading): the read figure may include the page cache"
)


def probe(
    t: Topology,
    ssd_dir: str | Path | None,
    *,
    size_mb: int = 256,
    repeats: int = 3,
    devices=None,
    host_adam: Callable[[list[str]], float] | None = None,
) -> Topology:
    """`t` with `measured` filled in, each gpu's link_gbps set to its host->gpu bandwidth alone and each root
    complex's uplink_gbps to what its whole group moved at once (switch uplinks are kept: not measured).

    Method: sequential write (then fsync) and read of a `size_mb` MiB temporary file in 1 MiB blocks; pinned
    host->gpu copies (non_blocking, own stream, CUDA events) per gpu alone, then per contention group with every
    gpu copying at once; a device-to-device copy per ordered gpu pair; an 8192^3 bf16 matmul per gpu (matmul_tflops),
    and the same in fp32 with TF32 off (matmul_fp32_tflops).
    Best of `repeats`, GB/s = 1e9 bytes/s.

    ssd_dir: folder whose drive is measured (None = skip the SSD). devices: CUDA device index per topology gpu,
    overriding the mapping by UUID (or by index when the topology has no UUIDs). host_adam: measures the host
    update's parameters per second (appending its note); default topology.probe_cpu.probe_host_adam, torch's AdamW
    in this process (`mobiuspipe topology --probe` gives the runtime's own update, every rank at once).
    """
    for name, value in (("size_mb", size_mb), ("repeats", repeats)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TopologyError(f"probe: {name} must be an int >= 1, found {value!r}; pass a positive integer")
    notes: list[str] = []
    ssd = (0.0, 0.0)
    if ssd_dir is None:
        notes.append("no ssd_dir given: SSD bandwidth not measured")
    else:
        ssd = _probe_ssd(Path(ssd_dir), size_mb, repeats, notes)
    h2d, group, d2d, matmul, fp32 = _probe_gpus(t, size_mb, repeats, devices, notes)
    adam = (host_adam or partial(probe_host_adam, repeats=repeats))(notes)
    m = Measured(
        h2d_gbps=h2d,
        h2d_group_gbps=group,
        d2d_gbps=d2d,
        matmul_tflops=matmul,
        matmul_fp32_tflops=fp32,
        ssd_dir=str(ssd_dir or ""),
        ssd_read_gbps=ssd[0],
        ssd_write_gbps=ssd[1],
        host_adam_params_per_s=adam,
        notes=tuple(notes),
    )
    return _fold_measured(t, m)


def _fold_measured(t: Topology, m: Measured) -> Topology:
    """`t` with `m` attached and written into the links: gpu link_gbps = m.h2d_gbps[g], root complex uplink_gbps
    = sum of m.h2d_group_gbps over its gpus. A 0 (not measured) keeps the value `t` had."""
    n = t.num_gpus
    for name, values in (
        ("h2d_gbps", m.h2d_gbps),
        ("h2d_group_gbps", m.h2d_group_gbps),
        ("matmul_tflops", m.matmul_tflops),
        ("matmul_fp32_tflops", m.matmul_fp32_tflops),
    ):
        if values and len(values) != n:
            raise TopologyError(
                f"measured.{name} has {len(values)} values but topology {t.name!r} has {n} gpus; "
                f"expected one per gpu (0 = not measured)"
            )
    gpus = tuple(
        dataclasses.replace(g, link_gbps=float(m.h2d_gbps[g.index])) if m.h2d_gbps and m.h2d_gbps[g.index] > 0 else g
        for g in t.gpus
    )
    rcs = []
    for rc in t.root_complexes:
        members = [g.index for g in t.gpus if g.root_complex == rc.name]
        seen = [m.h2d_group_gbps[i] for i in members] if m.h2d_group_gbps else []
        if members and all(v > 0 for v in seen) and len(seen) == len(members):
            rc = dataclasses.replace(rc, uplink_gbps=float(sum(seen)))
        rcs.append(rc)
    return dataclasses.replace(t, gpus=gpus, root_complexes=tuple(rcs), measured=m)


# --- SSD ---------------------------------------------------------------------------------------------------------


def _probe_ssd(folder: Path, size_mb: int, repeats: int, notes: list[str]) -> tuple[float, float]:
    """(read, write) GB/s of `size_mb` MiB in 1 MiB blocks through a temporary file in `folder`, best of repeats."""
    _check_folder(folder, size_mb)
    try:
        fd, name = tempfile.mkstemp(prefix=".mobiuspipe-probe-", suffix=".bin", dir=folder)
    except OSError as e:
        raise _folder_error(
            folder,
            "a folder where a file can be created",
            f"{e.strerror} (errno {e.errno})",
            "check its permissions or choose another ssd_dir",
        ) from e
    os.close(fd)
    path = Path(name)
    buf = mmap.mmap(-1, MiB)  # anonymous mmap: page aligned, as O_DIRECT needs
    try:
        buf.write(os.urandom(MiB))
        direct = _direct_ok(path, buf)
        if not direct:
            notes.append(BUFFERED_NOTE.format(folder=folder))
        writes = [_write_file(path, buf, size_mb, direct) for _ in range(repeats)]
        reads = [_read_file(path, buf, size_mb, direct) for _ in range(repeats)]
    finally:
        path.unlink(missing_ok=True)
        buf.close()
    nbytes = size_mb * MiB
    return nbytes / min(reads) / 1e9, nbytes / min(writes) / 1e9


def _folder_error(folder: Path, expected: str, found: str, fix: str) -> TopologyError:
    return TopologyError(f"SSD probe folder {folder}: expected {expected}, found {found}; fix: {fix}")


def _check_folder(folder: Path, size_mb: int) -> None:
    """TopologyError unless `folder` is an existing, writable directory with room for the probe file."""
    if not folder.exists():
        raise _folder_error(
            folder, "an existing directory", "nothing there", f"create it (mkdir -p {folder}) or choose another ssd_dir"
        )
    if not folder.is_dir():
        raise _folder_error(folder, "a directory", "a file", "give the folder on the SSD, not a file")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise _folder_error(
            folder,
            "a writable directory",
            "no write permission for this user",
            f"chmod u+wx {folder} or choose another ssd_dir",
        )
    need = int(size_mb * _SPACE_MARGIN * MiB)
    free = shutil.disk_usage(folder).free
    if free < need:
        raise _folder_error(
            folder,
            f"{need / GiB:.2f} GiB free ({size_mb} MiB probe file + 10%)",
            f"{free / GiB:.2f} GiB free",
            "free some space, choose another ssd_dir or lower size_mb",
        )


def _direct_ok(path: Path, buf: mmap.mmap) -> bool:
    """True when `path`'s filesystem takes O_DIRECT (open and write one aligned block).

    Refusal is EINVAL, at open or at the first write: tmpfs before Linux 6.6, some FUSE and network filesystems."""
    if not _O_DIRECT:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | _O_DIRECT)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise _io_error(path, "open", 0, e) from e
    try:
        os.write(fd, buf)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise _io_error(path, "write", 0, e) from e
    finally:
        os.close(fd)
    return True


def _io_error(path: Path, what: str, offset: int, e: OSError) -> TopologyError:
    return TopologyError(
        f"SSD probe: {what} of {path} failed at offset {offset}: errno {e.errno} ({e.strerror}); "
        f"expected {MiB} bytes per block; fix: check the drive and its free space, or choose "
        f"another ssd_dir"
    )


def _write_file(path: Path, buf: mmap.mmap, blocks: int, direct: bool) -> float:
    """Seconds to write `blocks` 1 MiB blocks to `path` (truncated first) and fsync them."""
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC | (_O_DIRECT if direct else 0))
    try:
        watch = Stopwatch()
        for k in range(blocks):
            try:
                n = os.write(fd, buf)
            except OSError as e:
                raise _io_error(path, "write", k * MiB, e) from e
            if n != MiB:
                raise TopologyError(
                    f"SSD probe: short write to {path} at offset {k * MiB}: {n} of {MiB} bytes "
                    "written, errno none (a short write sets no errno; the usual cause is a full disk, "
                    "ENOSPC); fix: free space on the drive or choose another ssd_dir"
                )
        os.fsync(fd)
        return watch.s
    finally:
        os.close(fd)


def _read_file(path: Path, buf: mmap.mmap, blocks: int, direct: bool) -> float:
    """Seconds to read `blocks` 1 MiB blocks of `path`; buffered reads drop the file's cached pages first."""
    fd = os.open(path, os.O_RDONLY | (_O_DIRECT if direct else 0))
    try:
        if not direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        watch = Stopwatch()
        for k in range(blocks):
            try:
                n = os.readv(fd, [buf])
            except OSError as e:
                raise _io_error(path, "read", k * MiB, e) from e
            if n != MiB:
                raise TopologyError(
                    f"SSD probe: short read of {path} at offset {k * MiB}: {n} of {MiB} bytes; "
                    f"expected the file just written; fix: check the drive, or another process "
                    f"truncated the file"
                )
        return watch.s
    finally:
        os.close(fd)


# --- GPU (CUDA only; torch imported here, never at module level) -------------------------------------------------


def _probe_gpus(t: Topology, size_mb: int, repeats: int, devices, notes: list[str]):
    """(h2d alone, h2d in its group at once, d2d matrix) per topology gpu, GB/s, and each gpu's bf16 and fp32 matmul
    rates, TFLOPS; () each without CUDA."""
    try:
        import torch
    except ImportError:
        notes.append("torch not installed: host<->GPU and GPU<->GPU bandwidths not measured")
        return (), (), (), (), ()
    if not torch.cuda.is_available():
        notes.append(NO_CUDA_NOTE)
        return (), (), (), (), ()
    devs = _cuda_devices(torch, t, devices, notes)
    nbytes, n = size_mb * MiB, t.num_gpus
    alone = tuple(_h2d_together(torch, [d], nbytes, repeats)[0] for d in devs)
    group = [0.0] * n
    for members in t.contention_groups():
        for g, v in zip(members, _h2d_together(torch, [devs[g] for g in members], nbytes, repeats)):
            group[g] = v
    d2d = tuple(
        tuple(0.0 if a == b else _d2d(torch, devs[a], devs[b], nbytes, repeats) for b in range(n)) for a in range(n)
    )
    matmul = tuple(matmul_tflops(torch, f"cuda:{d}", repeats) for d in devs)
    fp32 = tuple(matmul_tflops(torch, f"cuda:{d}", repeats, dtype="fp32") for d in devs)
    torch.cuda.empty_cache()
    return alone, tuple(group), d2d, matmul, fp32


def matmul_tflops(torch, device: str, repeats: int, n: int = 8192, dtype: str = "bf16") -> float:
    """TFLOPS (1e12 FLOP/s) of n x n x n matmuls in `dtype` ("bf16" or "fp32") on `device` (2 n^3 FLOPs each). On CUDA
    the rate a gpu sustains (_sustained_rate: the planner's layers run for seconds on end, at the clock the gpu's
    power limit allows, below the boost clock of a single product); elsewhere the best of `repeats` single products
    after one warm-up. fp32 runs with TF32 off, as mobiuspipe's fp32 runs compute (torch's default, which it keeps)."""
    kind = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    a = torch.randn(n, n, device=device).to(kind)
    b = torch.randn(n, n, device=device).to(kind)
    if device.startswith("cuda") and dtype == "fp32":
        with ieee_matmuls(torch):
            return _best_rate(torch, device, a, b, repeats, n)
    return _best_rate(torch, device, a, b, repeats, n)


@contextmanager
def ieee_matmuls(torch):
    """cuBLAS's fp32 matmuls in full fp32 (no TF32) inside, the setting as it was after: torch's
    backends.cuda.matmul.fp32_precision, the API torch >= 2.9 wants (its legacy allow_tf32 refuses to be read once
    the two were mixed)."""
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "ieee"
    try:
        yield
    finally:
        matmul.fp32_precision = before


SUSTAIN_S = (0.2, 0.1)
"""_sustained_rate's warm-up of back-to-back products, and the least gpu time of each timed run [s]."""


def _best_rate(torch, device: str, a, b, repeats: int, n: int) -> float:
    """matmul_tflops' timing of a @ b."""
    if device.startswith("cuda"):
        return _sustained_rate(torch, device, a, b, repeats, n)
    best = float("inf")
    for k in range(repeats + 1):  # the first is a warm-up
        with Stopwatch() as sw:
            torch.matmul(a, b)
        if k:
            best = min(best, sw.s)
    return 2 * n**3 / best / 1e12


def _sustained_rate(torch, device: str, a, b, repeats: int, n: int) -> float:
    """The median rate of `repeats` runs of back-to-back a @ b, each of at least SUSTAIN_S[1] of gpu time between two
    CUDA events on the current stream, after SUSTAIN_S[0] of them (the clocks settle where the power limit holds them;
    the warm-up also finds how many products a run takes)."""
    count, warm = 1, 0.0
    with torch.cuda.device(device):
        while warm < SUSTAIN_S[0]:
            s = _products_s(torch, a, b, count)
            warm += s
            if s < SUSTAIN_S[1]:
                count *= 2
        rates = sorted(2 * n**3 * count / _products_s(torch, a, b, count) / 1e12 for _ in range(max(1, repeats)))
    return rates[len(rates) // 2]


def _products_s(torch, a, b, count: int) -> float:
    """Seconds of gpu time `count` back-to-back a @ b take (CUDA events around them, waited for)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(count):
        torch.matmul(a, b)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3


def _norm_uuid(u: str) -> str:
    u = str(u).strip().lower()
    return u[4:] if u.startswith("gpu-") else u


def _cuda_devices(torch, t: Topology, devices, notes: list[str]) -> list[int]:
    """CUDA device index of each topology gpu: `devices` if given, else by UUID, else by index (with a note)."""
    count = torch.cuda.device_count()
    if devices is not None:
        devs = [int(d) for d in devices]
    else:
        cuda = [_norm_uuid(getattr(torch.cuda.get_device_properties(i), "uuid", "") or "") for i in range(count)]
        if all(g.uuid for g in t.gpus) and all(cuda):
            missing = [g.index for g in t.gpus if _norm_uuid(g.uuid) not in cuda]
            if missing:
                raise TopologyError(
                    f"probe: topology gpus {missing} have UUIDs CUDA does not see (CUDA sees "
                    f"{count} devices); expected every topology gpu visible; fix: check "
                    f"CUDA_VISIBLE_DEVICES or pass devices=[cuda index per gpu]"
                )
            return [cuda.index(_norm_uuid(g.uuid)) for g in t.gpus]
        notes.append("no GPU UUIDs to match: topology gpu i measured on CUDA device i")
        devs = list(range(t.num_gpus))
    if len(devs) != t.num_gpus or len(set(devs)) != len(devs) or not all(0 <= d < count for d in devs):
        raise TopologyError(
            f"probe: expected {t.num_gpus} distinct CUDA devices in 0..{count - 1}, one per "
            f"topology gpu, found {devs}; fix: pass devices=[cuda index per gpu] or set "
            f"CUDA_VISIBLE_DEVICES to the topology's gpus"
        )
    return devs


def _h2d_setup(torch, dev: int, nbytes: int):
    """(pinned host source, device destination, copy stream) on `dev`, after one untimed warm-up copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    with torch.cuda.device(dev):
        dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dev}")
        stream = torch.cuda.Stream(device=dev)
    _h2d_once(torch, dev, src, dst, stream)
    return src, dst, stream


def _h2d_once(torch, dev: int, src, dst, stream) -> float:
    """GB/s of one non_blocking pinned host->device copy on `stream`, timed by CUDA events on that stream."""
    with torch.cuda.device(dev), torch.cuda.stream(stream):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        dst.copy_(src, non_blocking=True)
        end.record(stream)
    end.synchronize()
    return src.numel() / (start.elapsed_time(end) * 1e-3) / 1e9


def _h2d_together(torch, devs: list[int], nbytes: int, repeats: int) -> list[float]:
    """Per-device GB/s while all `devs` copy host->device at once (one thread each, released by a barrier);
    the round with the highest total of `repeats` rounds."""
    setups = [_h2d_setup(torch, d, nbytes) for d in devs]
    barrier = threading.Barrier(len(devs), timeout=_BARRIER_TIMEOUT_S)

    def run(k: int) -> float:
        barrier.wait()
        return _h2d_once(torch, devs[k], *setups[k])

    best: list[float] = [0.0] * len(devs)
    with ThreadPoolExecutor(max_workers=len(devs)) as pool:
        for _ in range(repeats):
            rates = [f.result() for f in [pool.submit(run, k) for k in range(len(devs))]]
            if sum(rates) > sum(best):
                best = rates
    return best


def _d2d(torch, a: int, b: int, nbytes: int, repeats: int) -> float:
    """GB/s of a device a -> device b copy, best of repeats. PyTorch runs a cross-device copy on the source
    device's current stream (after a barrier with the destination's), so events on that stream bracket it."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{a}")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{b}")
    best = 0.0
    for k in range(repeats + 1):  # the first copy is a warm-up
        torch.cuda.synchronize(a)
        torch.cuda.synchronize(b)
        with torch.cuda.device(a):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
        end.synchronize()
        if k:
            best = max(best, nbytes / (start.elapsed_time(end) * 1e-3) / 1e9)
    return best
