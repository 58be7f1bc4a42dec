"""The SSD tiers' staging buffers come from the gpu's Device (on CUDA page-locked at their own size,
mobiuspipe.memory.pinned), not from torch's pinned allocator, which rounds each block up to a power of two and keeps
it: a stage's group-sized buffers of 2.2 GiB would take 4 GiB each that no host budget counts."""

from __future__ import annotations

import pytest
import torch

from mobiuspipe.memory.device import Device
from mobiuspipe.memory.store.ssd_store import SSDStore
from mobiuspipe.memory.swap_ssd import SsdSwap
from mobiuspipe.memory.weight_stream import BUFFERS, SsdWeights
from mobiuspipe.runtime.frozen import SsdFrozenWeights
from mobiuspipe.runtime.stage import _frozen_tier


class AskingDevice(Device):
    """The stand-in Device, recording the sizes of the host buffers asked of it."""

    def __init__(self):
        super().__init__(0, use_cuda=False)
        self.asked: list[int] = []

    def host_empty(self, nbytes: int) -> torch.Tensor:
        self.asked.append(nbytes)
        return super().host_empty(nbytes)


def as_on_a_cuda_host(monkeypatch) -> None:
    """From now on, a host where CUDA exists: a buffer pinned by torch (torch.empty(pin_memory=True)) would come from
    its rounding allocator; on this CPU build such a request fails, so the test sees it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("MOBIUSPIPE_STRICT", "0")  # the stand-in's marks follow is_available; not what is tested


def test_the_ssd_activation_tier_stages_through_the_devices_buffers(monkeypatch, tmp_path):
    device = AskingDevice()
    swap = SsdSwap(device, SSDStore(str(tmp_path / "act")), owns_store=True)
    as_on_a_cuda_host(monkeypatch)
    try:
        held = [torch.randn(37, 5), torch.randn(3, 41).to(torch.bfloat16)]
        want = [t.clone() for t in held]
        swap.start_out((0, 0), held)
        swap.finish_out((0, 0))
        back = swap.finish_in((0, 0))
        assert all(torch.equal(a, b) for a, b in zip(back, want))
        assert sorted(set(device.asked)) == [3 * 41 * 2, 37 * 5 * 4]
    finally:
        swap.close()
        device.close()


def test_the_ssd_frozen_weights_stage_through_the_devices_buffers(monkeypatch, tmp_path):
    device = AskingDevice()
    flat = torch.randint(0, 256, (3 * 4096 + 5,), dtype=torch.uint8)
    store = SSDStore(str(tmp_path / "store"))
    as_on_a_cuda_host(monkeypatch)
    try:
        frozen = _frozen_tier(flat, device, store, 0)
        assert isinstance(frozen, SsdFrozenWeights)
        assert device.asked == [b.nbytes for b in frozen.records.buffers]
        assert torch.equal(frozen.read(), flat)
    finally:
        store.close()
        device.close()


@pytest.mark.parametrize("versions", [1, 2])
def test_the_ssd_weight_stream_stages_through_the_devices_buffers(monkeypatch, tmp_path, versions):
    """Its staging buffers (BUFFERS, and BUFFERS more for the delayed update's second version) and the buffer a device
    gradient is added through, each of one record's bytes."""
    device = AskingDevice()
    store = SSDStore(str(tmp_path / "store"))
    as_on_a_cuda_host(monkeypatch)
    try:
        weights = torch.randn(3000)
        stream = SsdWeights(store, "s0/lowp", weights, 1024, device.host_empty, versions)
        record = 1024 * 4
        assert device.asked == [record] * BUFFERS * versions
        g1, g2 = torch.randn(3000), torch.randn(3000)
        stream.save_grads(g1, _copy, check_finite=True)
        stream.save_grads(g2, _copy, check_finite=True, accumulate=True)
        assert device.asked == [record] * (BUFFERS * versions + 1)
        assert torch.equal(stream.read_grads(0, 3000), g1 + g2) and torch.equal(stream.read(), weights)
    finally:
        store.close()
        device.close()


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)
