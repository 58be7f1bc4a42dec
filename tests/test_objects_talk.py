"""Objects talk through methods: no module sets an attribute of the engine (or of a Pipeline from the checkpoint
code) from outside; a scaler's state goes through its own methods."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mobiuspipe.optim.loss_scale import LossScaler

ROOT = Path(__file__).resolve().parents[1]


def _outside_sets(path: Path, owner: str) -> list[str]:
    """Lines of path that assign to an attribute of `owner` (a name, or an attribute of that name) or setattr it."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        for t in _targets(node):
            for elt in t.elts if isinstance(t, ast.Tuple) else [t]:
                if isinstance(elt, ast.Attribute) and _names(elt.value, owner):
                    out.append(f"{path.name}:{elt.lineno}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            if node.args and _names(node.args[0], owner):
                out.append(f"{path.name}:{node.lineno}")
    return out


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    return [node.target] if isinstance(node, ast.AugAssign) else []


def _names(value: ast.AST, owner: str) -> bool:
    """value is `owner` or `something.owner`."""
    return (isinstance(value, ast.Name) and value.id == owner) or (
        isinstance(value, ast.Attribute) and value.attr == owner
    )


def test_nothing_sets_the_engines_attributes_from_outside():
    files = [f for f in (ROOT / "mobiuspipe").rglob("*.py") if f != ROOT / "mobiuspipe/runtime/engine.py"]
    assert not [line for f in files for line in _outside_sets(f, "engine")]


@pytest.mark.parametrize("owner", ["pipe", "scaler"])
def test_the_checkpoint_code_sets_no_pipeline_or_scaler_field(owner):
    assert not _outside_sets(ROOT / "mobiuspipe/checkpoint.py", owner)


def test_the_checker_sees_an_outside_set(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("engine.lr = 1\nself.engine.held, x = {1}, 2\nsetattr(pipe.engine, 'a', 1)\nengine.run(1)\n")
    assert _outside_sets(f, "engine") == ["m.py:1", "m.py:2", "m.py:3"]


def test_a_scalers_state_goes_back_through_load_state():
    a = LossScaler(scale=2.0**10, growth_interval=3)
    a.update(False)
    b = LossScaler()
    b.load_state(a.state())
    assert b == a
    with pytest.raises(ValueError, match="fields"):
        b.load_state({"scale": 1.0})
    with pytest.raises(ValueError, match="scale > 0"):
        b.load_state({**a.state(), "scale": -1.0})
    assert b == a  # a refused state leaves the scaler as it was


def _reads_through(path: Path, owner: str, attr: str) -> list[str]:
    """Lines of path that read `owner.attr` (owner a name, or an attribute of that name)."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        f"{path.name}:{n.lineno}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr == attr and _names(n.value, owner)
    ]


def test_the_run_and_the_checkpoint_ask_the_pipeline_not_its_engine():
    """Stages, device, pending updates and the device peak come from Pipeline methods (a checkpoint takes any
    Checkpointed owner), so the engine can change behind them."""
    files = [ROOT / "mobiuspipe/checkpoint.py", *(ROOT / "mobiuspipe/run").rglob("*.py")]
    assert not [line for f in files for line in _reads_through(f, "pipe", "engine")]
