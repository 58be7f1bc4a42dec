"""A model of every gpu's action list running together under NCCL's point-to-point rules: the check that schedules
cannot deadlock (mobiuspipe.schedule.check) and the choice of receives posted ahead (mobiuspipe.schedule.ahead) run it.

Rules: a rank posts a send and goes on, but the send completes only when the peer's matching receive is posted; the
operations a rank posts on one channel (mobiuspipe.runtime.peers.channels: "pair", both ways of a pair on one queue, or
"direction") run in post order, so an operation starts only at the head of its queue; a receive blocks its rank until
it completes; every send completes before the step ends (Comm.flush). Messages between stages of one gpu are handed
over. A receive posted ahead (NcclRun's `early`) blocks its rank from the action after the one that posted it, until
it completes: CUDA may synchronize the whole device at any call (cudaFree when the caching allocator retries, a pinned
allocation), and that waits for NCCL's receive kernel, which waits for its sender.
"""

from __future__ import annotations

from mobiuspipe.schedule.actions import Action, Kind

__all__ = ["NcclRun", "PEER", "Message", "sender", "is_receive"]

Message = tuple[Kind, int, int]
"""A message by the send that carries it: (SEND_ACT or SEND_GRAD, the sending stage, the microbatch)."""
PEER = {Kind.SEND_ACT: (Kind.RECV_ACT, +1), Kind.SEND_GRAD: (Kind.RECV_GRAD, -1)}
"""A send's kind -> the kind of its receive, and the receiving stage's offset from the sender."""


def is_receive(a: Action) -> bool:
    return a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD)


def sender(a: Action) -> Message:
    """The message a receive takes."""
    if a.kind is Kind.RECV_ACT:
        return (Kind.SEND_ACT, a.stage - 1, a.microbatch)
    return (Kind.SEND_GRAD, a.stage + 1, a.microbatch)


class NcclRun:
    """Every gpu's list run together (the module's rules): each gpu's next action, its posted operations per
    channel, what arrived. Drive it with `while run.post() | run.match(): ...`; `finished` says whether it ran to
    the end."""

    def __init__(
        self,
        mapping: list[int],
        schedules: list[list[Action]],
        channels: str,
        early: list[dict[int, int]] | None = None,
    ):
        """early: per gpu, the index of a receive -> the index of the receive it posts once it has arrived (ahead
        of that receive's own action); drop_early() takes such a post back."""
        self.mapping, self.schedules, self.channels = mapping, schedules, channels
        self.early = early if early is not None else [{} for _ in schedules]
        self.pc = [0] * len(schedules)
        self.queues: dict[tuple[int, object], list[tuple[bool, Message, int]]] = {}
        """(gpu, channel) -> [(is a send, the message, the peer)], oldest first."""
        self.arrived: set[Message] = set()
        self._posted: set[tuple[int, int]] = set()  # (gpu, action index) of receives already posted
        self._pending: list[tuple[int, int] | None] = [None] * len(schedules)
        """Per gpu: (the receive that posted one ahead, that one) while the gpu waits for it."""

    @property
    def finished(self) -> bool:
        return all(self.pc[g] == len(acts) for g, acts in enumerate(self.schedules)) and not any(self.queues.values())

    def _channel(self, src: int, dst: int) -> object:
        return frozenset((src, dst)) if self.channels == "pair" else (src, dst)

    def post(self) -> bool:
        """Run each gpu's list until it waits on a receive that has not completed; whether any moved."""
        moved = False
        for g, acts in enumerate(self.schedules):
            while self.pc[g] < len(acts):
                if (pending := self._pending[g]) is not None:
                    if sender(acts[pending[1]]) not in self.arrived:
                        break
                    self._pending[g] = None
                a = acts[self.pc[g]]
                if a.kind in PEER:
                    msg, peer = (a.kind, a.stage, a.microbatch), self.mapping[a.stage + PEER[a.kind][1]]
                    self._post(g, peer, True, msg)
                elif is_receive(a):
                    self._post_receive(g, self.pc[g])
                    if sender(a) not in self.arrived:
                        break
                    if (ahead := self.early[g].get(self.pc[g])) is not None:
                        self._post_receive(g, ahead)
                        self._pending[g] = (self.pc[g], ahead)
                self.pc[g] += 1
                moved = True
        return moved

    def _post_receive(self, g: int, k: int) -> None:
        if (g, k) not in self._posted:
            self._posted.add((g, k))
            msg = sender(self.schedules[g][k])
            self._post(g, self.mapping[msg[1]], False, msg)

    def _post(self, g: int, peer: int, send: bool, msg: Message) -> None:
        if peer == g:  # handed over on the gpu
            if send:
                self.arrived.add(msg)
            return
        ch = self._channel(g, peer) if send else self._channel(peer, g)
        self.queues.setdefault((g, ch), []).append((send, msg, peer))

    def match(self) -> bool:
        """Complete every send and receive that head their two queues together; whether any did."""
        done = False
        for (_, ch), q in self.queues.items():
            while q and q[0][0]:
                _, msg, h = q[0]
                other = self.queues.get((h, ch), [])
                if not other or other[0][0] or other[0][1] != msg:
                    break
                q.pop(0)
                other.pop(0)
                self.arrived.add(msg)
                done = True
        return done

    def drop_early(self) -> bool:
        """Take back one receive posted ahead that a stuck gpu waits for: it is posted at its own action instead (its
        queue entry goes: it has not arrived, so it held nothing up). One that moves to another stage or direction
        goes first (a stream of one stage's microbatches is the overlap worth keeping), then the lowest gpu's.
        Whether one was taken back."""
        stuck = [(g, p) for g, p in enumerate(self._pending) if p is not None]
        if not stuck:
            return False
        g, (first, ahead) = min(stuck, key=lambda gp: (self._streams(gp[0], *gp[1]), gp[0]))
        msg = sender(self.schedules[g][ahead])
        peer = self.mapping[msg[1]]
        self.queues[(g, self._channel(peer, g))].remove((False, msg, peer))
        self._posted.discard((g, ahead))
        del self.early[g][first]
        self._pending[g] = None
        return True

    def _streams(self, g: int, first: int, ahead: int) -> bool:
        """Whether a post ahead takes the next microbatch of the same stage and direction."""
        a, b = self.schedules[g][first], self.schedules[g][ahead]
        return (a.kind, a.stage) == (b.kind, b.stage)

    def stuck(self) -> str:
        """Where each unfinished gpu waits, and the heads of its queues."""
        out = []
        for g, acts in enumerate(self.schedules):
            heads = [
                f"{'send' if q[0][0] else 'receive'} {_name(q[0][1])} {'to' if q[0][0] else 'from'} gpu {q[0][2]}"
                for (h, _), q in self.queues.items()
                if h == g and q
            ]
            if self.pc[g] < len(acts) or heads:
                at = str(acts[self.pc[g]]) if self.pc[g] < len(acts) else "the end of the step"
                if (pending := self._pending[g]) is not None:
                    at += f" (after {acts[pending[0]]}, for {acts[pending[1]]} posted ahead)"
                out.append(f"gpu {g} waits at {at}, its queues start with [{'; '.join(heads)}]")
        return "; ".join(out)


def _name(msg: Message) -> str:
    return str(Action(*msg))
