"""Whether a plan's states fit the run's memory settings, checked before launch: each rank's stages under
memory.host_budget_mb (the placement rule every rank applies when it builds its Pipeline), memory.ssd_dir, a
folder this process can write with room for what the plan puts there, and this host's memory, with room for what
its ranks hold there (host_room).

SSD bytes of a stage of n parameters (b = bytes of the training dtype), as the ranks' stores allocate them:
  optimizer on ssd:  12 n (fp32 master, exp_avg, exp_avg_sq)
  weights on ssd:    2 b n more (the weights the device loads and the gradients it offloads), twice with the
                     delayed update (two versions of each)
  the speculative update (UpdatePolicy.copies undo): a second set of the optimizer's records, 12 n, and of the
                     weights' with weights on ssd, b n (where each tentative update writes)
  frozen on ssd (memory.frozen ssd): the stage's frozen bytes (StagePlan.frozen_bytes: LoRA's base)
  activations on ssd (memory.activation_tier ssd, or the plan's choice under `plan`): H_j per microbatch, all
  the step's microbatches at once at most (H_j: the plan's held bytes, else its activation bytes).
What an earlier run left in ranks' stores is discarded at start-up, so its files count as free, unless a
checkpoint links them (a file with several links stays).

Host bytes of a stage (host_bytes): its states as placed (partition.rules.placement.host_bytes, and the streaming
share of a stage on SSD), its frozen weights (LoRA's base: with memory.frozen host all of them, with ssd the
FROZEN_STREAM_BYTES it streams them through), and its saved activations on the host tier (M per step: the plan's
held bytes, partition.rules.tiers.host_held_bytes). The ranks of a host need their sum within its MemAvailable.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from foundation.checked import Problem
from foundation.host_memory import mem_available as _mem_available
from foundation.units import MiB, fmt_bytes
from mobiuspipe.config import RunConfig
from mobiuspipe.runtime.states import least_share
from mobiuspipe.startup.config_plan import run_copies
from partition.plan import Plan
from partition.rules.placement import (
    FROZEN_STREAM_BYTES,
    STATE_BYTES,
    BudgetShortfall,
    Placement,
    host_bytes,
    run_placement,
)
from partition.rules.tiers import host_held_bytes
from partition.spec.analytic import dtype_bytes

__all__ = ["placements", "shortfall_problem", "ssd_need", "ssd_room", "ssd_bytes", "host_bytes_of", "host_room"]


def placements(cfg: RunConfig, plan: Plan) -> tuple[dict[int, Placement], list[Problem]]:
    """Each gpu's placement of its stages by memory.optimizer and memory.weights (where auto, the plan's tiers) under
    memory.host_budget_mb, as its rank will place them; one Problem naming the ranks whose stages the budget does not
    hold."""
    mem, b = cfg.memory, dtype_bytes(plan.dtype)
    placed, short = {}, {}
    for g in range(plan.num_gpus):
        params = {j: plan.stages[j].trains for j in plan.stages_of(g)}  # LoRA: the adapters; the base has no state
        recorded = {j: (plan.stages[j].optimizer_tier, plan.stages[j].weights_tier) for j in params}
        try:
            placed[g] = run_placement(
                mem.optimizer,
                mem.weights,
                recorded,
                params,
                int(mem.host_budget_mb * MiB),
                least_share(b),
                b,
                run_copies(cfg),
            )
        except BudgetShortfall as e:
            short[g] = e
    return placed, [shortfall_problem(short, mem.host_budget_mb)] if short else []


def shortfall_problem(short: dict[int, BudgetShortfall], budget_mb: float) -> Problem:
    """One Problem for the ranks (gpu -> its shortfall) the budget per rank does not hold."""
    worst = max(short.values(), key=lambda e: e.need)
    each = "; ".join(
        f"rank {g}: stages {', '.join(map(str, sorted(e.params)))}, {sum(e.params.values())} parameters, "
        f"{fmt_bytes(e.held)} in memory, {e.need / MiB:.4g} MiB in all"
        for g, e in short.items()
    )
    return Problem(
        "memory.host_budget_mb",
        f"at least {worst.need / MiB:.4g} MiB per rank, to hold its stages with memory.optimizer {worst.optimizer} "
        f"and memory.weights {worst.weights}, each stage on SSD streaming through at least {fmt_bytes(worst.least)} "
        f"({each})",
        f"{budget_mb:g} MiB",
        worst.fix,
    )


def ssd_bytes(cfg: RunConfig, plan: Plan, g: int, placement: Placement | None) -> int:
    """Bytes gpu g's rank writes under memory.ssd_dir (see the module docstring)."""
    b, total, copies = dtype_bytes(plan.dtype), 0, run_copies(cfg)
    twice = copies.undo  # the speculative update: a second set of records
    for j in plan.stages_of(g):
        s = plan.stages[j]
        if placement is not None and placement.optimizer[j] == "ssd":
            streamed = placement.weights[j] == "ssd"
            total += STATE_BYTES * s.trains + (2 * copies.versions * b * s.trains if streamed else 0)
            total += (STATE_BYTES * s.trains + (b * s.trains if streamed else 0)) if twice else 0
        if cfg.memory.frozen == "ssd":
            total += s.frozen_bytes
        if _activations_on_ssd(cfg, s.activation_tier):
            total += plan.num_microbatches * (s.held_bytes if s.held_bytes >= 0 else s.activation_bytes)
    return total


def _activations_on_ssd(cfg: RunConfig, planned: str) -> bool:
    tier = cfg.memory.activation_tier
    return tier == "ssd" or (tier == "plan" and planned == "ssd")


def ssd_need(cfg: RunConfig, plan: Plan, placed: dict[int, Placement], host_ranks: range) -> int:
    """Bytes the ranks of this host (host_ranks) write under memory.ssd_dir, all together (0 without one)."""
    if not cfg.memory.ssd_dir:
        return 0
    return sum(ssd_bytes(cfg, plan, g, placed.get(g)) for g in host_ranks)


def ssd_room(folder: Path, need: int, host_ranks: range) -> list[Problem]:
    """A Problem when `folder` (memory.ssd_dir) has no room for `need` bytes of the ranks host_ranks."""
    free = shutil.disk_usage(folder).free + sum(_reclaimable(folder, g) for g in host_ranks)
    if free >= need:
        return []
    ranks = f"rank {host_ranks.start}" if len(host_ranks) == 1 else f"ranks {host_ranks.start}..{host_ranks.stop - 1}"
    return [
        Problem(
            "memory.ssd_dir",
            f"room for the {fmt_bytes(need)} that the plan's {ranks} keep there (optimizer states, streamed "
            f"weights, frozen weights and SSD activations)",
            f"{fmt_bytes(free)} free in {folder}",
            "free space there, or set memory.ssd_dir to a folder on a bigger disk",
        )
    ]


def _reclaimable(folder: Path, g: int) -> int:
    """Bytes of the files an earlier run left in rank g's stores there that no checkpoint links (start-up
    discards them)."""
    total = 0
    for store in (folder / f"rank{g}", folder / f"rank{g}-activations"):
        for dirpath, _, names in os.walk(store):
            for name in names:
                st = os.lstat(os.path.join(dirpath, name))
                total += st.st_blocks * 512 if st.st_nlink == 1 else 0
    return total


HOST_KINDS = ("states", "frozen", "activations")
"""What a rank holds in host memory, by kind (host_bytes_of)."""


def host_bytes_of(cfg: RunConfig, plan: Plan, g: int, placement: Placement) -> dict[str, int]:
    """Host bytes gpu g's rank holds, by kind: states, frozen (LoRA's base), saved activations (module docstring)."""
    b = dtype_bytes(plan.dtype)
    out: dict[str, int] = dict.fromkeys(HOST_KINDS, 0)
    for j in plan.stages_of(g):
        s = plan.stages[j]
        opt, wts = placement.optimizer[j], placement.weights[j]
        out["states"] += host_bytes(s.trains, opt, wts, b, run_copies(cfg)) + (
            placement.slot_bytes if opt == "ssd" else 0
        )
        if s.frozen_bytes:
            out["frozen"] += s.frozen_bytes if cfg.memory.frozen == "host" else FROZEN_STREAM_BYTES
        if cfg.memory.activation_tier in ("plan", "host"):
            held = host_held_bytes(plan, j) if cfg.memory.activation_tier == "plan" else max(s.held_bytes, 0)
            out["activations"] += plan.num_microbatches * held
    return out


def host_room(cfg: RunConfig, plan: Plan, placed: dict[int, Placement], host_ranks: range) -> list[Problem]:
    """A Problem when the ranks host_ranks would hold more in host memory than this host has available
    (MemAvailable; no check where /proc/meminfo is not there)."""
    free = _mem_available()
    if free is None:
        return []
    kinds: dict[str, int] = dict.fromkeys(HOST_KINDS, 0)
    for g in host_ranks:
        if g in placed:
            for k, v in host_bytes_of(cfg, plan, g, placed[g]).items():
                kinds[k] += v
    need = sum(kinds.values())
    if need <= free:
        return []
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in kinds.items() if v)
    fixes = []
    if kinds["frozen"] and cfg.memory.frozen == "host":
        fixes.append(
            "`memory.frozen: ssd` (with memory.ssd_dir) or `lora.base_dtype: int8` / `nf4` for the frozen base"
        )
    if kinds["states"]:
        fixes.append("`memory.optimizer: auto` with a memory.host_budget_mb for the states")
    if kinds["activations"]:
        fixes.append("`memory.activation_tier: ssd` or `device` for the saved activations")
    return [
        Problem(
            "host memory",
            f"room for the {fmt_bytes(need)} that ranks {host_ranks.start}..{host_ranks.stop - 1} hold in this "
            f"host's memory ({parts})",
            f"{fmt_bytes(free)} available (MemAvailable)",
            "; or ".join(fixes) or "use a host with more memory",
        )
    ]
