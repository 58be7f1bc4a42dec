"""Memory tiers of a plan: where each state kind of each stage lives (device, host, ssd) under a host budget.

Legend (stage j of a plan; units in brackets):
  N_j      parameter count of stage j                                                    [-]
  P_j      parameter bytes of stage j in the plan's dtype (StagePlan.param_bytes)        [bytes]
  A_j      live activation bytes of stage j's backward on one microbatch                  [bytes]
  I_j      stage j's input for one microbatch: stage j-1's output bytes (0 for j = 0)     [bytes]
  M        microbatches per step                                                          [-]
  W        one weight slot of the device arena: max_j P_j                                 [bytes]
  H        host budget: host memory the whole server gives the job (None = unlimited)     [bytes]
  S        STREAM_BYTES: host memory per gpu the out-of-core Adam streams SSD states through [bytes]

State kinds, as the runtime keeps them (mobiuspipe/stage.py, mobiuspipe/stage_states.py):
  weights       the copy the device loads, P_j, in host memory. In fp32 with the optimizer states in host
                memory the fp32 master is that copy (0 extra bytes).
  optimizer     fp32 master + Adam exp_avg + exp_avg_sq: OPTIMIZER_BYTES_PER_PARAM * N_j, host or ssd.
  gradients     the gradients the device offloads after the stage's last microbatch, P_j (the training
                dtype), host or ssd.
  saved inputs  the stage inputs the forward saves for the recompute, M * I_j, host.
  streaming     S per gpu once any state is on the SSD, host.
Device bytes of gpu g: the arena (ARENA_SLOTS * W) + the largest A_j of its stages; of stage j while it
runs backward: its weights and gradient slots and activations, 2 * P_j + A_j.

Placement: all in host memory if that fits H. Otherwise states move to the SSD in this order until the
host bytes fit: the optimizer states of each stage, largest N_j first (as memory.optimizer auto does),
then the gradients of each stage, largest first. Weights and saved inputs stay in host memory (the loads
stream from it): PlanInfeasibleError when they alone do not fit.

SSD traffic per step of stage j: optimizer on ssd: read 12 N_j and write 12 N_j (the out-of-core Adam
reads, updates and writes master and moments once); gradients on ssd: write P_j (offload) and read P_j
(update). The simulator streams this traffic under the stage's update (partition.simulate.SsdLink).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from foundation.units import GiB
from partition.costmodel import ARENA_SLOTS
from partition.errors import PlanInfeasibleError
from partition.plan import Plan
from partition.simulate import SsdLink
from topology import Topology

__all__ = [
    "OPTIMIZER_BYTES_PER_PARAM",
    "STREAM_BYTES",
    "SSD_READ_GBPS",
    "SSD_WRITE_GBPS",
    "HostBudget",
    "SsdInfo",
    "StageTiers",
    "MemoryPlan",
    "host_budget",
    "ssd_info",
    "place_tiers",
]

OPTIMIZER_BYTES_PER_PARAM = 12
"""fp32 master weights + Adam exp_avg + exp_avg_sq, bytes per parameter (stage_states.HOST_STATE_BYTES)."""
STREAM_BYTES = 1 * GiB
"""S: host memory per gpu the out-of-core Adam streams through (memory.host_budget_mb's default, 1024 MiB)."""
SSD_READ_GBPS = 3.0
"""Sequential read of one NVMe drive when the topology was not probed (a PCIe 3.0 x4 drive's ~3.5 GB/s, less)."""
SSD_WRITE_GBPS = 2.0
"""Sequential write of one NVMe drive when the topology was not probed (sustained, past the SLC cache)."""
KINDS = ("weights", "optimizer", "gradients")
"""The state kinds that have a tier, in the order reports list them."""


@dataclass(frozen=True)
class HostBudget:
    """H of the legend (None = unlimited) and where it came from, for the report."""

    bytes: int | None
    source: str


@dataclass(frozen=True)
class SsdInfo:
    """The SSD tier's bandwidth and whether it was measured."""

    link: SsdLink
    measured: bool
    note: str


@dataclass(frozen=True)
class StageTiers:
    """Stage j's tier per state kind, its bytes per tier and its SSD traffic per step."""

    optimizer: str
    gradients: str
    device_bytes: int
    host_bytes: int
    ssd_bytes: int
    ssd_read_bytes: int
    ssd_write_bytes: int

    def to_dict(self) -> dict:
        return {
            "weights": "host",
            "optimizer": self.optimizer,
            "gradients": self.gradients,
            "device_bytes": self.device_bytes,
            "host_bytes": self.host_bytes,
            "ssd_bytes": self.ssd_bytes,
            "ssd_read_bytes": self.ssd_read_bytes,
            "ssd_write_bytes": self.ssd_write_bytes,
        }


@dataclass(frozen=True)
class MemoryPlan:
    """A plan's tiers: per stage, per kind, and the job's totals per tier (bytes)."""

    stages: tuple[StageTiers, ...]
    budget: HostBudget
    device_bytes: int
    """Sum over gpus of the arena and the gpu's largest activations."""
    host_by_kind: dict[str, int]
    """Host bytes of weights, optimizer, gradients, saved_inputs and streaming."""
    ssd_by_kind: dict[str, int]
    """SSD bytes of optimizer and gradients."""

    @property
    def host_bytes(self) -> int:
        return sum(self.host_by_kind.values())

    @property
    def ssd_bytes(self) -> int:
        return sum(self.ssd_by_kind.values())

    @property
    def ssd_read_bytes(self) -> int:
        return sum(s.ssd_read_bytes for s in self.stages)

    @property
    def ssd_write_bytes(self) -> int:
        return sum(s.ssd_write_bytes for s in self.stages)

    def tier(self, kind: str) -> str:
        """ "host", "ssd", or "host+ssd" when the kind's stages are split between them."""
        used = {"host"} if kind == "weights" else {getattr(s, kind) for s in self.stages}
        return "+".join(t for t in ("host", "ssd") if t in used)

    def on_ssd(self, kind: str) -> int:
        """How many stages keep `kind` on the SSD."""
        return 0 if kind == "weights" else sum(getattr(s, kind) == "ssd" for s in self.stages)

    def to_dict(self) -> dict:
        return {
            "device_bytes": self.device_bytes,
            "host_bytes": self.host_bytes,
            "ssd_bytes": self.ssd_bytes,
            "tiers": {k: self.tier(k) for k in KINDS},
            "host_budget_bytes": self.budget.bytes,
            "host_budget_source": self.budget.source,
            "host_bytes_by_kind": dict(self.host_by_kind),
            "ssd_bytes_by_kind": dict(self.ssd_by_kind),
            "ssd_read_bytes": self.ssd_read_bytes,
            "ssd_write_bytes": self.ssd_write_bytes,
            "stages": [s.to_dict() for s in self.stages],
        }


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


def place_tiers(plan: Plan, budget: HostBudget) -> MemoryPlan:
    """The tiers of the legend's placement rule for `plan` under `budget`; PlanInfeasibleError when even
    every optimizer state and gradient on the SSD leaves more host bytes than the budget."""
    n = plan.num_stages
    opt, grad = ["host"] * n, ["host"] * n
    limit = math.inf if budget.bytes is None else budget.bytes
    largest = sorted(range(n), key=lambda j: (-plan.stages[j].param_count, j))
    moves = [(opt, j) for j in largest] + [(grad, j) for j in largest]
    memory = _memory(plan, budget, opt, grad)
    for tiers, j in moves:
        if memory.host_bytes <= limit:
            return memory
        tiers[j] = "ssd"
        memory = _memory(plan, budget, opt, grad)
    if memory.host_bytes <= limit:
        return memory
    raise _too_small(plan, budget, memory)


def _memory(plan: Plan, budget: HostBudget, opt: list[str], grad: list[str]) -> MemoryPlan:
    """Bytes per stage, kind and tier for the given optimizer and gradient tiers of each stage."""
    fp32 = plan.dtype == "fp32"
    host: dict[str, int] = dict.fromkeys(("weights", "optimizer", "gradients", "saved_inputs", "streaming"), 0)
    ssd: dict[str, int] = dict.fromkeys(("optimizer", "gradients"), 0)
    rows = []
    for j, s in enumerate(plan.stages):
        states = OPTIMIZER_BYTES_PER_PARAM * s.param_count
        saved = plan.num_microbatches * plan.stages[j - 1].output_bytes if j > 0 else 0
        weights = 0 if fp32 and opt[j] == "host" else s.param_bytes
        kinds = {"optimizer": (opt[j], states), "gradients": (grad[j], s.param_bytes)}
        host["weights"] += weights
        host["saved_inputs"] += saved
        for kind, (tier, nbytes) in kinds.items():
            (host if tier == "host" else ssd)[kind] += nbytes
        on_ssd = sum(b for t, b in kinds.values() if t == "ssd")
        rows.append(
            StageTiers(
                optimizer=opt[j],
                gradients=grad[j],
                device_bytes=2 * s.param_bytes + s.activation_bytes,
                host_bytes=weights + saved + sum(b for t, b in kinds.values() if t == "host"),
                ssd_bytes=on_ssd,
                ssd_read_bytes=on_ssd,
                ssd_write_bytes=on_ssd,
            )
        )
    if ssd["optimizer"] or ssd["gradients"]:
        host["streaming"] = STREAM_BYTES * plan.num_gpus
    return MemoryPlan(tuple(rows), budget, _device_bytes(plan), host, ssd)


def _device_bytes(plan: Plan) -> int:
    """Sum over gpus g of ARENA_SLOTS * W + the largest A_j of g's stages."""
    arena = ARENA_SLOTS * plan.slot_bytes
    return sum(arena + max(plan.stages[j].activation_bytes for j in plan.stages_of(g)) for g in range(plan.num_gpus))


def _too_small(plan: Plan, budget: HostBudget, memory: MemoryPlan) -> PlanInfeasibleError:
    need = memory.host_bytes
    parts = ", ".join(f"{k.replace('_', ' ')} {v / GiB:.1f} GiB" for k, v in memory.host_by_kind.items() if v)
    return PlanInfeasibleError(
        f"{plan.model} needs {need / GiB:.1f} GiB of host memory even with every optimizer state and gradient "
        f"on the SSD ({parts}), but the host budget ({budget.source}) is {(budget.bytes or 0) / GiB:.1f} GiB: "
        f"give more host memory (--host-memory-gb {math.ceil(need / GiB)}), fewer microbatches, or a smaller model"
    )
