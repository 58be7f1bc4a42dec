"""The activation policy chosen per stage (partition.rules.activation_choice): keep everything when memory is
plenty, recompute when it is tight, held bytes off the device when even that does not fit; the choice fits
every gpu's walk, no single change would fit and save time, and its total is within 6% of exhaustive search
on small plans (exact in 239 of 246 budgets and links swept; printed with -s)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from foundation.units import fmt_bytes
from partition.rules.activation_choice import _Walker, choose_activations, runtime_links, with_activations
from partition.rules.activations import Link, fused_cost, options
from partition.rules.costmodel import LayerArrays
from partition.rules.device_peak import planned_device_bytes
from partition.rules.tiers import (
    SSD_READ_GBPS,
    SSD_WRITE_GBPS,
    HostBudget,
    activation_host_caps,
    host_held_bytes,
    place_tiers,
)
from partition.search import make_plan
from partition.spec.profile import LayerProfile, Profile
from topology import cpu_standin

LINKS: dict[str, Link | None] = {"device": None, "host": Link(10.0, 10.0)}


def _profile(n: int = 5) -> Profile:
    def layer(k):
        return LayerProfile(
            f"l{k}", 100 + k, 400 + 4 * k, 3000 + 500 * k, 64 + 8 * k, 0.0, 0.0, 1e-3 * (1 + k % 3), 2e-3
        )

    return Profile(
        "toy", "cpu-standin", "fp32", 2, 1, tuple(layer(k) for k in range(n)), input_bytes=32, target_bytes=24
    )


def _plan(gpus: int = 1, stages: int = 3):
    return make_plan(_profile(), cpu_standin(gpus, 1 << 30), 3, num_stages=stages, solver="dp")


def _options(plan, profile, links):
    arr, m = LayerArrays.of(profile), plan.num_microbatches
    last = plan.num_stages - 1
    return [
        [fused_cost(arr, s.first, s.last, m, plan.input_bytes)]
        if j == last
        else options(arr, s.first, s.last, m, links, plan.input_bytes)
        for j, s in enumerate(plan.stages)
    ]


def _exhaustive(plan, profile, budget, links):
    """The least sum of C_j over every combination of every stage's options that fits, by brute force."""
    opts = _options(plan, profile, links)
    walker = _Walker(plan, standin=True)
    best = None
    for combo in itertools.product(*opts):
        if max(walker.peaks(list(combo))) <= budget:
            total = sum(c.compute_s for c in combo)
            best = total if best is None else min(best, total)
    return best


def test_plenty_of_memory_keeps_everything_on_the_device():
    plan, profile = _plan(), _profile()
    got = choose_activations(plan, profile, 1 << 30, LINKS, standin=True)
    assert [p.mode for p in got.policies] == ["keep", "keep", "keep"] and all(p.tier == "device" for p in got.policies)
    assert all(c.recompute_s == 0 for c in got.costs[:-1])  # the last runs its forward inside its backward
    rows = [r for r in got.considered if r.stage == 0 and r.cost.policy.mode == "recompute"]
    assert rows and all(r.verdict.startswith("slower by") for r in rows)


@pytest.mark.parametrize("gpus,stages", [(1, 3), (2, 4)])
def test_the_budget_decides_and_the_choice_is_locally_and_globally_best(gpus, stages):
    plan, profile = _plan(gpus, stages), _profile()
    most = max(choose_activations(plan, profile, 10**12, {"device": None}, standin=True).peaks)
    slow: dict[str, Link | None] = {"device": None, "host": Link(2e-6, 2e-6)}
    alone: dict[str, Link | None] = {"device": None}  # a swap exposes about as much as a recompute costs
    chosen, ratios = set(), []
    for links in (alone, LINKS, slow):
        for budget in range(most // 3, most + 1, most // 60):
            try:
                got = choose_activations(plan, profile, budget, links, standin=True)
            except ValueError as e:
                assert "even with every stage's held activations off the device" in str(e)
                continue
            assert max(got.peaks) <= budget
            best = _exhaustive(plan, profile, budget, links)
            assert best is not None
            ratios.append(sum(c.compute_s for c in got.costs) / best)
            for r in got.considered:  # no option that fits is faster than the chosen one of its stage
                assert r.peak_bytes > budget or r.cost.compute_s >= got.costs[r.stage].compute_s - 1e-12, r
            chosen.add(tuple((p.mode, p.tier) for p in got.policies[:-1]))
    print(
        f"greedy / exhaustive: worst {max(ratios):.4f}, exact in {sum(r < 1 + 1e-9 for r in ratios)} of {len(ratios)}"
    )
    assert min(ratios) > 1 - 1e-9 and max(ratios) < 1.06
    modes = {m for c in chosen for m, _ in c}
    assert modes == {"recompute", "selective", "keep"} and {t for c in chosen for _, t in c} == {"device", "host"}


def test_tight_memory_recomputes_and_a_too_small_budget_is_named():
    plan, profile = _plan(), _profile()
    opts = _options(plan, profile, {"device": None})
    tight = max(_Walker(plan, standin=True).peaks([o[0] for o in opts]))  # all recompute: the device's least
    got = choose_activations(plan, profile, tight, {"device": None}, standin=True)
    assert max(got.peaks) <= tight
    keep = [r for r in got.considered if r.cost.policy.mode == "keep" and r.stage < 2]
    assert any(r.verdict.startswith("over gpu 0's budget by") for r in keep)
    with pytest.raises(ValueError, match="gpu 0 needs .* even with every stage's held activations off the device"):
        choose_activations(plan, profile, 1000, LINKS, standin=True)


def test_the_plan_records_the_choice_and_predicts_its_step():
    profile, topo = _profile(), cpu_standin(2, 1 << 30)
    auto = make_plan(profile, topo, 3, num_stages=4, solver="dp")
    plain = make_plan(profile, topo, 3, num_stages=4, solver="dp", activations="recompute")
    assert [s.activations for s in auto.stages] == ["keep"] * 4 and [s.recompute_s for s in auto.stages[:-1]] == [
        0.0
    ] * 3
    assert [s.activations for s in plain.stages] == ["recompute"] * 4
    assert auto.predicted_step_time_s < plain.predicted_step_time_s  # no forward redone in the backward


def test_with_activations_restricted_to_keep_records_keeps_walk():
    """modes={"device": ("keep",)} under a large budget: every stage recorded as keep, and the plan's walk is
    the keep choice's (what a benchmark compares recompute and the planner's choice against)."""
    plan, profile, topo = _plan(), _profile(), cpu_standin(1, 1 << 30)
    kept, choice = with_activations(plan, profile, topo, 10**12, modes={"device": ("keep",)})
    assert [s.activations for s in kept.stages] == ["keep"] * 3
    assert planned_device_bytes(kept, standin=True) == list(choice.peaks)
    chosen, _ = with_activations(plan, profile, topo, 10**12)  # plenty: the choice keeps too, the same walk
    assert planned_device_bytes(chosen, standin=True) == planned_device_bytes(kept, standin=True)
    recompute, _ = with_activations(plan, profile, topo, 10**12, modes={"device": ("recompute",)})
    assert [s.activations for s in recompute.stages] == ["recompute", "recompute", "keep"]  # the last: fused
    assert planned_device_bytes(recompute, standin=True) < planned_device_bytes(kept, standin=True)


def test_the_host_tier_stays_within_the_host_memory_left_for_activations():
    """Keep-on-host saves every recompute when the device is tight; host_caps bound what the host tier holds
    (M H_j per host stage): 0 allows none, one stage's bytes allow that stage only; the rest are named."""
    plan, profile = _plan(), _profile()
    modes = {"device": ("recompute",), "host": ("recompute", "selective", "keep")}
    opts = _options(plan, profile, {"device": None})
    tight = max(_Walker(plan, standin=True).peaks([o[0] for o in opts]))
    free = choose_activations(plan, profile, tight, LINKS, standin=True, modes=modes)
    assert ("keep", "host") in [(p.mode, p.tier) for p in free.policies[:-1]]
    none = choose_activations(plan, profile, tight, LINKS, standin=True, modes=modes, host_caps=[0])
    assert [(p.mode, p.tier) for p in none.policies[:-1]] == [("recompute", "device")] * 2
    over = [r for r in none.considered if r.cost.policy.tier == "host" and r.peak_bytes <= tight]
    m = plan.num_microbatches
    assert over and all(
        r.verdict == f"over gpu 0's host memory for activations by {fmt_bytes(m * r.cost.held_bytes)}" for r in over
    )
    one = min(m * c.held_bytes for c in free.costs[:-1] if c.policy.tier == "host")
    got = choose_activations(plan, profile, tight, LINKS, standin=True, modes=modes, host_caps=[one])
    held = [m * c.held_bytes for c in got.costs[:-1] if c.policy.tier == "host"]
    assert held and sum(held) <= one
    assert (
        sum(c.compute_s for c in none.costs)
        > sum(c.compute_s for c in got.costs)
        >= sum(c.compute_s for c in free.costs)
    )


def test_the_tiers_count_what_the_choice_holds_in_host_memory():
    """place_tiers: a stage on the host tier holds M x its held bytes in host memory; on the device nothing; a
    plan without the choice (tier auto) its input, as the runtime's path did."""
    plan = _plan()
    m, inp = plan.num_microbatches, plan.stages[0].output_bytes
    stages = list(plan.stages)
    stages[0] = dataclasses.replace(stages[0], activations="keep", activation_tier="host", held_bytes=1234)
    stages[1] = dataclasses.replace(stages[1], activations="recompute", activation_tier="device", held_bytes=inp)
    mine = dataclasses.replace(plan, stages=tuple(stages))
    assert [host_held_bytes(mine, j) for j in range(3)] == [1234, 0, 0]
    assert place_tiers(mine, HostBudget(None, "unlimited")).host_by_kind["saved_inputs"] == m * 1234
    legacy = dataclasses.replace(
        plan, stages=tuple(dataclasses.replace(s, activation_tier="auto") for s in plan.stages)
    )
    assert [host_held_bytes(legacy, j) for j in range(3)] == [0, inp, plan.stages[1].output_bytes]
    caps = activation_host_caps(plan, HostBudget(10**9, "test"))
    assert caps == [10**9 - sum(16 * s.param_count for s in plan.stages)]  # fp32: master + moments + grads
    assert activation_host_caps(plan, HostBudget(None, "unknown")) == [0]


def test_the_ssd_tier_holds_what_the_host_cannot():
    """With no host memory left for activations, keep-on-SSD saves the recompute when the drive keeps up; the
    drive's GB/s are shared by the gpus (runtime_links), and the tier is offered only when asked for."""
    plan, profile = _plan(), _profile()
    opts = _options(plan, profile, {"device": None})
    tight = max(_Walker(plan, standin=True).peaks([o[0] for o in opts]))
    all_modes = ("recompute", "selective", "keep")
    modes = {"device": ("recompute",), "host": all_modes, "ssd": all_modes}
    links = {**LINKS, "ssd": Link(10.0, 10.0)}
    got = choose_activations(plan, profile, tight, links, standin=True, modes=modes, host_caps=[0])
    tiers = [(p.mode, p.tier) for p in got.policies[:-1]]
    assert ("keep", "ssd") in tiers and all(t != "host" for _, t in tiers)
    topo = cpu_standin(2, 1 << 30)
    gbps = min(g.link_gbps for g in topo.gpus)
    links2, runs, _ = runtime_links(topo, ("host", "ssd"))
    assert links2["ssd"] == Link(min(gbps, SSD_WRITE_GBPS / 2), min(gbps, SSD_READ_GBPS / 2))
    assert runs["ssd"] == all_modes and "ssd" not in runtime_links(topo)[0]
    with pytest.raises(ValueError, match=r"activation tiers \['nvme'\]: the planner offers host, ssd and peer"):
        runtime_links(topo, ("host", "nvme"))


def test_the_peer_tier_is_chosen_within_both_gpus_budgets():
    """With no host memory for activations, keeping a stage's graphs in the other gpu's memory saves its
    recompute where that gpu has room: over a ladder of budgets the choice sometimes parks on the peer, every
    gpu's walk (the regions it gives included) stays within the budget, and the plan's walk agrees."""
    plan, profile, topo = _plan(2, 4), _profile(), cpu_standin(2, 1 << 30)
    every = ("recompute", "selective", "keep")
    modes = {"device": ("recompute",), "host": every, "peer": every}  # no keeping on the device itself
    most = max(choose_activations(plan, profile, 10**12, {"device": None}, standin=True).peaks)
    parked = 0
    for budget in range(most // 3, most + 1, most // 40):
        try:
            chosen, choice = with_activations(
                plan, profile, topo, budget, modes=modes, host_caps=[0, 0], tiers=("host", "peer")
            )
        except ValueError:
            continue
        assert max(choice.peaks) <= budget
        assert planned_device_bytes(chosen, standin=True) == list(choice.peaks)
        parked += any(s.activation_tier == "peer" for s in chosen.stages)
    assert parked
    one = cpu_standin(1, 1 << 30)
    assert "peer" not in runtime_links(one, ("host", "peer"))[0]  # one gpu has no peer


def test_the_last_stage_holds_its_input_from_forward_to_backward():
    """Its forward runs inside its backward, so each microbatch's input waits on the device in between: H = I (the
    previous layer's output; the model's input when the last stage is the only one)."""
    arr = LayerArrays.of(_profile())
    assert fused_cost(arr, 3, 4, 2).held_bytes == _profile().layers[2].output_bytes
    assert fused_cost(arr, 0, 4, 2, input_bytes=32).held_bytes == 32


def test_a_gpu_offers_and_starts_from_recompute_on_the_device_as_the_stand_in_does():
    """compute.fwd keeps a recompute stage's input on the device on a gpu as on the stand-in (since the first GPU run);
    the planner on a gpu still started every stage at recompute on the host and never offered recompute on the
    device, as if the runtime copied the input off: each such input crossed the link twice a microbatch, page-locked
    host memory and used the host's caps, where leaving it in place fit."""
    from topology.presets import preset

    _, runs, standin = runtime_links(preset("4"))
    assert not standin and set(runs["device"]) == {"recompute", "selective", "keep"}
    plan, profile = _plan(), _profile()
    opts = _options(plan, profile, {"device": None})
    tight = max(_Walker(plan, standin=False).peaks([o[0] for o in opts]))  # every stage recomputing on the device
    got = choose_activations(plan, profile, tight, LINKS, standin=False, modes=runs)
    recomputing = [p.tier for p in got.policies if p.mode == "recompute"]
    assert recomputing and set(recomputing) == {"device"}  # an input is moved off only where that buys a keep


def _toy(layers: list[tuple[int, int, float]]) -> Profile:
    """A profile of layers (activation_bytes, output_bytes, fwd_s), each backward 2 ms."""
    ls = tuple(LayerProfile(f"l{k}", 100, 400, a, o, 0.0, 0.0, f, 2e-3) for k, (a, o, f) in enumerate(layers))
    return Profile("toy", "cpu-standin", "fp32", 2, 1, ls, input_bytes=32, target_bytes=24)


@pytest.mark.parametrize(
    "layers,budget,better",
    [
        # a stage's 20 kB input on the device leaves no room to keep the costly layer after it: only from the host
        (
            [(9000, 5000, 1e-3), (1000, 5000, 1e-3), (1000, 64, 1e-3), (1000, 20000, 5e-3), (1000, 64, 1e-3)],
            107602,
            "host",
        ),
        # where the inputs fit, the host start pays a transfer the device start does not
        ([(3000, 20000, 1e-4), (3000, 64, 1e-4), (9000, 64, 5e-3), (3000, 64, 1e-4)], 135379, "device"),
    ],
)
def test_the_choice_takes_the_better_of_the_two_starts(layers, budget, better):
    """From every input on the device the greedy cannot move inputs off to make room for keeps (it takes only
    changes that save compute), and from the host it pays transfers where the inputs fit: the choice computes what
    the better start does (gpt3-175b on preset 2+2: 83.36 s a step from the device alone, 82.78 s with both)."""
    from partition.rules.activation_choice import _best_start

    profile = _toy(layers)
    plan = make_plan(profile, cpu_standin(1, 1 << 30), 3, num_stages=4, solver="dp")
    opts, walker = _options(plan, profile, LINKS), _Walker(plan, standin=False)
    total = {h: sum(c.compute_s for c in _best_start(walker, opts, budget, (h,))) for h in ("device", "host")}
    worse = "device" if better == "host" else "host"
    assert total[better] < total[worse] - 1e-9
    got = _best_start(walker, opts, budget, ("device", "host"))
    assert sum(c.compute_s for c in got) == pytest.approx(total[better], abs=1e-12)


def test_a_start_over_the_host_caps_loses_to_one_within_them():
    """The host start puts every input on the host and its greedy takes no change that holds more, so it can end over
    the host memory the states leave the activations while computing less: the device start's choice, within them,
    is kept (the caps are the room place_tiers then needs; over them states go to the SSD or the plan is refused)."""
    from partition.rules.activation_choice import _best_start

    layers = [(1000, 20000, 1e-4), (3000, 64, 1e-3), (3000, 5000, 5e-3), (3000, 64, 1e-4), (3000, 64, 1e-3)]
    profile = _toy(layers)
    plan = make_plan(profile, cpu_standin(1, 1 << 30), 3, num_stages=4, solver="dp")
    links: dict[str, Link | None] = {"device": None, "host": Link(0.01, 10.0)}
    opts, walker = _options(plan, profile, links), _Walker(plan, standin=True, host_caps=[0])
    budget = 84488
    device, host = (_best_start(walker, opts, budget, (h,)) for h in ("device", "host"))
    assert walker.host(device, 0) == 0 < walker.host(host, 0)
    assert sum(c.compute_s for c in host) < sum(c.compute_s for c in device)  # faster, but over the caps
    got = _best_start(walker, opts, budget, ("device", "host"))
    assert walker.host(got, 0) == 0 and got == device
