"""Imports flow one way: topology -> partition -> mobiuspipe (DESIGN.md), checked by reading every import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {"topology": set(), "partition": {"topology"}, "mobiuspipe": {"topology", "partition"}}


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
    wrong = {str(f.relative_to(ROOT)): sorted(_imported_packages(f) - ALLOWED[package] - {package})
             for f in files}
    assert not {f: w for f, w in wrong.items() if w}, f"{package} imports against the flow"


def test_checker_sees_a_wrong_way_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom mobiuspipe.engine import Engine\nimport partition.plan as p\n")
    assert _imported_packages(bad) == {"mobiuspipe", "partition"}
