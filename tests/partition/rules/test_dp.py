"""The exact DP against exhaustive enumeration of every cut, on random small profiles."""

import dataclasses
import itertools
import math

import numpy as np
import pytest

from partition.rules.costmodel import ARENA_SLOTS, LayerArrays, arena_bytes, stage_cost
from partition.rules.dp import interval_matrices, solve_dp
from partition.spec.profile import LayerProfile, Profile


def _profile(params, acts, outs, fwds, bwds, transients=None) -> Profile:
    xs = [0] * len(params) if transients is None else transients
    layers = tuple(
        LayerProfile(
            name=f"l{i}",
            param_count=int(p) // 2,
            param_bytes=int(p),
            activation_bytes=int(a),
            output_bytes=int(o),
            fwd_flops=0.0,
            bwd_flops=0.0,
            fwd_s=float(f),
            bwd_s=float(b),
            workspace_bytes=int(x),
        )
        for i, (p, a, o, f, b, x) in enumerate(zip(params, acts, outs, fwds, bwds, xs))
    )
    return Profile(model="rand", device="dev", dtype="fp16", microbatch_size=1, seq_len=1, layers=layers)


def _random_profile(rng: np.random.Generator, L: int) -> Profile:
    return _profile(
        rng.integers(1, 1000, L),
        rng.integers(0, 1000, L),
        rng.integers(0, 600, L),
        rng.uniform(1e-4, 1e-2, L),
        rng.uniform(1e-4, 2e-2, L),
        rng.integers(0, 800, L) * rng.integers(0, 2, L),  # X_l, 0 for about half the layers
    )


def _need(arr: LayerArrays, a: int, b: int) -> int:
    """The memory rule's need beyond the arena of a stage of layers a..b: A_j + X_j."""
    return arr.activations(a, b) + arr.transients(a, b)


def _enumerate(arr: LayerArrays, memory: int, m: int, gbps: float, s: int):
    """(best bottleneck, all feasible cuts achieving it) by brute force, with the legend's rule verbatim."""
    L = arr.num_layers
    best, argbest = math.inf, []
    for inner in itertools.combinations(range(1, L), s - 1):
        cuts = (0, *inner, L)
        ranges = [(cuts[j], cuts[j + 1] - 1) for j in range(s)]
        W = max(arr.params(a, b) for a, b in ranges)
        if any(ARENA_SLOTS * W + _need(arr, a, b) > memory for a, b in ranges):
            continue
        c = max(stage_cost(arr, a, b, m, gbps) for a, b in ranges)
        if c < best:
            best, argbest = c, [cuts]
        elif c == best:
            argbest.append(cuts)
    return best, argbest


def _check_solution(arr, memory, m, gbps, sol, s):
    L = arr.num_layers
    assert sol.num_stages == s and len(sol.cuts) == s + 1
    assert sol.cuts[0] == 0 and sol.cuts[-1] == L
    assert all(sol.cuts[j] < sol.cuts[j + 1] for j in range(s)), sol.cuts
    W = max(arr.params(a, b) for a, b in sol.ranges)
    assert W <= sol.slot_bytes
    for a, b in sol.ranges:
        assert ARENA_SLOTS * W + _need(arr, a, b) <= memory
        assert ARENA_SLOTS * sol.slot_bytes + _need(arr, a, b) <= memory
    achieved = max(stage_cost(arr, a, b, m, gbps) for a, b in sol.ranges)
    assert achieved == pytest.approx(sol.bottleneck_s, rel=1e-12, abs=0)


def _memories(arr: LayerArrays, rng: np.random.Generator) -> list[int]:
    """Budgets from 'nothing fits' through 'some cuts fit' to 'everything fits'."""
    L = arr.num_layers
    need = sorted({ARENA_SLOTS * arr.params(a, b) + _need(arr, a, b) for a in range(L) for b in range(a, L)})
    picks = [need[0] - 1, need[0], need[-1]]
    picks += [int(x) for x in rng.choice(need, size=min(4, len(need)), replace=False)]
    picks += [int(x) + 1 for x in rng.choice(need, size=min(2, len(need)), replace=False)]
    return sorted(set(picks))


@pytest.mark.parametrize("seed", [1, 7, 23, 101, 4099])
def test_dp_matches_exhaustive_enumeration(seed):
    rng = np.random.default_rng(seed)
    checked = infeasible = 0
    for L in range(1, 11):
        arr = LayerArrays.of(_random_profile(rng, L))
        m = int(rng.choice([1, 3, 5]))
        gbps = float(rng.choice([1e-4, 1e-3, 0.01]))  # byte counts are small: keep loads comparable to compute
        for memory in _memories(arr, rng):
            got = solve_dp(arr, memory, m, gbps, list(range(1, L + 1)))
            assert set(got) <= set(range(1, L + 1))
            for s in range(1, L + 1):
                best, argbest = _enumerate(arr, memory, m, gbps, s)
                if math.isinf(best):
                    assert s not in got, (L, memory, s, got.get(s))
                    infeasible += 1
                    continue
                assert s in got, (L, memory, s, best, argbest)
                sol = got[s]
                assert sol.bottleneck_s == pytest.approx(best, rel=1e-12, abs=0)
                _check_solution(arr, memory, m, gbps, sol, s)
                checked += 1
    assert checked > 50 and infeasible > 10  # the budgets really exercise both sides of the memory rule


@pytest.mark.parametrize("seed", [3, 17, 71])
def test_dp_subset_of_stage_counts_and_out_of_range(seed):
    """Asking for a few S gives the same answers as asking for all; S > L or S = 0 is simply absent."""
    rng = np.random.default_rng(seed)
    L = 7
    arr = LayerArrays.of(_random_profile(rng, L))
    memory = max(ARENA_SLOTS * arr.params(a, b) + _need(arr, a, b) for a in range(L) for b in range(a, L))
    full = solve_dp(arr, memory, 3, 1e-3, list(range(1, L + 1)))
    assert set(full) == set(range(1, L + 1))  # everything fits
    part = solve_dp(arr, memory, 3, 1e-3, [0, 2, 5, L + 1, L + 4])
    assert set(part) == {2, 5}
    for s in (2, 5):
        assert part[s].bottleneck_s == full[s].bottleneck_s


def test_activation_of_a_merged_stage_can_be_below_every_single_layer():
    """A_j counts only the stage's boundary outputs, so merging a layer with a huge output can make a cut fit
    that no single layer fits. The DP must not prune that slot size away."""
    # layer 0 writes a huge output that layer 1 consumes; layer 1's own output is tiny.
    prof = _profile(params=[10, 10], acts=[0, 0], outs=[1000, 1], fwds=[1.0, 1.0], bwds=[1.0, 1.0])
    arr = LayerArrays.of(prof)
    assert arr.activations(0, 0) == 1000 and arr.activations(1, 1) == 1001 and arr.activations(0, 1) == 1
    memory = ARENA_SLOTS * 20 + 1
    got = solve_dp(arr, memory, 1, 1.0, [1, 2])
    assert set(got) == {1}
    assert got[1].cuts == (0, 2) and got[1].slot_bytes == 20
    assert got[1].bottleneck_s == pytest.approx(6.0, rel=1e-12)


def test_single_layer_and_all_fit_tie_breaks_to_smaller_slot():
    # Two identical cheap-load layers: S=1 has slot 20, S=2 slot 10; within one S the smaller slot wins ties.
    prof = _profile(params=[10, 10, 10], acts=[5, 5, 5], outs=[1, 1, 1], fwds=[0.5, 0.5, 0.5], bwds=[1, 1, 1])
    arr = LayerArrays.of(prof)
    got = solve_dp(arr, 10**6, 1, 1.0, [1, 2, 3])
    assert got[1].cuts == (0, 3) and got[1].slot_bytes == 30 and got[1].bottleneck_s == 6.0
    assert got[3].cuts == (0, 1, 2, 3) and got[3].slot_bytes == 10 and got[3].bottleneck_s == 2.0
    assert got[2].bottleneck_s == 4.0 and got[2].slot_bytes == 20


def test_interval_matrices_match_layer_arrays():
    rng = np.random.default_rng(5)
    L = 9
    arr = LayerArrays.of(_random_profile(rng, L))
    P, A, C = interval_matrices(arr, 3, 1e-3)
    for k in range(L + 1):
        for l in range(L + 1):
            if l <= k:
                assert math.isinf(C[k, l])
                continue
            assert P[k, l] == arr.params(k, l - 1)
            assert A[k, l] == arr.activations(k, l - 1)
            assert C[k, l] == pytest.approx(stage_cost(arr, k, l - 1, 3, 1e-3), rel=1e-12, abs=0)


def _lora_profile(rng: np.random.Generator, L: int) -> Profile:
    """A random profile whose layers train a few of their parameters (LoRA): gradients far below the weights."""
    base = _random_profile(rng, L)
    layers = tuple(
        dataclasses.replace(x, trainable_count=int(rng.integers(0, max(1, x.param_count // 8)))) for x in base.layers
    )
    return dataclasses.replace(base, layers=layers)


def _bound_grads(arr: LayerArrays, W: int) -> int:
    """The DP's W_grad for slot W: the largest gradient of any interval whose parameters fit W."""
    L = arr.num_layers
    return max(arr.grads(a, b) for a in range(L) for b in range(a, L) if arr.params(a, b) <= W)


@pytest.mark.parametrize("seed", [2, 31, 977])
def test_under_lora_the_dp_uses_the_smaller_gradient_slot(seed):
    """With gradients the adapters' alone the arena is 2 W + W_grad: the DP finds the best cut under its bound of
    W_grad (brute force with the same rule), every cut it returns meets the runtime's exact rule, and it is never
    worse than the three equal slots of before."""
    rng = np.random.default_rng(seed)
    better = 0
    for L in range(2, 9):
        arr = LayerArrays.of(_lora_profile(rng, L))
        m, gbps = 3, 1e-3
        for memory in _memories(arr, rng):
            got = solve_dp(arr, memory, m, gbps, list(range(1, L + 1)))
            for s in range(1, L + 1):
                best, old = math.inf, math.inf
                for inner in itertools.combinations(range(1, L), s - 1):
                    cuts = (0, *inner, L)
                    ranges = [(cuts[j], cuts[j + 1] - 1) for j in range(s)]
                    W = max(arr.params(a, b) for a, b in ranges)
                    c = max(stage_cost(arr, a, b, m, gbps) for a, b in ranges)
                    if all(arena_bytes(W, _bound_grads(arr, W)) + _need(arr, a, b) <= memory for a, b in ranges):
                        best = min(best, c)
                    if all(ARENA_SLOTS * W + _need(arr, a, b) <= memory for a, b in ranges):
                        old = min(old, c)
                if math.isinf(best):
                    assert s not in got
                    continue
                sol = got[s]
                assert sol.bottleneck_s == pytest.approx(best, rel=1e-12, abs=0) and sol.bottleneck_s <= old
                W, grads = max(arr.params(a, b) for a, b in sol.ranges), max(arr.grads(a, b) for a, b in sol.ranges)
                assert all(arena_bytes(W, grads) + _need(arr, a, b) <= memory for a, b in sol.ranges)
                better += math.isinf(old)
    assert better > 0  # some budgets fit only because the gradient slot is smaller
