"""Activation policies of a stage and what each one costs: the bytes held from a microbatch's forward to its
backward, the bytes live while the backward runs, the forward time redone, and the transfer time to and from
the tier that holds the bytes, exposed beyond the compute the schedule overlaps it with.

Legend (stage j = layers a..b, one microbatch unless marked; units in brackets):
  A_l, O_l, F_l, B_l  per-layer saved-activation bytes, output bytes, forward and backward time (profile)
                      [bytes, bytes, s, s]
  I_j        = O_{a-1}, the stage input (stage 0: the token ids, `input_bytes`)                 [bytes]
  K          the kept layers, whose saved activations live from F to B (keep: all, recompute: none)
  seg        a maximal run of the stage's layers outside K, recomputed in B from its saved input; s0 its
             first layer
  run        a maximal run of kept layers, r0 its first layer and r1 its last: its graph holds its layers'
             saved activations and its input and output (the runtime's leaf and output: measured)
  G_j        = sum_run (sum_{l in run} A_l + O_{r0-1} + O_{r1}): the kept graphs                     [bytes]
  H_j        = G_j + sum_seg O_{s0-1}: held per microbatch from F(j,i) to B(j,i), a segment's input
             counted only where it is not a kept run's output (that tensor is in G_j already)   [bytes]
  T_j        = G_j + (max_seg sum_{l in seg} A_l + I_j + O_b when there are segments): live while
             B(j,i) runs (the graphs until the backward ends, the recomputed segment)             [bytes]
             (recompute: today's A_j of partition.rules.costmodel; keep: G_j = A_j)
  R_l        a layer's forward as the backward redoes it (with grad; profile recompute_s, else F_l)  [s]
  K_l        a kept layer's forward as F runs it (with grad, graph kept; profile kept_s, else R_l)  [s]
  R_j        = sum_{l not in K} R_l: the forward redone in each B                              [s]
  F_j, B_j   = sum_l F_l, sum_l B_l                                                            [s]
  F'_j       = sum_{l in K} K_l + sum_{l not in K} F_l: F(j,i) as the policy runs it (kept layers run
             with grad and keep their graphs; the others without grad)                          [s]
  out, in_   bandwidth from the device to the tier and back (the share of a shared link)        [GB/s]
  W_out      = F'_j: a swap-out of microbatch i overlaps the forward of microbatch i+1           [s]
  W_in       = B_j + R_j: a swap-in of microbatch i overlaps the backward of microbatch i+1      [s]
  X_j        = M * (max(0, H_j / out - W_out) + max(0, H_j / in_ - W_in)): exposed transfer time   [s]
             (tier device: 0, nothing moves)
  C_j        = M * (F'_j + B_j + R_j) + X_j: stage j's compute per step under the policy         [s]
A policy never changes the math: every option computes the same gradients (the runtime's tests hold them to
bit-identical results); it trades device bytes (H_j, T_j) for time (R_j, X_j).
"""

from __future__ import annotations

from dataclasses import dataclass

from partition.rules.costmodel import LayerArrays

__all__ = [
    "MODES",
    "TIERS",
    "ActivationPolicy",
    "PolicyCost",
    "Link",
    "kept_layers_order",
    "policy_cost",
    "fused_cost",
    "options",
]

MODES = ("recompute", "selective", "keep")
"""recompute: only the stage input is held; keep: every layer's saved activations; selective: some layers'."""
TIERS = ("device", "host", "ssd", "peer")
"""Where the held bytes live between F and B."""


@dataclass(frozen=True)
class ActivationPolicy:
    """A stage's activation policy: its mode, the kept layers (absolute indices; selective only) and its tier."""

    mode: str = "recompute"
    keep_layers: tuple[int, ...] = ()
    tier: str = "device"

    def kept(self, a: int, b: int) -> frozenset[int]:
        """K for stage a..b."""
        if self.mode == "keep":
            return frozenset(range(a, b + 1))
        return frozenset(self.keep_layers) if self.mode == "selective" else frozenset()


@dataclass(frozen=True)
class Link:
    """Bandwidth from the device to a tier and back, as this stage's gpu gets it [GB/s]."""

    out_gbps: float
    in_gbps: float


@dataclass(frozen=True)
class PolicyCost:
    """One option for a stage and its figures (symbols of the module legend)."""

    policy: ActivationPolicy
    held_bytes: int  # H_j
    work_bytes: int  # T_j
    recompute_s: float  # R_j
    exposed_s: float  # X_j
    compute_s: float  # C_j
    forward_s: float = 0.0  # F'_j
    held_output: int = 0  # the part of H_j that is the stage's output O_b (its last layer kept), else 0


def _segments(a: int, b: int, kept: frozenset[int]) -> list[tuple[int, int]]:
    """The maximal runs (first, last) of layers a..b outside kept."""
    out: list[tuple[int, int]] = []
    for layer in range(a, b + 1):
        if layer in kept:
            continue
        if out and out[-1][1] == layer - 1:
            out[-1] = (out[-1][0], layer)
        else:
            out.append((layer, layer))
    return out


def _output(arr: LayerArrays, layer: int, input_bytes: int) -> int:
    """O_layer, where layer -1 is the model's input."""
    return int(arr.O[layer]) if layer >= 0 else input_bytes


def policy_cost(
    arr: LayerArrays, a: int, b: int, m: int, policy: ActivationPolicy, link: Link | None, input_bytes: int = 0
) -> PolicyCost:
    """The figures of `policy` for stage a..b with m microbatches; link: the bandwidth to the policy's tier
    (None for tier device)."""
    kept = policy.kept(a, b)
    segs = _segments(a, b, kept)
    runs = _segments(a, b, frozenset(range(a, b + 1)) - kept)  # the maximal runs of kept layers
    graphs = sum(int(arr.A[e + 1] - arr.A[s]) + _output(arr, s - 1, input_bytes) + int(arr.O[e]) for s, e in runs)
    held = graphs + sum(_output(arr, s0 - 1, input_bytes) for s0, _ in segs if s0 - 1 not in kept)
    work = graphs
    if segs:
        work += max(int(arr.A[e + 1] - arr.A[s]) for s, e in segs) + _output(arr, a - 1, input_bytes) + int(arr.O[b])
    recompute = sum(arr.recompute(s, e) for s, e in segs)
    fwd = sum(arr.kept(s, e) for s, e in runs) + sum(float(arr.F[e + 1] - arr.F[s]) for s, e in segs)
    bwd = float(arr.B[b + 1] - arr.B[a])
    exposed = 0.0
    if policy.tier != "device":
        if link is None:
            raise ValueError(f"tier {policy.tier!r} needs the link's bandwidth to it")
        out_s, in_s = held / (link.out_gbps * 1e9), held / (link.in_gbps * 1e9)
        exposed = m * (max(0.0, out_s - fwd) + max(0.0, in_s - (bwd + recompute)))
    total = m * (fwd + bwd + recompute) + exposed
    return PolicyCost(policy, held, work, recompute, exposed, total, fwd, int(arr.O[b]) if b in kept else 0)


def kept_layers_order(arr: LayerArrays, a: int, b: int) -> list[int]:
    """Stage a..b's layers, the best to keep first: the most forward time saved per byte held (Fuyou's order;
    a layer holding nothing comes first, ties by index)."""

    def score(layer: int) -> float:
        held = int(arr.A[layer + 1] - arr.A[layer])
        return float("inf") if held == 0 else arr.recompute(layer, layer) / held

    return sorted(range(a, b + 1), key=lambda x: (-score(x), x))


def options(
    arr: LayerArrays, a: int, b: int, m: int, links: dict[str, Link | None], input_bytes: int = 0
) -> list[PolicyCost]:
    """Every option for stage a..b: recompute, selective with the first k of kept_layers_order (k = 1 ..
    n-1), keep; each on every tier of `links` (tier -> its Link; None for device). Ordered as listed."""
    order = kept_layers_order(arr, a, b)
    policies = [("recompute", ())]
    policies += [("selective", tuple(sorted(order[:k]))) for k in range(1, b - a + 1)]
    policies.append(("keep", ()))
    return [
        policy_cost(arr, a, b, m, ActivationPolicy(mode, kept, tier), link, input_bytes)
        for mode, kept in policies
        for tier, link in links.items()
    ]


def fused_cost(arr: LayerArrays, a: int, b: int, m: int, input_bytes: int = 0) -> PolicyCost:
    """The last stage's only option: its forward runs with grad inside its backward (the loss needs both at
    once), so between them it holds its input alone, H = I (recorded as keep, on the device; recompute_s: that
    forward)."""
    held = _output(arr, a - 1, input_bytes)
    work = int(arr.A[b + 1] - arr.A[a]) + held + int(arr.O[b])
    inside, bwd = arr.recompute(a, b), float(arr.B[b + 1] - arr.B[a])
    return PolicyCost(ActivationPolicy("keep"), held, work, inside, 0.0, m * (inside + bwd))
