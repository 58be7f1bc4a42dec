"""The MIP over several stage counts: one solve per S, each cut off at the best T found so far, one gap for all.

Legend: z_S, b_S = the objective and proven lower bound of the solve for S stages (partition.mip.solve);
z* = min_S z_S. Stage counts are solved in the order given (the DP's best first); the solve for S searches
only T <= (1 - g/2) z* (g the relative gap asked for; half of it, so that proving the cutoff stays cheap
and the search's gap below g), so a count that cannot beat the best by more than that ends early with
status "cutoff" and b_S = the cutoff. The gap of the whole search is
(z* - min_S b_S) / z*: the best T over the counts solved is within it of the best T any cut into any of
them has. Over every S from N to L (counts=all) this is the exhaustive optimum over every S and every cut
(tests check it against enumeration); the planner (partition.search) solves the DP's best few counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from foundation.timing import Stopwatch
from partition.mip.model import StageData
from partition.mip.solve import StageCountSolution, solve_stage_count
from partition.mip.solvers import INF
from partition.spec.profile import Profile

__all__ = ["CountCandidate", "CountsResult", "solve_counts"]


@dataclass(frozen=True)
class CountCandidate:
    """One stage count to solve: its mapping, the MIP's stage data for it and a start cut (or None)."""

    mapping: list[int]
    data: StageData
    start_cuts: list[int] | None


@dataclass(frozen=True)
class CountsResult:
    solutions: list[StageCountSolution]
    """One per candidate, in the order given."""
    best: float
    """z*: the least T found (inf when none)."""
    gap: float
    """(z* - min_S b_S) / z*, inf without a solution."""

    @property
    def status(self) -> str:
        """ "optimal" when every count was solved to the gap, cut off or proven infeasible, else the statuses
        joined."""
        got = {s.result.status for s in self.solutions}
        return "optimal" if got <= {"optimal", "cutoff", "infeasible"} and self.best < INF else "+".join(sorted(got))

    @property
    def size(self) -> tuple[int, int]:
        """(variables, constraints) of the largest model solved."""
        sizes = [(s.num_vars, s.num_rows) for s in self.solutions]
        return max((v for v, _ in sizes), default=0), max((r for _, r in sizes), default=0)


def solve_counts(
    profile: Profile,
    candidates: list[CountCandidate],
    microbatches: int,
    memory_bytes: int,
    solver: str = "auto",
    time_limit_s: float = 2.0,
    gap: float = 0.01,
) -> CountsResult:
    """Solve each candidate within time_limit_s in all (the time left is shared by the counts left)."""
    out: list[StageCountSolution] = []
    best, watch = INF, Stopwatch()
    for k, c in enumerate(candidates):
        left = max(0.05, time_limit_s - watch.s) / (len(candidates) - k)
        cutoff = best * (1 - gap / 2) if best < INF else INF
        sol = solve_stage_count(
            profile, c.mapping, microbatches, c.data, memory_bytes, c.start_cuts, solver, left, gap, cutoff
        )
        out.append(sol)
        if sol.cuts is not None:
            best = min(best, sol.result.objective)
    return CountsResult(out, best, _gap(best, min((s.bound for s in out), default=-INF)))


def _gap(best: float, bound: float) -> float:
    if best == INF:
        return INF
    return max(0.0, (best - bound) / best) if best > 0 else 0.0
