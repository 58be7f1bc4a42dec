"""Per-stage memory and partial prefetch: timeline by hand, simulator = timeline, MIP = enumeration where it binds."""

from __future__ import annotations

import numpy as np
import pytest

from partition.mip.model import build_mip, memory_need, start_of
from partition.mip.solve import enumerate_best, mip_feasible, solve_stage_count, stage_data, stage_times
from partition.mip.solvers.gurobi import gurobi_available
from partition.mip.solvers.highs import solve_highs
from partition.rules.timeline import StageTimes, aggregate_step, aggregate_times
from partition.sim.simulate import SimStage, simulate
from partition.spec.profile import LayerProfile, Profile
from topology import preset

pytestmark = pytest.mark.mip  # the MIP itself: skipped where no solver is installed

INF = float("inf")


def _two_stages(free_f0: float) -> list[StageTimes]:
    """One gpu, stages 0 and 1 (visits F0 F1 B1 B0), loads at 2 bytes/s: u0 = 1 s (2 bytes), u1 = 2 s (4 bytes)."""
    return [StageTimes(1.0, 2.0, 1.0, 0.5, 0.0, 2.0, free_f0, INF), StageTimes(1.0, 2.0, 2.0, 0.5, 0.0, 2.0, INF, INF)]


def test_partial_prefetch_by_hand():
    """F0 runs 1..2 and leaves 1 byte free: 1 of stage 1's 4 bytes is prefetched, the other 3 load after F0
    ends: LF1 = 2 + 1.5 = 3.5 (whole prefetch: 1 + 2 = 3). Then F1 3.5..4.5, B1 4.5..6.5 and its offload
    6.5..7; B0's load (after LF1, its slot freed when F0 ended) ends 4.5; B0 starts after the gradient slot
    is free, 7..9; T = 9 + 0.5."""
    total, t = aggregate_times(_two_stages(1.0), [0, 0], 1)
    assert t["LF"][1] == pytest.approx(3.5) and t["EF"][1] == pytest.approx(4.5)
    assert t["LB"][0] == pytest.approx(4.5) and t["TB"][0] == pytest.approx(7.0)
    assert total == pytest.approx(9.5)
    assert aggregate_step(_two_stages(INF), [0, 0], 1) == pytest.approx(9.0)
    assert aggregate_step(_two_stages(4.0), [0, 0], 1) == pytest.approx(9.0)  # all 4 bytes fit


def test_the_simulator_splits_the_load_the_same_way():
    # G = 20 bytes; F0 holds 2 bytes of weights and 17 of activations, so 1 byte is free for stage 1's 4
    sims = [SimStage(0, 1.0, 1.0, 1.0, 0.5, 0.0, 0.0, 2, 2, 17), SimStage(0, 1.0, 1.0, 2.0, 0.5, 0.0, 0.0, 4, 4, 0)]
    res = simulate(sims, 1, 1, memory_bytes=20)
    loads = [(e[2], e[4], e[5]) for e in res.events if e[0] == "load"]
    assert loads[:3] == [(0, 0.0, 1.0), (1, 1.0, pytest.approx(1.5)), (1, 2.0, pytest.approx(3.5))]
    assert res.step_time_s == pytest.approx(9.5)
    assert simulate(sims, 1, 1).step_time_s == pytest.approx(9.0)


@pytest.mark.parametrize("seed", range(6))
def test_bandwidth_times_duration_bound_is_implied(seed):
    """The paper also caps a prefetch at bandwidth x the current visit's duration. In the timeline that cap
    changes nothing: LF = max(a + P/r, E + (P - X)/r) equals max(a + X'/r, E) + (P - X')/r for X' = min(X,
    r (E - a)), the prefetch capped to what loads before the visit ends."""
    rng = np.random.default_rng(seed)
    for _ in range(200):
        a, e = sorted(rng.uniform(0, 10, 2))
        p, r = rng.uniform(0.1, 10), rng.uniform(0.1, 5)
        x = min(p, rng.uniform(0, 12))
        capped = min(x, r * (e - a))
        assert max(a + p / r, e + (p - x) / r) == pytest.approx(max(a + capped / r, e) + (p - capped) / r)


def _sim_and_timeline(rng, g: float):
    gpus, s = int(rng.integers(1, 4)), int(rng.integers(1, 8))
    mapping, sims, sts = [j % gpus for j in range(s)], [], []
    for j in range(s):
        f, b, p = rng.uniform(0.1, 1), rng.uniform(0.1, 2), int(rng.integers(5, 40))
        act, rate, off = min(int(rng.integers(0, 30)), int(g) - 2 * p), float(rng.uniform(20, 100)), rng.uniform(0, 0.5)
        d = 0.0 if j + 1 == s or mapping[j + 1] == mapping[j] else rng.uniform(0, 0.2)
        sims.append(SimStage(mapping[j], f, b, p / rate, off, 0.0, d, p, p, act))
        sts.append(StageTimes(f, f + b, p / rate, off, d, rate, g - p - act, g - 2 * p - act))
    return mapping, sims, sts


def test_simulator_equals_timeline_with_partial_prefetch_for_one_microbatch():
    """With one microbatch the aggregated timeline is exact, so the event simulation agrees with it to the
    last digit, loads split by the memory the previous visit leaves free included."""
    split = 0
    for seed in range(150):
        rng = np.random.default_rng(seed)
        mapping, sims, sts = _sim_and_timeline(rng, 100.0)
        res = simulate(sims, max(mapping) + 1, 1, memory_bytes=100)
        assert res.step_time_s == pytest.approx(aggregate_step(sts, mapping, 1), rel=1e-12), seed
        split += sum(e[0] == "load" for e in res.events) > len({(e[1], e[2]) for e in res.events if e[0] == "load"})
    assert split > 20  # the rule was exercised


def _profile(rng, L: int) -> Profile:
    """Layers heavy in activations (few parameters) or in parameters, loads slower than compute: a stage
    beside an activation-heavy one does not fit whole in the memory that one leaves free."""
    layers = []
    for k in range(L):
        heavy = bool(rng.integers(2))
        p = int(rng.integers(1, 8) if heavy else rng.integers(20, 40)) * 2**26
        a = int(rng.integers(20, 40) if heavy else rng.integers(1, 8)) * 2**26
        f, b = rng.uniform(0.005, 0.05), rng.uniform(0.01, 0.1)
        layers.append(LayerProfile(f"l{k}", p // 2, p, a, 2**24, 1.0, 2.0, f, b))
    return Profile("rand", "dev", "fp16", 1, 16, tuple(layers))


def _tight(rng, prof: Profile) -> int:
    """A memory barely above what the largest single layer needs."""
    need = max(2 * x.param_bytes + x.activation_bytes for x in prof.layers) + memory_need(prof)
    return int(need * rng.uniform(1.0, 1.3))


def _instance(seed: int):
    rng = np.random.default_rng(1000 + seed)
    topo = preset(["2+2", "3+1", "2x2-nvlink"][seed % 3])
    L = int(rng.integers(4, 10))
    prof, n = _profile(rng, L), int(rng.integers(1, 3))
    mapping = [j % n for j in range(int(rng.integers(max(n, L - 3), L + 1)))]
    return prof, mapping, stage_data(topo, mapping, prof), _tight(rng, prof), int(rng.integers(1, 4))


@pytest.mark.parametrize("seed", range(30))
def test_mip_equals_enumeration_under_tight_memory(seed):
    prof, mapping, data, memory, m = _instance(seed)
    best, best_cuts = enumerate_best(prof, mapping, m, data, memory)
    for solver in ["highs"] + (["gurobi"] if gurobi_available() else []):
        sol = solve_stage_count(prof, mapping, m, data, memory, None, solver=solver, time_limit_s=20, gap=1e-9)
        if best_cuts is None:
            assert sol.cuts is None and sol.result.status == "infeasible", (solver, sol.result)
            continue
        assert sol.cuts is not None and mip_feasible(prof, sol.cuts, memory), (solver, sol.result)
        got = aggregate_step(stage_times(prof, sol.cuts, data, memory), mapping, m)
        assert got == pytest.approx(best, rel=1e-7) and sol.result.objective == pytest.approx(best, rel=1e-6)


def test_tight_memory_instances_exercise_partial_prefetch():
    """In the instances above, the best cut's step is longer than with whole prefetch in several."""
    differs = 0
    for seed in range(30):
        prof, mapping, data, memory, m = _instance(seed)
        _, cuts = enumerate_best(prof, mapping, m, data, memory)
        if cuts is not None:
            tight = aggregate_step(stage_times(prof, cuts, data, memory), mapping, m)
            differs += tight > aggregate_step(stage_times(prof, cuts, data), mapping, m) * (1 + 1e-9)
    assert differs >= 3


@pytest.mark.parametrize("seed", range(10))
def test_lp_of_fixed_cuts_equals_the_timeline(seed):
    """Every cut variable fixed to one cut: the LP optimum is the timeline's T for that cut."""
    rng = np.random.default_rng(2000 + seed)
    topo = preset(["2+2", "3+1"][seed % 2])
    L = int(rng.integers(5, 10))
    prof = _profile(rng, L)
    s = int(rng.integers(2, L + 1))
    mapping = [j % topo.num_gpus for j in range(s)]
    data, memory, m = stage_data(topo, mapping, prof), _tight(rng, prof) * 2, int(rng.integers(1, 5))
    cuts = [0, *sorted(rng.choice(np.arange(1, L), s - 1, replace=False).tolist()), L]
    while not mip_feasible(prof, cuts, memory):  # more memory until this cut fits
        memory *= 2
    want, values = aggregate_times(stage_times(prof, cuts, data, memory), mapping, m)
    model, layout = build_mip(prof, mapping, m, data, memory)
    x = start_of(layout, cuts, model, values, want)
    for k, integer in enumerate(model.integer):
        if integer:
            model.lb[k] = model.ub[k] = x[k]
    res = solve_highs(model, 20, 1e-9)
    assert res.objective == pytest.approx(want, rel=1e-7)
