"""Swap tiers of held activations (mobiuspipe.memory.swap, swap_ssd): what comes back equals what went out,
bit for bit, in every dtype and shape (odd sizes, views, empty), with several microbatches in flight in the
pipeline's order; the copies are real (overwriting the device tensors after the swap-out changes nothing);
host buffers are reused; an SSD error comes out of finish_in."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
import torch

from mobiuspipe.errors import SwapIOError
from mobiuspipe.memory.device import Device
from mobiuspipe.memory.store.ssd_store import SSDStore
from mobiuspipe.memory.swap import HostSwap, Swap
from mobiuspipe.memory.swap_peer import PeerSwap, RegionFull, shm_region
from mobiuspipe.memory.swap_ssd import SsdSwap
from mobiuspipe.standin.places import gpu_buffer


def _shm(tmp_path) -> str:
    return f"/dev/shm/mobiuspipe-test-{os.getpid()}-{tmp_path.name}"


TIERS = ["device", "host", "ssd", "peer-staged", "peer-direct"]


@pytest.fixture(params=[(name, gpu) for gpu in (0, 1) for name in TIERS], ids=lambda p: f"{p[0]}-gpu{p[1]}")
def tier(request, tmp_path):
    """Each tier on gpu 0 and on gpu 1 (a rank >= 1: the strict stand-in refuses copies from a thread that did
    not bind itself to its gpu, as a new CUDA thread's device is 0); a peer region is the other gpu's memory."""
    name, gpu = request.param
    device = Device(gpu, use_cuda=False)
    peer = 1 - gpu
    swap = {
        "device": lambda: Swap(),
        "host": lambda: HostSwap(device),
        "ssd": lambda: SsdSwap(device, SSDStore(tmp_path / "act")),
        "peer-staged": lambda: PeerSwap(device, gpu_buffer(shm_region(_shm(tmp_path), 1 << 20), peer), True, peer),
        "peer-direct": lambda: PeerSwap(device, gpu_buffer(torch.zeros(1 << 20, dtype=torch.uint8), peer), False, peer),
    }
    t = swap[name]()
    yield t
    t.close()
    if isinstance(t, SsdSwap):
        t.store.close()
    if os.path.exists(_shm(tmp_path)):
        os.unlink(_shm(tmp_path))
    device.close()


def _held(g: torch.Generator, i: int) -> list[torch.Tensor]:
    n = 37 + 11 * i
    return [
        torch.randn(n, 5, generator=g),
        torch.randn(3, n, generator=g).to(torch.bfloat16),
        torch.randint(0, 50_000, (n,), generator=g),
        torch.randn(n, 7, generator=g).t(),  # a non-contiguous view
        torch.empty(0, 4),
    ]


def test_round_trip_in_pipeline_order(tier):
    g = torch.Generator().manual_seed(13)
    device = getattr(tier, "device", None)
    sent = {(2, i): [t if device is None else device.place(t) for t in _held(g, i)] for i in range(5)}
    want = {k: [t.clone() for t in ts] for k, ts in sent.items()}
    for k, ts in sent.items():  # forwards: out after each, finished after the next one's
        tier.start_out(k, ts)
        if k[1] > 0:
            tier.finish_out((2, k[1] - 1))
    tier.finish_out((2, 4))
    if tier.name != "device":
        for ts in sent.values():  # the device memory is reused by now: the tier must hold its own copy
            for t in ts:
                t.zero_() if t.is_floating_point() else t.fill_(-1)
        held = sum(t.numel() * t.element_size() for ts in want.values() for t in ts)
        assert tier.bytes_held() == (0 if tier.name == "ssd" else held)
    tier.start_in((2, 4))
    for i in reversed(range(5)):  # backwards: each prefetches the one before it
        if i > 0:
            tier.start_in((2, i - 1))
        got = tier.finish_in((2, i))
        assert len(got) == len(want[(2, i)])
        for a, b in zip(got, want[(2, i)]):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert tier.bytes_held() == 0


def test_host_buffers_are_reused_across_steps():
    device = Device()
    tier = HostSwap(device)
    made = []
    real = tier.pool._allocate
    tier.pool._allocate = lambda n: made.append(n) or real(n)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for i in range(2):
            tier.start_out((0, i), _held(g, i))
        for i in range(2):
            tier.finish_out((0, i))
        for i in range(2):
            tier.finish_in((0, i))
    assert len(made) == 2 * 5  # the first step's buffers only
    device.close()


def test_an_ssd_error_comes_out_of_finish_in(tmp_path, monkeypatch):
    device = Device()
    with SSDStore(tmp_path / "act") as store:
        tier = SsdSwap(device, store)

        def full(key, t):
            raise SwapIOError(f"write of {key} failed: no space left", str(tmp_path / "act"), errno=errno.ENOSPC)

        monkeypatch.setattr(store, "put_async", full)
        tier.start_out((1, 0), [torch.randn(100)])
        tier.finish_out((1, 0))
        with pytest.raises(SwapIOError, match="no space left") as e:
            tier.finish_in((1, 0))
        assert e.value.errno == errno.ENOSPC
        tier.close()
    device.close()


def test_a_failed_ssd_read_comes_out_of_finish_in_and_gives_its_staging_buffers_back(tmp_path, monkeypatch):
    device = Device()
    with SSDStore(tmp_path / "act") as store:
        tier = SsdSwap(device, store)
        real = store.get_async
        reads = []

        def second_fails(name, out):
            reads.append(name)
            if len(reads) == 2:
                raise SwapIOError(f"read of {name} failed: input/output error", str(tmp_path / "act"), errno=errno.EIO)
            return real(name, out=out)

        monkeypatch.setattr(store, "get_async", second_fails)
        tier.start_out((1, 0), [torch.randn(100), torch.randn(7, 3), torch.randn(5)])
        tier.finish_out((1, 0))
        with pytest.raises(SwapIOError, match="input/output error"):
            tier.finish_in((1, 0))
        assert tier._pool.buffers == 3 and not tier._pool._lent  # every staging buffer is back in the pool
        tier.close()
    device.close()


def test_a_peer_region_holds_the_bytes_in_shared_memory_and_has_a_size(tmp_path):
    device, path = Device(), _shm(tmp_path)
    try:
        tier = PeerSwap(device, shm_region(path, 8192), staged=True, peer=1)
        x = torch.arange(1000, dtype=torch.float32)
        tier.start_out((0, 0), [x])
        tier.finish_out((0, 0))
        peer = "import sys, torch; r = torch.from_file(sys.argv[1], shared=True, size=8192, dtype=torch.uint8); "
        peer += "print(float(r[:4000].view(torch.float32).sum()))"
        out = subprocess.run([sys.executable, "-c", peer, path], capture_output=True, text=True, timeout=60)
        assert float(out.stdout) == float(x.sum())  # another process (the peer's rank) sees them
        with pytest.raises(
            RegionFull, match=r"the peer region of 8.00 KiB holds 4.00 KiB already and has no free range of 6.00 KiB"
        ):
            tier.start_out((0, 1), [torch.zeros(1500)])
        tier.start_out((0, 1), [torch.zeros(1000)])  # the failed one took nothing
        assert torch.equal(tier.finish_in((0, 0))[0], x)
        tier.finish_out((0, 1))
        tier.close()
    finally:
        os.unlink(path)
        device.close()


def test_a_pool_of_varying_sizes_reuses_the_larger_buffers():
    """The host, staged-peer and SSD tiers keep their buffers in a BufferPool, once keyed by exact size: a batch
    padded to its longest sequence (a new size each step) added buffers for every size seen, never freed (on CUDA
    page-locked memory). A request now takes the smallest free buffer that holds it."""
    import random

    from mobiuspipe.memory.swap import BufferPool

    made = []

    def allocate(n: int) -> torch.Tensor:
        made.append(n)
        return torch.empty(n, dtype=torch.uint8)

    pool = BufferPool(allocate)
    sizes = [1000 - 37 * k for k in range(13)]
    order = random.Random(0)
    for step in range(5):  # the longest first, then any order: two buffers live at a time
        for n in sizes if step == 0 else order.sample(sizes, len(sizes)):
            a, b = pool.take(n), pool.take(n // 2 + 1)
            assert (a.numel(), b.numel()) == (n, n // 2 + 1) and a.data_ptr() != b.data_ptr()
            a.fill_(1)
            b.fill_(2)
            assert int(a.sum()) == n  # b's fill did not reach into a
            pool.give(a)
            pool.give(b)
    assert made == [1000, 501] and pool.buffers == 2
