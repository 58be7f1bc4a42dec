"""Host optimizer throughput: parameters per second torch's fused AdamW updates on this machine's CPU.

Method: one fp32 parameter of `params` elements with a random gradient; one warm-up step, then the best
of `repeats` timed steps; rate = params / seconds. It uses torch's current intra-op thread count (say so
in the note): the planner's host-update time is this rate's inverse times each stage's parameters.
"""

from __future__ import annotations

from foundation.timing import Stopwatch

__all__ = ["probe_host_adam"]


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
