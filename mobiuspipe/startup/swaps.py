"""Where each stage's held activations live between its forward and its backward (memory.activation_tier or
the plan's choice), and the swap tiers this rank runs for its stages (mobiuspipe.memory.swap, swap_ssd)."""

from __future__ import annotations

import dataclasses
import os

from mobiuspipe.config.memory import MemoryConfig
from mobiuspipe.errors import PipelineError
from mobiuspipe.memory.device import Device
from mobiuspipe.memory.ledger import DeviceLedger
from mobiuspipe.memory.store.ssd_store import SSDStore
from mobiuspipe.memory.swap import HostSwap, Swap
from mobiuspipe.memory.swap_ssd import SsdSwap
from mobiuspipe.runtime.peers.ranks import RankInfo
from mobiuspipe.startup.peer_regions import open_regions
from partition.plan import Plan

__all__ = ["swap_tiers", "make_swaps", "plan_as_run", "RUN_TIERS"]

RUN_TIERS = ("host", "ssd", "peer")
"""The tiers off the device the engine runs."""


def swap_tiers(plan: Plan, memory: MemoryConfig, modes: dict) -> dict[int, str]:
    """Stage -> its tier off the device, for the stages whose held activations swap (the same on every rank):
    a recompute stage's input, a keep or selective stage's kept graphs and recomputed parts' inputs.
    memory.activation_tier "plan": the plan's choice; else that tier for every stage but the last (whose
    forward runs inside its backward); "device": none."""
    last = plan.num_stages - 1
    if memory.activation_tier == "plan":
        wanted = {j: s.activation_tier for j, s in enumerate(plan.stages) if s.activation_tier in RUN_TIERS}
    elif memory.activation_tier == "device":
        wanted = {}
    else:
        wanted = {j: memory.activation_tier for j in range(last)}
    if last in wanted:
        raise PipelineError(
            f"stage {last} is the last: its forward runs inside its backward, so nothing is held in between to "
            f"swap to {wanted[last]}; give the last stage activation_tier device"
        )
    return wanted


def make_swaps(
    tiers: dict[int, str], plan: Plan, device: Device, memory: MemoryConfig, info: RankInfo, ledger: DeviceLedger
) -> dict[int, Swap]:
    """The swap tier objects of this rank's stages in `tiers` (one SSD store per rank, in ssd_dir; one region on
    the peer); plan: as the run runs it (plan_as_run: its held bytes size the peer regions). Key -1: the regions
    this rank gives its peers (mobiuspipe.startup.peer_regions; every rank sets them up together)."""
    out: dict[int, Swap] = {}
    ssd: SsdSwap | None = None
    peer, out[-1] = open_regions(plan, info, device, ledger)
    for j in (j for j in plan.stages_of(info.rank) if j in tiers):
        if tiers[j] == "host":
            out[j] = HostSwap(device)
            continue
        if tiers[j] == "peer":
            assert peer is not None, (
                "the plan parks this stage on the peer tier, so partition.rules.peer sized a region"
            )
            out[j] = peer
            continue
        if ssd is None:
            if not memory.ssd_dir:
                raise PipelineError("activation_tier ssd needs memory.ssd_dir: set it to a folder on an NVMe drive")
            store = SSDStore(os.path.join(memory.ssd_dir, f"rank{info.rank}-activations"))
            ssd = SsdSwap(device, store, owns_store=True)
        out[j] = ssd
    return out


def plan_as_run(plan: Plan, modes: dict, tiers: dict[int, str]) -> Plan:
    """The plan with each stage's activation policy as this run runs it (memory.activations and
    memory.activation_tier may force another than the plan's), so that its lifetime walk is the run's. A
    forced mode's bytes and times come from the stage's sums (the plan has no per-layer figures): recompute
    holds the input and redoes the forward with grad in B; keep and selective hold up to the stage's live
    activations A_j; keep runs the forward with grad in F; a forced selective is timed as recompute. The same on a
    gpu and on the stand-in: a recompute stage's input on the device tier stays there (compute.fwd), held."""
    stages = []
    for j, s in enumerate(plan.stages):
        mode, tier = modes[j].mode, tiers.get(j, "device")
        before_choice = (s.activation_tier, mode, tier) == ("auto", "recompute", "device")  # the path's own
        if (mode, tier) == (s.activations, s.activation_tier) or before_choice or j == plan.num_stages - 1:
            stages.append(s)
            continue
        inp = plan.stages[j - 1].output_bytes if j > 0 else plan.input_bytes
        held = inp if mode == "recompute" else s.activation_bytes
        kept = tuple(sorted(modes[j].keep_layers)) if mode == "selective" else ()
        grad = _grad_forward_s(s)
        forward, redo = (grad if s.kept_s is None else s.kept_s, 0.0) if mode == "keep" else (s.fwd_s, grad)
        stages.append(
            dataclasses.replace(
                s,
                activations=mode,
                kept_layers=kept,
                activation_tier=tier,
                held_bytes=held,
                work_bytes=s.activation_bytes,
                recompute_s=redo,
                forward_s=forward,
            )
        )
    return dataclasses.replace(plan, stages=tuple(stages))


def _grad_forward_s(s) -> float:
    """A stage's whole forward with grad (s): its grad_s, or in plans before it, from the times its plan records
    under its own policy (a selective stage's: an upper bound, its recomputed segments counted with and
    without grad)."""
    if s.grad_s is not None:
        return s.grad_s
    if s.activations == "recompute":
        return s.fwd_s if s.recompute_s is None else s.recompute_s
    return s.f_s + (s.recompute_s or 0.0)
