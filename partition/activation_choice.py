"""The activation policy of each stage of a plan, chosen under the device budget, and why (`--explain`).

Every stage starts at recompute from its input, on the path's own tier (the device on the CPU stand-in; the
host on a gpu, where the runtime copies the input off). If a gpu's walk (partition.lifetimes: arena, held
bytes, queued messages, the computing stage's live bytes) exceeds the budget G, the stages with the most
held bytes move them off the device, cheapest exposed transfer first, until it fits. Then, greedily, the
one-stage change that saves the most compute per step C_j (partition.activations: recompute R_j saved,
transfer X_j exposed) is taken while every gpu's walk stays within G, until no change saves time.

Legend (units in brackets): C_j, H_j, T_j, R_j, X_j as in partition.activations [s, bytes]; D_g the walk's
peak on gpu g [bytes]; G the budget: usable gpu memory [bytes].
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from foundation.units import fmt_bytes
from partition.activations import ActivationPolicy, Link, PolicyCost, fused_cost, options
from partition.costmodel import LayerArrays
from partition.device_peak import stage_bytes
from partition.lifetimes import device_peaks
from partition.plan import Plan
from partition.profile import Profile

__all__ = ["Considered", "Choice", "choose_activations"]


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
    """The chosen policy of every stage, with its figures, every gpu's peak D_g, and every option weighed."""

    costs: tuple[PolicyCost, ...]
    peaks: tuple[int, ...]
    considered: tuple[Considered, ...]

    @property
    def policies(self) -> tuple[ActivationPolicy, ...]:
        return tuple(c.policy for c in self.costs)


class _Walker:
    """D_g of a plan under a choice of policies, per gpu."""

    def __init__(self, plan: Plan, standin: bool):
        self.plan, self.standin = plan, standin
        self.base = stage_bytes(plan)
        self.extra = [b.work - s.activation_bytes for b, s in zip(self.base, plan.stages)]  # Y, I_0

    def peaks(self, costs: list[PolicyCost]) -> list[int]:
        plan = self.plan
        stages = [
            dataclasses.replace(b, held=c.held_bytes, work=c.work_bytes + e)
            for b, c, e in zip(self.base, costs, self.extra)
        ]
        swapped = frozenset(j for j, c in enumerate(costs) if c.policy.tier != "device")
        arena = None if self.standin else plan.arena_bytes
        peaks = device_peaks(plan.mapping, plan.num_microbatches, stages, arena, self.standin, swapped)
        return peaks + [arena or 0] * (plan.num_gpus - len(peaks))


def choose_activations(
    plan: Plan, profile: Profile, budget_bytes: int, links: dict[str, Link | None], standin: bool = False
) -> Choice:
    """Each stage's policy under budget_bytes per gpu; links: the tiers the runtime may use, each with its
    bandwidth from the device (None for "device"). ValueError when even moving every held byte off the
    device does not fit."""
    arr, m = LayerArrays.of(profile), plan.num_microbatches
    walker = _Walker(plan, standin)
    last = plan.num_stages - 1
    opts = [
        [fused_cost(arr, s.first, s.last, m, plan.input_bytes)]
        if j == last
        else options(arr, s.first, s.last, m, links, plan.input_bytes)
        for j, s in enumerate(plan.stages)
    ]
    home = "device" if standin or "host" not in links else "host"
    costs = [next((c for c in o if c.policy == ActivationPolicy(tier=home)), o[0]) for o in opts]
    costs = _fit(walker, opts, costs, budget_bytes)
    costs = _improve(walker, opts, costs, budget_bytes)
    peaks = walker.peaks(costs)
    return Choice(tuple(costs), tuple(peaks), tuple(_weigh(walker, plan, opts, costs, budget_bytes)))


def _fit(walker: _Walker, opts: list[list[PolicyCost]], costs: list[PolicyCost], budget: int) -> list[PolicyCost]:
    """Move held bytes off the device (recompute, the least exposed tier), most held first, until it fits."""
    costs = list(costs)
    order = sorted(range(len(costs)), key=lambda j: -costs[j].held_bytes)
    for j in order:
        if max(walker.peaks(costs)) <= budget:
            return costs
        off = [c for c in opts[j] if c.policy.mode == "recompute" and c.policy.tier != "device"]
        if off and costs[j].policy.tier == "device":
            costs[j] = min(off, key=lambda c: c.exposed_s)
    peaks = walker.peaks(costs)
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
        moves = sorted(  # the most time saved; on a tie, fewer bytes held, then no traffic (the device)
            (
                (costs[j].compute_s - c.compute_s, -c.held_bytes, c.policy.tier == "device", -j, -k)
                for j, o in enumerate(opts)
                for k, c in enumerate(o)
            ),
            reverse=True,
        )
        for gain, _, _, j, k in ((g, h, d, -j, -k) for g, h, d, j, k in moves):
            if gain <= 1e-12:
                return costs
            trial = costs[:j] + [opts[j][k]] + costs[j + 1 :]
            if max(walker.peaks(trial)) <= budget:
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
            peak = walker.peaks(costs[:j] + [c] + costs[j + 1 :])[g]
            rows.append(Considered(j, c, peak, _verdict(c, costs[j], peak, budget, g, len(o))))
    return rows


def _verdict(c: PolicyCost, chosen: PolicyCost, peak: int, budget: int, gpu: int, count: int) -> str:
    if c == chosen:
        if count == 1:
            return "chosen: the last stage's forward runs inside its backward"
        saved = c.recompute_s == 0.0 and c.exposed_s == 0.0
        return "chosen: no recompute, nothing exposed" if saved else "chosen: the fastest that fits"
    if peak > budget:
        return f"over gpu {gpu}'s budget by {fmt_bytes(peak - budget)}"
    slower = c.compute_s - chosen.compute_s
    if slower > 1e-12:
        return f"slower by {slower:.4g} s per step"
    return "as fast, holds more"
