"""A plan's memory tiers as plain data: the host budget a plan is placed under (a server's, or a run's memory settings),
the SSD it streams through, and where each stage's states went, per gpu and in all (partition.rules.tiers places
them; its docstring holds the legend of the symbols below)."""

from __future__ import annotations

from dataclasses import dataclass

from partition.rules.placement import Placement
from partition.sim.simulate import SsdLink

__all__ = ["KINDS", "RunMemory", "HostBudget", "SsdInfo", "StageTiers", "GpuShare", "MemoryPlan"]

KINDS = ("optimizer", "weights", "frozen")
"""The state kinds that have a tier, in the order they move to the SSD."""


@dataclass(frozen=True)
class RunMemory:
    """A training run's memory section (mobiuspipe.config.MemoryConfig) as the planner applies it: every gpu is a rank
    that places its stages' states exactly as the runtime does, under `state_bytes` of host memory
    (memory.host_budget_mb, for the states alone: what the rank holds there besides is checked against the host's
    memory at launch), each kind where the run's setting puts it: host, ssd, device (the optimizer of a LoRA plan),
    or auto (the rule's choice; the optimizer of a LoRA plan also on the gpus where that predicts faster)."""

    optimizer: str = "host"
    weights: str = "host"
    frozen: str = "host"
    """memory.frozen: host or ssd, for every stage with frozen weights."""
    state_bytes: int = 0
    """memory.host_budget_mb in bytes, for each rank's states (read where optimizer or weights is not host)."""

    @property
    def gpu_states(self) -> tuple[bool, ...]:
        """Whether the optimizer states may go to the gpus (True), stay off them (False) or both are weighed."""
        return {"device": (True,), "auto": (True, False)}.get(self.optimizer, (False,))


@dataclass(frozen=True)
class HostBudget:
    """H of the legend (None = unlimited) and where it came from, for the report; or a run's memory settings, each
    rank's states under its own budget (`run`; bytes None: the host's memory is checked at launch instead)."""

    bytes: int | None
    source: str
    run: RunMemory | None = None
    delayed: bool = False
    """The run delays its updates (train.delayed_update): each step's host updates run during the next step, which
    the simulator then bounds by max(pipeline, host updates) (partition.sim.simulate)."""
    speculative: bool = False
    """The run's updates start speculatively (clipping or fp16 with train.speculative_update) and keep a copy of what
    they overwrite in host memory (partition.rules.placement.HostCopies)."""
    accumulates: bool = False
    """The run adds several passes' gradients a step (train.accumulation_steps > 1): a buffer for a pass's gradients
    on their way (partition.rules.placement.HostCopies)."""


@dataclass(frozen=True)
class SsdInfo:
    """The SSD tier's bandwidth and whether it was measured."""

    link: SsdLink
    measured: bool
    note: str


@dataclass(frozen=True)
class StageTiers:
    """Stage j's tier per state kind, its bytes per tier and its SSD traffic per step (legend)."""

    gpu: int
    optimizer: str
    weights: str
    loads: int
    """L_j."""
    device_bytes: int
    host_bytes: int
    """Its states, saved inputs and streaming share in host memory."""
    ssd_bytes: int
    load_read_bytes: int
    """Bytes each LOAD reads from the SSD (P_j with the weights on ssd, else 0)."""
    offload_write_bytes: int
    """Bytes the OFFLOAD writes to the SSD (P_j with the weights on ssd, else 0)."""
    update_read_bytes: int
    update_write_bytes: int
    frozen: str = "host"
    """Where its frozen weights (LoRA's base) are: host or ssd (a stage without any: host)."""

    @property
    def ssd_read_bytes(self) -> int:
        return self.loads * self.load_read_bytes + self.update_read_bytes

    @property
    def ssd_write_bytes(self) -> int:
        return self.offload_write_bytes + self.update_write_bytes

    def to_dict(self) -> dict:
        return {
            "gpu": self.gpu,
            "optimizer": self.optimizer,
            "weights": self.weights,
            "frozen": self.frozen,
            "loads": self.loads,
            "device_bytes": self.device_bytes,
            "host_bytes": self.host_bytes,
            "ssd_bytes": self.ssd_bytes,
            "ssd_read_bytes": self.ssd_read_bytes,
            "ssd_write_bytes": self.ssd_write_bytes,
        }


@dataclass(frozen=True)
class GpuShare:
    """Gpu g's part of the budget: H_g, S_g, what is left for states (the runtime's memory.host_budget_mb that
    makes the same choice) and the placement made under it."""

    share_bytes: int | None
    saved_inputs_bytes: int
    placement: Placement
    frozen_bytes: int = 0
    """Z_g: its stages' frozen weights (LoRA) in host memory (0 with them on the SSD)."""
    frozen_stream_bytes: int = 0
    """F k_g: the host memory its stages stream their frozen weights through, with them on the SSD."""

    @property
    def state_budget_bytes(self) -> int | None:
        if self.share_bytes is None:
            return None
        return self.share_bytes - self.saved_inputs_bytes - self.frozen_bytes - self.frozen_stream_bytes

    def to_dict(self, g: int) -> dict:
        return {
            "gpu": g,
            "host_share_bytes": self.share_bytes,
            "saved_inputs_bytes": self.saved_inputs_bytes,
            "frozen_bytes": self.frozen_bytes,
            "frozen_stream_bytes": self.frozen_stream_bytes,
            "state_budget_bytes": self.state_budget_bytes,
            "stream_share_bytes": self.placement.slot_bytes,
        }


@dataclass(frozen=True)
class MemoryPlan:
    """A plan's tiers: per stage, per gpu, per kind, and the job's totals per tier (bytes)."""

    stages: tuple[StageTiers, ...]
    gpus: tuple[GpuShare, ...]
    budget: HostBudget
    device_bytes: int
    """Sum over gpus of the arena and the gpu's largest activations."""
    host_by_kind: dict[str, int]
    """Host bytes of optimizer, weights (with the gradients), frozen, saved_inputs and streaming."""
    ssd_by_kind: dict[str, int]
    """SSD bytes of optimizer, weights (with the gradients) and frozen."""

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

    @property
    def has_frozen(self) -> bool:
        """Whether any stage has frozen weights (a LoRA plan)."""
        return any(g.frozen_bytes or g.frozen_stream_bytes for g in self.gpus)

    def tier(self, kind: str) -> str:
        """ "host", "ssd", "device" (the gpus), or "host+ssd" when the kind's stages are split between them."""
        used = {getattr(s, kind) for s in self.stages}
        return "+".join(t for t in ("device", "host", "ssd") if t in used)

    def on_ssd(self, kind: str) -> int:
        """How many stages keep `kind` on the SSD."""
        return sum(getattr(s, kind) == "ssd" for s in self.stages)

    def to_dict(self) -> dict:
        return {
            "device_bytes": self.device_bytes,
            "host_bytes": self.host_bytes,
            "ssd_bytes": self.ssd_bytes,
            "tiers": {k: self.tier(k) for k in KINDS if k != "frozen" or self.has_frozen},
            "host_budget_bytes": self.budget.bytes,
            "host_budget_source": self.budget.source,
            "host_bytes_by_kind": dict(self.host_by_kind),
            "ssd_bytes_by_kind": dict(self.ssd_by_kind),
            "ssd_read_bytes": self.ssd_read_bytes,
            "ssd_write_bytes": self.ssd_write_bytes,
            "gpus": [s.to_dict(g) for g, s in enumerate(self.gpus)],
            "stages": [s.to_dict() for s in self.stages],
        }
