"""The communicators a rank opens before step 0: one per direction of each pair of ranks that exchange messages
(mobiuspipe.runtime.peers.channels), the neighbours of the plan's mapping and the halves of tied parameters."""

from __future__ import annotations

from collections.abc import Sequence

from mobiuspipe.runtime.peers.channels import LAYOUT, Channels, neighbour_pairs
from mobiuspipe.runtime.peers.ranks import RankInfo
from mobiuspipe.runtime.tied import tied_ranks
from partition.plan import Plan

__all__ = ["open_channels"]


def open_channels(info: RankInfo, plan: Plan, tied: Sequence[tuple[str, str]], timeout_s: float) -> Channels:
    """This rank's channels, made in one order on every rank (none with one rank); Comm.warm_up sets them up."""
    pairs = neighbour_pairs(plan.mapping) | tied_ranks(tied, plan)
    return Channels(info.rank, LAYOUT, pairs if info.world_size > 1 else (), timeout_s)
