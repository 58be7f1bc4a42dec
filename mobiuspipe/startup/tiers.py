"""Where a Pipeline's stages keep their states: the plan's tiers, or the memory settings that force others, by one rule
(partition.rules.placement.run_placement) applied by every rank to its stages, gathered so that every rank knows every
stage's tiers, and the rank's SSD store."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable

from foundation.units import MiB
from mobiuspipe.config.memory import MemoryConfig
from mobiuspipe.errors import PipelineError
from mobiuspipe.memory.store.ssd_store import SSDStore
from mobiuspipe.optim.hyper import AdamHyper
from mobiuspipe.runtime.peers.ranks import RankInfo, gather_all
from mobiuspipe.runtime.states import SsdTier, least_share
from partition.plan import Plan
from partition.rules.placement import PLAIN, HostCopies, Placement, run_placement

__all__ = ["agree_on_tiers", "check_delayed", "with_tiers"]


def agree_on_tiers(
    info: RankInfo,
    mem: MemoryConfig,
    dtype_bytes: int,
    make_optimizer: Callable,
    params: dict[int, int],
    recorded: dict[int, tuple[str, str]],
    copies: HostCopies = PLAIN,
) -> tuple[Placement, dict[int, tuple[str, str]], SSDStore | None, dict[int, SsdTier | None]]:
    """(this rank's placement, every stage's (optimizer tier, weights tier), the rank's store or None, stage j
    -> its SSD tier or None) for this rank's stages (params: stage -> parameter count): the tiers memory.optimizer
    and memory.weights name, or where they say auto those the plan records (recorded: stage -> (optimizer_tier,
    weights_tier); partition.rules.placement.run_placement, with the run's copies: UpdatePolicy.copies); the store
    is there too when memory.frozen is ssd. Every rank raises the first failing rank's error."""
    b = dtype_bytes
    try:
        mine: Placement | str = run_placement(
            mem.optimizer, mem.weights, recorded, params, int(mem.host_budget_mb * MiB), least_share(b), b, copies
        )
    except ValueError as e:
        mine = str(e)
    every = gather_all(info, mine)
    failed = [(r, p) for r, p in enumerate(every) if isinstance(p, str)]
    if failed:
        r, why = failed[0]
        raise PipelineError(f"memory.optimizer {mem.optimizer}, rank {r}: {why}")
    placement = every[info.rank]
    assert isinstance(placement, Placement)
    state_tiers = {j: (p.optimizer[j], p.weights[j]) for p in every if isinstance(p, Placement) for j in p.optimizer}
    if not placement.on_ssd:
        return placement, state_tiers, _store(info, mem) if mem.frozen == "ssd" else None, {j: None for j in params}
    hyper = AdamHyper.of(make_optimizer)
    store = _store(info, mem)
    tier = SsdTier(store, placement.slot_bytes, hyper)
    return placement, state_tiers, store, {j: tier if t == "ssd" else None for j, t in placement.optimizer.items()}


def _store(info: RankInfo, mem: MemoryConfig) -> SSDStore:
    """The rank's SSD store under memory.ssd_dir, emptied of what an earlier run left."""
    if not mem.ssd_dir:
        what = "the frozen weights" if mem.frozen == "ssd" else f"memory.optimizer {mem.optimizer}'s states"
        raise PipelineError(f"{what} go to SSD but memory.ssd_dir is not set")
    store = SSDStore(os.path.join(mem.ssd_dir, f"rank{info.rank}"))
    if store.meta or store.keys():  # what an earlier run (or attempt) left: a run resumes from its checkpoints instead
        warnings.warn(f"discarding the states an earlier run left in {store.folder}", stacklevel=2)
        store.clear()
    return store


def check_delayed(delayed_update: int | None, state_tiers: dict[int, tuple[str, str]]) -> None:
    """The delayed update keeps two versions of the loaded weights and gradients (in host memory, or as records on the
    SSD): every rank refuses it alike where some stage keeps its states on the gpu (state_tiers: every stage's, from
    agree_on_tiers), whose update runs on the gpu's own stream at the stage's next load and has nothing to hide."""
    if delayed_update is None:
        return
    other = sorted(j for j, (_, weights) in state_tiers.items() if weights == "device")
    if other:
        raise PipelineError(
            f"delayed_update: stages {other} keep their states on the gpu (memory.optimizer device), whose update "
            f"runs on the gpu at the stage's next load and has nothing to hide under the next step; keep them on the "
            f"host (memory.optimizer: host, ssd or auto), or drop the delayed update"
        )


def with_tiers(plan: Plan, state_tiers: dict[int, tuple[str, str]]) -> Plan:
    """The plan with each stage's tiers as the run keeps its states (the plan's, or what memory settings forced)."""
    stages = tuple(
        dataclasses.replace(s, optimizer_tier=state_tiers[j][0], weights_tier=state_tiers[j][1])
        for j, s in enumerate(plan.stages)
    )
    return dataclasses.replace(plan, stages=stages)
