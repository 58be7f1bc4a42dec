"""Timeline of one Mobius pipeline step from a plan: when each load, compute, offload and update runs.

Per gpu g the schedule runs its stages' forwards in ascending order, then their backwards in descending
order, each over microbatches i = 0..M-1. Resources and rules (times in seconds):
  compute   one stream per gpu. F(j,i) starts after F(j-1,i) arrived (+ comm), B(j,i) after B(j+1,i)
            arrived; F takes F_j, B takes F_j + B_j (the stage recomputes its forward first).
  copy      one host->gpu engine per gpu, two weight slots: the load of the k-th stage visit starts when
            the engine is free and the slot of visit k-2 is released (its last microbatch computed).
            A gpu's last forward stage stays resident into its backward (no reload).
  offload   one gpu->host engine per gpu: after B(j, M-1) the stage's gradients (P_j bytes) go to host.
            There is one gradient slot, so the next backward visit starts after that offload ended.
  update    the host CPU runs one stage's Adam at a time, after its gradients arrived.
  comm      an activation of O bytes between two gpus takes hops * O / (link GB/s * 1e9); hops = 2 when
            it is staged through host memory (no peer-to-peer), 1 otherwise.
Step time = when the last update (or the last compute) ends.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SimStage", "SimResult", "simulate"]


@dataclass(frozen=True)
class SimStage:
    """What the simulator needs of stage j (per-microbatch times, bytes, its gpu)."""

    gpu: int
    fwd_s: float
    bwd_s: float
    load_s: float
    offload_s: float
    update_s: float
    comm_s: float
    """Time to move this stage's output (or the gradient of it) to the next stage's gpu."""


@dataclass(frozen=True)
class SimResult:
    step_time_s: float
    compute_busy_s: tuple[float, ...]
    """Per gpu: seconds its compute stream is busy."""
    events: tuple[tuple[str, int, int, int, float, float], ...]
    """(kind, gpu, stage, microbatch or -1, start, end) for kind in load/F/B/offload/update."""


def _visits(stages: list[SimStage], gpu: int) -> list[tuple[int, str]]:
    mine = [j for j, s in enumerate(stages) if s.gpu == gpu]
    return [(j, "F") for j in mine] + [(j, "B") for j in reversed(mine)]


def simulate(stages: list[SimStage], num_gpus: int, microbatches: int) -> SimResult:
    """Event times of one step; raises RuntimeError if the schedule cannot make progress (a bug)."""
    done: dict[tuple[str, int, int], float] = {}
    events: list[tuple[str, int, int, int, float, float]] = []
    gpus = [_GpuState(_visits(stages, g)) for g in range(num_gpus)]
    while not all(s.finished for s in gpus):
        progressed = False
        for g, st in enumerate(gpus):
            progressed |= st.advance(g, stages, microbatches, done, events)
        if not progressed:
            raise RuntimeError("schedule deadlock in simulate(): a stage waits on one that never runs")
    host_free = 0.0
    end = max(done.values(), default=0.0)
    for kind, g, j, _, start, stop in sorted((e for e in list(events) if e[0] == "offload"), key=lambda e: e[5]):
        t0 = max(host_free, stop)
        host_free = t0 + stages[j].update_s
        events.append(("update", g, j, -1, t0, host_free))
    busy = tuple(sum(e[5] - e[4] for e in events if e[1] == g and e[0] in "FB") for g in range(num_gpus))
    return SimResult(max(end, host_free), busy, tuple(events))


class _GpuState:
    """Where one gpu is in its visit list, and when its engines and slots free up."""

    def __init__(self, visits: list[tuple[int, str]]):
        self.visits, self.k, self.i = visits, 0, 0
        self.compute_free = self.copy_free = self.offload_free = 0.0
        self.slot_free = [0.0, 0.0]
        self.slot_of: list[int] = []
        self.ready = -1.0  # when the current visit's weights are resident

    @property
    def finished(self) -> bool:
        return self.k >= len(self.visits)

    def _load(self, g: int, stages: list[SimStage], events: list) -> None:
        j, _ = self.visits[self.k]
        if self.k > 0 and self.visits[self.k - 1][0] == j:  # last forward stage stays for its backward
            self.slot_of.append(self.slot_of[-1])
            return
        slot = 0 if not self.slot_of else 1 - self.slot_of[-1]
        start = max(self.copy_free, self.slot_free[slot])
        self.copy_free = self.ready = start + stages[j].load_s
        self.slot_of.append(slot)
        events.append(("load", g, j, -1, start, self.ready))

    def advance(self, g: int, stages: list[SimStage], m: int, done: dict, events: list) -> bool:
        progressed = False
        while not self.finished:
            j, phase = self.visits[self.k]
            if self.i == 0 and len(self.slot_of) == self.k:
                self._load(g, stages, events)
            dep = ("F", j - 1, self.i) if phase == "F" else ("B", j + 1, self.i)
            if (phase == "F" and j == 0) or (phase == "B" and j == len(stages) - 1):
                dep_t = 0.0
            elif dep in done:
                dep_t = done[dep] + stages[dep[1] if phase == "F" else j].comm_s
            else:
                return progressed
            start = max(self.compute_free, self.ready, dep_t, self.offload_free if phase == "B" else 0.0)
            dur = stages[j].fwd_s if phase == "F" else stages[j].fwd_s + stages[j].bwd_s
            self.compute_free = done[(phase, j, self.i)] = start + dur
            events.append((phase, g, j, self.i, start, self.compute_free))
            progressed = True
            self.i += 1
            if self.i == m:
                self._finish_visit(g, j, phase, stages, events)
        return progressed

    def _finish_visit(self, g: int, j: int, phase: str, stages: list[SimStage], events: list) -> None:
        self.slot_free[self.slot_of[self.k]] = self.compute_free
        if phase == "B":
            t0 = max(self.offload_free, self.compute_free)
            self.offload_free = t0 + stages[j].offload_s
            events.append(("offload", g, j, -1, t0, self.offload_free))
        self.k, self.i = self.k + 1, 0
