"""Stage -> gpu mapping: round-robin, and Mobius cross mapping that keeps adjacent stages apart.

Stages run in waves: stage j on gpu m[j], with m cyclic over the gpus (m[j] = pi[j mod N] for a
permutation pi). Stages close in index load their weights at close times, so two nearby stages whose
gpus share a root complex contend for its uplink. Following the Mobius slides,

  contention(i, j) = shared(m[i], m[j]) / |i - j|          (shared = 1 when both gpus share an uplink)

Cross mapping picks pi minimizing the total contention of every pair of stages less than N apart.
The expected number of copies overlapping stage j's load is 1 + sum_i contention(i, j), which scales
stage j's share of its uplink (Topology.load_gbps).
"""

from __future__ import annotations

import functools
import itertools

from topology import Topology

__all__ = [
    "MAPPING_RULES",
    "round_robin",
    "cross_mapping",
    "make_mapping",
    "stage_contention",
    "peer_gbps",
    "mapping_score",
    "mapping_candidates",
    "SEARCH_MAX_GPUS",
]

MAPPING_RULES = ("cross", "round-robin", "search")
"""cross: least contention; round-robin: j mod N; search: every cyclic gpu order, the planner keeps the
fastest (up to SEARCH_MAX_GPUS gpus)."""
_EXHAUSTIVE_MAX_GPUS = 8
SEARCH_MAX_GPUS = 4


def round_robin(num_stages: int, num_gpus: int) -> list[int]:
    """m[j] = j mod N."""
    return [j % num_gpus for j in range(num_stages)]


def _cyclic_cost(shared: list[list[bool]], pi: tuple[int, ...]) -> float:
    """Total contention over one period of the cyclic mapping pi (pairs less than N apart)."""
    n = len(pi)
    return sum(1.0 / d for j in range(n) for d in range(1, n) if shared[pi[j]][pi[(j + d) % n]])


@functools.lru_cache(maxsize=64)
def _best_cycle(topo: Topology) -> tuple[int, ...]:
    """The gpu order of least cyclic contention (exhaustive up to 8 gpus; interleaved groups above)."""
    n = topo.num_gpus
    if n > _EXHAUSTIVE_MAX_GPUS:
        return _interleave_groups(topo)
    shared = [[topo.shared(a, b) for b in range(n)] for a in range(n)]
    perms = ((0,) + p for p in itertools.permutations(range(1, n)))  # rotations are equivalent
    return min(perms, key=lambda p: (_cyclic_cost(shared, p), p))


def cross_mapping(topo: Topology, num_stages: int) -> list[int]:
    """The cyclic mapping of least total contention (exhaustive over permutations up to 8 gpus)."""
    pi = _best_cycle(topo)
    return [pi[j % len(pi)] for j in range(num_stages)]


def _interleave_groups(topo: Topology) -> tuple[int, ...]:
    """Take one gpu from each contention group in turn (the rule cross mapping finds on small machines)."""
    groups = [list(g) for g in topo.contention_groups()]
    out: list[int] = []
    while any(groups):
        for g in sorted(groups, key=len, reverse=True):
            if g:
                out.append(g.pop(0))
    return tuple(out)


def make_mapping(rule: str, topo: Topology, num_stages: int) -> list[int]:
    """Mapping by rule name ("cross" or "round-robin"; "search" has several, see mapping_candidates)."""
    if rule == "cross":
        return cross_mapping(topo, num_stages)
    if rule == "round-robin":
        return round_robin(num_stages, topo.num_gpus)
    raise ValueError(f"unknown mapping rule {rule!r}; expected one of {list(MAPPING_RULES)}")


def mapping_candidates(rule: str, topo: Topology, num_stages: int) -> list[list[int]]:
    """The mappings a rule offers: one for cross and round-robin, every cyclic gpu order for search."""
    if rule != "search":
        return [make_mapping(rule, topo, num_stages)]
    n = topo.num_gpus
    if n > SEARCH_MAX_GPUS:
        raise ValueError(
            f"mapping rule 'search' tries all {n - 1}! cyclic gpu orders and takes at most "
            f"{SEARCH_MAX_GPUS} gpus, found {n}; use 'cross' (the least-contention order)"
        )
    orders = ((0,) + p for p in itertools.permutations(range(1, n)))
    return [[pi[j % n] for j in range(num_stages)] for pi in orders]


def stage_contention(topo: Topology, mapping: list[int]) -> list[float]:
    """Expected number of copies overlapping each stage's load: 1 + sum of contention with stages < N away."""
    n, s = topo.num_gpus, len(mapping)
    out = []
    for j in range(s):
        c = 1.0
        for i in range(max(0, j - n + 1), min(s, j + n)):
            if i != j and topo.shared(mapping[i], mapping[j]):
                c += 1.0 / abs(i - j)
        out.append(c)
    return out


def mapping_score(topo: Topology, mapping: list[int]) -> float:
    """Total contention of a stage -> gpu mapping: sum over i < j, j - i < N, of shared / (j - i)."""
    n = topo.num_gpus
    return sum(
        1.0 / (j - i)
        for j in range(len(mapping))
        for i in range(max(0, j - n + 1), j)
        if topo.shared(mapping[i], mapping[j])
    )


def peer_gbps(topo: Topology, a: int, b: int) -> float:
    """Effective gpu a -> gpu b bandwidth, GB/s: NVLink, PCIe P2P, or two hops through host memory."""
    if link := topo.nvlink(a, b):
        return link.gbps
    pcie = min(topo.gpus[a].link_gbps, topo.gpus[b].link_gbps)
    return pcie if topo.p2p_ok(a, b) else pcie / 2
