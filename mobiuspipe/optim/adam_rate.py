"""The host update's rate as a run's ranks get it, for `mobiuspipe topology --probe` (Measured.host_adam_params_per_s,
the planner's host-update rate).

Method: `ranks` processes (one per gpu of the topology) each take `threads` threads (its share of the cores, as
runtime.threads auto gives a rank: mobiuspipe.optim.host_threads.rank_threads), and step CPUAdam on `params` fp32
parameters with bf16 gradients, writing the next bf16 weights in the same pass (CPUAdam.step_fused: what a bf16 run's
update does), all at once: the memory bandwidth they share is what bounds the update. One warm-up step, then
`repeats` steps together; a rank's rate is params / its median step, and the probe reports the slowest rank's.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics

from foundation.timing import Stopwatch

__all__ = ["probe_rank_adam"]


def _worker(i: int, threads: int, params: int, repeats: int, cmds, results, barrier) -> None:
    """One rank's update: its threads, its states, a step per "go"."""
    import torch

    from mobiuspipe.optim import CPUAdam

    torch.set_num_threads(threads)
    p = torch.nn.Parameter(torch.randn(params))
    grads = {p: torch.randn(params).to(torch.bfloat16)}
    out = {p: torch.empty(params, dtype=torch.bfloat16)}
    opt = CPUAdam([p], lr=1e-3, weight_decay=0.01)
    opt.step_fused(out, grads)  # the states' first touch, untimed
    results.put(("ready", i, 0.0))
    while cmds.get() is not None:
        times = []
        for _ in range(repeats):
            barrier.wait()
            with Stopwatch() as sw:
                opt.step_fused(out, grads)
            times.append(sw.s)
        results.put(("done", i, statistics.median(times)))


def probe_rank_adam(notes: list[str], ranks: int, threads: int, params: int = 16_000_000, repeats: int = 5) -> float:
    """Parameters per second one rank's host update steps on `threads` threads while every rank of the `ranks`
    updates at once (the module's method); its note says the threads and the kernel."""
    from mobiuspipe import _ext

    ctx = mp.get_context("spawn")
    cmds = [ctx.Queue() for _ in range(ranks)]
    results, barrier = ctx.Queue(), ctx.Barrier(ranks)
    procs = [
        ctx.Process(target=_worker, args=(i, threads, params, repeats, cmds[i], results, barrier), daemon=True)
        for i in range(ranks)
    ]
    for p in procs:
        p.start()
    try:
        for _ in range(ranks):
            results.get(timeout=300)
        for q in cmds:
            q.put("go")
        seconds = [results.get(timeout=300)[2] for _ in range(ranks)]
    finally:
        for q in cmds:
            q.put(None)
        for p in procs:
            p.join(timeout=10)
    kernel = "the C++ SIMD kernel" if _ext.HAVE_C else f"torch's ops ({_ext.WHY_NOT})"
    notes.append(
        f"host Adam: mobiuspipe's CPUAdam ({kernel}, bf16 gradients and weights) on {threads} threads in each of "
        f"{ranks} ranks updating at once ({os.cpu_count()} cores), {params:,} fp32 params each; the slowest rank's rate"
    )
    return params / max(seconds)
