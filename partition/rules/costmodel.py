"""Cost model of one Mobius pipeline step: stage sums, load times and the memory rule.

Legend (stage j holds layers a..b; all per ONE microbatch unless marked; units in brackets):
  M        number of microbatches per step                                               [-]
  P_j      sum of P_l: parameter bytes loaded into the gpu for stage j (under LoRA, up to [bytes]
           FROZEN_ALIGN - 1 more: its frozen ones start aligned, frozen_start)
  A_j      sum of A_l + O_{a-1} + O_b: live activations while stage j runs backward on
           one microbatch (the stage recomputes its forward from its saved input, so all
           of its layers' activations are live at once, plus the input and output buffers)[bytes]
  F_j      sum of F_l: forward time                                                      [s]
  B_j      sum of B_l: backward time                                                     [s]
  R_j      sum of R_l: the forward as the backward visit redoes it (profile.recompute_s;
           F_j when the profile has no separate figure)                                   [s]
  T_j      sum of T_l: the parameters that train (all N_j but under LoRA, its adapters)   [-]
  G_j      bytes of stage j's gradients: T_j in the plan's dtype (P_j when all train)     [bytes]
  V_j      sum of V_l: the layers' buffers, on stage j's gpu the whole run, outside the arena [bytes]
  X_j      max of X_l: what the stage's computing layer holds beyond A_j (the profile's
           workspace_bytes: its backward's transients), on a gpu while the stage computes   [bytes]
  beta_j   host->gpu bandwidth stage j's gpu gets under contention (topology.load_gbps)  [GB/s]
  U_j      = P_j / (beta_j * 1e9): time to load stage j's parameters                     [s]
  W        = max_j P_j: size of one weight slot of the device arena                      [bytes]
  G        usable gpu memory = gpu memory - reserve - what every gpu holds apart (the math
           libraries' workspaces, the layers' buffers: partition.search.make_plan)        [bytes]

Compute of stage j in one step: forward M*F_j, backward M*(F_j + B_j) (recompute, then backward).
A stage is loaded twice per step (before its forward and before its backward), except the gpu's last
forward stage, which stays resident into the backward.

Memory rule. The device arena holds three slots of W bytes: the computing stage, the prefetched next
stage of the same gpu, and the computing stage's gradients. With fixed slots there is no fragmentation,
so a plan is feasible iff, for every stage j:  3*W + A_j + X_j <= G. (The Mobius MIP, partition.mip.model, uses the
paper's per-stage rule with partial prefetch, which admits more cuts; the plan search keeps only the cuts
this rule, the runtime's, admits.)

Stage cost used by the DP (the busier of the gpu's compute and copy engines for that stage):
  c_j = max(M*(2*F_j + B_j), 2*U_j)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import DTypeLike

from partition.spec.analytic import DTYPE_BYTES
from partition.spec.profile import Profile

__all__ = [
    "WEIGHT_SLOTS",
    "GRAD_SLOTS",
    "ARENA_SLOTS",
    "FROZEN_ALIGN",
    "LayerArrays",
    "stage_cost",
    "arena_bytes",
    "frozen_start",
    "slot_weight_bytes",
]

WEIGHT_SLOTS = 2
"""Arena slots for weights: the computing stage's and the prefetched next stage's of the same gpu."""
GRAD_SLOTS = 1
"""Arena slots for gradients: the computing stage's, accumulated over its microbatches until offloaded."""
ARENA_SLOTS = WEIGHT_SLOTS + GRAD_SLOTS
"""Slots in the device arena: WEIGHT_SLOTS of W bytes (the largest stage's parameter bytes) and GRAD_SLOTS of
W_grad (the largest stage's gradient bytes: W without LoRA, its adapters' alone with it); the memory rule is
arena_bytes(W, W_grad) + A_j + X_j <= G."""


FROZEN_ALIGN = 8
"""Bytes: a stage's frozen weights start in its weight slot at a multiple of this after its trainable ones, so that
each frozen item (the widest first: a quantized base's int32 scales) is viewed in place at an offset its element
size divides."""


def frozen_start(trainable_bytes: int, frozen_bytes: int) -> int:
    """Where a stage's frozen weights start in its weight slot (bytes): right after its trainable ones, rounded up to
    FROZEN_ALIGN when it has frozen ones. A stage's P_j is this plus frozen_bytes."""
    return trainable_bytes + (-trainable_bytes % FROZEN_ALIGN if frozen_bytes else 0)


def slot_weight_bytes(trainable_bytes: int, frozen_bytes: int) -> int:
    """P_j: the bytes a stage's weights take in its weight slot, the trainable ones, then the frozen ones."""
    return frozen_start(trainable_bytes, frozen_bytes) + frozen_bytes


def arena_bytes(weight_slot: int, grad_slot: int) -> int:
    """The device arena's bytes: WEIGHT_SLOTS slots of weight_slot (W) and GRAD_SLOTS of grad_slot (W_grad)."""
    return WEIGHT_SLOTS * weight_slot + GRAD_SLOTS * grad_slot


@dataclass(frozen=True)
class LayerArrays:
    """Prefix sums of a profile's per-layer numbers, so any stage a..b costs O(1) to sum."""

    P: np.ndarray  # prefix sums of param bytes, length L+1
    A: np.ndarray  # prefix sums of activation bytes
    F: np.ndarray  # prefix sums of forward seconds
    B: np.ndarray  # prefix sums of backward seconds
    O: np.ndarray  # output bytes per layer, length L
    N: np.ndarray  # prefix sums of parameter counts
    T: np.ndarray | None = None  # prefix sums of trainable counts (None: the same as N)
    G: np.ndarray | None = None  # prefix sums of gradient bytes (None: the same as P)
    R: np.ndarray | None = None  # prefix sums of recompute seconds (None: the same as F)
    K: np.ndarray | None = None  # prefix sums of kept-forward seconds (None: the same as R)
    V: np.ndarray | None = None  # prefix sums of buffer bytes (None: no layer has buffers)
    X: np.ndarray | None = None  # each layer's transients X_l, length L (None: none)

    @classmethod
    def of(cls, profile: Profile) -> LayerArrays:
        def pre(vals: Sequence[float], dtype: DTypeLike = np.float64) -> np.ndarray:
            return np.concatenate([[0], np.cumsum(np.asarray(vals, dtype=dtype))])

        ls = profile.layers
        e = DTYPE_BYTES.get(profile.dtype, 0)
        grads = [x.param_bytes if x.trainable_count is None else x.trainable_count * e for x in ls]
        return cls(
            P=pre([x.param_bytes for x in ls], np.int64),
            A=pre([x.activation_bytes for x in ls], np.int64),
            F=pre([x.fwd_s for x in ls]),
            B=pre([x.bwd_s for x in ls]),
            O=np.asarray([x.output_bytes for x in ls], dtype=np.int64),
            N=pre([x.param_count for x in ls], np.int64),
            T=pre([x.trains for x in ls], np.int64),
            G=pre(grads, np.int64),
            R=pre([x.redo_s for x in ls]),
            K=pre([x.keep_s for x in ls]),
            V=pre([x.buffer_bytes for x in ls], np.int64),
            X=np.asarray([x.workspace_bytes for x in ls], dtype=np.int64),
        )

    @property
    def num_layers(self) -> int:
        return len(self.O)

    def params(self, a: int, b: int) -> int:
        """P_j for layers a..b inclusive."""
        return int(self.P[b + 1] - self.P[a])

    def activations(self, a: int, b: int) -> int:
        """A_j for layers a..b inclusive: the layers' saved activations plus input and output buffers."""
        inp = int(self.O[a - 1]) if a > 0 else 0
        return int(self.A[b + 1] - self.A[a]) + inp + int(self.O[b])

    def buffers(self, a: int, b: int) -> int:
        """V_j for layers a..b inclusive: the layers' buffers, which their stage's gpu keeps the whole run."""
        return 0 if self.V is None else int(self.V[b + 1] - self.V[a])

    def transients(self, a: int, b: int) -> int:
        """X_j for layers a..b inclusive: the most any of them holds beyond A_j while it computes."""
        return 0 if self.X is None else int(self.X[a : b + 1].max())

    def fwd(self, a: int, b: int) -> float:
        return float(self.F[b + 1] - self.F[a])

    def bwd(self, a: int, b: int) -> float:
        return float(self.B[b + 1] - self.B[a])

    def recompute(self, a: int, b: int) -> float:
        """R_j for layers a..b inclusive."""
        r = self.F if self.R is None else self.R
        return float(r[b + 1] - r[a])

    def kept(self, a: int, b: int) -> float:
        """K_j for layers a..b inclusive: their forward as a keep F runs it (profile kept_s)."""
        if self.K is None:
            return self.recompute(a, b)
        return float(self.K[b + 1] - self.K[a])

    def param_count(self, a: int, b: int) -> int:
        return int(self.N[b + 1] - self.N[a])

    def trainable(self, a: int, b: int) -> int:
        """T_j for layers a..b inclusive."""
        t = self.N if self.T is None else self.T
        return int(t[b + 1] - t[a])

    def grads(self, a: int, b: int) -> int:
        """G_j for layers a..b inclusive."""
        g = self.P if self.G is None else self.G
        return int(g[b + 1] - g[a])


def stage_cost(arr: LayerArrays, a: int, b: int, microbatches: int, load_gbps: float) -> float:
    """c_j of the legend for layers a..b: the scalar reference that the DP's vectorized interval costs
    (partition.rules.dp.interval_matrices) and the exhaustive oracle in the tests are checked against."""
    compute = microbatches * (2 * arr.fwd(a, b) + arr.bwd(a, b))
    load = arr.params(a, b) / (load_gbps * 1e9)
    return max(compute, 2 * load)
