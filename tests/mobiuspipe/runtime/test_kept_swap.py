"""mobiuspipe.runtime.kept_swap: held tensors out to a tier as the spans of their storages and rebuilt after, with the
same values, shapes, strides, dtypes and alignment, views of one storage sharing one span again; a buffer's
storage stays; the ledger drops what went."""

from __future__ import annotations

import pytest
import torch

from mobiuspipe.memory.device import Device
from mobiuspipe.memory.ledger import DeviceLedger
from mobiuspipe.memory.swap import HostSwap
from mobiuspipe.runtime.activations import Held
from mobiuspipe.runtime.kept_swap import rebuild, release, spans_out

CPU_ALIGN = 64
"""The CPU allocator's alignment: a rebuilt tensor keeps its address modulo it."""


def _held(seed: int) -> tuple[list[Held], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(7, 13, generator=g)  # odd sizes: offsets that are not multiples of an alignment
    qkv = torch.randn(3, 5, 11, generator=g)
    ints = torch.randint(0, 50, (9,), generator=g)
    buffer = torch.randn(4, generator=g)
    tensors = [
        base[2:, 3:11],  # a strided slice at an odd offset
        base.t(),  # the same storage, transposed
        qkv[1].transpose(0, 1),  # a slice of a larger storage, transposed
        qkv[2, :, 4:],
        qkv.view(torch.int32)[0, 1:3],  # the same storage under another dtype
        ints,
        buffer,
        torch.empty(0, 3),
    ]
    return [Held(("kept", 0, 0, 0, n), t) for n, t in enumerate(tensors)], buffer


@pytest.mark.parametrize("seed", [1, 2])
def test_spans_come_back_as_the_same_tensors(seed):
    held, buffer = _held(seed)
    before = [h.t.clone() for h in held]  # type: ignore[union-attr]
    layouts = [(h.t.shape, h.t.stride(), h.t.dtype, h.t.data_ptr() % CPU_ALIGN) for h in held]  # type: ignore[union-attr]
    ledger = DeviceLedger()
    for h in held:
        ledger.hold(h.key, h.t)  # type: ignore[arg-type]
    device = Device(use_cuda=False)
    spans, layout = spans_out(held, {buffer.untyped_storage().data_ptr()}, device.in_memory)
    assert len(spans) == 3  # base, qkv (three views and a reinterpretation), ints; the buffer stays
    assert sum(s.numel() for s in spans) <= 7 * 13 * 4 + 3 * 5 * 11 * 4 + 9 * 8
    swap = HostSwap(device)
    swap.start_out((0, 0), spans)
    swap.finish_out((0, 0))
    del spans
    release(layout, ledger)
    assert [h.t is None for h in held] == [True] * 6 + [False, False]
    assert ledger.bytes == 4 * 4  # only the buffer is still on the device
    rebuild(layout, swap.finish_in((0, 0)))
    for h, want, (shape, stride, dtype, align) in zip(held, before, layouts):
        assert h.t is not None and torch.equal(h.t, want)
        assert (h.t.shape, h.t.stride(), h.t.dtype) == (shape, stride, dtype)
        if h.t.numel():
            assert h.t.data_ptr() % CPU_ALIGN == align
    assert held[0].t.untyped_storage().data_ptr() == held[1].t.untyped_storage().data_ptr()  # type: ignore[union-attr]
    assert held[6].t is buffer


def test_rebuild_refuses_the_wrong_number_of_spans():
    held, _ = _held(3)
    spans, layout = spans_out(held, set(), Device(use_cuda=False).in_memory)
    with pytest.raises(RuntimeError, match="2 spans came back from the swap tier; 4 went out"):
        rebuild(layout, spans[:2])


def test_a_held_tensor_in_host_memory_stays_where_it_is():
    """CUDA's memory-efficient attention saves its philox seed and offset as 0-d int64 host tensors, which its
    backward reads on the host with dropout; swapped out with the device tensors, they came back as device tensors
    (rebuild makes every span on the device), and that read would be of a device pointer. The stand-in's attention
    saves none, so only a host-marked tensor shows it."""
    from mobiuspipe.standin.places import on_gpu, on_host

    x, seed = on_gpu(torch.randn(64), 0), on_host(torch.tensor(7))
    held = [Held(("kept", 0, 0, 0, 0), x), Held(("kept", 0, 0, 0, 1), seed)]
    device = Device(0, use_cuda=False)
    other, unmarked = on_gpu(torch.ones(2), 1), torch.ones(2)
    assert [device.in_memory(t) for t in (x, seed, other, unmarked)] == [True, False, False, True]
    spans, layout = spans_out(held, set(), device.in_memory)
    assert len(spans) == 1 and [m.held for m in layout.members] == [held[0]]
