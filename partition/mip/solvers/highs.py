"""Solve a MipModel with HiGHS (highspy): the open solver, always available."""

from __future__ import annotations

import ctypes
import os
import sys

from foundation.timing import Stopwatch
from partition.mip.solvers import INF, MipModel, MipResult

__all__ = ["solve_highs"]


def _lp(model: MipModel, highspy):
    lp = highspy.HighsLp()
    n = model.num_vars
    lp.num_col_, lp.num_row_ = n, model.num_rows
    big = highspy.kHighsInf
    clip = lambda v: big if v == INF else (-big if v == -INF else v)  # noqa: E731
    lp.col_cost_ = list(model.cost)
    lp.col_lower_ = [clip(v) for v in model.lb]
    lp.col_upper_ = [clip(v) for v in model.ub]
    lp.row_lower_ = [clip(lo) for _, lo, _ in model.rows]
    lp.row_upper_ = [clip(hi) for _, _, hi in model.rows]
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    starts, index, value = [0], [], []
    for coeffs, _, _ in model.rows:
        for k in sorted(coeffs):
            index.append(k)
            value.append(coeffs[k])
        starts.append(len(index))
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = starts, index, value
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = n, model.num_rows
    lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in model.integer]
    return lp


_BANNER_SHOWN = False
"""Whether this process has made a Highs already (HiGHS prints its banner at the first only)."""


def _quiet_highs(highspy):
    """A silent Highs. A process's first Highs() prints HiGHS's banner on the C library's standard output, before
    it can be silenced, which would spoil a `--json` document there: that one is made with fd 1 pointed at fd 2
    (the banner goes to standard error); the later ones print nothing and are made as they are."""
    global _BANNER_SHOWN
    if _BANNER_SHOWN:
        h = highspy.Highs()
        h.silent()
        return h
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        h = highspy.Highs()
        h.silent()
        ctypes.CDLL(None).fflush(None)  # C's buffered standard output (a pipe's) is written out while it is fd 2
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    _BANNER_SHOWN = True
    return h


def solve_highs(model: MipModel, time_limit_s: float, rel_gap: float, start: list[float] | None = None) -> MipResult:
    """Solve with a time limit and a relative gap; `start` is a MIP start (ignored if infeasible)."""
    import highspy

    watch = Stopwatch()
    h = _quiet_highs(highspy)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", float(rel_gap))
    h.setOptionValue("threads", 1)
    h.passModel(_lp(model, highspy))
    if start is not None:
        sol = highspy.HighsSolution()
        sol.col_value = list(start)
        h.setSolution(sol)
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    sol = h.getSolution()
    has_x = bool(sol.value_valid) and info.primal_solution_status == 2
    name = {
        highspy.HighsModelStatus.kOptimal: "optimal",
        highspy.HighsModelStatus.kTimeLimit: "time_limit",
        highspy.HighsModelStatus.kInfeasible: "infeasible",
    }.get(status, h.modelStatusToString(status))
    obj = info.objective_function_value if has_x else INF
    lp = not any(model.integer)  # an LP has no MIP bound: its optimum is the bound
    return MipResult(
        "highs",
        name,
        obj,
        obj if lp and name == "optimal" else info.mip_dual_bound,
        0.0 if lp and name == "optimal" else (info.mip_gap if has_x else INF),
        tuple(sol.col_value) if has_x else None,
        watch.s,
    )
