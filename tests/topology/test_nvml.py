"""read_nvml on fake pynvml modules of the recorded machines, on every failure mode, and on its traps."""

import ctypes
import os
import sys
from types import SimpleNamespace

import pynvml
import pytest

from topology.nvml import _remote_bus, cpulist, read_nvml

NAMES = {"10": "PIX", "20": "PXB", "30": "PHB", "40": "NODE", "50": "SYS", "0": "X", "-1": "?"}
BUSES = {
    "2+2": "3d 3e b1 b2",
    "3+1": "4d 4e 4f e3",
    "8-dual-socket": "43 44 47 48 c3 c4 c7 c8",
    "nvlink-pair": "01 21 41 61",
    "4-pxb": "1b 1c 1f 20",
}
LEVELS = {  # nvidia-smi topo -m rows, as each box was recorded
    "2+2": ["X PIX SYS SYS", "PIX X SYS SYS", "SYS SYS X PIX", "SYS SYS PIX X"],
    "3+1": ["X PIX PIX SYS", "PIX X PIX SYS", "PIX PIX X SYS", "SYS SYS SYS X"],
    "8-dual-socket": [
        "X PIX PHB PHB SYS SYS SYS SYS",
        "PIX X PHB PHB SYS SYS SYS SYS",
        "PHB PHB X PIX SYS SYS SYS SYS",
        "PHB PHB PIX X SYS SYS SYS SYS",
        "SYS SYS SYS SYS X PIX PHB PHB",
        "SYS SYS SYS SYS PIX X PHB PHB",
        "SYS SYS SYS SYS PHB PHB X PIX",
        "SYS SYS SYS SYS PHB PHB PIX X",
    ],
    "nvlink-pair": ["X NODE NODE NODE", "NODE X NODE NODE", "NODE NODE X NODE", "NODE NODE NODE X"],
    "4-pxb": ["X PIX PXB PXB", "PIX X PXB PXB", "PXB PXB X PIX", "PXB PXB PIX X"],
    "vm": ["X SYS SYS SYS", "SYS X SYS SYS", "SYS SYS X SYS", "SYS SYS SYS X"],
}
PCIE = {
    "2+2": (3, 16),
    "3+1": (4, 16),
    "8-dual-socket": (4, 16),
    "nvlink-pair": (4, 16),
    "4-pxb": (4, 16),
    "vm": (4, 16),
}


def _labels(levels):
    return [" ".join(NAMES[str(x)] for x in row) for row in levels]


@pytest.mark.parametrize("box", sorted(LEVELS))
def test_box(box, nvml_box, boxes):
    fake = nvml_box(box)
    scan = read_nvml(fake)
    assert scan.available
    expect = boxes.nvml_gpus(box)
    assert [g.index for g in scan.gpus] == list(range(len(expect)))
    assert [g.name for g in scan.gpus] == [e["name"] for e in expect]
    assert [g.uuid for g in scan.gpus] == [e["uuid"] for e in expect]
    assert all(g.uuid.startswith("GPU-") for g in scan.gpus)
    if box in BUSES:
        assert [g.bus_id for g in scan.gpus] == [f"0000:{b}:00.0" for b in BUSES[box].split()]
    assert _labels(scan.levels) == LEVELS[box]
    assert {(g.max_gen, g.max_width) for g in scan.gpus[:-1]} == {PCIE[box]}
    assert fake.calls[-1] == ("nvmlShutdown", ()) and not fake.live


def test_box_details(nvml_box):
    two = read_nvml(nvml_box("2+2"))
    assert {g.memory_bytes for g in two.gpus} == {24 << 30}
    assert two.gpus[2].bus_id == "0000:b1:00.0" and two.gpus[0].name == "NVIDIA GeForce RTX 3090 Ti"
    assert [g.cpu_affinity for g in two.gpus] == ["0-11,24-35"] * 2 + ["12-23,36-47"] * 2
    assert two.p2p == tuple(tuple("X" if a == b else "GNS" for b in range(4)) for a in range(4))
    assert two.notes == () and all(g.nvlinks == () for g in two.gpus)
    three = read_nvml(nvml_box("3+1"))
    assert (three.gpus[3].max_gen, three.gpus[3].max_width) == (4, 8)  # the x8 root port
    vm = read_nvml(nvml_box("vm"))
    assert {g.memory_bytes for g in vm.gpus} == {48 << 30} and vm.gpus[0].bus_id == "0000:00:05.0"
    assert {x for row in vm.p2p for x in row} == {"X", "NS"}


def test_cpu_affinity_over_64_cpus(nvml_box, monkeypatch):
    fake = nvml_box("8-dual-socket")
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    scan = read_nvml(fake)
    assert [g.cpu_affinity for g in scan.gpus] == ["0-31,64-95"] * 4 + ["32-63,96-127"] * 4
    assert {args[1] for fn, args in fake.calls if fn == "nvmlDeviceGetCpuAffinity"} == {2}


def test_nvlink_pairs_bounded_by_link_count(nvml_box):
    fake = nvml_box("nvlink-pair")
    scan = read_nvml(fake)
    assert [g.nvlinks for g in scan.gpus] == [
        (("0000:21:00.0", 4),),
        (("0000:01:00.0", 4),),
        (("0000:61:00.0", 4),),
        (("0000:41:00.0", 4),),
    ]
    assert [row for row in scan.p2p] == [
        ("X", "OK", "GNS", "GNS"),
        ("OK", "X", "GNS", "GNS"),
        ("GNS", "GNS", "X", "OK"),
        ("GNS", "GNS", "OK", "X"),
    ]
    links = [args[1] for fn, args in fake.calls if fn == "nvmlDeviceGetNvLinkState"]
    assert links == [0, 1, 2, 3] * 4  # the link count field said 4: index 4 (InvalidArgument) never asked
    assert {str(args[1]) for fn, args in fake.calls if fn == "nvmlDeviceGetFieldValues"} == {"[(91, 0)]"}
    assert scan.notes == ()


def test_nvlink_without_link_count_stops_at_first_invalid_argument(nvml_box):
    fake = nvml_box("nvlink-unbounded")
    scan = read_nvml(fake)
    assert [g.nvlinks for g in scan.gpus][:2] == [(("0000:21:00.0", 2),), (("0000:01:00.0", 2),)]
    links = [args[1] for fn, args in fake.calls if fn == "nvmlDeviceGetNvLinkState"]
    assert links == [0, 1, 2] * 4
    assert len(scan.notes) == 1 and "NVLink link count" in scan.notes[0]


def test_nvlink_not_supported_is_quiet(nvml_box):
    """The vm has no NVLink: every state call says NotSupported; only the link count field is noted."""
    scan = read_nvml(nvml_box("vm"))
    assert all(g.nvlinks == () for g in scan.gpus)
    assert len(scan.notes) == 1 and "field returned code 3" in scan.notes[0]


@pytest.mark.parametrize(
    "name, text", [("no-library", "NVML Shared Library Not Found"), ("no-driver", "Driver Not Loaded")]
)
def test_no_library_or_driver(name, text, nvml_box):
    fake = nvml_box(name)
    scan = read_nvml(fake)
    assert (scan.available, scan.gpus, scan.p2p, scan.levels) == (False, (), (), ())
    assert scan.notes == (f"NVML not available ({text}): using sysfs only",)
    assert [fn for fn, _ in fake.calls] == ["nvmlInit"]  # no shutdown after a failed init


def test_other_init_error_is_named(nvml_box):
    scan = read_nvml(nvml_box("2+2", faults={"nvmlInit": "NoPermission"}))
    assert not scan.available
    assert scan.notes == ("NVML not available (Insufficient Permissions, NVMLError_NoPermission): using sysfs only",)


def test_pynvml_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    scan = read_nvml()
    assert not scan.available and "pynvml not importable" in scan.notes[0]


def test_real_pynvml_fails_soft():
    scan = read_nvml()
    assert scan.available or scan.notes[0].startswith("NVML not available (")


def test_unsupported_fields_are_unknown_and_noted_once(nvml_box):
    fake = nvml_box("unsupported")
    scan = read_nvml(fake)
    assert scan.available and len(scan.gpus) == 4
    assert {(g.max_gen, g.max_width, g.cpu_affinity, g.nvlinks) for g in scan.gpus} == {(0, 16, "", ())}
    assert sorted(n.split(":")[0] for n in scan.notes) == [
        "NVML CPU affinity",
        "NVML NVLink link count",
        "NVML max PCIe link generation",
    ]
    assert all("NVMLError_NotSupported (Not Supported)" in n for n in scan.notes)
    links = [args[1] for fn, args in fake.calls if fn == "nvmlDeviceGetNvLinkState"]
    assert links == [0, 1, 2, 3, 4] * 4  # fell back to NVML_NVLINK_MAX_LINKS, stopped at InvalidArgument


@pytest.mark.parametrize(
    "error", ["NotSupported", "NoPermission", "InvalidArgument", "FunctionNotFound", "Unknown", "GpuIsLost"]
)
def test_each_field_error_class(error, nvml_box):
    faults = {
        fn: error
        for fn in (
            "nvmlDeviceGetName",
            "nvmlDeviceGetUUID",
            "nvmlDeviceGetMemoryInfo",
            "nvmlDeviceGetMaxPcieLinkWidth",
            "nvmlDeviceGetTopologyCommonAncestor",
        )
    }
    scan = read_nvml(nvml_box("3+1", faults=faults))
    g = scan.gpus[0]
    assert (g.name, g.uuid, g.memory_bytes, g.max_width, g.bus_id) == ("", "", 0, 0, "0000:4d:00.0")
    assert {x for i, row in enumerate(scan.levels) for j, x in enumerate(row) if i != j} == {-1}
    assert len(scan.notes) == 5 and all(f"NVMLError_{error}" in n for n in scan.notes)


def test_p2p_read_index_trap(nvml_box):
    """pynvml's NVML_P2P_CAPS_INDEX_READ is (0,), which ctypes rejects; read_nvml must pass a literal 0."""
    fake = nvml_box("2+2")
    fake.nvmlInit()
    h0, h1 = fake.nvmlDeviceGetHandleByIndex(0), fake.nvmlDeviceGetHandleByIndex(1)
    assert pynvml.NVML_P2P_CAPS_INDEX_READ == (0,)
    with pytest.raises(ctypes.ArgumentError):
        fake.nvmlDeviceGetP2PStatus(h0, h1, pynvml.NVML_P2P_CAPS_INDEX_READ)
    fake.nvmlShutdown()
    scan = read_nvml(fake)
    indices = [args[2] for fn, args in fake.calls if fn == "nvmlDeviceGetP2PStatus"][1:]
    assert len(indices) == 12 and all(type(i) is int and i == 0 for i in indices)
    assert "U" not in {x for row in scan.p2p for x in row}


def test_p2p_argument_error_is_unknown(nvml_box):
    scan = read_nvml(nvml_box("2+2", faults={"nvmlDeviceGetP2PStatus": "ArgumentError"}))
    assert {x for row in scan.p2p for x in row} == {"X", "U"}
    assert len(scan.notes) == 1 and "ArgumentError" in scan.notes[0]


def test_p2p_status_labels(nvml_box):
    scan = read_nvml(nvml_box("3+1", p2p=("OK CNS GNS", "TNS DR", "NS")))
    assert scan.p2p == (
        ("X", "OK", "CNS", "GNS"),
        ("OK", "X", "TNS", "DR"),
        ("CNS", "TNS", "X", "NS"),
        ("GNS", "DR", "NS", "X"),
    )
    fake = nvml_box("3+1", p2p="U")
    fake.p2p[0][1] = 7  # out of range: unknown
    assert {x for row in read_nvml(fake).p2p for x in row} == {"X", "U"}


def test_count_error_after_init_still_shuts_down(nvml_box):
    fake = nvml_box("2+2", faults={"nvmlDeviceGetCount": "Unknown"})
    scan = read_nvml(fake)
    assert not scan.available and "nvmlDeviceGetCount" in scan.notes[0]
    assert fake.calls[-1][0] == "nvmlShutdown"


def test_bug_inside_scan_still_shuts_down(nvml_box, monkeypatch):
    fake = nvml_box("2+2")
    monkeypatch.setattr(fake, "nvmlDeviceGetCount", lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        read_nvml(fake)
    assert fake.calls[-1][0] == "nvmlShutdown" and not fake.live


def test_gpu_without_bus_id_is_left_out(nvml_box):
    fake = nvml_box("2+2")
    fake.gpus[1]["pci"] = SimpleNamespace(busId="", domain=0, bus=0, device=0)
    scan = read_nvml(fake)
    assert [g.index for g in scan.gpus] == [0, 2, 3] and len(scan.p2p) == len(scan.levels) == 3
    assert any("gpu 1" in n for n in scan.notes)


def test_bytes_strings_are_decoded(nvml_box, monkeypatch):
    fake = nvml_box("vm")
    monkeypatch.setattr(fake, "nvmlDeviceGetName", lambda h: b"NVIDIA RTX A6000")
    assert read_nvml(fake).gpus[0].name == "NVIDIA RTX A6000"


def test_remote_bus():
    assert _remote_bus(SimpleNamespace(busId="00000000:3B:00.0", domain=0, bus=0x3B, device=0)) == "0000:3b:00.0"
    assert _remote_bus(SimpleNamespace(busId="00000001:3B:00.0")) == "0001:3b:00.0"
    assert _remote_bus(SimpleNamespace(busId="", domain=0, bus=0, device=0)) == ""  # NVSwitch not visible
    assert _remote_bus(None) == ""


def test_cpulist():
    assert cpulist([]) == "" and cpulist([0]) == ""
    assert cpulist([0xF]) == "0-3"
    assert cpulist([0b1011]) == "0-1,3"
    assert cpulist([1 << 63, 1]) == "63-64"
