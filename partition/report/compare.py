"""The `partition --compare` table: a plan's predicted step beside the baselines' (partition.report.baselines)."""

from __future__ import annotations

from partition.plan import Plan
from partition.report.baselines import BaselineResult, gpipe, predict, sequential_mapping, zero_offload
from partition.search import host_adam_rate
from partition.spec.profile import Profile
from topology import Topology

__all__ = ["compare", "compare_json", "compare_text"]


def compare(plan: Plan, topo: Topology, profile: Profile, delayed: bool = False) -> list[BaselineResult]:
    """mobiuspipe's plan, then the same planner with sequential mapping, ZeRO-3 offload and GPipe, all
    predicted with shared links on `topo` for the plan's microbatches and memory reserve; delayed: mobiuspipe's rows
    with the delayed update (each step's host updates under the next step)."""
    sim = predict(plan, topo, delayed)
    m = plan.num_microbatches
    reserve = min(g.memory_bytes for g in topo.gpus) - plan.gpu_share_bytes  # make_plan holds W and V apart itself
    most_x = max(s.transient_bytes for s in plan.stages)  # and each stage's X within its rule
    net = reserve + plan.workspace_bytes + most_x + plan.buffer_bytes  # the baselines' own rules do not
    mine = BaselineResult(
        f"mobiuspipe ({plan.mapping_rule} mapping)",
        sim.step_time_s,
        notes=(
            f"{plan.num_stages} stages; compute busy {min(sim.busy_fraction):.0%}-{max(sim.busy_fraction):.0%} "
            f"of the step; host Adam "
            + ("runs under the next step (the delayed update)" if delayed else "overlaps the backward"),
        ),
    )
    return [
        mine,
        sequential_mapping(profile, topo, m, delayed, num_stages=plan.num_stages, reserve_bytes=reserve),
        zero_offload(profile, topo, m, net),
        gpipe(profile, topo, m, net),
    ]


def compare_json(
    plan: Plan, topo: Topology, profile: Profile, results: list[BaselineResult] | None = None, delayed: bool = False
) -> dict:
    """{"systems": [{name, step_time_s, reason, notes, speedup}], ...}: speedup = its step / mobiuspipe's."""
    results = results or compare(plan, topo, profile, delayed)
    base = results[0].step_time_s
    rows = [r.to_dict() | {"speedup": (r.step_time_s / base) if r.step_time_s and base else None} for r in results]
    adam = max(sum(s.trains for s in plan.stages if s.gpu == g) for g in range(plan.num_gpus)) / host_adam_rate(topo)
    return {
        "model": plan.model,
        "topology": topo.name,
        "num_microbatches": plan.num_microbatches,
        "microbatch_size": plan.microbatch_size,
        "host_adam_s": adam,
        "systems": rows,
    }


def _speed(ratio: float) -> str:
    return f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"


def compare_text(
    plan: Plan, topo: Topology, profile: Profile, results: list[BaselineResult] | None = None, delayed: bool = False
) -> str:
    """The table `partition --compare` prints: each system's step and mobiuspipe's speed-up over it (delayed: with the
    delayed update)."""
    d = compare_json(plan, topo, profile, results, delayed)
    lines = [
        f"compare: {plan.model}, one step of {plan.num_microbatches} microbatches of {plan.microbatch_size} "
        f"on topology {topo.name}, every system on the same shared-link model",
        f"{'system':<34}{'step (s)':>10}  mobiuspipe is",
    ]
    for k, r in enumerate(d["systems"]):
        step = f"{r['step_time_s']:.2f}" if r["step_time_s"] is not None else "-"
        speed = "(the reference)" if k == 0 else _speed(r["speedup"]) if r["speedup"] else r["reason"]
        lines.append(f"{r['name']:<34}{step:>10}  {speed}")
        lines += [f"{'':<4}{n}" for n in r["notes"]]
    measured = (
        "measured by `topology --probe`"
        if topo.measured and topo.measured.host_adam_params_per_s
        else "assumed: partition.search.HOST_ADAM_PARAMS_PER_S; `topology --probe --save` measures it"
    )
    lines.append(
        f"host Adam over a rank's trained parameters takes {d['host_adam_s']:.1f} s (the busiest rank; the ranks at "
        f"once) at {host_adam_rate(topo):.3g} params/s a rank ({measured}); mobiuspipe runs it "
        + ("under the next step (the delayed update)" if delayed else "behind the backward")
        + ", ZeRO-3 offload after it (modelled without a delayed update)"
    )
    return "\n".join(lines) + "\n"
