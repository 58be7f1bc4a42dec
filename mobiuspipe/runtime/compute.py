"""The engine's compute actions (F, B of a stage under its activation mode) and the state a step holds.

recompute (mobiuspipe.runtime.activations): F saves the stage input and runs without grad; B recomputes the forward
with grad under F's random state, then backprops. keep and selective: F runs the kept parts with grad and
keeps their graphs (KeptForward), the other parts without grad saving their inputs and random states; B walks
the parts back, backprops the kept graphs from their gradient edges and recomputes the others. Every mode
computes the same numbers: the same ops on the same values, the same dropout masks (drawn in F, replayed in
B), each weight's gradient added once per microbatch into the gradient slot.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from foundation.timing import Stopwatch
from mobiuspipe.errors import PipelineError
from mobiuspipe.memory.arena import DeviceArena
from mobiuspipe.memory.device import Device
from mobiuspipe.memory.ledger import DeviceLedger
from mobiuspipe.memory.measure import counting_saved
from mobiuspipe.memory.swap import Swap
from mobiuspipe.runtime.activations import (
    GradSink,
    Held,
    KeptForward,
    KeptPart,
    Part,
    RecomputedPart,
    edge_of,
    entry,
    keeping,
)
from mobiuspipe.runtime.kept_swap import rebuild, release, spans_out
from mobiuspipe.runtime.peers.comm import TensorSpec
from mobiuspipe.runtime.stage import Stage
from mobiuspipe.schedule.actions import Action, Kind

__all__ = ["Compute", "StepOptions", "StepState", "StepTimes", "LossFn", "MessageKey"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MessageKey = tuple[Kind, int, int]
"""(receive kind, stage, microbatch) of a message a rank takes in."""


@dataclass
class StepTimes:
    """Seconds this rank spent computing, waiting for loads, and waiting on communication."""

    compute_s: float = 0.0
    load_s: float = 0.0
    comm_s: float = 0.0


@dataclass
class StepState:
    """Everything one step of one rank holds between its actions."""

    step: int
    xs: list[torch.Tensor | None]
    """Each microbatch's input: on the device on the rank of stage 0 (Compute.device_inputs), each taken (None) by its
    forward so that nothing here keeps it past the stage's own hold; else unused."""
    ys: tuple[torch.Tensor, ...]
    specs: dict[MessageKey, TensorSpec]
    """Shapes of the messages this rank receives for this batch shape (filled on its first step)."""
    learning: bool
    """True on the first step of a batch shape: every message travels after its TensorSpec header."""
    saved: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    rng: dict[tuple[int, int], tuple] = field(default_factory=dict)
    """The random state each (stage, microbatch) forward started from, so that its recompute in the backward
    draws the same dropout masks (as torch.utils.checkpoint does)."""
    kept: dict[tuple[int, int], KeptForward] = field(default_factory=dict)
    """What the forward of a keep or selective stage left for its backward, by (stage, microbatch)."""
    inbox: dict[MessageKey, torch.Tensor] = field(default_factory=dict)
    outbox: dict[tuple[Kind, int, int], torch.Tensor] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)
    """Each microbatch's share of the loss, on the device: read once, at the step's end (Engine.end_step, every
    pass's at once), so that the steady state has no host-blocking wait but that one."""
    times: StepTimes = field(default_factory=StepTimes)


@dataclass(frozen=True)
class StepOptions:
    """What one pipeline pass of an optimizer step asks of the engine (Pipeline.train_batch makes one per pass)."""

    step: int
    """The optimizer step (0-based), for the trace and the messages' tags."""
    passes: int = 1
    """Pipeline passes per optimizer step (gradient accumulation): each microbatch's loss is divided by
    num_microbatches * passes."""
    loss_scale: float = 1.0
    """The factor the loss is multiplied by before backward (fp16 loss scaling)."""
    accumulate: bool = False
    """OFFLOAD adds to the gradients the tiers hold (every pass of an accumulated step but the first)."""
    want_norm: bool = False
    """OFFLOAD has the tiers note their gradients' squared norm (gradient clipping, on the last pass)."""
    check_finite: bool = False
    """OFFLOAD has the tiers note whether their gradients are all finite (fp16's overflow check, on the last pass)."""
    hold_updates: bool = False
    """Every host update waits for start_updates (a pass before the last; fp16's overflow check, clipping's norm)."""
    speculate: bool = False
    """The updates held for fp16's overflow check or clipping's norm start at once, tentatively, where the stage's
    tier can undo them (Stage.speculates); start_updates then keeps, redoes or drops each."""
    lr: float | None = None
    """The learning rate of the updates this pass starts (bound when each starts); None: the optimizer's own."""
    lag: bool = False
    """A delayed step (train.delayed_update): its LOADs read the weights before the update of the step before, which
    runs while this step computes."""


class Compute:
    """F and B of a rank's stages, and the swaps of their held inputs: the part of the engine that computes (the
    Engine holds one and hands it each pass's StepState and StepOptions with begin())."""

    def __init__(
        self,
        *,
        stages: dict[int, Stage],
        parts: dict[int, list[Part]],
        swaps: dict[int, Swap],
        device: Device,
        arena: DeviceArena,
        ledger: DeviceLedger,
        loss_fn: LossFn,
        num_microbatches: int,
        dtype: torch.dtype,
        last: int,
    ):
        """parts: the parts of each keep or selective stage of this rank (recompute stages and the last are
        absent); swaps: the recompute stages whose saved inputs swap to another tier between F and B; last: the
        model's last stage."""
        self.stages, self.parts, self.swaps = stages, parts, swaps
        self.device, self.arena, self.ledger, self.loss_fn = device, arena, ledger, loss_fn
        self.num_microbatches, self.dtype, self.last = num_microbatches, dtype, last
        self.state = StepState(0, [], (), {}, False)
        self.options = StepOptions(step=0)

    def begin(self, state: StepState, options: StepOptions) -> None:
        """The pass the next actions belong to: its state (shared with the engine's messages) and options."""
        self.state, self.options = state, options

    def _ready(self, stage: Stage) -> None:
        with Stopwatch() as sw:
            stage.wait_loaded()
        self.state.times.load_s += sw.s

    def device_inputs(self, xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Stage 0's input of every microbatch on the device, held in the ledger as ("inputs", 0, i) until its
        forward: copied at the step's start, ahead of the step's weight loads (on CUDA a small copy queued behind
        a load on the copy engine waits for all of it)."""
        out = tuple(self.device.to_device(x, self.dtype if x.is_floating_point() else x.dtype) for x in xs)
        for i, x in enumerate(out):
            self.ledger.hold(("inputs", 0, i), x)
        return out

    def _input(self, j: int, i: int) -> torch.Tensor:
        """Stage j's input for microbatch i on the device, held in the ledger as ("inputs", j, i) (stage 0's since
        the step's start: device_inputs)."""
        if j == 0:
            x, self.state.xs[i] = self.state.xs[i], None
            assert x is not None, f"stage 0's input of microbatch {i} was taken already"
            return x
        x = self._take((Kind.RECV_ACT, j, i))
        self.ledger.hold(("inputs", j, i), x)
        return x

    def _take(self, key: MessageKey) -> torch.Tensor:
        """A received tensor out of the inbox (and out of the ledger's "inbox": the taker holds it now)."""
        t = self.state.inbox.pop(key)
        self.ledger.drop(("inbox", *key))
        return t

    def fwd(self, a: Action) -> None:
        j, i, stage, st = a.stage, a.microbatch, self.stages[a.stage], self.state
        self._ready(stage)
        x = self._input(j, i)
        try:
            if j in self.parts:
                self._fwd_kept(j, i, stage, x)
                return
            if j in self.swaps:  # to its tier on the copy stream; the device copy lives until SWAP_OUT
                self.swaps[j].start_out((j, i), [x])
                self.ledger.hold(("saved", j, i), x)
            else:  # tier device: the input stays where it is, for B to recompute from
                st.saved[(j, i)] = x
                self.ledger.hold(("saved", j, i), x)
            if j < self.last:  # the last stage's forward is fused into its backward (loss and gradient at once)
                st.rng[(j, i)] = self._rng_state()
                with Stopwatch() as sw, torch.no_grad():
                    out = stage.forward(x, with_grad=False)
                self._put_output(j, i, stage, out)
                st.times.compute_s += sw.s
        finally:
            self.ledger.drop(("inputs", j, i))

    def _put_output(self, j: int, i: int, stage: Stage, out: torch.Tensor) -> None:
        if not out.is_floating_point():
            raise PipelineError(
                f"stage {j} (layers {stage.order[0]}..{stage.order[-1]}) outputs a {out.dtype} "
                f"tensor: tensors between stages must be floating point so that gradients flow "
                f"back; make the layer that produces it part of the next stage's first layer"
            )
        self.state.outbox[(Kind.SEND_ACT, j, i)] = out
        self.ledger.hold(("outbox", Kind.SEND_ACT, j, i), out)

    def _fwd_kept(self, j: int, i: int, stage: Stage, x: torch.Tensor) -> None:
        """F of a keep or selective stage: kept parts with grad (graphs kept, weights as slot references),
        recomputed parts without grad (input and random state saved)."""
        kept = self.state.kept[(j, i)] = KeptForward()
        h = x
        with Stopwatch() as sw:
            for p, part in enumerate(self.parts[j]):
                key = ("kept", j, i, p)
                if part.kept:
                    sink = GradSink() if (j > 0 or p > 0) and h.is_floating_point() else None
                    with keeping(self.ledger, key, stage.weight_bytes(), stage.weight_bytes) as held:
                        start = h if sink is None else entry(h, sink)
                        out = stage.forward(start, with_grad=True, layers=part.layers, kept=True)
                    kept.held += held
                    kept.parts.append(KeptPart(sink, edge_of(out)))
                    h = out.detach()
                else:
                    kept.held.append(Held((*key, "in"), h))
                    self.ledger.hold((*key, "in"), h)
                    kept.parts.append(RecomputedPart(kept.held[-1], self._rng_state()))
                    with torch.no_grad():
                        h = stage.forward(h, with_grad=False, layers=part.layers)
        self._put_output(j, i, stage, h)
        self.state.times.compute_s += sw.s
        if j in self.swaps:  # to its tier on the copy stream; the device tensors live until SWAP_OUT
            spans, kept.swapped = spans_out(kept.held, set(stage.buffer_bytes()), self.device.in_memory)
            self.swaps[j].start_out((j, i), spans)

    def bwd(self, a: Action) -> None:
        j, i, stage, st = a.stage, a.microbatch, self.stages[a.stage], self.state
        self._ready(stage)
        if stage.grads is None:
            stage.begin_backward(self.arena)
        if (j, i) in st.kept:
            self._bwd_kept(j, i, stage, st.kept.pop((j, i)))
            return
        with Stopwatch() as sw:
            if j in self.swaps:
                x = self.swaps[j].finish_in((j, i))[0]  # back from its tier (SWAP_IN started the copy)
            else:
                x = st.saved.pop((j, i))
                self.ledger.drop(("saved", j, i))
            self.ledger.hold(("inputs", j, i), x)
            if j > 0:
                x.requires_grad_(True)
            try:
                with self._replaying(st.rng.pop((j, i), None)):
                    self._fwd_bwd(j, i, stage, x)
            finally:
                self.ledger.drop_kind("autograd")
                self.ledger.drop_kind("output")
            if j > 0:
                self._put_input_grad(j, i, self._input_grad(x.grad, stage))
            for k in [("inputs", j, i), *self._swapped_in(j, i)]:
                self.ledger.drop(k)
        st.times.compute_s += sw.s

    def swap_out(self, a: Action) -> None:
        """The copy of (j, i)'s held tensors to its tier has ended: their device bytes go."""
        key = (a.stage, a.microbatch)
        self.swaps[a.stage].finish_out(key)
        kept = self.state.kept.get(key)
        if kept is None:
            self.ledger.drop(("saved", *key))
        elif kept.swapped is not None:
            release(kept.swapped, self.ledger)

    def swap_in(self, a: Action) -> None:
        """Start copying (j, i)'s held tensors back for its backward (held as ("swapin", j, i, n) from now)."""
        for n, t in enumerate(self.swaps[a.stage].start_in((a.stage, a.microbatch))):
            self.ledger.hold(("swapin", a.stage, a.microbatch, n), t)

    def _swapped_in(self, j: int, i: int) -> list[tuple]:
        """The ledger keys of (j, i)'s swap-in (none without one)."""
        return [k for k in self.ledger.keys("swapin") if k[1:3] == (j, i)]

    def _put_input_grad(self, j: int, i: int, g: torch.Tensor) -> None:
        self.state.outbox[(Kind.SEND_GRAD, j, i)] = g
        self.ledger.hold(("outbox", Kind.SEND_GRAD, j, i), g)

    def _bwd_kept(self, j: int, i: int, stage: Stage, kept: KeptForward) -> None:
        """B of a keep or selective stage: its parts from the last back, each passing the gradient at its
        input to the part before."""
        st, key = self.state, (Kind.RECV_GRAD, j, i)
        stage.zero_grads()
        with Stopwatch() as sw:
            g: torch.Tensor | None = st.inbox[key]
            if kept.swapped is not None:  # back from its tier (SWAP_IN started the copies)
                rebuild(kept.swapped, self.swaps[j].finish_in((j, i)))
            try:
                for part, done in zip(reversed(kept.parts), reversed(self.parts[j])):
                    if g is None:
                        break  # no gradient reaches the parts before (an integer tensor between layers)
                    g = self._part_backward(j, i, stage, part, done, g)
            finally:
                self._take(key)
                for k in [h.key for h in kept.held] + self._swapped_in(j, i):
                    if self.ledger.holds(k):
                        self.ledger.drop(k)
                self.ledger.drop_kind("autograd")
                self.ledger.drop_kind("output")
            if j > 0:
                self._put_input_grad(j, i, self._input_grad(g, stage))
        st.times.compute_s += sw.s

    def _part_backward(
        self, j: int, i: int, stage: Stage, part: KeptPart | RecomputedPart, layers: Part, g: torch.Tensor
    ) -> torch.Tensor | None:
        """One part's backward from the gradient g at its output; the gradient at its input (None: not wanted)."""
        if isinstance(part, KeptPart):
            if part.edge is not None:
                torch.autograd.backward([part.edge], [g])
            return None if part.sink is None else part.sink.grad
        x = part.saved.t
        assert x is not None, "a recomputed part's input is swapped out at its backward"
        x = x.detach()  # requires_grad_ below must not touch the held tensor
        wants_grad = x.is_floating_point() and (j > 0 or layers.layers[0] != stage.order[0])
        if wants_grad:
            x.requires_grad_(True)
        with self._replaying(part.rng), counting_saved(self.ledger):
            out = stage.forward(x, with_grad=True, layers=layers.layers)
            self.ledger.hold(("output", j, i), out)
        if out.requires_grad:  # else these layers train nothing and pass no gradient on (frozen, at the input)
            out.backward(g)
        self.ledger.drop_kind("autograd")
        self.ledger.drop_kind("output")
        return x.grad if wants_grad else None

    def _fwd_bwd(self, j: int, i: int, stage: Stage, x: torch.Tensor) -> None:
        """Stage j's forward with grad (its saved tensors and output held in the ledger), then its backward."""
        st = self.state
        with counting_saved(self.ledger):
            out = stage.forward(x, with_grad=True)
            self.ledger.hold(("output", j, i), out)
            loss = self._last_loss(out, i) if j == self.last else None
        stage.zero_grads()  # the forward did not need the gradient slot: cleared only now
        if loss is not None:
            st.losses.append(loss.detach())
            if loss.requires_grad:  # else nothing before it trains (every weight frozen)
                (loss * self.options.loss_scale if self.options.loss_scale != 1.0 else loss).backward()
            self.ledger.drop(("inputs", "targets", i))
        else:
            key = (Kind.RECV_GRAD, j, i)
            g = st.inbox.pop(key)
            if out.requires_grad:  # else the stage trains nothing and wants no input gradient (stage 0, frozen)
                out.backward(g)
            self.ledger.drop(("inbox", *key))

    def _rng_state(self) -> tuple:
        dev = self.device.torch_device
        return torch.get_rng_state(), (torch.cuda.get_rng_state(dev) if self.device.is_cuda else None)

    def _replaying(self, state: tuple | None):
        """A context in which the random generators start from `state` and are put back after (no-op for None)."""
        if state is None:
            return contextlib.nullcontext()
        return _replay(state, self.device.torch_device if self.device.is_cuda else None)

    @staticmethod
    def _input_grad(g: torch.Tensor | None, stage: Stage) -> torch.Tensor:
        if g is None:
            raise PipelineError(
                f"stage {stage.index} (layers {stage.order[0]}..{stage.order[-1]}) got no gradient "
                f"for its input: its output does not depend on its input, so the pipeline cannot "
                f"cut there; re-plan so that those layers join a neighbouring stage"
            )
        return g

    def _last_loss(self, out: torch.Tensor, i: int) -> torch.Tensor:
        """The loss of microbatch i in fp32 (a no-op in fp32), its targets held as ("inputs", "targets", i)."""
        y = self.device.to_device(self.state.ys[i])
        self.ledger.hold(("inputs", "targets", i), y)
        return self._loss(out.float(), y)

    def _loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The microbatch's share of the step's loss: loss_fn(out, y) / num_microbatches."""
        loss = self.loss_fn(out, y)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            found = (
                f"a {loss.dtype} tensor of shape {tuple(loss.shape)}"
                if isinstance(loss, torch.Tensor)
                else type(loss).__name__
            )
            raise PipelineError(
                f"the loss function returned {found}; expected a floating-point scalar tensor "
                f"(the mean loss of the microbatch), e.g. F.cross_entropy(out, y)"
            )
        return loss.reshape(()) / (self.num_microbatches * self.options.passes)


@contextlib.contextmanager
def _replay(state: tuple, cuda: torch.device | None):
    """Run with the CPU (and CUDA) random state of an earlier forward; the current state comes back after."""
    with torch.random.fork_rng(devices=[cuda] if cuda is not None else []):
        torch.set_rng_state(state[0])
        if cuda is not None:
            torch.cuda.set_rng_state(state[1], cuda)
        yield
