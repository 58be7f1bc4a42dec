"""Page-locked buffers of their own size (mobiuspipe.memory.pinned): torch's pinned allocator rounds each block up to
a power of two, so a host tier's 2.2 GiB buffer took 4 GiB that can never be swapped and no budget counted."""

from __future__ import annotations

import pytest
import torch

from mobiuspipe.memory.aio import ALIGN
from mobiuspipe.memory.device import Device
from mobiuspipe.memory.pinned import PinnedBlocks, PinnedMemoryError


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_pins_a_buffer_at_its_size_and_copies_from_it_asynchronously():
    device = Device(0)
    try:
        n = (1 << 20) + 1  # 4 MiB + 4 bytes: torch's pinned allocator would take 8 MiB
        t = torch.randn(n)
        pinned = device.pin(t)
        assert pinned.is_pinned() and torch.equal(pinned, t)
        assert device.pinned_bytes == -(-4 * n // ALIGN) * ALIGN
        on_gpu = pinned.to(device.torch_device, non_blocking=True)
        back = device.host_empty(4 * n).view(torch.float32)
        back.copy_(on_gpu, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(back, t)
    finally:
        device.close()
    assert device.pinned_bytes == 0
