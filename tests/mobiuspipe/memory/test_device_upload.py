"""Device.to_device on CUDA: a large pageable tensor that may wait (a stage's states at start-up or from a checkpoint)
is not copied through torch's pinned allocator, which rounds each block up to a power of two and keeps it
page-locked in its cache, counted by no budget; small ones still are, and so is one that may not wait (a batch) at
any size (the host does not wait for them)."""

from __future__ import annotations

import pytest
import torch

from mobiuspipe.memory.device import PIN_COPY_LIMIT, Device, upload_route
from mobiuspipe.standin.places import plain


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


# -- a buffer the Device page-locked itself is read in place (torch's is_pinned does not see it) -------------------
# cudaHostRegister locks the buffer's aligned bytes, which start past the start of the storage aligned_empty takes;
# torch's is_pinned() asks CUDA about the storage's start, so it answers False for every one of them (seen on an
# H200, torch 2.11). Taken for pageable, such a buffer was copied through torch's pinned allocator (a block of up to
# twice its size kept in its cache), and during a span with the host waiting (no upload a run makes hands it one
# today: the groundwork for those that will).
def _routes(monkeypatch) -> list[str]:
    from mobiuspipe.memory import device as device_module

    routes: list[str] = []
    route = device_module.upload_route
    monkeypatch.setattr(device_module, "upload_route", lambda *a, **k: routes.append(r := route(*a, **k)) or r)
    return routes


def test_a_buffer_the_device_page_locked_is_uploaded_in_place(monkeypatch):
    routes = _routes(monkeypatch)
    device = Device(0, use_cuda=False)
    try:
        t = torch.randn(4001)
        buf = device.host_empty(4 * t.numel()).view(torch.float32)
        buf.copy_(t)
        assert device.page_locked(buf) and device.page_locked(buf[1000:2000])
        assert not device.page_locked(torch.randn(4001))
        assert torch.equal(plain(device.to_device(buf)), t)
        with device.stepping():
            assert torch.equal(plain(device.to_device(buf[7:])), t[7:])
        assert routes == ["pinned", "pinned"]
    finally:
        device.close()


def test_a_buffer_made_during_a_span_is_pageable_until_it_ends(monkeypatch):
    routes = _routes(monkeypatch)
    device = Device(0, use_cuda=False)
    try:
        with device.stepping():
            buf = device.host_empty(4 * 300).view(torch.float32)
            assert not device.page_locked(buf)
            device.to_device(buf)
        assert device.page_locked(buf)
        device.to_device(buf)
        assert routes == ["pin", "pinned"]  # pageable in the span: to_device copies it with the host waiting
    finally:
        device.close()
