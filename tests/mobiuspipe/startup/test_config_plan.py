"""A run's plan: made at start-up from the config, or read from plan.file and checked against the model."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mobiuspipe.config import config_from_dict, load_config
from mobiuspipe.errors import ConfigError
from mobiuspipe.models.gpt import build_layers
from mobiuspipe.startup.config_plan import model_spec, num_ranks, plan_for_config, run_topology
from partition.plan import save_plan
from partition.spec.models import layer_param_counts
from topology import TopologyError, preset, save_topology


def _cfg(**plan):
    return config_from_dict(
        {
            "model": {"num_blocks": 3, "d_model": 12, "num_heads": 3, "seq_len": 9},
            "data": {"num_microbatches": 4},
            "train": {"precision": "fp32"},
            "plan": {"num_gpus": 2, "num_stages": 3, **plan},
        }
    )


def test_analytic_parameter_counts_equal_the_real_layers():
    cfg = _cfg()
    spec = model_spec(cfg)
    layers = build_layers(spec, seed=0)
    real = [sum(p.numel() for p in layers[l].parameters()) for l in range(spec.num_layers)]
    assert real == layer_param_counts(spec)


def test_start_up_plan_has_the_configured_shape():
    plan = plan_for_config(_cfg(mapping="round-robin"))
    assert plan.num_stages == 3 and plan.num_gpus == 2 and plan.mapping == [0, 1, 0]
    assert plan.dtype == "fp32" and plan.slot_bytes == max(s.param_count for s in plan.stages) * 4


def test_too_small_device_memory_is_infeasible():
    from partition.errors import PlanInfeasibleError

    with pytest.raises(PlanInfeasibleError, match="alone needs .* usable"):
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
    with pytest.raises(
        ConfigError,
        match=r"data\.num_microbatches: expected 4 \(as in plan\.file .*\), found 3; fix: "
        r".*set data\.num_microbatches: 4 and data\.batch_size: 8$",
    ):
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
    with pytest.raises(
        ConfigError,
        match=r"train\.precision: expected fp32 \(as in plan\.file .*\), found bf16; "
        r"fix: .*set train\.precision: fp32$",
    ):
        plan_for_config(cfg)


def test_a_bf16_plan_counts_two_bytes_per_parameter():
    plan = plan_for_config(config_from_dict({**_cfg().to_dict(), "train": {"precision": "bf16"}}))
    assert plan.dtype == "bf16" and plan.slot_bytes == max(s.param_count for s in plan.stages) * 2
    assert all(s.param_bytes == s.param_count * 2 for s in plan.stages)


def _on(topology, **plan):
    return config_from_dict(
        {
            "model": {"num_blocks": 6, "d_model": 12, "num_heads": 3, "seq_len": 9},
            "train": {"precision": "fp32"},
            "plan": {"topology": topology, "num_stages": 8, **plan},
        }
    )


def test_a_preset_topology_gives_its_gpus_and_a_real_cross_mapping():
    cross = plan_for_config(_on("2+2"))
    assert cross.num_gpus == 4 and cross.topology == "2+2"
    assert cross.mapping == [0, 2, 1, 3] * 2  # neighbours under different root complexes
    rr = plan_for_config(_on("2+2", mapping="round-robin"))
    assert rr.mapping == [0, 1, 2, 3] * 2 and rr.mapping_score > cross.mapping_score
    assert num_ranks(_on("3+1")) == 4 and run_topology(_on("3+1")).name == "3+1"


def test_a_layout_file_beside_the_config(tmp_path):
    save_topology(preset("2+2"), tmp_path / "server.yaml")
    path = tmp_path / "run.yaml"
    path.write_text("train: {precision: fp32}\nplan: {topology: server.yaml, num_stages: 4}\n")
    assert plan_for_config(load_config(path)).mapping == [0, 2, 1, 3]


def test_topology_mistakes_are_named():
    with pytest.raises(ConfigError, match="plan.num_gpus is 2 but plan.topology '2\\+2' has 4 gpus"):
        run_topology(_on("2+2", num_gpus=2))
    with pytest.raises(ConfigError, match="plan.num_stages is 3 but plan.topology '2\\+2' has 4 gpus"):
        run_topology(_on("2+2", num_stages=3))
    with pytest.raises(TopologyError):
        run_topology(_on("5+5"))


def test_the_run_offers_the_activation_tiers_it_can_run(monkeypatch, tmp_path):
    """The host always; the SSD with memory.ssd_dir; the peer with several ranks on this host."""
    from mobiuspipe.config import config_from_dict
    from mobiuspipe.startup.config_plan import activation_tiers

    def cfg(gpus: int, ssd: bool):
        memory = {"ssd_dir": str(tmp_path)} if ssd else {}
        return config_from_dict({"plan": {"num_gpus": gpus}, "memory": memory})

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert activation_tiers(cfg(1, False)) == ("host",)
    assert activation_tiers(cfg(2, True)) == ("host", "ssd", "peer")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # two hosts of one rank each
    assert activation_tiers(cfg(2, False)) == ("host",)


def test_a_launcher_of_several_nodes_plans_without_the_peer_tier(monkeypatch, tmp_path):
    """`mobiuspipe train --nnodes 2` plans before torchrun sets LOCAL_WORLD_SIZE: it must not offer the peer tier,
    which needs every rank on one host (its ranks would stop at start-up on a plan that parks activations there)."""
    from mobiuspipe.config import config_from_dict
    from mobiuspipe.run import preflight
    from mobiuspipe.startup.config_plan import activation_tiers

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = config_from_dict({"plan": {"num_gpus": 4}, "memory": {"ssd_dir": str(tmp_path)}})
    assert activation_tiers(cfg, hosts=2) == ("host", "ssd")
    asked, made = [], SimpleNamespace(num_gpus=4)
    monkeypatch.setattr(preflight, "plan_from_config", lambda c, **kw: asked.append(kw) or made)
    monkeypatch.setattr(preflight, "_check_memory", lambda *a: None)
    monkeypatch.setattr(preflight, "_check_out_dir", lambda *a: None)
    assert preflight.launch_checks(cfg, None, nnodes=2) == (4, made)
    assert asked == [{"hosts": 2}]


@pytest.mark.parametrize(
    "train, undo, versions",
    [
        ({}, False, 1),
        ({"max_grad_norm": 1.0}, True, 1),
        ({"precision": "fp16"}, True, 1),
        ({"max_grad_norm": 1.0, "speculative_update": False}, False, 1),
        ({"max_grad_norm": 1.0, "delayed_update": 1}, False, 2),
        ({"max_grad_norm": 1.0, "delayed_update": 4}, True, 2),
    ],
)
def test_the_runs_budget_counts_the_copies_its_updates_keep(train, undo, versions):
    """The speculative update's copy is counted where some step speculates (clipping or fp16, not delayed from step 1
    on), the delayed update's second version where it delays (mobiuspipe.startup.update_policy)."""
    from mobiuspipe.startup.config_plan import run_budget, run_copies

    cfg = config_from_dict({"model": {"num_blocks": 2, "d_model": 16, "num_heads": 2, "seq_len": 8}, "train": train})
    copies = run_copies(cfg)
    assert (copies.undo, copies.versions) == (undo, versions)
    budget = run_budget(cfg)
    assert (budget.speculative, budget.delayed) == (undo, versions == 2)


EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-gpt.yaml"
MEASURED_MS = {(3, 2): 34.0, (4, 2): 33.2, (4, 4): 48.0, (6, 4): 60.0, (8, 4): 72.0, (4, 8): 85.3, (8, 8): 132.5}
"""Median steps of the tiny GPT on 2 CPU stand-ins at (stages, microbatches), measured by
scripts/bench_standin_plans.py on 2026-11-27 (BENCHMARKS.md)."""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the run plans for this host's gpus, not CPU stand-ins")
def test_the_stand_in_planner_ranks_plans_as_they_measured_and_auto_picks_a_fastest():
    """With the stand-in's per-call and per-message costs, every pair of plans measured 1.3x or more apart is
    predicted in the same order, and auto's plan is predicted no slower than any of them (on 2026-11-26 auto picked
    8 x 8, measured 4x the best)."""
    import dataclasses

    from mobiuspipe.startup.config_plan import plan_from_config

    cfg = load_config(EXAMPLE)

    def predicted(stages, microbatches) -> float:
        plan = dataclasses.replace(cfg.plan, num_stages=stages)
        data = dataclasses.replace(cfg.data, num_microbatches=microbatches)
        return plan_from_config(dataclasses.replace(cfg, plan=plan, data=data)).predicted_step_time_s

    ms = {k: predicted(*k) for k in MEASURED_MS}
    for a, b in ((a, b) for a in MEASURED_MS for b in MEASURED_MS if MEASURED_MS[b] >= 1.3 * MEASURED_MS[a]):
        assert ms[a] < ms[b], (a, b, ms)
    auto = plan_from_config(cfg)
    assert auto.predicted_step_time_s <= min(ms.values()) * 1.05
    assert (len(auto.stages), auto.num_microbatches) in {(3, 2), (4, 2)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the run plans for this host's gpus, not CPU stand-ins")
def test_the_python_api_and_a_config_run_plan_stand_ins_with_the_same_message_costs():
    """Pipeline(plan=None) and a run from a config (the torchrun entry) both plan unprobed stand-ins with
    STANDIN_MESSAGES, so the same model gets the same choice either way."""
    from mobiuspipe.runtime.peers.ranks import RankInfo
    from mobiuspipe.startup import plan as api_plan
    from mobiuspipe.startup.config_plan import run_topology
    from topology.presets import STANDIN_MESSAGES

    info = RankInfo(rank=0, world_size=2, local_rank=0, under_torchrun=False)
    from_api = api_plan._topology(None, info, torch.device("cpu"))
    assert from_api.measured == run_topology(_cfg()).measured == STANDIN_MESSAGES


def test_a_deterministic_run_holds_apart_the_workspaces_it_sets_beyond_what_its_profile_measured():
    """runtime.deterministic gives cuBLAS 32 MiB workspaces; a profile measured without it (8.125 MiB each before
    Hopper) held W for those: the plan holds LIBRARY_BYTES apart instead. More measured stays; the stand-in's 0 too."""
    import dataclasses

    from mobiuspipe.startup.config_plan import gpt_profile, with_run_library_bytes
    from partition.spec.hardware import LIBRARY_BYTES

    cfg = _cfg()
    deterministic = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, deterministic=True))
    base = gpt_profile(cfg)
    measured = dataclasses.replace(base, library_bytes=17 * 2**20)
    assert with_run_library_bytes(deterministic, measured).library_bytes == LIBRARY_BYTES
    assert with_run_library_bytes(cfg, measured) is measured
    more = dataclasses.replace(base, library_bytes=LIBRARY_BYTES + 1)
    assert with_run_library_bytes(deterministic, more) is more
    standin = dataclasses.replace(base, library_bytes=0)
    assert with_run_library_bytes(deterministic, standin) is standin


def test_a_config_planned_for_a_gpu_server_from_a_host_without_one_counts_the_gpus_transients():
    """`mobiuspipe partition --config RUN.yaml --topology 2+2` on a laptop makes the plan a server runs: its profile
    is the server's gpus', with their transients and cuBLAS workspaces (it was the stand-in's, with none)."""
    from mobiuspipe.startup.config_plan import gpt_profile
    from partition.spec.hardware import LIBRARY_BYTES

    server = gpt_profile(_cfg(topology="2+2", num_gpus=None, num_stages=None))
    here = gpt_profile(_cfg(num_gpus=1, num_stages=None))
    assert server.device == preset("2+2").gpus[0].name and server.library_bytes == LIBRARY_BYTES
    assert all(x.workspace_bytes > 0 for x in server.layers)
    if not torch.cuda.is_available():
        assert here.device == "cpu-standin" and here.library_bytes == 0
        assert all(x.workspace_bytes == 0 for x in here.layers)


def test_a_deterministic_run_from_a_plan_file_holds_the_workspaces_it_sets(tmp_path):
    """A plan file made from a profile measured without runtime.deterministic holds its measured W apart: the run
    holds LIBRARY_BYTES instead, the difference out of the usable memory (the gpu's share stays); a plan made
    before stages recorded their X (its workspace_bytes held the largest X too) is read as written."""
    import dataclasses

    from mobiuspipe.run import preflight
    from mobiuspipe.startup.config_plan import gpt_profile, plan_from_config
    from partition.rules.device_peak import gpu_headroom
    from partition.spec.hardware import LIBRARY_BYTES

    base = gpt_profile(_cfg())
    layers = tuple(dataclasses.replace(x, workspace_bytes=1000 + i) for i, x in enumerate(base.layers))
    measured = dataclasses.replace(base, layers=layers, library_bytes=17 * 2**20)
    made = plan_from_config(_cfg(device_memory_mb=128), solver="dp", profile=measured)
    save_plan(made, tmp_path / "plan.yaml")
    cfg = _cfg(file=str(tmp_path / "plan.yaml"), device_memory_mb=128)
    deterministic = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, deterministic=True))
    assert plan_for_config(cfg) == made
    raised = plan_for_config(deterministic)
    assert raised.workspace_bytes == LIBRARY_BYTES and raised.gpu_share_bytes == made.gpu_share_bytes
    assert raised.gpu_memory_bytes == made.gpu_memory_bytes - (LIBRARY_BYTES - 17 * 2**20)
    assert preflight._plan_file(deterministic, None) == raised  # the run's own path: mobiuspipe train, its ranks
    older = dataclasses.replace(made, stages=tuple(dataclasses.replace(s, transient_bytes=0) for s in made.stages))
    save_plan(older, tmp_path / "plan.yaml")
    assert plan_for_config(deterministic) == older
    left = min(gpu_headroom(made))
    for short in (0, 1):  # the plan left `left` bytes: the 48 MiB more fit it, or not by `short` bytes
        tight = dataclasses.replace(made, gpu_memory_bytes=made.gpu_memory_bytes - left + LIBRARY_BYTES - 17 * 2**20)
        tight = dataclasses.replace(tight, gpu_memory_bytes=tight.gpu_memory_bytes - short)
        save_plan(tight, tmp_path / "plan.yaml")
        if not short:
            assert min(gpu_headroom(plan_for_config(deterministic))) == 0
            continue
        with pytest.raises(ConfigError, match=r"runtime.deterministic .* needs 1 B more .* re-plan for them"):
            plan_for_config(deterministic)
