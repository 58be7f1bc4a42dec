"""Layout files: exact JSON/YAML round trips, memory strings, and errors that name the file and the key."""

import copy
import json
import re
from dataclasses import replace

import pytest
import yaml

from topology import PRESETS, Topology, TopologyError, cpu_standin, load_topology, preset, save_topology
from topology.layout import parse_bytes, topology_from_dict
from topology.types import Measured, NvLink, Nvme, Switch


def _full() -> Topology:
    """2+2 with every optional part filled in: nested switch, NVMe, NVLink, P2P, measurements, notes."""
    t = preset("2+2")
    return replace(
        t,
        host_memory_bytes=512 * 2**30,
        notes=("no NVML: names from sysfs",),
        switches=t.switches + (Switch("sw0b", "rc0", 7.88, parent="sw0"),),
        nvme=(Nvme("nvme0", "0000:3d:00.0", "rc0", 0, 7.88, switch="sw0b", model="Samsung 980 PRO"),),
        nvlinks=(NvLink(0, 1, 4, 56.25),),
        p2p=tuple(tuple("X" if a == b else "GNS" for b in range(4)) for a in range(4)),
        measured=Measured(
            h2d_gbps=(12.0, 12.5, 11.5, 13.0),
            h2d_group_gbps=(6.0, 6.5, 5.5, 6.0),
            d2d_gbps=tuple(tuple(0.0 if a == b else 9.5 for b in range(4)) for a in range(4)),
            ssd_dir="/scratch",
            ssd_read_gbps=3.2,
            ssd_write_gbps=2.1,
            notes=("p2p not measured",),
        ),
    )


TOPOLOGIES = [*PRESETS.values(), _full(), cpu_standin(1, 1234567), cpu_standin(4, 3 * 2**30, link_gbps=12.5)]


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
@pytest.mark.parametrize("t", TOPOLOGIES, ids=lambda t: t.name + ("-full" if t.nvme else ""))
def test_round_trip_is_exact(tmp_path, t, suffix):
    path = save_topology(t, tmp_path / f"layout{suffix}")
    assert load_topology(str(path)) == t


def test_from_dict_inverts_to_dict():
    for t in TOPOLOGIES:
        assert topology_from_dict(t.to_dict(), "test") == t


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


@pytest.mark.parametrize(
    "text, expected",
    [
        (25769803776, 25769803776),
        ("24GiB", 24 * 2**30),
        ("24 GB", 24 * 10**9),
        ("1.5tib", 3 * 2**39),
        ("512 MiB", 2**29),
        ("0.1GB", 10**8),
        ("7B", 7),
    ],
)
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


_NVME = {"name": "nvme0", "pci_bus_id": "0000:3d:00.0", "root_complex": "rc0", "numa_node": 0, "link_gbps": 7.88}
_P2P = [["X" if a == b else "GNS" for b in range(4)] for a in range(4)]
_LINK = {"a": 0, "b": 1, "links": 4, "gbps": 56.25}

BAD = [  # (dotted key, value or ... to delete, message fragment)
    (
        "gpus[2].memroy_bytes",
        1,
        r"gpus\[2\]\.memroy_bytes: expected one of the keys of gpus\[2\]: .*found unknown "
        r"key 'memroy_bytes'; fix: did you mean 'memory_bytes'",
    ),
    ("contention", 1, r"contention: expected one of the keys of the top level.*found unknown key 'contention'"),
    ("gpus[2].memory_bytes", [24], r"gpus\[2\]\.memory_bytes: expected bytes.*found list \[24\]"),
    ("gpus[0].memory_bytes", -1, r"gpus\[0\]\.memory_bytes: expected bytes: an integer >= 0.*found integer -1"),
    ("gpus[1].link_gbps", "fast", r"gpus\[1\]\.link_gbps: expected a number, found string 'fast'"),
    (
        "gpus[1].link_gbps",
        0,
        r"gpus\[1\]\.link_gbps: expected a bandwidth in GB/s, a finite number > 0, found number "
        r"0\.0",
    ),
    ("gpus[0].name", "", r"gpus\[0\]\.name: expected a non-empty string, found string ''"),
    ("root_complexes[0].numa_node", 0.5, r"root_complexes\[0\]\.numa_node: expected an integer, found number 0\.5"),
    ("root_complexes[0].name", 5, r"root_complexes\[0\]\.name: expected a string, found integer 5"),
    ("root_complexes[0].name", "", r"root_complexes\[0\]\.name: expected a non-empty string"),
    ("root_complexes[1].uplink_gbps", -2.0, r"root_complexes\[1\]\.uplink_gbps: expected a bandwidth.*> 0"),
    ("gpus", {}, r"gpus: expected a list of mappings, found mapping \{\}"),
    ("gpus", [], r"gpus: expected a non-empty list of gpus, found an empty list"),
    (
        "gpus[3].pci_bus_id",
        ...,
        r"gpus\[3\]\.pci_bus_id: expected a string \(a required key\), found nothing: the "
        r"key is missing",
    ),
    ("name", ..., r": name: expected a string \(a required key\), found nothing"),
    ("name", "", r": name: expected a non-empty string"),
    ("root_complexes[1].uplink_gbps", ..., r"root_complexes\[1\]\.uplink_gbps: expected a number \(a required key\)"),
    (
        "gpus[3].root_complex",
        "rc7",
        r"gpus\[3\]\.root_complex: expected one of the root_complexes.*found string "
        r"'rc7'",
    ),
    ("gpus[1].index", 5, r"gpus\[1\]\.index: expected 1"),
    ("root_complexes[1].name", "rc0", r"root_complexes\[1\]\.name: expected a name no other root complex has.*'rc0'"),
    # switches
    (
        "switches[0].parent",
        "sw9",
        r"switches\[0\]\.parent: expected one of the switches \['sw0', 'sw1'\] or \"\" "
        r"for none, found string 'sw9'",
    ),
    ("switches[1].root_complex", "rc9", r"switches\[1\]\.root_complex: expected one of the root_complexes.*'rc9'"),
    ("switches[0].parent", "sw0", r"switches\[0\]\.parent: expected a switch that is not below 'sw0' \(parents form"),
    ("switches[1].name", "sw0", r"switches\[1\]\.name: expected a name no other switch has.*found string 'sw0'"),
    ("switches[1].uplink_gbps", 0, r"switches\[1\]\.uplink_gbps: expected a bandwidth in GB/s, a finite number > 0"),
    (
        "switches[0].colour",
        "red",
        r"switches\[0\]\.colour: expected one of the keys of switches\[0\].*found unknown "
        r"key 'colour'",
    ),
    ("switches", {"name": "sw0"}, r"switches: expected a list"),
    (
        "gpus[0].switch",
        "sw7",
        r"gpus\[0\]\.switch: expected one of the switches \['sw0', 'sw1'\].*found string "
        r"'sw7'",
    ),
    ("gpus[2].switch", "sw0", r"gpus\[2\]\.root_complex: expected 'rc0', the root complex of its switch 'sw0'.*'rc1'"),
    # nvme
    ("nvme", [{**_NVME, "root_complex": "rc5"}], r"nvme\[0\]\.root_complex: expected one of the root_complexes"),
    ("nvme", [{**_NVME, "switch": "sw1"}], r"nvme\[0\]\.root_complex: expected 'rc1', the root complex of its"),
    ("nvme", [{**_NVME, "link_gbps": "x"}], r"nvme\[0\]\.link_gbps: expected a number, found string 'x'"),
    # nvlinks
    ("nvlinks", [{**_LINK, "b": 4}], r"nvlinks\[0\]\.b: expected a gpu index in 0\.\.3, with a != b, found integer 4"),
    ("nvlinks", [_LINK, {**_LINK, "a": -1}], r"nvlinks\[1\]\.a: expected a gpu index in 0\.\.3"),
    ("nvlinks", [{**_LINK, "a": 1}], r"nvlinks\[0\]\.b: expected a gpu index in 0\.\.3, with a != b, found integer 1"),
    ("nvlinks", [{**_LINK, "links": 0}], r"nvlinks\[0\]\.links: expected an integer >= 1, found integer 0"),
    ("nvlinks", [{**_LINK, "gbps": 0}], r"nvlinks\[0\]\.gbps: expected a bandwidth in GB/s, a finite number > 0"),
    ("nvlinks", [{"a": 0, "b": 1, "links": 4}], r"nvlinks\[0\]\.gbps: expected a number \(a required key\)"),
    # p2p
    ("p2p", "no", r"p2p: expected a list of lists of strings, found string 'no'"),
    ("p2p", [["X", "OK"], ["OK", "X"]], r"p2p: expected \[\] or a 4 x 4 matrix of statuses"),
    ("p2p", [*_P2P[:2], ["GNS", "GNS", "X"], _P2P[3]], r"p2p\[2\]: expected a row of 4 statuses"),
    ("p2p", [["X", "ok", "GNS", "GNS"], *_P2P[1:]], r"p2p\[0\]\[1\]: expected one of the nvidia-smi statuses.*'ok'"),
    ("p2p", [[True] * 4] * 4, r"p2p\[0\]\[0\]: expected a string, found boolean True"),
    # measured
    ("measured", "fast", r"measured: expected a mapping with keys among h2d_gbps.*found string 'fast'"),
    ("measured", {"h2d_gbps": 12.0}, r"measured\.h2d_gbps: expected a list of numbers, found number 12\.0"),
    ("measured", {"h2d_gbps": [12.0, 12.0]}, r"measured\.h2d_gbps: expected \[\] \(not measured\) or 4 values"),
    ("measured", {"d2d_gbps": [[0.0] * 4] * 3}, r"measured\.d2d_gbps: expected \[\] \(not measured\) or 4 rows"),
    ("measured", {"ssd_read_gbps": "quick"}, r"measured\.ssd_read_gbps: expected a number, found string 'quick'"),
    ("measured", {"ssd_read_gbps": -1.0}, r"measured\.ssd_read_gbps: expected a finite number >= 0"),
    (
        "measured",
        {"h2d_gbpz": []},
        r"measured\.h2d_gbpz: expected one of the keys of measured.*found unknown key "
        r"'h2d_gbpz'; fix: did you mean 'h2d_gbps'",
    ),
    ("notes", "one", r"notes: expected a list of strings, found string 'one'"),
]


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
@pytest.mark.parametrize("key, value, message", BAD, ids=[b[0] + ("-del" if b[1] is ... else "") for b in BAD])
def test_bad_layout_names_file_and_key(tmp_path, key, value, message, suffix):
    d = _layout()
    _set(d, key, value)
    path = _write(tmp_path, d, "server" + suffix)
    with pytest.raises(TopologyError) as e:
        load_topology(path)
    assert str(e.value).startswith(f"layout {path}: ")
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
    with pytest.raises(
        TopologyError,
        match=r"'2\+3' is neither a preset nor an existing file; known presets: "
        r"\['2\+2', '2x2-nvlink', '3\+1', '4', '8-dual-socket'\]",
    ):
        load_topology("2+3")


def test_malformed_yaml(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\ngpus: [\n  {name: a\nroot_complexes: ]\n")
    with pytest.raises(TopologyError, match=r"broken\.yaml: expected valid YAML, found .* at line \d+, column \d+"):
        load_topology(str(path))


def test_malformed_json(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"name": "x",}')
    with pytest.raises(TopologyError, match=r"broken\.json: expected valid JSON, found .* at line 1, column 14"):
        load_topology(str(path))


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just a string\n"])
def test_top_level_not_a_mapping(tmp_path, text):
    path = tmp_path / "odd.yaml"
    path.write_text(text)
    with pytest.raises(TopologyError, match=r"odd\.yaml: \(top level\): expected a mapping"):
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


def test_switch_loop_is_refused_when_built_in_code_too():
    t = preset("2+2")
    loop = (Switch("sw0", "rc0", 15.75, parent="sw0b"), Switch("sw0b", "rc0", 15.75, parent="sw0"), t.switches[1])
    with pytest.raises(TopologyError, match=r"topology '2\+2': the parents above switch 'sw0' form a loop"):
        replace(t, switches=loop)  # switch_chain() would never return


def test_every_problem_of_a_layout_at_once(tmp_path):
    d = _layout()
    d["gpus"][0]["memroy_bytes"] = 1
    d["gpus"][1]["link_gbps"] = 0
    d["gpus"][3]["root_complex"] = "rc7"
    d["root_complexes"][0]["numa_node"] = "zero"
    path = _write(tmp_path, d)
    with pytest.raises(TopologyError) as e:
        load_topology(path)
    message = str(e.value)
    assert message.startswith(f"layout {path}: 3 errors: (1) ") and "\n" not in message
    for key in ("gpus[0].memroy_bytes: expected", "gpus[1].link_gbps: expected", "root_complexes[0].numa_node"):
        assert key in message
    del d["gpus"][0]["memroy_bytes"]
    d["root_complexes"][0]["numa_node"] = 0
    d["gpus"][1]["link_gbps"] = 15.75
    d["switches"][0]["parent"] = "sw9"
    with pytest.raises(TopologyError, match=r"2 errors: \(1\) switches\[0\]\.parent: .* \(2\) gpus\[3\]\.root_complex"):
        load_topology(_write(tmp_path, d))


@pytest.mark.parametrize(
    "name, text, needle",
    [
        (
            "dup.yaml",
            "name: a\nname: b\ngpus: []\n",
            "name: expected each key once per mapping, found it at line 1 and again at line 2",
        ),
        ("dup.json", '{"name": "a", "gpus": [{"index": 0, "index": 1}]}', "gpus[0].index: expected each key once"),
    ],
)
def test_duplicate_keys_in_a_layout(tmp_path, name, text, needle):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TopologyError) as e:
        load_topology(str(path))
    assert str(e.value).startswith(f"layout {path}: ") and needle in str(e.value)


def test_exponent_without_a_dot_is_a_bandwidth(tmp_path):
    d = _layout()
    text = yaml.safe_dump(d).replace("uplink_gbps: 15.753846153846155", "uplink_gbps: 16e0")
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    assert load_topology(str(path)).root_complexes[0].uplink_gbps == 16.0


def test_value_problems_and_references_come_together(tmp_path):
    """A part whose values are wrong (not their types) is still checked against the rest of the layout."""
    d = _layout()
    d["gpus"][0]["memory_bytes"] = 24  # meant as 24 GiB: a bare number is bytes
    d["gpus"][1]["link_gbps"] = -3
    d["gpus"][3]["root_complex"] = "rc7"
    with pytest.raises(TopologyError) as e:
        load_topology(_write(tmp_path, d))
    message = str(e.value)
    assert "3 errors" in message and "gpus[3].root_complex: expected one of the root_complexes" in message
    assert "gpus[0].memory_bytes: expected a gpu's memory in bytes: 0 (unknown) or at least 67108864" in message
    assert "fix: a bare number is bytes: write the unit, e.g. `memory_bytes: 24GiB`" in message
    d = _layout()
    d["gpus"][0]["memory_bytes"] = 0  # unknown
    load_topology(_write(tmp_path, d))
    assert load_topology(str(save_topology(cpu_standin(2, 1000), tmp_path / "s.yaml"))).gpus[0].memory_bytes == 1000
