"""Parameters that two stages share (tied input and output embeddings): each stage keeps its own copy, and
after the step's backward both copies get the sum of the two gradients, so both update alike.

The two halves are exchanged between the ranks holding them (or added locally when one rank holds both), CHUNK
elements at a time, from where their states keep them (host memory, the SSD store, or the gpu: DeviceStates);
a + b and b + a are the same float, so the copies stay bit-identical step after step. The stages holding a
tied parameter hold their updates until the sum is in (Engine.held), which costs the head stage the
overlap of its update with the rest of the backward.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from mobiuspipe.errors import PipelineError
from mobiuspipe.memory.device import Device
from mobiuspipe.memory.ledger import DeviceLedger
from mobiuspipe.memory.reduce import squared_norm
from mobiuspipe.runtime.peers.comm import Comm, TensorSpec
from mobiuspipe.runtime.peers.ranks import RankInfo, gather_all
from mobiuspipe.runtime.stage import ParamSlice, Stage
from partition.plan import Plan

__all__ = ["TiedGrads", "tied_ranks"]

TAG_BASE = 1 << 30
"""Message tags of the exchange: above every tag the engine uses (those are taken modulo 2^30)."""

CHUNK = 1 << 20
"""Elements of a tied gradient exchanged and added at a time (4 MiB in fp32): the exchange's gpu memory, a chunk
sent and a chunk received, stays within the reserve the plan leaves (a whole embedding table's gradient would not)."""


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

    def sum(self, comm: Comm, device: Device, step: int) -> list[torch.Tensor]:
        """Give both halves of every pair this rank holds the sum of their offloaded gradients. Returns what
        this rank adds to the squared gradient norm its stages noted (states.grad_sumsq, taken before the sum) to
        count each pair once, with its summed gradient: minus each held half's, plus the sum's on the rank of
        the pair's first half; as float64 tensors, one a device the halves are on, for the host to read with the
        stages' figures (Engine.grad_checks)."""
        squares = _Squares()
        for k, (a, b) in enumerate(self.pairs):
            if a.slice is not None and b.slice is not None:
                self._add_local(a, b, device, squares, comm.ledger)
            elif a.slice is not None or b.slice is not None:
                own, other = (a, b) if a.slice is not None else (b, a)
                self._exchange(own, other, k, comm, device, step, squares, own is a)
        return squares.terms()

    def _add_local(self, a: _Side, b: _Side, device: Device, squares: _Squares, ledger: DeviceLedger | None) -> None:
        """Both halves on this rank: each gets the other's gradient added, CHUNK elements at a time."""
        ha, hb = self._half(a), self._half(b)
        for lo, n in ha.chunks():
            ga, gb = ha.chunk(lo, n), hb.chunk(lo, n)
            squares.add(ga, -1.0)
            squares.add(gb, -1.0)
            ga_at_b, gb_at_a = _moved(ga, ha, hb, device), _moved(gb, hb, ha, device)
            on_gpu = [t for t, h in ((ga, ha), (gb, hb), (ga_at_b, hb), (gb_at_a, ha)) if h.on_gpu]
            with _held(ledger, on_gpu):
                ha.add(lo, gb_at_a)
                hb.add(lo, ga_at_b)
                squares.add(gb_at_a.add_(ga))  # b + a: the floats add_ puts into both halves
        ha.finish()
        hb.finish()

    def _exchange(
        self, own: _Side, other: _Side, k: int, comm: Comm, device: Device, step: int, squares: _Squares, first: bool
    ) -> None:
        """Send this rank's half and add the other's, CHUNK elements at a time: a chunk's message and its sum are
        done before the next is sent, so the exchange holds two chunks of gpu memory at most (none that the plan
        counts), and gradients kept on the gpu (DeviceStates) never pass through host memory."""
        peer = self.plan.mapping[other.stage]
        what = f"the gradient of tied parameter {own.key} (step {step}) for {other.key}"
        half = self._half(own)
        for lo, n in half.chunks():
            g = half.chunk(lo, n)
            squares.add(g, -1.0)
            comm.send(g if half.on_gpu else device.to_device(g), peer, TAG_BASE + k, what)
            received = comm.recv(TensorSpec((n,), g.dtype), device.torch_device, peer, TAG_BASE + k, what)
            with _held(comm.ledger, [received]):
                comm.flush()
                got = received if half.on_gpu else device.to_host(received)
                half.add(lo, got)
                if first:
                    squares.add(got.add_(g))  # the sum, as add_ makes it
        half.finish()

    def _half(self, side: _Side) -> _Half:
        assert side.slice is not None
        return _Half(self.stages[side.stage].states, side.slice.offset, side.slice.numel)


class _Half:
    """One half of a tied pair as the exchange reads and adds it, CHUNK elements at a time: where its states keep
    the gradients on the gpu (DeviceStates.grads_on_gpu), each chunk is read and added there; where they are in host
    memory or the SSD store (read and written a record at a time), the half is read once and what it gets is added
    once, at finish()."""

    def __init__(self, states, offset: int, numel: int):
        self.states, self.offset, self.numel = states, offset, numel
        self.on_gpu: bool = states.grads_on_gpu
        self._whole = None if self.on_gpu else states.grad_slice(offset, numel)
        self._gets = None if self._whole is None else torch.empty_like(self._whole)

    def chunks(self) -> list[tuple[int, int]]:
        """(first element, count) of the chunks of at most CHUNK elements."""
        return [(lo, min(CHUNK, self.numel - lo)) for lo in range(0, self.numel, CHUNK)]

    def chunk(self, lo: int, n: int) -> torch.Tensor:
        """A copy of elements lo .. lo + n of the gradient, where the states keep it."""
        if self._whole is None:
            return self.states.grad_slice(self.offset + lo, n)
        return self._whole[lo : lo + n].clone()

    def add(self, lo: int, t: torch.Tensor) -> None:
        """Add t (where the states keep the gradient) into elements lo .. lo + len(t)."""
        if self._gets is None:
            self.states.add_grads(self.offset + lo, t)
        else:
            self._gets[lo : lo + t.numel()].copy_(t)

    def finish(self) -> None:
        """Add what the chunks got, for a half kept off the gpu."""
        if self._gets is not None:
            self.states.add_grads(self.offset, self._gets)


def _moved(t: torch.Tensor, src: _Half, dst: _Half, device: Device) -> torch.Tensor:
    """t, a gradient chunk of src, where dst keeps its gradient."""
    if src.on_gpu == dst.on_gpu:
        return t
    return device.to_device(t) if dst.on_gpu else device.to_host(t)


class _Squares:
    """A signed sum of squared norms (float64, summed on the device of each tensor)."""

    def __init__(self) -> None:
        self._sums: dict[torch.device, torch.Tensor] = {}

    def add(self, t: torch.Tensor, sign: float = 1.0) -> None:
        term = sign * squared_norm(t)
        self._sums[t.device] = self._sums[t.device] + term if t.device in self._sums else term

    def terms(self) -> list[torch.Tensor]:
        """The sum on each device (a float64 tensor of no dimension), for the host to read at once."""
        return list(self._sums.values())


@contextmanager
def _held(ledger: DeviceLedger | None, tensors: list[torch.Tensor]) -> Iterator[None]:
    """Count tensors (gpu memory) in the ledger while the block runs."""
    tensors = list({id(t): t for t in tensors}.values())
    keys = [("tied", id(t)) for t in tensors]
    if ledger is not None:
        for key, t in zip(keys, tensors):
            ledger.hold(key, t)
    try:
        yield
    finally:
        if ledger is not None:
            for key in keys:
                ledger.drop(key)


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
