"""The asynchronous I/O engines (io_uring, C++ threads, Python threads) and CRC-32C: bit-exact round trips
at unaligned sizes, offsets and addresses, short transfers, and injected and real faults."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import zlib

import pytest
import torch

from mobiuspipe import _ext
from mobiuspipe.errors import SwapIOError
from mobiuspipe.memory.aio import ALIGN, IOEngine, aligned_empty

needs_c = pytest.mark.skipif(not _ext.HAVE_C, reason=f"C++ extension not built ({_ext.WHY_NOT})")
BACKENDS = [pytest.param("uring", marks=needs_c), pytest.param("threads", marks=needs_c), "python"]
SIZES = [1, 7, 4095, 4096, 4097, (1 << 16) + 3, 3 * (1 << 16) - 5]
BLOCK = 1 << 16  # small pieces so that a few hundred KiB span many of them


def _engine(backend: str) -> IOEngine:
    try:
        return IOEngine(backend, queue_depth=8, block_bytes=BLOCK)
    except RuntimeError as exc:  # io_uring refused in this sandbox: the threads backend covers the rest
        pytest.skip(str(exc))


def _open(path, direct: bool) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o600)


@contextlib.contextmanager
def _opened(path, direct: bool):
    fd = _open(path, direct)
    try:
        yield fd
    finally:
        os.close(fd)


def _modes(backend: str) -> list[bool]:
    return [False, True] if backend != "python" else [False]


def _random_bytes(n: int, seed: int, skew: int = 0) -> torch.Tensor:
    """n random bytes starting `skew` bytes past a 4 KiB boundary (unaligned memory when skew > 0)."""
    base = aligned_empty(n + skew)
    base.copy_(torch.randint(0, 256, (n + skew,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return base[skew:]


@needs_c
def test_crc32c_known_value_paths_agree_and_combine():
    check = torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)
    assert _ext.C.crc32c(check) == 0xE3069283  # the standard CRC-32C check value
    g = torch.Generator().manual_seed(1)
    for n in [0, 1, 7, 8, 9, 63, 4097, 3 * 4096 - 1, 3 * 4096, 3 * 4096 + 11, 100_003, (1 << 20) + 5]:
        data = torch.randint(0, 256, (n + 3,), dtype=torch.uint8, generator=g)[3:]  # unaligned start
        assert _ext.C.crc32c(data) == _ext.C.crc32c(data, reference=True)
        head = _ext.C.crc32c(data[: n // 3])
        assert _ext.C.crc32c(data[n // 3 :], head) == _ext.C.crc32c(data)  # continues a running checksum
        tail = _ext.C.crc32c(data[n // 3 :])
        assert _ext.C.crc32c_combine(head, tail, n - n // 3) == _ext.C.crc32c(data)  # joins two checksums


def _crc(t: torch.Tensor, algo: str) -> int:
    b = t.reshape(-1).view(torch.uint8)
    return _ext.C.crc32c(b) if algo == "crc32c" else zlib.crc32(b.numpy().tobytes())


@pytest.mark.parametrize("backend", BACKENDS)
def test_checksums_computed_in_flight(tmp_path, backend):
    """The engine's per-piece checksums, joined, equal the checksum of the whole tensor both ways."""
    io = _engine(backend)
    direct = backend != "python"
    with _opened(tmp_path / "f", direct) as fd:
        for i, n in enumerate([0, 5, 4096, BLOCK, 3 * BLOCK + 777]):
            data = _random_bytes(n, seed=20 + i, skew=i)
            done, crc_w = io.wait_checked(io.submit(fd, data, 0, True, direct, "f", checksum=True))
            back = torch.zeros_like(data)
            _, crc_r = io.wait_checked(io.submit(fd, back, 0, False, direct, "f", checksum=True))
            assert done == n and crc_w == crc_r == _crc(data, io.checksum_algo), (backend, n)


@pytest.mark.parametrize("backend", BACKENDS)
def test_round_trips_are_bit_exact(tmp_path, backend):
    io = _engine(backend)
    for direct in _modes(backend):
        with _opened(tmp_path / f"f{direct}", direct) as fd:
            for i, n in enumerate(SIZES):
                skew = [0, 1, 64, 4095][i % 4]
                offset = ALIGN * (i + 1) if direct else ALIGN * (i + 1) + 13 * i
                data = _random_bytes(n, seed=i, skew=skew)
                assert io.wait(io.submit(fd, data, offset, True, direct, "f")) == n
                back = _random_bytes(n, seed=99, skew=(skew + 5) % ALIGN)
                assert io.wait(io.submit(fd, back, offset, False, direct, "f")) == n
                assert torch.equal(back, data), (backend, direct, n, skew)


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_requests_in_flight_waited_out_of_order(tmp_path, backend):
    io = _engine(backend)
    direct = backend != "python"
    with _opened(tmp_path / "f", direct) as fd:
        dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.float16]
        g = torch.Generator().manual_seed(7)
        tensors = [torch.randn(5_000 + 333 * i, generator=g).to(dtypes[i % 4]) for i in range(12)]
        offsets, at = [], 0
        for t in tensors:
            offsets.append(at)
            at += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        tickets = [io.submit(fd, t, o, True, direct, "f") for t, o in zip(tensors, offsets)]
        for tk in reversed(tickets):
            io.wait(tk)
        backs = [torch.empty_like(t) for t in tensors]
        tickets = [io.submit(fd, b, o, False, direct, "f") for b, o in zip(backs, offsets)]
        for tk in tickets[::2] + tickets[1::2]:
            io.wait(tk)
        assert all(torch.equal(b, t) for b, t in zip(backs, tensors))


@needs_c
def test_the_engine_keeps_a_dropped_tensor_alive(tmp_path):
    io = _engine("threads")
    with _opened(tmp_path / "f", True) as fd:
        ticket = io.submit(fd, torch.full((300_001,), 3.5), 0, True, True, "f")  # no Python reference left
        io.wait(ticket)
        back = torch.empty(300_001)
        io.wait(io.submit(fd, back, 0, False, True, "f"))
        assert bool((back == 3.5).all())
        with pytest.raises(RuntimeError, match="already waited"):
            io.wait(ticket)


@needs_c
def test_an_unaligned_direct_offset_is_refused(tmp_path):
    io = _engine("threads")
    with _opened(tmp_path / "f", True) as fd:
        with pytest.raises(RuntimeError, match="multiple of 4096"):
            io.submit(fd, torch.ones(4), 100, True, True, "f")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
def test_an_injected_error_names_file_offset_and_errno(tmp_path, backend, err):
    io = _engine(backend)
    direct = backend != "python"
    path = str(tmp_path / "swap.bin")
    with _opened(path, direct) as fd:
        data = _random_bytes(5 * BLOCK + 11, seed=3)
        io.inject_fault(2, err)  # the third piece to complete fails
        with pytest.raises(SwapIOError) as info:
            io.wait(io.submit(fd, data, 8 * ALIGN, True, direct, path))
        e = info.value
        assert e.errno == err and e.path == path and e.offset >= 8 * ALIGN
        assert path in str(e) and errno.errorcode[err] in str(e) and f"offset {e.offset}" in str(e)
        assert io.wait(io.submit(fd, data, 8 * ALIGN, True, direct, path)) == data.numel()  # one-shot


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("write", [True, False])
def test_short_transfers_are_resubmitted(tmp_path, backend, write):
    """A piece that moves only part of its bytes is finished by resubmitting the rest: still bit-exact."""
    io = _engine(backend)
    direct = backend != "python"
    with _opened(tmp_path / "f", direct) as fd:
        data = _random_bytes(4 * BLOCK + 5, seed=4, skew=3)
        if not write:
            io.wait(io.submit(fd, data, 0, True, direct, "f"))
        io.inject_fault(1, 0, short_bytes=2 * ALIGN)
        target = data if write else torch.zeros_like(data)
        io.wait(io.submit(fd, target, 0, write, direct, "f"))
        back = torch.zeros_like(data)
        io.wait(io.submit(fd, back, 0, False, direct, "f"))
        assert torch.equal(back, data)


@needs_c
def test_a_short_direct_write_that_cannot_resume_is_an_error(tmp_path):
    io = _engine("threads")
    path = str(tmp_path / "f")
    with _opened(path, True) as fd:
        io.inject_fault(0, 0, short_bytes=100)  # O_DIRECT cannot continue at an unaligned offset
        with pytest.raises(SwapIOError, match="made no progress|disk is probably full") as info:
            io.wait(io.submit(fd, _random_bytes(BLOCK, 5), 0, True, True, path))
        assert info.value.offset == 100


@pytest.mark.parametrize("backend", BACKENDS)
def test_reading_past_the_end_of_a_truncated_file(tmp_path, backend):
    io = _engine(backend)
    direct = backend != "python"
    path = str(tmp_path / "f")
    with _opened(path, direct) as fd:
        io.wait(io.submit(fd, _random_bytes(3 * BLOCK, 6), 0, True, direct, path))
        os.truncate(path, BLOCK + ALIGN)
        with pytest.raises(SwapIOError, match="truncated") as info:
            io.wait(io.submit(fd, torch.empty(3 * BLOCK, dtype=torch.uint8), 0, False, direct, path))
        assert info.value.offset == BLOCK + ALIGN and info.value.path == path


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_real_full_device_gives_enospc(backend):
    """/dev/full answers every write with ENOSPC (buffered: it refuses O_DIRECT)."""
    io = _engine(backend)
    fd = os.open("/dev/full", os.O_WRONLY)
    try:
        with pytest.raises(SwapIOError, match="ENOSPC.*disk is full") as info:
            io.wait(io.submit(fd, torch.ones(1000), 0, True, False, "/dev/full"))
        assert info.value.errno == errno.ENOSPC
    finally:
        os.close(fd)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_real_file_size_limit_gives_efbig(tmp_path, backend):
    """The kernel stops a write at RLIMIT_FSIZE with EFBIG: run in a child that has the limit."""
    code = f"""
import os, resource, signal, sys, torch
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, ({4 * BLOCK}, {4 * BLOCK}))
from mobiuspipe.errors import SwapIOError
from mobiuspipe.memory.aio import IOEngine, aligned_empty
io = IOEngine({backend!r}, 4, {BLOCK})
direct = io.supports_direct
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o600)
try:
    io.wait(io.submit(fd, aligned_empty({8 * BLOCK}), 0, True, direct, sys.argv[1]))
except SwapIOError as e:
    print(e.errno, e.offset)
    print(e)
"""
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "big")], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    first, message = out.stdout.split("\n", 1)
    err, offset = map(int, first.split())
    assert err == errno.EFBIG and offset >= 4 * BLOCK and "EFBIG" in message and "ulimit -f" in message


def test_python_engine_checks():
    io = IOEngine("python")
    assert not io.supports_direct
    with pytest.raises(ValueError, match="O_DIRECT"):
        io.submit(0, torch.ones(1), 0, True, True, "x")
    with pytest.raises(ValueError, match="backend must be one of"):
        IOEngine("libaio")


def test_aligned_empty():
    for n in [1, 4095, 4096, 10_001]:
        t = aligned_empty(n)
        assert t.numel() == n and t.data_ptr() % ALIGN == 0 and t.dtype == torch.uint8


def test_zlib_crc_of_a_tensor_matches_bytes():
    from mobiuspipe.memory.store.ssd_store import checksum

    t = torch.arange(1000, dtype=torch.int32)
    assert checksum(t, "crc32") == zlib.crc32(t.numpy().tobytes())


@needs_c
def test_registered_buffers_round_trip_and_resume_short_transfers(tmp_path):
    """io_uring fixed-buffer reads/writes (pieces inside registered memory) move the same bytes."""
    io = _engine("uring")
    bufs = [aligned_empty(3 * BLOCK + ALIGN) for _ in range(2)]
    why = io.register(bufs)
    if why:
        pytest.skip(f"io_uring refused to register buffers here: {why}")
    assert io.register(bufs) == "this engine's registered buffers are already taken"
    with _opened(tmp_path / "f", True) as fd:
        src, dst = bufs[0][ALIGN:], bufs[1][: 3 * BLOCK]  # views inside the registered memory
        src.copy_(_random_bytes(3 * BLOCK, seed=8))
        io.inject_fault(1, 0, short_bytes=3 * ALIGN)
        io.wait(io.submit(fd, src, 0, True, True, "f"))
        io.inject_fault(2, 0, short_bytes=ALIGN)
        io.wait(io.submit(fd, dst, 0, False, True, "f"))
        assert torch.equal(dst, src)
        other = torch.empty(3 * BLOCK, dtype=torch.uint8)  # ordinary memory beside them
        io.wait(io.submit(fd, other, 0, False, True, "f"))
        assert torch.equal(other, src)
    assert IOEngine("threads").register(bufs) == "the 'threads' backend does not register buffers"


@needs_c
def test_python_and_cpp_share_the_engine_constants():
    from mobiuspipe.memory import pyio

    assert (_ext.C.IO_ALIGN, _ext.C.IO_SHORT_READ, _ext.C.IO_SHORT_WRITE) == (ALIGN, pyio.SHORT_READ, pyio.SHORT_WRITE)


def test_huge_page_alignment_can_be_turned_off(monkeypatch):
    assert aligned_empty(4 << 20).data_ptr() % (2 << 20) == 0
    monkeypatch.setenv("MOBIUSPIPE_HUGE_PAGES", "0")
    t = aligned_empty(4 << 20)
    assert t.data_ptr() % ALIGN == 0 and t.numel() == 4 << 20
