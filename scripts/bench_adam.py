"""CPU Adam benchmark: CPUAdam (C++ SIMD) vs torch's fused AdamW vs the memory floor, medians of alternating runs.

Usage: .venv/bin/python scripts/bench_adam.py [--numel 50000000] [--threads 2] [--rounds 7] [--markdown]
The floor (mobiuspipe._C.copy_floor) reads and writes exactly the bytes of the update with no arithmetic,
so "x floor" near 1 means the step is memory-bound. Variants: fp32 (fp32 grads), mixed (bf16 grads in,
bf16 weights out; torch needs an fp32 upcast of the grads before and a bf16 cast of the weights after).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics

import torch

from foundation.timing import Stopwatch
from mobiuspipe import _ext
from mobiuspipe.optim import CPUAdam


def _torch_adamw(p: torch.nn.Parameter) -> tuple[torch.optim.Optimizer, str]:
    """torch.optim.AdamW with fused=True where this torch supports it on CPU, else foreach."""
    try:
        opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
        p.grad = torch.zeros_like(p)
        opt.step()  # unsupported fused CPU kernels fail here, not in the constructor
        return opt, "fused"
    except (RuntimeError, ValueError):
        return torch.optim.AdamW([p], lr=1e-3, foreach=True), "foreach"


def _deepspeed(n: int, g: torch.Tensor, mixed: bool, gen: torch.Generator):
    """DeepSpeedCPUAdam on its own copy (mixed: upcast grads, step, downcast weights, as for torch), or None."""
    try:
        # deepspeed is an optional peer, not installed in the dev venv: pyright cannot resolve it
        import deepspeed  # pyright: ignore[reportMissingImports]
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # pyright: ignore[reportMissingImports]
    except Exception as exc:  # noqa: BLE001 - not installed, or its op does not build here
        print(f"# DeepSpeedCPUAdam not measured: {type(exc).__name__}: {exc}")
        return None
    p = torch.nn.Parameter(torch.randn(n, generator=gen))
    opt = DeepSpeedCPUAdam([p], lr=1e-3, adamw_mode=True)
    g32 = torch.empty(n) if mixed else g
    out = torch.empty(n, dtype=torch.bfloat16)

    def run():
        if mixed:
            g32.copy_(g)
        p.grad = g32
        opt.step()
        if mixed:
            out.copy_(p.detach())

    return f"DeepSpeedCPUAdam {deepspeed.__version__}", run


def _make(n: int, mixed: bool) -> dict:
    """The contestants on their own buffers (same sizes), each a zero-argument callable."""
    gdt = torch.bfloat16 if mixed else torch.float32
    gen = torch.Generator().manual_seed(0)
    ours = torch.nn.Parameter(torch.randn(n, generator=gen))
    g_ours = torch.randn(n, generator=gen).to(gdt)
    out = torch.empty(n, dtype=torch.bfloat16) if mixed else None
    opt = CPUAdam([ours], lr=1e-3)
    theirs = torch.nn.Parameter(ours.detach().clone())
    topt, kind = _torch_adamw(theirs)
    g_theirs, out_theirs = g_ours.clone(), torch.empty(n, dtype=torch.bfloat16)
    g32_theirs = torch.empty(n)  # the preallocated upcast buffer of torch's mixed-precision sequence
    fl = [torch.randn(n, generator=gen) for _ in range(3)]

    def run_ours():
        opt.step_fused({ours: out} if mixed else {}, grads={ours: g_ours})

    def run_torch():
        theirs.grad = g32_theirs.copy_(g_theirs) if mixed else g_theirs
        topt.step()
        if mixed:
            out_theirs.copy_(theirs.detach())

    def run_floor():
        _ext.C.copy_floor(fl[0], fl[1], fl[2], g_ours, out)

    fns = {"CPUAdam (C++)": run_ours, f"torch AdamW {kind}": run_torch, "memory floor": run_floor}
    ds = _deepspeed(n, g_ours, mixed, gen)
    if ds:
        fns[ds[0]] = ds[1]
    return fns


def _bench(fns: dict, rounds: int) -> dict:
    """Alternates A B C A B C ... after one warm-up each; returns the median seconds per name."""
    times = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for k, fn in fns.items():
            with Stopwatch() as watch:
                fn()
            times[k].append(watch.s)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--numel", type=int, default=50_000_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    if not _ext.HAVE_C:
        raise SystemExit(f"the C++ extension is not built ({_ext.WHY_NOT}); run scripts/setup.sh")
    torch.set_num_threads(args.threads)
    n = args.numel
    print(
        f"# bench_adam {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, torch "
        f"{torch.__version__}, {platform.processor() or platform.machine()}, {args.threads} threads, "
        f"{n / 1e6:.0f}M params, SIMD {_ext.C.resolve_simd('auto')}, median of {args.rounds}"
    )
    print("| variant | contestant | ms/step | GB/s moved | x floor | CPUAdam speed-up over it |")
    print("|---|---|---:|---:|---:|---:|")
    for mixed in (False, True):
        nbytes = n * (3 * 4 * 2 + (2 if mixed else 4) + (2 if mixed else 0))
        res = _bench(_make(n, mixed), args.rounds)
        floor, ours = res["memory floor"], res["CPUAdam (C++)"]
        for k, t in res.items():
            print(
                f"| {'mixed bf16' if mixed else 'fp32'} | {k} | {t * 1e3:.1f} | {nbytes / t / 1e9:.1f} | "
                f"{t / floor:.2f} | {t / ours:.2f} |"
            )


if __name__ == "__main__":
    main()
