"""Fuzzing the run-config, plan and layout loaders: any document gives that loader's own error or a valid object.

Property-based (hypothesis): random YAML-able trees, random text, and random mutations of valid documents
(a key dropped, a value of another type, an out-of-range number, an unknown key, a value nested one level
too deep or too shallow, a list item repeated or swapped). Each loader must return a valid object (which
saves and loads back equal) or raise its own UserError subclass (ConfigError, PlanFileError, TopologyError),
never another exception. Deterministic (derandomize) and bounded, for CI.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from foundation.hints import field_hints, unwrap_optional
from foundation.units import GiB
from mobiuspipe.config import RunConfig, config_from_dict, load_config
from mobiuspipe.errors import ConfigError
from partition.errors import PlanFileError
from partition.plan import Plan, load_plan
from partition.search import make_plan
from partition.spec.analytic import analytic_profile
from partition.spec.hardware import device_spec
from partition.spec.lookup import get_model
from topology import Topology, TopologyError, cpu_standin, load_topology, preset
from topology.layout import topology_from_dict
from topology.types import Measured, Nvme

FUZZ = settings(
    derandomize=True,  # the same examples on every run: CI is deterministic
    database=None,
    deadline=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.too_slow],
)
ROOT = Path(__file__).resolve().parents[1]


def _keys(cls: type, seen: set[type] | None = None) -> set[str]:
    """Every key a document of dataclass `cls` may hold, at any depth: random trees then hit real keys."""
    seen = seen if seen is not None else set()
    if cls in seen:
        return set()
    seen.add(cls)
    keys = set()
    for f in dataclasses.fields(cls):
        keys.add(f.name)
        hint, _ = unwrap_optional(field_hints(cls)[f.name])
        for inner in (hint, *getattr(hint, "__args__", ())):
            if isinstance(inner, type) and dataclasses.is_dataclass(inner):
                keys |= _keys(inner, seen)
    return keys


KEYS = sorted(_keys(RunConfig) | _keys(Plan) | _keys(Topology) | {"num_stages", "runs", "layers"})
ODD_NUMBERS = [0, -1, 1, 2, -0.5, 0.1, 2**31, 2**64, 10**30, -(10**30), 1e308, -1e-300, math.inf, -math.inf, math.nan]
ODD_TEXT = ["", " ", "~", ".", "..", "/", "2+2", "24GiB", "1e3", "-1", "nan", "auto", "ssd", "host", "fp16", "x.yaml"]
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=10),
    st.sampled_from(ODD_NUMBERS),
    st.sampled_from(ODD_TEXT + KEYS),
)
DICT_KEYS = st.one_of(st.sampled_from(KEYS), st.text(max_size=8), st.integers(-2, 2), st.booleans(), st.none())
TREES = st.recursive(
    SCALARS,
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(DICT_KEYS, kids, max_size=5)),
    max_leaves=24,
)
DOCS = st.one_of(TREES, st.dictionaries(st.sampled_from(KEYS), TREES, max_size=8))


def _places(tree: Any, at: tuple = ()) -> list[tuple]:
    """The path (keys and indices) of every node of a tree, the root first."""
    out = [at]
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += _places(v, (*at, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out += _places(v, (*at, i))
    return out


def _retyped(draw, value: Any) -> Any:
    """`value` as another type: text, a list, a mapping, a number, a bool or null."""
    return draw(
        st.sampled_from(
            [str(value), [value], {"value": value}, None, True, 1, 1.5, "text", [], {}]
            + ([int(value)] if isinstance(value, float) and math.isfinite(value) else [])
            + ([float(value)] if type(value) is int else [])
        )
    )


def _mutate(draw, doc: Any) -> Any:
    """One random change somewhere in `doc` (which it may replace whole)."""
    at = draw(st.sampled_from(_places(doc)))
    parent, key = (None, None) if not at else (_get(doc, at[:-1]), at[-1])
    value = doc if parent is None else parent[key]
    kind = draw(st.sampled_from(["drop", "replace", "retype", "number", "unknown", "nest", "unnest", "list"]))
    if kind == "drop" and parent is not None:
        del parent[key]
        return doc
    if kind == "unknown" and isinstance(value, dict):
        value[draw(DICT_KEYS)] = draw(TREES)
        return doc
    if kind == "list" and isinstance(value, list) and value:
        i, j = draw(st.integers(0, len(value) - 1)), draw(st.integers(0, len(value) - 1))
        value[i], value[j] = value[j], value[i]
        value.append(copy.deepcopy(value[i])) if draw(st.booleans()) else None
        return doc
    if kind == "unnest" and isinstance(value, (dict, list)) and value:
        new = draw(st.sampled_from(list(value.values()) if isinstance(value, dict) else value))
    elif kind == "nest":
        new = draw(st.sampled_from([[value], {draw(st.sampled_from(KEYS)): value}]))
    elif kind == "number":
        new = draw(st.sampled_from(ODD_NUMBERS))
    elif kind == "retype":
        new = _retyped(draw, value)
    else:
        new = draw(TREES)
    if parent is None:
        return new
    parent[key] = new
    return doc


def _get(doc: Any, at: tuple) -> Any:
    for k in at:
        doc = doc[k]
    return doc


@st.composite
def mutations(draw, bases: list[Any]) -> Any:
    """A valid document of `bases` with one to four random changes."""
    doc = copy.deepcopy(draw(st.sampled_from(bases)))
    for _ in range(draw(st.integers(1, 4))):
        doc = _mutate(draw, doc)
    return doc


# ---- the valid documents the mutations start from ----


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A folder with the files the valid configs name (relative paths start here, not at the cwd)."""
    d = tmp_path_factory.mktemp("fuzz")
    (d / "text.txt").write_text("some text to train on " * 40)
    (d / "held.txt").write_text("held-out text " * 40)
    (d / "plan.yaml").write_text("stages: []\n")
    (d / "box.yaml").write_text(yaml.safe_dump(preset("2+2").to_dict()))
    return d


def _config_bases() -> list[Any]:
    example = yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text())
    full = {
        "model": {"vocab_size": 256, "num_blocks": 2, "d_model": 32, "num_heads": 2, "seq_len": 16},
        "data": {"path": "text.txt", "eval_path": "held.txt", "batch_size": 4, "num_microbatches": 2},
        "train": {"steps": 3, "lr": 0.01, "lr_schedule": "cosine", "warmup_steps": 1, "max_grad_norm": 1.0,
                  "eval_every": 1, "eval_at_start": True, "out_dir": "runs/x", "betas": [0.9, 0.99]},
        "plan": {"topology": "box.yaml", "num_stages": 4, "mapping": "round-robin"},
        "memory": {"optimizer": "auto", "weights": "auto", "ssd_dir": "swap", "host_budget_mb": 8.0},
        "runtime": {"comm_timeout_s": 5.0, "threads": 1},
    }  # fmt: skip
    hf = {
        "model": {"hf": str(ROOT / "tests" / "partition" / "data" / "tiny-gpt2"), "seq_len": 16},
        "train": {"export_dir": "out/export", "export_dtype": "bf16", "precision": "fp16"},
        "plan": {"file": "plan.yaml", "num_gpus": 2},
    }
    return [example, full, hf]


def _plan_bases() -> list[Any]:
    gpu = preset("2+2")
    plan = make_plan(analytic_profile(get_model("gpt3-125m"), device_spec(gpu.gpus[0].name)), gpu, 4, solver="dp")
    cpu = cpu_standin(2, 2 * GiB)
    prof = analytic_profile(get_model("gpt3-125m"), device_spec("cpu-standin"), dtype="fp32")
    small = make_plan(prof, cpu, 2, reserve_bytes=GiB // 2, solver="dp")
    old = dataclasses.replace(small, layout=None).to_dict()
    del old["layout"]  # a plan file written before plans recorded their machine
    return [plan.to_dict(), small.to_dict(), old]


def _layout_bases() -> list[Any]:
    probed = dataclasses.replace(
        preset("3+1"),
        host_memory_bytes=512 * GiB,
        nvme=(Nvme("nvme0", "0000:3d:00.0", "rc0", 0, 7.88, switch="sw0"),),
        measured=Measured(
            h2d_gbps=(12.0,) * 4, h2d_group_gbps=(6.0,) * 4, d2d_gbps=((0.0, 9.0, 9.0, 9.0),) * 4, ssd_read_gbps=3.0
        ),
        notes=("no NVML",),
    )
    return [t.to_dict() for t in (preset("2+2"), preset("8-dual-socket"), preset("2x2-nvlink"), probed)]


CONFIGS, PLANS, LAYOUTS = _config_bases(), _plan_bases(), _layout_bases()


# ---- the properties ----


def _config(doc: Any, folder: Path) -> None:
    try:
        cfg = config_from_dict(doc, "fuzz.yaml", base_dir=str(folder))
    except ConfigError:
        return
    assert isinstance(cfg, RunConfig)
    assert config_from_dict(cfg.to_dict(), "fuzz.yaml", base_dir=str(folder)) == cfg  # a valid one loads back


def _plan(doc: Any) -> None:
    try:
        plan = Plan.from_dict(doc, "plan fuzz.yaml")
    except PlanFileError:
        return
    assert isinstance(plan, Plan) and Plan.from_dict(plan.to_dict()).to_dict() == plan.to_dict()


def _layout(doc: Any) -> None:
    try:
        topo = topology_from_dict(doc, "layout fuzz.yaml")
    except TopologyError:
        return
    assert isinstance(topo, Topology) and topology_from_dict(topo.to_dict(), "again") == topo


def test_the_valid_documents_are_valid(folder):
    for doc in CONFIGS:
        config_from_dict(doc, "base", base_dir=str(folder))
    for doc in PLANS:
        Plan.from_dict(doc)
    for doc in LAYOUTS:
        topology_from_dict(doc, "base")


@FUZZ
@given(doc=DOCS)
def test_random_documents(folder, doc):
    _config(doc, folder)
    _plan(doc)
    _layout(doc)


@settings(FUZZ, max_examples=300)
@given(doc=mutations(CONFIGS))
def test_mutated_configs(folder, doc):
    _config(doc, folder)


@settings(FUZZ, max_examples=300)
@given(doc=mutations(PLANS))
def test_mutated_plans(doc):
    _plan(doc)


@settings(FUZZ, max_examples=300)
@given(doc=mutations(LAYOUTS))
def test_mutated_layouts(doc):
    _layout(doc)


@settings(FUZZ, max_examples=60)
@given(
    text=st.one_of(st.text(max_size=200), TREES.map(yaml.safe_dump), st.binary(max_size=64)),
    suffix=st.sampled_from([".yaml", ".json"]),
)
def test_random_files(folder, text, suffix):
    """Through the files: the reader (YAML, JSON, bytes) as well as the builder."""
    path = folder / f"fuzz{suffix}"
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    for load, error in ((load_config, ConfigError), (load_plan, PlanFileError), (load_topology, TopologyError)):
        try:
            load(str(path))
        except error:
            pass


SPECIAL = {
    "deep.yaml": "train: " + "[" * 600 + "]" * 600 + "\n",
    "deep.json": '{"gpus": ' + "[" * 600 + "]" * 600 + "}",
    "alias.yaml": "train: &t {betas: *t}\ngpus: &g [*g]\n",
    "tags.yaml": "name: !!binary aGVsbG8=\nmodel: 2001-12-14\ntrain: !!set {a, b}\n",
    "python.yaml": "name: !!python/object/apply:os.system [ls]\n",
    "control.yaml": "name: a\x07b\n",
    "nan.json": '{"name": NaN, "train": {"lr": Infinity}}',
}


@pytest.mark.parametrize("name", sorted(SPECIAL))
def test_odd_files(folder, name):
    """Found by fuzzing and by hand: nesting deeper than the readers recurse, aliases, tags, control characters."""
    path = folder / name
    path.write_text(SPECIAL[name])
    for load, error in ((load_config, ConfigError), (load_plan, PlanFileError), (load_topology, TopologyError)):
        with pytest.raises(error, match=str(path)):
            load(str(path))


def test_nesting_deeper_than_the_readers_go_is_said(folder):
    path = folder / "deep.yaml"
    path.write_text(SPECIAL["deep.yaml"])
    with pytest.raises(ConfigError, match="nesting deeper than the reader can follow"):
        load_config(str(path))
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(ConfigError, match=r"train\.betas: expected a list of 2 numbers, found list nested too deeply"):
        config_from_dict({"train": {"betas": deep}})
