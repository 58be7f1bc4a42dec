"""Runs one rank's schedule for one step: a dispatch table from action kind to a small method.

The state of a step (the stage inputs saved for the recompute, the graphs kept from a forward to its
backward, received activations and gradients, outputs waiting to be sent, the loss, the times) lives in one
StepState; F and B are in mobiuspipe.runtime.compute. Each method times itself into the compute / load / comm
buckets. Shapes and dtypes of the tensors between ranks are learned on the first step of each batch shape: the
sender puts a small header (TensorSpec) ahead of each tensor. Every tensor the engine holds on the device is held in
its DeviceLedger too, under a key whose kind says why: "inputs" (a stage's input while it computes, a microbatch's
targets), "saved" (stage inputs kept on the device for the recompute), "kept" (what a keep or selective stage holds
from F to B: the saved tensors of its kept graphs, the inputs of its segments), "inbox", "outbox", "output" (a
stage's output during its backward), "autograd" (saved for backward), "buffers"; the arena and Comm add "arena" and
"sending". DevicePeak turns it into the step's measured device peak.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from foundation.timing import Stopwatch
from mobiuspipe.memory.arena import DeviceArena
from mobiuspipe.memory.device import Device
from mobiuspipe.memory.ledger import DeviceLedger
from mobiuspipe.memory.measure import DevicePeak, retry_warning
from mobiuspipe.memory.reduce import read_scalars
from mobiuspipe.memory.swap import Swap
from mobiuspipe.runtime.action_trace import ActionTrace
from mobiuspipe.runtime.activations import StageMode, parts_of
from mobiuspipe.runtime.clock import ActionClock
from mobiuspipe.runtime.compute import Compute, LossFn, MessageKey, StepOptions, StepState, StepTimes
from mobiuspipe.runtime.peers.comm import Comm, Posted, TensorSpec
from mobiuspipe.runtime.stage import Stage
from mobiuspipe.runtime.states import DeviceStates
from mobiuspipe.schedule.actions import Action, Kind

__all__ = ["Engine", "StepOptions", "StepTimes", "LossFn"]

EVAL_TAG_BASE = (1 << 30) + (1 << 24)
"""Message tags of evaluation: above every training tag (< 2^30) and the tied-gradient exchange's."""


@dataclass
class _Pass:
    """A pass run_step issued and end_step reads: its step, its microbatches' losses (on the device), its times (the
    stand-in's), its actions' (action, start, end) marks and its flush (not its StepState, whose device inputs would
    stay allocated until the step's end)."""

    step: int
    losses: list[torch.Tensor]
    times: StepTimes
    spans: list[tuple[Action, object, object]]
    flush_start: float
    flush_end: float


def _loss_of(losses: list[list[torch.Tensor]]) -> float:
    """The step's loss from each pass's microbatch losses (on the device), read at once: each pass's summed in order
    in float64, then the passes in order."""
    flat = [t for pass_losses in losses for t in pass_losses]
    values = torch.stack(flat).double().tolist() if flat else []
    total, k = 0.0, 0
    for pass_losses in losses:
        total += sum(values[k : k + len(pass_losses)])
        k += len(pass_losses)
    return total


class Engine:
    """One rank: its stages, arena, comm; run_step() issues one pass of the schedule, end_step() reads the step."""

    def __init__(
        self,
        *,
        mapping: list[int],
        rank: int,
        stages: dict[int, Stage],
        schedule: list[Action],
        device: Device,
        arena: DeviceArena,
        comm: Comm,
        loss_fn: LossFn,
        num_microbatches: int,
        dtype: torch.dtype = torch.float32,
        ledger: DeviceLedger | None = None,
        activations: dict[int, StageMode] | None = None,
        swaps: dict[int, Swap] | None = None,
        trace: ActionTrace | None = None,
        ahead: dict[MessageKey, Action] | None = None,
        releases: Mapping[tuple | None, list[tuple]] | None = None,
    ):
        """trace: records when each action of the steps it wants ran (Pipeline(trace_steps=...)); None: none. ahead:
        each receive from another rank -> the receive to post as it is taken (mobiuspipe.schedule.ahead.receives_ahead,
        this rank's; None: none); kept only where the channels give each direction its own queue. releases: each
        message action -> the sends to other ranks the schedules prove taken by then, dropped before it
        (partition.rules.lifetimes.send_releases, this rank's: what the plan's walk drops there; None: none, the
        sends go as Comm learns they completed)."""
        self.mapping, self.rank, self.stages, self.schedule = mapping, rank, stages, schedule
        self._releases = {
            step: {key[1:] for key in keys} for step, keys in (releases or {}).items() if step is not None
        }  # ("SA", j, i) -> {("SG", k, n), ...}: the sends' own actions
        self.device, self.arena, self.comm, self.loss_fn = device, arena, comm, loss_fn
        self.num_microbatches, self.dtype = num_microbatches, dtype
        self.options = StepOptions(step=0)
        """The pass run_step runs (its argument; read by the compute actions)."""
        self._held: set[int] = set()
        """Stages whose updates wait for start_updates whatever the options say (tied parameters)."""
        self._deferred: list[Stage] = []
        self._tentative: list[Stage] = []  # stages whose update of this step started tentatively
        self.rolled_back = 0
        """Tentative updates rolled back (redone, or dropped with a skipped step) so far."""
        self.last = len(mapping) - 1
        modes = activations or {}
        self.parts = {
            j: parts_of(s.order, modes[j])
            for j, s in stages.items()
            if j < self.last and modes.get(j, StageMode()).mode != "recompute"
        }
        """The kept and recomputed parts of this rank's keep and selective stages (the last stage's forward
        is fused into its backward under every mode, so it has none)."""
        self.swaps = swaps or {}
        """Stage -> the tier its saved inputs swap to between F and B (SWAP_OUT, SWAP_IN); others keep them."""
        self.ledger = ledger or DeviceLedger()
        """The tensors this rank holds on its device (the arena and comm, given the same ledger, add theirs)."""
        self.peak = DevicePeak(device.torch_device, self.ledger)
        for j, s in stages.items():
            for l, buffers in s.buffers.items():
                for n, b in buffers.items():
                    self.ledger.hold(("buffers", j, l, n), b)
            if isinstance(s.states, DeviceStates):  # the gpu tier's states, resident the whole run
                for n, t in s.states.tensors().items():
                    self.ledger.hold(("states", j, n), t)
        self.trace = trace or ActionTrace(())
        self.compute = Compute(
            stages=stages,
            parts=self.parts,
            swaps=self.swaps,
            device=device,
            arena=arena,
            ledger=self.ledger,
            loss_fn=loss_fn,
            num_microbatches=num_microbatches,
            dtype=dtype,
            last=self.last,
        )
        """F, B and the swaps of this rank's stages."""
        self.state = self.compute.state
        """The pass being run: its inputs, messages, saved tensors, loss and times (shared with compute)."""
        self.clock = ActionClock(device.compute)
        """When the actions ran: CUDA events on a gpu, the host's clock on the stand-in (mobiuspipe.runtime.clock)."""
        self.updater = device.executor("host-optimizer")
        """The host updates' thread: bound to the rank's gpu (it waits for the gradients' copies), pinned near it."""
        self._specs: dict[tuple, dict[MessageKey, TensorSpec]] = {}  # batch shape -> specs of its messages
        self._eval_specs: dict[tuple, dict[tuple[int, int], TensorSpec]] = {}  # the same for evaluation's
        self._ahead = dict(ahead or {}) if comm.channels.receives_apart else {}
        """A receive from another rank -> the next one, posted as the first is taken: its bytes move (in gloo's
        threads, on NCCL's stream) while this rank computes, and its sender's send completes."""
        self._posted: dict[MessageKey, Posted] = {}
        self._passes: list[_Pass] = []
        """The step's passes issued so far (end_step reads them)."""
        self._dispatch = {
            Kind.LOAD: self._load,
            Kind.RELEASE: self._release,
            Kind.FWD: self.compute.fwd,
            Kind.BWD: self.compute.bwd,
            Kind.SEND_ACT: self._send_act,
            Kind.RECV_ACT: self._recv,
            Kind.SEND_GRAD: self._send_grad,
            Kind.RECV_GRAD: self._recv,
            Kind.OFFLOAD: self._offload,
            Kind.SWAP_OUT: self.compute.swap_out,
            Kind.SWAP_IN: self.compute.swap_in,
        }

    @property
    def buffer_bytes(self) -> int:
        """The bytes of the layers' buffers this rank's stages keep on the gpu all run (a plan counts them as its
        profile measured them: Plan.buffers_on)."""
        return sum({p: n for s in self.stages.values() for p, n in s.buffer_bytes().items()}.values())

    def hold_updates_of(self, stages: Iterable[int]) -> None:
        """Have these stages' updates wait for start_updates on every pass (a tied parameter's halves, whose
        gradient is whole only once the ranks have added their halves)."""
        self._held = set(stages)

    def run_step(self, x: torch.Tensor, y: torch.Tensor, options: StepOptions) -> None:
        """One pipeline pass over the batch (x, y) as `options` ask, issued without waiting for what the device
        computes; end_step() reads the step's passes once they are all issued (on CUDA the passes of an accumulated
        step then run back to back: a read at each pass's end would drain the compute stream there)."""
        self.options = options
        step = options.step
        shape = (tuple(x.shape), x.dtype)
        learning = shape not in self._specs
        specs = self._specs.setdefault(shape, {})
        m = self.num_microbatches
        xs = self.compute.device_inputs(x.chunk(m)) if 0 in self.stages else x.chunk(m)
        ys = self.device.pinned_batch(y.chunk(m)) if self.last in self.stages else y.chunk(m)
        self.state = StepState(step, list(xs), ys, specs, learning)
        del xs  # the state's list alone refers to them: its forward takes each
        self.compute.begin(self.state, options)
        if not options.accumulate:  # the step's first pass
            self._passes = []
            self.peak.start_step()
            self.clock.start_step()
        clock, spans = self.clock, []
        with self.device.stepping():
            for a in self.schedule:
                start = clock.mark()
                self._dispatch[a.kind](a)
                spans.append((a, start, clock.mark()))
            start = time.perf_counter()
            self.comm.flush()
            end = time.perf_counter()
        self.state.times.comm_s += end - start
        self._passes.append(_Pass(step, self.state.losses, self.state.times, spans, start, end))

    def end_step(self) -> tuple[float, StepTimes]:
        """Read what the step's passes left on the device (CUDA: the step's one host-blocking wait): this rank's share
        of the loss (each pass's microbatches summed in order in float64, then the passes in order) and its times,
        summed over the passes. The step's measured device peak is then in peak.step_bytes."""
        passes, self._passes = self._passes, []
        loss = _loss_of([p.losses for p in passes])
        clock = self.clock
        if clock.on_device:  # the host's Stopwatches measured kernel launches there
            b = clock.buckets((a.kind.value, s, e) for p in passes for a, s, e in p.spans)
            times = StepTimes(b["compute"], b["load"], b["comm"] + sum(p.flush_end - p.flush_start for p in passes))
        else:
            times = StepTimes()
            for p in passes:
                t = p.times
                times = StepTimes(times.compute_s + t.compute_s, times.load_s + t.load_s, times.comm_s + t.comm_s)
        for p in passes:
            self._trace(p)
        before = self.peak.alloc_retries
        self.peak.end_step()
        if (
            why := retry_warning(self.device.index, self.peak.alloc_retries, before, len(set(self.mapping)))
        ) is not None:
            warnings.warn(why, RuntimeWarning, stacklevel=2)
        return loss, times

    def _trace(self, p: _Pass) -> None:
        """A pass's actions and its flush in the trace, if it wants the step (CUDA: after the clock has settled)."""
        step, clock = p.step, self.clock
        if self.trace.wants(step):
            for a, s, e in p.spans:
                self.trace.add(step, a.kind.value, a.stage, a.microbatch, clock.seconds(s), clock.seconds(e))
            self.trace.add(step, "flush", -1, -1, p.flush_start, p.flush_end)

    def wait_updates(self) -> None:
        """Wait for every host update started so far."""
        for s in self.stages.values():
            s.wait_update()

    def finish(self, failed: bool = False) -> None:
        """Wait for every pending host update (call before reading weights or exiting); failed: the run ends by an
        error, and the links do not wait for messages a lost peer will never match."""
        self.wait_updates()
        self.updater.shutdown(wait=True)
        for swap in set(self.swaps.values()):
            swap.close()
        self.comm.close(failed)
        self.device.close()

    # -- weights -------------------------------------------------------------------------------
    def _load(self, a: Action) -> None:
        options = self.options
        with Stopwatch() as sw:
            self.stages[a.stage].load(self.arena, options.step if options.lag else None)
        self.state.times.load_s += sw.s

    def _release(self, a: Action) -> None:
        self.stages[a.stage].release(self.arena)

    def _offload(self, a: Action) -> None:
        stage, options = self.stages[a.stage], self.options
        with Stopwatch() as sw:
            stage.offload(self.arena, options.accumulate, options.want_norm, options.step, options.check_finite)
        self.state.times.load_s += sw.s
        held = self.options.hold_updates or a.stage in self._held
        if held and self.options.speculate and a.stage not in self._held and stage.speculates:
            self._start_update(stage, self.options.loss_scale, tentative=True)
            self._tentative.append(stage)
        elif held:
            self._deferred.append(stage)
        else:
            self._start_update(stage, 1.0)

    def start_updates(self, apply: bool, grad_scale: float | None = None) -> None:
        """Start the held-back host updates (gradients divided by grad_scale, default the loss scale), or drop
        them (a skipped step, or a pass of an accumulated step that is not its last); and settle the tentative ones
        alike (Stage.validate_update)."""
        scale = self.options.loss_scale if grad_scale is None else grad_scale
        for stage in self._deferred:
            if apply:
                self._start_update(stage, scale)
        for stage in self._tentative:
            self.rolled_back += stage.validate_update(self.updater, apply, scale)
        self._deferred, self._tentative = [], []

    def _start_update(self, stage: Stage, grad_scale: float, tentative: bool = False) -> None:
        """Start stage's host update at this step's learning rate (traced as "U" when the step is)."""
        step = self.state.step
        note = partial(self.trace.add, step, "U", stage.index, -1) if self.trace.wants(step) else None
        stage.start_update(self.updater, grad_scale, self.options.lr, note, step, tentative)

    def grad_checks(self, norm: bool, finite: bool, tied: Sequence[float | torch.Tensor] = ()) -> tuple[float, bool]:
        """(the squared norm of the gradients this rank offloaded in this step: each stage's and the tied pairs'
        `tied` terms summed, 0.0 without norm; whether one held back (or updated tentatively) is inf or nan, False
        without finite). What the states reduced on the gpu (DeviceStates; HostGrads for a step's only pass) is read
        at once (read_scalars: one host synchronization, not one a stage)."""
        own = [s.states.grad_sumsq() for s in self.stages.values()] if norm else []
        ties = list(tied) if norm else []
        flags = [s.grads_finite() for s in self._deferred + self._tentative] if finite else []
        values = read_scalars([*own, *ties, *flags])
        a, b = len(own), len(own) + len(ties)
        return sum(values[:a]) + sum(values[a:b]), not all(values[b:])

    # -- evaluation ----------------------------------------------------------------------------
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor, what: str) -> float:
        """This rank's share of the batch's mean loss with no gradient, no recompute and no update (nonzero on the
        last stage's rank only). Each stage is visited in order: its weights loaded (after its pending update),
        every microbatch run in eval mode (dropout off), each output handed to the next stage (on this rank, or
        sent, with its shape header at a batch shape's first evaluation: the specs are learned then, as training's
        are), the slot released. A rank only waits for a lower stage, which its holder visits before any higher one,
        so the visit order cannot deadlock."""
        m, last = self.num_microbatches, self.last
        xs = self.device.pinned_batch(x.chunk(m)) if 0 in self.stages else x.chunk(m)
        ys = self.device.pinned_batch(y.chunk(m)) if last in self.stages else y.chunk(m)
        shape = (tuple(x.shape), x.dtype)
        learning = shape not in self._eval_specs
        specs = {} if learning else self._eval_specs[shape]
        handed: dict[tuple[int, int], torch.Tensor] = {}
        losses: list[torch.Tensor] = []  # read once all are queued: one host wait, not one a microbatch
        modules = [mod for s in self.stages.values() for layer in s.layers.values() for mod in layer.modules()]
        modes = [mod.training for mod in modules]  # each module's own: a layer's train(mode) would set them all
        for mod in modules:
            mod.eval()
        try:
            with self.device.stepping():
                self._eval_visits(xs, ys, handed, specs, losses, learning, what)
            self._eval_specs[shape] = specs  # learned: every rank's evaluation of this shape has passed
        finally:
            for mod, mode in zip(modules, modes):
                mod.training = mode
        total = 0.0
        for loss in torch.stack(losses).tolist() if losses else []:
            total += loss / m
        return total

    def _eval_visits(self, xs, ys, handed: dict, specs: dict, losses: list, learning: bool, what: str) -> None:
        """eval_loss's visits of this rank's stages, in order (each microbatch's loss queued in `losses` on the last
        stage's rank), and the flush of their sends."""
        m, last = self.num_microbatches, self.last
        for j in sorted(self.stages):
            stage = self.stages[j]
            stage.load(self.arena)
            stage.wait_loaded()
            try:
                for i in range(m):
                    with torch.no_grad():
                        out = stage.forward(self._eval_input(j, i, xs, handed, specs, what), with_grad=False)
                    if j == last:
                        losses.append(self.loss_fn(out.float(), self.device.to_device(ys[i])))
                    elif self.mapping[j + 1] == self.rank:
                        handed[(j + 1, i)] = out
                    else:
                        self._eval_send(out, j, i, learning, what)
            finally:
                stage.release(self.arena)
        self.comm.flush()

    def _eval_tag(self, j: int, i: int, header: bool) -> int:
        return EVAL_TAG_BASE + (j * self.num_microbatches + i) * 2 + header

    def _eval_input(self, j: int, i: int, xs, handed: dict, specs: dict, what: str) -> torch.Tensor:
        """Stage j's input for microbatch i: the batch's (stage 0), handed over on this rank, or received (its spec
        from `specs`, else from its header, then kept there)."""
        dev = self.device.torch_device
        if j == 0:
            x = xs[i]
            return self.device.to_device(x, self.dtype if x.is_floating_point() else x.dtype)
        if (j, i) in handed:
            return handed.pop((j, i))
        src = self.mapping[j - 1]
        what = f"the activation of stage {j - 1} microbatch {i} ({what})"
        if (j, i) not in specs:
            specs[(j, i)] = self.comm.recv_spec(dev, src, self._eval_tag(j - 1, i, True), what)
        return self.comm.recv(specs[(j, i)], dev, src, self._eval_tag(j - 1, i, False), what)

    def _eval_send(self, out: torch.Tensor, j: int, i: int, learning: bool, what: str) -> None:
        """Send stage j's output for microbatch i to the next stage's rank, after its shape header when learning."""
        dst, what = self.mapping[j + 1], f"the activation of stage {j} microbatch {i} ({what})"
        if learning:
            self.comm.send_spec(TensorSpec.of(out, what), out.device, dst, self._eval_tag(j, i, True), what)
        self.comm.send(out, dst, self._eval_tag(j, i, False), what)

    # -- communication -------------------------------------------------------------------------
    def _tag(self, kind: Kind, j: int, i: int, header: bool) -> int:
        grad = kind in (Kind.SEND_GRAD, Kind.RECV_GRAD)
        return (((j * self.num_microbatches + i) * 2 + grad) * 2 + header) % (1 << 30)

    def _send(self, a: Action, dst_stage: int, what: str) -> None:
        st = self.state
        t = st.outbox.pop((a.kind, a.stage, a.microbatch))
        if self.mapping[dst_stage] == self.rank:  # same gpu: hand over without the network
            recv_kind = Kind.RECV_ACT if a.kind is Kind.SEND_ACT else Kind.RECV_GRAD
            st.inbox[(recv_kind, dst_stage, a.microbatch)] = t
            self.ledger.hold(("inbox", recv_kind, dst_stage, a.microbatch), t)
            self.ledger.drop(("outbox", a.kind, a.stage, a.microbatch))
            return
        what = f"{what} of stage {a.stage} microbatch {a.microbatch} (step {st.step})"
        dst, step = self.mapping[dst_stage], (a.kind.value, a.stage, a.microbatch)
        with Stopwatch() as sw:
            self.comm.release(self._releases.get(step))
            if st.learning:
                spec = TensorSpec.of(t, what)
                self.comm.send_spec(spec, t.device, dst, self._tag(a.kind, a.stage, a.microbatch, True), what)
            self.comm.send(t, dst, self._tag(a.kind, a.stage, a.microbatch, False), what, key=step)
        self.ledger.drop(("outbox", a.kind, a.stage, a.microbatch))  # Comm holds it while in flight
        st.times.comm_s += sw.s

    def _recv(self, a: Action) -> None:
        if self.mapping[_sender_stage(a)] == self.rank:
            return  # handed over by _send on this rank
        st, key = self.state, (a.kind, a.stage, a.microbatch)
        with Stopwatch() as sw:
            self.comm.release(self._releases.get((a.kind.value, a.stage, a.microbatch)))
            if st.learning:  # the first step of a batch shape: its header first, nothing posted ahead
                src, _, what = self._source(a)
                header = self._tag(_sender_kind(a), _sender_stage(a), a.microbatch, True)
                st.specs[key] = self.comm.recv_spec(self.device.torch_device, src, header, what)
                posted = self._post(a)
            else:
                posted = self._posted.pop(key, None) or self._post(a)
                if (ahead := self._ahead.get(key)) is not None:
                    self._posted[(ahead.kind, ahead.stage, ahead.microbatch)] = self._post(ahead, early=True)
            st.inbox[key] = self.comm.take(posted)
        st.times.comm_s += sw.s

    def _post(self, a: Action, early: bool = False) -> Posted:
        """Post the receive of `a` into a new device buffer (held in the ledger from now); early: ahead of its action
        (Comm.post_recv)."""
        src, tag, what = self._source(a)
        key = (a.kind, a.stage, a.microbatch)
        posted = self.comm.post_recv(self.state.specs[key], self.device.torch_device, src, tag, what, early)
        self.ledger.hold(("inbox", *key), posted.buf)
        return posted

    def _source(self, a: Action) -> tuple[int, int, str]:
        """The rank a receive comes from, the tag of its tensor and what it is."""
        what = "activation" if a.kind is Kind.RECV_ACT else "output gradient"
        tag = self._tag(_sender_kind(a), _sender_stage(a), a.microbatch, False)
        where = f"for stage {a.stage} microbatch {a.microbatch} (step {self.state.step})"
        return self.mapping[_sender_stage(a)], tag, f"{what} {where}"

    def _send_act(self, a: Action) -> None:
        self._send(a, a.stage + 1, "activation")

    def _send_grad(self, a: Action) -> None:
        self._send(a, a.stage - 1, "input gradient")


def _sender_stage(a: Action) -> int:
    """The stage whose send a receive takes: the stage before (an activation) or after (a gradient)."""
    return a.stage - 1 if a.kind is Kind.RECV_ACT else a.stage + 1


def _sender_kind(a: Action) -> Kind:
    return Kind.SEND_ACT if a.kind is Kind.RECV_ACT else Kind.SEND_GRAD
