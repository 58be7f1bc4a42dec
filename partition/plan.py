"""The Plan: stages, their gpus, the arena layout and the predicted step; plain data, saved as YAML/JSON."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundation.loader import (
    Builder,
    Checked,
    Problem,
    at_least,
    found_text,
    non_empty,
    part_of,
    positive,
    read_file,
    rule,
    save_file,
    to_plain,
)
from foundation.units import fmt_bytes
from partition.errors import InvalidPlan, PlanFileError
from partition.rules.activations import MODES, TIERS
from partition.rules.costmodel import WEIGHT_SLOTS
from partition.rules.mapping import MAPPING_RULES
from partition.spec.analytic import DTYPE_BYTES
from topology.layout import LAYOUT_CHECKS, layout_defaults
from topology.types import Topology

__all__ = ["StagePlan", "SolverInfo", "Plan", "load_plan", "save_plan", "most_buffers", "STATE_TIERS"]

_WRITE_FIX = "write plans with `mobiuspipe partition ... -o FILE`"
STATE_TIERS = ("auto", "host", "ssd", "device")
"""A stage's optimizer_tier: auto (not placed by the planner), or where partition.rules.placement put it."""
_WEIGHT_TIERS = {
    ("auto", "auto"),
    ("host", "host"),
    ("host", "ssd"),
    ("ssd", "ssd"),
    ("device", "device"),
}
"""(weights_tier, optimizer_tier) pairs a stage may record: both placed or neither; the weights on the SSD only with
the optimizer (its update writes them), on the gpu only with it."""


class _PlanPart(Checked):
    """A part of a plan: its problems raise InvalidPlan, a PlanFileError."""

    invalid = InvalidPlan


@dataclass(frozen=True)
class StagePlan(_PlanPart):
    """Stage j: layers first..last (0-based, inclusive) on `gpu`, with its predicted costs."""

    first: int
    last: int
    gpu: int
    param_count: int
    param_bytes: int
    activation_bytes: int
    """Live activation bytes while the stage runs backward on one microbatch."""
    output_bytes: int
    """Bytes of the stage's output for one microbatch (what goes to the next stage)."""
    fwd_s: float
    """Forward seconds per microbatch."""
    bwd_s: float
    """Backward seconds per microbatch (without the recomputed forward)."""
    load_gbps: float
    """Host->gpu bandwidth this stage's loads get under the mapping's contention, GB/s."""
    recompute_s: float | None = None
    """Seconds per microbatch of the forward its backward runs (with grad): the whole stage's under recompute
    (and on the last stage, whose forward is fused into its backward), the recomputed segments' under
    selective, 0 under keep; None (plans before it was measured or chosen): fwd_s."""
    activations: str = "recompute"
    """Its activation policy (partition.rules.activations): recompute (the forward again in the backward, from the
    stage input), keep (every layer's saved activations from F to B) or selective (kept_layers' only)."""
    kept_layers: tuple[int, ...] = ()
    """selective: the layers (model indices) whose saved activations are kept."""
    activation_tier: str = "auto"
    """Where the held activations live from F to B: device, host, ssd or peer; auto (plans made before the
    choice): the runtime's own path (the device on the CPU stand-in, the host on a gpu)."""
    held_bytes: int = -1
    """H_j: bytes held per microbatch from F to B under the policy (-1 in plans made before the choice)."""
    work_bytes: int = -1
    """T_j: bytes live while B runs besides the held ones (-1: activation_bytes, plans before the choice)."""
    forward_s: float | None = None
    """Seconds per microbatch of F as the policy runs it: its kept layers' forward with grad (they keep their
    graphs), the others' without; 0 on the last stage (fused into B); None (plans before the choice): fwd_s."""
    grad_s: float | None = None
    """Seconds per microbatch of the whole stage's forward as a recompute's backward redoes it (R_j: with grad),
    whatever the stage's own policy: for a run that forces recompute (None, plans before it: from the others)."""
    trainable_count: int | None = None
    """T_j: the parameters that train, given a gradient and optimizer states (under LoRA its adapters; the rest
    are frozen, streamed read-only); None (every parameter trains, and plans before LoRA): param_count."""
    grad_bytes: int | None = None
    """G_j: bytes of its gradients, T_j in the plan's dtype, what its offload moves; None: param_bytes."""
    kept_s: float | None = None
    """Seconds per microbatch of the whole stage's forward as F runs it under keep (K_j: the profile's kept_s
    summed, with grad, the graphs kept), whatever the stage's own policy: for a run that forces keep (None,
    plans before it: grad_s)."""
    optimizer_tier: str = "auto"
    """Where its optimizer states (fp32 master, Adam moments) live, as the planner placed them under the host
    budget (partition.rules.tiers): host, ssd, or device (the gpu: a LoRA plan's adapters); auto (a plan made
    without a placement): a run places them by memory.optimizer. A run whose memory.optimizer is auto follows it."""
    weights_tier: str = "auto"
    """Where its device-dtype weights and offloaded gradients live: host, ssd (only where optimizer_tier is ssd) or
    device (where optimizer_tier is); auto: a run places them by memory.weights. A run whose memory.weights is auto
    follows it."""
    buffer_bytes: int = 0
    """V_j: its layers' buffers (a causal mask), which its gpu keeps the whole run, outside the arena; 0 in plans of
    profiles that did not measure them (partition.spec.profile's V_l)."""
    transient_bytes: int = 0
    """X_j: the most any of its layers holds beyond A_j while it computes (the profile's X_l, workspace_bytes: a
    backward's intermediates' gradients, a weight's gradient before it is added into the slot), on a gpu; 0 in plans
    of profiles that did not measure it, and in plans that held the largest X apart on every gpu (workspace_bytes)."""

    @property
    def f_s(self) -> float:
        """F's seconds per microbatch under the stage's policy (forward_s, else fwd_s)."""
        return self.fwd_s if self.forward_s is None else self.forward_s

    @property
    def layers(self) -> range:
        """The layer indices of the stage, first..last."""
        return range(self.first, self.last + 1)

    @property
    def load_s(self) -> float:
        return self.param_bytes / (self.load_gbps * 1e9)

    @property
    def trains(self) -> int:
        """T_j: trainable_count, or param_count when every parameter trains."""
        return self.param_count if self.trainable_count is None else self.trainable_count

    @property
    def gradient_bytes(self) -> int:
        """G_j: grad_bytes, or param_bytes when every parameter trains."""
        return self.param_bytes if self.grad_bytes is None else self.grad_bytes

    @property
    def frozen_bytes(self) -> int:
        """Bytes of its frozen weights as loaded (P_j less the trainable ones, which have G_j's size)."""
        return self.param_bytes - self.gradient_bytes

    def check_values(self) -> list[Problem]:
        counts = ("param_count", "param_bytes", "activation_bytes", "output_bytes", "buffer_bytes", "transient_bytes")
        return [
            *rule(
                self.activations in MODES,
                "activations",
                f"one of {', '.join(MODES)}",
                repr(self.activations),
                _WRITE_FIX,
            ),
            *rule(
                self.activation_tier in ("auto", *TIERS),
                "activation_tier",
                f"one of auto, {', '.join(TIERS)}",
                repr(self.activation_tier),
                _WRITE_FIX,
            ),
            *rule(
                self.optimizer_tier in STATE_TIERS,
                "optimizer_tier",
                f"one of {', '.join(STATE_TIERS)}",
                repr(self.optimizer_tier),
                _WRITE_FIX,
            ),
            *rule(
                (self.weights_tier, self.optimizer_tier) in _WEIGHT_TIERS,
                "weights_tier",
                f"a tier its optimizer_tier {self.optimizer_tier} admits: "
                + ", ".join(sorted(w for w, o in _WEIGHT_TIERS if o == self.optimizer_tier)),
                repr(self.weights_tier),
                _WRITE_FIX,
            ),
            *rule(
                all(self.first <= x <= self.last for x in self.kept_layers)
                and (self.activations == "selective" or not self.kept_layers),
                "kept_layers",
                f"layers of the stage ({self.first}..{self.last}), given only when activations is selective",
                found_text(list(self.kept_layers)),
                _WRITE_FIX,
            ),
            *(p for name in counts for p in at_least(self, name, 0, _WRITE_FIX)),
            *(p for name in ("fwd_s", "bwd_s") for p in positive(self, name, _WRITE_FIX, zero_ok=True)),
            *(
                p
                for name in ("recompute_s", "grad_s", "kept_s")
                if getattr(self, name) is not None
                for p in positive(self, name, _WRITE_FIX, zero_ok=True)
            ),
            *positive(self, "load_gbps", _WRITE_FIX, what="a bandwidth in GB/s, a finite number"),
            *part_of(self, "trainable_count", "param_count", _WRITE_FIX),
            *part_of(self, "grad_bytes", "param_bytes", _WRITE_FIX),
        ]


@dataclass(frozen=True)
class SolverInfo(_PlanPart):
    """Which algorithm produced the plan and how it ended."""

    name: str
    status: str
    gap: float
    wall_s: float
    num_vars: int = 0
    """Variables of the largest MIP solved (0: no MIP ran)."""
    num_rows: int = 0
    """Constraints of the largest MIP solved, a ranged row counted as two (as Gurobi counts them)."""

    def check_values(self) -> list[Problem]:
        return [
            *positive(self, "wall_s", _WRITE_FIX, zero_ok=True),
            *rule(
                self.gap >= 0,  # False for NaN; inf: no bound was proved
                "gap",
                "a relative gap >= 0 (inf when no bound was proved)",
                found_text(self.gap),
                _WRITE_FIX,
            ),
        ]


@dataclass(frozen=True)
class Plan(_PlanPart):
    """Output of `partition`: everything the runtime needs to run a step, and what it should cost."""

    model: str
    topology: str
    num_layers: int
    num_gpus: int
    num_microbatches: int
    microbatch_size: int
    dtype: str
    mapping_rule: str
    mapping_score: float
    """Total contention of the mapping: sum over stage pairs less than N apart of shared / |i - j|."""
    stages: tuple[StagePlan, ...]
    slot_bytes: int
    """W: one weight slot of the device arena = the largest stage's parameter bytes."""
    arena_bytes: int
    """Device arena budget: WEIGHT_SLOTS weight slots of slot_bytes and a gradient slot of the largest stage's
    gradient bytes (partition.rules.costmodel.arena_bytes; slot_bytes too without LoRA, and in older plans)."""
    activation_bytes: int
    """Largest live activation bytes of any stage (one microbatch)."""
    gpu_memory_bytes: int
    """Usable memory per gpu the plan was made for (after the reserve and what it holds apart on every gpu: the
    workspaces, the buffers); a gpu's walk with its transients (transients_on) is held to it."""
    predicted_step_time_s: float
    solver: SolverInfo
    layout: Topology | None = None
    """The machine the plan was made on (`topology` is its name), written as a layout file holds it
    (topology/layout.py), so that the plan file alone says where it runs; None in plans written before plans
    recorded it (then `mobiuspipe simulate` needs --topology unless `topology` names a preset)."""
    input_bytes: int = 0
    """Bytes of one microbatch of the model's input (the profile's; 0 in plans written before plans had it)."""
    target_bytes: int = 0
    """Bytes of one microbatch of the loss's targets (the profile's; 0 in plans written before plans had it)."""
    workspace_bytes: int = 0
    """What the plan holds apart on every gpu for the math libraries' workspaces of the compute stream (the profile's
    W, library_bytes); in plans made before each stage recorded its X_j (transient_bytes), the largest X_l too.
    gpu_memory_bytes is already net of it; 0 in plans of profiles that did not measure it."""
    buffer_bytes: int = 0
    """What the plan holds apart on every gpu for its stages' buffers (StagePlan.buffer_bytes, kept the whole run): at
    least the most any gpu's stages keep (buffers_on). gpu_memory_bytes is already net of it; 0 in plans of profiles
    that measured none."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def grad_slot_bytes(self) -> int:
        """The arena's gradient slot: arena_bytes less its WEIGHT_SLOTS weight slots."""
        return self.arena_bytes - WEIGHT_SLOTS * self.slot_bytes

    def arena_words(self) -> str:
        """The arena's slots in words: 3 slots of W, or (LoRA) 2 weight slots of W and a smaller gradient slot."""
        if self.grad_slot_bytes == self.slot_bytes:
            return f"{WEIGHT_SLOTS + 1} slots of {fmt_bytes(self.slot_bytes)}"
        return f"{WEIGHT_SLOTS} weight slots of {fmt_bytes(self.slot_bytes)} + a gradient slot of " + fmt_bytes(
            self.grad_slot_bytes
        )

    @property
    def mapping(self) -> list[int]:
        return [s.gpu for s in self.stages]

    @property
    def gpu_share_bytes(self) -> int:
        """The bytes of each gpu the plan was made to use, the gpu's memory less the reserve: gpu_memory_bytes and what
        it is net of (the workspaces, the buffers held apart)."""
        return self.gpu_memory_bytes + self.workspace_bytes + self.buffer_bytes

    def transients_on(self, gpu: int) -> int:
        """X_g: the most transients one of gpu's stages holds while it computes (the largest X_j of them)."""
        return max((s.transient_bytes for s in self.stages if s.gpu == gpu), default=0)

    def buffers_on(self, gpu: int) -> int:
        """The bytes of the buffers gpu keeps the whole run: its stages' V_j."""
        return sum(s.buffer_bytes for s in self.stages if s.gpu == gpu)

    @property
    def most_buffers(self) -> int:
        """The most buffers one gpu's stages keep (most_buffers of its stages)."""
        return most_buffers(self.stages, self.num_gpus)

    def stages_of(self, gpu: int) -> list[int]:
        """Indices j of the stages gpu runs, in forward order."""
        return [j for j, s in enumerate(self.stages) if s.gpu == gpu]

    def check_values(self) -> list[Problem]:
        stages = (
            _stage_problems(self)
            if self.stages
            else [Problem("stages", "at least one stage", "an empty list", _WRITE_FIX)]
        )
        return _field_problems(self) + stages + _layout_problems(self, self.layout)

    def to_dict(self) -> dict:
        """Plain data of every field, and `num_stages` for readers; from_dict takes it back exactly."""
        return {**to_plain(self), "num_stages": self.num_stages}

    @classmethod
    def from_dict(cls, d: Any, where: str = "plan") -> Plan:
        """The plan in plain data `d` (what to_dict gives); PlanFileError naming `where` lists every problem."""
        builder = Builder(where, PlanFileError, checks=LAYOUT_CHECKS)
        data = dict(d) if isinstance(d, dict) else {}
        written, listed = data.pop("num_stages", None), data.get("stages")
        if data.get("layout") is not None:
            data["layout"] = layout_defaults(data["layout"], f"plan:{where}")
        plan = builder.build(cls, data if isinstance(d, dict) else d)
        if written is not None and isinstance(listed, list) and (type(written) is not int or written != len(listed)):
            builder.add(
                [
                    Problem(
                        "num_stages",
                        f"{len(listed)}, the number of stages listed (written for readers, never read)",
                        found_text(written),
                        "correct it or delete the line",
                    )
                ]
            )
        return builder.finish(plan)


def _field_problems(p: Plan) -> list[Problem]:
    """Each field on its own: names said, counts and bytes in range, times finite, a known dtype and rule."""
    return [
        *(q for name in ("model", "topology") for q in non_empty(p, name, _WRITE_FIX)),
        *(q for name in ("num_gpus", "num_microbatches", "microbatch_size") for q in at_least(p, name, 1, _WRITE_FIX)),
        *(
            q
            for name in (
                "slot_bytes",
                "arena_bytes",
                "activation_bytes",
                "gpu_memory_bytes",
                "input_bytes",
                "target_bytes",
                "workspace_bytes",
                "buffer_bytes",
            )
            for q in at_least(p, name, 0, _WRITE_FIX)
        ),
        *(
            q
            for name in ("mapping_score", "predicted_step_time_s")
            for q in positive(p, name, _WRITE_FIX, zero_ok=True)
        ),
        *rule(p.dtype in DTYPE_BYTES, "dtype", f"one of {', '.join(DTYPE_BYTES)}", found_text(p.dtype), _WRITE_FIX),
        *rule(
            p.mapping_rule in MAPPING_RULES,
            "mapping_rule",
            f"one of {', '.join(MAPPING_RULES)}",
            found_text(p.mapping_rule),
            _WRITE_FIX,
        ),
    ]


def _layout_problems(p: Plan, t: Topology | None) -> list[Problem]:
    """The recorded machine `t` (p.layout) agrees with the plan: its name and its gpu count."""
    if t is None:
        return []
    fix = "the plan and its layout were edited apart: remake the plan with `mobiuspipe partition ... -o FILE`"
    return [
        *(
            []
            if t.name == p.topology
            else [Problem("layout.name", f"{p.topology!r}, the plan's topology", found_text(t.name), fix)]
        ),
        *(
            []
            if t.num_gpus == p.num_gpus
            else [Problem("layout.gpus", f"{p.num_gpus} gpus (num_gpus)", f"{t.num_gpus} gpus", fix)]
        ),
    ]


def _stage_problems(p: Plan) -> list[Problem]:
    """Stages contiguous from layer 0 to the last, each on a gpu of the plan within the slot; every gpu used."""
    problems, nxt = [], 0
    for j, s in enumerate(p.stages):
        if s.first != nxt or s.last < s.first:
            problems.append(
                Problem(
                    f"stages[{j}]",
                    f"stage {j} to start at layer {nxt} (stages must be contiguous, in order, and non-empty)",
                    f"stage {j} covers layers {s.first}..{s.last}",
                    _WRITE_FIX,
                )
            )
        if not 0 <= s.gpu < p.num_gpus:
            problems.append(
                Problem(f"stages[{j}].gpu", f"a gpu in 0..{p.num_gpus - 1}", f"stage {j} is on gpu {s.gpu}", _WRITE_FIX)
            )
        if s.param_bytes > p.slot_bytes:
            problems.append(
                Problem(
                    f"stages[{j}].param_bytes",
                    f"at most slot_bytes ({p.slot_bytes})",
                    f"stage {j} has {s.param_bytes} parameter bytes, more than the slot",
                    _WRITE_FIX,
                )
            )
        if s.gradient_bytes > p.grad_slot_bytes:
            problems.append(
                Problem(
                    "arena_bytes",
                    f"two weight slots and a gradient slot that holds each stage's gradients ({p.arena_bytes} - "
                    f"{WEIGHT_SLOTS} x {p.slot_bytes} >= {s.gradient_bytes})",
                    f"stage {j} has {s.gradient_bytes} gradient bytes, more than the gradient slot "
                    f"({p.grad_slot_bytes})",
                    _WRITE_FIX,
                )
            )
        nxt = s.last + 1
    if nxt != p.num_layers:
        problems.append(
            Problem(
                "num_layers",
                f"0..{p.num_layers - 1} (the layers the stages must cover)",
                f"stages covering layers 0..{nxt - 1}",
                _WRITE_FIX,
            )
        )
    unused = sorted(set(range(p.num_gpus)) - set(p.mapping))
    if unused:
        problems.append(
            Problem(
                "num_gpus",
                "every gpu to run at least one stage",
                f"gpus {unused} have no stage",
                "add stages, or lower num_gpus",
            )
        )
    most = p.most_buffers
    if most > p.buffer_bytes:
        problems.append(
            Problem(
                "buffer_bytes",
                f"at least the most buffers one gpu's stages keep ({most} bytes)",
                str(p.buffer_bytes),
                _WRITE_FIX,
            )
        )
    return problems


def most_buffers(stages: Sequence[StagePlan], num_gpus: int) -> int:
    """The most buffers (StagePlan.buffer_bytes) the stages mapped to one of num_gpus gpus keep together."""
    return max((sum(s.buffer_bytes for s in stages if s.gpu == g) for g in range(num_gpus)), default=0)


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write YAML (or JSON when the suffix is .json); load_plan reads back an equal plan."""
    save_file(plan.to_dict(), path)


def load_plan(path: str | Path) -> Plan:
    """Read a plan written by save_plan; PlanFileError naming the file lists everything malformed."""
    where = f"plan {path}"
    fix = f"write one with `mobiuspipe partition ... -o {Path(path).name}`"
    return Plan.from_dict(read_file(path, where=where, error=PlanFileError, fix=fix), where)
