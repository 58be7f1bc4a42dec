"""The cut variables of the Mobius MIP (partition.mip.model): where each stage starts, and any stage sum as a
linear form.

Legend (units in brackets; stage j = layers p_j .. p_{j+1}-1, p_0 = 0, p_S = L):
  runs r      maximal runs of identical consecutive layers (layer-similarity compression): first layer a_r,
              length n_r, per-layer value q_r of a quantity q, Qpre_r = sum of q over the layers before a_r
  lo_c, hi_c  bounds on cut c implied by the stage count and k_max (the most layers a stage can hold):
              lo_c = max(c, L - (S-c) k_max),  hi_c = min(L - (S-c), c k_max)                     [layers]
  Q(p)        = sum of q over layers 0..p-1, linear on every closed run segment [a_r, a_r + n_r]:
              Q(p) = Qpre_r + q_r (p - a_r)
Encodings of cut c (the cheapest that is exact):
  fixed       lo_c = hi_c: p_c is a constant, no variable
  one run     [lo_c, hi_c] lies in one closed segment r: p_c integer in [lo_c, hi_c], Q(p_c) linear in it
  runs        otherwise: binary w[c,r] (the cut lies in run r) for the runs [lo_c, hi_c] meets, integer
              offset o[c,r] in [0, hi_r] with o[c,r] <= hi_r w[c,r], sum_r w[c,r] = 1;
              p_c = sum_r a_r w[c,r] + o[c,r], Q(p_c) = sum_r Qpre_r w[c,r] + q_r o[c,r]
A stage sum Q_j = Q(p_{j+1}) - Q(p_j); with both cuts in one segment it is q_r (p_{j+1} - p_j).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from partition.mip.solvers import MipModel
from partition.spec.profile import LayerProfile, Profile, compress

__all__ = ["Lin", "Cut", "Cuts", "runs_of"]

Lin = dict  # {var index: coefficient}; the constant travels separately
Quantity = Callable[[LayerProfile], float]


def runs_of(profile: Profile) -> list[tuple[int, int, LayerProfile]]:
    """(first layer a_r, length n_r, the layer) of each run of identical layers."""
    out, a = [], 0
    for layer, n in compress(profile):
        out.append((a, n, layer))
        a += n
    return out


@dataclass(frozen=True)
class Cut:
    """Cut c's encoding (legend): a constant, one integer variable p, or per run it can meet (a_r, w[c,r],
    o[c,r] or None when the offset can only be 0, its upper bound hi_r)."""

    const: int | None = None
    p: int | None = None
    runs: tuple[tuple[int, int, int | None, int], ...] = ()

    def pos(self) -> tuple[Lin, float]:
        """p_c as a linear form."""
        if self.const is not None:
            return {}, float(self.const)
        if self.p is not None:
            return {self.p: 1.0}, 0.0
        lin: Lin = {}
        for a, w, o, _ in self.runs:
            lin[w] = float(a)
            if o is not None:
                lin[o] = 1.0
        return lin, 0.0

    def value(self, x: tuple[float, ...]) -> int:
        lin, const = self.pos()
        return round(const + sum(v * x[k] for k, v in lin.items()))

    def start(self, p: int, x: list[float]) -> None:
        """Write position p into a start vector x."""
        if self.p is not None:
            x[self.p] = float(p)
        for a, w, o, top in self.runs:
            if a <= p <= a + top:
                x[w] = 1.0
                if o is not None:
                    x[o] = float(p - a)
                return


class Cuts:
    """Adds the cut variables of S stages to a model; gives any stage sum as (Lin, const)."""

    def __init__(self, model: MipModel, profile: Profile, s: int, k_max: int):
        self.m, self.s, self.L = model, s, profile.num_layers
        self.runs = runs_of(profile)
        self.lo = [0] + [max(c, self.L - (s - c) * k_max) for c in range(1, s)] + [self.L]
        self.hi = [0] + [min(self.L - (s - c), c * k_max) for c in range(1, s)] + [self.L]
        self.cuts = [self._cut(c) for c in range(s + 1)]

    def _cut(self, c: int) -> Cut:
        lo, hi = self.lo[c], self.hi[c]
        if lo >= hi:
            return Cut(const=lo)
        if any(a <= lo and hi <= a + n for a, n, _ in self.runs):
            return Cut(p=self.m.var(f"p[{c}]", lo, hi, True))
        return self._run_choice(c, lo, hi)

    def _run_choice(self, c: int, lo: int, hi: int) -> Cut:
        runs = []
        for r, (a, n, _) in enumerate(self.runs):
            if a > hi or a + n - 1 < lo:
                continue
            w = self.m.var(f"w[{c},{r}]", 0, 1, True)
            top = min(n - 1, hi - a)
            o = self.m.var(f"o[{c},{r}]", 0, top, True) if top > 0 else None
            if o is not None:
                self.m.row({o: 1.0, w: -float(top)}, hi=0.0)
            runs.append((a, w, o, top))
        self.m.row({w: 1.0 for _, w, _, _ in runs}, 1.0, 1.0)
        return Cut(runs=tuple(runs))

    def prefix(self, q: Quantity, c: int) -> tuple[Lin, float]:
        """Q(p_c) for c in 0..S."""
        cut = self.cuts[c]
        if cut.const is not None:
            return {}, sum(q(x) for a, n, x in self.runs for _ in range(max(0, min(n, cut.const - a))))
        if cut.p is not None:
            a, n, x = next(r for r in self.runs if r[0] <= self.lo[c] and self.hi[c] <= r[0] + r[1])
            return {cut.p: q(x)}, self._pre(q, a) - q(x) * a
        lin: Lin = {}
        layer = {a: x for a, _, x in self.runs}
        for a, w, o, _ in cut.runs:
            lin[w] = self._pre(q, a)
            if o is not None:
                lin[o] = q(layer[a])
        return lin, 0.0

    def _pre(self, q: Quantity, a: int) -> float:
        """Qpre of the run starting at layer a."""
        return sum(q(x) * n for b, n, x in self.runs if b < a)

    def stage(self, q: Quantity, j: int) -> tuple[Lin, float]:
        """Q_j = Q(p_{j+1}) - Q(p_j)."""
        (hi, chi), (lo, clo) = self.prefix(q, j + 1), self.prefix(q, j)
        out = dict(hi)
        for k, v in lo.items():
            out[k] = out.get(k, 0.0) - v
        return {k: v for k, v in out.items() if v != 0.0}, chi - clo

    def length(self, j: int) -> tuple[Lin, float]:
        """p_{j+1} - p_j: stage j's layer count."""
        return self.stage(lambda x: 1.0, j)

    def positions(self, x: tuple[float, ...]) -> list[int]:
        return [cut.value(x) for cut in self.cuts]
