"""Quantized frozen base weights for LoRA, by torchao's implementations, quantized once as the layers are built and
dequantized on the device just before each use: NF4 (QLoRA's 4-bit NormalFloat with double-quantized per-block
scales: torchao's NF4Tensor) or int8 (symmetric, one float32 scale per output feature: torchao's weight-only
Int8Tensor, PerRow).

An NF4Linear holds the quantized weight of a frozen nn.Linear (or GPT-2's Conv1D) as frozen parameters of integer
dtypes, which the stage keeps in host memory and copies into its weight slot as they are (about 0.52 bytes per
weight instead of 2): `qdata` (uint8, two 4-bit codes per byte: n/2), `qscalers` (int8, one per block of 64: n/64),
`qfactor` (one per 256 blocks) and `qmean` (one), both bfloat16 kept as their int16 bits. The weight is quantized
from its bfloat16 value, as QLoRA does, and dequantizes to bfloat16 (then to the compute dtype): the same in every
training precision. The 16-value code table is a buffer. Its bias, if any, stays a floating parameter (the
training dtype). A weight whose size is not a multiple of 64 * 256 = 16,384
(torchao's blocks) stays in the training dtype, as do embeddings and norms.

An Int8Linear holds `qdata` (int8, [out, in]: GPT-2's Conv1D weight is transposed first, so that each scale
belongs to an output feature) and `qscale` (float32 kept as its int32 bits, one per output feature): 1 + 4 / in
bytes per weight. Every linear weight takes it. It is quantized from the bfloat16 value too, and dequantizes straight
to the compute dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from mobiuspipe.lora.layers import is_linear
from partition.spec.lora import DEQUANT_CHUNK, NF4_BLOCK, NF4_SCALER_BLOCK, nf4_quantizable

__all__ = ["NF4Linear", "Int8Linear", "QUANTIZERS", "quantize_frozen", "quantized", "quantizable"]


def _nf4():
    """torchao's NF4 module (mobiuspipe/__init__.py quiets torchao's import-time logs)."""
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    return nf4_tensor


def _int8():
    """torchao's Int8Tensor and PerRow."""
    from torchao.quantization.granularity import PerRow
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

    return Int8Tensor, PerRow


def quantizable(weight: torch.Tensor) -> bool:
    """Whether torchao's NF4 takes this weight: 2-D, its size a multiple of NF4_BLOCK * NF4_SCALER_BLOCK."""
    return weight.dim() == 2 and nf4_quantizable(weight.numel())


class NF4Linear(nn.Module):
    """A frozen linear layer whose weight is NF4 (see the module docstring); computes as its base with the weight
    torchao's NF4Tensor.get_original_weight gives back."""

    def __init__(self, base: nn.Module):
        super().__init__()
        weight = base.get_parameter("weight").detach()
        q = _nf4().to_nf4(weight.to(torch.bfloat16).contiguous(), NF4_BLOCK, NF4_SCALER_BLOCK)
        self.shape, self.conv1d = tuple(weight.shape), not isinstance(base, nn.Linear)
        self.qdata = nn.Parameter(q.quantized_data, requires_grad=False)
        self.qscalers = nn.Parameter(q.quantized_scalers, requires_grad=False)
        self.qfactor = nn.Parameter(q.quantization_factor.view(torch.int16), requires_grad=False)
        self.qmean = nn.Parameter(q.scaler_mean.reshape(1).view(torch.int16), requires_grad=False)
        self.register_buffer("nf4", q.nf4, persistent=False)
        bias = getattr(base, "bias", None)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def codes(self) -> tuple[torch.Tensor, ...]:
        """The tensors the weight is made from (see dequantize)."""
        return self.qdata, self.qscalers, self.qfactor, self.qmean, self.get_buffer("nf4")

    def weight(self) -> torch.Tensor:
        """The dequantized weight, bfloat16, in its base's layout ([out, in]; Conv1D's [in, out])."""
        return dequantize(self.shape, *self.codes())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _FrozenLinear.apply(x, partial(_nf4_weight, self.shape), self.conv1d, *self.codes())
        return out if self.bias is None else out + self.bias.to(out.dtype)


def _nf4_weight(shape: tuple[int, ...], *codes_and_dtype) -> torch.Tensor:
    *codes, dtype = codes_and_dtype
    return dequantize(shape, *codes, dtype=dtype)


class Int8Linear(nn.Module):
    """A frozen linear layer whose weight is int8 with a float32 scale per output feature (see the module
    docstring); computes as its base with the weight torchao's Int8Tensor.dequantize gives back."""

    def __init__(self, base: nn.Module):
        super().__init__()
        int8_tensor, per_row = _int8()
        weight = base.get_parameter("weight").detach()
        self.conv1d = not isinstance(base, nn.Linear)
        w = (weight.t() if self.conv1d else weight).to(torch.bfloat16).contiguous()  # [out, in]
        q = int8_tensor.from_hp(w, per_row())
        self.qdata = nn.Parameter(q.qdata, requires_grad=False)
        self.qscale = nn.Parameter(q.scale.view(torch.int32), requires_grad=False)
        bias = getattr(base, "bias", None)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def codes(self) -> tuple[torch.Tensor, ...]:
        """The tensors the weight is made from (see dequantize_int8)."""
        return self.qdata, self.qscale

    def weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The dequantized weight in `dtype`, [out, in] (a Conv1D's too: the transpose of its base's)."""
        return dequantize_int8(self.qdata, self.qscale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _FrozenLinear.apply(x, dequantize_int8, False, *self.codes())
        return out if self.bias is None else out + self.bias.to(out.dtype)


def dequantize_int8(qdata: torch.Tensor, qscale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An int8 weight ([out, in]) dequantized to `dtype`, bit for bit as torchao's Int8Tensor.dequantize gives it
    (each value times its row's float32 scale, computed in float32 and rounded once to `dtype`; symmetric: no zero
    point), over tensors wherever they are (the stage's weight slot). In place in the result: the weight in `dtype`
    is all it allocates (torchao's takes 7-9 bytes a weight: a copy, a float32 product, the cast)."""
    w = qdata.to(dtype)  # exact: an int8 value fits each dtype's significand
    return w.mul_(qscale.view(torch.float32).view(-1, 1))  # computed in float32, rounded once into w


def _pairs(table: torch.Tensor) -> torch.Tensor:
    """The two bfloat16 values of every byte of NF4 codes (high nibble first, as torchao interleaves them): [256, 2]."""
    byte = torch.arange(256, device=table.device)
    return torch.stack([table[byte >> 4], table[byte & 0b1111]], dim=1).to(torch.bfloat16)


def _scalers(qscalers: torch.Tensor, qfactor: torch.Tensor, qmean: torch.Tensor) -> torch.Tensor:
    """Each block's bfloat16 scale, undoing the double quantization as torchao's NF4Tensor.dequantize_scalers does."""
    bf16 = torch.bfloat16
    blocks = qscalers.view(-1, NF4_SCALER_BLOCK) / qfactor.view(bf16).unsqueeze(-1)
    return blocks.flatten().to(bf16) + qmean.view(bf16).reshape(())


def dequantize(shape: tuple[int, ...], qdata, qscalers, qfactor, qmean, table, *, dtype=torch.bfloat16) -> torch.Tensor:
    """An NF4 weight of `shape` dequantized to `dtype`, bit for bit as torchao's NF4Tensor.get_original_weight gives
    it in bfloat16 (then cast), over tensors wherever they are (the stage's weight slot): each code byte looked up
    as its two values, each block of NF4_BLOCK values times its bfloat16 scale (rounded once to bfloat16), written
    into the result DEQUANT_CHUNK weights at a time (torchao's takes 14 bytes a weight: int64 codes, the values,
    their products and the interleaving)."""
    pairs, scalers = _pairs(table), _scalers(qscalers, qfactor, qmean)
    out = torch.empty(shape, dtype=dtype, device=qdata.device)
    for start in range(0, qdata.numel(), DEQUANT_CHUNK // 2):  # bytes of codes, two weights each
        _dequantize_chunk(out.view(-1), qdata, start, pairs, scalers)
    return out


def _dequantize_chunk(out: torch.Tensor, qdata: torch.Tensor, start: int, pairs, scalers) -> None:
    """The weights of the chunk of codes from byte `start` into `out` (flat); its temporaries end with the call."""
    codes = qdata[start : start + DEQUANT_CHUNK // 2]
    values = torch.index_select(pairs, 0, codes.int()).view(-1, NF4_BLOCK)
    first = start * 2 // NF4_BLOCK
    values.mul_(scalers[first : first + values.shape[0]].unsqueeze(-1))
    out[start * 2 : start * 2 + values.numel()].copy_(values.view(-1))


class _FrozenLinear(torch.autograd.Function):
    """x times a quantized weight that never trains (`weight_of(*codes, dtype)` dequantizes it), as torchao's
    LinearNF4 computes it, but saving the weight's codes (small tensors in the stage's weight slot, which a kept
    graph references rather than copies) and dequantizing again in the backward, instead of saving a dequantized
    copy per layer and microbatch."""

    @staticmethod
    def forward(ctx, x, weight_of, conv1d, *codes):
        ctx.weight_of, ctx.conv1d = weight_of, conv1d
        ctx.save_for_backward(*codes)
        w = weight_of(*codes, x.dtype)
        return x @ w if conv1d else F.linear(x, w)

    @staticmethod
    def backward(ctx, grad):
        w = ctx.weight_of(*ctx.saved_tensors, grad.dtype)
        dx = grad @ w.t() if ctx.conv1d else grad @ w
        return (dx, None, None) + (None,) * len(ctx.saved_tensors)


QUANTIZERS: dict[str, tuple[Callable[[nn.Module], nn.Module], Callable[[torch.Tensor], bool]]] = {
    "nf4": (NF4Linear, quantizable),
    "int8": (Int8Linear, lambda w: w.dim() == 2),
}
"""base_dtype -> (the layer a frozen linear layer becomes, which weights it takes)."""


def quantize_frozen(module: nn.Module, base_dtype: str = "nf4") -> list[str]:
    """Replace every frozen linear layer of `module` that `base_dtype`'s form takes (QUANTIZERS) by its quantized
    layer; returns the names replaced. The adapters (trainable) and the others stay as they are."""
    layer, takes = QUANTIZERS[base_dtype]
    done = []
    for name, m in list(module.named_modules()):
        weight = getattr(m, "weight", None)
        if not name or not is_linear(m) or not isinstance(weight, torch.Tensor) or weight.requires_grad:
            continue
        if not takes(weight):
            continue
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent), child, layer(m))
        done.append(name)
    return done


def quantized(makers: Sequence[Callable[[], nn.Module]], base_dtype: str = "nf4") -> list[Callable[[], nn.Module]]:
    """Layer factories whose layers come with their frozen linear layers in `base_dtype` (quantize_frozen)."""
    return [partial(_quantized, make, base_dtype) for make in makers]


def _quantized(make: Callable[[], nn.Module], base_dtype: str) -> nn.Module:
    layer = make()
    if isinstance(layer, nn.Module):  # anything else is refused by the caller, naming the layer
        quantize_frozen(layer, base_dtype)
    return layer
