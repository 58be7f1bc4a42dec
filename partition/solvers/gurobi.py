"""Solve a MipModel with Gurobi (gurobipy), when it is installed and its license admits the model's size.

The pip wheel runs under a size-limited license (2000 variables, 2000 constraints; error 10010 at
optimize()); `fits_license` tells before solving, by probing once and caching the answer.
"""

from __future__ import annotations

import functools

from foundation.timing import Stopwatch
from partition.solvers import INF, MipModel, MipResult

__all__ = ["gurobi_available", "fits_license", "solve_gurobi", "SIZE_LIMIT"]

SIZE_LIMIT = 2000
"""Variables and constraints the size-limited (pip) license allows."""


@functools.lru_cache(maxsize=1)
def _license() -> str:
    """ "full", "size-limited" or "none" (not installed, or no usable license)."""
    try:
        import gurobipy as gp
    except ImportError:
        return "none"
    try:
        env = gp.Env(empty=True)
        env.setParam("OutputFlag", 0)
        env.start()
        m = gp.Model(env=env)
        m.addVars(SIZE_LIMIT + 1)
        m.optimize()
        return "full"
    except gp.GurobiError as e:
        return "size-limited" if e.errno == 10010 else "none"


def gurobi_available() -> bool:
    return _license() != "none"


def fits_license(model: MipModel) -> bool:
    lic = _license()
    return lic == "full" or (lic == "size-limited" and model.num_vars <= SIZE_LIMIT and model.num_rows <= SIZE_LIMIT)


def solve_gurobi(model: MipModel, time_limit_s: float, rel_gap: float, start: list[float] | None = None) -> MipResult:
    """Solve with Gurobi; the caller checked fits_license(model)."""
    import gurobipy as gp
    from gurobipy import GRB

    watch = Stopwatch()
    env = gp.Env(empty=True)
    env.setParam("OutputFlag", 0)
    env.start()
    m = gp.Model(env=env)
    m.Params.TimeLimit, m.Params.MIPGap, m.Params.Threads = float(time_limit_s), float(rel_gap), 1
    x = [
        m.addVar(
            lb=lo if lo != -INF else -GRB.INFINITY,
            ub=hi if hi != INF else GRB.INFINITY,
            vtype=GRB.INTEGER if integer else GRB.CONTINUOUS,
            obj=c,
        )
        for lo, hi, integer, c in zip(model.lb, model.ub, model.integer, model.cost)
    ]
    for coeffs, lo, hi in model.rows:
        expr = gp.quicksum(v * x[k] for k, v in coeffs.items())
        if lo == hi:
            m.addConstr(expr == lo)
        else:
            if lo != -INF:
                m.addConstr(expr >= lo)
            if hi != INF:
                m.addConstr(expr <= hi)
    if start is not None:
        for var, v in zip(x, start):
            var.Start = v
    m.optimize()
    name = {GRB.OPTIMAL: "optimal", GRB.TIME_LIMIT: "time_limit", GRB.INFEASIBLE: "infeasible"}.get(
        m.Status, f"status {m.Status}"
    )
    if m.SolCount == 0:
        return MipResult("gurobi", name, INF, -INF, INF, None, watch.s)
    bound, gap = (m.ObjBound, m.MIPGap) if m.IsMIP else (m.ObjVal, 0.0)  # an LP has neither attribute
    return MipResult("gurobi", name, m.ObjVal, bound, gap, tuple(v.X for v in x), watch.s)
