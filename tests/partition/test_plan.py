"""Plan files: exact YAML/JSON round trips, and a clear PlanFileError for every kind of malformed file."""

import dataclasses
import json

import numpy as np
import pytest
import yaml

from partition.errors import PlanFileError
from partition.plan import Plan, SolverInfo, StagePlan, load_plan, save_plan


def _plan(rng: np.random.Generator | None = None, mapping=(0, 1, 0, 1, 0), num_gpus=2) -> Plan:
    rng = rng or np.random.default_rng(0)
    stages, first = [], 0
    for g in mapping:
        n = int(rng.integers(1, 4))
        stages.append(
            StagePlan(
                first=first,
                last=first + n - 1,
                gpu=g,
                param_count=int(rng.integers(1, 10**9)),
                param_bytes=int(rng.integers(1, 10**10)),
                activation_bytes=int(rng.integers(0, 10**9)),
                output_bytes=int(rng.integers(1, 10**8)),
                fwd_s=float(rng.uniform(1e-6, 1.0)),
                bwd_s=float(rng.uniform(1e-6, 2.0)),
                load_gbps=float(rng.uniform(1.0, 32.0)),
            )
        )
        first += n
    slot = max(s.param_bytes for s in stages)
    return Plan(
        model="gpt3-175b",
        topology="2+2",
        num_layers=first,
        num_gpus=num_gpus,
        num_microbatches=7,
        microbatch_size=3,
        dtype="fp16",
        mapping_rule="cross",
        mapping_score=0.5,
        stages=tuple(stages),
        slot_bytes=slot,
        arena_bytes=3 * slot,
        activation_bytes=max(s.activation_bytes for s in stages),
        gpu_memory_bytes=24 * 2**30,
        predicted_step_time_s=float(rng.uniform(0.1, 500.0)),
        solver=SolverInfo("dp", "optimal", 0.0, float(rng.uniform(0, 2))),
    )


@pytest.mark.parametrize("suffix", [".yaml", ".json", ".yml"])
@pytest.mark.parametrize("seed", [0, 3, 77])
def test_round_trip_exact(tmp_path, suffix, seed):
    plan = _plan(np.random.default_rng(seed))
    path = tmp_path / f"plan{suffix}"
    save_plan(plan, path)
    back = load_plan(path)
    assert back == plan
    assert back.to_dict() == plan.to_dict()
    assert isinstance(back.stages, tuple) and isinstance(back.solver, SolverInfo)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_round_trip_awkward_floats(tmp_path, suffix):
    """Floats whose shortest repr has no '.', tiny and huge values, and integral floats survive exactly."""
    plan = _plan()
    odd = [1e-05, 2e-07, 1e16, 5e-324, 3.0, 0.1 + 0.2, 1 / 3]
    stages = tuple(
        dataclasses.replace(s, fwd_s=odd[j], bwd_s=odd[-1 - j], load_gbps=odd[(j + 2) % len(odd)])
        for j, s in enumerate(plan.stages)
    )
    plan = dataclasses.replace(
        plan, stages=stages, predicted_step_time_s=1e-05, solver=SolverInfo("dp", "optimal", 1e-09, 2e-06)
    )
    path = tmp_path / f"plan{suffix}"
    save_plan(plan, path)
    back = load_plan(path)
    assert back == plan
    for a, b in zip(back.stages, plan.stages):
        assert type(a.fwd_s) is float and a.fwd_s == b.fwd_s


def test_json_file_is_json_and_has_num_stages(tmp_path):
    plan = _plan()
    save_plan(plan, tmp_path / "p.json")
    d = json.loads((tmp_path / "p.json").read_text())
    assert d["num_stages"] == 5 and d["stages"][0]["first"] == 0
    save_plan(plan, tmp_path / "p.yaml")
    assert yaml.safe_load((tmp_path / "p.yaml").read_text())["num_stages"] == 5
    assert plan.mapping == [0, 1, 0, 1, 0] and plan.stages_of(1) == [1, 3]


def _write(tmp_path, d, name="bad.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


def _load_err(path) -> str:
    with pytest.raises(PlanFileError) as e:
        load_plan(path)
    return str(e.value)


def test_unknown_key(tmp_path):
    d = _plan().to_dict()
    d["colour"] = "blue"
    msg = _load_err(_write(tmp_path, d))
    assert "bad.yaml: colour: expected one of the keys" in msg and "found unknown key 'colour'" in msg


def test_unknown_key_in_a_stage(tmp_path):
    d = _plan().to_dict()
    d["stages"][2]["gpus"] = 1
    msg = _load_err(_write(tmp_path, d))
    assert "stages[2]" in msg and "'gpus'" in msg


def test_missing_key(tmp_path):
    d = _plan().to_dict()
    del d["slot_bytes"]
    msg = _load_err(_write(tmp_path, d))
    assert "bad.yaml: slot_bytes: expected an integer (a required key), found nothing" in msg
    d = _plan().to_dict()
    del d["stages"][0]["fwd_s"]
    assert "stages[0]" in _load_err(_write(tmp_path, d)) and "fwd_s" in _load_err(_write(tmp_path, d))
    d = _plan().to_dict()
    del d["solver"]
    assert "solver" in _load_err(_write(tmp_path, d))


def test_missing_stages(tmp_path):
    d = _plan().to_dict()
    del d["stages"]
    msg = _load_err(_write(tmp_path, d))
    assert "bad.yaml: stages: expected a list of mappings (a required key)" in msg


@pytest.mark.parametrize(
    "where,key,value",
    [
        ("top", "num_gpus", "two"),
        ("top", "num_gpus", True),
        ("top", "num_layers", 3.5),
        ("top", "predicted_step_time_s", "fast"),
        ("top", "model", 175),
        ("stage", "gpu", 1.0),
        ("stage", "fwd_s", None),
        ("stage", "first", [0]),
        ("solver", "gap", "0"),
    ],
)
def test_wrong_type(tmp_path, where, key, value):
    d = _plan().to_dict()
    target = d if where == "top" else d["stages"][1] if where == "stage" else d["solver"]
    target[key] = value
    msg = _load_err(_write(tmp_path, d))
    prefix = "" if where == "top" else "stages[1]." if where == "stage" else "solver."
    assert f"bad.yaml: {prefix}{key}: expected" in msg


def test_stages_not_a_list(tmp_path):
    d = _plan().to_dict()
    d["stages"] = 5
    assert "bad.yaml: stages: expected a list of mappings, found integer 5" in _load_err(_write(tmp_path, d))
    d["stages"] = ["x"]
    assert "stages[0]" in _load_err(_write(tmp_path, d))


@pytest.mark.parametrize("kind", ["gap", "empty", "overlap"])
def test_non_contiguous_stages(tmp_path, kind):
    d = _plan().to_dict()
    s, prev_last = d["stages"][2], d["stages"][1]["last"]
    if kind == "gap":
        s["first"] = prev_last + 2
    elif kind == "empty":
        s["last"] = s["first"] - 1
    else:
        s["first"] = prev_last
    msg = _load_err(_write(tmp_path, d))
    assert "bad.yaml" in msg and "stage 2 covers layers" in msg and f"start at layer {prev_last + 1}" in msg
    assert "contiguous" in msg


def test_stages_do_not_cover_all_layers(tmp_path):
    d = _plan().to_dict()
    d["num_layers"] += 2
    msg = _load_err(_write(tmp_path, d))
    assert "bad.yaml" in msg and f"expected 0..{d['num_layers'] - 1}" in msg


@pytest.mark.parametrize("gpu", [2, -1, 9])
def test_gpu_out_of_range(tmp_path, gpu):
    d = _plan().to_dict()
    d["stages"][3]["gpu"] = gpu
    msg = _load_err(_write(tmp_path, d))
    assert "bad.yaml" in msg and f"stage 3 is on gpu {gpu}" in msg and "0..1" in msg


def test_gpu_with_no_stage(tmp_path):
    d = _plan().to_dict()
    d["num_gpus"] = 3
    msg = _load_err(_write(tmp_path, d))
    assert "bad.yaml" in msg and "gpus [2] have no stage" in msg


def test_stage_bigger_than_slot(tmp_path):
    d = _plan().to_dict()
    d["slot_bytes"] = d["stages"][0]["param_bytes"] - 1
    assert "more than the slot" in _load_err(_write(tmp_path, d))


def test_constructing_an_invalid_plan_raises():
    plan = _plan()
    with pytest.raises(PlanFileError, match="at least one stage"):
        dataclasses.replace(plan, stages=())
    with pytest.raises(PlanFileError, match="gpus \\[1\\] have no stage"):
        dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, gpu=0) for s in plan.stages))


@pytest.mark.parametrize(
    "text,expect",
    [
        ("model: [unclosed\n", "expected valid YAML"),
        ("a: b: c\n", "expected valid YAML"),
        ('{ "json": \n', "expected valid YAML"),
        ("just a string\n", "(top level): expected a mapping"),
        ("just a string\n", "found string 'just a string'"),
        ("", "(top level): expected a mapping"),
        ("", "found null"),
        ("- 1\n- 2\n", "(top level): expected a mapping"),
        ("- 1\n- 2\n", "found list [1, 2]"),
    ],
)
def test_not_yaml_or_not_a_mapping(tmp_path, text, expect):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    msg = _load_err(path)
    assert "broken.yaml" in msg and expect in msg


def test_not_json(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"model": "x",}')
    msg = _load_err(path)
    assert "broken.json" in msg


def test_binary_file(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_bytes(b"\xff\xfe\x00\x81garbage")
    msg = _load_err(path)
    assert "plan.yaml" in msg


def test_missing_file(tmp_path):
    msg = _load_err(tmp_path / "nope.yaml")
    assert msg.startswith(f"plan {tmp_path / 'nope.yaml'}: file not found")
    assert "mobiuspipe partition" in msg


def test_directory_instead_of_file(tmp_path):
    assert f"plan {tmp_path}: cannot be read (Is a directory)" in _load_err(tmp_path)


def test_every_problem_of_a_plan_at_once(tmp_path):
    d = _plan().to_dict()
    d["colour"] = "blue"
    d["stages"][0]["gpus"] = 1
    d["stages"][1]["fwd_s"] = "fast"
    d["solver"]["gap"] = None
    del d["slot_bytes"]
    msg = _load_err(_write(tmp_path, d))
    assert "bad.yaml: 5 errors: (1) " in msg and "\n" not in msg
    for key in ("colour", "stages[0].gpus", "stages[1].fwd_s", "solver.gap", "slot_bytes"):
        assert f" {key}: expected" in msg, key


def test_every_inconsistency_of_a_plan_at_once(tmp_path):
    d = _plan().to_dict()
    d["stages"][1]["gpu"] = 7
    d["stages"][3]["first"] += 1
    d["num_gpus"] = 6
    d["num_stages"] = 4  # written for readers, and checked
    msg = _load_err(_write(tmp_path, d))
    assert "bad.yaml: 4 errors: (1) stages[1].gpu: expected a gpu in 0..5, found stage 1 is on gpu 7" in msg
    assert "(2) stages[3]: expected stage 3 to start at layer" in msg
    assert "(3) num_gpus: expected every gpu to run at least one stage, found gpus [2, 3, 4, 5] have no stage" in msg
    assert "(4) num_stages: expected 5, the number of stages listed" in msg and "found integer 4" in msg


@pytest.mark.parametrize(
    "suffix, text, needle",
    [
        (
            ".yaml",
            "model: a\nmodel: b\n",
            "model: expected each key once per mapping, found it at line 1 and again at line 2",
        ),
        (".json", '{"solver": {"gap": 0, "gap": 1}}', "solver.gap: expected each key once per object, found it twice"),
    ],
)
def test_duplicate_keys_in_a_plan(tmp_path, suffix, text, needle):
    path = tmp_path / f"dup{suffix}"
    path.write_text(text)
    assert needle in _load_err(path)


def test_exponent_without_a_dot_is_a_float(tmp_path):
    d = _plan().to_dict()
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False).replace(f"gap: {d['solver']['gap']}", "gap: 1e-3"))
    assert load_plan(path).solver.gap == 0.001


def test_impossible_values_of_a_plan_at_once(tmp_path):
    """Found by fuzzing: values a plan file held that the simulator or the runtime could not use."""
    d = _plan().to_dict()
    d.update(num_microbatches=0, microbatch_size=-1, mapping_score=float("nan"), predicted_step_time_s=-1.0)
    d.update(arena_bytes=-1, dtype="fp8", mapping_rule="", model="")
    msg = _load_err(_write(tmp_path, d))
    for key in ("num_microbatches", "microbatch_size", "mapping_score", "predicted_step_time_s", "arena_bytes"):
        assert f") {key}: expected" in msg, key
    assert "dtype: expected one of fp16, bf16, fp32, found string 'fp8'" in msg
    assert "mapping_rule: expected one of cross, round-robin, search" in msg and "model: expected a non-empty" in msg
    d = _plan().to_dict()
    d["solver"]["gap"] = float("nan")
    msg = _load_err(_write(tmp_path, d))
    assert "solver.gap: expected a relative gap >= 0 (inf when no bound was proved), found number nan" in msg
    d = _plan().to_dict()
    d["solver"]["gap"] = float("inf")  # no bound proved: a plan all the same
    assert load_plan(_write(tmp_path, d, "inf.yaml")).solver.gap == float("inf")


def test_an_arena_whose_gradient_slot_cannot_hold_a_stages_gradients_is_refused(tmp_path):
    """arena_bytes is two weight slots and a gradient slot (W without LoRA): one byte short of the largest stage's
    gradients is refused, naming the stage."""
    plan = _plan()
    d = plan.to_dict()
    assert plan.grad_slot_bytes == plan.slot_bytes
    d["arena_bytes"] = 2 * plan.slot_bytes + max(s.gradient_bytes for s in plan.stages) - 1
    msg = _load_err(_write(tmp_path, d))
    assert "arena_bytes: expected two weight slots and a gradient slot that holds each stage's gradients" in msg
