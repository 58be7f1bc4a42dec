"""The layout-file schema docs/worked-example.md shows: it loads, it names every key, and missing keys are named all
at once."""

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

import topology.layout
from topology import TopologyError, load_topology
from topology.layout import topology_from_dict
from topology.types import Gpu, Measured, NvLink, Nvme, RootComplex, Switch, Topology

PAGE = Path(__file__).resolve().parents[2] / "docs" / "worked-example.md"


def _page_schema() -> str:
    text = PAGE.read_text()
    found = re.search(r"\*\*Layout files\.\*\*.*?```yaml\n(.*?)```", text, re.S)
    assert found, "docs/worked-example.md lost its **Layout files.** section with the ```yaml schema"
    return found.group(1)


def test_the_page_schema_is_the_modules_and_loads():
    block = _page_schema()
    doc = topology.layout.__doc__ or ""
    assert "\n".join("    " + line if line else line for line in block.rstrip("\n").split("\n")) in doc, (
        "the schema in docs/worked-example.md differs from topology/layout.py's docstring: make them the same"
    )
    t = topology_from_dict(yaml.safe_load(block), "docs/worked-example.md")
    assert t.name == "my-server" and t.num_gpus == 2 and t.host_memory_bytes == 512 * 2**30
    assert [g.numa_node for g in t.gpus] == [0, 0] and t.gpus[1].index == 1 and t.level(0, 1) == "NV4"
    assert t.nvme[0].link_gbps == 7.88 and t.switches[0].parent == ""


@pytest.mark.parametrize("cls", [Topology, Gpu, RootComplex, Switch, Nvme, NvLink, Measured])
def test_the_page_schema_names_every_key(cls):
    block = _page_schema()
    for f in dataclasses.fields(cls):
        assert re.search(rf"\b{f.name}\b", block), f"{cls.__name__}.{f.name} is not in the page's layout schema"


def test_several_missing_keys_are_named_at_once(tmp_path):
    path = tmp_path / "box.yaml"
    path.write_text(
        "root_complexes:\n  - {name: rc0}\n"
        "gpus:\n  - {name: NVIDIA GeForce RTX 3090 Ti, root_complex: rc0}\n  - {name: x, root_complex: rc9}\n"
    )
    with pytest.raises(TopologyError) as e:
        load_topology(str(path))
    msg = str(e.value)
    assert msg.startswith(f"layout {path}: 9 errors: (1) ") and "\n" not in msg
    missing = [
        "root_complexes[0].numa_node",
        "root_complexes[0].uplink_gbps",
        "gpus[0].memory_bytes",
        "gpus[0].pci_bus_id",
        "gpus[0].link_gbps",
        "gpus[1].memory_bytes",
        "gpus[1].pci_bus_id",
        "gpus[1].link_gbps",
        "name",
    ]
    for key in missing:
        assert f") {key}: expected " in msg and "(a required key)" in msg, key
    assert "numa_node` under gpus" not in msg  # optional: its root complex's problem is the one reported
    for fix in ("add `memory_bytes: 24GiB` under gpus[0]", 'add `pci_bus_id: "0000:1a:00.0"`', "`link_gbps: 15.75`"):
        assert fix in msg


def test_a_gpu_on_an_unknown_root_complex_is_that_problem_not_a_missing_numa_node(tmp_path):
    d = yaml.safe_load(_page_schema())
    d["gpus"][1]["root_complex"] = "rc9"
    d["gpus"][1].pop("switch")
    with pytest.raises(TopologyError) as e:
        topology_from_dict(d, "box.yaml")
    assert str(e.value).startswith("box.yaml: gpus[1].root_complex: expected one of the root_complexes ['rc0']")
