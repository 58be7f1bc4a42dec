"""read_sysfs(): NVIDIA GPUs and NVMe drives with the PCIe path above each, parsed from a sysfs tree.

Pure parsing of files under `root` (/sys, or a copy made by `cp -a` or hwloc-gather-topology); every
read tolerates a missing file. `<root>/bus/pci/devices/<bdf>` is a symlink into `<root>/devices/`, and
the resolved path lists, after the host bridge (root bus), one PCI function per level:

    devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0/0000:3c:08.0/0000:3d:00.0
            root bus   root port    switch US    switch DS    GPU
            (root)     (top_port)   (switches[0])             (top_link = 3b:00.0's link)

Rule (NCCL's, src/graph/xml.cc): the bridge right under the root bus is a root port, never a switch.
The bridges below it are taken in pairs walking UP from the device: the parent is a downstream port
and ITS parent is the switch's upstream port, which names the switch; repeat for nested switches
(`switches` is nearest first). A lone bridge left over at the top of the pairs (an odd count, e.g. a
PCIe-to-PCI bridge) counts as a switch of its own. A device directly on the root bus (VMs:
devices/pci0000:00/0000:00:05.0) has no root port: top_port "" and top_link is its own link.
The root is the LAST `pciDDDD:BB` component, so paths under VMBUS or ACPI nodes work too; a device whose
link does not lead into <root>/devices/pciDDDD:BB/ gets root "" and a note.

Link speeds: a link is min(device's max_link_*, its parent port's max_link_*) over the values present
(0 = unknown), as NCCL does; "8.0 GT/s PCIe" and "8 GT/s" both parse (pci.gen_from_speed).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from topology.errors import TopologyError
from topology.pci import gen_from_speed, normalize_bus_id

__all__ = ["PciDevice", "SysfsScan", "read_sysfs", "NVIDIA", "NVME_CLASS"]

NVIDIA = 0x10DE
NVME_CLASS = 0x010802
_ROOT_RE = re.compile(r"^pci[0-9a-f]{4,8}:[0-9a-f]{2}$")
_BDF_RE = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_MEM_RE = re.compile(r"^Node\s+\d+\s+MemTotal:\s+(\d+)\s*kB", re.MULTILINE)


@dataclass(frozen=True)
class PciDevice:
    """A GPU (class 0x03xxxx, vendor 0x10de) or an NVMe drive (class 0x010802) and its PCIe path."""

    bdf: str
    """"0000:3b:00.0" (normalized, lower case)."""
    kind: str
    """"gpu" or "nvme"."""
    vendor: int
    device: int
    numa_node: int
    """-1 when sysfs says -1 or has no file."""
    link_gen: int
    """min(device, parent port) of max_link_speed as a PCIe generation; 0 unknown."""
    link_width: int
    """min(device, parent port) of max_link_width; 0 unknown."""
    root: str
    """Host bridge / root bus, the pciDDDD:BB component: "pci0000:3a"; "" when the path is unknown."""
    switches: tuple[str, ...]
    """Upstream-port BDFs of the PCIe switches above the device, nearest first."""
    switch_links: tuple[tuple[int, int], ...]
    """(gen, width) of each switch's upstream link (min with its parent port), same order."""
    top_link: tuple[int, int]
    """(gen, width) of the link under the root port (a switch upstream port or the device itself)."""
    top_port: str
    """BDF of the root port the path starts at; "" if the device sits directly on the root bus."""
    local_cpulist: str
    """CPUs close to the device ("0-11,24-35"); "" if unknown."""
    name: str
    """NVMe: "nvme0"; GPU: ""."""
    model: str
    """NVMe: nvme/nvmeN/model, stripped; GPU: ""."""


@dataclass(frozen=True)
class SysfsScan:
    """What one sysfs tree shows: the devices, NUMA nodes and host memory."""

    root: str
    """The sysfs root that was read."""
    devices: tuple[PciDevice, ...]
    """Sorted by bdf."""
    numa_cpus: dict[int, str]
    """NUMA node -> cpulist, from devices/system/node/node<N>/cpulist."""
    host_memory_bytes: int
    """Sum of the NUMA nodes' MemTotal; 0 unknown."""
    notes: tuple[str, ...]


def read_sysfs(root: str | Path = "/sys") -> SysfsScan:
    """Scan `<root>/bus/pci/devices` for NVIDIA GPUs and NVMe drives; TopologyError if root is no sysfs tree."""
    base = Path(root)
    pci_dir = base / "bus" / "pci" / "devices"
    if not pci_dir.is_dir():
        raise TopologyError(
            f"{root} is not a sysfs tree: expected {pci_dir} to be a directory, found "
            f"{'nothing' if not pci_dir.exists() else 'a file'}; point --sysfs-root at a /sys "
            f"copy (e.g. made by `cp -a` or hwloc-gather-topology)"
        )
    notes: list[str] = []
    devices_dir = os.path.realpath(base / "devices")
    nvme_names = _nvme_names(base)
    found = [_device(base, devices_dir, pci_dir / entry, nvme_names, notes) for entry in sorted(os.listdir(pci_dir))]
    devices = tuple(sorted((d for d in found if d), key=lambda d: d.bdf))
    numa = _numa_cpus(base)
    memory = _host_memory(base)
    if not numa:
        notes.append(f"no NUMA nodes under {base / 'devices/system/node'}: host memory and node CPUs unknown")
    return SysfsScan(str(root), devices, numa, memory, tuple(dict.fromkeys(notes)))


def _device(
    base: Path, devices_dir: str, entry: Path, nvme_names: dict[str, str], notes: list[str]
) -> PciDevice | None:
    path = os.path.realpath(entry)
    kind = _kind(_hex(path, "class", 0), _hex(path, "vendor", 0))
    if not kind:
        return None
    root, dirs = _pci_path(devices_dir, path)
    if not root:
        notes.append(
            f"PCIe path of {entry.name} unknown: {entry} does not link into "
            f"{devices_dir}/pciDDDD:BB/...; its root complex and switches are left unknown"
        )
    bridges = dirs[:-1]
    top_port = os.path.basename(bridges[0]) if bridges else ""
    ups = _upstream_ports(len(bridges))
    name = (_nvme_child(path) or nvme_names.get(path, "")) if kind == "nvme" else ""
    gen, width = _link(path)
    return PciDevice(
        bdf=normalize_bus_id(os.path.basename(path)),
        kind=kind,
        vendor=_hex(path, "vendor", 0),
        device=_hex(path, "device", 0),
        numa_node=_int(path, "numa_node", -1),
        link_gen=gen,
        link_width=width,
        root=root,
        switches=tuple(os.path.basename(bridges[i]) for i in ups),
        switch_links=tuple(_link(bridges[i]) for i in ups),
        top_link=_link(dirs[min(1, len(bridges))]),
        top_port=top_port,
        local_cpulist=_read(os.path.join(path, "local_cpulist")),
        name=name,
        model=_nvme_model(base, path, name) if kind == "nvme" else "",
    )


def _kind(cls: int, vendor: int) -> str:
    if cls >> 16 == 0x03 and vendor == NVIDIA:
        return "gpu"
    return "nvme" if cls == NVME_CLASS else ""


def _pci_path(devices_dir: str, path: str) -> tuple[str, list[str]]:
    """(root bus name, directories of the BDF components after it, top first, the device last)."""
    rel = os.path.relpath(path, devices_dir).split(os.sep)
    roots = [i for i, c in enumerate(rel) if _ROOT_RE.match(c)]
    if rel[0] == os.pardir or not roots:
        return "", [path]
    dirs, cur = [], os.path.join(devices_dir, *rel[: roots[-1] + 1])
    for comp in rel[roots[-1] + 1 :]:
        cur = os.path.join(cur, comp)
        if _BDF_RE.match(comp):
            dirs.append(cur)
    return rel[roots[-1]], dirs or [path]


def _upstream_ports(n_bridges: int) -> list[int]:
    """Indices (into the bridges above a device, top first) of switch upstream ports, nearest first.

    Index 0 is the root port; below it, walking up from the device, bridges pair as (downstream port,
    upstream port); a lone bridge left at the top is its own switch."""
    below, ups = list(range(1, n_bridges)), []
    while below:
        downstream = below.pop()
        ups.append(below.pop() if below else downstream)
    return ups


def _link(path: str) -> tuple[int, int]:
    """(gen, width) of the link above the function at `path`: min with its parent port, 0 unknown."""
    parent = os.path.dirname(path)
    gens = [g for g in (gen_from_speed(_read(os.path.join(p, "max_link_speed"))) for p in (path, parent)) if g]
    widths = [w for w in (_int(p, "max_link_width", 0) for p in (path, parent)) if w > 0]
    return (min(gens) if gens else 0, min(widths) if widths else 0)


def _nvme_names(base: Path) -> dict[str, str]:
    """Resolved PCI device path -> controller name, from <root>/class/nvme/nvmeN/device links."""
    cls = base / "class" / "nvme"
    names = {}
    for name in sorted(os.listdir(cls)) if cls.is_dir() else ():
        link = cls / name / "device"
        if os.path.exists(link):
            names.setdefault(os.path.realpath(link), name)
    return names


def _nvme_child(path: str) -> str:
    try:
        names = sorted(n for n in os.listdir(os.path.join(path, "nvme")) if n.startswith("nvme"))
    except OSError:
        return ""
    return names[0] if names else ""


def _nvme_model(base: Path, path: str, name: str) -> str:
    if not name:
        return ""
    return _read(os.path.join(path, "nvme", name, "model")) or _read(str(base / "class" / "nvme" / name / "model"))


def _numa_cpus(base: Path) -> dict[int, str]:
    node_dir = base / "devices" / "system" / "node"
    nodes = sorted(
        int(n[4:]) for n in (os.listdir(node_dir) if node_dir.is_dir() else ()) if re.fullmatch(r"node\d+", n)
    )
    return {n: _read(str(node_dir / f"node{n}" / "cpulist")) for n in nodes}


def _host_memory(base: Path) -> int:
    node_dir = base / "devices" / "system" / "node"
    total = 0
    for n in sorted(os.listdir(node_dir)) if node_dir.is_dir() else ():
        if re.fullmatch(r"node\d+", n):
            total += sum(int(kb) * 1024 for kb in _MEM_RE.findall(_read(str(node_dir / n / "meminfo"))))
    return total


def _read(path: str) -> str:
    """The stripped contents of a sysfs file; "" when it is missing or unreadable."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def _int(path: str, name: str, default: int) -> int:
    try:
        return int(_read(os.path.join(path, name)), 10)
    except ValueError:
        return default


def _hex(path: str, name: str, default: int) -> int:
    try:
        return int(_read(os.path.join(path, name)), 16)
    except ValueError:
        return default
