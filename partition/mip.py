"""The Mobius MIP: cut the layers into S stages (S fixed per solve) minimizing the step time T of the
aggregated timeline (partition.timeline), under the memory rule, for a given stage -> gpu mapping.

Legend (units in brackets; stage j = layers p_j .. p_{j+1}-1):
  L, S, M     layers, stages, microbatches                                            [-]
  runs r      maximal runs of identical consecutive layers (layer-similarity compression): start a_r,
              length n_r, per-layer q_r of each quantity q, Qpre_r = sum of q over the layers before a_r
  w[c,r]      binary: cut c (c = 1..S-1, p_c = first layer of stage c) lies in run r               [-]
  o[c,r]      integer offset of cut c inside run r, 0 <= o <= (n_r - 1) w[c,r]                     [layers]
  p_c         = sum_r a_r w[c,r] + o[c,r];  p_{c+1} >= p_c + 1 (each stage non-empty, ordered)     [layers]
  Q(p_c)      = sum_r Qpre_r w[c,r] + q_r o[c,r]  (prefix sum, linear);  Q_j = Q(p_{j+1}) - Q(p_j)
  f_j = F_j, b_j = F_j + B_j                      per-microbatch forward / backward+recompute      [s]
  u_j = P_j / (beta_j 1e9), o_j = P_j / (link_j 1e9)   load and offload time; beta_j from the mapping [s]
  d_j = O_max / (peer_gbps 1e9)                    activation transfer (all boundary outputs of a transformer
                                                   are equal) [s]
  W           weight slot >= P_j;  memory: 3 W + A_j + 2 O_max <= G          [GiB inside the model]
  TF,EF,TB,EB,LF,LB, T   the timeline variables of partition.timeline, same rules as "at least" rows [s]
Objective: min T. For fixed cuts the LP optimum equals partition.timeline.aggregate_step, so the MIP
optimum equals the best enumerated cut (tests check this). Symmetry: the cut order makes each cut set
unique. Bounds: every time lies in [0, T_start] where T_start is the warm start's value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from foundation.units import GiB
from partition.costmodel import ARENA_SLOTS, WEIGHT_SLOTS
from partition.order import gpu_visits
from partition.profile import LayerProfile, Profile, compress
from partition.solvers import INF, MipModel

__all__ = ["StageData", "MipLayout", "build_mip", "cuts_of", "start_of", "memory_need", "max_layers_per_stage"]

Lin = dict  # {var index: coefficient}; the constant travels separately


@dataclass(frozen=True)
class StageData:
    """Per-stage constants the MIP needs for a fixed mapping: beta_j, link_j [GB/s] and d_j [s]."""

    load_gbps: tuple[float, ...]
    link_gbps: tuple[float, ...]
    comm_s: tuple[float, ...]


@dataclass(frozen=True)
class MipLayout:
    """Where the variables of a built model sit, to read a solution back or write a start."""

    runs: tuple[tuple[int, int], ...]  # (a_r, n_r)
    w: tuple[tuple[int, ...], ...]  # w[c-1][r]
    o: tuple[tuple[int, ...], ...]  # o[c-1][r]
    times: dict  # ("TF", j) -> var, ..., ("T",) -> var
    slot: int


def _runs(profile: Profile) -> list[tuple[int, int, LayerProfile]]:
    """(first layer a_r, length n_r, the layer) of each run of identical layers."""
    out, a = [], 0
    for layer, n in compress(profile):
        out.append((a, n, layer))
        a += n
    return out


def max_layers_per_stage(profile: Profile, memory_bytes: int) -> int:
    """k_max: the most consecutive layers any stage can hold under the memory rule (with W = its own P)."""
    ls, best = profile.layers, 1
    for a in range(len(ls)):
        p = act = 0
        for b in range(a, len(ls)):
            p, act = p + ls[b].param_bytes, act + ls[b].activation_bytes
            if ARENA_SLOTS * p + act + memory_need(profile) > memory_bytes:
                break
            best = max(best, b - a + 1)
    return best


def memory_need(profile: Profile) -> int:
    """The constant part of the MIP's memory rule: 2 O_max (input and output buffers of any stage)."""
    return 2 * max(x.output_bytes for x in profile.layers)


GIB = float(GiB)
"""Bytes enter the model in GiB, so that byte and second coefficients are of similar size (numerics)."""

_Q = {
    "F": lambda x: x.fwd_s,
    "B": lambda x: x.bwd_s,
    "P": lambda x: x.param_bytes / GIB,
    "A": lambda x: x.activation_bytes / GIB,
}


class _Builder:
    """Adds the cut variables and returns, for any quantity, stage j's value as (Lin, const)."""

    def __init__(self, model: MipModel, profile: Profile, s: int, k_max: int):
        self.m, self.s, self.L = model, s, profile.num_layers
        self.runs = _runs(profile)
        self.lo = [max(c, self.L - (s - c) * k_max) for c in range(1, s)]  # tight bounds on cut c's position
        self.hi = [min(self.L - (s - c), c * k_max) for c in range(1, s)]
        self.total = {q: sum(fn(x) for x in profile.layers) for q, fn in _Q.items()}
        self.pre = {q: [sum(fn(x) for x in profile.layers[:a]) for a, _, _ in self.runs] for q, fn in _Q.items()}
        self.w = [
            [model.var(f"w[{c},{r}]", 0, 1 if self._meets(c, r) else 0, True) for r in range(len(self.runs))]
            for c in range(1, s)
        ]
        self.o = [
            [model.var(f"o[{c},{r}]", 0, n - 1, True) for r, (_, n, _) in enumerate(self.runs)] for c in range(1, s)
        ]
        for c in range(s - 1):
            model.row({k: 1.0 for k in self.w[c]}, 1.0, 1.0)
            for r, (_, n, _) in enumerate(self.runs):
                model.row({self.o[c][r]: 1.0, self.w[c][r]: -(n - 1)}, hi=0.0)
        for c in range(s - 2):
            model.row(_sub(self._pos(c + 1), self._pos(c)), lo=1.0)
        for c in range(s - 1):
            model.row(self._pos(c), lo=float(self.lo[c]), hi=float(self.hi[c]))

    def _meets(self, c: int, r: int) -> bool:
        """Can cut c (1-based) lie in run r, given its position bounds?"""
        a, n, _ = self.runs[r]
        return a <= self.hi[c - 1] and self.lo[c - 1] <= a + n - 1

    def _pos(self, c: int) -> Lin:
        lin: Lin = {}
        for r, (a, _, _) in enumerate(self.runs):
            lin[self.w[c][r]] = float(a)
            lin[self.o[c][r]] = 1.0
        return lin

    def _prefix(self, q: str, c: int) -> tuple[Lin, float]:
        """Q(p_c) for cut index c in 0..S (0 and S are the fixed ends)."""
        if c == 0:
            return {}, 0.0
        if c == self.s:
            return {}, self.total[q]
        lin: Lin = {}
        for r, (_, _, layer) in enumerate(self.runs):
            lin[self.w[c - 1][r]] = self.pre[q][r]
            lin[self.o[c - 1][r]] = _Q[q](layer)
        return lin, 0.0

    def stage(self, q: str, j: int) -> tuple[Lin, float]:
        hi, chi = self._prefix(q, j + 1)
        lo, clo = self._prefix(q, j)
        return _sub(hi, lo), chi - clo


def _sub(a: Lin, b: Lin) -> Lin:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0.0) - v
    return out


def _scaled(x: tuple[Lin, float], k: float) -> tuple[Lin, float]:
    return {i: v * k for i, v in x[0].items()}, x[1] * k


def _plus(*xs: tuple[Lin, float]) -> tuple[Lin, float]:
    lin: Lin = {}
    const = 0.0
    for x, c in xs:
        for k, v in x.items():
            lin[k] = lin.get(k, 0.0) + v
        const += c
    return lin, const


def _at_least(m: MipModel, var: int, *terms: tuple[Lin, float]) -> None:
    """var >= sum(terms)."""
    lin, const = _plus(*terms)
    row = {k: -v for k, v in lin.items()}
    row[var] = row.get(var, 0.0) + 1.0
    m.row(row, lo=const)


def _v(var: int) -> tuple[Lin, float]:
    return {var: 1.0}, 0.0


def build_mip(
    profile: Profile, mapping: list[int], microbatches: int, data: StageData, memory_bytes: int, horizon_s: float = INF
) -> tuple[MipModel, MipLayout]:
    """The model for a fixed stage count S = len(mapping); times bounded by horizon_s (a start's value)."""
    s, m = len(mapping), MipModel()
    b = _Builder(m, profile, s, max_layers_per_stage(profile, memory_bytes))
    t: dict[tuple, int] = {
        (k, j): m.var(f"{k}{j}", 0.0, horizon_s) for k in ("TF", "EF", "TB", "EB", "LF", "LB") for j in range(s)
    }
    t[("T",)] = m.var("T", 0.0, horizon_s, cost=1.0)
    slot = m.var("W", 0.0, INF)
    f = [b.stage("F", j) for j in range(s)]
    bw = [_plus(b.stage("F", j), b.stage("B", j)) for j in range(s)]
    p = [b.stage("P", j) for j in range(s)]
    for j in range(s):
        _at_least(m, slot, p[j])
        lin, const = _plus(_scaled(_v(slot), ARENA_SLOTS), b.stage("A", j))
        m.row(lin, hi=(memory_bytes - memory_need(profile)) / GIB - const)
    _timeline_rows(m, t, f, bw, p, data, mapping, microbatches)
    layout = MipLayout(tuple((a, n) for a, n, _ in b.runs), tuple(map(tuple, b.w)), tuple(map(tuple, b.o)), t, slot)
    return m, layout


def _timeline_rows(m: MipModel, t: dict, f, bw, p, data: StageData, mapping: list[int], mb: int) -> None:
    s = len(mapping)
    u = [_scaled(p[j], GIB / (data.load_gbps[j] * 1e9)) for j in range(s)]
    off = [_scaled(p[j], GIB / (data.link_gbps[j] * 1e9)) for j in range(s)]
    d = data.comm_s
    for j in range(s):
        _at_least(m, t[("EF", j)], _v(t[("TF", j)]), _scaled(f[j], mb))
        _at_least(m, t[("EB", j)], _v(t[("TB", j)]), _scaled(bw[j], mb))
        _at_least(m, t[("T",)], _v(t[("EB", j)]), off[j])
        if j > 0:
            _at_least(m, t[("TF", j)], _v(t[("TF", j - 1)]), f[j - 1], ({}, d[j - 1]))
            _at_least(m, t[("EF", j)], _v(t[("EF", j - 1)]), ({}, d[j - 1]), f[j])
        if j < s - 1:
            _at_least(m, t[("TB", j)], _v(t[("TB", j + 1)]), bw[j + 1], ({}, d[j]))
            _at_least(m, t[("EB", j)], _v(t[("EB", j + 1)]), ({}, d[j]), bw[j])
    for visits in gpu_visits(mapping).values():
        _gpu_rows(m, t, visits, u, off)


def _gpu_rows(m: MipModel, t: dict, visits: Sequence[tuple[int, str]], u, off) -> None:
    """Order on one gpu, its gradient slot, its copy engine and its two weight slots."""
    key = lambda v: ("TF", "EF", "LF") if v[1] == "F" else ("TB", "EB", "LB")  # noqa: E731
    for k, v in enumerate(visits):
        start, _, load = (t[(x, v[0])] for x in key(v))
        _at_least(m, start, _v(load))
        if k == 0:
            _at_least(m, load, u[v[0]])
            continue
        prev = visits[k - 1]
        _, prev_end, prev_load = (t[(x, prev[0])] for x in key(prev))
        _at_least(m, start, _v(prev_end))
        if v[1] == "B" and prev[1] == "B":
            _at_least(m, start, _v(prev_end), off[prev[0]])
        if prev[0] == v[0]:  # resident: same weights as the previous visit
            m.row({load: 1.0, prev_load: -1.0}, 0.0, 0.0)
            continue
        _at_least(m, load, _v(prev_load), u[v[0]])
        if k >= WEIGHT_SLOTS:
            freed = visits[k - WEIGHT_SLOTS]  # the visit whose weight slot this load takes over
            _at_least(m, load, _v(t[(key(freed)[1], freed[0])]), u[v[0]])


def cuts_of(layout: MipLayout, x: tuple[float, ...]) -> list[int]:
    """Cut positions p_0 = 0 < p_1 < ... < p_S = L read from a solution."""
    pos = [0]
    for wc, oc in zip(layout.w, layout.o):
        pos.append(sum(round(x[wi]) * a + round(x[oi]) for wi, oi, (a, _) in zip(wc, oc, layout.runs)))
    last = layout.runs[-1]
    return pos + [last[0] + last[1]]


def start_of(
    layout: MipLayout, cuts: list[int], model: MipModel, timeline: dict[str, list[float]], slot: float, total: float
) -> list[float]:
    """A full MIP start (cut variables and timeline values) for the given cuts."""
    x = [0.0] * model.num_vars
    for c, p in enumerate(cuts[1:-1]):
        r = max(k for k, (a, _) in enumerate(layout.runs) if a <= p)
        x[layout.w[c][r]] = 1.0
        x[layout.o[c][r]] = float(p - layout.runs[r][0])
    for (name, *j), var in layout.times.items():
        x[var] = total if name == "T" else timeline[name][j[0]]
    x[layout.slot] = slot
    return x
