"""Solver-neutral MIP container and the adapters that solve it (HiGHS, Gurobi)."""

from __future__ import annotations

import functools
import importlib.util
import math
import sys
from dataclasses import dataclass, field

__all__ = ["MipModel", "MipResult", "INF", "mip_installed", "NO_MIP"]

NO_MIP = (
    "no MIP solver is installed (neither highspy nor gurobipy): planned with the DP alone, whose cuts are exact "
    "for each stage count; `pip install highspy` (or gurobipy) for the MIP's search"
)

INF = math.inf


@dataclass
class MipModel:
    """min cost . x  s.t.  lo <= A x <= hi, lb <= x <= ub, some x integer. Rows are sparse dicts; a row
    that the bounds imply is never added (so the row count is what a solver gets)."""

    names: list[str] = field(default_factory=list)
    lb: list[float] = field(default_factory=list)
    ub: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    cost: list[float] = field(default_factory=list)
    rows: list[tuple[dict[int, float], float, float]] = field(default_factory=list)

    def var(self, name: str, lb: float = 0.0, ub: float = INF, integer: bool = False, cost: float = 0.0) -> int:
        self.names.append(name)
        self.lb.append(lb)
        self.ub.append(ub)
        self.integer.append(integer)
        self.cost.append(cost)
        return len(self.names) - 1

    def row(self, coeffs: dict[int, float], lo: float = -INF, hi: float = INF) -> None:
        """Add lo <= coeffs . x <= hi, unless the variables' bounds already imply it (then it is left out)."""
        coeffs = {k: v for k, v in coeffs.items() if v != 0.0}
        least, most = self.activity(coeffs)
        if lo <= least and most <= hi:
            return
        self.rows.append((coeffs, lo, hi))

    def activity(self, coeffs: dict[int, float]) -> tuple[float, float]:
        """The least and the largest value coeffs . x takes within the variables' bounds."""
        least = most = 0.0
        for k, v in coeffs.items():
            a, b = v * self.lb[k], v * self.ub[k]
            least, most = least + min(a, b), most + max(a, b)
        return least, most

    @property
    def num_vars(self) -> int:
        return len(self.names)

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def num_ranged(self) -> int:
        """Rows with two different finite sides (a solver without ranged rows takes each as two)."""
        return sum(1 for _, lo, hi in self.rows if -INF < lo < hi < INF)

    @property
    def bounded_below(self) -> bool:
        """True when the objective cannot go to -inf (every cost >= 0 on a variable bounded below)."""
        return all(c >= 0 and lo > -INF for c, lo in zip(self.cost, self.lb) if c != 0)


@dataclass(frozen=True)
class MipResult:
    """How a solve ended. x is None when no feasible point was found."""

    solver: str
    status: str
    """"optimal", "time_limit" (x is the incumbent), "infeasible", or the solver's own words."""
    objective: float
    bound: float
    gap: float
    x: tuple[float, ...] | None
    wall_s: float
    note: str = ""
    """Why another solver than the one asked for ran, if one did."""


def mip_installed() -> bool:
    """Whether a MIP solver (highspy, or gurobipy) can be imported; when not, NO_MIP is printed once to stderr."""
    found = any(importlib.util.find_spec(name) is not None for name in ("highspy", "gurobipy"))
    if not found:
        _say_no_mip()
    return found


@functools.cache
def _say_no_mip() -> None:
    print(f"mobiuspipe: {NO_MIP}", file=sys.stderr, flush=True)
