"""Swaps of held activations in the event simulation (partition.sim.simulate): the copy of a stage's held bytes
off the device after each forward and back before each backward, where the runtime's schedule puts them
(partition.rules.order.steps_of: SO, SI).

Per stage j whose held activations live off the device (SimStage.swap_tier host, ssd or peer) and microbatch i
(units: seconds, bytes; H = SimStage.held_bytes):
  out(j,i)  starts when F(j,i) ends and the gpu's previous swap-out ended (one d2h copy engine, in order);
            the compute op after SO(j,i) in the schedule (F(j,i+2), or the next visit's first computation
            after the last two) waits for it: the device bytes must have left.
  in(j,i)   starts where SI(j,i) stands: before B(j,0) for i = 0 and 1 (after the gpu's previous computation),
            else after B(j,i-2) (one microbatch ahead); also after out(j,i) and the gpu's previous swap-in
            (one h2d copy engine, in order). B(j,i) waits for it.
Durations: without a topology the static swap_out_s / swap_in_s (partition.search.sim_stages: H over the
gpu's link, and the drive's GB/s for the SSD tier); with a topology a flow of H bytes over the gpu's path
(d2h out, h2d in), shared with loads and offloads by processor sharing, that also crosses the drive's write
(out) or read (in) link for the SSD tier, and the peer gpu's path for the peer tier (staged through host:
out = own d2h then the peer's h2d, in = the peer's d2h then own h2d; an NVLink pair: that link alone).
Approximation: the runtime's copy stream is one queue for loads and swaps (the CPU stand-in's one copy
thread; on CUDA one side stream); here loads and swaps are separate engines that only share bandwidth.
"""

from __future__ import annotations

from collections.abc import Hashable

from partition.sim.flows import Link, TaskGraph
from partition.sim.types import SSD_READ, SSD_WRITE, SimStage

__all__ = ["SWAP_TIERS", "Swaps", "swap_path"]

SWAP_TIERS = ("host", "ssd", "peer")
"""The tiers whose held bytes move (device and auto: nothing moves)."""


def swap_path(st: SimStage, direction: str, paths: dict, nvlink: bool = False) -> tuple[Link, ...]:
    """The links a swap of stage st crosses: direction "out" (device to tier) or "in" (back)."""
    g, p = st.gpu, st.swap_peer
    if st.swap_tier == "peer":
        if nvlink:
            return ((f"nvlink {min(g, p)}-{max(g, p)}", "p2p"),)
        return paths[(g, "d2h")] + paths[(p, "h2d")] if direction == "out" else paths[(p, "d2h")] + paths[(g, "h2d")]
    own = paths[(g, "d2h")] if direction == "out" else paths[(g, "h2d")]
    if st.swap_tier == "ssd":
        return own + ((SSD_WRITE,) if direction == "out" else (SSD_READ,))
    return own


class Swaps:
    """One gpu's swap tasks as its visits are added to the graph (partition.sim.simulate._add_gpu drives it)."""

    def __init__(self, graph: TaskGraph, m: int, paths: dict, flows: bool, moves: list, nvlinks: frozenset):
        self.graph, self.m, self.paths, self.flows, self.moves = graph, m, paths, flows, moves
        self.nvlinks = nvlinks  # (a, b) gpu pairs with an NVLink, a < b
        self.pending: list[Hashable] = []  # swap-outs the next computation waits for
        self.prev_out: Hashable = None
        self.prev_in: Hashable = None

    def before(self, st: SimStage, j: int, i: int, phase: str, prev_op: Hashable) -> list[Hashable]:
        """Deps of computation (phase, j, i) from the swaps: the swap-outs its place in the schedule waits for,
        and for a swapped B its swap-in (started here, or earlier by the SI before B(j,0) or B(j,i-1))."""
        deps, self.pending = self.pending, []
        if phase == "B" and _swaps(st):
            if i == 0:
                for x in range(min(2, self.m)):
                    self._in(st, j, x, prev_op)
            elif i + 1 < self.m:
                self._in(st, j, i + 1, prev_op)
            deps = [*deps, ("swap-in", j, i)]
        return deps

    def after(self, st: SimStage, j: int, i: int, phase: str, op: Hashable) -> None:
        """After computation (phase, j, i): a swapped F starts its swap-out; SO(j, i-1) stands after F(j, i),
        SO(j, M-1) after the last F of the visit."""
        if phase != "F" or not _swaps(st):
            return
        self.prev_out = self._add(st, ("swap-out", j, i), (op, self.prev_out), "out")
        if i > 0:
            self.pending.append(("swap-out", j, i - 1))
        if i == self.m - 1:
            self.pending.append(("swap-out", j, i))

    def _in(self, st: SimStage, j: int, x: int, prev_op: Hashable) -> None:
        self.prev_in = self._add(st, ("swap-in", j, x), (prev_op, ("swap-out", j, x), self.prev_in), "in")

    def _add(self, st: SimStage, key: tuple, deps, direction: str) -> Hashable:
        pair = (min(st.gpu, st.swap_peer), max(st.gpu, st.swap_peer))
        move = (st.held_bytes, swap_path(st, direction, self.paths, pair in self.nvlinks))
        self.moves.append(move)
        dur = st.swap_out_s if direction == "out" else st.swap_in_s
        return self.graph.add(key, deps, 0.0 if self.flows else dur, (move,) if self.flows else ())


def _swaps(st: SimStage) -> bool:
    return st.swap_tier in SWAP_TIERS and st.held_bytes > 0 and not st.fused
