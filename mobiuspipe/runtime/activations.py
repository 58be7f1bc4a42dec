"""A stage's activation modes (recompute, keep, selective); hooks that keep a forward's graph until its backward.

recompute (today's and the default): F(j,i) saves the stage input and runs without grad; B(j,i) recomputes the
whole stage with grad under the forward's random state, then backprops. keep: F runs with grad and the graph
(what autograd saves for backward) stays on the device until B, which only backprops. selective: the kept
layers run with grad in F and keep their graphs; each maximal run of other layers (a segment) runs without
grad, saving its input and its own random state, and B recomputes it. The last stage's forward is fused into
its backward under every mode (it runs once), so a mode never applies to it.

A graph kept from F(j,i) to B(j,i) must not hold the weights themselves: between F and B the arena slot they
were in holds other stages' weights. The pack hook turns a saved tensor that lies in the stage's weight slot
into a WeightRef (its place in the slot), which the unpack hook rebuilds from the slot the stage holds at B
(the same weights: the update comes after OFFLOAD). Hooked saved tensors skip autograd's version check, so the
loads that rewrite the slot in between do not trip it. Every other saved tensor stays referenced by the graph
and held in the ledger as ("kept", j, i, ...) until B(j,i) has run.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge, saved_tensors_hooks

from mobiuspipe.errors import PipelineError
from mobiuspipe.memory.ledger import DeviceLedger
from partition.plan import Plan

__all__ = [
    "MODES",
    "StageMode",
    "Part",
    "KeptPart",
    "RecomputedPart",
    "KeptForward",
    "Held",
    "GradSink",
    "entry",
    "WeightRef",
    "ActivationsSpec",
    "stage_modes",
    "parts_of",
    "keeping",
    "edge_of",
]

MODES = ("recompute", "keep", "selective")

ActivationsSpec = str | Mapping[int, Any] | None
"""What Pipeline(activations=...) takes: "plan" (each stage's policy as the plan chose it:
partition.rules.activation_choice), a mode for every stage, or {stage: "recompute" | "keep" |
("selective", [layer indices])} (stages left out recompute); None: memory.activations."""


@dataclass(frozen=True)
class StageMode:
    """A stage's activation mode and, for selective, the layers (absolute indices) whose graphs it keeps."""

    mode: str = "recompute"
    keep_layers: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Part:
    """A maximal run of a stage's layers that is kept (runs with grad in F) or recomputed (in B)."""

    layers: tuple[int, ...]
    kept: bool


@dataclass
class Held:
    """A tensor a kept forward holds for its backward (a saved tensor or a recomputed part's input) and its
    ledger key; t is None while the tensor is swapped out (mobiuspipe.runtime.kept_swap)."""

    key: tuple
    t: torch.Tensor | None


class GradSink:
    """Where the gradient at a kept part's input lands in its backward (see entry)."""

    grad: torch.Tensor | None = None


@dataclass
class KeptPart:
    """What F left of a kept part: where the gradient at its input lands (None when none is wanted there)
    and the gradient edge of its output (None when the output needs none)."""

    sink: GradSink | None
    edge: GradientEdge | None


@dataclass
class RecomputedPart:
    """What F left of a recomputed segment: its input and the random state its forward started from."""

    saved: Held
    rng: tuple


@dataclass
class KeptForward:
    """What F(j,i) of a keep or selective stage leaves for B(j,i): its parts in order, and what it holds."""

    parts: list[KeptPart | RecomputedPart] = field(default_factory=list)
    held: list[Held] = field(default_factory=list)
    swapped: Any = None
    """While its held tensors are on a swap tier: how to rebuild them (mobiuspipe.runtime.kept_swap.Layout)."""


class _Entry(torch.autograd.Function):
    """Identity whose backward puts the gradient at its input into a GradSink."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor, sink: GradSink) -> torch.Tensor:
        ctx.sink = sink
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        ctx.sink.grad = g
        return None, None, None


def entry(x: torch.Tensor, sink: GradSink) -> torch.Tensor:
    """x as the start of a kept graph whose input gradient lands in sink. Unlike an autograd leaf (which its
    AccumulateGrad node keeps alive), nothing in the graph refers to x but what the ops save, so those saved
    tensors are all a swap tier has to move."""
    anchor = torch.empty(0, device=x.device, requires_grad=True)  # makes the output require grad
    return _Entry.apply(x, anchor, sink)


def stage_modes(spec: ActivationsSpec, plan: Plan) -> dict[int, StageMode]:
    """Each stage's mode from Pipeline(activations=...); PipelineError naming the entry that is wrong."""
    if spec == "plan":
        return {j: _stage_mode(j, _planned(s), plan) for j, s in enumerate(plan.stages)}
    if spec is None or isinstance(spec, str):
        mode = _mode(spec or "recompute", "activations")
        if mode == "selective":
            raise PipelineError(
                "activations='selective' needs the layers to keep per stage: pass "
                "activations={stage: ('selective', [layer indices])}"
            )
        return {j: StageMode(mode) for j in range(plan.num_stages)}
    if not isinstance(spec, Mapping):
        raise PipelineError(
            f"activations must be 'recompute', 'keep' or a dict {{stage: mode}}, not {type(spec).__name__}"
        )
    out = {j: StageMode() for j in range(plan.num_stages)}
    for j, entry in spec.items():
        if not isinstance(j, int) or not 0 <= j < plan.num_stages:
            raise PipelineError(f"activations names stage {j!r}; the plan has stages 0..{plan.num_stages - 1}")
        out[j] = _stage_mode(j, entry, plan)
    return out


def _stage_mode(j: int, entry: Any, plan: Plan) -> StageMode:
    if isinstance(entry, str):
        mode = _mode(entry, f"activations[{j}]")
        if mode != "selective":
            return StageMode(mode)
        entry = (mode, ())
    if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and entry[0] == "selective"):
        raise PipelineError(
            f"activations[{j}] is {entry!r}: expected 'recompute', 'keep' or ('selective', [layer indices])"
        )
    layers = set(plan.stages[j].layers)
    keep = frozenset(entry[1])
    if not all(isinstance(l, int) for l in keep) or not keep <= layers:
        raise PipelineError(
            f"activations[{j}] keeps layers {sorted(keep, key=str)}, but stage {j} has layers "
            f"{min(layers)}..{max(layers)}: name layers of the stage (absolute indices)"
        )
    return StageMode("selective", keep)


def _planned(s) -> str | tuple[str, tuple[int, ...]]:
    """A StagePlan's policy as a Pipeline(activations=...) entry."""
    return ("selective", s.kept_layers) if s.activations == "selective" else s.activations


def _mode(name: str, what: str) -> str:
    if name not in MODES:
        raise PipelineError(f"{what} is {name!r}: expected one of {', '.join(MODES)}")
    return name


def parts_of(layers: Sequence[int], mode: StageMode) -> list[Part]:
    """The stage's layers cut into maximal runs of kept and recomputed ones (keep: one kept run)."""
    kept = set(layers) if mode.mode == "keep" else mode.keep_layers
    return [Part(tuple(run), flag) for flag, run in itertools.groupby(layers, lambda l: l in kept)]


@dataclass(frozen=True)
class WeightRef:
    """A saved tensor that lies in the stage's weight slot: its dtype, byte offset in the slot, shape, strides."""

    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def rebuild(self, slot_bytes: torch.Tensor) -> torch.Tensor:
        """The same tensor on the slot (uint8 bytes) the stage holds now."""
        base = slot_bytes.view(self.dtype)
        return base.as_strided(self.size, self.stride, base.storage_offset() + self.offset // self.dtype.itemsize)


def _weight_ref(t: torch.Tensor, slot: torch.Tensor) -> WeightRef | None:
    """t as a WeightRef if it lies in the weight slot `slot` (uint8 bytes); None if it is elsewhere."""
    if t.device != slot.device or t.untyped_storage().data_ptr() != slot.untyped_storage().data_ptr():
        return None
    start = int(t.storage_offset()) * t.element_size() - int(slot.storage_offset())
    span = (1 + sum((int(n) - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size() if t.numel() else 0
    if start < 0 or start + span > slot.numel():
        raise RuntimeError(
            f"a tensor autograd saves lies in the device arena but outside the stage's weight slot "
            f"(bytes {start}..{start + span} of a {slot.numel()}-byte slot): the kept graph would read "
            f"memory another stage reuses; this is a bug in the stage's forward"
        )
    return WeightRef(t.dtype, start, tuple(int(n) for n in t.shape), tuple(t.stride()))


@contextmanager
def keeping(ledger: DeviceLedger, key: tuple, weight_slot: torch.Tensor, slot_at_b) -> Iterator[list[Held]]:
    """Saved-tensor hooks for a forward whose graph is kept until its backward: tensors in `weight_slot` (the
    stage's weights, uint8) become WeightRefs rebuilt from slot_at_b() when the backward unpacks them; each
    other is a Held, in the ledger as (*key, n). Yields the list of the Helds."""
    held: list[Held] = []

    def pack(t: torch.Tensor) -> WeightRef | Held:
        ref = _weight_ref(t, weight_slot)
        if ref is not None:
            return ref
        held.append(Held((*key, len(held)), t.detach()))  # detached: no reference cycle through grad_fn
        ledger.hold(held[-1].key, t)
        return held[-1]

    def unpack(p: WeightRef | Held) -> torch.Tensor:
        if isinstance(p, WeightRef):
            return p.rebuild(slot_at_b())
        if p.t is None:
            raise RuntimeError(f"the backward needs {p.key}, which is swapped out: a SWAP_IN is missing")
        return p.t

    with saved_tensors_hooks(pack, unpack):
        yield held


def edge_of(out: torch.Tensor) -> GradientEdge | None:
    """The gradient edge of a part's output (its backward starts there without holding the output), or None
    when the output needs no gradient."""
    return get_gradient_edge(out) if out.requires_grad else None
