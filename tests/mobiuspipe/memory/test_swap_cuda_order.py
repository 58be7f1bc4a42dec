"""The activation tiers under CUDA's timing, emulated on the CPU stand-in: on CUDA a copy's wait() orders the
compute stream and returns at once, so the host races ahead of copies. Emulated here by a non-blocking wait and
slowed copies, the SSD and staged-peer tiers must keep their staging buffers bounded (a few held sets, not one
per microbatch) and still bring back every tensor bit for bit; a swap-in, which waits for the compute queued at
its start, runs on a stream of its own, so the loads issued after it do not queue behind it; and a mark of the
compute queued so far is taken only on the thread that queues the compute (the strict stand-in refuses it
elsewhere)."""

from __future__ import annotations

import os
import time
from concurrent.futures import Future

import pytest
import torch

from mobiuspipe.memory import streams
from mobiuspipe.memory.device import CopyHandle, Device
from mobiuspipe.memory.store.ssd_store import SSDStore
from mobiuspipe.memory.swap import HostSwap
from mobiuspipe.memory.swap_peer import PeerSwap, shm_region
from mobiuspipe.memory.swap_ssd import SsdSwap
from mobiuspipe.standin import StandInError
from mobiuspipe.standin.places import gpu_buffer
from tests.mobiuspipe.waits import ended_within

M = 8
"""Microbatches of the stage in the emulated step."""


def _held(g: torch.Generator) -> list[torch.Tensor]:
    """A stage's held set: the same sizes every microbatch, as a stage's are."""
    return [torch.randn(301, 5, generator=g), torch.randn(3, 77, generator=g).to(torch.bfloat16), torch.randn(999)]


@pytest.fixture
def as_on_cuda(monkeypatch):
    """wait() returns at once (CUDA: the compute stream waits, not the host) and each copy takes 10 ms."""
    real = streams._copy_after

    def slow(waits, dst, src):
        time.sleep(0.01)
        real(waits, dst, src)

    monkeypatch.setattr(streams, "_copy_after", slow)
    monkeypatch.setattr(CopyHandle, "wait", lambda self: None)


def _step(tier, device: Device, pool) -> tuple[int, dict, dict]:
    """All forwards (swap-out each, finish the one before), then all backwards (prefetch the one before): the
    pool's most buffers at any time, what went out and what came back."""
    g = torch.Generator().manual_seed(3)
    sent = {(0, i): [device.place(t) for t in _held(g)] for i in range(M)}
    want = {k: [t.clone() for t in ts] for k, ts in sent.items()}
    most = 0
    for k, ts in sent.items():
        tier.start_out(k, ts)
        if k[1] > 0:
            tier.finish_out((0, k[1] - 1))
        most = max(most, pool.buffers)
    tier.finish_out((0, M - 1))
    got = {}
    tier.start_in((0, M - 1))
    for i in reversed(range(M)):
        if i > 0:
            tier.start_in((0, i - 1))
        got[(0, i)] = tier.finish_in((0, i))
        most = max(most, pool.buffers)
    return most, want, got


def _check(device: Device, tier, want: dict, got: dict) -> None:
    tier.close()
    device.close()  # every copy has ended
    for k in want:
        for a, b in zip(got[k], want[k]):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_the_ssd_tiers_staging_stays_within_a_few_sets_when_the_host_runs_ahead(as_on_cuda, tmp_path):
    device = Device(1, use_cuda=False)
    with SSDStore(tmp_path / "act") as store:
        tier = SsdSwap(device, store)
        most, want, got = _step(tier, device, tier._pool)
        _check(device, tier, want, got)
    assert most <= 4 * 3, f"{most} staging buffers for {M} microbatches of 3 tensors"


def test_the_staged_peer_tiers_staging_stays_within_a_few_sets_when_the_host_runs_ahead(as_on_cuda, tmp_path):
    path = f"/dev/shm/mobiuspipe-test-{os.getpid()}-{tmp_path.name}"
    device = Device(0, use_cuda=False)
    try:
        tier = PeerSwap(device, gpu_buffer(shm_region(path, 1 << 20), 1), True, 1)
        most, want, got = _step(tier, device, tier.pool)
        _check(device, tier, want, got)
    finally:
        os.unlink(path)
    assert most <= 4 * 3, f"{most} staging buffers for {M} microbatches of 3 tensors"


def test_a_load_does_not_queue_behind_a_swap_in():
    """On CUDA a swap-in waits for the compute queued at its start (its fresh device tensors may be in use until
    then); a load on the same stream would wait too, and the next stage's weights would not overlap this one's
    compute. Emulated by a swap-in held back by an unfinished copy: a load issued after it still ends."""
    device = Device(0, use_cuda=False)
    tier = HostSwap(device)
    tier.start_out((0, 0), [device.place(torch.randn(100))])
    tier.finish_out((0, 0))
    gate: Future = Future()
    tier._wrote[(0, 0)] = [*tier._wrote[(0, 0)], CopyHandle(future=gate)]  # and a copy that has not ended
    tier.start_in((0, 0))
    slot, weights = device.empty((64,), torch.float32), torch.randn(64)
    load = device.copy_in(slot, weights, computed=False)._future
    assert load is not None
    try:
        done = ended_within(load, 5)
    finally:
        gate.set_result(None)
    tier.finish_in((0, 0))
    tier.close()
    device.close()
    assert done, "the load waited for the swap-in issued before it"
    assert torch.equal(slot, weights)


def test_a_mark_of_the_compute_is_taken_only_on_the_compute_thread(monkeypatch):
    monkeypatch.setenv("MOBIUSPIPE_STRICT", "1")
    device = Device(0, use_cuda=False)
    device.computed()  # the thread that made the Device queues its compute
    worker = device.executor("io")
    with pytest.raises(StandInError, match="the compute queued so far"):
        worker.submit(device.computed).result()
    with pytest.raises(StandInError, match="the compute queued so far"):
        worker.submit(device.copy_in, device.empty((4,), torch.float32), torch.zeros(4)).result()
    worker.shutdown()
    device.close()


# -- two accumulated passes: the second's swap-outs while the first's copies back may not have ended ---------------
def _passes(tier, device: Device, passes: int = 2) -> tuple[int, dict, dict]:
    """`passes` passes of _step's order with no host wait between them (a step's accumulated passes on CUDA): the
    host pool's most buffers at any time, and what went out and came back in the last pass."""
    most, want, got = 0, {}, {}
    for _ in range(passes):
        n, want, got = _step(tier, device, tier.pool)
        most = max(most, n)
    return most, want, got


def test_the_host_tiers_buffers_stay_within_one_pass_when_the_host_runs_a_pass_ahead(as_on_cuda):
    """On CUDA finish_in's wait returns at once, so a pass's buffers go back pending their copies back; the next
    pass's swap-outs found none free and page-locked new ones: twice the M * H_j of host memory the plan counts."""
    device = Device(0, use_cuda=False)
    tier = HostSwap(device)
    most, want, got = _passes(tier, device)
    _check(device, tier, want, got)
    assert most <= M * 3, f"{most} host buffers for {M} microbatches of 3 tensors"


def test_the_peer_region_the_plan_sizes_holds_two_passes_when_the_host_runs_a_pass_ahead(as_on_cuda, tmp_path):
    """A direct peer tier's region of region_bytes(M, H) (the plan's size) raised RegionFull in the second pass: its
    ranges went back pending the first pass's copies back, which had not ended."""
    from partition.rules.peer import region_bytes

    held = sum(t.numel() * t.element_size() for t in _held(torch.Generator()))
    path = f"/dev/shm/mobiuspipe-test-{os.getpid()}-{tmp_path.name}"
    device = Device(0, use_cuda=False)
    try:
        tier = PeerSwap(device, gpu_buffer(shm_region(path, region_bytes(M, held)), 1), False, 1)
        _, want, got = _passes(tier, device)
        _check(device, tier, want, got)
    finally:
        os.unlink(path)
