"""A run's plan: made at start-up from the config, or read from plan.file and checked against the model."""

from __future__ import annotations

import pytest

from mobiuspipe.config import config_from_dict
from mobiuspipe.config_plan import gpt_spec, plan_for_config
from mobiuspipe.errors import ConfigError
from mobiuspipe.models.gpt import build_layers
from partition.models import layer_param_counts
from partition.plan import save_plan


def _cfg(**plan):
    return config_from_dict(
        {
            "model": {"num_blocks": 3, "d_model": 12, "num_heads": 3, "seq_len": 9},
            "train": {"precision": "fp32"},
            "plan": {"num_gpus": 2, "num_stages": 3, **plan},
        }
    )


def test_analytic_parameter_counts_equal_the_real_layers():
    cfg = _cfg()
    spec = gpt_spec(cfg)
    layers = build_layers(spec, seed=0)
    real = [sum(p.numel() for p in layers[l].parameters()) for l in range(spec.num_layers)]
    assert real == layer_param_counts(spec)


def test_start_up_plan_has_the_configured_shape():
    plan = plan_for_config(_cfg(mapping="round-robin"))
    assert plan.num_stages == 3 and plan.num_gpus == 2 and plan.mapping == [0, 1, 0]
    assert plan.dtype == "fp32" and plan.slot_bytes == max(s.param_count for s in plan.stages) * 4


def test_too_small_device_memory_is_infeasible():
    from partition.errors import PlanInfeasibleError

    with pytest.raises(PlanInfeasibleError, match="GiB"):
        plan_for_config(_cfg(device_memory_mb=0.01))


def test_plan_file_for_another_model_is_refused(tmp_path):
    other = config_from_dict(
        {
            "model": {"num_blocks": 3, "d_model": 16, "num_heads": 2, "seq_len": 9},
            "train": {"precision": "fp32"},
            "plan": {"num_gpus": 2, "num_stages": 3},
        }
    )
    save_plan(plan_for_config(other), tmp_path / "plan.yaml")
    with pytest.raises(ConfigError, match=r"stage 0 \(layers 0\.\.\d+\) has \d+ parameters .* another model"):
        plan_for_config(_cfg(file=str(tmp_path / "plan.yaml")))


def test_plan_file_with_other_microbatches_is_refused(tmp_path):
    save_plan(plan_for_config(_cfg()), tmp_path / "plan.yaml")
    cfg = config_from_dict(
        {
            "model": {"num_blocks": 3, "d_model": 12, "num_heads": 3, "seq_len": 9},
            "data": {"batch_size": 6, "num_microbatches": 3},
            "train": {"precision": "fp32"},
            "plan": {"num_gpus": 2, "num_stages": 3, "file": str(tmp_path / "plan.yaml")},
        }
    )
    with pytest.raises(ConfigError, match="the plan is for 4 microbatches, data.num_microbatches is 3"):
        plan_for_config(cfg)


def test_plan_file_of_another_precision_is_refused(tmp_path):
    save_plan(plan_for_config(_cfg()), tmp_path / "plan.yaml")
    cfg = config_from_dict(
        {
            "model": {"num_blocks": 3, "d_model": 12, "num_heads": 3, "seq_len": 9},
            "train": {"precision": "bf16"},
            "plan": {"num_gpus": 2, "num_stages": 3, "file": str(tmp_path / "plan.yaml")},
        }
    )
    with pytest.raises(ConfigError, match="the plan is for fp32 weights but train.precision is bf16"):
        plan_for_config(cfg)


def test_a_bf16_plan_counts_two_bytes_per_parameter():
    plan = plan_for_config(config_from_dict({**_cfg().to_dict(), "train": {"precision": "bf16"}}))
    assert plan.dtype == "bf16" and plan.slot_bytes == max(s.param_count for s in plan.stages) * 2
    assert all(s.param_bytes == s.param_count * 2 for s in plan.stages)
