"""Fixtures for the recorded test machines of boxes.py: sysfs trees and fake pynvml modules."""

import importlib.util
import sys
from pathlib import Path

import pytest


def _load_boxes():
    name = "topology_test_boxes"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("boxes.py"))
        assert spec is not None and spec.loader is not None  # a .py path always has a source loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture
def boxes():
    """The boxes module: BOXES, FAKES, nvml_gpus(), parse_cpulist(), FakeNvml."""
    return _load_boxes()


@pytest.fixture
def sysfs_box(tmp_path):
    """sysfs_box(name) -> the root of a fresh sysfs tree of box `name` (a key of boxes.BOXES)."""
    mod = _load_boxes()

    def make(name: str) -> Path:
        return mod.write_sysfs(name, tmp_path / f"sys-{name}")

    return make


@pytest.fixture
def nvml_box():
    """nvml_box(name, **changes) -> a fake pynvml module for a box or a failure fake (boxes.FAKES)."""
    return _load_boxes().fake_nvml
