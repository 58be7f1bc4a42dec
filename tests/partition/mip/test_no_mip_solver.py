"""Without highspy and gurobipy the planner falls back to the DP and says so in one line, instead of failing deep
in a solver import; with a solver installed nothing changes."""

from __future__ import annotations

import importlib.util

import pytest

from partition.mip.solvers import NO_MIP, _say_no_mip
from partition.search import make_plan
from partition.spec.analytic import analytic_profile
from partition.spec.hardware import device_spec
from partition.spec.models import ModelSpec
from topology.presets import cpu_standin

SMALL = ModelSpec("small", 4, 64, 4, 32, 256)


def _plan(solver: str):
    prof = analytic_profile(SMALL, device_spec("cpu-standin"), microbatch_size=2)
    return make_plan(prof, cpu_standin(2, 64 << 20), 4, num_stages=4, solver=solver)


def test_no_mip_solver_plans_with_the_dp_and_says_so_once(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n in ("highspy", "gurobipy") else real(n, *a)
    )
    _say_no_mip.cache_clear()
    plans = [_plan("auto"), _plan("highs")]
    assert all(p.solver.name == "dp" and p.solver.status == f"optimal; {NO_MIP}" for p in plans)
    assert [p.stages for p in plans] == [_plan("dp").stages] * 2
    err = capsys.readouterr().err
    assert err == f"mobiuspipe: {NO_MIP}\n"


@pytest.mark.mip
def test_with_a_solver_the_mip_runs():
    assert importlib.util.find_spec("highspy") is not None  # setup.sh installs it
    assert _plan("auto").solver.name != "dp"
