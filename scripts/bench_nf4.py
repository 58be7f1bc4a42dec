"""NF4 for a LoRA run's frozen base on this machine: how fast torchao's NF4 quantizes a weight (what each rank does
once per run as it builds its layers) and dequantizes it (what each forward and backward does per NF4 layer), against
the yardstick of copying the same bf16 weight once, for Llama-2-70B's two projection shapes.

    .venv/bin/python scripts/bench_nf4.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
from torch import nn

import mobiuspipe  # noqa: F401 - quiets torchao's import logs
from mobiuspipe.lora.quant import NF4Linear
from partition.spec.lora import nf4_bytes

SHAPES = {"q_proj / o_proj (8192 x 8192)": (8192, 8192), "gate/up_proj (28672 x 8192)": (28672, 8192)}
"""Llama-2-70B's square attention projections and its MLP projections (out x in)."""
QUANTIZABLE_70B = 80 * (2 * 8192 * 8192 + 3 * 28672 * 8192)
"""Weights of Llama-2-70B's blocks that NF4 takes: q, o and the three MLP projections of 80 blocks (k and v,
1024 x 8192 each, are divisible too and add 1.3B; left out of this round figure)."""


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
    print("| weight | quantize (M weights/s) | dequantize (M weights/s) | bf16 copy (M weights/s) | bytes vs bf16 |")
    print("|---|---|---|---|---|")
    rates = []
    for name, shape in SHAPES.items():
        lin = nn.Linear(shape[1], shape[0], bias=False)
        n = lin.weight.numel()
        dense = lin.weight.detach().bfloat16()
        q = NF4Linear(lin)
        quant = _best(partial(NF4Linear, lin), args.repeats)
        dequant = _best(q.weight, args.repeats)
        copy = _best(dense.clone, args.repeats)
        rates.append(n / quant)
        print(f"| {name} | {n / quant / 1e6:.1f} | {n / dequant / 1e6:.0f} | {n / copy / 1e6:.0f} | "
              f"{nf4_bytes(n) / (2 * n):.3f} |")  # fmt: skip
    slowest = min(rates)
    print(f"Llama-2-70B's {QUANTIZABLE_70B / 1e9:.1f}B NF4 block weights at {slowest / 1e6:.1f} M/s: "
          f"{QUANTIZABLE_70B / slowest / 60:.0f} min of one process's time here, shared by the ranks (each "
          f"quantizes its own stages' layers)")  # fmt: skip


if __name__ == "__main__":
    main()
