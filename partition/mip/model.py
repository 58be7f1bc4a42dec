"""The Mobius MIP: cut the layers into S stages (S fixed per solve) minimizing the step time T of the
aggregated timeline (partition.rules.timeline), under per-stage memory with partial prefetch, for a given mapping.

Legend (units in brackets; stage j = layers p_j .. p_{j+1}-1; the cut variables are partition.mip.cuts'):
  L, S, M     layers, stages, microbatches                                                         [-]
  Q_j         stage j's sum of a per-layer quantity, linear in the cut variables (partition.mip.cuts)
  F_j, B_j    forward and backward seconds per microbatch; f_j = F_j, b_j = F_j + B_j (recompute)   [s]
  P_j, A_j    parameter and activation bytes                                                       [GiB]
  c           = 2 O_max: the input and output buffers of any stage                                 [GiB]
  G           usable gpu memory                                                                     [GiB]
  S_F(j)      = P_j + A_j + c: memory while stage j computes its forward (weights, activations)    [GiB]
  S_B(j)      = 2 P_j + A_j + c: while it computes its backward (+ the gradients it accumulates)   [GiB]
  memory      S_B(j) <= G for every stage (S_F(j) <= S_B(j)); the paper's S <= G. Under LoRA a stage's gradients
              are its adapters' alone (G_j < P_j): the row keeps 2 P_j, stricter than the runtime's arena, and
              each solution is checked against the arena's rule (partition.search._arena_fits)
  u_j, o_j    = P_j / beta_j, P_j / link_j: load and gradient offload seconds (GiB -> bytes / 1e9)  [s]
  d_j         = O_max / peer_gbps: activation transfer to the next stage's gpu                     [s]
  TF,EF,TB,EB,LF,LB, T   the timeline variables of partition.rules.timeline, its rules as "at least" rows [s]
Partial prefetch (the paper's P <= G - S): while visit v-1 computes, the next visit v of the same gpu
prefetches what fits, min(P_v, G - S_{v-1}); the rest loads after v-1 ended, on the critical path:
  LV_v >= E_{v-1} + (P_v - (G - S_{v-1})) / beta_v        (one row, left out when P_v <= G - S_{v-1} for
                                                          every cut within bounds)
The paper's other bound, prefetch <= bandwidth x duration of v-1, is implied (partition.rules.timeline).
Objective: min T. For fixed cuts the LP optimum equals partition.rules.timeline.aggregate_step, so the MIP
optimum equals the best enumerated cut (tests check this). Rows the timeline implies are left out: a
backward visit's "after the previous visit" (its "after the previous offload" is stronger), T >= EB_j + o_j
except for each gpu's last backward visit (the offload rows chain the others to it), the resident visit's
"after its load" (it starts after the forward that used the same load); the resident backward visit
shares its load variable with its forward. Rows the variable bounds imply are never added (MipModel.row).
Bounds: every time lies in [0, T_start] where T_start is the warm start's value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from foundation.units import GiB
from partition.mip.cuts import Cuts, Lin
from partition.mip.solvers import INF, MipModel
from partition.rules.order import Visit, freed_by, gpu_visits
from partition.spec.profile import Profile

__all__ = [
    "StageData",
    "MipLayout",
    "build_mip",
    "cuts_of",
    "start_of",
    "memory_need",
    "max_layers_per_stage",
    "stage_memory",
    "GIB",
]

GIB = float(GiB)
"""Bytes enter the model in GiB, so that byte and second coefficients are of similar size (numerics)."""

Term = tuple[Lin, float]


@dataclass(frozen=True)
class StageData:
    """Per-stage constants the MIP needs for a fixed mapping: beta_j, link_j [GB/s] and d_j [s]."""

    load_gbps: tuple[float, ...]
    link_gbps: tuple[float, ...]
    comm_s: tuple[float, ...]


@dataclass(frozen=True)
class MipLayout:
    """Where the variables of a built model sit, to read a solution back or write a start."""

    cuts: Cuts
    times: dict  # ("TF", j) -> var, ..., ("T",) -> var


def memory_need(profile: Profile) -> int:
    """c of the legend, in bytes: 2 O_max (input and output buffers of any stage)."""
    return 2 * max(x.output_bytes for x in profile.layers)


def stage_memory(params: float, activations: float, phase: str) -> float:
    """S_F or S_B of the legend without c: weights (and in the backward their gradients) + activations."""
    return (1 if phase == "F" else 2) * params + activations


def max_layers_per_stage(profile: Profile, memory_bytes: int) -> int:
    """k_max: the most consecutive layers any stage can hold under the memory rule S_B(j) <= G."""
    ls, best, room = profile.layers, 1, memory_bytes - memory_need(profile)
    for a in range(len(ls)):
        p = act = 0
        for b in range(a, len(ls)):
            p, act = p + ls[b].param_bytes, act + ls[b].activation_bytes
            if stage_memory(p, act, "B") > room:
                break
            best = max(best, b - a + 1)
    return best


_Q = {
    "F": lambda x: x.fwd_s,
    "B": lambda x: x.bwd_s,
    "P": lambda x: x.param_bytes / GIB,
    "A": lambda x: x.activation_bytes / GIB,
}


def _scaled(x: Term, k: float) -> Term:
    return {i: v * k for i, v in x[0].items()}, x[1] * k


def _plus(*xs: Term) -> Term:
    lin: Lin = {}
    const = 0.0
    for x, c in xs:
        for k, v in x.items():
            lin[k] = lin.get(k, 0.0) + v
        const += c
    return lin, const


def _at_least(m: MipModel, var: int, *terms: Term) -> None:
    """var >= sum(terms)."""
    lin, const = _plus(*terms)
    row = {k: -v for k, v in lin.items()}
    row[var] = row.get(var, 0.0) + 1.0
    m.row(row, lo=const)


def _v(var: int) -> Term:
    return {var: 1.0}, 0.0


class _Stages:
    """Stage j's timeline and memory terms as linear forms of the cut variables."""

    def __init__(self, cuts: Cuts, data: StageData, room_gib: float):
        s = cuts.s
        q = {k: [cuts.stage(fn, j) for j in range(s)] for k, fn in _Q.items()}
        self.f = q["F"]
        self.b = [_plus(q["F"][j], q["B"][j]) for j in range(s)]
        self.p, self.a, self.room, self.cuts = q["P"], q["A"], room_gib, cuts
        self.u = [_scaled(self.p[j], GIB / (data.load_gbps[j] * 1e9)) for j in range(s)]
        self.off = [_scaled(self.p[j], GIB / (data.link_gbps[j] * 1e9)) for j in range(s)]
        self.d = data.comm_s
        self.load_gbps = data.load_gbps

    def used(self, j: int, phase: str) -> Term:
        """S_F(j) or S_B(j) - c [GiB]."""
        return _plus(_scaled(self.p[j], stage_memory(1.0, 0.0, phase)), self.a[j])

    def rest(self, j: int, prev: int, phase: str) -> Term:
        """(P_j - (G - S_prev)) / beta_j: the load of stage j left after visit (prev, phase) ended [s]."""
        over = _plus(self.p[j], self.used(prev, phase), ({}, -self.room))
        return _scaled(over, GIB / (self.load_gbps[j] * 1e9))


def build_mip(
    profile: Profile, mapping: list[int], microbatches: int, data: StageData, memory_bytes: int, horizon_s: float = INF
) -> tuple[MipModel, MipLayout]:
    """The model for a fixed stage count S = len(mapping); times bounded by horizon_s (a start's value)."""
    s, m = len(mapping), MipModel()
    cuts = Cuts(m, profile, s, max_layers_per_stage(profile, memory_bytes))
    st = _Stages(cuts, data, (memory_bytes - memory_need(profile)) / GIB)
    t = _time_vars(m, mapping, horizon_s)
    _stage_rows(m, st)
    _pipeline_rows(m, t, st, microbatches)
    for visits in gpu_visits(mapping).values():
        _gpu_rows(m, t, st, visits)
    return m, MipLayout(cuts, t)


def _time_vars(m: MipModel, mapping: list[int], horizon_s: float) -> dict:
    """TF..LB per stage and T; the gpu's last forward stage has one load variable for both its visits."""
    t: dict[tuple, int] = {}
    last_fwd = {max(j for j, h in enumerate(mapping) if h == g) for g in set(mapping)}
    for j in range(len(mapping)):
        for k in ("TF", "EF", "TB", "EB", "LF", "LB"):
            t[(k, j)] = t[("LF", j)] if k == "LB" and j in last_fwd else m.var(f"{k}{j}", 0.0, horizon_s)
    t[("T",)] = m.var("T", 0.0, horizon_s, cost=1.0)
    return t


def _stage_rows(m: MipModel, st: _Stages) -> None:
    """Each stage non-empty and within memory: one ranged row on its length when its memory is a multiple
    of it (both cuts in one run), else two rows."""
    for j in range(st.cuts.s):
        length, (mem, const) = st.cuts.length(j), st.used(j, "B")
        k = _ratio(mem, length[0])
        if k is not None and k > 0:
            top = math.floor((st.room - const) / k + 1e-9)
            m.row(length[0], lo=1.0 - length[1], hi=float(top))
            continue
        m.row(length[0], lo=1.0 - length[1])
        m.row(mem, hi=st.room - const)


def _ratio(a: Lin, b: Lin) -> float | None:
    """k with a = k b, or None."""
    if not b or a.keys() != b.keys():
        return None
    k = next(a[i] / b[i] for i in b)
    return k if all(math.isclose(a[i], k * b[i], rel_tol=1e-12) for i in b) else None


def _pipeline_rows(m: MipModel, t: dict, st: _Stages, mb: int) -> None:
    s = len(st.f)
    for j in range(s):
        _at_least(m, t[("EF", j)], _v(t[("TF", j)]), _scaled(st.f[j], mb))
        _at_least(m, t[("EB", j)], _v(t[("TB", j)]), _scaled(st.b[j], mb))
        if j > 0:
            _at_least(m, t[("TF", j)], _v(t[("TF", j - 1)]), st.f[j - 1], ({}, st.d[j - 1]))
            _at_least(m, t[("EF", j)], _v(t[("EF", j - 1)]), ({}, st.d[j - 1]), st.f[j])
        if j < s - 1:
            _at_least(m, t[("TB", j)], _v(t[("TB", j + 1)]), st.b[j + 1], ({}, st.d[j]))
            _at_least(m, t[("EB", j)], _v(t[("EB", j + 1)]), ({}, st.d[j]), st.b[j])


def _key(v) -> tuple[str, str, str]:
    return ("TF", "EF", "LF") if v[1] == "F" else ("TB", "EB", "LB")


def _gpu_rows(m: MipModel, t: dict, st: _Stages, visits: Sequence[Visit]) -> None:
    """Order on one gpu, its gradient slot, its copy engine, its memory and its step end."""
    for k, v in enumerate(visits):
        start, _, load = (t[(x, v[0])] for x in _key(v))
        if k == 0:
            _at_least(m, start, _v(load))
            _at_least(m, load, st.u[v[0]])
            continue
        prev = visits[k - 1]
        prev_end = t[(_key(prev)[1], prev[0])]
        if v[1] == "B" and prev[1] == "B":
            _at_least(m, start, _v(prev_end), st.off[prev[0]])
        else:
            _at_least(m, start, _v(prev_end))
        if prev[0] != v[0]:  # not the resident backward visit
            _at_least(m, start, _v(load))
            _load_rows(m, t, st, visits, k)
    last = visits[-1][0]
    _at_least(m, t[("T",)], _v(t[("EB", last)]), st.off[last])


def _load_rows(m: MipModel, t: dict, st: _Stages, visits: Sequence[Visit], k: int) -> None:
    """Visit k's load: after the previous load (copy engine), after the visit that frees its slot ended,
    and its rest after visit k-1 ended (partial prefetch)."""
    (j, _), prev = visits[k], visits[k - 1]
    load, prev_load = t[(_key(visits[k])[2], j)], t[(_key(prev)[2], prev[0])]
    _at_least(m, load, _v(prev_load), st.u[j])
    f = freed_by(list(visits), k)
    if f is not None:
        freed = visits[f]
        _at_least(m, load, _v(t[(_key(freed)[1], freed[0])]), st.u[j])
    rest = st.rest(j, prev[0], prev[1])
    if m.activity(rest[0])[1] + rest[1] > 0:  # some cut within bounds leaves a rest
        _at_least(m, load, _v(t[(_key(prev)[1], prev[0])]), rest)


def cuts_of(layout: MipLayout, x: tuple[float, ...]) -> list[int]:
    """Cut positions p_0 = 0 < p_1 < ... < p_S = L read from a solution."""
    return layout.cuts.positions(x)


def start_of(
    layout: MipLayout, cuts: list[int], model: MipModel, timeline: dict[str, list[float]], total: float
) -> list[float]:
    """A full MIP start (cut variables and timeline values) for the given cuts."""
    x = [0.0] * model.num_vars
    for cut, p in zip(layout.cuts.cuts, cuts):
        cut.start(p, x)
    for (name, *j), var in layout.times.items():
        x[var] = total if name == "T" else timeline[name][j[0]]
    return x
