"""The aggregated step timeline the MIP optimizes, evaluated directly for fixed cuts (its exact oracle).

Legend (stage j, per ONE microbatch unless marked; seconds unless marked):
  M        microbatches per step
  f_j      forward time                         b_j  backward time incl. the recomputed forward (F_j + B_j)
  u_j      weight load time  = P_j / beta_j     o_j  gradient offload time = P_j / link_j
  d_j      time to send stage j's output (or its gradient) to stage j+1's gpu
  TF_j,EF_j  start of stage j's first forward microbatch, end of its last one
  TB_j,EB_j  the same for the backward
  LF_j,LB_j  when stage j's weights are resident for its forward / backward visit
  r_j      host->gpu rate of stage j's loads = beta_j 1e9                                  [bytes/s]
  free_v   memory free while visit v computes = G - S_v, S_F(j) = P_j + A_j, S_B(j) = 2 P_j + A_j
           (weights, and in the backward their gradients, + activations and buffers)     [bytes]
Each gpu runs its visits F(j0) .. F(jk), B(jk) .. B(j0) (partition.rules.order). Rules, all "at least":
  pipeline   TF_j >= TF_{j-1} + f_{j-1} + d_{j-1};   EF_j >= TF_j + M f_j;   EF_j >= EF_{j-1} + d_{j-1} + f_j
             TB_j >= TB_{j+1} + b_{j+1} + d_j;      EB_j >= TB_j + M b_j;   EB_j >= EB_{j+1} + d_j + b_j
  gpu        a visit starts after the gpu's previous visit ended; a backward visit also after the previous
             backward visit's offload (one gradient slot)
  weights    a visit starts after its load ended; the load of visit v starts after the load of visit v-1
             (one copy engine) and after the visit before the previous load ended (two weight slots; that
             is visit v-2, or v-3 right after the resident backward visit, partition.rules.order.freed_by):
             LV_v >= max(LV_{v-1}, E_{freed}) + u_v, as the runtime (and partition.sim.simulate) orders loads.
             It prefetches X_v = min(P_v, free_{v-1}) bytes while visit v-1 computes, and loads the rest
             after visit v-1 ended: LV_v >= E_{v-1} + (P_v - free_{v-1}) / r_v (the Mobius paper's
             partial prefetch, P <= G - S; its other bound P <= B D is implied: bytes prefetched beyond
             what fits in visit v-1 only move the same load earlier, the two rows give the same LV_v).
             When the whole stage fits (free_{v-1} >= P_v) that row lies before E_{v-1} and binds nothing.
             The gpu's last forward stage stays resident for its backward (no load)
  step       T >= EB_j + o_j for every j
This is exact for a pipeline of identical microbatches (the classic flow-shop recurrence) and an
approximation when a gpu's visit is delayed mid-stream; partition.sim.simulate times every microbatch. The
runtime fuses the last stage (its forward inside its backward, each microbatch as it arrives: partition.rules
.order); the aggregate keeps its forward visit (f_j) ahead of its backward visit, an upper bound of that.
"""

from __future__ import annotations

from dataclasses import dataclass

from partition.rules.order import freed_by, gpu_visits

__all__ = ["StageTimes", "aggregate_step", "aggregate_times"]


@dataclass(frozen=True)
class StageTimes:
    """f, b, u, o, d of one stage (see the legend)."""

    f: float
    b: float
    u: float
    o: float
    d: float
    rate: float = float("inf")
    """r_j: bytes per second of its loads (with u = P_j / r_j); inf with free_* inf: whole-stage prefetch."""
    free_f: float = float("inf")
    """free_v of its forward visit [bytes]: what the next visit on its gpu can prefetch meanwhile."""
    free_b: float = float("inf")
    """free_v of its backward visit [bytes]."""


def aggregate_step(st: list[StageTimes], mapping: list[int], m: int) -> float:
    """T of the legend for fixed stage times: the longest path through the rules."""
    return aggregate_times(st, mapping, m)[0]


def aggregate_times(st: list[StageTimes], mapping: list[int], m: int) -> tuple[float, dict[str, list[float]]]:
    """T and every timeline value of the legend (TF, EF, TB, EB, LF, LB; lists by stage)."""
    s = len(st)
    start: dict[tuple[str, int], float] = {}
    end: dict[tuple[str, int], float] = {}
    loaded: dict[tuple[str, int], float] = {}
    ready = _loads(st, mapping, end, loaded)
    for j in range(s):  # forwards, ascending
        t = ready(("F", j))
        if j > 0:
            t = max(t, start[("F", j - 1)] + st[j - 1].f + st[j - 1].d)
        start[("F", j)] = t
        end[("F", j)] = max(t + m * st[j].f, end[("F", j - 1)] + st[j - 1].d + st[j].f if j > 0 else 0.0)
    for j in reversed(range(s)):  # backwards, descending
        t = ready(("B", j))
        if j < s - 1:
            t = max(t, start[("B", j + 1)] + st[j + 1].b + st[j].d)
        start[("B", j)] = t
        end[("B", j)] = max(t + m * st[j].b, end[("B", j + 1)] + st[j].d + st[j].b if j < s - 1 else 0.0)
    total = max(end[("B", j)] + st[j].o for j in range(s))
    values = {
        f"{kind}{ph}": [src[(ph, j)] for j in range(s)]
        for kind, src in (("T", start), ("E", end), ("L", loaded))
        for ph in "FB"
    }
    return total, values


def _loads(st: list[StageTimes], mapping: list[int], end: dict, load_end: dict):
    """ready(visit) -> earliest start allowed by the gpu order, the gradient slot and the weight loads.

    Visits are asked for in an order where every visit before them on their gpu is already timed."""
    order = gpu_visits(mapping)
    position = {(ph, j): (g, k) for g, vs in order.items() for k, (j, ph) in enumerate(vs)}

    def ready(v: tuple[str, int]) -> float:
        g, k = position[v]
        vs = [(ph, j) for j, ph in order[g]]
        prev = vs[k - 1] if k > 0 else None
        t = end[prev] if prev else 0.0
        if v[0] == "B" and prev and prev[0] == "B":
            t = max(t, end[prev] + st[prev[1]].o)
        if prev and prev[1] == v[1]:  # last forward stage stays resident
            load_end[v] = load_end[prev]
        else:
            copy_free = load_end[prev] if prev else 0.0
            freed = freed_by(order[g], k)
            slot_free = end[vs[freed]] if freed is not None else 0.0
            load_end[v] = max(copy_free, slot_free) + st[v[1]].u
            if prev:
                load_end[v] = max(load_end[v], end[prev] + _rest(st[prev[1]], prev[0], st[v[1]]))
        return max(t, load_end[v])

    return ready


def _rest(cur: StageTimes, phase: str, nxt: StageTimes) -> float:
    """(P_next - free_cur) / r_next: how long the part of the next stage that does not fit while the current
    visit computes takes to load after it (negative when all of it fits; -inf when memory is not modelled)."""
    free = cur.free_f if phase == "F" else cur.free_b
    if free == float("inf"):
        return -float("inf")
    return nxt.u - free / nxt.rate
