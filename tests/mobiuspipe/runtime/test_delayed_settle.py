"""With the delayed update (two versions of the gradients), update n reads gradient version n % 2, whose offload
ended with step n; it must not wait for step n+1's offload, into the other version. On CUDA the compute thread runs
ahead of the GPU and issues step n+1's OFFLOAD long before the GPU reaches it, and the updater, the bottleneck of a
delayed run, would sit idle until then. Emulated by a held copy-out stream (the GPU not there yet): update n ends
while step n+1's offload is still held, and equals the same update run after it."""

from __future__ import annotations

import threading
from functools import partial

import pytest
import torch

from mobiuspipe.memory.device import Device
from mobiuspipe.memory.store.ssd_store import SSDStore
from mobiuspipe.optim import CPUAdam
from mobiuspipe.optim.hyper import AdamHyper
from mobiuspipe.runtime.states import HostStates, SsdStreamStates, SsdTier, least_share
from tests.mobiuspipe.waits import ended_within

N = 5000


def _states(kind: str, device: Device, store: SSDStore, flat: torch.Tensor):
    if kind == "host":
        return HostStates(flat, torch.bfloat16, device.pin, partial(CPUAdam, lr=1e-2), versions=2)
    tier = SsdTier(store, 2 * least_share(4), AdamHyper.of(partial(CPUAdam, lr=1e-2)))
    return SsdStreamStates(flat, torch.bfloat16, tier, "s0", device.host_empty, versions=2)


def _updated(kind: str, tmp_path, hold: bool) -> torch.Tensor:
    """Version 1 of the weights after update n, issued once step n+1's offload is in flight (held, or let through
    before the update when hold is False)."""
    device = Device(0, use_cuda=False)
    g = torch.Generator().manual_seed(7)
    flat, grad_n, grad_n1 = (torch.randn(N, generator=g) for _ in range(3))
    with SSDStore(tmp_path / f"{kind}-{hold}") as store:
        states = _states(kind, device, store, flat)
        states.take_grads(device.to_device(grad_n, torch.bfloat16), device, into=0)  # step n's OFFLOAD
        states.grad_sumsq()  # it ended with step n
        gate = threading.Event()
        # the GPU has not reached step n+1's backward of this stage
        device._out.run(lambda: None if gate.wait() else None)
        states.take_grads(device.to_device(grad_n1, torch.bfloat16), device, into=1)  # step n+1's, issued ahead
        if not hold:
            gate.set()
        updater = device.executor("host-optimizer")
        update_n = updater.submit(states.step, 1.0, None, 0, 1)  # gradients of version 0 -> weights of version 1
        ended = ended_within(update_n, 5)
        gate.set()
        update_n.result()
        updater.shutdown()
        states.grad_sumsq()  # step n+1's offload ends before the store closes
        out = states.version(1).clone()
    device.close()
    assert ended, "update n waited for step n+1's offload, into the other gradient version"
    return out


@pytest.mark.parametrize("kind", ["host", "ssd"])
def test_update_n_does_not_wait_for_step_n_plus_1s_offload(kind, tmp_path):
    held = _updated(kind, tmp_path, hold=True)
    assert torch.equal(held, _updated(kind, tmp_path, hold=False))
