"""The planner's activation choice against the simpler policies it could have run, measured side by side on 2 ranks.

Usage: .venv/bin/python scripts/bench_policies.py [--budgets 64 80 100] [--rounds 3] [--steps 30]

The GPT of bench_pipeline's "small" size (8 blocks of d_model 256, seq 128, batch 8 in 4 microbatches, fp32), 4
stages cross-mapped on 2 CPU stand-ins of each --budgets MiB, 1 thread a rank, under torchrun. Per budget, in turn
round by round (so the machine's drift touches them alike): "auto" (the plan's choice, memory.activations: plan),
"recompute" (every stage recomputes) and "keep" (every stage keeps its graphs) where the walk of the plan with
every stage recorded as keep fits the budget. Each
figure is the median step of steps 5 onwards of one run; the table shows the median over rounds, the stage modes
the plan chose, and each run's measured device peak (the ledger) against the budget. Issue 27's check: a chosen
policy is never slower than a feasible simpler one.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
from pathlib import Path

from bench_pipeline import run_dict
from benchlib import cpu_model, markdown_table, torchrun_metrics

from mobiuspipe.config import config_from_dict
from mobiuspipe.startup.config_plan import gpt_profile, plan_from_config, run_topology
from partition.rules.activation_choice import with_activations
from partition.rules.device_peak import planned_device_bytes

POLICIES = ("auto", "recompute", "keep")


def config(budget_mb: float, policy: str, steps: int, out_dir: str | None) -> dict:
    """bench_pipeline's small run on 2 stand-ins of budget_mb, with `policy` forced (auto: the plan's)."""
    d = run_dict("small", 2, steps, out_dir, device_mb=budget_mb)
    if policy != "auto":
        d["memory"] = {"activations": policy}
    return d


def modes(budget_mb: float, policy: str) -> str | None:
    """The stage modes a run under `policy` runs (k, s[kept layers], r per stage; the last stage's forward runs inside
    its backward whatever its mode), or None when keep's walk does not fit the budget (nothing plans keep)."""
    cfg = config_from_dict(config(budget_mb, "auto", 2, None))
    plan = plan_from_config(cfg)
    if policy == "recompute":
        return "/".join("r" for _ in plan.stages)
    if policy == "keep":
        kept, _ = with_activations(plan, gpt_profile(cfg), run_topology(cfg), 1 << 62, modes={"device": ("keep",)})
        if max(planned_device_bytes(kept, standin=True)) > budget_mb * 2**20:
            return None
        return "/".join("k" for _ in plan.stages)
    return "/".join(s.activations[0] + (str(list(s.kept_layers)) if s.kept_layers else "") for s in plan.stages)


def measure(budget_mb: float, policy: str, steps: int, tmp: Path) -> tuple[float, float]:
    """(median step ms after the first 5, the largest measured device peak in MiB) of one run."""
    folder = Path(tempfile.mkdtemp(dir=tmp))
    d = config(budget_mb, policy, steps, str(folder / "out"))
    recs = [r for r in torchrun_metrics(d, 2, folder, 600) if "step_s" in r]
    return 1e3 * statistics.median(r["step_s"] for r in recs[5:]), max(r["device_peak_bytes"] for r in recs) / 2**20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budgets", type=float, nargs="+", default=[64.0, 80.0, 100.0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args(argv)
    runs = {b: {pol: modes(b, pol) for pol in POLICIES} for b in args.budgets}
    times: dict[tuple[float, str], list[float]] = {}
    peaks: dict[tuple[float, str], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for b in args.budgets:
                for pol in (pol for pol in POLICIES if runs[b][pol] is not None):
                    ms, peak = measure(b, pol, args.steps, Path(tmp))
                    times.setdefault((b, pol), []).append(ms)
                    peaks[(b, pol)] = max(peaks.get((b, pol), 0.0), peak)
                    print(f"  {b:g} MiB {pol}: {ms:.1f} ms, peak {peak:.1f} MiB", file=sys.stderr, flush=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"bench_policies {now:%Y-%m-%d %H:%M} UTC, {cpu_model()}, {args.rounds} rounds of {args.steps} steps")
    header = ["budget MiB", "policy", "stage modes", "step ms (median of rounds)", "each round", "peak MiB", "vs auto"]
    rows = []
    for b in args.budgets:
        auto = statistics.median(times[(b, "auto")])
        for pol in POLICIES:
            if runs[b][pol] is None:
                rows.append([f"{b:g}", pol, "no plan fits", "-", "-", "-", "-"])
                continue
            med = statistics.median(times[(b, pol)])
            each = " / ".join(f"{t:.1f}" for t in times[(b, pol)])
            peak = f"{peaks[(b, pol)]:.1f}"
            rows.append([f"{b:g}", pol, runs[b][pol], f"{med:.1f}", each, peak, f"{med / auto:.2f}x"])
    print(markdown_table(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
