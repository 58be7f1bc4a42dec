"""The torch releases the project runs on are said once for pip (pyproject.toml) and once for scripts/setup.sh, which
installs torch and checks a preinstalled one (MOBIUSPIPE_SYSTEM_TORCH=1): the two agree, and the check refuses a
torch outside them with the range."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "scripts" / "setup.sh"


def _setup_spec() -> str:
    found = re.search(r'^torch_spec="([^"]+)"$', SETUP.read_text(), re.M)
    assert found, "scripts/setup.sh sets no torch_spec"
    return found.group(1)


def test_setup_and_pyproject_name_one_range():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"{_setup_spec()}",' in pyproject


def _in_range(spec: str) -> subprocess.CompletedProcess:
    body = re.search(r"^torch_in_range\(\) \{\n.*?^\}\n", SETUP.read_text(), re.M | re.S)
    assert body, "scripts/setup.sh defines no torch_in_range"
    script = f'vpy="{sys.executable}"\n{body.group(0)}torch_in_range "$1"\n'
    return subprocess.run(["bash", "-c", script, "check", spec], capture_output=True, text=True, timeout=120)


def test_this_torch_is_in_the_range():
    done = _in_range(_setup_spec())
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_a_torch_outside_the_range_is_named_with_it():
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    for spec in (f"torch>={major}.{minor + 1}", f"torch>=2.0,<={major}.{minor - 1}"):
        done = _in_range(spec)
        assert done.returncode == 1, spec
        assert f"torch {torch.__version__} is outside {spec}, the releases this project runs on" in done.stderr


def _function(name: str) -> str:
    body = re.search(rf"^{name}\(\) \{{.*?\}}$", SETUP.read_text(), re.M | re.S)
    assert body, f"scripts/setup.sh defines no {name}"
    return body.group(0)


def test_a_venv_made_without_the_systems_packages_is_told_apart(tmp_path):
    """MOBIUSPIPE_SYSTEM_TORCH=1 over a .venv an earlier set-up made without --system-site-packages stops with
    "remove it" (that .venv cannot see the system's torch; the set-up never remakes an existing .venv)."""
    script = f'{_function("venv_sees_system")}\nvenv_sees_system "$1"\n'
    for text, sees in [
        ("home = /usr/bin\ninclude-system-site-packages = false\nversion = 3.12.3\n", False),
        ("home = /usr/bin\ninclude-system-site-packages = true\nversion = 3.12.3\n", True),
    ]:
        (tmp_path / "pyvenv.cfg").write_text(text)
        done = subprocess.run(["bash", "-c", script, "check", str(tmp_path)], capture_output=True, timeout=60)
        assert (done.returncode == 0) == sees, text
    assert "rm -rf .venv" in SETUP.read_text()


def test_the_set_up_installs_the_release_the_suite_runs_on():
    """CI's torch, which setup.sh installs into .venv, is the release it pins. A machine's own torch
    (MOBIUSPIPE_SYSTEM_TORCH=1: a .venv that sees the system's packages) is any release in pyproject's range."""
    if not Path(torch.__file__).resolve().is_relative_to(Path(sys.prefix).resolve()):
        pytest.skip(f"torch {torch.__version__} is the system's, not this environment's (MOBIUSPIPE_SYSTEM_TORCH=1)")
    pin = re.search(r'^torch_pin="torch==([^"]+)"$', SETUP.read_text(), re.M)
    assert pin and torch.__version__.split("+")[0] == pin.group(1), "CI's torch is the one setup.sh installs"
