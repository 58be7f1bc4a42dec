"""Fidelity of the planner's simulator on this machine: predicted against measured step time, per model, plan
and activation policy (issue 13's check: within 15% for CPU runs).

For each repetition and each model: probe the host (cores, messages), then for each plan (ranks x stages,
cross mapping) and policy: measure a profile of the model's layers on this machine right before the run (the
runtime's own call path: mobiuspipe.profiling.profiler; this VM's speed drifts by up to 1.7x within minutes, so a
profile taken minutes earlier predicts another machine), plan with that profile for CPU stand-ins
(partition.make_plan, the exact DP at the requested stage count), predict its step with the simulator under
the policy (partition.predict_step), train it under torchrun for --steps steps with that plan file and
policy, and keep the median step time after --warmup steps. The models and plans are interleaved and the
whole grid repeated --reps times, so that a slow spell of the machine hits every configuration alike; a
configuration reports the median over repetitions of its median step time, the spread of those medians
(max/min - 1), the median prediction, and the median of each repetition's measured / predicted (the pairs
share a moment of the machine), and the range of its drift over repetitions (reference_s after the run over
before the profile: how far the machine's speed moved while the pair was taken). Exits 1 when any ratio
falls outside 1 +- --tolerance.

Activation policies are a parameter of both sides (POLICIES): the run's memory.activations and
memory.activation_tier, and the plan as the run runs them (plan_as_run), simulated.

With --trace DIR each run traces its steps after the warm-up (runtime.trace_steps) and DIR keeps, per cell and
repetition, the trace (<cell>.json, for chrome://tracing or ui.perfetto.dev) and its comparison with the
simulated step (<cell>.txt, mobiuspipe.profiling.trace_compare: each stage's F and B measured against predicted, a
visit's first microbatch apart, and each rank's milliseconds per step by action kind); the table gains the
median measured / predicted of a steady F or B, so that a step's error splits into the computations' and the
rest (messages, waits, copies).

With --calibrate each cell also gets predictions from the profile refined by its PARTNER plan's runs (the same
model, ranks and policy, another cut; mobiuspipe.profiling.refine scales each layer by how its stage ran in a
traced run, the per-layer median over the repetitions' runs, partition.sim.retime re-times this cell's plan of each
repetition from it): the layers as they run in a pipeline on this machine, measured on a different plan than
the one predicted, and what posting and taking a message cost the ranks' threads in those runs (charged on the
sender's and the receiver's compute streams); the cell reports the median of measured / predicted. The exit code
then judges these predictions (a cell without a partner in the grid is not judged). The "adjacent" column makes
the same prediction of each repetition from the partner's run of that repetition alone (the runs a minute or
so apart): one traced run, then the next plan, as a user re-plans. The "self" column predicts each repetition
from this cell's own run in the next repetition (the same plan and policy, minutes apart; the last from the
first): no other plan is involved, so its spread is what the machine's drift alone leaves, the floor under
the other two columns. The "replay" column predicts each run from its own trace: what is left is the
simulator's, not the drift's (on one rank the step is the sum of its actions; on two, a late action of either
rank delays the other, which a simulation from typical action times does not see).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from bench_pipeline import machine
from benchlib import cpu_mark, markdown_table, other_share, torch_threads, torchrun_metrics
from fidelity_grid import (
    DEVICE_MB,
    GPT_MODELS,
    HF_MODELS,
    PARTNER,
    PLANS,
    POLICIES,
    measure,
    model_dicts,
    run_dict,
    simulated,
)

from foundation.units import MiB
from mobiuspipe.profiling.refine import Refinement, median_profile, refine_profile
from mobiuspipe.profiling.trace_compare import report
from mobiuspipe.runtime.action_trace import read_chrome
from partition import make_plan
from partition.plan import Plan, save_plan
from partition.sim.retime import retime
from partition.sim.types import SimResult
from partition.spec.profile import Profile
from topology import Topology, cpu_standin
from topology.probe_cpu import MatmulWork, probe_host_cores, probe_messages
from topology.types import Measured


@dataclass(frozen=True)
class Ran:
    """What calibration needs of one run: its profile, its plan as run, the prediction, its traced records."""

    profile: Profile
    run: Plan
    sim: SimResult
    topo: Topology
    per_rank: list
    measured: float
    """The run's median step, seconds."""


@dataclass
class Cell:
    """One configuration (model, plan, policy) over the repetitions."""

    model: str
    plan: str
    policy: str
    measured: list[float] = field(default_factory=list)
    predicted: list[float] = field(default_factory=list)
    split: list[tuple[float, float, float]] = field(default_factory=list)
    other: list[float] = field(default_factory=list)
    cores: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    drift: list[float] = field(default_factory=list)
    """Per repetition: the reference work's seconds after the run over its seconds before the profile."""
    actions: list[float] = field(default_factory=list)
    """Per repetition (with --trace): the median over stages of measured / predicted of a steady F and B."""
    calibrated: list[float] = field(default_factory=list)
    """Per repetition (with --calibrate): measured / predicted from the profile the PARTNER plan's runs refined."""
    adjacent: list[float] = field(default_factory=list)
    """Per repetition (with --calibrate): the same from the partner's run in that repetition alone."""
    itself: list[float] = field(default_factory=list)
    """Per repetition (with --calibrate and 2+ repetitions): the same from this cell's own run in the next
    repetition (the last from the first): the machine's noise floor, no other plan involved."""
    replay: list[float] = field(default_factory=list)
    """Per repetition (with --calibrate): the same from this very run's trace: the simulator's own error once
    it is given the run's action times (no drift between runs involved)."""

    @property
    def ratio(self) -> float:
        """The median over repetitions of measured / predicted, each pair from one profile and its run."""
        return statistics.median(m / p for m, p in zip(self.measured, self.predicted))

    @property
    def spread(self) -> float:
        return max(self.measured) / min(self.measured) - 1


def reference_s(repeats: int = 5) -> float:
    """This machine's speed now: the median seconds of 20 units of topology.probe_cpu.MatmulWork (about 10 ms) on
    one thread, `repeats` times. A cell's drift is this after its run over this before its profile: 1.00 when
    the machine kept its speed through the profile, the plan and the run."""
    with torch_threads(1):
        work = MatmulWork()
        work.seconds(20)
        return statistics.median(work.seconds(20) for _ in range(repeats))


def probe_host(args: argparse.Namespace) -> Measured:
    """This machine now: the cores the ranks' computations share and the gloo messages between them."""
    ranks = max(r for r, _ in PLANS.values())
    cores = 0.0 if args.no_cores else probe_host_cores([], workers=ranks)
    latency, gbps = (0.0, 0.0) if args.no_messages else probe_messages([])
    return Measured(host_cores=cores, message_latency_s=latency, message_gbps=gbps)


def run_cell(cell: Cell, parts: dict, host: Measured, args: argparse.Namespace, folder: Path) -> Ran:
    """Profile, plan, predict, run once; the cell gets the figures of this repetition. host: what probe_host
    measured (the simulator shares the host cores among the CPU stand-ins and times their messages with it).
    Returns what calibrating another cell from this run needs (its records only when traced)."""
    before = reference_s()
    profile = measure(parts)
    ranks, stages = PLANS[cell.plan]
    policy = POLICIES[cell.policy]
    m = parts["data"]["num_microbatches"]
    topo = dataclasses.replace(cpu_standin(ranks, DEVICE_MB * MiB), measured=host)
    cell.cores.append(host.host_cores)
    cell.latency.append(host.message_latency_s)
    plan = make_plan(profile, topo, m, num_stages=stages, mapping="cross", solver="dp")
    folder.mkdir(parents=True)
    save_plan(plan, folder / "plan.yaml")
    d = run_dict(parts, ranks, stages, args.steps, str(folder / "out"), str(folder / "plan.yaml"), policy)
    d["memory"]["ssd_dir"] = str(folder / "ssd")
    if args.trace or args.calibrate:
        d["runtime"]["trace_steps"] = list(range(args.warmup, args.steps))
    mark = cpu_mark()
    recs = torchrun_metrics(d, ranks, folder, args.timeout)
    cell.other.append(other_share(mark)[0])
    cell.drift.append(reference_s() / before)
    steady = recs[args.warmup :]
    cell.measured.append(statistics.median(r["step_s"] for r in steady))
    cell.split.append(tuple(statistics.median(r[k] for r in steady) for k in ("compute_s", "load_s", "comm_s")))
    run = policy.as_run(plan, str(folder / "ssd"))
    sim = simulated(run, topo)
    cell.predicted.append(sim.step_time_s)
    trace = folder / "out" / "trace.json"
    if args.trace:
        cell.actions.append(keep_trace(trace, sim, args, Path(args.trace) / folder.name))
    return Ran(profile, run, sim, topo, read_chrome(trace) if args.calibrate else [], cell.measured[-1])


def calibrate(cell: Cell, own: list[Ran], mine: list[Refinement], theirs: list[Refinement]) -> None:
    """The cell's calibrated predictions: in each repetition its plan as run, re-timed from the median of the
    profiles its partner's traced runs refined (theirs: mobiuspipe.profiling.refine of every repetition's run)
    and simulated with the median message and loop costs they measured (cell.calibrated: measured / predicted of each);
    from the partner's run of the same repetition alone, a minute or so from this one (cell.adjacent); from
    this cell's own run in the next repetition (mine; cell.itself, the machine's noise floor; none with one
    repetition); and from its own run's trace (cell.replay, the simulator's error given the run's action times)."""
    pooled = _pooled(theirs)
    for k, (ran, alone) in enumerate(zip(own, theirs)):
        cell.calibrated.append(ran.measured / _predicted(ran, pooled))
        cell.adjacent.append(ran.measured / _predicted(ran, alone))
        cell.replay.append(ran.measured / _predicted(ran, mine[k]))
        if len(own) > 1:
            cell.itself.append(ran.measured / _predicted(ran, mine[(k + 1) % len(own)]))


def _pooled(refined: list[Refinement]) -> Refinement:
    """The median profile over refinements, with the median of each cost they measured (None where none did)."""

    def med(xs: list[float | None]) -> float | None:
        got = [x for x in xs if x is not None]
        return statistics.median(got) if got else None

    return Refinement(
        median_profile([r.profile for r in refined]),
        (),
        med([r.send_s for r in refined]),
        med([r.recv_s for r in refined]),
        med([r.step_overhead_s for r in refined]),
    )


def _predicted(ran: Ran, refined: Refinement) -> float:
    """The simulated step of ran's plan as run, re-timed from the refined profile, with the costs it measured."""
    topo = dataclasses.replace(ran.topo, measured=refined.measured_on(ran.topo.measured))
    return simulated(retime(ran.run, refined.profile), topo).step_time_s


def keep_trace(trace: Path, sim: SimResult, args: argparse.Namespace, to: Path) -> float:
    """Keep the run's trace as to.json and its comparison with the prediction as to.txt (trace_compare.report);
    returns the median over stages of a steady F's and B's measured / predicted."""
    to.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(trace, to.with_suffix(".json"))
    lines, ratio = report(read_chrome(trace), sim, list(range(args.warmup, args.steps)))
    to.with_suffix(".txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return ratio


def row(cell: Cell, tol: float) -> list[str]:
    ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    split = " / ".join(ms(statistics.median(p[k] for p in cell.split)) for k in range(3))
    ok = abs(cell.ratio - 1) <= tol
    return [
        cell.model,
        cell.plan,
        cell.policy,
        ms(statistics.median(cell.measured)),
        f"{100 * cell.spread:.0f}%",
        split,
        ms(statistics.median(cell.predicted)),
        f"{cell.ratio:.2f}x",
        "ok" if ok else "OUT",
        f"{100 * statistics.median(cell.other):.0f}%",
        f"{statistics.median(cell.cores):.2f}",
        f"{statistics.median(cell.latency) * 1e3:.2f}",
        f"{min(cell.drift):.2f}-{max(cell.drift):.2f}",
        f"{statistics.median(cell.actions):.2f}x" if cell.actions else "-",
        _calibrated(cell.calibrated, tol),
        _calibrated(cell.adjacent, tol),
        _calibrated(cell.itself, tol),
        _calibrated(cell.replay, tol),
    ]


def _calibrated(ratios: list[float], tol: float) -> str:
    if not ratios:
        return "-"
    r = statistics.median(ratios)
    return f"{r:.2f}x {'ok' if abs(r - 1) <= tol else 'OUT'}"


HEADER = [
    "model",
    "plan",
    "policy",
    "measured ms (median)",
    "spread",
    "compute / load / comm ms",
    "predicted ms",
    "measured/pred.",
    "15%",
    "other CPU",
    "host cores",
    "msg ms",
    "drift",
    "F/B measured/pred.",
    "calibrated measured/pred.",
    "adjacent calibrated",
    "self calibrated",
    "replay",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=[*GPT_MODELS, *HF_MODELS], default=[*GPT_MODELS, *HF_MODELS])
    p.add_argument("--plans", nargs="+", choices=list(PLANS), default=list(PLANS))
    p.add_argument("--policies", nargs="+", choices=list(POLICIES), default=["plan", "recompute", "keep-host"])
    p.add_argument("--reps", type=int, default=3, help="repetitions of the whole grid (default 3)")
    p.add_argument("--steps", type=int, default=16, help="optimizer steps per run (default 16)")
    p.add_argument("--warmup", type=int, default=4, help="first steps left out of the median (default 4)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds each torchrun may take (default 600)")
    p.add_argument("--tolerance", type=float, default=0.15, help="allowed |measured/predicted - 1| (default 0.15)")
    p.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    p.add_argument(
        "--no-cores", action="store_true", help="predict as if every rank had a core of its own (host cores unused)"
    )
    p.add_argument("--no-messages", action="store_true", help="predict messages at the stand-ins' 10 GB/s, no latency")
    p.add_argument(
        "--trace",
        metavar="DIR",
        help="trace the steps after the warm-up; keep each run's trace and its action-by-action comparison with "
        "the prediction in DIR (<cell>.json, <cell>.txt)",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="also predict each cell from the profile its partner plan's traced run refined (PARTNER; traces the "
        "steps after the warm-up)",
    )
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = [*machine(), f"load average at the start: {os.getloadavg()[0]:.2f}"]
    cells = {
        (m, p, q): Cell(m, p, q)
        for m in args.models
        for p in args.plans
        for q in args.policies
        if PLANS[p][1] <= 99  # every model here has more layers than any plan has stages
    }
    ran: dict[tuple[str, str, str], list[Ran]] = {key: [] for key in cells}
    mark = cpu_mark()
    with tempfile.TemporaryDirectory(prefix="bench_fidelity_") as tmp_name:
        tmp = Path(tmp_name)
        models = model_dicts(tmp, args.models)
        for rep in range(args.reps):
            for name, parts in models.items():
                host = probe_host(args)
                for (m, p, q), cell in cells.items():
                    if m != name:
                        continue
                    ran[(m, p, q)].append(run_cell(cell, parts, host, args, tmp / f"r{rep}-{m}-{p}-{q}"))
                    print(
                        f"  rep {rep} {m} {p} {q}: {cell.measured[-1] * 1e3:.1f} ms measured, "
                        f"{cell.predicted[-1] * 1e3:.1f} ms predicted",
                        file=sys.stderr,
                        flush=True,
                    )
        if args.calibrate:
            steps = list(range(args.warmup, args.steps))
            refined = {
                k: [refine_profile(r.profile, r.run, r.per_rank, steps, r.sim) for r in runs] for k, runs in ran.items()
            }
            for (m, p, q), cell in cells.items():
                if (m, PARTNER[p], q) in cells:
                    calibrate(cell, ran[(m, p, q)], refined[(m, p, q)], refined[(m, PARTNER[p], q)])
    share, wall = other_share(mark)
    info.append(f"other processes kept {100 * share:.1f}% of the {os.cpu_count()} cores busy during the {wall:.0f} s")
    info.append(f"{args.reps} repetitions x {args.steps} steps, median of the last {args.steps - args.warmup} of each")
    table = [row(c, args.tolerance) for c in cells.values()]
    print("\n".join(info))
    widths = [max(len(r[i]) for r in [HEADER, *table]) for i in range(len(HEADER))]
    for r in [HEADER, *table]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    if args.markdown:
        print("\n" + markdown_table(HEADER, table))
    ratio = (lambda c: statistics.median(c.calibrated)) if args.calibrate else (lambda c: c.ratio)
    bad = [
        c for c in cells.values() if not (args.calibrate and not c.calibrated) and abs(ratio(c) - 1) > args.tolerance
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
