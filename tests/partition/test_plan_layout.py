"""A plan records the machine it was made on (Plan.layout): round trips, old plan files, bad layouts in a plan."""

import dataclasses

import pytest
import yaml

from foundation.units import GiB
from partition.errors import PlanFileError
from partition.plan import Plan, load_plan, save_plan
from partition.search import make_plan
from partition.spec.analytic import analytic_profile
from partition.spec.hardware import device_spec
from partition.spec.lookup import get_model
from topology import cpu_standin, preset


@pytest.fixture(scope="module")
def plan() -> Plan:
    """gpt3-125m on the 3+1 preset."""
    topo = preset("3+1")
    return make_plan(analytic_profile(get_model("gpt3-125m"), device_spec(topo.gpus[0].name)), topo, 4, solver="dp")


def _write(tmp_path, d, name="plan.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


def test_a_plan_records_its_machine_and_reads_it_back(plan, tmp_path):
    assert plan.layout == preset("3+1") and plan.topology == "3+1"
    for suffix in (".yaml", ".json"):
        save_plan(plan, tmp_path / f"plan{suffix}")
        back = load_plan(tmp_path / f"plan{suffix}")
        assert back == plan and back.layout == preset("3+1")
        assert back.to_dict()["layout"] == preset("3+1").to_dict()  # a layout file's own keys


def test_cpu_standins_are_recorded_with_their_whole_memory():
    topo = cpu_standin(2, 2 * GiB)
    prof = analytic_profile(get_model("gpt3-125m"), device_spec("cpu-standin"), dtype="fp32")
    p = make_plan(prof, topo, 2, reserve_bytes=GiB // 2, solver="dp")
    assert p.layout == topo and p.gpu_memory_bytes < topo.gpus[0].memory_bytes


def test_an_old_plan_file_without_a_layout_loads(plan, tmp_path):
    d = plan.to_dict()
    del d["layout"]
    assert load_plan(_write(tmp_path, d)) == dataclasses.replace(plan, layout=None)
    d["layout"] = None
    assert load_plan(_write(tmp_path, d)).layout is None


def test_a_layout_in_a_plan_is_read_as_strictly_as_a_layout_file(plan, tmp_path):
    d = plan.to_dict()
    d["layout"]["gpus"][1]["memory_bytes"] = "lots"
    del d["layout"]["root_complexes"]
    d["layout"]["colour"] = "blue"
    with pytest.raises(PlanFileError) as e:
        load_plan(_write(tmp_path, d))
    msg = str(e.value)
    assert "plan.yaml: 3 errors:" in msg
    for key in ("layout.gpus[1].memory_bytes", "layout.root_complexes", "layout.colour"):
        assert f"{key}: expected" in msg, key
    assert "(a required key)" in msg and "add `root_complexes: [{...}]` under layout" in msg
    d = plan.to_dict()
    d["layout"]["gpus"][2]["root_complex"] = "rc9"  # the checks across a layout's parts run too
    with pytest.raises(PlanFileError, match=r"layout\.gpus\[2\]\.root_complex: expected one of the root_complexes"):
        load_plan(_write(tmp_path, d))


def test_a_layout_edited_apart_from_the_plan_is_an_error(plan, tmp_path):
    d = plan.to_dict()
    d["layout"]["name"] = "other"
    d["layout"]["gpus"] = d["layout"]["gpus"][:3]
    d["layout"]["p2p"] = []
    with pytest.raises(PlanFileError) as e:
        load_plan(_write(tmp_path, d))
    msg = str(e.value)
    assert "layout.name: expected '3+1', the plan's topology, found string 'other'" in msg
    assert "layout.gpus: expected 4 gpus (num_gpus), found 3 gpus" in msg and "remake the plan" in msg
