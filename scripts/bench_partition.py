"""Planner benchmark: solve time, status, gap and predicted step of each solver on real models and servers.

Usage: .venv/bin/python scripts/bench_partition.py [--markdown] [--time-limit 2.0]
The yardstick is the exact DP of the same run: "vs dp" is the MIP plan's predicted step over the DP plan's.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform

from foundation.timing import Stopwatch
from foundation.units import GiB
from partition.errors import PlanInfeasibleError
from partition.mip.solvers.gurobi import _license
from partition.search import make_plan
from partition.spec.analytic import analytic_profile
from partition.spec.hardware import device_spec
from partition.spec.lookup import get_model
from topology import preset

MODELS = ("gpt3-13b", "gpt3-175b", "llama2-70b")
TOPOLOGIES = ("2+2", "3+1", "8-dual-socket")
SOLVERS = ("dp", "highs", "gurobi")


def _row(model: str, topo_name: str, solver: str, limit: float, dp_step: float | None) -> dict:
    topo = preset(topo_name)
    prof = analytic_profile(get_model(model), device_spec(topo.gpus[0].name), microbatch_size=1, dtype="fp16")
    watch = Stopwatch()
    try:
        plan = make_plan(prof, topo, 4, reserve_bytes=GiB, solver=solver, time_limit_s=limit)
    except PlanInfeasibleError as e:
        return {"model": model, "topology": topo_name, "solver": solver, "error": str(e).split(":")[0]}
    wall = watch.s
    step = plan.predicted_step_time_s
    status, _, note = plan.solver.status.partition("; ")
    return {
        "model": model,
        "topology": topo_name,
        "solver": plan.solver.name,
        "asked": solver,
        "status": status + (" (fallback)" if note else ""),
        "gap": plan.solver.gap,
        "wall_s": wall,
        "stages": plan.num_stages,
        "step_s": step,
        "vs_dp": step / dp_step if dp_step else 1.0,
    }


def _rows(limit: float) -> list[dict]:
    out = []
    for model in MODELS:
        for topo in TOPOLOGIES:
            dp = _row(model, topo, "dp", limit, None)
            out.append(dp)
            for solver in SOLVERS[1:]:
                out.append(_row(model, topo, solver, limit, dp.get("step_s")))
    return out


def _line(r: dict, md: bool) -> str:
    if "error" in r:
        cells = [r["model"], r["topology"], r["solver"], r["error"], "", "", "", "", ""]
    else:
        cells = [
            r["model"],
            r["topology"],
            f"{r['asked']} -> {r['solver']}",
            r["status"],
            f"{r['gap']:.4f}",
            f"{r['wall_s']:.2f}",
            str(r["stages"]),
            f"{r['step_s']:.2f}",
            f"{r['vs_dp']:.4f}",
        ]
    return (
        "| " + " | ".join(cells) + " |"
        if md
        else "  ".join(f"{c:<22}" if i < 3 else f"{c:>10}" for i, c in enumerate(cells))
    )


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--time-limit", type=float, default=2.0)
    args = p.parse_args()
    head = ["model", "topology", "solver", "status", "gap", "wall s", "S", "step s", "vs dp"]
    print(
        f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{platform.processor() or platform.machine()}"
        f", {os.cpu_count()} cores, gurobi license: {_license()}, time limit {args.time_limit} s"
    )
    print("| " + " | ".join(head) + " |" if args.markdown else "  ".join(head))
    if args.markdown:
        print("|" + "---|" * len(head))
    for r in _rows(args.time_limit):
        print(_line(r, args.markdown), flush=True)


if __name__ == "__main__":
    main()
