"""A GPU that partition/spec/hardware.py does not list plans from the tflops its layout file gives; without one the
error says what to write where, and no one edits the source to add a GPU."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from mobiuspipe.cli import main
from partition.spec.hardware import gpu_spec, topology_gpu_spec
from topology import TopologyError, load_topology, preset, save_topology
from topology.types import Measured

NAME = "NVIDIA RTX 6000 Ada Generation"


def _layout(tmp_path, tflops: float):
    tmp_path.mkdir(exist_ok=True)
    t = preset("2+2")
    t = replace(t, gpus=tuple(replace(g, name=NAME, memory_bytes=48 * 2**30, tflops=tflops) for g in t.gpus))
    return save_topology(t, tmp_path / "server.yaml")


def _partition(path, capsys) -> tuple[int, str, str]:
    code = main(["partition", "--model", "gpt3-1.3b", "--topology", str(path), "--solver", "dp", "--json"])
    out, err = capsys.readouterr()
    return code, out, err


def test_an_unlisted_gpu_plans_from_its_layouts_tflops(tmp_path, capsys):
    path = _layout(tmp_path, 364.25)
    assert load_topology(str(path)).gpus[0].tflops == 364.25  # the field round-trips through the file
    code, out, _ = _partition(path, capsys)
    assert code == 0 and json.loads(out)["num_gpus"] == 4
    fast = json.loads(out)["predicted_step_time_s"]
    code, out, _ = _partition(_layout(tmp_path, 36.425), capsys)  # a tenth of the rate: a slower step
    assert code == 0 and json.loads(out)["predicted_step_time_s"] > fast


def test_without_tflops_the_error_names_the_fix(tmp_path, capsys):
    code, _, err = _partition(_layout(tmp_path, 0.0), capsys)
    assert code == 2 and f"unknown device {NAME!r}" in err
    assert "write `tflops:`" in err and "layout file" in err and "hardware.py" not in err
    assert "topology --probe --save server.yaml" in err


def test_an_unlisted_gpu_plans_from_the_matmul_rate_its_probe_measured(tmp_path, capsys):
    """`topology --probe --save` writes each gpu's bf16 matmul rate into the layout: a GPU the table does not list
    plans from it as it would from the same tflops written by hand; a layout's own tflops comes first."""
    path = _layout(tmp_path, 0.0)
    t = load_topology(str(path))
    measured = Measured(matmul_tflops=(364.25,) * t.num_gpus)
    save_topology(replace(t, measured=measured), path)
    code, out, _ = _partition(path, capsys)
    assert code == 0
    by_hand, _, _ = _partition(_layout(tmp_path / "hand", 364.25), capsys), None, None
    assert json.loads(out)["predicted_step_time_s"] == json.loads(by_hand[1])["predicted_step_time_s"]
    assert topology_gpu_spec(load_topology(str(path))).peak_tflops == 364.25
    written = replace(load_topology(str(path)), gpus=tuple(replace(g, tflops=100.0) for g in t.gpus))
    assert topology_gpu_spec(written).peak_tflops == 100.0


def test_a_listed_gpu_keeps_the_tables_figure_and_a_negative_tflops_is_refused(tmp_path):
    assert gpu_spec("NVIDIA GeForce RTX 4090", 24 * 2**30, 31.5).peak_tflops == 165.2
    assert gpu_spec("NVIDIA GeForce RTX 4090", 24 * 2**30, 31.5, 100.0).peak_tflops == 100.0
    path = _layout(tmp_path, 1.0)
    path.write_text(path.read_text().replace("tflops: 1.0", "tflops: -5"))
    with pytest.raises(TopologyError, match=r"gpus\[0\]\.tflops"):
        load_topology(str(path))


def _fp32_step(path, capsys) -> float:
    code = main(
        ["partition", "--model", "gpt3-1.3b", "--topology", str(path), "--solver", "dp", "--dtype", "fp32", "--json"]
    )
    out, _ = capsys.readouterr()
    assert code == 0
    return json.loads(out)["predicted_step_time_s"]


def test_an_unlisted_gpu_plans_fp32_from_the_fp32_rate_its_probe_measured(tmp_path, capsys):
    """`topology --probe` measures the fp32 matmul too (TF32 off): an fp32 plan of a GPU the table does not list
    runs at that rate, not at its bf16 rate; a layout's fp32_tflops comes first."""
    path = _layout(tmp_path, 0.0)
    t = load_topology(str(path))
    save_topology(replace(t, measured=Measured(matmul_tflops=(364.25,) * t.num_gpus)), path)
    at_bf16 = _fp32_step(path, capsys)
    assert topology_gpu_spec(load_topology(str(path))).tflops("fp32") == 364.25  # no fp32 figure: the bf16 rate
    measured = Measured(matmul_tflops=(364.25,) * t.num_gpus, matmul_fp32_tflops=(91.0,) * t.num_gpus)
    save_topology(replace(t, measured=measured), path)
    spec = topology_gpu_spec(load_topology(str(path)))
    assert (spec.tflops("fp32"), spec.tflops("bf16")) == (91.0, 364.25)  # the measured figures round-trip
    assert _fp32_step(path, capsys) > at_bf16
    written = replace(load_topology(str(path)), gpus=tuple(replace(g, fp32_tflops=45.5) for g in t.gpus))
    assert topology_gpu_spec(written).tflops("fp32") == 45.5


def test_a_layouts_fp32_tflops_comes_before_the_tables_and_a_negative_one_is_refused(tmp_path):
    assert gpu_spec("NVIDIA GeForce RTX 4090", 24 * 2**30, 31.5).tflops("fp32") == 82.6
    assert gpu_spec("NVIDIA GeForce RTX 4090", 24 * 2**30, 31.5, fp32_tflops=70.0).tflops("fp32") == 70.0
    assert gpu_spec(NAME, 48 * 2**30, 31.5, 364.25, fp32_tflops=91.1).tflops("fp32") == 91.1
    path = _layout(tmp_path, 1.0)
    path.write_text(path.read_text().replace("fp32_tflops: 0.0", "fp32_tflops: -5", 1))
    with pytest.raises(TopologyError, match=r"gpus\[0\]\.fp32_tflops"):
        load_topology(str(path))


def test_an_unlisted_gpu_holds_transients_and_a_stand_in_given_tflops_stays_a_stand_in():
    """A gpu a layout describes holds a computing layer's transients and cuBLAS's workspaces; a layout's stand-in
    with a `tflops:` of its own keeps the stand-in's ways (its dropout's noise kept, no transients, no workspaces)."""
    from partition.spec.hardware import LIBRARY_BYTES

    listed = gpu_spec(NAME, 48 * 2**30, 31.5, tflops=364.25)
    assert listed.holds_transients and listed.library_bytes == LIBRARY_BYTES and listed.fused_dropout
    standin = gpu_spec("cpu-standin", 2**30, 5.0, tflops=0.2, fp32_tflops=0.1)
    assert (standin.peak_tflops, standin.pcie_gbps, standin.fp32_tflops) == (0.2, 5.0, 0.1)
    assert not standin.holds_transients and standin.library_bytes == 0 and not standin.fused_dropout
