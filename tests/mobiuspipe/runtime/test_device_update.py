"""The gpu-resident states' update (memory.optimizer: device, LoRA's adapters on the gpu): torch's AdamW, bit for bit,
in working memory the plan counts (partition.rules.placement.gpu_state_bytes) however large the stage."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from mobiuspipe.memory.device import Device
from mobiuspipe.optim import CPUAdam
from mobiuspipe.optim.hyper import AdamHyper
from mobiuspipe.runtime.states import DeviceStates
from partition.rules.placement import gpu_state_bytes
from tests.mobiuspipe.peak_rss import peak_growth_bytes

HYPER: dict = dict(lr=3e-3, betas=(0.85, 0.97), eps=1e-7, weight_decay=0.05)


@pytest.fixture
def device():
    d = Device(0, use_cuda=False)
    yield d
    d.close()


@pytest.mark.parametrize("n", [1, 7, (1 << 20) + 3, (5 << 19) - 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_update_is_torchs_adamw_bit_for_bit(device, n, dtype):
    """Three updates (a grad scale, then none, an lr change, an accumulated gradient) against torch.optim.AdamW over
    the fp32 master with the gradient it would be given: the master, both moments and the loaded weights equal."""
    g = torch.Generator().manual_seed(n)
    flat = torch.randn(n, generator=g)
    states = DeviceStates(flat, dtype, device, AdamHyper.of(partial(CPUAdam, **HYPER)))
    ref = torch.nn.Parameter(flat.clone())
    opt = torch.optim.AdamW([ref], **HYPER)
    for scale, lr, parts in ((1024.0, None, 1), (1.0, 1e-3, 2), (8.0, 2e-3, 1)):
        grads = [(torch.randn(n, generator=g) * scale).to(dtype) for _ in range(parts)]
        for k, part in enumerate(grads):
            states.take_grads(device.to_device(part), device, accumulate=k > 0)
        states.step(scale, lr)
        whole = grads[0].clone()
        for part in grads[1:]:
            whole.add_(part)  # in the gradients' dtype, as the resident ones accumulate
        ref.grad = whole.float() if scale == 1.0 else whole.float().mul_(1.0 / scale)
        if lr is not None:
            opt.param_groups[0]["lr"] = lr
        opt.step()
        loaded = device.empty((n,), dtype)
        states.load_into(loaded, device)
        assert torch.equal(device.to_host(loaded), ref.data.to(dtype))
        assert torch.equal(device.to_host(states.master.data), ref.data)
        state = states.optimizer.state[states.master]
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(device.to_host(state[k]), opt.state[ref][k])
        assert float(state["step"]) == float(opt.state[ref]["step"])
    assert torch.equal(device.to_host(states.master_weights()), ref.data)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_update_works_in_the_memory_the_plan_counts(device, dtype):
    """The update's working memory (beyond the states) is at most what gpu_state_bytes counts beyond them: a
    stage of 16M parameters once took a float32 copy of its gradients and AdamW's stage-sized temporaries (128 MiB
    measured here in fp32) that no plan counted."""
    n = 1 << 24
    states = DeviceStates(torch.zeros(n), dtype, device, AdamHyper.of(partial(CPUAdam, **HYPER)))
    src = device.to_device(torch.randn(n).to(dtype))
    counted = gpu_state_bytes([n], torch.finfo(dtype).bits // 8) - _state_bytes(states)
    for _ in range(2):  # the allocator's first growth is not the update's
        states.take_grads(src, device)
        states.step(4.0)
        # applies the noted update (and copies the master out: n * 4 bytes)
        grew = peak_growth_bytes(states.master_weights) - n * 4
    assert grew <= counted + (16 << 20)  # the allocator's slack


def _state_bytes(states: DeviceStates) -> int:
    return sum(t.numel() * t.element_size() for t in states.tensors().values())


def test_the_finite_check_works_in_a_chunks_memory(device):
    """fp16's overflow check (grads_finite, every step) once made a bool of every gradient (32 MiB here, a byte a
    parameter no plan counts); it checks a chunk at a time. Its answer is the same: an inf or a nan anywhere, the
    last element too, is found."""
    n = 1 << 25
    states = DeviceStates(torch.zeros(n), torch.float16, device, AdamHyper.of(partial(CPUAdam, **HYPER)))
    grads = torch.randn(n).to(torch.float16)
    states.take_grads(device.to_device(grads), device)
    assert states.grads_finite()
    assert peak_growth_bytes(states.grads_finite) <= 4 << 20
    for at, bad in ((n - 1, float("inf")), (12345, float("nan")), ((1 << 20) + 1, float("-inf"))):
        wrong = grads.clone()
        wrong[at] = bad
        states.take_grads(device.to_device(wrong), device)
        assert not states.grads_finite()
