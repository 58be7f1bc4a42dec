"""Plan search: make_plan() finds the fastest Plan (DP over stage counts, MIP re-cut, shared-link ranking)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from foundation.timing import Stopwatch
from foundation.units import fmt_bytes
from partition.errors import PlanInfeasibleError
from partition.mip.solvers import NO_MIP, mip_installed
from partition.plan import Plan, SolverInfo, StagePlan, most_buffers
from partition.rules.activation_choice import with_activations
from partition.rules.costmodel import LayerArrays, arena_bytes, slot_weight_bytes
from partition.rules.dp import solve_dp
from partition.rules.fits import check_layers_fit, infeasible_stages
from partition.rules.mapping import mapping_candidates, mapping_score, stage_contention
from partition.rules.tiers import (
    HostBudget,
    MemoryPlan,
    SsdInfo,
    activation_host_caps,
    gpu_states_bytes,
    place_tiers,
    ssd_info,
    states_fit_gpus,
)
from partition.sim.bounds import StepBound, step_bound
from partition.sim.simulate import SimResult, simulate
from partition.sim.stages import HOST_ADAM_PARAMS_PER_S, host_adam_rate, host_cores, loop_overhead, sim_stages
from partition.spec.profile import Profile
from topology import Topology

__all__ = [
    "make_plan",
    "plan_batch",
    "sim_stages",
    "predict_step",
    "Prediction",
    "HOST_ADAM_PARAMS_PER_S",
    "host_adam_rate",
    "host_cores",
]


def make_plan(
    profile: Profile,
    topo: Topology,
    microbatches: int,
    *,
    num_stages: int | None = None,
    mapping: str = "cross",
    reserve_bytes: int = 0,
    solver: str = "auto",
    time_limit_s: float = 2.0,
    gap: float = 0.01,
    host_budget: HostBudget | None = None,
    activations: str = "auto",
    activation_tiers: tuple[str, ...] = ("host",),
) -> Plan:
    """Cut the profiled layers into stages, map them to gpus and predict the step; the fastest plan wins.

    The exact DP runs for every stage count S (num_stages=None: from the gpu count to the layer count)
    and a quick simulation (fixed transfer times) ranks its plans. Then, unless solver="dp", the Mobius
    MIP (partition.mip.model) re-cuts the best MIP_CANDIDATES stage counts, warm-started from the DP, within
    time_limit_s of solver time in all and to a relative gap. The candidates are simulated again with
    shared links (partition.sim.simulate with the topology) and the least predicted step wins.

    host_budget: the host memory the states must fit (partition.rules.tiers); states that do not fit go to the
    SSD and the final simulation streams their traffic under the updates. None: unlimited, all in memory.
    activations: "auto" chooses each stage's activation policy under the memory (partition.rules.activation_choice)
    on every candidate and keeps the fastest whose lifetime walk then fits, each step predicted again with its
    choice (which can reorder them); when none fits, the first of up to WALK_RETRIES plans with more stages that
    does (PlanInfeasibleError when none does); "recompute" plans every stage to recompute from its input
    (the runtime's path before the choice) under the memory rule alone. activation_tiers: the tiers off the
    device the choice may hold activations on ("host", "ssd": the run has memory.ssd_dir).
    """
    watch = Stopwatch()
    _check_memory_known(topo)
    arr = LayerArrays.of(profile)
    usable = min(g.memory_bytes for g in topo.gpus) - reserve_bytes - profile.library_bytes  # W held apart

    def searched(held: int) -> Plan:
        memory = usable - held
        check_layers_fit(arr, profile, memory, held)
        ranked = _dp_plans(profile, topo, arr, microbatches, num_stages, mapping, memory)
        if not ranked:
            raise infeasible_stages(num_stages, arr, memory, profile.library_bytes, held)
        candidates, info = ranked[:MIP_CANDIDATES], SolverInfo("dp", "optimal", 0.0, 0.0)
        if solver != "dp" and not mip_installed():
            info = SolverInfo("dp", f"optimal; {NO_MIP}", 0.0, 0.0)
        elif solver != "dp":
            found, info = _mip_plans(
                profile, topo, arr, candidates, microbatches, mapping, memory, solver, time_limit_s, gap
            )
            candidates = candidates + found
        shared = sorted(_shared(candidates, topo, host_budget), key=lambda p: (p.predicted_step_time_s, p.num_stages))
        best = shared[0]
        if activations == "auto":
            more = [p for p in ranked[MIP_CANDIDATES:] if p.num_stages > best.num_stages][:WALK_RETRIES]
            best = _chosen(shared, more, profile, topo, memory, host_budget, activation_tiers)
        return dataclasses.replace(best, solver=info)

    best = _buffers_held_apart(searched, profile.buffer_bytes, topo.num_gpus)
    return dataclasses.replace(best, solver=dataclasses.replace(best.solver, wall_s=round(watch.s, 6)))


BUFFER_TRIES = 3
"""Plans make_plan makes with a gpu's share of the layers' buffers held apart before it holds all of them apart."""


def _buffers_held_apart(searched: Callable[[int], Plan], total: int, num_gpus: int) -> Plan:
    """The plan searched with the layers' buffers (V_j, each stage's gpu keeps them the whole run) held apart from the
    memory: first an even share of their `total` (the least any plan's fullest gpu keeps), then the most its plan's
    gpus keep while that is more (BUFFER_TRIES plans at most), then all of them. One plan when no layer has buffers."""
    held = -(-total // num_gpus)
    for _ in range(BUFFER_TRIES):
        plan = searched(held)
        most = plan.most_buffers
        if most <= held:
            return dataclasses.replace(plan, buffer_bytes=held)
        held = most
    return dataclasses.replace(searched(total), buffer_bytes=total)


def plan_batch(
    profile_of: Callable[[int], Profile],
    batch_size: int,
    topo: Topology,
    num_microbatches: int | None = None,
    **options,
) -> Plan:
    """The fastest plan of a batch of `batch_size` sequences per pass: make_plan (with `options`) for each count M of
    microbatches that divides the batch, on the profile of its microbatch size (profile_of(batch_size // M)), the
    least predicted step kept (the same batch, so the same work: the least step is the most throughput; a tie goes
    to fewer, larger microbatches). num_microbatches fixes M. PlanInfeasibleError, the one of the most microbatches
    (the smallest, likeliest to fit), when no count fits."""
    counts = [num_microbatches] if num_microbatches else [m for m in range(1, batch_size + 1) if batch_size % m == 0]
    plans, errors = [], []
    for m in counts:
        try:
            plans.append(make_plan(profile_of(batch_size // m), topo, m, **options))
        except PlanInfeasibleError as e:
            errors.append(e)
    if not plans:
        raise errors[-1]
    return min(plans, key=lambda p: (p.predicted_step_time_s, p.num_microbatches))


WALK_RETRIES = 8
"""Plans with more stages make_plan tries, after the candidates, when no candidate's lifetime walk fits."""


def _chosen(
    shared: list[Plan],
    more: list[Plan],
    profile: Profile,
    topo: Topology,
    memory: int,
    budget: HostBudget | None,
    tiers: tuple[str, ...],
) -> Plan:
    """The fastest of the candidates (shared) whose lifetime walk fits the memory with each stage's activation policy
    chosen (partition.rules.activation_choice), each step predicted again with its choice (the choice can reorder
    them: it saves more recompute on some cuts than on others); when none fits, the first of `more` that does;
    PlanInfeasibleError naming the first plan's shortfall when none fits (the memory rule alone would have let it
    through, and the run exceed it)."""
    budget = budget or HostBudget(None, "unlimited")
    errors: list[ValueError] = []
    fitting = _with_choices(shared, profile, topo, memory, budget, tiers, errors, every=True)
    fitting = fitting or _with_choices(more, profile, topo, memory, budget, tiers, errors, every=False)
    if fitting:
        return min(fitting, key=lambda p: (p.predicted_step_time_s, p.num_stages))
    plans = shared + more
    raise PlanInfeasibleError(
        f"no plan of {profile.model} fits {fmt_bytes(memory)} per gpu on the lifetime walk (the arena, held "
        f"activations, queued messages, the computing stage's live bytes and transients) with "
        f"{plans[0].num_microbatches} microbatches of {profile.microbatch_size}: with {plans[0].num_stages} stages, "
        f"{errors[0]}; use a smaller microbatch size or sequence length, fewer microbatches, more stages, or gpus "
        "with more memory"
    )


def _with_choices(
    plans: list[Plan],
    profile: Profile,
    topo: Topology,
    memory: int,
    budget: HostBudget,
    tiers: tuple[str, ...],
    errors: list[ValueError],
    every: bool,
) -> list[Plan]:
    """The plans whose walk fits with their activation choice, re-predicted (every: all of them; else the first);
    the others' errors appended to `errors`."""
    out = []
    for plan in plans:
        try:
            chosen = _best_choice(plan, profile, topo, memory, budget, tiers)
            out.append(_gpu_states_if_faster(chosen, profile, topo, memory, budget, tiers))
        except ValueError as e:  # PlanInfeasibleError (the states) too
            errors.append(e)
            continue
        if not every:
            break
    return out


def _best_choice(
    plan: Plan, profile: Profile, topo: Topology, memory: int, budget: HostBudget, tiers: tuple[str, ...]
) -> Plan:
    """The plan with the activation choice from each start (every input on the device; on the host), its states
    placed and its step predicted, that predicts the shortest step: a start whose choice holds more in host memory
    than the states leave may still win once the placement has made room (the states to the SSD). ValueError: the
    first start's when none fits."""
    caps = activation_host_caps(plan, budget)
    best, error = None, None
    for start in ("device", "host") if "host" in tiers else ("device",):  # a host start needs the host tier
        try:
            chosen, _ = with_activations(plan, profile, topo, memory, host_caps=caps, tiers=tiers, starts=(start,))
            placed = _shared([chosen], topo, budget)[0]
        except ValueError as e:
            error = error or e
            continue
        if best is None or placed.predicted_step_time_s < best.predicted_step_time_s:
            best = placed
    if best is None:
        assert error is not None
        raise error
    return best


def _gpu_states_if_faster(
    plan: Plan, profile: Profile, topo: Topology, memory: int, budget: HostBudget, tiers: tuple[str, ...]
) -> Plan:
    """A LoRA plan whose activation choice leaves room on every gpu for its stages' states is already on the gpu
    tier (partition.rules.tiers.states_fit_gpus). Otherwise the choice made again with that room kept (the most
    any gpu's states take), if that plan predicts a shorter step: keeping fewer activations against offloading no
    gradient and running no host update."""
    reserve = gpu_states_bytes(plan)
    if not reserve or states_fit_gpus(plan) or True not in (budget.run.gpu_states if budget.run else (True,)):
        # predict_step has weighed the gpu tier already, or the run keeps its states off the gpus
        return plan
    try:
        lean = _best_choice(plan, profile, topo, memory - reserve, budget, tiers)
    except ValueError:  # no choice fits the smaller memory
        return plan
    return lean if lean.predicted_step_time_s < plan.predicted_step_time_s else plan


def _shared(plans: list[Plan], topo: Topology, budget: HostBudget | None) -> list[Plan]:
    """The plans whose states fit the budget, each with its step predicted by the shared-link simulation
    with its SSD traffic; the first plan's PlanInfeasibleError when none fits."""
    out, errors = [], []
    for plan in plans:
        try:
            out.append(predict_step(plan, topo, budget or HostBudget(None, "unlimited")).plan)
        except PlanInfeasibleError as e:
            errors.append(e)
    if not out:
        raise errors[0]
    return out


@dataclass(frozen=True)
class Prediction:
    """A plan's predicted step with its memory tiers: the plan (predicted_step_time_s set), where its states
    live, the SSD it streams them through, the simulated step and the resource that bounds it."""

    plan: Plan
    memory: MemoryPlan
    ssd: SsdInfo
    sim: SimResult
    bound: StepBound


def predict_step(plan: Plan, topo: Topology, budget: HostBudget) -> Prediction:
    """Place the plan's states under `budget` (partition.rules.tiers) and simulate its step on `topo` with shared
    links, the SSD traffic of the states on the SSD, and the loop's per-step overhead the topology measured;
    PlanInfeasibleError when the states cannot fit. The plan returned records each stage's tiers
    (StagePlan.optimizer_tier, weights_tier). A LoRA plan whose adapters' states fit its gpus
    (partition.rules.tiers.states_fit_gpus) is simulated with them there and off them: the faster is the plan's."""
    choices = (True, False) if budget.run is None else budget.run.gpu_states
    if choices != (True,) and not states_fit_gpus(plan):
        return _predicted(plan, topo, place_tiers(plan, budget, gpu_states=False))
    both, errors = [], []
    for on_gpus in choices:
        try:
            both.append(_predicted(plan, topo, place_tiers(plan, budget, gpu_states=on_gpus)))
        except PlanInfeasibleError as e:
            errors.append(e)
    if not both:
        raise errors[0]
    return min(both, key=lambda p: p.sim.step_time_s)


def _predicted(plan: Plan, topo: Topology, memory: MemoryPlan) -> Prediction:
    """The plan's step simulated with its states where `memory` puts them."""
    ssd = ssd_info(topo)
    stages = sim_stages(plan.stages, topo, memory)
    sim = simulate(
        stages,
        topo.num_gpus,
        plan.num_microbatches,
        topology=topo,
        ssd=ssd.link,
        host_cores=host_cores(topo),
        overhead_s=loop_overhead(topo),
        delayed=memory.budget.delayed,
    )
    bound = step_bound(sim, stages, topo, ssd.link)
    placed = tuple(
        dataclasses.replace(s, optimizer_tier=t.optimizer, weights_tier=t.weights)
        for s, t in zip(plan.stages, memory.stages)
    )
    plan = dataclasses.replace(plan, stages=placed, predicted_step_time_s=sim.step_time_s)
    return Prediction(plan, memory, ssd, sim, bound)


MIP_CANDIDATES = 3
"""Stage counts (the DP's best by simulated step) the MIP re-cuts."""


def _dp_plans(
    profile: Profile,
    topo: Topology,
    arr: LayerArrays,
    microbatches: int,
    num_stages: int | None,
    mapping: str,
    memory: int,
) -> list[Plan]:
    """The DP's plan for every feasible stage count, fastest (quickly simulated) step first.

    One DP run answers every S that shares its load bandwidth (the DP table holds all stage counts)."""
    maps: dict[tuple[int, int], tuple[list[int], list[float]]] = {}  # (S, candidate k) -> (mapping, gbps)
    try:
        for s in _stage_counts(num_stages, topo.num_gpus, arr.num_layers):
            for k, m in enumerate(mapping_candidates(mapping, topo, s)):
                maps[(s, k)] = (m, [topo.load_gbps(g, c) for g, c in zip(m, stage_contention(topo, m))])
    except ValueError as e:
        raise PlanInfeasibleError(str(e)) from e
    plans = []
    for bw in sorted({min(g) for _, g in maps.values()}):
        for k in sorted({k for (s, k), (_, g) in maps.items() if min(g) == bw}):
            counts = [s for (s, kk), (_, g) in maps.items() if kk == k and min(g) == bw]
            for s, sol in solve_dp(arr, memory, microbatches, bw, counts).items():
                m, gbps = maps[(s, k)]
                plans.append(_plan_of(profile, topo, arr, sol.ranges, m, gbps, microbatches, mapping, memory))
    return sorted(plans, key=lambda p: (p.predicted_step_time_s, p.num_stages))


def _mip_plans(
    profile: Profile,
    topo: Topology,
    arr: LayerArrays,
    ranked: list[Plan],
    microbatches: int,
    mapping: str,
    memory: int,
    solver: str,
    time_limit_s: float,
    gap: float,
) -> tuple[list[Plan], SolverInfo]:
    """The MIP's cut for each candidate's stage count (partition.mip.counts), kept where the runtime's arena
    of fixed slots holds it; the solver info summarizes the whole search."""
    from partition.mip.counts import CountCandidate, solve_counts  # the solvers load only when used
    from partition.mip.solve import stage_data

    cands = [
        CountCandidate(p.mapping, stage_data(topo, p.mapping, profile), [s.first for s in p.stages] + [p.num_layers])
        for p in ranked
    ]
    res = solve_counts(profile, cands, microbatches, memory, solver, time_limit_s, gap)
    found = []
    for plan, sol in zip(ranked, res.solutions):
        ranges = [(a, b - 1) for a, b in zip(sol.cuts, sol.cuts[1:])] if sol.cuts else []
        if ranges and _arena_fits(arr, ranges, memory):
            gbps = [s.load_gbps for s in plan.stages]
            found.append(_plan_of(profile, topo, arr, ranges, plan.mapping, gbps, microbatches, mapping, memory))
    notes = list(dict.fromkeys(s.result.note for s in res.solutions if s.result.note))
    status = res.status + (f"; {notes[0]}" if notes else "")  # the first note says it; later ones differ in sizes
    used = "+".join(sorted({s.result.solver for s in res.solutions}))
    return found, SolverInfo(used, status, res.gap, 0.0, *res.size)


def _arena_fits(arr: LayerArrays, ranges: list[tuple[int, int]], memory: int) -> bool:
    """The runtime's arena rule, two weight slots of the largest stage + a gradient slot of the largest stage's
    gradients + each stage's activations and transients <= G. The MIP's per-stage rule with partial prefetch (which
    counts no transients) admits more cuts, which the runtime cannot run yet."""
    arena = arena_bytes(max(arr.params(a, b) for a, b in ranges), max(arr.grads(a, b) for a, b in ranges))
    return all(arena + arr.activations(a, b) + arr.transients(a, b) <= memory for a, b in ranges)


def _check_memory_known(topo: Topology) -> None:
    unknown = [g.index for g in topo.gpus if g.memory_bytes <= 0]
    if unknown:
        raise PlanInfeasibleError(
            f"topology {topo.name!r}: the memory of gpus {unknown} is unknown (0 bytes; "
            f"discovered without NVML?): save the topology with `mobiuspipe topology --save "
            f"server.yaml`, set each gpu's memory_bytes (e.g. 24GiB) and plan with it"
        )


def _stage_counts(num_stages: int | None, num_gpus: int, num_layers: int) -> list[int]:
    if num_stages is None:
        if num_layers < num_gpus:
            raise PlanInfeasibleError(
                f"the model has {num_layers} layers but there are {num_gpus} gpus; each gpu "
                f"needs at least one stage of one layer: use fewer gpus"
            )
        return list(range(num_gpus, num_layers + 1))
    if not num_gpus <= num_stages <= num_layers:
        raise PlanInfeasibleError(
            f"--stages {num_stages} is impossible: expected between the gpu count "
            f"({num_gpus}) and the layer count ({num_layers})"
        )
    return [num_stages]


def _plan_of(
    profile: Profile,
    topo: Topology,
    arr: LayerArrays,
    ranges: list[tuple[int, int]],
    m: list[int],
    gbps: list[float],
    microbatches: int,
    rule: str,
    memory: int,
) -> Plan:
    stages = tuple(stage_plan(arr, a, b, m[j], gbps[j]) for j, (a, b) in enumerate(ranges))
    slot = max(s.param_bytes for s in stages)
    sim = simulate(sim_stages(stages, topo), topo.num_gpus, microbatches, topology=topo)
    return Plan(
        model=profile.model,
        topology=topo.name,
        layout=topo,
        num_layers=arr.num_layers,
        num_gpus=topo.num_gpus,
        num_microbatches=microbatches,
        microbatch_size=profile.microbatch_size,
        dtype=profile.dtype,
        mapping_rule=rule,
        mapping_score=round(mapping_score(topo, m), 9),
        stages=stages,
        slot_bytes=slot,
        arena_bytes=arena_bytes(slot, max(s.gradient_bytes for s in stages)),
        activation_bytes=max(s.activation_bytes for s in stages),
        gpu_memory_bytes=memory,
        predicted_step_time_s=sim.step_time_s,
        solver=SolverInfo("dp", "optimal", 0.0, 0.0),
        input_bytes=profile.input_bytes,
        target_bytes=profile.target_bytes,
        workspace_bytes=profile.library_bytes,
        buffer_bytes=most_buffers(stages, topo.num_gpus),
    )


def _unless_all(part: int, whole: int) -> int | None:
    """`part`, or None when it is all of `whole` (every parameter trains: the plan file says nothing)."""
    return None if part == whole else part


def stage_plan(arr: LayerArrays, a: int, b: int, gpu: int, load_gbps: float) -> StagePlan:
    """The plan entry of the stage of layers a..b on `gpu`, its weights arriving at load_gbps (GB/s)."""
    return StagePlan(
        first=a,
        last=b,
        gpu=gpu,
        param_count=arr.param_count(a, b),
        param_bytes=slot_weight_bytes(arr.grads(a, b), arr.params(a, b) - arr.grads(a, b)),
        trainable_count=_unless_all(arr.trainable(a, b), arr.param_count(a, b)),
        grad_bytes=_unless_all(arr.grads(a, b), arr.params(a, b)),
        buffer_bytes=arr.buffers(a, b),
        transient_bytes=arr.transients(a, b),
        activation_bytes=arr.activations(a, b),
        output_bytes=int(arr.O[b]),
        fwd_s=arr.fwd(a, b),
        bwd_s=arr.bwd(a, b),
        load_gbps=load_gbps,
        recompute_s=arr.recompute(a, b),
        grad_s=arr.recompute(a, b),
        kept_s=arr.kept(a, b),
    )
