"""The part of a machine a job uses: its GPUs picked by PCI bus id, in the job's (CUDA's) order.

A training job sees the GPUs CUDA shows it (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER) and numbers its ranks
in that order, while discovery numbers every GPU of the host in PCI bus order. select_gpus() joins the two
by bus id (never by index) and renumbers the chosen GPUs 0..n-1 so that gpu g of the result is rank g's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from topology.errors import TopologyError
from topology.pci import normalize_bus_id
from topology.types import Measured, Topology

__all__ = ["select_gpus", "bus_id_of"]


def bus_id_of(domain: int, bus: int, device: int) -> str:
    """The normalized bus id ("0000:3b:00.0") of a GPU given as CUDA reports it (pci_domain_id, ...)."""
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def select_gpus(topo: Topology, bus_ids: Sequence[str]) -> Topology:
    """The topology of the GPUs with these bus ids, gpu g being bus_ids[g]; root complexes, switches and
    drives stay whole (they are the paths the chosen GPUs share), pairwise facts keep the chosen pairs."""
    wanted = [normalize_bus_id(b) for b in bus_ids]
    known = {g.pci_bus_id: g.index for g in topo.gpus}
    missing = [b for b in wanted if b not in known]
    if missing or len(set(wanted)) != len(wanted) or not wanted:
        raise TopologyError(
            f"the job's gpus {wanted} are not distinct gpus of {topo.name!r} (found there: {sorted(known)}; "
            f"missing: {missing}); describe the machine in a layout file and set plan.topology to it"
        )
    old = [known[b] for b in wanted]
    new_of = {o: n for n, o in enumerate(old)}
    gpus = tuple(replace(topo.gpus[o], index=n) for n, o in enumerate(old))
    nvlinks = tuple(
        replace(link, a=new_of[link.a], b=new_of[link.b])
        for link in topo.nvlinks
        if link.a in new_of and link.b in new_of
    )
    p2p = tuple(tuple(topo.p2p[a][b] for b in old) for a in old) if topo.p2p else ()
    return replace(
        topo,
        gpus=gpus,
        nvlinks=nvlinks,
        p2p=p2p,
        measured=_measured(topo.measured, old),
        notes=tuple(n for n in topo.notes if not n.startswith("CUDA_VISIBLE_DEVICES is set")),
    )


def _measured(m: Measured | None, old: list[int]) -> Measured | None:
    """Per-gpu measurements of the chosen gpus, in their new order (unmeasured fields stay empty)."""
    if m is None:
        return None

    def pick(values: tuple) -> tuple:
        return tuple(values[o] for o in old) if values else ()

    d2d = tuple(tuple(m.d2d_gbps[a][b] for b in old) for a in old) if m.d2d_gbps else ()
    return replace(m, h2d_gbps=pick(m.h2d_gbps), h2d_group_gbps=pick(m.h2d_group_gbps), d2d_gbps=d2d)
