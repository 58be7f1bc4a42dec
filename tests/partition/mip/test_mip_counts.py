"""The MIP over stage counts against enumeration of every count and cut; gpt3-175b's models fit Gurobi's pip license."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from foundation.units import GiB
from partition.mip.counts import CountCandidate, solve_counts
from partition.mip.model import build_mip
from partition.mip.solve import enumerate_best, stage_data
from partition.mip.solvers.gurobi import SIZE_LIMIT, fits_license, gurobi_available, gurobi_size
from partition.rules.costmodel import LayerArrays
from partition.rules.mapping import make_mapping
from partition.search import MIP_CANDIDATES, _dp_plans, make_plan
from partition.spec.analytic import analytic_profile
from partition.spec.hardware import device_spec
from partition.spec.lookup import get_model
from partition.spec.profile import LayerProfile, Profile
from topology import preset

pytestmark = pytest.mark.mip  # the MIP itself: skipped where no solver is installed


def _profile(rng, L: int) -> Profile:
    layers = []
    for k in range(L):
        p, a = int(rng.integers(1, 40)) * 2**26, int(rng.integers(1, 30)) * 2**26
        f, b = rng.uniform(0.005, 0.2), rng.uniform(0.01, 0.4)
        layers.append(LayerProfile(f"l{k}", p // 2, p, a, 2**24, 1.0, 2.0, f, b))
    if rng.integers(2):
        layers[1:-1] = [layers[1]] * (L - 2)
    return Profile("rand", "dev", "fp16", 1, 16, tuple(layers))


@pytest.mark.parametrize("seed", range(12))
def test_stage_counts_one_by_one_find_the_optimum_over_every_count_and_cut(seed):
    """The outer loop over S (each S solved, cut off at the best so far) reaches the least T over every S
    from N to L and every cut into S stages (exhaustive enumeration), in any order of the counts."""
    rng = np.random.default_rng(300 + seed)
    topo = preset(["2+2", "3+1", "2x2-nvlink"][seed % 3])
    L = int(rng.integers(topo.num_gpus, 9))
    prof, m = _profile(rng, L), int(rng.integers(1, 4))
    memory = int(rng.integers(100, 400)) * 2**26
    counts = [int(s) for s in rng.permutation(np.arange(topo.num_gpus, L + 1))]
    maps = [make_mapping("cross", topo, s) for s in counts]
    cands = [CountCandidate(mp, stage_data(topo, mp, prof), None) for mp in maps]
    want = min(enumerate_best(prof, c.mapping, m, c.data, memory)[0] for c in cands)
    got = solve_counts(prof, cands, m, memory, "highs", time_limit_s=60, gap=1e-7)
    assert got.best == pytest.approx(want, rel=1e-6)
    assert got.gap <= 1e-7 and got.status == "optimal"


def test_cut_off_counts_say_so_and_bound_the_gap():
    """8 stages first, then 4 from a start cut: the 4-stage count cannot beat 8 by half the gap, so its solve
    ends "cutoff" with the cutoff as its bound; without a start it cannot tell that from "infeasible"."""
    rng = np.random.default_rng(5)
    topo, prof, memory = preset("2+2"), _profile(rng, 8), 400 * 2**26
    maps = [make_mapping("cross", topo, s) for s in (8, 4)]
    data = [stage_data(topo, mp, prof) for mp in maps]
    start = enumerate_best(prof, maps[1], 2, data[1], memory)[1]
    for cuts, status in ((start, "cutoff"), (None, "infeasible")):
        cands = [CountCandidate(maps[0], data[0], None), CountCandidate(maps[1], data[1], cuts)]
        got = solve_counts(prof, cands, 2, memory, "highs", time_limit_s=20, gap=0.02)
        first, second = got.solutions
        assert first.result.status == "optimal" and second.result.status == status
        assert second.cuts is None and second.bound == pytest.approx(got.best * 0.99)
        assert got.status == "optimal" and got.gap == pytest.approx(0.01)


def _gpt3_candidates(topo_name: str):
    topo = preset(topo_name)
    prof = analytic_profile(get_model("gpt3-175b"), device_spec(topo.gpus[0].name), microbatch_size=1, dtype="fp16")
    memory = min(g.memory_bytes for g in topo.gpus) - GiB  # the CLI's default reserve
    ranked = _dp_plans(prof, topo, LayerArrays.of(prof), 4, None, "cross", memory)[:MIP_CANDIDATES]
    return prof, topo, memory, ranked


@pytest.mark.parametrize("topo_name", ["2+2", "3+1"])
def test_gpt3_175b_models_fit_gurobis_size_limited_license(topo_name):
    """Every stage count the planner re-cuts, and S = L-4 .. L, build to at most 2000 variables and 2000
    constraints (a ranged row counted as two), so the pip wheel's license solves the headline command."""
    prof, topo, memory, ranked = _gpt3_candidates(topo_name)
    mappings = [p.mapping for p in ranked] + [make_mapping("cross", topo, s) for s in range(94, 99)]
    for mapping in mappings:
        model, _ = build_mip(prof, mapping, 4, stage_data(topo, mapping, prof), memory)
        nvars, nrows = gurobi_size(model)
        assert nvars <= SIZE_LIMIT and nrows <= SIZE_LIMIT, (len(mapping), nvars, nrows)
        assert fits_license(model) or not gurobi_available()


@pytest.mark.parametrize("topo_name", ["2+2", "3+1"])
def test_gpt3_175b_plan_is_solved_by_gurobi_within_the_gap(topo_name):
    prof, topo, _, _ = _gpt3_candidates(topo_name)
    plan = make_plan(prof, topo, 4, reserve_bytes=GiB)
    assert plan.solver.name == ("gurobi" if gurobi_available() else "highs")
    assert plan.solver.gap <= 0.01 and plan.solver.status == "optimal"
    assert 0 < plan.solver.num_vars <= SIZE_LIMIT and 0 < plan.solver.num_rows <= SIZE_LIMIT


def test_every_count_is_enumerated_in_the_oracle():
    """The oracle above really covers every cut: C(L-1, S-1) cuts for S stages, 2^(L-1) over all S."""
    L = 7
    assert sum(len(list(itertools.combinations(range(1, L), s - 1))) for s in range(1, L + 1)) == 2 ** (L - 1)
