"""Reports: the `topology --json` contract and the text summary."""

import json

import pytest

from topology import cpu_standin, preset
from topology.presets import PCIE3_X16_GBPS
from topology.report import render_text, to_json_dict

GPU_KEYS = {"index", "name", "memory_bytes", "pci_bus_id", "root_complex", "numa_node", "link_gbps", "load_gbps"}


@pytest.mark.parametrize("t", [preset("2+2"), preset("3+1"), cpu_standin(2, 2**30)], ids=lambda t: t.name)
def test_json_dict_contract(t):
    d = json.loads(json.dumps(to_json_dict(t)))  # serializable as is
    assert {"gpus", "contention_groups", "source", "name", "root_complexes", "p2p"} <= set(d)
    assert d["source"] == t.source and d["contention_groups"] == t.contention_groups()
    assert [g["index"] for g in d["gpus"]] == list(range(t.num_gpus))
    for g in d["gpus"]:
        assert set(g) == GPU_KEYS
    for rc in d["root_complexes"]:
        assert set(rc) == {"name", "numa_node", "uplink_gbps", "gpus"}
    assert [rc["gpus"] for rc in d["root_complexes"]] == t.contention_groups()


def test_json_load_is_contended_by_the_whole_group():
    d = to_json_dict(preset("3+1"))
    loads = [g["load_gbps"] for g in d["gpus"]]
    assert loads == pytest.approx([PCIE3_X16_GBPS / 3] * 3 + [PCIE3_X16_GBPS])
    assert to_json_dict(cpu_standin(4, 2**30))["gpus"][0]["load_gbps"] == 10.0


@pytest.mark.parametrize("name, groups", [("2+2", "[0, 1] [2, 3]"), ("3+1", "[0, 1, 2] [3]")])
def test_text_report(name, groups):
    t = preset(name)
    text = render_text(t)
    lines = text.splitlines()
    assert lines[0] == f"topology {name} (preset:{name}): 4 GPUs, 2 root complexes, no GPU peer-to-peer"
    assert lines[-1] == f"contention groups: {groups}"
    for g in t.gpus:
        line = next(x for x in lines if x.startswith(f"  gpu {g.index} "))
        assert g.pci_bus_id in line and "24.0 GiB" in line and "link 15.75 GB/s" in line
    assert "rc0  numa 0  uplink 15.75 GB/s" in lines and "rc1  numa 1  uplink 15.75 GB/s" in lines


def test_text_report_contended_figures():
    text = render_text(preset("2+2"))
    assert "(15.75 alone, 7.88 with its group of 2)" in text
    assert "  gpu 3 " in render_text(preset("3+1")).splitlines()[-2]
    assert render_text(preset("3+1")).splitlines()[-2].endswith("(15.75 alone)")


def test_text_report_cpu_standin():
    text = render_text(cpu_standin(1, 512 * 2**20))
    assert "1 GPU, 1 root complex" in text and "512.0 MiB" in text and "cpu:0" in text
