"""A load into an arena slot waits for the compute that used the slot, not for the compute queued since."""

import pytest
import torch

from mobiuspipe.memory.arena import DeviceArena
from mobiuspipe.memory.device import Device
from mobiuspipe.optim import CPUAdam
from mobiuspipe.runtime.states import HostStates
from mobiuspipe.standin.places import plain


def _setup(cuda: bool, numel: int):
    device = Device(0, use_cuda=cuda)
    arena = DeviceArena(numel * 4, 1, device.torch_device, place=device.place)  # one slot: the load reuses it
    states = HostStates(torch.randn(numel), torch.float32, device.pin, lambda ps: CPUAdam(ps))
    return device, arena, states


def test_a_released_slot_carries_its_compute_mark_to_the_next_load():
    device, arena, states = _setup(False, 1000)
    slot = arena.acquire(4000, "stage 0 weights")
    arena.release(slot, [device.computed()])
    again = arena.acquire(4000, "stage 1 weights")
    busy = again.take_busy()
    assert len(busy) == 1 and busy[0].done()  # the stand-in's compute is synchronous: the mark has passed
    load = states.load_into(again.view(torch.float32, 1000), device, busy)
    load.synchronize()
    assert torch.equal(plain(again.view(torch.float32, 1000)), states.master_weights())
    device.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_load_runs_while_later_compute_still_runs():
    device, arena, states = _setup(True, 1 << 20)
    slot = arena.acquire(4 << 20, "stage 0 weights")
    slot.view(torch.float32, 1 << 20).mul_(2.0)  # compute that uses the slot, then its release
    arena.release(slot, [device.computed()])
    torch.cuda._sleep(400_000_000)  # ~0.2 s of compute queued after the release, on another stage's slot
    again = arena.acquire(4 << 20, "stage 1 weights")
    load = states.load_into(again.view(torch.float32, 1 << 20), device, again.take_busy())
    load.synchronize()  # the copy has ended ...
    assert device.compute is not None and not device.compute.query()  # ... while the compute queued since runs
    torch.cuda.synchronize()
    assert torch.equal(again.view(torch.float32, 1 << 20).cpu(), states.master_weights())
    device.close()
