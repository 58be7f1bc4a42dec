"""Which resource bounds a simulated step: the busy seconds of each gpu's compute, each PCIe link, the SSD
and the host's Adam, and the busiest of them.

Legend (one step; units in brackets):
  T        the simulated step time                                                         [s]
  C_g      gpu g's compute busy seconds (SimResult.compute_busy_s)                          [s]
  L_k      link k's busy seconds: bytes it moved / its capacity (GB/s * 1e9)                [s]
  D        the SSD's busy seconds: bytes the step reads / R + bytes it writes / W (updates,  [s]
           loads and offloads: SimResult.link_bytes' "ssd" rows)
  U        the host Adam's busy seconds: the busiest rank's update thread, the sum of update_s [s]
           over its gpu's stages (each rank updates its own stages, the ranks at once)

Each resource is busy at most T, so T >= max(C_g, L_k, D, U); the step is "bound by" the resource with
the most busy seconds, the tightest of these lower bounds. A step far above all of them is bound by the
dependencies between them (the pipeline's fill and drain), which the share (busy / T) shows.
"""

from __future__ import annotations

from dataclasses import dataclass

from partition.sim.simulate import SimResult, SimStage, SsdLink, link_paths
from topology import Topology

__all__ = ["StepBound", "step_bound"]


@dataclass(frozen=True)
class StepBound:
    """The busy seconds of each kind of resource (its busiest instance) and which of them bounds the step."""

    step_time_s: float
    busy_s: dict[str, float]
    """"compute", "pcie", "ssd", "host_adam" -> seconds the busiest such resource works in the step."""
    names: dict[str, str]
    """The same keys -> which instance ("gpu 2", "rc0 h2d", "ssd", "host")."""

    @property
    def bound_by(self) -> str:
        """The key with the most busy seconds (the first listed on a tie)."""
        return max(self.busy_s, key=lambda k: self.busy_s[k])

    @property
    def bound_link(self) -> str:
        return self.names[self.bound_by]

    @property
    def share(self) -> float:
        """Busy seconds of the bounding resource / step time."""
        return self.busy_s[self.bound_by] / self.step_time_s if self.step_time_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "bound_by": self.bound_by,
            "bound_link": self.bound_link,
            "bound_share": self.share,
            "busy_s": dict(self.busy_s),
            "busy_names": dict(self.names),
        }


def step_bound(sim: SimResult, stages: list[SimStage], topo: Topology | None, ssd: SsdLink | None) -> StepBound:
    """The legend's busy seconds of `sim` (simulated from `stages`, on `topo` if given, with `ssd`)."""
    g = max(range(len(sim.compute_busy_s)), key=lambda k: sim.compute_busy_s[k], default=0)
    busy = {"compute": max(sim.compute_busy_s, default=0.0)}
    names = {"compute": f"gpu {g}"}
    busy["pcie"], names["pcie"] = _busiest_link(sim, stages, topo)
    moved = {d: b for n, d, b in sim.link_bytes if n == "ssd"}
    busy["ssd"] = ssd.seconds(moved.get("read", 0), moved.get("write", 0)) if ssd else 0.0
    names["ssd"] = "ssd"
    per_rank = [sum(s.update_s for s in stages if s.gpu == g) for g in range(len(sim.compute_busy_s))]
    r = max(range(len(per_rank)), key=lambda k: per_rank[k], default=0)
    busy["host_adam"], names["host_adam"] = max(per_rank, default=0.0), f"rank {r}'s update thread"
    return StepBound(sim.step_time_s, busy, names)


def _busiest_link(sim: SimResult, stages: list[SimStage], topo: Topology | None) -> tuple[float, str]:
    """(seconds, "link direction") of the PCIe link with the most busy seconds: bytes over capacity with a
    topology, else each gpu's static load and offload times."""
    if topo is None:
        per: dict[str, float] = {}
        for e in sim.events:
            if e[0] in ("load", "offload"):
                key = f"gpu{e[1]} {'h2d' if e[0] == 'load' else 'd2h'}"
                per[key] = per.get(key, 0.0) + (stages[e[2]].load_s if e[0] == "load" else stages[e[2]].offload_s)
    else:
        caps, _ = link_paths(topo)
        per = {f"{n} {d}": b / (caps[(n, d)] * 1e9) for n, d, b in sim.link_bytes if (n, d) in caps}
    if not per:
        return 0.0, "none"
    name = max(per, key=lambda k: per[k])
    return per[name], name
