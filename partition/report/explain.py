"""`partition --explain`: per stage, every activation option weighed, its figures and why it won or lost."""

from __future__ import annotations

from foundation.units import fmt_bytes
from partition.plan import Plan
from partition.rules.activation_choice import Choice, Considered

__all__ = ["explain_lines", "explain_json"]

HEAD = (
    "activations: per stage, each option with H (held per microbatch from F to B), T (live in B besides H),\n"
    "R (forward redone per microbatch), X (transfer exposed per step), C (the stage's compute per step) and\n"
    "the peak of its gpu had it been chosen; * = chosen"
)


def _policy(r: Considered) -> str:
    p = r.cost.policy
    kept = f" {','.join(map(str, p.keep_layers))}" if p.mode == "selective" else ""
    return f"{p.mode}{kept} on {p.tier}"


def explain_lines(plan: Plan, choice: Choice) -> list[str]:
    """The text of `--explain`, a block per stage."""
    out = [
        HEAD,
        f"budget per gpu {fmt_bytes(plan.gpu_memory_bytes)}; "
        + ("needs (peak, transients, peers' contexts) " if choice.needs else "peaks ")
        + ", ".join(f"gpu {g} {fmt_bytes(p)}" for g, p in enumerate(choice.needs or choice.peaks)),
    ]
    for j, s in enumerate(plan.stages):
        out.append(f"stage {j} (layers {s.first}-{s.last}, gpu {s.gpu}):")
        rows = [r for r in choice.considered if r.stage == j]
        width = max(len(_policy(r)) for r in rows)
        for r in rows:
            c = r.cost
            mark = "*" if c == choice.costs[j] else " "
            out.append(
                f"  {mark} {_policy(r):<{width}}  H {fmt_bytes(c.held_bytes):>10}  T {fmt_bytes(c.work_bytes):>10}"
                f"  R {c.recompute_s * 1e3:8.3f} ms  X {c.exposed_s * 1e3:8.3f} ms  C {c.compute_s * 1e3:9.3f} ms"
                f"  peak {fmt_bytes(r.peak_bytes):>10}  {r.verdict}"
            )
    return out


def explain_json(choice: Choice) -> list[dict]:
    """The `--json --explain` rows: one per option of each stage."""
    return [
        {
            "stage": r.stage,
            "mode": r.cost.policy.mode,
            "kept_layers": list(r.cost.policy.keep_layers),
            "tier": r.cost.policy.tier,
            "held_bytes": r.cost.held_bytes,
            "work_bytes": r.cost.work_bytes,
            "recompute_s": r.cost.recompute_s,
            "exposed_s": r.cost.exposed_s,
            "compute_s": r.cost.compute_s,
            "peak_bytes": r.peak_bytes,
            "chosen": r.cost == choice.costs[r.stage],
            "verdict": r.verdict,
        }
        for r in choice.considered
    ]
