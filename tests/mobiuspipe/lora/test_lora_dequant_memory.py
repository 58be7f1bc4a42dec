"""The memory a quantized frozen base takes while it computes: dequantizing a weight (each forward, recompute and
backward) allocates the weight in the compute dtype and a bounded chunk's temporaries, not several copies of it."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mobiuspipe.lora.quant import Int8Linear, NF4Linear
from partition.spec.lora import DEQUANT_CHUNK, dequantized_bytes

pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")


class PeakBytes(TorchDispatchMode):
    """The most bytes the tensors made under it hold at once (each storage once; what existed before, and views or
    in-place results of it, not counted)."""

    def __init__(self):
        super().__init__()
        self.made: list[weakref.ref] = []
        self.peak = 0

    def _live(self) -> dict[int, int]:
        tensors = [t for t in (r() for r in self.made) if t is not None]
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        before = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)} - set(self._live())
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in before:
                self.made.append(weakref.ref(t))
        self.made = [r for r in self.made if r() is not None]
        self.peak = max(self.peak, sum(self._live().values()))
        return out


def _peak(fn) -> int:
    with PeakBytes() as p:
        fn()
    return p.peak


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_dequantizing_a_weight_takes_about_the_weight(kind, dtype):
    """A frozen quantized layer's forward: its peak beside its input is the dequantized weight (e bytes a weight),
    NF4's chunk of temporaries and the output; torchao's dequantization took 14 (NF4) and 7-9 (int8) bytes a
    weight."""
    torch.manual_seed(1)
    base = nn.Linear(1024, 512, bias=False)
    q = NF4Linear(base) if kind == "nf4" else Int8Linear(base)
    n = base.weight.numel()
    e = torch.finfo(dtype).bits // 8
    allowance = dequantized_bytes(n, e, kind)  # what the plan counts
    x = torch.randn(2, 1024, dtype=dtype)
    peak = _peak(lambda: q(x))
    assert peak <= allowance + 2 * 512 * e, f"{kind} {dtype}: {peak / n:.2f} bytes a weight"  # and the output


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_weight_of_several_chunks_dequantizes_bit_for_bit_within_the_count(dtype):
    """NF4 over three chunks (and a backward, which dequantizes again): torchao's values, cast to the dtype, bit for
    bit, and the peak within the count (one chunk's temporaries at a time)."""
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    torch.manual_seed(2)
    base = nn.Linear(2048, 1536, bias=False)
    with torch.no_grad():
        base.weight[0, :5] = torch.tensor([0.0, -0.0, 1e-30, 3.0, -3.0])  # zeros, a tiny and the largest values
    q = NF4Linear(base)
    want = nf4_tensor.to_nf4(base.weight.detach().bfloat16(), 64, 256).get_original_weight().to(dtype)
    n, e = base.weight.numel(), torch.finfo(dtype).bits // 8
    assert n > 2 * DEQUANT_CHUNK and torch.equal(q.weight().to(dtype), want)
    x = torch.randn(3, 2048, dtype=dtype, requires_grad=True)
    out = q(x)
    assert torch.equal(out, torch.nn.functional.linear(x.detach(), want))
    grad = torch.randn_like(out)
    peak = _peak(lambda: out.backward(grad))
    assert peak <= dequantized_bytes(n, e, "nf4") + x.nbytes, f"{peak / n:.2f} bytes a weight"
    assert x.grad is not None and torch.equal(x.grad, grad @ want)
