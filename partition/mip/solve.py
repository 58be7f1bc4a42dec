"""Solve the Mobius MIP for one stage count (a fixed mapping), warm-started from the DP; exhaustive oracle.

Solver choice ("auto"): Gurobi when it is installed and its license admits the model (the pip wheel's
size-limited license takes 2000 variables and 2000 rows), HiGHS otherwise. Every solve has a time
limit and a relative gap; on a time-out the incumbent is kept and its gap reported, never hidden.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from partition.mip.model import StageData, build_mip, cuts_of, memory_need, stage_memory, start_of
from partition.mip.solvers import INF, MipModel, MipResult
from partition.mip.solvers.gurobi import SIZE_LIMIT, fits_license, gurobi_size, solve_gurobi
from partition.mip.solvers.highs import solve_highs
from partition.rules.mapping import peer_gbps, stage_contention
from partition.rules.timeline import StageTimes, aggregate_step, aggregate_times
from partition.spec.profile import Profile
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


def stage_times(profile: Profile, cuts: list[int], data: StageData, memory_bytes: float = INF) -> list[StageTimes]:
    """The timeline's stage times for these cuts; with memory_bytes (G), the free memory of each visit
    (G - S_F(j), G - S_B(j) of partition.mip.model), so that loads prefetch only what fits."""
    out, room = [], memory_bytes - memory_need(profile)
    for j in range(len(cuts) - 1):
        ls = profile.layers[cuts[j] : cuts[j + 1]]
        f, b, p = sum(x.fwd_s for x in ls), sum(x.bwd_s for x in ls), sum(x.param_bytes for x in ls)
        a, rate = sum(x.activation_bytes for x in ls), data.load_gbps[j] * 1e9
        free = {ph: room - stage_memory(p, a, ph) for ph in "FB"}
        out.append(StageTimes(f, f + b, p / rate, p / (data.link_gbps[j] * 1e9), data.comm_s[j], rate, **_free(free)))
    return out


def _free(free: dict[str, float]) -> dict[str, float]:
    return {"free_f": free["F"], "free_b": free["B"]}


def mip_feasible(profile: Profile, cuts: list[int], memory_bytes: int) -> bool:
    """The MIP's memory rule: S_B(j) = 2 P_j + A_j + 2 O_max <= G for every stage."""
    room = memory_bytes - memory_need(profile)
    stages = [profile.layers[cuts[j] : cuts[j + 1]] for j in range(len(cuts) - 1)]
    return all(
        stage_memory(sum(x.param_bytes for x in ls), sum(x.activation_bytes for x in ls), "B") <= room for ls in stages
    )


def enumerate_best(
    profile: Profile, mapping: list[int], m: int, data: StageData, memory_bytes: int
) -> tuple[float, list[int] | None]:
    """Exhaustive oracle: the least aggregated step over every cut into len(mapping) stages."""
    best: tuple[float, list[int] | None] = (INF, None)
    L, s = profile.num_layers, len(mapping)
    for inner in itertools.combinations(range(1, L), s - 1):
        cuts = [0, *inner, L]
        if mip_feasible(profile, cuts, memory_bytes):
            t = aggregate_step(stage_times(profile, cuts, data, memory_bytes), mapping, m)
            if t < best[0]:
                best = (t, cuts)
    return best


@dataclass(frozen=True)
class StageCountSolution:
    cuts: list[int] | None
    result: MipResult
    num_vars: int
    num_rows: int
    """Constraints, a ranged row counted as two (as Gurobi's size-limited license counts them)."""
    bound: float = -INF
    """A proven lower bound on T over every cut into these stages (the cutoff when none beats it)."""


def _solve(model: MipModel, solver: str, time_limit_s: float, gap: float, start) -> MipResult:
    """Gurobi when asked for (or on auto) and its license admits the model; HiGHS otherwise. A Gurobi
    that cannot take the model falls back to HiGHS and says so in the status."""
    if solver in ("gurobi", "auto") and fits_license(model):
        try:
            return solve_gurobi(model, time_limit_s, gap, start)
        except Exception as e:  # noqa: BLE001 - a license that expired or changed since the probe: fall back, and say why
            why = f"gurobi failed ({str(e).splitlines()[0]}), solved by HiGHS"
    elif solver == "gurobi":
        nvars, nrows = gurobi_size(model)
        why = (
            f"gurobi's license does not admit {nvars} variables x {nrows} rows "
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
    cutoff: float = INF,
) -> StageCountSolution:
    """Best cut into len(mapping) stages; start_cuts (e.g. the DP's) warm-starts and bounds the solve.

    cutoff: search only cuts with T <= cutoff (e.g. below the best of another stage count); when there
    is none but start_cuts fit, the status is "cutoff" and the bound the cutoff."""
    start, start_t, values = None, INF, {}
    if start_cuts is not None and mip_feasible(profile, start_cuts, memory_bytes):
        start_t, values = aggregate_times(stage_times(profile, start_cuts, data, memory_bytes), mapping, m)
        start_t *= 1 + 1e-9
    horizon = min(start_t, cutoff)
    model, layout = build_mip(profile, mapping, m, data, memory_bytes, horizon)
    if start_cuts is not None and start_t <= horizon < INF:
        start = start_of(layout, start_cuts, model, values, start_t)
    res = _solve(model, solver, time_limit_s, gap, start)
    size = gurobi_size(model)
    if res.x is not None:
        return StageCountSolution(cuts_of(layout, res.x), res, *size, res.bound)
    if res.status == "infeasible":
        res = dataclasses.replace(res, status="cutoff") if start_t < INF else res
        return StageCountSolution(None, res, *size, horizon)
    return StageCountSolution(None, res, *size)
