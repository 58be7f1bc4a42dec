"""A quantized LoRA base on this machine: how fast torchao's NF4 and int8 quantize a weight (what each rank does once
per run as it builds its layers) and mobiuspipe dequantizes it (what each forward and backward does per quantized
layer: the same bits as torchao's own dequantization, in the weight's memory and a chunk), against the yardsticks of
torchao's dequantization of the same weight and of copying the same bf16 weight once, for Llama-2-70B's two
projection shapes.

    .venv/bin/python scripts/bench_quant.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
from torch import nn

import mobiuspipe  # noqa: F401 - quiets torchao's import logs
from mobiuspipe.lora.quant import Int8Linear, NF4Linear
from partition.spec.lora import int8_bytes, nf4_bytes

SHAPES = {"q_proj / o_proj (8192 x 8192)": (8192, 8192), "gate/up_proj (28672 x 8192)": (28672, 8192)}
"""Llama-2-70B's square attention projections and its MLP projections (out x in)."""
QUANTIZABLE_70B = 80 * (2 * 8192 * 8192 + 3 * 28672 * 8192)
"""Weights of Llama-2-70B's blocks that both forms take: q, o and the three MLP projections of 80 blocks (k and v,
1024 x 8192 each, add 1.3B; left out of this round figure)."""
FORMS = {
    "nf4": (NF4Linear, lambda q: q.weight(), lambda o, i: nf4_bytes(o * i)),
    "int8": (Int8Linear, lambda q: q.weight(torch.bfloat16), int8_bytes),
}
"""base_dtype -> (its layer, its dequantization to bf16, bytes of an out x in weight)."""


def _torchao(form: str, dense: torch.Tensor):
    """torchao's own dequantization of `dense` (bf16) in `form`, to bf16: the yardstick."""
    if form == "nf4":
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        return to_nf4(dense, 64, 256).get_original_weight
    from torchao.quantization.granularity import PerRow
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

    return Int8Tensor.from_hp(dense, PerRow()).dequantize


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    rates_head = "quantize | dequantize | torchao's dequantize | bf16 copy (M weights/s each)"
    print(f"| form | weight | {rates_head} | dequantize vs torchao's | bytes vs bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    rates: dict[str, list[float]] = {}
    for form, (layer, dequantize, nbytes) in FORMS.items():
        for name, (o, i) in SHAPES.items():
            lin = nn.Linear(i, o, bias=False)
            n = lin.weight.numel()
            dense = lin.weight.detach().bfloat16()
            q = layer(lin)
            quant = _best(partial(layer, lin), args.repeats)
            dequant = _best(partial(dequantize, q), args.repeats)
            theirs = _best(_torchao(form, dense), args.repeats)
            copy = _best(dense.clone, args.repeats)
            rates.setdefault(form, []).append(n / quant)
            print(f"| {form} | {name} | {n / quant / 1e6:.1f} | {n / dequant / 1e6:.0f} | {n / theirs / 1e6:.0f} | "
                  f"{n / copy / 1e6:.0f} | {theirs / dequant:.2f}x | {nbytes(o, i) / (2 * n):.3f} |")  # fmt: skip
    for form, rate in rates.items():
        print(f"{form}: Llama-2-70B's {QUANTIZABLE_70B / 1e9:.1f}B block weights at {min(rate) / 1e6:.1f} M/s: "
              f"{QUANTIZABLE_70B / min(rate) / 60:.0f} min of one process's time here, shared by the ranks (each "
              f"quantizes its own stages' layers)")  # fmt: skip


if __name__ == "__main__":
    main()
