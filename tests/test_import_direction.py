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


# -- inside mobiuspipe: rooms by purpose, each importing only rooms below it ---------------------------------------

ROOMS = {
    0: {"errors", "_ext", "_build", "standin"},
    1: {"config", "models", "schedule", "memory", "lora"},
    2: {"optim", "data"},
    3: {"runtime"},
    4: {"profiling"},
    5: {"startup"},
    6: {"layers", "step_result", "checkpoint"},  # what the public Pipeline is built from
    7: {"pipeline"},
    8: {"run"},
    9: {"cli", "train"},
    10: {"__main__"},
}
"""mobiuspipe's rooms (a subpackage, or a module at its root) by level: a room imports its own modules and rooms of
a lower level only (docs/design.md draws them)."""
LEVEL = {room: level for level, rooms in ROOMS.items() for room in rooms}


def _modules(package: str) -> dict[str, Path]:
    out = {}
    for f in sorted((ROOT / package).rglob("*.py")):
        parts = f.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imports(path: Path, modules: dict[str, Path], top_level_only: bool = False) -> set[str]:
    """The modules of `modules` that path imports (a name imported from a package counts as its module when it is
    one), leaving out imports under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for node in ast.walk(tree) if _is_type_checking(node) for n in ast.walk(node)}
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = set()
    for node in nodes:
        if id(node) in typing_only:
            continue
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names
            ]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def _name_or_module(module: str, name: str, modules: dict[str, Path]) -> str:
    """`from module import name`: the module `module.name` where it is one, else `module`."""
    return f"{module}.{name}" if f"{module}.{name}" in modules else module


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the package's __init__ (its lazy public names)


def test_every_room_of_mobiuspipe_has_a_level():
    rooms = {r for m in _modules("mobiuspipe") if (r := _room(m)) is not None}
    assert rooms <= set(LEVEL), f"rooms without a level in ROOMS: {sorted(rooms - set(LEVEL))}"


def test_mobiuspipe_rooms_import_downwards():
    modules = _modules("mobiuspipe")
    wrong = []
    for module, path in modules.items():
        here = _room(module)
        for target in _imports(path, modules):
            there = _room(target)
            if here is None or there is None or there == here:
                continue
            if LEVEL[there] >= LEVEL[here]:
                wrong.append(f"{module} (level {LEVEL[here]}) imports {target} (level {LEVEL[there]})")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_import_cycles(package):
    """No cycle of imports between modules, function-level imports included (they must not hide one)."""
    modules = _modules(package)
    graph = {m: {t for t in _imports(p, modules) if t != m and not m.startswith(t + ".")} for m, p in modules.items()}
    cycles = _cycles(graph)
    assert not cycles, f"import cycles: {cycles}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


MOST_MODULES = 15
"""The most modules a folder holds side by side (more: a subpackage waiting to be made)."""


@pytest.mark.parametrize("package", ["mobiuspipe", "partition"])
def test_no_folder_holds_more_than_15_modules(package):
    crowded = {}
    for folder in [ROOT / package, *(ROOT / package).rglob("*/")]:
        n = len(list(folder.glob("*.py")))  # its __init__ too
        if n > MOST_MODULES:
            crowded[str(folder.relative_to(ROOT))] = n
    assert not crowded, f"folders over {MOST_MODULES} modules: {crowded}"


def test_the_reader_sees_function_level_imports_and_not_type_checking_ones(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mobiuspipe.pipeline import Pipeline\n"
        "def f():\n    from mobiuspipe.runtime import engine\n    from mobiuspipe.config import load_config\n"
    )
    modules = _modules("mobiuspipe")
    assert _imports(f, modules) == {"mobiuspipe.runtime.engine", "mobiuspipe.config"}
    assert _imports(f, modules, top_level_only=True) == set()
