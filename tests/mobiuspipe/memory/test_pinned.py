"""Page-locked buffers of their own size (mobiuspipe.memory.pinned): torch's pinned allocator rounds each block up to
a power of two, so a host tier's 2.2 GiB buffer took 4 GiB that can never be swapped and no budget counted."""

from __future__ import annotations

import ctypes

import pytest
import torch

from mobiuspipe.memory.aio import ALIGN
from mobiuspipe.memory.device import Device
from mobiuspipe.memory.pinned import PinnedBlocks, PinnedMemoryError
from mobiuspipe.standin import StandInError
from mobiuspipe.standin.places import plain


class FakeCuda:
    """cudaHostRegister and cudaHostUnregister, recorded; `refuse` bytes or more fail as CUDA's out of memory."""

    def __init__(self, refuse: int = 1 << 62):
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.refuse = refuse

    def register(self, address: int, nbytes: int) -> int:
        if nbytes >= self.refuse:
            return 2  # cudaErrorMemoryAllocation
        assert address not in self.registered
        self.registered[address] = nbytes
        return 0

    def unregister(self, address: int) -> int:
        self.unregistered.append(address)
        return 0


@pytest.mark.parametrize("nbytes", [1, ALIGN - 1, ALIGN + 1, (3 << 20) + 5, (1 << 21) + 3 * ALIGN])
def test_a_buffer_is_registered_at_its_own_size_aligned(nbytes):
    cuda = FakeCuda()
    blocks = PinnedBlocks(cuda.register, cuda.unregister)
    buf = blocks.empty(nbytes)
    assert buf.dtype == torch.uint8 and buf.numel() == nbytes and buf.data_ptr() % ALIGN == 0
    size = -(-nbytes // ALIGN) * ALIGN  # a power of two would be up to twice this
    assert cuda.registered == {buf.data_ptr(): size} and blocks.nbytes == size
    buf.fill_(7)  # the whole buffer is memory of its own
    assert int(buf.sum()) == 7 * nbytes


def test_covers_tells_the_bytes_of_a_registered_buffer_among_many():
    """A tensor lies in a registered buffer iff all its bytes do, whatever the buffers' order in memory."""
    g = torch.Generator().manual_seed(3)
    cuda = FakeCuda()
    blocks = PinnedBlocks(cuda.register, cuda.unregister)
    bufs = [blocks.empty(int(n)) for n in torch.randint(1, 3 * ALIGN, (40,), generator=g)]
    spans = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in bufs]
    outside = torch.empty(ALIGN, dtype=torch.uint8)
    views = [outside, outside[5:9]] + [b[a : a + n] for b in bufs for a, n in ((0, b.numel()), (b.numel() // 2, 1))]
    views += [b.view(-1)[1:].view(torch.uint8) for b in bufs[:5]] + [torch.empty(0, dtype=torch.uint8)]
    for v in views + [b.as_strided((2,), (1,), b.numel() - 1) for b in bufs[:5]]:  # the last: one byte past its end
        start = v.data_ptr()
        end = start + max(v.numel(), 1)
        assert blocks.covers(v) == any(a <= start and end <= e for a, e in spans)
    assert blocks.covers(bufs[7][3:]) and not blocks.covers(outside)
    blocks.close()
    assert not blocks.covers(bufs[7])


def test_close_unregisters_each_buffer_once_and_leaves_its_memory_valid():
    cuda = FakeCuda()
    blocks = PinnedBlocks(cuda.register, cuda.unregister)
    bufs = [blocks.empty(n) for n in (10, 5 * ALIGN, 1 << 20)]
    blocks.close()
    assert sorted(cuda.unregistered) == sorted(cuda.registered) and blocks.nbytes == 0
    blocks.close()
    assert len(cuda.unregistered) == 3  # not twice
    for b in bufs:
        b.fill_(1)  # pageable memory now, still the tensors'


def test_a_refused_registration_says_how_much_and_what_to_do():
    cuda = FakeCuda(refuse=1 << 20)
    blocks = PinnedBlocks(cuda.register, cuda.unregister)
    blocks.empty(1000)
    with pytest.raises(PinnedMemoryError, match=r"could not page-lock 1\.0 MiB .*error 2.*lower memory.host_budget_mb"):
        blocks.empty(1 << 20)
    assert blocks.nbytes == ALIGN


def test_the_stand_in_pins_nothing():
    device = Device(0, use_cuda=False)
    try:
        assert device.pinned_bytes == 0
        t = torch.arange(5.0)
        assert torch.equal(device.pin(t), t) and device.pinned_bytes == 0
    finally:
        device.close()


def registered_with_cuda(t: torch.Tensor) -> bool:
    """Whether CUDA holds t's first bytes page-locked. t.is_pinned() cannot tell: it asks about the start of t's
    storage, which lies before the aligned bytes a Device registers; so a tensor whose storage starts at t's first
    byte asks (torch's is_pinned clears the error CUDA reports for pageable memory). Registering the bytes again to
    see it fail would leave that error pending, for the next kernel launch, in whatever test, to raise."""
    at = torch.frombuffer((ctypes.c_char * ALIGN).from_address(t.data_ptr()), dtype=torch.uint8)
    return at.is_pinned()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_pins_a_buffer_at_its_size_and_copies_from_it_asynchronously():
    device = Device(0)
    try:
        n = (1 << 20) + 1  # 4 MiB + 4 bytes: torch's pinned allocator would take 8 MiB
        t = torch.randn(n)
        pinned = device.pin(t)
        assert device.page_locked(pinned) and registered_with_cuda(pinned) and torch.equal(pinned, t)
        assert device.pinned_bytes == -(-4 * n // ALIGN) * ALIGN
        on_gpu = pinned.to(device.torch_device, non_blocking=True)
        back = device.host_empty(4 * n).view(torch.float32)
        back.copy_(on_gpu, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(back, t)
    finally:
        device.close()
    assert device.pinned_bytes == 0


# -- no page-locking while messages may be in flight (Device.stepping) --------------------------------------------
def test_a_buffer_made_during_a_span_is_page_locked_when_the_span_ends(monkeypatch):
    """cudaHostRegister may synchronize the whole gpu, which waits for NCCL's kernels in flight: a pool's buffer made
    in step 0 (a held set's first swap-out) is pageable until the pass has flushed its messages."""
    monkeypatch.setenv("MOBIUSPIPE_STRICT", "1")
    device = Device(0, use_cuda=False)
    try:
        before = device.host_empty(3 * ALIGN)
        assert device.pinned_bytes == 3 * ALIGN
        with device.stepping():
            made = [device.host_empty(n) for n in (ALIGN + 1, 100)]
            assert device.pinned_bytes == 3 * ALIGN  # not yet
            made[0].fill_(3)  # usable at once
        assert device.pinned_bytes == 3 * ALIGN + 2 * ALIGN + ALIGN
        assert all(b.data_ptr() % ALIGN == 0 for b in (before, *made)) and int(made[0].sum()) == 3 * (ALIGN + 1)
        with pytest.raises(RuntimeError, match="entered twice"), device.stepping(), device.stepping():
            pass
        with pytest.raises(KeyError), device.stepping():  # a pass that fails may leave messages in flight
            device.host_empty(ALIGN)
            raise KeyError("a failed pass")
        assert device.pinned_bytes == 6 * ALIGN  # so its buffer waits for the next pass's end
        with device.stepping():
            pass
        assert device.pinned_bytes == 7 * ALIGN
    finally:
        device.close()
    assert device.pinned_bytes == 0


def test_the_strict_stand_in_refuses_an_upload_through_torchs_pinned_memory_during_a_span(monkeypatch):
    monkeypatch.setenv("MOBIUSPIPE_STRICT", "1")
    device = Device(0, use_cuda=False)
    try:
        ys = torch.arange(12).chunk(3)
        pinned = device.pinned_batch(ys)
        with device.stepping():
            with pytest.raises(StandInError, match=r"pageable \(4,\) tensor .*Device.pinned_batch"):
                device.to_device(ys[1])
            assert torch.equal(plain(device.to_device(pinned[1])), ys[1])  # pinned before the span
            buf = device.host_empty(16)  # a pool's buffer: locked at the span's end
            assert torch.equal(plain(device.to_device(buf)), torch.zeros(16, dtype=torch.uint8) + plain(buf))
        assert torch.equal(plain(device.to_device(ys[1])), ys[1])  # outside a span torch's pinned memory is fine
        with device.stepping():
            big = torch.zeros(5 << 20)  # 20 MiB: over PIN_COPY_LIMIT
            assert device.to_device(big, may_wait=True).shape == big.shape  # from pageable memory: no page-locking
    finally:
        device.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_page_locks_a_buffer_made_during_a_span_when_it_ends():
    device = Device(0)
    try:
        t = torch.randn(1000)
        with device.stepping():
            buf = device.host_empty(4 * 1000).view(torch.float32)
            assert not device.page_locked(buf) and not registered_with_cuda(buf) and device.pinned_bytes == 0
            on_gpu = device.to_device(t)
            buf.copy_(on_gpu, non_blocking=True)  # into pageable memory: the host waits for it
            assert torch.equal(buf, t)
            again = device.to_device(buf)  # from pageable memory, not through torch's pinned allocator
            assert torch.equal(again.cpu(), t) and not registered_with_cuda(buf)
        assert (
            device.page_locked(buf) and registered_with_cuda(buf) and device.pinned_bytes == -(-4000 // ALIGN) * ALIGN
        )
        back = device.to_device(buf)
        torch.cuda.synchronize()
        assert torch.equal(back.cpu(), t)
    finally:
        device.close()
