"""The type stub mobiuspipe/_C.pyi (what pyright checks callers against) matches the built extension."""

import ast
import re
from pathlib import Path

import pytest

from mobiuspipe import _ext

STUB = Path(_ext.__file__).with_name("_C.pyi")
pytestmark = pytest.mark.skipif(not _ext.HAVE_C, reason=f"C++ extension not built ({_ext.WHY_NOT})")


def _params(fn: ast.FunctionDef) -> list[tuple[str, bool]]:
    """(name, has a default) of each parameter but self."""
    args = fn.args.args
    defaults = [False] * (len(args) - len(fn.args.defaults)) + [True] * len(fn.args.defaults)
    return [(a.arg, d) for a, d in zip(args, defaults) if a.arg != "self"]


def _bound_params(obj) -> list[tuple[str, bool]]:
    """The same, read from the signature pybind11 writes on the first line of the docstring."""
    inside = obj.__doc__.splitlines()[0].split("(", 1)[1].rsplit(") ->", 1)[0]
    found = re.findall(r"(?:^|, )(\w+): ([^=]*?)(?= = |, \w+: |$)( = )?", inside)
    return [(name, bool(default)) for name, _, default in found if name != "self"]


def _stub() -> tuple[dict[str, ast.stmt], dict[str, dict[str, ast.FunctionDef]]]:
    tree = ast.parse(STUB.read_text())
    top: dict[str, ast.stmt] = {}
    classes: dict[str, dict[str, ast.FunctionDef]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            top[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            top[node.target.id] = node
        if isinstance(node, ast.ClassDef):
            classes[node.name] = {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}
    return top, classes


def test_the_stub_names_what_the_extension_exports():
    top, classes = _stub()
    assert sorted(top) == sorted(n for n in dir(_ext.C) if not n.startswith("_"))
    for name, members in classes.items():
        cls = getattr(_ext.C, name)
        assert sorted(set(members) - {"__init__"}) == sorted(n for n in dir(cls) if not n.startswith("_")), name


def test_the_stub_has_the_extensions_parameters():
    top, classes = _stub()
    functions = [(getattr(_ext.C, n), f) for n, f in top.items() if isinstance(f, ast.FunctionDef)]
    for name, members in classes.items():
        cls = getattr(_ext.C, name)
        functions += [(getattr(cls, n), f) for n, f in members.items() if not isinstance(getattr(cls, n), property)]
    assert len(functions) > 10
    for obj, fn in functions:
        assert _params(fn) == _bound_params(obj), fn.name
