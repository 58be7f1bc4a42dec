"""Imports flow one way: foundation -> topology -> partition -> mobiuspipe (docs/design.md), checked by reading every
import: foundation, the bottom layer, imports none of the others, and every package may import it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {
    "foundation": set(),
    "topology": {"foundation"},
    "partition": {"foundation", "topology"},
    "mobiuspipe": {"foundation", "topology", "partition"},
}


def _imported_packages(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out & set(ALLOWED)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_flow_one_way(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"package {package} has no modules"
    wrong = {str(f.relative_to(ROOT)): sorted(_imported_packages(f) - ALLOWED[package] - {package}) for f in files}
    assert not {f: w for f, w in wrong.items() if w}, f"{package} imports against the flow"


def test_checker_sees_a_wrong_way_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import os\nfrom mobiuspipe.runtime.engine import Engine\nimport partition.plan as p\n"
        "from foundation.loader import load_file\n"
    )
    assert _imported_packages(bad) == {"mobiuspipe", "partition", "foundation"}


def test_foundation_is_the_bottom_layer():
    assert all("foundation" in allowed for package, allowed in ALLOWED.items() if package != "foundation")
    assert ALLOWED["foundation"] == set()


LOADED = {  # a package's modules, and the top-level packages importing them must not load
    "foundation": (
        "foundation, foundation.errors, foundation.loader, foundation.units, foundation.timing",
        {"topology", "partition", "mobiuspipe", "torch"},
    ),
    "topology": (
        "topology, topology.report, topology.report_svg, topology.layout, topology.presets, "
        "topology.discover, topology.sysfs, topology.nvml, topology.probe, topology.pci",
        {"partition", "mobiuspipe", "torch"},
    ),
}


@pytest.mark.parametrize("package", sorted(LOADED))
def test_importing_a_lower_layer_loads_nothing_above_it(package):
    modules, above = LOADED[package]
    code = f"import sys, {modules}\nprint(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(above)!r}))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
