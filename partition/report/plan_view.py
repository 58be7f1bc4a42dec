"""A plan as `mobiuspipe partition` shows it: the text (header, memory and tiers, one row per stage, the ASCII
timeline) and the --json document (docs/design.md's contract)."""

from __future__ import annotations

from foundation.units import fmt_bytes
from partition.plan import Plan
from partition.report.trace import ascii_timeline
from partition.search import Prediction
from partition.sim.simulate import SimResult

__all__ = ["plan_to_json", "render_plan"]


def _stage_json(plan: Plan) -> list[dict]:
    return [
        {
            "layers": [s.first, s.last],
            "gpu": s.gpu,
            "param_count": s.param_count,
            "param_bytes": s.param_bytes,
            "trainable_count": s.trains,
            "grad_bytes": s.gradient_bytes,
            "activation_bytes": s.activation_bytes,
            "output_bytes": s.output_bytes,
            "buffer_bytes": s.buffer_bytes,
            "transient_bytes": s.transient_bytes,
            "fwd_s": s.fwd_s,
            "bwd_s": s.bwd_s,
            "load_s": s.load_s,
            "load_gbps": s.load_gbps,
            "optimizer_tier": s.optimizer_tier,
            "weights_tier": s.weights_tier,
            "activations": {
                "mode": s.activations,
                "kept_layers": list(s.kept_layers),
                "tier": s.activation_tier,
                "held_bytes": s.held_bytes,
                "forward_s": s.forward_s,
                "recompute_s": s.recompute_s,
            },
        }
        for s in plan.stages
    ]


def plan_to_json(plan: Plan, pred: Prediction | None = None) -> dict:
    """The `partition --json` document (docs/design.md contract plus the plan's memory and per-stage costs);
    with a prediction, `memory`: the bytes per tier, the tier of each state kind, the SSD and the bound."""
    doc = {
        "model": plan.model,
        "topology": plan.topology,
        "num_layers": plan.num_layers,
        "num_gpus": plan.num_gpus,
        "num_stages": plan.num_stages,
        "num_microbatches": plan.num_microbatches,
        "microbatch_size": plan.microbatch_size,
        "dtype": plan.dtype,
        "mapping": plan.mapping_rule,
        "mapping_score": plan.mapping_score,
        "param_count": sum(s.param_count for s in plan.stages),
        "trainable_count": sum(s.trains for s in plan.stages),
        "stages": _stage_json(plan),
        "predicted_step_time_s": plan.predicted_step_time_s,
        "slot_bytes": plan.slot_bytes,
        "arena_bytes": plan.arena_bytes,
        "activation_bytes": plan.activation_bytes,
        "gpu_memory_bytes": plan.gpu_memory_bytes,
        "workspace_bytes": plan.workspace_bytes,
        "buffer_bytes": plan.buffer_bytes,
        "solver": {
            "name": plan.solver.name,
            "status": plan.solver.status,
            "gap": plan.solver.gap,
            "wall_s": plan.solver.wall_s,
            "num_vars": plan.solver.num_vars,
            "num_rows": plan.solver.num_rows,
        },
    }
    if pred is not None:
        ssd = {"read_gbps": pred.ssd.link.read_gbps, "write_gbps": pred.ssd.link.write_gbps}
        ssd |= {"measured": pred.ssd.measured, "note": pred.ssd.note}
        doc["memory"] = {**pred.memory.to_dict(), "ssd": ssd, **pred.bound.to_dict()}
    return doc


def _memory_lines(pred: Prediction) -> list[str]:
    """The memory/tier section: bytes per tier, the tier of each kind, the SSD and what bounds the step."""
    mem, ssd, bound = pred.memory, pred.ssd, pred.bound
    budget = mem.budget.source
    if mem.budget.bytes:
        per_gpu = fmt_bytes(mem.budget.bytes // len(mem.gpus))
        budget = f"{fmt_bytes(mem.budget.bytes)} ({mem.budget.source}), {per_gpu} per gpu"
    named = [("optimizer", "optimizer"), ("weights", "weights and gradients")]
    kinds = ", ".join(
        f"{name} {mem.tier(k)}"
        + (f" ({mem.on_ssd(k)} of {len(mem.stages)} stages on ssd)" if "+" in mem.tier(k) else "")
        for k, name in named + ([("frozen", "frozen base")] if mem.has_frozen else [])
    )
    runs = [f"memory.{k}: ssd" for k in ("frozen",) if mem.has_frozen and mem.tier(k) == "ssd"]
    runs += ["memory.optimizer: device"] if mem.tier("optimizer") == "device" else []
    if runs:
        kinds += f" (a run sets {' and '.join(runs)})"
    busy = ", ".join(
        f"{k.replace('_', ' ')} {v:.1f} s" + (f" ({bound.names[k]})" if k in ("compute", "pcie") else "")
        for k, v in bound.busy_s.items()
    )
    name = bound.bound_by.replace("_", " ")
    name += f" ({bound.bound_link})" if bound.bound_by in ("compute", "pcie") else ""
    return [
        f"memory: device {fmt_bytes(mem.device_bytes)}, host {fmt_bytes(mem.host_bytes)}, "
        f"ssd {fmt_bytes(mem.ssd_bytes)}; host budget {budget}",
        f"tiers: {kinds}",
        f"ssd: {ssd.link.read_gbps:g} GB/s read, {ssd.link.write_gbps:g} GB/s write ({ssd.note}); "
        + (
            f"a step reads {fmt_bytes(mem.ssd_read_bytes)} and writes {fmt_bytes(mem.ssd_write_bytes)}"
            if mem.ssd_bytes
            else "unused: every state fits the host budget"
        ),
        f"step bound by {name}: busy {bound.share:.0%} of the step; busy seconds: {busy}",
    ]


def _header(plan: Plan) -> list[str]:
    p, s = plan, plan.solver
    return [
        f"plan: {p.model} on topology {p.topology}: {p.num_stages} stages on {p.num_gpus} gpus, {p.mapping_rule} "
        f"mapping (contention {p.mapping_score:.2f}), {p.num_microbatches} microbatches of {p.microbatch_size}, "
        f"{p.dtype}",
        f"predicted step time {p.predicted_step_time_s:.3f} s",
        f"memory per gpu: arena {fmt_bytes(p.arena_bytes)} ({p.arena_words()}) + activations "
        f"{fmt_bytes(p.activation_bytes)} = "
        f"{fmt_bytes(p.arena_bytes + p.activation_bytes)} of {fmt_bytes(p.gpu_memory_bytes)} usable" + _memory_notes(p),
        f"solver {s.name}: {s.status}, gap {s.gap:g}, {s.wall_s:.3f} s",
    ] + _lora_line(plan)


def _memory_notes(p: Plan) -> str:
    """The usable memory's notes: what each gpu's computing layer holds within it beyond the walk (X_g), and what it is
    net of beside the reserve: the workspaces (with the largest X in plans made before stages recorded theirs), the
    layers' buffers (nothing when none of them)."""
    notes, held = [], []
    if any(s.transient_bytes for s in p.stages):
        each = [p.transients_on(g) for g in range(p.num_gpus)]
        most = (
            f"{fmt_bytes(each[0])} on each gpu"
            if len(set(each)) == 1
            else ", ".join(f"gpu {g} {fmt_bytes(x)}" for g, x in enumerate(each))
        )
        notes.append(f"a computing layer's backward transients within it, at most {most}")
    if p.workspace_bytes:
        what = "cuBLAS's workspaces" if notes else "a layer's backward transients and cuBLAS's workspaces"
        held.append(f"{fmt_bytes(p.workspace_bytes)} for {what}")
    if p.buffer_bytes:
        held.append(f"the layers' buffers, {fmt_bytes(p.buffer_bytes)}")
    if held:
        notes.append(f"{' and '.join(held)} held apart")
    return f" ({'; '.join(notes)})" if notes else ""


def _lora_line(plan: Plan) -> list[str]:
    """Under LoRA, what trains and what is frozen (nothing when every parameter trains)."""
    trains, total = sum(s.trains for s in plan.stages), sum(s.param_count for s in plan.stages)
    if trains == total:
        return []
    frozen = sum(s.frozen_bytes for s in plan.stages)
    return [
        f"LoRA: {trains:,} parameters train (the adapters); the frozen base, {fmt_bytes(frozen)}, streams read-only: "
        f"no gradient, offload or optimizer state"
    ]


_COLUMNS = ("j", "layers", "#layers", "gpu", "params", "activations", "fwd ms/mb", "bwd ms/mb", "load ms")


def _table(plan: Plan) -> list[str]:
    rows = [
        (
            str(j),
            f"{s.first}-{s.last}",
            str(s.last - s.first + 1),
            str(s.gpu),
            fmt_bytes(s.param_bytes),
            fmt_bytes(s.activation_bytes),
            f"{s.fwd_s * 1e3:.2f}",
            f"{s.bwd_s * 1e3:.2f}",
            f"{s.load_s * 1e3:.1f}",
        )
        for j, s in enumerate(plan.stages)
    ]
    widths = [max(len(c), *(len(r[k]) for r in rows)) for k, c in enumerate(_COLUMNS)]
    return ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in (_COLUMNS, *rows)]


def render_plan(plan: Plan, sim: SimResult, width: int = 100, pred: Prediction | None = None) -> str:
    """Header (and with a prediction the memory/tier section), one row per stage, then the ASCII timeline."""
    head = _header(plan) + (_memory_lines(pred) if pred else [])
    return "\n".join(head + [""] + _table(plan) + [""]) + "\n" + ascii_timeline(sim, plan.num_gpus, width)
