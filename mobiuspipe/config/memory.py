"""The run config's `memory:` section: where each stage's states live (host memory or an SSD store) under a
host budget per rank; the rule that places them is partition/rules/placement.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from foundation.loader import Problem, rule
from mobiuspipe.config.section import WRITTEN_PATH, Section, mebibytes
from partition.rules.placement import FROZEN_TIERS, OPTIMIZER_TIERS, TIERS  # where memory.optimizer, ... put states

__all__ = ["MemoryConfig", "ACTIVATION_MODES", "ACTIVATION_TIERS"]

ACTIVATION_TIERS = ("plan", "device", "host", "ssd", "peer")
"""memory.activation_tier: where each stage's held activations live between its forward and backward."""

ACTIVATION_MODES = ("plan", "recompute", "keep")
"""memory.activations: the plan's choice per stage, or one mode for every stage (Pipeline(activations=...)
also takes per-stage selective)."""


@dataclass(frozen=True, kw_only=True)
class MemoryConfig(Section):
    """Where each stage's states live, host memory, an SSD store or (LoRA's adapters) the gpu, under a host budget
    per rank (see partition/rules/placement.py for the bytes each choice keeps in memory)."""

    optimizer: str = "host"
    """The fp32 master weights and Adam moments (12 bytes per parameter). "host": in host memory; "ssd": in
    an SSD store under ssd_dir, stepped by the out-of-core Adam through a share of host_budget_mb; "auto":
    in host memory while everything fits in host_budget_mb, the largest stages on SSD otherwise; "device": on the
    gpu, with the gradients and the weights too (16 bytes per parameter there), stepped by torch's AdamW on the gpu:
    nothing offloaded, no host update (for LoRA's adapters, whose states are small: `mobiuspipe partition` says
    when they fit)."""
    weights: str = "host"
    """The weights the device loads and the gradients it offloads (2 + 2 bytes per parameter in bf16/fp16).
    "host": in host memory; "ssd": in the SSD store too, streamed through staging buffers (needs optimizer:
    ssd, whose update writes them); "auto": in host memory while they fit, after the optimizer states."""
    frozen: str = "host"
    """Where a LoRA run's frozen base weights live (read-only: each stage LOAD copies them to the gpu, nothing
    writes them back). "host": in host memory; "ssd": in the SSD store under ssd_dir, written once at start-up and
    read at each LOAD through 4 MiB of staging buffers per stage (`mobiuspipe partition` puts them there when the
    host memory cannot hold them). Needs LoRA (lora.rank or model.adapter)."""
    ssd_dir: str | None = field(default=None, metadata=WRITTEN_PATH)
    """Folder of the ssd tier, relative to the config file's folder; each rank keeps its store in ssd_dir/rank{r}.
    A run starts it afresh (what an earlier run left there is discarded: runs resume from their checkpoints);
    checkpoints on the same filesystem hard-link its files instead of copying them."""
    host_budget_mb: float = 1024.0
    """Host memory per rank for the states (MiB): what stays in memory plus the streaming slots of the
    stages on SSD. With optimizer and weights both host it would not be read, so setting it then is refused."""
    activations: str = "plan"
    """How each stage keeps what its backward needs. "plan": as the plan chose per stage under the device
    memory (keep, selective or recompute; `mobiuspipe partition --explain` shows why); "recompute": the stage
    input only, the forward is run again in the backward; "keep": the forward's saved activations stay on the
    device until the backward (no recompute, more device memory). All give the same numbers bit for bit."""

    activation_tier: str = "plan"
    """Where each stage's held activations (a recompute stage's input; a keep or selective stage's kept graphs
    and recomputed parts' inputs) live from its forward to its backward. "plan": as the plan chose;
    "device": on the device; "host": copied to (pinned) host memory after the forward, prefetched back before
    the backward, on the copy stream; "ssd": on to an SSD store in ssd_dir (ssd_dir/rank{r}-activations)
    through a host staging buffer; "peer": into a region of the next rank's gpu (partition/rules/peer.py sizes it;
    device to device where the gpus have peer access, staged through host otherwise; ranks on one host).
    Every tier gives the same numbers bit for bit."""

    def check_values(self) -> list[Problem]:
        return [
            *rule(
                self.optimizer in OPTIMIZER_TIERS,
                "optimizer",
                "one of " + ", ".join(OPTIMIZER_TIERS),
                repr(self.optimizer),
                "use `optimizer: host`, `ssd` or `auto` (the last two with ssd_dir), or `device`",
            ),
            *rule(
                self.weights in TIERS,
                "weights",
                "one of " + ", ".join(TIERS),
                repr(self.weights),
                "use `weights: host`, `ssd` or `auto` (the last two with ssd_dir)",
            ),
            *rule(
                self.weights != "ssd" or self.optimizer == "ssd",
                "weights",
                "host or auto unless optimizer is ssd (its update writes the weights on SSD)",
                repr(self.weights),
                "set `optimizer: ssd` too, or `weights: auto`",
            ),
            *rule(
                self.weights == "host" or self.optimizer != "device",
                "weights",
                "host (left out) when optimizer is device (the weights are on the gpu with their states)",
                repr(self.weights),
                "remove memory.weights",
            ),
            *rule(
                self.weights != "auto" or self.optimizer not in ("host", "device"),
                "weights",
                "host when optimizer is host (weights go to SSD only after the optimizer states)",
                repr(self.weights),
                "set `optimizer: auto` or `ssd`, or `weights: host`",
            ),
            *rule(
                self.optimizer in ("host", "device") or bool(self.ssd_dir),
                "ssd_dir",
                "a folder when optimizer is ssd or auto",
                repr(self.ssd_dir),
                "set `ssd_dir:` to a folder on an NVMe drive, e.g. /nvme/mobiuspipe",
            ),
            *rule(
                self.frozen in FROZEN_TIERS,
                "frozen",
                "one of " + ", ".join(FROZEN_TIERS),
                repr(self.frozen),
                "use `frozen: host` or `ssd` (with ssd_dir)",
            ),
            *rule(
                self.frozen != "ssd" or bool(self.ssd_dir),
                "ssd_dir",
                "a folder when frozen is ssd",
                repr(self.ssd_dir),
                "set `ssd_dir:` to a folder on an NVMe drive, e.g. /nvme/mobiuspipe",
            ),
            *rule(
                self.activations in ACTIVATION_MODES,
                "activations",
                "one of " + ", ".join(ACTIVATION_MODES),
                repr(self.activations),
                "use `activations: plan` (the planner's choice), `recompute` (least device memory) or `keep`",
            ),
            *rule(
                self.activation_tier in ACTIVATION_TIERS,
                "activation_tier",
                "one of " + ", ".join(ACTIVATION_TIERS),
                repr(self.activation_tier),
                "use `activation_tier: plan` (the planner's choice), `device`, `host`, `ssd` or `peer`",
            ),
            *rule(
                self.activation_tier != "ssd" or bool(self.ssd_dir),
                "ssd_dir",
                "a folder when activation_tier is ssd",
                repr(self.ssd_dir),
                "set `ssd_dir:` to a folder on an NVMe drive, e.g. /nvme/mobiuspipe",
            ),
            *mebibytes(self, "host_budget_mb", "use a positive budget in MiB, e.g. 1024.0"),
            *rule(
                self.optimizer not in ("host", "device")
                or self.weights != "host"
                or self.host_budget_mb == MemoryConfig.host_budget_mb,
                "host_budget_mb",
                "no host_budget_mb while optimizer and weights are both host, or optimizer is device (every state is "
                "then in host memory, or on the gpu, whatever the budget: it would not be read)",
                repr(self.host_budget_mb),
                "set `optimizer: auto` to keep the states within the budget (the largest stages on SSD under "
                "ssd_dir), or remove host_budget_mb",
            ),
        ]
