"""Memory tiers of a plan: where each stage's states live under a host budget, by the runtime's own rule.

Legend (stage j of a plan, gpu g; units in brackets):
  N_j      parameter count of stage j                                                    [-]
  T_j      its trainable parameters: N_j, or under LoRA its adapters' (StagePlan.trains)   [-]
  Z_j      bytes of its frozen weights (LoRA's base), as loaded: P_j - G_j                  [bytes]
  b        bytes per parameter of the plan's dtype: 2 (fp16, bf16) or 4 (fp32)             [bytes]
  P_j      b N_j: stage j's weights in the plan's dtype (StagePlan.param_bytes)           [bytes]
  A_j      live activation bytes of stage j's backward on one microbatch                  [bytes]
  I_j      stage j's input for one microbatch: stage j-1's output bytes (0 for j = 0)     [bytes]
  M        microbatches per step                                                          [-]
  W        one weight slot of the device arena: max_j P_j                                 [bytes]
  G        gpus of the plan                                                               [-]
  H        host budget: host memory the whole server gives the job (None = unlimited)     [bytes]
  H_g      gpu g's share of H: floor(H / G), the same for every gpu                       [bytes]
  h_j      bytes stage j holds in host memory per microbatch from F to B (host_held_bytes): its held
           activations on the host tier (StagePlan.held_bytes), I_j for a plan without the choice  [bytes]
  S_g      saved activations of gpu g in host memory: the sum of M h_j over its stages     [bytes]
  L_j      LOADs of stage j per step: 2 (forward, backward), 1 for its gpu's last forward stage,
           which stays resident into its backward (partition.rules.order)                       [-]

State kinds, as the runtime keeps them (partition.rules.placement, mobiuspipe/runtime/states/):
  optimizer     fp32 master + Adam exp_avg + exp_avg_sq, 12 T_j: host or ssd; or, for a LoRA plan whose adapters'
                states (partition.rules.placement.gpu_state_bytes) fit every gpu's memory beside the plan's
                walk (device_peak), on the gpus for every stage (memory.optimizer device): no offload, no
                host update.
  frozen        a LoRA stage's frozen weights Z_j, read-only, never written back: host, or ssd for every stage of
                the plan (memory.frozen, one setting per run), each such stage streaming them through F host
                bytes (FROZEN_STREAM_BYTES).
  weights       the device-dtype weights b T_j and the offloaded gradients b T_j together: host or ssd (ssd only
                where the optimizer is). In fp32 with the optimizer in memory the master is the loaded copy:
                P_j (the gradients) in memory.
  saved inputs  what the forward holds for the backward on the host tier (a recompute's input, a keep's
                graphs), M h_j: host.
  streaming     the share of its gpu's budget each stage on the SSD streams through (Placement.slot_bytes): host.
Device bytes of gpu g: the arena (plan.arena_bytes: 2 W + the largest G_j) + the largest A_j of its stages; of
stage j while it runs backward: its weights and gradient slots and activations, P_j + G_j + A_j.

Placement, per gpu g (a rank of the runtime): S_g and Z_g (the sum of Z_j over its stages) come out of H_g
first; then place_states("auto", "auto", {j: T_j of g's stages}, H_g - S_g - Z_g, LEAST_SHARE_BYTES, b)
decides, exactly as a rank whose memory.host_budget_mb is H_g - S_g - Z_g: all in memory if it fits, else,
largest stage first, the optimizer states and then the weights to the SSD (partition.rules.placement).
When some gpu's share cannot hold S_g + Z_g and its stages' least shares, the frozen weights of every stage go to
the SSD, and each gpu places its states under H_g - S_g - F k_g instead (k_g: its stages with frozen weights).
Unlimited H: all in memory. PlanInfeasibleError when some gpu's share cannot hold its saved inputs, its frozen
weights' streaming shares and its stages' least shares.

SSD traffic per step of stage j: optimizer on ssd: the update reads 12 T_j and writes 12 T_j; weights on
ssd: each of the L_j LOADs reads the trainable weights G_j, the OFFLOAD writes the gradients G_j, the update
reads them (G_j) and writes the next weights (G_j); frozen on ssd: each LOAD reads Z_j too. The simulator streams
the update's part under the update and the loads' and offloads' part in the loads and offloads
(partition.sim.simulate).
"""

from __future__ import annotations

import math

from foundation.units import GiB, fmt_bytes
from partition.errors import PlanInfeasibleError
from partition.plan import Plan
from partition.rules.device_peak import gpu_headroom
from partition.rules.memory_plan import KINDS, GpuShare, HostBudget, MemoryPlan, RunMemory, SsdInfo, StageTiers
from partition.rules.order import visits_of
from partition.rules.placement import (
    FROZEN_STREAM_BYTES,
    LEAST_SHARE_BYTES,
    STATE_BYTES,
    BudgetShortfall,
    HostCopies,
    gpu_state_bytes,
    host_bytes,
    place_states,
)
from partition.sim.simulate import SsdLink
from partition.spec.analytic import dtype_bytes
from topology import Topology

__all__ = [
    "SSD_READ_GBPS",
    "SSD_WRITE_GBPS",
    "KINDS",
    "HostBudget",
    "RunMemory",
    "RunBudgetTooSmall",
    "copies_of",
    "SsdInfo",
    "StageTiers",
    "GpuShare",
    "MemoryPlan",
    "host_budget",
    "ssd_info",
    "place_tiers",
    "states_fit_gpus",
    "gpu_states_bytes",
    "host_held_bytes",
    "activation_host_caps",
    "loads_per_step",
]

SSD_READ_GBPS = 3.0
"""Sequential read of one NVMe drive when the topology was not probed (a PCIe 3.0 x4 drive's ~3.5 GB/s, less)."""
SSD_WRITE_GBPS = 2.0
"""Sequential write of one NVMe drive when the topology was not probed (sustained, past the SLC cache)."""


def host_budget(topo: Topology, given_bytes: int | None = None) -> HostBudget:
    """H: the given bytes (--host-memory-gb), else the topology's host memory when known, else unlimited."""
    if given_bytes is not None:
        return HostBudget(given_bytes, "--host-memory-gb")
    if topo.host_memory_bytes > 0:
        return HostBudget(topo.host_memory_bytes, f"host memory of topology {topo.name}")
    return HostBudget(None, f"unlimited: topology {topo.name} does not record its host memory")


def ssd_info(topo: Topology) -> SsdInfo:
    """The SSD bandwidth `topology --probe --ssd-dir DIR` measured, else SSD_READ_GBPS / SSD_WRITE_GBPS."""
    m = topo.measured
    read = m.ssd_read_gbps if m and m.ssd_read_gbps > 0 else 0.0
    write = m.ssd_write_gbps if m and m.ssd_write_gbps > 0 else 0.0
    link = SsdLink(read or SSD_READ_GBPS, write or SSD_WRITE_GBPS)
    if read and write:
        return SsdInfo(link, True, f"measured by topology --probe in {m.ssd_dir or 'its ssd_dir'}" if m else "")
    return SsdInfo(
        link,
        False,
        "unprobed: one NVMe drive's default; measure with `mobiuspipe topology --probe --ssd-dir DIR "
        "--save server.yaml` and plan with --topology server.yaml",
    )


def loads_per_step(mapping: list[int]) -> list[int]:
    """L_j of every stage: its gpu's visits in order, a LOAD at each visit but the resident backward."""
    loads = [0] * len(mapping)
    for g in set(mapping):
        visits = visits_of(mapping, g)
        for k, (j, _) in enumerate(visits):
            loads[j] += k == 0 or visits[k - 1].stage != j
    return loads


def host_held_bytes(plan: Plan, j: int) -> int:
    """Bytes stage j holds in host memory per microbatch from its forward to its backward (h_j): its held
    bytes when its activation policy puts them on the host tier; its input when the plan predates the choice
    (tier "auto": the runtime's path saves the input to host); none on the device, SSD or a peer gpu."""
    s = plan.stages[j]
    if s.activation_tier == "host":
        return s.held_bytes
    if s.activation_tier == "auto" and j > 0:
        return plan.stages[j - 1].output_bytes
    return 0


def activation_host_caps(plan: Plan, budget: HostBudget) -> list[int]:
    """Per gpu, the host bytes its held activations may take without pushing a state to the SSD: H_g less its
    stages' states all in memory (at least 0). Without a budget (host memory unknown) 0: the choice holds on
    the host no more than recompute's inputs (what a plan held before the choice), rather than guess."""
    if budget.bytes is None:
        return [0] * plan.num_gpus
    b, share = dtype_bytes(plan.dtype), budget.bytes // plan.num_gpus
    states = [0] * plan.num_gpus
    for s in plan.stages:
        states[s.gpu] += host_bytes(s.trains, "host", "host", b, copies_of(budget)) + s.frozen_bytes
    return [max(0, share - n) for n in states]


def place_tiers(plan: Plan, budget: HostBudget, gpu_states: bool | None = None) -> MemoryPlan:
    """The tiers of the legend's placement rule for `plan` under `budget`: the frozen weights in host memory if every
    gpu's share holds them, else on the SSD; the states on the gpus if gpu_states says so (None: where they fit,
    states_fit_gpus; True only for a plan they fit); PlanInfeasibleError when some gpu's share does not hold its saved
    inputs and the least streaming shares of its stages all on the SSD. A run's budget (budget.run) places each
    rank's states by the run's settings instead (RunMemory; None: on the gpus where its optimizer is device, or auto
    and they fit)."""
    saved = [plan.num_microbatches * host_held_bytes(plan, j) for j in range(plan.num_stages)]
    run = budget.run
    if gpu_states is not None:
        gpu = gpu_states
    else:
        gpu = run.optimizer == "device" if run and run.optimizer != "auto" else states_fit_gpus(plan)
    if run is not None:
        return _memory(plan, budget, _run_place(plan, run, saved, gpu, copies_of(budget)), saved)
    try:
        return _memory(plan, budget, _place(plan, budget, saved, "host", gpu), saved)
    except PlanInfeasibleError:
        if not any(s.frozen_bytes for s in plan.stages):
            raise
    return _memory(plan, budget, _place(plan, budget, saved, "ssd", gpu), saved)


def states_fit_gpus(plan: Plan) -> bool:
    """Whether the plan is LoRA's (frozen weights) and every gpu holds its stages' states (gpu_state_bytes) in the
    headroom its walk leaves (partition.rules.device_peak.gpu_headroom, without any states counted there)."""
    if not gpu_states_bytes(plan):
        return False
    return all(need <= left for need, left in zip(_gpu_states(plan), gpu_headroom(plan, on_device=())))


def gpu_states_bytes(plan: Plan) -> int:
    """The most gpu bytes any gpu's stages' states would take on the gpu tier; 0 for a plan without LoRA (frozen
    weights), which keeps its states off the gpus."""
    if not any(s.frozen_bytes for s in plan.stages):
        return 0
    return max(_gpu_states(plan))


def _gpu_states(plan: Plan) -> list[int]:
    b = dtype_bytes(plan.dtype)
    return [gpu_state_bytes([plan.stages[j].trains for j in plan.stages_of(g)], b) for g in range(plan.num_gpus)]


def _place(plan: Plan, budget: HostBudget, saved: list[int], frozen: str, gpu: bool) -> tuple[GpuShare, ...]:
    """Every gpu's share and placement with the frozen weights in `frozen` (host or ssd), the states on the gpus
    (`gpu`) or placed under the share."""
    b = dtype_bytes(plan.dtype)
    share = None if budget.bytes is None else budget.bytes // plan.num_gpus
    gpus = []
    for g in range(plan.num_gpus):
        mine = plan.stages_of(g)
        saved_g = sum(saved[j] for j in mine)
        streamed = sum(FROZEN_STREAM_BYTES for j in mine if plan.stages[j].frozen_bytes) if frozen == "ssd" else 0
        frozen_g = sum(plan.stages[j].frozen_bytes for j in mine) if frozen == "host" else 0
        params = {j: plan.stages[j].trains for j in mine}
        if gpu:
            placement = place_states("device", "host", params, 0, LEAST_SHARE_BYTES, b)
            if share is not None and share < saved_g + frozen_g + streamed:
                raise _too_small(plan, budget, share, saved, frozen)
        elif share is None:
            placement = place_states("host", "host", params, 0, LEAST_SHARE_BYTES, b)
        else:
            try:
                left = share - saved_g - frozen_g - streamed
                placement = place_states("auto", "auto", params, left, LEAST_SHARE_BYTES, b, copies_of(budget))
            except ValueError:
                raise _too_small(plan, budget, share, saved, frozen) from None
        gpus.append(GpuShare(share, saved_g, placement, frozen_g, streamed))
    return tuple(gpus)


def copies_of(budget: HostBudget) -> HostCopies:
    """What a stage keeps in host memory beyond its states under this budget's run (partition.rules.placement)."""
    return HostCopies(versions=2 if budget.delayed else 1, undo=budget.speculative, accumulates=budget.accumulates)


def _run_place(plan: Plan, run: RunMemory, saved: list[int], gpu: bool, copies: HostCopies) -> tuple[GpuShare, ...]:
    """Every gpu's placement as its rank makes it under the run's settings (RunMemory); PlanInfeasibleError naming
    memory.host_budget_mb when a rank's budget does not hold its stages' states."""
    b = dtype_bytes(plan.dtype)
    optimizer = "device" if gpu else "host" if run.optimizer == "device" else run.optimizer
    gpus, short = [], {}
    for g in range(plan.num_gpus):
        mine = plan.stages_of(g)
        params = {j: plan.stages[j].trains for j in mine}
        try:
            placement = place_states(optimizer, run.weights, params, run.state_bytes, LEAST_SHARE_BYTES, b, copies)
        except BudgetShortfall as e:
            short[g] = e
            continue
        frozen = sum(plan.stages[j].frozen_bytes for j in mine)
        on_ssd = run.frozen == "ssd"
        streamed = sum(FROZEN_STREAM_BYTES for j in mine if plan.stages[j].frozen_bytes) if on_ssd else 0
        gpus.append(GpuShare(None, sum(saved[j] for j in mine), placement, 0 if on_ssd else frozen, streamed))
    if short:
        raise RunBudgetTooSmall(plan.model, short)
    return tuple(gpus)


class RunBudgetTooSmall(PlanInfeasibleError):
    """A run's memory.host_budget_mb holds no placement of some ranks' stages: `shortfalls`, gpu -> its
    BudgetShortfall (what it holds and the least budget that would do)."""

    def __init__(self, model: str, shortfalls: dict[int, BudgetShortfall]):
        self.shortfalls = shortfalls
        g = max(shortfalls, key=lambda k: shortfalls[k].need)
        super().__init__(f"{model}, gpu {g}: {shortfalls[g]}")


def _memory(plan: Plan, budget: HostBudget, gpus: tuple[GpuShare, ...], saved: list[int]) -> MemoryPlan:
    """Bytes per stage, kind and tier of the gpus' placements."""
    b, loads = dtype_bytes(plan.dtype), loads_per_step(plan.mapping)
    host: dict[str, int] = dict.fromkeys(("optimizer", "weights", "frozen", "saved_inputs", "streaming"), 0)
    ssd: dict[str, int] = dict.fromkeys(KINDS, 0)
    rows = []
    for j, s in enumerate(plan.stages):
        p = gpus[s.gpu].placement
        opt, wts, n = p.optimizer[j], p.weights[j], s.trains
        frozen = "ssd" if gpus[s.gpu].frozen_stream_bytes and s.frozen_bytes else "host"
        fz = s.frozen_bytes if frozen == "ssd" else 0  # the frozen bytes on the SSD, each LOAD reads
        copies = copies_of(budget)
        sets = 2 if copies.undo else 1  # the speculative update's second set of states (a copy, or records)
        states = sets * STATE_BYTES * n if opt == "host" else 0
        stream = (p.slot_bytes if opt == "ssd" else 0) + (FROZEN_STREAM_BYTES if fz else 0)
        in_memory = {
            "optimizer": states,
            "weights": host_bytes(n, opt, wts, b, copies) - states,
            "frozen": s.frozen_bytes - fz,
        }
        streamed = (2 * copies.versions + sets - 1) * s.gradient_bytes  # weights and gradients, versions, undo
        on_ssd = {
            "optimizer": sets * STATE_BYTES * n if opt == "ssd" else 0,
            "weights": streamed if wts == "ssd" else 0,
            "frozen": fz,
        }
        for k, v in in_memory.items():
            host[k] += v
        for k in KINDS:
            ssd[k] += on_ssd[k]
        host["saved_inputs"] += saved[j]
        host["streaming"] += stream
        moved = s.gradient_bytes if wts == "ssd" else 0
        rows.append(
            StageTiers(
                gpu=s.gpu,
                optimizer=opt,
                weights=wts,
                loads=loads[j],
                device_bytes=s.param_bytes + s.gradient_bytes + s.activation_bytes,
                host_bytes=sum(in_memory.values()) + saved[j] + stream,
                ssd_bytes=sum(on_ssd.values()),
                load_read_bytes=moved + fz,
                offload_write_bytes=moved,
                update_read_bytes=on_ssd["optimizer"] + moved,
                update_write_bytes=on_ssd["optimizer"] + moved,
                frozen=frozen,
            )
        )
    device = [(s.gpu, s.trains) for s, r in zip(plan.stages, rows) if r.optimizer == "device"]
    gpu_states = sum(gpu_state_bytes([n for g, n in device if g == gpu], b) for gpu in range(plan.num_gpus))
    return MemoryPlan(tuple(rows), gpus, budget, _device_bytes(plan) + gpu_states, host, ssd)


def _device_bytes(plan: Plan) -> int:
    """Sum over gpus g of the arena + the largest A_j of g's stages."""
    arena = plan.arena_bytes
    return sum(arena + max(plan.stages[j].activation_bytes for j in plan.stages_of(g)) for g in range(plan.num_gpus))


def _too_small(plan: Plan, budget: HostBudget, share: int, saved: list[int], tier: str) -> PlanInfeasibleError:
    """The error naming the gpu that needs the most: its saved inputs, frozen weights (in host memory, or their
    streaming shares with them on the SSD: `tier`) and its stages' least shares."""
    held = {g: sum(saved[j] for j in plan.stages_of(g)) for g in range(plan.num_gpus)}
    frozen = {g: sum(plan.stages[j].frozen_bytes for j in plan.stages_of(g)) for g in held}
    if tier == "ssd":
        frozen = {g: sum(FROZEN_STREAM_BYTES for j in plan.stages_of(g) if plan.stages[j].frozen_bytes) for g in held}
    least = {g: len(plan.stages_of(g)) * LEAST_SHARE_BYTES for g in held}
    g = max(held, key=lambda k: held[k] + frozen[k] + least[k])
    need = held[g] + frozen[g] + least[g]
    what = "frozen weights" if tier == "host" else "the streaming share of its frozen weights on the SSD"
    base = f", {what} {fmt_bytes(frozen[g])}" if frozen[g] else ""
    nf4 = ", the frozen base in int8 or NF4 (LoRA's base_dtype)" if frozen[g] and tier == "host" else ""
    return PlanInfeasibleError(
        f"{plan.model}: gpu {g} needs {fmt_bytes(need)} of host memory even with every state on the "
        f"SSD (saved stage inputs {fmt_bytes(held[g])}{base}, the least streaming share of its "
        f"{len(plan.stages_of(g))} stages {fmt_bytes(least[g])}), but its share of the host budget ({budget.source}: "
        f"{fmt_bytes(budget.bytes or 0)} over {plan.num_gpus} gpus) is {fmt_bytes(share)}: give more host memory "
        f"(--host-memory-gb {math.ceil(plan.num_gpus * need / GiB)}), fewer microbatches{nf4}, or a smaller model"
    )
