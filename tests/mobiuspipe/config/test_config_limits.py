"""Run-config values that load but would break the run later (found by fuzzing): refused at load, named."""

import json
from pathlib import Path

import pytest

from mobiuspipe.config import config_from_dict
from mobiuspipe.config.runtime import MAX_THREADS
from mobiuspipe.errors import ConfigError


def _error(d: dict, base_dir: Path | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        config_from_dict(d, "run.yaml", base_dir=None if base_dir is None else str(base_dir))
    return str(e.value)


@pytest.mark.parametrize(
    "section, key, value, expected",
    [
        ("train", "seed", -1, "a seed in [0, 2**32 - 1]"),
        ("train", "seed", 2**32, "a seed in [0, 2**32 - 1]"),
        ("train", "max_grad_norm", float("inf"), "a positive finite norm or null"),
        ("runtime", "threads", MAX_THREADS + 1, f"a thread count in [1, {MAX_THREADS}]"),
        ("runtime", "comm_timeout_s", 1e308, "a number of seconds > 0 and at most 1e9"),
        ("memory", "host_budget_mb", 1e308, "a number of MiB > 0 and at most 2**40"),
        ("plan", "device_memory_mb", float("inf"), "a number of MiB > 0 and at most 2**40"),
        ("model", "num_blocks", 10**30, "an integer of 64 bits"),
    ],
)
def test_values_the_run_could_not_use(section, key, value, expected):
    assert f"{section}.{key}: expected {expected}" in _error({section: {key: value}})


def test_limits_that_are_fine():
    runtime = {"threads": MAX_THREADS, "comm_timeout_s": 1e9, "hang_timeout_s": 1e9}
    cfg = config_from_dict({"train": {"seed": 2**32 - 1}, "runtime": runtime})
    assert cfg.train.seed == 2**32 - 1 and cfg.runtime.threads == MAX_THREADS


def test_no_stages_is_refused_with_a_topology_too():
    assert "plan.num_stages: expected an integer >= 1" in _error({"plan": {"topology": "2+2", "num_stages": 0}})


def test_a_missing_or_unreadable_model_folder_is_a_config_error_with_the_others(tmp_path):
    message = _error({"model": {"hf": "nope"}, "train": {"lr": -1}}, tmp_path)
    assert "2 errors" in message and "model.hf: expected an existing folder" in message and "train.lr" in message
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    message = _error({"model": {"hf": "bert"}}, tmp_path)
    assert "model.hf: expected a Hugging Face model folder whose config.json describes a supported model" in message
    assert "'bert' is not supported" in message
