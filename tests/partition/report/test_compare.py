"""The `partition --compare` table and document: mobiuspipe's plan against the baselines on one topology."""

import json

import pytest

from partition.report.compare import compare, compare_json, compare_text
from partition.search import make_plan
from partition.spec.analytic import analytic_profile
from partition.spec.hardware import device_spec
from partition.spec.lookup import get_model
from topology import preset

GiB = 1024**3


def _planned(model: str):
    """(profile, topology, plan) of model on 2+2, 4 microbatches, 1 GiB reserve, the DP's plan."""
    topo = preset("2+2")
    prof = analytic_profile(get_model(model), device_spec(topo.gpus[0].name))
    return prof, topo, make_plan(prof, topo, 4, reserve_bytes=GiB, solver="dp")


def test_compare_small_model():
    prof, topo, plan = _planned("gpt3-125m")
    results = compare(plan, topo, prof)
    assert [r.name for r in results] == [
        "mobiuspipe (cross mapping)",
        "mobiuspipe, sequential mapping",
        "DeepSpeed ZeRO-3 offload",
        "GPipe (all in gpu memory)",
    ]
    assert all(r.step_time_s and r.step_time_s > 0 for r in results)  # 125M parameters fit everywhere
    d = compare_json(plan, topo, prof, results)
    assert d["systems"][0]["speedup"] == 1.0
    fastest, zero = results[0].step_time_s, results[2].step_time_s
    assert fastest and zero
    assert d["systems"][2]["speedup"] == pytest.approx(zero / fastest)
    text = compare_text(plan, topo, prof, results)
    assert "(the reference)" in text and f"{d['systems'][2]['speedup']:.2f}x faster" in text
    gp = d["systems"][3]["speedup"]  # 125M parameters: GPipe keeps everything on the gpus and wins
    assert gp < 1 and f"{1 / gp:.2f}x slower" in text
    assert "host Adam" in text


def test_compare_175b_names_the_gpipe_oom():
    prof, topo, plan = _planned("gpt3-175b")
    d = compare_json(plan, topo, prof)
    gp = d["systems"][3]
    assert gp["step_time_s"] is None and gp["speedup"] is None and gp["reason"].startswith("out of memory")
    assert d["systems"][2]["speedup"] > 1  # ZeRO-3 offload is slower than the plan
    assert "out of memory" in compare_text(plan, topo, prof)
    json.dumps(d)  # plain data


def test_the_delayed_update_puts_mobiuspipes_host_adam_under_the_next_step():
    """175B on 2+2: with the delayed update mobiuspipe's rows take the longer of the pipeline and the updates (each
    rank's, the ranks at once), no longer the pipeline and then the last stage's update; the ZeRO-3 row (modelled
    without it) is unchanged."""
    prof, topo, plan = _planned("gpt3-175b")
    held, delayed = compare(plan, topo, prof), compare(plan, topo, prof, delayed=True)
    adam = compare_json(plan, topo, prof, held)["host_adam_s"]
    late, before = delayed[0].step_time_s, held[0].step_time_s
    assert late is not None and before is not None and adam <= late < before
    assert delayed[2].step_time_s == held[2].step_time_s
    assert delayed[2].step_time_s == held[2].step_time_s
    assert "under the next step (the delayed update)" in compare_text(plan, topo, prof, delayed, delayed=True)


def test_the_baselines_plan_with_the_memory_mobiuspipes_plan_had(monkeypatch):
    """The sequential mapping plans through make_plan, which holds the workspaces W and the layers' buffers V apart
    itself and each stage's transients X within its rule: it gets the plan's reserve alone (it got the reserve with X
    in it, and held X apart twice); the other baselines, whose rules do not, get the memory the plan's rules had
    less the largest X."""
    import dataclasses

    import partition.report.compare as compare_module
    from partition.errors import PlanInfeasibleError

    topo = preset("2+2")
    prof = analytic_profile(get_model("gpt3-125m"), device_spec(topo.gpus[0].name))
    layers = [dataclasses.replace(x, workspace_bytes=GiB // 4, buffer_bytes=GiB // 8) for x in prof.layers]
    prof = dataclasses.replace(prof, layers=tuple(layers), library_bytes=0)
    plan = make_plan(prof, topo, 4, reserve_bytes=GiB, solver="dp")
    assert plan.workspace_bytes == 0 and {s.transient_bytes for s in plan.stages} == {GiB // 4}
    assert plan.buffer_bytes > 0
    asked = {}

    def sequential(*_, reserve_bytes, **__):
        asked["sequential"] = reserve_bytes
        raise PlanInfeasibleError("recorded")

    def record(name):
        return lambda profile, topo, m, reserve: asked.setdefault(name, reserve) and None

    monkeypatch.setattr("partition.report.baselines.make_plan", sequential)
    monkeypatch.setattr(compare_module, "zero_offload", record("zero"))
    monkeypatch.setattr(compare_module, "gpipe", record("gpipe"))
    compare(plan, topo, prof)
    memory = min(g.memory_bytes for g in topo.gpus)
    net = memory - plan.gpu_memory_bytes + GiB // 4
    assert asked == {"sequential": GiB, "zero": net, "gpipe": net}
