"""Where a gpu's stages keep their optimizer states and their device-dtype weights and gradients: host, SSD or the
gpu itself.

The one placement rule: the runtime applies it per rank under memory.host_budget_mb
(mobiuspipe.pipeline), the planner per gpu under its share of the server's host budget (partition.rules.tiers).

Host bytes per parameter n of a stage (b = bytes of the training dtype, B = its share of the budget):
  optimizer host (weights host):  12 n  + b n gradients + b n weights (none in fp32: the master is loaded)
  optimizer ssd, weights host:    b n gradients + b n weights + B (the out-of-core Adam's slots)
  optimizer ssd, weights ssd:     B (the Adam's slots and the weight stream's staging buffers)
  optimizer device:               0: the fp32 master, the moments, the gradients and the device-dtype weights are
                                  on the gpu, device_state_bytes of them (weights: device too), and a gpu holds
                                  the working memory of one update beside them (gpu_state_bytes)
and what the run keeps beside them (HostCopies): the delayed update's second version of the weights and gradients
(b n each; in fp32 the loaded weights are then a copy of the master), gradient accumulation's buffer for a pass's
gradients on their way (b n where the gradients are in memory), and the speculative update's copy of what it
overwrites: the master and the moments (12 n) where the optimizer is in memory, and the weights it writes (b n; none
where the master is what is loaded); on SSD its states and weights go to a second set of records instead.
`auto` moves, largest stage first, first the optimizer states and then the weights to SSD, until what
stays in memory leaves every stage on SSD a share B of at least a quarter of the budget over their count
and at least the least share the out-of-core Adam takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from foundation.units import KiB

__all__ = [
    "Placement",
    "BudgetShortfall",
    "place_states",
    "run_placement",
    "host_bytes",
    "HostCopies",
    "PLAIN",
    "TIERS",
    "OPTIMIZER_TIERS",
    "FROZEN_TIERS",
    "device_state_bytes",
    "gpu_state_bytes",
    "STATE_BYTES",
    "UPDATE_CHUNK",
    "UPDATE_WORK_BYTES",
    "LEAST_SHARE_BYTES",
    "FROZEN_STREAM_BYTES",
]

TIERS = ("host", "ssd", "auto")
"""Where a kind of state may live: memory.optimizer and memory.weights take one of these."""
STATE_BYTES = 12
UPDATE_CHUNK = 1 << 20
"""Parameters the gpu-resident states' update (mobiuspipe.runtime.states.device) steps at a time."""
UPDATE_WORK_BYTES = 12
"""Gpu bytes per parameter of a chunk that update works in beside the states: the chunk's fp32 gradient (cast or
unscaled) and AdamW's square root of the second moment and its quotient."""
"""Bytes per parameter of the optimizer states: fp32 master + exp_avg + exp_avg_sq."""
LEAST_SHARE_BYTES = 4 * STATE_BYTES * KiB + 4 * 4 * KiB
"""The least host share of a stage on SSD, for every training dtype (fp32, bf16, fp16): the out-of-core Adam's
4 group slots of one 4 KiB-aligned group (1024 elements x 12 bytes each) and the weight stream's 4 staging
buffers of one group (1024 elements of <= 4 bytes: one 4 KiB page each) = 64 KiB. The runtime derives it
from its group layout (mobiuspipe.runtime.states.ooc.least_share); tests/mobiuspipe/runtime/test_state_tiers.py
checks the two agree."""
OPTIMIZER_TIERS = (*TIERS, "device")
"""memory.optimizer takes these: the tiers, or the gpu itself (a LoRA plan's adapters, whose states are small)."""
FROZEN_TIERS = ("host", "ssd")
"""Where a LoRA run's frozen base may live: memory.frozen takes one of these."""
FROZEN_STREAM_BYTES = 4 * 1024 * KiB
"""Host bytes through which each stage whose frozen weights are on the SSD streams them at each LOAD: the runtime's
4 staging buffers of one 1 MiB record each (mobiuspipe.runtime.frozen.SsdFrozenWeights)."""


@dataclass(frozen=True)
class HostCopies:
    """What a run keeps in host memory beyond one set of each stage's states (see the module docstring)."""

    versions: int = 1
    """2 with the delayed update (train.delayed_update): the loaded weights and the gradients twice."""
    undo: bool = False
    """The speculative update (clipping or fp16 with train.speculative_update): a copy of what it overwrites."""
    accumulates: bool = False
    """Several passes a step (train.accumulation_steps > 1): a pass's gradients on their way to be added to the
    ones before, b n, where the gradients are in memory."""


PLAIN = HostCopies()
"""One set of states and nothing beside it."""


@dataclass(frozen=True)
class Placement:
    """The tier of each stage's optimizer states and weights, and the host share of each stage on SSD."""

    optimizer: dict[int, str]
    """Stage j -> "host", "ssd" or "device"."""
    weights: dict[int, str]
    """Stage j -> "host" or "ssd" (ssd only where the optimizer is on ssd: its update writes them), "device" where
    the optimizer is."""
    slot_bytes: int
    """Host budget of each stage whose optimizer is on SSD (0 when none is)."""

    @property
    def on_ssd(self) -> list[int]:
        """Stages whose optimizer states are on SSD."""
        return sorted(j for j, t in self.optimizer.items() if t == "ssd")


class BudgetShortfall(ValueError):
    """A host budget holds no placement of a rank's stages (params: stage -> parameter count): `held` bytes stay
    in memory even with every stage moved to SSD that the settings allow, each stage on SSD needs `least` more,
    and `need` bytes in all would hold them."""

    def __init__(self, budget: int, params: dict[int, int], optimizer: str, weights: str, held: int, least: int):
        self.budget, self.params, self.optimizer, self.weights, self.held = budget, params, optimizer, weights, held
        self.least = least
        k = len(params) if optimizer != "host" else 0  # every stage is on SSD by now, or none
        fixed = optimizer != "auto" and weights != "auto"
        self.need = held + k * least if fixed else max(held + k * least, -(-4 * (held + k) // 3))
        """The least budget that holds them (auto leaves every stage on SSD a quarter of the budget at least)."""
        super().__init__(
            f"a host budget of {budget} bytes does not hold the rank's {len(params)} stages "
            f"({sum(params.values())} parameters) with memory.optimizer {optimizer} and memory.weights {weights}: "
            f"{held} bytes stay in memory and each stage on SSD needs at least {least} more; {self.fix}"
        )

    @property
    def fix(self) -> str:
        """What to change: the budget, or where the weights live."""
        more = "" if self.weights != "host" else ", or set memory.weights: auto to stream the weights too"
        return f"raise memory.host_budget_mb to at least {self.need / 2**20:.4g}{more}"


def device_state_bytes(n: int, dtype_bytes: int) -> int:
    """Gpu bytes of the states of n parameters on the device tier: the fp32 master and AdamW's two moments (12 n),
    the gradients (b n) and, unless the training dtype is fp32 (the master is then what a LOAD copies), the weights
    (b n): 16 n in fp32 and in bf16/fp16 alike."""
    return STATE_BYTES * n + dtype_bytes * n + (dtype_bytes * n if dtype_bytes != 4 else 0)


def gpu_state_bytes(counts: Sequence[int], dtype_bytes: int) -> int:
    """Gpu bytes of one gpu's stages of these parameter counts on the device tier: their states
    (device_state_bytes) and the working memory of one update, UPDATE_WORK_BYTES for each parameter of the largest
    stage's chunk (the compute thread updates one stage at a time)."""
    work = UPDATE_WORK_BYTES * min(max(counts, default=0), UPDATE_CHUNK)
    return sum(device_state_bytes(n, dtype_bytes) for n in counts) + work


def host_bytes(n: int, optimizer: str, weights: str, dtype_bytes: int, copies: HostCopies = PLAIN) -> int:
    """Host bytes a stage of n parameters keeps in memory besides its share of the budget, with the run's copies
    (see above)."""
    if optimizer == "device":
        return 0
    b, k = dtype_bytes, copies.versions
    loads_master = b == 4 and k == 1  # fp32, one version: the device loads the master itself
    undo_weights = b * n if copies.undo and not (optimizer == "host" and loads_master) else 0
    incoming = b * n if copies.accumulates else 0
    if optimizer == "host":
        undo = STATE_BYTES * n + undo_weights if copies.undo else 0
        return STATE_BYTES * n + k * b * n + (0 if loads_master else k * b * n) + undo + incoming
    return 0 if weights == "ssd" else 2 * k * b * n + undo_weights + incoming


def place_states(
    optimizer: str,
    weights: str,
    params: dict[int, int],
    budget_bytes: int,
    least_slot_bytes: int,
    dtype_bytes: int,
    copies: HostCopies = PLAIN,
) -> Placement:
    """Tiers of stages {j: parameter count} by memory.optimizer (host | ssd | auto | device) and memory.weights
    (host | ssd | auto) under the rank's host budget (copies: host_bytes'). ValueError when nothing fits, naming
    the budget that would."""
    if optimizer == "device":
        return Placement(dict.fromkeys(params, "device"), dict.fromkeys(params, "device"), 0)
    opt = {j: "ssd" if optimizer == "ssd" else "host" for j in params}
    wts = {j: "ssd" if weights == "ssd" else "host" for j in params}
    largest = sorted(params, key=lambda j: (-params[j], j))
    moves = [(j, "optimizer") for j in largest if optimizer == "auto"]
    moves += [(j, "weights") for j in largest if weights == "auto"]
    fixed = optimizer != "auto" and weights != "auto"
    for step in range(len(moves) + 1):
        if step:
            j, kind = moves[step - 1]
            (opt if kind == "optimizer" else wts)[j] = "ssd"
        slot = _slot(params, opt, wts, budget_bytes, least_slot_bytes, dtype_bytes, fixed, copies)
        if slot is not None:
            return Placement(dict(opt), {j: wts[j] if opt[j] == "ssd" else "host" for j in params}, slot)
    held = sum(host_bytes(n, opt[j], wts[j], dtype_bytes, copies) for j, n in params.items())
    raise BudgetShortfall(budget_bytes, params, optimizer, weights, held, least_slot_bytes)


def run_placement(
    optimizer: str,
    weights: str,
    recorded: dict[int, tuple[str, str]],
    params: dict[int, int],
    budget_bytes: int,
    least_slot_bytes: int,
    dtype_bytes: int,
    copies: HostCopies = PLAIN,
) -> Placement:
    """The tiers a run gives its stages {j: parameter count}: what memory.optimizer and memory.weights name, where
    they name a tier; where they say auto, the tier the plan records for the stage (recorded: j -> (its
    optimizer_tier, weights_tier), partition.plan.StagePlan); a plan that records none (every tier "auto") is placed
    by place_states. The weights go to the SSD only with the optimizer, and to the gpu with it. BudgetShortfall when
    the rank's budget does not hold the result (with either setting auto, as place_states' auto rule would ask: each
    stage on SSD streams through a quarter of the budget over their count at least)."""
    if any(recorded.get(j, ("auto", "auto")) == ("auto", "auto") for j in params):
        return place_states(optimizer, weights, params, budget_bytes, least_slot_bytes, dtype_bytes, copies)
    opt = {j: recorded[j][0] if optimizer == "auto" else optimizer for j in params}
    wts = {j: recorded[j][1] if weights == "auto" else weights for j in params}
    wts = {j: "device" if opt[j] == "device" else "ssd" if opt[j] == wts[j] == "ssd" else "host" for j in params}
    fixed = optimizer != "auto" and weights != "auto"
    slot = _slot(params, opt, wts, budget_bytes, least_slot_bytes, dtype_bytes, fixed, copies)
    if slot is None:
        held = sum(host_bytes(n, opt[j], wts[j], dtype_bytes, copies) for j, n in params.items())
        raise BudgetShortfall(budget_bytes, params, optimizer, weights, held, least_slot_bytes)
    return Placement(opt, wts, slot)


def _slot(params, opt, wts, budget: int, least: int, b: int, fixed: bool, copies: HostCopies = PLAIN) -> int | None:
    """The share of each stage on SSD if this placement fits (0 when none is on SSD), else None."""
    held = sum(host_bytes(n, opt[j], wts[j], b, copies) for j, n in params.items())
    k = sum(1 for t in opt.values() if t == "ssd")
    if k == 0:
        return 0 if fixed or held <= budget else None
    slot = (budget - held) // k
    floor = least if fixed else max(least, budget // 4 // k)
    return slot if slot >= floor else None
