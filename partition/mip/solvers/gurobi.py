"""Solve a MipModel with Gurobi (gurobipy), when it is installed and its license admits the model's size.

The pip wheel runs under a size-limited license (2000 variables, 2000 constraints; error 10010 at
optimize()); `fits_license` tells before solving, by probing once and caching the answer.
"""

from __future__ import annotations

import functools

from foundation.timing import Stopwatch
from partition.mip.solvers import INF, MipModel, MipResult

__all__ = ["gurobi_available", "fits_license", "gurobi_size", "solve_gurobi", "SIZE_LIMIT"]

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
    return lic == "full" or (lic == "size-limited" and max(gurobi_size(model)) <= SIZE_LIMIT)


def gurobi_size(model: MipModel) -> tuple[int, int]:
    """(variables, constraints) of the model as solve_gurobi hands it over: a ranged row is two constraints."""
    return model.num_vars, model.num_rows + model.num_ranged


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
    infeasible = (GRB.INFEASIBLE,) + ((GRB.INF_OR_UNBD,) if model.bounded_below else ())
    name = (
        "infeasible"
        if m.Status in infeasible
        else {GRB.OPTIMAL: "optimal", GRB.TIME_LIMIT: "time_limit"}.get(m.Status, f"status {m.Status}")
    )
    if m.SolCount == 0:
        return MipResult("gurobi", name, INF, -INF, INF, None, watch.s)
    bound, gap = (m.ObjBound, m.MIPGap) if m.IsMIP else (m.ObjVal, 0.0)  # an LP has neither attribute
    return MipResult("gurobi", name, m.ObjVal, bound, gap, tuple(v.X for v in x), watch.s)
