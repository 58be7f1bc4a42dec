"""A plan's stage times from another profile of the same model: the cut, mapping, activation policies and bytes
stay, every per-microbatch time is summed again from the new profile (partition.rules.costmodel,
partition.rules.activations).

Symbols of partition.rules.activations for stage j = layers a..b: F_j, B_j, R_j (the forward a recompute's backward
redoes, over the stage's recomputed segments), K_j (the forward as a keep F runs it), F'_j (F as the stage's
policy runs it). A plan made before the activation choice (held_bytes -1) keeps that form: its recompute_s is
R_j of the whole stage. The last stage is fused (its forward runs inside its backward): recompute_s is its R_j
and, after the choice, forward_s is 0. predicted_step_time_s is left as it was: partition.search.predict_step
simulates the re-timed plan.
"""

from __future__ import annotations

import dataclasses

from partition.plan import Plan, StagePlan
from partition.rules.activations import ActivationPolicy, policy_cost
from partition.rules.costmodel import LayerArrays
from partition.spec.profile import Profile

__all__ = ["retime"]


def retime(plan: Plan, profile: Profile) -> Plan:
    """The plan with every stage's times (fwd_s, bwd_s, recompute_s, forward_s, grad_s, kept_s) from `profile`.

    Raises ValueError when the profile has another number of layers than the plan."""
    if len(profile.layers) != plan.num_layers:
        raise ValueError(
            f"the profile has {len(profile.layers)} layers and the plan {plan.num_layers}: re-time a plan with a "
            f"profile of the model it was made for"
        )
    arr = LayerArrays.of(profile)
    last = plan.num_stages - 1
    return dataclasses.replace(plan, stages=tuple(_stage(arr, s, j == last, plan) for j, s in enumerate(plan.stages)))


def _stage(arr: LayerArrays, s: StagePlan, last: bool, plan: Plan) -> StagePlan:
    a, b = s.first, s.last
    whole = arr.recompute(a, b)
    times = {"fwd_s": arr.fwd(a, b), "bwd_s": arr.bwd(a, b), "grad_s": whole, "kept_s": arr.kept(a, b)}
    if s.held_bytes < 0:  # before the activation choice: the whole forward redone, F without grad
        return dataclasses.replace(s, **times, recompute_s=whole)
    if last:
        return dataclasses.replace(s, **times, recompute_s=whole, forward_s=0.0)
    policy = ActivationPolicy(s.activations, s.kept_layers)  # on the device: the times do not depend on the tier
    cost = policy_cost(arr, a, b, plan.num_microbatches, policy, None, plan.input_bytes)
    return dataclasses.replace(s, **times, recompute_s=cost.recompute_s, forward_s=cost.forward_s)
