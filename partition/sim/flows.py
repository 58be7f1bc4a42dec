"""The simulator's machinery: fluid flows on shared links (FlowNet) and a graph of tasks that start when their
dependencies end (TaskGraph); partition.sim.simulate and partition.report.baselines build their steps from them."""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

__all__ = ["Link", "FlowNet", "TaskGraph"]

Link = tuple[str, str]
"""(link name, direction): ("gpu0", "h2d"), ("sw0", "d2h"), ("rc1", "h2d"), ("nvlink 0-1", "p2p")."""


class FlowNet:
    """Fluid flows on shared links: each moves at min over its path of link GB/s / flows on that link."""

    def __init__(self, caps: dict[Link, float]):
        self.caps = dict(caps)
        self.now = 0.0
        self._flows: dict[Hashable, list] = {}  # id -> [bytes left, path, rate in bytes/s]

    def start(self, fid: Hashable, nbytes: float, path: tuple[Link, ...]) -> None:
        """A flow of nbytes > 0 starts now over path."""
        self._flows[fid] = [float(nbytes), tuple(path), 0.0]
        self._rates()

    def rate_gbps(self, fid: Hashable) -> float:
        return self._flows[fid][2] / 1e9

    def _rates(self) -> None:
        count = Counter(link for f in self._flows.values() for link in f[1])
        for f in self._flows.values():
            f[2] = min(self.caps[link] / count[link] for link in f[1]) * 1e9

    def next_end(self) -> float:
        """When the first active flow ends at the current rates (inf when none is active)."""
        return min((self.now + f[0] / f[2] for f in self._flows.values()), default=math.inf)

    def advance(self, t: float) -> list[Hashable]:
        """Move every flow on to time t (no later than next_end()); the ids of the flows that end at t."""
        dt, tol = t - self.now, 1e-12 * max(1.0, abs(t))
        done = [fid for fid, f in self._flows.items() if self.now + f[0] / f[2] <= t + tol]
        for f in self._flows.values():
            f[0] -= f[2] * dt
        for fid in done:
            del self._flows[fid]
        self.now = t
        if done:
            self._rates()
        return done


@dataclass
class _Task:
    deps: tuple[Hashable, ...]
    dur: float
    flows: tuple[tuple[float, tuple[Link, ...]], ...]
    start: float = math.nan
    end: float = math.nan


class TaskGraph:
    """Tasks that start when all their dependencies ended; each lasts a fixed time or until its flows end."""

    def __init__(self, net: FlowNet | None = None):
        self.net = net
        self.tasks: dict[Hashable, _Task] = {}

    def add(
        self,
        key: Hashable,
        deps: Iterable[Hashable] = (),
        dur: float = 0.0,
        flows: Iterable[tuple[float, tuple[Link, ...]]] = (),
    ) -> Hashable:
        """A task; with flows (and a FlowNet) it ends when the last of its flows with bytes > 0 ended."""
        self.tasks[key] = _Task(tuple(d for d in deps if d is not None), dur, tuple(flows))
        return key

    def run(self) -> dict[Hashable, _Task]:
        """Times every task; RuntimeError (a bug in the caller's graph) when some task can never start."""
        waiting = {k: len(t.deps) for k, t in self.tasks.items()}
        users: dict[Hashable, list[Hashable]] = {}
        for k, t in self.tasks.items():
            for d in t.deps:
                users.setdefault(d, []).append(k)
        self._timers: list[tuple[float, int, Hashable]] = []
        self._open: dict[Hashable, int] = {}
        self._seq = 0
        for k in [k for k, n in waiting.items() if n == 0]:
            self._start(k, 0.0)
        while True:
            t = min(self._timers[0][0] if self._timers else math.inf, self.net.next_end() if self.net else math.inf)
            if t == math.inf:
                break
            ended = [(_task_of(fid), fid) for fid in self.net.advance(t)] if self.net else []
            while self._timers and self._timers[0][0] <= t:
                ended.append((heapq.heappop(self._timers)[2], None))
            for k, fid in ended:
                if fid is not None:
                    self._open[k] -= 1
                    if self._open[k]:
                        continue
                self.tasks[k].end = t
                for u in users.get(k, ()):
                    waiting[u] -= 1
                    if waiting[u] == 0:
                        self._start(u, t)
        stuck = [k for k, t in self.tasks.items() if math.isnan(t.end)]
        if stuck:
            raise RuntimeError(
                f"schedule deadlock in simulate(): {len(stuck)} tasks wait on ones that never run, first {stuck[0]!r}"
            )
        return self.tasks

    def _start(self, k: Hashable, now: float) -> None:
        """Start task k now: its flows on the FlowNet, or a timer (a transfer of 0 bytes ends at once)."""
        task = self.tasks[k]
        task.start, dur = now, task.dur
        if self.net is not None and task.flows:
            live = [(b, p) for b, p in task.flows if b > 0]
            for n, (b, p) in enumerate(live):
                self.net.start((k, n), b, p)
            self._open[k] = len(live)
            if live:
                return
            dur = 0.0
        self._seq += 1
        heapq.heappush(self._timers, (now + dur, self._seq, k))


def _task_of(fid: Hashable) -> Hashable:
    """The task a flow belongs to: flows are named (task key, flow number) by TaskGraph."""
    if not isinstance(fid, tuple):
        raise TypeError(f"flow id {fid!r} is not a (task, number) pair")
    return fid[0]
