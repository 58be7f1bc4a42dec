"""`mobiuspipe topology` in-process: text, --tree, --matrix, --json, --svg and its one-line user errors."""

import json
import sys
import xml.etree.ElementTree as ET

import pytest

from mobiuspipe import cli
from topology import PRESETS, preset
from topology.report import render_matrix, render_text, render_tree, to_json_dict

SVG = "{http://www.w3.org/2000/svg}"


def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    """cli.main(argv) -> (exit code, stdout, stderr); argparse's SystemExit becomes its code."""
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_text_is_tree_and_matrix(capsys, name):
    assert run(capsys, ["topology", "--layout", name]) == (0, render_text(preset(name)), "")


def test_layout_2_plus_2(capsys):
    code, out, _ = run(capsys, ["topology", "--layout", "2+2"])
    assert code == 0 and out.startswith("topology 2+2 (preset:2+2): ")
    assert "contention groups: [0, 1] [2, 3]" in out and "Legend:" in out


def test_default_discovers_and_points_to_layout_without_gpus(capsys, monkeypatch, tmp_path):
    (tmp_path / "bus" / "pci" / "devices").mkdir(parents=True)  # a sysfs tree with no GPU
    monkeypatch.setitem(sys.modules, "pynvml", None)  # and no NVML (which would find a GPU on a GPU machine)
    code, out, err = run(capsys, ["topology", "--sysfs-root", str(tmp_path)])
    assert code == 2 and out == ""
    assert err.startswith("mobiuspipe: error: no GPU found") and "--layout 2+2" in err


def test_tree_only(capsys):
    code, out, err = run(capsys, ["topology", "--layout", "8-dual-socket", "--tree"])
    assert (code, err) == (0, "") and out == render_tree(preset("8-dual-socket"))
    assert "Legend:" not in out and "sw3  PCIe switch" in out


def test_matrix_only(capsys):
    code, out, err = run(capsys, ["topology", "--layout", "2x2-nvlink", "--matrix"])
    assert (code, err) == (0, "") and out == render_matrix(preset("2x2-nvlink"))
    assert out.splitlines()[1].split()[:5] == ["GPU0", "X", "NV4", "SYS", "SYS"]
    assert "P2P read status" in out and "root complex" not in out


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_json_only_json_on_stdout(capsys, name):
    code, out, err = run(capsys, ["topology", "--layout", name, "--json"])
    assert (code, err) == (0, "")
    d = json.loads(out)  # fails on anything printed besides the document
    assert d == json.loads(json.dumps(to_json_dict(preset(name))))
    assert {"gpus", "contention_groups", "source"} <= set(d)
    for g in d["gpus"]:
        assert {"index", "name", "memory_bytes", "pci_bus_id", "root_complex", "numa_node"} <= set(g)


def test_json_with_svg_puts_the_note_on_stderr(capsys, tmp_path):
    path = tmp_path / "t.svg"
    code, out, err = run(capsys, ["topology", "--layout", "3+1", "--json", "--svg", str(path)])
    assert code == 0 and json.loads(out)["contention_groups"] == [[0, 1, 2], [3]]
    assert err == f"picture written to {path}\n"
    assert ET.parse(path).getroot().tag == f"{SVG}svg"


def test_svg_with_text(capsys, tmp_path):
    path = tmp_path / "t.svg"
    code, out, err = run(capsys, ["topology", "--layout", "2x2-nvlink", "--tree", "--svg", str(path)])
    assert (code, err) == (0, "")
    assert out == render_tree(preset("2x2-nvlink")) + f"picture written to {path}\n"
    texts = [e.text for e in ET.parse(path).getroot().iter(f"{SVG}text")]
    assert {"GPU 0", "GPU 3", "NV4 56 GB/s", "topology 2x2-nvlink"} <= set(texts)


def test_layout_file(capsys, tmp_path):
    path = tmp_path / "box.json"
    path.write_text(json.dumps(preset("4").to_dict()))
    code, out, _ = run(capsys, ["topology", "--layout", str(path), "--matrix"])
    assert code == 0 and out == render_matrix(preset("4"))


def _assert_user_error(capsys, argv: list[str], *needles: str) -> None:
    code, out, err = run(capsys, argv)
    assert code == 2 and out == ""
    assert err.startswith("mobiuspipe: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err


def test_unknown_preset(capsys):
    _assert_user_error(capsys, ["topology", "--layout", "5+5"], "'5+5'", "2+2", "8-dual-socket")
    _assert_user_error(capsys, ["topology", "--layout", "5+5", "--json"], "'5+5'")


def test_bad_layout_file(capsys, tmp_path):
    d = preset("2+2").to_dict()
    d["switches"][0]["parent"] = "sw9"
    path = tmp_path / "box.yaml"
    path.write_text(json.dumps(d))
    _assert_user_error(capsys, ["topology", "--layout", str(path)], str(path), "switches[0].parent", "sw9")


def test_unwritable_svg_prints_nothing_else(capsys, tmp_path):
    target = str(tmp_path / "no" / "t.svg")
    _assert_user_error(capsys, ["topology", "--layout", "2+2", "--svg", target], target, "cannot write")
    _assert_user_error(capsys, ["topology", "--layout", "2+2", "--json", "--svg", target], target)


@pytest.mark.parametrize("flags", [["--json", "--matrix"], ["--tree", "--matrix"], ["--json", "--tree"]])
def test_views_exclude_each_other(capsys, flags):
    code, out, err = run(capsys, ["topology", "--layout", "2+2", *flags])
    assert code == 2 and out == "" and "not allowed with argument" in err
