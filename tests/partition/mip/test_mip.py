"""The Mobius MIP against exhaustive enumeration of every cut, on small random instances, both solvers."""

from __future__ import annotations

import numpy as np
import pytest

from partition.mip.solve import enumerate_best, solve_stage_count, stage_data, stage_times
from partition.mip.solvers.gurobi import gurobi_available
from partition.rules.timeline import aggregate_step
from partition.spec.profile import LayerProfile, Profile
from topology import preset

pytestmark = pytest.mark.mip  # the MIP itself: skipped where no solver is installed


def _profile(rng, L: int, identical: bool) -> Profile:
    def layer(k):
        p = int(rng.integers(1, 40)) * 2**26
        return LayerProfile(
            f"l{k}",
            p // 2,
            p,
            int(rng.integers(1, 30)) * 2**26,
            2**24,
            1.0,
            2.0,
            float(rng.uniform(0.01, 0.2)),
            float(rng.uniform(0.02, 0.4)),
        )

    block = layer(0)
    layers = [layer(1)] + [block if identical else layer(k + 2) for k in range(L - 2)] + [layer(L)]
    return Profile("rand", "dev", "fp16", 1, 16, tuple(layers))


@pytest.mark.parametrize("seed", range(40))
def test_mip_equals_enumeration(seed):
    rng = np.random.default_rng(seed)
    topo = preset(["2+2", "3+1", "2x2-nvlink"][seed % 3])
    L = int(rng.integers(4, 10))
    prof = _profile(rng, L, identical=bool(seed % 2))
    n = int(rng.integers(1, 3))
    s = int(rng.integers(n, min(L, 2 * n + 2) + 1))
    mapping = [j % n for j in range(s)] if n > 1 else [0] * s
    data = stage_data(topo, mapping, prof)
    memory = int(rng.integers(60, 400)) * 2**26
    m = int(rng.integers(1, 5))
    best, best_cuts = enumerate_best(prof, mapping, m, data, memory)
    for solver in ["highs"] + (["gurobi"] if gurobi_available() else []):
        sol = solve_stage_count(prof, mapping, m, data, memory, None, solver=solver, time_limit_s=20, gap=1e-9)
        if best_cuts is None:
            assert sol.cuts is None and sol.result.status == "infeasible", (solver, sol.result)
            continue
        assert sol.result.status == "optimal" and sol.cuts is not None, (solver, sol.result)
        got = aggregate_step(stage_times(prof, sol.cuts, data), mapping, m)
        assert got == pytest.approx(best, rel=1e-7), (solver, sol.cuts, best_cuts)
        assert sol.result.objective == pytest.approx(best, rel=1e-6)


def test_warm_start_bounds_and_is_kept():
    rng = np.random.default_rng(7)
    prof = _profile(rng, 9, identical=True)
    mapping = [0, 1, 0, 1, 0]
    data = stage_data(preset("2+2"), mapping, prof)
    memory = 400 * 2**26
    best, best_cuts = enumerate_best(prof, mapping, 4, data, memory)
    sol = solve_stage_count(prof, mapping, 4, data, memory, best_cuts, time_limit_s=20, gap=1e-9)
    assert sol.result.objective == pytest.approx(best, rel=1e-6)


def test_gurobi_over_its_license_falls_back_to_highs_and_says_so(monkeypatch):
    import partition.mip.solve as mp

    monkeypatch.setattr(mp, "fits_license", lambda model: False)
    rng = np.random.default_rng(3)
    prof = _profile(rng, 6, identical=True)
    mapping = [0, 1, 0]
    data = stage_data(preset("2+2"), mapping, prof)
    sol = solve_stage_count(prof, mapping, 2, data, 400 * 2**26, None, solver="gurobi", time_limit_s=10)
    assert sol.result.solver == "highs" and "license does not admit" in sol.result.note
    assert sol.cuts is not None


@pytest.mark.parametrize("seed", range(6))
def test_mip_over_every_mapping_equals_enumeration_of_cuts_and_mappings(seed):
    from partition.rules.mapping import mapping_candidates

    rng = np.random.default_rng(100 + seed)
    topo = preset(["2+2", "3+1"][seed % 2])
    L = int(rng.integers(5, 9))
    prof = _profile(rng, L, identical=bool(seed % 2))
    s = int(rng.integers(4, min(L, 6) + 1))
    memory, m = 300 * 2**26, int(rng.integers(1, 4))
    enum, mip = [], []
    for mapping in mapping_candidates("search", topo, s):
        data = stage_data(topo, mapping, prof)
        enum.append(enumerate_best(prof, mapping, m, data, memory)[0])
        sol = solve_stage_count(prof, mapping, m, data, memory, None, solver="highs", time_limit_s=20, gap=1e-9)
        mip.append(sol.result.objective)
    assert len(enum) == 6
    assert min(mip) == pytest.approx(min(enum), rel=1e-7)


@pytest.mark.parametrize("seed", range(8))
def test_mip_and_dp_agree_where_the_step_is_the_bottleneck(seed):
    """One stage per gpu (S = N), nothing to load or send, backward = 2 x forward: then the step is
    4 (sum f + (M - 1) max f), so the MIP minimizes the largest stage, which is the DP's objective."""
    from partition.rules.costmodel import LayerArrays
    from partition.rules.dp import solve_dp
    from topology.presets import cpu_standin

    rng = np.random.default_rng(200 + seed)
    L, n, m = int(rng.integers(4, 12)), int(rng.integers(2, 5)), int(rng.integers(1, 6))
    layers = tuple(
        LayerProfile(f"l{k}", 0, 0, 0, 0, 1.0, 2.0, f, 2 * f) for k, f in enumerate(rng.uniform(0.01, 1.0, L))
    )
    prof = Profile("bottleneck", "dev", "fp32", 1, 8, layers)
    mapping = list(range(n))
    data = stage_data(cpu_standin(n, 2**30), mapping, prof)
    dp = solve_dp(LayerArrays.of(prof), 2**30, m, 10.0, [n])[n]
    mip = solve_stage_count(prof, mapping, m, data, 2**30, None, solver="highs", time_limit_s=20, gap=1e-9)
    t_dp = aggregate_step(stage_times(prof, list(dp.cuts), data), mapping, m)
    assert mip.cuts is not None
    t_mip = aggregate_step(stage_times(prof, mip.cuts, data), mapping, m)
    assert t_mip == pytest.approx(t_dp, rel=1e-9)
    if m > 1:  # with one microbatch every cut takes the same time; otherwise both minimize the largest stage
        biggest = lambda cuts: max(sum(x.fwd_s for x in layers[a:b]) for a, b in zip(cuts, cuts[1:]))  # noqa: E731
        assert biggest(mip.cuts) == pytest.approx(biggest(list(dp.cuts)), rel=1e-9)
