"""Device.to_device on CUDA: a large pageable tensor that may wait (a stage's states at start-up or from a checkpoint)
is not copied through torch's pinned allocator, which rounds each block up to a power of two and keeps it
page-locked in its cache, counted by no budget; small ones still are, and so is one that may not wait (a batch) at
any size (the host does not wait for them)."""

from __future__ import annotations

import pytest
import torch

from mobiuspipe.memory.device import PIN_COPY_LIMIT, Device, upload_route


def test_the_route_of_a_host_tensor_by_its_size():
    assert upload_route(torch.empty(PIN_COPY_LIMIT, dtype=torch.uint8), may_wait=True) == "pin"
    assert upload_route(torch.empty(PIN_COPY_LIMIT // 4 + 1, dtype=torch.float32), may_wait=True) == "pageable"
    assert upload_route(torch.empty(3, 5, dtype=torch.bfloat16), may_wait=True) == "pin"


def test_a_copy_that_may_not_wait_is_pinned_at_any_size():
    assert upload_route(torch.empty(PIN_COPY_LIMIT // 4 + 1, dtype=torch.float32)) == "pin"
    assert upload_route(torch.empty(3, 5, dtype=torch.bfloat16)) == "pin"


def test_the_stand_in_copies_every_size():
    device = Device(0, use_cuda=False)
    try:
        for t in (torch.randn(7), torch.randn(PIN_COPY_LIMIT // 4 + 3)):
            got = device.to_device(t, torch.bfloat16)
            assert got.dtype == torch.bfloat16 and torch.equal(got.float(), t.bfloat16().float())
    finally:
        device.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_uploads_a_large_pageable_tensor_without_torchs_pinned_cache():
    device = Device(0)
    try:
        big = torch.randn(PIN_COPY_LIMIT // 4 * 3 + 1)  # 48 MiB and 4 bytes: torch's allocator would keep 64 MiB
        before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)  # blocks owned, cached included
        got = device.to_device(big, may_wait=True)
        torch.cuda.synchronize()
        assert torch.equal(got.cpu(), big)
        assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before
    finally:
        device.close()
