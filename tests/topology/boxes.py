"""Recorded test machines, each described once and written out both as a sysfs tree and as a fake pynvml."""

from __future__ import annotations

import ctypes
import os
import uuid
from pathlib import Path
from types import SimpleNamespace

import pynvml

from foundation.units import GiB

GEN3, GEN4, OLD3, OLD4 = "8.0 GT/s PCIe", "16.0 GT/s PCIe", "8 GT/s", "16 GT/s"
INTEL_RP, AMD_RP, PLX, BRCM = (0x8086, 0x2030), (0x1022, 0x1483), (0x10B5, 0x8747), (0x1000, 0xC010)
MODELS = {  # name -> (PCI device id, memory bytes, own max gen, own max width)
    "3090 Ti": ("NVIDIA GeForce RTX 3090 Ti", 0x2203, 24 * GiB, 4, 16),
    "3090": ("NVIDIA GeForce RTX 3090", 0x2204, 24 * GiB, 4, 16),
    "A6000": ("NVIDIA RTX A6000", 0x2230, 48 * GiB, 4, 16),
}
LEVEL = {"PIX": 10, "PXB": 20, "PHB": 30, "NODE": 40, "SYS": 50}


def port(bdf, speed, width, *children, ids=INTEL_RP):
    """A PCIe bridge (root port or switch port)."""
    return dict(bdf=bdf, cls=0x060400, ids=ids, speed=speed, width=width, children=children)


def switch(us, speed, width, downstream, ids=PLX):
    """A PCIe switch: upstream port `us` and one downstream port per (ds bdf, child) pair."""
    return port(us, speed, width, *(port(ds, speed, width, child, ids=ids) for ds, child in downstream), ids=ids)


def gpu(bdf, model, speed: str | None = GEN4, width: int | None = 16, audio=True):
    return dict(
        bdf=bdf,
        cls=0x030000,
        ids=(0x10DE, MODELS[model][1]),
        speed=speed,
        width=width,
        model=model,
        audio=audio,
        children=(),
    )


def nvme(bdf, name, model, ids, speed=GEN4, width=4):
    return dict(bdf=bdf, cls=0x010802, ids=ids, speed=speed, width=width, nvme=(name, model), children=())


def _other(bdf, cls, ids, speed, width, *children):
    return dict(bdf=bdf, cls=cls, ids=ids, speed=speed, width=width, children=children)


def _pair(rp, us, ds, gpus, model="3090", rp_ids=AMD_RP):
    """Root port -> gen4 switch -> two GPUs: ds = downstream port bdfs, gpus = gpu bdfs."""
    return port(
        rp, GEN4, 16, switch(us, GEN4, 16, [(d, gpu(g, model)) for d, g in zip(ds, gpus)], ids=BRCM), ids=rp_ids
    )


def _child(us, ds, gpus):
    """A gen4 switch with an x8 upstream port and x16 downstream ports to two 3090s."""
    return port(us, GEN4, 8, *(port(d, GEN4, 16, gpu(g, "3090"), ids=BRCM) for d, g in zip(ds, gpus)), ids=BRCM)


BOXES = {
    "2+2": dict(  # dual Xeon SP (gen3), old kernel speed strings, a PLX switch per socket with two 3090 Ti
        nodes={0: ("0-11,24-35", 96 * GiB), 1: ("12-23,36-47", 96 * GiB)},
        roots={
            "pci0000:00": (
                0,
                [
                    port(
                        "0000:00:1c.0",
                        OLD3,
                        1,
                        _other(
                            "0000:02:00.0",
                            0x060400,
                            (0x1A03, 0x1150),
                            "5 GT/s",
                            1,
                            _other("0000:03:00.0", 0x030000, (0x1A03, 0x2000), None, None),
                        ),
                    )
                ],
            ),
            "pci0000:17": (
                0,
                [
                    port(
                        "0000:17:00.0",
                        OLD3,
                        4,
                        nvme("0000:18:00.0", "nvme0", "Samsung SSD 980 PRO 1TB", (0x144D, 0xA80A), OLD4),
                    )
                ],
            ),
            "pci0000:3a": (
                0,
                [
                    port(
                        "0000:3a:00.0",
                        OLD3,
                        16,
                        switch(
                            "0000:3b:00.0",
                            OLD3,
                            16,
                            [
                                ("0000:3c:08.0", gpu("0000:3d:00.0", "3090 Ti", OLD4)),
                                ("0000:3c:10.0", gpu("0000:3e:00.0", "3090 Ti", OLD4)),
                            ],
                        ),
                    )
                ],
            ),
            "pci0000:ae": (
                1,
                [
                    port(
                        "0000:ae:00.0",
                        OLD3,
                        16,
                        switch(
                            "0000:af:00.0",
                            OLD3,
                            16,
                            [
                                ("0000:b0:08.0", gpu("0000:b1:00.0", "3090 Ti", OLD4)),
                                ("0000:b0:10.0", gpu("0000:b2:00.0", "3090 Ti", OLD4)),
                            ],
                        ),
                    )
                ],
            ),
        },
        levels=("PIX SYS SYS", "SYS SYS", "PIX"),
        p2p="GNS",
        nvlinks=(),
        nvlink_hw=4,
        link_count_field=True,
    ),
    "3+1": dict(  # dual Xeon (gen4): 3 GPUs + an NVMe under one switch on socket 0, 1 GPU on an x8 root port
        nodes={0: ("0-15,32-47", 128 * GiB), 1: ("16-31,48-63", 128 * GiB)},
        roots={
            "pci0000:4a": (
                0,
                [
                    port(
                        "0000:4a:02.0",
                        GEN4,
                        16,
                        switch(
                            "0000:4b:00.0",
                            GEN4,
                            16,
                            [
                                ("0000:4c:00.0", gpu("0000:4d:00.0", "3090")),
                                ("0000:4c:04.0", gpu("0000:4e:00.0", "3090")),
                                ("0000:4c:08.0", gpu("0000:4f:00.0", "3090")),
                                (
                                    "0000:4c:0c.0",
                                    nvme("0000:50:00.0", "nvme0", "INTEL SSDPF2KX038TZ", (0x8086, 0x0B60)),
                                ),
                            ],
                            ids=BRCM,
                        ),
                    )
                ],
            ),
            "pci0000:e2": (1, [port("0000:e2:02.0", GEN4, 8, gpu("0000:e3:00.0", "3090"))]),
        },
        levels=("PIX PIX SYS", "PIX SYS", "SYS"),
        p2p="GNS",
        nvlinks=(),
        nvlink_hw=4,
        link_count_field=True,
    ),
    "8-dual-socket": dict(  # dual EPYC: per socket two root ports on one root bus, a switch with 2 GPUs on each
        nodes={0: ("0-31,64-95", 256 * GiB), 1: ("32-63,96-127", 256 * GiB)},
        roots={
            "pci0000:00": (
                0,
                [
                    port(
                        "0000:00:01.1",
                        GEN4,
                        4,
                        nvme("0000:01:00.0", "nvme0", "SAMSUNG MZQL23T8HCLS-00A07", (0x144D, 0xA80A)),
                        ids=AMD_RP,
                    )
                ],
            ),
            "pci0000:40": (
                0,
                [
                    _pair(
                        "0000:40:01.1",
                        "0000:41:00.0",
                        ["0000:42:00.0", "0000:42:01.0"],
                        ["0000:43:00.0", "0000:44:00.0"],
                    ),
                    _pair(
                        "0000:40:03.1",
                        "0000:45:00.0",
                        ["0000:46:00.0", "0000:46:01.0"],
                        ["0000:47:00.0", "0000:48:00.0"],
                    ),
                ],
            ),
            "pci0000:c0": (
                1,
                [
                    _pair(
                        "0000:c0:01.1",
                        "0000:c1:00.0",
                        ["0000:c2:00.0", "0000:c2:01.0"],
                        ["0000:c3:00.0", "0000:c4:00.0"],
                    ),
                    _pair(
                        "0000:c0:03.1",
                        "0000:c5:00.0",
                        ["0000:c6:00.0", "0000:c6:01.0"],
                        ["0000:c7:00.0", "0000:c8:00.0"],
                    ),
                ],
            ),
            "pci0000:e0": (
                1,
                [
                    port(
                        "0000:e0:03.1",
                        GEN4,
                        4,
                        nvme("0000:e1:00.0", "nvme1", "SAMSUNG MZWLJ3T8HBLS-00007", (0x144D, 0xA824)),
                        ids=AMD_RP,
                    )
                ],
            ),
        },
        levels=(
            "PIX PHB PHB SYS SYS SYS SYS",
            "PHB PHB SYS SYS SYS SYS",
            "PIX SYS SYS SYS SYS",
            "SYS SYS SYS SYS",
            "PIX PHB PHB",
            "PHB PHB",
            "PIX",
        ),
        p2p="GNS",
        nvlinks=(),
        nvlink_hw=4,
        link_count_field=True,
    ),
    "nvlink-pair": dict(  # Threadripper Pro: 4 GPUs on 4 root buses of one socket, two NVLink bridges (NV4)
        nodes={0: ("0-63", 256 * GiB)},
        roots={
            f"pci0000:{b:02x}": (
                0,
                [port(f"0000:{b:02x}:01.1", GEN4, 16, gpu(f"0000:{b + 1:02x}:00.0", "3090"), ids=AMD_RP)],
            )
            for b in (0x00, 0x20, 0x40, 0x60)
        },
        levels=("NODE NODE NODE", "NODE NODE", "NODE"),
        p2p=("OK GNS GNS", "GNS GNS", "OK"),
        nvlinks=((0, 1, 4), (2, 3, 4)),
        nvlink_hw=4,
        link_count_field=True,
    ),
    "4-pxb": dict(  # one socket: a parent switch over two x8-uplinked child switches of two GPUs (PIX / PXB)
        nodes={0: ("0-23", 128 * GiB)},
        roots={
            "pci0000:16": (
                0,
                [
                    port(
                        "0000:16:00.0",
                        GEN4,
                        16,
                        switch(
                            "0000:17:00.0",
                            GEN4,
                            16,
                            [
                                (
                                    "0000:18:00.0",
                                    _child(
                                        "0000:19:00.0",
                                        ["0000:1a:00.0", "0000:1a:08.0"],
                                        ["0000:1b:00.0", "0000:1c:00.0"],
                                    ),
                                ),
                                (
                                    "0000:18:08.0",
                                    _child(
                                        "0000:1d:00.0",
                                        ["0000:1e:00.0", "0000:1e:08.0"],
                                        ["0000:1f:00.0", "0000:20:00.0"],
                                    ),
                                ),
                            ],
                            ids=BRCM,
                        ),
                    )
                ],
            )
        },
        levels=("PIX PXB PXB", "PXB PXB", "PIX"),
        p2p="GNS",
        nvlinks=(),
        nvlink_hw=4,
        link_count_field=True,
    ),
    "vm": dict(  # 4 passed-through GPUs straight on the root bus: no bridges, numa -1, no link files
        nodes={0: ("0-15", 64 * GiB)},
        roots={"pci0000:00": (-1, [gpu(f"0000:00:{s:02x}.0", "A6000", None, None, audio=False) for s in (5, 6, 7, 8)])},
        levels=("SYS SYS SYS", "SYS SYS", "SYS"),
        p2p="NS",
        nvlinks=(),
        nvlink_hw=0,
        link_count_field=False,
    ),
}

FAKES = {  # failure fakes: (box, changes to the box's NVML behaviour)
    "no-library": ("2+2", dict(faults={"nvmlInit": "LibraryNotFound"})),
    "no-driver": ("2+2", dict(faults={"nvmlInit": "DriverNotLoaded"})),
    "unsupported": (
        "2+2",
        dict(
            faults={
                "nvmlDeviceGetMaxPcieLinkGeneration": "NotSupported",
                "nvmlDeviceGetCpuAffinity": "NotSupported",
                "nvmlDeviceGetFieldValues": "NotSupported",
            }
        ),
    ),
    "nvlink-unbounded": ("nvlink-pair", dict(nvlink_hw=2, link_count_field=False)),
}


def walk(box: dict):
    """(path components from the root bus, node, parent node or None, numa node) for every function."""

    def down(parts, node, parent, numa):
        here = parts + [node["bdf"]]
        yield here, node, parent, numa
        for child in node["children"]:
            yield from down(here, child, node, numa)

    for root, (numa, children) in box["roots"].items():
        for child in children:
            yield from down([root], child, None, numa)


def _cpulist(box: dict, numa: int) -> str:
    return box["nodes"][numa][0] if numa >= 0 else ",".join(c for c, _ in box["nodes"].values())


def write_sysfs(name: str, root: Path) -> Path:
    """Write box `name` as a sysfs tree under `root` and return root."""
    box = BOXES[name]
    for parts, node, _, numa in walk(box):
        _write_function(root, parts, node, numa, _cpulist(box, numa))
        if node.get("audio"):
            audio = dict(node, bdf=node["bdf"][:-1] + "1", cls=0x040300, ids=(0x10DE, 0x1AEF), audio=False)
            _write_function(root, parts[:-1] + [audio["bdf"]], audio, numa, _cpulist(box, numa))
    for n, (cpus, mem) in box["nodes"].items():
        d = root / "devices" / "system" / "node" / f"node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
        (d / "meminfo").write_text(f"Node {n} MemTotal:       {mem // 1024} kB\nNode {n} MemFree:        1024 kB\n")
    return root


def _write_function(root: Path, parts: list[str], node: dict, numa: int, cpus: str) -> None:
    d = root.joinpath("devices", *parts)
    d.mkdir(parents=True, exist_ok=True)
    files = {
        "class": f"0x{node['cls']:06x}",
        "vendor": f"0x{node['ids'][0]:04x}",
        "device": f"0x{node['ids'][1]:04x}",
        "numa_node": str(numa),
        "local_cpulist": cpus,
        "max_link_speed": node["speed"],
        "max_link_width": node["width"],
    }
    for fname, text in files.items():
        if text is not None:
            (d / fname).write_text(f"{text}\n")
    links = root / "bus" / "pci" / "devices"
    links.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.join("..", "..", "..", "devices", *parts), links / node["bdf"])
    if "nvme" in node:
        ctrl, model = node["nvme"]
        (d / "nvme" / ctrl).mkdir(parents=True)
        (d / "nvme" / ctrl / "model").write_text(f"{model:<40}\n")
        os.symlink(os.path.join("..", ".."), d / "nvme" / ctrl / "device")
        (root / "class" / "nvme").mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.join("..", "..", "devices", *parts, "nvme", ctrl), root / "class" / "nvme" / ctrl)


def _gen(speed) -> int:
    return {"8": 3, "16": 4, "5": 2}.get((speed or "").split(".")[0].split(" ")[0], 0)


def nvml_gpus(name: str) -> list[dict]:
    """The box's GPUs in NVML order (PCI bus order) with what NVML reports about each."""
    box, out = BOXES[name], []
    for _parts, node, parent, numa in sorted(walk(box), key=lambda w: w[1]["bdf"]):
        if "model" not in node:
            continue
        full, devid, memory, gen, width = MODELS[node["model"]]
        if parent and _gen(parent["speed"]):
            gen, width = min(gen, _gen(parent["speed"])), min(width, parent["width"])
        bus, dev = int(node["bdf"][5:7], 16), int(node["bdf"][8:10], 16)
        out.append(
            dict(
                bdf=node["bdf"],
                name=full,
                memory=memory,
                gen=gen,
                width=width,
                cpus=_cpulist(box, numa),
                uuid="GPU-" + str(uuid.uuid5(uuid.NAMESPACE_URL, f"{name}/{node['bdf']}")),
                pci=SimpleNamespace(
                    busId=f"00000000:{bus:02X}:{dev:02X}.0",
                    domain=0,
                    bus=bus,
                    device=dev,
                    pciDeviceId=devid << 16 | 0x10DE,
                ),
            )
        )
    return out


def triangle(rows, n: int, diagonal) -> list[list]:
    """Upper-triangle rows ("PIX SYS", "SYS") or one label for every pair -> a symmetric n x n matrix."""
    m = [[diagonal] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            m[i][j] = m[j][i] = rows if isinstance(rows, str) else rows[i].split()[j - i - 1]
    return m


class Handle:
    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"<fake nvmlDevice {self.index}>"


class FakeNvml:
    """A pynvml stand-in for one box: the nvml* functions read_nvml uses, raising the real pynvml errors.

    `faults` maps a function name to the pynvml error suffix ("NotSupported") or "ArgumentError" it
    raises; `calls` records (function, args) in order."""

    NVMLError = pynvml.NVMLError
    NVML_FI_DEV_NVLINK_LINK_COUNT = pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT
    NVML_NVLINK_MAX_LINKS = pynvml.NVML_NVLINK_MAX_LINKS
    NVML_P2P_CAPS_INDEX_READ = pynvml.NVML_P2P_CAPS_INDEX_READ

    def __init__(self, name: str, faults=None, p2p=None, nvlink_hw=None, link_count_field=None):
        box = BOXES[name]
        self.box, self.gpus, self.faults = name, nvml_gpus(name), dict(faults or {})
        n = len(self.gpus)
        self.levels = [[LEVEL.get(x, 0) for x in row] for row in triangle(box["levels"], n, "X")]
        self.p2p = [[pynvml_status(x) for x in row] for row in triangle(p2p or box["p2p"], n, "X")]
        self.nvlink_hw = box["nvlink_hw"] if nvlink_hw is None else nvlink_hw
        self.link_field = box["link_count_field"] if link_count_field is None else link_count_field
        self.links = {i: [] for i in range(n)}  # gpu -> remote gpu of each of its links, in link order
        for a, b, k in box["nvlinks"]:
            self.links[a] += [b] * k
            self.links[b] += [a] * k
        self.calls: list[tuple] = []
        self.live = False

    def _enter(self, fn: str, *args) -> None:
        self.calls.append((fn, args))
        fault = self.faults.get(fn)
        if fault == "ArgumentError":
            raise ctypes.ArgumentError(f"argument 3: TypeError: fault injected into {fn}")
        if fault:
            raise getattr(pynvml, f"NVMLError_{fault}")()
        if not self.live and fn != "nvmlInit":
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    def nvmlInit(self):
        self._enter("nvmlInit")
        self.live = True

    def nvmlShutdown(self):
        self._enter("nvmlShutdown")
        self.live = False

    def nvmlDeviceGetCount(self):
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        self._enter("nvmlDeviceGetHandleByIndex", i)
        if not 0 <= i < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return Handle(i)

    def _get(self, fn, h, key):
        self._enter(fn, h)
        return self.gpus[h.index][key]

    def nvmlDeviceGetPciInfo(self, h):
        return self._get("nvmlDeviceGetPciInfo", h, "pci")

    def nvmlDeviceGetName(self, h):
        return self._get("nvmlDeviceGetName", h, "name")

    def nvmlDeviceGetUUID(self, h):
        return self._get("nvmlDeviceGetUUID", h, "uuid")

    def nvmlDeviceGetMemoryInfo(self, h):
        total = self._get("nvmlDeviceGetMemoryInfo", h, "memory")
        return SimpleNamespace(total=total, free=total - (512 << 20), used=512 << 20)

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self._get("nvmlDeviceGetMaxPcieLinkGeneration", h, "gen")

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self._get("nvmlDeviceGetMaxPcieLinkWidth", h, "width")

    def nvmlDeviceGetCpuAffinity(self, h, size):
        self._enter("nvmlDeviceGetCpuAffinity", h, size)
        words = [0] * size
        for cpu in parse_cpulist(self.gpus[h.index]["cpus"]):
            if cpu < 64 * size:
                words[cpu // 64] |= 1 << cpu % 64
        return (ctypes.c_ulonglong * size)(*words)

    def nvmlDeviceGetFieldValues(self, h, fields):
        self._enter("nvmlDeviceGetFieldValues", h, fields)
        out = []
        for field_id, scope in fields:
            known = field_id == pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT and self.link_field
            out.append(
                SimpleNamespace(
                    fieldId=field_id,
                    scopeId=scope,
                    valueType=pynvml.NVML_VALUE_TYPE_UNSIGNED_INT,
                    nvmlReturn=0 if known else pynvml.NVML_ERROR_NOT_SUPPORTED,
                    value=SimpleNamespace(uiVal=self.nvlink_hw if known else 0),
                )
            )
        return out

    def nvmlDeviceGetNvLinkState(self, h, link):
        self._enter("nvmlDeviceGetNvLinkState", h, link)
        if not self.nvlink_hw:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < self.nvlink_hw:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(link < len(self.links[h.index]))

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        self._enter("nvmlDeviceGetNvLinkRemotePciInfo", h, link)
        if link >= len(self.links[h.index]):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self.gpus[self.links[h.index][link]]["pci"]

    def nvmlDeviceGetP2PStatus(self, h1, h2, index):
        self._enter("nvmlDeviceGetP2PStatus", h1, h2, index)
        if not isinstance(index, int):  # as ctypes does with pynvml's NVML_P2P_CAPS_INDEX_READ == (0,)
            raise ctypes.ArgumentError(f"argument 3: TypeError: Don't know how to convert parameter 3: {index!r}")
        return self.p2p[h1.index][h2.index]

    def nvmlDeviceGetTopologyCommonAncestor(self, h1, h2):
        self._enter("nvmlDeviceGetTopologyCommonAncestor", h1, h2)
        return self.levels[h1.index][h2.index]


def pynvml_status(label: str) -> int:
    """nvidia-smi P2P label -> NVML_P2P_STATUS_* int ("X" -> -1, never asked)."""
    return ("OK", "CNS", "GNS", "TNS", "DR", "NS", "U").index(label) if label != "X" else -1


def parse_cpulist(text: str) -> list[int]:
    cpus = []
    for part in filter(None, text.split(",")):
        a, _, b = part.partition("-")
        cpus += range(int(a), int(b or a) + 1)
    return cpus


def fake_nvml(name: str, **changes) -> FakeNvml:
    """A fake for box `name`, or for a failure fake of FAKES, with optional further changes."""
    box, base = FAKES.get(name, (name, {}))
    return FakeNvml(box, **{**base, **changes})
