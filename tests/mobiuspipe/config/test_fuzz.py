"""Fuzz: whatever config file or layout a user writes, `mobiuspipe train` answers with a launch or one line and
exit 2, and a layout loads or raises TopologyError; never a traceback. Hypothesis draws every key of every section
(and unknown ones), plausible values and odd ones, and raw text; `mobiuspipe train` runs in this process up to the
point where it would start torchrun."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from foundation.loader import file_fields, to_plain
from mobiuspipe.cli import main as cli
from mobiuspipe.config.run import RunConfig
from topology import PRESETS, TopologyError
from topology.layout import topology_from_dict

WORDS = [
    "auto",
    "host",
    "ssd",
    "bf16",
    "fp16",
    "fp32",
    "cross",
    "search",
    "plan",
    "recompute",
    "keep",
    "device",
    "peer",
    "cosine",
    "linear",
    "constant",
    "uint16",
    "uint32",
    "text",
    "out",
    "x.bin",
    "",
    "2+2",
    "3+1",
    "-1",
]
ODD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 10**7),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def _plausible(default: object) -> st.SearchStrategy:
    """Values of the default's kind, small enough that some configs are valid and get as far as the launch."""
    if isinstance(default, bool):
        return st.booleans()
    if isinstance(default, int):
        return st.integers(-1, 70)
    if isinstance(default, float):
        return st.floats(-1, 2000, allow_nan=False)
    if isinstance(default, tuple):
        return st.lists(st.floats(0, 1.2, allow_nan=False), max_size=3)
    return st.sampled_from(WORDS)


def _section(section_cls: type) -> st.SearchStrategy:
    defaults = section_cls()
    keys = {f.name: st.one_of(_plausible(getattr(defaults, f.name)), ODD) for f in file_fields(section_cls)}
    keys["stepz"] = ODD  # a misspelled key
    return st.fixed_dictionaries({}, optional=keys)


CONFIGS = st.fixed_dictionaries(
    {},
    optional={f.name: st.one_of(_section(f.default_factory), ODD) for f in file_fields(RunConfig)},  # type: ignore[misc]
)


class Launched(Exception):
    """torchrun would have started: every check before the launch passed."""


def _train(text: str, monkeypatch) -> None:
    """`mobiuspipe train` on a config file holding `text`: exit 2 or a launch, nothing else."""

    def launched(*args, **kwargs):
        raise Launched

    monkeypatch.setattr(subprocess, "Popen", launched)
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "run.yaml"
        config.write_text(text)
        try:
            code = cli(["train", "--config", str(config)])
        except Launched:
            return
        assert code == 2


@pytest.mark.timeout(300)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=CONFIGS)
def test_any_config_launches_or_is_one_line_exit_2(doc, monkeypatch, capsys):
    _train(yaml.safe_dump(doc), monkeypatch)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err == "" or err.startswith(("mobiuspipe: error: ", "mobiuspipe: launching", "mobiuspipe: ")), err


@pytest.mark.timeout(120)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60))
def test_any_text_as_a_config_file_is_read_or_refused(text, monkeypatch, capsys):
    _train(text, monkeypatch)
    assert "Traceback" not in capsys.readouterr().err


def _mutate(d: object, path: list, value: object) -> None:
    """Set (value ... : delete) the item at `path` (keys and list positions, taken modulo the sizes found)."""
    for i, step in enumerate(path):
        last = i == len(path) - 1
        if isinstance(d, dict) and d:
            key = sorted(d, key=str)[step % len(d)]
        elif isinstance(d, list) and d:
            key = step % len(d)
        else:
            return
        if last:
            if value is ... and isinstance(d, dict):
                del d[key]
            elif value is not ...:
                d[key] = value
            return
        d = d[key]


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(sorted(PRESETS)),
    st.lists(
        st.tuples(st.lists(st.integers(0, 50), min_size=1, max_size=3), st.one_of(st.just(...), ODD)),
        min_size=1,
        max_size=3,
    ),
)
def test_any_layout_loads_or_names_its_problems(name, mutations):
    d = to_plain(PRESETS[name])
    for path, value in mutations:
        _mutate(d, path, value)
    try:
        topology_from_dict(d, "fuzz.yaml")
    except TopologyError as e:
        assert str(e).startswith("fuzz.yaml") and "\n" not in str(e)
