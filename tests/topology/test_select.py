"""select_gpus(): the job's gpus picked by bus id in CUDA's order, with every pairwise fact following them;
and the torchrun job's discovered topology (mobiuspipe.startup.machine) on a faked CUDA."""

from types import SimpleNamespace

import pytest
import torch

from mobiuspipe.config import config_from_dict
from mobiuspipe.errors import WorldSizeError
from mobiuspipe.startup.config_plan import plan_for_config, run_topology
from mobiuspipe.startup.machine import discovered_topology
from topology.discover import discover
from topology.errors import TopologyError
from topology.select import bus_id_of, select_gpus
from topology.types import Measured


def test_reorders_and_keeps_the_paths(sysfs_box, nvml_box):
    t = discover(sysfs_box("2+2"), nvml_box("2+2"))
    ids = [g.pci_bus_id for g in t.gpus]
    s = select_gpus(t, [ids[3], ids[0], ids[2]])  # CUDA's order differs from PCI bus order
    assert [g.index for g in s.gpus] == [0, 1, 2]
    assert [g.pci_bus_id for g in s.gpus] == [ids[3], ids[0], ids[2]]
    assert [g.root_complex for g in s.gpus] == [t.gpus[3].root_complex, t.gpus[0].root_complex, t.gpus[2].root_complex]
    assert s.shared(0, 2) and not s.shared(0, 1)  # old 3 and 2 share a root complex, old 3 and 0 do not
    assert s.p2p[0][2] == t.p2p[3][2] and s.p2p[1][1] == "X"
    assert s.root_complexes == t.root_complexes and s.nvme == t.nvme


def test_nvlinks_and_measurements_follow_the_gpus(sysfs_box, nvml_box):
    t = discover(sysfs_box("nvlink-pair"), nvml_box("nvlink-pair"))
    n = t.num_gpus
    d2d = tuple(tuple(float(10 * a + b) for b in range(n)) for a in range(n))
    t = t.__class__(**{**t.__dict__, "measured": Measured(h2d_gbps=tuple(range(1, n + 1)), d2d_gbps=d2d)})
    link = t.nvlinks[0]
    ids = [g.pci_bus_id for g in t.gpus]
    s = select_gpus(t, [ids[link.b], ids[link.a]])
    assert len(s.nvlinks) == 1 and {s.nvlinks[0].a, s.nvlinks[0].b} == {0, 1} and s.p2p_ok(0, 1)
    assert s.measured is not None
    assert s.measured.h2d_gbps == (link.b + 1, link.a + 1)
    assert s.measured.d2d_gbps == ((0.0 + 11 * link.b, 10.0 * link.b + link.a), (10.0 * link.a + link.b, 11.0 * link.a))
    others = [i for i in range(n) if i not in (link.a, link.b)]
    if others:
        assert select_gpus(t, [ids[link.a], ids[others[0]]]).nvlinks == ()


def test_unknown_or_repeated_gpus_are_named(sysfs_box, nvml_box):
    t = discover(sysfs_box("2+2"), nvml_box("2+2"))
    ids = [g.pci_bus_id for g in t.gpus]
    with pytest.raises(TopologyError, match=r"missing: \['0000:ee:00.0'\].*set plan.topology"):
        select_gpus(t, [ids[0], "0000:ee:00.0"])
    with pytest.raises(TopologyError, match="not distinct"):
        select_gpus(t, [ids[1], ids[1]])
    assert bus_id_of(0, 0x3B, 0) == "0000:3b:00.0"


def _fake_cuda(monkeypatch, bus_ids: list[str]) -> None:
    """CUDA with these gpus, in this order (what get_device_properties reports of each)."""

    def props(i):
        domain, bus, dev = bus_ids[i].split(":")[0], bus_ids[i].split(":")[1], bus_ids[i].split(":")[2][:2]
        return SimpleNamespace(pci_domain_id=int(domain, 16), pci_bus_id=int(bus, 16), pci_device_id=int(dev, 16))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(bus_ids))
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA GeForce RTX 3090")


def test_a_gpu_run_plans_on_the_discovered_machine_in_cuda_order(sysfs_box, nvml_box, monkeypatch):
    machine = discover(sysfs_box("2+2"), nvml_box("2+2"))
    ids = [g.pci_bus_id for g in machine.gpus]
    _fake_cuda(monkeypatch, [ids[2], ids[3], ids[0], ids[1]])  # CUDA numbers the second socket first
    monkeypatch.setattr("mobiuspipe.startup.machine.discover", lambda: machine)
    cfg = config_from_dict(
        {
            "model": {"num_blocks": 6, "d_model": 32, "num_heads": 4, "seq_len": 16},
            "data": {"batch_size": 8, "num_microbatches": 4},
            "plan": {"num_stages": 8},
        }
    )
    topo = run_topology(cfg)
    assert [g.pci_bus_id for g in topo.gpus] == [ids[2], ids[3], ids[0], ids[1]]
    assert topo.contention_groups() == [[2, 3], [0, 1]] or topo.contention_groups() == [[0, 1], [2, 3]]
    plan = plan_for_config(cfg)
    first = plan.mapping[:4]
    # cross mapping: stages next to each other run on gpus under different root complexes
    assert all(not topo.shared(a, b) for a, b in zip(first, first[1:])), plan.mapping
    assert sorted(first) == [0, 1, 2, 3]
    with pytest.raises(WorldSizeError, match="CUDA shows this process 4"):
        discovered_topology(6, machine)
