"""discover(): sysfs and NVML merged by bus id, on the recorded boxes, and every way a source can fail."""

from __future__ import annotations

import json

import pytest

from topology import TopologyError, load_topology, save_topology
from topology.discover import discover
from topology.pci import pcie_gbps

GEN3, GEN4 = pcie_gbps(3, 16), pcie_gbps(4, 16)


@pytest.mark.parametrize(
    "box,groups,switches,levels0,contended",
    [
        ("2+2", [[0, 1], [2, 3]], 2, ["X", "PIX", "SYS", "SYS"], GEN3 / 2),
        ("3+1", [[0, 1, 2], [3]], 1, ["X", "PIX", "PIX", "SYS"], GEN4 / 3),
        ("8-dual-socket", [[0, 1, 2, 3], [4, 5, 6, 7]], 4, ["X", "PIX", "PHB", "PHB"] + ["SYS"] * 4, GEN4 / 2),
        ("nvlink-pair", [[0], [1], [2], [3]], 0, ["X", "NV4", "NODE", "NODE"], GEN4),
        ("vm", [[0, 1, 2, 3]], 0, ["X", "PHB", "PHB", "PHB"], GEN3),
    ],
)
def test_boxes(sysfs_box, nvml_box, box, groups, switches, levels0, contended):
    t = discover(sysfs_box(box), nvml_box(box))
    assert t.source == "discovered:nvml+sysfs"
    assert t.contention_groups() == groups
    assert len(t.switches) == switches
    assert [t.level(0, b) for b in range(t.num_gpus)] == levels0
    assert t.load_gbps(0, len(groups[0])) == pytest.approx(contended)
    assert all(g.uuid and g.memory_bytes > 0 for g in t.gpus)
    assert [g.pci_bus_id for g in t.gpus] == sorted(g.pci_bus_id for g in t.gpus)  # PCI bus order


def test_nvlink_pairs_and_p2p(sysfs_box, nvml_box):
    t = discover(sysfs_box("nvlink-pair"), nvml_box("nvlink-pair"))
    assert [(x.a, x.b, x.links) for x in t.nvlinks] == [(0, 1, 4), (2, 3, 4)]
    assert t.p2p_ok(0, 1) and not t.p2p_ok(1, 2)
    assert t.nvlinks[0].gbps == pytest.approx(4 * 14.0625)  # GeForce bridge links


def test_2_plus_2_details(sysfs_box, nvml_box):
    t = discover(sysfs_box("2+2"), nvml_box("2+2"))
    assert [d.name for d in t.nvme] == ["nvme0"]
    assert t.host_memory_bytes > 0
    assert {g.numa_node for g in t.gpus[:2]} == {0} and {g.numa_node for g in t.gpus[2:]} == {1}
    assert all(g.pcie_gen == 3 and g.pcie_width == 16 for g in t.gpus)
    assert t.gpus[0].cpu_affinity and t.p2p[0][1] == "GNS"
    assert t.notes == ()


def test_vm_all_sys_is_noted(sysfs_box, nvml_box):
    t = discover(sysfs_box("vm"), nvml_box("vm"))
    assert any("labels 6 GPU pair(s) SYS" in n for n in t.notes)
    assert all(g.numa_node == -1 for g in t.gpus)


@pytest.mark.parametrize("fake", ["no-library", "no-driver"])
def test_without_nvml_sysfs_alone(sysfs_box, nvml_box, fake):
    t = discover(sysfs_box("2+2"), nvml_box(fake))
    assert t.source == "discovered:sysfs" and t.contention_groups() == [[0, 1], [2, 3]]
    assert all(g.memory_bytes == 0 and g.name.startswith("NVIDIA GPU 0x") for g in t.gpus)
    assert any("NVML not available" in n for n in t.notes)
    assert any("memory unknown without NVML" in n for n in t.notes)


def test_unsupported_fields_become_unknown_not_a_crash(sysfs_box, nvml_box):
    t = discover(sysfs_box("2+2"), nvml_box("unsupported"))
    assert t.num_gpus == 4 and all(g.pcie_gen == 3 for g in t.gpus)  # sysfs fills what NVML lacks
    assert t.notes


def test_nvml_alone_groups_by_levels(tmp_path, nvml_box):
    (tmp_path / "bus" / "pci" / "devices").mkdir(parents=True)
    t = discover(tmp_path, nvml_box("2+2"))
    assert t.source == "discovered:nvml"
    assert t.contention_groups() == [[0, 1], [2, 3]]
    assert any("sysfs" in n and "NVML levels" in n for n in t.notes)


def test_no_gpu_anywhere_points_to_layout(tmp_path, nvml_box):
    (tmp_path / "bus" / "pci" / "devices").mkdir(parents=True)
    with pytest.raises(TopologyError, match=r"no GPU found: .*--layout 2\+2"):
        discover(tmp_path, nvml_box("no-library"))


def test_not_a_sysfs_tree(tmp_path, nvml_box):
    with pytest.raises(TopologyError, match="is not a sysfs tree"):
        discover(tmp_path, nvml_box("2+2"))


@pytest.mark.parametrize("box", ["2+2", "8-dual-socket", "nvlink-pair", "vm"])
def test_saved_discovery_round_trips(sysfs_box, nvml_box, tmp_path, box):
    t = discover(sysfs_box(box), nvml_box(box))
    for suffix in (".yaml", ".json"):
        path = save_topology(t, tmp_path / f"server{suffix}")
        assert load_topology(str(path)) == t


def test_cli_discovers_saves_and_reports(sysfs_box, nvml_box, monkeypatch, tmp_path, capsys):
    from mobiuspipe.cli import main

    monkeypatch.setitem(__import__("sys").modules, "pynvml", nvml_box("3+1"))
    out_file = tmp_path / "server.yaml"
    assert main(["topology", "--sysfs-root", str(sysfs_box("3+1")), "--save", str(out_file), "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["contention_groups"] == [[0, 1, 2], [3]] and doc["source"] == "discovered:nvml+sysfs"
    assert f"layout written to {out_file}" in captured.err
    assert load_topology(str(out_file)).contention_groups() == [[0, 1, 2], [3]]
    assert main(["partition", "--model", "gpt3-13b", "--topology", str(out_file), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_gpus"] == 4


def _nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:  # noqa: BLE001  no library, no driver: this is the skip condition, not an error
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _nvml_works(), reason="needs an NVIDIA driver (NVML)")
def test_real_machine():
    t = discover()
    assert t.num_gpus >= 1 and all(g.memory_bytes > 0 and g.uuid for g in t.gpus)
    assert "nvml" in t.source
    assert load_topology(str(save_topology(t, "/tmp/mobiuspipe-real-topology.yaml"))) == t
