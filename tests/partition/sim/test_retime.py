"""A plan re-timed from another profile (partition.sim.retime): the same profile gives the plan's own times back,
a profile twice as slow doubles every time, and the cut, mapping, policies and bytes never change."""

from __future__ import annotations

import dataclasses
import random

import pytest

from partition.rules.activation_choice import with_activations
from partition.search import make_plan
from partition.sim.retime import retime
from partition.spec.profile import LayerProfile, Profile
from topology import cpu_standin

TIMES = ("fwd_s", "bwd_s", "recompute_s", "forward_s", "grad_s", "kept_s")


def _profile(n: int, seed: int, scale: float = 1.0) -> Profile:
    rng = random.Random(seed)

    def layer(k: int) -> LayerProfile:
        f = rng.uniform(0.5e-3, 3e-3)
        return LayerProfile(
            f"l{k}",
            100 + k,
            400 + 4 * k,
            rng.randrange(1000, 9000),
            rng.randrange(32, 256),
            0.0,
            0.0,
            f * scale,
            rng.uniform(1.5, 2.5) * f * scale,
            recompute_s=1.2 * f * scale,
            kept_s=1.3 * f * scale,
        )

    return Profile("toy", "cpu-standin", "fp32", 2, 1, tuple(layer(k) for k in range(n)), input_bytes=32)


def _plans(n: int, seed: int):
    """A plan before the activation choice, and the same plan after it under a budget that mixes policies."""
    profile = _profile(n, seed)
    topo = cpu_standin(2, 1 << 30)
    plan = make_plan(profile, topo, 3, num_stages=4, mapping="cross", solver="dp")
    plain = dataclasses.replace(
        plan,
        stages=tuple(
            dataclasses.replace(
                s, activations="recompute", activation_tier="auto", held_bytes=-1, forward_s=None, recompute_s=s.grad_s
            )
            for s in plan.stages
        ),
    )
    return profile, plain, plan, _mixed(plan, profile, topo)


def _mixed(plan, profile, topo):
    """The plan's choice under the largest budget (bytes) that makes some stage give up keeping everything."""
    for budget in range(200_000, 1_000, -1_000):
        try:
            chosen = with_activations(plan, profile, topo, budget)[0]
        except ValueError:  # no policy fits: the budgets below do not either
            break
        if {s.activations for s in chosen.stages[:-1]} != {"keep"}:
            return chosen
    raise AssertionError("no budget mixes the policies of this plan")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_same_profile_gives_the_plans_own_times(seed):
    profile, plain, chosen, tight = _plans(7 + seed, seed)
    for plan in (plain, chosen, tight):
        again = retime(plan, profile)
        for s, t in zip(plan.stages, again.stages):
            for name in TIMES:
                want, got = getattr(s, name), getattr(t, name)
                assert got == (None if want is None else pytest.approx(want, rel=1e-12, abs=1e-15)), (name, s, t)


@pytest.mark.parametrize("seed", [3, 4])
def test_a_slower_profile_scales_every_time_and_nothing_else(seed):
    profile, _, chosen, tight = _plans(9, seed)
    slow = _profile(9, seed, scale=2.0)
    for plan in (chosen, tight):
        again = retime(plan, slow)
        for s, t in zip(plan.stages, again.stages):
            for name in TIMES:
                assert getattr(t, name) == pytest.approx(2.0 * getattr(s, name), rel=1e-12, abs=1e-15), name
            assert dataclasses.replace(t, **{k: getattr(s, k) for k in TIMES}) == s
        assert dataclasses.replace(again, stages=plan.stages) == plan


def test_another_models_profile_is_refused():
    profile, plain, _, _ = _plans(7, 0)
    with pytest.raises(ValueError, match="the profile has 8 layers and the plan 7"):
        retime(plain, _profile(8, 0))
