"""The bytes one gpu holds on its device during a step, walked action by action in the order the runtime runs them.

Legend (stage j, microbatch i, gpu g; per ONE microbatch unless marked; units in brackets):
  M        microbatches per step                                                            [-]
  P_j      stage j's parameter bytes; its gradients take as many                            [bytes]
  W_arena  the device arena preallocated whole: ARENA_SLOTS * W (partition.rules.costmodel)       [bytes]
  I_j      stage j's input: O of stage j-1's last layer; I_0 the model input (token ids)    [bytes]
  O_j      stage j's output (what SA sends); the gradient RG receives has the same size     [bytes]
  A_j      work bytes while B(j,i) computes: the stage's saved activations, its input and
           output buffers (partition.rules.costmodel A_j); stage 0 adds I_0, the last stage adds
           Y, the targets of its loss                                                       [bytes]
  H_j      held bytes: what (j,i) keeps on the device from F(j,i) to the start of B(j,i).
           Recompute: H_j = I_j, the input stays on the device (on a gpu and on the stand-in);
           the last stage, whose forward runs inside its backward, holds its input too. A
           policy that keeps activations passes its own.                                     [bytes]
  Y        the loss targets of one microbatch, live during B(last, i)                       [bytes]
  E        HEADER_BYTES: the shape header sent ahead of a message (first step of a shape)   [bytes]
  D_g      max over gpu g's actions of the bytes held during the action: the walk's peak   [bytes]

What the walk holds, and when (mirroring mobiuspipe.runtime.engine's DeviceLedger keys):
  arena    either W_arena all step long (the memory the device gives up), or the slots in use (what the
           ledger counts: "arena"): P_j from L(j) to R(j), and P_j of gradients from j's first B to O(j).
  held     H_j from F(j,i) to the start of B(j,i)  (ledger "saved"); for a stage that swaps, from F(j,i) to
           SO(j,i) and from SI(j,i) to the start of B(j,i).
  inputs   I_0 of every microbatch on stage 0's gpu from the step's start (the runtime copies them in ahead of
           the step's loads: Compute.device_inputs) to F(0,i).
  inbox    I_j from RA(j,i) to F(j,i); O_j from RG(j,i) to the end of B(j,i). From a stage of the same
           gpu the message arrives at the sender's SA / SG, so up to M of them queue ("inbox"). A receive from
           another gpu is posted one ahead, at the gpu's previous such receive (mobiuspipe.runtime.engine), and
           holds its buffer from there.
  outbox   O_j from F(j,i) to SA(j,i); I_j from B(j,i) to SG(j,i)  ("outbox").
  sending  a message to another gpu, O_j or I_j plus E, from its send until the sender's first send or
           receive after it learnt the message was taken ("sending": Comm drops completed sends at its next
           call). The walk takes the latest such point the schedules prove: the receiver took it before it
           sent a message that this gpu has received; without one, at the end of the step (Comm.flush). Where
           sends report their completion (NCCL, whose host runs ahead of the gpu and so would learn it later,
           and the strict stand-in) the engine drops each there itself (send_releases, Comm.release).
           With sends_until_flush (gloo, the CPU stand-in's backend: its send requests report completion
           only once waited on, so Comm keeps every send until Comm.flush) all are held to the step's end.
  transient during F(j,i): its input and output (I_j + O_j, and H_j beyond I_j); during B(j,i): A_j.
  shared   G_j of a stage whose last layer is kept includes its output O_j (the graph's output): the same
           storage the outbox, the message and the next stage's inbox hold. Those bytes count once, while
           any of them holds it (O_j of the legend's StageBytes.held_output); a swap-in's copy is its own.
Not walked: operator temporaries and gradients inside one backward (the CUDA allocator sees them, the
ledger does not), the layers' buffers (held the whole run: partition.rules.device_peak adds each gpu's,
Plan.buffers_on), and send headers beyond one per message.
Nor the gradient checks' working memory at O(j) (mobiuspipe.memory.reduce: the norm's float64 cast of one chunk,
8 MiB), taken right after B(j, M-1) has freed A_j: the walk's top at that B already holds it wherever A_j - I_j,
the stage's saved activations, is at least that (every stage of a real model; on a gpu X adds more room).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from partition.rules.order import Step, steps_of

__all__ = ["HEADER_BYTES", "StageBytes", "device_timeline", "device_peak", "device_peaks", "send_releases"]

HEADER_BYTES = 80
"""E of the legend: mobiuspipe.runtime.peers.comm.TensorSpec's header, MAX_DIMS + 2 = 10 int64s."""


@dataclass(frozen=True)
class StageBytes:
    """One stage's bytes per microbatch for the walk (see the legend)."""

    input: int
    """I_j."""
    output: int
    """O_j (0 for the last stage: its output stays inside its fused backward)."""
    work: int
    """A_j, the stage's input and output included (stage 0: I_0 too; the last stage: Y too)."""
    held: int
    """H_j."""
    params: int = 0
    """P_j (walked only when the arena is walked slot by slot)."""
    held_output: int = 0
    """The part of H_j that is O_j itself (the stage's last layer kept: its graph holds its output); 0 else."""


def device_timeline(
    mapping: list[int],
    gpu: int,
    microbatches: int,
    stages: Sequence[StageBytes],
    arena: int | None = None,
    sends_until_flush: bool = False,
    swapped: frozenset[int] = frozenset(),
) -> list[tuple[Step, int]]:
    """(action, the most bytes held while it runs) for each of gpu's actions of one step, in order. arena:
    W_arena held whole, or None to walk the slots in use (each stage's P_j); sends_until_flush: messages to
    other gpus are held to the step's end (see the legend); swapped: the stages whose held bytes swap out
    between F and B (partition.rules.order.steps_of)."""
    steps = steps_of(mapping, gpu, microbatches, swapped)
    releases = {} if sends_until_flush else send_releases(tuple(mapping), gpu, microbatches)
    walk = _Walk(arena)
    if mapping[0] == gpu:  # the runtime copies every microbatch's input in at the step's start, ahead of the loads
        for i in range(microbatches):
            walk.hold(("in", 0, i), stages[0].input)
    ahead = _receives_ahead(mapping, gpu, steps)
    out = []
    for kind, j, i in steps:
        for key in releases.get((kind, j, i), ()):
            walk.drop(key)
        top = _step(walk, mapping, gpu, (kind, j, i), stages)
        if (kind, j, i) in ahead:  # the next receive from another gpu is posted before this one is waited for
            _, k, n = nxt = ahead[(kind, j, i)]
            walk.hold(_inbox(nxt), stages[k].input if nxt[0] == "RA" else stages[k].output)
            top = max(top, walk.total)
        out.append(((kind, j, i), top))
    return out


def _receives_ahead(mapping: list[int], gpu: int, steps: list[Step]) -> dict[Step, Step]:
    """Each receive of gpu's steps from another gpu -> the next such receive (posted at the first)."""
    remote = [s for s in steps if s[0] in ("RA", "RG") and _partner(mapping, s)[0] != gpu]
    return dict(zip(remote, remote[1:]))


def _inbox(step: Step) -> tuple:
    """The walk's key of a receive's buffer."""
    kind, j, i = step
    return ("in", j, i) if kind == "RA" else ("gin", j, i)


def device_peak(
    mapping: list[int],
    gpu: int,
    microbatches: int,
    stages: Sequence[StageBytes],
    arena: int | None = None,
    sends_until_flush: bool = False,
    swapped: frozenset[int] = frozenset(),
) -> int:
    """D_g: the most bytes gpu holds at any moment of the step (the arena alone for a gpu without stages)."""
    timeline = device_timeline(mapping, gpu, microbatches, stages, arena, sends_until_flush, swapped)
    return max((b for _, b in timeline), default=arena or 0)


def device_peaks(
    mapping: list[int],
    microbatches: int,
    stages: Sequence[StageBytes],
    arena: int | None = None,
    sends_until_flush: bool = False,
    swapped: frozenset[int] = frozenset(),
) -> list[int]:
    """D_g for every gpu 0 .. max(mapping)."""
    return [
        device_peak(mapping, g, microbatches, stages, arena, sends_until_flush, swapped)
        for g in range(max(mapping) + 1)
    ]


class _Walk:
    """Bytes held under keys, like the runtime's ledger: each key its own bytes, plus at most one share of a
    buffer several keys hold (a stage's output, held by its graph and by its message), counted once."""

    def __init__(self, arena: int | None):
        self.slots = arena is None
        """Walk the arena slot by slot (else it is held whole)."""
        self.held: dict[tuple, int] = {("arena",): arena or 0}
        self.total = arena or 0
        self.share: dict[tuple, tuple] = {}
        """key -> the buffer it holds a share of."""
        self.buffers: dict[tuple, list[int]] = {}
        """buffer -> [its bytes, how many keys hold it]."""

    def hold(self, key: tuple, n: int, shared: tuple[tuple, int] | None = None) -> None:
        """key holds n bytes of its own and, with shared = (buffer, bytes), the buffer too."""
        self.held[key] = n
        self.total += n
        if shared is not None:
            buf, nbytes = shared
            entry = self.buffers.setdefault(buf, [nbytes, 0])
            self.total += nbytes if entry[1] == 0 else 0
            entry[1] += 1
            self.share[key] = buf

    def drop(self, key: tuple) -> None:
        self.total -= self.held.pop(key)
        buf = self.share.pop(key, None)
        if buf is not None:
            entry = self.buffers[buf]
            entry[1] -= 1
            if entry[1] == 0:
                self.total -= entry[0]
                del self.buffers[buf]

    def move(self, old: tuple, new: tuple) -> None:
        """The same bytes under another key (a message handed to a stage of the same gpu)."""
        self.held[new] = self.held.pop(old)
        if old in self.share:
            self.share[new] = self.share.pop(old)

    def counted(self, buf: tuple) -> bool:
        """Whether some key holds the buffer (its bytes are in total)."""
        return buf in self.buffers


def _step(walk: _Walk, mapping: list[int], gpu: int, step: Step, stages: Sequence[StageBytes]) -> int:
    """Apply one action to the walk; the most bytes held while it ran."""
    kind, j, i = step
    s, last = stages[j], len(mapping) - 1
    if walk.slots and kind in ("L", "R", "O"):
        if kind == "L":
            walk.hold(("weights", j), s.params)
        else:
            walk.drop(("weights", j) if kind == "R" else ("grads", j))
    elif kind in ("RA", "RG") and _partner(mapping, step)[0] != gpu:
        if _inbox(step) not in walk.held:  # else posted at the receive before it
            walk.hold(_inbox(step), s.input if kind == "RA" else s.output)
    elif kind == "F":
        top = walk.total + max(0, s.held - s.input - s.held_output) + (s.output if j < last else 0)
        walk.drop(("in", j, i))
        if j < last:
            walk.hold(("out", j, i), 0, (_output(j, i), s.output))
        _hold_graph(walk, s, j, i)
        return top
    elif kind == "B":
        if walk.slots and i == 0:
            walk.hold(("grads", j), s.params)
        shares = _drop_graph(walk, j, i)  # the graph's output is still the message's (no swap between)
        top = walk.total + s.work - (s.held_output if shares and walk.counted(_output(j, i)) else 0)
        if j < last:
            walk.drop(("gin", j, i))
        if j > 0:
            walk.hold(("gout", j, i), s.input)
        return top
    elif kind == "SO":  # the copy out has ended: the held bytes leave the device (a message still holds its own)
        _drop_graph(walk, j, i)
    elif kind == "SI":  # the copy back lands in fresh device memory, until B(j, i) is done with it
        walk.hold(("held", j, i), s.held)
    elif kind in ("SA", "SG"):
        old, new = (("out", j, i), ("in", j + 1, i)) if kind == "SA" else (("gout", j, i), ("gin", j - 1, i))
        if _partner(mapping, step)[0] == gpu:
            walk.move(old, new)
        else:
            walk.drop(old)
            if kind == "SA":
                walk.hold(("sending", kind, j, i), HEADER_BYTES, (_output(j, i), s.output))
            else:
                walk.hold(("sending", kind, j, i), s.input + HEADER_BYTES)
    return walk.total


def _output(j: int, i: int) -> tuple:
    """The buffer of stage j's output for microbatch i (shared by its outbox, message, inbox and graph)."""
    return ("output", j, i)


def _drop_graph(walk: _Walk, j: int, i: int) -> bool:
    """Let (j, i)'s held bytes go; whether they included a share of its output's buffer."""
    walk.drop(("held", j, i))
    shares = ("held-output", j, i) in walk.held
    if shares:
        walk.drop(("held-output", j, i))
    return shares


def _hold_graph(walk: _Walk, s: StageBytes, j: int, i: int) -> None:
    """H_j from F(j, i): the part beyond the output under "held", the output as a share of its buffer."""
    walk.hold(("held", j, i), s.held - s.held_output)
    if s.held_output:
        walk.hold(("held-output", j, i), 0, (_output(j, i), s.output))


def _partner(mapping: Sequence[int], step: Step) -> tuple[int, Step]:
    """The other end of a message step: (its gpu, its step there)."""
    kind, j, i = step
    other = {"SA": ("RA", j + 1), "RA": ("SA", j - 1), "SG": ("RG", j - 1), "RG": ("SG", j + 1)}[kind]
    return mapping[other[1]], (other[0], other[1], i)


@functools.lru_cache(maxsize=64)
def send_releases(mapping: tuple[int, ...], gpu: int, microbatches: int) -> dict[Step | None, list[tuple]]:
    """For gpu's sends to other gpus: the message action whose comm call drops each (None: the step's end), as
    ("sending", kind, j, i) of the send's action. The runtime drops them there too where a send reports its
    completion (NCCL, the strict stand-in: mobiuspipe.runtime.engine). Swaps are no messages, so they change nothing
    here. Cached: the activation choice walks the same schedules many times (do not change what it returns)."""
    steps = {g: steps_of(list(mapping), g, microbatches) for g in sorted(set(mapping))}
    index = {g: {s: n for n, s in enumerate(st)} for g, st in steps.items()}
    mine = steps.get(gpu, [])
    remote = [n for n, s in enumerate(mine) if s[0] in ("SA", "RA", "SG", "RG") and _partner(mapping, s)[0] != gpu]
    out: dict[Step | None, list[tuple]] = {}
    for p in (n for n in remote if mine[n][0] in ("SA", "SG")):
        h, taken = _partner(mapping, mine[p])
        r = index[h][taken]
        known = next(
            (n for n in remote if n > p and mine[n][0] in ("RA", "RG") and _sent_after(mapping, index, mine[n], h, r)),
            None,
        )
        at = next((mine[n] for n in remote if known is not None and n > known), None)
        out.setdefault(at, []).append(("sending", *mine[p]))
    return out


def _sent_after(mapping: Sequence[int], index: dict, recv: Step, h: int, r: int) -> bool:
    """Whether the message `recv` takes was sent by gpu h after h's action r."""
    src, send = _partner(mapping, recv)
    return src == h and index[h][send] > r
