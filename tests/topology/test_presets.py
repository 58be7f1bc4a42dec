"""Presets: root complexes, contention groups, bandwidths and contended load of the built-in topologies."""

import pytest

from topology import PRESETS, Topology, TopologyError, cpu_standin, preset
from topology.presets import PCIE3_X16_GBPS

GIB = 2**30


def test_preset_names():
    assert sorted(PRESETS) == ["2+2", "3+1"]
    for name in PRESETS:
        assert preset(name) is PRESETS[name]
        assert preset(name).source == f"preset:{name}"


def test_pcie3_x16_bandwidth():
    assert PCIE3_X16_GBPS == pytest.approx(8 * 16 * 128 / 130 / 8)
    assert round(PCIE3_X16_GBPS, 2) == 15.75


@pytest.mark.parametrize("name, groups", [("2+2", [[0, 1], [2, 3]]), ("3+1", [[0, 1, 2], [3]])])
def test_preset_shape(name, groups):
    t = preset(name)
    assert [(r.name, r.numa_node) for r in t.root_complexes] == [("rc0", 0), ("rc1", 1)]
    assert t.contention_groups() == groups
    assert t.num_gpus == 4 and not t.p2p
    for g in t.gpus:
        assert g.name == "NVIDIA GeForce RTX 3090 Ti"
        assert g.memory_bytes == 24 * GIB == 25769803776
        assert g.link_gbps == PCIE3_X16_GBPS
        assert g.numa_node == t.root_complex(g.root_complex).numa_node
        assert len(g.pci_bus_id) == 16 and g.pci_bus_id.startswith("00000000:")
    assert len({g.pci_bus_id for g in t.gpus}) == 4
    assert all(r.uplink_gbps == PCIE3_X16_GBPS for r in t.root_complexes)


@pytest.mark.parametrize("name", ["2+2", "3+1"])
def test_load_alone_and_contended(name):
    t = preset(name)
    for group in t.contention_groups():
        for i in group:
            assert t.load_gbps(i) == pytest.approx(PCIE3_X16_GBPS)
            assert t.load_gbps(i, concurrent=len(group)) == pytest.approx(PCIE3_X16_GBPS / len(group))


def test_shared_follows_root_complexes():
    t = preset("3+1")
    assert t.shared(0, 2) and not t.shared(2, 3) and not t.shared(1, 1)


def test_unknown_preset_lists_known_names():
    with pytest.raises(TopologyError, match=r"'4\+0'.*2\+2.*3\+1"):
        preset("4+0")


def test_cpu_standin():
    t = cpu_standin(3, 2 * GIB, link_gbps=5.0)
    assert isinstance(t, Topology) and t.source == "cpu-standin"
    assert [r.name for r in t.root_complexes] == ["host"] and t.root_complexes[0].numa_node == 0
    assert t.root_complexes[0].uplink_gbps == 15.0
    assert [g.pci_bus_id for g in t.gpus] == ["cpu:0", "cpu:1", "cpu:2"]
    assert all(g.name == "cpu-standin" and g.memory_bytes == 2 * GIB for g in t.gpus)
    assert t.contention_groups() == [[0, 1, 2]]
    assert t.load_gbps(1, concurrent=3) == 5.0  # CPU copies do not split one uplink


@pytest.mark.parametrize("args", [(0, GIB), (2, 0), (2, GIB, 0.0)])
def test_cpu_standin_rejects_impossible_values(args):
    with pytest.raises(TopologyError):
        cpu_standin(*args)
