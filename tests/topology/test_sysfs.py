"""read_sysfs on the recorded machines of boxes.py, on odd trees, and on roots that are no sysfs tree."""

import os
import shutil

import pytest

from topology.errors import TopologyError
from topology.sysfs import _upstream_ports, read_sysfs

# bdf (0000: dropped) | root | switches nearest first ("-" = none) | gen x width | top port | top link | numa
GPUS = {
    "2+2": """
        3d:00.0 pci0000:3a 3b:00.0 3x16 3a:00.0 3x16 0
        3e:00.0 pci0000:3a 3b:00.0 3x16 3a:00.0 3x16 0
        b1:00.0 pci0000:ae af:00.0 3x16 ae:00.0 3x16 1
        b2:00.0 pci0000:ae af:00.0 3x16 ae:00.0 3x16 1""",
    "3+1": """
        4d:00.0 pci0000:4a 4b:00.0 4x16 4a:02.0 4x16 0
        4e:00.0 pci0000:4a 4b:00.0 4x16 4a:02.0 4x16 0
        4f:00.0 pci0000:4a 4b:00.0 4x16 4a:02.0 4x16 0
        e3:00.0 pci0000:e2 - 4x8 e2:02.0 4x8 1""",
    "8-dual-socket": """
        43:00.0 pci0000:40 41:00.0 4x16 40:01.1 4x16 0
        44:00.0 pci0000:40 41:00.0 4x16 40:01.1 4x16 0
        47:00.0 pci0000:40 45:00.0 4x16 40:03.1 4x16 0
        48:00.0 pci0000:40 45:00.0 4x16 40:03.1 4x16 0
        c3:00.0 pci0000:c0 c1:00.0 4x16 c0:01.1 4x16 1
        c4:00.0 pci0000:c0 c1:00.0 4x16 c0:01.1 4x16 1
        c7:00.0 pci0000:c0 c5:00.0 4x16 c0:03.1 4x16 1
        c8:00.0 pci0000:c0 c5:00.0 4x16 c0:03.1 4x16 1""",
    "nvlink-pair": """
        01:00.0 pci0000:00 - 4x16 00:01.1 4x16 0
        21:00.0 pci0000:20 - 4x16 20:01.1 4x16 0
        41:00.0 pci0000:40 - 4x16 40:01.1 4x16 0
        61:00.0 pci0000:60 - 4x16 60:01.1 4x16 0""",
    "4-pxb": """
        1b:00.0 pci0000:16 19:00.0,17:00.0 4x16 16:00.0 4x16 0
        1c:00.0 pci0000:16 19:00.0,17:00.0 4x16 16:00.0 4x16 0
        1f:00.0 pci0000:16 1d:00.0,17:00.0 4x16 16:00.0 4x16 0
        20:00.0 pci0000:16 1d:00.0,17:00.0 4x16 16:00.0 4x16 0""",
    "vm": """
        00:05.0 pci0000:00 - 0x0 - 0x0 -1
        00:06.0 pci0000:00 - 0x0 - 0x0 -1
        00:07.0 pci0000:00 - 0x0 - 0x0 -1
        00:08.0 pci0000:00 - 0x0 - 0x0 -1""",
}
# bdf | name | root | switches | gen x width | numa | model
NVMES = {
    "2+2": [("18:00.0", "nvme0", "pci0000:17", "-", "3x4", 0, "Samsung SSD 980 PRO 1TB")],
    "3+1": [("50:00.0", "nvme0", "pci0000:4a", "4b:00.0", "4x4", 0, "INTEL SSDPF2KX038TZ")],
    "8-dual-socket": [
        ("01:00.0", "nvme0", "pci0000:00", "-", "4x4", 0, "SAMSUNG MZQL23T8HCLS-00A07"),
        ("e1:00.0", "nvme1", "pci0000:e0", "-", "4x4", 1, "SAMSUNG MZWLJ3T8HBLS-00007"),
    ],
}
MEMORY_GIB = {"2+2": 192, "3+1": 256, "8-dual-socket": 512, "nvlink-pair": 256, "4-pxb": 128, "vm": 64}


def _bdf(short: str) -> str:
    return "" if short == "-" else f"0000:{short}"


def _link(text: str) -> tuple[int, int]:
    gen, width = text.split("x")
    return int(gen), int(width)


@pytest.mark.parametrize("box", sorted(GPUS))
def test_gpus_roots_switches_links(box, sysfs_box):
    scan = read_sysfs(sysfs_box(box))
    gpus = [d for d in scan.devices if d.kind == "gpu"]
    rows = [line.split() for line in GPUS[box].strip().splitlines()]
    assert [g.bdf for g in gpus] == [_bdf(r[0]) for r in rows]
    for g, (_, root, switches, link, top_port, top_link, numa) in zip(gpus, rows):
        assert g.root == root
        assert g.switches == tuple(_bdf(s) for s in switches.split(",") if s != "-")
        assert (g.link_gen, g.link_width) == _link(link)
        assert g.top_port == _bdf(top_port)
        assert g.top_link == _link(top_link)
        assert g.numa_node == int(numa)
        assert (g.vendor, g.name, g.model) == (0x10DE, "", "")


@pytest.mark.parametrize("box", sorted(GPUS))
def test_nvme_numa_and_memory(box, sysfs_box, boxes):
    scan = read_sysfs(sysfs_box(box))
    drives = [
        (d.bdf, d.name, d.root, ",".join(d.switches) or "-", f"{d.link_gen}x{d.link_width}", d.numa_node, d.model)
        for d in scan.devices
        if d.kind == "nvme"
    ]
    assert drives == [
        (_bdf(b), n, r, _bdf(s) or "-", link, numa, m) for b, n, r, s, link, numa, m in NVMES.get(box, [])
    ]
    assert scan.numa_cpus == {n: cpus for n, (cpus, _) in boxes.BOXES[box]["nodes"].items()}
    assert scan.host_memory_bytes == MEMORY_GIB[box] << 30
    assert scan.devices == tuple(sorted(scan.devices, key=lambda d: d.bdf))
    assert scan.notes == ()


def test_cpulists_follow_the_socket(sysfs_box):
    scan = read_sysfs(sysfs_box("2+2"))
    assert {d.bdf: d.local_cpulist for d in scan.devices} == {
        "0000:18:00.0": "0-11,24-35",
        "0000:3d:00.0": "0-11,24-35",
        "0000:3e:00.0": "0-11,24-35",
        "0000:b1:00.0": "12-23,36-47",
        "0000:b2:00.0": "12-23,36-47",
    }


def test_only_nvidia_gpus_and_nvme_are_listed(sysfs_box):
    """2+2 also holds bridges, an ASPEED VGA (class 0x03, vendor 0x1a03) and the GPUs' audio functions."""
    root = sysfs_box("2+2")
    listed = os.listdir(root / "bus/pci/devices")
    assert "0000:03:00.0" in listed and "0000:3d:00.1" in listed and "0000:3b:00.0" in listed
    assert [d.kind for d in read_sysfs(root).devices] == ["nvme", "gpu", "gpu", "gpu", "gpu"]


def test_switch_links_nearest_first_with_parent_port_min(sysfs_box):
    """4-pxb: child switch uplinks are x8 (min with the parent switch's x16 downstream port)."""
    gpu = read_sysfs(sysfs_box("4-pxb")).devices[0]
    assert gpu.switches == ("0000:19:00.0", "0000:17:00.0")
    assert gpu.switch_links == ((4, 8), (4, 16))


def test_link_is_min_of_device_and_parent_port(sysfs_box):
    """2+2: a gen4 GPU ("16 GT/s", kernel <= 5.6 form) behind a gen3 switch port is a gen3 link."""
    root = sysfs_box("2+2")
    gpu_dir = os.path.realpath(root / "bus/pci/devices/0000:3d:00.0")
    assert open(os.path.join(gpu_dir, "max_link_speed")).read().strip() == "16 GT/s"
    assert read_sysfs(root).devices[1].link_gen == 3
    os.remove(os.path.join(os.path.dirname(gpu_dir), "max_link_speed"))  # parent port unknown: the device's own
    assert read_sysfs(root).devices[1].link_gen == 4


def test_missing_files_are_unknown(sysfs_box):
    root = sysfs_box("3+1")
    gpu_dir = os.path.realpath(root / "bus/pci/devices/0000:e3:00.0")
    for name in ("numa_node", "local_cpulist", "max_link_width"):
        os.remove(os.path.join(gpu_dir, name))
    gpu = [d for d in read_sysfs(root).devices if d.bdf == "0000:e3:00.0"][0]
    assert (gpu.numa_node, gpu.local_cpulist, gpu.link_width) == (-1, "", 8)  # width from the x8 root port


def test_vm_gpu_on_root_bus_has_no_root_port(sysfs_box):
    gpu = read_sysfs(sysfs_box("vm")).devices[0]
    assert (gpu.top_port, gpu.switches, gpu.switch_links, gpu.top_link) == ("", (), (), (0, 0))


def test_root_is_the_last_pci_component(tmp_path):
    """Hyper-V style: the host bridge sits under VMBUS nodes, and the GPU directly on it."""
    parts = ["LNXSYSTM:00", "VMBUS:00", "47505500-0001-0000-3130-444531303244", "pci0001:00", "0001:00:00.0"]
    dev = tmp_path.joinpath("devices", *parts)
    dev.mkdir(parents=True)
    for name, text in {"class": "0x030200", "vendor": "0x10de", "device": "0x20b5", "numa_node": "0"}.items():
        (dev / name).write_text(text + "\n")
    (tmp_path / "bus/pci/devices").mkdir(parents=True)
    os.symlink(os.path.join("../../../devices", *parts), tmp_path / "bus/pci/devices/0001:00:00.0")
    gpu = read_sysfs(tmp_path).devices[0]
    assert (gpu.bdf, gpu.root, gpu.top_port, gpu.switches, gpu.numa_node) == ("0001:00:00.0", "pci0001:00", "", (), 0)


def test_entry_that_is_not_a_link_has_unknown_path(sysfs_box):
    """A copy that dereferenced the bus/pci/devices links (cp -L) loses the PCIe path: said in a note."""
    root = sysfs_box("2+2")
    link = root / "bus/pci/devices/0000:3d:00.0"
    target = os.path.realpath(link)
    os.remove(link)
    shutil.copytree(target, link)
    scan = read_sysfs(root)
    gpu = [d for d in scan.devices if d.bdf == "0000:3d:00.0"][0]
    assert (gpu.root, gpu.switches, gpu.top_port, gpu.link_gen) == ("", (), "", 4)
    assert len(scan.notes) == 1 and "PCIe path of 0000:3d:00.0 unknown" in scan.notes[0]


@pytest.mark.parametrize("n_bridges, ups", [(0, []), (1, []), (2, [1]), (3, [1]), (4, [2, 1]), (5, [3, 1])])
def test_bridge_pairing(n_bridges, ups):
    """Bridges above a device, top first: 0 is the root port; then (upstream, downstream) pairs from the
    bottom, a lone bridge at the top being a switch of its own."""
    assert _upstream_ports(n_bridges) == ups


def test_not_a_sysfs_tree(tmp_path):
    with pytest.raises(TopologyError) as e:
        read_sysfs(tmp_path)
    msg = str(e.value)
    assert f"{tmp_path} is not a sysfs tree" in msg and "bus/pci/devices" in msg and "--sysfs-root" in msg
    with pytest.raises(TopologyError, match="is not a sysfs tree"):
        read_sysfs(tmp_path / "missing")


def test_empty_valid_tree(tmp_path):
    (tmp_path / "bus/pci/devices").mkdir(parents=True)
    scan = read_sysfs(str(tmp_path))
    assert (scan.root, scan.devices, scan.numa_cpus, scan.host_memory_bytes) == (str(tmp_path), (), {}, 0)
    assert any("no NUMA nodes" in n for n in scan.notes)
