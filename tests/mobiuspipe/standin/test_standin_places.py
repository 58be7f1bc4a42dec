"""The strict stand-in's places (mobiuspipe.standin.places): a gpu's tensors and host tensors refuse to meet in one
op except through copies, as CUDA's do; and the host tiers take a device gradient only through a copy."""

from __future__ import annotations

import io
from functools import partial

import pytest
import torch

from mobiuspipe.memory.device import Device
from mobiuspipe.memory.store.ssd_store import SSDStore
from mobiuspipe.memory.weight_stream import SsdWeights
from mobiuspipe.optim import CPUAdam
from mobiuspipe.runtime.states import HostStates
from mobiuspipe.standin import StandInError
from mobiuspipe.standin.places import on_gpu, on_host, place_of, read_waiting


@pytest.fixture
def strict(monkeypatch):
    monkeypatch.setenv("MOBIUSPIPE_STRICT", "1")


def test_two_places_in_one_op_fail_but_copies_pass(strict):
    host, gpu = on_host(torch.zeros(5)), on_gpu(torch.arange(5.0), 1)
    with pytest.raises(StandInError, match="mixes tensors in gpu 1's memory and host memory"):
        host.add_(gpu)
    with pytest.raises(StandInError, match="mixes"):
        torch.cat([gpu, on_gpu(torch.ones(2), 0)])
    host.copy_(gpu)
    host[1:3] = gpu[:2]
    assert host.tolist() == [0.0, 0.0, 1.0, 3.0, 4.0]
    assert place_of(gpu * 2 + torch.ones(5)) == "gpu 1's memory"  # results keep the place; unmarked ones mix
    assert place_of(host.float()) == "host memory"


def test_a_0d_host_tensor_meets_a_gpu_one_in_elementwise_ops_only(strict):
    """CUDA moves a 0-d host tensor into an elementwise op on a gpu, never a 0-d gpu tensor into one on the host or
    another gpu (pytorch#119609, #38998), and joins (stack, cat) take one device's tensors only."""
    host, gpu = on_host(torch.arange(3.0)), on_gpu(torch.arange(3.0), 1)
    assert (gpu + host[2]).tolist() == [2.0, 3.0, 4.0] and place_of(gpu * host[1]) == "gpu 1's memory"
    for mixed in (
        lambda: host + gpu[0],
        lambda: on_gpu(torch.ones(3), 0).add(gpu[1]),
        lambda: torch.stack([gpu[0], host[0]]),
        lambda: torch.stack([gpu[0], on_gpu(torch.ones(2), 0)[0]]),
    ):
        with pytest.raises(StandInError, match="mixes"):
            mixed()
    assert torch.stack([gpu[0], gpu[2]]).tolist() == [0.0, 2.0]


READS = {
    "__bool__": bool,
    "__float__": float,
    "__int__": lambda t: int(t.long()),
    "item": lambda t: t.item(),
    "tolist": lambda t: t.tolist(),
    "numpy": lambda t: t.numpy(),
    "nonzero": torch.nonzero,
    "unique": torch.unique,
    "masked_select": lambda t: t.masked_select(t > 0),
    "__getitem__": lambda t: t.reshape(-1)[t.reshape(-1) > 0],
    "__index__": lambda t: [7, 8][t.long()],
}


@pytest.mark.parametrize("read", list(READS), ids=list(READS))
def test_a_host_read_of_a_gpus_tensor_fails_during_a_pass_only(strict, read):
    """On CUDA a read of a gpu's values on the host waits for the compute stream: inside a pass of the schedule
    (Device.stepping) the strict stand-in refuses it; a host tensor's read, and any read outside a pass, pass."""
    gpu, host = on_gpu(torch.tensor(1.0), 0), on_host(torch.tensor(1.0))
    device = Device(0, use_cuda=False)
    try:
        with device.stepping():
            with pytest.raises(StandInError, match=r"reads gpu 0's memory on the host during a pass"):
                READS[read](gpu)
            READS[read](host)
            READS[read](torch.tensor(1.0))
            assert place_of(gpu.reshape(1)[0:1]) == "gpu 0's memory"  # indexing that reads no value
            assert read_waiting(gpu.reshape(1)) == [1.0]  # a read the caller means (a shape header)
        READS[read](gpu)
    finally:
        device.close()


def test_naming_a_device_on_a_placed_tensor_fails(strict):
    gpu = on_gpu(torch.ones(3), 0)
    for move in (lambda: gpu.to("cpu"), lambda: gpu.cpu(), lambda: gpu.to(torch.device("cpu"), torch.float16)):
        with pytest.raises(StandInError, match="use Device.to_device or Device.to_host"):
            move()
    assert place_of(gpu.to(torch.bfloat16)) == "gpu 0's memory"


def test_placed_tensors_save_as_plain_ones(strict):
    buf = io.BytesIO()
    torch.save({"w": on_gpu(torch.arange(4.0), 3)}, buf)
    buf.seek(0)
    back = torch.load(buf)["w"]
    assert type(back) is torch.Tensor and back.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_device_copies_mark_both_ends(strict):
    device = Device(1, use_cuda=False)
    x = torch.randn(4, 3)
    on = device.to_device(x, torch.bfloat16)
    assert place_of(on) == "gpu 1's memory" and on.dtype == torch.bfloat16
    back = device.to_host(on)
    assert place_of(back) is None and torch.equal(back, x.to(torch.bfloat16))
    assert place_of(device.pin(torch.zeros(2))) == "host memory" and place_of(device.empty((2,), torch.int64))
    device.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_states_accumulate_a_device_gradient(strict, dtype):
    """Gradient accumulation adds the second pass's device gradient to the host's: through a copy on CUDA."""
    device = Device(0, use_cuda=False)
    states = HostStates(torch.randn(37), dtype, device.pin, partial(CPUAdam))
    g1, g2 = torch.randn(37).to(dtype), torch.randn(37).to(dtype)
    states.take_grads(device.to_device(g1), device, accumulate=False)
    states.take_grads(device.to_device(g2), device, accumulate=True, norm=True)
    assert torch.equal(states.grad_slice(0, 37), g1 + g2)
    device.close()


def test_ssd_weights_accumulate_a_device_gradient(strict, tmp_path):
    device = Device(0, use_cuda=False)
    with SSDStore(tmp_path / "ssd") as store:
        stream = SsdWeights(store, "s0/lowp", torch.randn(3000), 1024, device.host_empty)
        g1, g2 = torch.randn(3000), torch.randn(3000)
        stream.save_grads(device.to_device(g1), _copy, check_finite=True)
        stream.save_grads(device.to_device(g2), _copy, check_finite=True, accumulate=True, norm=True)
        assert torch.equal(stream.read_grads(0, 3000), g1 + g2) and stream.finite
    device.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_master_is_pinned_only_where_the_device_loads_it(strict, dtype):
    """fp32 loads the master itself (pinned); bf16 loads its low-precision copy, so the master stays pageable."""
    device = Device(0, use_cuda=False)
    states = HostStates(torch.randn(9), dtype, device.pin, partial(CPUAdam))
    assert place_of(states.weights) == "host memory"
    assert place_of(states.master.data) == ("host memory" if dtype == torch.float32 else None)
    device.close()


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)
