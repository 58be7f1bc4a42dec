"""Solve the Mobius MIP for one stage count (a fixed mapping), warm-started from the DP; exhaustive oracle.

Solver choice ("auto"): Gurobi when it is installed and its license admits the model (the pip wheel's
size-limited license takes 2000 variables and 2000 rows), HiGHS otherwise. Every solve has a time
limit and a relative gap; on a time-out the incumbent is kept and its gap reported, never hidden.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from partition.costmodel import ARENA_SLOTS
from partition.mapping import peer_gbps, stage_contention
from partition.mip import GIB, StageData, build_mip, cuts_of, memory_need, start_of
from partition.profile import Profile
from partition.solvers import INF, MipModel, MipResult
from partition.solvers.gurobi import SIZE_LIMIT, fits_license, solve_gurobi
from partition.solvers.highs import solve_highs
from partition.timeline import StageTimes, aggregate_step, aggregate_times
from topology import Topology

__all__ = ["stage_data", "stage_times", "mip_feasible", "enumerate_best", "solve_stage_count", "SOLVERS"]

SOLVERS = ("auto", "highs", "gurobi", "dp")


def stage_data(topo: Topology, mapping: list[int], profile: Profile) -> StageData:
    """beta_j, link_j and d_j of the MIP legend for this mapping."""
    omax = max(x.output_bytes for x in profile.layers[:-1]) if profile.num_layers > 1 else 0
    load = tuple(topo.load_gbps(g, c) for g, c in zip(mapping, stage_contention(topo, mapping)))
    link = tuple(topo.gpus[g].link_gbps for g in mapping)
    comm = tuple(
        0.0
        if j + 1 == len(mapping) or mapping[j + 1] == mapping[j]
        else omax / (peer_gbps(topo, mapping[j], mapping[j + 1]) * 1e9)
        for j in range(len(mapping))
    )
    return StageData(load, link, comm)


def stage_times(profile: Profile, cuts: list[int], data: StageData) -> list[StageTimes]:
    out = []
    for j in range(len(cuts) - 1):
        ls = profile.layers[cuts[j] : cuts[j + 1]]
        f, b, p = sum(x.fwd_s for x in ls), sum(x.bwd_s for x in ls), sum(x.param_bytes for x in ls)
        out.append(StageTimes(f, f + b, p / (data.load_gbps[j] * 1e9), p / (data.link_gbps[j] * 1e9), data.comm_s[j]))
    return out


def mip_feasible(profile: Profile, cuts: list[int], memory_bytes: int) -> bool:
    """The MIP's memory rule: 3 W + A_j + 2 O_max <= G for every stage."""
    stages = [profile.layers[cuts[j] : cuts[j + 1]] for j in range(len(cuts) - 1)]
    slot = max(sum(x.param_bytes for x in ls) for ls in stages)
    fixed = memory_need(profile)
    return all(ARENA_SLOTS * slot + sum(x.activation_bytes for x in ls) + fixed <= memory_bytes for ls in stages)


def enumerate_best(
    profile: Profile, mapping: list[int], m: int, data: StageData, memory_bytes: int
) -> tuple[float, list[int] | None]:
    """Exhaustive oracle: the least aggregated step over every cut into len(mapping) stages."""
    best: tuple[float, list[int] | None] = (INF, None)
    L, s = profile.num_layers, len(mapping)
    for inner in itertools.combinations(range(1, L), s - 1):
        cuts = [0, *inner, L]
        if mip_feasible(profile, cuts, memory_bytes):
            t = aggregate_step(stage_times(profile, cuts, data), mapping, m)
            if t < best[0]:
                best = (t, cuts)
    return best


@dataclass(frozen=True)
class StageCountSolution:
    cuts: list[int] | None
    result: MipResult
    num_vars: int
    num_rows: int


def _solve(model: MipModel, solver: str, time_limit_s: float, gap: float, start) -> MipResult:
    """Gurobi when asked for (or on auto) and its license admits the model; HiGHS otherwise. A Gurobi
    that cannot take the model falls back to HiGHS and says so in the status."""
    if solver in ("gurobi", "auto") and fits_license(model):
        try:
            return solve_gurobi(model, time_limit_s, gap, start)
        except Exception as e:  # noqa: BLE001 - a license that expired or changed since the probe: fall back, and say why
            why = f"gurobi failed ({str(e).splitlines()[0]}), solved by HiGHS"
    elif solver == "gurobi":
        why = (
            f"gurobi's license does not admit {model.num_vars} variables x {model.num_rows} rows "
            f"(size-limited: {SIZE_LIMIT} each, or none), solved by HiGHS"
        )
    else:
        return solve_highs(model, time_limit_s, gap, start)
    res = solve_highs(model, time_limit_s, gap, start)
    return dataclasses.replace(res, note=why)


def solve_stage_count(
    profile: Profile,
    mapping: list[int],
    m: int,
    data: StageData,
    memory_bytes: int,
    start_cuts: list[int] | None,
    solver: str = "auto",
    time_limit_s: float = 2.0,
    gap: float = 0.01,
) -> StageCountSolution:
    """Best cut into len(mapping) stages; start_cuts (e.g. the DP's) warm-starts and bounds the solve."""
    start, horizon = None, INF
    if start_cuts is not None and mip_feasible(profile, start_cuts, memory_bytes):
        horizon, values = aggregate_times(stage_times(profile, start_cuts, data), mapping, m)
        horizon *= 1 + 1e-9
    model, layout = build_mip(profile, mapping, m, data, memory_bytes, horizon)
    if start_cuts is not None and horizon < INF:
        slot = max(sum(x.param_bytes for x in profile.layers[a:b]) for a, b in zip(start_cuts, start_cuts[1:]))
        start = start_of(layout, start_cuts, model, values, slot / GIB, horizon)
    res = _solve(model, solver, time_limit_s, gap, start)
    cuts = cuts_of(layout, res.x) if res.x is not None else None
    return StageCountSolution(cuts, res, model.num_vars, model.num_rows)
