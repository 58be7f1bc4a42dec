"""Layout files: exact JSON/YAML round trips, memory strings, and errors that name the file and the key."""

import copy
import json
import re

import pytest
import yaml

from topology import PRESETS, TopologyError, cpu_standin, load_topology, preset, save_topology
from topology.layout import parse_bytes, topology_from_dict

TOPOLOGIES = [preset("2+2"), preset("3+1"), cpu_standin(1, 1234567), cpu_standin(4, 3 * 2**30, link_gbps=12.5)]


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
@pytest.mark.parametrize("t", TOPOLOGIES, ids=lambda t: t.name)
def test_round_trip_is_exact(tmp_path, t, suffix):
    path = save_topology(t, tmp_path / f"layout{suffix}")
    assert load_topology(str(path)) == t


def test_from_dict_inverts_to_dict():
    for t in TOPOLOGIES:
        assert type(t).from_dict(t.to_dict()) == t


def test_load_preset_by_name():
    for name in PRESETS:
        assert load_topology(name) == preset(name)


def _layout() -> dict:
    return copy.deepcopy(preset("2+2").to_dict())


def _write(tmp_path, d, name="server.yaml"):
    path = tmp_path / name
    path.write_text(json.dumps(d) if name.endswith(".json") else yaml.safe_dump(d))
    return str(path)


def test_hand_written_layout_with_defaults(tmp_path):
    d = _layout()
    for g in d["gpus"]:
        del g["index"], g["numa_node"]
        g["memory_bytes"] = "24GiB"
    del d["source"], d["p2p"], d["host_memory_bytes"]
    path = _write(tmp_path, d)
    t = load_topology(path)
    assert t.gpus == preset("2+2").gpus
    assert t.source == f"file:{path}"


@pytest.mark.parametrize("text, expected", [
    (25769803776, 25769803776), ("24GiB", 24 * 2**30), ("24 GB", 24 * 10**9), ("1.5tib", 3 * 2**39),
    ("512 MiB", 2**29), ("0.1GB", 10**8), ("7B", 7),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text, "f.yaml", "k") == expected


@pytest.mark.parametrize("bad", ["24", "24 GiBs", "1.5B", "-3GB", 2.5, True, None, [24]])
def test_parse_bytes_rejects(bad):
    with pytest.raises(TopologyError, match=r"f\.yaml: gpus\[0\]\.memory_bytes: expected"):
        parse_bytes(bad, "f.yaml", "gpus[0].memory_bytes")


def _set(d, dotted, value):
    """Set (or with value ... delete) a dotted key like "gpus[2].memory_bytes" in a nested layout dict."""
    *parents, last = dotted.replace("[", ".").replace("]", "").split(".")
    for p in parents:
        d = d[int(p)] if p.isdigit() else d[p]
    if value is ...:
        del d[last]
    else:
        d[last] = value


BAD = [  # (dotted key, value or ... to delete, message fragment)
    ("gpus[2].memroy_bytes", 1, r"gpus\[2\]\.memroy_bytes: unknown key.*did you mean 'memory_bytes'"),
    ("contention", 1, r"contention: unknown key"),
    ("gpus[2].memory_bytes", [24], r"gpus\[2\]\.memory_bytes: expected bytes.*found list \[24\]"),
    ("gpus[1].link_gbps", "fast", r"gpus\[1\]\.link_gbps: expected a bandwidth.*found 'fast'"),
    ("root_complexes[0].numa_node", 0.5, r"root_complexes\[0\]\.numa_node: expected an integer.*float 0\.5"),
    ("p2p", "no", r"p2p: expected true or false"),
    ("gpus", {}, r"gpus: expected a non-empty list"),
    ("gpus[3].pci_bus_id", ..., r"gpus\[3\]\.pci_bus_id: missing key"),
    ("name", ..., r"name: missing key"),
    ("root_complexes[1].uplink_gbps", ..., r"root_complexes\[1\]\.uplink_gbps: missing key"),
    ("gpus[3].root_complex", "rc7", r"gpus\[3\]\.root_complex: expected one of the root_complexes.*found 'rc7'"),
    ("gpus[1].index", 5, r"gpus\[1\]\.index: expected 1"),
    ("gpus[0].memory_bytes", 0, r"gpus\[0\]\.memory_bytes: expected memory > 0"),
    ("root_complexes[1].name", "rc0", r"root_complexes: expected distinct names"),
]


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
@pytest.mark.parametrize("key, value, message", BAD, ids=[b[0] + ("-del" if b[1] is ... else "") for b in BAD])
def test_bad_layout_names_file_and_key(tmp_path, key, value, message, suffix):
    d = _layout()
    _set(d, key, value)
    path = _write(tmp_path, d, "server" + suffix)
    with pytest.raises(TopologyError) as e:
        load_topology(path)
    assert str(e.value).startswith(f"{path}: ")
    assert re.search(message, str(e.value)), str(e.value)


def test_unused_root_complex_is_accepted():
    d = _layout()
    d["root_complexes"].append({"name": "rc2", "numa_node": 0, "uplink_gbps": 1.0})
    t = topology_from_dict(d, "x.yaml")
    assert t.root_complexes[2].name == "rc2" and t.contention_groups() == [[0, 1], [2, 3]]


def test_nonexistent_path(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(TopologyError, match=r"nope\.yaml.*2\+2.*3\+1.*path of a \.yaml/\.yml/\.json"):
        load_topology(missing)


def test_unknown_preset_name():
    with pytest.raises(TopologyError, match=r"'2\+3' is neither a preset nor an existing file.*'2\+2', '3\+1'"):
        load_topology("2+3")


def test_malformed_yaml(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\ngpus: [\n  {name: a\nroot_complexes: ]\n")
    with pytest.raises(TopologyError, match=r"broken\.yaml: malformed YAML at line \d+ column \d+"):
        load_topology(str(path))


def test_malformed_json(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"name": "x",}')
    with pytest.raises(TopologyError, match=r"broken\.json: malformed JSON at line 1"):
        load_topology(str(path))


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just a string\n"])
def test_top_level_not_a_mapping(tmp_path, text):
    path = tmp_path / "odd.yaml"
    path.write_text(text)
    with pytest.raises(TopologyError, match=r"odd\.yaml: top level: expected a mapping"):
        load_topology(str(path))


def test_wrong_suffix(tmp_path):
    path = tmp_path / "server.txt"
    path.write_text(yaml.safe_dump(_layout()))
    with pytest.raises(TopologyError, match=r"server\.txt: expected a layout file ending in"):
        load_topology(str(path))
    with pytest.raises(TopologyError, match=r"server\.txt: cannot save"):
        save_topology(preset("2+2"), path)


def test_directory_is_not_a_layout(tmp_path):
    with pytest.raises(TopologyError, match="is a directory"):
        load_topology(str(tmp_path))


def test_save_into_missing_directory(tmp_path):
    with pytest.raises(TopologyError, match="cannot write"):
        save_topology(preset("2+2"), tmp_path / "no" / "such" / "dir.yaml")
