"""scripts/gpu_check.py's (c): the memory a run measured against its plan, at the step's peak and at each action, and
what Hugging Face layers keep and allocate beyond it against the analytic profile's counts."""

from __future__ import annotations

from pathlib import Path

import gpu_runs as runs
import torch
from gpu_table import Table

from mobiuspipe.profiling.profiler import library_bytes
from partition.plan import save_plan
from partition.rules.device_peak import planned_timeline

ALLOCATOR_ROUNDING = 32 << 10
"""Bytes a layer's measured transients may exceed their count by: CUDA's caching allocator rounds every block up to
512 bytes (64 blocks' worth here); the profiler empties its cache first, so that no larger cached block is handed
out whole (up to 1 MiB more)."""


def memory_rows(
    t: Table,
    base: runs.Run,
    size: runs.Size,
    device: torch.device,
    plan,
    cuda: bool,
    out: str,
    memory_report: str | None,
) -> None:
    """(c): the run's peak against the plan's walk, each action's, the ledger at the peak; on a GPU the allocator's
    reserved and used bytes, the host memory the run page-locked, X and W, the plan written beside `out` and (with
    memory_report) what was live at the peak."""
    own = base.peak_bytes - base.before_bytes  # the run's own bytes: the process held the rest before it began
    held = f" (+ {base.before_bytes / 2**20:.2f} held before the run)" if base.before_bytes else ""
    t.add(
        "peak at or below the plan",
        own <= base.planned_bytes,
        f"{own / 2**20:.2f} of {base.planned_bytes / 2**20:.2f} MiB planned{held}",
        "<= plan",
    )
    t.guarded("each action within the plan at it", action_rows, t, size, plan, cuda)
    parts = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(base.ledger_parts.items(), key=lambda kv: -kv[1]))
    t.add("the runtime's ledger at its peak (MiB)", None, f"{sum(base.ledger_parts.values()) / 2**20:.1f}: {parts}")
    if cuda:
        t.add(
            "reserved / used by the process",
            None,
            f"{base.reserved_bytes / 2**30:.2f} / {base.used_bytes / 2**30:.2f} GiB",
        )
        t.add(
            "host memory page-locked by the run",
            None,
            f"{base.pinned_bytes / 2**20:.1f} MiB (cudaHostRegister, each buffer at its own size)",
        )
        w = library_bytes(device, torch.float32)
        xs = ", ".join(f"{plan.transients_on(g) / 2**20:.1f}" for g in range(plan.num_gpus))
        t.add(
            "beyond the walk: X per gpu + W (MiB)",
            None,
            f"{xs} + {plan.workspace_bytes / 2**20:.1f} planned; W {w / 2**20:.1f} (cuBLAS workspaces, measured now)",
        )
        save_plan(plan, Path(out).with_name("plan_fp32.yaml"))
        if memory_report:
            print("\n".join(runs.memory_report(size, plan, memory_report)), flush=True)


def hf_counts(t: Table, device: torch.device, folder: Path) -> None:
    """What Hugging Face layers keep for backward, and allocate beyond it while it runs, on this device's kernels
    within what the plan counts (the transients on a gpu only: the stand-in's ledger counts none)."""
    for name, kept, spent in runs.hf_kept(device, folder):
        t.add(f"HF {name}: kept within the count", kept <= 1.0, f"{kept:.6f} of it at most", "<= 1")
        if spent is not None:
            ratio, over = spent
            t.add(
                f"HF {name}: transients within the count",
                over <= ALLOCATOR_ROUNDING,
                f"{ratio:.6f} of it at most ({over:+,} bytes)",
                f"<= {ALLOCATOR_ROUNDING:,} bytes over",
            )


def action_rows(t: Table, size: runs.Size, plan, cuda: bool) -> None:
    """Each action's measured peak against the plan's bytes at that action (planned_timeline, of the plan as the run
    ran it): where the walk is short, not only whether the step's peak is. On the stand-in, the ledger once each
    action ended against the stand-in's walk."""
    measured, as_run = runs.action_peaks(size, plan)
    timeline = planned_timeline(as_run, 0, standin=not cuda, sends_until_flush=False)
    if [step for step, _ in measured] != [step for step, _ in timeline]:
        t.add("each action within the plan at it", False, "the run's actions are not the walk's, in order", "the same")
        return
    room = sorted((planned - got, step) for (step, planned), (_, got) in zip(timeline, measured))
    least, step = room[0]
    over = [_action(s) for spare, s in room if spare < 0]
    figure = f"{len(room)} actions; least room {least / 2**20:.2f} MiB, at {_action(step)}"
    t.add(
        "each action within the plan at it",
        not over,
        figure + (f"; over: {', '.join(over[:4])}" if over else ""),
        "<= the walk + X at it" if cuda else "<= the walk at it",
    )


def _action(step: tuple[str, int, int]) -> str:
    """An action as the schedule prints it: B7.3 (kind, stage, microbatch), L2 (a stage's)."""
    kind, j, i = step
    return f"{kind}{j}" + (f".{i}" if i >= 0 else "")
