"""The activation policy of each stage of a plan, chosen under the device budget, and why (`--explain`).

Every stage starts at recompute from its input, kept on the device (the runtime keeps it there on a gpu as on
the CPU stand-in). If a gpu's walk (partition.rules.lifetimes: arena, held bytes, queued messages, the computing
stage's live bytes) exceeds the budget G, the stages with the most held bytes move them off the device, cheapest
exposed transfer first, until it fits. Then, greedily, the one-stage change that saves the most compute per step
C_j (partition.rules.activations: recompute R_j saved, transfer X_j exposed) is taken while every gpu's walk stays
within G and what its stages hold on the host tier, sum of M H_j, within the host memory the states leave it
(partition.rules.tiers.activation_host_caps), until no change saves time. The same again from every input on the
host, where the run offers that tier (from the device, the inputs' bytes can keep the greedy steps from keeps that
moving them off would make room for): choose_activations keeps the start whose choice holds least over the host
caps, then computes least; make_plan (partition.search._best_choice) the one whose plan, its states placed,
predicts the shorter step.

Legend (units in brackets): C_j, H_j, T_j, R_j, X_j as in partition.rules.activations [s, bytes]; D_g the walk's
peak on gpu g [bytes]; G the budget: usable gpu memory [bytes]. "Within G" is D_g + N_g + C_g <= G, N_g the most
transients one of g's computing layers holds beyond the walk (Plan.transients_on, partition.rules.device_peak's X_g:
not this legend's X_j; 0 on the stand-in, whose ledger counts none), C_g the context a peer's process makes on gpu g
when it parks there (partition.rules.peer's C; 0 on the stand-in).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from foundation.units import fmt_bytes
from partition.plan import Plan
from partition.rules.activations import MODES, ActivationPolicy, Link, PolicyCost, fused_cost, options
from partition.rules.costmodel import LayerArrays
from partition.rules.device_peak import stage_bytes
from partition.rules.lifetimes import device_peak
from partition.rules.peer import CONTEXT_BYTES, peer_gpu, region_bytes
from partition.rules.tiers import ssd_info
from partition.spec.profile import Profile
from topology.types import Topology

__all__ = ["Considered", "Choice", "choose_activations", "runtime_links", "with_activations"]


@dataclass(frozen=True)
class Considered:
    """One option of one stage (a row of `partition --explain`): its figures, the peak of its gpu had it been
    chosen (the other stages as chosen), and why it was or was not chosen."""

    stage: int
    cost: PolicyCost
    peak_bytes: int
    verdict: str


@dataclass(frozen=True)
class Choice:
    """The chosen policy of every stage, with its figures, every gpu's peak D_g, and (with explain) every
    option weighed; needs: what each gpu must have free under it, held to the budget (D_g + N_g + C_g)."""

    costs: tuple[PolicyCost, ...]
    peaks: tuple[int, ...]
    considered: tuple[Considered, ...] = ()
    needs: tuple[int, ...] = ()

    @property
    def policies(self) -> tuple[ActivationPolicy, ...]:
        return tuple(c.policy for c in self.costs)


class _Walker:
    """D_g of a plan under a choice of policies, per gpu. A gpu's D_g depends only on the choices of the stages
    it runs and of those parked on it (the peer tier): each walk is kept under those choices, so the search's
    trials of another gpu's stages, and a trial weighed again, take no new walk."""

    def __init__(self, plan: Plan, standin: bool, host_caps: list[int] | None = None):
        self.plan, self.standin, self.host_caps = plan, standin, host_caps
        self.base = stage_bytes(plan)
        last = plan.num_stages - 1  # the work beyond T_j: the model's input on stage 0, the targets on the last
        self.extra = [
            (plan.input_bytes if j == 0 else 0) + (plan.target_bytes if j == last else 0) for j in range(last + 1)
        ]
        self.bearing = [  # per gpu, the stages whose choices its D_g depends on
            [j for j, s in enumerate(plan.stages) if g in (s.gpu, peer_gpu(s.gpu, plan.num_gpus))]
            for g in range(plan.num_gpus)
        ]
        self.walked: dict[tuple, int] = {}

    def peaks(self, costs: list[PolicyCost]) -> list[int]:
        """D_g of every gpu of the plan."""
        return [self.peak(costs, g) for g in range(self.plan.num_gpus)]

    def host(self, costs: list[PolicyCost], gpu: int) -> int:
        """Host bytes of gpu's stages' host tier at the turn from forwards to backwards: sum of M H_j."""
        m = self.plan.num_microbatches
        return sum(
            m * c.held_bytes for s, c in zip(self.plan.stages, costs) if s.gpu == gpu and c.policy.tier == "host"
        )

    def over_caps(self, costs: list[PolicyCost]) -> int:
        """Bytes the choice's host tier holds over the gpus' caps, summed (0 without caps)."""
        if self.host_caps is None:
            return 0
        return sum(max(0, self.host(costs, g) - cap) for g, cap in enumerate(self.host_caps))

    def host_fits(self, trial: list[PolicyCost], now: list[PolicyCost], gpu: int) -> bool:
        """trial's host bytes on gpu are within its cap, or no more than now's."""
        if self.host_caps is None:
            return True
        used = self.host(trial, gpu)
        return used <= self.host_caps[gpu] or used <= self.host(now, gpu)

    def peak(self, costs: list[PolicyCost], gpu: int) -> int:
        """D_g of one gpu (only its stages' choices count)."""
        key = (gpu, *(costs[j] for j in self.bearing[gpu]))
        if key not in self.walked:
            self.walked[key] = self._walk(costs, gpu)
        return self.walked[key]

    def _walk(self, costs: list[PolicyCost], gpu: int) -> int:
        plan = self.plan
        arena = None if self.standin else plan.arena_bytes
        if gpu not in plan.mapping:
            return (arena or 0) + self.region(costs, gpu)
        stages = [  # the walk reads only gpu's own stages
            dataclasses.replace(b, held=c.held_bytes, work=c.work_bytes + e, held_output=c.held_output)
            if g == gpu
            else b
            for b, c, e, g in zip(self.base, costs, self.extra, plan.mapping)
        ]
        swapped = frozenset(j for j, c in enumerate(costs) if c.policy.tier != "device")
        own = device_peak(plan.mapping, gpu, plan.num_microbatches, stages, arena, self.standin, swapped)
        return own + self.region(costs, gpu)

    def need(self, costs: list[PolicyCost], gpu: int) -> int:
        """What gpu must have free under a choice: its D_g and, on a gpu (not the stand-in), its stages' transients
        N_g and, where it gives a peer a region, the context the parking rank's process makes there
        (partition.rules.peer's C)."""
        if self.standin:
            return self.peak(costs, gpu)
        context = CONTEXT_BYTES if self.region(costs, gpu) > 0 else 0
        return self.peak(costs, gpu) + self.plan.transients_on(gpu) + context

    def needs(self, costs: list[PolicyCost]) -> list[int]:
        return [self.need(costs, g) for g in range(self.plan.num_gpus)]

    def region(self, costs: list[PolicyCost], gpu: int) -> int:
        """The bytes gpu gives its peers' stages on the peer tier (partition.rules.peer), the whole step."""
        plan, m = self.plan, self.plan.num_microbatches
        return sum(
            region_bytes(m, c.held_bytes)
            for s, c in zip(plan.stages, costs)
            if c.policy.tier == "peer" and peer_gpu(s.gpu, plan.num_gpus) == gpu
        )

    def affected(self, j: int, *options: PolicyCost) -> set[int]:
        """The gpus whose peak changes when stage j takes one of options instead of another: its own, and its
        peer's when one of them is on the peer tier."""
        g = self.plan.stages[j].gpu
        peer = any(c.policy.tier == "peer" for c in options)
        return {g, peer_gpu(g, self.plan.num_gpus)} if peer else {g}


def runtime_links(
    topo: Topology, tiers: tuple[str, ...] = ("host",)
) -> tuple[dict[str, Link | None], dict[str, tuple[str, ...]], bool]:
    """(links, the modes each tier runs, standin) of what the runtime runs on topo, with the tiers off the
    device in `tiers`: every mode on the device (a recompute stage's input stays there, on a gpu as on the CPU
    stand-in); every mode with its held bytes in host memory
    (mobiuspipe.memory.swap's HostSwap over the gpu's link: a recompute stage's input, a keep or selective
    stage's kept graphs and recomputed parts' inputs) or on the SSD (through the gpu's link and the drive,
    which the gpus share: each gets 1/G of its write and read GB/s, partition.rules.tiers.ssd_info; the run needs
    memory.ssd_dir) or in the peer gpu's memory (partition.rules.peer; with two gpus or more), whose region the
    walk counts on the peer."""
    gbps = min(g.link_gbps for g in topo.gpus)
    standin = all(g.name == "cpu-standin" for g in topo.gpus)
    links: dict[str, Link | None] = {"device": None, "host": Link(gbps, gbps)}
    if "ssd" in tiers:
        drive = ssd_info(topo).link
        links["ssd"] = Link(min(gbps, drive.write_gbps / topo.num_gpus), min(gbps, drive.read_gbps / topo.num_gpus))
    if "peer" in tiers and topo.num_gpus > 1:
        links["peer"] = Link(_peer_gbps(topo), _peer_gbps(topo))
    tiers = tuple(t for t in tiers if t != "peer" or topo.num_gpus > 1)
    unknown = sorted(set(tiers) - {"host", "ssd", "peer"})
    if unknown:
        raise ValueError(f"activation tiers {unknown}: the planner offers host, ssd and peer")
    runs: dict[str, tuple[str, ...]] = {t: MODES for t in ("device", *tiers)}
    return {t: links[t] for t in ("device", *tiers)}, runs, standin


def _peer_gbps(topo: Topology) -> float:
    """The slowest gpu's rate to its peer (partition.rules.peer): an NVLink's GB/s, else staged through host memory,
    the two copies in turn on one copy stream: 1 / (1 / own link + 1 / the peer's link)."""
    rates = []
    for g in topo.gpus:
        p = topo.gpus[peer_gpu(g.index, topo.num_gpus)]
        link = topo.nvlink(g.index, p.index)
        rates.append(link.gbps if link else 1.0 / (1.0 / g.link_gbps + 1.0 / p.link_gbps))
    return min(rates)


def with_activations(
    plan: Plan,
    profile: Profile,
    topo: Topology,
    budget_bytes: int,
    explain: bool = False,
    modes: dict[str, tuple[str, ...]] | None = None,
    host_caps: list[int] | None = None,
    tiers: tuple[str, ...] = ("host",),
    starts: tuple[str, ...] | None = None,
) -> tuple[Plan, Choice]:
    """The plan with each stage's chosen policy recorded (activations, kept_layers, activation_tier,
    held_bytes, recompute_s, work_bytes), and the choice (with explain: every option weighed); modes: the
    modes each tier may run, default what the runtime runs on topo ({"device": ("keep",)} with a large budget:
    the plan as it would be keeping every stage's activations, its walk in planned_device_bytes); host_caps:
    per gpu, the host memory its stages' host tier may hold (partition.rules.tiers.activation_host_caps); tiers:
    the tiers off the device the run offers (runtime_links); starts: choose_activations'."""
    links, runs, standin = runtime_links(topo, tiers)
    choice = choose_activations(
        plan, profile, budget_bytes, links, standin, runs if modes is None else modes, explain, host_caps, starts
    )
    stages = tuple(
        dataclasses.replace(
            s,
            activations=c.policy.mode,
            kept_layers=c.policy.keep_layers,
            activation_tier=c.policy.tier,
            held_bytes=c.held_bytes,
            recompute_s=c.recompute_s,
            work_bytes=c.work_bytes,
            forward_s=c.forward_s,
        )
        for s, c in zip(plan.stages, choice.costs)
    )
    return dataclasses.replace(plan, stages=stages), choice


def choose_activations(
    plan: Plan,
    profile: Profile,
    budget_bytes: int,
    links: dict[str, Link | None],
    standin: bool = False,
    modes: dict[str, tuple[str, ...]] | None = None,
    explain: bool = True,
    host_caps: list[int] | None = None,
    starts: tuple[str, ...] | None = None,
) -> Choice:
    """Each stage's policy under budget_bytes per gpu; links: the tiers the runtime may use, each with its
    bandwidth from the device (None for "device"); modes: the modes each tier may run (default all);
    explain: weigh every option against the choice (Choice.considered; one walk per option); host_caps: per
    gpu, the host bytes M H_j of its host-tier stages may take (None: unlimited; the start, which must fit
    the device, may exceed it: the tiers' placement then moves states to the SSD or names the shortfall); starts:
    the tiers whose every-input start the choice begins from (_best_start; default the device, and the host where
    it is offered). ValueError when even moving every held byte off the device does not fit."""
    arr, m = LayerArrays.of(profile), plan.num_microbatches
    walker = _Walker(plan, standin, host_caps)
    last = plan.num_stages - 1
    opts = [
        [fused_cost(arr, s.first, s.last, m, plan.input_bytes)]
        if j == last
        else [
            c
            for c in options(arr, s.first, s.last, m, links, plan.input_bytes)
            if modes is None or c.policy.mode in modes.get(c.policy.tier, ())
        ]
        for j, s in enumerate(plan.stages)
    ]
    homes = starts or (("device", "host") if "host" in links else ("device",))
    costs = _best_start(walker, opts, budget_bytes, homes)
    peaks = walker.peaks(costs)
    weighed = _weigh(walker, plan, opts, costs, budget_bytes) if explain else []
    return Choice(tuple(costs), tuple(peaks), tuple(weighed), tuple(walker.needs(costs)))


def _best_start(walker: _Walker, opts: list[list[PolicyCost]], budget: int, homes: tuple[str, ...]) -> list[PolicyCost]:
    """The fitted and improved choice over the starts that holds the least in host memory over the gpus' caps, then
    computes least per step: every stage recomputing with its input on each tier of `homes` in turn (the device
    first, which wins ties). One start is not enough: from the device, the inputs' bytes can keep the greedy steps
    from the keeps that moving them off would make room for; from the host, a plan whose inputs fit pays their
    transfers, and may stay over the host caps (the greedy takes no change that holds more). ValueError (_fit's) when
    no start fits."""

    def rank(costs: list[PolicyCost]) -> tuple[int, float]:
        return walker.over_caps(costs), sum(c.compute_s for c in costs)

    best: list[PolicyCost] | None = None
    best_rank = (0, 0.0)
    error: ValueError | None = None
    for home in homes:
        start = [
            next((c for c in o if c.policy == ActivationPolicy(tier=home)), min(o, key=lambda c: c.held_bytes))
            for o in opts
        ]
        try:
            costs = _improve(walker, opts, _fit(walker, opts, start, budget), budget)
        except ValueError as e:
            error = error or e
            continue
        ranked = rank(costs)
        if best is None or ranked < (best_rank[0], best_rank[1] - 1e-12):  # a tie keeps the earlier start
            best, best_rank = costs, ranked
    if best is None:
        assert error is not None
        raise error
    return best


def _fit(walker: _Walker, opts: list[list[PolicyCost]], costs: list[PolicyCost], budget: int) -> list[PolicyCost]:
    """Move held bytes off the device (recompute, the least exposed tier), most held first, until it fits."""
    costs = list(costs)
    order = sorted(range(len(costs)), key=lambda j: -costs[j].held_bytes)
    for j in order:
        if max(walker.needs(costs)) <= budget:
            return costs
        off = [c for c in opts[j] if c.policy.mode == "recompute" and c.policy.tier != "device"]
        if off and costs[j].policy.tier == "device":
            costs[j] = min(off, key=lambda c: c.exposed_s)
    peaks = walker.needs(costs)
    if max(peaks) > budget:
        g = max(range(len(peaks)), key=lambda x: peaks[x])
        raise ValueError(
            f"gpu {g} needs {fmt_bytes(peaks[g])} even with every stage's held activations off the device, "
            f"over its {fmt_bytes(budget)}: plan more stages or fewer microbatches"
        )
    return costs


def _improve(walker: _Walker, opts: list[list[PolicyCost]], costs: list[PolicyCost], budget: int) -> list[PolicyCost]:
    """Take the change that saves the most C_j and fits, until none does."""
    costs = list(costs)
    while True:
        moves = [(costs[j].compute_s - c.compute_s, c, j, k) for j, o in enumerate(opts) for k, c in enumerate(o)]
        # the most time saved; on a tie, fewer bytes held, then no traffic (the device), then the first stage
        moves.sort(key=lambda m: (-m[0], m[1].held_bytes, m[1].policy.tier != "device", m[2], m[3]))
        for gain, _, j, k in moves:
            if gain <= 1e-12:
                return costs
            trial = costs[:j] + [opts[j][k]] + costs[j + 1 :]
            g = walker.plan.stages[j].gpu
            fits = all(walker.need(trial, h) <= budget for h in walker.affected(j, costs[j], opts[j][k]))
            if fits and walker.host_fits(trial, costs, g):
                costs = trial
                break
        else:
            return costs


def _weigh(
    walker: _Walker, plan: Plan, opts: list[list[PolicyCost]], costs: list[PolicyCost], budget: int
) -> list[Considered]:
    """Every option of every stage against the choice: the gpu's peak had it been chosen, and why not."""
    rows = []
    for j, o in enumerate(opts):
        g = plan.stages[j].gpu
        for c in o:
            trial = costs[:j] + [c] + costs[j + 1 :]
            peak = max(walker.need(trial, h) for h in walker.affected(j, costs[j], c))
            host = None if walker.host_fits(trial, costs, g) else walker.host(trial, g)
            rows.append(Considered(j, c, peak, _verdict(c, costs[j], peak, budget, g, len(o), host, walker.host_caps)))
    return rows


def _verdict(
    c: PolicyCost,
    chosen: PolicyCost,
    peak: int,
    budget: int,
    gpu: int,
    count: int,
    host: int | None = None,
    caps: list[int] | None = None,
) -> str:
    """Why c was (or was not) chosen; host: gpu's host-tier bytes with c when over its cap (else None)."""
    if c == chosen:
        if count == 1:
            return "chosen: the last stage's forward runs inside its backward"
        saved = c.recompute_s == 0.0 and c.exposed_s == 0.0
        return "chosen: no recompute, nothing exposed" if saved else "chosen: the fastest that fits"
    if peak > budget:
        return f"over gpu {gpu}'s budget by {fmt_bytes(peak - budget)}"
    if host is not None and caps is not None:
        return f"over gpu {gpu}'s host memory for activations by {fmt_bytes(host - caps[gpu])}"
    slower = c.compute_s - chosen.compute_s
    if slower > 1e-12:
        return f"slower by {slower:.4g} s per step"
    return "as fast, holds more"
