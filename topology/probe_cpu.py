"""The host CPU measured: the optimizer's throughput, and how many cores computations running at once get.

Host Adam: parameters per second torch's fused AdamW updates. One fp32 parameter of `params` elements with
a random gradient; one warm-up step, then the best of `repeats` timed steps; rate = params / seconds. It
uses torch's current intra-op thread count (say so in the note): the planner's host-update time is this
rate's inverse times each stage's parameters.

Host cores: C, the cores `workers` processes of one torch thread each (the CPU stand-ins' ranks) get at once,
in units of one process computing alone: the same work (a 256 x 256 fp32 matmul and a tanh, `iters` times)
is timed in one process alone (t_1), then in every process at once (t_i); C = sum_i t_1 / t_i, between 1
(one alone is the unit) and `workers`. Rounds alternate alone / together `repeats` times and C is their
median. An idle machine of n cores gives C = n; processes of other users lower it, which is what the
simulator's host-cores link needs (partition.sim.simulate, host_cores).

Messages: two processes send a tensor back and forth over torch.distributed's gloo on this host (what the
CPU stand-ins' activations and gradients cross), `repeats` round trips per size after 5 untimed; one way =
the median round trip / 2, at a small and a large size: latency = the small one's time, GB/s = the extra
bytes over the extra time. On a busy machine the latency includes waking the receiver, which is most of it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics

from foundation.timing import Stopwatch

__all__ = ["MatmulWork", "probe_host_adam", "probe_host_cores", "probe_messages"]


def probe_host_adam(notes: list[str], params: int = 32_000_000, repeats: int = 3) -> float:
    """Params/s of one AdamW step (0.0 with a note when torch is missing)."""
    try:
        import torch
    except ImportError:
        notes.append("torch is not installed: host Adam throughput not measured")
        return 0.0
    p = torch.zeros(params, requires_grad=True)
    p.grad = torch.randn(params)
    try:
        opt, kind = torch.optim.AdamW([p], lr=1e-3, fused=True), "fused"
    except (RuntimeError, TypeError):  # a torch without the fused CPU kernel
        opt, kind = torch.optim.AdamW([p], lr=1e-3), "for-loop"
    opt.step()
    best = float("inf")
    for _ in range(repeats):
        with Stopwatch() as step:
            opt.step()
        best = min(best, step.s)
    notes.append(f"host Adam: torch.optim.AdamW ({kind}) on {torch.get_num_threads()} threads, {params:,} fp32 params")
    return params / best


class MatmulWork:
    """The probes' unit of CPU work on the calling thread: an fp32 256 x 256 matmul and a tanh, on tensors made
    once (host cores times it alone and in several processes at once; scripts/bench_fidelity.py times it
    before and after each run to see the machine's speed move)."""

    def __init__(self) -> None:
        import torch

        self.a, self.b, self.c = torch.randn(256, 256), torch.randn(256, 256), torch.empty(256, 256)

    def seconds(self, iters: int) -> float:
        """Seconds `iters` units take now."""
        import torch

        with Stopwatch() as sw:
            for _ in range(iters):
                torch.tanh(torch.mm(self.a, self.b, out=self.c), out=self.c)
        return sw.s


def _core_worker(i: int, iters: int, cmds, results, barrier) -> None:
    """A probe process: one torch thread, the same work on every command ("alone" or "together")."""
    import torch

    torch.set_num_threads(1)
    work = MatmulWork()
    work.seconds(20)
    results.put(("ready", i, 0.0))
    while (cmd := cmds.get()) is not None:
        if cmd == "together":
            barrier.wait()
        results.put((cmd, i, work.seconds(iters)))


def probe_host_cores(notes: list[str], workers: int | None = None, repeats: int = 3, iters: int = 300) -> float:
    """C of the module docstring for `workers` processes (default: every core); 0.0 with a note when torch
    is missing."""
    try:
        import torch  # noqa: F401 - only to know the workers can run
    except ImportError:
        notes.append("torch is not installed: host cores not measured")
        return 0.0
    n = workers or os.cpu_count() or 1
    ctx = mp.get_context("spawn")
    cmds = [ctx.Queue() for _ in range(n)]
    results, barrier = ctx.Queue(), ctx.Barrier(n)
    args = [(i, iters, cmds[i], results, barrier) for i in range(n)]
    procs = [ctx.Process(target=_core_worker, args=a, daemon=True) for a in args]
    for p in procs:
        p.start()
    try:
        for _ in range(n):
            results.get(timeout=120)
        cores = []
        for _ in range(repeats):
            cmds[0].put("alone")
            alone = results.get(timeout=120)[2]
            for q in cmds:
                q.put("together")
            together = [results.get(timeout=120)[2] for _ in range(n)]
            cores.append(min(float(n), max(1.0, sum(alone / t for t in together))))
    finally:
        for q in cmds:
            q.put(None)
        for p in procs:
            p.join(timeout=10)
    c = statistics.median(cores)
    notes.append(f"host cores: {n} one-thread processes at once computed as fast as {c:.2f} alone")
    return c


def _ping_worker(rank: int, port: int, sizes: tuple[int, ...], repeats: int, results) -> None:
    """One end of the ping-pong: rank 0 reports the median one-way seconds of each size."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for nbytes in sizes:
            t, times = torch.zeros(max(1, nbytes // 4)), []
            for k in range(5 + repeats):
                with Stopwatch() as sw:
                    if rank == 0:
                        dist.send(t, 1)
                        dist.recv(t, 1)
                    else:
                        dist.recv(t, 0)
                        dist.send(t, 0)
                if k >= 5:
                    times.append(sw.s / 2)
            if rank == 0:
                results.put((nbytes, statistics.median(times)))
    finally:
        dist.destroy_process_group()


def probe_messages(notes: list[str], repeats: int = 100, sizes=(4096, 1 << 20)) -> tuple[float, float]:
    """(latency seconds, GB/s) of one message between two processes over gloo (the module docstring);
    (0.0, 0.0) with a note when torch or its gloo backend is missing."""
    try:
        import torch.distributed as dist
    except ImportError:
        notes.append("torch is not installed: messages between ranks not measured")
        return 0.0, 0.0
    if not dist.is_available() or not dist.is_gloo_available():
        notes.append("torch has no gloo backend: messages between ranks not measured")
        return 0.0, 0.0
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_ping_worker, args=(r, port, sizes, repeats, results), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=120) for _ in sizes)
    finally:
        for p in procs:
            p.join(timeout=30)
    small, large = got[sizes[0]], got[sizes[1]]
    gbps = (sizes[1] - sizes[0]) / max(large - small, 1e-9) / 1e9
    notes.append(f"messages (gloo, this host): {small * 1e3:.3f} ms one way, {gbps:.2f} GB/s beyond that")
    return small, gbps
