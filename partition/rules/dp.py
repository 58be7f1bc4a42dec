"""Exact dynamic program: cut L layers into S contiguous stages minimizing the largest stage cost.

Solves, for every S at once, min over cuts of max_j c_j (partition.rules.costmodel) subject to the memory rule
2*W + W_grad + A_j + X_j <= G, where W = max_j P_j, W_grad = max_j of the stages' gradient bytes and X_j the most
transients of stage j's layers. The rule couples stages only through W and W_grad, so the DP runs once per candidate
W (every distinct interval parameter sum that could be the largest stage) with W fixed as a per-stage cap and W_grad
taken as the largest gradient of any interval within that cap; the best over W is exact where gradients grow with
parameters (W_grad = W: every weight trains), and under LoRA, whose gradients are the adapters', the W_grad used is
an upper bound of the cut's own. X_j is the stage's own, so it leaves the coupling as it was. Each run is the
textbook recurrence

  f[s][l] = min_k max(f[s-1][k], c(k..l-1))      (f[s][l]: first l layers in s stages)

vectorized over (k, l) as an (L+1) x (L+1) matrix, O(S * L^2) per candidate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from partition.rules.costmodel import LayerArrays, arena_bytes

__all__ = ["DpSolution", "solve_dp", "interval_matrices"]

INF = float("inf")


@dataclass(frozen=True)
class DpSolution:
    """Best cut into `num_stages` stages: stage j holds layers cuts[j]..cuts[j+1]-1."""

    num_stages: int
    bottleneck_s: float
    slot_bytes: int
    cuts: tuple[int, ...]

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(self.cuts[j], self.cuts[j + 1] - 1) for j in range(self.num_stages)]


def interval_matrices(arr: LayerArrays, microbatches: int, load_gbps: float):
    """(P, A, C): params, live activations and cost c of every interval k..l-1, as (L+1)^2 arrays."""
    L = arr.num_layers
    k = np.arange(L + 1)[:, None]
    l = np.arange(L + 1)[None, :]
    valid = l > k
    P = np.where(valid, arr.P[l] - arr.P[k], 0)
    o_in = np.where(k > 0, arr.O[np.maximum(k - 1, 0)], 0)
    o_out = arr.O[np.maximum(l - 1, 0)]
    A = np.where(valid, arr.A[l] - arr.A[k] + o_in + o_out, 0)
    compute = microbatches * (2 * (arr.F[l] - arr.F[k]) + (arr.B[l] - arr.B[k]))
    C = np.where(valid, np.maximum(compute, 2 * P / (load_gbps * 1e9)), INF)
    return P, A, C


def interval_grads(arr: LayerArrays) -> np.ndarray:
    """The gradient bytes of every interval k..l-1 as an (L+1)^2 array (0 off the intervals)."""
    g = arr.P if arr.G is None else arr.G
    k = np.arange(arr.num_layers + 1)[:, None]
    l = np.arange(arr.num_layers + 1)[None, :]
    return np.where(l > k, g[l] - g[k], 0)


def interval_transients(arr: LayerArrays) -> np.ndarray:
    """X_j of every interval k..l-1 (the most X_l of its layers) as an (L+1)^2 array (0 off the intervals)."""
    L = arr.num_layers
    out = np.zeros((L + 1, L + 1), dtype=np.int64)
    if arr.X is None:
        return out
    for k in range(L):
        out[k, k + 1 :] = np.maximum.accumulate(arr.X[k:])
    return out


def _grad_slot(P: np.ndarray, Gm: np.ndarray, w: int) -> int:
    """W_grad for weight slot w: the largest gradient of any interval whose parameters fit w."""
    return int(Gm[P <= w].max())


def _dp(C: np.ndarray, max_stages: int) -> tuple[np.ndarray, np.ndarray]:
    """f[s][l] and argmin k for s = 0..max_stages over an interval cost matrix with inf = forbidden."""
    L = C.shape[0] - 1
    f = np.full((max_stages + 1, L + 1), INF)
    arg = np.zeros((max_stages + 1, L + 1), dtype=np.int64)
    f[0][0] = 0.0
    for s in range(1, max_stages + 1):
        cand = np.maximum(f[s - 1][:, None], C)
        arg[s] = np.argmin(cand, axis=0)
        f[s] = cand[arg[s], np.arange(L + 1)]
    return f, arg


def _cuts(arg: np.ndarray, s: int, L: int) -> tuple[int, ...]:
    cuts = [L]
    for t in range(s, 0, -1):
        cuts.append(int(arg[t][cuts[-1]]))
    return tuple(reversed(cuts))


def solve_dp(
    arr: LayerArrays, memory_bytes: int, microbatches: int, load_gbps: float, stage_counts: list[int]
) -> dict[int, DpSolution]:
    """Optimal cut for each S in stage_counts that has a feasible one (S missing from the result = none)."""
    L = arr.num_layers
    P, A, C = interval_matrices(arr, microbatches, load_gbps)
    A = A + interval_transients(arr)  # the rule's per-stage need beyond the arena: A_j + X_j
    Gm = interval_grads(arr)
    max_s = min(max(stage_counts), L)
    best: dict[int, DpSolution] = {}
    for w in _slot_candidates(P, Gm, memory_bytes, A):
        ok = (P <= w) & (arena_bytes(w, _grad_slot(P, Gm, w)) + A <= memory_bytes)
        f, arg = _dp(np.where(ok, C, INF), max_s)
        for s in stage_counts:
            if s > max_s or not np.isfinite(f[s][L]):
                continue
            sol = DpSolution(s, float(f[s][L]), int(w), _cuts(arg, s, L))
            if s not in best or _better(sol, best[s]):
                best[s] = sol
    return best


def _better(a: DpSolution, b: DpSolution) -> bool:
    """Lower bottleneck wins; on a tie, the smaller slot (more room left for activations)."""
    if not np.isclose(a.bottleneck_s, b.bottleneck_s, rtol=1e-12, atol=0.0):
        return a.bottleneck_s < b.bottleneck_s
    return a.slot_bytes < b.slot_bytes


def _slot_candidates(P: np.ndarray, Gm: np.ndarray, memory_bytes: int, A: np.ndarray) -> list[int]:
    """Every interval parameter sum W that is at least the largest single layer and leaves room for some stage
    (A: each interval's need beyond the arena, A_j + X_j).

    The room test uses the least A over ALL intervals: A_j counts only a stage's boundary outputs, so a
    stage of several layers can need less than any of its layers alone.
    """
    L = P.shape[0] - 1
    single = max(int(P[i, i + 1]) for i in range(L))
    upper = np.triu_indices(L + 1, k=1)
    min_act = int(A[upper].min())
    vals = np.unique(P[upper])
    return [
        int(w) for w in vals if single <= w and arena_bytes(int(w), _grad_slot(P, Gm, int(w))) + min_act <= memory_bytes
    ]
