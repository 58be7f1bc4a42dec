"""discover(): this machine's Topology, from sysfs (the PCIe tree) and NVML (names, memory, NVLink, P2P).

The two sources are joined by normalized PCI bus id, never by index (NVML's order ignores
CUDA_VISIBLE_DEVICES). GPU indices follow PCI bus order, as NVML and CUDA_DEVICE_ORDER=PCI_BUS_ID do.
Each source fails soft and says so once in Topology.notes; finding no GPU at all is a TopologyError
that points to --layout.
"""

from __future__ import annotations

import os
import socket
from collections import Counter
from pathlib import Path

from topology.errors import TopologyError
from topology.nvml import NvmlGpu, NvmlScan, read_nvml
from topology.pci import pcie_gbps
from topology.presets import PRESETS
from topology.sysfs import PciDevice, SysfsScan, read_sysfs
from topology.types import Gpu, NvLink, Nvme, RootComplex, Switch, Topology

__all__ = ["discover", "merge"]

DEFAULT_LINK = (3, 16)
"""Assumed PCIe link (gen, width) when neither source knows it (NCCL assumes the same)."""
NVLINK_GBPS = {"GeForce": 14.0625, "": 25.0}
"""Assumed one-direction GB/s per NVLink: RTX 30-series bridge links, otherwise NVLink 3 (A100)."""
UNKNOWN = "unknown"
"""Root complex of devices whose PCIe path is not known."""
_PHB = 30
"""NVML common-ancestor level of a PCIe host bridge: at most this, two GPUs share a root complex."""


def discover(sysfs_root: str | Path | None = None, nvml=None) -> Topology:
    """The topology of this machine. sysfs_root=None reads /sys and tolerates its absence; a root given
    explicitly must be a sysfs tree. `nvml` is a pynvml-like module (None: the real one)."""
    notes: list[str] = []
    scan = None
    if sysfs_root is None and not Path("/sys/bus/pci/devices").is_dir():
        notes.append("no sysfs PCI tree at /sys: the PCIe layout comes from NVML alone")
    else:
        scan = read_sysfs(sysfs_root or "/sys")
    return merge(scan, read_nvml(nvml), notes)


def merge(scan: SysfsScan | None, nv: NvmlScan, notes: list[str] | None = None) -> Topology:
    """One Topology from the two scans (either may be empty)."""
    notes = list(notes or []) + list(scan.notes if scan else ()) + list(nv.notes)
    pci = {d.bdf: d for d in (scan.devices if scan else ()) if d.kind == "gpu"}
    by_bus = {g.bus_id: g for g in nv.gpus}
    buses = sorted(set(pci) | set(by_bus))
    if not buses:
        raise _no_gpu(scan, nv)
    if nv.available and not pci and scan is not None:
        notes.append(f"sysfs at {scan.root} shows none of NVML's GPUs: the PCIe layout comes from NVML levels")
    rcs, switches, owner = _tree(scan, buses) if pci and scan is not None else _tree_from_levels(nv, buses)
    gpus = tuple(_gpu(i, bus, pci.get(bus), by_bus.get(bus), owner, rcs, notes) for i, bus in enumerate(buses))
    rc_objs = tuple(RootComplex(name, numa, gbps) for name, (numa, gbps) in rcs.items())
    topo = Topology(
        name=socket.gethostname() or "this-machine",
        gpus=gpus,
        root_complexes=rc_objs,
        source="discovered:" + "+".join(s for s, ok in (("nvml", nv.available), ("sysfs", bool(pci))) if ok),
        host_memory_bytes=scan.host_memory_bytes if scan else 0,
        switches=switches,
        nvme=_nvme(scan, rcs),
        nvlinks=_nvlinks(nv, buses, gpus),
        p2p=_p2p(nv, buses),
        notes=(),
    )
    notes += _cross_check(topo, nv, buses)
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        notes.append(
            "CUDA_VISIBLE_DEVICES is set: gpu indices here are PCI bus order over ALL GPUs; "
            "match them to ranks by the uuid column"
        )
    return Topology(**{**topo.__dict__, "notes": tuple(dict.fromkeys(notes))})


def _no_gpu(scan: SysfsScan | None, nv: NvmlScan) -> TopologyError:
    nvml = "NVML lists no GPU" if nv.available else (nv.notes[0] if nv.notes else "NVML is not available")
    where = f"sysfs at {scan.root} lists no NVIDIA GPU (class 0x03, vendor 0x10de)" if scan else "no sysfs tree"
    return TopologyError(
        f"no GPU found: {nvml}; {where}. On a machine without GPUs (or to plan for another "
        f"one) give a layout: --layout {' | '.join(PRESETS)} or --layout server.yaml"
    )


def _link(gen: int, width: int) -> float:
    return pcie_gbps(*((gen, width) if gen and width else DEFAULT_LINK))


def _root(d: PciDevice) -> str:
    """The device's root complex; sysfs paths that do not lead to a host bridge go to UNKNOWN."""
    return d.root or UNKNOWN


def _tree(scan: SysfsScan, buses: list[str]) -> tuple[dict, tuple[Switch, ...], dict[str, str]]:
    """Root complexes {name: (numa, uplink GB/s)}, the switches above the GPUs and drives sysfs shows, and
    each GPU's root complex (a GPU NVML knows but sysfs does not show goes to root complex "unknown")."""
    devs = [d for d in scan.devices if d.kind == "nvme" or d.bdf in buses]
    owner = {bus: next((_root(d) for d in devs if d.bdf == bus), UNKNOWN) for bus in buses}
    rcs: dict[str, tuple[int, float]] = {}
    if UNKNOWN in owner.values():
        rcs[UNKNOWN] = (-1, _link(*DEFAULT_LINK))
    for root in sorted({_root(d) for d in devs}):
        under = [d for d in devs if _root(d) == root]
        numa = Counter(d.numa_node for d in under).most_common(1)[0][0]
        tops = {(d.top_port or d.bdf): _link(*d.top_link) for d in under}
        rcs[root] = (numa, sum(tops.values()))
    switches: dict[str, Switch] = {}
    for d in devs:
        for k, name in enumerate(d.switches):
            parent = d.switches[k + 1] if k + 1 < len(d.switches) else ""
            switches.setdefault(name, Switch(name, _root(d), _link(*d.switch_links[k]), parent))
    return rcs, tuple(switches[n] for n in sorted(switches)), owner


def _tree_from_levels(nv: NvmlScan, buses: list[str]) -> tuple[dict, tuple[Switch, ...], dict[str, str]]:
    """Without sysfs: GPUs whose common ancestor is at most a host bridge (PHB) share a root complex."""
    pos = {g.bus_id: k for k, g in enumerate(nv.gpus)}
    rcs: dict[str, tuple[int, float]] = {}
    owner: dict[str, str] = {}
    for i, bus in enumerate(buses):
        near = [b for b in buses[:i] if 0 <= nv.levels[pos[bus]][pos[b]] <= _PHB]
        owner[bus] = owner[near[0]] if near else f"rc{len(rcs)}"
        numa, bw = rcs.get(owner[bus], (-1, 0.0))
        g = nv.gpus[pos[bus]]
        rcs[owner[bus]] = (numa, bw + _link(g.max_gen, g.max_width))
    return rcs, (), owner


def _gpu(
    i: int, bus: str, d: PciDevice | None, n: NvmlGpu | None, owner: dict[str, str], rcs: dict, notes: list[str]
) -> Gpu:
    gen = (n.max_gen if n and n.max_gen else 0) or (d.link_gen if d else 0)
    width = (n.max_width if n and n.max_width else 0) or (d.link_width if d else 0)
    if not (gen and width):
        notes.append(
            f"PCIe generation/width of some GPUs unknown: assuming gen {DEFAULT_LINK[0]} "
            f"x{DEFAULT_LINK[1]}; --probe measures the real bandwidth"
        )
    if n:
        name = n.name
    else:
        notes.append(
            "GPU names and memory unknown without NVML: memory_bytes is 0; edit a saved layout "
            "or install the NVIDIA driver"
        )
        assert d is not None  # merge() passes only buses that sysfs or NVML lists
        name = f"NVIDIA GPU {d.device:#06x}"
    rc = owner[bus]
    return Gpu(
        index=i,
        name=name,
        memory_bytes=n.memory_bytes if n else 0,
        pci_bus_id=bus,
        root_complex=rc,
        numa_node=d.numa_node if d else rcs[rc][0],
        link_gbps=_link(gen, width),
        uuid=n.uuid if n else "",
        switch=d.switches[0] if d and d.switches else "",
        pcie_gen=gen,
        pcie_width=width,
        cpu_affinity=(n.cpu_affinity if n and n.cpu_affinity else (d.local_cpulist if d else "")),
    )


def _nvme(scan: SysfsScan | None, rcs: dict) -> tuple[Nvme, ...]:
    drives = [d for d in (scan.devices if scan else ()) if d.kind == "nvme" and _root(d) in rcs]
    return tuple(
        Nvme(
            name=d.name or d.bdf,
            pci_bus_id=d.bdf,
            root_complex=_root(d),
            numa_node=d.numa_node,
            link_gbps=_link(d.link_gen, d.link_width),
            switch=d.switches[0] if d.switches else "",
            model=d.model,
        )
        for d in drives
    )


def _nvlinks(nv: NvmlScan, buses: list[str], gpus: tuple[Gpu, ...]) -> tuple[NvLink, ...]:
    index = {b: i for i, b in enumerate(buses)}
    out = {}
    for g in nv.gpus:
        a = index[g.bus_id]
        for remote, count in g.nvlinks:
            b = index.get(remote)
            if b is not None and a < b:
                per = NVLINK_GBPS["GeForce" if "GeForce" in gpus[a].name else ""]
                out[(a, b)] = NvLink(a, b, count, count * per)
    return tuple(out[k] for k in sorted(out))


def _p2p(nv: NvmlScan, buses: list[str]) -> tuple[tuple[str, ...], ...]:
    if not nv.available or not nv.p2p:
        return ()
    pos = [next(k for k, g in enumerate(nv.gpus) if g.bus_id == b) for b in buses]
    return tuple(tuple(nv.p2p[a][b] for b in pos) for a in pos)


def _cross_check(t: Topology, nv: NvmlScan, buses: list[str]) -> list[str]:
    """NVML may label every pair SYS (VMs, some boards): say so when sysfs disagrees."""
    if not nv.available or not nv.levels:
        return []
    pos = {g.bus_id: k for k, g in enumerate(nv.gpus)}
    odd = [
        (a, b)
        for a in range(t.num_gpus)
        for b in range(a + 1, t.num_gpus)
        if buses[a] in pos and buses[b] in pos and nv.levels[pos[buses[a]]][pos[buses[b]]] == 50 and t.shared(a, b)
    ]
    if not odd:
        return []
    return [
        f"NVML labels {len(odd)} GPU pair(s) SYS (e.g. gpus {odd[0][0]} and {odd[0][1]}) that sysfs puts under "
        f"one root complex: a VM or a hidden PCIe tree; contention groups follow sysfs, --probe measures it"
    ]
