"""runtime.deterministic: the config key, and the switch a rank throws before its first CUDA work."""

import os

import pytest
import torch

from mobiuspipe.config import ConfigError, load_config
from mobiuspipe.memory.device import deterministic_kernels


def test_the_switch_turns_on_deterministic_kernels_and_cublas_workspace(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        deterministic_kernels()
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(before)


def test_a_workspace_setting_of_the_users_is_kept(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    before = torch.are_deterministic_algorithms_enabled()
    try:
        deterministic_kernels()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(before)


def test_the_config_key(tmp_path):
    path = tmp_path / "run.yaml"
    assert not load_config(_write(path, "")).runtime.deterministic
    assert load_config(_write(path, "runtime:\n  deterministic: true\n")).runtime.deterministic
    with pytest.raises(ConfigError, match="runtime.deterministic"):
        load_config(_write(path, "runtime:\n  deterministic: sometimes\n"))


def _write(path, text: str):
    path.write_text("train:\n  steps: 1\n" + text)
    return path
