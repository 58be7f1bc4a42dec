"""`mobiuspipe simulate` through its own argparse parser."""

import argparse
import contextlib
import dataclasses
import io
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from foundation.units import GiB
from mobiuspipe.cli._common import CliError
from mobiuspipe.cli.simulate import register
from partition.errors import PlanFileError
from partition.plan import save_plan
from partition.report.baselines import predict
from partition.search import make_plan
from partition.spec.analytic import analytic_profile
from partition.spec.hardware import device_spec
from partition.spec.lookup import get_model
from topology import cpu_standin, load_topology, preset, save_topology


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mobiuspipe")
    register(p.add_subparsers(dest="command", required=True))
    return p


def run(argv: list[str]) -> tuple[int, str]:
    """(exit code, stdout) of the registered subcommand; user errors propagate (cli.main turns them into exit 2)."""
    args = parser().parse_args(argv)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = args.func(args, sys.stdout)
    return code, out.getvalue()


@pytest.fixture(scope="module")
def small():
    """gpt3-125m on 2+2 (4 microbatches): (profile, topology, plan, plan file)."""
    topo = preset("2+2")
    prof = analytic_profile(get_model("gpt3-125m"), device_spec(topo.gpus[0].name))
    plan = make_plan(prof, topo, 4, reserve_bytes=GiB, solver="dp")
    return prof, topo, plan


@pytest.fixture()
def plan_file(small, tmp_path) -> Path:
    path = tmp_path / "plan.yaml"
    save_plan(small[2], path)
    return path


def test_text_report(small, plan_file):
    code, out = run(["simulate", "--plan", str(plan_file)])  # the plan's topology "2+2" is a preset
    assert code == 0
    sim = predict(small[2], small[1])
    assert f"simulated step time {sim.step_time_s:.3f} s" in out
    assert f"{small[2].predicted_step_time_s:.3f} s" in out  # the plan's own, static estimate beside it
    rows = [line.split() for line in out.splitlines()]
    for g in range(4):
        assert any(r[:1] == [str(g)] and f"{sim.busy_fraction[g]:.0%}" in r for r in rows)
    for link in ("gpu0", "sw0", "rc0", "rc1"):
        assert any(r[:2] == [link, "h2d"] for r in rows) and any(r[:2] == [link, "d2h"] for r in rows)


def test_json_is_one_document(small, plan_file, tmp_path, capsys):
    trace = tmp_path / "t.json"
    code, out = run(["simulate", "--plan", str(plan_file), "--topology", "2+2", "--json", "--trace", str(trace)])
    assert code == 0
    d = json.loads(out)
    sim = predict(small[2], small[1])
    assert d["step_time_s"] == sim.step_time_s and d["link_model"] == "flows:2+2"
    assert d["num_stages"] == small[2].num_stages and d["plan_predicted_step_time_s"] == small[2].predicted_step_time_s
    assert len(d["busy_fraction"]) == len(d["peak_memory_bytes"]) == 4
    assert all(p == a + b for p, a, b in zip(d["peak_memory_bytes"], d["peak_arena_bytes"], d["activation_bytes"]))
    assert max(d["peak_arena_bytes"]) <= small[2].arena_bytes  # never above the plan's three slots
    rc0 = next(r for r in d["link_bytes"] if r["link"] == "rc0" and r["direction"] == "h2d")
    assert rc0["gbps"] == pytest.approx(15.75, rel=1e-3) and 0 < rc0["utilization"] < 1
    assert "Chrome trace written to" in capsys.readouterr().err  # the note goes to stderr with --json
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == len(sim.events)


def test_pictures(plan_file, tmp_path, monkeypatch):
    svg, png = tmp_path / "step.svg", tmp_path / "step.png"
    code, out = run(["simulate", "--plan", str(plan_file), "--svg", str(svg)])
    assert code == 0 and f"SVG timeline written to {svg}" in out
    assert ET.parse(svg).getroot().tag.endswith("svg")
    monkeypatch.setenv("PATH", str(tmp_path))  # a fresh machine: no converter program on PATH
    code, out = run(["simulate", "--plan", str(plan_file), "--png", str(png)])
    assert code == 0 and f"PNG timeline written to {png}" in out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_png_without_matplotlib_is_a_user_error(plan_file, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(CliError, match="matplotlib.*--svg"):
        run(["simulate", "--plan", str(plan_file), "--png", str(tmp_path / "x.png")])


def test_unwritable_trace_is_a_user_error(plan_file, tmp_path):
    with pytest.raises(CliError, match="cannot write the Chrome trace"):
        run(["simulate", "--plan", str(plan_file), "--trace", str(tmp_path / "no" / "such" / "t.json")])


def test_topology_must_be_the_plans_machine(plan_file, tmp_path):
    with pytest.raises(CliError, match="--topology 8-dual-socket is not the machine the plan was made on .'2\\+2'"):
        run(["simulate", "--plan", str(plan_file), "--topology", "8-dual-socket"])
    layout = tmp_path / "server.yaml"
    save_topology(preset("3+1"), layout)  # the same gpu count, another machine
    with pytest.raises(CliError, match="leave --topology out .* make a plan for .*server.yaml"):
        run(["simulate", "--plan", str(plan_file), "--topology", str(layout)])
    save_topology(preset("2+2"), layout)  # the plan's machine, read from a file
    assert run(["simulate", "--plan", str(plan_file), "--topology", str(layout)]) == run(
        ["simulate", "--plan", str(plan_file)]
    )


def test_a_plan_made_on_a_layout_file_simulates_on_that_machine(small, tmp_path):
    """The layout file is gone: the plan file alone says where it runs (its links, not the preset's)."""
    slow = dataclasses.replace(
        preset("2+2"),
        name="server-7",
        root_complexes=tuple(dataclasses.replace(r, uplink_gbps=4.0) for r in preset("2+2").root_complexes),
    )
    layout = tmp_path / "server-7.yaml"
    save_topology(slow, layout)
    plan = make_plan(small[0], load_topology(str(layout)), 4, reserve_bytes=GiB, solver="dp")
    layout.unlink()
    path = tmp_path / "plan.yaml"
    save_plan(plan, path)
    d = json.loads(run(["simulate", "--plan", str(path), "--json"])[1])
    assert d["topology"] == "server-7" and d["step_time_s"] == predict(plan, slow).step_time_s
    rc0 = next(r for r in d["link_bytes"] if r["link"] == "rc0" and r["direction"] == "h2d")
    assert rc0["gbps"] == 4.0


def test_an_old_plan_file_without_its_layout(small, tmp_path):
    """Plans written before plans recorded their machine: a preset by name, else --topology (any of its size)."""
    old = dataclasses.replace(small[2], layout=None)
    path = tmp_path / "plan.yaml"
    save_plan(old, path)
    assert run(["simulate", "--plan", str(path)]) == run(["simulate", "--plan", str(path), "--topology", "2+2"])
    with pytest.raises(CliError, match="plan is for 4 gpus but topology '8-dual-socket' has 8"):
        run(["simulate", "--plan", str(path), "--topology", "8-dual-socket"])
    assert run(["simulate", "--plan", str(path), "--topology", "3+1"])[0] == 0
    save_plan(dataclasses.replace(old, topology="server-7"), path)
    with pytest.raises(CliError, match="made for topology 'server-7', which is not a preset.*--topology"):
        run(["simulate", "--plan", str(path)])
    assert run(["simulate", "--plan", str(path), "--topology", "2+2"])[0] == 0


def test_plan_for_cpu_standins(tmp_path):
    prof = analytic_profile(get_model("gpt3-125m"), device_spec("cpu-standin"), dtype="fp32")
    plan = make_plan(prof, cpu_standin(2, 2 * GiB), 2, solver="dp")
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    code, out = run(["simulate", "--plan", str(path), "--json"])
    assert code == 0 and json.loads(out)["topology"] == "cpu-standin-2"


def test_missing_plan_file(tmp_path):
    with pytest.raises(PlanFileError, match=r"plan .*none\.yaml: file not found"):
        run(["simulate", "--plan", str(tmp_path / "none.yaml")])
    with pytest.raises(SystemExit):
        parser().parse_args(["simulate"])  # --plan is required
