"""Activation policies' figures (partition.rules.activations) against hand-computed values on a 4-layer stage."""

from __future__ import annotations

import numpy as np
import pytest

from partition.rules.activations import ActivationPolicy, Link, kept_layers_order, options, policy_cost
from partition.rules.costmodel import LayerArrays

# layer:          0     1     2     3
A = np.array([1000, 4000, 2000, 3000])  # saved-activation bytes
O = np.array([100, 200, 300, 400])  # output bytes
F = np.array([1.0, 4.0, 1.0, 6.0])  # forward s
B = np.array([2.0, 8.0, 2.0, 12.0])  # backward s


def _arrays() -> LayerArrays:
    def pre(v):
        return np.concatenate([[0], np.cumsum(v)])

    zeros = np.zeros(4)
    return LayerArrays(P=pre(zeros), A=pre(A), F=pre(F), B=pre(B), O=O, N=pre(zeros))


def test_recompute_holds_the_input_and_redoes_the_forward():
    c = policy_cost(_arrays(), 1, 3, 2, ActivationPolicy("recompute"), None)
    assert c.held_bytes == 100  # O_0, the stage input
    assert c.work_bytes == 4000 + 2000 + 3000 + 100 + 400  # today's A_j
    assert c.recompute_s == 11.0 and c.exposed_s == 0.0
    assert c.compute_s == 2 * (11 + 22 + 11)


def test_keep_holds_every_layer_and_redoes_nothing():
    c = policy_cost(_arrays(), 1, 3, 2, ActivationPolicy("keep"), None)
    graph = 9000 + 100 + 400  # every layer's saved activations, the stage's input and output
    assert (c.held_bytes, c.work_bytes, c.recompute_s) == (graph, graph, 0.0)
    assert c.compute_s == 2 * (11 + 22)


def test_selective_splits_the_stage_into_recomputed_segments():
    # keep layer 2: segments 0..1 (input: the model's 50 bytes) and 3..3 (input O_2, the graph's); kept run 2..2
    c = policy_cost(_arrays(), 0, 3, 3, ActivationPolicy("selective", (2,)), None, input_bytes=50)
    graph = 2000 + 200 + 300  # layer 2's saved activations, its input O_1 and output O_2
    assert c.held_bytes == graph + 50
    assert c.work_bytes == graph + max(1000 + 4000, 3000) + 50 + 400
    assert c.recompute_s == 1 + 4 + 6


def test_a_segment_after_a_kept_run_holds_no_second_copy_of_its_input():
    """Keep layer 1 of 0..3: segments 0..0 (input: the model's 50 bytes) and 2..3, whose input is O_1, the kept
    graph's output: one tensor (the runtime holds it once; the stand-in's ledger counts it once)."""
    c = policy_cost(_arrays(), 0, 3, 3, ActivationPolicy("selective", (1,)), None, input_bytes=50)
    graph = 4000 + 100 + 200  # layer 1's saved activations, its input O_0 and output O_1
    assert c.held_bytes == graph + 50


def test_the_forward_runs_kept_layers_with_grad():
    """F'_j without a kept time in the profile: kept layers at their with-grad time R_l (they keep their graphs),
    the others at F_l; C_j with it."""
    r = np.array([1.5, 5.0, 1.25, 7.0])  # with grad: slower than F
    arr = _arrays()
    arr = LayerArrays(P=arr.P, A=arr.A, F=arr.F, B=arr.B, O=arr.O, N=arr.N, R=np.concatenate([[0], np.cumsum(r)]))
    keep = policy_cost(arr, 1, 3, 2, ActivationPolicy("keep"), None)
    assert keep.forward_s == pytest.approx(5.0 + 1.25 + 7.0) and keep.recompute_s == 0.0
    assert keep.compute_s == pytest.approx(2 * (13.25 + 22))
    redo = policy_cost(arr, 1, 3, 2, ActivationPolicy("recompute"), None)
    assert redo.forward_s == pytest.approx(11.0) and redo.recompute_s == pytest.approx(13.25)
    sel = policy_cost(arr, 0, 3, 2, ActivationPolicy("selective", (1, 2)), None)
    assert sel.forward_s == pytest.approx(1.0 + 5.0 + 1.25 + 6.0) and sel.recompute_s == pytest.approx(1.5 + 7.0)


def test_kept_layers_forward_at_their_kept_time_when_the_profile_has_one():
    """F'_j: K_l (the forward as a keep F runs it, graphs held M in a row) for kept layers; R_l stays what the
    backward redoes (and what orders the layers to keep)."""
    r, k = np.array([1.5, 5.0, 1.25, 7.0]), np.array([1.75, 5.5, 1.5, 8.0])
    arr = _arrays()
    pre = lambda v: np.concatenate([[0], np.cumsum(v)])  # noqa: E731
    arr = LayerArrays(P=arr.P, A=arr.A, F=arr.F, B=arr.B, O=arr.O, N=arr.N, R=pre(r), K=pre(k))
    assert arr.kept(1, 3) == pytest.approx(5.5 + 1.5 + 8.0) and arr.recompute(1, 3) == pytest.approx(13.25)
    keep = policy_cost(arr, 1, 3, 2, ActivationPolicy("keep"), None)
    assert keep.forward_s == pytest.approx(5.5 + 1.5 + 8.0) and keep.compute_s == pytest.approx(2 * (15.0 + 22))
    sel = policy_cost(arr, 0, 3, 2, ActivationPolicy("selective", (1, 2)), None)
    assert sel.forward_s == pytest.approx(1.0 + 5.5 + 1.5 + 6.0) and sel.recompute_s == pytest.approx(1.5 + 7.0)
    without = LayerArrays(P=arr.P, A=arr.A, F=arr.F, B=arr.B, O=arr.O, N=arr.N, R=pre(r))
    assert without.kept(1, 3) == without.recompute(1, 3)  # no K: R


def test_a_swap_is_exposed_only_beyond_its_window():
    link = Link(out_gbps=9500 / 20e9, in_gbps=9500 / 30e9)  # 9500 bytes held: 20 s out, 30 s back
    c = policy_cost(_arrays(), 1, 3, 2, ActivationPolicy("keep", tier="host"), link)
    # window out = F_j = 11 s -> 9 s exposed; window in = B_j + R_j = 22 s -> 8 s exposed; per microbatch
    assert c.exposed_s == pytest.approx(2 * (9 + 8))
    assert c.compute_s == pytest.approx(2 * 33 + 34)
    with pytest.raises(ValueError, match="needs the link's bandwidth"):
        policy_cost(_arrays(), 1, 3, 2, ActivationPolicy("keep", tier="ssd"), None)


def test_options_order_and_count():
    arr = _arrays()
    # forward seconds per byte: layer 0 1/1000, 1 1/1000, 2 1/2000, 3 2/1000 -> 3, 0, 1, 2
    assert kept_layers_order(arr, 0, 3) == [3, 0, 1, 2]
    got = options(arr, 0, 3, 2, {"device": None, "host": Link(10.0, 10.0)})
    assert len(got) == (1 + 3 + 1) * 2
    assert [c.policy.keep_layers for c in got if c.policy.tier == "device"] == [(), (3,), (0, 3), (0, 1, 3), ()]
    held = [c.held_bytes for c in got if c.policy.tier == "device"]
    assert held == sorted(held)  # each option holds more than the one before
    recompute = [c.recompute_s for c in got if c.policy.tier == "device"]
    assert recompute == sorted(recompute, reverse=True)


def _naive(a_, o_, f_, a, b, kept, input_bytes):
    """H, T, R by walking the layers one by one: a layer that starts a run (of kept or of recomputed layers)
    holds its input, unless a kept run's output is that input, a kept layer that ends its run its output; runs of
    recomputed layers are live together in B, the kept graphs all along."""
    graphs = inputs = seg = longest = 0
    recompute = 0.0
    segments = False
    for layer in range(a, b + 1):
        starts = layer == a or ((layer - 1) in kept) != (layer in kept)
        into = (o_[layer - 1] if layer > 0 else input_bytes) if starts else 0
        if layer in kept:
            graphs += a_[layer] + into + (o_[layer] if layer == b or layer + 1 not in kept else 0)
            seg = 0
            continue
        segments = True
        inputs += 0 if (layer - 1) in kept else into
        seg += a_[layer]
        longest = max(longest, seg)
        recompute += f_[layer]
    edge = (o_[a - 1] if a > 0 else input_bytes) + o_[b]
    return graphs + inputs, graphs + (longest + edge if segments else 0), recompute


def test_random_stages_against_a_naive_walk():
    rng = np.random.default_rng(13)
    for _ in range(200):
        n = int(rng.integers(1, 9))
        a_, o_ = rng.integers(0, 5000, n), rng.integers(1, 500, n)
        f_ = rng.random(n)
        arr = LayerArrays(
            P=np.zeros(n + 1),
            A=np.concatenate([[0], np.cumsum(a_)]),
            F=np.concatenate([[0], np.cumsum(f_)]),
            B=np.zeros(n + 1),
            O=o_,
            N=np.zeros(n + 1),
        )
        a = int(rng.integers(0, n))
        b = int(rng.integers(a, n))
        kept = tuple(
            sorted(int(x) for x in rng.choice(np.arange(a, b + 1), int(rng.integers(0, b - a + 2)), replace=False))
        )
        c = policy_cost(arr, a, b, 1, ActivationPolicy("selective", kept), None, input_bytes=77)
        h, t, r = _naive(a_, o_, f_, a, b, set(kept), 77)
        assert (c.held_bytes, c.work_bytes) == (h, t)
        assert c.recompute_s == pytest.approx(r)
