"""Presets: root complexes, contention groups, bandwidths and contended load of the built-in topologies."""

import pytest

from foundation.units import GiB
from topology import PRESETS, Topology, TopologyError, cpu_standin, preset
from topology.pci import normalize_bus_id, pcie_gbps
from topology.presets import PCIE3_X16_GBPS, PCIE4_X16_GBPS, RTX_3090, RTX_3090_TI


def test_preset_names():
    assert sorted(PRESETS) == ["2+2", "2x2-nvlink", "3+1", "4", "8-dual-socket"]
    for name in PRESETS:
        assert preset(name) is PRESETS[name]
        assert preset(name).source == f"preset:{name}"


def test_pcie_x16_bandwidths():
    assert PCIE3_X16_GBPS == pytest.approx(8 * 16 * 128 / 130 / 8)
    assert round(PCIE3_X16_GBPS, 2) == 15.75
    assert round(PCIE4_X16_GBPS, 2) == 31.51 and PCIE4_X16_GBPS == pytest.approx(2 * PCIE3_X16_GBPS)


SHAPES = {  # name: (gpu name, pcie gen, root complexes (name, numa, uplink), contention groups, switch per gpu)
    "2+2": (
        RTX_3090_TI,
        3,
        [("rc0", 0, PCIE3_X16_GBPS), ("rc1", 1, PCIE3_X16_GBPS)],
        [[0, 1], [2, 3]],
        ["sw0", "sw0", "sw1", "sw1"],
    ),
    "3+1": (
        RTX_3090_TI,
        3,
        [("rc0", 0, PCIE3_X16_GBPS), ("rc1", 1, PCIE3_X16_GBPS)],
        [[0, 1, 2], [3]],
        ["sw0", "sw0", "sw0", ""],
    ),
    "4": (RTX_3090_TI, 3, [("rc0", 0, 2 * PCIE3_X16_GBPS)], [[0, 1, 2, 3]], ["sw0", "sw0", "sw1", "sw1"]),
    "8-dual-socket": (
        RTX_3090,
        4,
        [("rc0", 0, 2 * PCIE4_X16_GBPS), ("rc1", 1, 2 * PCIE4_X16_GBPS)],
        [[0, 1, 2, 3], [4, 5, 6, 7]],
        ["sw0", "sw0", "sw1", "sw1", "sw2", "sw2", "sw3", "sw3"],
    ),
    "2x2-nvlink": (
        RTX_3090,
        4,
        [("rc0", 0, 2 * PCIE4_X16_GBPS), ("rc1", 1, 2 * PCIE4_X16_GBPS)],
        [[0, 1], [2, 3]],
        ["", "", "", ""],
    ),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_preset_shape(name):
    gpu_name, gen, rcs, groups, switches = SHAPES[name]
    t = preset(name)
    assert [(r.name, r.numa_node, r.uplink_gbps) for r in t.root_complexes] == rcs
    assert t.contention_groups() == groups
    assert [g.switch for g in t.gpus] == switches
    for g in t.gpus:
        assert g.name == gpu_name
        assert g.memory_bytes == 24 * GiB == 25769803776
        assert (g.pcie_gen, g.pcie_width) == (gen, 16)
        assert g.link_gbps == pytest.approx(pcie_gbps(gen, 16))
        assert g.numa_node == t.root_complex(g.root_complex).numa_node
        assert normalize_bus_id(g.pci_bus_id) == g.pci_bus_id  # the sysfs form, 0000:1a:00.0
        if g.switch:
            assert t.switch(g.switch).root_complex == g.root_complex
    assert len({g.pci_bus_id for g in t.gpus}) == t.num_gpus
    assert [g.pci_bus_id for g in t.gpus] == sorted(g.pci_bus_id for g in t.gpus)  # index = PCI bus order
    assert all(s.uplink_gbps == pytest.approx(pcie_gbps(gen, 16)) for s in t.switches)


@pytest.mark.parametrize("name", ["2+2", "3+1", "4", "8-dual-socket"])
def test_pcie_only_presets_have_no_peer_to_peer(name):
    t = preset(name)
    assert not t.p2p and not t.nvlinks
    assert not any(t.p2p_ok(a, b) for a in range(t.num_gpus) for b in range(t.num_gpus))


def test_nvlink_pairs():
    t = preset("2x2-nvlink")
    assert [(x.a, x.b, x.links) for x in t.nvlinks] == [(0, 1, 4), (2, 3, 4)]
    link = t.nvlink(1, 0)
    assert link is not None and link.gbps == pytest.approx(56.25) and t.nvlink(0, 2) is None
    assert t.p2p[0] == ("X", "OK", "GNS", "GNS") and t.p2p[3] == ("GNS", "GNS", "OK", "X")
    assert t.p2p_ok(0, 1) and t.p2p_ok(3, 2) and not t.p2p_ok(1, 2) and not t.p2p_ok(0, 0)


LOADS = {  # name: (alone, with the whole contention group copying) per gpu, GB/s
    "2+2": ([PCIE3_X16_GBPS] * 4, [PCIE3_X16_GBPS / 2] * 4),
    "3+1": ([PCIE3_X16_GBPS] * 4, [PCIE3_X16_GBPS / 3] * 3 + [PCIE3_X16_GBPS]),
    "4": ([PCIE3_X16_GBPS] * 4, [PCIE3_X16_GBPS / 2] * 4),  # two per switch, 4 on a 2 x16 uplink
    "8-dual-socket": ([PCIE4_X16_GBPS] * 8, [PCIE4_X16_GBPS / 2] * 8),
    "2x2-nvlink": ([PCIE4_X16_GBPS] * 4, [PCIE4_X16_GBPS] * 4),  # each rc uplink carries both root ports
}


@pytest.mark.parametrize("name", sorted(LOADS))
def test_load_alone_and_contended(name):
    t = preset(name)
    alone, grouped = LOADS[name]
    sizes = {i: len(group) for group in t.contention_groups() for i in group}
    assert [t.load_gbps(i) for i in range(t.num_gpus)] == pytest.approx(alone)
    assert [t.load_gbps(i, concurrent=sizes[i]) for i in range(t.num_gpus)] == pytest.approx(grouped)


def test_switch_is_shared_before_the_root_complex():
    t = preset("4")  # sw0 (x16) holds gpus 0, 1 under a 2 x16 root complex
    assert t.load_gbps(0, concurrent=2) == pytest.approx(PCIE3_X16_GBPS / 2)
    assert t.switch_chain(3) == ["sw1"]


def test_shared_follows_root_complexes():
    t = preset("3+1")
    assert t.shared(0, 2) and not t.shared(2, 3) and not t.shared(1, 1)


def test_unknown_preset_lists_known_names():
    with pytest.raises(TopologyError, match=r"'4\+0'.*\['2\+2', '2x2-nvlink', '3\+1', '4', '8-dual-socket'\]"):
        preset("4+0")


def test_cpu_standin():
    t = cpu_standin(3, 2 * GiB, link_gbps=5.0)
    assert isinstance(t, Topology) and t.source == "cpu-standin"
    assert [r.name for r in t.root_complexes] == ["host"] and t.root_complexes[0].numa_node == 0
    assert t.root_complexes[0].uplink_gbps == 15.0
    assert [g.pci_bus_id for g in t.gpus] == ["cpu:0", "cpu:1", "cpu:2"]
    assert all(g.name == "cpu-standin" and g.memory_bytes == 2 * GiB for g in t.gpus)
    assert t.contention_groups() == [[0, 1, 2]]
    assert t.load_gbps(1, concurrent=3) == 5.0  # CPU copies do not split one uplink


@pytest.mark.parametrize("args", [(0, GiB), (2, 0), (2, -GiB), (2, 1.5 * GiB), (2, GiB, 0.0)])
def test_cpu_standin_rejects_impossible_values(args):
    with pytest.raises(TopologyError):
        cpu_standin(*args)
