"""The reductions over a stage's gradients (mobiuspipe.memory.reduce). The squared L2 norm clipping reads (every step
with max_grad_norm): summed in float64 as the reference is, without a float64 copy of the whole gradient (8 bytes a
parameter: gigabytes of host memory for a large stage's gradients, counted by no budget). fp16's overflow check: the
answer torch.isfinite gives, without its temporaries."""

from __future__ import annotations

import pytest
import torch

from mobiuspipe.memory.reduce import all_finite, finite_flag, read_scalars, sum_of_squares
from mobiuspipe.standin.places import on_gpu
from tests.mobiuspipe.peak_rss import peak_growth_bytes


@pytest.mark.parametrize("n", [0, 1, 7, (1 << 20) + 3, 3 * (1 << 20) - 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_it_is_the_float64_sum_of_squares(n, dtype):
    t = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)
    want = float(t.double().square().sum())
    assert sum_of_squares(t) == pytest.approx(want, rel=1e-12, abs=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_it_makes_no_float64_copy_of_the_gradients(dtype):
    t = torch.randn(1 << 24).to(dtype)  # a float64 copy: 128 MiB
    sum_of_squares(t)  # the allocator's first growth is not the norm's copy
    assert peak_growth_bytes(lambda: sum_of_squares(t)) < 48 << 20  # a chunk's cast or two, and the allocator's slack


def test_the_gpu_resident_states_take_the_norm_without_a_float64_copy():
    """memory.optimizer: device (LoRA's adapters on the gpu): the norm is taken on the device, where a float64 copy
    of the gradients is memory the plan does not count; its value is the float64 sum of squares."""
    from functools import partial

    from mobiuspipe.memory.device import Device
    from mobiuspipe.optim import CPUAdam
    from mobiuspipe.optim.hyper import AdamHyper
    from mobiuspipe.runtime.states import DeviceStates

    n = 1 << 24  # a float64 copy: 128 MiB
    device = Device(0, use_cuda=False)
    try:
        states = DeviceStates(torch.zeros(n), torch.float32, device, AdamHyper.of(partial(CPUAdam)))
        src = device.to_device(torch.randn(n, generator=torch.Generator().manual_seed(1)))
        states.take_grads(src, device, norm=True)  # the allocator's first growth is not the norm's copy
        grew = peak_growth_bytes(lambda: states.take_grads(src, device, norm=True))
        want = float(device.to_host(src).double().square().sum())
        assert states.grad_sumsq() == pytest.approx(want, rel=1e-12, abs=0.0)
        assert grew < 48 << 20
    finally:
        device.close()


@pytest.mark.parametrize("n", [1, 2, 7, (1 << 20) + 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_is_torchs_isfinite_all(n, dtype):
    g = torch.Generator().manual_seed(n)
    t = (torch.randn(n, generator=g) * 1e3).to(dtype)
    assert all_finite(t) and all_finite(t[:0])
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in {0, n // 2, n - 1}:
            wrong = t.clone()
            wrong[at] = bad
            assert not all_finite(wrong) and not bool(torch.isfinite(wrong).all())
    big = torch.full((n,), torch.finfo(dtype).max, dtype=dtype)  # the largest finite value is finite
    assert all_finite(big) and all_finite(-big)


def test_read_scalars_reads_each_device_once_and_keeps_the_order(monkeypatch):
    """Numbers pass as they are; the tensors of a device (gpu 0, gpu 1 and unmarked host here) are read in one copy
    each, every value back in its place, a float64 norm exactly and a finiteness flag as 1.0 or 0.0."""
    g = torch.Generator().manual_seed(11)
    norm0, norm1 = (torch.randn(5, generator=g, dtype=torch.float64).square().sum() for _ in range(2))
    values = [
        2.5,
        on_gpu(norm0, 0),
        finite_flag(on_gpu(torch.tensor([1.0, float("inf")]), 1)),
        True,
        on_gpu(finite_flag(torch.ones(3, dtype=torch.float16)), 0),
        on_gpu(norm1, 1),
        torch.tensor(-0.75),
    ]
    stacks = []
    stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda ts, *a, **k: stacks.append(len(ts)) or stack(ts, *a, **k))
    got = read_scalars(values)
    assert got == [2.5, float(norm0), 0.0, 1.0, 1.0, float(norm1), -0.75]
    assert sorted(stacks) == [1, 2, 2]  # host; gpu 0; gpu 1
