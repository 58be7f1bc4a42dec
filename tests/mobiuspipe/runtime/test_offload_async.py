"""The gradient offload runs on the copy-out stream: OFFLOAD returns while the copy waits its turn, whoever reads
the gradients (the update, the norm, a tied half) waits for it, and the freed slot is refilled only after it."""

from __future__ import annotations

import threading
from functools import partial

import pytest
import torch

from mobiuspipe.memory.arena import DeviceArena
from mobiuspipe.memory.device import Device
from mobiuspipe.optim import CPUAdam
from mobiuspipe.runtime.states import HostStates
from tests.mobiuspipe.waits import ended_within


def _hold(gate: threading.Event) -> None:
    gate.wait()


@pytest.fixture
def held_stream():
    """A stand-in device whose copy-out stream is held until gate.set()."""
    device = Device(0, use_cuda=False)
    gate = threading.Event()
    device._out.run(partial(_hold, gate))  # the stream is busy until the gate opens
    yield device, gate
    gate.set()
    device.close()


@pytest.mark.parametrize("accumulate", [False, True])
def test_take_grads_returns_before_the_copy_and_readers_wait_for_it(held_stream, accumulate):
    device, gate = held_stream
    states = HostStates(torch.zeros(1000), torch.float32, device.pin, partial(CPUAdam))
    first, second = torch.randn(1000), torch.randn(1000)
    if accumulate:
        states.make_accumulation_buffer()
        gate.set()
        states.take_grads(device.to_device(first), device)
        gate.clear()
        device._out.run(partial(_hold, gate))
    copy = states.take_grads(device.to_device(second), device, accumulate=accumulate, norm=True)
    assert not copy.done()  # the compute thread goes on while the copy waits for the stream
    gate.set()
    want = first + second if accumulate else second
    assert states.grad_sumsq() == pytest.approx(float(want.double().square().sum()), rel=1e-12)
    assert torch.equal(states.grad_slice(0, 1000), want) and copy.done()


def test_a_slot_freed_under_a_copy_is_refilled_after_it(held_stream):
    device, gate = held_stream
    arena = DeviceArena(4096, 1, device.torch_device, place=device.place)
    slot = arena.acquire(4096, "gradients")
    slot.data.fill_(7)
    host = device.pin(torch.zeros(4096, dtype=torch.uint8))
    copy = device.copy_out(host, slot.data)
    arena.release(slot, [copy])
    again = arena.acquire(4096, "weights")
    busy = again.take_busy()
    assert busy == [copy] and not copy.done()
    gate.set()
    for c in busy:
        c.wait()
    again.data.fill_(1)  # the new holder writes only now
    assert bool((host == 7).all())


def test_the_device_tier_frees_the_gradient_slot_after_the_compute_that_reads_it(monkeypatch):
    """DeviceStates copies the slot's gradients on the compute stream: the slot goes back with a mark after that work
    (Device.computed), so a load on a copy stream into it waits for the copy (on CUDA the mark is an event)."""
    from mobiuspipe.memory.streams import CopyHandle
    from mobiuspipe.optim.hyper import AdamHyper
    from mobiuspipe.runtime.states import DeviceStates

    device = Device(0, use_cuda=False)
    try:
        states = DeviceStates(torch.zeros(10), torch.float32, device, AdamHyper.of(partial(CPUAdam)))
        mark = CopyHandle()
        monkeypatch.setattr(device, "computed", lambda: mark)  # what a CUDA device records on its compute stream
        src = device.to_device(torch.arange(10.0))
        assert states.take_grads(src, device) is mark
        assert states.take_grads(src, device, accumulate=True) is mark
        assert device.to_host(states.grads).tolist() == [2.0 * i for i in range(10)]
    finally:
        device.close()


@pytest.fixture
def ssd_stream(held_stream, tmp_path):
    """SsdStreamStates of 5000 fp32 elements in groups of 1024, on the held device, and their first weights."""
    from mobiuspipe.memory.store.ssd_store import SSDStore
    from mobiuspipe.optim.hyper import AdamHyper
    from mobiuspipe.runtime.states import SsdStreamStates, SsdTier, least_share

    device, gate = held_stream
    with SSDStore(tmp_path / "job") as store:
        tier = SsdTier(store, least_share(4), AdamHyper.of(partial(CPUAdam)))
        weights = torch.randn(5000)
        states = SsdStreamStates(weights, torch.float32, tier, "s0", device.host_empty)
        assert len(states.stream.groups) == 5
        yield device, gate, states, weights
        gate.set()
        states.grad_sumsq()  # the offload in flight ends before the store closes


@pytest.mark.parametrize("accumulate", [False, True])
def test_the_ssd_stream_takes_grads_off_the_compute_thread(ssd_stream, accumulate):
    """The d records are written on the copy-out stream's side, group by group: take_grads returns while the copies
    wait their turn, and whoever reads the gradients waits for the offload."""
    device, gate, states, _ = ssd_stream
    first, second = torch.randn(5000), torch.randn(5000)
    if accumulate:
        gate.set()
        states.take_grads(device.to_device(first), device)
        states.grad_sumsq()
        gate.clear()
        device._out.run(partial(_hold, gate))
    copy = states.take_grads(device.to_device(second), device, accumulate=accumulate, norm=True)
    assert copy is not None and not copy.done()  # the compute thread goes on
    gate.set()
    want = first + second if accumulate else second
    assert states.grad_sumsq() == pytest.approx(float(want.double().square().sum()), rel=1e-12)
    assert torch.equal(states.grad_slice(0, 5000), want) and copy.done()


def test_a_load_of_the_ssd_stream_waits_for_its_offload(ssd_stream):
    """LOAD and OFFLOAD share the stage's staging buffers: a load issued while the offload waits for the stream
    starts after it, and both move the right bytes."""
    device, gate, states, weights = ssd_stream
    grads = torch.randn(5000)
    states.take_grads(device.to_device(grads), device)
    dst = device.to_device(torch.zeros(5000))
    load = states.load_into(dst, device)
    assert not load.done()
    gate.set()
    load.wait()
    assert torch.equal(device.to_host(dst), weights)
    assert torch.equal(states.grad_slice(0, 5000), grads)


@pytest.mark.gpu
def test_a_copy_after_an_offload_jobs_handle_waits_for_the_job():
    """A slot freed under an SSD offload (a job's handle, not an event) is refilled only after the job's copies: a
    CUDA stream cannot wait for a host job, so the issuing thread does (the stand-in's copy stream waits as well).
    Runs on the GPU where there is one (gpu_check's `-m gpu`), on the stand-in otherwise."""
    device = Device(0)
    gate = threading.Event()
    try:
        src = device.to_device(torch.full((1 << 20,), 7.0))
        host = device.pin(torch.zeros(1 << 20))

        def job(copy, copied) -> None:
            gate.wait()
            copy(host, src)

        copies, whole = device.stream_out(job)
        timer = threading.Timer(0.2, gate.set)
        timer.start()
        device.copy_in(src, device.pin(torch.ones(1 << 20)), [copies]).synchronize()
        whole.result()
        timer.join()
        assert bool((host == 7).all()) and bool((device.to_host(src) == 1).all())
    finally:
        gate.set()
        device.close()


def test_a_failed_offload_fails_the_next_one_of_its_stage(ssd_stream, monkeypatch):
    """An accumulation pass's offload adds to the records the one before wrote: that one's error is its too, so that
    settling the last offload reports it (not the records it could not read)."""
    device, gate, states, _ = ssd_stream
    gate.set()
    save, calls = states.stream.save_grads, []

    def first_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return save(*args, **kwargs)

    monkeypatch.setattr(states.stream, "save_grads", first_fails)
    states.take_grads(device.to_device(torch.randn(5000)), device)
    states.take_grads(device.to_device(torch.randn(5000)), device, accumulate=True)
    with pytest.raises(OSError, match="No space left"):
        states.grad_sumsq()
    states._offload = None  # the fixture's teardown settles the stage


class _HeldWrite:
    """A write that happens when its result is asked for, once `gate` is open (the drive holding it till then)."""

    def __init__(self, put_async, key: str, t: torch.Tensor, gate: threading.Event):
        self.put_async, self.key, self.t, self.gate = put_async, key, t, gate
        self.written = False

    def done(self) -> bool:
        return self.written

    def result(self, timeout=None):
        assert self.gate.wait(30), "the test never opened the writes"
        if not self.written:
            self.put_async(self.key, self.t).result()
            self.written = True


def test_the_slot_is_free_at_the_last_copy_off_the_device_not_the_last_write(held_stream, tmp_path, monkeypatch):
    """The handle OFFLOAD releases the gradient slot with ends once every group is in a staging buffer: the next
    holder need not wait for the SSD's writes (held here), which the readers of the gradients do wait for."""
    from mobiuspipe.memory.store.ssd_store import SSDStore
    from mobiuspipe.optim.hyper import AdamHyper
    from mobiuspipe.runtime.states import SsdStreamStates, SsdTier, least_share

    device, gate = held_stream
    gate.set()
    writes = threading.Event()
    with SSDStore(tmp_path / "job") as store:
        tier = SsdTier(store, least_share(4), AdamHyper.of(partial(CPUAdam)))
        states = SsdStreamStates(torch.randn(3000), torch.float32, tier, "s0", device.host_empty)
        assert len(states.stream.groups) == 3  # each fits a staging buffer of its own: no fill waits for a write
        put_async = store.put_async
        monkeypatch.setattr(store, "put_async", lambda key, t: _HeldWrite(put_async, key, t, writes))
        grads = torch.randn(3000)
        copies = states.take_grads(device.to_device(grads), device)
        copies.wait()  # the slot may be refilled now
        offload = states._offload
        assert offload is not None and not any(w.done() for w in offload.result())  # the writes wait for the drive
        writes.set()
        assert torch.equal(states.grad_slice(0, 3000), grads)


def test_a_stages_offload_does_not_wait_for_another_stages_writes(held_stream, tmp_path, monkeypatch):
    """The offload jobs run one at a time, but a job ends once its writes are issued: the next stage's gradients come
    off the device (and its slot is freed) while the stage before's writes still wait for the drive; whoever reads a
    stage's gradients waits for its own writes."""
    import time

    from mobiuspipe.memory.store.ssd_store import SSDStore
    from mobiuspipe.optim.hyper import AdamHyper
    from mobiuspipe.runtime.states import SsdStreamStates, SsdTier, least_share

    device, gate = held_stream
    gate.set()
    writes = threading.Event()
    with SSDStore(tmp_path / "job") as store:
        tier = SsdTier(store, least_share(4), AdamHyper.of(partial(CPUAdam)))
        first, second = (
            SsdStreamStates(torch.randn(3000), torch.float32, tier, f"s{j}", device.host_empty) for j in (0, 1)
        )
        put_async = store.put_async
        monkeypatch.setattr(store, "put_async", lambda key, t: _HeldWrite(put_async, key, t, writes))
        g1, g2 = torch.randn(3000), torch.randn(3000)
        first.take_grads(device.to_device(g1), device)
        copies = second.take_grads(device.to_device(g2), device)
        deadline = time.monotonic() + 10
        while not copies.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert copies.done()  # the first stage's writes are still held
        writes.set()
        assert torch.equal(first.grad_slice(0, 3000), g1) and torch.equal(second.grad_slice(0, 3000), g2)


def test_a_backward_visit_takes_the_slot_an_offload_still_reads_and_waits_only_to_clear_it(held_stream):
    """The visit's recompute forward does not touch the gradient slot: begin_backward returns while the previous
    stage's offload still reads it (on CUDA its D2H; with SSD weights a host wait for the job), and zero_grads, before
    the first backward, waits for that offload. Both stages' gradients come out as plain PyTorch's."""
    import copy

    from torch import nn

    from mobiuspipe.runtime.stage import Stage
    from mobiuspipe.standin.places import plain

    device, gate = held_stream
    torch.manual_seed(0)
    layers = [nn.Linear(6, 5), nn.Linear(6, 5)]
    reference = copy.deepcopy(layers)
    stages = [Stage(j, {j: layer}, device, partial(CPUAdam, lr=0.01)) for j, layer in enumerate(layers)]
    arena = DeviceArena(
        stages[0].weight_nbytes, 2, device.torch_device, place=device.place, grad_slot_bytes=stages[0].nbytes
    )
    x = torch.randn(3, 6)
    last, before = stages
    last.load(arena)
    last.wait_loaded()
    last.begin_backward(arena)
    out = last.forward(device.place(x.clone()), with_grad=True)
    last.zero_grads()  # before the visit's first backward
    out.sum().backward()
    last.offload(arena)  # its copy waits for the held stream
    before.load(arena)
    before.wait_loaded()
    worker = device.executor("compute")
    took = worker.submit(before.begin_backward, arena)
    returned = ended_within(took, 5)
    gate.set()
    took.result()
    worker.shutdown()
    assert returned, "begin_backward waited for the last stage's offload"
    out = before.forward(device.place(x.clone()), with_grad=True)
    before.zero_grads()
    out.sum().backward()
    for layer in reference:
        layer(x).sum().backward()
    assert before.grads is not None
    got = plain(before.grads.view(torch.float32, before.numel))
    assert torch.equal(got.sort().values, _grads_of(reference[0]).sort().values)
    assert torch.equal(last.states.grad_slice(0, last.numel).sort().values, _grads_of(reference[1]).sort().values)


def _grads_of(layer: torch.nn.Linear) -> torch.Tensor:
    w, b = layer.weight.grad, layer.bias.grad
    assert w is not None and b is not None
    return torch.cat([w.flatten(), b.flatten()])
