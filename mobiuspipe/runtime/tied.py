"""Parameters that two stages share (tied input and output embeddings): each stage keeps its own copy, and
after the step's backward both copies get the sum of the two gradients, so both update alike.

The two halves are exchanged between the ranks holding them (or added locally when one rank holds both);
a + b and b + a are the same float, so the copies stay bit-identical step after step. The stages holding a
tied parameter hold their updates until the sum is in (Engine.held), which costs the head stage the
overlap of its update with the rest of the backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mobiuspipe.errors import PipelineError
from mobiuspipe.memory.device import Device
from mobiuspipe.memory.reduce import sum_of_squares
from mobiuspipe.runtime.peers.comm import Comm, TensorSpec
from mobiuspipe.runtime.peers.ranks import RankInfo, gather_all
from mobiuspipe.runtime.stage import ParamSlice, Stage
from partition.plan import Plan

__all__ = ["TiedGrads", "tied_ranks"]

TAG_BASE = 1 << 30
"""Message tags of the exchange: above every tag the engine uses (those are taken modulo 2^30)."""


@dataclass(frozen=True)
class _Side:
    key: str
    stage: int
    slice: ParamSlice | None
    """Where the parameter is in its stage's flat weights; None on ranks that do not hold that stage."""


class TiedGrads:
    """The tied pairs of a Pipeline, resolved to stages; sum() adds each pair's gradients on both sides."""

    def __init__(self, pairs: Sequence[tuple[str, str]], plan: Plan, stages: dict[int, Stage], info: RankInfo):
        self.plan, self.stages, self.info = plan, stages, info
        self.pairs = [(self._side(a), self._side(b)) for a, b in pairs]
        self._check_shapes()

    @property
    def held_stages(self) -> set[int]:
        """This rank's stages that hold a tied parameter (their updates wait for sum())."""
        return {s.stage for pair in self.pairs for s in pair if s.slice is not None}

    def _side(self, key: str) -> _Side:
        layer, _, name = key.partition(".")
        if not layer.isdigit() or not name or int(layer) >= self.plan.num_layers:
            raise PipelineError(
                f"tied parameter {key!r}: expected 'layer.name' with a layer below {self.plan.num_layers}, as "
                f"Pipeline.state_dict() names parameters (e.g. '0.wte.weight')"
            )
        j = _stage_of(self.plan, int(layer))
        stage = self.stages.get(j)
        if stage is None:
            return _Side(key, j, None)
        found = [p for p in stage.params if p.key == key]
        if not found:
            raise PipelineError(
                f"tied parameter {key!r}: layer {layer} has no parameter {name!r} (it has "
                f"{', '.join(p.name for p in stage.params if p.layer == int(layer)) or 'none'})"
            )
        return _Side(key, j, found[0])

    def _check_shapes(self) -> None:
        """Both halves of each pair have one shape (every rank learns every held half's shape)."""
        mine = {s.key: tuple(s.slice.shape) for pair in self.pairs for s in pair if s.slice is not None}
        shapes = {k: v for every in gather_all(self.info, mine) for k, v in every.items()}
        for a, b in self.pairs:
            if shapes[a.key] != shapes[b.key]:
                raise PipelineError(
                    f"tied parameters {a.key!r} {shapes[a.key]} and {b.key!r} {shapes[b.key]} differ in shape; "
                    f"only parameters of one shape can be tied"
                )

    def sum(self, comm: Comm, device: Device, step: int) -> float:
        """Give both halves of every pair this rank holds the sum of their offloaded gradients. Returns what
        this rank adds to the squared gradient norm its stages noted (states.grad_sumsq, taken before the sum) to
        count each pair once, with its summed gradient: minus each held half's, plus the sum's on the rank of
        the pair's first half."""
        fix = 0.0
        for k, (a, b) in enumerate(self.pairs):
            if a.slice is not None and b.slice is not None:
                ga, gb = self._grad(a), self._grad(b)
                self._add(a, gb)
                self._add(b, ga)
                fix += sum_of_squares(self._grad(a)) - sum_of_squares(ga) - sum_of_squares(gb)
            elif a.slice is not None or b.slice is not None:
                own, other = (a, b) if a.slice is not None else (b, a)
                g = self._exchange(own, other, k, comm, device, step)
                fix += (sum_of_squares(self._grad(own)) if own is a else 0.0) - sum_of_squares(g)
        return fix

    def _exchange(self, own: _Side, other: _Side, k: int, comm: Comm, device: Device, step: int):
        """Send this rank's half, add the other's; returns this rank's half as it was."""
        peer = self.plan.mapping[other.stage]
        what = f"the gradient of tied parameter {own.key} (step {step}) for {other.key}"
        g = self._grad(own)
        comm.send(device.to_device(g), peer, TAG_BASE + k, what)
        got = comm.recv(TensorSpec(tuple(g.shape), g.dtype), device.torch_device, peer, TAG_BASE + k, what)
        comm.flush()
        self._add(own, device.to_host(got))
        return g

    def _grad(self, side: _Side) -> torch.Tensor:
        assert side.slice is not None
        return self.stages[side.stage].states.grad_slice(side.slice.offset, side.slice.numel)

    def _add(self, side: _Side, t: torch.Tensor) -> None:
        assert side.slice is not None
        self.stages[side.stage].states.add_grads(side.slice.offset, t)


def _stage_of(plan: Plan, layer: int) -> int:
    return next(j for j, s in enumerate(plan.stages) if s.first <= layer <= s.last)


def tied_ranks(pairs: Sequence[tuple[str, str]], plan: Plan) -> set[tuple[int, int]]:
    """The (sender, receiver) ranks of the exchanges of the tied pairs whose halves are on different ranks (keys
    that name no layer of the plan are left to TiedGrads to refuse)."""
    out = set()
    for a, b in pairs:
        layers = [k.partition(".")[0] for k in (a, b)]
        if all(l.isdigit() and int(l) < plan.num_layers for l in layers):
            ga, gb = (plan.mapping[_stage_of(plan, int(l))] for l in layers)
            if ga != gb:
                out |= {(ga, gb), (gb, ga)}
    return out
