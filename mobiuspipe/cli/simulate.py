"""`mobiuspipe simulate`: one step of a plan on a topology with shared links."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from functools import partial
from pathlib import Path

from foundation.units import fmt_bytes
from mobiuspipe.cli._common import CliError, write_output
from partition.plan import Plan, load_plan
from partition.report.baselines import predict
from partition.report.trace import chrome_trace, svg_timeline
from partition.report.trace_png import png_timeline
from partition.sim.simulate import SimResult, link_paths
from topology import PRESETS, Topology, cpu_standin, load_topology

__all__ = ["register", "run", "simulate_json", "render_simulation"]


def register(sub) -> None:
    """Add the `simulate` subcommand to an argparse subparsers object."""
    p = sub.add_parser(
        "simulate",
        help="predict one step of a plan with shared PCIe links: step time, busy "
        "fractions, link traffic, peak memory; Chrome trace and Gantt picture",
    )
    p.add_argument("--plan", required=True, metavar="PLAN.yaml", help="a plan written by `partition -o`")
    p.add_argument(
        "--topology",
        metavar="NAME_OR_FILE",
        help="preset name or .yaml/.json layout file (default: the machine recorded in the plan; given, it must "
        "be that machine)",
    )
    p.add_argument("--trace", metavar="OUT.json", help="write a Chrome trace (chrome://tracing, ui.perfetto.dev)")
    p.add_argument("--png", metavar="OUT.png", help="write a Gantt chart as PNG (drawn with matplotlib)")
    p.add_argument("--svg", metavar="OUT.svg", help="write a Gantt chart as SVG")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the report")
    p.set_defaults(func=run)


def _topology(plan: Plan, spec: str | None) -> Topology:
    """The machine the plan was made on (plan.layout); --topology must be that machine. A plan file written
    before plans recorded their machine: --topology, else its preset or the CPU stand-ins it names."""
    if plan.layout is not None:
        if spec is not None and not _same_machine(load_topology(spec), plan.layout):
            raise CliError(
                f"--topology {spec} is not the machine the plan was made on ({plan.layout.name!r}, recorded in the "
                f"plan file): leave --topology out to simulate on the plan's machine, or make a plan for {spec} "
                f"with `mobiuspipe partition ... --topology {spec} -o FILE` and simulate that"
            )
        return plan.layout
    if spec is None and plan.topology == f"cpu-standin-{plan.num_gpus}":
        return cpu_standin(plan.num_gpus, plan.gpu_memory_bytes)
    if spec is None and plan.topology not in PRESETS:
        raise CliError(
            f"the plan was made for topology {plan.topology!r}, which is not a preset, and the plan file does not "
            f"record its layout (written by an older mobiuspipe): give its layout file with --topology (save one "
            f"with `mobiuspipe topology --save server.yaml`), or remake the plan with `mobiuspipe partition ... -o`"
        )
    topo = load_topology(spec or plan.topology)
    if topo.num_gpus != plan.num_gpus:
        raise CliError(
            f"the plan is for {plan.num_gpus} gpus but topology {topo.name!r} has {topo.num_gpus}: "
            f"give the topology the plan was made for (--topology)"
        )
    return topo


def _same_machine(a: Topology, b: Topology) -> bool:
    """The same machine, wherever each description was read from (a preset, a layout file, a plan)."""
    return dataclasses.replace(a, source="") == dataclasses.replace(b, source="")


def run(args: argparse.Namespace, out) -> int:
    """Simulate the plan, write the requested files, print the report (or JSON) to `out`."""
    plan = load_plan(args.plan)
    topo = _topology(plan, args.topology)
    sim = predict(plan, topo)
    title = (
        f"{plan.model} on {topo.name}: {plan.num_stages} stages on {plan.num_gpus} gpus, "
        f"simulated step {sim.step_time_s:.3f} s (shared links)"
    )
    notes = []
    for what, path, write in (
        ("Chrome trace", args.trace, lambda p: chrome_trace(sim, p)),
        ("SVG timeline", args.svg, lambda p: svg_timeline(sim, topo.num_gpus, Path(p), title)),
        ("PNG timeline", args.png, lambda p: png_timeline(sim, topo.num_gpus, Path(p), title)),
    ):
        if path:
            write_output(what, path, partial(write, path))
            notes.append(f"{what} written to {path}")
    if args.json:
        out.write(json.dumps(simulate_json(plan, topo, sim), indent=2) + "\n")
    else:
        out.write(render_simulation(plan, topo, sim))
    note_to = sys.stderr if args.json else out
    for n in notes:
        print(n, file=note_to)
    return 0


def _link_rows(topo: Topology, sim: SimResult) -> list[dict]:
    caps, _ = link_paths(topo)
    rows = []
    for name, d, nbytes in sim.link_bytes:
        gbps = caps.get((name, d), 0.0)
        use = nbytes / (gbps * 1e9 * sim.step_time_s) if gbps and sim.step_time_s > 0 else None
        rows.append({"link": name, "direction": d, "bytes": nbytes, "gbps": gbps, "utilization": use})
    return rows


def simulate_json(plan: Plan, topo: Topology, sim: SimResult) -> dict:
    """The `simulate --json` document: the plan's identity, the simulated step, per-link capacity and use."""
    d = sim.to_dict()
    d["link_bytes"] = _link_rows(topo, sim)
    return {
        "model": plan.model,
        "topology": topo.name,
        "num_gpus": plan.num_gpus,
        "num_stages": plan.num_stages,
        "num_microbatches": plan.num_microbatches,
        "mapping": plan.mapping_rule,
        "plan_predicted_step_time_s": plan.predicted_step_time_s,
        "gpu_memory_bytes": [g.memory_bytes for g in topo.gpus],
        **d,
    }


def render_simulation(plan: Plan, topo: Topology, sim: SimResult) -> str:
    """The text report: step time, per gpu busy fraction and peak memory, per link bytes and utilization."""
    lines = [
        f"simulate: {plan.model}, {plan.num_stages} stages ({plan.mapping_rule} mapping), "
        f"{plan.num_microbatches} microbatches of {plan.microbatch_size}, on topology {topo.name} "
        f"(loads and offloads share PCIe links)",
        f"simulated step time {sim.step_time_s:.3f} s (the plan's own estimate: {plan.predicted_step_time_s:.3f} s)",
        "",
        "gpu  compute busy  peak memory = arena + activations       of gpu memory",
    ]
    for g in range(topo.num_gpus):
        lines.append(
            f"{g:>3}  {sim.compute_busy_s[g]:9.3f} s {sim.busy_fraction[g]:4.0%}  "
            f"{fmt_bytes(sim.peak_memory_bytes[g]):>10} = {fmt_bytes(sim.peak_arena_bytes[g]):>10} + "
            f"{fmt_bytes(sim.activation_bytes[g]):>10}  {fmt_bytes(topo.gpus[g].memory_bytes):>10}"
        )
    lines += ["", "link        direction        moved   capacity  used over the step"]
    for r in _link_rows(topo, sim):
        use = f"{r['utilization']:.0%}" if r["utilization"] is not None else "-"
        cap = f"{r['gbps']:.2f} GB/s" if r["gbps"] else "-"
        lines.append(f"{r['link']:<12}{r['direction']:<10}{fmt_bytes(r['bytes']):>12}  {cap:>12}  {use:>6}")
    return "\n".join(lines) + "\n"
