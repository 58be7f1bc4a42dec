"""A run plans itself with the whole planner: without plan.num_stages and data.num_microbatches, and with
memory.optimizer and memory.weights auto, `mobiuspipe train` follows the plan `mobiuspipe partition --config` writes,
stage for stage and tier for tier; the plan records each stage's optimizer_tier and weights_tier, and a tight host
budget puts states on the SSD; memory settings other than auto force their tier over the plan's; the microbatch count
and size are the fastest of every count that divides the batch, checked against planning each one."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from foundation.units import MiB
from mobiuspipe.config import config_from_dict
from mobiuspipe.startup.config_plan import plan_from_config
from partition.errors import PlanFileError, PlanInfeasibleError
from partition.plan import Plan, load_plan, save_plan
from partition.rules.placement import BudgetShortfall, run_placement

RUN = {
    "model": {"num_blocks": 4, "d_model": 32, "num_heads": 2, "seq_len": 16},
    "data": {"batch_size": 4},  # the planner picks the microbatches
    "train": {"steps": 2, "precision": "fp32", "tensorboard": False},
    "plan": {"num_gpus": 2},
}


def _config(tmp_path: Path, **memory) -> dict:
    mem = {"optimizer": "auto", "weights": "auto", "ssd_dir": str(tmp_path / "ssd"), "host_budget_mb": 0.25, **memory}
    return {**RUN, "train": {**RUN["train"], "out_dir": str(tmp_path / "out")}, "memory": mem}


def _cut(plan: Plan) -> list[tuple]:
    """What a run must follow of a plan: each stage's layers, gpu, tiers and activation policy."""
    return [
        (s.first, s.last, s.gpu, s.optimizer_tier, s.weights_tier, s.activations, s.kept_layers, s.activation_tier)
        for s in plan.stages
    ]


def _too_big_are_on_ssd(plan: Plan, budget_mb: float) -> bool:
    """Whether every stage whose fp32 states (16 bytes a parameter) the budget cannot hold keeps them on the SSD, and
    there is such a stage."""
    big = [s for s in plan.stages if 16 * s.trains > budget_mb * MiB]
    return bool(big) and all(s.optimizer_tier == "ssd" for s in big)


def test_a_run_follows_the_plan_partition_writes_for_its_config(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(_config(tmp_path)))
    written = tmp_path / "p.yaml"
    cli = [sys.executable, "-m", "mobiuspipe"]
    subprocess.run([*cli, "partition", "--config", str(cfg), "-o", str(written)], check=True, timeout=120)
    run = subprocess.run([*cli, "train", "--config", str(cfg)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    planned, ran = load_plan(written), load_plan(tmp_path / "out" / "plan.yaml")
    assert _cut(ran) == _cut(planned)
    assert planned.num_stages != 4  # searched (4 was the fixed default): the tight budget's SSD traffic weighs in
    assert _too_big_are_on_ssd(planned, 0.25)
    assert "optimizer states (auto): host for stage 0; ssd for stage 1" in run.stdout


def test_the_plan_records_the_tiers_and_a_1_mib_budget_puts_states_on_the_ssd(tmp_path):
    big = {**_config(tmp_path, host_budget_mb=1), "model": {**RUN["model"], "d_model": 64}}
    plan = plan_from_config(config_from_dict(big))
    assert _too_big_are_on_ssd(plan, 1)
    roomy = plan_from_config(config_from_dict(_config(tmp_path, host_budget_mb=64)))
    assert {(s.optimizer_tier, s.weights_tier) for s in roomy.stages} == {("host", "host")}
    path = tmp_path / "plan.yaml"
    save_plan(plan, path)
    assert _cut(load_plan(path)) == _cut(plan)


def test_memory_settings_other_than_auto_force_their_tier(tmp_path):
    forced = plan_from_config(config_from_dict(_config(tmp_path, optimizer="ssd", weights="host", host_budget_mb=4)))
    assert {(s.optimizer_tier, s.weights_tier) for s in forced.stages} == {("ssd", "host")}
    host = {**RUN, "train": RUN["train"]}  # the defaults: every state in host memory, the budget not read
    assert {(s.optimizer_tier, s.weights_tier) for s in plan_from_config(config_from_dict(host)).stages} == {
        ("host", "host")
    }


def test_a_budget_that_holds_no_placement_names_the_key(tmp_path):
    with pytest.raises(PlanInfeasibleError, match="raise memory.host_budget_mb to at least"):
        plan_from_config(config_from_dict(_config(tmp_path, host_budget_mb=0.01)))


def test_run_placement_follows_the_recorded_tiers_unless_a_setting_forces_one():
    params, b, least = {0: 1000, 2: 5000}, 4, 64 << 10
    recorded = {0: ("host", "host"), 2: ("ssd", "ssd")}
    follow = run_placement("auto", "auto", recorded, params, 1 * MiB, least, b)
    assert (follow.optimizer, follow.weights) == ({0: "host", 2: "ssd"}, {0: "host", 2: "ssd"})
    assert follow.slot_bytes == 1 * MiB - 16 * 1000  # stage 0's states and gradients stay in memory
    weights = run_placement("auto", "host", recorded, params, 1 * MiB, least, b)
    assert weights.weights == {0: "host", 2: "host"}
    host = run_placement("host", "host", recorded, params, 1 * MiB, least, b)
    assert host.optimizer == {0: "host", 2: "host"} and host.slot_bytes == 0
    unplaced = {0: ("auto", "auto"), 2: ("auto", "auto")}  # a plan made without a placement: the rule places them
    rule = run_placement("auto", "auto", unplaced, params, 10 * MiB, least, b)
    assert rule.optimizer == {0: "host", 2: "host"}
    with pytest.raises(BudgetShortfall, match="memory.host_budget_mb"):
        run_placement("auto", "auto", {0: ("host", "host"), 2: ("host", "host")}, params, 1000, least, b)


def test_a_plan_file_with_an_impossible_tier_pair_is_refused(tmp_path):
    plan = plan_from_config(config_from_dict(_config(tmp_path)))
    doc = plan.to_dict()
    doc["stages"][0]["weights_tier"] = "ssd"
    doc["stages"][0]["optimizer_tier"] = "host"
    with pytest.raises(PlanFileError, match="weights_tier.*admits: host"):
        Plan.from_dict(doc)


def _every_count(cfg, divisors) -> dict[int, float]:
    """The predicted step of the plan of each microbatch count, made one by one (the search's reference)."""
    out = {}
    for m in divisors:
        one = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, num_microbatches=m))
        try:
            out[m] = plan_from_config(one).predicted_step_time_s
        except PlanInfeasibleError:
            pass
    return out


@pytest.mark.parametrize("memory_mb", [64.0, 0.5])
def test_the_microbatches_are_the_fastest_count_that_fits(tmp_path, memory_mb):
    run = {**RUN, "data": {"batch_size": 12}, "plan": {"num_gpus": 2, "device_memory_mb": memory_mb}}
    cfg = config_from_dict(run)
    plan = plan_from_config(cfg)
    every = _every_count(cfg, [1, 2, 3, 4, 6, 12])
    assert plan.num_microbatches * plan.microbatch_size == 12
    assert plan.predicted_step_time_s == min(every.values())
    assert plan.num_microbatches == min(every, key=lambda m: (every[m], m))
    if memory_mb < 1:  # the whole batch in one microbatch does not fit this device
        assert 1 not in every and plan.num_microbatches > 1


def test_a_fixed_microbatch_count_is_kept(tmp_path):
    cfg = config_from_dict({**RUN, "data": {"batch_size": 12, "num_microbatches": 3}})
    plan = plan_from_config(cfg)
    assert (plan.num_microbatches, plan.microbatch_size) == (3, 4)


def test_a_delayed_run_is_planned_with_its_updates_under_the_pipeline_and_its_second_versions_in_memory(tmp_path):
    """train.delayed_update: the plan's step is max(pipeline, updates), never longer than the same plan's without it;
    and the weights and gradients kept twice count in the host budget (a budget that holds a rank's states without
    the delay puts some of them on the SSD with it)."""
    base = {**RUN, "data": {"batch_size": 4, "num_microbatches": 2}, "plan": {"num_gpus": 2, "num_stages": 4}}
    delayed = {**base, "train": {**RUN["train"], "delayed_update": 1}}
    plain, late = plan_from_config(config_from_dict(base)), plan_from_config(config_from_dict(delayed))
    assert late.predicted_step_time_s <= plain.predicted_step_time_s
    mem = {"optimizer": "auto", "ssd_dir": str(tmp_path), "host_budget_mb": 0.7}  # 34,112 params: 16 B each fit
    fits = plan_from_config(config_from_dict({**base, "memory": mem}))
    assert {s.optimizer_tier for s in fits.stages} == {"host"}
    tight = plan_from_config(config_from_dict({**delayed, "memory": mem}))  # 28 B a parameter do not
    assert "ssd" in {s.optimizer_tier for s in tight.stages}


def test_a_forced_setting_is_written_into_the_runs_plan(tmp_path):
    """A plan file that puts every state in host memory, run with memory.optimizer ssd: the run's plan (what
    out_dir/plan.yaml keeps) records the tiers the run used."""
    import torch.nn.functional as F

    from mobiuspipe import Pipeline
    from mobiuspipe.config import MemoryConfig
    from mobiuspipe.models.gpt import layer_factories
    from mobiuspipe.startup.config_plan import model_spec

    cfg = config_from_dict({**RUN, "data": {"batch_size": 4, "num_microbatches": 2}, "plan": {"num_gpus": 1}})
    plan = plan_from_config(cfg)
    assert {s.optimizer_tier for s in plan.stages} == {"host"}
    forced = MemoryConfig(optimizer="ssd", ssd_dir=str(tmp_path), host_budget_mb=4)
    layers = layer_factories(model_spec(cfg), 0)
    with Pipeline(layers, F.cross_entropy, plan=plan, memory=forced) as pipe:
        assert {(s.optimizer_tier, s.weights_tier) for s in pipe.plan.stages} == {("ssd", "host")}
