"""How the out-of-core Adam cuts the flat fp32 space of its parameters into groups, one stored record each,
and the host budget that a group size needs (the layout is described in ooc_adam's docstring)."""

from __future__ import annotations

from dataclasses import dataclass

from foundation.units import fmt_bytes
from mobiuspipe.memory.aio import ALIGN

__all__ = [
    "Segment",
    "plan_groups",
    "section_elems",
    "least_budget_bytes",
    "group_elems_for",
    "ELEM_ALIGN",
    "BYTES_PER_ELEM",
]

ELEM_ALIGN = ALIGN // 4
"""fp32 elements per 4 KiB: every section of a record starts on a 4 KiB boundary (O_DIRECT)."""
BYTES_PER_ELEM = 12
"""Bytes of state per parameter: fp32 master weight + exp_avg + exp_avg_sq."""


@dataclass(frozen=True)
class Segment:
    """The part of parameter `name` in one group: elements [param_off, param_off + numel) of the
    parameter sit at [group_off, group_off + numel) of the group."""

    name: str
    param_off: int
    group_off: int
    numel: int


def plan_groups(numels: list[tuple[str, int]], group_elems: int) -> list[list[Segment]]:
    """Cut the flat space of the parameters (in order) into groups of group_elems elements."""
    groups: list[list[Segment]] = []
    flat = 0
    for name, n in numels:
        done = 0
        while done < n:
            g, at = divmod(flat, group_elems)
            take = min(n - done, group_elems - at)
            while len(groups) <= g:
                groups.append([])
            groups[g].append(Segment(name, done, at, take))
            done += take
            flat += take
    return groups


def least_budget_bytes(slots: int = 4) -> int:
    """The smallest host budget OutOfCoreAdam takes: `slots` slots of one 4 KiB-aligned group each."""
    return slots * BYTES_PER_ELEM * ELEM_ALIGN


def group_elems_for(host_budget_bytes: int, slots: int) -> int:
    """G: the largest multiple of ELEM_ALIGN whose `slots` slots of 12 * G bytes fit the host budget."""
    if slots < 3:
        raise ValueError(f"slots must be >= 3 (read ahead, update, write back), not {slots}")
    g = host_budget_bytes // (slots * BYTES_PER_ELEM) // ELEM_ALIGN * ELEM_ALIGN
    if g < ELEM_ALIGN:
        least = least_budget_bytes(slots)
        raise ValueError(
            f"host_budget_bytes {host_budget_bytes} is too small for {slots} slots: it needs at "
            f"least {least} bytes ({fmt_bytes(least)})"
        )
    return g


def section_elems(group: list[Segment]) -> int:
    """Elements per section of a group's record: the group's extent, padded to ELEM_ALIGN (4 KiB)."""
    ext = max(s.group_off + s.numel for s in group)
    return -(-ext // ELEM_ALIGN) * ELEM_ALIGN
